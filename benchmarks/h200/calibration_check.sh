#!/bin/bash
# H200 check of the start-up step-cost calibration (issue 17, part 1) on SGLang 0.5.17
# with CUDA graphs: EAGLE3_DYNAMIC servers started with SGLANG_DYNSPEC_CALIBRATE=1 under
# the overlap and the synchronous scheduler (topk 1) and with a tree (topk 4, 16 draft
# tokens), each serving a short load afterwards (and showing no KV in use once idle),
# and one start without calibration for the start-up time it adds. Prints each
# server's step-cost table, its calibration warnings (steps that replayed no CUDA
# graph) and its scheduler start-up time (scheduler_e2e). The cost cache is off, so
# every calibrating server times its own table. Results of 2026-12-02:
# benchmarks/results/h200-20261202-calibration/.
# Usage (on the device, repo root): bash benchmarks/h200/calibration_check.sh
set -u
source .gpu/device-env.sh || exit 1
source benchmarks/h200/lib.sh
export SGLANG_DYNSPEC_COST_CACHE=off

TOPK1=(--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
TOPK4=(--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16)

run() {  # run NAME CALIBRATE [server args...]
  local name=$1 calibrate=$2; shift 2
  SGLANG_DYNSPEC_CALIBRATE=$calibrate start_server "$name" --speculative-algorithm EAGLE3_DYNAMIC \
    "${EAGLE_ARGS[@]}" --log-level info "$@" || return
  python3 .gpu/client.py "$URL" "${C:-1,64}" 128 32 | sed "s/^/{\"cfg\": \"$name\", \"r\": /; s/\$/}/"
  sleep 2
  curl -s "$URL/v1/loads" | python3 -c "import json,sys; print(json.dumps({'cfg': '$name', 'kv_used_idle': \
    [l['num_used_tokens'] for l in json.load(sys.stdin)['loads']]}))"
  stop_server
  grep -A 14 "step costs" "$OUT/server_$name.log" | sed 's/^\[[^]]*\] //' | cut -c1-160
  grep -E "calibration|Traceback|Error" "$OUT/server_$name.log" | grep -v Capturing | head -10
  grep -o "scheduler_e2e=[0-9.]*" "$OUT/server_$name.log"
}

run calib-overlap 1 "${TOPK1[@]}"
run calib-sync 1 "${TOPK1[@]}" --disable-overlap-schedule
run calib-overlap-topk4 1 "${TOPK4[@]}"
run nocalib-overlap 0 "${TOPK1[@]}"
