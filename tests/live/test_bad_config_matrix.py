"""The bad-configuration matrix: every case is a real ``histate-server --config bad.yaml``
start and must end with exit status 2 and exactly one line on stderr naming the problem,
never a traceback.

Start-up faults (memory, disk, ports, Redis) need a real start; schema errors stop at load
either way, so no case uses ``--dry-run``. The Redis cases run against one real
``redis-server`` with ACL users (``USERS``); nothing is mocked. Expected lines are written
by hand from the configuration each case builds.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lmcache_histate.backends.demo.servers import free_port, free_ports
from support.redis_server import RedisServer, self_signed

LAUNCHER = "lmcache_histate.backends.server.launcher"
PASSWORD = "matrix-redis-password-0123"
RIGHTS = ("~histate:* -@all +ping +evalsha +script|load +script|exists +get +set +setnx "
          "+mget +incrby +decrby +del +time +scan +hget +hmget +hset +hincrby +hdel +hgetall "
          "+zadd +zrem +zcard +zcount +zrange +zrangebyscore +zremrangebyscore")
"""The rights docs/deployment.md (Security) documents for the index's user."""
USERS = {
    "histate": RIGHTS,
    "nohset": RIGHTS + " -hset",
    "nozadd": RIGHTS + " -zadd -zrem",
    "nokeys": RIGHTS.replace("~histate:*", "~other:*"),
    "noeval": RIGHTS + " -evalsha",
    "noload": RIGHTS + " -script|load",
    "noping": RIGHTS + " -ping",
    "noexists": RIGHTS + " -script|exists",
}
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def redis_acl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    lines = [f"user {name} on >{PASSWORD} {rights}" for name, rights in USERS.items()]
    folder = tmp_path_factory.mktemp("redis")
    self_signed(folder, "other")  # a CA that signed nothing of this server
    server = RedisServer(folder, config="\n".join([*lines, "user default off", ""]),
                         tls=self_signed(folder, "server"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def secret(tmp: Path, name: str, text: str, mode: int = 0o600) -> str:
    path = tmp / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def index(url: str, tmp: Path, password: str | None = PASSWORD) -> dict[str, Any]:
    section: dict[str, Any] = {"url": url, "deployment": "d", "instance": "a",
                               "connect_timeout_s": 0.5, "op_timeout_s": 0.5}
    if password is not None:
        section["password_file"] = secret(tmp, "redis-pw", password)
    return {"shared_index": section}


Case = Callable[[Path, RedisServer], dict[str, Any]]
SHARED = ["x", "x"]
"""One list used three times: ``yaml.safe_dump`` writes it once and aliases it after."""
R = "redis://{user}@127.0.0.1:{port}/0"


def user(name: str, password: str | None = PASSWORD) -> Case:
    return lambda t, r: index(R.format(user=name, port=r.port), t, password)


def denied(name: str, what: str) -> tuple[str, Case, str]:
    """A case of user ``name`` lacking a right: the line says it may not ``what``."""
    return (f"redis-{name}", user(name),
            f"shared_index: Redis at redis://{name}@127.0.0.1:{{redis}}/0: user may not {what}")


CASES: list[tuple[str, Case, str]] = [
    # ---- schema (load)
    ("cpu-not-a-number", lambda t, r: {"cpu_gib": "abc"},
     "cpu_gib: must be a positive number, got 'abc'"),
    ("cpu-negative", lambda t, r: {"cpu_gib": -1}, "cpu_gib: must be a positive number, got -1"),
    ("cpu-zero", lambda t, r: {"cpu_gib": 0}, "cpu_gib: must be a positive number, got 0"),
    ("disk-nan", lambda t, r: {"disk_gib": float("nan")},
     "disk_gib: must be a positive number, got nan"),
    ("chunk-zero", lambda t, r: {"chunk_size": 0},
     "chunk_size: must be a positive integer, got 0"),
    ("chunk-text", lambda t, r: {"chunk_size": "big"},
     "chunk_size: must be a positive integer, got 'big'"),
    ("model-missing", lambda t, r: {"model": None}, "model: required key is missing"),
    ("unknown-key", lambda t, r: {"cpu_gb": 1}, "cpu_gb: unknown key; allowed keys: model,"),
    ("policy", lambda t, r: {"policy": "fifo"},
     "policy: must be one of histate, lru; got 'fifo'"),
    ("platform", lambda t, r: {"platform": "tpu"},
     "platform: must be one of auto, cpu, cuda; got 'tpu'"),
    ("port-range", lambda t, r: {"port": 70000},
     "port: must be a TCP port (an integer in 1..65535), got 70000"),
    ("port-text", lambda t, r: {"port": "x"},
     "port: must be a TCP port (an integer in 1..65535), got 'x'"),
    ("same-ports", lambda t, r: {"port": 7001, "http_port": 7001},
     "http_port: must differ from port"),
    ("host-any", lambda t, r: {"host": "0.0.0.0"}, "host: '0.0.0.0' is not a loopback address"),
    ("http-host-lan", lambda t, r: {"http_host": "10.1.2.3"},
     "http_host: '10.1.2.3' is not a loopback address"),
    ("remote-without-token", lambda t, r: {"allow_remote": True},
     "auth_token_file: required when allow_remote is true"),
    ("token-world-readable",
     lambda t, r: {"auth_token_file": secret(t, "tok", "x" * 32, 0o644)},
     "auth_token_file: '{t}/tok' is readable by other users (mode 644); chmod 600 it"),
    ("token-short", lambda t, r: {"auth_token_file": secret(t, "tok", "short")},
     "auth_token_file: the secret in '{t}/tok' must be at least 16 characters"),
    ("token-missing", lambda t, r: {"auth_token_file": str(t / "nope")},
     "auth_token_file: cannot read '{t}/nope'"),
    ("workers-huge", lambda t, r: {"disk_io_workers": 100000},
     "disk_io_workers: must be at most 64 (threads of one disk tier), got 100000"),
    ("workers-zero", lambda t, r: {"disk_io_workers": 0},
     "disk_io_workers: must be a positive integer, got 0"),
    ("cpu-fill", lambda t, r: {"cpu_fill": 1.5}, "cpu_fill: must be a number in (0, 1], got 1.5"),
    ("tau-negative", lambda t, r: {"tau": -1}, "tau: must be 'auto' or a number ≥ 0"),
    ("intervals-off-chunk", lambda t, r: {"supported_intervals": [17]},
     "supported_intervals: every entry must be a multiple of chunk_size (16)"),
    ("watermark", lambda t, r: {"l1_eviction_watermark": 2},
     "l1_eviction_watermark: must be a number in [0.1, 1.0], got 2"),
    ("fsync-text", lambda t, r: {"disk_fsync": "yes"},
     "disk_fsync: must be true or false, got 'yes'"),
    ("extra-not-list", lambda t, r: {"extra_server_args": "--foo"},
     "extra_server_args: must be a list of strings"),
    ("extra-http-host", lambda t, r: {"extra_server_args": ["--http-host", "0.0.0.0"]},
     "extra_server_args: --http-host is set by the YAML key http_host; use that key"),
    ("extra-run-script", lambda t, r: {"extra_server_args": ["--run-script-api-enabled"]},
     "extra_server_args: --run-script-api-enabled opens /run_script"),
    ("extra-server-module", lambda t, r: {"extra_server_args": ["--server-module", "{}"]},
     "extra_server_args: --server-module imports a Python module into the server"),
    ("extra-abbreviated", lambda t, r: {"extra_server_args": ["--ho", "0.0.0.0"]},
     "extra_server_args: '--ho' abbreviates --host"),
    ("extra-unknown-flag", lambda t, r: {"extra_server_args": ["--no-such-flag"]},
     "extra_server_args: unrecognized arguments: --no-such-flag"),
    ("extra-bad-value", lambda t, r: {"extra_server_args": ["--max-cpu-workers", "many"]},
     "extra_server_args: argument --max-cpu-workers: invalid int value: 'many'"),
    ("chunk-huge", lambda t, r: {"chunk_size": 10**12},
     "chunk_size: must be at most max_model_tokens (1048576)"),
    ("max-tokens-huge", lambda t, r: {"max_model_tokens": 10**9},
     "max_model_tokens: must be at most 1.67772e+07 (16 times the default"),
    ("host-ipv6", lambda t, r: {"host": "::1"},
     "host: '::1' is an IPv6 address; LMCache binds its ZMQ port over IPv4 only"),
    ("yaml-aliases", lambda t, r: {"cpu_gib": [SHARED, SHARED, SHARED]},
     "YAML aliases (*id001) are not accepted in a configuration; write the value out"),
    ("redis-url-password", lambda t, r: {"shared_index": {
        "url": "redis://u:hunter2hunter2@127.0.0.1:1/0", "deployment": "d", "instance": "a"}},
     "shared_index.url: must not hold a password"),
    ("redis-url-scheme", lambda t, r: {"shared_index": {
        "url": "http://127.0.0.1:1/0", "deployment": "d", "instance": "a"}},
     "shared_index.url: the scheme must be one of redis, rediss, unix; got 'http://127.0.0.1:1/0'"),
    # ---- start-up faults (preflight, a real start)
    ("cpu-beyond-ram", lambda t, r: {"cpu_gib": 100000},
     "cpu_gib: 100000 GiB is more than the memory this server may use"),
    ("disk-beyond-fs", lambda t, r: {"disk_gib": 10**6},
     "disk_gib: 1e+06 GiB is more than the filesystem of disk_path can hold"),
    ("disk-under-file", lambda t, r: {"disk_path": str(t / "file" / "disk")},
     "disk_path: '{t}/file/disk' is under a file ('{t}/file' is not a folder)"),
    ("disk-in-proc", lambda t, r: {"disk_path": "/proc/histate-disk"},
     "disk_path: '/proc/histate-disk' is on the kernel's virtual filesystem /proc"),
    ("port-in-use", lambda t, r: {"port": r.port}, "port: {redis} on 127.0.0.1 is in use"),
    ("redis-unreachable", lambda t, r: index(f"redis://127.0.0.1:{free_port()}/0", t, None),
     "shared_index: Redis at redis://127.0.0.1:"),
    ("redis-missing-password", lambda t, r: index(f"redis://127.0.0.1:{r.port}/0", t, None),
     "shared_index: Redis at redis://127.0.0.1:{redis}/0 refused the credentials"),
    ("redis-wrong-password", user("histate", "not-the-password-at-all"),
     "shared_index: Redis at redis://histate@127.0.0.1:{redis}/0 refused the credentials"),
    ("redis-unknown-user", user("ghost"),
     "shared_index: Redis at redis://ghost@127.0.0.1:{redis}/0 refused the credentials"),
    denied("nohset", "run HSET "),
    denied("nozadd", "run ZADD, ZREM "),
    denied("nokeys", "use keys histate:{{d:tiny-qwen3-next}}:* "),
    denied("noeval", "run EVALSHA"),
    denied("noload", "run SCRIPT LOAD"),
    denied("noexists", "run SCRIPT EXISTS"),
    ("redis-no-ping", user("noping"),
     "shared_index: Redis at redis://noping@127.0.0.1:{redis}/0 refused PING"),
    ("redis-tls-to-plain-port",
     lambda t, r: index(f"rediss://histate@127.0.0.1:{r.port}/0", t),
     "; TLS handshake failed: is the url's port Redis's TLS port (tls-port)?"),
    ("redis-plain-to-tls-port",
     lambda t, r: index(f"redis://histate@127.0.0.1:{r.tls_port}/0", t),
     "; the server reset the connection: if its port speaks TLS, use rediss://"),
    ("redis-tls-wrong-ca", lambda t, r: {"shared_index": {
        **index(f"rediss://histate@127.0.0.1:{r.tls_port}/0", t)["shared_index"],
        "tls_ca_file": str(r.workdir / "other.pem")}},
     "; TLS: the server's certificate is not trusted by shared_index.tls_ca_file "
     "'{redis_dir}/other.pem'"),
]
CLI_CASES: list[tuple[str, list[str], str]] = [
    ("cli-abbreviated-host", ["--ho", "0.0.0.0"], "command line: '--ho' abbreviates --host"),
    ("cli-run-script", ["--run-script-api-enabled"],
     "command line: --run-script-api-enabled opens /run_script"),
    ("cli-bad-port", ["--port", "x"], "--port (overrides port): not a valid int: 'x'"),
]


def run(tmp: Path, values: dict[str, Any], argv: list[str] = ()) -> tuple[int, str, str]:
    """Exit status, stderr and stdout of ``histate-server --config bad.yaml ARGV``."""
    (tmp / "file").write_text("x")
    port, http_port = free_ports(2)
    cfg = {"model": "tiny-qwen3-next", "chunk_size": 16, "cpu_gib": 0.05,
           "disk_path": str(tmp / "disk"), "disk_gib": 0.01, "platform": "cpu",
           "port": port, "http_port": http_port}
    cfg.update(values)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = tmp / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", LAUNCHER, "--config", str(path), *argv],
                            capture_output=True, text=True, timeout=120, check=False)
    return result.returncode, result.stderr, result.stdout


def only_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize(("make", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_is_one_line(
    tmp_path: Path, redis_acl: RedisServer, make: Case, expected: str
) -> None:
    status, stderr, stdout = run(tmp_path, make(tmp_path, redis_acl))
    line = only_line(stderr)
    assert status == 2, stderr
    # Nothing before the error: no lmcache command line or vLLM flags for a server that
    # does not start (a too-large cpu_gib was found only after printing them).
    assert stdout == "", stdout
    assert expected.format(t=tmp_path, redis=redis_acl.port,
                           redis_dir=redis_acl.workdir) in line, line
    assert PASSWORD not in stderr


@pytest.mark.parametrize(("argv", "expected"), [c[1:] for c in CLI_CASES],
                         ids=[c[0] for c in CLI_CASES])
def test_bad_command_line_is_one_line(tmp_path: Path, argv: list[str], expected: str) -> None:
    status, stderr, stdout = run(tmp_path, {}, argv)
    assert status == 2 and expected in only_line(stderr), stderr
    assert stdout == "", stdout


def test_documented_rights_pass_the_start_up_check(
    tmp_path: Path, redis_acl: RedisServer
) -> None:
    """The user with exactly the documented rights passes the Redis start-up check."""
    from lmcache_histate.backends.server import preflight

    from lmcache_histate.config import parse_config

    base = {"model": "tiny-qwen3-next", "chunk_size": 16, "cpu_gib": 0.05,
            "disk_path": str(tmp_path / "disk"), "disk_gib": 0.01,
            **user("histate")(tmp_path, redis_acl)}
    preflight.check_shared_index(parse_config(base))  # no error
