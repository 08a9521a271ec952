# Helpers for H200 runs (source after `source .gpu/device-env.sh`, from the repo root).
# Servers use the dummy-weight Llama-3.1-8B-shaped target of ../shared/gpu, bind to
# 127.0.0.1, and are stopped by PID. Logs go to $OUT/server_NAME.log.
OUT=${OUT:-out}; mkdir -p "$OUT"
PORT=${PORT:-30000}
URL=http://127.0.0.1:$PORT
# SHAPE (8b or 3b), when set, picks the target, its EAGLE-3 draft and the results' shape
# tag (../shared/gpu/models); unset, MODEL (default the 8B shape) and the 8B draft apply.
case ${SHAPE:-} in
  "") ;;
  8b) MODEL=.gpu/models/llama8b; DRAFT=.gpu/models/eagle3-8b; SHAPE_TAG=llama-3.1-8b-dummy ;;
  3b) MODEL=.gpu/models/llama3b; DRAFT=.gpu/models/eagle3-3b; SHAPE_TAG=llama-3.2-3b-dummy ;;
  *) echo "SHAPE must be 8b or 3b, got $SHAPE" >&2; exit 2 ;;
esac
export MODEL=${MODEL:-.gpu/models/llama8b}
DRAFT=${DRAFT:-.gpu/models/eagle3-8b}
# DRAFT_VOCAB=N: the draft with a vocabulary of N ids instead of the target's (a copy of its
# config, dummy weights, no hot-token map: draft id = target id), tagged in SHAPE_TAG.
# ../shared/gpu's drafts have the target's 128,256 ids; the published Llama-3.1-8B EAGLE-3
# drafts have 32,000, and the draft is weight-bound: on the H100 at C=64 its three steps
# took 1.37 ms of a 13.2 ms speculative step, about the time to read its weights three
# times, the lm_head 70% of them (benchmarks/results/h100-20261207g-59f849a/).
if [ -n "${DRAFT_VOCAB:-}" ]; then
  SMALL_DRAFT=/tmp/$(basename "$DRAFT")-d$DRAFT_VOCAB
  mkdir -p "$SMALL_DRAFT"
  python3 - "$DRAFT/config.json" "$SMALL_DRAFT/config.json" "$DRAFT_VOCAB" <<'PY' || exit 2
import json, sys
config = json.load(open(sys.argv[1]))
config["draft_vocab_size"] = int(sys.argv[3])
json.dump(config, open(sys.argv[2], "w"))
PY
  DRAFT=$SMALL_DRAFT
  SHAPE_TAG=${SHAPE_TAG:-llama-3.1-8b-dummy}-d$DRAFT_VOCAB
fi
COMMON_ARGS=(--model-path "$MODEL" --load-format dummy --skip-tokenizer-init
  --attention-backend triton --sampling-backend pytorch --grammar-backend none
  --host 127.0.0.1 --port "$PORT" --mem-fraction-static 0.7 --max-running-requests 128
  --cuda-graph-max-bs 128)
# The card, for the results' hw tag: the device lends H100s as well as H200s, and a row
# labelled with the wrong card would be compared with the wrong files.
HW_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9.\n-' _)
HW_TAG=${HW_TAG:-unknown-gpu}
# The card's short name for results files (h100-decision-..., h200-offstate-...).
case $HW_TAG in *H100*) CARD=h100 ;; *H200*) CARD=h200 ;; *) CARD=gpu ;; esac
# The JIT caches of an earlier machine, when carried (.gpu/jit-cache.tar.xz: ~/.triton/cache and
# ~/.cache/flashinfer of a machine with the same bundle, packed at the end of a call with
# `tar -cJf $OUT/jit-cache.tar.xz -C $HOME .triton/cache .cache/flashinfer`, about 1.4 MB; the
# H100 and the H200 are both sm_90). A fresh machine's first server otherwise compiles them
# while it captures its graphs: 60 s against 9 s for the next server on the H100 of
# ../results/h100-20261207d-d03009e. Both caches are keyed by kernel source and target, so an
# entry that does not match is recompiled, as without the archive. Absent, nothing changes.
if [ -f .gpu/jit-cache.tar.xz ] && [ ! -e "$HOME/.jit-cache-unpacked" ]; then
  tar -xJf .gpu/jit-cache.tar.xz -C "$HOME" && touch "$HOME/.jit-cache-unpacked"
fi
EAGLE_ARGS=(--speculative-draft-model-path "$DRAFT" --speculative-draft-load-format dummy)

# start_server NAME [extra server args...]: starts, waits for /health; returns 1 if it died.
start_server() {
  local name=$1; shift
  SERVER_NAME=$name
  python3 -m sglang.launch_server "${COMMON_ARGS[@]}" --log-level warning "$@" \
    > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  local t0=$SECONDS
  until curl -sf "$URL/health" >/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "{\"server\": \"$name\", \"up\": false}"; grep -v Capturing "$OUT/server_$name.log" | tail -30
      return 1
    fi
    sleep 2
  done
  echo "{\"server\": \"$name\", \"up\": true, \"start_s\": $((SECONDS - t0))}"
}

# closed_loop CONFIG C PROMPT OUTPUT REQUESTS FILE: one closed-loop point against $URL, REQUESTS
# requests of PROMPT tokens and OUTPUT tokens each, C in flight; its record (output_tok_s, ITL
# and TTFT percentiles, steps per mode) is appended to FILE. The plugin's own bench client,
# whose connector has no cap: the shared harness's .gpu/client.py uses aiohttp's default of 100
# connections, so its "C=128" points ran 100 requests at a time (the servers' logs of
# h100-20261206b-0043f33 show #running-req 100).
# The seed names the point, not the config: every server gets the same prompts. Within a
# point no two prompts share a first token (bench client.FirstTokens: a baseline's radix cache
# would serve it from the cache); two points on one server draw theirs at offsets derived from
# their seeds, so they seldom share one (one sweep over all points would never).
closed_loop() {
  python3 -m sglang_dynspec.bench sweep --url "$URL" --config "$1" --concurrency "$2" \
    --prompt-len "$3" --output-len "$4" --requests-per-point "$5" --repeats 1 --warmup 0 \
    --seed "c$2-p$3-o$4-n$5" \
    --no-progress --tag "hw=$HW_TAG" --out "$6"
}

# stop_server: stops the last server started; does nothing once it is stopped, or if none was.
stop_server() {
  [ -n "${SERVER_PID:-}" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=; sleep 2
}

# on_exit FUNCTION: runs FUNCTION on any exit of the script, a `timeout` included (it sends
# TERM to the whole group; the TERM trap turns that into an exit). A call returns at most 8
# files, so scripts pack their logs into one archive there, and a call that runs out of
# time still brings them back (on 2026-12-03 two calls ran past their limits before packing).
on_exit() {
  trap "$1" EXIT
  trap 'exit 124' TERM
}

# pack_server_logs [PATH...]: stops the server, packs $OUT/logs and the servers' logs into
# $OUT/logs.tar.xz, and removes PATHs (profiler traces: too large to bring back). For on_exit.
pack_server_logs() {
  stop_server
  mv "$OUT"/server_*.log "$OUT/logs/" 2> /dev/null
  [ -d "$OUT/logs" ] && tar -C "$OUT" -cJf "$OUT/logs.tar.xz" logs && rm -rf "$OUT/logs"
  [ $# -eq 0 ] || rm -rf "$@"
}
