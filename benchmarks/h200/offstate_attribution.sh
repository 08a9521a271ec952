#!/bin/bash
# Issue 19, step 1: where the off state's cost goes, on the H200 (SGLang 0.5.17, CUDA
# graphs), in one call: a baseline server and EAGLE3_DYNAMIC with default flags (at
# C >= 48 and acceptance 3.0 the goodput policy decodes plain), and, for the catch-up's
# share, EAGLE3_DYNAMIC without it (--speculative-catch-up-tokens 0).
#
# Per server:
#   1. the decode sweep at C=64,128 (REPEATS, closed loop with 2xC requests, 256/256),
#      rows in $OUT/$CARD-offstate-attr-YYYYMMDD-$SHAPE.jsonl (bench sweep: output tok/s,
#      ITL p50/p99, TTFT, and the dynamic server's steps per mode and catch-ups);
#   2. prefill only (output 1 token, 8xC requests at C=64): the EAGLE-3 prefill path's
#      cost beside the baseline's, with no decode step at all (kind prefill_only);
#   3. for PROFILE_CONFIGS (default baseline dynamic), a torch-profiler trace of PROFILE_STEPS (default
#      30) forward steps of a load at PROFILE_C (default 64; 8xC requests, PROFILE_REQ_PER_C; the
#      load's own record in $OUT/logs/profile-load.jsonl), from the load's first forward
#      (PROFILE_ALIGN, default 1; 0: 4 s into it) and without Python stacks (PROFILE_STACK, default
#      0) (160 or more steps see a buffer-full flush of the default 128-position buffer), summarized
#      on the device (benchmarks/profiles/summarize_trace.py), and the kernels per decode step of
#      each against the baseline (--diff), in
#      $OUT/profiles.md; the traces are not brought back (too large).
#
# CONFIGS picks the servers (default: baseline dynamic dynamic-t0); dynamic-tN is
# EAGLE3_DYNAMIC with --speculative-catch-up-tokens N (0: no catch-up); dynamic-pieces is
# EAGLE3_DYNAMIC with its buffer-full flushes in pieces of FLUSH_TOKENS positions
# (SGLANG_DYNSPEC_FLUSH_TOKENS, default 2048 here). WAVES: requests per point = WAVES x C
# (default 2); PROFILE_CONFIGS="" skips the profiles; SWEEP_CONFIGS (default: all) the servers that
# run the sweep and the prefill-only point; dynamic-plain is EAGLE3_DYNAMIC held plain above 2 requests,
# for a profile of the off state: PROFILE_CONFIGS="baseline dynamic-plain"; dynamic-graph is
# EAGLE3_DYNAMIC with SGLANG_DYNSPEC_EAGER_DRAFT_TOKENS=0 (flushes in the draft's prefill graph);
# dynamic-stream with SGLANG_DYNSPEC_FLUSH_STREAM=1 (flushes on a side stream);
# dynamic-plain-pieces is dynamic-plain with the flushes in pieces (the A/B of the pieces where
# the default policy speculates at C=64 and 128 and so flushes nothing).
# Usage (on the device, repo root): SHAPE=8b PLUGIN_COMMIT=<sha> bash benchmarks/h200/offstate_attribution.sh
#   e.g. the flush A/B: CONFIGS="baseline dynamic-plain dynamic-plain-pieces" WAVES=4 REPEATS=3 PROFILE_CONFIGS="" ...
set -u
source .gpu/device-env.sh || exit 1
SHAPE=${SHAPE:-8b}
source benchmarks/h200/lib.sh  # SHAPE picks the models
export SGLANG_SIMULATE_ACC_LEN=${ACC:-3.0}
RESULTS=$OUT/$CARD-offstate-attr-$(date -u +%Y%m%d)-$SHAPE.jsonl
SPEC=("${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
BENCH=(--url "$URL" --prompt-len 256 --output-len 256 --no-progress --tag "hw=$HW_TAG" --tag "shape=$SHAPE_TAG"
       --tag "acc_len=$SGLANG_SIMULATE_ACC_LEN" --tag "plugin_commit=${PLUGIN_COMMIT:-unknown}")
PROF_ROOT=$(cd "$OUT" && pwd)/prof
mkdir -p "$OUT/logs" "$PROF_ROOT"
# The logs go back as one archive, packed on any exit (lib.sh on_exit).
pack_logs() { pack_server_logs "$PROF_ROOT"; }
on_exit pack_logs

server_args() {
  case $1 in
    baseline) echo --enable-metrics ;;
    dynamic) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    # dynamic-tN: the catch-up buffer at N positions per request (0: catch-up off).
    dynamic-t[0-9]*) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics --speculative-catch-up-tokens "${1#dynamic-t}" ;;
    dynamic-pieces) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    # dynamic-plain: plain above 2 running requests whatever the step costs say. For a profile
    # of the off state: under the profiler the measured plain steps slow down and the default
    # policy resumed speculation at C=64 (2026-12-03, plugin d594c0d: no plain-mode trace).
    # dynamic-graph: flushes and prefills in SGLang's draft prefill graph, as before 2026-12-03
    # night (SGLANG_DYNSPEC_EAGER_DRAFT_TOKENS=0): the A/B of leaving that graph.
    dynamic-graph) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    # dynamic-stream: buffer-full flushes on a side stream (SGLANG_DYNSPEC_FLUSH_STREAM=1).
    dynamic-stream) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    dynamic-plain | dynamic-plain-pieces) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics \
      --speculative-dynamic-policy threshold --speculative-disable-batch-threshold 2 \
      --speculative-enable-batch-threshold 1 ;;
  esac
}

CONFIG_LIST=${CONFIGS:-baseline dynamic dynamic-t0}
for cfg in $CONFIG_LIST; do
  if [ "${cfg%-pieces}" != "$cfg" ]; then
    export SGLANG_DYNSPEC_FLUSH_TOKENS=${FLUSH_TOKENS:-2048}
  else
    unset SGLANG_DYNSPEC_FLUSH_TOKENS
  fi
  if [ "$cfg" = dynamic-graph ]; then
    export SGLANG_DYNSPEC_EAGER_DRAFT_TOKENS=0
  else
    unset SGLANG_DYNSPEC_EAGER_DRAFT_TOKENS
  fi
  if [ "$cfg" = dynamic-stream ]; then
    export SGLANG_DYNSPEC_FLUSH_STREAM=1
  else
    unset SGLANG_DYNSPEC_FLUSH_STREAM
  fi
  # shellcheck disable=SC2046
  start_server "$cfg" $(server_args "$cfg") --log-level info || continue
  case " ${SWEEP_CONFIGS-$CONFIG_LIST} " in *" $cfg "*)
    python3 -m sglang_dynspec.bench sweep "${BENCH[@]}" --config "$cfg" --concurrency "${C:-64,128}" \
      --repeats "${REPEATS:-2}" --waves "${WAVES:-2}" --out "$RESULTS" 2> "$OUT/logs/sweep_$cfg.err" | tail -n 2
    REQ_PER_C=8 python3 .gpu/client.py "$URL" 64 256 1 \
      | sed -u "s/^/{\"kind\": \"prefill_only\", \"config\": \"$cfg\", \"prompt_len\": 256, \"r\": /; s/\$/}/" | tee -a "$RESULTS" ;;
  esac
  case " ${PROFILE_CONFIGS-baseline dynamic} " in *" $cfg "*)
    # 8xC requests: 200 profiled steps end before the load does (4xC did not on 2026-12-03).
    # The plugin's bench client (lib.sh closed_loop): the harness's .gpu/client.py holds at
    # most 100 connections, so it cannot load C=128, and its prompts may share first tokens.
    # PROFILE_ALIGN=1: the profile starts before the load, so that every server's trace holds
    # the same forwards (the first wave's prefills, then its decode steps). Started 4 s into
    # the load (PROFILE_ALIGN=0), the C=128 traces of 2026-12-07 caught different parts of a
    # wave boundary (5 prefill forwards in one, 12 in the other): h100-20261207f-59f849a.
    # PROFILE_STACK=0: no Python stacks; with them both servers were host-bound under the
    # profiler (GPU busy 54% and 70%, decode periods twice the unprofiled ITL), so the step
    # periods measured the tracing, not the server. 1 brings back the host summary.
    PC=${PROFILE_C:-64}
    profile() {
      curl -s -X POST "$URL/start_profile" -H 'Content-Type: application/json' \
        -d "{\"output_dir\": \"$PROF_ROOT/$cfg\", \"num_steps\": ${PROFILE_STEPS:-30}, \"activities\": [\"CPU\", \"GPU\"], \"with_stack\": $([ "${PROFILE_STACK:-0}" = 1 ] && echo true || echo false), \"profile_prefix\": \"$cfg\"}"
      echo
    }
    [ "${PROFILE_ALIGN:-1}" = 1 ] && profile
    closed_loop "$cfg" "$PC" 256 256 $((${PROFILE_REQ_PER_C:-8} * PC)) "$OUT/logs/profile-load.jsonl" \
      > /dev/null 2>> "$OUT/logs/profile-load.err" &
    LOAD=$!
    [ "${PROFILE_ALIGN:-1}" = 1 ] || { sleep 4; profile; }
    wait $LOAD ;;
  esac
  # The catch-up's histogram keeps its buckets: a flush's time is otherwise only a sum over the
  # run, first flushes after start-up included (2026-12-04).
  [ "${cfg#dynamic}" != "$cfg" ] && curl -s "$URL/metrics" | grep "^sglang:spec_dynamic" \
    | awk '!/_bucket/ || /^sglang:spec_dynamic_catch_up_seconds_bucket/' > "$OUT/logs/metrics_$cfg.txt"
  stop_server
  mv "$OUT/server_$cfg.log" "$OUT/logs/" 2>/dev/null
done

trace() { find "$PROF_ROOT/$1" -name "*.trace.json.gz" 2>/dev/null | head -n 1; }
{
  for cfg in $CONFIG_LIST; do
    t=$(trace "$cfg"); [ -n "$t" ] && python3 benchmarks/profiles/summarize_trace.py "$t"
  done
  for cfg in $CONFIG_LIST; do
    [ "$cfg" != baseline ] && [ -n "$(trace baseline)" ] && [ -n "$(trace "$cfg")" ] && \
      python3 benchmarks/profiles/summarize_trace.py --diff --top 16 "$(trace baseline)" "$(trace "$cfg")"
  done
} > "$OUT/profiles.md" 2>&1
python3 benchmarks/summarize.py "$RESULTS" || true
grep -h "prefill_only" "$RESULTS"
