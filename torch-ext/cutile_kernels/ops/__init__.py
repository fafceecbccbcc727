"""Torch custom ops over the cuTile kernels, one module per op family, and their functional API."""

from .norm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]
