"""Real SGLang speculative decode batches, built on the CPU, for property tests.

:func:`spec_decode_cases` is a Hypothesis strategy of :class:`SpecDecodeCase`
(plain parameters: request lengths, draft shape, flags, a seed), and
:func:`build_spec_decode_batch` turns one case into a real
``sglang.srt.managers.schedule_batch.ScheduleBatch`` in the state the v2 EAGLE
worker receives a speculative decode step in (what ``eagle_prepare_for_decode``
and, under overlap, ``FutureMap.resolve_future`` leave behind):

* ``forward_mode`` DECODE, ``input_ids`` and ``out_cache_loc`` None (or, with
  ``leftover_verify_tensors``, the draft/verify-sized tensors a v1 worker left on
  the batch: ``input_ids [bs*num_draft_tokens]``, ``out_cache_loc
  [bs*topk*num_steps]``, the shape of the original crash);
* ``seq_lens [bs]`` int64 = KV-committed lengths; ``seq_lens_cpu`` its host mirror
  and ``seq_lens_sum`` its sum, or both None (the mirrorless overlap path, which
  also sets ``max_seq_len_host``);
* ``spec_info`` an ``EagleDraftInput`` with ``bonus_tokens [bs]`` (the pending token,
  the last output id of each request), ``topk_p``/``topk_index [bs, topk]``,
  ``hidden_states [bs, H]`` and, under overlap, ``future_indices [bs]``;
* ``req_to_token``: each request's row holds distinct random KV slot ids for
  positions ``[0, seq_len + reserve)``, ``reserve = 2 * max(topk * num_steps,
  num_draft_tokens)`` as ``get_alloc_reserve_per_decode`` reserves at page size 1;
  the rest of the row is 0, as in a fresh pool.

SGLang constructors used: ``Req(...)`` with normalised ``SamplingParams``, a real
``ReqToTokenPool`` (``alloc`` assigns the rows; its free list is shuffled first so
the rows are arbitrary, as on a long-running server), ``ModelConfig`` of a tiny
config.json, ``ScheduleBatch.init_new`` and ``SamplingBatchInfo.from_schedule_batch``.
The last two read SGLang's runtime config, so they run inside a private
``RuntimeContext`` (``create_context`` + ``use_context``) that never becomes the
process-wide one. The decode-step fields are then set as the scheduler sets them.
No KV allocator, tree cache or model runner: the builder under test reads none.

Importing this module imports SGLang (about 15 s). It first puts the test bed's
pure-PyTorch ``sgl_kernel`` stand-in on ``sys.path`` and selects SGLang's CPU engine,
unless the environment already chose otherwise.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import json
import os
import sys
import tempfile

from hypothesis import strategies as st

from dynspec_testbed import SHIM_DIR

if str(SHIM_DIR) not in sys.path:
    sys.path.insert(0, str(SHIM_DIR))
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402
from sglang.srt import runtime_context  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (  # noqa: E402
    CaptureHiddenMode,
    ForwardMode,
)
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

VOCAB_SIZE = 1000
MAX_REQUESTS = 16
MAX_DRAFT_TOKENS = 16
MAX_TOPK = 4
MAX_STEPS = 8


@dataclasses.dataclass(frozen=True)
class SpecDecodeCase:
    """Parameters of one speculative decode batch (see the module docstring)."""

    prompt_lens: tuple[int, ...]  # per request; committed length = prompt + output - 1
    output_lens: tuple[int, ...]  # per request, >= 1: the last output id is pending
    greedy: tuple[bool, ...]  # per request: temperature 0, else 0.7 with top_k 20
    return_logprob: tuple[bool, ...]  # per request
    num_draft_tokens: int
    topk: int
    num_steps: int
    hidden_size: int
    extra_pool_rows: int  # free req_to_token rows beyond the batch
    host_mirror: bool  # seq_lens_cpu a tensor, else None (mirrorless)
    overlap: bool  # enable_overlap, and spec_info.future_indices set
    leftover_verify_tensors: bool  # input_ids / out_cache_loc left draft-sized
    bonus_dtype: torch.dtype  # dtype of spec_info.bonus_tokens
    seed: int  # token ids, KV slot ids, draft tensors, row order

    @property
    def batch_size(self) -> int:
        return len(self.prompt_lens)

    @property
    def committed_lens(self) -> tuple[int, ...]:
        return tuple(p + o - 1 for p, o in zip(self.prompt_lens, self.output_lens))

    @property
    def reserve(self) -> int:
        """KV slots reserved past the committed length (page size 1)."""
        return 2 * max(self.topk * self.num_steps, self.num_draft_tokens)

    @property
    def draft_sized_dims(self) -> frozenset:
        """Sizes only a draft or verify tensor has: ``bs*num_draft_tokens`` rows (the
        verify tree) and ``bs*topk*num_steps`` rows (the draft's KV writes)."""
        bs = self.batch_size
        return frozenset({bs * self.num_draft_tokens, bs * self.topk * self.num_steps})


@st.composite
def spec_decode_cases(draw, max_requests: int = MAX_REQUESTS) -> SpecDecodeCase:
    """Random speculative decode batches: 1..max_requests requests, 2..16 draft
    tokens, top-k 1..4, every flag either way.

    Size rule: ``topk * num_steps >= 2`` and ``num_draft_tokens >= 2``, so both
    draft-sized dimensions are at least ``2 * bs``, never ``bs`` or 1, the only
    sizes a plain decode batch's tensors have. The draft shape follows SGLang's
    EAGLE rules: top-k 1 is a chain (``num_draft_tokens = num_steps + 1``); a tree
    picks ``num_draft_tokens - 1`` of the ``topk + (num_steps - 1) * topk**2``
    candidates its draft steps score.
    """
    bs = draw(st.integers(1, max_requests), label="batch_size")
    topk = draw(st.integers(1, MAX_TOPK), label="topk")
    if topk == 1:
        num_draft_tokens = draw(st.integers(3, MAX_DRAFT_TOKENS), label="num_draft_tokens")
        num_steps = num_draft_tokens - 1
    else:
        num_steps = draw(st.integers(1, MAX_STEPS), label="num_steps")
        candidates = topk + (num_steps - 1) * topk * topk
        num_draft_tokens = draw(
            st.integers(2, min(MAX_DRAFT_TOKENS, candidates + 1)), label="num_draft_tokens"
        )
    per_request = st.lists(st.integers(1, 48), min_size=bs, max_size=bs).map(tuple)
    flags = st.lists(st.booleans(), min_size=bs, max_size=bs).map(tuple)
    return SpecDecodeCase(
        prompt_lens=draw(per_request, label="prompt_lens"),
        output_lens=draw(per_request, label="output_lens"),
        greedy=draw(flags, label="greedy"),
        return_logprob=draw(flags, label="return_logprob"),
        num_draft_tokens=num_draft_tokens,
        topk=topk,
        num_steps=num_steps,
        hidden_size=draw(st.integers(1, 96), label="hidden_size"),
        extra_pool_rows=draw(st.integers(0, 16), label="extra_pool_rows"),
        host_mirror=draw(st.booleans(), label="host_mirror"),
        overlap=draw(st.booleans(), label="overlap"),
        leftover_verify_tensors=draw(st.booleans(), label="leftover_verify_tensors"),
        bonus_dtype=draw(st.sampled_from([torch.int32, torch.int64]), label="bonus_dtype"),
        seed=draw(st.integers(0, 2**32 - 1), label="seed"),
    )


@dataclasses.dataclass
class SpecDecodeBatch:
    case: SpecDecodeCase
    batch: ScheduleBatch
    req_to_token_pool: ReqToTokenPool

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token


@functools.cache
def _sglang_runtime() -> tuple[ModelConfig, runtime_context.RuntimeContext]:
    """A tiny model config and a private runtime context, built once per process.

    Resolving ``ServerArgs`` exports a few ``SGLANG_*`` defaults; they are put back
    so that nothing leaks into the rest of the test session.
    """
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
    }
    saved_environment = dict(os.environ)
    try:
        with tempfile.TemporaryDirectory(prefix="dynspec-model-config-") as model_dir:
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(config, f)
            model_config = ModelConfig(model_path=model_dir, trust_remote_code=False)
            server_args = ServerArgs(model_path=model_dir, device="cpu", skip_tokenizer_init=True)
            context = runtime_context.create_context(server_args, role="scheduler")
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)
    return model_config, context


def _make_request(i: int, case: SpecDecodeCase, gen: torch.Generator) -> Req:
    if case.greedy[i]:
        params = SamplingParams(max_new_tokens=4096, temperature=0.0)
    else:
        params = SamplingParams(max_new_tokens=4096, temperature=0.7, top_k=20)
    params.normalize(None)
    params.verify(VOCAB_SIZE)
    num_tokens = case.prompt_lens[i] + case.output_lens[i]
    tokens = torch.randint(0, VOCAB_SIZE, (num_tokens,), generator=gen)
    req = Req(
        rid=f"req-{i}",
        origin_input_text="",
        origin_input_ids=array.array("q", tokens[: case.prompt_lens[i]].tolist()),
        sampling_params=params,
        return_logprob=case.return_logprob[i],
        vocab_size=VOCAB_SIZE,
    )
    req.output_ids.extend(tokens[case.prompt_lens[i] :].tolist())
    return req


def build_spec_decode_batch(case: SpecDecodeCase) -> SpecDecodeBatch:
    """A real ScheduleBatch for one speculative decode step of ``case``."""
    model_config, context = _sglang_runtime()
    gen = torch.Generator().manual_seed(case.seed)
    bs = case.batch_size
    committed = case.committed_lens
    reserve = case.reserve

    reqs = [_make_request(i, case, gen) for i in range(bs)]
    pool = ReqToTokenPool(
        size=bs + case.extra_pool_rows,
        max_context_len=max(committed) + reserve,
        device="cpu",
        enable_memory_saver=False,
    )
    order = torch.randperm(len(pool.free_slots), generator=gen).tolist()
    pool.free_slots = [pool.free_slots[j] for j in order]
    rows = pool.alloc(reqs)
    assert rows is not None and len(set(rows)) == bs

    # KV slot ids: distinct, from 1 (slot 0 is the padding slot), per request over
    # the committed prefix and the reserved positions.
    total = sum(length + reserve for length in committed)
    slots = torch.randperm(total, generator=gen, dtype=torch.int64) + 1
    start = 0
    for i, (req, length) in enumerate(zip(reqs, committed)):
        n = length + reserve
        pool.write((req.kv.req_pool_idx, slice(0, n)), slots[start : start + n].to(torch.int32))
        start += n
        req.prefix_len = len(req.origin_input_ids)
        req.kv.kv_committed_len = length
        req.kv.kv_allocated_len = n
        req.decode_batch_idx = case.output_lens[i]

    with runtime_context.use_context(context):
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=None,
            tree_cache=None,
            model_config=model_config,
            enable_overlap=case.overlap,
            spec_algorithm=SpeculativeAlgorithm.EAGLE3,
        )
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, VOCAB_SIZE)

    seq_lens = torch.tensor(committed, dtype=torch.int64)
    batch.forward_mode = ForwardMode.DECODE
    batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64)
    batch.req_pool_indices_cpu = batch.req_pool_indices.clone()
    batch.seq_lens = seq_lens
    batch.orig_seq_lens = seq_lens.to(torch.int32)
    if case.host_mirror:
        batch.seq_lens_cpu = seq_lens.clone()
        batch.seq_lens_sum = int(seq_lens.sum())
    else:
        batch.seq_lens_cpu = None
        batch.seq_lens_sum = None
        batch.max_seq_len_host = max(committed) + reserve  # eagle_prepare_for_decode
    if batch.return_logprob:
        batch.top_logprobs_nums = [r.logprob.top_logprobs_num for r in reqs]
        batch.token_ids_logprobs = [r.logprob.token_ids_logprob for r in reqs]
    if case.leftover_verify_tensors:
        batch.input_ids = torch.randint(0, VOCAB_SIZE, (bs * case.num_draft_tokens,), generator=gen)
        draft_slots = bs * case.topk * case.num_steps
        batch.out_cache_loc = torch.randint(1, total + 1, (draft_slots,), generator=gen)
    else:
        batch.input_ids = None
        batch.out_cache_loc = None

    topk_p = torch.rand(bs, case.topk, generator=gen)
    batch.spec_info = EagleDraftInput(
        bonus_tokens=torch.tensor([r.output_ids[-1] for r in reqs], dtype=case.bonus_dtype),
        topk_p=topk_p / topk_p.sum(dim=1, keepdim=True),
        topk_index=torch.randint(0, VOCAB_SIZE, (bs, case.topk), generator=gen),
        hidden_states=torch.randn(bs, case.hidden_size, generator=gen),
        capture_hidden_mode=CaptureHiddenMode.LAST,
        num_tokens_per_req=case.num_draft_tokens,
        num_tokens_for_logprob_per_req=case.num_draft_tokens,
        future_indices=batch.req_pool_indices.clone() if case.overlap else None,
    )
    return SpecDecodeBatch(case=case, batch=batch, req_to_token_pool=pool)


def attributes(obj) -> dict:
    """Every attribute of ``obj``: its ``__dict__`` (dataclass fields and instance
    extras such as ``max_seq_len_host``), or its fields for a slotted dataclass."""
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def tensor_attributes(obj, prefix: str = "") -> list:
    """``(name, tensor)`` for every tensor attribute of ``obj`` (dataclass fields and
    instance extras), descending into attributes that are dataclass instances
    (``sampling_info``, ``spec_info``)."""
    found = []
    if obj is None:
        return found
    for name, value in attributes(obj).items():
        if isinstance(value, torch.Tensor):
            found.append((prefix + name, value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            found.extend(tensor_attributes(value, prefix + name + "."))
    return found


# ---------------------------------------------------------------- snapshot of the input
_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
_CONTAINERS = (list, dict, set, tuple, array.array)


def _copy_value(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, _CONTAINERS):
        if isinstance(value, array.array):
            return array.array(value.typecode, value)
        return type(value)(value)
    return None


def _record(obj) -> dict:
    return {name: (value, _copy_value(value)) for name, value in attributes(obj).items()}


def snapshot(batch: ScheduleBatch) -> dict:
    """Everything ``build_plain_decode_batch`` must leave as it found: every attribute
    of the batch, of its ``spec_info``, ``sampling_info``, requests and their KV
    records (the object, and a copy of each tensor's values and of each container),
    and the ``req_to_token`` table."""
    parts = {"batch": _record(batch)}
    if batch.spec_info is not None:
        parts["spec_info"] = _record(batch.spec_info)
    if batch.sampling_info is not None:
        parts["sampling_info"] = _record(batch.sampling_info)
    for i, req in enumerate(batch.reqs):
        parts[f"reqs[{i}]"] = _record(req)
        parts[f"reqs[{i}].kv"] = _record(req.kv)
    parts["req_to_token"] = {"req_to_token": (None, batch.req_to_token_pool.req_to_token.clone())}
    return parts


def _objects(batch: ScheduleBatch) -> dict:
    objects = {"batch": batch, "spec_info": batch.spec_info, "sampling_info": batch.sampling_info}
    for i, req in enumerate(batch.reqs):
        objects[f"reqs[{i}]"] = req
        objects[f"reqs[{i}].kv"] = req.kv
    return objects


def differences(batch: ScheduleBatch, before: dict) -> list:
    """Attributes of ``batch`` (and of its parts) that differ from ``before``."""
    diffs = []
    objects = _objects(batch)
    for part, recorded in before.items():
        if part == "req_to_token":
            if not torch.equal(batch.req_to_token_pool.req_to_token, recorded["req_to_token"][1]):
                diffs.append("req_to_token: values changed")
            continue
        obj = objects.get(part)
        if obj is None:
            diffs.append(f"{part}: gone")
            continue
        now = attributes(obj)
        for name in sorted(set(now) | set(recorded)):
            where = f"{part}.{name}"
            if name not in now or name not in recorded:
                diffs.append(f"{where}: attribute added or removed")
                continue
            value, copied = recorded[name]
            current = now[name]
            if current is not value:
                if not (isinstance(value, _IMMUTABLE) and type(current) is type(value) and current == value):
                    diffs.append(f"{where}: rebound ({value!r:.60} -> {current!r:.60})")
                continue
            if isinstance(value, torch.Tensor):
                if current.dtype != copied.dtype or current.shape != copied.shape:
                    diffs.append(f"{where}: dtype/shape changed")
                elif not torch.equal(current, copied):
                    diffs.append(f"{where}: values changed in place")
            elif isinstance(value, _CONTAINERS) and copied is not None and current != copied:
                diffs.append(f"{where}: contents changed in place")
    return diffs
