"""``histate-server``: validate a HiState YAML config and run ``lmcache server`` with HiState.

    histate-server --config configs/histate.yaml [--dry-run | --print-config] [lmcache flags]

1. Validates the YAML (``lmcache_histate.config``); a bad value fails here, before any
   import of lmcache, with a message naming the key (exit status 2). ``chunk_size: auto``
   is resolved from the engine (``resolve_engine_layout``: vLLM's block size and state
   dtypes for the model on this machine, asked of vLLM without loading weights). So do
   start-up faults (``preflight``: disk folder, free space, ports, hosts), in one line.
2. Translates it into ``lmcache server`` flags: ``--separate-object-groups`` (one object
   group per attention/recurrent bucket: required for hybrid models), ``--chunk-size``,
   ``--l1-size-gb``, the disk tier as an ``--l2-adapter`` plugin, ``--l2-store-policy
   histate``, the HiState ``--server-module`` (plus the vLLM-CPU fix-up module on CPU),
   ``--eviction-policy LRU`` (a name the CLI accepts; see below), host and ports.
   Further flags on the command line are passed through; ``--host``, ``--port``,
   ``--http-host``, ``--http-port``, ``--chunk-size`` and ``--l1-size-gb`` there override
   the file (so test harnesses can pick free ports). ``access_flags`` screens both
   ``extra_server_args`` and the command line (no abbreviations, no flag that loads code
   from the file, never ``--run-script-api-enabled``) and decides, on the complete list,
   that every listening address is loopback unless ``allow_remote`` + ``auth_token_file``.
3. Prints the vLLM ``--kv-transfer-config`` JSON (``kv_transfer_config(cfg)``) and flags.
4. With ``policy: histate``: builds the HiState runtime and hands it to LMCache bound into
   the ``histate`` store policy (LMCache validates ``--l2-store-policy`` against its
   registry when the CLI parser is built, so this must happen first, in this process) and
   the L1 eviction hook (``plugins.install``: LMCache 0.5.6 has no L1 eviction-policy
   registry) and onto LMCache's HTTP app's state, where the server module finds it
   (``plugins`` NOTE 2) and attaches the disk tier to it. With
   ``auth_token_file`` it guards the HTTP API (``access``); it always installs the
   shared-memory release on engine close (``upstream.install_shm_release``, an lmcache
   0.5.6 leak). Then
   runs ``lmcache.cli.main.main(["server", ...])`` in this process.

``--dry-run`` stops after printing the command line; ``--print-config`` prints the
validated configuration (defaults filled in) as YAML.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lmcache_histate import __version__
from lmcache_histate.config import DISK_TIER_KEYS, ConfigError, HiStateConfig, load_config

from . import preflight
from .access_flags import (
    check_extra_with_lmcache,
    confirm_with_lmcache,
    decide_bindings,
    screen_command_line,
    screen_extra_server_args,
)

__all__ = ["kv_transfer_config", "main", "resolve_engine_layout", "server_argv", "vllm_flags"]

CPU_SERVER_MODULE = "lmcache_histate.backends.server.cpu_server_module"
HISTATE_SERVER_MODULE = "lmcache_histate.backends.server.plugins"
DISK_ADAPTER_MODULE = "lmcache_histate.backends.server.disk.tier"
SHARED_ADAPTER_MODULE = "lmcache_histate.backends.server.shared_tier.tier"

# lmcache server flags that map onto configuration keys: on the command line they win.
_OVERRIDES = {
    "--host": ("host", str),
    "--port": ("port", int),
    "--http-host": ("http_host", str),
    "--http-port": ("http_port", int),
    "--chunk-size": ("chunk_size", int),
    "--l1-size-gb": ("cpu_gib", float),
}


def kv_transfer_config(cfg: HiStateConfig) -> dict[str, Any]:
    """The vLLM ``--kv-transfer-config`` for a server started from ``cfg``."""
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    out: dict[str, Any] = {
        "kv_connector": cfg.kv_connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{host}",
            "lmcache.mp.port": cfg.port,
        },
    }
    if cfg.kv_connector_module_path:
        out["kv_connector_module_path"] = cfg.kv_connector_module_path
    if cfg.auth_token_file:
        # HiState's RPCs need the secret: the connector reads it from this file.
        out["kv_connector_extra_config"]["histate.auth_token_file"] = cfg.auth_token_file
    if cfg.policy != "histate" and cfg.kv_connector == "HiStateConnector":
        # A baseline server has no interval controller: save a state wherever vLLM
        # offers one, as stock LMCache does (the connector still brings CPU support).
        out["kv_connector_extra_config"]["histate.interval_saves"] = False
    return out


def vllm_flags(cfg: HiStateConfig) -> list[str]:
    """vLLM flags to pair with this server.

    ``chunk_size`` must be vLLM's block size N (vLLM chooses it for hybrid models; it
    prints it at start) or a multiple of it. No ``--max-num-batched-tokens``: the engine
    keeps its default step budget, and HiState's scheduler ends a prefill step early only
    where the request's plan keeps a snapshot (``step_scheduler``).
    """
    from lmcache_histate.backends.vllm.connector_config import SCHEDULER_CLS

    n = cfg.chunk_tokens
    engine = [f"--{key.replace('_', '-')}" + f"={getattr(cfg, key)}"
              for key in ("dtype", "mamba_ssm_cache_dtype") if getattr(cfg, key) != "auto"]
    return [
        # The engine dtypes the server's layout was resolved for (config NOTE 1).
        *engine,
        "--enable-prefix-caching",
        # A recurrent state exists only at a step's end: steps end at planned boundaries.
        "--scheduler-cls", SCHEDULER_CLS,
        # States only at block-aligned step ends, and every such boundary handed to the
        # connector (vLLM's default retention 0 keeps only the replay boundary).
        "--mamba-cache-mode", "align",
        "--prefix-cache-retention-interval", str(n),
        "--kv-transfer-config", json.dumps(kv_transfer_config(cfg), separators=(",", ":")),
    ]


def _platform_is_cpu(cfg: HiStateConfig) -> bool:
    if cfg.platform != "auto":
        return cfg.platform == "cpu"
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:
        return True


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def disk_adapter_spec(cfg: HiStateConfig) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON of the disk tier: its ``adapter_params`` are the server's
    own disk keys, validated again by the adapter with the same checks (``config`` NOTE 5)."""
    values = cfg.to_dict()
    params = {key: values[key] for key in DISK_TIER_KEYS if values[key] is not None}
    if cfg.shared_index is not None:  # one folder for the deployment (docs/shared-index.md)
        # Imported here: the shared_index package imports redis, which neither --help nor a
        # config without a shared index needs (a wheel installed without the live extras).
        from .shared_index.layout import index_model_name

        params["index_model"] = index_model_name(cfg.model)
    spec: dict[str, Any] = {
        "type": "plugin",
        "module_path": DISK_ADAPTER_MODULE,
        "class_name": "HiStateDiskAdapter",
        "adapter_params": params,
    }
    if cfg.policy == "lru":
        # Baseline: LMCache's own LRU evicts the disk tier when it is full.
        spec["eviction"] = {"eviction_policy": "LRU", "trigger_watermark": 0.9,
                            "eviction_ratio": 0.1}
    return spec


def shared_adapter_spec(cfg: HiStateConfig) -> dict[str, Any] | None:
    """The ``--l2-adapter`` JSON of the shared tier (None without a ``shared_tier``
    section). Listed after the disk tier: LMCache's prefetch plan loads each chunk from
    the first adapter that has it, so a node reads the cluster only for what its own
    tiers lack (docs/multi-node.md)."""
    if cfg.shared_tier is None:
        return None
    from .shared_index.layout import index_model_name  # imports redis (see above)

    return {
        "type": "plugin",
        "module_path": SHARED_ADAPTER_MODULE,
        "class_name": "HiStateSharedAdapter",
        "adapter_params": {"shared_tier": cfg.shared_tier.to_dict(),
                           "index_model": index_model_name(cfg.model)},
    }


def server_argv(cfg: HiStateConfig, passthrough: Sequence[str] = ()) -> list[str]:
    """``lmcache`` CLI arguments (starting with ``server``) for ``cfg``."""
    argv = [
        "server",
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--http-host", cfg.http_host,
        "--http-port", str(cfg.http_port),
        "--chunk-size", str(cfg.chunk_tokens),
        "--separate-object-groups",
        "--supported-transfer-mode", "lmcache_driven",
        "--l1-size-gb", f"{cfg.cpu_gib:g}",
        "--eviction-policy", "LRU",
        "--eviction-trigger-watermark", f"{cfg.l1_eviction_watermark:g}",
        "--l2-adapter", json.dumps(disk_adapter_spec(cfg), separators=(",", ":")),
    ]
    shared = shared_adapter_spec(cfg)
    if shared is not None:
        argv += ["--l2-adapter", json.dumps(shared, separators=(",", ":"))]
    if cfg.policy == "histate":
        argv += ["--l2-store-policy", "histate"]
    # With policy lru too: its HiState RPCs then answer at once that HiState is off
    # (without a handler LMCache never answers, and the client waits out its timeout).
    argv += ["--server-module", json.dumps({"module_path": HISTATE_SERVER_MODULE,
                                            "factory_name": "build_server_modules",
                                            "config": {"policy": cfg.policy}},
                                           separators=(",", ":"))]
    if _platform_is_cpu(cfg):
        if _module_available(CPU_SERVER_MODULE):
            argv += ["--server-module", json.dumps({"module_path": CPU_SERVER_MODULE,
                                                    "factory_name": "build_server_modules",
                                                    "config": {}}, separators=(",", ":"))]
        else:
            print(f"histate-server: {CPU_SERVER_MODULE} not installed; CPU server module "
                  "skipped", file=sys.stderr)
    return [*argv, *cfg.extra_server_args, *passthrough]


def apply_overrides(
    cfg: HiStateConfig, passthrough: Sequence[str]
) -> tuple[HiStateConfig, list[str]]:
    """Fold overriding ``lmcache server`` flags into ``cfg``; return the remaining flags."""
    rest: list[str] = []
    changes: dict[str, Any] = {}
    args = list(passthrough)
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, inline = arg.partition("=")
        if flag in _OVERRIDES or flag == "--eviction-policy":
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise ConfigError(f"{flag}: missing value on the command line")
            if flag == "--eviction-policy":
                if cfg.policy == "histate" and value != "LRU":
                    raise ConfigError(
                        f"--eviction-policy {value}: policy histate replaces L1 eviction "
                        "with its H queue; remove the flag or use policy: lru"
                    )
                if cfg.policy == "lru":
                    rest += [flag, value]
            else:
                key, kind = _OVERRIDES[flag]
                try:
                    changes[key] = kind(value)
                except ValueError:
                    raise ConfigError(
                        f"{flag} (overrides {key}): not a valid {kind.__name__}: {value!r}"
                    ) from None
        else:
            rest.append(arg)
        i += 1
    if changes:
        cfg = cfg.with_overrides(**changes)
    return cfg, rest


def resolve_engine_layout(cfg: HiStateConfig) -> HiStateConfig:
    """``chunk_size: auto`` → vLLM's block size and state dtypes for the model, on this machine.

    Asks vLLM in a child process (``engine_facts.probe``: its own config resolution, no
    weights loaded) with the config's ``dtype`` and ``mamba_ssm_cache_dtype``, and returns the
    config with the chunk and the engine's resolved dtypes filled in. A number is kept.

    Raises:
        ConfigError: vLLM cannot resolve the model (message names ``chunk_size``).
    """
    if cfg.chunk_size != "auto":
        return cfg
    from lmcache_histate.backends.vllm.engine_facts import probe

    model = Path(cfg.model)
    model_dir = model.parent if model.is_file() else model
    try:
        facts = probe(model_dir, dtype=cfg.dtype, mamba_ssm_cache_dtype=cfg.mamba_ssm_cache_dtype)
    except Exception as exc:
        raise ConfigError(f"chunk_size: auto: {exc}") from None
    print(f"histate-server: chunk_size auto -> {facts.block_size} ({facts.describe()})",
          flush=True)
    return cfg.with_overrides(**facts.server_settings())


def _parser() -> argparse.ArgumentParser:
    # NOTE: no abbreviations: ``--con`` must not mean ``--config``, and a prefix of an
    # lmcache flag must reach ``access_flags`` as typed (its NOTE 1).
    p = argparse.ArgumentParser(
        prog="histate-server",
        allow_abbrev=False,
        description="Run lmcache server with HiState (disk tier, placement, unified eviction).",
        epilog="Other arguments are passed to `lmcache server`.",
    )
    p.add_argument("--version", action="version", version=f"lmcache-histate {__version__}")
    p.add_argument("--config", required=True, help="HiState YAML configuration")
    p.add_argument("--dry-run", action="store_true",
                   help="validate, print the lmcache command line and vLLM flags, exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the validated configuration (defaults filled in) and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, passthrough = _parser().parse_known_args(argv)
    try:
        cfg = load_config(args.config)
        screen_extra_server_args(cfg.extra_server_args)
        check_extra_with_lmcache(cfg.extra_server_args)
        screen_command_line(passthrough)
        cfg, rest = apply_overrides(cfg, passthrough)
        cfg = resolve_engine_layout(cfg)
        lmcache_args = server_argv(cfg, rest)
        # The one decision on where the server listens, after every source of flags.
        bindings = decide_bindings(lmcache_args, allow_remote=cfg.allow_remote,
                                   auth_token_file=cfg.auth_token_file)
    except ConfigError as exc:
        print(f"histate-server: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if not args.dry_run:
        # Sizes, folders and ports against this machine before anything is printed: a
        # server that cannot start prints its one-line error and no command line or flags.
        # (A dry run prints the flags for a machine that may be another.)
        try:
            preflight.check(cfg)
        except ConfigError as exc:
            print(f"histate-server: {exc}", file=sys.stderr)
            return 2
    print("lmcache " + shlex.join(lmcache_args), flush=True)
    print("vLLM --kv-transfer-config: "
          + json.dumps(kv_transfer_config(cfg), separators=(",", ":")), flush=True)
    print("vLLM flags: " + shlex.join(vllm_flags(cfg)), flush=True)
    if args.dry_run:
        return 0
    return run(cfg, lmcache_args, bindings)


def run(cfg: HiStateConfig, lmcache_args: list[str], bindings: dict[str, str]) -> int:
    """Install HiState into this process and run ``lmcache server`` (blocks).

    ``bindings``: ``access_flags.decide_bindings``'s answer, which LMCache's own parser
    must read from ``lmcache_args`` too (checked once the ``histate`` store policy is
    registered: the parser validates ``--l2-store-policy`` against the registry).
    """
    from lmcache_histate.backends.log_routing import route_logs

    route_logs("lmcache")  # HiState's lines in the server's log, in LMCache's format
    guard_control_plane(cfg)
    from lmcache_histate.backends.upstream import install_shm_release

    install_shm_release()  # upstream leak of one mapping + fd per KV tensor per engine
    keep_request_thread()
    stop_on_hangup()
    l1_policy = None
    if cfg.policy == "histate":
        from lmcache.v1.multiprocess.http_server import app

        from . import plugins
        from .routing_api import install_routing_api
        from .runtime.runtime import HiStateRuntime

        runtime = HiStateRuntime(cfg)
        l1_policy = plugins.install(runtime, app)
        install_routing_api(app, runtime)
    try:
        confirm_with_lmcache(lmcache_args, bindings)
    except ConfigError as exc:
        print(f"histate-server: {exc}", file=sys.stderr)
        return 2
    from lmcache.cli.main import main as lmcache_main

    if l1_policy is None:
        lmcache_main(lmcache_args)
        return 0
    from lmcache_histate.backends.upstream import route_l1_eviction_policy

    with route_l1_eviction_policy(l1_policy):  # the runtime's, for this server's run
        lmcache_main(lmcache_args)
    return 0


def guard_control_plane(cfg: HiStateConfig) -> None:
    """Health routes fail with the data plane (``data_plane``); bound every HTTP request
    body (``access.BodyLimit``); with ``auth_token_file``, every HTTP route but
    ``/healthcheck`` needs the secret; refused RPCs log quietly.

    Must run before ``lmcache server`` starts its FastAPI app (``access``, NOTE 1).
    """
    from lmcache.v1.multiprocess.http_server import app

    from lmcache_histate.exposure import read_secret

    from .access import install_http_guard, install_refusal_log
    from .data_plane import install_data_plane_gate, probe_url

    secret = read_secret(cfg.auth_token_file) if cfg.auth_token_file else None
    install_data_plane_gate(app, probe_url(cfg.host, cfg.port))  # innermost: added first
    install_http_guard(app, secret)
    install_refusal_log()


def stop_on_hangup() -> None:
    """SIGHUP stops the server as SIGTERM does (docs/reliability.md, promise 11).

    Without a handler SIGHUP killed the process at once (no shutdown lines, the disk tier
    not closed). There is nothing to reload: every setting is read at start, and most
    (ports, sizes, the disk folder) cannot change under running engines. The handler
    raises SIGTERM, so whichever SIGTERM handler holds at that moment runs: uvicorn's
    graceful shutdown once the server runs, the default exit during start-up.
    """
    import logging
    import signal

    log = logging.getLogger("lmcache_histate.launcher")

    def hangup(_signum: int, _frame: object) -> None:
        log.warning("SIGHUP: stopping as for SIGTERM (histate-server reloads nothing)")
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGHUP, hangup)


def keep_request_thread() -> None:
    """Malformed frames are dropped with one rate-limited line and LMCache's request
    thread lives (``upstream.install_request_loop_guard``); if it ends otherwise, one
    CRITICAL line, and ``/healthcheck`` fails (``data_plane``)."""
    import logging

    from lmcache_histate.backends.upstream import install_request_loop_guard

    from .quiet_log import install_malformed_request_log

    quiet = install_malformed_request_log()
    log = logging.getLogger("lmcache_histate.data_plane")

    def on_death(exc: BaseException) -> None:
        log.critical("LMCache's request thread stopped (%s: %s): engines get no answers; "
                     "/healthcheck answers 503", type(exc).__name__, exc, exc_info=exc)

    install_request_loop_guard(quiet.line, on_death)


if __name__ == "__main__":
    sys.exit(main())
