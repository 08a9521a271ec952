#!/bin/bash
# H200 smoke check of the goodput policy (issue 17) on SGLang 0.5.17, CUDA graphs: one
# EAGLE3_DYNAMIC server with --speculative-dynamic-policy goodput (simulated acceptance
# 3.0: a speed check, not an output check), a closed loop at C=1 then C=64, and the
# plugin's /metrics after each: decode steps per mode, switches, the acceptance source.
# Expected from the 8B-shape sweeps (EAGLE-3 1.9x baseline at C=1, 0.78x at 64):
# speculative steps at C=1, plain steps at C=64.
# Usage (on the device, repo root): bash benchmarks/h200/decision_smoke.sh
set -u
source .gpu/device-env.sh || exit 1
source benchmarks/h200/lib.sh
export SGLANG_SIMULATE_ACC_LEN=3.0
start_server goodput --speculative-algorithm EAGLE3_DYNAMIC --speculative-dynamic-policy goodput \
  "${EAGLE_ARGS[@]}" --speculative-num-steps 3 --speculative-eagle-topk 1 \
  --speculative-num-draft-tokens 4 --enable-metrics --log-level info || exit 1
grep -A 14 "step costs" "$OUT/server_goodput.log" | sed 's/^\[[^]]*\] //' | cut -c1-160
for c in 1 64; do
  python3 .gpu/client.py "$URL" "$c" 256 128 | sed "s/^/{\"c\": $c, \"r\": /; s/\$/}/"
  curl -s "$URL/metrics" | grep -E "^sglang:spec_dynamic_(decode_steps|switches)_total|^sglang:spec_dynamic_acceptance\{" \
    | grep -v "NaN" | sed "s/^/C=$c /"
done
grep -E "\-> (spec|plain)" "$OUT/server_goodput.log" | sed 's/^\[[^]]*\] //' | head -8
stop_server
