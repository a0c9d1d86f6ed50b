"""The HiState shared tier: an LMCache L2 adapter keeping objects in a Redis Cluster.

Load it with ``--l2-adapter '{"type": "plugin", "module_path":
"lmcache_histate.backends.server.shared_tier.tier", "class_name": "HiStateSharedAdapter",
"adapter_params": {"shared_tier": {...}, "index_model": ...}}'`` (the launcher does, after
the disk tier, when the server YAML has a ``shared_tier`` section).

Every node of a deployment runs one. What it holds:

* **values**: one per object, ``<key_prefix>:<deployment>:<id>`` (no hash tag: the values
  spread over the cluster's masters), laid out as the disk tier's files (``values``) and
  verified on every read: a wrong, torn or foreign value is a miss, never served, and is
  removed with its entry;
* **entries, budget, ranking**: the shared index's (``shared_index``), in the namespace
  ``histate:{<deployment>:<model>}:`` of the cluster (one hash slot, so its scripts run on
  a cluster): a write reserves its bytes under the deployment's one budget before the value
  is set, and when the budget is short the lowest-``H`` unleased objects are claimed, their
  values deleted and their entries dropped (``budget.reserve_with_eviction``). The cluster
  runs ``maxmemory-policy noeviction``: nothing leaves it that HiState did not choose;
* **leases**: a lookup leases what it found; no node deletes a leased value.

NOTE 1 (LMCache's ``valkey`` adapter, not used). lmcache 0.5.6 ships a ``valkey`` L2
adapter (``l2_adapters/valkey_l2_adapter.py``, valkey-glide-sync client). It stores raw
payloads with no checksum, keeps its byte accounting in each process (its docstring: its
eviction is reliable only with one writer), and its lookups call the cluster on every
request with glide's retries: measured on this machine with a 3-master cluster in
``cluster_state:fail``, every lookup took 7.7 s, also for objects in L1. This tier drives
redis-py's cluster client (already a dependency) through the shared index's connection:
verified values, one budget in the cluster, and a circuit breaker (NOTE 2).

NOTE 2 (the breaker). Every call goes through one ``IndexConnection``: the first call that
fails puts the tier in degraded mode (one log line) and from then on calls are not
attempted at all; lookups find nothing here and the node serves from its own CPU and disk
tiers at their usual cost; writes are not made (counted ``not_stored_degraded``). The
tier's thread probes the cluster every ``retry_s``; when it answers, one log line, then a
reconcile (entries whose value is gone — a master restarted empty — are forgotten and
their bytes freed; claims and reservations of dead nodes expire) so the budget matches
what the cluster holds.

NOTE 3 (what goes here) is ``plan.to_shared``'s, applied by the store policy
(``plugins.HiStateStorePolicy`` through the runtime's ``shared_route``): every KV chunk
the core holds and each session's final snapshot, what another node needs to resume a
session at its deepest boundary; the node's interval snapshots stay on its own tiers.
Headers (kind, depth, parent, the core's ``C`` and ``M``) come down from the runtime as
for the disk tier (``expect_headers``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import redis
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache_histate.backends.upstream.lmcache_symbols import l2_memory_tags

from ..disk import file_format as df
from ..disk.entries import UNKNOWN_META, ObjectMeta
from ..disk.shared_link import key_id
from ..l2_tasks import ExpectedHeaders, TaskBoard
from ..shared_index.budget import reserve_with_eviction
from ..shared_index.connection import IndexConnection, Unavailable
from ..shared_index.index import BudgetMismatch, Location, SharedIndex, Victim
from ..shared_index.layout import KeySpace, ObjectRecord
from . import values
from .cluster import cluster_client
from .config import HiStateSharedAdapterConfig
from .scores import SharedScores, Update

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.memory_management import MemoryObj

logger = logging.getLogger("lmcache_histate.shared_tier")

__all__ = ["SHARED_TIER_NUMBER", "HiStateSharedAdapter"]

SHARED_TIER_NUMBER = 2
"""The ``tier`` field of the shared tier's entries (1 = a shared disk folder)."""
POLL_S = 0.5
HEARTBEAT_S = 5.0
ALIVE_S = 30.0


class HiStateSharedAdapter(L2AdapterInterface):
    """Objects as verified values in a Redis Cluster, one budget for the deployment."""

    def __init__(
        self, config: HiStateSharedAdapterConfig | dict[str, Any], l1_memory_desc: object = None
    ) -> None:
        if isinstance(config, dict):
            config = HiStateSharedAdapterConfig.from_dict(config)
        tier = config.tier
        super().__init__(max_capacity_bytes=tier.budget_bytes)
        self.config = config
        self.prefix = f"{tier.key_prefix}:{tier.deployment}:"
        try:
            index_client = cluster_client(tier, decode=True)
            self.data = cluster_client(tier, decode=False)
        except (redis.RedisError, OSError) as exc:
            raise ValueError(
                f"shared_tier.nodes: no startup node of the cluster {list(tier.nodes)} answered "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''})"
            ) from None
        self.conn = IndexConnection(tier.index_config(), client=index_client,
                                    label="HiState shared tier",
                                    recovery="reconciling the tier's entries")
        self.index = SharedIndex(self.conn, KeySpace(tier.deployment, config.model))
        try:
            self.index.join(tier.budget_bytes)
        except BudgetMismatch:
            raise ValueError(
                f"shared_tier.budget_gib: this server's budget ({tier.budget_bytes} bytes) "
                f"differs from the one registered for deployment {tier.deployment!r}; give "
                f"every node the same shared_tier.budget_gib"
            ) from None
        except Unavailable as exc:
            raise ValueError(f"shared_tier: {exc}") from None
        self.conn.on_recovery(self._recovered)
        self._lock = threading.Lock()
        self._locks: Counter[ObjectKey] = Counter()
        self._where: dict[ObjectKey, Location] = {}
        self._releases: list[str] = []
        self.stats: Counter[str] = Counter()
        self._headers = ExpectedHeaders(self.stats)
        self.scores = SharedScores()
        self.tasks = TaskBoard()
        self.last_reconcile: dict[str, int] = {}
        self._reconcile_due = threading.Event()
        self._closed = False
        self._pool = ThreadPoolExecutor(config.io_workers, thread_name_prefix="histate-shared")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_heartbeat = 0.0
        self._thread = threading.Thread(target=self._loop, name="histate-shared-tier",
                                        daemon=True)
        self._thread.start()
        logger.info("HiState shared tier on the cluster at %s: deployment %s, instance %s, "
                    "budget %d bytes", ", ".join(tier.nodes), tier.deployment, tier.instance,
                    tier.budget_bytes)

    # ---------------------------------------------------------------- wiring
    @property
    def degraded(self) -> bool:
        return self.conn.degraded

    def expect_headers(self, metas: Mapping[ObjectKey, ObjectMeta]) -> None:
        """Headers of writes about to be submitted (as the disk tier's, its NOTE 2)."""
        self._headers.expect(metas)

    def value_key(self, oid: str) -> str:
        return self.prefix + oid

    def get_store_event_fd(self) -> int:
        return self.tasks.store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self.tasks.lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self.tasks.load_efd.fileno()

    # ----------------------------------------------------------------- store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self.tasks.new_id()
        self._pool.submit(self._store_task, tid, list(keys), [o.byte_array for o in objects])
        return tid

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self.tasks.pop_stores()

    def _store_task(self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Any]) -> None:
        result = L2StoreResult(False, 0)
        try:
            result = self._write(keys, buffers)
        except Exception:
            logger.exception("HiState shared tier: a write of %d objects failed", len(keys))
            self.stats["write_errors"] += len(keys)
        finally:
            self.tasks.store_done(tid, result)

    def _write(self, keys: list[ObjectKey], buffers: list[Any]) -> L2StoreResult:
        """Reserve under the deployment budget (evicting by ``H``), set the reserved values
        in one pipeline, commit them; present ones are not written again."""
        if self.conn.degraded:
            self.stats["not_stored_degraded"] += len(keys)
            return L2StoreResult(False, 0)
        expected = self._headers.take(keys)
        metas = [expected.get(k, UNKNOWN_META) for k in keys]
        items = []
        for key, buf, meta in zip(keys, buffers, metas, strict=True):
            oid = df.ObjectId.of(key)
            value, crc = values.encode(oid, buf, meta.kind, meta.depth, meta.parent)
            items.append((key_id(key), oid, value, crc, meta))
        got = reserve_with_eviction(
            self.index, [(i, len(v), self.value_key(i)) for i, _o, v, _c, _m in items],
            self._delete_victims)
        if got is None:
            self.stats["not_stored_degraded"] += len(keys)
            return L2StoreResult(False, 0)
        reserved = set(got.reserved)
        todo = [it for it in items if it[0] in reserved]
        self.stats["present"] += len(got.present)
        self.stats["over_budget"] += len(got.full)

        def put(_c: Any) -> list[Any]:
            with self.data.pipeline(transaction=False) as p:
                for i, _o, value, _c2, _m in todo:
                    p.set(self.value_key(i), value)
                return p.execute(raise_on_error=False)

        replies = self.conn.call(put, None) if todo else []
        done = [it for it, r in zip(todo, replies or [None] * len(todo), strict=True) if r is True]
        failed = [it[0] for it in todo if it not in done]
        codes = self.index.commit([
            ObjectRecord(df.encode_id(o), self.value_key(i), len(v), c, m.kind, m.depth,
                         m.parent, *(m.score or (float(len(v)), float(len(v)))),
                         tier=SHARED_TIER_NUMBER)
            for i, o, v, c, m in done
        ]) if done else []
        # scores NOTE 2: re-scored from now on; 0 = stored already, with another value
        committed = list(zip((it[0] for it in done), codes or (), strict=False))
        self.scores.committed([i for i, code in committed if code],
                              [*got.present, *(i for i, code in committed if not code)])
        if failed:
            self.index.unreserve(failed)
        written = sum(len(it[2]) for it in done)
        self.stats["objects_stored"] += len(done)
        self.stats["bytes_stored"] += written
        self.stats["write_failures"] += len(failed)
        return L2StoreResult(not failed and not got.full, written)

    def _delete_victims(self, victims: list[Victim]) -> list[str]:
        """Delete the values of entries this node claimed; the ids now gone."""
        if not victims:
            return []
        if self.conn.call(lambda _c: self._delete_each(victims), None) is None:
            return []
        self.stats["evicted"] += len(victims)
        return [v.id for v in victims]

    def _delete_each(self, victims: list[Victim]) -> int:
        with self.data.pipeline(transaction=False) as p:
            for v in victims:
                p.delete(v.path)
            return len(p.execute(raise_on_error=False))

    def rescore(self, updates: list[Update]) -> bool:
        """This node's current ``(C, M, age)`` of objects it wrote (``scores``), through
        the index's ``rescore`` script; False (to be collected again) when not sent."""
        if not updates:
            return True
        ok = not self.conn.degraded and self.index.rescore(updates) is not None
        self.scores.sent(updates, ok)
        self.stats["rescored" if ok else "rescore_deferred"] += len(updates)
        return ok

    # ------------------------------------------------------------ lookup / lock
    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        tid = self.tasks.new_id()
        bitmap = Bitmap(len(keys))
        ids = [key_id(k) for k in keys]
        found = self.index.lookup(ids) if keys else {}  # NOTE 2: None at once when degraded
        with self._lock:
            if found:
                for n, (key, oid) in enumerate(zip(keys, ids, strict=True)):
                    loc = found.get(oid)
                    if loc is not None:
                        self._where[key] = loc
                        self._locks[key] += 1
                        bitmap.set(n)
            self.stats["lookups" if found is not None else "lookups_skipped"] += 1
            self.stats["lookup_hits"] += len(found or ())
        self.tasks.lookup_done(tid, bitmap)
        return tid

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self.tasks.pop_lookup(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                if self._locks[key] <= 1:
                    self._locks.pop(key, None)
                    self._where.pop(key, None)
                    self._releases.append(key_id(key))
                else:
                    self._locks[key] -= 1
        self._wake.set()  # the leases go back on the tier's thread

    # ------------------------------------------------------------------ load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self.tasks.new_id()
        self._pool.submit(self._load_task, tid, list(keys), [o.byte_array for o in objects])
        return tid

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self.tasks.pop_load(task_id)

    def _load_task(self, tid: L2TaskId, keys: list[ObjectKey], buffers: list[Any]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            self._load(keys, buffers, bitmap)
        except Exception:
            logger.exception("HiState shared tier: a load of %d objects failed", len(keys))
        finally:
            self.tasks.load_done(tid, bitmap)

    def _load(self, keys: list[ObjectKey], buffers: list[Any], bitmap: Bitmap) -> None:
        ids = [key_id(k) for k in keys]
        with self._lock:
            crcs = [(loc.crc if (loc := self._where.get(k)) is not None else None) for k in keys]

        def get(_c: Any) -> list[Any]:
            with self.data.pipeline(transaction=False) as p:
                for i in ids:
                    p.get(self.value_key(i))
                return p.execute(raise_on_error=False)

        replies = self.conn.call(get, None)
        if replies is None:  # the cluster went away meanwhile: misses, nothing forgotten
            self.stats["load_misses_degraded"] += len(keys)
            return
        bad: list[str] = []
        for n, (key, buf, reply) in enumerate(zip(keys, buffers, replies, strict=True)):
            value = reply if isinstance(reply, bytes) else None
            why = values.verify(value, df.ObjectId.of(key), buf, crcs[n])
            if not why:
                bitmap.set(n)
                self.stats["objects_loaded"] += 1
                self.stats["bytes_loaded"] += len(value or b"")
                self.stats[f"loads_group_{key.object_group_id}"] += 1
                continue
            logger.warning("HiState shared tier: %s not served (%s); its entry and value go",
                           key, why)
            self.stats["missing_values" if value is None else "corrupt_values"] += 1
            bad.append(ids[n])
        if bad:
            self.index.forget_stored(bad)
            self.conn.call(lambda _c: self._delete_each(
                [Victim(i, self.value_key(i), 0) for i in bad]), None)

    # ---------------------------------------------------------------- delete
    # ------------------------------------------- LMCache 0.5.7's adapter interface
    def get_memory_tags(self) -> Any:
        """``REMOTE`` storage: every node of the fleet reads it. Abstract from LMCache 0.5.7,
        which filters prefetch targets by it; 0.5.6 never calls it
        (``upstream.lmcache_symbols``)."""
        return l2_memory_tags(shared=True)

    def submit_touch(self, keys: list[ObjectKey]) -> None:
        """Nothing to do: LMCache 0.5.7 calls it on a hit served from L1, a use of the
        node's copy, not of the shared one. The shared tier's ranking lives in the index and
        moves with the lookups that read it (the ``lookup`` script refreshes ``t``)."""

    def delete(self, keys: list[ObjectKey]) -> None:
        """LMCache's own L2 eviction is not configured for this tier: the deployment's
        ranking deletes (module docstring). Counted, nothing done."""
        self.stats["deletes_ignored"] += len(keys)

    # ------------------------------------------------------------ background
    def _recovered(self) -> None:
        """The cluster answers again (connection's recovery listener): rejoin, reconcile."""
        self.index.rejoin(self.config.tier.budget_bytes)
        self._reconcile_due.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            try:
                with self._lock:
                    ids, self._releases = self._releases, []
                self.index.release(ids)
                self.conn.poll()
                if time.monotonic() - self._last_heartbeat >= HEARTBEAT_S:
                    self._last_heartbeat = time.monotonic()
                    self.index.heartbeat(ALIVE_S)
                if self._reconcile_due.is_set() and not self.conn.degraded:
                    self._reconcile_due.clear()
                    if self.reconcile() is None:  # incomplete: again at the next step
                        self._reconcile_due.set()
            except Exception:
                logger.exception("HiState shared tier: background step failed")

    def reconcile(self) -> dict[str, int] | None:
        """Entries whose value is gone are forgotten (their bytes freed); reservations and
        claims past their deadline expire (a claim taken over: its value deleted, its entry
        dropped). None, changing nothing, when any master did not answer (a value on it is
        unknown, not gone). Scans every entry: run after an outage, not per request."""
        keys = self.index.keys
        ids = self.conn.call(lambda c: list(c.zrange(keys.rank, 0, -1)), None)
        every = self.conn.call(lambda c: [keys.id_of(k) for k in c.scan_iter(
            match=keys.object_pattern, count=1000)], None)
        if ids is None or every is None:
            return None

        def exists(_c: Any) -> list[Any]:
            with self.data.pipeline(transaction=False) as p:
                for i in ids:
                    p.exists(self.value_key(i))
                return p.execute(raise_on_error=False)

        present = self.conn.call(exists, None) if ids else []
        if present is None or any(isinstance(e, Exception) for e in present):
            return None  # a master did not answer: its values are unknown, not gone
        gone = [i for i, e in zip(ids, present, strict=True) if e == 0]
        report: Counter[str] = Counter()
        report["values_gone"] = self.index.forget_stored(gone) if gone else 0
        stored = set(ids)
        taken = self.index.forget_expired([i for i in every if i not in stored])
        claims = [Victim(i, p, 0) for i, s, p in taken if s == "evicting"]
        if claims:
            self.index.drop(self._delete_victims(claims))
        report["expired"] = len(taken)
        self.last_reconcile = dict(report)
        self.stats["reconciles"] += 1
        self.stats["values_gone"] += report["values_gone"]
        logger.info("HiState shared tier reconciled: %s", dict(report))
        return dict(report)

    # ------------------------------------------------------------- inspection
    def report_status(self) -> dict:
        usage = None if self.conn.degraded else self.index.usage()
        out: dict[str, Any] = {
            "is_healthy": not self._closed,  # degraded: the node serves from its own tiers
            "type": "HiStateSharedAdapter",
            "mode": "degraded" if self.conn.degraded else "connected",
            "fault": self.conn.fault,
            "nodes": list(self.config.tier.nodes),
            "deployment": self.config.tier.deployment,
            "instance": self.config.tier.instance,
            "connection": self.conn.counters(),
            "stats": dict(self.stats),
            "last_reconcile": self.last_reconcile,
        }
        if usage is not None:
            out["used_bytes"], out["budget_bytes"], out["evicting_bytes"] = usage
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True, cancel_futures=False)
        self.conn.close()
        self.data.close()
        self.tasks.close()
