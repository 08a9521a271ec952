#!/bin/bash
# Issue 20, step 1: where a speculative step's time goes, on the H200 (SGLang 0.5.17, CUDA graphs,
# triton attention, EAGLE-3 steps 3 / topk 1 / 4 draft tokens, simulated acceptance ACC, default
# 3.0), beside the plain step of a baseline server, in one call.
#
# For each server of CONFIGS (default: baseline eagle3) and each POINT C:PROMPT (default
# 16:256 64:256 128:256 64:1024): a closed-loop load of 8xC requests of PROMPT tokens and 256
# output tokens, and, once it is steady (PROFILE_WAIT_S, default 4 s), SGLang's /start_profile
# for PROFILE_STEPS (default 40) forward steps, CPU and GPU. Each trace is summarized on the
# device (benchmarks/profiles/summarize_trace.py: per step kind, `step[TARGET_VERIFY ..]`,
# `step[DRAFT_EXTEND ..]` ..., the GPU span, the kernel time inside it and the period; the GPU's
# busy share; the kernel time outside every step annotation, where the draft's decode graph
# replays land if SGLang does not annotate them) into $OUT/profiles-spec.md, then deleted (too
# large to bring back); the load's own record (lib.sh's closed_loop: output tok/s, ITL, steps
# per mode) goes to $OUT/profile-spec.jsonl.
# The bound each phase is measured against is in issue 20 (≈ 4.5-6 ms for a step at C=64).
# Usage (on the device, repo root, carry .gpu): bash benchmarks/h200/profile_spec.sh
#   e.g. CONFIGS=eagle3 POINTS="64:256" PROFILE_STEPS=60 bash benchmarks/h200/profile_spec.sh
set -u
source .gpu/device-env.sh || exit 1
SHAPE=${SHAPE:-8b}
source benchmarks/h200/lib.sh  # SHAPE picks the models
export SGLANG_SIMULATE_ACC_LEN=${ACC:-3.0}
SPEC=("${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
PROF_ROOT=$(cd "$OUT" && pwd)/prof
mkdir -p "$OUT/logs" "$PROF_ROOT"
pack_logs() { pack_server_logs "$PROF_ROOT"; }
on_exit pack_logs

server_args() {
  case $1 in
    baseline) echo --enable-metrics ;;
    eagle3) echo --speculative-algorithm EAGLE3 "${SPEC[@]}" --enable-metrics ;;
    dynamic) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    # EAGLE3_DYNAMIC held speculative at every batch size (a threshold above any batch), with
    # the target's verify attention through SGLang's split-KV kernel (SGLANG_DYNSPEC_SPLIT_KV_VERIFY,
    # exported below; the default since the commit after 8c5c7b8) or its prefill kernel, or
    # through the grouped-head kernel first (SGLANG_DYNSPEC_GROUPED_VERIFY).
    spec-splitkv | spec-prefill-verify | spec-grouped | spec-sglang-splits | spec-draft-splitkv) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics \
      --speculative-dynamic-policy threshold --speculative-disable-batch-threshold 4096 --log-level info ;;
    # Issue 20 §2, the attention backend: flashinfer for both servers (lib.sh's triton is
    # overridden: the last --attention-backend wins).
    baseline-fi) echo --enable-metrics --attention-backend flashinfer ;;
    eagle3-fi) echo --speculative-algorithm EAGLE3 "${SPEC[@]}" --enable-metrics --attention-backend flashinfer ;;
    *) echo "unknown config $1 (baseline, eagle3, dynamic, spec-splitkv, spec-prefill-verify, spec-grouped, spec-sglang-splits, spec-draft-splitkv, baseline-fi, eagle3-fi)" >&2; return 1 ;;
  esac
}

for cfg in ${CONFIGS:-baseline eagle3}; do
  args=$(server_args "$cfg") || continue
  unset SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND
  case $cfg in
    spec-splitkv) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=1 SGLANG_DYNSPEC_GROUPED_VERIFY=0 ;;
    spec-prefill-verify) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=0 SGLANG_DYNSPEC_GROUPED_VERIFY=0 ;;
    spec-grouped) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=1 SGLANG_DYNSPEC_GROUPED_VERIFY=1 ;;
    # The per-head kernel with SGLang's split count (16 in every graph replay), the A/B of
    # SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH (on by default).
    spec-sglang-splits) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=1 SGLANG_DYNSPEC_GROUPED_VERIFY=0 \
      SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH=0 ;;
    # The draft extend's attention through the split-KV kernel too (SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND,
    # the default since the commit after e76add8; spec-splitkv sets neither, so it takes the default).
    spec-draft-splitkv) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=1 SGLANG_DYNSPEC_GROUPED_VERIFY=0 \
      SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND=1 ;;
    *) unset SGLANG_DYNSPEC_SPLIT_KV_VERIFY SGLANG_DYNSPEC_GROUPED_VERIFY ;;
  esac
  # shellcheck disable=SC2086  # the server's flags, word-split on purpose
  start_server "$cfg" $args || continue
  for point in ${POINTS:-16:256 64:256 128:256 64:1024}; do
    c=${point%%:*} prompt=${point#*:}
    dir=$PROF_ROOT/$cfg-c$c-p$prompt
    closed_loop "$cfg" "$c" "$prompt" 256 $((8 * c)) "$OUT/profile-spec.jsonl" > /dev/null 2>> "$OUT/logs/load.err" &
    load=$!
    sleep "${PROFILE_WAIT_S:-4}"
    curl -s -X POST "$URL/start_profile" -H 'Content-Type: application/json' \
      -d "{\"output_dir\": \"$dir\", \"num_steps\": ${PROFILE_STEPS:-40}, \"activities\": [\"CPU\", \"GPU\"], \"profile_prefix\": \"$cfg\"}" > /dev/null
    wait $load
    trace=$(find "$dir" -name "*.trace.json.gz" 2> /dev/null | head -n 1)
    {
      echo "# $cfg, C=$c, prompt $prompt, output 256, acceptance $SGLANG_SIMULATE_ACC_LEN"
      echo
      if [ -n "$trace" ]; then python3 benchmarks/profiles/summarize_trace.py "$trace"; else echo "(no trace written)"; fi
      echo
    } >> "$OUT/profiles-spec.md" 2>&1
    rm -rf "$dir"
  done
  stop_server
done
cat "$OUT/profile-spec.jsonl"
