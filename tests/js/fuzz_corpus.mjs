// fuzz_corpus.mjs - a deterministic pseudo-random corpus for test_tokenizer_qwen3.sh.
// Usage: node fuzz_corpus.mjs [COUNT] [SEED]   -> prints a JSON array of COUNT strings
// Each string strings together pieces that stress pre-tokenization boundaries: contractions
// in both cases, letters of several scripts, combining marks, digits of several scripts,
// emoji sequences, whitespace runs and special tokens. Characters where the reference
// (qwen3_ref.mjs) is known to differ from HF are left out: U+0085 NEL (not \s in JS),
// U+FEFF (\s in JS only) and case-folded contraction letters such as U+017F.
const count = Number(process.argv[2] ?? 2000);
let state = Number(process.argv[3] ?? 12345) >>> 0;
const rand = (n) => {
  // xorshift32: stable across node versions, unlike Math.random
  state ^= state << 13; state >>>= 0;
  state ^= state >>> 17;
  state ^= state << 5; state >>>= 0;
  return state % n;
};
const pool = [
  ..."abcXYZ ' \t\n\r.,;:!?-_()[]{}<>|/\\\"#$%^&*+=~`0123456789",
  "'s", "'S", "'ll", "'LL", "'Re", "'ve", "'d", "'m", "'t", "’s",
  ..."éèêÅåßøæœçñüöä", "e\u0301", "a\u0308", "\u0301", "\u093f",
  ..."日本語中文字한국어", ..."ПриветΓειά", ..."مرحباשלום", ..."नमस्ते",
  "😀", "👍🏽", "👨‍👩‍👧", "🇩🇪", "❤️", "1️⃣",
  "\u00a0", "\u3000", "\u2028", "\u2029", "\u200b", "\u200d", "\u2009", "\u202f", "\u000b", "\u000c",
  ..."١٢٣४५६Ⅻ½²",
  "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>", "<|im_", "|>",
  "    ", "\n\n", "\r\n", "  \n", "\t\t",
];
const out = [];
for (let i = 0; i < count; i++) {
  let s = "";
  const n = 1 + rand(30);
  for (let k = 0; k < n; k++) s += pool[rand(pool.length)];
  out.push(s);
}
process.stdout.write(JSON.stringify(out) + "\n");
