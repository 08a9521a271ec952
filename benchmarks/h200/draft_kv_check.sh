#!/bin/bash
# The draft KV after the catch-up on the H200 (SGLang 0.5.17, CUDA graphs, the test bed's tiny
# random pair, deterministic inference): each finished request's draft K/V rows from an
# always-speculating EAGLE-3 server against EAGLE3_DYNAMIC (threshold 3, a 4-position buffer:
# plain with six requests, flushes every 4 steps, a resume once two are left).
# benchmarks/h200/draft_kv_check.py sends the workload and compares; one JSON line per
# comparison in $OUT/draft-kv.jsonl. CHECKS picks the comparisons, in order (default: all):
#   chain    EAGLE3 and EAGLE3_DYNAMIC with a chain draft (steps 3, topk 1, 4 draft tokens),
#            flushes in order
#   stream   the same with SGLANG_DYNSPEC_FLUSH_STREAM=1 (needs chain's reference)
#   pieces   the same with buffer-full flushes in pieces (SGLANG_DYNSPEC_FLUSH_TOKENS=PIECE_TOKENS,
#            default 25) and --max-running-requests 8: a request pool of 9 slots, where pieces
#            of 25 positions give each 4-position log catch_up.flush_slack's 1 more position
#            (the start-up log's count goes to the results; needs chain's reference)
#   control  EAGLE3_DYNAMIC without the catch-up: its plain positions were never written, so it
#            must differ there (needs chain's reference)
#   tree     a tree draft (steps 3, topk 4, 8 draft tokens) on both servers (issue 21 §2)
# No mixed prefill+decode check: SGLang 0.5.17 refuses --enable-mixed-chunk with any speculative
# algorithm (server_args asserts it), so mixed catch-ups exist only on 0.5.23, where
# tests/test_catch_up_e2e.py covers them on the CPU.
# Decode graphs are captured up to batch 8 (the workload runs six requests). Even so a tiny
# server's start took 105 s on a fresh H100 (2026-12-07, flashinfer JIT included; 84-130 s on the
# H200 with graphs to 128), so each server needs about 100 s and each pair about 200 s.
# Usage (device, repo root): bash benchmarks/h200/draft_kv_check.sh   (DTYPE=float32 to try fp32)
#   CHECKS="tree chain control" timeout 540 bash benchmarks/h200/draft_kv_check.sh   (5 servers)
set -u
source .gpu/device-env.sh || exit 1
source benchmarks/h200/tiny_models.sh
source benchmarks/h200/lib.sh
TINY=(--load-format auto --dtype "${DTYPE:-bfloat16}" --enable-deterministic-inference --enable-metrics
  --cuda-graph-max-bs 8)
DRAFT=(--speculative-draft-model-path "$M/draft" --speculative-num-steps 3)
SPEC=("${DRAFT[@]}" --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
TREE=("${DRAFT[@]}" --speculative-eagle-topk 4 --speculative-num-draft-tokens 8)
THRESHOLDS=(--speculative-dynamic-policy threshold --speculative-disable-batch-threshold 3
  --speculative-enable-batch-threshold 2 --speculative-min-dwell-steps 0 --speculative-catch-up-tokens 4)
DYNAMIC=(--speculative-algorithm EAGLE3_DYNAMIC "${SPEC[@]}" "${THRESHOLDS[@]}")
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

compare() {  # compare REFERENCE NAME LABEL
  python3 $P compare "/tmp/kv-$1" "/tmp/kv-$2" --label "$3" | tee -a "$RESULTS"
}

for check in ${CHECKS:-chain stream pieces control tree}; do
  case $check in
    chain)
      serve eagle3 --speculative-algorithm EAGLE3 "${SPEC[@]}" || exit 1
      serve dynamic "${DYNAMIC[@]}" && compare eagle3 dynamic "EAGLE3_DYNAMIC, flushes in order" ;;
    stream)
      SGLANG_DYNSPEC_FLUSH_STREAM=1 serve dynamic-stream "${DYNAMIC[@]}" \
        && compare eagle3 dynamic-stream "EAGLE3_DYNAMIC, flushes on a side stream" ;;
    pieces)
      SGLANG_DYNSPEC_FLUSH_TOKENS=${PIECE_TOKENS:-25} serve dynamic-pieces "${DYNAMIC[@]}" --max-running-requests 8 \
        && compare eagle3 dynamic-pieces "EAGLE3_DYNAMIC, flushes in pieces of ${PIECE_TOKENS:-25} positions"
      grep -o "[0-9]* more positions per request" "$OUT/server_dynamic-pieces.log" | head -n 1 \
        | sed 's/^\([0-9]*\).*/{"kind": "flush_slack", "label": "dynamic-pieces", "slack": \1}/' | tee -a "$RESULTS" ;;
    control)
      serve dynamic-t0 "${DYNAMIC[@]}" --speculative-catch-up-tokens 0 \
        && compare eagle3 dynamic-t0 "EAGLE3_DYNAMIC without the catch-up (control)" ;;
    tree)
      serve eagle3-tree --speculative-algorithm EAGLE3 "${TREE[@]}" || exit 1
      serve dynamic-tree --speculative-algorithm EAGLE3_DYNAMIC "${TREE[@]}" "${THRESHOLDS[@]}" \
        && compare eagle3-tree dynamic-tree "EAGLE3_DYNAMIC, tree draft (topk 4, 8 draft tokens)" ;;
    *) echo "CHECKS: chain, stream, pieces, control or tree, got $check" >&2; exit 2 ;;
  esac
done
