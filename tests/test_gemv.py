"""``gemv`` (``ops/gemv.py``) and patch ``gemv`` (``layers/linear.py``): one-row projections on the
cuTile GEMV. CPU: the reference is ``F.linear``, the checks, the router's choice (one 16-bit row to
the op, anything else to ``F.linear``), the kernel's logic through the NumPy interpreter on every
built tile (ragged N and K, bias), the build matrix, the patch (which modules, undo, the stock bytes
on save, no graph break under ``torch.compile(fullgraph=True)``). GPU: against a float64 product
on real projection shapes and the edges, an output poisoned with NaN first; fp16; a bias; a view
for x; graph replay; an unaligned weight falls back and says so; a patched model's logits.
The gated MLP's down projection with its activation in the same launch (``gemv_swiglu``,
``gemv_geglu``) likewise, and bit for bit the two launches it replaces."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutile_kernels
from cutile_kernels import dispatch
from cutile_kernels.kernel_src import gemv as kgemv
from cutile_kernels.layers import linear as glinear

from families import model as tiny_model
from families import transformers_functions

gops = importlib.import_module("cutile_kernels.ops.gemv")  # the module (ops.gemv is the op)


def _operands(n, k, dtype=torch.float32, device="cpu", bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def test_reference_is_f_linear():
    x, w, b = _operands(24, 32, bias=True)
    assert torch.equal(cutile_kernels.gemv_reference(x, w, b), F.linear(x, w, b))
    assert torch.equal(cutile_kernels.gemv(x, w, b), F.linear(x, w, b))  # CPU: the reference


def test_checks_name_what_does_not_match():
    x, w, b = _operands(24, 32, bias=True)
    with pytest.raises(ValueError, match="exactly one row"):
        cutile_kernels.gemv(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match=r"\(N, K\)"):
        cutile_kernels.gemv(x, w[:, :16])
    with pytest.raises(ValueError, match="bias"):
        cutile_kernels.gemv(x, w, b[:3])
    with pytest.raises(ValueError, match="share a dtype"):
        cutile_kernels.gemv(x.double(), w)
    with pytest.raises(TypeError, match="cutile_kernels.gemv: weight is int32"):
        cutile_kernels.gemv(x, w.int())


def _compiled(fn, *args):
    """``torch.compile(fn, fullgraph=True)(*args)`` on a backend that records our ops in the graphs:
    (output, {op names}, graphs compiled)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    ops = set()

    def backend(gm, example_inputs):
        ops.update(str(n.target).split(".")[-2] for n in gm.graph.nodes
                   if n.op == "call_function" and "cutile_kernels" in str(n.target))
        return gm.forward

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    out = torch.compile(fn, backend=counter, fullgraph=True)(*args)
    torch._dynamo.reset()
    return out, ops, counter.frame_count


def _traced_ops(fn, *args) -> set:
    """Our ops in the graph ``torch.compile(fullgraph=True)`` traces for ``fn(*args)``."""
    return _compiled(fn, *args)[1]


def test_router_sends_a_traced_one_row_16_bit_step_to_the_op_and_the_rest_to_f_linear():
    x, w, _ = _operands(24, 32, torch.bfloat16)
    assert _traced_ops(gops.linear, x, w) == {"gemv"}  # one row, bf16, compiled: the op
    for other in (torch.randn(1, 3, 32).to(torch.bfloat16), x.float()):  # three rows; float32
        assert _traced_ops(gops.linear, other, w.to(other.dtype)) == set()
    dispatch.reset_stats()
    assert torch.equal(gops.linear(x, w), F.linear(x, w))  # an eager step: F.linear (the host paces it)
    assert "gemv" not in dispatch.stats()["reference_calls"]


@pytest.mark.parametrize("n,k,bias", [(24, 32, False), (37, 1040, True), (1, 16, True), (300, 2304, False)],
                         ids=["small", "ragged-n-and-k-bias", "one-output", "gemma-k"])
def test_emulated_kernel_matches_the_product_on_every_tile(n, k, bias):
    """The kernel's logic on the CPU (NumPy interpreter, float32) for every built (BN, BK): N and K
    that are not multiples of the tile (zero-padded loads, bounds-checked stores), a bias."""
    from cutile_numpy import emulate

    x, w, b = _operands(n, k, bias=bias)
    want = (x[0].double() @ w.double().T + (0 if b is None else b.double())).float()
    kernel = kgemv.gemv_bias_kernel if bias else kgemv.gemv_kernel
    run = emulate(kernel, kgemv)
    for bn, bk in kgemv.TILES:
        out = torch.full((1, n), float("nan"))
        args = (x[0], w, *(() if b is None else (b,)), out, bn, bk)
        run((-(-n // bn),), args)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=f"tile {bn}x{bk}")


def test_variants_cover_the_chosen_tiles_in_both_dtypes():
    built = {(s.kernel, s.params[0].dtype, s.constants["BN"], s.constants["BK"]) for s in kgemv.VARIANTS}
    for kernel in ("gemv", "gemv_bias"):
        for dtype in ("bfloat16", "float16"):
            for n, k in [(2048, 2048), (1024, 3072), (7, 16), (2048, 8192)]:
                assert (kernel, dtype, *gops.tile_for(n, k)) in built
    assert gops.tile_for(3072, 2048) is None and gops.tile_for(151936, 1024) is None  # cuBLAS's


@pytest.mark.parametrize("n,k,tile", [(40, 64, (16, 16, 2)), (33, 128, (8, 16, 4)), (1, 32, (16, 16, 2)),
                                      (300, 2304, (16, 256, 4)), (24, 80, (8, 16, 4)), (24, 48, (8, 16, 4))],
                         ids=["ragged-n", "one-partial-block", "one-output", "9-tiles-4-ways", "5-tiles-4-ways",
                              "3-tiles-4-ways"])
def test_emulated_split_k_kernel_matches_the_product_in_any_block_order(n, k, tile):
    """The GEMV sweep's split-K candidate (``dev/sweeps/gemv_variants.py``; rejected in the model) on
    the CPU: whichever block of an output tile arrives last adds the partial rows in index order, so
    the result is the same bit for bit in any arrival order (here in order, reversed and shuffled),
    equals the product, and leaves every count at zero for the next launch; a count left nonzero by
    a broken launch shows as a wrong sum."""
    import random

    from cutile_numpy import emulate

    from dev.sweeps import gemv_variants

    bn, bk, split = tile
    x, w, _ = _operands(n, k)
    want = (x[0].double() @ w.double().T).float()
    run = emulate(gemv_variants.gemv_splitk_kernel, gemv_variants)
    part = torch.full((split, n), float("nan"))
    counts = torch.zeros(-(-n // bn), dtype=torch.int32)
    outs = []
    for order in (None, lambda b: b[::-1], lambda b: random.Random(n).sample(b, len(b))):
        out = torch.full((1, n), float("nan"))
        part.fill_(float("nan"))  # a hand-over that reads a part not yet written shows
        run((-(-n // bn), split), (x[0], w, out, part, counts, bn, bk, split), order=order)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert not counts.any()
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    # A count left at 1 (a launch stopped half-way): the next launch's first block of tile 0 takes
    # itself for the last and reads a partial row not written yet (NaN here), and the count stays off.
    counts[0] = 1
    part.fill_(float("nan"))
    out = torch.full((1, n), float("nan"))
    run((-(-n // bn), split), (x[0], w, out, part, counts, bn, bk, split))
    assert torch.isnan(out[0, :bn]).all() and counts[0] != 0
    torch.testing.assert_close(out[0, bn:], want[0, bn:], rtol=1e-5, atol=1e-5)


def test_interpreter_atomics_count_every_index_and_return_the_old_values():
    """The NumPy interpreter's ``atomic_add`` / ``atomic_xchg`` (what the split-K test relies on): a
    repeated index adds each time, the old values come back in the indices' shape, an index outside
    the array changes nothing, an update of another kind is an error."""
    import numpy as np

    import cutile_numpy as cn

    arr = np.array([1, 2, 3], dtype=np.int32)
    old = cn.atomic_add(arr, np.array([0, 2, 0, 5]), np.int32(10))
    assert old.tolist()[:3] == [1, 3, 11] and arr.tolist() == [21, 2, 13]
    assert cn.atomic_xchg(arr, 1, np.int32(0)) == 2 and arr.tolist() == [21, 0, 13]
    with pytest.raises(cn.UndefinedBehaviour):
        cn.atomic_add(arr, 0, np.float32(1.0))


def test_router_conditions(monkeypatch):
    """What the router sends to the op while a step is compiled or captured (both stand-ins here):
    one contiguous 16-bit row of a plain tensor, K a multiple of 16, N <= 2048; else F.linear."""
    calls = []
    monkeypatch.setattr(gops, "gemv", lambda *a: calls.append(a) or F.linear(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    class Sub(torch.Tensor):  # a weight subclass (a quantized weight put in place after the patch)
        pass

    x, w, b = _operands(64, 32, torch.bfloat16, bias=True)
    big = torch.randn(1, 1, 64).to(torch.bfloat16)
    taken = [(x, w, None), (x, w, b), (x.view(1, 32), w, None), (x.half(), w.half(), None)]
    left = [(big[..., ::2], w, None),  # a strided row
            (x[..., :24], w[:, :24], None),  # K 24
            (x, w.as_subclass(Sub), None), (x.float(), w.float(), None),
            (torch.cat([x, x], 1), w, None)]  # two rows
    for args in taken + left:
        torch.testing.assert_close(gops.linear(*args), F.linear(*args))
    assert len(calls) == len(taken)


def test_router_leaves_wide_projections_to_cublas():
    x, w, _ = _operands(gops.TILE_BY_N[-1][0] + 8, 32, torch.bfloat16)
    assert _traced_ops(gops.linear, x, w) == set()
    x, w, _ = _operands(gops.TILE_BY_N[-1][0], 32, torch.bfloat16)
    assert _traced_ops(gops.linear, x, w) == {"gemv"}


def test_router_takes_the_pdl_shapes_only_in_a_capture_with_twins_on_sm90(monkeypatch):
    """A weight of PDL_SHAPES (Llama-3.2-1B's stacked q/k/v, 3072 x 2048) goes to the op in a captured
    step that launches twins with the attribute: inside ``programmatic_launches`` or a capture of its
    own (``CAPTURE_TWINS``), on sm_90+; not with the switch off, not on sm_8x, not while tracing, and
    other shapes past TILE_BY_N (wider, deeper, or between) keep F.linear."""
    n, k = gops.PDL_SHAPES[0]
    x, w, _ = _operands(n, k, torch.bfloat16)
    with dispatch.programmatic_launches():
        assert _traced_ops(gops.linear, x, w) == set()  # compiled: decided while tracing, no capture then
    calls = []
    monkeypatch.setattr(gops, "gemv", lambda *a: calls.append(a[1].shape) or F.linear(*a))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(dispatch, "_capturing", lambda: True)
    arch = {"sm90": True}
    monkeypatch.setattr(dispatch, "launches_programmatic", lambda index: arch["sm90"])
    shapes = [(n, k), (n + 16, k), (n, k + 16), (n - 512, k)]
    ops = [_operands(*s, torch.bfloat16)[:2] for s in shapes]

    def taken():
        calls.clear()
        for x, w in ops:
            torch.testing.assert_close(gops.linear(x, w), F.linear(x, w))
        return list(calls)

    assert taken() == []  # a capture of its own, CAPTURE_TWINS off (the default)
    monkeypatch.setattr(dispatch, "CAPTURE_TWINS", True)
    assert taken() == [torch.Size((n, k))]
    with dispatch.programmatic_launches():
        assert taken() == [torch.Size((n, k))]
    with dispatch.programmatic_launches(False):
        assert taken() == []
    monkeypatch.setattr(dispatch, "CAPTURE_TWINS", False)
    assert taken() == []
    arch["sm90"] = False
    with dispatch.programmatic_launches():
        assert taken() == []  # sm_8x: the twin would run without the wait, and cuBLAS wins there


# ---------------------------------------------------------------------------------------------
# The MLP block's exit: the residual add in the down projection's epilogue
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(24, 32), (37, 1040), (1, 16), (300, 2304)],
                         ids=["small", "ragged-n-and-k", "one-output", "gemma-k"])
def test_emulated_residual_kernel_matches_on_every_tile(n, k):
    """``gemv_residual_kernel`` on the CPU (NumPy interpreter, float32) for every built tile, with and
    without the wait (``PDL`` 1: the interpreter fails a read before it, the residual's included):
    ``residual + x W^T`` on a NaN-poisoned output, N and K off the tile."""
    from cutile_numpy import emulate

    x, w, _ = _operands(n, k)
    residual = torch.randn(1, n, generator=torch.Generator().manual_seed(3))
    want = (residual.double() + x[0].double() @ w.double().T).float()
    run = emulate(kgemv.gemv_residual_kernel, kgemv)
    for bn, bk in kgemv.TILES:
        for pdl in (0, 1):
            out = torch.full((1, n), float("nan"))
            run((-(-n // bn),), (x[0], w, residual, out, bn, bk, pdl))
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=f"tile {bn}x{bk} PDL {pdl}")


def test_residual_op_is_the_add_after_the_projection_and_checks_its_operands():
    x, w, _ = _operands(24, 32, torch.bfloat16)
    residual = torch.randn(1, 1, 24).to(torch.bfloat16)
    assert torch.equal(cutile_kernels.gemv_residual(x, w, residual), residual + F.linear(x, w))
    with pytest.raises(ValueError, match="output's shape"):
        cutile_kernels.gemv_residual(x, w, residual[..., :23])
    with pytest.raises(ValueError, match="dtype"):
        cutile_kernels.gemv_residual(x, w, residual.half())
    with pytest.raises(ValueError, match="gemv_residual: x .* exactly one row"):
        cutile_kernels.gemv_residual(torch.cat([x, x], 1), w, torch.cat([residual, residual], 1))
    with pytest.raises(TypeError, match="residual must be a tensor"):
        cutile_kernels.gemv_residual(x, w, None)


def test_residual_router_adds_in_the_gemv_only_where_linear_takes_the_gemv(monkeypatch):
    """On the tiles of RESIDUAL_TILES (none by default), one bf16 row traced: one ``gemv_residual``; a
    bias, three rows or a wide projection: the projection as :func:`linear` routes it, then the add; an
    eager step: F.linear and the add."""
    x, w, _ = _operands(24, 32, torch.bfloat16)
    residual = torch.randn(1, 1, 24).to(torch.bfloat16)
    assert _traced_ops(gops.linear_residual, x, w, None, residual) == {"gemv"}  # not routed by default
    monkeypatch.setattr(gops, "RESIDUAL_TILES", kgemv.TILES)
    assert _traced_ops(gops.linear_residual, x, w, None, residual) == {"gemv_residual"}
    assert _traced_ops(gops.linear_residual, x, w, torch.zeros(24, dtype=torch.bfloat16), residual) == {"gemv"}
    rows = torch.randn(1, 3, 32).to(torch.bfloat16)
    assert _traced_ops(gops.linear_residual, rows, w, None, torch.randn(1, 3, 24).to(torch.bfloat16)) == set()
    wide, wr = _operands(gops.TILE_BY_N[-1][0] + 8, 32, torch.bfloat16)[1], torch.randn(1, 1, 2056).to(torch.bfloat16)
    assert _traced_ops(gops.linear_residual, x, wide, None, wr) == set()
    dispatch.reset_stats()
    assert torch.equal(gops.linear_residual(x, w, None, residual), residual + F.linear(x, w))
    assert not dispatch.stats()["reference_calls"]


# ---------------------------------------------------------------------------------------------
# The gated MLP's down projection: activation + GEMV in one launch
# ---------------------------------------------------------------------------------------------

#: kernel -> (gelu, the activation's reference, the activation op it replaces)
GLU = {"gemv_swiglu": (False, cutile_kernels.silu_and_mul_fused_reference, "silu_and_mul_fused"),
       "gemv_geglu": (True, cutile_kernels.gelu_tanh_and_mul_fused_reference, "gelu_tanh_and_mul_fused")}


def _glu_operands(n, k, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(1, 1, 2 * k, generator=g)).to(dtype).to(device)  # gate/up row, gate first
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("kernel", list(GLU))
def test_glu_reference_is_the_activation_then_f_linear(kernel):
    _, act, _ = GLU[kernel]
    x, w = _glu_operands(24, 32)
    fn, ref = getattr(cutile_kernels, kernel), getattr(cutile_kernels, f"{kernel}_reference")
    assert torch.equal(ref(x, w), F.linear(act(x), w))
    assert torch.equal(fn(x, w), F.linear(act(x), w))  # CPU: the reference
    with pytest.raises(ValueError, match="2K"):
        fn(x[..., :48], w)
    with pytest.raises(ValueError, match="exactly one row"):
        fn(torch.cat([x, x], 1), w)
    with pytest.raises(ValueError, match="share a dtype"):
        fn(x.double(), w)


@pytest.mark.parametrize("n,k", [(24, 32), (37, 1040), (1, 16), (300, 2320)],
                         ids=["small", "ragged-n-and-k", "one-output", "ragged-k-wide"])
def test_emulated_glu_kernel_matches_on_every_tile(n, k):
    """``gemv_glu_kernel`` on the CPU (NumPy interpreter, float32) for both activations and every
    built tile: zero-padded gate/up tiles past K must add nothing, the store is bounds-checked."""
    from cutile_numpy import emulate

    x, w = _glu_operands(n, k)
    run = emulate(kgemv.gemv_glu_kernel, kgemv)
    for kernel, (gelu, act, _) in GLU.items():
        want = F.linear(act(x.double()), w.double())[0].float()
        for bn, bk in kgemv.TILES:
            out = torch.full((1, n), float("nan"))
            run((-(-n // bn),), (x[0].view(1, 2, k), w, out, bn, bk, kgemv.GLU[kernel]))
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=f"{kernel} tile {bn}x{bk}")


def test_glu_variants_cover_the_chosen_tiles_in_both_dtypes():
    built = {(s.kernel, s.params[0].dtype, s.params[0].ndim, s.constants["BN"], s.constants["BK"],
              s.constants["GELU"]) for s in kgemv.VARIANTS if s.kernel in GLU}
    for kernel, (gelu, _, _) in GLU.items():
        for dtype in ("bfloat16", "float16"):
            for n, k in [(2048, 8192), (1024, 3072), (1152, 6912), (7, 16)]:
                assert (kernel, dtype, 3, *gops.tile_for(n, k), int(gelu)) in built


def test_glu_router_fuses_a_traced_one_row_step_only(monkeypatch):
    """With the fused kernel routed on every tile: one bf16 row traced is one ``gemv_swiglu``
    (``gemv_geglu``); three rows, float32, a bias or a wide projection: our activation op, then the
    projection as :func:`linear` routes it; an eager step: the activation op and F.linear, with the
    reference's values. Routed on no tile (the shipped ``GLU_TILES``): the activation op, then the GEMV."""
    x, w = _glu_operands(24, 32, torch.bfloat16)
    assert gops.GLU_TILES == ()
    for gelu, _, act_op in GLU.values():
        assert _traced_ops(lambda a, b: gops.glu_linear(a, b, gelu=gelu), x, w) == {act_op, "gemv"}
    monkeypatch.setattr(gops, "GLU_TILES", kgemv.TILES)
    for kernel, (gelu, act, act_op) in GLU.items():
        assert _traced_ops(lambda a, b: gops.glu_linear(a, b, gelu=gelu), x, w) == {kernel}
        rows = torch.randn(1, 3, 64).to(torch.bfloat16)
        assert _traced_ops(lambda a, b: gops.glu_linear(a, b, gelu=gelu), rows, w) == {act_op}
        assert _traced_ops(lambda a, b: gops.glu_linear(a, b, gelu=gelu), x.float(), w.float()) == {act_op}
        bias = torch.randn(24).to(torch.bfloat16)
        assert _traced_ops(lambda a, b, c: gops.glu_linear(a, b, c, gelu=gelu), x, w, bias) == {act_op, "gemv"}
        _, wide = _glu_operands(gops.TILE_BY_N[-1][0] + 8, 32, torch.bfloat16)
        assert _traced_ops(lambda a, b: gops.glu_linear(a, b, gelu=gelu), x, wide) == {act_op}
        dispatch.reset_stats()
        assert torch.equal(gops.glu_linear(x, w, gelu=gelu), F.linear(act(x), w))
        assert kernel not in dispatch.stats()["reference_calls"]


# ---------------------------------------------------------------------------------------------
# The patch
# ---------------------------------------------------------------------------------------------


class _LoRALinear(nn.Linear):
    """A subclass (as PEFT's layers are): keeps its own forward."""


def test_patch_switches_exact_linears_only_and_undoes():
    model = tiny_model("llama", seed=0)
    model.model.layers[0].mlp.down_proj.__class__ = _LoRALinear
    hooked = model.model.layers[1].self_attn.o_proj
    hooked.register_forward_hook(lambda *a: None)
    wrapped = model.model.layers[1].self_attn.q_proj
    wrapped.forward = types.MethodType(lambda self, x: nn.Linear.forward(self, x), wrapped)  # e.g. accelerate's
    unhooked = model.model.layers[1].self_attn.k_proj
    unhooked.forward = types.MethodType(nn.Linear.forward, unhooked)  # what remove_hook_from_module leaves
    assert cutile_kernels.layers._patching.PATCHES["gemv"].default  # kernel_config() and kernelize apply it
    linears = [m for m in model.model.layers.modules() if type(m) is nn.Linear]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = cutile_kernels.patch(model, names=["gemv"])
    n = report.changed["gemv"]
    assert n == len(linears) - 2  # every exact nn.Linear of the decoder layers but the hooked and wrapped ones
    assert type(model.lm_head) is nn.Linear  # outside the layer stack
    assert all(type(m) is glinear.CutileGemvLinear for m in linears if m is not hooked and m is not wrapped)
    assert type(hooked) is nn.Linear and type(wrapped) is nn.Linear
    assert type(model.model.layers[0].mlp.down_proj) is _LoRALinear
    # A class switch: no forward on the instances, parameters and state_dict untouched.
    assert not any("forward" in m.__dict__ for m in linears if m is not wrapped)  # the left-over binding dropped
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert cutile_kernels.patch(model, names=["gemv"]).changed.get("gemv", 0) == 0  # idempotent
    assert cutile_kernels.unpatch(model, names=["gemv"]).changed["gemv"] == n
    assert all(type(m) is nn.Linear for m in linears)
    assert not any(type(m) is glinear.CutileGemvLinear for m in model.modules())


def test_switched_class_pickles_and_stacks_as_nn_linear():
    """The switched class is importable by name (pickle, deepcopy) and counts as ``nn.Linear`` for
    the stacking patches' check, but a subclass of it does not."""
    import copy
    import pickle

    from cutile_kernels.layers._fusion import linear_problem

    model = tiny_model("llama", seed=0)
    cutile_kernels.patch(model, names=["gemv"])
    proj = model.model.layers[0].self_attn.k_proj
    assert linear_problem(proj) is None
    for clone in (pickle.loads(pickle.dumps(proj)), copy.deepcopy(proj)):
        assert type(clone) is glinear.CutileGemvLinear and torch.equal(clone.weight, proj.weight)

    class Sub(glinear.CutileGemvLinear):
        pass

    proj.__class__ = Sub
    assert "not nn.Linear" in linear_problem(proj)


def test_patched_projection_traces_with_fx_as_nn_linear():
    """``torch.fx`` treats torch.nn's modules as leaves but traces into ours: a patched projection traces
    to ``F.linear`` on its parameters, with the module's numbers."""
    import torch.fx

    model = tiny_model("llama", seed=0)
    cutile_kernels.patch(model, names=["gemv"])
    proj = model.model.layers[0].self_attn.o_proj
    assert type(proj) is glinear.CutileGemvLinear

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = proj

        def forward(self, x):
            return self.p(x)

    traced = torch.fx.symbolic_trace(Wrap())
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"] == [F.linear]
    x = torch.randn(3, proj.in_features)
    torch.testing.assert_close(traced(x), F.linear(x, proj.weight))


def test_unpatch_rebases_a_projection_parametrized_after_the_patch():
    """``torch.nn.utils.parametrize`` makes a parametrized module a class of its own over the module's
    class: ``unpatch`` rebases that class onto ``nn.Linear``, so the GEMV is gone with the patch."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    model = tiny_model("llama", seed=0)
    cutile_kernels.patch(model, names=["gemv"])
    proj = model.model.layers[0].mlp.down_proj
    parametrize.register_parametrization(proj, "weight", Doubled())
    assert isinstance(proj, glinear.CutileGemvLinear)
    n = cutile_kernels.unpatch(model, names=["gemv"]).changed["gemv"]
    assert n == len([m for m in model.model.layers.modules() if isinstance(m, nn.Linear)])
    assert not isinstance(proj, glinear.CutileGemvLinear) and isinstance(proj, nn.Linear)
    parametrize.remove_parametrizations(proj, "weight")
    assert type(proj) is nn.Linear


def test_patched_model_decodes_as_stock_and_saves_the_stock_bytes(tmp_path):
    from safetensors.torch import load_file

    stock = tiny_model("llama", seed=1).to(torch.bfloat16)
    ours = tiny_model("llama", seed=1).to(torch.bfloat16)
    cutile_kernels.patch(ours, names=["gemv"])
    dispatch.reset_stats()
    ids = torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        a, b = stock(ids, use_cache=True), ours(ids, use_cache=True)
        nxt = torch.tensor([[5]])
        a2 = stock(nxt, past_key_values=a.past_key_values).logits
        b2 = ours(nxt, past_key_values=b.past_key_values).logits
    assert torch.equal(a.logits, b.logits) and torch.equal(a2, b2)
    assert "gemv" not in dispatch.stats()["reference_calls"]  # eager steps stay on F.linear
    stock.save_pretrained(tmp_path / "stock")
    ours.save_pretrained(tmp_path / "ours")
    sa, sb = load_file(tmp_path / "stock" / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)


def test_patched_decode_step_compiles_without_a_graph_break():
    model = tiny_model("llama", seed=2).to(torch.bfloat16)
    cutile_kernels.patch(model, names=["gemv"])
    ids = torch.tensor([[7]])
    with torch.no_grad():
        got, ops, graphs = _compiled(lambda ids: model(ids, use_cache=False).logits, ids)
        ref = model(ids, use_cache=False).logits
    assert graphs == 1 and "gemv" in ops
    assert torch.equal(got, ref)


@pytest.mark.parametrize("family,stacking,kernel", [("llama", "fused_gate_up", "gemv_swiglu"),
                                                    ("gemma3_text", "fused_gate_up_geglu", "gemv_geglu")])
def test_stacked_mlp_step_fuses_its_activation_into_the_down_projection(family, stacking, kernel, monkeypatch):
    """A one-token step of a model with stacked gate/up and patch ``gemv``, compiled with fullgraph,
    the fused kernel routed on every tile: each MLP's activation and down projection are one fused op
    (no separate activation op); the logits are the eager step's. Without patch ``gemv`` the
    activation op stays; so it does with the shipped (empty) ``GLU_TILES``, before the GEMV."""
    act_op = GLU[kernel][2]
    model = tiny_model(family, seed=5).to(torch.bfloat16)
    cutile_kernels.patch(model, names=[stacking, "gemv"])
    ids = torch.tensor([[7]])
    with torch.no_grad():
        _, ops, _ = _compiled(lambda ids: model(ids, use_cache=False).logits, ids)
        assert {act_op, "gemv"} <= ops and kernel not in ops
        monkeypatch.setattr(gops, "GLU_TILES", kgemv.TILES)
        got, ops, graphs = _compiled(lambda ids: model(ids, use_cache=False).logits, ids)
        dispatch.reset_stats()
        ref = model(ids, use_cache=False).logits
        calls = dispatch.stats()["reference_calls"]  # the eager step: activation op, then F.linear
        assert act_op in calls and kernel not in calls
        assert graphs == 1 and kernel in ops and act_op not in ops
        assert torch.equal(got, ref)
        cutile_kernels.unpatch(model, names=["gemv"])
        _, ops, _ = _compiled(lambda ids: model(ids, use_cache=False).logits, ids)
    assert act_op in ops and kernel not in ops


def test_hooked_down_projection_keeps_its_module_call(monkeypatch):
    """A forward hook on ``down_proj`` sees the activation's output: the fused op is not used there."""
    monkeypatch.setattr(gops, "GLU_TILES", kgemv.TILES)
    model = tiny_model("llama", seed=6).to(torch.bfloat16)
    cutile_kernels.patch(model, names=["fused_gate_up", "gemv"])
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        _, ops, _ = _compiled(lambda ids: model(ids, use_cache=False).logits, torch.tensor([[7]]))
    assert "gemv_swiglu" in ops and "silu_and_mul_fused" in ops  # the other layers fuse; layer 0 does not
    assert seen and seen[0][-1] == model.config.intermediate_size


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

#: (N, K): Llama-3.2-1B's stacked q/k/v, o_proj, gate/up, down_proj; Qwen3-0.6B's o_proj and
#: lm_head; Gemma 2's K = 2304 (not a multiple of 512); N of no tile's multiple (1001 on 8 x 512,
#: 2040 on 16 x 256, both routed); K = 2320 (a multiple of neither 256 nor 512); one output.
GPU_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1024, 2048), (151936, 1024),
              (4096, 2304), (1001, 2048), (2040, 2320), (1, 16)]


def _launches(part: str) -> int:
    """Launches since the last ``reset_stats`` of the variants whose symbol contains ``part``
    (``"gemv"``: every GEMV kernel)."""
    return sum(v for key, v in dispatch.stats()["launches"].items() if part in key)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_gpu_matches_a_float64_product(shape, dtype, bias, strict):
    n, k = shape
    x, w, b = _operands(n, k, dtype, "cuda", bias, seed=n + k)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    # Poison the block the op's output will get: the caching allocator hands a freed block of the
    # same size back (an unwritten element then reads NaN).
    poison = torch.full((1, 1, n), float("nan"), device="cuda", dtype=dtype)
    del poison
    dispatch.reset_stats()
    got = cutile_kernels.gemv(x, w, b)
    torch.cuda.synchronize()
    assert got.shape == (1, 1, n) and torch.isfinite(got).all()
    assert _launches("gemv") == 1
    cublas = _rel(F.linear(x, w, b), want)
    assert _rel(got, want) <= max(1.5 * cublas, 4e-3)


@pytest.mark.gpu
def test_gpu_every_tile_writes_every_output(strict):
    n, k = 1001, 2320  # ragged on every tile in N and K
    x, w, b = _operands(n, k, torch.bfloat16, "cuda", True)
    want = x[0].double() @ w.double().T + b.double()
    for bias in (None, b):
        for tile in kgemv.TILES:
            out = torch.full((1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            assert gops.gemv_into(x[0], w, bias, out, tile)
            extra = 0 if bias is not None else b.double()
            assert _rel(out, want - extra) < 4e-3, (bias is not None, tile)


@pytest.mark.gpu
def test_gpu_x_as_a_view_and_graph_replay(strict):
    """``cutile_kernels.gemv`` with x an offset view (as a split of a stacked projection), then
    captured in a CUDA graph and replayed over fresh inputs into a NaN-poisoned output, each result
    against a float64 product."""
    n, k = 3072, 2048
    _, w, _ = _operands(n, k, torch.bfloat16, "cuda")
    big = torch.randn(1, 1, 3 * k, device="cuda", dtype=torch.bfloat16)
    x = big[..., k:2 * k]  # a view with an offset
    got = cutile_kernels.gemv(x, w)
    assert _rel(got, x.double() @ w.double().T) < 4e-3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cutile_kernels.gemv(x, w)
    for seed in range(3):
        big.copy_(torch.randn(big.shape, generator=torch.Generator().manual_seed(seed)).to(big))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, x.double() @ w.double().T) < 4e-3


@pytest.mark.gpu
def test_gpu_unaligned_operands_fall_back_and_say_so(caplog):
    """K of 40, a weight view 2 bytes off 16-byte alignment, a strided row: no variant assumes
    them; each call logs why and returns F.linear's result. A row-strided weight view that keeps
    the alignment runs the kernel."""
    n, k = 64, 48
    x, w, _ = _operands(n, k, torch.bfloat16, "cuda")
    wide = torch.randn(n, k + 16, device="cuda", dtype=torch.bfloat16)
    row = torch.randn(1, 1, 2 * k, device="cuda", dtype=torch.bfloat16)
    cases = [(x[..., :40], w[:, :40].contiguous()), (x, wide[:, 1:1 + k]), (row[..., ::2], w)]
    for xx, ww in cases:
        dispatch.reset_stats()
        with caplog.at_level("WARNING", logger="cutile_kernels"):
            got = cutile_kernels.gemv(xx, ww)
        assert torch.equal(got, F.linear(xx, ww)), (xx.shape, ww.stride())
        assert "gemv" in str(dispatch.stats()["fallbacks"])
    assert "gemv" in caplog.text
    dispatch.reset_stats()
    got = cutile_kernels.gemv(x, wide[:, :k])  # rows 2 * (k + 16) bytes apart: still aligned
    assert _launches("gemv") == 1
    assert _rel(got, x.double() @ wide[:, :k].double().T) < 4e-3


@pytest.mark.gpu
def test_gpu_router_runs_the_gemv_only_in_a_captured_step(strict):
    x, w, _ = _operands(2048, 2048, torch.bfloat16, "cuda")
    dispatch.reset_stats()
    eager = gops.linear(x, w)
    assert _launches("gemv") == 0  # eager: F.linear
    gops.gemv(x, w)  # load the kernel outside the capture
    dispatch.reset_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gops.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert _launches("gemv") == 1
    assert _rel(out, x.double() @ w.double().T) <= max(1.5 * _rel(eager, x.double() @ w.double().T), 4e-3)


def _captured_step(model: tuple, patches: list) -> tuple:
    """A one-token forward of the tiny ``(family, seed)`` model in bf16 with ``patches``, run once
    eagerly on a side stream, then captured in a CUDA graph (launch counts reset just before the
    capture) and replayed into a NaN-filled output: (replayed logits, float64 stock logits, bf16
    stock logits, the patched model)."""
    family, seed = model
    stock = tiny_model(family, seed=seed).to("cuda", torch.bfloat16)
    ours = tiny_model(family, seed=seed).to("cuda", torch.bfloat16)
    cutile_kernels.patch(ours, names=patches)
    ids = torch.tensor([[5]], device="cuda")
    with torch.no_grad():
        with transformers_functions(stock):  # a model kernelized earlier may have rebound them
            ref = tiny_model(family, seed=seed).to("cuda", torch.float64)(ids, use_cache=False).logits
            a = stock(ids, use_cache=False).logits
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ours(ids, use_cache=False)  # eager: F.linear; the GEMV loads inside the capture below
        torch.cuda.current_stream().wait_stream(side)
        dispatch.reset_stats()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ours(ids, use_cache=False).logits
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    return out, ref, a, ours


@pytest.mark.gpu
def test_gpu_patched_model_in_a_cuda_graph_at_batch_one(strict):
    """A one-token forward of the patched model captured in a CUDA graph runs our GEMV (the
    capture launches it) and replays to logits as close to float64 as stock bf16's."""
    out, ref, a, _ = _captured_step(("llama", 3), ["gemv"])
    assert _launches("gemv") > 0
    assert torch.isfinite(out).all() and _rel(out, ref) <= 1.5 * _rel(a, ref) + 1e-6


def test_projections_stacked_or_unstacked_later_are_covered_too():
    """A stacking patch applied after ``gemv`` (``patch(model, names=["fused_qkv"])`` on a kernelized
    model), and its undo, leave every projection of the layers on the GEMV's forward."""
    model = tiny_model("llama", seed=4)
    cutile_kernels.patch(model)  # the defaults: gemv on, q/k/v not stacked (fused_qkv is opt-in)

    def uncovered():
        return [n for n, m in model.model.layers.named_modules()
                if type(m) is nn.Linear]

    assert uncovered() == []
    report = cutile_kernels.patch(model, names=["fused_qkv"])
    assert report.changed["fused_qkv"] == len(model.model.layers) and report.changed["gemv"] == len(model.model.layers)
    assert uncovered() == [] and all(hasattr(layer.self_attn, "qkv_proj") for layer in model.model.layers)
    cutile_kernels.unpatch(model, names=["fused_qkv"])
    assert uncovered() == [] and all(hasattr(layer.self_attn, "k_proj") for layer in model.model.layers)


#: (N, K) of down projections: Llama-3.2-1B, Qwen3-0.6B, Gemma-3-1B (K 6912: a multiple of 256, not
#: of 512), N and K ragged on every tile, one output.
GLU_GPU_SHAPES = [(2048, 8192), (1024, 3072), (1152, 6912), (1001, 2320), (1, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(GLU))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", GLU_GPU_SHAPES, ids=str)
def test_gpu_glu_matches_a_float64_product(shape, dtype, kernel, strict):
    """One launch, no activation launch; as close to the float64 down projection of the rounded
    activation as the stock two-step bf16/fp16 path."""
    n, k = shape
    _, act, _ = GLU[kernel]
    x, w = _glu_operands(n, k, dtype, "cuda", seed=n + k)
    h = act(x)  # rounded to the dtype as stock rounds it
    want = F.linear(h.double(), w.double())
    # The caching allocator hands this freed block to the op's output: an unwritten element reads NaN.
    poison = torch.full((1, 1, n), float("nan"), device="cuda", dtype=dtype)
    del poison
    dispatch.reset_stats()
    got = getattr(cutile_kernels, kernel)(x, w)
    torch.cuda.synchronize()
    assert got.shape == (1, 1, n) and torch.isfinite(got).all()
    assert _launches("gemv_glu") == 1 and _launches("and_mul") == 0
    assert _rel(got, want) <= max(1.5 * _rel(F.linear(h, w), want), 4e-3)


@pytest.mark.gpu
def test_gpu_glu_is_the_two_launches_bit_for_bit_on_every_tile(strict):
    """The fused kernel equals our activation kernel followed by the GEMV on the same tile, bit for
    bit (same roundings, same order of sums), ragged N and K, every output written."""
    n, k = 1001, 2320
    x, w = _glu_operands(n, k, torch.bfloat16, "cuda", seed=9)
    for kernel, (_, _, act_op) in GLU.items():
        h = getattr(cutile_kernels, act_op)(x)
        for tile in kgemv.TILES:
            fused = torch.full((1, 1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            two = torch.full((1, 1, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            assert gops.gemv_glu_into(kernel, x, w, fused, tile) and gops.gemv_into(h, w, None, two, tile)
            torch.cuda.synchronize()
            assert torch.isfinite(fused).all() and torch.equal(fused, two), (kernel, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("family,stacking", [("llama", "fused_gate_up"), ("gemma3_text", "fused_gate_up_geglu")])
def test_gpu_stacked_mlp_model_in_a_cuda_graph_fuses_the_activation(family, stacking, strict, monkeypatch):
    """A one-token forward of a model with stacked gate/up and patch ``gemv``, the fused kernel routed
    on every tile, captured in a CUDA graph: the capture launches the fused down projection and no
    activation kernel; replayed, the logits are as close to float64 as stock bf16's."""
    monkeypatch.setattr(gops, "GLU_TILES", kgemv.TILES)
    out, ref, a, ours = _captured_step((family, 7), [stacking, "gemv"])
    assert _launches("gemv_glu") == len(ours.model.layers) and _launches("and_mul") == 0
    assert torch.isfinite(out).all() and _rel(out, ref) <= 1.5 * _rel(a, ref) + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(2048, 8192), (1024, 3072), (1001, 2320)], ids=["llama-down", "qwen3-down", "ragged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_residual_is_the_gemv_and_the_add_bit_for_bit(n, k, dtype, strict):
    """``gemv_residual`` equals the GEMV on the same tile followed by torch's 16-bit add, bit for bit,
    every output written (NaN-poisoned), with a strided residual; as a twin in a captured graph
    (``PDL`` 1) replayed on fresh inputs, the same; and the op captured plainly and under
    ``torch.compile(fullgraph=True)`` computes what it does eagerly."""
    from launches import launched_variants, replays_and_compiles

    x, w, _ = _operands(n, k, dtype, "cuda", seed=4)
    residual = torch.randn(1, 1, 2 * n, device="cuda", dtype=dtype)[..., ::2]
    for tile in kgemv.TILES:
        prod = torch.full((1, 1, n), float("nan"), device="cuda", dtype=dtype)
        assert gops.gemv_into(x, w, None, prod, tile)
        out = torch.full((1, 1, n), float("nan"), device="cuda", dtype=dtype)
        assert gops._launch("gemv_residual", (x, w, residual, out), w, tile, gops._residual_rows)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and torch.equal(out, residual + prod), tile
    before = dict(dispatch.stats()["launches"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), dispatch.programmatic_launches():
        got = cutile_kernels.gemv_residual(x, w, residual)
    assert {(v.kernel, v.constants.get("PDL")) for v in launched_variants(before)} == {("gemv_residual", 1)}
    for i in range(5):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        assert torch.equal(got, residual + gops.gemv(x, w)), i
    replays_and_compiles(lambda x, w, r: (cutile_kernels.gemv_residual(x, w, r),), [x, w, residual], scaled=2)


def test_sweep_candidates_include_what_ships_and_compute_the_product():
    """dev/sweeps/gemv_sweep.py (run on the GPU by hand) times the shipped tiles beside its
    candidates, one tag each; the candidates' device code (latency hint, per-tile row sum, the split
    kernel's loop bounds) is the same product, checked here in the CPU emulator on N and K that are
    not multiples of the tile (the split-K candidate has its own test above)."""
    from cutile_numpy import emulate

    from dev.sweeps import gemv_sweep, gemv_variants

    specs = gemv_sweep.candidates()
    assert len({s.tag for s in specs}) == len(specs)
    for bn, bk in kgemv.TILES:
        assert any(s.function == "gemv_kernel" and s.module == "gemv"
                   and s.constants == {"BN": bn, "BK": bk, "PDL": 0} for s in specs)
    n, k = 40, 272
    x, w, _ = _operands(n, k, bias=False)
    want = (x[0].double() @ w.double().T).float()
    for kernel in (gemv_variants.gemv_lat_kernel, gemv_variants.gemv_rowsum_kernel):
        out = torch.full((1, n), float("nan"))
        emulate(kernel, gemv_variants)((-(-n // 16),), (x[0], w, out, 16, 128, 4))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=str(kernel._pyfunc.__name__))
    out = torch.full((1, n), float("nan"))
    emulate(gemv_variants.gemv_range_kernel, gemv_variants)((-(-n // 16), 1), (x[0], w, out, 16, 128))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,tile", [(40, 64, (16, 16, 2)), (33, 128, (8, 16, 4)), (300, 2304, (16, 128, 4)),
                                      (24, 96, (8, 64, 2))],
                         ids=["ragged-n", "one-partial-block", "wide-4-ways", "tile-past-the-part"])
def test_emulated_static_split_kernels_match_the_product_in_any_block_order(n, k, tile):
    """The GEMV sweep's static split (``gemv_split3_kernel`` over (N, SPLIT, K / SPLIT) views) on the
    CPU: the product in any block arrival order, bit for bit across orders, every count back at zero;
    its stream-only diagnostic (``gemv_split3_part_kernel``) writes partial rows that sum to the
    product and leaves ``out`` alone. A K tile wider than a part (48 of 64) is zero-padded."""
    import random

    from cutile_numpy import emulate

    from dev.sweeps import gemv_variants

    bn, bk, split = tile
    x, w, _ = _operands(n, k)
    want = (x[0].double() @ w.double().T).float()
    xv, wv = x[0].view(1, split, -1), w.view(n, split, -1)
    grid = (-(-n // bn), split)
    part = torch.full((split, n), float("nan"))
    counts = torch.zeros(grid[0], dtype=torch.int32)
    run = emulate(gemv_variants.gemv_split3_kernel, gemv_variants)
    outs = []
    for order in (None, lambda b: b[::-1], lambda b: random.Random(n).sample(b, len(b))):
        out = torch.full((1, n), float("nan"))
        part.fill_(float("nan"))  # a hand-over that reads a part not yet written shows
        run(grid, (xv, wv, out, part, counts, bn, bk, split), order=order)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert not counts.any()
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs)
    part.fill_(float("nan"))
    out = torch.full((1, n), float("nan"))
    emulate(gemv_variants.gemv_split3_part_kernel, gemv_variants)(grid, (xv, wv, out, part, counts, bn, bk, split))
    torch.testing.assert_close(part.sum(0, keepdim=True), want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(out).all() and not counts.any()
