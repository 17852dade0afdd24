#!/bin/bash
# h26-attn-load (batched page loads, pow2 pages, coop P split once) against 02268b1: bits, kernel and step A/B
# The bundle (built here, not tracked): o_test_kernels / o_bench = main's test_kernels / pdspark-bench
# (kernels of 02268b1), the rest this branch's build-dev:
#   X=z; rm -rf devbundle/$X && mkdir -p devbundle/$X/bin
#   cp build-dev/bin/{test_kernels,pdspark-bench,test_golden,test_eval} OLD/{o_test_kernels,o_bench} devbundle/$X/bin/
#   strip devbundle/$X/bin/* && bash ../shared/tools/device-bundle.sh devbundle/$X devbundle/$X
#   (cd devbundle/$X && tar cf - bin lib | xz -T1 --lzma2=preset=6,dict=192MiB > ../../devcarry/$X.tar.xz)
# then run(command="bash devcarry/runZ.sh", carry=["devcarry/z.tar.xz", "devcarry/runZ.sh"]), ~130 s

set -u
[ -e /work/main ] || { mkdir -p /work && ln -s "$PWD" /work/main; }
mkdir -p /tmp/z && tar xJf devcarry/z.tar.xz -C /tmp/z
export LD_LIBRARY_PATH=/tmp/z/lib:${LD_LIBRARY_PATH:-}
B=/tmp/z/bin; O=/tmp/r; mkdir -p $O
T() { date -u +%H:%M:%S >> $O/t0.txt; tar cf $OUT/r.tar -C /tmp r; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/gpu.txt
T
for k in o_test_kernels test_kernels o_test_kernels test_kernels; do echo "== $k"; for c in "*d:1023" "*v:1016"; do timeout 60 $B/$k --op attn --perf-only --invariant --case "$c" 2>&1 | grep -E "attn:|perf:"; done; done > $O/perf.txt
T
for v in 0 1 0 1; do echo "== PD_ATTN_COOP2=$v"; PD_ATTN_COOP2=$v timeout 60 $B/test_kernels --op attn --perf-only --invariant --case "*v:1016" 2>&1 | grep -E "attn:|perf:"; done > $O/perf_c2.txt
PD_ATTN_COOP2=1 timeout 90 $B/test_kernels --op attn --invariant > $O/k_attn_c2.txt 2>&1; echo "rc $?" >> $O/k_attn_c2.txt
for v in 0 1 0 1; do echo "== PD_ATTN_KV_EF=$v"; for c in "*d:1023" "*v:1016"; do PD_ATTN_KV_EF=$v timeout 60 $B/test_kernels --op attn --perf-only --invariant --case "$c" 2>&1 | grep -E "attn:|perf:"; done; done > $O/perf_ef.txt
T
timeout 90 $B/test_kernels --op attn --invariant > $O/k_attn.txt 2>&1; echo "rc $?" >> $O/k_attn.txt
timeout 60 $B/test_kernels --op attn_block --invariant > $O/k_ab.txt 2>&1; echo "rc $?" >> $O/k_ab.txt
timeout 150 $B/test_kernels --op invariance > $O/k_inv.txt 2>&1; echo "rc $?" >> $O/k_inv.txt
timeout 60 $B/test_golden --backend cuda > $O/golden.txt 2>&1; echo "rc $?" >> $O/golden.txt
timeout 120 $B/test_eval --backend cuda --ref bf16 --draft vanilla > $O/eval.txt 2>&1; echo "rc $?" >> $O/eval.txt
T
P="--synthetic qwen3-4b --batch 1 --verify 8 --skip prefill,e2e --iters 20 --invariant 1"
for k in o_bench pdspark-bench o_bench pdspark-bench; do echo "== $k"; timeout 40 $B/$k $P 2>&1 | grep -E "^  "; T; done > $O/b1.txt
P="--synthetic qwen3-4b --batch 16,64 --verify 8 --skip prefill,e2e --iters 10 --invariant 1"
for k in o_bench pdspark-bench; do echo "== $k"; timeout 90 $B/$k $P 2>&1 | grep -E "graph|chain"; T; done > $O/bench.txt
T
T
