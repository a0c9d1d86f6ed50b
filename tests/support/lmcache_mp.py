"""Real LMCache multiprocess-mode harness: a ``lmcache server`` subprocess and an engine client.

Why this exists: hybrid (attention + recurrent) state reaches LMCache storage only in MP mode
(docs/design.md §5.1), so every live test of the HiState backend needs (a) a real ``lmcache
server`` on free localhost ports and (b) something that behaves like vLLM's
``LMCacheMPConnector`` worker: it registers paged KV buffers for two object groups, stores
chunks, looks prefixes up and retrieves them. Starting vLLM for that is slow and hides the
protocol; this module drives the same protocol with LMCache's own client classes
(``RequestClientFactory``, ``create_transfer_context(mode="lmcache_driven")``,
``IPCCacheServerKey``, ``EngineGroupInfo``) on small CPU tensors, so a test can assert byte
equality of what comes back.

Nothing here is mocked: the server is the stock ``lmcache`` CLI (or any command that wraps it,
e.g. the project's launcher), the buffers are shared with the server through POSIX shared
memory exactly as vLLM's CPU path does, and the bytes travel through L1 and the configured L2.

Layout chosen for the two groups (mirrors what LMCache's vLLM integration registers):

* group 0, attention: per layer ``[2, num_blocks, block_size, heads, head_size]`` (vLLM NHD);
* group 1, recurrent: per layer ``[num_blocks, 2, block_size, 1, width]``, the "mamba page view"
  LMCache's vLLM integration builds from a Mamba ``[conv, ssm]`` page
  (``integration/vllm/kv_cache_group_edits.py: _MambaPageViewEdit``); registered with
  ``EngineGroupInfo(recurrent_state=True, sw_size_tokens=block_size)`` so the server treats it
  as a one-chunk window: a hit of L chunks needs only the recurrent object of chunk L-1.

Block id 0 is the server's null block (``--null-block-id`` default): a chunk whose block ids are
all 0 for a group is not stored for that group. ``store_chunks(snapshot_chunks=...)`` uses this
to store a recurrent snapshot only at chosen chunks, as vLLM's align mode does.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.distributed.api import ObjectKey, ipc_key_to_object_keys
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.multiprocess.token_hasher import TokenHasher
from lmcache.v1.multiprocess.transfer_context import TransferContext, create_transfer_context
from lmcache.v1.multiprocess.transport.base import RequestClient
from lmcache_histate.backends.demo.servers import free_ports

from support.request_client import OwnedRequestClient

ATTN_GROUP = 0
"""Object group id of the attention KV (first regular group under --separate-object-groups)."""
REC_GROUP = 1
"""Object group id of the recurrent state snapshots."""
NULL_BLOCK = 0
"""The server's null block id: chunks whose block ids are all NULL_BLOCK are not stored."""

# LMCache phones home for usage telemetry by default; tests must not (and cannot) reach out.
QUIET_ENV: Mapping[str, str] = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}

SUPPORT_DIR = Path(__file__).resolve().parent
"""``tests/support``: test-only server modules (``pressure_override``, ``zero_restore_hook``)
live here, outside the installed package; a server that loads them needs this folder on its
``PYTHONPATH`` (:func:`support_pythonpath`)."""


def support_pythonpath() -> dict[str, str]:
    """Environment for a server subprocess that loads test-only server modules by their
    top-level names: ``PYTHONPATH`` = ``tests/support`` + the current one."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([str(SUPPORT_DIR), *paths])}


class LMCacheServerError(RuntimeError):
    """The server failed to start, died, or answered an HTTP call with an error."""


def default_server_command() -> list[str]:
    """``lmcache server`` run by this interpreter, so the venv's lmcache is the one tested."""
    return [sys.executable, "-m", "lmcache.cli.main", "server"]


@dataclass(frozen=True)
class ServerEndpoints:
    """Where a server listens: ZMQ request port (MP protocol) and HTTP admin port."""

    host: str
    zmq_port: int
    http_port: int

    @property
    def zmq_url(self) -> str:
        """URL for ``RequestClientFactory.create``."""
        return f"tcp://{self.host}:{self.zmq_port}"

    @property
    def http_url(self) -> str:
        """Base URL of the FastAPI admin API (``/healthcheck``, ``/status``, ``/cache/...``)."""
        return f"http://{self.host}:{self.http_port}"


class LMCacheServer:
    """Handle on a running ``lmcache server`` subprocess (use :func:`lmcache_server` to get one).

    Output goes to a log file rather than a pipe so a chatty server can never block on a full
    pipe; :meth:`log_tail` reads it back for error messages.
    """

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        endpoints: ServerEndpoints,
        log_path: Path,
        argv: Sequence[str],
    ) -> None:
        self.proc = proc
        self.endpoints = endpoints
        self.log_path = log_path
        self.argv = list(argv)

    # -- process control -------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Process id of the server."""
        return self.proc.pid

    @property
    def is_running(self) -> bool:
        """Whether the server process is still alive."""
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """Stop cleanly, escalating to SIGKILL after ``timeout``.

        SIGTERM makes uvicorn run the app's lifespan shutdown (request server, engine, L2
        adapters closed) and then re-raise the signal, so a clean stop returns ``-15``.

        Returns:
            The exit code (negative signal number when ended by a signal).
        """
        if self.is_running:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return self.kill()
        self._reap_group()
        return int(self.proc.returncode)

    def kill(self) -> int:
        """Kill hard (SIGKILL), as a crash would: no shutdown hooks run. For fault tests.

        Returns:
            The exit code (``-9`` unless the process had already exited).
        """
        if self.is_running:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        self.proc.wait(timeout=30)
        self._reap_group()
        return int(self.proc.returncode)

    def _reap_group(self) -> None:
        """Kill anything the server left in its own process group (it was started in a new
        session, so its group id is its pid and holds nothing of ours)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 60) -> str:
        """Last ``lines`` lines of the server's combined stdout/stderr."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no server log>"
        return "\n".join(text.splitlines()[-lines:])

    # -- HTTP admin API --------------------------------------------------------------------

    def http(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
        """Call the admin API; return the decoded JSON body (text if the body is not JSON).

        Raises:
            LMCacheServerError: On a non-2xx answer or a connection failure.
        """
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.endpoints.http_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
                is_json = "json" in response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise LMCacheServerError(f"{method} {path} -> {exc.code}: {detail}") from exc
        except OSError as exc:
            raise LMCacheServerError(f"{method} {path} failed: {exc}") from exc
        if not payload:
            return None
        return json.loads(payload) if is_json else payload.decode(errors="replace")

    def status(self) -> dict[str, Any]:
        """``GET /status``: every component's ``report_status()`` (L1, L2, controllers...)."""
        result = self.http("GET", "/status")
        assert isinstance(result, dict)
        return result

    def clear_l1(self, force: bool = False) -> None:
        """``POST /cache/clear`` for tier L1. Unforced, objects still locked stay resident."""
        self.http("POST", "/cache/clear", {"tier": "l1", "force": force})

    def l1_object_count(self) -> int:
        """Number of objects resident in the default L1: committed, not staging.

        LMCache's ``total_object_count`` also counts a STORE's reserved objects before their
        write finishes (lmcache 0.5.6 ``L1Manager.report_status``). Resident ones were
        committed by ``finish_write``, which notifies the L1 listeners (HiState's
        ``CommitListener``) in the same critical section as ``report_status``: once they are
        counted here, HiState has queued their commit."""
        l1 = self.status()["storage_manager"]["l1_manager"]
        return int(l1["total_object_count"]) - int(l1["staging_object_count"])

    def wait_l2_flushed(self, timeout: float = 20.0) -> None:
        """Wait until every store controller has no pending or in-flight L1->L2 store.

        Call it after the stored keys are committed to L1 (see
        :meth:`HybridEngineClient.wait_for_hit`): keys are queued for L2 only once their L1
        write finishes. Idle must hold on two polls in a row, to step over the short window
        between a controller popping keys and submitting them.
        """
        deadline = time.monotonic() + timeout
        idle_polls = 0
        while time.monotonic() < deadline:
            controllers = self.status()["storage_manager"].get("store_controllers", {})
            busy = any(
                c.get("pending_keys_count", 0) or c.get("in_flight_task_count", 0)
                for c in controllers.values()
            )
            idle_polls = 0 if busy else idle_polls + 1
            if idle_polls >= 2:
                return
            time.sleep(0.1)
        raise LMCacheServerError(f"L2 stores still in flight after {timeout}s")

    def histate_settled(self, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until HiState is idle and a janitor tick ran after that; its status.

        Idle: L2 stores flushed, no disk write in flight, no L1 delete to retry and no
        queued L1 event. Then the janitor's tick count (``janitor_ticks``) must grow by
        two: the first tick may have started before idle was seen, the second began
        after it, so whatever the janitor does with an idle server (drain, re-rank
        sweep step, deferred deletes) has been done once. Polls; no fixed sleep.
        """
        self.wait_l2_flushed(timeout)
        deadline = time.monotonic() + timeout
        ticks: int | None = None
        while time.monotonic() < deadline:
            hs = self.status()["histate"]
            idle = (hs.get("disk", {}).get("writes_in_flight", 0) == 0
                    and hs["pending_l1_retries"] == 0 and hs["queued_l1_events"] == 0)
            if not idle:
                ticks = None
            elif ticks is None:
                ticks = hs["janitor_ticks"]
            elif hs["janitor_ticks"] >= ticks + 2:
                return hs
            time.sleep(0.05)
        raise LMCacheServerError(f"HiState not settled after {timeout}s")


def _wait_ready(server: LMCacheServer, timeout: float) -> None:
    """Poll ``/healthcheck`` until the engine is up; fail fast if the process exits."""
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if not server.is_running:
            raise LMCacheServerError(
                f"lmcache server exited with code {server.proc.returncode} during start-up\n"
                f"argv: {server.argv}\n--- server log tail ---\n{server.log_tail()}"
            )
        try:
            if server.http("GET", "/healthcheck", timeout=2.0) == {"status": "healthy"}:
                return
        except LMCacheServerError as exc:
            last_error = str(exc)
        time.sleep(0.2)
    server.kill()
    raise LMCacheServerError(
        f"lmcache server not ready after {timeout}s ({last_error})\n"
        f"argv: {server.argv}\n--- server log tail ---\n{server.log_tail()}"
    )


@contextlib.contextmanager
def lmcache_server(
    extra_args: Sequence[str] = (),
    *,
    workdir: Path,
    chunk_size: int | None = 16,
    l1_size_gb: float = 0.05,
    eviction_policy: str = "LRU",
    separate_object_groups: bool = True,
    command: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 90.0,
    host: str = "127.0.0.1",
) -> Iterator[LMCacheServer]:
    """Run a real ``lmcache server`` on free localhost ports for the duration of the block.

    Args:
        extra_args: Further CLI flags, e.g. ``["--l2-adapter", json.dumps({...})]``.
        workdir: Directory for the server's cwd and log file (a pytest ``tmp_path``).
        chunk_size: ``--chunk-size`` (tokens per LMCache chunk); None passes none (the
            HiState launcher then takes its YAML's value, e.g. ``auto``).
        l1_size_gb: ``--l1-size-gb``.
        eviction_policy: ``--eviction-policy`` (L1).
        separate_object_groups: pass ``--separate-object-groups`` (needed for hybrid models).
        command: argv prefix replacing ``lmcache server`` (e.g. the project's launcher).
        env: Extra environment variables (added to this process's environment).
        startup_timeout: Seconds to wait for ``/healthcheck``.
        host: Interface for both ports (loopback only in tests).

    Yields:
        The ready server. On exit it is stopped cleanly (or killed if it does not stop).

    Raises:
        LMCacheServerError: If the server exits or is not healthy within ``startup_timeout``;
            the message carries the tail of its log.
    """
    zmq_port, http_port = free_ports(2, host)
    endpoints = ServerEndpoints(host=host, zmq_port=zmq_port, http_port=http_port)
    argv = [
        *(command if command is not None else default_server_command()),
        "--host",
        host,
        "--port",
        str(endpoints.zmq_port),
        "--http-host",
        host,
        "--http-port",
        str(endpoints.http_port),
        *(["--chunk-size", str(chunk_size)] if chunk_size is not None else []),
        "--l1-size-gb",
        str(l1_size_gb),
        "--eviction-policy",
        eviction_policy,
        *(["--separate-object-groups"] if separate_object_groups else []),
        *extra_args,
    ]
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"lmcache-server-{endpoints.zmq_port}.log"
    full_env = {**os.environ, **QUIET_ENV, **(env or {})}
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = LMCacheServer(proc, endpoints, log_path, argv)
    try:
        _wait_ready(server, startup_timeout)
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------
# Engine-side client
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineGeometry:
    """Shape of the toy hybrid engine's paged buffers (small: tests move bytes, not models).

    ``block_size`` tokens per engine block for both groups (vLLM aligns hybrid block sizes);
    a chunk is ``blocks_per_chunk`` blocks, so the server's ``--chunk-size`` must equal
    :attr:`chunk_size`.
    """

    block_size: int = 16
    blocks_per_chunk: int = 1
    num_blocks: int = 64
    attn_layers: int = 2
    attn_heads: int = 2
    head_size: int = 8
    attn_dtype: torch.dtype = torch.bfloat16
    rec_layers: int = 2
    rec_width: int = 32
    rec_dtype: torch.dtype = torch.float32

    @property
    def chunk_size(self) -> int:
        """Tokens per LMCache chunk."""
        return self.block_size * self.blocks_per_chunk


@dataclass(frozen=True)
class StoredPrefix:
    """What :meth:`HybridEngineClient.store_chunks` wrote: tokens and the source blocks.

    ``attn_blocks[i]`` / ``rec_blocks[i]`` are the block ids of chunk ``i`` (``rec_blocks[i]``
    is all ``NULL_BLOCK`` for chunks stored without a recurrent snapshot).
    """

    token_ids: tuple[int, ...]
    attn_blocks: tuple[tuple[int, ...], ...]
    rec_blocks: tuple[tuple[int, ...], ...]

    @property
    def num_chunks(self) -> int:
        """Number of chunks stored."""
        return len(self.attn_blocks)

    def snapshot_chunks(self) -> list[int]:
        """Indices of the chunks that carry a recurrent snapshot."""
        return [i for i, ids in enumerate(self.rec_blocks) if any(b != NULL_BLOCK for b in ids)]


@dataclass(frozen=True)
class RetrievedPrefix:
    """Result of :meth:`HybridEngineClient.lookup_and_retrieve`.

    ``attn_blocks`` cover chunks ``[0, hit_chunks)``; ``rec_blocks`` are the blocks of the one
    recurrent snapshot restored (chunk ``hit_chunks - 1``), empty on a miss.
    """

    hit_chunks: int
    ok: bool
    attn_blocks: tuple[tuple[int, ...], ...] = ()
    rec_blocks: tuple[int, ...] = ()


_instance_counter = itertools.count(1)


class HybridEngineClient:
    """A toy hybrid "engine worker" speaking LMCache's MP protocol, lmcache-driven transfer.

    It owns CPU paged buffers for an attention group and a recurrent group, registers them (the
    tensors are migrated to POSIX shared memory in place, so the server reads and writes them
    directly), and issues STORE / LOOKUP / RETRIEVE like vLLM's ``LMCacheMPConnector`` does.
    Use it as a context manager; :meth:`close` unregisters and closes the socket.
    """

    def __init__(
        self,
        zmq_url: str,
        geometry: EngineGeometry | None = None,
        *,
        model_name: str = "histate-toy",
        rpc_timeout: float = 20.0,
        seed: int = 0,
    ) -> None:
        self.geometry = geometry or EngineGeometry()
        self.model_name = model_name
        self.rpc_timeout = rpc_timeout
        self.instance_id = os.getpid() * 1000 + next(_instance_counter)
        self._generator = torch.Generator().manual_seed(seed)
        self._next_block = NULL_BLOCK + 1
        g = self.geometry
        self.attn_caches: dict[str, torch.Tensor] = {
            f"model.layers.{i}.attn": torch.zeros(
                2, g.num_blocks, g.block_size, g.attn_heads, g.head_size, dtype=g.attn_dtype
            )
            for i in range(g.attn_layers)
        }
        self.rec_caches: dict[str, torch.Tensor] = {
            f"model.layers.{g.attn_layers + i}.linear_attn": torch.zeros(
                g.num_blocks, 2, g.block_size, 1, g.rec_width, dtype=g.rec_dtype
            )
            for i in range(g.rec_layers)
        }
        # Registration order = layer index order: attention layers, then recurrent layers.
        self.kv_caches: dict[str, torch.Tensor] = {**self.attn_caches, **self.rec_caches}
        self.group_infos = [
            EngineGroupInfo(
                engine_group_id=ATTN_GROUP,
                layer_indices=tuple(range(g.attn_layers)),
                tokens_per_block=g.block_size,
            ),
            EngineGroupInfo(
                engine_group_id=REC_GROUP,
                layer_indices=tuple(range(g.attn_layers, g.attn_layers + g.rec_layers)),
                tokens_per_block=g.block_size,
                sw_size_tokens=g.block_size,
                recurrent_state=True,
            ),
        ]
        self._hasher = TokenHasher(chunk_size=g.chunk_size, hash_algorithm="blake3")
        self._owned_client = OwnedRequestClient(zmq_url)  # own ZMQ context: request_client.py
        self._transfer: TransferContext | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> HybridEngineClient:
        self.register()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def register(self) -> None:
        """REGISTER_KV_CACHE with both groups; waits for the server's acknowledgement."""
        transfer = create_transfer_context(
            self.kv_caches,
            instance_id=self.instance_id,
            req_client=self.client,
            mode="lmcache_driven",
        )
        transfer.register(
            self.kv_caches,
            self.model_name,
            1,
            self.geometry.blocks_per_chunk,
            self.rpc_timeout,
            layout_hints={"kv_layout": "NHD"},
            engine_group_infos=self.group_infos,
        )
        self._transfer = transfer

    def close(self) -> None:
        """Unregister (best effort: the server may be dead in a fault test) and disconnect."""
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            future = transfer.unregister()
            if future is not None:
                with contextlib.suppress(Exception):
                    future.result(timeout=2.0)
            transfer.close()
        self._owned_client.close()

    @property
    def client(self) -> RequestClient:
        """The engine's request client (on its own ZMQ context, ``request_client``)."""
        return self._owned_client.client

    @property
    def transfer(self) -> TransferContext:
        """The registered transfer context."""
        if self._transfer is None:
            raise RuntimeError("HybridEngineClient is not registered")
        return self._transfer

    # -- buffers ---------------------------------------------------------------------------

    def alloc_blocks(self, count: int) -> list[int]:
        """Hand out ``count`` fresh block ids (never the null block, never reused)."""
        if self._next_block + count > self.geometry.num_blocks:
            raise RuntimeError("toy engine out of blocks; raise EngineGeometry.num_blocks")
        ids = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        return ids

    def _caches(self, group: int) -> dict[str, torch.Tensor]:
        return self.attn_caches if group == ATTN_GROUP else self.rec_caches

    @staticmethod
    def _block_view(group: int, tensor: torch.Tensor, block: int) -> torch.Tensor:
        return tensor[:, block] if group == ATTN_GROUP else tensor[block]

    def fill_random(self, group: int, block_ids: Sequence[int]) -> None:
        """Write random values into the given blocks of every layer of ``group``."""
        for tensor in self._caches(group).values():
            for block in block_ids:
                view = self._block_view(group, tensor, block)
                noise = torch.randn(view.shape, generator=self._generator)
                view.copy_(noise.to(view.dtype))

    def read_blocks(self, group: int, block_ids: Sequence[int]) -> bytes:
        """Raw bytes of the given blocks across all layers of ``group`` (for comparisons)."""
        parts = [
            self._block_view(group, tensor, block).contiguous().view(torch.uint8).numpy()
            for tensor in self._caches(group).values()
            for block in block_ids
        ]
        return b"".join(part.tobytes() for part in parts)

    # -- keys ------------------------------------------------------------------------------

    def _key(
        self, token_ids: Sequence[int], start: int, end: int, request_id: str, worker: bool
    ) -> IPCCacheServerKey:
        return IPCCacheServerKey(
            model_name=self.model_name,
            world_size=1,
            worker_id=0 if worker else None,
            token_ids=tuple(token_ids),
            start=start,
            end=end,
            request_id=request_id,
            num_kv_readers=1,
        )

    def chunk_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The server's chunk hashes for ``token_ids`` (blake3 rolling prefix hash)."""
        return self._hasher.compute_chunk_hashes(list(token_ids))

    def object_keys(self, token_ids: Sequence[int], group: int) -> list[ObjectKey]:
        """The ``ObjectKey`` of every full chunk of ``token_ids`` in object group ``group``."""
        key = self._key(token_ids, 0, len(token_ids), "keys", worker=True)
        return ipc_key_to_object_keys(key, self.chunk_hashes(token_ids), [group])[0]

    # -- protocol operations ---------------------------------------------------------------

    def store(
        self,
        token_ids: Sequence[int],
        attn_blocks: Sequence[int],
        rec_blocks: Sequence[int],
        *,
        start: int = 0,
        end: int | None = None,
        request_id: str | None = None,
    ) -> bool:
        """STORE chunks ``[start, end)`` of ``token_ids`` from the given blocks (flat lists,
        ``blocks_per_chunk`` ids per chunk per group, covering exactly that range).

        Returns the server's success flag. The L1 commit completes asynchronously after the
        reply; use :meth:`wait_for_hit` before relying on it.
        """
        end = len(token_ids) if end is None else end
        rid = request_id or f"store-{uuid.uuid4().hex[:8]}"
        future = self.transfer.submit_store(
            rid,
            self._key(token_ids, start, end, rid, worker=True),
            self.kv_caches,
            [list(attn_blocks), list(rec_blocks)],
            self.transfer.create_recorded_event(),
            self.geometry.blocks_per_chunk,
        )
        ok = bool(future.result(timeout=self.rpc_timeout))
        self.end_session(rid)
        return ok

    def lookup(self, token_ids: Sequence[int], request_id: str) -> int:
        """LOOKUP + WAIT_PREFETCH_STATUS: the number of chunks servable as a prefix hit.

        Like vLLM, this read-locks (and, from L2, prefetches into L1) the hit's objects; follow
        it with :meth:`retrieve` or :meth:`free_lookup_locks`, then :meth:`end_session`.
        """
        aligned = len(token_ids) - len(token_ids) % self.geometry.chunk_size
        key = self._key(token_ids, 0, aligned, request_id, worker=False)
        self.client.lookup(key, 1).result(timeout=self.rpc_timeout)
        hits = self.client.wait_prefetch_status(request_id, self.rpc_timeout).result(
            timeout=self.rpc_timeout + 5
        )
        if hits is None:
            raise TimeoutError(f"prefetch for {request_id} not done in {self.rpc_timeout}s")
        return int(hits)

    def retrieve(
        self,
        token_ids: Sequence[int],
        num_chunks: int,
        attn_blocks: Sequence[int],
        rec_blocks: Sequence[int],
        request_id: str,
    ) -> bool:
        """RETRIEVE the first ``num_chunks`` chunks (after a :meth:`lookup` with the same
        ``request_id``) into the given blocks. ``rec_blocks`` must span all chunks too; only
        the last chunk's blocks are written (a recurrent group needs one snapshot)."""
        end = num_chunks * self.geometry.chunk_size
        future = self.transfer.submit_retrieve(
            request_id,
            self._key(token_ids, 0, end, request_id, worker=True),
            self.kv_caches,
            [list(attn_blocks), list(rec_blocks)],
            self.transfer.create_recorded_event(),
            self.geometry.blocks_per_chunk,
        )
        return bool(future.result(timeout=self.rpc_timeout))

    def free_lookup_locks(self, token_ids: Sequence[int], num_chunks: int, request_id: str) -> None:
        """Release the read locks a lookup took on its first ``num_chunks`` chunks."""
        end = num_chunks * self.geometry.chunk_size
        key = self._key(token_ids, 0, end, request_id, worker=False)
        self.client.free_lookup_locks(key, 1).result(timeout=self.rpc_timeout)

    def end_session(self, request_id: str) -> None:
        """END_SESSION: drop the request's server-side session (touches its keys in L1)."""
        self.client.end_session(request_id).result(timeout=self.rpc_timeout)

    # -- convenience -----------------------------------------------------------------------

    def probe(self, token_ids: Sequence[int]) -> int:
        """Hit length in chunks without keeping locks (lookup, then free and end session)."""
        rid = f"probe-{uuid.uuid4().hex[:8]}"
        hits = self.lookup(token_ids, rid)
        if hits:
            self.free_lookup_locks(token_ids, hits, rid)
        self.end_session(rid)
        return hits

    def wait_for_hit(self, token_ids: Sequence[int], chunks: int, timeout: float = 10.0) -> None:
        """Poll :meth:`probe` until ``chunks`` chunks hit: a STORE's L1 commit is async."""
        deadline = time.monotonic() + timeout
        hits = -1
        while time.monotonic() < deadline:
            hits = self.probe(token_ids)
            if hits >= chunks:
                return
            time.sleep(0.05)
        raise TimeoutError(f"expected {chunks} hit chunks, still {hits} after {timeout}s")

    def store_chunks(
        self,
        token_ids: Sequence[int],
        *,
        snapshot_chunks: Sequence[int] | None = None,
        wait: bool = True,
    ) -> StoredPrefix:
        """Fill fresh blocks with random data and STORE every full chunk of ``token_ids``.

        Args:
            token_ids: The prefix; its length should be a multiple of the chunk size.
            snapshot_chunks: Chunks that get a recurrent snapshot (``None``: all). The others
                pass the null block for the recurrent group, so the server stores only their
                attention KV.
            wait: Block until the L1 commit is visible to lookups (see :meth:`wait_for_hit`).
        """
        g = self.geometry
        num_chunks = len(token_ids) // g.chunk_size
        with_snapshot = set(range(num_chunks) if snapshot_chunks is None else snapshot_chunks)
        attn = [tuple(self.alloc_blocks(g.blocks_per_chunk)) for _ in range(num_chunks)]
        rec = [
            tuple(self.alloc_blocks(g.blocks_per_chunk))
            if i in with_snapshot
            else (NULL_BLOCK,) * g.blocks_per_chunk
            for i in range(num_chunks)
        ]
        self.fill_random(ATTN_GROUP, [b for ids in attn for b in ids])
        self.fill_random(REC_GROUP, [b for ids in rec for b in ids if b != NULL_BLOCK])
        flat = [b for ids in attn for b in ids], [b for ids in rec for b in ids]
        end = num_chunks * g.chunk_size
        if not self.store(token_ids, flat[0], flat[1], end=end):
            raise RuntimeError("server reported a failed STORE")
        stored = StoredPrefix(tuple(token_ids[:end]), tuple(attn), tuple(rec))
        if wait and num_chunks:
            expected = max(stored.snapshot_chunks(), default=-1) + 1
            self.wait_for_hit(token_ids[:end], expected)
        return stored

    def lookup_and_retrieve(
        self, token_ids: Sequence[int], request_id: str | None = None
    ) -> RetrievedPrefix:
        """LOOKUP then RETRIEVE the hit into freshly allocated blocks, then END_SESSION."""
        g = self.geometry
        rid = request_id or f"req-{uuid.uuid4().hex[:8]}"
        try:
            hits = self.lookup(token_ids, rid)
            if hits == 0:
                return RetrievedPrefix(hit_chunks=0, ok=True)
            attn = [tuple(self.alloc_blocks(g.blocks_per_chunk)) for _ in range(hits)]
            rec_last = tuple(self.alloc_blocks(g.blocks_per_chunk))
            rec_flat = [NULL_BLOCK] * ((hits - 1) * g.blocks_per_chunk) + list(rec_last)
            ok = self.retrieve(token_ids, hits, [b for ids in attn for b in ids], rec_flat, rid)
            return RetrievedPrefix(
                hit_chunks=hits, ok=ok, attn_blocks=tuple(attn), rec_blocks=rec_last
            )
        finally:
            self.end_session(rid)

    def stored_bytes(self, stored: StoredPrefix, chunks: int) -> tuple[bytes, bytes]:
        """Bytes a hit of ``chunks`` chunks must restore: (attention KV of chunks
        ``[0, chunks)``, recurrent snapshot of chunk ``chunks - 1``). Read them before the
        source blocks are reused or the engine goes away."""
        attn = [b for ids in stored.attn_blocks[:chunks] for b in ids]
        return (
            self.read_blocks(ATTN_GROUP, attn),
            self.read_blocks(REC_GROUP, stored.rec_blocks[chunks - 1]),
        )

    def retrieved_bytes(self, retrieved: RetrievedPrefix) -> tuple[bytes, bytes]:
        """(attention KV, recurrent snapshot) bytes a retrieve wrote into this engine."""
        attn = [b for ids in retrieved.attn_blocks for b in ids]
        return self.read_blocks(ATTN_GROUP, attn), self.read_blocks(REC_GROUP, retrieved.rec_blocks)

    def matches(self, stored: StoredPrefix, retrieved: RetrievedPrefix) -> bool:
        """Whether the retrieved blocks hold exactly the stored bytes: attention KV of chunks
        ``[0, hit)`` and the recurrent snapshot of chunk ``hit - 1``."""
        hit = retrieved.hit_chunks
        if not retrieved.ok or hit == 0 or hit > stored.num_chunks:
            return False
        return self.stored_bytes(stored, hit) == self.retrieved_bytes(retrieved)


@dataclass
class TokenSource:
    """Deterministic random token sequences, distinct per call (tests share servers)."""

    seed: int = 1234
    vocab: int = 50_000
    _gen: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)

    def tokens(self, count: int) -> list[int]:
        """``count`` random token ids."""
        return torch.randint(0, self.vocab, (count,), generator=self._gen).tolist()
