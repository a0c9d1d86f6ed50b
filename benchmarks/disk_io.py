"""Disk-tier I/O engines: a thread pool (what the adapter uses) vs aiofiles.

Both engines do the same work per object, in the disk tier's format
(``backends/server/disk/file_format.py``): header + payload written to a temporary file,
fsync, rename;
reads parse the header, read the payload into a preallocated buffer and verify its
crc32. The thread pool calls ``file_format.write_object`` / ``read_object`` from
``--workers`` threads; the aiofiles engine runs the same steps as coroutines with
``--workers`` in flight (aiofiles itself delegates each call to a thread pool).

Usage: .venv/bin/python benchmarks/disk_io.py [--dir DIR] [--sizes-mib 2 32] [--count 24]
       [--workers 4] [--repeats 3] [--drop-caches]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiofiles
import aiofiles.os
from lmcache_histate.backends.server.disk import file_format as df


def _oid(i: int) -> df.ObjectId:
    return df.ObjectId("bench/model", 0x01000100, 1, i.to_bytes(4, "little") * 8)


def _payloads(size: int, count: int) -> list[bytes]:
    base = os.urandom(size)
    return [i.to_bytes(4, "little") + base[4:] for i in range(count)]


# --------------------------------------------------------------- thread pool
def thread_write(root: Path, payloads: list[bytes], workers: int, *, direct: bool = False) -> None:
    def one(i: int) -> None:
        oid = _oid(i)
        df.write_object(
            df.object_path(root, oid), oid, payloads[i], kind=1, depth=i, parent=b"",
            direct=direct,
        )

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(len(payloads))))


def thread_read(root: Path, bufs: list[bytearray], workers: int) -> None:
    def one(i: int) -> None:
        oid = _oid(i)
        status, why = df.read_object(df.object_path(root, oid), oid, memoryview(bufs[i]))
        assert status is df.ReadStatus.OK, why

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(len(bufs))))


# ------------------------------------------------------------------ aiofiles
async def _aio_write_one(root: Path, i: int, payload: bytes, sem: asyncio.Semaphore) -> None:
    oid = _oid(i)
    path = df.object_path(root, oid)
    header = df.encode_header(oid, 1, i, b"", len(payload), zlib.crc32(payload))
    async with sem:
        await aiofiles.os.makedirs(path.parent, exist_ok=True)
        tmp = path.with_name(path.name + ".aio" + df.TMP_SUFFIX)
        async with aiofiles.open(tmp, "wb") as f:
            await f.write(header)
            await f.write(payload)
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())
        await aiofiles.os.replace(tmp, path)


async def _aio_read_one(root: Path, i: int, buf: bytearray, sem: asyncio.Semaphore) -> None:
    oid = _oid(i)
    path = df.object_path(root, oid)
    async with sem, aiofiles.open(path, "rb") as f:
        head = await f.read(4096)
        header, end = df.parse_header(head)
        view = memoryview(buf)
        have = head[end:]
        view[: len(have)] = have
        pos = len(have)
        while pos < len(view):
            n = await f.readinto(view[pos:])
            assert n
            pos += n
    assert header.oid == oid and zlib.crc32(view) == header.payload_crc


def aio_write(root: Path, payloads: list[bytes], workers: int) -> None:
    async def main() -> None:
        sem = asyncio.Semaphore(workers)
        await asyncio.gather(*(_aio_write_one(root, i, p, sem) for i, p in enumerate(payloads)))

    asyncio.run(main())


def aio_read(root: Path, bufs: list[bytearray], workers: int) -> None:
    async def main() -> None:
        sem = asyncio.Semaphore(workers)
        await asyncio.gather(*(_aio_read_one(root, i, b, sem) for i, b in enumerate(bufs)))

    asyncio.run(main())


ENGINES = {"thread": (thread_write, thread_read), "aiofiles": (aio_write, aio_read)}


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="folder on the disk to test (default: a temp dir)")
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[2.0, 32.0])
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true", help="read cold (needs root)")
    args = ap.parse_args()

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="histate-bench-"))
    print(f"dir={base} count={args.count} workers={args.workers} repeats={args.repeats}")
    print("| object | engine | write MiB/s (median) | read MiB/s (median) |")
    print("|---:|---|---:|---:|")
    try:
        for size_mib in args.sizes_mib:
            size = int(size_mib * 2**20)
            payloads = _payloads(size, args.count)
            total = size * args.count / 2**20
            results: dict[str, tuple[list[float], list[float]]] = {e: ([], []) for e in ENGINES}
            for _ in range(args.repeats):
                for name, (write, read) in ENGINES.items():  # interleaved: fair to drift
                    root = base / name
                    shutil.rmtree(root, ignore_errors=True)
                    root.mkdir(parents=True)
                    t0 = time.perf_counter()
                    write(root, payloads, args.workers)
                    t1 = time.perf_counter()
                    cold = args.drop_caches and drop_caches()
                    bufs = [bytearray(size) for _ in range(args.count)]
                    t2 = time.perf_counter()
                    read(root, bufs, args.workers)
                    t3 = time.perf_counter()
                    assert all(bytes(b[:4]) == p[:4] for b, p in zip(bufs, payloads, strict=True))
                    results[name][0].append(total / (t1 - t0))
                    results[name][1].append(total / (t3 - t2))
                    del cold
            for name, (w, r) in results.items():
                print(
                    f"| {size_mib:g} MiB | {name} | {statistics.median(w):,.0f} "
                    f"| {statistics.median(r):,.0f} |"
                )
    finally:
        if not args.dir:
            with contextlib.suppress(OSError):
                shutil.rmtree(base)


if __name__ == "__main__":
    main()
