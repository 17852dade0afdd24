#!/usr/bin/env bash
# quickstart.sh - installs what is missing, builds, starts the co-located decode_node on the
# bundled tiny Qwen3 target + DSpark draft (port 0: the script reads the printed address),
# streams one completion through pdspark-client, prints tau and tokens/s, and stops the server.
# If the server cannot start (e.g. a build without the net libraries), it says so and falls back
# to offline generation with pdspark-generate. Extra arguments go to pdspark-client (e.g.
# --temperature 0.8 --seed 1); PDSPARK_DEVICE=cuda runs the server on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
pd_install_deps
pd_build build
prompt=${PDSPARK_PROMPT:-'import numpy as np


def softmax(x):
    """Compute the softmax of x."""
'}
device=${PDSPARK_DEVICE:-cpu}
models=models
print_stats() {
  python3 -c '
import json, sys
o = json.loads(sys.stdin.read().strip().splitlines()[-1])
o["pos"] = " ".join("%.2f" % a for a in o["acceptance_by_position"])
print("prompt tokens {prompt_tokens}, generated {completion_tokens} ({finish_reason})".format(**o))
print("rounds {rounds}, tau {tau:.3f} accepted tokens per round (incl. the bonus token)".format(**o))
print("acceptance by draft position: {pos}".format(**o))
print("{tokens_per_s:.1f} tokens/s, {time_ms:.1f} ms (ttft {ttft_ms:.1f} ms) on {device} ({mode})".format(**o))
'
}

echo "== prompt =="
printf '%s' "$prompt"
echo

addr=""
if [ -x build/bin/decode_node ] && [ -x build/bin/pdspark-client ]; then
  tmp=$(mktemp -d)
  build/bin/decode_node --model $models/tiny-code-qwen3 --draft $models/tiny-code-dspark \
    --listen 127.0.0.1:0 --colocated --device "$device" >"$tmp/out" 2>"$tmp/log" &
  server=$!
  trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -rf "$tmp"' EXIT
  for _ in $(seq 300); do   # up to 30 s for the models to load
    addr=$(awk '/^listening grpc /{print $3; exit}' "$tmp/out")
    [ -n "$addr" ] && break
    kill -0 $server 2>/dev/null || break
    sleep 0.1
  done
fi

if [ -n "$addr" ]; then
  echo "== decode_node --colocated listening on $addr =="
  echo "== completion (streamed through pdspark-client) =="
  build/bin/pdspark-client --server "$addr" --prompt "$prompt" --max-new-tokens 128 "$@"
  echo "== stats =="
  build/bin/pdspark-client --server "$addr" --prompt "$prompt" --max-new-tokens 128 --json "$@" \
    | print_stats
  kill $server
  wait $server || true
  echo "== server stopped =="
else
  echo "!! the co-located decode_node did not start; falling back to offline pdspark-generate" >&2
  [ -n "${tmp:-}" ] && [ -s "$tmp/log" ] && tail -5 "$tmp/log" >&2
  echo "== completion (streamed, offline) =="
  build/bin/pdspark-generate --model $models/tiny-code-qwen3 --draft $models/tiny-code-dspark \
    --prompt "$prompt" --max-new-tokens 128 --stream --device "$device" "$@"
  echo "== stats =="
  build/bin/pdspark-generate --model $models/tiny-code-qwen3 --draft $models/tiny-code-dspark \
    --prompt "$prompt" --max-new-tokens 128 --json --device "$device" "$@" | print_stats
fi
