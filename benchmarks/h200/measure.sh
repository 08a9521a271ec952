#!/bin/bash
# The H200 measurement of BENCHMARKS.md: closed-loop sweeps of several server
# configurations, measured in one run so that ratios compare like with like, then
# (optionally) a load ramp on EAGLE3_DYNAMIC.
#
# Shapes: dummy Llama-3.1-8B-shaped target, dummy EAGLE-3 draft, steps 3, topk 1,
# 4 draft tokens, SGLANG_SIMULATE_ACC_LEN=3.0 (never use it to check outputs),
# prompt 256, output 256, 2xC requests per point, $REPEATS repeats.
#
# Usage (on the device, repo root):
#   CONFIGS="baseline eagle3 dynamic" bash benchmarks/h200/measure.sh
#   CONFIGS="adaptive" RAMP_CONFIGS="dynamic baseline" bash benchmarks/h200/measure.sh
# Results: $OUT/$CARD-YYYYMMDD.jsonl (sweeps; CARD h100, h200 or gpu), $OUT/ramp-YYYYMMDD.jsonl (ramp).
set -u
source .gpu/device-env.sh || exit 1
# SHAPE=3b measures the Llama-3.2-3B-shaped pair instead (lib.sh picks the models).
SHAPE=${SHAPE:-8b}
source benchmarks/h200/lib.sh
export SGLANG_SIMULATE_ACC_LEN=${ACC_LEN:-3.0}   # read only by speculative verify
DAY=$(date -u +%Y%m%d)
RESULTS=${RESULTS:-$OUT/$CARD-$DAY.jsonl}
SPEC=("${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
# PLUGIN_COMMIT=<git sha> tags every row with the plugin code that was measured.
COMMON_BENCH=(--url "$URL" --prompt-len 256 --output-len 256 --no-progress --tag "hw=$HW_TAG"
              --tag "shape=$SHAPE_TAG" --tag "acc_len=$SGLANG_SIMULATE_ACC_LEN"
              --tag "plugin_commit=${PLUGIN_COMMIT:-unknown}")

# Every server gets --enable-metrics: the dynamic one needs it to report its mode, and
# SGLang's metrics collection has a cost of its own (the 2026-11-29 run gave it to the
# dynamic server only; see BENCHMARKS.md).
server_args() {
  case $1 in
    baseline) echo --enable-metrics ;;
    eagle3)   echo --speculative-algorithm EAGLE3 "${SPEC[@]}" --enable-metrics ;;
    dynamic)  echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    # dynamic-tN: --speculative-catch-up-tokens N; dynamic-goodput: the goodput policy.
    dynamic-t*) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics \
                  --speculative-catch-up-tokens "${1#dynamic-t}" ;;
    dynamic-goodput) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics \
                  --speculative-dynamic-policy goodput ;;
    adaptive) echo --speculative-algorithm EAGLE3 "${SPEC[@]}" --speculative-adaptive --enable-metrics ;;
  esac
}

for cfg in ${CONFIGS:-baseline eagle3 dynamic}; do
  # shellcheck disable=SC2046
  if start_server "$cfg" $(server_args "$cfg"); then
    case $cfg in
      dynamic-t*) CATCH_UP=${cfg#dynamic-t} ;;
      dynamic*) CATCH_UP=$(python3 -c "from sglang_dynspec.config import DEFAULT_CATCH_UP_TOKENS as t; print(t)") ;;
      *) CATCH_UP=none ;;
    esac
    python3 -m sglang_dynspec.bench sweep "${COMMON_BENCH[@]}" --config "$cfg" --tag "catch_up_tokens=$CATCH_UP" \
      --concurrency "${C:-1,4,16,32,64,128}" --repeats "${REPEATS:-2}" --out "$RESULTS" \
      2> "$OUT/sweep_$cfg.err" | tail -n 3
    stop_server
  else
    echo "{\"kind\": \"server_start\", \"config\": \"$cfg\", \"started\": false, \"sglang\": \"0.5.17\"," \
         "\"error\": $(grep -E 'Error|error' "$OUT/server_$cfg.log" | tail -1 | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()))')}" >> "$RESULTS"
  fi
done

# Ramps: RAMP_CONFIGS="dynamic baseline" compares the gaps at the dynamic server's
# switches with the gaps a server without switches shows at the same load steps.
# RAMP_STEPS=24,26,...,40,...,24 steps the load in small increments around the
# thresholds, so that no load step prefills dozens of prompts at once (default: the
# tool's 1 -> 128 -> 1 doubling ramp).
for cfg in ${RAMP_CONFIGS:-${RAMP_CONFIG:-}}; do
  # shellcheck disable=SC2046
  start_server "ramp-$cfg" $(server_args "$cfg") && {
    python3 -m sglang_dynspec.bench ramp "${COMMON_BENCH[@]}" --config "$cfg" \
      --hold-s "${RAMP_HOLD_S:-4}" ${RAMP_STEPS:+--steps "$RAMP_STEPS"} --out "$OUT/ramp-$DAY.jsonl" 2>> "$OUT/ramp.err" | tail -n 3
    stop_server; }
done
grep -h "sglang-dynspec" "$OUT"/server_*.log | grep -v Capturing | tail -n 8
