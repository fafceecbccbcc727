"""Which prebuilt variants a GPU test's calls launched (shared by the kernel tests; import it as
``from launches import launched_variants``, like ``cutile_numpy``)."""

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
