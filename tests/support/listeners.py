"""A listener that records what it is told: the core's byte movements (``EventLog``)."""

from __future__ import annotations

from lmcache_histate.core.index import Node


class EventLog:
    """``events``: ``(what, chunk key, part, tier)`` in call order.

    ``what`` is ``moved`` (tier = destination), ``stored`` (tier = where) or ``dropped``
    (tier = the bitmask of tiers the part left).
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, int, str, int]] = []

    def moved(self, node: Node, part: str, src: int, dst: int) -> None:
        self.events.append(("moved", node.key, part, dst))

    def stored(self, node: Node, part: str, tier: int) -> None:
        self.events.append(("stored", node.key, part, tier))

    def dropped(self, node: Node, part: str, tiers: int) -> None:
        self.events.append(("dropped", node.key, part, tiers))

    def take(self) -> list[tuple[str, int, str, int]]:
        """The events so far; the log starts empty again."""
        out, self.events = self.events, []
        return out
