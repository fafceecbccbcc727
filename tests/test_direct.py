"""Direct forwards (layers/_direct.py): the patched decoder, attention and MLP skip the module calls
of their children only when the call would run nothing else, and every hook still runs.

On the CPU the ops take their reference paths, so a patched model's logits equal the stock
model's exactly, hooks or not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cutile_kernels
from cutile_kernels.layers import _direct

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

LAYERS = 3


def _pair(model_type: str = "llama"):
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)
    if model_type in ("mistral", "qwen3"):
        kw["head_dim"] = 16
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    ours = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    ours.load_state_dict(stock.state_dict())
    cutile_kernels.patch(ours)
    return stock, ours


@pytest.fixture
def ids():
    return torch.randint(0, 256, (2, 7))


class _Calls:
    """Counts the module calls that go through ``nn.Module.__call__``, per module class."""

    def __init__(self, monkeypatch):
        self.counts: dict[str, int] = {}
        real = nn.Module._call_impl

        def counting(module, *args, **kwargs):
            name = type(module).__name__
            self.counts[name] = self.counts.get(name, 0) + 1
            return real(module, *args, **kwargs)

        monkeypatch.setattr(nn.Module, "_call_impl", counting)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_without_hooks_the_children_are_not_module_called(model_type, grad_mode, ids, monkeypatch):
    stock, ours = _pair(model_type)
    mode = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    with mode():
        want = stock(ids).logits
        calls = _Calls(monkeypatch)
        got = ours(ids).logits
    assert torch.equal(got, want)
    # The decoder layers are called by the model; inside them no projection, MLP or attention is.
    assert calls.counts.get("Linear", 0) == 1, calls.counts  # lm_head only
    assert not any("MLP" in name or "Attention" in name for name in calls.counts), calls.counts
    assert calls.counts[type(ours.model.layers[0]).__name__] == LAYERS


@pytest.mark.parametrize("target", ["q_proj", "o_proj", "self_attn", "mlp", "gate_up_proj", "down_proj"])
def test_a_forward_hook_on_a_child_runs_and_its_edit_counts(target, ids):
    stock, ours = _pair()
    seen = {"stock": 0, "ours": 0}

    def hook(tag):
        def fn(module, args, out):
            seen[tag] += 1
            if isinstance(out, tuple):
                return (out[0] * 0.5, *out[1:])
            return out * 0.5
        return fn

    for tag, model in (("stock", stock), ("ours", ours)):
        layer = model.model.layers[1]
        child = {"self_attn": layer.self_attn, "mlp": layer.mlp}.get(target)
        if child is None:
            parent = layer.mlp if target in ("gate_up_proj", "down_proj") else layer.self_attn
            name = "gate_proj" if tag == "stock" and target == "gate_up_proj" else target
            child = getattr(parent, name)
        child.register_forward_hook(hook(tag))
    with torch.no_grad():
        want, got = stock(ids).logits, ours(ids).logits
    assert seen["ours"] == 1 and seen["stock"] == 1
    if target != "gate_up_proj":  # halving the stacked gate/up output is not halving gate alone
        assert torch.equal(got, want)


@pytest.mark.parametrize("target", ["o_proj", "down_proj", "mlp"])
def test_a_forward_hook_on_a_child_runs_under_torch_compile(target, ids):
    """While dynamo traces, the helpers skip their eager-only checks (``_plain_call`` keeps only the
    hook checks) but never a hook: the compiled forward runs it as eager stock does."""
    stock, ours = _pair()
    for model in (stock, ours):
        layer = model.model.layers[1]
        child = layer.mlp if target == "mlp" else getattr(layer.mlp if target == "down_proj" else layer.self_attn,
                                                           target)
        child.register_forward_hook(lambda module, args, out: out * 0.5)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = stock(ids).logits
            got = torch.compile(ours, backend="eager", fullgraph=True)(ids).logits
            unhooked = torch.compile(_pair()[1], backend="eager", fullgraph=True)(ids).logits
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    assert not torch.allclose(unhooked, want)  # the hook changes the logits: it ran


def test_a_global_hook_sees_the_same_module_calls_as_in_stock(ids):
    stock, ours = _pair()
    # (transformers' hub functions such as apply_rotary_pos_emb are modules outside the model)
    names = {id(m): n for model in (stock, ours) for n, m in model.named_modules()}
    called = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: called.append(names.get(id(m), type(m).__name__)))
    try:
        with torch.no_grad():
            want = stock(ids).logits
            stock_calls, called[:] = list(called), []
            got = ours(ids).logits
    finally:
        handle.remove()
    assert torch.equal(got, want)
    stacked = {"gate_proj", "up_proj", "act_fn"}  # ours has gate_up_proj and silu_and_mul instead
    norm = [n for n in stock_calls if n.rsplit(".", 1)[-1] not in stacked]
    assert [n for n in called if not n.endswith("gate_up_proj")] == norm


def test_a_replaced_projection_forward_and_a_linear_subclass_keep_theirs(ids):
    stock, ours = _pair()

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    for model in (stock, ours):
        attn = model.model.layers[0].self_attn
        attn.k_proj.__class__ = Scaled  # a LoRA-like subclass: its own forward must run
        v = attn.v_proj
        v.forward = lambda x, v=v: nn.functional.linear(x, v.weight, v.bias) + 1  # as accelerate replaces it
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, stock(ids).logits)
        attn = ours.model.layers[0].self_attn
        x = torch.randn(2, 64)
        assert torch.equal(_direct.linear(attn.k_proj, x), 2 * nn.functional.linear(x, attn.k_proj.weight))
        assert torch.equal(_direct.linear(attn.v_proj, x), nn.functional.linear(x, attn.v_proj.weight) + 1)


def test_direct_ok_follows_every_kind_of_hook():
    m = nn.Linear(4, 4)
    assert _direct.direct_ok(m)
    for register in (m.register_forward_hook, m.register_forward_pre_hook, m.register_full_backward_hook,
                     m.register_full_backward_pre_hook):
        handle = register(lambda *a: None)
        assert not _direct.direct_ok(m)
        handle.remove()
    for register in (nn.modules.module.register_module_forward_hook,
                     nn.modules.module.register_module_forward_pre_hook,
                     nn.modules.module.register_module_full_backward_hook):
        handle = register(lambda *a: None)
        try:
            assert not _direct.direct_ok(m)
        finally:
            handle.remove()
    assert _direct.direct_ok(m)
    m._compiled_call_impl = lambda *a: None  # what module.compile() installs
    assert not _direct.direct_ok(m)


def test_a_jit_trace_keeps_the_module_calls():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            seen.append(_direct.direct_ok(self.lin))
            return _direct.linear(self.lin, x)

    probe = Probe()
    torch.jit.trace(probe, torch.randn(2, 4), check_trace=False)
    assert seen == [False]  # the trace records the module call (its scope), as stock
    probe(torch.randn(2, 4))
    assert seen == [False, True]


def test_a_class_forward_replaced_after_the_first_forward_runs(ids, monkeypatch):
    # Analysis and KV-compression patches replace LlamaAttention.forward on the class; the verdict
    # that the decoder may run its reproduction is per forward function, not per class.
    from transformers.models.llama.modeling_llama import LlamaAttention

    stock, ours = _pair()
    with torch.no_grad():
        ours(ids)  # the verdicts are made
        original, seen = LlamaAttention.forward, []

        def patched(self, *args, **kwargs):
            seen.append(1)
            out, weights = original(self, *args, **kwargs)
            return out * 0.5, weights

        monkeypatch.setattr(LlamaAttention, "forward", patched)
        want = stock(ids).logits
        seen.clear()
        got = ours(ids).logits
    assert len(seen) == LAYERS
    assert torch.equal(got, want)


def test_an_instance_forward_on_the_attention_runs(ids):
    stock, ours = _pair()
    seen = []
    for model in (stock, ours):
        attn = model.model.layers[1].self_attn
        bound = attn.forward

        def wrapped(*args, bound=bound, **kwargs):  # as accelerate's add_hook_to_module does
            seen.append(1)
            out, weights = bound(*args, **kwargs)
            return out + 1, weights

        attn.forward = wrapped
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, stock(ids).logits)
    assert len(seen) == 2


def test_training_with_attention_dropout_matches_stock(ids):
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, attention_dropout=0.5)
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **kw), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **kw), attn_implementation="eager")
    ours.load_state_dict(stock.state_dict())
    cutile_kernels.patch(ours)
    stock.train()
    ours.train()
    logits = []
    for model in (stock, ours):
        torch.manual_seed(7)  # the same dropout masks, drawn in the same order
        out = model(ids).logits
        out.sum().backward()
        logits.append(out.detach())
    assert torch.equal(logits[0], logits[1])
    s_attn, o_attn = stock.model.layers[0].self_attn, ours.model.layers[0].self_attn
    # (the fused add+norm differentiates its reference formula: equal up to float32 rounding)
    torch.testing.assert_close(o_attn.q_proj.weight.grad, s_attn.q_proj.weight.grad, rtol=1e-5, atol=1e-7)
    torch.manual_seed(7)
    ours.eval()
    with torch.no_grad():
        assert not torch.equal(ours(ids).logits, logits[1])  # dropout did act in training


def test_a_class_with_its_own_call_and_an_fx_trace_keep_the_module_call():
    class Wrapper(nn.Linear):  # e.g. a checkpointing wrapper that works in __call__
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs) * 0

    assert not _direct.direct_ok(Wrapper(4, 4))

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return _direct.linear(self.lin, x)

    graph = torch.fx.symbolic_trace(Probe()).graph
    assert [n.op for n in graph.nodes if n.op.startswith("call")] == ["call_module"]  # lin, as stock


def test_a_replaced_linear_forward_runs(monkeypatch):
    lin, seen = nn.Linear(4, 4), []
    original = nn.Linear.forward

    def counted(self, x):
        seen.append(1)
        return original(self, x)

    monkeypatch.setattr(nn.Linear, "forward", counted)
    _direct.linear(lin, torch.randn(2, 4))
    assert seen == [1]


def test_a_non_strict_export_keeps_the_down_projection_module_call(ids):
    """``torch.export`` without dynamo (``strict=False``) runs this Python with fx's module call and
    reports ``is_compiling()``; only dynamo's tracing skips ``_plain_call``'s checks, so the exported
    graph still records the fused MLP's down projection as a module (what module-name based tools,
    e.g. quantizers' per-module configs, select by)."""
    _, ours = _pair()
    with torch.no_grad():
        exported = torch.export.export(ours, (ids,), {"use_cache": False}, strict=False)
    stacks = [node.meta.get("nn_module_stack", {}) for node in exported.graph.nodes]
    paths = {path for stack in stacks for path, _ in stack.values()}
    assert any(path.endswith("layers.1.mlp.down_proj") for path in paths), sorted(paths)[:10]
