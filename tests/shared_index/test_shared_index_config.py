"""The ``shared_index`` section of the server YAML: validation, defaults, no secret shown."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from lmcache_histate.config import ConfigError, load_config, parse_config, redacted_url

REPO = Path(__file__).resolve().parents[2]
BASE = {"model": "tiny-qwen3-next", "chunk_size": 16, "cpu_gib": 0.05,
        "disk_path": "/tmp/histate-test-disk", "disk_gib": 1}
SECTION = {"url": "redis://127.0.0.1:6379/0", "deployment": "prod-a"}


def test_absent_section_is_one_server() -> None:
    assert parse_config(BASE).shared_index is None


def test_section_defaults_and_round_trip() -> None:
    cfg = parse_config({**BASE, "port": 5600, "shared_index": SECTION})
    si = cfg.shared_index
    assert (si.url, si.deployment, si.op_timeout_s, si.lease_ttl_s) == (
        "redis://127.0.0.1:6379/0", "prod-a", 0.25, 30.0)
    # Default instance name: <host name>-<ZMQ port>, characters outside [A-Za-z0-9._/-] as _.
    assert si.instance == re.sub(r"[^A-Za-z0-9._/-]", "_", f"{socket.gethostname()}-5600")
    assert cfg.with_overrides(cpu_gib=2).shared_index == si


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"deployment": "x"}, "shared_index.url: required: a redis://, rediss:// or unix:// URL"),
        ({**SECTION, "url": "http://h:1"},
         "shared_index.url: the scheme must be one of redis, rediss, unix; got 'http://h:1'"),
        ({**SECTION, "url": "redis://h:99999"}, "shared_index.url: not a valid URL"),
        ({**SECTION, "url": "redis:///0"}, "shared_index.url: names no host"),
        ({**SECTION, "url": "redis://h/zero"}, "shared_index.url: the path must be a database"),
        ({**SECTION, "url": "unix://"}, "shared_index.url: a unix:// URL needs the socket path"),
        ({**SECTION, "deployment": "a b"}, "shared_index.deployment: must be 1-128 characters"),
        ({**SECTION, "op_timeout_s": 0}, "shared_index.op_timeout_s: must be a positive number"),
        ({**SECTION, "lease_ttl_s": "long"}, "shared_index.lease_ttl_s: must be a positive"),
        ({**SECTION, "colour": 1}, "shared_index.colour: unknown key; allowed keys: url,"),
        ({**SECTION, "tls_ca_file": "/etc/hostname"},
         "shared_index.tls_ca_file: only used with a rediss:// (TLS) url"),
        ("redis://h", "shared_index: must be a mapping"),
    ],
)
def test_bad_values_name_the_key(section: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "shared_index": section})
    assert message in str(err.value)


def test_a_password_in_the_url_is_refused_without_echoing_it() -> None:
    url = "rediss://alice:Tr0ub4dor-and-3@redis.internal:6380/0"
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, "shared_index": {**SECTION, "url": url}})
    text = str(err.value)
    assert "shared_index.url: must not hold a password" in text
    assert "'rediss://alice:***@redis.internal:6380/0'" in text
    assert "Tr0ub4dor" not in text
    assert redacted_url("redis://h:1/0") == "redis://h:1/0"


def test_password_file_must_be_private(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text("pw\n")
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match=r"shared_index.password_file: .* chmod 600"):
        parse_config({**BASE, "shared_index": {**SECTION, "password_file": str(secret)}})
    secret.chmod(0o600)
    cfg = parse_config({**BASE, "shared_index": {**SECTION, "password_file": str(secret)}})
    assert cfg.shared_index.password_file == str(secret)


@pytest.mark.parametrize("name", ["shared-index-a.yaml", "shared-index-b.yaml"])
def test_two_instance_examples_load(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    assert cfg.shared_index.deployment == "example"
    assert cfg.shared_index.instance == f"server-{name[-6]}"
    assert cfg.disk_path == "/var/tmp/histate-shared-disk"
