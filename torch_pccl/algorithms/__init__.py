"""Algorithms built on a pccl group: the quantized all-reduce and the DiLoCo family.

Submodules: ``quantized`` (``all_reduce_quantized``) and ``diloco``
(``DiLoCo``, ``StreamingDiLoCo``, ``AsyncDiLoCo``); the public names are
re-exported by ``torch_pccl``.
"""
