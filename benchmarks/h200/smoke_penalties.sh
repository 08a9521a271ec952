#!/bin/bash
# H200 smoke check of --speculative-penalties exact on SGLang 0.5.17 (CUDA graphs, tiny pair, bf16):
# the plugin starts at HEAD (its host-symbol table resolves against 0.5.17), a lone request with a
# frequency penalty decodes plain (below the threshold) and a lone unpenalised one speculates; prints
# each request's step modes and the plugin's counters. Usage (device, repo root):
#   bash benchmarks/h200/smoke_penalties.sh
set -u
source .gpu/device-env.sh || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site ./testbed > /tmp/tb.log 2>&1 || { tail -5 /tmp/tb.log; exit 1; }
M=/tmp/tiny-models; python3 -m dynspec_testbed.models "$M" > /dev/null || exit 1
export MODEL=$M/target; source benchmarks/h200/lib.sh
SGLANG_DYNSPEC_REQUEST_MODES=1 start_server smoke --load-format auto --dtype bfloat16 --speculative-algorithm EAGLE3_DYNAMIC \
  --speculative-draft-model-path "$M/draft" --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 \
  --speculative-disable-batch-threshold 8 --speculative-min-dwell-steps 0 --enable-metrics --log-level info || { grep -E "Error|error" $OUT/server_smoke.log | tail -5; exit 1; }
for p in '"frequency_penalty": 0.5' '"temperature": 0'; do
  curl -s $URL/generate -H 'content-type: application/json' -d "{\"input_ids\": [5, 17, 42, 99], \"sampling_params\": {\"max_new_tokens\": 24, \"ignore_eos\": true, $p}}" \
    | python3 -c "import sys, json; r=json.load(sys.stdin); m=r['meta_info']['spec_dynamic_step_modes']; print(json.dumps({'params': '''$p''', 'plain': m.count('plain'), 'spec': m.count('spec'), 'tokens': len(r['output_ids'])}))"
done
curl -s "$URL/metrics" | grep -E "spec_dynamic_(decode_steps|penalty_plain_steps|switches)_total" | grep -v "^#"
grep -E "sglang-dynspec\]" $OUT/server_smoke.log | head -5
stop_server
