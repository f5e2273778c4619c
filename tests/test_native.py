"""The native layer on its own: the public header is strict C99, and the I/O-free
parts (wire codec, conversions, reduce kernels, schedules executed in memory)
pass their C++ unit tests under AddressSanitizer and UndefinedBehaviorSanitizer.
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NATIVE = os.path.join(ROOT, "native")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("cc") is None,
                                reason="needs a C and a C++ compiler")


def test_public_header_is_strict_c99(tmp_path):
    src = tmp_path / "use_header.c"
    src.write_text('#include "pccl.h"\nint main(void) { return (int)pcclSuccess; }\n')
    subprocess.run(
        ["cc", "-std=c99", "-pedantic", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
         "-I", os.path.join(NATIVE, "include"), str(src)],
        check=True, capture_output=True, text=True)


def test_native_unit_tests_under_sanitizers(tmp_path):
    exe = tmp_path / "test_native"
    sources = [os.path.join(NATIVE, "tests", "test_native.cpp")] + [
        os.path.join(NATIVE, "src", f) for f in ("wire.cpp", "reduce.cpp", "schedule.cpp")]
    build = subprocess.run(
        ["g++", "-std=c++17", "-O1", "-g", "-Wall", "-Werror", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=undefined", "-I", os.path.join(NATIVE, "include"), *sources,
         "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all passed" in run.stdout
