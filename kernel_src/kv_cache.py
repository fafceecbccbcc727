"""Appending a step's keys and values to a static KV cache: cuTile device code and build matrix.

transformers' ``StaticLayer.update`` (cache_utils.py, v5.22.2) writes the ``S`` new rows of each
(batch, KV head) at the slots ``cumulative_length + [0, S)``, as ``torch.arange``, an add and two
``index_copy_`` launches, then advances ``cumulative_length`` by ``S``. ``kv_append_kernel`` does
the writes of both tensors in one launch, reading the first slot from the device-side length, so
that a replayed CUDA graph writes each step where the cache is. The values are copied unchanged
(no arithmetic). A row whose slot would be past the cache's end is not written (the caller checks
room beforehand: ``layers/decode_graphs.py`` raises ``CacheFullError``).
"""

from __future__ import annotations

import cuda.tile as ct

from ._pdl import pdl_wait, with_pdl
from ._spec import DTYPE_TAGS, ArrayParam, ConstParam, VariantSpec, array

ZERO = ct.PaddingMode.ZERO


@ct.function
def _append(cache, new, b, h, sb, first, BS: ct.Constant[int], D: ct.Constant[int]):
    # Rows [sb * BS, sb * BS + BS) of new[b, h] into cache[b, h] from slot first + sb * BS.
    rows = ct.reshape(sb * BS + ct.arange(BS, dtype=ct.int32), (BS, 1))
    cols = ct.reshape(ct.arange(D, dtype=ct.int32), (1, D))
    keep = (rows < new.shape[2]) & (cols < new.shape[3])
    tile = ct.reshape(ct.load(new, index=(b, h, sb, 0), shape=(1, 1, BS, D), padding_mode=ZERO), (BS, D))
    ct.scatter(cache, (b, h, first + rows, cols), tile, mask=keep)


@ct.kernel
def kv_append_kernel(keys, values, k, v, length, BS: ct.Constant[int], D: ct.Constant[int], PDL: ct.Constant[int]):
    """Write ``k[b, h, s]`` to ``keys[b, h, length + s]`` and ``v`` likewise into ``values``.

    keys, values: (B, H, L, head_dim), the cache; k, v: (B, H, S, head_dim), the new rows (any
    strides); length: (1,) int64, the first free slot. head_dim is loaded as D (a power of two)
    lanes; the padded lanes and slots past L are not written. Grid: (cdiv(S, BS), B * H). PDL: see
    kernel_src/_pdl.py.
    """
    pdl_wait(PDL)
    sb = ct.bid(0)
    b = ct.bid(1) // keys.shape[1]
    h = ct.bid(1) % keys.shape[1]
    first = ct.gather(length, 0).astype(ct.int32)
    _append(keys, k, b, h, sb, first, BS, D)
    _append(values, v, b, h, sb, first, BS, D)


# ---------------------------------------------------------------------------------------------
# Build matrix
# ---------------------------------------------------------------------------------------------

#: Per array, the dimensions every tile indexes with extent 1 (batch and head; see
#: ``registry.ArrayCheck``): the int32 bound counts a tile's reach only along slots and lanes.
ARRAY_FLAT_DIMS = {"keys": (0, 1), "values": (0, 1), "k": (0, 1), "v": (0, 1)}
#: Padded head dims built (head_dim <= 256; 80 and 96 take 128).
HEAD_DIMS = (64, 128, 256)
#: New rows per block: one decode token, or a short chunk (longer writes take more blocks).
ROWS = 16
DTYPES = ("bfloat16", "float16", "float32")


def _params(dtype: str, consts: dict) -> tuple:
    # The cache is contiguous (StaticLayer allocates it); the new rows are any view (q/k/v splits).
    return (array("keys", dtype, 4, "aligned"), array("values", dtype, 4, "aligned"),
            ArrayParam("k", dtype, 4), ArrayParam("v", dtype, 4), ArrayParam("length", "int64", 1),
            *(ConstParam(n, val) for n, val in consts.items()))


#: Every variant of this family; the 16-bit ones also with programmatic dependent launch, for captured
#: decode steps (kernel_src/_pdl.py).
VARIANTS: list[VariantSpec] = with_pdl([
    VariantSpec("kv_append", "kv_cache", "kv_append_kernel", f"{DTYPE_TAGS[dtype]}.d{d}.r{ROWS}",
                _params(dtype, {"BS": ROWS, "D": d}))
    for dtype in DTYPES for d in HEAD_DIMS
], ("kv_append_kernel",))
