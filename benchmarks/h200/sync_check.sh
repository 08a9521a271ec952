#!/bin/bash
# Issue 11: no host sync in the plugin's step code, on the H200 with CUDA graphs.
# One EAGLE3_DYNAMIC server (Llama-3.2-3B shape, threshold 8, catch-up buffer 16, no
# dwell) under the test bed's host-read guard with CUDA sync warnings on
# (dynspec_testbed/host_reads.py: SGLANG_DYNSPEC_TESTBED_HOST_READS, _SYNC_WATCH),
# driven at C = 1, 16, 4, 16 so that it speculates, runs plain with buffer-full
# flushes, resumes with a catch-up and goes plain again. Writes $OUT/reads.<pid>.json:
# tensor reads to the host by the plugin's own frames (violations must be {}) and
# every synchronizing CUDA call made during the worker's steps, by Python line.
# Usage (device, repo root, after installing .whl/setuptools into /tmp/site):
#   bash benchmarks/h200/sync_check.sh
set -u
source .gpu/device-env.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site ./testbed \
  > /tmp/testbed-install.log 2>&1 || { tail -20 /tmp/testbed-install.log; exit 1; }
export MODEL=.gpu/models/llama3b
source benchmarks/h200/lib.sh
export SGLANG_DYNSPEC_TESTBED=1 SGLANG_DYNSPEC_TESTBED_HOST_READS=$OUT/reads SGLANG_DYNSPEC_TESTBED_SYNC_WATCH=1
start_server sync-check --speculative-algorithm EAGLE3_DYNAMIC \
  --speculative-draft-model-path .gpu/models/eagle3-3b --speculative-draft-load-format dummy \
  --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
  --speculative-disable-batch-threshold 8 --speculative-min-dwell-steps 0 \
  --speculative-catch-up-tokens 16 --enable-metrics || exit 1
python3 -m sglang_dynspec.bench sweep --url "$URL" --config sync-check --concurrency 1,16,4,16 \
  --prompt-len 128 --output-len 128 --repeats 1 --warmup 1 --no-progress --out "$OUT/sync-check.jsonl" 2>&1 | tail -n 5
curl -s "$URL/metrics" | grep -E "spec_dynamic_(decode_steps|catch_up|switches|plain_graph_steps)_total" | grep -v "^#"
stop_server
cat "$OUT"/reads.*.json; echo
