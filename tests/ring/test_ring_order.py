"""The ring solver (``torch_pccl.ring.order``), pure: known optima on hand-made
matrices, a brute-force cross-check, the heuristic on planted rings, determinism and the
argument checks."""

import itertools
import math
import os
import random
import subprocess
import sys

import pytest

from torch_pccl.ring import order as ring_order
from torch_pccl.ring.order import EXACT_LIMIT, MAX_EXACT_LIMIT, best_ring, ring_bottleneck

GBIT, MBIT = 1e9 / 8, 1e6 / 8                # bytes/s
FAST, SLOW = 1e9, 1e7


def _uniform(n, value):
    return [[value] * n for _ in range(n)]


def _inverse_sum(order, bw):
    n = len(order)
    return math.fsum(1.0 / bw[order[k - 1]][order[k]] if bw[order[k - 1]][order[k]] > 0
                     else math.inf for k in range(n))


def _rings(n):
    """Every directed ring once: rank 0 first."""
    return [[0, *rest] for rest in itertools.permutations(range(1, n))]


def _assert_ring(order, n):
    assert isinstance(order, list) and order[:1] == [0] and sorted(order) == list(range(n))


def _planted(n, seed, fast_chords=0.0):
    """Slow links everywhere, one fast ring through every rank in a random order and, with
    ``fast_chords``, that share of the other links fast too. Returns (matrix, planted ring)."""
    rng = random.Random(seed)
    bw = [[rng.uniform(1e6, 1e7) for _ in range(n)] for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if rng.random() < fast_chords:
                bw[i][j] = rng.uniform(1e8, 1e9)
    ring = list(range(n))
    rng.shuffle(ring)
    for k in range(n):
        bw[ring[k - 1]][ring[k]] = rng.uniform(1e8, 1e9)
    return bw, ring


# --- ring_bottleneck ---------------------------------------------------------------------

def test_the_bottleneck_is_the_slowest_directed_hop():
    bw = [[0, 5, 1, 1],
          [1, 0, 7, 1],
          [1, 1, 0, 3],
          [9, 2, 1, 0]]
    assert ring_bottleneck([0, 1, 2, 3], bw) == 3          # 5, 7, 3, 9
    assert ring_bottleneck((1, 2, 3, 0), bw) == 3          # a rotation is the same ring
    assert ring_bottleneck(range(4), bw) == 3
    assert ring_bottleneck([0, 3, 2, 1], bw) == 1          # the reverse uses the other direction


def test_one_and_two_ranks():
    assert ring_bottleneck([0], [[0.0]]) == math.inf       # no hop
    assert ring_bottleneck([0, 1], [[0, 4], [6, 0]]) == 4  # both directions are hops
    assert ring_bottleneck([1, 0], [[0, 4], [6, 0]]) == 4
    assert best_ring([[0.0]]) == [0]
    assert best_ring([[0, 4], [6, 0]]) == [0, 1]


# --- best_ring on matrices with a known optimum -------------------------------------------

def test_the_ring_avoids_the_slow_pairs_benchmark_scenario_c():
    # 4 peers on 1 Gbit/s, but pairs (0,1) and (2,3) share 100 Mbit/s: rank order uses both.
    bw = _uniform(4, GBIT)
    for a, b in ((0, 1), (2, 3)):
        bw[a][b] = bw[b][a] = 100 * MBIT
    assert ring_bottleneck(range(4), bw) == 100 * MBIT
    order = best_ring(bw)
    assert order in ([0, 2, 1, 3], [0, 3, 1, 2])
    assert ring_bottleneck(order, bw) == GBIT


@pytest.mark.parametrize("n", [5, 6])
def test_the_only_fast_hamiltonian_cycle_is_found(n):
    # A fast ring 0 -> 2 -> 4 -> 1 -> 3 (-> 5) -> 0 and fast chords that close no other ring.
    cycle = [0, 2, 4, 1, 3, 5][:n]
    bw = _uniform(n, SLOW)
    for k in range(n):
        bw[cycle[k - 1]][cycle[k]] = FAST
    for a, b in ((0, 1), (1, 0), (2, 3), (4, 0)):
        bw[a][b] = FAST
    fast = [r for r in _rings(n) if ring_bottleneck(r, bw) == FAST]
    assert fast == [cycle], "the matrix must hold exactly one fast ring"
    assert best_ring(bw) == cycle
    assert best_ring(bw, exact_limit=0) == cycle           # the heuristic too


def test_directed_bandwidths_choose_the_reverse_ring():
    # Rank order is fast in one direction only; the ring must go the other way round.
    bw = _uniform(4, SLOW)
    for k in range(4):
        bw[k][k - 1] = FAST                               # k -> k-1 fast, k -> k+1 slow
        bw[k - 1][k] = 2 * SLOW
    assert ring_bottleneck([0, 1, 2, 3], bw) == 2 * SLOW
    assert best_ring(bw) == [0, 3, 2, 1]
    assert ring_bottleneck([0, 3, 2, 1], bw) == FAST


def test_the_bottleneck_beats_pccls_sum_of_inverses():
    # Ring A = 0-1-2-3-0 has every hop at 10; ring B = 0-3-2-1-0 has three hops at 1000
    # and one at 5. Sum of 1/bandwidth prefers B (0.203 < 0.4); B runs at 5, A at 10.
    bw = _uniform(4, 1.0)
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 0)):
        bw[a][b] = 10.0
    for a, b, w in ((0, 3, 1000.0), (3, 2, 1000.0), (2, 1, 1000.0), (1, 0, 5.0)):
        bw[a][b] = w
    pccl = min(_rings(4), key=lambda r: _inverse_sum(r, bw))
    assert pccl == [0, 3, 2, 1]
    ours = best_ring(bw)
    assert ours == [0, 1, 2, 3]
    assert ring_bottleneck(ours, bw) > ring_bottleneck(pccl, bw)


def test_ties_go_to_the_smallest_sum_of_inverses():
    # Both 0-1-2-3-0 and 0-2-1-3-0 (and more) run at 10; 0-2-1-3-0's other hops are faster.
    bw = _uniform(4, 10.0)
    for a, b in ((0, 2), (2, 1), (1, 3)):
        bw[a][b] = 1000.0
    assert best_ring(bw) == [0, 2, 1, 3]
    assert best_ring(bw, exact_limit=0) == [0, 2, 1, 3]


def test_missing_links():
    # An all-zero matrix still gives a ring; zeros are avoided where a ring can avoid them.
    for n in (3, 5, 16):
        order = best_ring(_uniform(n, 0.0))
        _assert_ring(order, n)
        assert ring_bottleneck(order, _uniform(n, 0.0)) == 0.0
    bw = _uniform(5, 0.0)
    for a, b in ((0, 3), (3, 1), (1, 4), (4, 2), (2, 0)):
        bw[a][b] = 1.0
    assert best_ring(bw) == [0, 3, 1, 4, 2]
    assert best_ring(bw, exact_limit=0) == [0, 3, 1, 4, 2]


def test_an_unbounded_link_is_allowed():
    bw = _uniform(4, 5.0)
    bw[0][2] = bw[2][1] = math.inf
    order = best_ring(bw)
    assert ring_bottleneck(order, bw) == 5.0
    assert order == [0, 2, 1, 3]                           # two hops cost nothing


# --- against brute force ------------------------------------------------------------------

def _random_matrix(rng, n):
    kind = rng.randrange(3)
    if kind == 0:                                          # distinct values
        return [[rng.uniform(1e6, 1e9) for _ in range(n)] for _ in range(n)]
    if kind == 1:                                          # many ties
        return [[float(rng.choice((1, 2, 3, 10))) for _ in range(n)] for _ in range(n)]
    return [[rng.choice((0.0, 1.0, 7.0, 1e9, math.inf)) for _ in range(n)] for _ in range(n)]


@pytest.mark.parametrize("n", range(1, 8))
def test_the_exact_solver_matches_brute_force(n):
    rng = random.Random(1000 + n)
    for _ in range(25):
        bw = _random_matrix(rng, n)
        optimum = max(ring_bottleneck(r, bw) for r in _rings(n))
        order = best_ring(bw)
        _assert_ring(order, n)
        assert ring_bottleneck(order, bw) == optimum
        if n >= 3:                                         # and the tie-break is exact
            least = min(_inverse_sum(r, bw) for r in _rings(n)
                        if ring_bottleneck(r, bw) == optimum)
            got = _inverse_sum(order, bw)
            assert got == least or math.isclose(got, least, rel_tol=1e-12)
        heuristic = best_ring(bw, exact_limit=0)
        _assert_ring(heuristic, n)
        assert ring_bottleneck(heuristic, bw) == optimum


def test_the_bottleneck_does_not_depend_on_the_ranks_names():
    rng = random.Random(7)
    for n in (6, 9, 12):
        bw = _random_matrix(rng, n)
        names = list(range(n))
        rng.shuffle(names)                                 # rank i is renamed names[i]
        renamed = [[0.0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                renamed[names[i]][names[j]] = bw[i][j]
        assert ring_bottleneck(best_ring(renamed), renamed) == \
            ring_bottleneck(best_ring(bw), bw)


# --- the heuristic above the exact limit --------------------------------------------------

@pytest.mark.parametrize("n", [16, 17, 18, 19, 20])
def test_the_heuristic_finds_a_planted_fast_ring(n):
    assert n > EXACT_LIMIT
    bw, planted = _planted(n, seed=n)
    order = best_ring(bw)
    _assert_ring(order, n)
    # The planted ring is the only one without a slow hop: nothing else reaches its bottleneck.
    assert ring_bottleneck(order, bw) == ring_bottleneck(planted, bw)
    assert order == planted[planted.index(0):] + planted[:planted.index(0)]


@pytest.mark.parametrize("n", [16, 18, 20])
@pytest.mark.parametrize("chords", [0.1, 0.3])
def test_the_heuristic_finds_a_planted_ring_among_fast_chords(n, chords):
    bw, planted = _planted(n, seed=100 * n + int(chords * 10), fast_chords=chords)
    order = best_ring(bw)
    _assert_ring(order, n)
    assert ring_bottleneck(order, bw) >= ring_bottleneck(planted, bw)


def test_the_exact_solver_and_the_heuristic_agree_at_the_limit():
    for seed in range(3):
        bw, planted = _planted(EXACT_LIMIT, seed, fast_chords=0.2)
        exact = best_ring(bw)
        heuristic = best_ring(bw, exact_limit=EXACT_LIMIT - 1)
        assert ring_bottleneck(exact, bw) >= ring_bottleneck(planted, bw)
        assert ring_bottleneck(heuristic, bw) == ring_bottleneck(exact, bw)
        assert _inverse_sum(heuristic, bw) >= _inverse_sum(exact, bw) * (1 - 1e-12)


# --- determinism --------------------------------------------------------------------------

def test_the_same_matrix_gives_the_same_ring():
    rng = random.Random(3)
    for n in (4, 9, EXACT_LIMIT, 18):
        bw = [[float(rng.choice((1, 2, 3))) for _ in range(n)] for _ in range(n)]   # many ties
        first = best_ring(bw)
        assert best_ring(bw) == first
        assert best_ring(tuple(tuple(int(v) for v in row) for row in bw)) == first


_CHILD = """
import importlib.util, json, random, sys
spec = importlib.util.spec_from_file_location("ring_order", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
rng = random.Random(5)
out = []
for n in (5, 8, 11, 17):
    bw = [[float(rng.choice((1, 2, 3))) for _ in range(n)] for _ in range(n)]
    out.append(module.best_ring(bw))
assert "torch" not in sys.modules and "numpy" not in sys.modules
print(json.dumps(out))
"""


def test_every_process_gets_the_same_ring_whatever_its_hash_seed():
    # Peers are separate interpreters with their own hash randomisation; the module needs
    # only the standard library (it is loaded here without torch_pccl or torch).
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", _CHILD, ring_order.__file__], env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        outputs.add(done.stdout)
    assert len(outputs) == 1


# --- argument checks ----------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    ([], "empty"),
    ([[0, 1], [1]], "square"),
    ([[0, 1, 2], [1, 0, 2]], "square"),
    ([[0, float("nan")], [1, 0]], "NaN"),
    ([[0, -1.0], [1, 0]], "negative"),
    ([[0, -math.inf], [1, 0]], "negative"),
    ([[0, "fast"], [1, 0]], "not a number"),
    ([[0, None], [1, 0]], "not a number"),
    (["ab", "cd"], "string"),
    (5, "square matrix"),
])
def test_bad_matrices_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        best_ring(bad)
    with pytest.raises(ValueError, match=message):
        ring_bottleneck([0, 1], bad)


def test_the_diagonal_is_ignored():
    bw = [[float("nan"), 3.0], [4.0, -1.0]]
    assert ring_bottleneck([0, 1], bw) == 3.0
    assert best_ring(bw) == [0, 1]


@pytest.mark.parametrize("order", [[0, 1], [0, 1, 1], [0, 1, 3], [1.0, 0, 2], [True, 0, 2], 7])
def test_bad_orders_are_refused(order):
    with pytest.raises(ValueError, match="order"):
        ring_bottleneck(order, _uniform(3, 1.0))


@pytest.mark.parametrize("limit", [-1, MAX_EXACT_LIMIT + 1, 2.0, True, None])
def test_bad_exact_limits_are_refused(limit):
    with pytest.raises(ValueError, match="exact_limit"):
        best_ring(_uniform(3, 1.0), exact_limit=limit)
