"""A timed-out op says so in torch's words: " Timed out " (what torch's _test_barrier_timeout
matches) and "Timed out waiting <T>ms" (gloo's wording, matched by test_barrier_timeout_arg),
no earlier than its deadline."""

import re

import pytest

pytestmark = pytest.mark.timeout(120)

TORCH_TIMEOUT = re.compile(" (Timed out|closed|timeout) ")


@pytest.mark.parametrize("timeout_s", (1.0, 0.001))
def test_lone_barrier_times_out_in_torchs_words(fresh_group, timeout_s):
    pool = fresh_group(2, 30.0)
    rec = pool.run("fidelity.lone_barrier", timeout_s, ranks=[0], deadline_s=30)[0]
    assert rec is not None, "a barrier nobody else called returned"
    assert "RuntimeError" in rec["mro"], rec
    assert TORCH_TIMEOUT.search(rec["message"]), rec["message"]
    assert f"Timed out waiting {round(timeout_s * 1000)}ms" in rec["message"], rec["message"]
    assert timeout_s - 0.1 <= rec["elapsed"] < timeout_s + 5, rec["elapsed"]
