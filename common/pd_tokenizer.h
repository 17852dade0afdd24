/* pd_tokenizer.h - Hugging Face tokenizer.json byte-level BPE (Qwen2/Qwen3 family): encode,
 * decode and streaming detokenization.
 * Owns: loading tokenizer.json (vocab, merges, added tokens, NFC normalizer, Split + ByteLevel
 *       pre-tokenizer), text -> ids, ids -> text, the incremental UTF-8-safe detokenizer.
 * Not here: chat templates, adding BOS/EOS (encode is HF's encode(text,
 *       add_special_tokens=False)), stop-string matching (decode_node/).
 * Threading: a loaded pd_tokenizer is immutable; any number of threads may call encode, decode
 *       and the lookups on it at once (all scratch state is per call). A pd_detok belongs to
 *       the one thread that pushes into it.
 *
 * Semantics, as in HF `tokenizers`:
 *  - Added tokens are matched verbatim (leftmost, longest) before normalization, honouring
 *    lstrip/rstrip/single_word/normalized. With parse_special == 0 the tokens marked special
 *    are not matched (plain text, like split_special_tokens=True); non-special added tokens
 *    such as <think> are still matched, as HF does.
 *  - Invalid UTF-8 in the input text is replaced with U+FFFD (one per maximal invalid
 *    subpart, as Python's bytes.decode(errors="replace")) before encoding; it is not an error.
 *  - Decode joins the bytes of the tokens and replaces invalid UTF-8 with U+FFFD, as HF's
 *    decode does. Added tokens contribute their content verbatim; HF runs it through the
 *    byte-level map, which gives the same bytes for contents of printable ASCII without
 *    spaces (every Qwen2/Qwen3 added token) and mangles Latin-1 letters, so we do not copy it.
 *  - The post_processor is not applied: encode never adds BOS/EOS. */
#ifndef PD_TOKENIZER_H
#define PD_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "pd_status.h"

typedef struct pd_tokenizer pd_tokenizer;
typedef struct pd_detok pd_detok;

/* Loads `path`: a tokenizer.json file, or a directory that contains one (a checkpoint dir).
 * Errors: PD_ERR_NOT_FOUND / PD_ERR_IO (file), PD_ERR_INVALID (bad JSON or a malformed field;
 * the message names the file and the field), PD_ERR_UNSUPPORTED (a model, normalizer,
 * pre-tokenizer or decoder this module does not implement), PD_ERR_NOMEM.
 * *out is set only on success; free it with pd_tokenizer_free. */
pd_status pd_tokenizer_load(const char *path, pd_tokenizer **out, pd_err *err);
void pd_tokenizer_free(pd_tokenizer *t);   /* NULL is fine */

/* Length of the longest prefix of text[0..n) that is valid UTF-8 (RFC 3629: no overlong forms,
 * surrogates or code points past U+10FFFF); n when all of it is. The tokenizer's input check and
 * the HTTP body check are this. */
size_t pd_utf8_valid_prefix(const void *text, size_t n);

/* Encodes text[0..len) (need not be NUL-terminated). parse_special: match special added tokens
 * such as <|im_start|> in the text (1) or treat them as plain text (0). On success *ids_out is
 * a malloc'd array the caller frees with free() (non-NULL even when *n_out == 0).
 * Errors: PD_ERR_NOMEM, PD_ERR_INTERNAL (regex engine failure). */
pd_status pd_tokenizer_encode(const pd_tokenizer *t, const char *text, size_t len,
                              int parse_special, int32_t **ids_out, size_t *n_out, pd_err *err);

/* Decodes ids to UTF-8 text. skip_special drops tokens marked special. On success *text_out is
 * a malloc'd NUL-terminated string (free with free()) of *len_out bytes (len_out may be NULL).
 * Errors: PD_ERR_INVALID naming the first id outside the vocabulary, PD_ERR_NOMEM. */
pd_status pd_tokenizer_decode(const pd_tokenizer *t, const int32_t *ids, size_t n,
                              int skip_special, char **text_out, size_t *len_out, pd_err *err);

/* Size of the id space: 1 + the largest id of the vocabulary and the added tokens
 * (HF get_vocab_size(with_added_tokens=True) when ids are contiguous). */
size_t pd_tokenizer_vocab_size(const pd_tokenizer *t);
/* Id of a token given as in tokenizer.json (an added token's content, or a vocab string in
 * byte-level form such as "Ġthe"); -1 when absent. */
int32_t pd_tokenizer_token_to_id(const pd_tokenizer *t, const char *token);
/* The token string of id as in tokenizer.json (borrowed, lives as long as t); NULL when the
 * id is not in the vocabulary. */
const char *pd_tokenizer_id_to_token(const pd_tokenizer *t, int32_t id);
/* The raw bytes id stands for (an added token: its content), not NUL-terminated and possibly
 * an incomplete UTF-8 sequence; *len set. NULL when the id is not in the vocabulary. */
const uint8_t *pd_tokenizer_token_bytes(const pd_tokenizer *t, int32_t id, size_t *len);
/* 1 when id is an added token marked "special": true, else 0. */
int pd_tokenizer_is_special(const pd_tokenizer *t, int32_t id);

/* Text that may hold NUL bytes (the byte-0 token) travels through the servers' C strings with
 * each NUL written as the two bytes C0 80 ("modified UTF-8": an overlong form that valid UTF-8
 * never holds, so it can only mean NUL). Replies turn it back: JSON as \u0000
 * (pd_json_print), a terminal or file as the byte, gRPC (C strings again) leaves it out. */
#define PD_TEXT_NUL "\xC0\x80"
/* A malloc'd NUL-terminated copy of s[0..n) with each NUL byte as PD_TEXT_NUL; NULL when out of
 * memory. */
char *pd_text_nul_mark(const char *s, size_t n);
/* In place: each PD_TEXT_NUL in s[0..n) becomes a NUL byte again (drop 0) or is removed (drop
 * 1); returns the new length (s[len] = '\0'). */
size_t pd_text_nul_unmark(char *s, size_t n, int drop);

/* Streaming detokenizer: push ids one at a time, get back only complete UTF-8 text. An
 * incomplete trailing UTF-8 sequence is held back until a later id completes it; bytes that
 * can never become valid are replaced with U+FFFD as soon as that is known. The concatenation
 * of every push and the flush equals pd_tokenizer_decode of the same ids with each NUL byte
 * (the byte-0 token) as PD_TEXT_NUL: the pieces are C strings.
 * t is borrowed and must outlive the detokenizer. */
pd_status pd_detok_create(const pd_tokenizer *t, pd_detok **out, pd_err *err);
/* Drop special tokens from the stream (default: emit their content). */
void pd_detok_set_skip_special(pd_detok *d, int skip_special);
/* On success *text_out is a malloc'd NUL-terminated string, possibly "" (free with free()).
 * Errors: PD_ERR_INVALID for an id outside the vocabulary (the stream is unchanged and may
 * continue), PD_ERR_NOMEM. */
pd_status pd_detok_push(pd_detok *d, int32_t id, char **text_out, pd_err *err);
/* Emits whatever is held back (an incomplete sequence becomes U+FFFD) and resets the stream
 * so it can be reused. *text_out as for pd_detok_push. */
pd_status pd_detok_flush(pd_detok *d, char **text_out, pd_err *err);
void pd_detok_destroy(pd_detok *d);        /* NULL is fine */

#endif
