"""The connector's schema (``backends/vllm/connector_config.py``: ``ConnectorConfig``).

Pure: the keys of vLLM's ``kv_connector_extra_config`` as a mapping, no engine. Every bad
value is refused with a message naming its key and the values allowed; every bad key of one
mapping is reported in one error.
"""

from __future__ import annotations

from typing import Any

import pytest
from lmcache_histate.backends.vllm.connector_config import (
    KEYS,
    ConnectorConfig,
    SettingsError,
)


def test_absent_keys_take_the_defaults_and_lmcache_keys_are_left_to_lmcache() -> None:
    config = ConnectorConfig.from_extra({"lmcache.mp.host": "tcp://127.0.0.1",
                                         "lmcache.mp.port": 5555})
    assert config == ConnectorConfig(interval_saves=True, plan_timeout_s=5.0,
                                     auth_token_file=None, stall_polls=2000, step_price=None)


def test_good_values_are_read_into_their_fields() -> None:
    config = ConnectorConfig.from_extra({
        "histate.interval_saves": "off",
        "histate.plan_timeout_s": 2,
        "histate.auth_token_file": "/etc/histate/token",
        "histate.stall_polls": 1,
        "histate.step_price": 25.5,
    })
    assert config == ConnectorConfig(interval_saves=False, plan_timeout_s=2.0,
                                     auth_token_file="/etc/histate/token", stall_polls=1,
                                     step_price=25.5)
    assert isinstance(config.plan_timeout_s, float)
    assert ConnectorConfig.from_extra({"histate.interval_saves": False}).interval_saves is False
    assert ConnectorConfig.from_extra({"histate.interval_saves": "True"}).interval_saves is True
    assert ConnectorConfig.from_extra({"histate.step_price": "measured"}).step_price is None
    assert ConnectorConfig.from_extra({"histate.step_price": 0}).step_price == 0.0
    assert ConnectorConfig.from_extra({"histate.plan_timeout_s": 60}).plan_timeout_s == 60.0


BAD = [
    ("histate.plan_timeout_s", "5", r"histate\.plan_timeout_s: must be a number of seconds "
                                    r"in \(0, 60\] .*got '5'"),
    ("histate.plan_timeout_s", 0, r"histate\.plan_timeout_s: .*in \(0, 60\].*got 0"),
    ("histate.plan_timeout_s", -1.5, r"histate\.plan_timeout_s: .*got -1\.5"),
    ("histate.plan_timeout_s", float("nan"), r"histate\.plan_timeout_s: .*got nan"),
    ("histate.plan_timeout_s", 5000, r"histate\.plan_timeout_s: .*in \(0, 60\].*got 5000"),
    ("histate.plan_timeout_s", True, r"histate\.plan_timeout_s: .*got True"),
    ("histate.interval_saves", "maybe", r"histate\.interval_saves: must be true or false, "
                                        r"got 'maybe'"),
    ("histate.interval_saves", 2, r"histate\.interval_saves: must be true or false, got 2"),
    ("histate.interval_saves", None, r"histate\.interval_saves: must be true or false"),
    ("histate.stall_polls", 0, r"histate\.stall_polls: must be an integer >= 1 .*got 0"),
    ("histate.stall_polls", "2000", r"histate\.stall_polls: must be an integer >= 1 .*'2000'"),
    ("histate.stall_polls", 2.5, r"histate\.stall_polls: must be an integer >= 1 .*got 2\.5"),
    ("histate.step_price", -1, r"histate\.step_price: must be \"measured\" or a finite "
                               r"number >= 0 .*got -1"),
    ("histate.step_price", float("inf"), r"histate\.step_price: .*got inf"),
    ("histate.step_price", "25", r"histate\.step_price: .*got '25'"),
    ("histate.step_price", True, r"histate\.step_price: .*got True"),
    ("histate.auth_token_file", "", r"histate\.auth_token_file: must be the path of the "
                                    r"server's shared-secret file, got ''"),
    ("histate.auth_token_file", 7, r"histate\.auth_token_file: .*got 7"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD,
                         ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_a_bad_value_is_refused_naming_the_key_and_the_values_allowed(
    key: str, value: Any, message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        ConnectorConfig.from_extra({key: value})


def test_an_unknown_histate_key_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SettingsError) as caught:
        ConnectorConfig.from_extra({"histate.plan_timeout": 5})
    assert ("histate.plan_timeout: unknown key; the connector's keys are "
            "histate.interval_saves, histate.plan_timeout_s, histate.auth_token_file, "
            "histate.stall_polls, histate.step_price") in str(caught.value)
    assert len(KEYS) == 5


def test_every_bad_key_is_reported_at_once() -> None:
    with pytest.raises(SettingsError) as caught:
        ConnectorConfig.from_extra({"histate.stall_polls": 0, "histate.plan_timeout_s": "x",
                                    "histate.saves": True})
    lines = str(caught.value).splitlines()
    assert lines[0] == "HiState connector: bad kv_connector_extra_config:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "histate.saves", "histate.plan_timeout_s", "histate.stall_polls"]


def test_a_huge_bad_value_is_quoted_short() -> None:
    with pytest.raises(SettingsError) as caught:
        ConnectorConfig.from_extra({"histate.step_price": "9" * 10_000})
    assert len(str(caught.value)) < 300 and "(10002 characters)" in str(caught.value)
