"""The runtime's CPU-testable parts: cubin parameter layouts vs. our argument packing, variant
selection on real tensor layouts, aliasing checks, arch mapping, fallback bookkeeping, and where
the runtime looks for a build. Nothing here needs a GPU; CPU tensors carry the same dtype, shape,
stride and data_ptr information that selection uses."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch

import cutile_kernels
from cutile_kernels import cubin, dispatch, registry
from cutile_kernels.cubin import ArgPacker, _unit_dim_stride

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_stats(monkeypatch):
    """Zeroed counters and a fresh warn-once memory for every test."""
    dispatch.reset_stats()
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.delenv(dispatch.ENV_STRICT, raising=False)
    monkeypatch.delenv(dispatch.ENV_DISABLE, raising=False)
    yield
    dispatch.reset_stats()


@pytest.fixture(scope="module")
def reg(built_package_dir):
    return registry.Registry(built_package_dir)


@pytest.fixture(scope="module")
def sel_arch(reg):
    """An arch of the build to run selection against (sm_90 when built)."""
    if not reg.archs:
        pytest.skip("the build has no variants")
    return "sm_90" if "sm_90" in reg.archs else reg.archs[0]


# ---------------------------------------------------------------------------------------------
# cubin: the parameter layout the compiler wrote == the one we pack
# ---------------------------------------------------------------------------------------------

def test_param_info_matches_argpacker_for_every_built_variant(reg):
    variants = reg.variants()
    assert variants, "the manifest lists no variants"
    assert {v.arch for v in variants} == set(reg.manifest["archs"])
    mismatches = []
    for v in variants:
        data = v.cubin.read_bytes()
        got = cubin.param_info(data, v.symbol)
        want = ArgPacker(v.params).layout
        if got != want:
            mismatches.append((v.arch, v.kernel, v.tag, got, want))
    assert not mismatches, f"{len(mismatches)} variants disagree with cutile_python_v1 packing: {mismatches[:3]}"


def test_param_info_layout_is_nontrivial(reg):
    # rms_norm(x[2D], weight[1D], y[2D], eps): 3 + 5 + 3 + 5... driver-visible params:
    # x: ptr + 2 shape + 2 strides, weight: ptr + shape + stride, y: 5, eps: 1 -> 14.
    v = next(v for v in reg.variants(kernel="rms_norm"))
    layout = cubin.param_info(v.cubin.read_bytes(), v.symbol)
    assert len(layout) == 14
    assert layout[0] == (0, 8)  # x pointer
    assert layout[1] == (8, 4)  # x.shape[0], int32
    assert layout[-1][1] == 4  # eps float32
    offsets = [o for o, _ in layout]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


def test_param_info_errors(reg):
    v = reg.variants()[0]
    data = v.cubin.read_bytes()
    with pytest.raises(KeyError):
        cubin.param_info(data, v.symbol + "_no_such_kernel")
    with pytest.raises(ValueError):
        cubin.param_info(b"not an elf file at all, just bytes" * 4, v.symbol)
    with pytest.raises(ValueError):  # a 32-bit ELF header is refused too
        cubin.param_info(b"\x7fELF\x01" + bytes(100), v.symbol)


def _manual_params(index_dtype="int32"):
    return [
        {"kind": "array", "name": "a", "dtype": "bfloat16", "ndim": 1, "stride_one": [0],
         "stride_divisible_by": [1], "shape_divisible_by": [1], "base_addr_divisible_by": 1,
         "index_dtype": index_dtype},
        {"kind": "scalar", "name": "s", "dtype": "float32"},
        {"kind": "array", "name": "b", "dtype": "bfloat16", "ndim": 2, "stride_one": [],
         "stride_divisible_by": [1, 1], "shape_divisible_by": [1, 1], "base_addr_divisible_by": 1,
         "index_dtype": index_dtype},
        {"kind": "constant", "name": "C", "value": 4},
    ]


def test_argpacker_c_alignment_int32_and_int64():
    # int32 indices: a(ptr 0, shape 8, stride 12) s(16) b(ptr 24 after padding, 32, 36, 40, 44)
    p32 = ArgPacker(_manual_params("int32"))
    assert p32.layout == [(0, 8), (8, 4), (12, 4), (16, 4), (24, 8), (32, 4), (36, 4), (40, 4), (44, 4)]
    assert p32.struct.size == 48
    # int64 indices: everything 8 wide but the float scalar, which is padded after.
    p64 = ArgPacker(_manual_params("int64"))
    assert p64.layout == [(0, 8), (8, 8), (16, 8), (24, 4), (32, 8), (40, 8), (48, 8), (56, 8), (64, 8)]
    with pytest.raises(ValueError):
        ArgPacker([{"kind": "mystery", "name": "z"}])


def test_argpacker_values_and_template(reg, sel_arch):
    v = next(v for v in reg.variants(kernel="rms_norm", arch=sel_arch) if v.tag.endswith("generic"))
    x = torch.randn(19, 2048, dtype=v.arrays[0].dtype)
    w = torch.randn(2048, dtype=x.dtype)
    y = torch.empty_like(x)
    args = (x, w, y, 1e-5)
    packer = ArgPacker(v.params)
    values = packer.values(args)
    assert values == [x.data_ptr(), 19, 2048, 2048, 1,
                      w.data_ptr(), 2048, 1,
                      y.data_ptr(), 19, 2048, 2048, 1,
                      1e-5]
    tmpl, ptr_slots, scalar_slots = packer.template(args)
    assert ptr_slots == [(0, 0), (5, 1), (8, 2)]
    assert scalar_slots == [(13, 3)]
    # Fill the per-call slots with another call's pointers/scalars: equals that call's values().
    x2, w2, y2 = torch.randn_like(x), torch.randn_like(w), torch.empty_like(y)
    args2 = (x2, w2, y2, 0.25)
    filled = list(tmpl)
    for slot, i in ptr_slots:
        filled[slot] = args2[i].data_ptr()
    for slot, i in scalar_slots:
        filled[slot] = args2[i]
    assert filled == packer.values(args2)
    assert filled != values
    # The values pack into exactly the cubin's parameter buffer size.
    raw = packer.struct.pack(*filled)
    assert len(raw) == packer.layout[-1][0] + packer.layout[-1][1]
    assert struct.unpack_from("<Q", raw, 0)[0] == x2.data_ptr()
    assert struct.unpack_from("<f", raw, packer.offsets[13])[0] == 0.25


def test_unit_dim_stride_is_repacked(reg, sel_arch):
    assert _unit_dim_stride((1, 2048), 0, 8) == 2048
    assert _unit_dim_stride((1, 1004), 0, 8) == 1008  # rounded up to the divisibility
    assert _unit_dim_stride((1, 1004), 0, 1) == 1004
    assert _unit_dim_stride((3, 1), 1, 1) == 1
    assert _unit_dim_stride((1, 0), 0, 8) == 8  # empty inner dims count as 1

    aligned = next(v for v in reg.variants(kernel="rms_norm", arch=sel_arch)
                   if v.tag.endswith("aligned") and v.arrays[0].dtype == BF16)
    packer = ArgPacker(aligned.params)
    base = torch.randn(2048, dtype=BF16)
    x = base.as_strided((1, 2048), (7, 1))  # torch may give size-1 dims any stride
    y = torch.empty(1, 2048, dtype=BF16)
    w = torch.randn(2048, dtype=BF16)
    vals = packer.values((x, w, y, 1e-6))
    assert vals[1:5] == [1, 2048, 2048, 1]  # stride 7 replaced by the contiguous stride
    # ... and the selection check ignores the size-1 dim's stride as well.
    assert aligned.violation((x, w, y, 1e-6)) is None
    # A size>1 dim keeps its stride as given.
    x3 = torch.randn(3, 2056, dtype=BF16)[:, :2048]
    assert packer.values((x3, w, torch.empty(3, 2048, dtype=BF16), 1e-6))[1:5] == [3, 2048, 2056, 1]


# ---------------------------------------------------------------------------------------------
# registry: variant selection on real layouts
# ---------------------------------------------------------------------------------------------

def _counterpart(reg, v, layout):
    """The variant of ``v``'s kernel, arch, dtype and width compiled for the other layout."""
    width = {k: val for k, val in v.constants.items() if k != "ROWS"}
    return next(c for c in reg.variants(v.kernel, v.arch)
                if c.tag.endswith(layout) and c.arrays[0].dtype == v.arrays[0].dtype
                and all(c.constants.get(k) == val for k, val in width.items()))


def _select(reg, arch, x, w, want, y=None):
    y = torch.empty(x.shape, dtype=x.dtype) if y is None else y
    return reg.select("rms_norm", arch, want, (x, w, y, 1e-6))


def test_select_contiguous_is_aligned(reg, sel_arch):
    x = torch.randn(19, 2048, dtype=BF16)
    w = torch.randn(2048, dtype=BF16)
    v, why = _select(reg, sel_arch, x, w, {"BLOCK_N": 2048})
    assert v is not None, why
    assert why == ""
    assert v.tag.endswith("aligned")
    assert v.kernel == "rms_norm" and v.arch == sel_arch
    assert v.constants["BLOCK_N"] == 2048
    assert v.tag.startswith("bf16.")


@pytest.mark.parametrize("dtype,prefix", [(torch.float16, "fp16."), (torch.float32, "fp32.")])
def test_select_picks_the_dtype_variant(reg, sel_arch, dtype, prefix):
    x = torch.randn(5, 4096, dtype=dtype)
    v, why = _select(reg, sel_arch, x, torch.randn(4096, dtype=dtype), {"BLOCK_N": 4096})
    assert v is not None, why
    assert v.tag.startswith(prefix) and v.tag.endswith("aligned")


def test_select_misaligned_base_is_generic(reg, sel_arch):
    flat = torch.randn(19 * 2048 + 8, dtype=BF16)
    assert flat.data_ptr() % 16 == 0
    x = flat[1:19 * 2048 + 1].view(19, 2048)
    assert x.data_ptr() % 16 == 2
    v, why = _select(reg, sel_arch, x, torch.randn(2048, dtype=BF16), {"BLOCK_N": 2048})
    assert v is not None, why
    assert v.tag.endswith("generic")
    aligned = _counterpart(reg, v, "aligned")
    assert "base address" in aligned.violation((x, torch.randn(2048, dtype=BF16), torch.empty(19, 2048, dtype=BF16), 1e-6))


def test_select_strided_rows(reg, sel_arch):
    w = torch.randn(2048, dtype=BF16)
    x8 = torch.randn(19, 2048 + 8, dtype=BF16)[:, :2048]  # row stride 2056 = 8 * 257
    assert x8.stride() == (2056, 1)
    v, why = _select(reg, sel_arch, x8, w, {"BLOCK_N": 2048})
    assert v is not None and v.tag.endswith("aligned"), why
    x4 = torch.randn(19, 2048 + 4, dtype=BF16)[:, :2048]  # row stride 2052, not a multiple of 8
    v, why = _select(reg, sel_arch, x4, w, {"BLOCK_N": 2048})
    assert v is not None and v.tag.endswith("generic"), why
    # The output's layout counts as much as the input's.
    v, why = _select(reg, sel_arch, torch.randn(19, 2048, dtype=BF16), w, {"BLOCK_N": 2048},
                     y=torch.empty(19, 2052, dtype=BF16)[:, :2048])
    assert v is not None and v.tag.endswith("generic"), why


def test_select_unaligned_hidden_is_generic(reg, sel_arch):
    x = torch.randn(19, 1000, dtype=BF16)
    v, why = _select(reg, sel_arch, x, torch.randn(1000, dtype=BF16), {"BLOCK_N": 1024})
    assert v is not None, why
    assert v.tag.endswith("generic") and v.constants["BLOCK_N"] == 1024


def test_select_non_unit_last_stride_is_generic(reg, sel_arch):
    xt = torch.randn(2048, 64, dtype=BF16).t()
    assert xt.shape == (64, 2048) and xt.stride() == (1, 64)
    v, why = _select(reg, sel_arch, xt, torch.randn(2048, dtype=BF16), {"BLOCK_N": 2048})
    assert v is not None and v.tag.endswith("generic"), why
    # Every other row's every other element: row stride a multiple of 8, last stride 2.
    xs = torch.randn(64, 4096, dtype=BF16)[:, ::2]
    assert xs.stride() == (4096, 2)
    w = torch.randn(2048, dtype=BF16)
    v, why = _select(reg, sel_arch, xs, w, {"BLOCK_N": 2048})
    assert v is not None and v.tag.endswith("generic"), why
    aligned = _counterpart(reg, v, "aligned")
    assert aligned.violation((xs, w, torch.empty(64, 2048, dtype=BF16), 1e-6)) == "x: stride[1]=2 is not 1"


def test_select_wrong_dtype_has_no_variant(reg, sel_arch):
    x = torch.randn(19, 2048, dtype=torch.float64)
    v, why = _select(reg, sel_arch, x, torch.randn(2048, dtype=torch.float64), {"BLOCK_N": 2048})
    assert v is None
    assert "dtype" in why and "float64" in why


def test_select_unbuilt_constants_has_no_variant(reg, sel_arch):
    x = torch.randn(19, 2048, dtype=BF16)
    v, why = _select(reg, sel_arch, x, torch.randn(2048, dtype=BF16), {"BLOCK_N": 3})
    assert v is None
    assert "no prebuilt rms_norm variant" in why and "BLOCK_N" in why and sel_arch in why
    v, why = reg.select("no_such_kernel", sel_arch, {}, ())
    assert v is None and "no_such_kernel" in why


@pytest.mark.parametrize("hidden,layout", [(10000, "aligned"), (10008, "generic")])
def test_select_chunked_variant(reg, sel_arch, hidden, layout):
    x = torch.randn(3, hidden, dtype=BF16)
    v, why = _select(reg, sel_arch, x, torch.randn(hidden, dtype=BF16), {"CHUNK": 2048})
    assert v is not None, why
    assert "chunk" in v.tag and v.function == "rms_norm_chunked_kernel" and v.tag.endswith(layout)


def test_select_add_rms_norm(reg, sel_arch):
    x, r = torch.randn(7, 4096, dtype=BF16), torch.randn(7, 4096, dtype=BF16)
    w = torch.randn(4096, dtype=BF16)
    y, s = torch.empty_like(x), torch.empty_like(x)
    v, why = reg.select("add_rms_norm", sel_arch, {"BLOCK_N": 4096}, (x, r, w, y, s, 1e-6))
    assert v is not None and v.tag.endswith("aligned") and v.kernel == "add_rms_norm", why
    # The residual is argument 1: a misaligned residual alone demotes to generic.
    flat = torch.randn(7 * 4096 + 8, dtype=BF16)
    r_bad = flat[1:7 * 4096 + 1].view(7, 4096)
    v, why = reg.select("add_rms_norm", sel_arch, {"BLOCK_N": 4096}, (x, r_bad, w, y, s, 1e-6))
    assert v is not None and v.tag.endswith("generic"), why


def _check(reg, sel_arch, layout="generic"):
    v = next(v for v in reg.variants("rms_norm", sel_arch) if v.tag.endswith(layout) and v.arrays[0].dtype == BF16)
    return v.arrays[0]


def test_int32_overflow_is_a_violation(reg, sel_arch):
    check = _check(reg, sel_arch)
    assert check.index_bits == 32
    extent = check.tile_extent  # the variant's largest tile dimension may reach past the edge
    assert extent == max(v for v in next(v for v in reg.variants("rms_norm", sel_arch)
                                         if v.arrays[0] is check).constants.values())
    # Meta tensors carry shape and strides but no storage, so huge strides are free.
    # max offset = (2 - 1) * stride + (16 - 1) * 1 + extent * stride
    stride = (registry._INT32_MAX - 15) // (extent + 1)
    ok = torch.empty_strided((2, 16), (stride, 1), device="meta", dtype=BF16)
    over = torch.empty_strided((2, 16), (stride + 1, 1), device="meta", dtype=BF16)
    assert registry._max_offset(ok, extent) <= registry._INT32_MAX < registry._max_offset(over, extent)
    assert check.violation(ok) is None
    assert check.violation(over) == "x: offsets exceed int32 indexing"


def _huge_bf16_call():
    big = torch.empty_strided((2, 2048), (2**31, 1), device="meta", dtype=BF16)
    return (big, torch.empty(2048, device="meta", dtype=BF16), torch.empty(2, 2048, device="meta", dtype=BF16), 1e-6)


def test_select_refuses_int32_overflow(reg, sel_arch):
    # No int64-index variant is built, so selection refuses a tensor with int32-overflowing offsets
    # (every bf16 candidate refuses it for that reason).
    args = _huge_bf16_call()
    cands = [v for v in reg.variants("rms_norm", sel_arch) if v.constants.get("BLOCK_N") == 2048]
    bf16 = [v for v in cands if v.arrays[0].dtype == BF16]  # aligned and generic, prefill and decode tiles
    assert len(bf16) == 3 and {v.tag.rsplit(".", 1)[1] for v in bf16} == {"aligned", "generic"}
    assert [v.violation(args) for v in bf16] == ["x: offsets exceed int32 indexing"] * 3
    v, _why = reg.select("rms_norm", sel_arch, {"BLOCK_N": 2048}, args)
    assert v is None


def test_select_reason_names_int32_for_huge_bf16(reg, sel_arch):
    v, why = reg.select("rms_norm", sel_arch, {"BLOCK_N": 2048}, _huge_bf16_call())
    assert v is None
    assert "int32" in why


def test_flat_dims_bound_a_tiles_reach_to_the_other_dims():
    # A static cache of OLMo-3-7B at batch 16 (16 x 32 KV heads x 4096 slots x 128): its largest offset
    # is an eighth of int32's, but a 256-key tile reaching past the batch dim's stride would not be.
    k = torch.empty(16, 32, 4096, 128, device="meta", dtype=BF16)
    numel_reach = k.numel() - 1
    assert registry._max_offset(k, 256) == numel_reach + 256 * k.stride(0) > registry._INT32_MAX
    assert registry._max_offset(k, 256, (0, 1)) == numel_reach + 256 * k.stride(2) <= registry._INT32_MAX
    # Every dim flat (a tile of one element): the reach is one stride-1 step.
    assert registry._max_offset(k, 256, (0, 1, 2, 3)) == numel_reach + 256
    check = registry.ArrayCheck(index=1, name="k", dtype=BF16, ndim=4, stride_one=(3,),
                                stride_divisible_by=(8,) * 3 + (1,), shape_divisible_by=(1, 1, 1, 16),
                                base_addr_divisible_by=16, index_bits=32, tile_extent=256, flat_dims=(0, 1))
    assert check.violation(k) is None
    assert registry.ArrayCheck(**{**check.__dict__, "flat_dims": ()}).violation(k) == "k: offsets exceed int32 indexing"
    # The flat dims do not excuse offsets past int32 within the tensor itself.
    huge = torch.empty(64, 32, 8192, 128, device="meta", dtype=BF16)
    assert check.violation(huge) == "k: offsets exceed int32 indexing"


def test_attention_variants_carry_their_flat_dims(reg, sel_arch):
    from cutile_kernels.kernel_src.attention import ARRAY_FLAT_DIMS

    variants = [v for k in ("attention", "attention_combine", "attention_mask_tiles")
                for v in reg.variants(k, sel_arch)]
    assert variants
    for v in variants:
        for check in v.arrays:
            assert check.flat_dims == ARRAY_FLAT_DIMS.get(check.name, ()), (v.tag, check.name)
    # A family that declares none (rms_norm) bounds a tile's reach along every dim, as before.
    assert all(c.flat_dims == () for v in reg.variants("rms_norm", sel_arch) for c in v.arrays)


def test_mha_decode_over_a_long_static_cache_has_a_variant(reg, sel_arch):
    # OLMo-3-7B's layout at batch 16 over 3000 of 4096 slots: the plan's every launch finds a prebuilt
    # variant (the H100 took the PyTorch fallback here before the flat dims: "k: offsets exceed int32").
    import importlib

    ops = importlib.import_module("cutile_kernels.ops.attention")
    for B, slots in ((16, 4096), (16, 2176), (64, 4096)):
        q = torch.empty(B, 1, 32, 128, device="meta", dtype=BF16).transpose(1, 2)
        k = torch.empty(B, 32, slots, 128, device="meta", dtype=BF16)
        out = torch.empty(B, 1, 32, 128, device="meta", dtype=BF16)
        n = torch.empty(1, device="meta", dtype=torch.int64)
        plan = ops.launches(q, k, k.clone(), None, out, 128 ** -0.5, True, kv_len=n, sms=132)
        for kernel, want, args, _n, _grid in plan:
            v, why = reg.select(kernel, sel_arch, dict(want), args)
            assert v is not None, (B, slots, kernel, why)


def test_kv_append_into_a_long_mha_cache_has_a_variant(reg, sel_arch):
    keys = torch.empty(16, 32, 4096, 128, device="meta", dtype=BF16)
    new = torch.empty(16, 1, 32, 128, device="meta", dtype=BF16).transpose(1, 2)
    args = (keys, keys.clone(), new, new.clone(), torch.empty(1, device="meta", dtype=torch.int64))
    v, why = reg.select("kv_append", sel_arch, {"D": 128}, args)
    assert v is not None, why
    assert [c.flat_dims for c in v.arrays[:4]] == [(0, 1)] * 4


def test_rope_append_into_a_long_cache_has_a_variant(reg, sel_arch):
    # OLMo-3-7B's layout at batch 16 over 8192 slots, in the (B, H, L, 2, D/2) halves view the op
    # launches with: refused by the bound before the flat dims (the batch stride times 64 lanes).
    B, H, L = 16, 32, 8192
    new = torch.empty(B, 1, H, 2, 64, device="meta", dtype=BF16).transpose(1, 2)
    cache = torch.empty(B, H, L, 2, 64, device="meta", dtype=BF16)
    cos = torch.empty(1, 1, 2, 64, device="meta", dtype=BF16)
    args = (new, new.clone(), new.clone(), cos, cos.clone(), cache, cache.clone(),
            torch.empty(1, device="meta", dtype=torch.int64), new.clone())
    v, why = reg.select("rope_append", sel_arch, {"BLOCK": 64, "ROWS": 1}, args)
    assert v is not None, why
    assert registry._max_offset(cache, v.arrays[5].tile_extent) > registry._INT32_MAX  # the old bound's verdict


def test_batched_long_prefill_of_qwen35s_linear_attention_has_variants(reg, sel_arch):
    # Qwen3.5's gated DeltaNet at 4 x 8192 tokens: the conv over its 6144 channels and the chunked
    # delta rule over q/k/v sliced from the conv's output (16 heads of 128). The old bound (the batch
    # stride times the tile) refused all of these and sent them to the PyTorch paths.
    B, T, C, H = 4, 8192, 6144, 16
    x = torch.empty(B, T, C, device="meta", dtype=BF16)
    w = torch.empty(C, 4, device="meta", dtype=BF16)
    v, why = reg.select("causal_conv1d", sel_arch, {"K": 4}, (x, w, x.clone()))
    assert v is not None, why
    assert registry._max_offset(x, v.arrays[0].tile_extent) > registry._INT32_MAX  # the old bound's verdict
    q, k, vv = (x[..., i * H * 128:(i + 1) * H * 128].unflatten(-1, (H, 128)) for i in range(3))
    g = torch.empty(B, T, H, device="meta", dtype=torch.float32)
    beta = torch.empty(B, T, H, device="meta", dtype=BF16)
    work = torch.empty(B, T, H, 128, device="meta", dtype=torch.float32)
    attn = torch.empty(B, H, T, 32, device="meta", dtype=torch.float32)
    o = torch.empty(B, T, H, 128, device="meta", dtype=BF16)
    state = torch.empty(B, H, 128, 128, device="meta", dtype=torch.float32)
    want = {"DK": 128, "BT": 32}
    for kernel, args in (("gated_delta_prepare", (q, k, vv, g, beta, work, work.clone(), attn, 0.1)),
                         ("gated_delta_scan", (q, k, g, work, work.clone(), attn, state, o, 0.1))):
        v, why = reg.select(kernel, sel_arch, want, args)
        assert v is not None, (kernel, why)


def test_int32_overflow_via_max_offset(reg, sel_arch, monkeypatch):
    check = _check(reg, sel_arch, "aligned")
    x = torch.randn(4, 64, dtype=BF16)
    assert check.violation(x) is None
    monkeypatch.setattr(registry, "_max_offset", lambda t, extent=1, flat_dims=(): 2**31)
    assert "int32" in check.violation(x)


def test_array_check_messages(reg, sel_arch):
    check = _check(reg, sel_arch, "aligned")
    assert "rank 1 != 2" in check.violation(torch.randn(64, dtype=BF16))
    assert "dtype" in check.violation(torch.randn(4, 64, dtype=torch.float16))
    assert "shape[1]=40 not divisible by 16" in check.violation(torch.randn(4, 40, dtype=BF16))
    assert "stride[0]=68 not divisible by 8" in check.violation(torch.randn(4, 68, dtype=BF16)[:, :64])


def test_internal_overlap():
    assert registry.internal_overlap(torch.randn(1, 8).expand(4, 8)) is True
    assert registry.internal_overlap(torch.randn(4, 8)) is False
    assert registry.internal_overlap(torch.randn(8, 4).t()) is False
    assert registry.internal_overlap(torch.randn(4, 16)[:, ::2]) is False
    base = torch.randn(64)
    assert registry.internal_overlap(base.as_strided((4, 8), (4, 1))) is True  # rows overlap
    assert registry.internal_overlap(base.as_strided((4, 8), (8, 1))) is False
    assert registry.internal_overlap(base.as_strided((1, 8), (0, 1))) is False  # size-1 dim: no aliasing
    assert registry.internal_overlap(base.as_strided((2, 2), (3, 2))) is False  # interleaved, disjoint


def test_overlapping_pair_and_byte_range():
    buf = torch.randn(64)
    a, b = buf[:8], buf[8:16]
    assert registry.byte_range(a) == (buf.data_ptr(), buf.data_ptr() + 32)
    assert registry.overlapping_pair([a, b]) is None
    assert registry.overlapping_pair([buf[:9], b]) == (0, 1)
    assert registry.overlapping_pair([a, b, buf[4:6]]) == (0, 2)
    assert registry.overlapping_pair([torch.randn(8), b, buf[15:20]]) == (1, 2)
    assert registry.overlapping_pair([buf[:0], buf]) is None  # an empty tensor touches nothing
    # Strided views span from first to last element.
    assert registry.overlapping_pair([buf[0:32:4], buf[30:40]]) is None
    assert registry.overlapping_pair([buf[0:33:4], buf[30:40]]) == (0, 1)


# ---------------------------------------------------------------------------------------------
# registry: which built arch runs on which device
# ---------------------------------------------------------------------------------------------

def test_arch_for_on_the_build(reg):
    archs = set(reg.archs)
    assert archs == set(reg.manifest["archs"])
    assert reg.arch_for((9, 0)) == ("sm_90" if "sm_90" in archs else None)
    assert reg.arch_for((8, 6)) == ("sm_80" if "sm_80" in archs else None)
    assert reg.arch_for((9, 0)) != "sm_80"
    assert reg.arch_for((7, 5)) is None
    if "sm_100" in archs:
        assert reg.arch_for((10, 0)) == "sm_100"
    if "sm_120" in archs:
        assert reg.arch_for((12, 0)) == "sm_120"


def _fake_registry(tmp_path, entry, archs):
    pkg = tmp_path / "torch-cuda" / "cutile_kernels"
    pkg.mkdir(parents=True)
    variants = [dict(entry, arch=a) for a in archs]
    (pkg / "manifest.json").write_text(json.dumps({"archs": archs, "variants": variants}))
    return registry.Registry(pkg)


def test_arch_for_rules(reg, tmp_path):
    entry = reg.manifest["variants"][0]
    r = _fake_registry(tmp_path / "all", entry, ["sm_120", "sm_80", "sm_100", "sm_90", "sm_86"])
    assert r.archs == ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    assert r.arch_for((8, 0)) == "sm_80"
    assert r.arch_for((8, 6)) == "sm_86"  # the newest compatible minor wins
    assert r.arch_for((8, 9)) == "sm_86"
    assert r.arch_for((9, 0)) == "sm_90"
    assert r.arch_for((10, 0)) == "sm_100"
    assert r.arch_for((10, 3)) is None  # sm_100a cubins need exactly 10.0
    assert r.arch_for((12, 0)) == "sm_120"
    assert r.arch_for((12, 1)) == "sm_120"
    assert r.arch_for((7, 5)) is None
    assert r.arch_for((11, 0)) is None
    only80 = _fake_registry(tmp_path / "only80", entry, ["sm_80"])
    assert only80.arch_for((9, 0)) is None  # an Ampere cubin does not run on Hopper
    assert only80.arch_for((8, 7)) == "sm_80"
    assert only80.variants(kernel=entry["kernel"], arch="sm_80")[0].cubin == tmp_path / "only80" / "torch-cuda" / "cutile_kernels" / entry["cubin"]
    empty = registry.Registry(None)
    assert empty.archs == [] and empty.arch_for((9, 0)) is None
    assert empty.select("rms_norm", "sm_90", {}, ())[0] is None


# ---------------------------------------------------------------------------------------------
# dispatch bookkeeping (no CUDA)
# ---------------------------------------------------------------------------------------------

def test_cpu_call_counts_as_reference():
    x = torch.randn(3, 64, dtype=BF16)
    w = torch.randn(64, dtype=BF16)
    assert dispatch.stats()["reference_calls"] == {}
    out = cutile_kernels.rms_norm(x, w, 1e-6)
    assert torch.equal(out, cutile_kernels.rms_norm_reference(x, w, 1e-6))
    cutile_kernels.rms_norm(x, w)
    y, s = cutile_kernels.add_rms_norm(x, x, w)
    assert torch.equal(s, x + x)
    st = dispatch.stats()
    assert st["reference_calls"] == {"rms_norm": 2, "add_rms_norm": 1}
    assert st["fallbacks"] == {} and st["launches"] == {} and st["jit_launches"] == {}
    dispatch.reset_stats()
    assert dispatch.stats()["reference_calls"] == {}


def test_cpu_reference_is_not_a_fallback_even_when_strict(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_STRICT, "1")
    x = torch.randn(3, 64)
    cutile_kernels.rms_norm(x, torch.ones(64))
    assert dispatch.stats()["reference_calls"] == {"rms_norm": 1}


def test_fallback_records_and_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="cutile_kernels"):
        assert dispatch.fallback("k", "some reason") is False
        assert dispatch.fallback("k", "some reason") is False
        assert dispatch.fallback("k", "another reason") is False
    assert dispatch.stats()["fallbacks"] == {"k: some reason": 2, "k: another reason": 1}
    msgs = [r.getMessage() for r in caplog.records if r.name == "cutile_kernels"]
    assert msgs == ["cutile_kernels: k falls back to PyTorch: some reason",
                    "cutile_kernels: k falls back to PyTorch: another reason"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "cutile_kernels")


def test_fallback_raises_when_strict(monkeypatch):
    monkeypatch.setenv("CUTILE_KERNELS_STRICT", "1")
    with pytest.raises(cutile_kernels.FallbackError, match="k has no cuTile path here: why not"):
        dispatch.fallback("k", "why not")
    assert dispatch.stats()["fallbacks"] == {}
    monkeypatch.setenv("CUTILE_KERNELS_STRICT", "0")
    assert dispatch.fallback("k", "why not") is False


@pytest.mark.parametrize("value,expected", [
    (None, False), ("", False), ("0", False), ("no", False), ("off", False),
    ("1", True), ("true", True), ("YES", True), (" on ", True),
])
def test_disabled_follows_env(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("CUTILE_KERNELS_DISABLE", raising=False)
    else:
        monkeypatch.setenv("CUTILE_KERNELS_DISABLE", value)
    assert dispatch.disabled() is expected


def test_run_when_disabled_falls_back_before_touching_cuda(monkeypatch):
    monkeypatch.setenv("CUTILE_KERNELS_DISABLE", "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda *a, **k: pytest.fail("disabled run must not query the device"))
    x = torch.randn(2, 64)
    args = (x, torch.ones(64), torch.empty(2, 64), 1e-6)
    assert dispatch.run("rms_norm", (("BLOCK_N", 64),), args, 2, lambda c: (1, 1, 1)) is False
    assert dispatch.stats()["fallbacks"] == {"rms_norm: disabled by CUTILE_KERNELS_DISABLE": 1}
    monkeypatch.setenv(dispatch.ENV_STRICT, "1")
    with pytest.raises(cutile_kernels.FallbackError, match="disabled"):
        dispatch.run("rms_norm", (("BLOCK_N", 64),), args, 2, lambda c: (1, 1, 1))


# ---------------------------------------------------------------------------------------------
# where the runtime finds a build
# ---------------------------------------------------------------------------------------------

def test_default_build_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTILE_KERNELS_BUILD_DIR", str(tmp_path / "somewhere"))
    assert registry.default_build_dir() == (tmp_path / "somewhere").resolve()
    assert registry.package_dir_of(tmp_path) == tmp_path / "torch-cuda" / "cutile_kernels"


def test_default_build_dir_of_a_checkout(monkeypatch):
    monkeypatch.delenv("CUTILE_KERNELS_BUILD_DIR", raising=False)
    checkout = Path(registry.__file__).resolve().parents[2]
    if not (checkout / "pyproject.toml").is_file():
        pytest.skip("not running from a source checkout")
    assert registry.default_build_dir() == checkout / "build"


def test_find_package_dir_empty_and_present(monkeypatch, tmp_path):
    if (Path(registry.__file__).resolve().parent / "manifest.json").is_file():
        pytest.skip("running from a build variant, which always uses its own manifest")
    monkeypatch.setenv("CUTILE_KERNELS_BUILD_DIR", str(tmp_path))
    assert registry.find_package_dir() is None
    pkg = tmp_path / "torch-cuda" / "cutile_kernels"
    pkg.mkdir(parents=True)
    assert registry.find_package_dir() is None  # a directory without a manifest is no build
    (pkg / "manifest.json").write_text('{"variants": []}')
    assert registry.find_package_dir() == pkg.resolve()
    assert registry.Registry(registry.find_package_dir()).archs == []


def test_interleaved_views_of_one_buffer_do_not_overlap():
    # q and k split from one fused QKV projection (B, S, Nq + 2 Nkv), as attention sees them
    # (B, H, S, D): their byte ranges meet, their elements do not.
    qkv = torch.randn(2, 7, (8 + 2 + 2) * 64, dtype=BF16)
    q, k, v = (t.view(2, 7, -1, 64).transpose(1, 2) for t in qkv.split((512, 128, 128), dim=-1))
    assert registry.overlapping_pair([q, k]) is None and registry.overlapping_pair([q, k, v]) is None
    assert registry.row_arcs(q)[12 * 64 * 2] == 512 * 2 and registry.row_arcs(k)[12 * 64 * 2] == 128 * 2
    # Half a head further, k meets q's last head: overlapping.
    k_shifted = qkv[..., 480:608].view(2, 7, 2, 64).transpose(1, 2)
    assert registry.overlapping_pair([q, k_shifted]) == (0, 1)


def _touched(t: torch.Tensor) -> set:
    """Storage indices of every element of ``t``, enumerated."""
    grids = torch.meshgrid(*[torch.arange(n) for n in t.shape], indexing="ij")
    offsets = sum((i * st for i, st in zip(grids, t.stride())), torch.zeros(t.shape, dtype=torch.long))
    return {int(t.storage_offset() + o) for o in offsets.flatten()}


def test_disjoint_arcs_never_claims_disjoint_for_views_that_share_an_element():
    # Random strided views of one buffer: whenever the check says "disjoint", no element is shared.
    g = torch.Generator().manual_seed(0)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    buf = torch.zeros(4096)
    proven = 0
    for i in range(600):
        row, views = rand(4, 40), []
        for _ in range(2):
            if i % 3:  # rows of one shared stride, as split projections: (rows, heads, head_dim)
                d, h = rand(1, 5), rand(1, 4)
                views.append(buf.as_strided((3, h, d), (row, d, 1), rand(0, 64)))
            else:
                ndim = rand(1, 4)
                shape = [rand(1, 5) for _ in range(ndim)]
                views.append(buf.as_strided(shape, [rand(1, 40) for _ in range(ndim)], rand(0, 64)))
        a, b = views
        if registry.disjoint_arcs(registry.row_arcs(a), registry.row_arcs(b), a.data_ptr(), b.data_ptr()):
            proven += 1
            assert not _touched(a) & _touched(b), (a.shape, a.stride(), a.storage_offset(), b.shape, b.stride(),
                                                   b.storage_offset())
    assert proven > 20  # the check proves some pairs disjoint, not none
