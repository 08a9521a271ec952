#!/bin/bash
# The draft KV after the catch-up on the H200 (SGLang 0.5.17, CUDA graphs, the test bed's tiny
# random pair, deterministic inference): each finished request's draft K/V rows from an
# always-speculating EAGLE-3 server, from EAGLE3_DYNAMIC (threshold 3, a 4-position buffer: plain
# with six requests, flushes every 4 steps, a resume once two are left) with flushes in order and
# with SGLANG_DYNSPEC_FLUSH_STREAM=1, and from EAGLE3_DYNAMIC without the catch-up (the control:
# its plain positions were never written, so it must differ there). benchmarks/h200/draft_kv_check.py
# sends the workload and compares; one JSON line per server in $OUT/draft-kv.jsonl.
# Usage (device, repo root): bash benchmarks/h200/draft_kv_check.sh   (DTYPE=float32 to try fp32)
set -u
source .gpu/device-env.sh || exit 1
source benchmarks/h200/tiny_models.sh
source benchmarks/h200/lib.sh
TINY=(--load-format auto --dtype "${DTYPE:-bfloat16}" --enable-deterministic-inference --enable-metrics)
SPEC=(--speculative-draft-model-path "$M/draft" --speculative-num-steps 3 --speculative-eagle-topk 1
  --speculative-num-draft-tokens 4)
DYNAMIC=(--speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" --speculative-dynamic-policy threshold
  --speculative-disable-batch-threshold 3 --speculative-enable-batch-threshold 2 --speculative-min-dwell-steps 0)
P=benchmarks/h200/draft_kv_check.py
RESULTS=$OUT/draft-kv.jsonl
# The dumps go back too (kilobytes: the tiny draft's rows of six requests per server).
pack() { stop_server; (cd "$OUT" && tar -cJf draft-kv-logs.tar.xz server_*.log -C /tmp $(cd /tmp && ls -d kv-* 2> /dev/null) && rm -f server_*.log); }
on_exit pack

serve() {  # serve NAME [server args...]: one server, the workload, its dumps in $OUT/kv-NAME
  local name=$1; shift
  mkdir -p "/tmp/kv-$name"
  SGLANG_DYNSPEC_TESTBED=1 SGLANG_DYNSPEC_TESTBED_DRAFT_KV_DIR="/tmp/kv-$name" \
    start_server "$name" "${TINY[@]}" --log-level info "$@" || return 1
  python3 $P run "$URL"
  curl -s "$URL/metrics" | grep -E "^sglang:spec_dynamic_(decode_steps|catch_up)_total" | sed "s/^/$name /"
  stop_server
  grep -E "Traceback|Error" "$OUT/server_$name.log" | head -5
}

serve eagle3 --speculative-algorithm EAGLE3 "${SPEC[@]}" || exit 1
serve dynamic "${DYNAMIC[@]}" --speculative-catch-up-tokens 4 \
  && python3 $P compare /tmp/kv-eagle3 /tmp/kv-dynamic --label "EAGLE3_DYNAMIC, flushes in order" | tee -a "$RESULTS"
SGLANG_DYNSPEC_FLUSH_STREAM=1 serve dynamic-stream "${DYNAMIC[@]}" --speculative-catch-up-tokens 4 \
  && python3 $P compare /tmp/kv-eagle3 /tmp/kv-dynamic-stream --label "EAGLE3_DYNAMIC, flushes on a side stream" \
  | tee -a "$RESULTS"
serve dynamic-t0 "${DYNAMIC[@]}" --speculative-catch-up-tokens 0 \
  && python3 $P compare /tmp/kv-eagle3 /tmp/kv-dynamic-t0 --label "EAGLE3_DYNAMIC without the catch-up (control)" \
  | tee -a "$RESULTS"
