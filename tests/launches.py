"""Which prebuilt variants a GPU test's calls launched, and two checks the kernel tests share
(import them as ``from launches import launched_variants``, like ``cutile_numpy``)."""

from __future__ import annotations

import torch
from cutile_kernels import dispatch, registry


def launched_variants(before: dict) -> list[registry.Variant]:
    """The variants for this GPU's arch whose launch count moved since ``before`` (a copy of
    ``dispatch.stats()["launches"]`` taken earlier)."""
    after = dispatch.stats()["launches"]
    syms = [s for s in after if after[s] != before.get(s, 0)]
    reg = registry.registry()
    arch = reg.arch_for(torch.cuda.get_device_capability())
    return [v for v in reg.variants(arch=arch) if v.symbol in syms]


def replays_and_compiles(fn, inputs: list, scaled: int = 0) -> None:
    """Check that ``fn(*inputs)`` (a tuple of tensors) captured in a CUDA graph replays what an eager
    call computes once ``inputs[scaled]`` is doubled in place, and that ``torch.compile(fn,
    fullgraph=True)`` computes the same. A warm-up call on a side stream first (kernels load outside
    the capture, as PyTorch asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(*inputs)
    inputs[scaled].mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    eager = fn(*inputs)
    assert all(torch.equal(c, e) for c, e in zip(captured, eager))
    compiled = torch.compile(fn, fullgraph=True)(*inputs)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))


def assert_solution_passes(kernel: str, inventory_dir) -> None:
    """The inventory's one Solution of Definition ``kernel`` passes ``evaluate`` on this GPU."""
    from cutile_kernels_tools import inventory
    from cutile_kernels_tools.inventory import evaluate

    (solution,) = inventory.Inventory.load(inventory_dir).solutions_of(kernel)
    result = evaluate.evaluate(solution.name, inventory_dir)
    assert result.status == "PASSED", result.message
