"""The shared index's API: what a server asks Redis, each question one round trip.

A server calls (``docs/shared-index.md`` §9 says where: the disk tier's link, the runtime's
``deployment`` part):

* ``join`` at start: the deployment's disk budget (the first server sets it; a server
  configured with another one is refused, naming ``disk_gib``) and a heartbeat;
* ``lookup`` on a LOOKUP that misses its own CPU tier: where the objects are (one
  script: entries read, load leases taken, last access refreshed for refresh-all);
  ``release`` once the load finished;
* ``reserve`` before writing objects to the shared disk tier, ``commit`` after the files
  are renamed into place (``budget.reserve_with_eviction`` adds the eviction step),
  ``unreserve`` for the reserved objects that were not written;
* ``claim`` / ``drop`` to evict by the deployment's ``H`` ranking; ``forget_stored`` when a
  stored entry's file is gone or corrupt (a miss; the entry is cleaned up);
* ``rescore`` when a server's ``C`` / ``M`` of an object change (``sync`` batches it with
  the residence samples, session starts and the EMAs: the janitor's one exchange);
* ``heartbeat``: the servers alive, for a degraded server's budget share;
* ``session_begin`` / ``session_end`` and ``emas`` for the deployment's session facts and
  residence-time EMAs.

NOTE 1 (a restart between two calls): redis-py reconnects at the next command when Redis
restarted meanwhile, so a Redis that came back empty between two of this server's calls
raises nothing and the connection never degrades: its recovery (rejoin, re-registration
of the server's objects) would not run, the budget key would stay missing (``reserve``
then bounds nothing) and the server's files would have no entry until a reconcile adopts
them, ranked as nothing needed. So ``join`` takes the deployment's ``epoch`` (a random
token the first server to find it missing sets) and every ``heartbeat`` reads it back:
another token, or none, means Redis lost the keys since, and the connection's recovery
runs (``IndexConnection.data_lost``). Every server of the deployment sees it, whichever
of them rejoins first and sets the new token.

Every method returns ``None`` (or the documented empty value) when Redis is unreachable:
the caller then uses its local view (``connection`` degraded mode). Every hot-path method
is one script call (EVALSHA; redis-py falls back to EVAL once after a Redis restart
emptied the script cache) or one pipeline.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from .connection import IndexConnection
from .layout import KeySpace, ObjectRecord
from .rights import probe_rights
from .scripts import LOOKUP_FIELDS, SCRIPTS

__all__ = ["BudgetMismatch", "Location", "Reservation", "SessionFacts", "SharedIndex", "Victim"]

LEASE = 1
TOUCH = 2


class BudgetMismatch(ValueError):
    """This server's ``disk_gib`` differs from the deployment's registered budget."""


@dataclass(frozen=True, slots=True)
class Location:
    """Where a stored object is: enough to load and verify it."""

    id: str
    path: str
    size: int
    crc: int
    owner: str
    kind: int
    depth: int
    parent: bytes
    tier: int
    oid: bytes


@dataclass(frozen=True, slots=True)
class Victim:
    """An entry this server claimed for eviction: delete ``path``, then ``drop`` it."""

    id: str
    path: str
    size: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """Outcome of ``reserve``: ids to write, ids already present, ids over budget."""

    reserved: tuple[str, ...]
    present: tuple[str, ...]
    full: tuple[str, ...]
    deficit: int  # bytes to claim for the ``full`` ones to fit


@dataclass(frozen=True, slots=True)
class SessionFacts:
    """A session as the deployment knew it before this request."""

    owner: str  # "" for a new session
    end: str  # id of its final snapshot object ("" if none recorded)
    end_tokens: int
    gap: float | None  # seconds since its previous access at any server


class SharedIndex:
    """One server's handle on one (deployment, model) namespace."""

    def __init__(
        self,
        conn: IndexConnection,
        keys: KeySpace,
        *,
        tau: float | None = None,
        ema_alpha: float = 0.05,
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.instance = conn.cfg.instance
        self._tau = "-1" if tau is None else repr(float(tau))
        self._alpha = repr(float(ema_alpha))
        self._lease_ms = max(1, int(conn.cfg.lease_ttl_s * 1000))
        self._claim_ms = max(1, int(conn.cfg.claim_ttl_s * 1000))
        self._write_ms = max(1, int(conn.cfg.write_ttl_s * 1000))
        self.epoch: str | None = None
        """The deployment's epoch token at this server's last (re)join (NOTE 1)."""
        client = conn.client
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}
        # Out of an outage only when every command works again (connection module).
        conn.probe = lambda c: probe_rights(c, keys, self.instance)

    def _run(self, name: str, args: Sequence[object], fallback: Any = None) -> Any:
        """Script ``name`` with ``args`` (one round trip), or ``fallback`` if unreachable."""
        script = self._scripts[name]
        used = self.keys.used
        return self.conn.call(lambda c: script(keys=[used], args=list(args), client=c), fallback)

    # ------------------------------------------------------------ start-up
    def join(self, budget_bytes: int) -> None:
        """Register this server and the deployment budget (raises when unreachable).

        Raises:
            BudgetMismatch: another server registered a different budget.
            connection.Unavailable: Redis cannot be reached or refused the credentials.
        """
        k = self.keys

        def go(c: redis.Redis) -> object:
            with c.pipeline(transaction=False) as p:
                p.set(k.budget, budget_bytes, nx=True)
                p.get(k.budget)
                p.setnx(k.used, 0)
                p.zadd(k.servers, {self.instance: 0}, nx=True)  # a heartbeat's time stays
                p.set(k.epoch, secrets.token_hex(8), nx=True)
                p.get(k.epoch)
                out = p.execute()
                return out[1], out[-1]

        registered, self.epoch = self.conn.require(go)
        registered = int(registered)
        if registered != budget_bytes:
            raise BudgetMismatch(
                f"disk_gib: this server's disk budget ({budget_bytes} bytes) differs from the "
                f"deployment's ({registered} bytes, registered in Redis for "
                f"{k.deployment}/{k.model}); give every server of a deployment the same "
                f"disk_gib"
            )

    def rejoin(self, budget_bytes: int) -> bool:
        """``join`` after an outage (Redis may have restarted empty); False if unreachable."""
        k = self.keys

        def go(c: redis.Redis) -> bool:
            with c.pipeline(transaction=False) as p:
                p.set(k.budget, budget_bytes, nx=True)
                p.setnx(k.used, 0)
                p.zadd(k.servers, {self.instance: 0}, nx=True)  # a heartbeat's time stays
                p.set(k.epoch, secrets.token_hex(8), nx=True)
                p.get(k.epoch)
                self.epoch = p.execute()[-1]
            return True

        return bool(self.conn.call(go, False))

    # ------------------------------------------------------------ lookups
    def lookup(
        self, load: Iterable[str], touch: Iterable[str] = (), *, lease: bool = True
    ) -> dict[str, Location] | None:
        """Locations of the ``load`` ids that are stored (leased when ``lease``), last
        access refreshed for them and for ``touch`` (refresh-all). None = degraded."""
        wanted = set(load)
        modes: dict[str, int] = {i: TOUCH for i in touch}
        for i in wanted:
            modes[i] = (LEASE if lease else 0) | TOUCH
        if not modes:
            return {}
        args: list[object] = [self.instance, self._lease_ms, self._tau]
        for i, mode in modes.items():
            args += (i, mode)
        rows = self._run("lookup", args)
        if rows is None:
            return None
        out: dict[str, Location] = {}
        for i, row in zip(modes, rows, strict=True):
            if row and i in wanted:
                f = dict(zip(LOOKUP_FIELDS, row.split("\t"), strict=True))
                out[i] = Location(
                    i, f["path"], int(f["size"]), int(f["crc"]), f["owner"], int(f["kind"]),
                    int(f["depth"]), bytes.fromhex(f["parent"]), int(f["tier"]),
                    bytes.fromhex(f["oid"]),
                )
        return out

    def release(self, ids: Iterable[str]) -> None:
        """Give back this server's load leases on ``ids`` (a pipeline, no reply used)."""
        ids = list(ids)
        if not ids:
            return

        def go(c: redis.Redis) -> None:
            with c.pipeline(transaction=False) as p:
                for i in ids:
                    p.zrem(self.keys.lease(i), self.instance)
                p.execute()

        self.conn.call(go, None)

    # ------------------------------------------------------------ writes
    def reserve(self, items: Iterable[tuple[str, int, str]]) -> Reservation | None:
        """Reserve ``(id, size, path)`` objects under the budget before writing them."""
        items = list(items)
        args: list[object] = [self.instance, self._write_ms]
        for i, size, path in items:
            args += (i, size, path)
        out = self._run("reserve", args)
        if out is None:
            return None
        status = [int(x) for x in out[:-1]]
        pick = lambda code: tuple(it[0] for it, s in zip(items, status, strict=True) if s == code)  # noqa: E731
        return Reservation(pick(1), pick(0), pick(-1), int(out[-1]))

    def commit(
        self, records: Iterable[ObjectRecord], *, adopting: bool = False
    ) -> list[int] | None:
        """Mark written objects stored (1 = reserved, 2 = registered anew, 3 = taken back
        from an adoption, 0 = present). ``adopting``: files this server did not write
        (``reconcile``), which their writer's commit takes back (``scripts`` NOTE 4)."""
        args: list[object] = [self.instance, self._tau, int(adopting)]
        for r in records:
            args += (
                r.id, r.path, r.size, r.crc, r.kind, r.depth, r.parent.hex(),
                repr(float(r.cost)), repr(float(r.freed)), r.tier, r.oid.hex(),
            )
        if len(args) == 3:
            return []
        out = self._run("commit", args)
        return None if out is None else [int(x) for x in out]

    # ------------------------------------------------------------ eviction
    def claim(self, need_bytes: int, max_scan: int = 256) -> list[Victim] | None:
        """Claim the lowest-``H`` unleased objects until ``need_bytes`` are covered."""
        out = self._run(
            "claim", [self.instance, need_bytes, self._claim_ms, max_scan, self._tau]
        )
        return None if out is None else [Victim(i, p, int(s)) for i, p, s in out]

    def drop(self, ids: Iterable[str]) -> int | None:
        """Forget claimed entries whose files this server deleted (residence EMAs fed)."""
        ids = list(ids)
        return self._run("drop", [self.instance, self._alpha, *ids], 0) if ids else 0

    def forget_stored(self, ids: Iterable[str]) -> int:
        """A stored entry's file is gone or corrupt: forget it (the caller had a miss)."""
        ids = list(ids)
        if not ids:
            return 0
        return len(self._run("forget", ["stored", self.instance, self._claim_ms, *ids], []))

    def unreserve(self, ids: Iterable[str]) -> int | None:
        """Give back this server's reservations of objects it did not write (a failed or
        skipped write): their entries go and their bytes are freed at once, not at their
        deadline. Returns how many were given back; None when Redis is unreachable (the
        deadline's ``forget_expired`` frees them then)."""
        ids = list(ids)
        if not ids:
            return 0
        out = self._run("forget", ["unreserved", self.instance, self._claim_ms, *ids])
        return None if out is None else len(out)

    def forget_expired(self, ids: Iterable[str]) -> list[tuple[str, str, str]]:
        """Entries past their deadline: dead writers' reservations are forgotten, dead
        claimants' claims taken over by this server. Returns ``(id, state, path)``."""
        ids = list(ids)
        if not ids:
            return []
        out = self._run("forget", ["expired", self.instance, self._claim_ms, *ids], [])
        return [(i, s, p) for i, s, p in out]

    def rescore(self, updates: Iterable[Sequence[Any]]) -> int | None:
        """This server's ``C`` share and ``M`` for stored objects, ``H`` re-queued.

        Each update is ``(id, C, M)`` or ``(id, C, M, age)``: ``age`` = seconds since this
        server's last access of the object (moves ``t`` forward, never back; ``scripts``
        NOTE 3 for how the servers' shares add up)."""
        args = self._rescore_args(updates)
        return self._run("rescore", args) if len(args) > 2 else 0

    def _rescore_args(self, updates: Iterable[Sequence[Any]]) -> list[object]:
        args: list[object] = [self._tau, self.instance]
        for u in updates:
            age = u[3] if len(u) > 3 and u[3] is not None else -1.0
            args += (u[0], repr(float(u[1])), repr(float(u[2])), repr(float(age)))
        return args

    def heartbeat(self, window_s: float) -> tuple[int, int] | None:
        """This server is alive: ``(servers seen alive within window_s, used bytes)``.
        A changed or missing epoch runs the connection's recovery first (NOTE 1)."""
        out = self._run("heartbeat", [self.instance, repr(float(window_s))])
        if out is None:
            return None
        if self.epoch is not None and out[2] != self.epoch:
            self.conn.data_lost()
        return int(out[0]), int(out[1])

    def sync(
        self,
        samples: Sequence[tuple[str, float]],
        updates: Sequence[Sequence[Any]],
        sessions: Sequence[tuple[str, str, int]],
    ) -> dict[str, float] | None:
        """The janitor's exchange with the deployment, one pipeline: residence / gap
        ``samples`` (``observe``), score ``updates`` (``rescore``), the ``(session, final
        snapshot id or "", its tokens)`` of sessions that began a request here since the
        last sync (``session`` with begin), then the deployment EMAs (``emas``).
        Off the request path (redis-py checks the pipeline's scripts first: two round
        trips). None = degraded."""
        k, used, alpha = self.keys, [self.keys.used], self._alpha
        sc = self._scripts

        def go(c: redis.Redis) -> dict[str, float]:
            with c.pipeline(transaction=False) as p:
                if samples:
                    args: list[object] = [alpha]
                    for name, value in samples:
                        args += (name, repr(float(value)))
                    sc["observe"](keys=used, args=args, client=p)
                if updates:
                    sc["rescore"](keys=used, args=self._rescore_args(updates), client=p)
                for sid, end_id, end_tokens in sessions:
                    sc["session"](keys=used, args=[sid, self.instance, end_id, end_tokens,
                                                   alpha, 1], client=p)
                p.hgetall(k.ema)
                raw = p.execute()[-1]
            return {name: float(v) for name, v in raw.items()}

        return self.conn.call(go, None)

    # ------------------------------------------------------------ deployment facts
    def session_begin(self, sid: str) -> SessionFacts | None:
        """A request of ``sid`` begins here: returns where the session was before."""
        out = self._run("session", [sid, self.instance, "", 0, self._alpha, 1])
        if out is None:
            return None
        owner, end, end_tokens, gap = out
        return SessionFacts(owner, end, int(end_tokens or 0), float(gap) if gap else None)

    def session_end(self, sid: str, end_id: str, end_tokens: int) -> None:
        """``sid``'s request stored its final snapshot ``end_id`` at ``end_tokens``."""
        self._run("session", [sid, self.instance, end_id, end_tokens, self._alpha, 0])

    def sessions(self, idle_at_most_s: float) -> dict[str, SessionFacts] | None:
        """Sessions of the deployment accessed within ``idle_at_most_s`` seconds (Redis
        clock), with their owner and final snapshot: what a server adds to its core's view
        so that ``C`` counts the sessions other servers serve. Janitor work (two round
        trips), never on a request's path; ``gap`` is None in these facts."""
        k = self.keys

        def go(c: redis.Redis) -> dict[str, SessionFacts]:
            sec, usec = c.time()
            since = sec + usec / 1e6 - idle_at_most_s
            sids = c.zrangebyscore(k.sessions, since, "+inf")
            with c.pipeline(transaction=False) as p:
                for sid in sids:
                    p.hmget(k.session(sid), "owner", "end", "end_tokens")
                rows = p.execute()
            return {
                sid: SessionFacts(owner or "", end or "", int(tokens or 0), None)
                for sid, (owner, end, tokens) in zip(sids, rows, strict=True)
            }

        return self.conn.call(go, None)

    def observe(self, samples: Iterable[tuple[str, float]]) -> list[float] | None:
        """Seeded EMA steps of deployment fields (``layout.EMA_FIELDS`` names)."""
        args: list[object] = [self._alpha]
        for name, value in samples:
            args += (name, repr(float(value)))
        out = self._run("observe", args)
        return None if out is None else [float(v) for v in out]

    def emas(self) -> dict[str, float] | None:
        """The deployment EMAs (``kv``, ``state``, ``gap`` and their ``_n`` counts)."""
        raw = self.conn.call(lambda c: c.hgetall(self.keys.ema), None)
        return None if raw is None else {k: float(v) for k, v in raw.items()}

    def usage(self) -> tuple[int, int, int] | None:
        """``(used, budget, evicting)`` bytes of the deployment's disk tier."""
        k = self.keys
        raw = self.conn.call(lambda c: c.mget(k.used, k.budget, k.prefix + "evicting"), None)
        if raw is None:
            return None
        used, budget, evicting = (int(v or 0) for v in raw)
        return used, budget, evicting
