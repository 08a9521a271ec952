#!/bin/bash
# H200 check of the catch-up's replay comparison (issue 17, acceptance in plain mode) on
# SGLang 0.5.17 with CUDA graphs. Dummy weights and NO simulated acceptance: the draft
# is random, so the counters and the replay should both read about 1 token per step.
#
# 1. goodput (the default): the replay is compared. A closed loop at C=64 runs plain
#    (acceptance ~1), the catch-up flushes every 128 positions; /metrics must show
#    sglang:spec_dynamic_acceptance{source="replay"} near 1.0, and the catch-up's device
#    time per position.
# 2. threshold, plain above 1 request: the same flushes with no comparison, for the
#    comparison's cost (catch-up seconds per position, 1 against 2).
# Usage (on the device, repo root): bash benchmarks/h200/replay_check.sh
set -u
source .gpu/device-env.sh || exit 1
source benchmarks/h200/lib.sh
SPEC=("${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)

run() {  # run NAME [server args...]
  local name=$1; shift
  start_server "$name" --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics \
    --log-level info "$@" || return
  python3 .gpu/client.py "$URL" 1,64 256 256 | sed "s/^/{\"cfg\": \"$name\", \"r\": /; s/\$/}/"
  curl -s "$URL/metrics" | grep -E "^sglang:spec_dynamic_(acceptance|catch_up_(total|tokens_total|seconds_sum|seconds_count)|decode_steps|switches|step_cost_correction)" \
    | grep -v NaN | sed "s/^/$name /"
  stop_server
  grep -E "sglang-dynspec\] (spec|plain) ->|cannot read|Traceback|Error" "$OUT/server_$name.log" \
    | cut -c1-220 | head -8
}

run replay-goodput
run replay-off-threshold --speculative-dynamic-policy threshold --speculative-disable-batch-threshold 2 \
  --speculative-enable-batch-threshold 1
