"""Reconcile the shared folder with the index: orphan files, stale entries, dead holders.

Run by one server at start and then periodically (any server may: every step is a
conditional script, so two reconciles at once change nothing twice). What it fixes:

* **a file without an entry** (a server died between rename and commit, or wrote while
  Redis was away, or Redis lost its data): older than ``grace_s``, it is *adopted*
  (registered, owned by this server, with ``C = 0``: it ranks as a unit nothing is known
  to need, until a server that knows its chain re-scores it) or, with ``adopt=False``,
  removed. Younger files are left alone: their commit may be on its way;
* **a stored entry whose file is gone**: forgotten (a lookup would miss anyway);
* **a reservation past its deadline** (the writer died): committed if its file is
  complete under its final name (renames are atomic), forgotten otherwise;
* **an eviction claim past its deadline** (the claimant died): taken over, the file
  deleted, the entry dropped;
* **a temporary file older than ``grace_s``**: a dead writer's leftover, removed. Never
  ``file_format.scan`` here: it removes every temporary file, including the ones other
  servers are writing right now.

Leases need no scan: they carry their expiry and the claim script ignores expired ones.
Files are matched to entries by the id of the key in their header, never by name alone.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import redis

from ..disk import file_format as df
from .budget import Deleter, delete_victims
from .index import SharedIndex, Victim
from .layout import ObjectRecord, object_id

__all__ = ["reconcile"]


def _record(root: Path, path: Path, header: df.Header) -> ObjectRecord:
    size = header.file_size
    return ObjectRecord(
        df.encode_id(header.oid), str(path.relative_to(root)), size, header.payload_crc,
        header.kind, header.depth, header.parent, cost=0.0, freed=float(size),
    )


def _files(
    root: Path, grace_s: float, now: float, report: Counter[str]
) -> dict[str, tuple[Path, df.Header]]:
    """Valid object files older than ``grace_s`` by id; stale temporaries removed."""
    found: dict[str, tuple[Path, df.Header]] = {}
    for path in df.iter_files(root):
        try:
            st = path.lstat()
        except OSError:
            continue
        old = now - st.st_mtime >= grace_s
        if df.OWN_TMP_NAME.fullmatch(path.name):
            if old:
                with contextlib.suppress(OSError):
                    path.unlink()
                    report["tmp_removed"] += 1
            continue
        if not df.OWN_NAME.fullmatch(path.name) or not old or path.is_symlink():
            continue
        try:
            header = df.read_header(path)
        except (df.FormatError, OSError, ValueError):
            continue  # a load finds it corrupt and deletes it
        found[object_id(df.encode_id(header.oid))] = (path, header)
    return found


def reconcile(
    index: SharedIndex,
    root: Path,
    *,
    grace_s: float = 60.0,
    adopt: bool = True,
    delete: Deleter | None = None,
    clock: Callable[[], float] = time.time,
    batch: int = 512,
) -> Counter[str] | None:
    """One pass over ``root`` and the namespace's entries; counts what it did, or None
    if Redis became unreachable. ``delete`` removes taken-over claims' files."""
    report: Counter[str] = Counter()
    files = _files(root, grace_s, clock(), report)
    report["files"] = len(files)
    conn, keys = index.conn, index.keys

    # 1. files without an entry
    ids = list(files)
    states: dict[str, str | None] = {}
    for part in _batches(ids, batch):
        got = _read(index, [keys.entry(i) for i in part], ("state",))
        if got is None:
            return None
        states.update((i, row[0]) for i, row in zip(part, got, strict=True))
    orphans = [i for i in ids if states.get(i) is None]
    if adopt and orphans:
        for part in _batches(orphans, batch):
            status = index.commit([_record(root, *files[i]) for i in part], adopting=True)
            if status is None:
                return None
            report["adopted"] += sum(1 for s in status if s == 2)
    elif orphans:
        for i in orphans:
            with contextlib.suppress(OSError):
                files[i][0].unlink()
                report["orphans_removed"] += 1

    # 2. entries: stale stored ones, expired reservations and claims
    stale: list[str] = []
    expiring: list[str] = []
    cursor: int | str = 0
    while True:
        page = conn.call(
            lambda c, cur=cursor: c.scan(cur, match=keys.object_pattern, count=batch), None
        )
        if page is None:
            return None
        cursor, names = page
        if names:
            rows = _read(index, names, ("state", "path"))
            if rows is None:
                return None
            for name, (state, path) in zip(names, rows, strict=True):
                i = keys.id_of(name)
                if state == "stored" and path and not (root / path).exists():
                    stale.append(i)
                elif state in ("writing", "evicting"):
                    expiring.append(i)
        if int(cursor) == 0:
            break
    for part in _batches(stale, batch):
        report["stale_forgotten"] += index.forget_stored(part)
    delete = delete or delete_victims(root)
    complete: list[ObjectRecord] = []
    expired = [row for part in _batches(expiring, batch) for row in index.forget_expired(part)]
    for i, state, path in expired:
        if state == "evicting":
            report["claims_completed"] += index.drop(delete([Victim(i, path, 0)])) or 0
        elif i in files:  # the writer died after the rename: the file is complete
            complete.append(_record(root, *files[i]))
        else:
            report["writes_expired"] += 1
    if complete:
        status = index.commit(complete, adopting=True) or ()
        report["writes_adopted"] += sum(1 for s in status if s == 2)
    return report


def _batches(ids: list[str], size: int) -> list[list[str]]:
    return [ids[start : start + size] for start in range(0, len(ids), size)]


def _read(index: SharedIndex, names: list[str], fields: tuple[str, ...]) -> list | None:
    """``HMGET name *fields`` for every name, one pipeline; None if unreachable."""

    def go(c: redis.Redis) -> list:
        with c.pipeline(transaction=False) as p:
            for name in names:
                p.hmget(name, *fields)
            return p.execute()

    return index.conn.call(go, None)
