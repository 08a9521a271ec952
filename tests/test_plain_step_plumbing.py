"""The parts of the plain step that only a GPU run exercises end to end: the graph swap,
the WAR-barrier runner, and the shape of the result handed to the scheduler.

Real SGLang result classes, small stand-ins for the model runner (its graph runner
and attention backend are opaque objects to the code under test).
"""

from __future__ import annotations

import types

import pytest
import torch

from sglang_dynspec import compat
from sglang_dynspec.compat import spec_shaped_result
from sglang_dynspec.plain_graph import PlainGraph, using_plain_graph
from sglang_dynspec.plain_step import PlainDecoder, run_plain_decode


def fake_runner():
    return types.SimpleNamespace(
        decode_cuda_graph_runner="verify-graph",
        attn_backend="verify-backend",
        **{compat.READ_DONE_EVENT: "stale-event-from-a-verify-replay"},
    )


def test_graph_swap_uses_the_plain_graph_and_restores_on_error():
    runner = fake_runner()
    plain = PlainGraph(runner="plain-graph", attn_backend="plain-backend", memory_bytes=0)
    with pytest.raises(RuntimeError):
        with using_plain_graph(runner, plain):
            assert (runner.decode_cuda_graph_runner, runner.attn_backend) == ("plain-graph", "plain-backend")
            # a stale read-done event would let the WAR barrier pass too early
            assert getattr(runner, compat.READ_DONE_EVENT) is None
            raise RuntimeError("forward failed")
    assert (runner.decode_cuda_graph_runner, runner.attn_backend) == ("verify-graph", "verify-backend")


def test_without_a_plain_graph_the_forward_runs_eagerly():
    runner = fake_runner()
    with using_plain_graph(runner, None):
        assert runner.decode_cuda_graph_runner is None and runner.attn_backend == "verify-backend"
    assert runner.decode_cuda_graph_runner == "verify-graph"


@pytest.mark.parametrize("grammar", [False, True])
def test_a_plain_step_runs_the_bound_forward_on_a_fresh_batch_inside_the_plain_graph(grammar):
    import schedule_batches

    case = schedule_batches.SpecDecodeCase(
        prompt_lens=(5, 9, 3),
        output_lens=(2, 4, 1),
        greedy=(True, False, True),
        return_logprob=(False, True, False),
        num_draft_tokens=4,
        topk=1,
        num_steps=3,
        hidden_size=8,
        extra_pool_rows=2,
        host_mirror=True,
        overlap=True,
        leftover_verify_tensors=True,
        bonus_dtype=torch.int32,
        seed=5,
    )
    made = schedule_batches.build_spec_decode_batch(case)
    batch = made.batch
    batch.has_grammar = grammar
    before = schedule_batches.snapshot(batch)
    runner = fake_runner()
    graph = PlainGraph(runner="plain-graph", attn_backend="plain-backend", memory_bytes=0)
    seen, order = [], []

    def decode(plain, draft_input, capture_hidden):
        order.append("forward")
        seen.append((plain, draft_input, capture_hidden, runner.decode_cuda_graph_runner))
        return "result", "aux"

    decoder = PlainDecoder(req_to_token=made.req_to_token, model_runner=runner, decode=decode)
    step = run_plain_decode(decoder, batch, graph, lambda: order.append("barrier"), capture_hidden=True)

    [(plain, draft_input, capture_hidden, graph_runner)] = seen
    assert order == (["barrier", "forward"] if grammar else ["forward"])
    assert plain is not batch and plain.input_ids.tolist() == batch.spec_info.bonus_tokens.tolist()
    assert draft_input is batch.spec_info and capture_hidden and graph_runner == "plain-graph"
    assert runner.decode_cuda_graph_runner == "verify-graph"  # swapped back
    assert (step.result, step.aux_hidden) == ("result", "aux") and step.input_ids is plain.input_ids
    assert schedule_batches.differences(batch, before) == []


def test_plain_result_accept_lens_are_made_on_the_host():
    """Whatever device the step ran on (``meta`` here stands for a GPU): SGLang reads
    ``accept_lens`` only on the host, so a plain step makes it there, no fill kernel
    and no copy back per step."""
    from sglang.srt.managers.utils import GenerationBatchResult

    bs = 4
    previous = compat.EagleDraftInput(
        bonus_tokens=torch.zeros(bs, dtype=torch.int64, device="meta"),
        topk_p=torch.zeros(bs, 1, device="meta"),
        topk_index=torch.zeros(bs, 1, dtype=torch.int64, device="meta"),
        hidden_states=torch.zeros(bs, 8, device="meta"),
    )
    plain = types.SimpleNamespace(
        seq_lens=torch.zeros(bs, dtype=torch.int64, device="meta"),
        return_logprob=False,
        input_ids=torch.zeros(bs, dtype=torch.int64, device="meta"),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64, device="meta"),
    )
    out = GenerationBatchResult(next_token_ids=torch.zeros(bs, dtype=torch.int64, device="meta"))
    result = spec_shaped_result(out, plain, previous)
    assert result.accept_lens.device.type == "cpu" and result.accept_lens.tolist() == [1] * bs
    assert result.next_draft_input.bonus_tokens.device.type == "meta"  # the step's tokens stay put


def test_plain_result_is_spec_shaped_and_carries_the_draft_state():
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult

    bs, topk, hidden = 3, 2, 8
    previous = compat.EagleDraftInput(
        bonus_tokens=torch.tensor([5, 6, 7]),
        topk_p=torch.rand(bs, topk),
        topk_index=torch.randint(0, 100, (bs, topk)),
        hidden_states=torch.rand(bs, hidden),
    )
    plain = types.SimpleNamespace(
        seq_lens=torch.tensor([11, 21, 31]),
        return_logprob=True,
        input_ids=torch.tensor([5, 6, 7]),
        out_cache_loc=torch.tensor([1, 2, 3]),
    )
    out = GenerationBatchResult(
        logits_output=LogitsProcessorOutput(
            next_token_logits=torch.rand(bs, 100), next_token_logprobs=torch.rand(bs)
        ),
        next_token_ids=torch.tensor([8, 9, 10]),
    )
    result = spec_shaped_result(out, plain, previous)
    assert result.accept_lens.dtype == torch.int32 and result.accept_lens.tolist() == [1, 1, 1]
    assert result.speculative_num_draft_tokens == 1
    assert result.new_seq_lens is plain.seq_lens
    assert result.logits_output.next_token_logprobs.shape == (bs, 1)
    nxt = result.next_draft_input
    assert nxt.bonus_tokens.tolist() == [8, 9, 10]
    assert nxt.topk_p is previous.topk_p and nxt.topk_index is previous.topk_index
    assert nxt.hidden_states is previous.hidden_states


def test_war_barrier_runner_follows_the_last_step():
    from sglang_dynspec.worker import DynamicEagleWorker

    worker = DynamicEagleWorker.__new__(DynamicEagleWorker)  # no model: only the property is tested
    target, draft = object(), object()
    worker._target_worker = types.SimpleNamespace(model_runner=target)
    worker._draft_worker = types.SimpleNamespace(draft_runner=draft)
    worker._last_step_plain = True
    assert getattr(worker, compat.WAR_RUNNER_PROPERTY) is target
    worker._last_step_plain = False
    assert getattr(worker, compat.WAR_RUNNER_PROPERTY) is draft


class FakeWeightUpdater:
    """Stands in for SGLang's frozen WeightUpdater: records calls, returns (ok, message).
    A tensor update writes into the model's parameters; a disk update gives the model a
    new parameter (new storage), as a loader that rebuilds a tensor does."""

    def __init__(self, model=None):
        self.calls, self.tp_rank, self.model = [], 0, model

    def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph=False):
        self.calls.append(("disk", recapture_cuda_graph))
        if self.model is not None:
            self.model.weight = torch.nn.Parameter(self.model.weight.detach() + 1)
        return True, "ok"

    def update_weights_from_tensor(self, recv_req):
        self.calls.append(("tensor", None))
        if self.model is not None:
            with torch.no_grad():
                self.model.weight.add_(1)
        return True, "ok"

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        self.calls.append(("distributed", None))
        return False, "failed"

    # SGLang 0.5.23's routes: a weight-update session around the loads, and a distributed
    # update split into a receive (buffers only) and a load.
    def begin_weight_update(self):
        self.calls.append(("begin", None))

    def end_weight_update(self, *, run_post_load):
        self.calls.append(("end", run_post_load))

    def receive_weights_from_distributed(self, names, dtypes, shapes, group_name, load_format=None):
        self.calls.append(("receive", None))
        return [(n, torch.zeros(1)) for n in names]

    def load_weights_from_distributed(self, named_tensors):
        self.calls.append(("load", None))
        if self.model is not None:
            self.model.weight = torch.nn.Parameter(self.model.weight.detach() + 1)
        return True, "ok"


def test_weight_updates_drop_the_plain_graph_until_a_recapture():
    from sglang_dynspec.plain_graph import PlainGraphKeeper

    captures = []

    def capture(runner, capture_hidden):
        captures.append(capture_hidden)
        return PlainGraph(runner=f"graph-{len(captures)}", attn_backend="b", memory_bytes=0)

    model = torch.nn.Linear(4, 4)
    inner = FakeWeightUpdater(model)
    runner = types.SimpleNamespace(weight_updater=inner, model=model)
    keeper = PlainGraphKeeper(runner, capture_hidden=True, capture=capture)
    assert keeper.graph.runner == "graph-1"
    assert runner.weight_updater.tp_rank == 0  # everything else reads through

    # Written in place: the graph reads the new values where it always read them.
    assert runner.weight_updater.update_weights_from_tensor("req") == (True, "ok")
    assert keeper.graph.runner == "graph-1"
    # A tensor moved: the graph would read the old storage, so plain steps run eagerly.
    assert runner.weight_updater.update_weights_from_disk("/m", "auto", recapture_cuda_graph=False)[0]
    assert keeper.graph is None
    assert runner.weight_updater.update_weights_from_tensor("req")[0]  # eager stays eager
    assert keeper.graph is None
    assert runner.weight_updater.update_weights_from_disk("/m", "auto", recapture_cuda_graph=True)[0]
    assert keeper.graph.runner == "graph-2" and captures == [True, True]
    # A failed update (the weights may be half-written) drops the graph too.
    assert runner.weight_updater.update_weights_from_distributed("n", "d", "s", "g") == (False, "failed")
    assert keeper.graph is None
    assert [c[0] for c in inner.calls] == ["tensor", "disk", "tensor", "disk", "distributed"]
    assert keeper.weight_updates == 5


def test_sglang_0_5_23_session_and_distributed_load_are_watched():
    """0.5.23 loads distributed weights with load_weights_from_distributed (not an
    update_weights_from_* method) inside begin/end_weight_update: the storage check must
    run there too, or a moved weight would leave the graph reading the old storage."""
    from sglang_dynspec.plain_graph import PlainGraphKeeper

    model = torch.nn.Linear(4, 4)
    inner = FakeWeightUpdater(model)
    runner = types.SimpleNamespace(weight_updater=inner, model=model)
    keeper = PlainGraphKeeper(
        runner, capture_hidden=True, capture=lambda r, capture_hidden: PlainGraph("g", "b", 0)
    )
    updater = runner.weight_updater
    updater.begin_weight_update()
    weights = updater.receive_weights_from_distributed(["weight"], ["bf16"], [[4, 4]], "group")
    assert keeper.graph is not None and keeper.weight_updates == 1  # begin: in place; receive: no write
    assert updater.load_weights_from_distributed(weights) == (True, "ok")  # gives the model a new tensor
    assert keeper.graph is None
    updater.end_weight_update(run_post_load=False)
    assert keeper.weight_updates == 3
    assert [c[0] for c in inner.calls] == ["begin", "receive", "load", "end"]


def test_every_weight_updater_method_is_classified():
    """Each public method of the installed SGLang's WeightUpdater either may write the
    weights (the plain graph is checked after it) or is known not to. A method added by a
    later SGLang fails here until compat.is_weight_write or this list says which it is."""
    not_writing = {
        "init_weights_update_group",
        "destroy_weights_update_group",
        "receive_weights_from_distributed",  # fills receive buffers; load_weights_from_distributed loads
        "get_model",
        "get_model_runner",
        "recapture_cuda_graph",
        "update_model_fields",  # called inside update_weights_from_disk
        "custom_weight_loaders",
    }
    methods = {
        name
        for name in dir(compat.WeightUpdater)
        if not name.startswith("_") and callable(getattr(compat.WeightUpdater, name, None))
    }
    writing = {name for name in methods if compat.is_weight_write(name)}
    assert {"update_weights_from_disk", "update_weights_from_tensor"} <= writing
    assert methods - writing <= not_writing, methods - writing - not_writing
    assert not writing & not_writing


def test_without_cuda_graphs_nothing_is_wrapped():
    from sglang_dynspec.plain_graph import PlainGraphKeeper

    inner = FakeWeightUpdater()
    runner = types.SimpleNamespace(weight_updater=inner)
    keeper = PlainGraphKeeper(runner, capture_hidden=False, capture=lambda r, capture_hidden: None)
    assert keeper.graph is None and runner.weight_updater is inner


def real_weight_updater(recapture):
    """SGLang's own (frozen) WeightUpdater with stand-in callables."""
    return compat.WeightUpdater(
        tp_rank=0,
        device="cuda",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: None,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=recapture,
        get_model_runner=lambda: None,
    )


@pytest.mark.parametrize(
    "is_draft, graph, recaptures",
    [
        (True, None, False),  # an EAGLE draft runner: its graphs are the draft worker's own
        (True, "eager", False),  # the eager runner in place of a decode graph: same
        (True, "graph", True),  # a draft that owns a decode graph recaptures it
        (False, None, True),  # a target always recaptures
    ],
)
def test_draft_runners_recapture_only_a_decode_graph_they_own(monkeypatch, is_draft, graph, recaptures):
    """SGLang 0.5.17 recaptures a draft runner's decode graph on an update with
    recapture_cuda_graph=True and crashes; the backport applies 0.5.23's rule."""
    monkeypatch.setattr(compat, "_DRAFT_RECAPTURE_SKIPPED_UPSTREAM", False)
    calls = []
    runner = types.SimpleNamespace(
        is_draft_worker=is_draft,
        eager_runner="eager",
        decode_cuda_graph_runner=graph,
        weight_updater=real_weight_updater(lambda: calls.append("recaptured")),
    )
    worker = types.SimpleNamespace(draft_worker=types.SimpleNamespace(draft_runners=[runner]))

    assert compat.keep_draft_graphs_on_recapture(worker) == 1
    assert isinstance(runner.weight_updater, compat.WeightUpdater) and runner.weight_updater.tp_rank == 0
    runner.weight_updater.recapture_cuda_graph()
    assert calls == (["recaptured"] if recaptures else [])


def test_no_backport_where_sglang_skips_graphless_drafts(monkeypatch):
    monkeypatch.setattr(compat, "_DRAFT_RECAPTURE_SKIPPED_UPSTREAM", True)
    updater = real_weight_updater(lambda: None)
    runner = types.SimpleNamespace(weight_updater=updater)
    worker = types.SimpleNamespace(draft_worker=types.SimpleNamespace(draft_runners=[runner]))
    assert compat.keep_draft_graphs_on_recapture(worker) == 0 and runner.weight_updater is updater
