"""RoPE cos/sin tables in one launch: cuTile device code and build matrix.

Definition ``rope_cos_sin`` (inventory/definitions/rope_cos_sin/rope_cos_sin.json), scaffolded by
``cutile-kernels autokernelize llama-3.2-1b --scaffold rotary_emb`` from the region ``rotary_emb``
(``LlamaRotaryEmbedding``), which the kernelized Llama-3.2-1B still ran in PyTorch.

Math: transformers' ``LlamaRotaryEmbedding.forward`` (models/llama/modeling_llama.py at v5.22.2;
Mistral, Qwen2, Qwen3 and ~120 other classes compile to the same code), with ``H = R / 2``
inverse frequencies for a rotary dimension ``R`` (``head_dim * partial_rotary_factor``)::

    freqs = float32(position) * inv_freq            # (..., H), one float32 product
    emb   = cat(freqs, freqs)                       # (..., R)
    cos   = (cos(emb) * attention_scaling).to(dtype)
    sin   = (sin(emb) * attention_scaling).to(dtype)

all in float32 (``attention_scaling`` as a float32 scalar, as torch multiplies a float32 tensor by
a Python float), then one rounding to the model dtype. Every RoPE scaling type (linear, dynamic,
yarn, longrope, llama3) lives in ``inv_freq`` and ``attention_scaling``, which the host passes as
the module holds them (after transformers' ``dynamic_rope_update`` has run).

Layout handed to the kernel: positions flattened to ``(N,)`` (N = batch x seq tokens), the outputs
``(N, R)`` seen as ``(N, 2, H)``: the two equal halves of ``emb`` are two stores of one tile, so
cos and sin are computed once per (token, frequency). ``H`` is loaded as the next power of two
(zero padding, masked on store), ROWS tokens per block.

Estimate, written before the kernel (Amdahl, ``1 / (1 - f + f / s)``):

* What it replaces: one call per forward (the model computes cos/sin once and hands them to every
  layer). Stock eager launches 9 small kernels for it (int64 -> float32 cast of the positions, the
  product, ``cat``, ``cos``, ``sin``, two multiplies by ``attention_scaling``, two casts to the model
  dtype), each ~8-15 us of host time on the H200 (README: a small torch op 7-12 us), so ~70-120 us
  of host time, plus the no_grad / ``dynamic_rope_update`` wrappers. Ours: one launch through the
  dispatch, ~30 us of host time (checks, two ``torch.empty``, the cuda-python launch).
* Share of the step f: a batch-1 decode step of Llama-3.2-1B eager is ~8 ms of wall time on the
  H200 and host-bound (the GPU is busy ~13 % of it), so f ~= 0.1 / 8 = 1.2 % (0.9-1.5 %).
* Local speedup s ~= 100 / 30 ~= 3 (2-4).
* Ceiling: 1 / (1 - 0.012 + 0.012 / 3) ~= 1.008, i.e. < 1 % of decode tokens/s; at most
  1 / (1 - f) ~= 1.2 % if the region cost nothing. Prefill (15 ms, GPU-bound): the nine kernels on
  2048 x 64 elements take a few us each, f < 0.3 %, nothing measurable. Under CUDA graphs or
  ``torch.compile`` the host cost is gone and inductor fuses these ops itself: no gain there, and
  our custom op is opaque to inductor. Small: worth it as a launch-count cut in eager decode, and
  as the loop's worked example, not for throughput.
"""

from __future__ import annotations

import cuda.tile as ct

from ._spec import DTYPE_TAGS, LAYOUTS, ArrayParam, ConstParam, ScalarParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def rope_cos_sin_kernel(inv_freq, position_ids, cos, sin, attention_scaling: float,
                        BLOCK: ct.Constant[int], ROWS: ct.Constant[int]):
    """cos/sin of ROWS tokens per block.

    inv_freq: (H,) float32, H <= BLOCK; position_ids: (N,) int64; cos, sin: (N, 2, H) in the model
    dtype (the two halves of each row of R = 2H). Grid: (cdiv(N, ROWS),).
    """
    t = ct.bid(0)
    pos = ct.load(position_ids, index=(t,), shape=(ROWS,), padding_mode=ZERO).astype(ct.float32)
    inv = ct.load(inv_freq, index=(0,), shape=(BLOCK,), padding_mode=ZERO)
    # One float32 product, as transformers' ``position_ids[..., None].float() * inv_freq``.
    freqs = ct.reshape(pos, (ROWS, 1)) * ct.reshape(inv, (1, BLOCK))
    shape = (ROWS, 1, BLOCK)
    c = ct.reshape((ct.cos(freqs) * attention_scaling).astype(cos.dtype), shape)
    s = ct.reshape((ct.sin(freqs) * attention_scaling).astype(sin.dtype), shape)
    # cat(freqs, freqs): both halves of the row get the same tile.
    ct.store(cos, index=(t, 0, 0), tile=c)
    ct.store(cos, index=(t, 1, 0), tile=c)
    ct.store(sin, index=(t, 0, 0), tile=s)
    ct.store(sin, index=(t, 1, 0), tile=s)


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Half-widths built (H = R/2 padded up to one of them): 32 serves R <= 64 (Llama-3.2's 64, Phi's
#: partial 32), 64 serves 80, 96 and 128 (Qwen2/3, Mistral), 128 serves 256. Wider: PyTorch path.
BLOCKS = (32, 64, 128)
#: Tokens per block: 2048 (token, frequency) pairs per tile, 16 blocks for a 2048-token prefill at
#: R = 128; decode (N = batch) fits in one block.
ROWS = {32: 64, 64: 32, 128: 16}


def _params(dtype: str, layout: str, consts: dict):
    # The inputs are tiny (H floats, N positions) and come as they come (positions of a decode
    # step are one int64): no assumption on them. The outputs are ours, so the aligned variant
    # holds whenever H % 16 == 0 (R = 64, 96, 128, 256); R = 80 or an odd partial dim takes generic.
    return (ArrayParam("inv_freq", "float32", 1), ArrayParam("position_ids", "int64", 1),
            array("cos", dtype, 3, layout), array("sin", dtype, 3, layout),
            ScalarParam("attention_scaling", "float32"),
            *(ConstParam(k, v) for k, v in consts.items()))


def _matrix() -> list[VariantSpec]:
    specs = []
    for dtype in ("bfloat16", "float16", "float32"):
        for layout in LAYOUTS:
            for block in BLOCKS:
                consts = {"BLOCK": block, "ROWS": ROWS[block]}
                specs.append(VariantSpec("rope_cos_sin", "rope_cos_sin", "rope_cos_sin_kernel",
                                         f"{DTYPE_TAGS[dtype]}.h{block}.r{ROWS[block]}.{layout}",
                                         _params(dtype, layout, consts)))
    return specs


#: Every variant of this family, in the runtime's order of preference (aligned before generic).
VARIANTS: list[VariantSpec] = _matrix()
