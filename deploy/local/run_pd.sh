#!/usr/bin/env bash
# run_pd.sh - the disaggregated pair on loopback: a prefill_node with context-parallel prefill
# (cp 2, ranks as threads on the CPU) and a decode_node that sends it Prefill and receives the KV
# pages + aux rows over UCX (tcp/shm). Both pick free ports; prints the decode node's gRPC address
# and a pdspark-client command; runs until Ctrl-C, then stops both.
# Environment: BUILD (default build), MODEL, DRAFT (default the bundled tiny pair), CP_SIZE
# (default 2), CP_STRATEGY (default: the engine's), DEVICE (cpu), UCX_TLS (default tcp,shm,self).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MODEL=${MODEL:-models/tiny-code-qwen3}
DRAFT=${DRAFT:-models/tiny-code-dspark}
CP_SIZE=${CP_SIZE:-2}
DEVICE=${DEVICE:-cpu}
export UCX_TLS=${UCX_TLS:-tcp,shm,self}
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT INT TERM
wait_addr() {   # $1 = stdout file, $2 = pid; prints HOST:PORT (bounded: 60 s)
  for _ in $(seq 600); do
    a=$(awk '/^listening grpc /{print $3; exit}' "$1")
    [ -n "$a" ] && { echo "$a"; return 0; }
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
strategy=()
[ -n "${CP_STRATEGY:-}" ] && strategy=(--cp-strategy "$CP_STRATEGY")
"$BUILD/bin/prefill_node" --model "$MODEL" --draft "$DRAFT" --listen 127.0.0.1:0 \
  --cp-size "$CP_SIZE" "${strategy[@]}" --device "$DEVICE" >"$tmp/prefill.out" &
pids+=($!)
paddr=$(wait_addr "$tmp/prefill.out" "${pids[0]}") || { echo "prefill_node did not start" >&2; exit 1; }
echo "prefill_node (cp $CP_SIZE) listening on $paddr"
"$BUILD/bin/decode_node" --model "$MODEL" --draft "$DRAFT" --listen 127.0.0.1:0 \
  --prefill "$paddr" --device "$DEVICE" "$@" >"$tmp/decode.out" &
pids+=($!)
daddr=$(wait_addr "$tmp/decode.out" "${pids[1]}") || { echo "decode_node did not start" >&2; exit 1; }
echo "decode_node listening on $daddr"
echo "try: $BUILD/bin/pdspark-client --server $daddr --prompt 'def fib(n):'"
wait -n "${pids[@]}" || true
