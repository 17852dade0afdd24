#!/usr/bin/env bash
# quickstart.sh - installs what is missing, builds, and runs DSpark speculative decoding on the
# bundled tiny Qwen3 target + DSpark draft, streaming the completion and printing tau and
# tokens/s. Extra arguments go to the generate command (e.g. --device cuda, --temperature 0.8).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
pd_install_deps
pd_build build
prompt=${PDSPARK_PROMPT:-'import numpy as np


def softmax(x):
    """Compute the softmax of x."""
'}
echo "== prompt =="
printf '%s' "$prompt"
echo
echo "== completion (streamed) =="
./build/bin/pdspark-generate --model models/tiny-code-qwen3 --draft models/tiny-code-dspark \
  --prompt "$prompt" --max-new-tokens 128 --stream "$@"
echo "== stats =="
./build/bin/pdspark-generate --model models/tiny-code-qwen3 --draft models/tiny-code-dspark \
  --prompt "$prompt" --max-new-tokens 128 --json "$@" | python3 -c '
import json, sys
o = json.load(sys.stdin)
o["pos"] = " ".join("%.2f" % a for a in o["acceptance_by_position"])
print("prompt tokens {prompt_tokens}, generated {completion_tokens} ({finish_reason})".format(**o))
print("rounds {rounds}, tau {tau:.3f} accepted tokens per round (incl. the bonus token)".format(**o))
print("acceptance by draft position: {pos}".format(**o))
print("{tokens_per_s:.1f} tokens/s, {time_ms:.1f} ms on {device} ({mode})".format(**o))
'
