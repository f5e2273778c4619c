"""Communicator.set_option over the native typed config (pcclConfig_t, pcclCommSetConfig)."""

import pytest

from torch_pccl.core.communicator import Communicator
from torch_pccl.core.handle import CONFIG_FIELDS
from torch_pccl.errors import InvalidArgumentError, InvalidUsageError


def _connected(comm_id):
    comm = Communicator(0, 1, comm_id, "127.0.0.1", 5.0)
    comm.connect([f"127.0.0.1:{comm.port}"])
    return comm


def test_every_field_of_the_typed_config_is_settable_by_name():
    comm = Communicator(0, 1, 81, "127.0.0.1", 5.0)
    try:
        for name, value in (("streams", 2), ("link_timeout_ms", 2000),
                            ("chunk_bytes", 1 << 16), ("pacing", 1_000_000)):
            comm.set_option(name, value)
        assert set(CONFIG_FIELDS) == {"streams", "link_timeout_ms", "chunk_bytes", "pacing"}
    finally:
        comm.close()


@pytest.mark.parametrize("name, value, word", [
    ("chunk_bytes", 1, "chunk_bytes"),
    ("streams", 0, "streams"),
    ("link_timeout_ms", 10, "link_timeout_ms"),
    ("pacing", -2, "pacing"),
    ("no_such_option", 1, "unknown option"),
])
def test_a_bad_name_or_value_is_refused(name, value, word):
    comm = _connected(82)
    try:
        with pytest.raises(InvalidArgumentError, match=word):
            comm.set_option(name, value)
        comm.set_option("chunk_bytes", 8192)   # the handle is still configurable
    finally:
        comm.close()


@pytest.mark.parametrize("name, value", [("streams", 2), ("link_timeout_ms", 5000)])
def test_connect_time_fields_cannot_change_once_connected(name, value):
    comm = _connected(83)
    try:
        with pytest.raises(InvalidUsageError, match=name):
            comm.set_option(name, value)
        comm.set_option("pacing", 0)       # any time
    finally:
        comm.close()
