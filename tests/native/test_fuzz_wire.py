"""The libFuzzer targets of the native decoders, bounded: the wire codec (hello, frame header,
check_expected, abort_code) and the quantized payload codec, each built with ASan + UBSan and run
for a fixed number of inputs by benchmarks/fuzz_wire.py, the same script as the documented
1,000,000-input runs (docs/protocol.md#fuzzing).

A run passes only when libFuzzer executed every requested input (a fuzzer that silently ran
nothing, or stopped at its deadline, fails), exited 0, printed no sanitizer or property report
and left no crash artifact. Skipped, with the packages to install, where no clang++ with
libFuzzer is found (the CI script installs clang-14 where apt-get can).
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "fuzz_wire.py")
SKIP = 77  # the script's "no fuzzing compiler" status

# Inputs per target: a few seconds each on one core of the CI runner (wire ~40,000 inputs/s,
# quant ~10,000 inputs/s), plus a few seconds of build.
RUNS = {"wire": 100_000, "quant": 30_000}

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("target", sorted(RUNS))
def test_fuzz_target_bounded(target, tmp_path):
    runs = RUNS[target]
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--targets", target, "--runs", str(runs), "--max-seconds", "120",
         "--out", str(tmp_path)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=280)
    if proc.returncode == SKIP:
        pytest.skip(proc.stderr.strip())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]

    # The script's verdict is not taken on trust: its log and results are read again here.
    log = (tmp_path / f"fuzz_{target}.log").read_text()
    assert re.search(rf"^Done {runs} runs in \d+ second", log, re.MULTILINE), log[-3000:]
    assert not re.search(r"Sanitizer|runtime error:|property violated|ERROR: libFuzzer", log), \
        log[-6000:]
    assert os.listdir(tmp_path / f"artifacts_{target}") == []
    (result,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert result["passed"] and result["runs"] == runs
    # The seeds get past the magic numbers: the run reached well beyond the first checks.
    assert result["cov"] > 100 and result["ft"] > 200, result
