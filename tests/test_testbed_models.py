"""Tests of the test bed's tiny models (``dynspec_testbed.models``)."""

import json

import torch
from safetensors.torch import load_file

from dynspec_testbed.models import (
    AGREE_TOKEN,
    AUX_LAYER_IDS,
    MARKER_FILE,
    MODEL_NAMES,
    SHAPE,
    build_models,
)


def _file_bytes(paths):
    return {(name, f.name): f.read_bytes() for name, root in paths.items() for f in sorted(root.iterdir())}


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


def test_count_target_follows_every_token_with_the_next_id(tiny_models):
    """The counting pair's target, run by HF transformers: at every position, over
    random contexts, the next token is the current one + 1 (mod vocab)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, SHAPE.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tiny_models["target-count"])(ids).logits
    assert torch.equal(logits.argmax(-1), (ids + 1) % SHAPE.vocab_size)


def test_count_draft_proposes_two_ahead_from_the_aux_state(tiny_models):
    """The draft's pass-through: fc keeps the first aux state (the token's embedding),
    the layer adds nothing, and lm_head ranks the token two ahead first. Computed
    from the saved weights with the RMS norm EAGLE-3 applies (weights of ones)."""
    draft = load_file(str(tiny_models["draft-count"] / "model.safetensors"))
    target = load_file(str(tiny_models["target-count"] / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    aux = torch.cat([embed] * len(AUX_LAYER_IDS), dim=-1)  # the zeroed layers pass it through
    residual = aux @ draft["fc.weight"].T
    assert torch.count_nonzero(draft["midlayer.self_attn.o_proj.weight"]) == 0
    assert torch.count_nonzero(draft["midlayer.mlp.down_proj.weight"]) == 0
    normed = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-5)
    proposals = (normed @ draft["lm_head.weight"].T).argmax(-1)
    assert torch.equal(proposals, (torch.arange(SHAPE.vocab_size) + 2) % SHAPE.vocab_size)
