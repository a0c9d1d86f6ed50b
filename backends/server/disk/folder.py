"""Which folder the disk tier may use: its ownership marker and the space it may fill.

The tier deletes files at start (its own leftover temporaries and invalid objects), so it
must never run on a folder that holds other things unless told to. Rules (``claim``):

* a missing or empty folder (``lost+found`` aside: a dedicated filesystem's root) becomes
  the tier's own: the marker file ``.histate-disk`` is written at first use;
* a folder with the marker is the tier's own (a restart);
* a non-empty folder without the marker is refused, unless ``adopt`` is set: then the
  marker is written and the tier uses the folder. Even then ``file_format.scan`` touches only
  its own layout (shard folders ``00``..``ff`` and its own file-name patterns), so other
  files in an adopted folder survive.

While a tier uses the folder it holds an exclusive ``flock`` on the marker (``hold``;
released when it closes or its process dies): a second server on the same folder would
delete the first one's temporary files at its start scan and double-count its bytes, so
it is refused.

``capacity_limit`` is the other half: the bytes the tier can really hold on its
filesystem (what it already holds plus the free space), used at start and after ENOSPC.

Pure Python (no lmcache import): the launcher checks a folder with it before anything
starts, the adapter claims it when the server builds the tier.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from . import file_format as df

__all__ = [
    "MARKER", "FolderError", "capacity_limit", "check_claim", "check_free", "claim",
    "held_bytes", "hold",
]

MARKER = ".histate-disk"
_MARKER_BODY = {"format": "histate-disk", "layout": 1}
_IGNORED = frozenset({"lost+found", MARKER})


class FolderError(ValueError):
    """The folder cannot be used as the disk tier (the message says why and what to do)."""


def _is_ours(root: Path) -> bool:
    marker = root / MARKER
    if not marker.exists():
        return False
    try:
        body = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise FolderError(f"{str(root)!r}: unreadable marker {MARKER}: {exc}") from None
    if body != _MARKER_BODY:
        raise FolderError(
            f"{str(root)!r}: marker {MARKER} says {body}, this version writes {_MARKER_BODY}"
        )
    return True


def check_claim(root: Path, *, adopt: bool) -> str:
    """What ``claim`` would do, without writing: ``"new"``, ``"ours"`` or ``"adopt"``.

    Raises:
        FolderError: ``root`` is not a folder, or holds foreign files and ``adopt`` is off.
    """
    if not root.exists():
        return "new"
    if not root.is_dir():
        raise FolderError(f"{str(root)!r} exists and is not a folder")
    if _is_ours(root):
        return "ours"
    foreign = sorted(e.name for e in root.iterdir() if e.name not in _IGNORED)
    if not foreign:
        return "new"
    if adopt:
        return "adopt"
    shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    raise FolderError(
        f"{str(root)!r} is not empty ({len(foreign)} entries: {shown}) and has no {MARKER} "
        "marker: it is not a HiState disk tier; point disk_path at an empty or new folder, "
        "or set disk_adopt: true to let the tier use it (it only ever touches its own files)"
    )


def claim(root: Path, *, adopt: bool) -> str:
    """Create ``root`` if needed and make it the tier's own (writes the marker).

    Returns what ``check_claim`` found. Raises ``FolderError`` as ``check_claim`` does,
    and ``OSError`` when the folder or marker cannot be written.
    """
    found = check_claim(root, adopt=adopt)
    if found != "ours":
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{MARKER}.{os.getpid()}"
        tmp.write_text(json.dumps(_MARKER_BODY) + "\n")
        os.replace(tmp, root / MARKER)
    return found


def hold(root: Path, *, shared: bool = False) -> int:
    """Lock ``root``'s marker for as long as the returned fd stays open.

    ``shared``: the servers of one shared-index deployment use one folder; each holds a
    shared lock, which still refuses a server *without* a shared index (it asks for the
    exclusive lock), and a shared server is refused while such a server runs.

    Raises:
        FolderError: another tier (a running server) holds it.
    """
    fd = os.open(root / MARKER, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderError(
            f"{str(root)!r} is in use by another HiState disk tier (a running server); "
            "give each server its own disk_path, or every server of the folder the same "
            "shared_index section"
        ) from None
    return fd


def check_free(root: Path, *, shared: bool = False) -> None:
    """Raise ``FolderError`` if a running tier holds ``root`` so that this one cannot
    (``hold``'s ``shared``); no-op without a marker."""
    if (root / MARKER).exists():
        os.close(hold(root, shared=shared))


def held_bytes(root: Path) -> int:
    """Bytes of the tier's own object files under ``root`` (stat only, no reads)."""
    total = 0
    for path in df.iter_files(root):
        if df.OWN_NAME.fullmatch(path.name):
            try:
                total += path.stat().st_size
            except OSError:
                continue
    return total


def capacity_limit(root: Path, held: int) -> int:
    """Bytes the tier could hold on ``root``'s filesystem: ``held`` + what is free there.

    Free space is what an unprivileged writer gets (``f_bavail``): the blocks reserved for
    root are not the tier's to fill.
    """
    st = os.statvfs(root)
    return held + st.f_bavail * st.f_frsize
