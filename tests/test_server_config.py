"""The HiState YAML configuration validator (pure: no server involved)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_histate.config import ALLOWED, ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]

VALID = {
    "model": "tiny-qwen3-next",
    "chunk_size": 16,
    "cpu_gib": 0.05,
    "disk_path": "/tmp/histate-test-disk",
    "disk_gib": 1,
}


def test_minimal_config_gets_defaults() -> None:
    cfg = parse_config(VALID)
    assert cfg.policy == "histate"
    assert cfg.tau is None  # "auto": calibrated online from session re-access gaps
    assert parse_config({**VALID, "tau": "auto"}).tau is None
    assert parse_config({**VALID, "tau": 90}).tau == 90.0
    assert cfg.intervals[:3] == (16, 32, 48)
    assert len(cfg.intervals) == cfg.max_interval_chunks
    assert cfg.cpu_bytes == int(0.05 * 2**30)
    assert cfg.geometry.recurrent_layers == 3
    assert cfg.initial_pressure_factor == 0.0  # a snapshot per chunk until one leaves
    assert parse_config({**VALID, "initial_pressure_factor": 1}).initial_pressure_factor == 1.0
    # The design's end-hit weight, as the simulator's HiState rows run it; false = the
    # paper's pricing (the histate-paper row).
    assert cfg.exposed_ends is True
    assert parse_config({**VALID, "exposed_ends": False}).exposed_ends is False


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("cpu_gib", "abc", "cpu_gib: must be a positive number, got 'abc'"),
        ("cpu_gib", -1, "cpu_gib: must be a positive number, got -1"),
        ("disk_gib", 0, "disk_gib: must be a positive number, got 0"),
        ("chunk_size", 16.5, "chunk_size: must be a positive integer, got 16.5"),
        ("chunk_size", True, "chunk_size: must be a positive integer, got True"),
        ("tau", -3, "tau: must be 'auto' or a number ≥ 0 (seconds), got -3"),
        ("policy", "fifo", "policy: must be one of histate, lru; got 'fifo'"),
        ("platform", "tpu", "platform: must be one of auto, cpu, cuda; got 'tpu'"),
        ("port", 70000, "port: must be a TCP port (an integer in 1..65535), got 70000"),
        ("http_port", 5555, "http_port: must differ from port"),
        ("cpu_fill", 2, "cpu_fill: must be a number in (0, 1], got 2"),
        ("cpu_fill", 0, "cpu_fill: must be a number in (0, 1], got 0"),
        ("initial_pressure_factor", -1,
         "initial_pressure_factor: must be a number in [0.0, 1000000.0], got -1"),
        ("session_ttl_s", -1, "session_ttl_s: must be a positive number, got -1"),
        ("refresh_all", "yes", "refresh_all: must be true or false, got 'yes'"),
        ("exposed_ends", 1, "exposed_ends: must be true or false, got 1"),
        ("model", "no-such-model", "model: 'no-such-model' is neither a model preset"),
        ("supported_intervals", [16, 40], "must be a multiple of chunk_size (16)"),
        ("supported_intervals", [], "supported_intervals: must be a non-empty list"),
        ("extra_server_args", "--foo", "extra_server_args: must be a list of strings"),
        ("disk_io", "aiofiles", "disk_io: must be one of thread; got 'aiofiles'"),
        ("hit_positions", "learned",
         "hit_positions: must be one of measured, uniform; got 'learned'"),
        ("cpu_gib", 1e-12, "cpu_gib: 1e-12 GiB rounds to 0 bytes; must be at least 1 byte"),
        ("disk_gib", 5e-10, "disk_gib: 5e-10 GiB rounds to 0 bytes; must be at least 1 byte"),
        ("disk_adopt", "yes", "disk_adopt: must be true or false, got 'yes'"),
        ("max_model_tokens", 0, "max_model_tokens: must be a positive integer, got 0"),
        ("host", "0.0.0.0", "host: '0.0.0.0' is not a loopback address"),
        ("http_host", "10.1.2.3", "http_host: '10.1.2.3' is not a loopback address"),
        ("http_host", "cache.example", "http_host: 'cache.example' is not a loopback address"),
        ("allow_remote", True, "auth_token_file: required when allow_remote is true"),
        ("auth_token_file", "/no/such/token", "auth_token_file: cannot read '/no/such/token'"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**VALID, key: value})
    assert message in str(info.value)


def test_unknown_keys_are_rejected_with_the_allowed_list() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**VALID, "cpu_gb": 4})
    text = str(info.value)
    assert "cpu_gb: unknown key; allowed keys:" in text
    for key in ("cpu_gib", "disk_path", "tau", "supported_intervals"):
        assert key in text
    assert set(ALLOWED) >= {"model", "chunk_size", "cpu_gib", "disk_path", "disk_gib"}


def test_missing_required_keys_and_all_errors_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"chunk_size": "x", "tau": "soon"})
    text = str(info.value)
    for key in ("model", "cpu_gib", "disk_path", "disk_gib"):
        assert f"{key}: required key is missing" in text
    assert "chunk_size: must be a positive integer" in text
    assert "tau: must be 'auto' or a number" in text


def test_supported_intervals_are_sorted_and_deduplicated() -> None:
    cfg = parse_config({**VALID, "supported_intervals": [64, 16, 64, 32]})
    assert cfg.intervals == (16, 32, 64)


def test_load_config_resolves_paths_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "c.yaml").write_text(
        "model: tiny-qwen3-next\nchunk_size: 16\ncpu_gib: 1\ndisk_path: disk\ndisk_gib: 2\n"
    )
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.disk_path == str(tmp_path / "disk")


def test_load_config_reports_file_and_yaml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(scalar)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model: tiny-qwen3-next\nchunk_size: 16\ncpu_gib: abc\n")
    with pytest.raises(ConfigError) as info:
        load_config(wrong)
    assert str(wrong) in str(info.value)
    assert "cpu_gib: must be a positive number, got 'abc'" in str(info.value)


def test_disk_path_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"disk_path: .* is not a directory"):
        parse_config({**VALID, "disk_path": str(f)})


@pytest.mark.parametrize("name", ["histate.yaml", "lru-baseline.yaml"])
def test_shipped_configs_are_valid(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    assert cfg.chunk_size > 0


@pytest.mark.parametrize("name", ["histate.yaml", "lru-baseline.yaml"])
def test_the_example_config_fits_a_small_machine_beside_vllm(name: str) -> None:
    """``configs/histate.yaml`` and its baseline ``lru-baseline.yaml`` start as shipped on a
    2-core / 24 GiB machine: the CPU tier (allocated whole at start) takes at most a sixth of
    24 GiB, leaving the rest to vLLM and the OS, and the disk tier fits a small VM disk (at
    most 16 GiB). Checked by hand on such a machine: ``histate-server --config configs/NAME``
    answers /healthcheck."""
    cfg = load_config(REPO / "configs" / name)
    assert cfg.cpu_gib <= 24 / 6 and cfg.disk_gib <= 16


def test_with_overrides_revalidates() -> None:
    cfg = parse_config(VALID)
    assert cfg.with_overrides(cpu_gib=2).cpu_gib == 2
    with pytest.raises(ConfigError, match="cpu_gib"):
        cfg.with_overrides(cpu_gib="lots")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost"])
def test_loopback_hosts_need_no_opt_in(host: str) -> None:
    assert parse_config({**VALID, "host": host, "http_host": host}).host == host


def test_host_is_what_zmq_binds_and_http_host_may_be_ipv6() -> None:
    """LMCache binds ZMQ over IPv4 only (config NOTE 7): ``host: ::1`` is refused at load;
    ``http_host: ::1`` is accepted, and the start-up check binds it as uvicorn will."""
    from lmcache_histate.backends.demo.servers import free_ports
    from lmcache_histate.backends.server.preflight import check_listen

    with pytest.raises(ConfigError, match=r"host: '::1' is an IPv6 address; LMCache binds "
                                          r"its ZMQ port over IPv4 only: use 127\.0\.0\.1"):
        parse_config({**VALID, "host": "::1"})
    port, http_port = free_ports(2)
    cfg = parse_config({**VALID, "http_host": "::1", "port": port, "http_port": http_port})
    check_listen(cfg)  # binds 127.0.0.1:port and [::1]:http_port, or raises


UPPER = {
    "max_model_tokens": (16_777_216, "16 times the default"),
    "max_interval_chunks": (65_536, "the plan weighs one interval per multiple"),
    "session_ttl_s": (2_592_000, "30 days"),
    "request_ttl_s": (86_400, "a day"),
    "tau": (1e9, "10^9 s"),
}


@pytest.mark.parametrize("key", sorted(UPPER))
def test_every_number_has_an_upper_bound_with_its_reason(key: str) -> None:
    bound, reason = UPPER[key]
    assert parse_config({**VALID, key: bound}).to_dict()[key] == bound
    with pytest.raises(ConfigError) as info:
        parse_config({**VALID, key: bound * 2})
    assert f"{key}: must be at most {bound:g} ({reason}" in str(info.value)


@pytest.mark.parametrize(
    ("key", "bound"),
    [("connect_timeout_s", 60), ("op_timeout_s", 60), ("lease_ttl_s", 86_400),
     ("claim_ttl_s", 86_400), ("write_ttl_s", 86_400), ("retry_s", 3600)],
)
def test_shared_index_times_have_upper_bounds(key: str, bound: int) -> None:
    section = {"url": "redis://127.0.0.1:6379/0", "deployment": "d", "instance": "a"}
    assert getattr(parse_config({**VALID, "shared_index": {**section, key: bound}})
                   .shared_index, key) == bound
    with pytest.raises(ConfigError, match=rf"shared_index\.{key}: must be at most {bound:g} \("):
        parse_config({**VALID, "shared_index": {**section, key: bound + 1}})


def test_token_counts_are_bounded_by_max_model_tokens() -> None:
    """chunk_size and supported_intervals: at most max_model_tokens (a chunk or an
    interval longer than any prompt is never reached)."""
    with pytest.raises(ConfigError, match=r"chunk_size: must be at most max_model_tokens "
                                          r"\(1048576\): a chunk longer than the longest"):
        parse_config({**VALID, "chunk_size": 10**12})
    assert parse_config({**VALID, "chunk_size": 64, "max_model_tokens": 64}).chunk_size == 64
    with pytest.raises(ConfigError, match=r"chunk_size: must be at most max_model_tokens \(32\)"):
        parse_config({**VALID, "chunk_size": 64, "max_model_tokens": 32})
    # The default max_interval_chunks (64 x 16 tokens) past a short max_model_tokens is
    # harmless (never reached): accepted, also when the launcher revalidates.
    cfg = parse_config({**VALID, "max_model_tokens": 64})
    assert cfg.with_overrides(chunk_size=16).max_model_tokens == 64
    with pytest.raises(ConfigError, match=r"supported_intervals: every entry must be at most "
                                          r"max_model_tokens \(160\)"):
        parse_config({**VALID, "max_model_tokens": 160, "supported_intervals": [16, 176]})


def test_a_huge_value_is_quoted_short() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**VALID, "cpu_gib": ["x" * 100] * 10_000})
    text = str(info.value)
    assert len(text) < 300 and "... (1040000 characters)" in text


def test_yaml_aliases_are_refused_in_one_line(tmp_path: Path) -> None:
    """Nine nested aliases in 222 bytes expand to 9^6 = 531,441 strings; refused at the
    first alias, naming its line."""
    levels = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcde", "bcdef", strict=True):
        levels.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    levels[-1] = levels[-1].replace("f: &f", "cpu_gib:")
    path = tmp_path / "aliases.yaml"
    path.write_text("\n".join(levels) + "\n")
    assert len(path.read_bytes()) < 260
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: line 2: YAML aliases (*a) are not accepted in a "
                               "configuration; write the value out")


def _token(tmp_path: Path, text: str, mode: int) -> Path:
    path = tmp_path / "token"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_remote_binding_needs_opt_in_and_a_private_secret(tmp_path: Path) -> None:
    remote = {**VALID, "host": "0.0.0.0", "http_host": "0.0.0.0", "allow_remote": True}
    secret = "s3cret-" * 4
    ok = parse_config({**remote, "auth_token_file": str(_token(tmp_path, secret, 0o600))})
    assert (ok.allow_remote, ok.auth_token_file) == (True, str(tmp_path / "token"))
    for text, mode, message in [
        (secret, 0o644, r"is readable by other users \(mode 644\); chmod 600 it"),
        ("short\n", 0o600, "the secret in .* must be at least 16 characters"),
    ]:
        path = _token(tmp_path, text, mode)
        with pytest.raises(ConfigError, match=message):
            parse_config({**remote, "auth_token_file": str(path)})
    with pytest.raises(ConfigError, match="is not a regular file"):
        parse_config({**remote, "auth_token_file": str(tmp_path)})


def test_command_line_host_override_is_held_to_the_same_rule() -> None:
    cfg = parse_config(VALID)
    with pytest.raises(ConfigError, match=r"host: '0\.0\.0\.0' is not a loopback address"):
        cfg.with_overrides(host="0.0.0.0")


def test_the_connector_is_told_where_the_secret_is(tmp_path: Path) -> None:
    from lmcache_histate.backends.server.launcher import disk_adapter_spec, kv_transfer_config

    path = _token(tmp_path, "s3cret-" * 4, 0o600)
    cfg = parse_config({**VALID, "auth_token_file": str(path), "disk_adopt": True})
    extra = kv_transfer_config(cfg)["kv_connector_extra_config"]
    assert extra["histate.auth_token_file"] == str(path)
    assert "s3cret" not in repr(kv_transfer_config(cfg))  # the path, never the secret
    assert disk_adapter_spec(cfg)["adapter_params"]["disk_adopt"] is True
    assert "histate.auth_token_file" not in kv_transfer_config(parse_config(VALID))[
        "kv_connector_extra_config"
    ]


# ------------------------------------------------ the disk adapter: the same keys, the same rules
DISK = {"disk_path": "/tmp/histate-test-disk", "disk_gib": 1}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"disk_io_workers": 100},
         "disk_io_workers: must be at most 64 (threads of one disk tier), got 100"),
        ({"disk_io_workers": 0}, "disk_io_workers: must be a positive integer, got 0"),
        ({"disk_gib": 1e-12},
         "disk_gib: 1e-12 GiB rounds to 0 bytes; must be at least 1 byte (9.31e-10 GiB)"),
        ({"disk_gib": "big"}, "disk_gib: must be a positive number, got 'big'"),
        ({"disk_fsync": "yes"}, "disk_fsync: must be true or false, got 'yes'"),
        ({"disk_path": ""}, "disk_path: must be a non-empty string, got ''"),
        ({"shared_index": {"url": "redis://u:pw@h/0", "deployment": "d", "instance": "i"}},
         "shared_index.url: must not hold a password ('redis://u:***@h/0'); put it in "
         "shared_index.password_file (chmod 600)"),
    ],
)
def test_disk_adapter_and_server_yaml_refuse_alike(changes: dict, message: str) -> None:
    """A bad disk value is refused with one message, whether the server YAML or LMCache's
    ``--l2-adapter`` JSON (the adapter's ``from_dict``) carries it."""
    from lmcache_histate.backends.server.disk.config import HiStateDiskAdapterConfig

    expected = f"invalid HiState configuration: {message}"
    with pytest.raises(ConfigError) as yaml_error:
        parse_config({**VALID, **changes})
    with pytest.raises(ValueError) as adapter_error:
        HiStateDiskAdapterConfig.from_dict({**DISK, **changes})
    assert str(yaml_error.value) == expected
    assert str(adapter_error.value) == expected


def test_disk_adapter_gets_the_servers_values() -> None:
    from lmcache_histate.backends.server.disk.config import HiStateDiskAdapterConfig
    from lmcache_histate.backends.server.launcher import disk_adapter_spec

    cfg = parse_config({**VALID, "disk_gib": 0.5, "disk_io_workers": 2, "disk_fsync": False})
    params = disk_adapter_spec(cfg)["adapter_params"]
    disk = HiStateDiskAdapterConfig.from_dict(params)
    assert disk.capacity_bytes == 536_870_912  # 0.5 GiB = 2**29 bytes
    assert (disk.path, disk.io_workers, disk.fsync, disk.direct_io, disk.adopt) == (
        "/tmp/histate-test-disk", 2, False, True, False)
    assert (disk.shared_index, disk.model) == (None, "model")
    with pytest.raises(ValueError, match=r"^invalid HiState configuration: size: unknown key; "
                       r"allowed keys: disk_path, disk_gib, disk_io_workers, disk_fsync, "
                       r"disk_direct_io, disk_adopt, shared_index, index_model$"):
        HiStateDiskAdapterConfig.from_dict({**DISK, "size": 2})
    with pytest.raises(ValueError, match=r"disk_gib: required key is missing"):
        HiStateDiskAdapterConfig.from_dict({"disk_path": "/tmp/histate-test-disk"})


def test_the_server_and_the_simulator_map_the_rule_through_one_function() -> None:
    """``config.cache_config`` is the one mapping from the server schema's rule keys into
    ``CacheConfig`` (``config`` NOTE 9): the server's core and the simulator's HiState rows
    are built through it, so the same rule keys land in the core alike. Expected values by
    hand: the keys set on both sides, the YAML's or ``CacheConfig``'s default for the rest,
    and the intervals 1..4 chunks of 528 tokens."""
    from lmcache_histate.backends.server.runtime.objects import core_config

    from lmcache_histate.config import CORE_KNOBS
    from lmcache_histate.sim.config import SimSetup
    from lmcache_histate.sim.variants import histate_policy

    set_both = {"tau": 120.0, "ema_alpha": 0.2, "max_interval_chunks": 4}
    extra = {"end_probability_prior": 0.5, "initial_pressure_factor": 1.0}
    yaml = load_config(REPO / "configs" / "histate.yaml").with_overrides(**set_both, **extra)
    server = core_config(yaml, 528, 2**20, 2**22, 2**30)
    sim = histate_policy(SimSetup.paper(**set_both), "histate-fixed-tau", **extra).cache.config
    expected = {
        "tau": 120.0, "refresh_all": True, "exposed_ends": True, "hit_positions": "uniform",
        "end_probability_prior": 0.5, "ema_alpha": 0.2, "initial_pressure_factor": 1.0,
        "max_interval_chunks": 4, "supported_intervals": (528, 1056, 1584, 2112),
    }
    assert set(expected) == set(CORE_KNOBS)
    for side, config in (("server", server), ("simulator", sim)):
        assert {key: getattr(config, key) for key in expected} == expected, side
    # Each side's own part: its tiers (the simulator's GPU pool ranks by recency).
    assert [t.name for t in server.tiers] == ["cpu", "disk"] and server.recency_tiers == 0
    assert [t.name for t in sim.tiers] == ["gpu", "cpu", "disk"] and sim.recency_tiers == 1
