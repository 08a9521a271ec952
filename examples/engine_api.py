"""EAGLE3_DYNAMIC through the Python API (``sglang.Engine``).

The Engine has no command line, so the plugin's settings are environment variables,
set before the engine starts (its scheduler processes inherit them). Needs an NVIDIA
GPU; for a CPU run see tests/test_engine_api.py, which uses the test bed.
"""

import os

# The goodput policy (the default) needs no threshold; SGLANG_DYNSPEC_POLICY=threshold
# with SGLANG_DYNSPEC_DISABLE_BATCH_THRESHOLD / _ENABLE_BATCH_THRESHOLD switches by batch size.
os.environ.setdefault("SGLANG_DYNSPEC_POLICY", "goodput")
os.environ.setdefault("SGLANG_DYNSPEC_MIN_DWELL_STEPS", "8")
os.environ.setdefault("SGLANG_DYNSPEC_CATCH_UP_TOKENS", "128")  # draft catch-up buffer per request

import sglang  # noqa: E402  (after the environment is set)


def main():
    engine = sglang.Engine(
        model_path="meta-llama/Llama-3.1-8B-Instruct",
        speculative_algorithm="EAGLE3_DYNAMIC",
        speculative_draft_model_path="jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        max_running_requests=128,
    )
    try:
        prompts = [f"Write one sentence about the number {i}." for i in range(64)]
        outputs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 64})
        for prompt, out in list(zip(prompts, outputs))[:3]:
            print(prompt, "->", out["text"])
    finally:
        engine.shutdown()


if __name__ == "__main__":  # SGLang spawns processes: keep start-up under the main guard
    main()
