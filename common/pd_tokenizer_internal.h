/* pd_tokenizer_internal.h - private to the tokenizer's files (pd_tokenizer.c: load, decode,
 *   streaming detokenizer; pd_tokenizer_encode.c: encode).
 * Owns: the loaded form (struct pd_tokenizer), the growing buffers and the helpers one file
 *   lends the other (hash, UTF-8, vocab and merge lookup, NFC).
 * Not here: the public API (pd_tokenizer.h).
 * Threading: as pd_tokenizer.h: a loaded tokenizer is read-only. */
#ifndef PD_TOKENIZER_INTERNAL_H
#define PD_TOKENIZER_INTERNAL_H

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif

#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_tokenizer.h"

#define PD_TOK_MAX_SPLITS 8       /* regex pre-tokenizer levels we chain */
#define PD_TOK_BYTE_CPS 324       /* bytes_to_unicode maps into U+0000..U+0143 */

/* Per-id flags; an added token may also be a vocab entry (GPT-2's <|endoftext|>). */
enum { PD_TOK_KIND_NONE = 0, PD_TOK_KIND_VOCAB = 1, PD_TOK_KIND_ADDED = 2, PD_TOK_KIND_SPECIAL = 4 };

typedef struct {
    char *content;        /* as matched in the text (NFC'd when normalized) */
    size_t len;
    int32_t id;
    uint8_t special, lstrip, rstrip, single_word, normalized;
} pd_tok_added;

/* Added tokens of one matching pass, bucketed by first byte, longest first inside a bucket,
 * so the first hit at a position is the leftmost-longest match. */
typedef struct {
    uint32_t *idx;        /* indices into pd_tokenizer.added */
    uint32_t start[257];
} pd_tok_added_set;

typedef struct {
    uint64_t key;         /* (left id << 32) | right id */
    int32_t rank;
    int32_t new_id;
} pd_tok_merge;

struct pd_tokenizer {
    char *path;
    size_t n_ids;                 /* 1 + largest id */
    uint8_t *kind;                /* TOK_KIND_* flags per id */
    uint32_t *str_off;            /* tokenizer.json form of each id, into strs */
    uint32_t *byte_off;           /* raw bytes of each id, into bytes */
    uint32_t *byte_len;
    char *strs;
    uint8_t *bytes;
    int32_t *vocab_tab;           /* open addressing over raw bytes -> id, -1 empty */
    size_t vocab_mask;
    pd_tok_merge *merge_tab;         /* open addressing, key 0 never used (ids pair 0,0 excluded) */
    uint8_t *merge_used;
    size_t merge_mask;
    int32_t *rank_new_id;         /* merged id of each merge rank */
    int32_t byte_id[256];         /* single-byte token of each byte */
    int32_t b2c[256];             /* GPT-2 bytes_to_unicode */
    int16_t c2b[PD_TOK_BYTE_CPS];    /* its inverse, -1 where no byte maps */
    int ignore_merges;
    pd_tok_added *added;
    size_t n_added;
    pd_tok_added_set raw_set;        /* normalized == false: matched on the input text */
    pd_tok_added_set norm_set;       /* normalized == true: matched after NFC */
    int nfc;
    pcre2_code *split[PD_TOK_MAX_SPLITS];
    size_t n_split;
};


typedef struct {
    uint8_t *p;
    size_t n, cap;
} pd_tok_buf;

typedef struct {
    int32_t *v;
    size_t n, cap;
} pd_tok_ids;

/* Growing buffers; 0 or -1 when out of memory. */
int pd_tok_buf_reserve(pd_tok_buf *b, size_t extra);
int pd_tok_buf_put(pd_tok_buf *b, const void *src, size_t n);
int pd_tok_ids_push(pd_tok_ids *a, int32_t id);
uint64_t pd_tok_hash_bytes(const uint8_t *s, size_t n);
/* The GPT-2 pattern's \s and word classes on a code point (the encoder's fast split). */
int pd_tok_is_white_space(int32_t c);
int pd_tok_is_word_char(int32_t c);
/* Start of the code point that ends at s[end] (exclusive), its value in *cp. */
size_t pd_tok_utf8_prev(const uint8_t *s, size_t end, int32_t *cp);
/* Appends s[0:n] as valid UTF-8 (invalid sequences become U+FFFD; an incomplete tail is kept
 * back unless final); returns the bytes of s consumed, (size_t)-1 when out of memory. */
size_t pd_tok_utf8_lossy_append(pd_tok_buf *out, const uint8_t *s, size_t n, int final);
/* The id of the raw bytes s[0:n], -1 when not in the vocabulary. */
int32_t pd_tok_vocab_find(const pd_tokenizer *t, const uint8_t *s, size_t n);
/* The merge of ids (a, b), NULL when none. */
const pd_tok_merge *pd_tok_merge_find(const pd_tokenizer *t, int32_t a, int32_t b);
/* NFC of s[0:n] into a malloc'd *out (utf8proc). */
pd_status pd_tok_nfc(const uint8_t *s, size_t n, uint8_t **out, size_t *out_len);

#endif
