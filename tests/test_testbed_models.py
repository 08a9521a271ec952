"""Tests of the test bed's tiny models (``sglang_dynspec.testbed.models``)."""

import json

import torch
from safetensors.torch import load_file

from sglang_dynspec.testbed.models import (
    AGREE_TOKEN,
    AUX_LAYER_IDS,
    MARKER_FILE,
    MODEL_NAMES,
    SHAPE,
    build_models,
)


def _file_bytes(paths):
    return {
        (name, f.name): f.read_bytes()
        for name, root in paths.items()
        for f in sorted(root.iterdir())
    }


def test_rebuild_replaces_a_half_written_dir_with_identical_files(tiny_models, tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "left-over.bin").write_bytes(b"partial")  # no marker: incomplete

    rebuilt = build_models(tmp_path)

    assert (tmp_path / MARKER_FILE).is_file()
    assert not (tmp_path / "target" / "left-over.bin").exists()
    assert _file_bytes(rebuilt) == _file_bytes(tiny_models)  # seeded: byte-identical


def test_complete_build_is_not_redone(tiny_models):
    mtimes = {f: f.stat().st_mtime_ns for root in tiny_models.values() for f in root.iterdir()}
    assert build_models(next(iter(tiny_models.values())).parent) == tiny_models
    assert {f: f.stat().st_mtime_ns for f in mtimes} == mtimes
    assert set(tiny_models) == set(MODEL_NAMES)


def test_draft_uses_public_eagle3_layout_and_capturable_aux_layers(tiny_models):
    config = json.loads((tiny_models["draft"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # SGLang captures the input of layer id + 1, so the last usable id is num_layers - 2.
    assert max(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) <= SHAPE.num_layers - 2
    weights = load_file(str(tiny_models["draft"] / "model.safetensors"))
    assert "embed_tokens.weight" not in weights  # shared with the target
    assert weights["fc.weight"].shape == (SHAPE.hidden_size, SHAPE.hidden_size * len(AUX_LAYER_IDS))
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * SHAPE.hidden_size
    assert all(w.dtype in (torch.float32, torch.int64, torch.bool) for w in weights.values())


def test_agree_target_always_predicts_the_agree_token_and_random_target_does_not(tiny_models):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, SHAPE.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        agree = AutoModelForCausalLM.from_pretrained(tiny_models["target-agree"])(ids).logits
        random = AutoModelForCausalLM.from_pretrained(tiny_models["target"])(ids).logits
    assert (agree.argmax(-1) == AGREE_TOKEN).all()
    assert len(set(random.argmax(-1).flatten().tolist())) > 5
