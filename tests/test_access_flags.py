"""The flag screens and the bind decision of ``backends/server/access_flags``.

Expected values are written out by hand from LMCache 0.5.6's flag names
(``lmcache/v1/multiprocess/config.py``); the last test checks those names against
LMCache's own parser, and that its parser does resolve abbreviations (why they are refused).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lmcache_histate.backends.server.access_flags import (
    CODE_FLAGS,
    NEVER,
    YAML_FLAGS,
    confirm_with_lmcache,
    decide_bindings,
    screen_command_line,
    screen_extra_server_args,
)

from lmcache_histate.config import ConfigError


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (["--http-host", "0.0.0.0"],
         "extra_server_args: --http-host is set by the YAML key http_host; use that key"),
        (["--host=0.0.0.0"], "extra_server_args: --host is set by the YAML key host"),
        (["--port", "9"], "extra_server_args: --port is set by the YAML key port; use that key"),
        (["--l1-size-gb", "9"], "extra_server_args: --l1-size-gb is set by the YAML key cpu_gib"),
        (["--run-script-api-enabled"],
         "extra_server_args: --run-script-api-enabled opens /run_script"),
        (["--run-script"], "extra_server_args: '--run-script' abbreviates "
                           "--run-script-api-enabled; spell lmcache server flags in full"),
        (["--ho", "0.0.0.0"], "extra_server_args: '--ho' abbreviates --host"),
        (["--server-module", "{}"],
         "extra_server_args: --server-module imports a Python module into the server"),
        (["--l2-adapter", "{}"], "extra_server_args: --l2-adapter imports an L2 adapter"),
        (["--runtime-plugin-locations", "/tmp/p.py"],
         "extra_server_args: --runtime-plugin-locations runs plugin scripts"),
        (["--p2p-listen-url", "0.0.0.0:1"], "extra_server_args: --p2p-listen-url opens"),
        (["--", "--host"], "extra_server_args: '--' abbreviates"),
    ],
)
def test_extra_server_args_refuses_with_one_line(tokens: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        screen_extra_server_args(tokens)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_extra_server_args_keeps_harmless_flags() -> None:
    screen_extra_server_args(["--max-workers", "2", "--no-run-script-api-enabled",
                              "--l1-use-lazy", "--hash-algorithm", "blake3"])


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (["--ho", "0.0.0.0", "--http-ho", "0.0.0.0"], "command line: '--ho' abbreviates --host"),
        (["--http-ho", "0.0.0.0"], "command line: '--http-ho' abbreviates --http-host"),
        (["--h", "0.0.0.0"], "command line: '--h' abbreviates --host, --http-host, --http-port"),
        (["--run-script-api-enabled"], "command line: --run-script-api-enabled opens /run_script"),
        (["--p2p-advertise-url=1.2.3.4:5"], "command line: --p2p-advertise-url opens"),
    ],
)
def test_command_line_refuses_abbreviations_and_never_flags(
    tokens: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        screen_command_line(tokens)
    assert str(err.value).startswith(message)


def test_command_line_may_load_modules_and_override_keys() -> None:
    screen_command_line(["--server-module", "{}", "--host", "127.0.0.1", "--port", "7"])


def test_the_last_address_decides_and_needs_remote_and_token() -> None:
    argv = ["server", "--host", "127.0.0.1", "--http-host", "::1", "--host=0.0.0.0"]
    with pytest.raises(ConfigError, match=r"^host: '0.0.0.0' is not a loopback address"):
        decide_bindings(argv, allow_remote=False, auth_token_file=None)
    with pytest.raises(ConfigError, match=r"^host: '0.0.0.0'"):
        decide_bindings(argv, allow_remote=True, auth_token_file=None)
    assert decide_bindings(argv, allow_remote=True, auth_token_file="/t") == {
        "host": "0.0.0.0", "http_host": "::1"}
    assert decide_bindings(["server", "--host", "localhost"], allow_remote=False,
                           auth_token_file=None) == {"host": "localhost"}


def test_never_flags_are_refused_even_with_remote_and_token() -> None:
    refused = r"^lmcache server flags: --run-script-api-enabled opens /run_script"
    with pytest.raises(ConfigError, match=refused):
        decide_bindings(["server", "--run-script-api-enabled"], allow_remote=True,
                        auth_token_file="/t")


def test_lmcache_parser_knows_every_flag_and_resolves_abbreviations() -> None:
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser()  # allow_abbrev=True, as ``lmcache server`` builds it
    ServerCommand().add_arguments(parser)
    known = set(parser._option_string_actions)
    assert set(YAML_FLAGS) | set(CODE_FLAGS) | set(NEVER) <= known
    # Why abbreviations are refused: LMCache's own parser binds 0.0.0.0 for these.
    args = parser.parse_args(["--ho", "0.0.0.0", "--http-ho", "0.0.0.0"])
    assert (args.host, args.http_host) == ("0.0.0.0", "0.0.0.0")
    confirm_with_lmcache(["server", "--host", "127.0.0.1"], {"host": "127.0.0.1"})
    with pytest.raises(ConfigError, match=r"^host: lmcache would bind '::1', not '127.0.0.1'"):
        confirm_with_lmcache(["server", "--host", "::1"], {"host": "127.0.0.1"})
    with pytest.raises(ConfigError, match=r"^lmcache server flags: unrecognized arguments: --ho"):
        confirm_with_lmcache(["server", "--ho", "::1"], {})


def test_the_flag_snapshot_is_lmcaches_parser() -> None:
    """``lmcache_flags.FLAGS`` is what LMCache's own parser holds for the installed version
    (regenerate the table when this fails after an LMCache upgrade)."""
    from lmcache_histate.backends.server.lmcache_flags import (
        FLAGS,
        LMCACHE_VERSION,
        live_flags,
    )

    assert importlib.metadata.version("lmcache") == LMCACHE_VERSION
    assert live_flags() == FLAGS
    assert {"--host", "--max-cpu-workers", "--l2-adapter"} <= {f for e in FLAGS for f in e[0]}


def test_extra_server_args_are_checked_before_lmcache_is_imported(tmp_path: Path) -> None:
    """An unknown flag or a bad value in extra_server_args: one line, exit 2, and LMCache
    never imported (its parser's import alone took 15-20 s on a loaded machine)."""
    config = tmp_path / "histate.yaml"
    script = ("import sys; from lmcache_histate.backends.server.launcher import main; "
              "rc = main(['--config', sys.argv[1]]); print(rc, 'lmcache' in sys.modules)")
    for extra, line in (
        (["--no-such-flag"], "extra_server_args: unrecognized arguments: --no-such-flag"),
        (["--transport", "udp"], "extra_server_args: argument --transport: invalid choice: "
                                 "'udp' (choose from 'zmq', 'grpc')"),
    ):
        config.write_text(yaml.safe_dump({
            "model": "tiny-qwen3-next", "chunk_size": 16, "cpu_gib": 0.05,
            "disk_path": str(tmp_path / "disk"), "disk_gib": 0.01, "platform": "cpu",
            "extra_server_args": extra}))
        result = subprocess.run([sys.executable, "-c", script, str(config)],
                                capture_output=True, text=True, timeout=120, check=False)
        assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
        assert result.stderr.strip() == f"histate-server: {line}"
