#!/usr/bin/env bash
# test_cli.sh - pdspark-generate / pdspark-tokenize / pdspark-loadsim from the outside: a good run's JSON, and bad
# input (missing/corrupt/truncated checkpoints, mismatched shapes, a draft that does not fit,
# bad token ids, empty and oversized prompts, bad flags) -> a clear error and a non-zero exit.
# Usage: test_cli.sh BIN_DIR MODELS_DIR
set -u
bin=$1
models=$2
gen=$bin/pdspark-generate
pass=0
fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

# expect_fail NAME PATTERN CMD...: non-zero exit, no crash (exit < 128), stderr matches PATTERN
expect_fail() {
  local name=$1 pat=$2
  shift 2
  "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ $rc -eq 0 ]; then bad "$name: exit 0"; return; fi
  if [ $rc -ge 128 ]; then bad "$name: crashed (exit $rc)"; cat "$tmp/err"; return; fi
  if ! grep -qiE -- "$pat" "$tmp/err"; then bad "$name: message does not match /$pat/:"; cat "$tmp/err"; return; fi
  echo "ok   $name: $(head -c 300 "$tmp/err" | tr '\n' ' ')"
  ok
}

T=$models/tiny-code-qwen3
D=$models/tiny-code-dspark

# wait_addr FILE: the HOST:PORT a node printed to FILE as 'listening grpc HOST:PORT' (empty if it
# did not within 60 s)
wait_addr() {
  local a= _
  for _ in $(seq 1 600); do
    a=$(sed -n 's/^listening grpc \(.*:[0-9]*\)$/\1/p' "$1")
    [ -n "$a" ] && break
    sleep 0.1
  done
  echo "$a"
}

# a good run: JSON with the documented fields
if $gen --model "$T" --draft "$D" --prompt 'import os
def main():' --max-new-tokens 24 --json >"$tmp/good.json" 2>"$tmp/err"; then
  if python3 - "$tmp/good.json" <<'PY'
import json, sys
o = json.load(open(sys.argv[1]))
for k in ("tokens", "text", "rounds", "accepted_per_round", "tau", "prompt_tokens", "time_ms"):
    assert k in o, k
assert 1 <= len(o["tokens"]) <= 24
assert len(o["accepted_per_round"]) == o["rounds"] > 0
assert abs(sum(o["accepted_per_round"]) / o["rounds"] - o["tau"]) < 1e-9
PY
  then ok; echo "ok   good run JSON"; else bad "good run JSON fields"; cat "$tmp/good.json"; fi
else
  bad "good run failed"; cat "$tmp/err"
fi
# --no-draft and --prompt-ids agree with greedy tokens of the speculative run
python3 -c "import json;print(' '.join(map(str,json.load(open('$tmp/good.json'))['tokens'])))" >/dev/null
echo "1069 4873 4088 7158 365" >"$tmp/ids.txt"
a=$($gen --model "$T" --draft "$D" --prompt-ids "$tmp/ids.txt" --max-new-tokens 20 --json 2>/dev/null | python3 -c "import json,sys;print(json.load(sys.stdin)['tokens'])")
b=$($gen --model "$T" --no-draft --prompt-ids "$tmp/ids.txt" --max-new-tokens 20 --json 2>/dev/null | python3 -c "import json,sys;print(json.load(sys.stdin)['tokens'])")
if [ -n "$a" ] && [ "$a" = "$b" ]; then ok; echo "ok   speculative == target-only ($a)"; else bad "speculative $a != target-only $b"; fi

# RoPE scaling: a yarn rope_parameters (as Qwen3's model card adds for long contexts) serves
# factor x original_max_position_embeddings positions, speculative == target-only under it, and it
# reaches the model (its greedy tokens part from the plain model's)
for v in plain256 yarn; do
  mkdir -p "$tmp/$v" && ln -s "$(cd "$T" && pwd)"/* "$tmp/$v/" && rm "$tmp/$v/config.json"
  python3 - "$T/config.json" "$tmp/$v/config.json" "$v" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["max_position_embeddings"] = 256
if sys.argv[3] == "yarn":
    c["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 8.0,
                            "original_max_position_embeddings": 256}
json.dump(c, open(sys.argv[2], "w"))
PY
done
python3 -c "import random; random.seed(5); print(' '.join(str(random.randrange(100, 8000)) for _ in range(300)))" >"$tmp/ids300.txt"
ya=$($gen --model "$tmp/yarn" --draft "$D" --prompt-ids "$tmp/ids.txt" --max-new-tokens 20 --json 2>/dev/null | python3 -c "import json,sys;print(json.load(sys.stdin)['tokens'])")
yb=$($gen --model "$tmp/yarn" --no-draft --prompt-ids "$tmp/ids.txt" --max-new-tokens 20 --json 2>/dev/null | python3 -c "import json,sys;print(json.load(sys.stdin)['tokens'])")
if [ -n "$ya" ] && [ "$ya" = "$yb" ] && [ "$ya" != "$a" ]; then ok; echo "ok   yarn: speculative == target-only ($ya), not the plain model's"; else bad "yarn: speculative $ya, target-only $yb, plain $a"; fi
expect_fail "300-token prompt in a 256-position model" "context of 256" $gen --model "$tmp/plain256" --no-draft --prompt-ids "$tmp/ids300.txt" --max-new-tokens 4
ya=$($gen --model "$tmp/yarn" --draft "$D" --prompt-ids "$tmp/ids300.txt" --max-new-tokens 8 --json 2>"$tmp/err" | python3 -c "import json,sys;print(json.load(sys.stdin)['tokens'])")
yb=$($gen --model "$tmp/yarn" --no-draft --prompt-ids "$tmp/ids300.txt" --max-new-tokens 8 --json 2>/dev/null | python3 -c "import json,sys;print(json.load(sys.stdin)['tokens'])")
if [ -n "$ya" ] && [ "$ya" = "$yb" ]; then ok; echo "ok   yarn serves 8 x 256 positions: a 300-token prompt, speculative == target-only"; else bad "yarn 300-token prompt: $ya vs $yb"; cat "$tmp/err"; fi

# --version: every tool prints one line naming itself, pdspark's version and the commit (the same
# for all), exits 0, and does nothing else (no model is needed)
vers=
for t in decode_node prefill_node pdspark-generate pdspark-client pdspark-bench pdspark-loadsim pdspark-calibrate \
         pdspark-tokenize pdspark-xferbench; do
  [ -x "$bin/$t" ] || continue
  v=$("$bin/$t" --version --model /nonexistent 2>&1); rc=$?
  if [ $rc -eq 0 ] && [[ "$v" =~ ^$t\ \(pdspark\ [0-9]+\.[0-9]+\.[0-9]+,\ commit\ ([0-9a-f]{12}(-dirty)?|unknown)\;\ cuda\ (on|off),\ services\ (on|off) ]]; then
    vers="$vers ${BASH_REMATCH[1]}"
  else
    bad "$t --version: rc $rc: $v"
  fi
done
if [ -n "$vers" ] && [ "$(echo $vers | tr ' ' '\n' | sort -u | wc -l)" = 1 ]; then ok; echo "ok   --version of every tool:$vers"; else bad "--version commits differ:$vers"; fi

expect_fail "missing model dir" "nope|no such|not found" $gen --model "$tmp/nope" --prompt hi
mkdir -p "$tmp/noconf" && cp "$T"/*.safetensors "$tmp/noconf/"
expect_fail "missing config.json" "config.json" $gen --model "$tmp/noconf" --prompt-ids "$tmp/ids.txt"
cp -r "$T" "$tmp/trunc" && truncate -s 100000 "$tmp/trunc/model-00002-of-00003.safetensors"
expect_fail "truncated shard" "model-00002-of-00003" $gen --model "$tmp/trunc" --prompt-ids "$tmp/ids.txt"
cp -r "$T" "$tmp/corrupt" && printf 'garbage!garbage!' | dd of="$tmp/corrupt/model-00001-of-00003.safetensors" conv=notrunc 2>/dev/null
expect_fail "corrupt header" "model-00001-of-00003" $gen --model "$tmp/corrupt" --prompt-ids "$tmp/ids.txt"
cp -r "$T" "$tmp/shape" && sed -i 's/"intermediate_size": 768/"intermediate_size": 512/' "$tmp/shape/config.json"
expect_fail "config/tensor shape mismatch" "mlp|shape|512" $gen --model "$tmp/shape" --prompt-ids "$tmp/ids.txt"
cp -r "$D" "$tmp/draftvocab" && sed -i 's/"hidden_size": 256/"hidden_size": 128/' "$tmp/draftvocab/config.json"
expect_fail "draft hidden size does not fit" "hidden" $gen --model "$T" --draft "$tmp/draftvocab" --prompt-ids "$tmp/ids.txt"
cp -r "$D" "$tmp/drafttap" && python3 - "$tmp/drafttap/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["target_layer_ids"] = [1, 3, 7]; json.dump(c, open(sys.argv[1], "w"))
PY
expect_fail "draft taps the final layer" "layer|tap" $gen --model "$T" --draft "$tmp/drafttap" --prompt-ids "$tmp/ids.txt"
echo "1 2 99999" >"$tmp/badid.txt"
expect_fail "token id out of range" "99999.*vocab|vocab.*99999" $gen --model "$T" --draft "$D" --prompt-ids "$tmp/badid.txt"
echo "1 -5" >"$tmp/negid.txt"
expect_fail "negative token id" "-5" $gen --model "$T" --prompt-ids "$tmp/negid.txt"
echo "1 two 3" >"$tmp/word.txt"
expect_fail "non-numeric token id" "two" $gen --model "$T" --prompt-ids "$tmp/word.txt"
expect_fail "empty prompt" "empty prompt" $gen --model "$T" --draft "$D" --prompt ''
# --grammar (GBNF): the output is a whole match, speculative == target-only; bad grammars by name
printf 'root ::= "return " term (" + " term)* "\\n"\nterm ::= [a-z]+ | [0-9]+\n' >"$tmp/g.gbnf"
ga=$($gen --model "$T" --draft "$D" --prompt "def f(a, b):
    " --max-new-tokens 30 --grammar "$tmp/g.gbnf" --json 2>/dev/null)
gb=$($gen --model "$T" --no-draft --prompt "def f(a, b):
    " --max-new-tokens 30 --grammar "$tmp/g.gbnf" --json 2>/dev/null)
if python3 -c "
import json, re, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert a['tokens'] == b['tokens'], (a['tokens'], b['tokens'])
assert a['finish_reason'] == 'stop' and re.fullmatch(r'return [a-z0-9]+( \+ [a-z0-9]+)*\n', a['text']), a
" "$ga" "$gb"; then echo "ok   --grammar: a whole match, DSpark == target-only"; ok
else bad "--grammar: $ga / $gb"; fi
printf 'root ::= x\n' >"$tmp/bad.gbnf"
expect_fail "grammar with an undefined rule" "'x' is used but not defined" $gen --model "$T" --prompt hi --grammar "$tmp/bad.gbnf"
expect_fail "grammar and regex together" "only one of" $gen --model "$T" --prompt hi --grammar "$tmp/g.gbnf" --regex a

python3 -c "print(' '.join(['220']*5000))" >"$tmp/long.txt"
expect_fail "prompt longer than the context" "context" $gen --model "$T" --draft "$D" --prompt-ids "$tmp/long.txt"
expect_fail "bad flag value" "max-new-tokens" $gen --model "$T" --prompt hi --max-new-tokens abc
expect_fail "unknown flag" "unknown" $gen --model "$T" --prompt hi --frobnicate
expect_fail "negative temperature" "temperature" $gen --model "$T" --prompt hi --temperature -1
expect_fail "unknown device" "backend|device" $gen --model "$T" --prompt hi --device tpu
expect_fail "unknown dtype" "dtype.*f16" $gen --model "$T" --prompt hi --dtype f16
expect_fail "block size above the draft's" "block size" $gen --model "$T" --draft "$D" --prompt hi --block-size 9
expect_fail "tokenize: bad id to decode" "99999" sh -c "echo 99999 | $bin/pdspark-tokenize --tokenizer $T --decode"

# --tp: the same tokens as --tp 1 (sampled, fixed seed), bad N refused by name
tp_tokens() {
  $gen --model "$T" --draft "$D" --prompt-ids "$tmp/ids.txt" --max-new-tokens 24 --temperature 0.8 \
    --seed 7 --json --tp "$1" 2>"$tmp/tp_err" | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])'
}
t1=$(tp_tokens 1); t2=$(tp_tokens 2)
if [ -n "$t1" ] && [ "$t1" = "$t2" ]; then echo "ok   --tp 2 tokens == --tp 1: $t1"; ok
else bad "--tp 2 tokens '$t2' != --tp 1 '$t1'"; cat "$tmp/tp_err"; fi
expect_fail "tp not dividing the heads" "tp 3 does not divide the model's 4 attention heads" $gen --model "$T" --prompt-ids "$tmp/ids.txt" --tp 3
expect_fail "tp above the heads" "tp 8 exceeds the model's 4 attention heads" $gen --model "$T" --prompt-ids "$tmp/ids.txt" --tp 8
expect_fail "tp below 1" "--tp.*1\.\.64" $gen --model "$T" --prompt-ids "$tmp/ids.txt" --tp 0

# --graphs: padded batches give the same tokens; a bad mode is refused by name
g_off=$($gen --model "$T" --draft "$D" --prompt-ids "$tmp/ids.txt" --max-new-tokens 24 --json --graphs off 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
g_pad=$($gen --model "$T" --draft "$D" --prompt-ids "$tmp/ids.txt" --max-new-tokens 24 --json --graphs pad 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
if [ -n "$g_off" ] && [ "$g_off" = "$g_pad" ]; then echo "ok   --graphs pad tokens == --graphs off"; ok
else bad "--graphs pad tokens '$g_pad' != off '$g_off'"; fi
expect_fail "bad graphs mode" "graphs 'always'.*auto, off or pad" $gen --model "$T" --prompt-ids "$tmp/ids.txt" --graphs always

# pdspark-loadsim: a small CPU sweep writes one CSV row per policy and level; bad flags refused
ls=$bin/pdspark-loadsim
if $ls --model "$T" --draft "$D" --prompt-len 16 --max-new-tokens 4 --concurrency 1,2 --requests 2 \
    --csv "$tmp/ls.csv" >"$tmp/ls.out" 2>"$tmp/err" && python3 - "$tmp/ls.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert len(rows) == 8, len(rows)
assert {r["policy"] for r in rows} == {"target", "full", "threshold", "scheduled"}
assert all(float(r["tokens_per_s"]) > 0 and int(r["output_tokens"]) == 8 for r in rows), rows
PY
then echo "ok   pdspark-loadsim: 8 CSV rows (4 policies x 2 levels)"; ok
else bad "pdspark-loadsim small sweep"; cat "$tmp/err" "$tmp/ls.out"; fi
expect_fail "loadsim without a model" "exactly one of --model" $ls --concurrency 1
expect_fail "loadsim bad concurrency" "concurrency.*'0'" $ls --model "$T" --concurrency 0
expect_fail "loadsim bad policy" "verify policy 'fast'" $ls --model "$T" --policies target,fast
expect_fail "loadsim unknown flag" "unknown or incomplete flag '--bogus'" $ls --bogus

# a bad flag gets one line naming it (the usage would scroll it away), exit 2
for b in decode_node prefill_node pdspark-generate pdspark-client pdspark-loadsim pdspark-calibrate pdspark-bench \
         pdspark-xferbench; do
    [ -x "$bin/$b" ] || continue
    "$bin/$b" --bogus >"$tmp/out" 2>"$tmp/err"
    rc=$?
    if [ $rc -eq 2 ] && [ "$(wc -l <"$tmp/err")" -eq 1 ] &&
       grep -q "^$b: unknown or incomplete flag '--bogus' ($b --help lists the flags)$" "$tmp/err"; then
        echo "ok   $b --bogus: $(cat "$tmp/err")"; ok
    else bad "$b --bogus: exit $rc, stderr:"; cat "$tmp/err"; fi
done

# --chat: the prompt as a user message rendered by the checkpoint's template gives the tokens of
# that ChatML text as the prompt; a --chat-template of another shape is rendered by the Jinja
# subset (the same tokens as its text); one that does not parse and --system without --chat refused
chat_toks=$($gen --model "$T" --draft "$D" --chat --system "You write Python." --prompt "def add(a, b):" \
    --max-new-tokens 12 --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
raw_toks=$($gen --model "$T" --draft "$D" --prompt $'<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n' \
    --max-new-tokens 12 --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
if [ -n "$chat_toks" ] && [ "$chat_toks" = "$raw_toks" ]
then echo "ok   pdspark-generate --chat equals its ChatML text as the prompt"; ok
else bad "pdspark-generate --chat: '$chat_toks' vs '$raw_toks'"; fi
jinja_toks=$($gen --model "$T" --draft "$D" --chat --jinja --system "You write Python." --prompt "def add(a, b):" \
    --max-new-tokens 12 --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
if [ -n "$jinja_toks" ] && [ "$jinja_toks" = "$raw_toks" ]
then echo "ok   pdspark-generate --chat --jinja: the bundled template through the Jinja subset, the same prompt"; ok
else bad "pdspark-generate --chat --jinja: '$jinja_toks' vs '$raw_toks'"; fi
inst_toks=$($gen --model "$T" --draft "$D" --chat --prompt "def add(a, b):" --max-new-tokens 12 --json \
    --chat-template "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] | trim }} [/INST]{% endfor %}" 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
raw_toks=$($gen --model "$T" --draft "$D" --prompt '[INST] def add(a, b): [/INST]' --max-new-tokens 12 --json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["tokens"])')
if [ -n "$inst_toks" ] && [ "$inst_toks" = "$raw_toks" ]
then echo "ok   pdspark-generate --chat with a Jinja template equals its text as the prompt"; ok
else bad "pdspark-generate --chat with a Jinja template: '$inst_toks' vs '$raw_toks'"; fi
expect_fail "generate --chat-template that does not parse" "does not parse as Jinja .line 1:" $gen --model "$T" \
    --draft "$D" --chat --prompt hi --chat-template '{% for m in messages %}'
expect_fail "generate --system without --chat" "need --chat" $gen --model "$T" --draft "$D" --prompt hi \
    --system x

# the servers take --dtype too (built with the network stack only)
if [ -x "$bin/decode_node" ]; then
    expect_fail "decode_node unknown dtype" "dtype: 'f16' is not bf16 or f32" $bin/decode_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --colocated --dtype f16
fi
if [ -x "$bin/prefill_node" ]; then
    expect_fail "prefill_node --prefix-cache with raw aux" "prefix-cache needs --aux-transfer draft-kv" \
        $bin/prefill_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --prefix-cache
    expect_fail "prefill_node unknown dtype" "dtype: 'f16' is not bf16 or f32" $bin/prefill_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --dtype f16
fi

# --chunked-prefill-size: a bad value and a disaggregated node are refused; a colocated node
# prefilling in 16-token chunks gives pdspark-generate's tokens
if [ -x "$bin/decode_node" ] && [ -x "$bin/pdspark-client" ]; then
    expect_fail "decode_node --chunked-prefill-size 0" "chunked-prefill-size" $bin/decode_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --colocated --chunked-prefill-size 0
    expect_fail "decode_node --chat-template missing" "no such file" $bin/decode_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --colocated --http 127.0.0.1:0 --chat-template "$tmp/nope.jinja"
    expect_fail "decode_node --chat-template that does not parse" "does not parse as Jinja" $bin/decode_node \
        --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --http 127.0.0.1:0 --chat-template '{{ m + }}'
    mkdir -p "$tmp/badgen" && echo '{"top_p": 5}' > "$tmp/badgen/generation_config.json"
    expect_fail "decode_node --generation-config out of range" "top_p.*must be a number" $bin/decode_node \
        --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --http 127.0.0.1:0 --generation-config "$tmp/badgen"
    echo '{"typical_p": 0}' > "$tmp/badgen/generation_config.json"
    expect_fail "decode_node --generation-config typical_p 0" "typical_p.*must be a number" $bin/decode_node \
        --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --http 127.0.0.1:0 --generation-config "$tmp/badgen"
    expect_fail "decode_node --generation-config missing" "cannot read" $bin/decode_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --colocated --http 127.0.0.1:0 --generation-config "$tmp/nogen"
    expect_fail "decode_node --draft with --no-draft" "--draft and --no-draft exclude each other" \
        $bin/decode_node --model "$T" --draft "$D" --no-draft --listen 127.0.0.1:0 --colocated
    expect_fail "decode_node --max-local-prefill colocated" "max-local-prefill applies to --prefill only" \
        $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --max-local-prefill 64
    expect_fail "decode_node --prefix-cache with --tp" "prefix cache does not combine" \
        $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --prefix-cache --tp 2
    expect_fail "decode_node --kv-memory-fraction 1.5" "not a fraction in \\(0, 1\\)" $bin/decode_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --colocated --kv-memory-fraction 1.5
    expect_fail "decode_node --swap-space -1" "not a size in GiB in \\[0, 65536\\]" $bin/decode_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --colocated --swap-space -1
    expect_fail "decode_node --swap-space abc" "--swap-space: 'abc' is not a size in GiB" $bin/decode_node \
        --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --swap-space abc
    expect_fail "decode_node --kv-memory-fraction with --kv-pages" "kv-pages N or --kv-memory-fraction F, not both" \
        $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --kv-memory-fraction 0.5 --kv-pages 64
    # on the cpu the fraction is of the host's available memory: a tiny one gives too few pages
    expect_fail "decode_node --kv-memory-fraction too small" "gives [0-9]+ pages of 16 tokens .*fewer than 64" \
        $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --kv-memory-fraction 1e-9
    expect_fail "decode_node --kv-memory-fraction too small with --tp 2" "for the tp ranks' pools on that device" \
        $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --kv-memory-fraction 1e-9 --tp 2
    expect_fail "prefill_node --stage-memory abc" "--stage-memory: 'abc' is not a size in GiB" $bin/prefill_node \
        --model "$T" --draft "$D" --listen 127.0.0.1:0 --stage-memory abc
    expect_fail "prefill_node --kv-memory-fraction too small" "fewer than 64" $bin/prefill_node --model "$T" \
        --draft "$D" --listen 127.0.0.1:0 --kv-memory-fraction 1e-9
    expect_fail "decode_node --prefill-refresh-ms colocated" "prefill-refresh-ms applies to --prefill only" \
        $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --prefill-refresh-ms 100
    expect_fail "decode_node --chunked-prefill-size disaggregated" "chunked-prefill-size applies to prompts prefilled here" \
        $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --prefill 127.0.0.1:1 --chunked-prefill-size 64
    prompt='import os
import sys

def read_lines(path):
    with open(path) as f:
        return [line.rstrip() for line in f]

def main():
    lines = read_lines(sys.argv[1])
    for i, line in enumerate(lines):'
    $bin/decode_node --model "$T" --draft "$D" --listen 127.0.0.1:0 --colocated --chunked-prefill-size 16 \
        --log-format json >"$tmp/chunk.out" 2>"$tmp/chunk.err" &
    node=$!
    addr=$(wait_addr "$tmp/chunk.out")
    if [ -z "$addr" ]; then
        bad "chunked prefill: decode_node did not start"; cat "$tmp/chunk.err"
    elif $bin/pdspark-client --server "$addr" --prompt "$prompt" --max-new-tokens 24 --ignore-eos --json \
            >"$tmp/chunk.json" 2>"$tmp/err" &&
         $gen --model "$T" --draft "$D" --prompt "$prompt" --max-new-tokens 24 --ignore-eos --json \
            >"$tmp/whole.json" 2>>"$tmp/err"; then
        if python3 - "$tmp/chunk.json" "$tmp/whole.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
assert a["prompt_tokens"] > 48, a["prompt_tokens"]  # 4+ chunks
assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 24, (a["tokens"], b["tokens"])
PY
        then echo "ok   chunked prefill (16-token chunks) equals pdspark-generate"; ok
        else bad "chunked prefill: tokens differ from pdspark-generate"; fi
    else
        bad "chunked prefill: client or generate failed"; cat "$tmp/err"
    fi
    # a gRPC request_id that would forge a log line (a newline, a terminal escape, a byte that is
    # not UTF-8): the node's JSON log stays one valid object per line, the id escaped in it
    if [ -n "$addr" ]; then
        $bin/pdspark-client --server "$addr" --prompt "$prompt" --max-new-tokens 4 --json \
            --request-id "$(printf 'evil\n{"level":"error","msg":"forged"}\033[2J\377')" >/dev/null 2>"$tmp/err" ||
            { bad "log line: the client failed"; cat "$tmp/err"; }
    fi
    kill $node 2>/dev/null
    wait $node 2>/dev/null
    if [ -n "$addr" ]; then
        if python3 - "$tmp/chunk.err" <<'PY'
import json, re, sys
lines = open(sys.argv[1], "rb").read().decode("utf-8").splitlines()   # strict: valid UTF-8 only
# gRPC core's own lines (E1207 ...) are not pdspark's; every other line is one JSON object
objs = [json.loads(l) for l in lines if not re.match(r"[EWID][0-9]{4} ", l)]
assert not any(o.get("msg") == "forged" for o in objs), "a forged line"
ids = [o["id"] for o in objs if o.get("module") == "request" and "evil" in o.get("id", "")]
assert ids == ['evil\\n{"level":"error","msg":"forged"}\\x1b[2J\\xff'], ids
PY
        then echo "ok   a request_id with a newline, an escape and a non-UTF-8 byte: one valid JSON log line"; ok
        else bad "log line: the JSON log of a hostile request_id"; cat "$tmp/chunk.err"; fi
    fi
fi

# a port another node already serves is an error for both nodes (gRPC would otherwise share it)
if [ -x "$bin/prefill_node" ] && [ -x "$bin/decode_node" ]; then
    $bin/prefill_node --model "$T" --listen 127.0.0.1:0 >"$tmp/first.out" 2>"$tmp/first.err" &
    first=$!
    addr=$(wait_addr "$tmp/first.out")
    port=${addr##*:}
    if [ -z "$port" ]; then
        bad "busy port: the first prefill_node did not start"; cat "$tmp/first.err"
    else
        # (timeout: a node that did start on the shared port would otherwise serve forever)
        expect_fail "prefill_node on a busy port" "cannot listen on 127.0.0.1:$port" \
            timeout 120 $bin/prefill_node --model "$T" --listen "127.0.0.1:$port"
        expect_fail "decode_node on a busy port" "cannot listen on 127.0.0.1:$port" \
            timeout 120 $bin/decode_node --model "$T" --draft "$D" --colocated --listen "127.0.0.1:$port"
    fi
    kill $first 2>/dev/null
    wait $first 2>/dev/null
fi

echo "$pass passed, $fail failed"
[ $fail -eq 0 ] && [ $pass -gt 0 ]
