"""The model families (``layers/models/``): each claimed model type has a tiny config the tests build,
each family's pins are registered, and the benchmark presets belong to the families that name them."""

from __future__ import annotations

import families
from cutile_kernels.layers import _pins, models
from cutile_kernels_tools import presets


def test_every_family_model_type_has_a_tiny_config_row():
    assert families.CLAIMED == models.claimed_model_types()
    assert set(models.claimed_model_types(opt_in=True)) <= set(families.FAMILIES)
    for model_type in models.claimed_model_types(opt_in=True):
        assert families.config(model_type, layers=1).model_type == model_type


def test_families_are_found_by_name_and_claim_disjoint_model_types():
    assert models.discover() == ("gemma", "granite", "llama", "olmo2", "phi3", "qwen3", "qwen3_5", "smollm3")
    assert set(models.FAMILIES) == set(models.discover())
    claimed = models.claimed_model_types()
    assert len(claimed) == len(set(claimed))
    assert {"llama", "mistral", "qwen2", "qwen3", "granite", "smollm3", "gemma", "gemma2", "gemma3_text", "phi3",
            "olmo2", "olmo3", "qwen3_5_text"} == set(claimed)
    every = models.claimed_model_types(opt_in=True)
    assert len(every) == len(set(every)) and set(every) == set(claimed)  # no family is opt-in today
    assert models.family_of("mistral").name == "llama" and models.family_of("gemma3_text").name == "gemma"
    assert models.family_of("phi3").name == "phi3" and models.family_of("olmo3").name == "olmo2" and models.family_of("gpt2") is None


def test_every_family_pin_is_registered_once():
    for family in models.FAMILIES.values():
        # a family with forwards of its own to reproduce (PATCH_ROWS) pins them; one that only reuses
        # another family's code (granite, smollm3) is gated by that family's pins; qwen3_5 pins the functions
        # its hub layers reproduce
        module = next(m for m in models.modules() if m.FAMILY is family)
        assert family.pins or not hasattr(module, "PATCH_ROWS"), family.name
        for pin in family.pins:
            assert _pins.PINS[pin.name] is pin
    names = [p.name for f in models.FAMILIES.values() for p in f.pins]
    assert len(names) == len(set(names))
    # the rest are the interfaces' pins, which gate nothing (reported by `pins check` only), the
    # decode graphs' (a cache layer's step they reproduce, and the generate hooks they follow) and
    # the static cache layer's update (our attention reads its length, decode graphs reproduce its writes)
    # and the dynamic cache layers' updates (patch dynamic_cache_prefill's layers follow them)
    from cutile_kernels.layers import attention, decode_graphs, kv_cache

    others = (set(_pins.PINS) - set(names) - {p.name for p in decode_graphs.PINS} - {attention.PIN.name}
              - {p.name for p in kv_cache.PINS})
    assert others and all(not _pins.PINS[n].gates for n in others)


def test_presets_belong_to_the_family_that_names_them():
    named = {p: f for f in models.FAMILIES.values() for p in f.presets}
    for name, preset in presets.PRESETS.items():
        if name == "tiny":
            continue
        family = models.family_of(preset.config["model_type"])
        if family is not None:
            assert named.get(name) is family, f"preset {name} ({preset.config['model_type']}) not in {family.name}"
    assert set(named) <= set(presets.PRESETS)
