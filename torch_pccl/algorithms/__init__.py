"""Algorithms built on a pccl group: the quantized and the non-finite-rejecting all-reduces,
and the DiLoCo family.

Submodules: ``quantized`` (``all_reduce_quantized``), ``finite``
(``all_reduce_finite``: contributions holding an inf or NaN are left out and their
senders named) and ``diloco`` (``DiLoCo``, ``StreamingDiLoCo``, ``AsyncDiLoCo``); the
public names are re-exported by ``torch_pccl``.
"""
