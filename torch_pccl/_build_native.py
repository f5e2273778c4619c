"""cffi builder (API mode) for torch_pccl's native data plane.

setuptools runs this through ``cffi_modules`` in setup.py: it compiles every
``native/src/*.cpp`` file together with a generated C wrapper into the
extension ``torch_pccl._pccl_native``. The declarations given to ``ffi.cdef``
are the slice of ``native/include/pccl.h`` between its ``cffi-cdef-begin`` and
``cffi-cdef-end`` markers, read as is, so the header and the binding cannot
drift apart: a mismatch fails the build, not a run.
"""

import glob
import os

from cffi import FFI

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NATIVE = os.path.join(_ROOT, "native")
_HEADER = os.path.join(_NATIVE, "include", "pccl.h")


def _cdef_text(header_path):
    with open(header_path, encoding="ascii") as f:
        text = f.read()
    begin = text.index("cffi-cdef-begin")
    begin = text.index("*/", begin) + 2
    end = text.index("/* cffi-cdef-end */")
    return text[begin:end]


def _native_files(*patterns):
    # setuptools wants paths relative to setup.py's folder.
    files = sorted(f for p in patterns for f in glob.glob(os.path.join(_NATIVE, p)))
    return [os.path.relpath(f, _ROOT) for f in files]


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text(_HEADER))
ffibuilder.set_source(
    "torch_pccl._pccl_native",
    '#include "pccl.h"\n',
    sources=_native_files("src/*.cpp"),
    # setuptools rebuilds the extension only when one of these is newer than it: without the
    # headers, an edit to a struct in a .hpp alone kept the old objects, whose layouts then
    # disagreed with the ones rebuilt later (undefined behaviour, not a build error).
    depends=_native_files("src/*.hpp", "include/*.h"),
    include_dirs=[os.path.relpath(os.path.join(_NATIVE, "include"), _ROOT)],
    # The sources are C++17; the cffi wrapper itself is C. Flags that the C
    # compiler rejects are filtered by our build_ext in setup.py.
    extra_compile_args=["-O3", "-fvisibility=hidden", "-Wall"],
    # libcrypto (OpenSSL) for the data-plane authentication's HMAC-SHA256 and nonces (auth.cpp).
    libraries=["stdc++", "pthread", "crypto"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
