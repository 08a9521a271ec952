#!/bin/bash
# Serve Llama-3.1-8B-Instruct with EAGLE-3 while it yields more tokens/s than plain decode
# (the goodput policy, the default: step costs timed at start-up, acceptance measured).
# Needs an NVIDIA GPU, SGLang >=0.5.17,<0.6 and `pip install sglang-dynspec`.
# `python -m sglang_dynspec.bench crossover --url http://127.0.0.1:30000` prints where it
# stops speculating for each acceptance and context.
set -eu
exec python -m sglang.launch_server \
  --model-path meta-llama/Llama-3.1-8B-Instruct \
  --speculative-algorithm EAGLE3_DYNAMIC \
  --speculative-draft-model-path jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B \
  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
  --max-running-requests 128 \
  --speculative-min-dwell-steps 8 \
  --speculative-catch-up-tokens 128 \
  --enable-metrics \
  --host 127.0.0.1 --port 30000 "$@"
