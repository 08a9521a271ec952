"""``sglang.Engine(speculative_algorithm="EAGLE3_DYNAMIC")``: the Python API, configured
through the environment variables, switches to plain decode and matches a
non-speculative engine token for token.

Runs in a fresh interpreter (SGLang engines spawn scheduler processes and must be
built before anything else initialises SGLang's runtime context in the process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from torch._inductor.runtime import cache_dir_utils as inductor_cache_dir

from dynspec_testbed.serve import server_environment

pytestmark = pytest.mark.server

SCRIPT = """
import json, sys
import sglang
from sglang.srt.runtime_context import override_platform
from dynspec_testbed.workload import random_requests

models = json.loads(sys.argv[1])
requests = random_requests(6, seed=21, prefix="engine")
prompts = [list(r.input_ids) for r in requests]
params = [{"max_new_tokens": r.max_new_tokens, "temperature": 0.0, "ignore_eos": True} for r in requests]
common = dict(device="cpu", attention_backend="intel_amx", dtype="float32", disable_cuda_graph=True,
              mem_fraction_static=0.05, max_total_tokens=4096, context_length=2048,
              max_running_requests=8, log_level="info")

def run(**kwargs):
    with override_platform(has_amx=True):  # keep intel_amx on a CPU without AMX (see dynspec_testbed.serve)
        engine = sglang.Engine(**common, **kwargs)
    try:
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        engine.shutdown()

reference = run(model_path=models["target"])
dynamic = run(model_path=models["target"], speculative_algorithm="EAGLE3_DYNAMIC",
              speculative_draft_model_path=models["draft"], speculative_num_steps=3,
              speculative_eagle_topk=1, speculative_num_draft_tokens=4)
print("RESULT", json.dumps({"reference": reference, "dynamic": dynamic}))
"""


def test_engine_api_switches_and_matches_non_speculative(tiny_models, tmp_path):
    env = server_environment(dict(os.environ))
    # The Engine API has no command line: the plugin reads its settings from these.
    env.update(
        SGLANG_DYNSPEC_POLICY="threshold",
        SGLANG_DYNSPEC_DISABLE_BATCH_THRESHOLD="2",
        SGLANG_DYNSPEC_MIN_DWELL_STEPS="0",
        SGLANG_IS_IN_CI="1",
        # SGLang names its ZeroMQ sockets with files it leaves in the temporary directory:
        # the engines' one is this test's (torch's compile cache stays where it was).
        TMPDIR=str(tmp_path),
        TORCHINDUCTOR_CACHE_DIR=env.get("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir.default_cache_dir()),
    )
    models = {k: str(v) for k, v in tiny_models.items()}
    log = tmp_path / "engine.log"
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SCRIPT), json.dumps(models)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=f,
            text=True,
            timeout=900,
        )
    text = log.read_text()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, text[-4000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["dynamic"] == result["reference"]
    assert "[sglang-dynspec] spec -> plain" in text, "the engine never switched to plain decode"
