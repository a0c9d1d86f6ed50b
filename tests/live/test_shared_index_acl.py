"""A Redis right revoked under a running HiState server, then given back (real
``redis-server`` with ACL users, real server through the launcher).

The index's user has exactly the documented rights (docs/deployment.md, Security). An
admin revokes ``EVALSHA``, ``EVAL`` and ``SCRIPT LOAD`` mid-run: the server goes
``degraded`` on the first call that meets the refusal (no timeout to wait), keeps serving
its own files from its local view, logs the change once and no traceback; when the
rights return it is ``connected`` again within its probe backoff (retry_s 0.2 s, at most
8 × 0.2 s between probes) and the index answers again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from support.lmcache_mp import ATTN_GROUP, HybridEngineClient, TokenSource
from support.redis_server import RedisServer
from test_backend_server import CHUNK, GEOMETRY, KV, SNAP, cpu_fill_for, histate, on_disk
from test_bad_config_matrix import RIGHTS
from test_shared_index_servers import section, shared, store_demoted, tokens  # noqa: F401

pytestmark = pytest.mark.timeout(300)

PASSWORD = "acl-test-password-0123456"
ADMIN = "acl-admin-password-0123456"


def secret(path: Path, text: str) -> str:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return str(path)


def test_revoked_script_rights_degrade_serve_own_files_and_recover(
    tmp_path: Path, tokens: TokenSource  # noqa: F811
) -> None:
    server = RedisServer(tmp_path / "redis", config="\n".join([
        f"user histate on >{PASSWORD} {RIGHTS}", f"user admin on >{ADMIN} ~* &* +@all",
        "user default off", ""]))
    server.start()
    admin = redis.Redis(port=server.port, username="admin", password=ADMIN)
    disk = tmp_path / "disk"
    index: dict[str, Any] = {**section(f"redis://histate@127.0.0.1:{server.port}/0", "a"),
                             "password_file": secret(tmp_path / "pw", PASSWORD)}
    p, q = tokens.tokens(4 * CHUNK), tokens.tokens(4 * CHUNK)
    try:
        with (histate(tmp_path / "a", disk, shared_index=index,
                      cpu_fill=cpu_fill_for(4 * KV + SNAP + 3 * KV)) as a,
              HybridEngineClient(a.endpoints.zmq_url, GEOMETRY) as engine):
            expected = store_demoted(a, engine, p, q)
            assert on_disk(disk, engine, p, ATTN_GROUP) == [0, 1, 2, 3]
            assert shared(a)["mode"] == "connected"
            log_before = a.log_path.read_text(errors="replace")

            admin.execute_command("ACL", "SETUSER", "histate", "-evalsha", "-eval",
                                  "-script|load")
            admin.script_flush()  # the index's scripts must be loaded again: refused
            t0 = time.monotonic()
            got = engine.lookup_and_retrieve(p)
            assert got.hit_chunks == 4 and engine.retrieved_bytes(got) == expected
            assert shared(a)["mode"] == "degraded"
            assert time.monotonic() - t0 < 0.3 + 2.0  # op_timeout_s + the call itself
            for _ in range(20):  # still its own files, no call to Redis
                assert engine.lookup_and_retrieve(p).hit_chunks == 4
            counters = shared(a)["connection"]
            assert counters["outages"] == 1 and counters["skipped"] >= 20

            admin.execute_command("ACL", "SETUSER", "histate", "+evalsha", "+eval",
                                  "+script|load")
            deadline = time.monotonic() + 15
            while shared(a)["mode"] != "connected" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert shared(a)["mode"] == "connected"
            got = engine.lookup_and_retrieve(p)
            assert got.hit_chunks == 4 and engine.retrieved_bytes(got) == expected
            assert shared(a)["connection"]["outages"] == 1
            added = a.log_path.read_text(errors="replace")[len(log_before):]
        lines = [x for x in added.splitlines() if "shared index" in x]
        assert "Traceback" not in added, added
        assert len(lines) == 2, lines
        assert "permission denied" in lines[0] and "usable again" in lines[1], lines
    finally:
        admin.close()
        server.stop()
