"""An ACL user with a password: it authenticates, and the password is never shown."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from lmcache_histate.backends.server.shared_index import open_index
from lmcache_histate.backends.server.shared_index.connection import Unavailable
from support.redis_server import RedisServer, self_signed

from lmcache_histate.config import parse_config

PASSWORD = "Corr3ct-Horse-Battery"
BASE = {"model": "tiny-qwen3-next", "chunk_size": 16, "cpu_gib": 0.05,
        "disk_path": "/tmp/histate-test-disk", "disk_gib": 1}


def _secret(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def test_acl_user_authenticates_and_the_password_never_shows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    server = RedisServer(tmp_path / "redis",
                         config=f"user alice on >{PASSWORD} ~* &* +@all\nuser default off\n")
    server.start()
    seen: list[str] = []
    try:
        section = {"url": f"redis://alice@127.0.0.1:{server.port}/0", "deployment": "d",
                   "instance": "A", "password_file": str(_secret(tmp_path, "pw", PASSWORD)),
                   "op_timeout_s": 0.3, "connect_timeout_s": 0.3, "retry_s": 0.01}
        cfg = parse_config({**BASE, "shared_index": section})
        seen += [repr(cfg), repr(cfg.shared_index), yaml.safe_dump(cfg.to_dict())]
        index = open_index(cfg.shared_index, "tiny-qwen3-next")
        index.join(cfg.disk_bytes)  # authenticated as alice
        assert index.usage() == (0, cfg.disk_bytes, 0)

        wrong = {**section, "password_file": str(_secret(tmp_path, "bad", "not-the-password"))}
        bad = open_index(parse_config({**BASE, "shared_index": wrong}).shared_index, "m")
        with pytest.raises(Unavailable, match="refused the credentials") as err:
            bad.join(1)
        seen.append(str(err.value))

        server.kill()  # degraded: logged with the URL
        assert index.usage() is None
        assert index.conn.degraded
    finally:
        server.stop()
    seen += [r.getMessage() for r in caplog.records]
    out = capsys.readouterr()
    seen += [out.out, out.err]
    assert any("redis://alice@127.0.0.1" in line for line in seen)  # the logs name the URL
    assert not [line for line in seen if PASSWORD in line]


def test_rediss_verifies_the_server_against_tls_ca_file(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "server")
    other, _ = self_signed(tmp_path, "other")  # a CA that did not sign the server's cert
    server = RedisServer(tmp_path / "redis", tls=(cert, key))
    server.start()
    try:
        section = {"url": server.tls_url, "deployment": "d", "instance": "A",
                   "tls_ca_file": str(cert), "connect_timeout_s": 2.0, "op_timeout_s": 2.0}
        cfg = parse_config({**BASE, "shared_index": section})
        assert cfg.shared_index.tls
        index = open_index(cfg.shared_index, "tiny-qwen3-next")
        index.join(cfg.disk_bytes)  # over TLS, the server's certificate verified
        assert index.usage() == (0, cfg.disk_bytes, 0)

        untrusted = parse_config({**BASE, "shared_index": {**section, "tls_ca_file": str(other)}})
        with pytest.raises(Unavailable, match=r"TLS: the server's certificate is not trusted by "
                           r"shared_index\.tls_ca_file"):
            open_index(untrusted.shared_index, "tiny-qwen3-next").join(cfg.disk_bytes)
    finally:
        server.stop()
