#!/bin/bash
# Serve Llama-3.1-8B-Instruct with EAGLE-3 below 33 running requests and plain decode above.
# Needs an NVIDIA GPU, SGLang >=0.5.17,<0.6 and `pip install sglang-dynspec`.
# Move the thresholds to the crossover of your own model and draft
# (`python -m sglang_dynspec.bench sweep` against an EAGLE3 and a baseline server).
set -eu
exec python -m sglang.launch_server \
  --model-path meta-llama/Llama-3.1-8B-Instruct \
  --speculative-algorithm EAGLE3_DYNAMIC \
  --speculative-draft-model-path jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B \
  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
  --max-running-requests 128 \
  --speculative-disable-batch-threshold 32 \
  --speculative-enable-batch-threshold 28 \
  --speculative-min-dwell-steps 8 \
  --speculative-catch-up-tokens 128 \
  --enable-metrics \
  --host 127.0.0.1 --port 30000 "$@"
