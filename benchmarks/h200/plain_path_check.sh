#!/bin/bash
# H200 check of the plain-decode path with CUDA graphs on (SGLang 0.5.17).
# 1. The original crash scenario: threshold 5, concurrency 1, 2, 5, 10, then 1 again,
#    16 draft tokens (steps 5, topk 4). A plain step that replayed the TARGET_VERIFY graph
#    failed with "size of tensor a (80) must match ... (5)". Prints the plugin's metrics:
#    plain steps, switches, plain steps that replayed the plain DECODE graph, draft
#    catch-ups (at resume and when the buffer fills) and their device time, and the
#    acceptance of the first speculative step after a resume.
# 2. Optional quick sweep of EAGLE3_DYNAMIC (topk 1, 4 draft tokens, acceptance 3.0) at
#    $C (default 1,64,128); set C= to skip.
# Usage (on the device, repo root): bash benchmarks/h200/plain_path_check.sh
set -u
source .gpu/device-env.sh || exit 1
source benchmarks/h200/lib.sh

# SCHEDULERS="overlap sync" also runs the synchronous scheduler (--disable-overlap-schedule).
for sched in ${SCHEDULERS:-overlap}; do
  name=crash16-$sched
  extra=(); [ "$sched" = sync ] && extra=(--disable-overlap-schedule)
  start_server "$name" --speculative-algorithm EAGLE3_DYNAMIC "${EAGLE_ARGS[@]}" \
    --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 \
    --speculative-disable-batch-threshold 5 --speculative-min-dwell-steps 0 \
    --enable-metrics --log-level info "${extra[@]}" \
    && { python3 .gpu/client.py "$URL" 1,2,5,10,1 256 64 | sed "s/^/{\"cfg\": \"$name\", \"r\": /; s/\$/}/" | tee -a "$OUT/results.jsonl"
         curl -s "$URL/metrics" | grep spec_dynamic | grep -v "^#" ; stop_server; }
  grep -E "sglang-dynspec|Error|error|Traceback" "$OUT/server_$name.log" | grep -v "Capturing" | head -30
done

C=${C-1,64,128}
if [ -n "$C" ]; then
  export C OUT_LEN=${OUT_LEN:-128}
  SGLANG_SIMULATE_ACC_LEN=3.0 bash .gpu/serve-and-sweep.sh dynamic --speculative-algorithm EAGLE3_DYNAMIC \
    "${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
    --log-level info
  grep -E "sglang-dynspec|Traceback|Error" "$OUT/server_dynamic.log" | head -10
fi
