#!/usr/bin/env python3
"""test_deploy.py - deploy/k8s and deploy/docker against the binaries, without a cluster.

For each manifest: every Deployment's container runs one of our nodes, its --listen/--http ports
are the container ports its probes and Services name, the probe paths are ones the node serves,
the grace period outlasts --drain-timeout-ms, every Service selects a Deployment, and the
decode node's --prefill names the prefill Service's gRPC port. Then the command lines run here
(the /models paths pointed at the repo's models, the ports at free ones, --prefill at the local
prefill node): each node starts, its startup/readiness/liveness paths answer 200, a completion
goes through the Service's HTTP port, and SIGTERM ends it with exit 0 within the grace period.
The Dockerfile: the files it copies exist, the targets it builds are CMake targets, and its
runtime packages exist in this Debian's archive (when apt-cache is here).
Usage: test_deploy.py BIN_DIR MODELS_DIR REPO_DIR
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

try:
    import yaml
except ImportError:
    print("SKIPPED: python3-yaml is not installed")
    sys.exit(77)

BIN, MODELS, REPO = sys.argv[1], sys.argv[2], sys.argv[3]
K8S = os.path.join(REPO, "deploy", "k8s")
FAILS = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILS.append(what)
    return cond


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def port_of(addr):
    return int(addr.rsplit(":", 1)[1])


# ---- static checks -------------------------------------------------------------------------

def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def container_of(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]


def static_checks(name, docs):
    deps = [d for d in docs if d["kind"] == "Deployment"]
    svcs = [d for d in docs if d["kind"] == "Service"]
    check(deps and svcs, "%s: Deployments and Services" % name)
    for dep in deps:
        dn = "%s/%s" % (name, dep["metadata"]["name"])
        tpl = dep["spec"]["template"]
        check(len(tpl["spec"]["containers"]) == 1, "%s: one container" % dn)
        check(dep["spec"]["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items(),
              "%s: selector matches the pod labels" % dn)
        c = container_of(dep)
        binary, args = c["command"][0], c.get("args", [])
        check(binary in ("decode_node", "prefill_node"), "%s: runs %s" % (dn, binary))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        check(port_of(flag(args, "--listen")) == ports.get("grpc"), "%s: --listen is the grpc port" % dn)
        check(port_of(flag(args, "--http")) == ports.get("http"), "%s: --http is the http port" % dn)
        for probe, path in (("startupProbe", "/health"), ("readinessProbe", "/ready"),
                            ("livenessProbe", "/health")):
            g = c.get(probe, {}).get("httpGet", {})
            check(g.get("path") == path and g.get("port") in ports, "%s: %s GET %s on a named port" % (dn, probe, path))
        grace = tpl["spec"].get("terminationGracePeriodSeconds", 30)
        drain = int(flag(args, "--drain-timeout-ms") or 30000)
        check(grace * 1000 >= drain + 5000, "%s: grace %d s outlasts the %d ms drain" % (dn, grace, drain))
    for svc in svcs:
        sn = "%s/svc %s" % (name, svc["metadata"]["name"])
        sel = svc["spec"]["selector"]
        match = [d for d in deps if sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        check(len(match) == 1, "%s: selects one Deployment" % sn)
        if match:
            names = {p["name"] for p in container_of(match[0])["ports"]}
            check(all(p["targetPort"] in names for p in svc["spec"]["ports"]), "%s: target ports exist" % sn)
    for dep in deps:
        args = container_of(dep).get("args", [])
        pf = flag(args, "--prefill")
        if pf is None:
            continue
        host, port = pf.rsplit(":", 1)
        svc = [s for s in svcs if s["metadata"]["name"] == host]
        check(len(svc) == 1 and svc[0]["spec"].get("clusterIP") == "None",
              "%s: --prefill names a headless Service (every prefill pod's address)" % name)
        if svc:
            check(int(port) in [p["port"] for p in svc[0]["spec"]["ports"] if p["name"] == "grpc"],
                  "%s: --prefill port is the prefill Service's grpc port" % name)
    return deps, svcs


# ---- the command lines, run here -------------------------------------------------------------

class Node:
    def __init__(self, c, subst):
        args = []
        for a in c.get("args", []):
            a = a.replace("/models", MODELS)
            a = re.sub(r"^0\.0\.0\.0:\d+$", "127.0.0.1:0", a)
            args.append(subst.get(a, a))
        env = dict(os.environ)
        env.update({e["name"]: e["value"] for e in c.get("env", [])})
        self.c = c
        self.log = open(os.path.join(TMP, "%s.err" % c["name"]), "w")
        self.p = subprocess.Popen([os.path.join(BIN, c["command"][0])] + args, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, env=env)
        self.grpc = self.http = None
        end = time.time() + 120
        while time.time() < end and (self.grpc is None or self.http is None):
            line = self.p.stdout.readline()
            if not line:
                break
            m = re.match(r"listening (grpc|http) (\S+)", line)
            if m:
                setattr(self, m.group(1), m.group(2))

    def get(self, path):
        try:
            with urllib.request.urlopen("http://%s%s" % (self.http, path), timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""
        except OSError:
            return None, b""

    def probes_ok(self):
        """every probe's path answers 200 (readiness within 60 s)"""
        ok = True
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = self.c[probe]["httpGet"]["path"]
            end = time.time() + 60
            st = self.get(path)[0]
            while st != 200 and time.time() < end:
                time.sleep(0.2)
                st = self.get(path)[0]
            ok &= check(st == 200, "%s: %s %s -> %s" % (self.c["name"], probe, path, st))
        return ok

    def stop(self, grace):
        self.p.send_signal(signal.SIGTERM)
        try:
            rc = self.p.wait(grace)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = None
        self.log.close()
        return rc


def run_manifest(name, deps):
    by_role = {container_of(d)["command"][0]: d for d in deps}
    nodes = []
    try:
        subst = {}
        if "prefill_node" in by_role:
            pc = container_of(by_role["prefill_node"])
            pn = Node(pc, {})
            nodes.append((pn, by_role["prefill_node"]))
            if not check(pn.grpc and pn.http, "%s: prefill_node started (%s, %s)" % (name, pn.grpc, pn.http)):
                return
            pn.probes_ok()
            subst[flag(container_of(by_role["decode_node"])["args"], "--prefill")] = pn.grpc
        dn = Node(container_of(by_role["decode_node"]), subst)
        nodes.append((dn, by_role["decode_node"]))
        if not check(dn.grpc and dn.http, "%s: decode_node started (%s, %s)" % (name, dn.grpc, dn.http)):
            return
        dn.probes_ok()
        body = json.dumps({"prompt": "def fib(n):", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request("http://%s/v1/completions" % dn.http, data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.loads(r.read())
            check(out["usage"]["completion_tokens"] == 8, "%s: a completion through the http port" % name)
        except OSError as e:
            check(False, "%s: completion: %s" % (name, e))
    finally:
        for node, dep in reversed(nodes):
            grace = dep["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            rc = node.stop(grace)
            check(rc == 0, "%s: %s exits 0 on SIGTERM within %d s (rc %s)" % (name, node.c["name"], grace, rc))


# ---- Dockerfile ------------------------------------------------------------------------------

def dockerfile_checks():
    path = os.path.join(REPO, "deploy", "docker", "Dockerfile")
    text = open(path).read()
    for src in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
        if src != ".":
            check(os.path.exists(os.path.join(REPO, src)), "Dockerfile: COPY %s exists" % src)
    cmake = "".join(open(os.path.join(REPO, d, "CMakeLists.txt")).read() for d in ("decode_node", "prefill_node"))
    for t in re.search(r"--target ([^&]+)&&", text).group(1).split():
        check(re.search(r"add_executable\(%s\b" % re.escape(t), cmake) is not None,
              "Dockerfile: %s is a CMake target" % t)
    for b in re.findall(r"/src/build/bin/(\S+)", text):
        check(os.path.exists(os.path.join(BIN, b)), "Dockerfile: %s is built here too" % b)
    pkgs = re.search(r"--no-install-recommends \\\n(.*?)&&", text, re.S).group(1).split()
    pkgs = [p for p in pkgs if p != "\\"]
    if shutil.which("apt-cache"):
        for p in pkgs:
            r = subprocess.run(["apt-cache", "show", p], capture_output=True)
            check(r.returncode == 0, "Dockerfile: runtime package %s is in the archive" % p)
    else:
        print("apt-cache not here: the runtime package names are not checked")
    # every library the nodes link directly comes from those packages or from the base image
    # (libraries dpkg does not know, e.g. the CUDA toolkit's in a CUDA build, are the base's)
    if shutil.which("dpkg") and shutil.which("readelf") and shutil.which("ldconfig"):
        paths = {}
        for line in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.splitlines():
            m = re.match(r"\s+(\S+) \(([^)]*)\) => (\S+)", line)
            if m and "x86-64" in m.group(2):
                paths.setdefault(m.group(1), m.group(3))
        base = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g"}
        # the packages those pull in (a build without --as-needed links some of them directly)
        if shutil.which("apt-cache"):
            r = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
                                "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances"] + pkgs,
                               capture_output=True, text=True)
            base |= {l.strip() for l in r.stdout.splitlines() if l and not l[0].isspace()}
        for b in re.findall(r"/src/build/bin/(\S+)", text):
            dyn = subprocess.run(["readelf", "-d", os.path.join(BIN, b)], capture_output=True, text=True).stdout
            if "libasan" in dyn:
                print("%s is a sanitizer build: its libraries are not the image's" % b)
                continue
            for lib in re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn):
                if lib not in paths:
                    continue
                r = subprocess.run(["dpkg", "-S", os.path.realpath(paths[lib])], capture_output=True, text=True)
                if r.returncode != 0:
                    continue
                pkg = r.stdout.split(":")[0]
                check(pkg in pkgs or pkg in base, "Dockerfile: %s's %s comes from %s" % (b, lib, pkg))


TMP = None


def main():
    global TMP
    import tempfile
    TMP = tempfile.mkdtemp(prefix="pd_deploy_")
    for b in ("decode_node", "prefill_node"):
        if not os.access(os.path.join(BIN, b), os.X_OK):
            print("SKIPPED: %s not built" % b)
            return 77
    dockerfile_checks()
    for f in sorted(os.listdir(K8S)):
        if not f.endswith(".yaml"):
            continue
        deps, _ = static_checks(f, load(os.path.join(K8S, f)))
        run_manifest(f, deps)
    shutil.rmtree(TMP, ignore_errors=True)
    print("%d failed" % len(FAILS))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
