"""End-to-end checks of the CPU test bed: real SGLang servers on this machine.

Run one at a time machine-wide (an idle SGLang server keeps a core busy):

    flock /work/server.lock python -m pytest -m server tests/test_testbed_server.py

Three servers start (40-60 s each): EAGLE3 synchronous, EAGLE3 with the overlap
scheduler, and EAGLE3 on the always-agree pair; the plain server is the session's
shared reference (``reference_servers``). The plain server's outputs are recorded
first and every later server is compared with them.
"""

import pytest
import torch

from dynspec_testbed.models import AGREE_TOKEN
from dynspec_testbed.plugin import OVERLAP_ENV
from dynspec_testbed.server import (
    SHARED_MEMORY,
    CpuServer,
    assert_no_kv_left,
    generate,
    generate_concurrently,
    speculative_server_args,
)

pytestmark = pytest.mark.server

PROMPTS = [
    [0, 483, 14, 511, 506, 508, 509, 487, 33],
    [0, 100, 200, 300, 400, 50, 60],
]
NEW_TOKENS = 16
# EAGLE3 servers (speculative_server_args): topk 1, 3 draft steps, 4 verify tokens (3 drafts +
# the bonus token).


def _requests():
    # ignore_eos: compare a fixed number of tokens whatever the random model emits.
    return [
        {"input_ids": p, "max_new_tokens": NEW_TOKENS, "sampling_params": {"ignore_eos": True}}
        for p in PROMPTS
    ]


def _generate_all(url):
    return [generate(url, **request) for request in _requests()]


def hf_greedy(model_path, prompt, new_tokens):
    """Greedy continuation by HF transformers, one full forward per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def plain_outputs(reference_servers):
    """Greedy output ids of a non-speculative server, one list per prompt."""
    url = reference_servers.url("random")
    outputs = [r["output_ids"] for r in _generate_all(url)]
    assert_no_kv_left(url)
    return outputs


def test_plain_server_matches_hf_transformers_greedy(plain_outputs, tiny_models):
    expected = [hf_greedy(tiny_models["target"], p, NEW_TOKENS) for p in PROMPTS]
    assert plain_outputs == expected
    # A degenerate model (one token forever) would make every comparison vacuous.
    assert all(len(set(out)) > 3 for out in expected), expected


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_eagle3_output_equals_non_speculative(plain_outputs, tiny_models, tmp_path, overlap):
    log = tmp_path / "server.log"
    env = {OVERLAP_ENV: "1" if overlap else "0"}
    with CpuServer(speculative_server_args("EAGLE3", tiny_models), log_path=log, env=env) as server:
        sequential = _generate_all(server.url)
        concurrent = generate_concurrently(server.url, _requests(), concurrency=len(PROMPTS))
        assert_no_kv_left(server.url)

    assert [r["output_ids"] for r in sequential] == plain_outputs
    assert [r["output_ids"] for r in concurrent] == plain_outputs
    assert all(r["meta_info"]["spec_verify_ct"] > 0 for r in sequential), sequential

    text = log.read_text()
    # The scheduler's overlap loop is the only caller of gather_spec_extras.
    assert ("torch gather_spec_extras in use" in text) is overlap
    assert ("Non-overlap (synchronous) spec v2 is used" in text) is not overlap


def test_agree_pair_accepts_every_draft(tiny_models, tmp_path):
    shared_memory_before = set(SHARED_MEMORY.iterdir())
    with CpuServer(
        speculative_server_args("EAGLE3", tiny_models, "agree"), log_path=tmp_path / "server.log"
    ) as server:
        results = _generate_all(server.url)
        assert_no_kv_left(server.url)
        # SGLang names its ZeroMQ sockets with files in the server's temporary directory,
        # which is the server's own and goes with it.
        temp_dir = server.temp_dir
        assert temp_dir is not None and any(temp_dir.iterdir()), temp_dir
        # It makes shared-memory files (a semaphore, SGLang's load snapshot) that
        # SGLang's SIGKILL of its children leaves behind; they go with the server.
        shared_memory = set(SHARED_MEMORY.iterdir()) - shared_memory_before
        assert shared_memory, "the server made no shared-memory file: the check below tests nothing"
    assert not temp_dir.exists()
    assert not [path for path in shared_memory if path.exists()]

    for result in results:
        assert result["output_ids"] == [AGREE_TOKEN] * NEW_TOKENS
        # 3 drafts + the bonus token per verify step.
        accept_length = result["meta_info"]["spec_accept_length"]
        assert accept_length == pytest.approx(4.0, abs=0.3), result["meta_info"]
