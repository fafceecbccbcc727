"""The torch.library namespace of the source package.

`cutile-kernels build` writes a `_ops.py` with a unique namespace into each build variant (the
`kernels` convention), so a Hub/local variant and this package can be loaded in one process.
"""
import torch

NAMESPACE = "cutile_kernels"
ops = getattr(torch.ops, NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix an op name with this package's namespace (`kernels` convention)."""
    return f"{NAMESPACE}::{op_name}"
