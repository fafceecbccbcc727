"""SiLU and SiLU-and-mul (the SwiGLU MLP's activation): cuTile device code and build matrix.

Math (Elfwing et al. 2017, "Sigmoid-Weighted Linear Units"; Shazeer 2020, "GLU Variants Improve
Transformer"): ``silu(g) = g * sigmoid(g)``, ``swiglu(g, u) = silu(g) * u``. The rounding order
is that of transformers' ``LlamaMLP.forward`` (models/llama/modeling_llama.py at v5.22.2), whose
``act_fn`` is ``SiLUActivation`` (``nn.functional.silu``)::

    s = silu(gate)     # torch computes g / (1 + exp(-g)) in float32 and rounds to gate.dtype
    y = s * up         # float32 product of the two rounded operands, rounded to the dtype

so the kernels compute in float32, round ``silu`` to the output dtype, multiply and round again.
For float32 inputs both roundings are no-ops and the result is torch's to within exp's ulps.

Three kernels, all on a 2-D grid of (row blocks, column blocks) with ``(ROWS, BLOCK)`` tiles, so
any width N is covered by ``cdiv(N, BLOCK)`` power-of-two chunks; loads past the edge are
zero-padded and stores past it are masked by ``ct.store``'s bounds check, so nothing outside the
arrays is read or written:

* ``silu_and_mul_kernel(gate, up, out)``: two separate (M, N) inputs;
* ``silu_and_mul_fused_kernel(x, out)``: ``x`` is the (M, 2, N) view of a fused gate/up GEMM
  output (M, 2N) (``x[:, 0]`` is gate, ``x[:, 1]`` is up). Passing the halves as one array keeps
  the no-aliasing contract (two strided views of one tensor would interleave in memory) and lets
  the aligned variant declare every stride, so the loads can be vectorised;
* ``silu_kernel(x, out)``: ``out = silu(x)``, for transformers' ``SiLU`` hub layer;
* ``gelu_tanh_and_mul_fused_kernel(x, out)``: GeGLU (Gemma's MLP, ``act_fn`` ``gelu_pytorch_tanh``)
  on the (M, 2, N) view, with the rounding order of ``silu_and_mul``: ``gelu(gate)`` computed as
  torch's CUDA kernel does, ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` in float32
  (Hendrycks & Gimpel 2016, "Gaussian Error Linear Units"), rounded to the dtype, then the product;
* ``sigmoid_and_mul_kernel(gate, x, out)``: gated attention's output gate (Qiu et al. 2025, "Gated
  Attention for Large Language Models"; Qwen3.5's ``attn_output * torch.sigmoid(gate)``), sigmoid
  as torch's CUDA kernel, ``1 / (1 + exp(-g))`` in float32, rounded, then the product rounded. The
  gate is a strided view (the second half of each head of the q projection), read in place.

Estimate for ``sigmoid_and_mul``, written before the kernel (Amdahl), Qwen3.5-0.8B on the H200: per
full-attention layer stock runs three launches (the gate's ``reshape`` copies the strided half, the
sigmoid, the product), ours one; 12 launches fewer a step in 6 layers: host-bound eager decode
f ~ 2 % of a ~17 ms step, ceiling ~1.02; prefill device time f ~ 3 % (three passes over 8 MB a
layer become one, s ~ 3), ceiling ~1.02.
"""

from __future__ import annotations

import cuda.tile as ct

from ._pdl import pdl_wait, with_pdl
from ._spec import DTYPE_TAGS, LAYOUTS, ConstParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO
RN = ct.RoundingMode.RN
FULL = ct.RoundingMode.FULL


@ct.function
def _silu(h):
    # torch's CUDA silu: x / (1 + exp(-x)) in float32, full-precision exp and IEEE division.
    return ct.truediv(h, 1.0 + ct.exp(-h, rounding_mode=FULL), rounding_mode=RN)


#: torch's constants for ``gelu(approximate="tanh")`` (``kBeta = M_SQRT2 * M_2_SQRTPI * 0.5``, i.e.
#: sqrt(2 / pi), and ``kKappa``), rounded to float32 as its opmath is.
GELU_BETA = 0.7978845608028654
GELU_KAPPA = 0.044715


@ct.function
def _gelu_tanh(h):
    # torch's order: x^3 as (x * x) * x, inner = beta * (x + kappa * x^3), (0.5 * x) * (1 + tanh(inner)).
    inner = GELU_BETA * (h + GELU_KAPPA * (h * h * h))
    return (0.5 * h) * (1.0 + ct.tanh(inner, rounding_mode=FULL))


@ct.function
def _gelu_tanh_and_mul(g, u, dtype):
    # GemmaMLP's order (LlamaMLP's code): act_fn(gate) rounded to the input dtype, then the product.
    s = _gelu_tanh(g.astype(ct.float32)).astype(dtype).astype(ct.float32)
    return (s * u.astype(ct.float32)).astype(dtype)


@ct.function
def _silu_and_mul(g, u, dtype):
    # LlamaMLP's order: act_fn(gate) is a tensor of the input dtype, then the product is rounded.
    s = _silu(g.astype(ct.float32)).astype(dtype).astype(ct.float32)
    return (s * u.astype(ct.float32)).astype(dtype)


@ct.kernel
def silu_and_mul_kernel(gate, up, out, ROWS: ct.Constant[int], BLOCK: ct.Constant[int]):
    """out = silu(gate) * up. gate, up, out: (M, N); block (i, j) covers rows i*ROWS.., columns j*BLOCK.."""
    i, j = ct.bid(0), ct.bid(1)
    g = ct.load(gate, index=(i, j), shape=(ROWS, BLOCK), padding_mode=ZERO)
    u = ct.load(up, index=(i, j), shape=(ROWS, BLOCK), padding_mode=ZERO)
    ct.store(out, index=(i, j), tile=_silu_and_mul(g, u, out.dtype))


@ct.kernel
def silu_and_mul_fused_kernel(x, out, ROWS: ct.Constant[int], BLOCK: ct.Constant[int], PDL: ct.Constant[int]):
    """out = silu(x[:, 0]) * x[:, 1]. x: (M, 2, N), out: (M, N); blocks as silu_and_mul_kernel.
    PDL: see kernel_src/_pdl.py."""
    pdl_wait(PDL)
    i, j = ct.bid(0), ct.bid(1)
    g = ct.reshape(ct.load(x, index=(i, 0, j), shape=(ROWS, 1, BLOCK), padding_mode=ZERO), (ROWS, BLOCK))
    u = ct.reshape(ct.load(x, index=(i, 1, j), shape=(ROWS, 1, BLOCK), padding_mode=ZERO), (ROWS, BLOCK))
    ct.store(out, index=(i, j), tile=_silu_and_mul(g, u, out.dtype))


@ct.kernel
def gelu_tanh_and_mul_fused_kernel(x, out, ROWS: ct.Constant[int], BLOCK: ct.Constant[int]):
    """out = gelu_tanh(x[:, 0]) * x[:, 1]. x: (M, 2, N), out: (M, N); blocks as silu_and_mul_kernel."""
    i, j = ct.bid(0), ct.bid(1)
    g = ct.reshape(ct.load(x, index=(i, 0, j), shape=(ROWS, 1, BLOCK), padding_mode=ZERO), (ROWS, BLOCK))
    u = ct.reshape(ct.load(x, index=(i, 1, j), shape=(ROWS, 1, BLOCK), padding_mode=ZERO), (ROWS, BLOCK))
    ct.store(out, index=(i, j), tile=_gelu_tanh_and_mul(g, u, out.dtype))


@ct.function
def _sigmoid(h):
    # torch's CUDA sigmoid: 1 / (1 + exp(-x)) in float32, full-precision exp and IEEE division.
    return ct.truediv(1.0, 1.0 + ct.exp(-h, rounding_mode=FULL), rounding_mode=RN)


@ct.kernel
def sigmoid_and_mul_kernel(gate, x, out, ROWS: ct.Constant[int], BLOCK: ct.Constant[int]):
    """out = x * sigmoid(gate), the sigmoid rounded to the dtype first (gated attention's output
    gate, ``attn_output * torch.sigmoid(gate)``). gate, x, out: (M, N); blocks as silu_and_mul_kernel."""
    i, j = ct.bid(0), ct.bid(1)
    g = ct.load(gate, index=(i, j), shape=(ROWS, BLOCK), padding_mode=ZERO).astype(ct.float32)
    u = ct.load(x, index=(i, j), shape=(ROWS, BLOCK), padding_mode=ZERO).astype(ct.float32)
    s = _sigmoid(g).astype(out.dtype).astype(ct.float32)
    ct.store(out, index=(i, j), tile=(u * s).astype(out.dtype))


@ct.kernel
def silu_kernel(x, out, ROWS: ct.Constant[int], BLOCK: ct.Constant[int]):
    """out = silu(x), computed in float32 and rounded once. x, out: (M, N)."""
    i, j = ct.bid(0), ct.bid(1)
    h = ct.load(x, index=(i, j), shape=(ROWS, BLOCK), padding_mode=ZERO).astype(ct.float32)
    ct.store(out, index=(i, j), tile=_silu(h).astype(out.dtype))


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: (ROWS, BLOCK) tile configs, the same for both layouts (the runtime asks for a config by its
#: constants, then takes the first layout the tensors satisfy). One row per block and 512-column
#: chunks: 1-16 rows of a 3072-14336 wide activation still spread over dozens of blocks, and on the
#: H200 it also beat a 4x1024 tile at prefill (Llama M=2048 fused: 38.8 vs 51.4 us; Qwen3 16.5 vs
#: 22.7 us; benchmarks/results/h200-2026-11-30b/swiglu-bench.log), so it is the only config built.
TILES = {"row": (1, 512)}

#: kernel name -> (device function, its array parameters as (name, ndim)).
KERNELS = {
    "silu_and_mul": ("silu_and_mul_kernel", (("gate", 2), ("up", 2), ("out", 2))),
    "silu_and_mul_fused": ("silu_and_mul_fused_kernel", (("x", 3), ("out", 2))),
    "silu": ("silu_kernel", (("x", 2), ("out", 2))),
    "gelu_tanh_and_mul_fused": ("gelu_tanh_and_mul_fused_kernel", (("x", 3), ("out", 2))),
    "sigmoid_and_mul": ("sigmoid_and_mul_kernel", (("gate", 2), ("x", 2), ("out", 2))),
}


def _matrix() -> list[VariantSpec]:
    specs = []
    for kernel, (function, arrays) in KERNELS.items():
        for dtype in ("bfloat16", "float16", "float32"):
            for layout in LAYOUTS:
                for rows, block in TILES.values():
                    params = tuple(array(a, dtype, nd, layout) for a, nd in arrays)
                    params += (ConstParam("ROWS", rows), ConstParam("BLOCK", block))
                    specs.append(VariantSpec(kernel, "activation", function,
                                             f"{DTYPE_TAGS[dtype]}.r{rows}.b{block}.{layout}", params))
    return specs


#: Every variant of this family, in the runtime's order of preference (aligned before generic);
#: silu_and_mul_fused's 16-bit aligned ones also with programmatic dependent launch, for captured decode
#: steps (kernel_src/_pdl.py).
VARIANTS: list[VariantSpec] = with_pdl(_matrix(), ("silu_and_mul_fused_kernel",))
