#!/usr/bin/env python3
"""test_e2e.py - both services as real processes on loopback (real gRPC, real UCX over tcp/shm).

Runs the 32 public prompts (input_ids, max_new_tokens 128, greedy) through pdspark-client, 8 at a
time, against (a) prefill_node (cp 2) + decode_node and (b) decode_node --colocated (and 8 of
them --colocated --cp-size 2, 8 in a pool of 64 KV pages that preempts), and checks that tokens,
text, rounds, accepted_per_round and tau equal pdspark-generate --prompt-ids (with --cp-size 2 for CP on a GPU). Then 8 of them through
the other drafter payloads (prefill_node --aux-transfer ctx and draft-kv, cp 2), and 8 through
draft-kv with host staging forced (target and draft pools staged), and 8 with --fast-kernels on
both nodes (equal on the cpu; on a GPU only complete answers are required). The staged run
takes 20 prompts at once into a staging pool of 16 prompts' pages (4 wait for staging pages,
then get the same tokens), cancels one whose Prefill is in flight (its staging pages stay held
until the prefill node's reply), and checks that --kv-staging-pages is refused by name when
bad.

usage: test_e2e.py BIN_DIR MODELS_DIR FIXTURES_DIR [colocated|disagg|aux|all]
PD_E2E_DEVICE=cuda runs every node and pdspark-generate with --device cuda (a GPU run by hand;
ctest runs the CPU).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

BIN, MODELS, FIX = sys.argv[1], sys.argv[2], sys.argv[3]
WHICH = sys.argv[4] if len(sys.argv) > 4 else "all"
TARGET = os.path.join(MODELS, "tiny-code-qwen3")
DRAFT = os.path.join(MODELS, "tiny-code-dspark")
ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", UCX_TLS=os.environ.get("UCX_TLS", "tcp,shm,self"))
DEV = ["--device", os.environ["PD_E2E_DEVICE"]] if os.environ.get("PD_E2E_DEVICE") else []
MAX_NEW = 128
CONCURRENCY = 8
COMPARE = ("tokens", "text", "rounds", "accepted_per_round", "tau", "prompt_tokens",
           "completion_tokens", "finish_reason")
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg, flush=True)


def start(args, name, timeout=60, env=None, http=False):
    """Start a node, return (proc, 'HOST:PORT') from its 'listening grpc' line (with http, also
    the 'listening http' line's address: (proc, grpc, http))."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=open(f"{TMP}/{name}.log", "w"),
                         env=dict(ENV, **(env or {})), text=True)
    t0 = time.time()
    grpc = None
    while time.time() - t0 < timeout:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("listening grpc "):
            grpc = line.split()[2]
            if not http:
                return p, grpc
        if line.startswith("listening http ") and grpc is not None:
            return p, grpc, line.split()[2]
    p.kill()
    with open(f"{TMP}/{name}.log") as f:   # the temporary directory goes with the exit
        tail = "".join(f.readlines()[-5:])
    raise SystemExit(f"{name} did not start; the end of its log:\n{tail}")


def stop(p):
    p.terminate()
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        failures.append("node did not stop within 30 s of SIGTERM")


def run_client(addr, ids_path):
    r = subprocess.run([f"{BIN}/pdspark-client", "--server", addr, "--prompt-ids", ids_path,
                        "--max-new-tokens", str(MAX_NEW), "--json", "--timeout-ms", "120000"],
                       capture_output=True, text=True, env=ENV, timeout=180)
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_ref(ids_path, extra=()):
    r = subprocess.run([f"{BIN}/pdspark-generate", "--model", TARGET, "--draft", DRAFT,
                        "--prompt-ids", ids_path, "--max-new-tokens", str(MAX_NEW), "--json"] + DEV +
                       list(extra),
                       capture_output=True, text=True, env=ENV, timeout=300)
    if r.returncode != 0:
        raise SystemExit("pdspark-generate failed: " + r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(mode, refs, outs, strict=True):
    """strict: every field of COMPARE equal; else (bf16 kernels that depend on the batch) every
    prompt answered, for the same prompt tokens, with at least one token; the identical ones
    counted either way"""
    same = 0
    for i, (ref, out) in enumerate(zip(refs, outs)):
        if "error" in out:
            check(False, f"{mode}: prompt {i}: {out['error']}")
            continue
        bad = [k for k in COMPARE if out.get(k) != ref.get(k)]
        if strict:
            check(not bad, f"{mode}: prompt {i}: differs from pdspark-generate in {bad}")
        else:
            check(out.get("completion_tokens", 0) > 0 and out.get("prompt_tokens") == ref.get("prompt_tokens"),
                  f"{mode}: prompt {i}: {out.get('completion_tokens')} tokens for {out.get('prompt_tokens')}")
        same += not bad
    taus = [o.get("tau", 0) for o in outs if "error" not in o]
    print(f"{mode}: {same}/{len(refs)} identical to pdspark-generate; mean tau "
          f"{sum(taus) / max(1, len(taus)):.4f}", flush=True)


def serve(mode, addr, paths, refs, strict=True):
    t0 = time.time()
    with ThreadPoolExecutor(CONCURRENCY) as ex:
        outs = list(ex.map(lambda p: run_client(addr, p), paths))
    dt = time.time() - t0
    toks = sum(o.get("completion_tokens", 0) for o in outs)
    print(f"{mode}: {len(paths)} prompts, {CONCURRENCY} at a time: {dt:.1f} s, {toks / dt:.1f} tokens/s",
          flush=True)
    compare(mode, refs, outs, strict)


def metrics(http):
    """The decode node's /metrics as {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, val = line.rpartition(" ")
            out[name] = float(val)
    return out


def wait_metrics(http, pred, timeout=30.0):
    """Poll /metrics until pred(m) holds; the last scrape either way."""
    t0 = time.time()
    while True:
        m = metrics(http)
        if pred(m) or time.time() - t0 > timeout:
            return m
        time.sleep(0.05)


STAGED = "pdspark_kv_staging_pages_used"


def health(addr):
    """The node's gRPC Health as pdspark-client --health prints it ({} when that fails)."""
    r = subprocess.run([f"{BIN}/pdspark-client", "--server", addr, "--health"], capture_output=True,
                       text=True, timeout=30, env=ENV)
    return json.loads(r.stdout) if r.returncode == 0 else {}
CANCELLED = 'pdspark_requests_total{outcome="cancelled"}'


def staged(paths, refs):
    """The host-staging path forced on host memory (what device KV takes without UCX CUDA
    support), draft-kv so that both pools are staged, with a staging pool smaller than the
    demand: 256 pages, the least the node takes (the longest prompt: 4095 tokens of 16-token
    pages), against 20 prompts of 256 tokens (16 pages each) at once. The prefill node is
    stopped while they are admitted, so exactly 16 hold staging pages and 4 wait in the queue;
    then all 20 must give pdspark-generate's tokens and every staging page must come back. Then
    a request cancelled while its Prefill is in flight (the prefill node stopped again): it
    ends at once for its caller, its staging pages stay held until the prefill node answers.
    gRPC Health reports the pool as /metrics does (pages used and total, waits).
    paths: 22 prompts (20 at once, the cancelled one, one after)."""
    env = {"PD_XFER_FORCE_STAGING": "1"}
    base = [f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen", "127.0.0.1:0"] + DEV
    # bad values, refused by name: not a count, fewer pages than the longest prompt, colocated
    for extra, code, needle in ((["--prefill", "127.0.0.1:1", "--kv-staging-pages", "0"], 2, "--kv-staging-pages"),
                                (["--prefill", "127.0.0.1:1", "--kv-staging-pages", "255"], 1,
                                 "--kv-staging-pages 255: the longest prompt this node admits (4095 tokens) needs 256"),
                                (["--colocated", "--kv-staging-pages", "300"], 2, "--kv-staging-pages")):
        r = subprocess.run(base + extra, capture_output=True, text=True, env=dict(ENV, **env), timeout=120)
        check(r.returncode == code and needle in r.stderr,
              f"decode_node {' '.join(extra)}: exit {r.returncode}, stderr {r.stderr.strip()[-300:]!r}")
    # --stage-memory of ~10 MB: the node's arena holds the staged pages of about 4 prompts at
    # once (~2.5 MB each on the cpu), the others stage into plain memory, so both kinds are put
    pn, paddr = start([f"{BIN}/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                       "127.0.0.1:0", "--aux-transfer", "draft-kv", "--stage-memory", "0.01"] + DEV,
                      "prefill_staged", env=env)
    stopped = False
    try:
        dn, addr, http = start(base + ["--prefill", paddr, "--kv-staging-pages", "256",
                                       "--transfer-timeout-ms", "30000", "--http", "127.0.0.1:0"],
                               "decode_staged", env=env, http=True)
        try:
            m = metrics(http)
            check(m.get("pdspark_kv_staging_pages_total") == 256 and m.get(STAGED) == 0,
                  f"staging pool at start: {m.get('pdspark_kv_staging_pages_total')} pages, {m.get(STAGED)} used")
            h = health(addr)
            check(h.get("staging_pages_total") == 256 and h.get("staging_pages_used") == 0 and
                  h.get("staging_waits") == 0, f"Health at start: {h}")
            n_at_once = len(paths) - 2
            t0 = time.time()
            pn.send_signal(signal.SIGSTOP)
            stopped = True
            with ThreadPoolExecutor(n_at_once) as ex:
                futs = [ex.submit(run_client, addr, p) for p in paths[:n_at_once]]
                m = wait_metrics(http, lambda m: m.get(STAGED) == 256 and m.get("pdspark_requests_queued") == 4)
                check(m.get(STAGED) == 256 and m.get("pdspark_requests_queued") == 4 and
                      m.get("pdspark_kv_staging_waits_total", 0) >= 1,
                      f"staging pool exhausted: {m.get(STAGED)} of 256 pages used, "
                      f"{m.get('pdspark_requests_queued')} queued, {m.get('pdspark_kv_staging_waits_total')} waited")
                h = health(addr)   # the prefill node is still stopped: nothing moved since
                check(h.get("staging_pages_total") == 256 and h.get("staging_pages_used") == 256 and
                      h.get("queued_requests") == 4 and
                      h.get("staging_waits") == m.get("pdspark_kv_staging_waits_total"),
                      f"Health with the staging pool exhausted: {h}, /metrics "
                      f"{m.get('pdspark_kv_staging_waits_total')} waits")
                pn.send_signal(signal.SIGCONT)
                stopped = False
                outs = [f.result() for f in futs]
            print(f"staged: {n_at_once} prompts at once through 256 staging pages: {time.time() - t0:.1f} s",
                  flush=True)
            compare("disaggregated (aux draft-kv, host staging of 256 pages)", refs[:n_at_once], outs)
            m = wait_metrics(http, lambda m: m.get(STAGED) == 0 and m.get("pdspark_kv_pages_used") == 0)
            check(m.get(STAGED) == 0 and m.get("pdspark_kv_pages_used") == 0,
                  f"after the staged run: {m.get(STAGED)} staging pages, {m.get('pdspark_kv_pages_used')} kv pages used")
            h = health(addr)
            check(h.get("staging_pages_total") == 256 and h.get("staging_pages_used") == 0 and
                  h.get("staging_waits", 0) >= 1, f"Health after the staged run: {h}")
            # a cancel while the Prefill is in flight (the prefill node stopped: no reply yet)
            cancelled0 = m.get(CANCELLED, 0)
            pn.send_signal(signal.SIGSTOP)
            stopped = True
            c = subprocess.Popen([f"{BIN}/pdspark-client", "--server", addr, "--prompt-ids", paths[-2],
                                  "--max-new-tokens", "8"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=ENV)
            m = wait_metrics(http, lambda m: m.get(STAGED) == 16)
            check(m.get(STAGED) == 16, f"cancel: its Prefill holds {m.get(STAGED)} staging pages, not 16")
            c.kill()
            c.wait()
            m = wait_metrics(http, lambda m: m.get(CANCELLED, 0) > cancelled0)
            check(m.get(CANCELLED, 0) == cancelled0 + 1, f"cancel: {m.get(CANCELLED)} cancelled, {cancelled0} before")
            time.sleep(0.5)
            m = metrics(http)
            check(m.get(STAGED) == 16 and m.get("pdspark_kv_pages_used", 0) > 0,
                  f"cancelled, no reply yet: {m.get(STAGED)} staging pages held (16 expected), "
                  f"{m.get('pdspark_kv_pages_used')} kv pages")
            pn.send_signal(signal.SIGCONT)
            stopped = False
            m = wait_metrics(http, lambda m: m.get(STAGED) == 0 and m.get("pdspark_kv_pages_used") == 0)
            check(m.get(STAGED) == 0 and m.get("pdspark_kv_pages_used") == 0,
                  f"after the reply: {m.get(STAGED)} staging pages, {m.get('pdspark_kv_pages_used')} kv pages used")
            # and the pair serves on
            compare("disaggregated (host staging, after a cancel)", refs[-1:], [run_client(addr, paths[-1])])
        finally:
            if stopped:
                pn.send_signal(signal.SIGCONT)
            stop(dn)
    finally:
        stop(pn)


def disagg(prefill_args, env, mode, name, paths, refs, decode_args=(), strict=True):
    """prefill_node (with prefill_args) + decode_node (with decode_args), both with env; serve
    paths."""
    pn, paddr = start([f"{BIN}/prefill_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                       "127.0.0.1:0"] + DEV + prefill_args, name, env=env)
    try:
        dn, addr = start([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT,
                          "--listen", "127.0.0.1:0", "--prefill", paddr] + DEV + list(decode_args),
                         "decode_" + name, env=env)
        try:
            serve(mode, addr, paths, refs, strict)
        finally:
            stop(dn)
    finally:
        stop(pn)


def main():
    prompts = [json.loads(l) for l in open(os.path.join(FIX, "eval", "public_prompts.jsonl"))]
    paths = []
    for i, p in enumerate(prompts):
        path = f"{TMP}/p{i:02d}.ids"
        with open(path, "w") as f:
            f.write(" ".join(map(str, p["input_ids"])))
        paths.append(path)
    if WHICH == "aux":
        paths = paths[:22]
    t0 = time.time()
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as ex:
        refs = list(ex.map(run_ref, paths))
    print(f"references: {len(refs)} prompts with pdspark-generate in {time.time() - t0:.1f} s", flush=True)
    # CP prefill: on the cpu every path is exact, so cp 2 equals cp 1. On a GPU the ranks' row
    # counts take other kernels than one rank's (bf16 rounding), so the nodes' cp 2 is held to
    # pdspark-generate --cp-size 2 (one prompt per forward in both: the same pieces, the same
    # bits), and that to cp 1 by acceptance
    refs_cp = refs
    if DEV and WHICH in ("colocated", "disagg", "aux", "all"):
        with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as ex:
            refs_cp = list(ex.map(lambda p: run_ref(p, ["--cp-size", "2"]), paths))
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(refs, refs_cp))
        tau1 = sum(r["tau"] for r in refs) / len(refs)
        tau2 = sum(r["tau"] for r in refs_cp) / len(refs_cp)
        print(f"pdspark-generate cp 2: {same}/{len(refs)} token-identical to cp 1; mean tau {tau2:.4f} "
              f"(cp 1 {tau1:.4f})", flush=True)
        check(abs(tau2 - tau1) <= 0.05 * tau1, f"pdspark-generate cp 2: mean tau {tau2:.4f} vs cp 1 {tau1:.4f}")

    if WHICH in ("colocated", "all"):
        dn, addr = start([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                          "127.0.0.1:0", "--colocated"] + DEV, "decode_colocated")
        try:
            serve("colocated", addr, paths, refs)
            # Health's preemption fields (default --swap-space 4): nothing preempted here; on a
            # GPU the swap space's first 256 MiB chunk is pinned at start, on the cpu no arena
            h = health(addr)
            held = 256 << 20 if DEV else 0
            check(h.get("preemptions") == 0 and h.get("swapped_requests") == 0 and h.get("swap_bytes") == 0 and
                  h.get("swap_space_held_bytes") == held, f"Health after the colocated run: {h} (held {held})")
        finally:
            stop(dn)
        # preemption: 8 prompts at once in a pool of 64 pages (each answer needs 25: 256 + 128
        # tokens and a block), so requests are admitted with their prompts' pages and the pool
        # runs out as they grow; the ones preempted wait with their KV in host memory (the
        # pinned swap arena on a GPU) and resume, and every answer must be pdspark-generate's
        dn, addr = start([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                          "127.0.0.1:0", "--colocated", "--kv-pages", "64"] + DEV, "decode_preempt")
        try:
            serve("colocated (64 KV pages, preemption)", addr, paths[:8], refs[:8])
            h = health(addr)
            check(h.get("preemptions", 0) >= 1 and h.get("swapped_requests") == 0 and h.get("swap_bytes") == 0 and
                  h.get("free_kv_pages") == 64, f"Health after the preemption run: {h}")
            print(f"preemption: {h.get('preemptions')} preemptions, every request resumed", flush=True)
        finally:
            stop(dn)
        # the in-process prefill context-parallel over 2 ranks; 8 prompts (CI time)
        dn, addr = start([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                          "127.0.0.1:0", "--colocated", "--cp-size", "2"] + DEV, "decode_colocated_cp")
        try:
            serve("colocated (cp 2)", addr, paths[:8], refs_cp[:8])
        finally:
            stop(dn)
        if DEV:
            # the KV pool sized from the GPU's free memory (--kv-memory-fraction): far more pages
            # than the default (two contexts + 64), the same tokens; 8 prompts
            dn, addr = start([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                              "127.0.0.1:0", "--colocated", "--kv-memory-fraction", "0.2"] + DEV, "decode_kvfrac")
            try:
                r = subprocess.run([f"{BIN}/pdspark-client", "--server", addr, "--health"], capture_output=True,
                                   text=True, timeout=30)
                h = json.loads(r.stdout) if r.returncode == 0 else {}
                print(f"colocated --kv-memory-fraction 0.2: {h.get('total_kv_pages')} KV pages", flush=True)
                check(h.get("total_kv_pages", 0) > 4096 // 16 * 2 + 64, f"--kv-memory-fraction 0.2: health {h}")
                serve("colocated (--kv-memory-fraction 0.2)", addr, paths[:8], refs[:8])
            finally:
                stop(dn)
            # with cp 2 the ranks' pools on the GPU share the fraction: fewer pages than one
            # rank's, still far more than the default; the cp 2 tokens
            dn, addr = start([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                              "127.0.0.1:0", "--colocated", "--cp-size", "2", "--kv-memory-fraction", "0.2"] + DEV,
                             "decode_kvfrac_cp")
            try:
                r = subprocess.run([f"{BIN}/pdspark-client", "--server", addr, "--health"], capture_output=True,
                                   text=True, timeout=30)
                h2 = json.loads(r.stdout) if r.returncode == 0 else {}
                print(f"colocated --cp-size 2 --kv-memory-fraction 0.2: {h2.get('total_kv_pages')} KV pages",
                      flush=True)
                check(4096 // 16 * 2 + 64 < h2.get("total_kv_pages", 0) < h.get("total_kv_pages", 0),
                      f"--cp-size 2 --kv-memory-fraction 0.2: health {h2} (one rank: {h.get('total_kv_pages')})")
                serve("colocated (cp 2, --kv-memory-fraction 0.2)", addr, paths[:8], refs_cp[:8])
            finally:
                stop(dn)
        else:
            # on the cpu the fraction is of the host's available memory; with --tp 2 every
            # rank's pools (each a shard of the target's KV heads and a whole drafter's) share
            # it, sized once the shards are built; both serve the same tokens
            for extra, ps, rs in (([], paths[:4], refs[:4]), (["--tp", "2"], paths[:2], refs[:2])):
                dn, addr = start([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                                  "127.0.0.1:0", "--colocated", "--kv-memory-fraction", "0.02"] + extra,
                                 "decode_kvfrac_cpu" + "".join(extra).replace("-", ""))
                try:
                    h = health(addr)
                    print(f"colocated --kv-memory-fraction 0.02{''.join(' ' + a for a in extra)} on the cpu: "
                          f"{h.get('total_kv_pages')} KV pages", flush=True)
                    check(h.get("total_kv_pages", 0) >= 64, f"--kv-memory-fraction 0.02 {extra}: health {h}")
                    serve(f"colocated (--kv-memory-fraction 0.02{''.join(' ' + a for a in extra)}, cpu)", addr, ps, rs)
                finally:
                    stop(dn)
            # refused by name: pages and a fraction both
            r = subprocess.run([f"{BIN}/decode_node", "--model", TARGET, "--draft", DRAFT, "--listen",
                                "127.0.0.1:0", "--colocated", "--kv-memory-fraction", "0.2", "--kv-pages", "100"],
                               capture_output=True, text=True, env=ENV, timeout=120)
            check(r.returncode != 0 and "not both" in r.stderr,
                  f"--kv-memory-fraction with --kv-pages: exit {r.returncode}, stderr {r.stderr.strip()[-300:]!r}")
    # CP prefill in a node: ranks as threads; on a GPU rank r runs on GPU r % (visible GPUs)
    # with its own copy of the target (one GPU: both ranks on it, the local communicator)
    if WHICH in ("disagg", "all"):
        disagg(["--cp-size", "2"], {}, "disaggregated (prefill cp 2)", "prefill_cp", paths, refs_cp)
    if WHICH in ("disagg", "aux", "all"):
        # the drafter payloads other than raw: context rows, and the draft's context K/V pages
        # put into the decode node's draft pool; 8 prompts each (CI time)
        for aux in ("ctx", "draft-kv"):
            disagg(["--cp-size", "2", "--aux-transfer", aux], {},
                   f"disaggregated (aux {aux}, prefill cp 2)", f"prefill_{aux}", paths[:8], refs_cp[:8])
        # the host-staging path (what device KV memory takes without UCX CUDA support), forced
        # on host memory: the prefill node downloads pages before the puts, the decode node
        # receives them in its staging pool (target and draft layout) and uploads them; 20
        # prompts at once into a pool of 16 prompts' pages, a cancel, bad flag values
        staged(paths[:22], refs[:22])
    if WHICH in ("disagg", "all"):
        # both nodes with the fastest kernels (prompts batched into one prefill forward): on the
        # cpu every kernel is exact, so the tokens still equal pdspark-generate's; on a GPU bf16
        # results depend on the batch, so only complete answers are required there; 8 prompts
        disagg(["--fast-kernels"], {}, "disaggregated (--fast-kernels)", "prefill_fast", paths[16:24],
               refs[16:24], decode_args=["--fast-kernels"], strict=not DEV)
    if failures:
        print(f"{len(failures)} failure(s); logs in {TMP}")
        sys.exit(1)
    print("all e2e checks passed")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="pd_e2e_") as TMP:
        main()
