#!/bin/bash
# Issue 21 §1 on the H200: SGLang 0.5.17's parity and logprob kits, unchanged, with SGLang's own
# server fixture, against EAGLE3_DYNAMIC and stock EAGLE3 (benchmarks/h200/kits_gpu.py).
# The GPU bundle (.gpu) ships SGLang without its sglang/test package; prepare it here first:
#   bash benchmarks/h200/kits.sh --prepare       # unpacks sglang/test of the 0.5.17 wheel into .gpu-kits/
# then on the device (carry .gpu and .gpu-kits):
#   bash benchmarks/h200/kits.sh                 # results: $OUT/kits.jsonl, logs: $OUT/kits-logs.tar.xz
#   KITS_CLASSES=DynamicCrossingModes bash benchmarks/h200/kits.sh   # one class (StockEagle3: the control)
#   KITS_CLASSES=DynamicCrossingModes.test_logprob_mixed bash ...    # one method (KIT_METHOD_TIMEOUT_S: 240)
set -u
if [ "${1:-}" = --prepare ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps sglang==0.5.17 -d "$tmp" || exit 1
  rm -rf .gpu-kits && mkdir -p .gpu-kits
  python3 -m zipfile -e "$tmp"/sglang-0.5.17-*.whl "$tmp/wheel" && cp -r "$tmp/wheel/sglang/test" .gpu-kits/ || exit 1
  rm -rf "$tmp"
  echo "sglang/test of 0.5.17 in .gpu-kits/ ($(du -sh .gpu-kits | cut -f1))"
  exit 0
fi
source .gpu/device-env.sh || exit 1
[ -d .gpu-kits/test/kits ] || { echo "no .gpu-kits/test: run 'bash benchmarks/h200/kits.sh --prepare' and carry .gpu-kits"; exit 1; }
cp -r .gpu-kits/test /tmp/site/sglang/
source benchmarks/h200/tiny_models.sh
# SGLang's popen_launch_server runs the `sglang` console script, which a --target install lacks.
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from sglang.cli.main import main; sys.exit(main())" "$@"\n' > /tmp/bin/sglang
chmod +x /tmp/bin/sglang
export PATH=/tmp/bin:$PATH
python3 -c "import requests, aiohttp, PIL" || exit 1
# SGLang's test utilities import its benchmark package, whose dataset loaders import
# `datasets` (and its tables `tabulate`) at module level; the kits call neither, and the
# device lacks `datasets` (the first call failed there). A stand-in that raises if
# anything calls it, for each one missing.
mkdir -p /tmp/kit-stubs
for mod in datasets tabulate; do
  python3 -c "import $mod" 2> /dev/null && continue
  printf 'def __getattr__(name):\n    def missing(*args, **kwargs):\n        raise RuntimeError("%s is not installed on this machine (benchmarks/h200/kits.sh)")\n    return missing\n' "$mod" \
    > "/tmp/kit-stubs/$mod.py"
  echo "stand-in for $mod (not installed here)"
done
export PYTHONPATH=$PYTHONPATH:/tmp/kit-stubs
python3 -c "import sglang.test.kits.spec_server_kits" || exit 1
# shellcheck disable=SC2086  # KITS_CLASSES: class names, space-separated (default both)
python3 benchmarks/h200/kits_gpu.py "$M" "$OUT/kits.jsonl" ${KITS_CLASSES:-} > "$OUT/kits.log" 2>&1
status=$?
cat "$OUT/kits.jsonl" | cut -c1-300
tail -5 "$OUT/kits.log"
(cd "$OUT" && tar -cJf kits-logs.tar.xz kits.log && rm -f kits.log)
exit $status
