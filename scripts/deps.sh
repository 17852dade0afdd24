#!/usr/bin/env bash
# deps.sh - installs the Debian packages pdspark needs when they are missing (idempotent,
# non-interactive), and puts the CUDA toolkit on PATH when it is installed.
# Sourced by quickstart.sh and test.sh; safe to run on its own.
PD_DEB_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libopenblas-dev libcjson-dev libpcre2-dev libutf8proc-dev
  libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
  libucx-dev ucx-utils libevent-dev libssl-dev
  curl python3 python3-yaml
)
# node and npm only serve the tokenizer comparison test; a machine may have them from
# elsewhere (e.g. NodeSource), where Debian's npm package would conflict.
PD_DEB_IF_NO_COMMAND=(node:nodejs npm:npm)

pd_install_deps() {
  local missing=()
  for p in "${PD_DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  for pair in "${PD_DEB_IF_NO_COMMAND[@]}"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
}

# Configures and builds into $1 (default build/) with any extra CMake arguments.
pd_build() {
  local dir=${1:-build}
  shift || true
  cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
  cmake --build "$dir" -j "$(nproc)"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  pd_install_deps
fi
