"""The core's placement events as short tuples, for tests to compare (``EventLog``)."""

from __future__ import annotations

from collections.abc import Callable

from lmcache_histate.core.placement import PlacementEvent, TieredStore


class EventLog:
    """``events``: ``(what, chunk key, part, tier)`` in the order the core queued them,
    drained from ``take_events`` (a ``HiStateCache``'s, or ``store_events(store)``) each
    time they are read.

    ``what`` is ``moved`` (tier = destination), ``stored`` (tier = where) or ``dropped``
    (tier = the bitmask of tiers the part left).
    """

    def __init__(self, take_events: Callable[[], list[PlacementEvent]]) -> None:
        self._take_events = take_events
        self._events: list[tuple[str, int, str, int]] = []

    @property
    def events(self) -> list[tuple[str, int, str, int]]:
        """The events so far (this list: clearing it forgets them)."""
        for event in self._take_events():
            what, key, part = event[0], event[1], event[2]
            self._events.append((what, key, part, event[4] if what == "moved" else event[3]))
        return self._events

    def take(self) -> list[tuple[str, int, str, int]]:
        """The events so far; the log starts empty again."""
        out = self.events
        self._events = []
        return out


def store_events(store: TieredStore) -> Callable[[], list[PlacementEvent]]:
    """``take_events`` of a ``TieredStore`` driven without the facade."""

    def take() -> list[PlacementEvent]:
        events, store.events = store.events, []
        return events

    return take
