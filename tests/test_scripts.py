#!/usr/bin/env python3
"""test_scripts - the measurement scripts of scripts/ on small made-up inputs.

Usage: test_scripts.py SCRIPTS_DIR
ktrace-summary (launch grouping, per-launch spans, the attention merge line, the layer period)
and ncu-kernel-sum (per-kernel sums, unit scaling, division by the forward count) print what
docs/BENCHMARKS.md quotes from them; each check compares their output with the values the input
was made to give."""
import csv
import os
import subprocess
import sys
import tempfile

FAILS = []


def check(ok, what):
    print('%s %s' % ('ok  ' if ok else 'FAIL', what))
    if not ok:
        FAILS.append(what)


def run(script, *args):
    p = subprocess.run([sys.executable, script] + [str(a) for a in args], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def ktrace_rows():
    """three layers of a plain linear launch (kind 10, 4 CTAs) 100 us apart, each followed by an
    attention launch (kind 31, 3 CTAs on 2 SMs, the third merging) that reuses its tag"""
    us = 1000
    rows = []
    for layer in range(3):
        t = 10 ** 12 + layer * 100 * us   # %globaltimer ns; 0 means "not recorded" in a mark
        for c in range(4):
            rows.append(dict(kind=10, tag='aa', cta=c, sm=c, t0=t, t1=t + 1 * us, t2=t + 10 * us + c * us,
                             x0=0, x1=0, x2=0))
        a = t + 20 * us
        rows.append(dict(kind=31, tag='bb', cta=0, sm=5, t0=a, t1=a + 2 * us, t2=a + 30 * us, x0=0, x1=0, x2=0))
        rows.append(dict(kind=31, tag='bb', cta=1, sm=5, t0=a, t1=a + 2 * us, t2=a + 31 * us, x0=0, x1=0, x2=0))
        rows.append(dict(kind=31, tag='bb', cta=2, sm=6, t0=a, t1=a + 2 * us, t2=a + 40 * us,
                         x2=a + 32 * us, x0=a + 34 * us, x1=a + 39 * us))
    return rows


def test_ktrace(scripts, tmp):
    path = os.path.join(tmp, 'tr.1.csv')
    with open(path, 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=['kind', 'tag', 'cta', 'sm', 't0', 't1', 't2', 'x0', 'x1', 'x2'])
        w.writeheader()
        for r in ktrace_rows():
            w.writerow(r)
    rc, out = run(os.path.join(scripts, 'ktrace-summary'), path)
    check(rc == 0, 'ktrace-summary runs (rc %d)' % rc)
    check('21 CTAs, 6 launches, 260.0 us' in out, 'ktrace-summary: CTAs, launches and the span')
    check('   0 linear        4    4      1  0.00..0.00        1.00..1.00        10.00..13.00' in out,
          'ktrace-summary: the first linear launch line')
    check('   1 attn          3    2      2  20.00..20.00      22.00..22.00      50.00..60.00' in out,
          'ktrace-summary: the attention launch (its tag reused every layer) split from the next')
    check('merge: 1 CTAs merged (the others end at 51.00); start 52.00, (max, sum) 2.00, items 5.00, '
          'then 1.00 to the end' in out, 'ktrace-summary: the merge line')
    check('layer period (ends of the 3 plain linear launches of 4 CTAs, the QKV projections): '
          'median 100.00 us' in out, 'ktrace-summary: the layer period')
    rc, out = run(os.path.join(scripts, 'ktrace-summary'), path, 2, 1)
    check(rc == 0 and '   2 linear' in out and '   1 attn' not in out and '   3 attn' not in out,
          'ktrace-summary FIRST COUNT selects launches')
    empty = os.path.join(tmp, 'empty.csv')
    with open(empty, 'w') as f:
        f.write('kind,tag,cta,sm,t0,t1,t2,x0,x1,x2\n')
    rc, out = run(os.path.join(scripts, 'ktrace-summary'), empty)
    check(rc != 0 and 'no records' in out, 'ktrace-summary: an empty trace is an error that says so')


def test_ncu(scripts, tmp):
    path = os.path.join(tmp, 'ncu.csv')
    hdr = ['ID', 'Kernel Name', 'Metric Name', 'Metric Unit', 'Metric Value']
    with open(path, 'w', newline='') as f:
        f.write('==PROF== Connected to process 1\n')   # ncu's own log lines are skipped
        w = csv.writer(f)
        w.writerow(hdr)
        w.writerow(['0', 'gemm_kernel', 'gpu__time_duration.sum', 'usecond', '1,500.0'])
        w.writerow(['1', 'attn_kernel', 'gpu__time_duration.sum', 'nsecond', '250000'])
        w.writerow(['2', 'gemm_kernel', 'gpu__time_duration.sum', 'msecond', '0.5'])
        w.writerow(['3', 'gemm_kernel', 'dram__throughput.avg.pct_of_peak_sustained_elapsed', '%', '80'])
    rc, out = run(os.path.join(scripts, 'ncu-kernel-sum'), path, 2)
    check(rc == 0, 'ncu-kernel-sum runs (rc %d)' % rc)
    lines = out.splitlines()
    check(len(lines) == 3 and lines[0].split() == ['1.00', 'ms', '1.0', 'launches', 'gemm_kernel'],
          'ncu-kernel-sum: a kernel\'s launches summed over units, halved for 2 forwards, largest first')
    check(len(lines) == 3 and lines[1].split() == ['0.12', 'ms', '0.5', 'launches', 'attn_kernel'],
          'ncu-kernel-sum: nanoseconds scaled')
    check(len(lines) == 3 and lines[2] == 'total 1.12 ms (divided by 2)', 'ncu-kernel-sum: the total')


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    scripts = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        test_ktrace(scripts, tmp)
        test_ncu(scripts, tmp)
    print('%d failed' % len(FAILS))
    sys.exit(1 if FAILS else 0)


if __name__ == '__main__':
    main()
