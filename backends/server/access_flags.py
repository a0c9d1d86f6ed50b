"""Which ``lmcache server`` flags a configuration or a command line may give, and where the
server binds once every source of flags is applied.

``lmcache server`` reads flags from three sources, concatenated by the launcher in this
order (argparse keeps the last value of a repeated flag): the YAML translated by the
launcher, the YAML's ``extra_server_args``, and ``histate-server``'s own command line.
LMCache's ZMQ port has no authentication, so binding only to loopback is the protection
(``lmcache_histate.config`` NOTE 4); this module keeps every source from getting around it:

* ``screen_extra_server_args``: the file may not set what a YAML key owns (``--host``,
  ``--port``, ``--http-host``, ...: the error names the key), load code into the server
  (``--server-module``, ``--l2-adapter``, ``--l1-manager``, runtime plugins, script
  imports) or widen what it exposes (``NEVER``);
* ``screen_command_line``: the operator's command line may load modules (test harnesses
  add test-only server modules) and override the YAML keys (the launcher folds them into
  the configuration, which is validated again, loopback rule included), but never give a
  ``NEVER`` flag;
* both refuse an abbreviation of any flag named here (NOTE 1);
* ``decide_bindings``: the ONE decision on the complete ``lmcache server`` argument list:
  the address each listening flag ends with, loopback unless ``allow_remote`` and
  ``auth_token_file`` are both set; ``confirm_with_lmcache`` checks that LMCache's own
  parser reads the same addresses from that list before the server starts.

NOTE 1 (abbreviations): LMCache's parser accepts any unambiguous prefix of a long flag
(argparse ``allow_abbrev``), so ``--ho 0.0.0.0`` is ``--host 0.0.0.0``. argparse resolves
a token ``t`` to a flag ``f`` only when ``f`` starts with ``t``, so refusing every token
that is a proper prefix of a guarded flag leaves no spelling of a guarded flag unchecked,
without a copy of LMCache's flag list here.

Pure (no lmcache import) except ``check_extra_with_lmcache`` and ``confirm_with_lmcache``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping, Sequence

from lmcache_histate.config import ConfigError
from lmcache_histate.exposure import is_loopback

__all__ = [
    "ADDRESS_FLAGS",
    "CODE_FLAGS",
    "NEVER",
    "YAML_FLAGS",
    "check_extra_with_lmcache",
    "confirm_with_lmcache",
    "decide_bindings",
    "screen_command_line",
    "screen_extra_server_args",
]

YAML_FLAGS: Mapping[str, str] = {
    "--host": "host",
    "--port": "port",
    "--http-host": "http_host",
    "--http-port": "http_port",
    "--chunk-size": "chunk_size",
    "--l1-size-gb": "cpu_gib",
    "--eviction-policy": "policy",
    "--eviction-trigger-watermark": "l1_eviction_watermark",
    "--l2-store-policy": "policy",
}
"""``lmcache server`` flags the launcher sets from a YAML key (the key named in errors)."""

CODE_FLAGS: Mapping[str, str] = {
    "--server-module": "imports a Python module into the server",
    "--l2-adapter": "imports an L2 adapter module (the disk tier is set by disk_path, "
                    "disk_gib and the disk_* keys)",
    "--l1-manager": "replaces the L1 memory manager (its size is cpu_gib)",
    "--runtime-plugin-locations": "runs plugin scripts alongside the server",
    "--runtime-plugin-config": "configures plugin scripts run alongside the server",
    "--script-allowed-imports": "lets /run_script import modules",
}
"""Flags that load code into the server: the operator's command line only."""

NEVER: Mapping[str, str] = {
    "--run-script-api-enabled": "opens /run_script, which executes caller-supplied Python "
                                "(remote code execution)",
    "--p2p-listen-url": "opens LMCache's P2P transfer port, which has no authentication",
    "--p2p-advertise-url": "opens LMCache's P2P transfer port, which has no authentication",
    "--coordinator-url": "joins LMCache's coordinator, which turns on P2P transfer",
}
"""Flags that widen what the server exposes: refused from every source."""

ADDRESS_FLAGS: Mapping[str, str] = {"--host": "host", "--http-host": "http_host"}
"""The flags that choose a listening address (ZMQ, HTTP), with their YAML keys."""

_GUARDED = (*YAML_FLAGS, *CODE_FLAGS, *NEVER)


def _flag(token: str) -> str | None:
    """The flag a token names (``--a=b`` names ``--a``); None for a value."""
    if not token.startswith("--"):
        return None
    return token.partition("=")[0]


def _refuse_abbreviation(source: str, flag: str) -> None:
    meant = sorted(g for g in _GUARDED if g != flag and g.startswith(flag))
    if meant:
        raise ConfigError(
            f"{source}: {flag!r} abbreviates {', '.join(meant)}; spell lmcache server "
            f"flags in full"
        )


def _flags(source: str, tokens: Sequence[str]) -> Iterator[str]:
    """The flags among ``tokens``, each checked: no abbreviation, no ``NEVER`` flag."""
    for token in tokens:
        flag = _flag(token)
        if flag is None:
            continue
        _refuse_abbreviation(source, flag)
        if flag in NEVER:
            raise ConfigError(f"{source}: {flag} {NEVER[flag]}; HiState refuses it")
        yield flag


def screen_extra_server_args(tokens: Sequence[str]) -> None:
    """Raise ``ConfigError`` (one line) for the first flag the file may not give."""
    source = "extra_server_args"
    for flag in _flags(source, tokens):
        if flag in YAML_FLAGS:
            raise ConfigError(
                f"{source}: {flag} is set by the YAML key {YAML_FLAGS[flag]}; use that key"
                + (" (with allow_remote and auth_token_file beyond loopback)"
                   if flag in ADDRESS_FLAGS else "")
            )
        if flag in CODE_FLAGS:
            raise ConfigError(
                f"{source}: {flag} {CODE_FLAGS[flag]}; a configuration file may not load "
                "code into the server"
            )


def screen_command_line(tokens: Sequence[str]) -> None:
    """Raise ``ConfigError`` (one line) for a ``NEVER`` flag or an abbreviation."""
    for _ in _flags("command line", tokens):
        pass


def _last_values(argv: Sequence[str], flags: Sequence[str]) -> dict[str, str]:
    """The last value given to each of ``flags`` in ``argv`` (argparse's rule)."""
    out: dict[str, str] = {}
    for i, token in enumerate(argv):
        flag, eq, inline = token.partition("=")
        if flag in flags:
            if eq:
                out[flag] = inline
            elif i + 1 < len(argv):
                out[flag] = argv[i + 1]
    return out


def decide_bindings(
    argv: Sequence[str], *, allow_remote: bool, auth_token_file: str | None
) -> dict[str, str]:
    """The address of each listening flag in the complete ``lmcache server`` list ``argv``.

    Raises:
        ConfigError: an address beyond loopback without both ``allow_remote`` and
            ``auth_token_file``, or a ``NEVER`` flag anywhere (one line).
    """
    for _ in _flags("lmcache server flags", argv):
        pass
    bound = _last_values(argv, list(ADDRESS_FLAGS))
    remote_ok = allow_remote and auth_token_file is not None
    for flag, host in bound.items():
        if not remote_ok and not is_loopback(host):
            key = ADDRESS_FLAGS[flag]
            raise ConfigError(
                f"{key}: {host!r} is not a loopback address; set allow_remote: true and "
                "auth_token_file to bind beyond this machine (docs/deployment.md, Security)"
            )
    return {ADDRESS_FLAGS[f]: h for f, h in bound.items()}


class _StrictParser(argparse.ArgumentParser):
    """argparse that raises ``ConfigError`` instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"lmcache server flags: {message}")


def _lmcache_parser() -> argparse.ArgumentParser:
    from lmcache.cli.commands.server import ServerCommand

    parser = _StrictParser(prog="lmcache server", allow_abbrev=False, add_help=False)
    ServerCommand().add_arguments(parser)
    return parser


def check_extra_with_lmcache(tokens: Sequence[str]) -> None:
    """Parse ``extra_server_args`` alone with LMCache's server flags, before anything
    starts: with the checked snapshot of LMCache's parser (``lmcache_flags``, milliseconds)
    when it is the installed version's, else with LMCache's own (which imports LMCache).

    Raises:
        ConfigError: a flag LMCache does not know or a bad value for one (one line).
    """
    if not tokens:
        return
    from .lmcache_flags import snapshot_parser

    parser = snapshot_parser(_StrictParser) or _lmcache_parser()
    try:
        parser.parse_args(list(tokens))
    except ConfigError as exc:
        raise ConfigError(
            "extra_server_args: " + str(exc).removeprefix("lmcache server flags: ")
        ) from None


def confirm_with_lmcache(argv: Sequence[str], decided: Mapping[str, str]) -> None:
    """Parse ``argv`` (starting with ``server``) with LMCache's own server flags, without
    abbreviations, and check it binds where ``decide_bindings`` decided and keeps
    ``/run_script`` off.

    Raises:
        ConfigError: a flag LMCache does not know, or a disagreement (one line).
    """
    args = _lmcache_parser().parse_args(list(argv[1:]))
    for flag, key in ADDRESS_FLAGS.items():
        dest = flag.lstrip("-").replace("-", "_")
        if key in decided and getattr(args, dest) != decided[key]:
            raise ConfigError(
                f"{key}: lmcache would bind {getattr(args, dest)!r}, not {decided[key]!r}"
            )
    if getattr(args, "run_script_api_enabled", False):
        raise ConfigError(f"--run-script-api-enabled: {NEVER['--run-script-api-enabled']}")
