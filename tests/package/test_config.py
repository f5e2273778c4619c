"""torch_pccl.config: each setting parsed strictly, documented in the README, limits from pccl.h."""

import os
import re
from datetime import timedelta

import pytest
from harness import REPO

from torch_pccl import config, errors

README = os.path.join(REPO, "README.md")


def test_master_switch_accepts_the_usual_spellings(monkeypatch):
    for value in ("0", "false", "FALSE", "no", "off", " Off "):
        monkeypatch.setenv("PCCL_MASTER", value)
        assert config.master_enabled() is False, value
    for value in ("1", "true", "True", "yes", "on"):
        monkeypatch.setenv("PCCL_MASTER", value)
        assert config.master_enabled() is True, value
    for value in ("", "   "):
        monkeypatch.setenv("PCCL_MASTER", value)
        assert config.master_enabled() is True       # unset: the default
    monkeypatch.delenv("PCCL_MASTER")
    assert config.master_enabled() is True


@pytest.mark.parametrize("value", ["2", "maybe", "of", "-1"])
def test_master_switch_rejects_junk_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("PCCL_MASTER", value)
    with pytest.raises(ValueError, match=f"PCCL_MASTER={value!r}"):
        config.master_enabled()


def test_timeout(monkeypatch):
    monkeypatch.delenv("PCCL_TIMEOUT", raising=False)
    assert config.timeout_s(1800.0) == 1800.0
    monkeypatch.setenv("PCCL_TIMEOUT", "2.5")
    assert config.timeout_s(1800.0) == 2.5
    for bad in ("0", "-3", "soon", "nan", "inf-ish"):
        monkeypatch.setenv("PCCL_TIMEOUT", bad)
        with pytest.raises(ValueError, match="PCCL_TIMEOUT"):
            config.timeout_s(1800.0)


def test_lanes_bound_is_the_caller_s(monkeypatch):
    monkeypatch.setenv("PCCL_LANES", "8")
    assert config.lanes(8) == 8
    with pytest.raises(ValueError, match=r"PCCL_LANES='8' must be an int in 1 \.\. 7"):
        config.lanes(7)


def test_pacing(monkeypatch):
    monkeypatch.delenv("PCCL_PACING", raising=False)
    assert config.pacing() == -1                       # measured (auto) unless told
    for value, native in (("auto", -1), ("AUTO", -1), ("off", 0), ("0", 0),
                          ("100", 12_500_000), ("0.5", 62_500)):
        monkeypatch.setenv("PCCL_PACING", value)
        assert config.pacing() == native, value
    for bad in ("-5", "fast", "nan", "1e9"):
        monkeypatch.setenv("PCCL_PACING", bad)
        with pytest.raises(ValueError, match="PCCL_PACING"):
            config.pacing()


def test_strings_are_stripped_and_empty_is_unset(monkeypatch):
    monkeypatch.setenv("PCCL_PEER_ID", "  node-3 ")
    assert config.peer_id() == "node-3"
    monkeypatch.setenv("PCCL_HOST", "")
    assert config.host() is None
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert config.rendezvous_host() is None


def test_to_seconds():
    assert config.to_seconds(None, 60.0) == 60.0
    assert config.to_seconds(timedelta(minutes=2)) == 120.0
    assert config.to_seconds(0.25) == 0.25
    for bad in (0, -1, timedelta(0)):
        with pytest.raises(ValueError, match="positive"):
            config.to_seconds(bad, 1.0)
    with pytest.raises(ValueError):
        config.to_seconds(None)


def test_every_setting_is_in_the_readme_configuration_table():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Configuration", 1)
    assert len(section) == 2, "README has no '## Configuration' section"
    table = section[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Z_]+)` \| (.*) \| (.*) \|$", table, flags=re.M)
    assert rows == [(s.name, s.default, s.help) for s in config.SETTINGS]


def test_master_defaults_are_config_s(monkeypatch):
    from torch_pccl.master.__main__ import _parser
    from torch_pccl.master.server import MasterServer
    from torch_pccl.master.state import MembershipState

    monkeypatch.delenv("PCCL_HEARTBEAT_INTERVAL", raising=False)
    monkeypatch.delenv("PCCL_HEARTBEAT_TIMEOUT", raising=False)
    args = _parser().parse_args([])
    # The CLI leaves the heartbeat to the server, which reads the environment.
    assert (args.heartbeat_interval, args.heartbeat_timeout, args.round_timeout) == (
        None, None, config.ROUND_TIMEOUT_S)
    server = MasterServer()
    assert (server.state.heartbeat_interval_s, server.state.heartbeat_timeout_s) == (
        config.HEARTBEAT_INTERVAL_S, config.HEARTBEAT_TIMEOUT_S)
    monkeypatch.setenv("PCCL_HEARTBEAT_INTERVAL", "0.25")
    monkeypatch.setenv("PCCL_HEARTBEAT_TIMEOUT", "3")
    server = MasterServer()
    assert (server.state.heartbeat_interval_s, server.state.heartbeat_timeout_s) == (0.25, 3.0)
    assert server.tick_interval_s == 0.125
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("PCCL_HEARTBEAT_TIMEOUT", bad)
        with pytest.raises(ValueError, match="PCCL_HEARTBEAT_TIMEOUT"):
            MasterServer()
    monkeypatch.setenv("PCCL_HEARTBEAT_TIMEOUT", "0.2")   # not above the interval
    with pytest.raises(ValueError, match="must exceed"):
        MasterServer()
    state = MembershipState()
    assert (state.heartbeat_interval_s, state.heartbeat_timeout_s, state.round_timeout_s) == (
        config.HEARTBEAT_INTERVAL_S, config.HEARTBEAT_TIMEOUT_S, config.ROUND_TIMEOUT_S)


def test_result_codes_and_limits_agree_with_the_header():
    from torch_pccl.core.native import MAX_QUANT_BLOCK, MAX_TIMEOUT_S, lib

    pairs = {
        "SUCCESS": "pcclSuccess", "INVALID_ARGUMENT": "pcclInvalidArgument",
        "INVALID_USAGE": "pcclInvalidUsage", "SYSTEM_ERROR": "pcclSystemError",
        "PEER_LOST": "pcclPeerLost", "TIMEOUT": "pcclTimeout", "ABORTED": "pcclAborted",
        "PROTOCOL_ERROR": "pcclProtocolError", "MISMATCH": "pcclMismatch",
        "OUT_OF_MEMORY": "pcclOutOfMemory", "REMOTE_ERROR": "pcclRemoteError",
        "AUTH_ERROR": "pcclAuthError", "INTEGRITY_ERROR": "pcclIntegrityError",
    }
    for py, c in pairs.items():
        assert getattr(errors, py) == getattr(lib, c), py
    assert len(pairs) == lib.pcclNumResults
    # Every non-zero code has its own class, carrying that code.
    classes = {errors.error_class(code) for code in range(1, lib.pcclNumResults)}
    assert len(classes) == lib.pcclNumResults - 1
    assert all(cls.code == code for code in range(1, lib.pcclNumResults)
               for cls in [errors.error_class(code)])
    # Python's argument checks stop exactly at the header's limits.
    import torch
    import torch.distributed as dist

    from torch_pccl.core.tensors import checked_timeout, quantized_args

    t = torch.zeros(4)
    quantized_args(t, 8, MAX_QUANT_BLOCK, dist.ReduceOp.SUM)
    with pytest.raises(errors.InvalidArgumentError, match=str(MAX_QUANT_BLOCK)):
        quantized_args(t, 8, MAX_QUANT_BLOCK + 1, dist.ReduceOp.SUM)
    assert checked_timeout(MAX_TIMEOUT_S) == lib.PCCL_MAX_TIMEOUT_MS / 1000.0
    with pytest.raises(errors.InvalidArgumentError):
        checked_timeout(MAX_TIMEOUT_S + 1)


def test_link_and_connect_timeouts(monkeypatch):
    for var in ("PCCL_LINK_TIMEOUT", "PCCL_CONNECT_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    assert config.link_timeout_ms() == 30_000
    assert config.connect_timeout_s() == config.CONNECT_TIMEOUT_S == 30.0
    monkeypatch.setenv("PCCL_LINK_TIMEOUT", "2.5")
    monkeypatch.setenv("PCCL_CONNECT_TIMEOUT", "4")
    assert (config.link_timeout_ms(), config.connect_timeout_s()) == (2500, 4.0)
    for bad in ("0.5", "3601", "x", "-1"):
        monkeypatch.setenv("PCCL_LINK_TIMEOUT", bad)
        with pytest.raises(ValueError, match="PCCL_LINK_TIMEOUT"):
            config.link_timeout_ms()
    monkeypatch.setenv("PCCL_CONNECT_TIMEOUT", "0")
    with pytest.raises(ValueError, match="PCCL_CONNECT_TIMEOUT"):
        config.connect_timeout_s()


def test_status_port(monkeypatch):
    monkeypatch.delenv("PCCL_STATUS_PORT", raising=False)
    assert config.status_port() is None
    for value, port in (("0", 0), (" 8080 ", 8080), ("65535", 65535)):
        monkeypatch.setenv("PCCL_STATUS_PORT", value)
        assert config.status_port() == port
    for junk in ("-1", "65536", "http", "80.5"):
        monkeypatch.setenv("PCCL_STATUS_PORT", junk)
        with pytest.raises(ValueError, match="PCCL_STATUS_PORT"):
            config.status_port()
