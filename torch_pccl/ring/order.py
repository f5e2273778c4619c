"""The ring order with the largest bottleneck bandwidth: ``best_ring`` and ``ring_bottleneck``.

A pipelined ring all-reduce cuts the payload into chunks that travel around
the ring in one direction, and every byte crosses every hop; the hops work at
once, so the operation takes about ``bytes / (slowest hop's bandwidth)``. The
order of the ring therefore matters only through its *bottleneck*, the slowest
directed hop ``order[k] -> order[k+1]``, and the best order is the one that
maximises it: the bottleneck (maximin) travelling salesman problem
(Gilmore & Gomory 1964, "Sequencing a one state-variable machine";
Garfinkel & Gilbert 1978, "The bottleneck traveling salesman problem").

PCCL (arXiv 2505.14065) measured its links too but made two mistakes: it
minimised the *sum* of 1/bandwidth over the ring, which lets one very slow hop
hide behind many fast ones although that hop alone paces the ring, and the
order it optimised was never applied to its collectives.

How ``best_ring`` solves it:

* Exact (``n <= exact_limit``): the bottleneck problem is a decision problem per
  threshold ``t``: is there a directed Hamiltonian cycle among the edges of
  bandwidth ``>= t``? The largest such ``t`` is found by binary search over the
  matrix's distinct values, each question decided by a Held-Karp / Bellman
  subset dynamic programme (Held & Karp 1962, "A dynamic programming approach
  to sequencing problems"; Bellman 1962, "Dynamic programming treatment of the
  travelling salesman problem") on bitsets. A last Held-Karp pass over the
  edges ``>= t`` applies the tie-break. Time and memory grow as ``2^n n^2``.
* Heuristic (larger worlds): the same question per threshold, put to a
  depth-first search for a Hamiltonian cycle (most constrained next rank
  first, dead-end pruning, failed states remembered) bounded by a count of
  expanded states. A search that gives up proves nothing, so thresholds are
  probed from the largest strongly connected one downwards (sparse graphs are
  the easy ones), then bisected. Then local search (moving a segment of 1-3
  ranks elsewhere, reversing a segment) on the bottleneck, then the
  tie-break. Not guaranteed optimal.

Tie-break: among rings with the same bottleneck, the one with the smallest sum
of 1/bandwidth over its hops (the time one byte would take to go around the
ring hop after hop, i.e. PCCL's objective, used only second); exact below the
limit, a local optimum above it. Any tie left is broken by the solver's fixed
scan order (lower rank first).

Every peer runs this on the same matrix and must get the same list: the
result starts at rank 0 (the problem does not change under rotation), and
nothing depends on dict or set iteration order, hash randomisation, the clock
or a random generator; the heuristic's budgets count states, not seconds.
Standard library only; ``ring.optimize`` measures the matrix and applies the result.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

# Largest world solved exactly by default: at most about 0.06 s at n = 14 (see best_ring).
EXACT_LIMIT = 14
# Beyond this the exact solver's 2^n n^2 time and memory are refused.
MAX_EXACT_LIMIT = 20
# States the heuristic's depth-first search may expand per threshold it tries.
SEARCH_BUDGET = 20_000
# Passes of the heuristic's local search at most (each pass scans every move once).
LOCAL_SEARCH_PASSES = 50


def _matrix(bandwidth: Sequence[Sequence[float]]) -> list[list[float]]:
    """The checked matrix as floats; the diagonal is ignored (0.0)."""
    if isinstance(bandwidth, (str, bytes)):
        raise ValueError("bandwidth must be a square matrix (a sequence of rows), got a string")
    try:
        rows = [row for row in bandwidth]
    except TypeError:
        raise ValueError(f"bandwidth must be a square matrix (a sequence of rows), "
                         f"got {type(bandwidth).__name__}") from None
    n = len(rows)
    if n == 0:
        raise ValueError("bandwidth is empty: a ring needs at least one rank")
    matrix = []
    for i, row in enumerate(rows):
        if isinstance(row, (str, bytes)):
            raise ValueError(f"bandwidth row {i} is a string, not a sequence of numbers")
        try:
            values = list(row)
        except TypeError:
            raise ValueError(f"bandwidth must be square: row {i} is "
                             f"{type(row).__name__}, not a sequence") from None
        if len(values) != n:
            raise ValueError(f"bandwidth must be square: {n} rows, but row {i} has "
                             f"{len(values)} entries")
        out = []
        for j, v in enumerate(values):
            if i == j:
                out.append(0.0)
                continue
            if isinstance(v, (str, bytes)):
                raise ValueError(f"bandwidth[{i}][{j}] = {v!r} is not a number")
            try:
                x = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"bandwidth[{i}][{j}] = {v!r} is not a number") from None
            if math.isnan(x):
                raise ValueError(f"bandwidth[{i}][{j}] is NaN (a link not measured?); "
                                 f"use 0.0 for a missing link")
            if x < 0:
                raise ValueError(f"bandwidth[{i}][{j}] = {x!r} is negative; bytes/s must be >= 0")
            out.append(x)
        matrix.append(out)
    return matrix


def _permutation(order: Iterable[int], n: int) -> list[int]:
    """``order`` as a list, checked to hold each of 0..n-1 once."""
    try:
        ring = list(order)
    except TypeError:
        raise ValueError(f"order must be a sequence of ranks, got {type(order).__name__}") from None
    if len(ring) != n or sorted(ring) != list(range(n)) or \
            any(isinstance(r, bool) or not isinstance(r, int) for r in ring):
        raise ValueError(f"order must hold each rank 0..{n - 1} once, got {ring!r}")
    return ring


def _bottleneck(ring: Sequence[int], bw: list[list[float]]) -> float:
    n = len(ring)
    if n == 1:
        return math.inf
    return min(bw[ring[k - 1]][ring[k]] for k in range(n))


def _inverse(w: float) -> float:
    """Seconds per byte over a hop of ``w`` bytes/s (inf for a missing link)."""
    return 1.0 / w if w > 0 else math.inf


def _key(ring: Sequence[int], bw: list[list[float]]) -> tuple[float, float]:
    """What the solver maximises, compared as a tuple: bottleneck, then -sum of 1/bandwidth."""
    n = len(ring)
    if n == 1:
        return (math.inf, 0.0)
    return (_bottleneck(ring, bw), -math.fsum(_inverse(bw[ring[k - 1]][ring[k]]) for k in range(n)))


def _thresholds(bw: list[list[float]]) -> list[float]:
    """The distinct off-diagonal values, ascending."""
    n = len(bw)
    return sorted({bw[i][j] for i in range(n) for j in range(n) if i != j})


def _edges_at_least(bw: list[list[float]], t: float) -> tuple[list[int], list[int]]:
    """Bitsets of the graph of edges >= t: ``succ[i]`` (bit j: i -> j) and ``pred[j]``."""
    n = len(bw)
    succ, pred = [0] * n, [0] * n
    for i in range(n):
        for j in range(n):
            if i != j and bw[i][j] >= t:
                succ[i] |= 1 << j
                pred[j] |= 1 << i
    return succ, pred


def _upper_bound(bw: list[list[float]]) -> float:
    """No ring beats this: every rank needs one outgoing and one incoming hop."""
    n = len(bw)
    best_out = min(max(bw[i][j] for j in range(n) if j != i) for i in range(n))
    best_in = min(max(bw[i][j] for i in range(n) if i != j) for j in range(n))
    return min(best_out, best_in)


def _has_hamiltonian_cycle(succ: list[int], pred: list[int]) -> bool:
    """Held-Karp on bitsets: is there a directed cycle through every node (n >= 2)?

    Nodes 1..n-1 are bits 0..n-2 of ``mask``; ``ends[mask]`` has bit k set when a
    path leaves node 0, visits exactly ``mask`` and ends at node k+1. Bit n-1
    of ``ends[0]`` stands for node 0 itself, the start.
    """
    n = len(succ)
    m = n - 1
    start = 1 << m
    # into[k]: the nodes with an edge to node k+1, node 0 as bit m.
    into = [(pred[k + 1] >> 1) | (start if pred[k + 1] & 1 else 0) for k in range(m)]
    ends = [0] * (1 << m)
    ends[0] = start
    for mask in range(1, 1 << m):
        reached = 0
        rest = mask
        while rest:
            low = rest & -rest
            if into[low.bit_length() - 1] & ends[mask ^ low]:
                reached |= low
            rest ^= low
        ends[mask] = reached
    return bool(ends[(1 << m) - 1] & (pred[0] >> 1))


def _cheapest_cycle(bw: list[list[float]], succ: list[int], pred: list[int]) -> list[int]:
    """Held-Karp: the cycle from node 0 with the least sum of 1/bandwidth over the given edges.

    The caller guarantees that one exists. Ties go to the lower node at each
    step (strict comparisons, ascending scans).
    """
    n = len(bw)
    m = n - 1
    inv = [[_inverse(bw[i][j]) for j in range(n)] for i in range(n)]
    into = [pred[k + 1] >> 1 for k in range(m)]     # predecessors among nodes 1..n-1
    size = 1 << m
    cost: list[list[float | None]] = [[]] * size
    parent: list[list[int]] = [[]] * size
    for mask in range(1, size):
        row: list[float | None] = [None] * m
        back = [-1] * m
        rest = mask
        while rest:
            low = rest & -rest
            v = low.bit_length() - 1
            rest ^= low
            before = mask ^ low
            if before == 0:
                if pred[v + 1] & 1:
                    row[v] = inv[0][v + 1]
                continue
            prow = cost[before]
            best = None
            arg = -1
            cand = into[v] & before
            while cand:
                lu = cand & -cand
                u = lu.bit_length() - 1
                cand ^= lu
                pc = prow[u]
                if pc is None:
                    continue
                val = pc + inv[u + 1][v + 1]
                if best is None or val < best:
                    best, arg = val, u
            row[v] = best
            back[v] = arg
        cost[mask] = row
        parent[mask] = back
    full = size - 1
    best_total, last = None, -1
    for v in range(m):
        c = cost[full][v]
        if c is not None and pred[0] >> (v + 1) & 1:
            total = c + inv[v + 1][0]
            if best_total is None or total < best_total:
                best_total, last = total, v
    if last < 0:
        raise AssertionError("no Hamiltonian cycle among the edges at the bottleneck threshold")
    path = []
    mask, v = full, last
    while v >= 0:
        path.append(v + 1)
        mask, v = mask ^ (1 << v), parent[mask][v]
    return [0] + path[::-1]


def _exact(bw: list[list[float]]) -> list[int]:
    weights = _thresholds(bw)
    lo = 0                                           # a complete digraph (n >= 3) has a ring
    hi = bisect.bisect_right(weights, _upper_bound(bw)) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _has_hamiltonian_cycle(*_edges_at_least(bw, weights[mid])):
            lo = mid
        else:
            hi = mid - 1
    return _cheapest_cycle(bw, *_edges_at_least(bw, weights[lo]))


def _strongly_connected(succ: list[int], pred: list[int]) -> bool:
    n = len(succ)
    full = (1 << n) - 1
    for adj in (succ, pred):
        seen, frontier = 1, 1
        while frontier:
            nxt = 0
            while frontier:
                low = frontier & -frontier
                frontier ^= low
                nxt |= adj[low.bit_length() - 1]
            frontier = nxt & ~seen
            seen |= nxt
        if seen != full:
            return False
    return True


def _search_cycle(succ: list[int], pred: list[int], budget: int) -> list[int] | None:
    """Depth-first search for a Hamiltonian cycle from node 0, or None (none, or budget spent).

    Next rank: the one with the fewest onward choices first (Warnsdorff's rule),
    lower rank on ties. A state is dropped when an unvisited rank has no
    possible predecessor or successor left, or when two unvisited ranks can
    only be entered from the current one; a rank that only the current one can
    enter is taken next. Failed states (visited set, current rank) are
    remembered.
    """
    n = len(succ)
    full = (1 << n) - 1
    if not _strongly_connected(succ, pred):
        return None
    failed: set[tuple[int, int]] = set()
    expanded = 0

    def choices(visited: int, cur: int) -> list[int] | None:
        """The ranks to try after ``cur``, best first; None for a dead state."""
        remaining = full & ~visited
        if not remaining:
            return [0] if succ[cur] & 1 else None
        if not pred[0] & remaining:
            return None
        open_in = remaining | (1 << cur)
        open_out = remaining | 1
        forced = -1
        rest = remaining
        while rest:
            low = rest & -rest
            rest ^= low
            w = low.bit_length() - 1
            ins = pred[w] & open_in & ~low
            if not ins or not succ[w] & open_out & ~low:
                return None
            if ins == 1 << cur:
                if forced >= 0:
                    return None
                forced = w
        if forced >= 0:
            return [forced]
        cand = succ[cur] & remaining
        ranked = []
        while cand:
            low = cand & -cand
            cand ^= low
            u = low.bit_length() - 1
            ranked.append(((succ[u] & remaining & ~low).bit_count(), u))
        ranked.sort()
        return [u for _, u in ranked]

    path = [0]
    visited = 1
    stack = [choices(visited, 0) or []]
    while stack:
        options = stack[-1]
        if not options:
            stack.pop()
            cur = path.pop()
            if stack:
                failed.add((visited, cur))
                visited ^= 1 << cur
            continue
        u = options.pop(0)
        if u == 0:                                   # every rank visited and the ring closes
            return path[:]
        if (visited | 1 << u, u) in failed:
            continue
        expanded += 1
        if expanded > budget:
            return None
        visited |= 1 << u
        path.append(u)
        stack.append(choices(visited, u) or [])
    return None


def _promising(score: float, change: float, key: tuple[float, float]) -> bool:
    """A faster bottleneck than ``key``'s, or the same one and (estimated) a smaller sum of 1/bw."""
    return score > key[0] or (score == key[0] and change < 0)


def _improved(candidate: list[int], bw: list[list[float]],
              key: tuple[float, float]) -> tuple[list[int], tuple[float, float]] | None:
    """``candidate`` and its key when the key, computed on the whole ring, beats ``key``."""
    new_key = _key(candidate, bw)
    return (candidate, new_key) if new_key > key else None


def _move_segment(ring: list[int], bw: list[list[float]], inv: list[list[float]],
                  key: tuple[float, float]) -> tuple[list[int], tuple[float, float]] | None:
    """The first move of ``ring[i:i+length]`` (1-3 ranks) to another place that improves ``key``."""
    n = len(ring)
    hops = [bw[ring[k]][ring[(k + 1) % n]] for k in range(n)]       # hop k: position k -> k+1
    slowest = sorted(range(n), key=lambda k: (hops[k], k))[:4]      # a move removes 3 hops
    for length in (1, 2, 3):
        for i in range(1, n - length + 1):
            a, first, last = ring[i - 1], ring[i], ring[i + length - 1]
            b = ring[(i + length) % n]
            for j in range(n):                   # between ring[j] and ring[j+1]
                if i - 1 <= j <= i + length - 1:
                    continue
                x, y = ring[j], ring[(j + 1) % n]
                kept = next((hops[k] for k in slowest if k not in (i - 1, i + length - 1, j)),
                            math.inf)
                score = min(kept, bw[a][b], bw[x][first], bw[last][y])
                change = (inv[a][b] + inv[x][first] + inv[last][y]
                          - inv[a][first] - inv[last][b] - inv[x][y])
                if not _promising(score, change, key):
                    continue
                rest = ring[:i] + ring[i + length:]
                at = rest.index(x) + 1
                better = _improved(rest[:at] + ring[i:i + length] + rest[at:], bw, key)
                if better:
                    return better
    return None


def _reverse_segment(ring: list[int], bw: list[list[float]], inv: list[list[float]],
                     key: tuple[float, float]) -> tuple[list[int], tuple[float, float]] | None:
    """The first reversal of ``ring[i..k]`` (inner hops change direction) improving ``key``."""
    n = len(ring)
    hops = [bw[ring[k]][ring[(k + 1) % n]] for k in range(n)]
    prefix = [math.inf] * (n + 1)                # prefix[p]: the slowest of hops 0..p-1
    for p in range(n):
        prefix[p + 1] = min(prefix[p], hops[p])
    suffix = [math.inf] * (n + 1)                # suffix[p]: the slowest of hops p..n-1
    for p in range(n - 1, -1, -1):
        suffix[p] = min(suffix[p + 1], hops[p])
    for i in range(1, n - 1):
        a, first = ring[i - 1], ring[i]
        inner = math.inf
        change = 0.0                             # reversed inner hops minus the forward ones
        for k in range(i + 1, n):
            last, b = ring[k], ring[(k + 1) % n]
            inner = min(inner, bw[last][ring[k - 1]])
            change += inv[last][ring[k - 1]] - inv[ring[k - 1]][last]
            score = min(prefix[i - 1], suffix[k + 1], inner, bw[a][last], bw[first][b])
            if not _promising(score, change + inv[a][last] + inv[first][b]
                              - inv[a][first] - inv[last][b], key):
                continue
            better = _improved(ring[:i] + ring[i:k + 1][::-1] + ring[k + 1:], bw, key)
            if better:
                return better
    return None


def _local_search(ring: list[int], bw: list[list[float]]) -> list[int]:
    """Improves ``_key`` by segment moves, then reversals; first improvement, bounded passes.

    Rank 0 stays at position 0 (rotations are the same ring). A candidate is
    scored from the hops it changes and taken only when ``_key`` of the whole
    new ring is strictly larger, so the search cannot cycle.
    """
    inv = [[_inverse(w) for w in row] for row in bw]
    key = _key(ring, bw)
    for _ in range(LOCAL_SEARCH_PASSES):
        better = _move_segment(ring, bw, inv, key) or _reverse_segment(ring, bw, inv, key)
        if better is None:
            break
        ring, key = better
    return ring


def _heuristic(bw: list[list[float]]) -> list[int]:
    """Threshold search by ``_search_cycle``, then ``_local_search``.

    A threshold at which the bounded search finds no cycle is not proof that
    none exists, and dense graphs (low thresholds) are the hard ones, so the
    thresholds are probed from the top down: from the largest one whose graph
    is strongly connected (a necessary condition, monotone in the threshold),
    with steps 1, 2, 4, ... down to the first success, then by bisection between
    that success and the failure above it.
    """
    n = len(bw)
    weights = _thresholds(bw)
    best = list(range(n))
    known = bisect.bisect_left(weights, _bottleneck(best, bw))       # rank order's bottleneck
    lo, hi = known, bisect.bisect_right(weights, _upper_bound(bw)) - 1
    while lo < hi:                               # the largest strongly connected threshold
        mid = (lo + hi + 1) // 2
        if _strongly_connected(*_edges_at_least(bw, weights[mid])):
            lo = mid
        else:
            hi = mid - 1
    failed, step, probe = lo + 1, 1, lo
    lo = known
    while probe > lo:
        found = _search_cycle(*_edges_at_least(bw, weights[probe]), SEARCH_BUDGET)
        if found is not None:
            best = found
            lo = max(probe, bisect.bisect_left(weights, _bottleneck(found, bw)))
            break
        failed, probe, step = probe, probe - step, step * 2
    while lo + 1 < failed:
        mid = (lo + failed) // 2
        found = _search_cycle(*_edges_at_least(bw, weights[mid]), SEARCH_BUDGET)
        if found is None:
            failed = mid
        else:
            best = found
            lo = max(mid, bisect.bisect_left(weights, _bottleneck(found, bw)))
    return _local_search(best, bw)


def ring_bottleneck(order: Iterable[int], bandwidth: Sequence[Sequence[float]]) -> float:
    """The slowest hop of the directed ring ``order[0] -> order[1] -> ... -> order[0]``.

    Args:
        order: the rank at each ring position, each of 0..n-1 once.
        bandwidth: ``bandwidth[i][j]``, bytes/s from rank i to rank j (n x n,
            finite or +inf, >= 0; the diagonal is ignored).

    Returns:
        The smallest ``bandwidth[order[k]][order[k+1]]`` around the ring: for
        two ranks the smaller of the two directions, for one rank ``math.inf``
        (no hop).

    Raises:
        ValueError: a matrix that is not square, empty, or holds NaN, a negative
            value or a non-number; an order that is not a permutation of 0..n-1.
    """
    bw = _matrix(bandwidth)
    return _bottleneck(_permutation(order, len(bw)), bw)


def best_ring(bandwidth: Sequence[Sequence[float]], exact_limit: int = EXACT_LIMIT) -> list[int]:
    """The ring order with the largest bottleneck bandwidth, starting at rank 0.

    Exact for ``n <= exact_limit`` ranks (binary search over thresholds, Held-Karp
    per threshold; in CPython at most about 0.06 s at n = 14, 0.3 s at 16, 1.9 s
    at 18), a heuristic above it (threshold search by bounded depth-first
    search, then local search; milliseconds to about a second up to n = 64).
    Among rings with the same bottleneck it picks the one with the smallest sum
    of 1/bandwidth (exact below the limit). Deterministic: the same matrix gives
    the same list on every peer.

    Args:
        bandwidth: ``bandwidth[i][j]``, measured bytes/s from rank i to rank j
            (n x n, n >= 1; values >= 0, +inf allowed for an unbounded link,
            0 for a missing one; the diagonal is ignored).
        exact_limit: the largest world solved exactly, 0..``MAX_EXACT_LIMIT``.

    Returns:
        A permutation of 0..n-1 with ``order[0] == 0``: the ring
        ``order[0] -> order[1] -> ... -> order[0]``. With no ring free of
        missing links (e.g. an all-zero matrix) the order is still a valid
        permutation, with bottleneck 0.

    Raises:
        ValueError: a bad matrix (as ``ring_bottleneck``) or ``exact_limit``.
    """
    if isinstance(exact_limit, bool) or not isinstance(exact_limit, int) or \
            not 0 <= exact_limit <= MAX_EXACT_LIMIT:
        raise ValueError(f"exact_limit must be an int in 0..{MAX_EXACT_LIMIT}, got {exact_limit!r}")
    bw = _matrix(bandwidth)
    n = len(bw)
    if n <= 2:
        return list(range(n))
    if n <= exact_limit:
        return _exact(bw)
    return _heuristic(bw)


__all__ = ["EXACT_LIMIT", "MAX_EXACT_LIMIT", "best_ring", "ring_bottleneck"]
