#!/bin/bash
# Serve the test bed's tiny models on a CPU with EAGLE3_DYNAMIC, then send a burst of
# requests that crosses the threshold policy's batch size and print the plugin's counters.
# Needs the project and its CPU test bed: pip install -e . -e ./testbed
set -eu
DIR=${1:-/tmp/sglang-dynspec-models}
python -m dynspec_testbed.models "$DIR"
python -m dynspec_testbed.serve --model-path "$DIR/target" \
  --speculative-algorithm EAGLE3_DYNAMIC --speculative-draft-model-path "$DIR/draft" \
  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
  --speculative-dynamic-policy threshold --speculative-disable-batch-threshold 4 \
  --enable-metrics --port 30000 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf 127.0.0.1:30000/health_generate >/dev/null; do sleep 2; done
REQUESTS=()
for i in $(seq 1 8); do
  curl -s 127.0.0.1:30000/generate -H 'Content-Type: application/json' \
    -d "{\"input_ids\": [5, 6, 7, $i], \"sampling_params\": {\"max_new_tokens\": 32, \"temperature\": 0}}" >/dev/null &
  REQUESTS+=($!)
done
wait "${REQUESTS[@]}"
curl -s 127.0.0.1:30000/metrics | grep '^sglang:spec_dynamic'
