"""Deterministic test inputs, reference results and tensor packing.

Imported by both the pytest process and the worker processes: a worker builds
its input from (seed, rank) and the parent rebuilds every rank's input from the
same pair to compute the reference result, so no input ever crosses a pipe.
"""

import hashlib

import torch

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
INT_DTYPES = ("int8", "uint8", "int32", "int64")
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")

# Integer input ranges [low, high) per op, chosen so that no reduction over up
# to 4 ranks overflows the dtype: the reference can then be computed exactly in
# int64 and compared bit for bit.
_INT_RANGES = {
    ("int8", "sum"): (-30, 31),
    ("uint8", "sum"): (0, 61),
    ("int32", "sum"): (-(2**28), 2**28),
    ("int64", "sum"): (-(2**60), 2**60),
    ("int8", "prod"): (-2, 3),
    ("uint8", "prod"): (0, 4),
    ("int32", "prod"): (-100, 101),
    ("int64", "prod"): (-10_000, 10_001),
    ("int8", "minmax"): (-128, 128),
    ("uint8", "minmax"): (0, 256),
    ("int32", "minmax"): (-(2**31), 2**31),
    ("int64", "minmax"): (-(2**63), 2**63 - 1),
}


def _op_family(op):
    return {"SUM": "sum", "AVG": "sum", "PRODUCT": "prod", "MIN": "minmax", "MAX": "minmax"}[op]


def _generator(seed, rank):
    g = torch.Generator()
    g.manual_seed(seed * 1009 + rank * 7919 + 17)
    return g


def make_input(seed, rank, numel, dtype, op="SUM"):
    """Returns rank's deterministic input: `numel` elements of `dtype` (a name in DTYPES)."""
    g = _generator(seed, rank)
    family = _op_family(op)
    if dtype in FLOAT_DTYPES:
        if family == "prod":
            # Magnitudes near 1 (so products of 4 stay small), random signs.
            mag = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
            sign = torch.randint(0, 2, (numel,), generator=g, dtype=torch.int64) * 2 - 1
            values = mag * sign
        else:
            values = torch.rand(numel, generator=g, dtype=torch.float64) * 2 - 1
        return values.to(DTYPES[dtype])
    low, high = _INT_RANGES[(dtype, family)]
    return torch.randint(low, high, (numel,), generator=g, dtype=torch.int64).to(DTYPES[dtype])


def eps(dtype):
    return torch.finfo(DTYPES[dtype]).eps


def reduce_reference(inputs, op, dtype):
    """Reduces the per-rank inputs in float64 (floats) or int64 (ints).

    Returns (reference, scale): reference in the wide type; scale bounds the
    magnitude of every intermediate result, for the float tolerance.
    """
    n = len(inputs)
    if dtype in FLOAT_DTYPES:
        x = torch.stack([t.to(torch.float64) for t in inputs])
    else:
        x = torch.stack([t.to(torch.int64) for t in inputs])
    if op == "SUM":
        ref = x.sum(0)
    elif op == "AVG":
        s = x.sum(0)
        ref = s / n if dtype in FLOAT_DTYPES else torch.div(s, n, rounding_mode="trunc")
    elif op == "MIN":
        ref = x.min(0).values
    elif op == "MAX":
        ref = x.max(0).values
    elif op == "PRODUCT":
        ref = x.prod(0)
    else:
        raise AssertionError(op)
    scale = None
    if dtype in FLOAT_DTYPES:
        a = x.abs()
        scale = a.prod(0) if op == "PRODUCT" else a.sum(0)
    return ref, scale


def assert_reduced(got, inputs, op, dtype, what=""):
    """Asserts `got` (a tensor of `dtype`) equals op over `inputs` within dtype tolerance.

    Exact for integers and for MIN/MAX; for float SUM/AVG/PRODUCT the error may
    be one rounding per ring step plus the final rounding to `dtype`.
    """
    ref, scale = reduce_reference(inputs, op, dtype)
    assert got.dtype == DTYPES[dtype], f"{what}: dtype {got.dtype}, expected {dtype}"
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    if got.numel() == 0:
        return
    if dtype in INT_DTYPES or op in ("MIN", "MAX"):
        expected = ref.to(DTYPES[dtype])
        bad = (got != expected).nonzero()
        assert bad.numel() == 0, (
            f"{what}: {bad.shape[0]} of {got.numel()} elements differ, first at {bad[0].item()}: "
            f"got {got[bad[0]].item()}, expected {expected[bad[0]].item()}"
        )
        return
    n = len(inputs)
    # Unit roundoff eps/2 per rounding: at most n - 1 ring steps plus a final rounding
    # (AVG's division), each bounded by the largest intermediate magnitude `scale`.
    tol = (n + 1) * (eps(dtype) / 2) * scale
    if op == "AVG":
        tol = tol / n
    tol = tol + 4 * torch.finfo(DTYPES[dtype]).tiny
    err = (got.to(torch.float64) - ref).abs()
    bad = (err > tol).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} of {got.numel()} elements out of tolerance, first at "
        f"{bad[0].item()}: got {got[bad[0]].item()!r}, expected {ref[bad[0]].item()!r} "
        f"(tolerance {tol[bad[0]].item():.3g})"
    )


def assert_equal(got, expected, what=""):
    """Bit-exact comparison of two tensors (dtype, shape and bytes)."""
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    assert got.shape == expected.shape, (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    )
    if got.numel() == 0:
        return
    bad = (_bits(got) != _bits(expected)).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} of {got.numel()} elements differ, first at flat index "
        f"{bad[0].item()}: got {got.reshape(-1)[bad[0]].item()!r}, "
        f"expected {expected.reshape(-1)[bad[0]].item()!r}"
    )


def _bits(t):
    t = t.contiguous().reshape(-1)
    if t.dtype.is_floating_point:
        t = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


# --- packing tensors for the pipe -------------------------------------------------------------


def pack(t, raw=True):
    """A picklable, torch-independent record of a tensor: dtype, shape, digest, bytes.

    Raw bytes are left out when raw=False (large results: other ranks send only
    the digest, which the parent compares with rank 0's).
    """
    t = t.detach().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {
        "dtype": str(t.dtype).replace("torch.", ""),
        "shape": tuple(t.shape),
        "digest": hashlib.sha256(data).hexdigest(),
        "raw": data if raw else None,
    }


def unpack(rec):
    dtype = DTYPES[rec["dtype"]] if rec["dtype"] in DTYPES else getattr(torch, rec["dtype"])
    if rec["raw"] is None:
        raise AssertionError("record carries only a digest")
    if not rec["raw"]:
        return torch.empty(rec["shape"], dtype=dtype)
    flat = torch.frombuffer(bytearray(rec["raw"]), dtype=torch.uint8).view(dtype)
    return flat.reshape(rec["shape"])


def assert_identical_across_ranks(records, what=""):
    """Asserts every rank's packed result has the same dtype, shape and bytes."""
    first = records[0]
    for rank, rec in enumerate(records):
        assert (rec["dtype"], rec["shape"]) == (first["dtype"], first["shape"]), (
            f"{what}: rank {rank} has {rec['dtype']}{list(rec['shape'])}, "
            f"rank 0 has {first['dtype']}{list(first['shape'])}"
        )
        assert rec["digest"] == first["digest"], (
            f"{what}: rank {rank}'s result bytes differ from rank 0's"
        )
