#!/usr/bin/env bash
# run_colocated.sh - one decode_node with the prefill in-process (--colocated) on loopback.
# Prints the gRPC address and a pdspark-client command; runs until Ctrl-C.
# Environment: BUILD (build dir, default build), MODEL, DRAFT (checkpoint dirs, default the
# bundled tiny pair), LISTEN (default 127.0.0.1:0), DEVICE (cpu|cuda), CP_SIZE (in-process CP
# prefill ranks, default 1). Extra arguments go to decode_node (e.g. --kv-pages 2048).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MODEL=${MODEL:-models/tiny-code-qwen3}
DRAFT=${DRAFT:-models/tiny-code-dspark}
LISTEN=${LISTEN:-127.0.0.1:0}
DEVICE=${DEVICE:-cpu}
CP_SIZE=${CP_SIZE:-1}
cp_args=()
[ "$CP_SIZE" -gt 1 ] && cp_args=(--cp-size "$CP_SIZE")
"$BUILD/bin/decode_node" --model "$MODEL" --draft "$DRAFT" --listen "$LISTEN" --colocated \
  --device "$DEVICE" "${cp_args[@]}" "$@" | while IFS= read -r line; do
  echo "$line"
  case $line in
    "listening grpc "*)
      echo "try: $BUILD/bin/pdspark-client --server ${line#listening grpc } --prompt 'def fib(n):'" ;;
  esac
done
