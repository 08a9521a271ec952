"""Tiny deterministic models for the CPU test bed.

``python -m dynspec_testbed.models DIR`` (or ``build_models(DIR)``) writes:

* ``DIR/target``: a random-weight Llama (hidden 256, 4 layers, GQA 4/2 heads,
  vocab 512) with a byte-level BPE tokenizer trained locally, so nothing is
  downloaded. ``initializer_range=0.1`` (not HF's 0.02) because with small
  weights greedy decoding emits the same token forever, which would hide
  ordering bugs; with 0.1 the output varies with the context.
* ``DIR/draft``: a random-weight EAGLE-3 draft for it (``LlamaForCausalLMEagle3``,
  one decoder layer, public EAGLE-3 checkpoint key layout, no ``embed_tokens``:
  SGLang shares the target's embedding).
* ``DIR/target-agree`` and ``DIR/draft-agree``: a pair that both always predict
  ``AGREE_TOKEN``, so every draft is accepted (accept length = draft tokens).
* ``DIR/target-count`` and ``DIR/draft-count``: a counting pair. The target
  follows token ``x`` with ``x + 1`` (mod vocab); the draft, given the target's
  state at position ``p``, proposes ``x[p] + 2``, which is right one step ahead
  (``--speculative-num-steps 1``). Unlike the agree pair, the right proposal
  depends on the position, so a draft that resumes from stale state proposes a
  wrong token: the pair shows whether the draft state is current.
* ``DIR/target-wide`` and ``DIR/draft-wide``: the random pair's shape with
  SGLang's test vocabulary (``WIDE_VOCAB`` = 32,000 ids) and context
  (``WIDE_POSITIONS``), for SGLang's own test kits, which send token ids up to
  31,999 and prompts of 8,000 tokens. The tokenizer is ``target``'s plus one added
  token per id past it (``<w512>`` ...), so every id the model emits decodes.
* ``DIR/target-update``: a weight update for ``target`` (for
  ``/update_weights_from_disk``): new random weights for decoder layers 1 and up
  only. SGLang loads an update's path into the EAGLE draft as well; the draft has
  one layer (``layers.0``) and skips names it lacks, so this checkpoint changes
  the target and leaves the draft as it was.

All weights are float32: the tests compare SGLang's greedy output with HF
transformers token for token, and bf16 near-ties flip tokens between kernels.
Everything is seeded; rebuilding gives identical files. ``build_models`` skips
the work when ``DIR`` already holds a complete build (marker file written last).
"""

import argparse
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# transformers / tokenizers take seconds to import; they are imported where the
# models are built, so reading the constants below and the up-to-date check of
# build_models stay cheap (tests import AGREE_TOKEN at collection time).
if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TARGET, DRAFT, TARGET_AGREE, DRAFT_AGREE = "target", "draft", "target-agree", "draft-agree"
TARGET_COUNT, DRAFT_COUNT = "target-count", "draft-count"
TARGET_UPDATE = "target-update"
TARGET_WIDE, DRAFT_WIDE = "target-wide", "draft-wide"
MODEL_NAMES = (
    TARGET, DRAFT, TARGET_AGREE, DRAFT_AGREE, TARGET_COUNT, DRAFT_COUNT, TARGET_UPDATE,
    TARGET_WIDE, DRAFT_WIDE,
)  # fmt: skip

# Bump when anything below changes, so existing test-bed directories are rebuilt.
BUILD_VERSION = "4"
MARKER_FILE = ".testbed-models-complete"
SEED = 0


@dataclass(frozen=True)
class TinyLlamaShape:
    vocab_size: int = 512
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 2048

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPE = TinyLlamaShape()

# The wide pair (SGLang's test kits): the vocabulary of the Llama-2 tokenizer the kits
# were written for (their radix-cache test draws ids up to 31,999) and room for their
# 8,000-token prompt.
WIDE_VOCAB = 32_000
WIDE_POSITIONS = 16_384

# Target layers whose hidden states feed the draft's ``fc``. SGLang captures the
# *input* of layer ``id + 1`` (models/llama.py), so ids must be <= num_layers - 2:
# with [1, 2, 3] on 4 layers only two states are captured and the first draft
# forward fails with a shape mismatch in ``fc``.
AUX_LAYER_IDS = (0, 1, 2)

# The agree pair: residual-stream dimension AGREE_DIM carries a constant that no
# layer writes to, and only lm_head row AGREE_TOKEN reads it.
AGREE_DIM = 7
AGREE_TOKEN = 300
_AGREE_VALUE = 10.0


def build_models(root) -> dict[str, Path]:
    """Write the four test-bed models under ``root`` unless already complete.

    Returns ``{"target": root/target, "draft": ..., "target-agree": ...,
    "draft-agree": ...}``.
    """
    root = Path(root)
    paths = {name: root / name for name in MODEL_NAMES}
    marker = root / MARKER_FILE
    if marker.is_file() and marker.read_text() == BUILD_VERSION:
        return paths

    marker.unlink(missing_ok=True)
    for path in paths.values():
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)

    torch.manual_seed(SEED)
    tokenizer = _train_tokenizer()
    target = _random_target(tokenizer)
    draft_config = _draft_config(tokenizer)
    draft_weights = _random_draft_weights()

    _save_target(target, tokenizer, paths[TARGET])
    _save_draft(draft_weights, draft_config, tokenizer, paths[DRAFT])
    target.load_state_dict(_agree_target_weights(target.state_dict()))
    _save_target(target, tokenizer, paths[TARGET_AGREE])
    _save_draft(_agree_draft_weights(draft_weights), draft_config, tokenizer, paths[DRAFT_AGREE])
    embeddings = torch.randn(SHAPE.vocab_size, SHAPE.hidden_size)
    target.load_state_dict(_count_target_weights(target.state_dict(), embeddings))
    _save_target(target, tokenizer, paths[TARGET_COUNT])
    _save_draft(_count_draft_weights(draft_weights, embeddings), draft_config, tokenizer, paths[DRAFT_COUNT])
    _save_weight_update(paths[TARGET], paths[TARGET_UPDATE])
    _build_wide_pair(tokenizer, paths[TARGET_WIDE], paths[DRAFT_WIDE])

    marker.write_text(BUILD_VERSION)
    return paths


def _train_tokenizer() -> "PreTrainedTokenizerFast":
    """Byte-level BPE trained on seeded synthetic sentences (any text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    words = (
        "the quick brown fox jumps over lazy dog speculative decoding draft model "
        "target token verify accept reject eagle tree hidden state layer attention "
        "cache batch server request generate sample logits prompt answer question "
        "hello world python plugin test machine learning language small random cpu"
    ).split()
    corpus = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(3000)]
    corpus += ["Hello, how are you today? The capital of France is Paris. 1 2 3 4 5"] * 50

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SHAPE.vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    if bpe.get_vocab_size() > SHAPE.vocab_size:
        raise RuntimeError(f"tokenizer has {bpe.get_vocab_size()} tokens > {SHAPE.vocab_size}")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=SHAPE.max_positions,
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return tokenizer


def _llama_config(tokenizer, **extra) -> "LlamaConfig":
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=SHAPE.vocab_size,
        hidden_size=SHAPE.hidden_size,
        intermediate_size=SHAPE.intermediate_size,
        num_attention_heads=SHAPE.num_heads,
        num_key_value_heads=SHAPE.num_kv_heads,
        max_position_embeddings=SHAPE.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return LlamaConfig(**{**settings, **extra})


def _random_target(tokenizer, **extra) -> "LlamaForCausalLM":
    from transformers import LlamaForCausalLM

    config = _llama_config(tokenizer, num_hidden_layers=SHAPE.num_layers, initializer_range=0.1, **extra)
    return LlamaForCausalLM(config).to(torch.float32)


def _save_target(model: "LlamaForCausalLM", tokenizer, path: Path) -> None:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def _save_weight_update(target: Path, path: Path) -> None:
    """``target``'s config and tokenizer, and new weights for its layers 1 and up."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(SEED + 1)
    weights = load_file(str(target / "model.safetensors"))
    update = {
        name: torch.randn(w.shape, generator=generator, dtype=w.dtype) * w.std() if w.dim() > 1 else w
        for name, w in weights.items()
        if name.startswith("model.layers.") and not name.startswith("model.layers.0.")
    }
    save_file(update, str(path / "model.safetensors"), metadata={"format": "pt"})
    for item in target.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, path / item.name)


def _draft_config(tokenizer, vocab_size: int = SHAPE.vocab_size, **extra) -> "LlamaConfig":
    return _llama_config(
        tokenizer,
        vocab_size=vocab_size,
        num_hidden_layers=1,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=vocab_size,
        target_hidden_size=SHAPE.hidden_size,
        eagle_config={
            "eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS),
            "use_aux_hidden_state": True,
        },
        **extra,
    )


def _random_draft_weights(vocab: int = SHAPE.vocab_size) -> dict[str, torch.Tensor]:
    """One EAGLE-3 decoder layer in the public checkpoint key layout.

    The layer's attention reads ``[input embedding, hidden state]`` concatenated,
    hence the 2 * hidden input width of q/k/v.
    """
    hidden, inter = SHAPE.hidden_size, SHAPE.intermediate_size
    q_width, kv_width = SHAPE.num_heads * SHAPE.head_dim, SHAPE.num_kv_heads * SHAPE.head_dim

    def random(*shape):
        return torch.randn(*shape) * 0.1

    def ones(size):
        return torch.ones(size)

    return {
        "fc.weight": random(hidden, hidden * len(AUX_LAYER_IDS)),
        "midlayer.hidden_norm.weight": ones(hidden),
        "midlayer.input_layernorm.weight": ones(hidden),
        "midlayer.post_attention_layernorm.weight": ones(hidden),
        "midlayer.self_attn.q_proj.weight": random(q_width, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": random(kv_width, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": random(kv_width, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": random(hidden, q_width),
        "midlayer.mlp.gate_proj.weight": random(inter, hidden),
        "midlayer.mlp.up_proj.weight": random(inter, hidden),
        "midlayer.mlp.down_proj.weight": random(hidden, inter),
        "norm.weight": ones(hidden),
        "lm_head.weight": random(vocab, hidden),
        # Draft id -> target id offsets (zeros = identity) and the draft vocab mask.
        "d2t": torch.zeros(vocab, dtype=torch.int64),
        "t2d": torch.ones(vocab, dtype=torch.bool),
    }


def _build_wide_pair(tokenizer, target_path: Path, draft_path: Path) -> None:
    """The random pair's shape with WIDE_VOCAB ids and WIDE_POSITIONS positions; the
    tokenizer gets one added token per id it lacks, so any id the model emits decodes."""
    import copy

    wide = copy.deepcopy(tokenizer)
    wide.add_tokens([f"<w{i}>" for i in range(len(wide), WIDE_VOCAB)])
    wide.model_max_length = WIDE_POSITIONS
    if len(wide) != WIDE_VOCAB:
        raise RuntimeError(f"wide tokenizer has {len(wide)} tokens, not {WIDE_VOCAB}")
    shape = dict(vocab_size=WIDE_VOCAB, max_position_embeddings=WIDE_POSITIONS)
    _save_target(_random_target(wide, **shape), wide, target_path)
    _save_draft(_random_draft_weights(WIDE_VOCAB), _draft_config(wide, **shape), wide, draft_path)


def _save_draft(weights, config: "LlamaConfig", tokenizer, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _reads_only_agree_dim(lm_head: torch.Tensor) -> torch.Tensor:
    head = torch.zeros_like(lm_head)
    head[AGREE_TOKEN, AGREE_DIM] = 1.0
    return head


def _agree_target_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every embedding carries +10 in AGREE_DIM; no layer writes that dimension
    (o_proj / down_proj output rows zeroed), so it reaches the final norm intact
    and lm_head, reading only that dimension, always ranks AGREE_TOKEN first."""
    state = {name: tensor.clone() for name, tensor in state.items()}
    state["model.embed_tokens.weight"][:, AGREE_DIM] = _AGREE_VALUE
    for name, tensor in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[AGREE_DIM, :] = 0.0
    state["lm_head.weight"] = _reads_only_agree_dim(state["lm_head.weight"])
    return state


def _agree_draft_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``fc`` copies AGREE_DIM of the first captured target state (+10, see
    above) into the draft's hidden state; the draft layer does not write it, and
    lm_head reads only it, so the draft always proposes AGREE_TOKEN too."""
    weights = {name: tensor.clone() for name, tensor in weights.items()}
    fc = torch.zeros_like(weights["fc.weight"])
    fc[AGREE_DIM, AGREE_DIM] = 1.0
    weights["fc.weight"] = fc
    weights["midlayer.self_attn.o_proj.weight"][AGREE_DIM, :] = 0.0
    weights["midlayer.mlp.down_proj.weight"][AGREE_DIM, :] = 0.0
    weights["lm_head.weight"] = _reads_only_agree_dim(weights["lm_head.weight"])
    return weights


def _predicts_shifted(embeddings: torch.Tensor, shift: int) -> torch.Tensor:
    """An lm_head whose row for token ``y`` is the embedding of ``y - shift``: on the
    (normalised) embedding of ``x`` it ranks ``x + shift`` first. Random 256-wide
    embeddings are nearly orthogonal: the right row scores about 256, the others
    about 0 +- 16."""
    return torch.roll(embeddings, shifts=shift, dims=0).clone()


def _count_target_weights(
    state: dict[str, torch.Tensor], embeddings: torch.Tensor
) -> dict[str, torch.Tensor]:
    """No layer writes the residual stream (o_proj, down_proj zero), so the final
    state at every position is the embedding of its token, and every captured aux
    state too; lm_head maps it to the next count."""
    state = {name: tensor.clone() for name, tensor in state.items()}
    state["model.embed_tokens.weight"] = embeddings.clone()
    for name, tensor in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    state["lm_head.weight"] = _predicts_shifted(embeddings, 1)
    return state


def _count_draft_weights(
    weights: dict[str, torch.Tensor], embeddings: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``fc`` passes the first aux state (the embedding of the token at position
    ``p``) through as the draft's residual; the layer adds nothing (o_proj,
    down_proj zero) but still writes K and V from its inputs, and lm_head ranks
    ``x[p] + 2`` first, the token after the pending one."""
    weights = {name: tensor.clone() for name, tensor in weights.items()}
    hidden = SHAPE.hidden_size
    fc = torch.zeros_like(weights["fc.weight"])
    fc[:, :hidden] = torch.eye(hidden)
    weights["fc.weight"] = fc
    weights["midlayer.self_attn.o_proj.weight"].zero_()
    weights["midlayer.mlp.down_proj.weight"].zero_()
    weights["lm_head.weight"] = _predicts_shifted(embeddings, 2)
    return weights


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="output directory")
    args = parser.parse_args(argv)
    paths = build_models(args.dir)
    print(json.dumps({name: str(path) for name, path in paths.items()}, indent=2))


if __name__ == "__main__":
    main()
