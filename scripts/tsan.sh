#!/usr/bin/env bash
# tsan.sh - a ThreadSanitizer run, by hand (not in CI: instrumented code is ~10x slower).
# Builds build-tsan (-DPD_TSAN=ON, no CUDA), runs the unit tests and tests/test_http.py's
# colocated part (the HTTP and engine threads through every HTTP feature; the other node kinds
# are left out for time) with UCX's memory hooks off (libucm's madvise hook crashes under
# TSan) and tests/tsan.supp (gRPC, abseil and UCX are not instrumented: their synchronisation is
# invisible to TSan). Every process writes its reports under $OUT (default /tmp/pd_tsan); the
# script fails when a test fails or any report was written.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
pd_install_deps
OUT=${OUT:-/tmp/pd_tsan}
rm -rf "$OUT" && mkdir -p "$OUT"
pd_build build-tsan -DPD_TSAN=ON -DPD_WITH_CUDA=OFF
export UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none OPENBLAS_NUM_THREADS=1
export TSAN_OPTIONS="halt_on_error=0 report_thread_leaks=0 history_size=7 suppressions=$PWD/tests/tsan.supp log_path=$OUT/report"
rc=0
(cd build-tsan && ctest --output-on-failure -j "$(nproc)" -L unit) || rc=1
PD_TEST_TIMEOUT_SCALE=10 PD_HTTP_EXTRA=0 python3 tests/test_http.py build-tsan/bin models > "$OUT/test_http.log" 2>&1 || {
  echo "tsan.sh: test_http failed (log: $OUT/test_http.log)"; rc=1; }
if ls "$OUT"/report.* >/dev/null 2>&1; then
  echo "tsan.sh: ThreadSanitizer reports:"
  grep -h "SUMMARY: ThreadSanitizer" "$OUT"/report.* | sort | uniq -c | sort -rn
  rc=1
else
  echo "tsan.sh: no ThreadSanitizer reports"
fi
exit $rc
