#!/bin/bash
# Where plain-mode time goes (issue 8): torch-profiler traces of a steady closed-loop
# load, then a short throughput sweep, for each server configuration, in one call.
#
# For each of $CONFIGS (default: baseline dynamic dynamic-t0):
#   1. start the server (shape $MODEL, default the Llama-3.2-3B-shaped target);
#   2. run the sweep at $C (default 64,128; 2xC requests per concurrency, lib.sh's closed_loop) and
#      print the plugin's catch-up metrics;
#   3. for $PROFILE_CONFIGS (default: baseline dynamic), run a closed-loop load at
#      $PROFILE_C (default 64) in the background and, once it is steady, ask SGLang's
#      /start_profile for $PROFILE_STEPS forward steps (CPU + GPU); the trace lands in
#      $OUT/prof-CONFIG/.
# Analyse the traces with: python benchmarks/profiles/summarize_trace.py TRACE.json.gz
# Usage (on the device, repo root): bash benchmarks/h200/profile_plain.sh
set -u
source .gpu/device-env.sh || exit 1
export MODEL=${MODEL:-.gpu/models/llama3b}
DRAFT_3B=.gpu/models/eagle3-3b
source benchmarks/h200/lib.sh
[ "$MODEL" = .gpu/models/llama3b ] && EAGLE_ARGS=(--speculative-draft-model-path "$DRAFT_3B" --speculative-draft-load-format dummy)
export SGLANG_SIMULATE_ACC_LEN=${SGLANG_SIMULATE_ACC_LEN:-3.0}
SPEC=("${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
PROFILE_C=${PROFILE_C:-64}
server_args() {
  case $1 in
    baseline)    echo --enable-metrics ;;
    eagle3)      echo --speculative-algorithm EAGLE3 "${SPEC[@]}" --enable-metrics ;;
    dynamic)     echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics --log-level info ;;
    dynamic-t0)  echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics --speculative-catch-up-tokens 0 ;;
    dynamic-t*)  echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics --speculative-catch-up-tokens "${1#dynamic-t}" ;;
  esac
}
PROF_ROOT=$(cd "$OUT" && pwd)
for cfg in ${CONFIGS:-baseline dynamic dynamic-t0}; do
  # shellcheck disable=SC2046
  start_server "$cfg" $(server_args "$cfg") || continue
  for c in $(echo "${C:-64,128}" | tr , " "); do closed_loop "$cfg" "$c" 256 256 $((2 * c)) "$OUT/results.jsonl"; done
  curl -s "$URL/metrics" | grep -E "spec_dynamic_(catch_up_seconds_(sum|count)|catch_up_tokens_total|decode_steps_total|catch_up_total)" | grep -v "^#"
  # Profile after the sweep: exporting the trace stalls the scheduler for seconds.
  case " ${PROFILE_CONFIGS-baseline dynamic} " in *" $cfg "*)
    closed_loop "$cfg" "$PROFILE_C" 256 256 $((4 * PROFILE_C)) "$OUT/profile-load.jsonl" > /dev/null &
    LOAD=$!
    sleep "${PROFILE_WAIT_S:-4}"
    curl -s -X POST "$URL/start_profile" -H 'Content-Type: application/json' \
      -d "{\"output_dir\": \"$PROF_ROOT/prof-$cfg\", \"num_steps\": ${PROFILE_STEPS:-30}, \"activities\": [\"CPU\", \"GPU\"], \"profile_prefix\": \"$cfg\"}"
    echo
    wait $LOAD ;;
  esac
  stop_server
done
grep -h "sglang-dynspec" "$OUT"/server_*.log | grep -v Capturing | tail -n 12
ls -la "$OUT"/prof-* 2>/dev/null
