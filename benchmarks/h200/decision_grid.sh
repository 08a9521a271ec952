#!/bin/bash
# One row of issue 17's decision grid on the H200 (SGLang 0.5.17, CUDA graphs): a
# baseline, an EAGLE-3 and an EAGLE3_DYNAMIC server with the plugin's default flags (no
# policy, no threshold) in one call, each swept over C in {1,4,16,32,48,64,128}, two
# repeats, closed loop with WAVES x C requests per point (2; 1 at prompt 2048). Dummy
# weights, so the acceptance is simulated (SGLANG_SIMULATE_ACC_LEN, read by the
# speculative verify only): a speed check, never an output check.
#
# Usage (on the device, repo root):  ROW=8b-acc3 bash benchmarks/h200/decision_grid.sh
#   ROW: 8b-acc2 | 8b-acc3 | 8b-acc4 | 3b-acc3 | 8b-p2048-acc3, or issue 19's
#     offstate-8b | offstate-3b (C=1,8,64,128, 3 repeats; results $CARD-offstate-...), or
#     issue 20's specstep (8b-acc3's servers and sweep; results $CARD-specstep-YYYYMMDD.jsonl,
#     the step = ITL p50 x accepted tokens per step, by benchmarks/summarize.py)
#   CONFIGS: the servers, in order (default: baseline eagle3 dynamic); also dynamic-tN
#     (catch-up buffer N), dynamic-splitkv, dynamic-prefill-verify, dynamic-grouped,
#     dynamic-draft-splitkv / dynamic-prefill-draft-extend (the draft extend through the
#     split-KV kernel, the default, or SGLang's prefill kernel), dynamic-last-logits (the
#     draft extend's LM head at the last accepted rows only), and
#     eagle3-sK / dynamic-sK (issue 20 item 4: a draft of K = 1 or 2 steps, K+1 draft
#     tokens, at the acceptance the 3-step chain's would give K steps: see chain_acc)
#   C, REPEATS, WAVES: override the row's sweep
#   PLUGIN_COMMIT: the plugin commit measured (tags every line)
#   SGLANG_DYNSPEC_COST_CACHE: where the dynamic server keeps its start-up step-cost
#     table; a table carried from an earlier call shows the cache hit on a restart.
# Results: $OUT/$CARD-decision-YYYYMMDD-$ROW.jsonl (CARD h100, h200 or gpu: lib.sh), one
# line per point (kind sweep_point: config, concurrency, repeat, output_tok_s, itl_p99_ms,
# decode_steps_spec/plain, ...), one per server start (kind server_start: start_s) and one
# for the dynamic server's step-cost table (kind startup_costs: seconds, cache_hit); server
# logs in $OUT/logs.tar.xz.
set -u
source .gpu/device-env.sh || exit 1
ROW=${ROW:?set ROW}
case $ROW in
  8b-acc2) SHAPE=8b ACC=2.0 PROMPT=256 ;;
  8b-acc3) SHAPE=8b ACC=3.0 PROMPT=256 ;;
  # Issue 20's targets are measured on the 8b-acc3 row, in a file of its own name.
  specstep) SHAPE=8b ACC=3.0 PROMPT=256 KIND=specstep ;;
  8b-acc4) SHAPE=8b ACC=4.0 PROMPT=256 ;;
  3b-acc3) SHAPE=3b ACC=3.0 PROMPT=256 ;;
  # At prompt 2048 two waves per point do not fit one call (the EAGLE-3 sweep alone took 250 s).
  8b-p2048-acc3) SHAPE=8b ACC=3.0 PROMPT=2048 WAVES=${WAVES:-1} ;;
  # Issue 19's off-state rows: C=1 and 8 against EAGLE-3, 64 and 128 against the baseline,
  # 3 repeats, 4xC requests on the 3B shape (its points are short). ACC (default 3.0, the
  # issue's) at 2.0 puts the dynamic server in plain mode from C=48 (2026-12-04 grid).
  offstate-8b | offstate-3b) SHAPE=${ROW#offstate-} ACC=${ACC:-3.0} PROMPT=256 KIND=offstate
    C=${C:-1,8,64,128} REPEATS=${REPEATS:-3}
    [ "$SHAPE" = 3b ] && WAVES=${WAVES:-4} ;;
  *) echo "ROW must be one of 8b-acc2 8b-acc3 8b-acc4 3b-acc3 8b-p2048-acc3 offstate-8b offstate-3b specstep, got $ROW" >&2
     exit 2 ;;
esac
source benchmarks/h200/lib.sh  # SHAPE picks the models
export SGLANG_SIMULATE_ACC_LEN=$ACC
if [ "${KIND:-decision}" = offstate ]; then
  RESULTS=$OUT/$CARD-offstate-$(date -u +%Y%m%d)-$SHAPE$([ "$ACC" = 3.0 ] || echo "-acc$ACC").jsonl
elif [ "${KIND:-decision}" = specstep ]; then
  RESULTS=$OUT/$CARD-specstep-$(date -u +%Y%m%d).jsonl
else
  RESULTS=$OUT/$CARD-decision-$(date -u +%Y%m%d)-$ROW.jsonl
fi
SPEC=("${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
BENCH=(--url "$URL" --prompt-len "$PROMPT" --output-len 256 --no-progress --tag "hw=$HW_TAG" --tag "shape=$SHAPE_TAG"
       --tag "acc_len=$ACC" --tag "row=$ROW" --tag "plugin_commit=${PLUGIN_COMMIT:-unknown}")
mkdir -p "$OUT/logs"

# Every server: --enable-metrics (the dynamic one reports its steps per mode there) and
# --log-level info (the dynamic one logs its step-cost table), so all pay the same.
server_args() {
  case $1 in
    baseline) echo --enable-metrics ;;
    eagle3) echo --speculative-algorithm EAGLE3 "${SPEC[@]}" --enable-metrics ;;
    dynamic) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    # dynamic-tN: the catch-up buffer at N positions per request (issue 19: 384 holds a
    # 256-token request's whole plain phase, so it never flushes).
    dynamic-t[0-9]*) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics \
      --speculative-catch-up-tokens "${1#dynamic-t}" ;;
    # The target's verify attention through SGLang's split-KV kernel (issue 20; the default
    # since the commit after 8c5c7b8, named for results measured before) or its prefill kernel,
    # or through the grouped-head kernel first (SGLANG_DYNSPEC_GROUPED_VERIFY).
    dynamic-splitkv | dynamic-prefill-verify | dynamic-grouped | dynamic-sglang-splits | dynamic-draft-splitkv | dynamic-prefill-draft-extend | dynamic-last-logits) echo --speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --enable-metrics ;;
    eagle3-s[12] | dynamic-s[12]) local k=${1#*-s} algo=EAGLE3; [ "${1%%-*}" = dynamic ] && algo=EAGLE3_DYNAMIC
      echo --speculative-algorithm $algo "${EAGLE_ARGS[@]}" --speculative-num-steps "$k" --speculative-eagle-topk 1 \
        --speculative-num-draft-tokens $((k + 1)) --enable-metrics ;;
  esac
}

# chain_acc K: the simulated acceptance of a K-step chain whose 3-step chain accepts $ACC
# tokens per step (bonus token included), with the same chance p of accepting each draft
# position given the one before: 1 + p + p^2 + p^3 = ACC, and 1 + p + ... + p^K for K steps.
# A model (real drafts accept later positions less often), written beside each row.
chain_acc() {
  python3 - "$ACC" "$1" <<'EOF'
import sys
acc, k = float(sys.argv[1]), int(sys.argv[2])
lo, hi = 0.0, 1.0
for _ in range(60):  # 1 + p + p^2 + p^3 rises with p on [0, 1]
    p = (lo + hi) / 2
    lo, hi = (p, hi) if 1 + p + p * p + p**3 < acc else (lo, p)
print(f"{sum(p**j for j in range(k + 1)):.3f}")
EOF
}

jsonl() { python3 -c "import json,sys; print(json.dumps(dict(a.split('=',1) for a in sys.argv[1:])))" "$@" >> "$RESULTS"; }

for cfg in ${CONFIGS:-baseline eagle3 dynamic}; do
  t0=$SECONDS
  unset SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS
  case $cfg in
    dynamic-splitkv) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=1 SGLANG_DYNSPEC_GROUPED_VERIFY=0 ;;
    dynamic-prefill-verify) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=0 SGLANG_DYNSPEC_GROUPED_VERIFY=0 ;;
    dynamic-grouped) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=1 SGLANG_DYNSPEC_GROUPED_VERIFY=1 ;;
    # The per-head kernel with SGLang's split count (16 in every graph replay), the A/B of
    # SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH (on by default).
    dynamic-sglang-splits) export SGLANG_DYNSPEC_SPLIT_KV_VERIFY=1 SGLANG_DYNSPEC_GROUPED_VERIFY=0 \
      SGLANG_DYNSPEC_SPLIT_KV_SPLITS_BY_BATCH=0 ;;
    # The draft extend's attention through the split-KV kernel (issue 20 §3; the default since
    # the commit after e76add8, named for results measured before) or SGLang's prefill kernel.
    dynamic-draft-splitkv) export SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND=1
      unset SGLANG_DYNSPEC_SPLIT_KV_VERIFY SGLANG_DYNSPEC_GROUPED_VERIFY ;;
    # The draft extend's LM head at the last accepted rows only (SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS).
    dynamic-last-logits) export SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS=1
      unset SGLANG_DYNSPEC_SPLIT_KV_VERIFY SGLANG_DYNSPEC_GROUPED_VERIFY ;;
    dynamic-prefill-draft-extend) export SGLANG_DYNSPEC_SPLIT_KV_DRAFT_EXTEND=0
      unset SGLANG_DYNSPEC_SPLIT_KV_VERIFY SGLANG_DYNSPEC_GROUPED_VERIFY ;;
  esac
  export SGLANG_SIMULATE_ACC_LEN=$ACC
  tags=(--tag "draft_steps=3")
  case $cfg in
    *-s[12]) export SGLANG_SIMULATE_ACC_LEN=$(chain_acc "${cfg#*-s}")
      tags=(--tag "draft_steps=${cfg#*-s}" --tag "sim_acc_len=$SGLANG_SIMULATE_ACC_LEN") ;;
    baseline) tags=() ;;
  esac
  # shellcheck disable=SC2046
  if start_server "$cfg" $(server_args "$cfg") --log-level info; then
    jsonl kind=server_start "config=$cfg" "row=$ROW" "start_s=$((SECONDS - t0))" up=true
    if [ "${cfg%%-*}" = dynamic ]; then
      python3 - "$OUT/server_$cfg.log" "$ROW" "$cfg" >> "$RESULTS" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read()
m = re.search(r"step costs \((timed at start-up|read from the cache) in ([0-9.]+) s", text)
print(json.dumps({"kind": "startup_costs", "config": sys.argv[3], "row": sys.argv[2],
                  "cache_hit": None if m is None else m.group(1) == "read from the cache",
                  "seconds": None if m is None else float(m.group(2))}))
EOF
    fi
    python3 -m sglang_dynspec.bench sweep "${BENCH[@]}" "${tags[@]}" --config "$cfg" \
      --concurrency "${C:-1,4,16,32,48,64,128}" --repeats "${REPEATS:-2}" --waves "${WAVES:-2}" \
      --out "$RESULTS" 2> "$OUT/logs/sweep_$cfg.err" | tail -n 2
    # The dynamic server's corrections, acceptance by source and steps per mode at the end.
    [ "${cfg%%-*}" = dynamic ] && curl -s "$URL/metrics" | grep "^sglang:spec_dynamic" > "$OUT/logs/metrics_$cfg.txt"
    stop_server
  else
    jsonl kind=server_start "config=$cfg" "row=$ROW" up=false
  fi
  mv "$OUT/server_$cfg.log" "$OUT/logs/" 2>/dev/null
done

grep -h "sglang-dynspec" "$OUT"/logs/server_dynamic*.log | grep -v Capturing | cut -c1-220 | head -n 30
python3 benchmarks/summarize.py "$RESULTS" || true
tar -C "$OUT" -cJf "$OUT/logs.tar.xz" logs && rm -rf "$OUT/logs"
