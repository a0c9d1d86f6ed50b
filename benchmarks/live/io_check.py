"""Disk-tier and CPU-tier throughput next to the hardware's, measured the same minute.

* disk: the disk tier's own write and read path (``benchmarks/disk_io.py``'s thread pool over
  ``file_format.write_object`` / ``read_object``: header, payload, fsync, rename; crc-checked
  reads) for objects the size of a Qwen3.5-9B snapshot (51.5 MB) and KV chunk (17 MB),
  beside ``dd`` with direct I/O (``oflag=direct`` / ``iflag=direct``: the device's raw
  sequential bandwidth) on the same folder. The page cache is dropped before reads where
  the kernel allows it (else the read column says so);
* CPU tier: ``torch.Tensor.copy_`` between host buffers (how a chunk lands in LMCache's L1
  on CPU) beside a plain ``memmove`` of the same bytes.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from disk_io import drop_caches, thread_read, thread_write

SIZES = {"snapshot 51.5 MB": 51_500_000, "KV chunk 17 MB": 17_000_000}


def _dd_rate(args: list[str]) -> float:
    """MB/s from dd's summary line (``..., 1.2 GB/s``)."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    match = re.search(r"([\d.]+) ([kMG]?B)/s", out.strip().splitlines()[-1])
    if not match:
        raise RuntimeError(f"unexpected dd output: {out!r}")
    scale = {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}[match.group(2)]
    return float(match.group(1)) * scale


def raw_disk(folder: Path, mib: int = 256) -> dict[str, float]:
    path = folder / "dd.bin"
    try:
        write = _dd_rate(["if=/dev/zero", f"of={path}", "bs=4M", f"count={mib // 4}",
                          "oflag=direct", "conv=fsync"])
        read = _dd_rate([f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"])
    finally:
        path.unlink(missing_ok=True)
    return {"write_mb_s": write, "read_mb_s": read}


def tier_disk(folder: Path, size: int, count: int, workers: int = 4) -> dict[str, Any]:
    base = bytes(range(256)) * (size // 256) + bytes(size % 256)
    payloads = [i.to_bytes(4, "little") + base[4:] for i in range(count)]
    root = Path(tempfile.mkdtemp(dir=folder, prefix="tier-"))
    try:
        # Buffered (disk_direct_io: false) first, then the default O_DIRECT path into a fresh
        # folder; the reads below read the O_DIRECT files.
        started = time.perf_counter()
        thread_write(root / "buffered", payloads, workers, direct=False)
        buffered = size * count / (time.perf_counter() - started) / 1e6
        started = time.perf_counter()
        thread_write(root, payloads, workers, direct=True)
        write = size * count / (time.perf_counter() - started) / 1e6
        dropped = drop_caches()
        bufs = [bytearray(size) for _ in range(count)]
        started = time.perf_counter()
        thread_read(root, bufs, workers)
        read = size * count / (time.perf_counter() - started) / 1e6
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"write_mb_s": write, "buffered_write_mb_s": buffered, "read_mb_s": read,
            "cold_reads": dropped}


def cpu_copy(size: int, repeats: int = 20) -> dict[str, float]:
    import torch

    src = torch.empty(size, dtype=torch.uint8).fill_(7)
    dst = torch.empty(size, dtype=torch.uint8)
    dst.copy_(src)  # touch the pages once
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    tier = size * repeats / (time.perf_counter() - started) / 1e6
    started = time.perf_counter()
    for _ in range(repeats):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), size)
    plain = size * repeats / (time.perf_counter() - started) / 1e6
    return {"tier_mb_s": tier, "memmove_mb_s": plain}


def measure(folder: Path, total_mb: int = 400) -> dict[str, Any]:
    """All rows, raw disk measured first and last (its mean is the reference).

    Each object size writes about ``total_mb`` MB (8 snapshots, 24 KV chunks at 400), the
    order of dd's 256 MiB: eight 17 MB objects took ~0.1 s, too short to time against dd.
    """
    first = raw_disk(folder)
    rows = {name: tier_disk(folder, size, max(1, round(total_mb * 1e6 / size)))
            for name, size in SIZES.items()}
    last = raw_disk(folder)
    raw = {k: (first[k] + last[k]) / 2 for k in first}
    return {"raw_disk": raw, "raw_disk_runs": [first, last], "disk_tier": rows,
            "cpu_tier": {name: cpu_copy(size) for name, size in SIZES.items()}}


def markdown(io: dict[str, Any]) -> str:
    raw = io["raw_disk"]
    lines = [
        "| object | disk tier write MB/s | raw write (dd, direct) | % | buffered write "
        "(`disk_direct_io: false`) | % | disk tier read MB/s | raw read | % "
        "| CPU tier copy MB/s | memmove | % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in io["disk_tier"].items():
        cpu = io["cpu_tier"][name]
        cold = "" if row["cold_reads"] else " (page cache not dropped)"
        lines.append(
            f"| {name} | {row['write_mb_s']:,.0f} | {raw['write_mb_s']:,.0f} | "
            f"{100 * row['write_mb_s'] / raw['write_mb_s']:.0f} | "
            f"{row['buffered_write_mb_s']:,.0f} | "
            f"{100 * row['buffered_write_mb_s'] / raw['write_mb_s']:.0f} | "
            f"{row['read_mb_s']:,.0f}{cold} "
            f"| {raw['read_mb_s']:,.0f} | {100 * row['read_mb_s'] / raw['read_mb_s']:.0f} | "
            f"{cpu['tier_mb_s']:,.0f} | {cpu['memmove_mb_s']:,.0f} | "
            f"{100 * cpu['tier_mb_s'] / cpu['memmove_mb_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python benchmarks/live/io_check.py [--folder DIR] [--total-mb N]``: the I/O table alone."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path.cwd(),
                        help="folder on the disk to measure (default: the current one)")
    parser.add_argument("--total-mb", type=int, default=400,
                        help="MB written per object size (default 400)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(dir=args.folder, prefix="io-check-"))
    try:
        print(markdown(measure(work, args.total_mb)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
