"""What every public op promises whatever the device: the dtypes it takes, and a one-line error
naming the op, the argument and the supported dtypes for any other (CPU)."""

from __future__ import annotations

import pytest
import torch

import cutile_kernels


def _f(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


#: op name -> (call with the given dtype for its first float argument, that argument's name)
CALLS = {
    "rms_norm": (lambda d: cutile_kernels.rms_norm(_f(3, 64, dtype=d), _f(64)), "x"),
    "add_rms_norm": (lambda d: cutile_kernels.add_rms_norm(_f(3, 64, dtype=d), _f(3, 64), _f(64)), "x"),
    "silu": (lambda d: cutile_kernels.silu(_f(3, 64, dtype=d)), "x"),
    "silu_and_mul": (lambda d: cutile_kernels.silu_and_mul(_f(3, 64, dtype=d), _f(3, 64)), "gate"),
    "silu_and_mul_fused": (lambda d: cutile_kernels.silu_and_mul_fused(_f(3, 64, dtype=d)), "x"),
    "apply_rope": (lambda d: cutile_kernels.apply_rope(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16), _f(1, 5, 16),
                                                       _f(1, 5, 16)), "q"),
    "qk_norm_rope": (lambda d: cutile_kernels.qk_norm_rope(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16), _f(16), _f(16),
                                                           1e-6, _f(1, 5, 16), _f(1, 5, 16)), "q"),
    "rope_cos_sin": (lambda d: cutile_kernels.rope_cos_sin(_f(8, dtype=d), torch.arange(5)[None], 1.0,
                                                           torch.float32), "inv_freq"),
    "attention": (lambda d: cutile_kernels.attention(_f(1, 4, 5, 16, dtype=d), _f(1, 2, 5, 16), _f(1, 2, 5, 16)), "q"),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
@pytest.mark.parametrize("op", sorted(CALLS))
def test_other_dtypes_raise_one_line_type_error(op, dtype):
    call, arg = CALLS[op]
    with pytest.raises(TypeError) as err:
        call(dtype)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"cutile_kernels.{op}: {arg} is {str(dtype).removeprefix('torch.')}; supported: ")
    assert all(d in msg for d in ("bfloat16", "float16", "float32", "float64"))
    assert isinstance(err.value, cutile_kernels.UnsupportedDtypeError) and isinstance(err.value, ValueError)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("op", sorted(CALLS))
def test_float_dtypes_run(op, dtype):
    out = CALLS[op][0](dtype)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.is_floating_point() and torch.isfinite(o).all() for o in outs)


def test_rope_cos_sin_checks_its_position_and_output_dtypes():
    inv = _f(8)
    with pytest.raises(TypeError, match=r"^cutile_kernels.rope_cos_sin: position_ids is float32; supported: an integer"):
        cutile_kernels.rope_cos_sin(inv, torch.zeros(1, 5), 1.0, torch.float32)
    with pytest.raises(TypeError, match=r"^cutile_kernels.rope_cos_sin: dtype is int32; supported: bfloat16"):
        cutile_kernels.rope_cos_sin(inv, torch.arange(5)[None], 1.0, torch.int32)
    with pytest.raises(TypeError, match=r"^cutile_kernels.rope_cos_sin: dtype must be a torch.dtype .*got str"):
        cutile_kernels.rope_cos_sin(inv, torch.arange(5)[None], 1.0, "float32")


def test_attention_names_its_16_bit_kernels():
    with pytest.raises(TypeError, match=r"supported: bfloat16, float16 \(cuTile kernels\) or float32, float64 \(the"):
        cutile_kernels.attention(_f(1, 2, 3, 8, dtype=torch.int64), _f(1, 2, 3, 8), _f(1, 2, 3, 8))


def test_the_dtype_check_traces_without_a_graph_break():
    fn = torch.compile(lambda x, w: cutile_kernels.rms_norm(x * 2, w), backend="eager", fullgraph=True)
    x, w = _f(3, 64), _f(64)
    torch.testing.assert_close(fn(x, w), cutile_kernels.rms_norm_reference(x * 2, w, 1e-6))
