"""Result codes become exceptions beside the native binding (``core.results``), with the
native layer's description of each code; the classes (``errors``) need no extension."""

import pytest

pytestmark = [pytest.mark.timeout(60), pytest.mark.pccl_only]


def test_native_errors_carry_the_native_description_of_their_code():
    from torch_pccl import errors
    from torch_pccl.core.native import ffi, lib
    from torch_pccl.core.results import native_error

    for code in [*range(1, lib.pcclNumResults), 99]:
        err = native_error(code, "detail")
        name = ffi.string(lib.pcclGetErrorString(code)).decode()
        assert str(err) == f"{name}: detail", code
        assert type(err) is errors.error_class(code) and err.code == code


def test_check_result_carries_the_native_detail():
    from torch_pccl.core.native import ffi, lib
    from torch_pccl.core.results import check_result
    from torch_pccl.errors import InvalidArgumentError

    check_result(0)
    out = ffi.new("pcclComm_t *")
    rc = lib.pcclCommCreate(out, 3, 2, 1, ffi.NULL)     # rank 3 of a group of 2
    assert rc == lib.pcclInvalidArgument
    lib.pcclCommDestroy(out[0])                          # NULL or a partial handle: freed
    with pytest.raises(InvalidArgumentError, match=r"^invalid argument: .+") as info:
        check_result(rc)
    assert info.value.code == rc and info.value.detail


def test_the_errors_module_describes_a_code_without_the_extension():
    from torch_pccl.errors import PeerLostError, check_result, result_error

    err = result_error(4, "rank 1 closed the connection")
    assert isinstance(err, PeerLostError)
    assert str(err) == "PeerLostError: rank 1 closed the connection" and err.code == 4
    assert str(result_error(4, "gone", "peer lost")) == "peer lost: gone"
    check_result(0)
    with pytest.raises(PeerLostError, match="^PeerLostError: gone$"):
        check_result(4, detail="gone")
