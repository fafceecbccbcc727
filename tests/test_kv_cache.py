"""``kv_append`` (``ops/kv_cache.py``): a step's keys and values written into a static KV cache at
the device-side length. CPU: the reference is ``StaticLayer.update``'s writes, the checks, the
kernel's logic through the NumPy interpreter, the build matrix; GPU: the kernel's writes are exact
copies on real-model head shapes, dtypes and strides, nothing else in the cache changes, and a
replayed CUDA graph writes where the length says."""

from __future__ import annotations

import pytest
import torch

import cutile_kernels
from cutile_kernels.kernel_src import kv_cache as kkv
from cutile_kernels.ops import kv_cache as kv_ops

transformers = pytest.importorskip("transformers")


def _cache(B, H, L, D, dtype=torch.float32, device="cpu", fill=float("nan")):
    return (torch.full((B, H, L, D), fill, dtype=dtype, device=device),
            torch.full((B, H, L, D), fill, dtype=dtype, device=device))


def _rows(B, H, S, D, dtype=torch.float32, device="cpu", strided=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if strided:  # views of one (B, S, 3 * H * D) projection, transposed as transformers passes them
        qkv = torch.randn(B, S, 3 * H * D, generator=g).to(dtype).to(device)
        k, v = qkv[..., H * D:2 * H * D], qkv[..., 2 * H * D:]
        return k.view(B, S, H, D).transpose(1, 2), v.view(B, S, H, D).transpose(1, 2)
    return (torch.randn(B, H, S, D, generator=g).to(dtype).to(device),
            torch.randn(B, H, S, D, generator=g).to(dtype).to(device))


def test_reference_is_static_layer_update():
    from transformers.cache_utils import StaticLayer

    layer = StaticLayer(12)
    keys, values = _cache(2, 3, 12, 8, fill=0.0)
    length = torch.tensor(0)
    for new in (4, 1, 1, 6):
        k, v = _rows(2, 3, new, 8, seed=new)
        cutile_kernels.kv_append_reference(keys, values, k, v, length)
        length += new
        layer.update(k, v)
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


def test_checks_name_what_does_not_match():
    keys, values = _cache(1, 2, 8, 16)
    k, v = _rows(1, 2, 1, 16)
    with pytest.raises(ValueError, match="must be one"):
        cutile_kernels.kv_append(keys, values[:, :, :4], k, v, torch.tensor(0))
    with pytest.raises(ValueError, match="with the cache's B, H and D"):
        cutile_kernels.kv_append(keys, values, k[..., :8], v[..., :8], torch.tensor(0))
    with pytest.raises(ValueError, match="share a dtype"):
        cutile_kernels.kv_append(keys, values, k.double(), v.double(), torch.tensor(0))
    with pytest.raises(ValueError, match="one int64 element"):
        cutile_kernels.kv_append(keys, values, k, v, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="length must be a one-element int64 tensor"):
        cutile_kernels.kv_append(keys, values, k, v, 3)
    with pytest.raises(TypeError, match="cutile_kernels.kv_append: keys is int32"):
        cutile_kernels.kv_append(keys.int(), values, k, v, torch.tensor(0))


@pytest.mark.parametrize("S,D,at", [(1, 64, 5), (17, 80, 100), (3, 128, 118)],
                         ids=["decode", "two-row-blocks-padded-lanes", "past-the-end"])
def test_emulated_kernel_writes_what_the_reference_writes(S, D, at):
    """The kernel's logic on the CPU (NumPy interpreter): two row blocks, padded head-dim lanes
    (80 of 128), rows past the cache's end dropped; nothing else in the cache changes."""
    from cutile_numpy import emulate

    L, B, H = 120, 2, 3
    keys, values = _cache(B, H, L, D)
    k, v = _rows(B, H, S, D, strided=True)
    dp = max(kkv.HEAD_DIMS[0], 1 << (D - 1).bit_length())
    run = emulate(kkv.kv_append_kernel, kkv)
    run((-(-S // kkv.ROWS), B * H), (keys, values, k, v, torch.tensor([at]), kkv.ROWS, dp))
    want_k, want_v = _cache(B, H, L, D)
    n = min(S, L - at)
    want_k[:, :, at:at + n], want_v[:, :, at:at + n] = k[:, :, :n], v[:, :, :n]
    torch.testing.assert_close(keys, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(values, want_v, rtol=0, atol=0, equal_nan=True)


def test_variants_cover_the_head_dims_models_use():
    built = {(s.params[0].dtype, s.constants["D"]) for s in kkv.VARIANTS}
    for dtype in ("bfloat16", "float16", "float32"):
        for head_dim in (64, 80, 96, 128, 256):
            assert (dtype, max(64, 1 << (head_dim - 1).bit_length())) in built


# ---------------------------------------------------------------------------------------------
# GPU: exact copies into a poisoned cache
# ---------------------------------------------------------------------------------------------

#: (B, H, S, D): Llama-3.2-1B, Qwen3-0.6B and Gemma-3 KV heads at decode and in chunks; one KV head;
#: head_dim 80 and 96 (padded lanes); a chunk of 17 rows (two row blocks).
GPU_SHAPES = [(1, 8, 1, 64), (16, 8, 1, 128), (3, 1, 1, 256), (2, 4, 17, 80), (2, 2, 5, 96), (1, 8, 40, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "qkv-views"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_writes_exactly_the_new_rows(shape, dtype, strided, strict):
    B, H, S, D = shape
    L = 300
    keys, values = _cache(B, H, L, D, dtype, "cuda")
    k, v = _rows(B, H, S, D, dtype, "cuda", strided)
    at = 129 if S < 40 else L - S  # across a 128-row boundary, or up to the last slot
    cutile_kernels.kv_append(keys, values, k, v, torch.tensor(at, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(keys[:, :, at:at + S], k) and torch.equal(values[:, :, at:at + S], v)
    rest = torch.ones(L, dtype=torch.bool)
    rest[at:at + S] = False
    assert torch.isnan(keys[:, :, rest].float()).all() and torch.isnan(values[:, :, rest].float()).all()


@pytest.mark.gpu
def test_gpu_appends_into_a_long_mha_cache(strict):
    # OLMo-3-7B's cache at batch 16 (32 heads x 4096 slots x 128): past the int32 bound the registry
    # used before the flat dims (a tile's reach along the batch stride), well within int32 itself.
    keys, values = _cache(16, 32, 4096, 128, torch.bfloat16, "cuda", fill=0.0)
    k, v = _rows(16, 32, 1, 128, torch.bfloat16, "cuda")
    cutile_kernels.kv_append(keys, values, k, v, torch.tensor(4000, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(keys[:, :, 4000:4001], k) and torch.equal(values[:, :, 4000:4001], v)
    assert keys[:, :, :4000].abs().sum() == 0 and keys[:, :, 4001:].abs().sum() == 0


@pytest.mark.gpu
def test_gpu_rows_past_the_end_are_not_written(strict):
    keys, values = _cache(2, 4, 10, 64, torch.bfloat16, "cuda")
    k, v = _rows(2, 4, 3, 64, torch.bfloat16, "cuda")
    cutile_kernels.kv_append(keys, values, k, v, torch.tensor(8, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(keys[:, :, 8:], k[:, :, :2]) and torch.equal(values[:, :, 8:], v[:, :, :2])
    assert torch.isnan(keys[:, :, :8].float()).all()


@pytest.mark.gpu
def test_gpu_graph_replay_writes_at_the_length_it_finds(strict):
    keys, values = _cache(4, 8, 64, 128, torch.bfloat16, "cuda", fill=0.0)
    k, v = _rows(4, 8, 1, 128, torch.bfloat16, "cuda")
    length = torch.tensor(0, device="cuda")
    cutile_kernels.kv_append(keys, values, k, v, length)  # load the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cutile_kernels.kv_append(keys, values, k, v, length)
        length.add_(1)
    keys.zero_()
    length.fill_(0)
    for step in range(5):
        k.copy_(torch.randn_like(k))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(keys[:, :, step:step + 1], k) and int(length) == step + 1
    assert not keys[:, :, 5:].any()


@pytest.mark.gpu
def test_gpu_unsupported_head_dim_falls_back_and_says_so(caplog):
    keys, values = _cache(1, 2, 8, 512, torch.bfloat16, "cuda", fill=0.0)
    k, v = _rows(1, 2, 1, 512, torch.bfloat16, "cuda")
    with caplog.at_level("WARNING", logger="cutile_kernels"):
        cutile_kernels.kv_append(keys, values, k, v, torch.tensor(3, device="cuda"))
    assert torch.equal(keys[:, :, 3:4], k) and "head_dim 512" in caplog.text
    assert kv_ops.KERNEL in str(cutile_kernels.stats()["fallbacks"])
