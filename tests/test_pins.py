"""The pin table (``layers/_pins.py``): every transformers function we reproduce or follow, pinned to
the release it was read in, checked by the verdicts and by ``cutile-kernels pins check`` (CPU)."""

from __future__ import annotations

import json

import pytest

from cutile_kernels.layers import _pins
from cutile_kernels.layers._match import source_digest
from cutile_kernels_tools import cli, pins


def test_every_pin_holds_on_the_installed_transformers():
    for name in _pins.PINS:
        assert _pins.holds(name), (name, _pins.digest_now(name), _pins.PINS[name].digest)


def test_the_stored_sources_are_the_pinned_ones():
    data = json.loads(pins.SOURCES.read_text())
    assert data["transformers"] == _pins.TRANSFORMERS
    assert set(data["sources"]) == set(_pins.PINS)
    for name, source in data["sources"].items():
        assert source_digest(source) == _pins.PINS[name].digest, name


def test_reproduced_code_is_gated_and_followed_code_is_reported():
    gating = {n for n, p in _pins.PINS.items() if p.gates}
    assert {"llama.LlamaRMSNorm.forward", "llama.LlamaDecoderLayer.forward", "qwen3.Qwen3Attention.forward",
            "llama.LlamaMLP.forward", "llama.LlamaRotaryEmbedding.forward"} <= gating
    assert "integrations.sdpa_attention.sdpa_attention_forward" not in gating


def test_check_says_all_hold(capsys):
    assert cli.main(["pins", "check"]) == 0
    out = capsys.readouterr().out
    assert f"{len(_pins.PINS)} of {len(_pins.PINS)} pins hold" in out
    assert "holds    llama.LlamaRMSNorm.forward: the RMSNorm hub layer" in out


def test_check_shows_the_diff_of_a_changed_pin(change_pin, monkeypatch, tmp_path, capsys):
    # Another transformers: the installed function's digest no longer matches, and the stored
    # (pinned) source differs from the installed one by a line.
    data = json.loads(pins.SOURCES.read_text())
    name = "qwen3.Qwen3Attention.forward"
    data["sources"][name] = data["sources"][name].replace("self.q_norm(", "self.q_norm_old(")
    stored = tmp_path / "pinned_sources.json"
    stored.write_text(json.dumps(data))
    monkeypatch.setattr(pins, "SOURCES", stored)
    change_pin(name)
    assert cli.main(["pins", "check"]) == 1
    out = capsys.readouterr().out
    assert f"changed  {name}: patch qk_norm_rope" in out
    assert f"--- {name} (transformers {_pins.TRANSFORMERS})" in out and "-" in out and "self.q_norm_old(" in out
    assert "left stock until re-read (a log line says so): qwen3.Qwen3Attention.forward" in out
    assert cli.main(["pins", "check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {p["name"]: p["status"] for p in report["pins"]}[name] == "changed"


def test_a_changed_pin_turns_its_patch_off(change_pin, caplog):
    from cutile_kernels.layers.models import qwen3 as qk_norm_rope
    from families import model

    qk_norm_rope.attention_verdict.cache_clear()
    change_pin(qk_norm_rope.PIN)
    try:
        import cutile_kernels

        with caplog.at_level("INFO", logger="cutile_kernels"):
            assert cutile_kernels.patch(model("qwen3"), names="qk_norm_rope").changed == {"qk_norm_rope": 0}
        assert "is not the one the fused forward reproduces" in caplog.text
    finally:
        qk_norm_rope.attention_verdict.cache_clear()


def test_record_refuses_while_a_pin_does_not_hold(change_pin):
    change_pin("llama.rotate_half")
    with pytest.raises(ValueError, match="llama.rotate_half"):
        pins.record()
