#!/bin/bash
# Issue 20: SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS on SGLang 0.5.17 with CUDA graphs, at a real
# acceptance: the test bed's tiny counting pair (benchmarks/h200/last_logits_check.py says why
# a wrong row would show), EAGLE3_DYNAMIC speculating on every step (threshold 8, six requests),
# one draft step and two draft tokens, decode graphs up to batch 8. Simulated acceptance
# (SGLANG_SIMULATE_ACC_LEN) accepts whatever the draft proposed, so the throughput A/B of
# benchmarks/results/h100-20261208b-ec34cd2/ could not check the proposals; this does.
# CONFIGS: last-logits (the switch on, default) and/or all-logits (off: the control).
# One JSON line per server in $OUT/last-logits.jsonl; a tiny server starts in about 100 s.
# Usage (device, repo root): timeout 240 bash benchmarks/h200/last_logits_check.sh
set -u
source .gpu/device-env.sh || exit 1
source benchmarks/h200/tiny_models.sh
export MODEL=$M/target-count
source benchmarks/h200/lib.sh
RESULTS=$OUT/last-logits.jsonl
pack() { stop_server; (cd "$OUT" && tar -cJf last-logits-logs.tar.xz server_*.log && rm -f server_*.log); }
on_exit pack
for cfg in ${CONFIGS:-last-logits}; do
  case $cfg in
    last-logits) export SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS=1 ;;
    all-logits) export SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS=0 ;;
    *) echo "CONFIGS: last-logits or all-logits, got $cfg" >&2; exit 2 ;;
  esac
  start_server "$cfg" --load-format auto --dtype "${DTYPE:-bfloat16}" --cuda-graph-max-bs 8 --enable-metrics \
    --log-level info --speculative-algorithm EAGLE3_DYNAMIC --speculative-draft-model-path "$M/draft-count" \
    --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 2 \
    --speculative-dynamic-policy threshold --speculative-disable-batch-threshold 8 || continue
  python3 benchmarks/h200/last_logits_check.py "$URL" "$cfg" | tee -a "$RESULTS"
  grep -h "draft extend logits" "$OUT/server_$cfg.log" | cut -c1-200
  stop_server
done
