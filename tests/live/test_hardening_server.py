"""Hardening against a real ``histate-server``: the shared secret on the control plane,
bounded RPC arguments, crafted model names, and server memory across engine reconnects.

Servers are started by the launcher through the MP harness, as in ``test_backend_server``
(whose helpers are reused); clients are LMCache's own client classes.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest
from lmcache_histate.backends.server.disk import file_format as df
from support.lmcache_mp import REC_GROUP, HybridEngineClient, LMCacheServer, TokenSource
from support.request_client import request_client
from test_backend_server import CHUNK, GEOMETRY, histate, on_disk, settle, tokens

__all__ = ["tokens"]  # the fixture, re-exported for pytest

pytestmark = pytest.mark.timeout(240)

SECRET = "hardening-test-secret-0123456789"
MAX_TOKENS = 1 << 20  # max_model_tokens (the default)


def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


def raw_http(
    server: LMCacheServer, method: str, path: str, token: str | None = None, body: Any = None
) -> int:
    """HTTP status code of one call (no exception for 4xx)."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.endpoints.http_url + path, data=data, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def rpc(server: LMCacheServer, method: str, payload: bytes) -> tuple[bool, str, float]:
    """(success, payload or error, seconds) of one ``server_module_call``."""
    with request_client(server.endpoints.zmq_url) as client:
        t0 = time.monotonic()
        request = ServerModuleCallRequest(method=method, payload=payload)
        response = client.server_module_call(request).result(timeout=20)
        seconds = time.monotonic() - t0
    text = response.payload.decode() if response.success else response.error
    return bool(response.success), text, seconds


def with_token(**values: Any) -> bytes:
    return json.dumps({**values, "token": SECRET}).encode()


def test_secret_guards_http_routes_and_rpcs(tmp_path: Path, tokens: TokenSource) -> None:
    """With auth_token_file: every HTTP route but /healthcheck answers 401 without the
    bearer secret (clear, delete, config, env, status, metrics), HiState's RPCs refuse a
    payload without it; with it all work, and the engine protocol is unaffected."""
    secret_file = str(token_file(tmp_path))
    with histate(tmp_path / "srv", tmp_path / "disk", auth_token_file=secret_file) as server:
        guarded = [("POST", "/cache/clear", {"tier": "l1"}), ("DELETE", "/cache/objects", None),
                   ("GET", "/config", None), ("GET", "/env", None), ("GET", "/status", None),
                   ("GET", "/metrics", None), ("POST", "/run_script", None)]
        for method, path, body in guarded:
            assert raw_http(server, method, path, body=body) == 401, path
            assert raw_http(server, method, path, "wrong-" + SECRET, body) == 401, path
        assert raw_http(server, "GET", "/healthcheck") == 200
        assert raw_http(server, "GET", "/status", SECRET) == 200
        assert raw_http(server, "POST", "/cache/clear", SECRET, {"tier": "l1"}) == 200

        ok, error, _ = rpc(server, "histate.status", b"{}")
        assert not ok and "missing or wrong token" in error
        ok, error, _ = rpc(server, "histate.plan", json.dumps({"input_tokens": 64}).encode())
        assert not ok and "missing or wrong token" in error
        ok, text, _ = rpc(server, "histate.status", with_token())
        assert ok and json.loads(text)["active"] is True

        with HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine:
            p = tokens.tokens(4 * CHUNK)
            sp = engine.store_chunks(p, snapshot_chunks=[3])
            got = engine.lookup_and_retrieve(p)
            assert got.hit_chunks == 4 and engine.matches(sp, got)


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (with_token(input_tokens=10**10), "input_tokens must be an integer in [0, 1048576]"),
        (with_token(input_tokens=-1), "input_tokens must be an integer in [0, 1048576]"),
        (with_token(input_tokens=True), "input_tokens must be an integer"),
        (with_token(input_tokens="64"), "input_tokens must be an integer"),
        (with_token(start_tokens=64, input_tokens=32), "start_tokens 64 is after input_tokens 32"),
        (with_token(), "input_tokens is missing"),
        (b"[1, 2]", "payload must be a JSON object"),
        (b"\xff not json", "payload is not JSON"),
        (b"{" + b" " * 5000 + b"}", "payload of 5002 bytes (at most 4096)"),
        (with_token(input_tokens=64, step_tokens=CHUNK + 1),
         f"step_tokens must be a positive multiple of the chunk size {CHUNK}"),
        (with_token(input_tokens=64, step_tokens=0), "step_tokens must be a positive multiple"),
        (with_token(input_tokens=64, step_tokens=2 * MAX_TOKENS),
         f"up to {MAX_TOKENS}, got {2 * MAX_TOKENS}"),
        (with_token(input_tokens=64, step_price=-1.0),
         "step_price must be a finite number >= 0 (tokens of prefill per step end), got -1.0"),
        (with_token(input_tokens=64, step_price="25"), "step_price must be a finite number"),
    ],
    ids=["huge", "negative", "bool", "string", "reversed", "missing", "list", "garbage", "big",
         "step-off-grid", "step-zero", "step-huge", "price-negative", "price-string"],
)
def test_plan_rpc_rejects_bad_arguments_at_once(
    tmp_path: Path, plan_server: LMCacheServer, payload: bytes, error: str
) -> None:
    ok, text, seconds = rpc(plan_server, "histate.plan", payload)
    assert not ok and error in text
    assert seconds < 2


def test_plan_rpc_at_the_bound_is_small_and_quick(plan_server: LMCacheServer) -> None:
    """The largest valid request (max_model_tokens) answers at most one position per chunk
    (65,536 here) in well under a second; a probe's 10^10 took 3.8 s and 116 MB."""
    ok, text, seconds = rpc(plan_server, "histate.plan", with_token(input_tokens=MAX_TOKENS))
    assert ok, text
    boundaries = json.loads(text)["boundaries"]
    assert boundaries[-1] == MAX_TOKENS and len(boundaries) <= MAX_TOKENS // CHUNK
    assert len(text) < 2 * 1024 * 1024
    assert seconds < 2


@pytest.fixture(scope="module")
def plan_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One guarded server for the RPC-argument cases (its core exists once an engine
    registered and stored)."""
    tmp = tmp_path_factory.mktemp("plan")
    with (
        histate(tmp / "srv", tmp / "disk", auth_token_file=str(token_file(tmp))) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        engine.store_chunks(TokenSource(seed=7).tokens(2 * CHUNK), snapshot_chunks=[1])
        yield server


CRAFTED = "org/odd\0name\n../" + "é" * 40 + "m" * 300


def test_crafted_model_names_are_persisted_and_served(tmp_path: Path, tokens: TokenSource) -> None:
    """A model name with a NUL byte, separators and 400 bytes: its snapshots reach the disk
    under bounded names inside the tier's folder, and a hit on them is byte-exact."""
    disk = tmp_path / "disk"
    with (
        histate(tmp_path / "srv", disk) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY, model_name=CRAFTED) as engine,
    ):
        p = tokens.tokens(4 * CHUNK)
        sp = engine.store_chunks(p, snapshot_chunks=[1, 3])
        status = settle(server)
        assert on_disk(disk, engine, p, REC_GROUP) == [1, 3]
        assert not [k for k in status["disk"]["stats"] if k.startswith("not_persisted")]
        files = [f for f in disk.rglob("*" + df.SUFFIX)]
        assert len(files) == 2
        assert all(f.parent.parent == disk and len(f.name) < 200 for f in files)
        got = engine.lookup_and_retrieve(p[: 2 * CHUNK])  # the chunk-1 snapshot: disk only
        assert got.hit_chunks == 2 and engine.matches(sp, got)


def shm_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/dev/shm/" in line)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


RECONNECTS = 24


def test_engine_reconnects_do_not_grow_server_mappings(tmp_path: Path, tokens: TokenSource) -> None:
    """Each engine registers 4 KV tensors (2 attention, 2 recurrent layers), stores, and
    unregisters. lmcache 0.5.6 alone keeps 4 mappings + 4 fds per engine forever; with the
    workaround (upstream.install_shm_release) the server's counts return to their level before the
    engines came."""
    with histate(tmp_path / "srv", tmp_path / "disk") as server:
        pid = server.pid

        def one_engine() -> None:
            with HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine:
                engine.store_chunks(tokens.tokens(CHUNK), snapshot_chunks=[0])

        one_engine()  # first use: the core, L1 pages, threads
        base_maps, base_fds = shm_mappings(pid), open_fds(pid)
        for _ in range(RECONNECTS):
            one_engine()
        deadline = time.monotonic() + 10
        while shm_mappings(pid) > base_maps and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shm_mappings(pid) <= base_maps  # without the fix: + 4 x RECONNECTS
        assert open_fds(pid) <= base_fds + 2


def test_requests_longer_than_the_model_allows_skip_histate(
    tmp_path: Path, tokens: TokenSource
) -> None:
    """A STORE / LOOKUP longer than max_model_tokens is served by LMCache without the
    HiState hooks (their chain work under the runtime lock is per chunk): counted, never
    wrong bytes; requests within the bound keep working."""
    with (
        histate(tmp_path / "srv", tmp_path / "disk", max_model_tokens=4 * CHUNK) as server,
        HybridEngineClient(server.endpoints.zmq_url, GEOMETRY) as engine,
    ):
        long = tokens.tokens(8 * CHUNK)
        sp = engine.store_chunks(long, snapshot_chunks=[7], wait=False)
        got = engine.lookup_and_retrieve(long)
        assert got.hit_chunks == 0 or engine.matches(sp, got)
        counters = settle(server)["counters"]
        assert counters["over_max_model_tokens.store"] == 1
        assert counters["over_max_model_tokens.lookup"] >= 1
        short = tokens.tokens(4 * CHUNK)
        sq = engine.store_chunks(short, snapshot_chunks=[3])
        got = engine.lookup_and_retrieve(short)
        assert got.hit_chunks == 4 and engine.matches(sq, got)
