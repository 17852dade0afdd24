/* pd_tokenizer.c - Hugging Face tokenizer.json byte-level BPE: load, decode, stream.
 * Owns: the tokenizer.json reader, the vocab and merge hash tables, the added-token sets,
 *       the normalizer and pre-tokenizer setup (utf8proc NFC, the PCRE2 patterns read from the
 *       file), the GPT-2 byte <-> unicode mapping, lossy UTF-8 output and the streaming
 *       detokenizer.
 * Not here: encoding (pd_tokenizer_encode.c: added-token matching, pre-tokenization,
 *       rank-ordered BPE merging), chat templates and BOS/EOS insertion (callers), stop strings
 *       (decode_node/).
 * Threading: after pd_tokenizer_load returns, the tokenizer is read-only; every encode call
 *       keeps its scratch (regex match data, BPE heap, word cache) in its own context, so
 *       calls from many threads need no lock. A pd_detok is single-threaded. */
#include "pd_tokenizer_internal.h"
#include "pd_json.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <utf8proc.h>

#define TOK_MAX_ID (1 << 24)      /* real vocabularies stay under 300k ids */

/* HF ByteLevel(use_regex=true) splits with the GPT-2 pattern before mapping bytes. */
static const char TOK_GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---------- small helpers ---------- */

int pd_tok_buf_reserve(pd_tok_buf *b, size_t extra)
{
    if (b->n + extra <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (p == NULL)
        return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

int pd_tok_buf_put(pd_tok_buf *b, const void *src, size_t n)
{
    if (pd_tok_buf_reserve(b, n) != 0)
        return -1;
    if (n > 0)
        memcpy(b->p + b->n, src, n);
    b->n += n;
    return 0;
}


int pd_tok_ids_push(pd_tok_ids *a, int32_t id)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = realloc(a->v, cap * sizeof(*v));
        if (v == NULL)
            return -1;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return 0;
}

uint64_t pd_tok_hash_bytes(const uint8_t *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c *= 2;
    return c;
}

/* Unicode White_Space (what Rust's char::is_whitespace tests for lstrip/rstrip). */
int pd_tok_is_white_space(int32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* Unicode \w as HF's single_word check uses it (Rust regex): letters, marks, decimal digits,
 * letter numbers, connector punctuation such as '_', and the two join controls. */
int pd_tok_is_word_char(int32_t c)
{
    if (c == 0x200C || c == 0x200D)
        return 1;
    utf8proc_category_t cat = utf8proc_category(c);
    return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
           (cat >= UTF8PROC_CATEGORY_MN && cat <= UTF8PROC_CATEGORY_ME) ||
           cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_PC;
}

/* Decodes the code point that ends at s[end) (s valid UTF-8); returns its start. */
size_t pd_tok_utf8_prev(const uint8_t *s, size_t end, int32_t *cp)
{
    size_t i = end - 1;
    while (i > 0 && (s[i] & 0xC0) == 0x80)
        i--;
    utf8proc_iterate(s + i, (utf8proc_ssize_t)(end - i), cp);
    return i;
}

/* Classifies the UTF-8 sequence at s[0] (n >= 1 bytes available), following the Unicode
 * "maximal subpart" rule that Python's errors="replace" and Rust's from_utf8_lossy use.
 * Returns k > 0: a valid sequence of k bytes; -k: an invalid subpart of k bytes (one U+FFFD);
 * 0: s[0..n) is a valid but incomplete prefix. */
static int utf8_classify(const uint8_t *s, size_t n)
{
    uint8_t b = s[0];
    if (b < 0x80)
        return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
        need = 1;
    } else if (b == 0xE0) {
        need = 2;
        lo = 0xA0;
    } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
        need = 2;
    } else if (b == 0xED) {
        need = 2;
        hi = 0x9F;
    } else if (b == 0xF0) {
        need = 3;
        lo = 0x90;
    } else if (b >= 0xF1 && b <= 0xF3) {
        need = 3;
    } else if (b == 0xF4) {
        need = 3;
        hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n)
            return 0;
        uint8_t c = s[i];
        int ok = (i == 1) ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
        if (!ok)
            return -i;
    }
    return need + 1;
}

/* Appends s[0..n) to out with invalid subparts replaced by U+FFFD. With final == 0 an
 * incomplete sequence at the very end is left unconsumed; returns the bytes consumed, or
 * (size_t)-1 when out of memory. */
size_t pd_tok_utf8_lossy_append(pd_tok_buf *out, const uint8_t *s, size_t n, int final)
{
    static const uint8_t repl[3] = {0xEF, 0xBF, 0xBD};
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        while (j < n && s[j] < 0x80)
            j++;
        if (j > i) {
            if (pd_tok_buf_put(out, s + i, j - i) != 0)
                return (size_t)-1;
            i = j;
            continue;
        }
        int k = utf8_classify(s + i, n - i);
        if (k > 0) {
            if (pd_tok_buf_put(out, s + i, (size_t)k) != 0)
                return (size_t)-1;
            i += (size_t)k;
        } else if (k < 0) {
            if (pd_tok_buf_put(out, repl, 3) != 0)
                return (size_t)-1;
            i += (size_t)-k;
        } else {
            if (!final)
                return i;
            if (pd_tok_buf_put(out, repl, 3) != 0)
                return (size_t)-1;
            return n;
        }
    }
    return n;
}

size_t pd_utf8_valid_prefix(const void *text, size_t n)
{
    const uint8_t *s = text;
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int k = utf8_classify(s + i, n - i);
        if (k <= 0)
            return i;
        i += (size_t)k;
    }
    return n;
}

/* GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
 * U+0100.. in byte order. */
static void byte_map_build(int32_t b2c[256], int16_t c2b[PD_TOK_BYTE_CPS])
{
    for (int i = 0; i < PD_TOK_BYTE_CPS; i++)
        c2b[i] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        b2c[b] = keep ? b : 256 + extra++;
        c2b[b2c[b]] = (int16_t)b;
    }
}

/* ---------- hash tables ---------- */

static const uint8_t *tok_bytes(const pd_tokenizer *t, int32_t id, size_t *len)
{
    *len = t->byte_len[id];
    return t->bytes + t->byte_off[id];
}

int32_t pd_tok_vocab_find(const pd_tokenizer *t, const uint8_t *s, size_t n)
{
    size_t i = (size_t)pd_tok_hash_bytes(s, n) & t->vocab_mask;
    for (;;) {
        int32_t id = t->vocab_tab[i];
        if (id < 0)
            return -1;
        size_t len;
        const uint8_t *b = tok_bytes(t, id, &len);
        if (len == n && memcmp(b, s, n) == 0)
            return id;
        i = (i + 1) & t->vocab_mask;
    }
}

/* Inserts id under its raw bytes; keeps the first id when two strings share the bytes. */
static void vocab_insert(pd_tokenizer *t, int32_t id)
{
    size_t n;
    const uint8_t *s = tok_bytes(t, id, &n);
    size_t i = (size_t)pd_tok_hash_bytes(s, n) & t->vocab_mask;
    for (;;) {
        int32_t other = t->vocab_tab[i];
        if (other < 0) {
            t->vocab_tab[i] = id;
            return;
        }
        size_t len;
        const uint8_t *b = tok_bytes(t, other, &len);
        if (len == n && memcmp(b, s, n) == 0)
            return;
        i = (i + 1) & t->vocab_mask;
    }
}

const pd_tok_merge *pd_tok_merge_find(const pd_tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = (size_t)hash_u64(key) & t->merge_mask;
    while (t->merge_used[i]) {
        if (t->merge_tab[i].key == key)
            return &t->merge_tab[i];
        i = (i + 1) & t->merge_mask;
    }
    return NULL;
}

/* First occurrence of a pair wins, as in HF (later duplicates would get a worse rank). */
static void merge_insert(pd_tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t new_id)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t i = (size_t)hash_u64(key) & t->merge_mask;
    while (t->merge_used[i]) {
        if (t->merge_tab[i].key == key)
            return;
        i = (i + 1) & t->merge_mask;
    }
    t->merge_used[i] = 1;
    t->merge_tab[i].key = key;
    t->merge_tab[i].rank = rank;
    t->merge_tab[i].new_id = new_id;
}

/* ---------- loading ---------- */

static pd_status read_file(const char *path, char **data, size_t *len, pd_err *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return pd_err_set(err, errno == ENOENT || errno == ENOTDIR ? PD_ERR_NOT_FOUND : PD_ERR_IO,
                          "tokenizer %s: %s", path, strerror(errno));
    pd_tok_buf b = {0};
    for (;;) {
        if (pd_tok_buf_reserve(&b, 1 << 16) != 0) {
            fclose(f);
            free(b.p);
            return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory reading", path);
        }
        size_t got = fread(b.p + b.n, 1, b.cap - b.n, f);
        b.n += got;
        if (got == 0)
            break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(b.p);
        return pd_err_set(err, PD_ERR_IO, "tokenizer %s: read failed", path);
    }
    *data = (char *)b.p;
    *len = b.n;
    return PD_OK;
}

/* Converts a tokenizer.json token string to raw bytes through the byte-level map; a string
 * with a character outside the map keeps its UTF-8 bytes (what HF's ByteLevel decoder does). */
static int token_str_to_bytes(const char *s, const int16_t c2b[PD_TOK_BYTE_CPS], pd_tok_buf *out)
{
    size_t n = strlen(s), start = out->n;
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate(p + i, (utf8proc_ssize_t)(n - i), &cp);
        if (k <= 0 || cp < 0 || cp >= PD_TOK_BYTE_CPS || c2b[cp] < 0) {
            out->n = start;
            return pd_tok_buf_put(out, s, n);
        }
        uint8_t byte = (uint8_t)c2b[cp];
        if (pd_tok_buf_put(out, &byte, 1) != 0)
            return -1;
        i += (size_t)k;
    }
    return 0;
}

static pd_status set_token(pd_tokenizer *t, int32_t id, const char *str, const uint8_t *raw,
                           size_t raw_len, pd_tok_buf *strs, pd_tok_buf *bytes, pd_err *err)
{
    if (strs->n > UINT32_MAX - strlen(str) - 1 || bytes->n > UINT32_MAX - raw_len)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: vocabulary too large", t->path);
    t->str_off[id] = (uint32_t)strs->n;
    if (pd_tok_buf_put(strs, str, strlen(str) + 1) != 0)
        return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", t->path);
    t->byte_off[id] = (uint32_t)bytes->n;
    t->byte_len[id] = (uint32_t)raw_len;
    if (pd_tok_buf_put(bytes, raw, raw_len) != 0)
        return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", t->path);
    return PD_OK;
}

static pd_status get_id(const pd_tokenizer *t, const cJSON *v, const char *field, int32_t *id,
                        pd_err *err)
{
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > (double)INT32_MAX - 1 ||
        v->valuedouble != (double)(int32_t)v->valuedouble)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: %s: expected a non-negative integer id",
                          t->path, field);
    *id = (int32_t)v->valuedouble;
    return PD_OK;
}

static int json_flag(const cJSON *obj, const char *name, int dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (cJSON_IsBool(v))
        return cJSON_IsTrue(v);
    return dflt;
}

static const char *json_type(const cJSON *obj)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, "type");
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

pd_status pd_tok_nfc(const uint8_t *s, size_t n, uint8_t **out, size_t *out_len)
{
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t r = utf8proc_map(s, (utf8proc_ssize_t)n, &dst,
                                      (utf8proc_option_t)(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (r < 0) {
        free(dst);
        return r == UTF8PROC_ERROR_NOMEM ? PD_ERR_NOMEM : PD_ERR_INTERNAL;
    }
    *out = dst;
    *out_len = (size_t)r;
    return PD_OK;
}

static pd_status load_normalizer(pd_tokenizer *t, const cJSON *norm, pd_err *err)
{
    if (norm == NULL || cJSON_IsNull(norm))
        return PD_OK;
    const char *type = json_type(norm);
    if (type == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: normalizer: missing type", t->path);
    if (strcmp(type, "NFC") == 0) {
        t->nfc = 1;
        return PD_OK;
    }
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(norm, "normalizers");
        if (!cJSON_IsArray(list))
            return pd_err_set(err, PD_ERR_INVALID,
                              "tokenizer %s: normalizer.normalizers: expected an array", t->path);
        const cJSON *n;
        cJSON_ArrayForEach(n, list) {
            const char *nt = json_type(n);
            if (nt == NULL || strcmp(nt, "NFC") != 0)
                return pd_err_set(err, PD_ERR_UNSUPPORTED,
                                  "tokenizer %s: normalizer %s is not supported (only NFC)",
                                  t->path, nt ? nt : "(no type)");
            t->nfc = 1;
        }
        return PD_OK;
    }
    return pd_err_set(err, PD_ERR_UNSUPPORTED,
                      "tokenizer %s: normalizer %s is not supported (only NFC)", t->path, type);
}

static pd_status add_split(pd_tokenizer *t, const char *pattern, size_t len, int literal,
                           pd_err *err)
{
    if (t->n_split == PD_TOK_MAX_SPLITS)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "tokenizer %s: more than %d split pre-tokenizers",
                          t->path, PD_TOK_MAX_SPLITS);
    int code;
    PCRE2_SIZE off;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, opts, &code, &off, NULL);
    if (re == NULL) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(code, msg, sizeof(msg));
        return pd_err_set(err, PD_ERR_INVALID,
                          "tokenizer %s: pre_tokenizer Split pattern: %s at offset %zu", t->path,
                          (const char *)msg, (size_t)off);
    }
    /* JIT is an optimisation; the interpreter gives the same matches when it is unavailable */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    t->split[t->n_split++] = re;
    return PD_OK;
}

static pd_status load_pretok_one(pd_tokenizer *t, const cJSON *p, int *saw_byte_level, pd_err *err)
{
    const char *type = json_type(p);
    if (type == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: pre_tokenizer: missing type", t->path);
    if (strcmp(type, "Split") == 0) {
        if (*saw_byte_level)
            return pd_err_set(err, PD_ERR_UNSUPPORTED,
                              "tokenizer %s: pre_tokenizer Split after ByteLevel is not supported",
                              t->path);
        const cJSON *beh = cJSON_GetObjectItemCaseSensitive(p, "behavior");
        if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated") != 0)
            return pd_err_set(err, PD_ERR_UNSUPPORTED,
                              "tokenizer %s: pre_tokenizer Split behavior %s is not supported "
                              "(only Isolated)", t->path,
                              cJSON_IsString(beh) ? beh->valuestring : "(missing)");
        if (json_flag(p, "invert", 0))
            return pd_err_set(err, PD_ERR_UNSUPPORTED,
                              "tokenizer %s: pre_tokenizer Split invert=true is not supported", t->path);
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
        const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
        if (cJSON_IsString(re))
            return add_split(t, re->valuestring, strlen(re->valuestring), 0, err);
        if (cJSON_IsString(lit))
            return add_split(t, lit->valuestring, strlen(lit->valuestring), 1, err);
        return pd_err_set(err, PD_ERR_INVALID,
                          "tokenizer %s: pre_tokenizer Split pattern: expected {\"Regex\": ...} or "
                          "{\"String\": ...}", t->path);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        if (json_flag(p, "add_prefix_space", 0))
            return pd_err_set(err, PD_ERR_UNSUPPORTED,
                              "tokenizer %s: pre_tokenizer ByteLevel add_prefix_space=true is not "
                              "supported", t->path);
        *saw_byte_level = 1;
        if (json_flag(p, "use_regex", 1))
            return add_split(t, TOK_GPT2_PATTERN, strlen(TOK_GPT2_PATTERN), 0, err);
        return PD_OK;
    }
    return pd_err_set(err, PD_ERR_UNSUPPORTED,
                      "tokenizer %s: pre_tokenizer %s is not supported (Split, ByteLevel)", t->path,
                      type);
}

static pd_status load_pretok(pd_tokenizer *t, const cJSON *p, pd_err *err)
{
    int saw_byte_level = 0;
    pd_status st;
    const char *type = p ? json_type(p) : NULL;
    if (type != NULL && strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
        if (!cJSON_IsArray(list))
            return pd_err_set(err, PD_ERR_INVALID,
                              "tokenizer %s: pre_tokenizer.pretokenizers: expected an array", t->path);
        const cJSON *e;
        cJSON_ArrayForEach(e, list) {
            if ((st = load_pretok_one(t, e, &saw_byte_level, err)) != PD_OK)
                return st;
        }
    } else if (p != NULL && !cJSON_IsNull(p)) {
        if ((st = load_pretok_one(t, p, &saw_byte_level, err)) != PD_OK)
            return st;
    }
    if (!saw_byte_level)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "tokenizer %s: pre_tokenizer: no ByteLevel step (only byte-level BPE is "
                          "supported)", t->path);
    return PD_OK;
}

static int added_cmp_ctx_len(const pd_tok_added *a, const pd_tok_added *b)
{
    uint8_t fa = (uint8_t)a->content[0], fb = (uint8_t)b->content[0];
    if (fa != fb)
        return fa < fb ? -1 : 1;
    if (a->len != b->len)
        return a->len > b->len ? -1 : 1;
    return 0;
}

static void added_set_build_sort(const pd_tokenizer *t, uint32_t *idx, size_t n)
{
    /* insertion sort: a handful to a few hundred tokens */
    for (size_t i = 1; i < n; i++) {
        uint32_t v = idx[i];
        size_t j = i;
        while (j > 0 && added_cmp_ctx_len(&t->added[idx[j - 1]], &t->added[v]) > 0) {
            idx[j] = idx[j - 1];
            j--;
        }
        idx[j] = v;
    }
}

static pd_status added_set_build(pd_tokenizer *t, pd_tok_added_set *set, int normalized, pd_err *err)
{
    size_t n = 0;
    set->idx = malloc((t->n_added ? t->n_added : 1) * sizeof(*set->idx));
    if (set->idx == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", t->path);
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == normalized && t->added[i].len > 0)
            set->idx[n++] = (uint32_t)i;
    added_set_build_sort(t, set->idx, n);
    size_t k = 0;
    for (int b = 0; b < 256; b++) {
        set->start[b] = (uint32_t)k;
        while (k < n && (uint8_t)t->added[set->idx[k]].content[0] == b)
            k++;
    }
    set->start[256] = (uint32_t)n;
    return PD_OK;
}

static pd_status load_added(pd_tokenizer *t, const cJSON *list, pd_tok_buf *strs, pd_tok_buf *bytes,
                            pd_err *err)
{
    pd_status st;
    size_t n = (size_t)cJSON_GetArraySize(list);
    t->added = calloc(n ? n : 1, sizeof(*t->added));
    if (t->added == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", t->path);
    const cJSON *e;
    cJSON_ArrayForEach(e, list) {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(e, "content");
        if (!cJSON_IsString(content) || content->valuestring[0] == '\0')
            return pd_err_set(err, PD_ERR_INVALID,
                              "tokenizer %s: added_tokens[%zu].content: expected a non-empty string",
                              t->path, t->n_added);
        char field[64];
        snprintf(field, sizeof(field), "added_tokens[%zu].id", t->n_added);
        int32_t id = 0;
        if ((st = get_id(t, cJSON_GetObjectItemCaseSensitive(e, "id"), field, &id, err)) != PD_OK)
            return st;
        PD_ASSERT((size_t)id < t->n_ids);
        pd_tok_added *a = &t->added[t->n_added++];
        a->id = id;
        a->special = (uint8_t)json_flag(e, "special", 0);
        a->lstrip = (uint8_t)json_flag(e, "lstrip", 0);
        a->rstrip = (uint8_t)json_flag(e, "rstrip", 0);
        a->single_word = (uint8_t)json_flag(e, "single_word", 0);
        a->normalized = (uint8_t)json_flag(e, "normalized", !a->special);
        const char *s = content->valuestring;
        size_t len = strlen(s);
        if (pd_utf8_valid_prefix(s, len) != len)
            return pd_err_set(err, PD_ERR_INVALID,
                              "tokenizer %s: added_tokens[%zu].content: invalid UTF-8", t->path,
                              t->n_added - 1);
        if (a->normalized && t->nfc) {
            uint8_t *norm;
            size_t nlen;
            if ((st = pd_tok_nfc((const uint8_t *)s, len, &norm, &nlen)) != PD_OK)
                return pd_err_set(err, st, "tokenizer %s: added token %s: normalization failed",
                                  t->path, s);
            a->content = (char *)norm;
            a->len = nlen;
        } else {
            a->content = strdup(s);
            a->len = len;
        }
        if (a->content == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", t->path);
        /* An added token may reuse a vocab id (GPT-2's <|endoftext|>): the vocab entry keeps
         * its bytes, which the vocab table is keyed on and BPE can still produce. */
        int in_vocab = t->kind[id] & PD_TOK_KIND_VOCAB;
        t->kind[id] |= PD_TOK_KIND_ADDED | (a->special ? PD_TOK_KIND_SPECIAL : 0);
        if (!in_vocab && (st = set_token(t, id, s, (const uint8_t *)s, len, strs, bytes, err)) != PD_OK)
            return st;
    }
    if ((st = added_set_build(t, &t->raw_set, 0, err)) != PD_OK)
        return st;
    return added_set_build(t, &t->norm_set, 1, err);
}

static pd_status merge_parts(const pd_tokenizer *t, const cJSON *m, size_t rank, const char **a,
                             const char **b, char *tmp, size_t tmp_cap, pd_err *err)
{
    if (cJSON_IsString(m)) {
        const char *s = m->valuestring;
        const char *sp = strchr(s, ' ');
        if (sp == NULL || strchr(sp + 1, ' ') != NULL || (size_t)(sp - s) + 1 > tmp_cap)
            return pd_err_set(err, PD_ERR_INVALID,
                              "tokenizer %s: model.merges[%zu]: expected \"left right\"", t->path, rank);
        memcpy(tmp, s, (size_t)(sp - s));
        tmp[sp - s] = '\0';
        *a = tmp;
        *b = sp + 1;
        return PD_OK;
    }
    if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(cJSON_GetArrayItem(m, 0)) &&
        cJSON_IsString(cJSON_GetArrayItem(m, 1))) {
        *a = cJSON_GetArrayItem(m, 0)->valuestring;
        *b = cJSON_GetArrayItem(m, 1)->valuestring;
        return PD_OK;
    }
    return pd_err_set(err, PD_ERR_INVALID,
                      "tokenizer %s: model.merges[%zu]: expected a string or a 2-element array",
                      t->path, rank);
}

/* Sizes the id space from both id sources, then fills the per-id tables and the vocab table. */
static pd_status load_vocab(pd_tokenizer *t, const cJSON *vocab, const cJSON *added, pd_err *err)
{
    pd_status st;
    int32_t max_id = -1, id = 0;
    size_t n_vocab = 0, k = 0;
    char field[64];
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        snprintf(field, sizeof(field), "model.vocab[%zu]", n_vocab++);
        if ((st = get_id(t, e, field, &id, err)) != PD_OK)
            return st;
        max_id = id > max_id ? id : max_id;
    }
    cJSON_ArrayForEach(e, added) {
        snprintf(field, sizeof(field), "added_tokens[%zu].id", k++);
        if ((st = get_id(t, cJSON_GetObjectItemCaseSensitive(e, "id"), field, &id, err)) != PD_OK)
            return st;
        max_id = id > max_id ? id : max_id;
    }
    if (n_vocab == 0)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: model.vocab is empty", t->path);
    /* ids index dense tables: refuse a sparse id that would make them absurdly large */
    if (max_id >= TOK_MAX_ID)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: token id %d is too large (limit %d)",
                          t->path, max_id, TOK_MAX_ID - 1);
    t->n_ids = (size_t)max_id + 1;
    t->kind = calloc(t->n_ids, 1);
    t->str_off = calloc(t->n_ids, sizeof(*t->str_off));
    t->byte_off = calloc(t->n_ids, sizeof(*t->byte_off));
    t->byte_len = calloc(t->n_ids, sizeof(*t->byte_len));
    size_t vcap = pow2_at_least(n_vocab * 2);
    t->vocab_tab = malloc(vcap * sizeof(*t->vocab_tab));
    if (!t->kind || !t->str_off || !t->byte_off || !t->byte_len || !t->vocab_tab)
        return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory for %zu ids", t->path,
                          t->n_ids);
    memset(t->vocab_tab, 0xff, vcap * sizeof(*t->vocab_tab));
    t->vocab_mask = vcap - 1;

    pd_tok_buf strs = {0}, bytes = {0}, raw = {0};
    cJSON_ArrayForEach(e, vocab) {
        id = (int32_t)e->valuedouble;
        if (t->kind[id] != PD_TOK_KIND_NONE) {
            st = pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: model.vocab: id %d used twice",
                            t->path, id);
            goto err_bufs;
        }
        raw.n = 0;
        if (token_str_to_bytes(e->string, t->c2b, &raw) != 0)
            goto err_nomem;
        t->kind[id] = PD_TOK_KIND_VOCAB;
        if ((st = set_token(t, id, e->string, raw.p, raw.n, &strs, &bytes, err)) != PD_OK)
            goto err_bufs;
    }
    if ((st = load_added(t, added, &strs, &bytes, err)) != PD_OK)
        goto err_bufs;
    if (bytes.p == NULL && pd_tok_buf_reserve(&bytes, 1) != 0)
        goto err_nomem;
    t->strs = (char *)strs.p;
    t->bytes = bytes.p;
    free(raw.p);
    for (size_t i = 0; i < t->n_ids; i++)
        if (t->kind[i] & PD_TOK_KIND_VOCAB)
            vocab_insert(t, (int32_t)i);
    for (int b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        if ((t->byte_id[b] = pd_tok_vocab_find(t, &byte, 1)) < 0)
            return pd_err_set(err, PD_ERR_UNSUPPORTED,
                              "tokenizer %s: model.vocab lacks the byte-level token for byte 0x%02x "
                              "(only byte-level BPE is supported)", t->path, b);
    }
    return PD_OK;
err_nomem:
    st = pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", t->path);
err_bufs:
    free(strs.p);
    free(bytes.p);
    free(raw.p);
    return st;
}

static pd_status load_merges(pd_tokenizer *t, const cJSON *merges, pd_err *err)
{
    pd_status st = PD_OK;
    size_t n_merges = (size_t)cJSON_GetArraySize(merges), rank = 0;
    size_t mcap = pow2_at_least(n_merges * 2);
    t->merge_tab = malloc(mcap * sizeof(*t->merge_tab));
    t->merge_used = calloc(mcap, 1);
    t->rank_new_id = malloc((n_merges ? n_merges : 1) * sizeof(*t->rank_new_id));
    if (t->merge_tab == NULL || t->merge_used == NULL || t->rank_new_id == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory for %zu merges", t->path,
                          n_merges);
    t->merge_mask = mcap - 1;
    pd_tok_buf raw = {0};
    const cJSON *e;
    cJSON_ArrayForEach(e, merges) {
        const char *a = NULL, *b = NULL;
        char tmp[1024];
        if ((st = merge_parts(t, e, rank, &a, &b, tmp, sizeof(tmp), err)) != PD_OK)
            break;
        raw.n = 0;
        int bad = token_str_to_bytes(a, t->c2b, &raw);
        size_t alen = raw.n;
        if (bad != 0 || token_str_to_bytes(b, t->c2b, &raw) != 0) {
            st = pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", t->path);
            break;
        }
        int32_t left = pd_tok_vocab_find(t, raw.p, alen);
        int32_t right = pd_tok_vocab_find(t, raw.p + alen, raw.n - alen);
        int32_t merged = pd_tok_vocab_find(t, raw.p, raw.n);
        if (left < 0 || right < 0 || merged < 0) {
            st = pd_err_set(err, PD_ERR_INVALID,
                            "tokenizer %s: model.merges[%zu] \"%s %s\": %s not in model.vocab",
                            t->path, rank, a, b,
                            left < 0 ? "left part" : right < 0 ? "right part" : "merged token");
            break;
        }
        t->rank_new_id[rank] = merged;
        merge_insert(t, left, right, (int32_t)rank++, merged);
    }
    free(raw.p);
    return st;
}

static pd_status load_model(pd_tokenizer *t, const cJSON *model, const cJSON *added,
                            pd_err *err)
{
    pd_status st;
    const char *type = json_type(model);
    if (!cJSON_IsObject(model))
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: model: expected an object", t->path);
    if (type != NULL && strcmp(type, "BPE") != 0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "tokenizer %s: model.type %s is not supported (only BPE)", t->path, type);
    const cJSON *csp = cJSON_GetObjectItemCaseSensitive(model, "continuing_subword_prefix");
    const cJSON *eow = cJSON_GetObjectItemCaseSensitive(model, "end_of_word_suffix");
    if ((cJSON_IsString(csp) && csp->valuestring[0]) || (cJSON_IsString(eow) && eow->valuestring[0]))
        return pd_err_set(err, PD_ERR_UNSUPPORTED,
                          "tokenizer %s: model: continuing_subword_prefix/end_of_word_suffix are "
                          "not supported", t->path);
    t->ignore_merges = json_flag(model, "ignore_merges", 0);
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsObject(vocab))
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: model.vocab: expected an object", t->path);
    if (!cJSON_IsArray(merges))
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: model.merges: expected an array", t->path);
    if (added != NULL && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: added_tokens: expected an array", t->path);
    byte_map_build(t->b2c, t->c2b);
    if ((st = load_vocab(t, vocab, cJSON_IsArray(added) ? added : NULL, err)) != PD_OK)
        return st;
    return load_merges(t, merges, err);
}

static pd_status load_decoder(const pd_tokenizer *t, const cJSON *dec, pd_err *err)
{
    if (dec == NULL || cJSON_IsNull(dec))
        return PD_OK;
    const char *type = json_type(dec);
    if (type != NULL && strcmp(type, "ByteLevel") == 0)
        return PD_OK;
    return pd_err_set(err, PD_ERR_UNSUPPORTED,
                      "tokenizer %s: decoder %s is not supported (only ByteLevel)", t->path,
                      type ? type : "(no type)");
}

pd_status pd_tokenizer_load(const char *path, pd_tokenizer **out, pd_err *err)
{
    pd_status st;
    struct stat sb;
    if (path == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer: no path given");
    if (stat(path, &sb) != 0)
        return pd_err_set(err, errno == ENOENT || errno == ENOTDIR ? PD_ERR_NOT_FOUND : PD_ERR_IO,
                          "tokenizer %s: %s", path, strerror(errno));
    pd_tokenizer *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "tokenizer: %zu bytes", sizeof(*t));
    size_t plen = strlen(path);
    t->path = malloc(plen + sizeof("/tokenizer.json"));
    if (t->path == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "tokenizer %s: out of memory", path);
        goto err_free_t;
    }
    memcpy(t->path, path, plen + 1);
    if (S_ISDIR(sb.st_mode))
        memcpy(t->path + plen, "/tokenizer.json", sizeof("/tokenizer.json"));

    char *data = NULL;
    size_t len = 0;
    if ((st = read_file(t->path, &data, &len, err)) != PD_OK)
        goto err_free_t;
    size_t off = 0;
    cJSON *root = pd_json_parse(data, len, &off);
    if (root == NULL) {
        st = pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: invalid JSON near byte %zu", t->path,
                        off);
        free(data);
        goto err_free_t;
    }
    free(data);
    if (!cJSON_IsObject(root)) {
        st = pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: expected a JSON object", t->path);
        goto err_free_json;
    }
    if ((st = load_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), err)) != PD_OK)
        goto err_free_json;
    if ((st = load_pretok(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), err)) != PD_OK)
        goto err_free_json;
    if ((st = load_decoder(t, cJSON_GetObjectItemCaseSensitive(root, "decoder"), err)) != PD_OK)
        goto err_free_json;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (model == NULL) {
        st = pd_err_set(err, PD_ERR_INVALID, "tokenizer %s: missing field model", t->path);
        goto err_free_json;
    }
    if ((st = load_model(t, model, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), err)) != PD_OK)
        goto err_free_json;
    cJSON_Delete(root);
    *out = t;
    return PD_OK;
err_free_json:
    cJSON_Delete(root);
err_free_t:
    pd_tokenizer_free(t);
    return st;
}

void pd_tokenizer_free(pd_tokenizer *t)
{
    if (t == NULL)
        return;
    for (size_t i = 0; i < t->n_split; i++)
        pcre2_code_free(t->split[i]);
    for (size_t i = 0; i < t->n_added; i++)
        free(t->added[i].content);
    free(t->added);
    free(t->raw_set.idx);
    free(t->norm_set.idx);
    free(t->merge_tab);
    free(t->merge_used);
    free(t->rank_new_id);
    free(t->vocab_tab);
    free(t->kind);
    free(t->str_off);
    free(t->byte_off);
    free(t->byte_len);
    free(t->strs);
    free(t->bytes);
    free(t->path);
    free(t);
}

/* ---------- decode ---------- */

static pd_status id_check(const pd_tokenizer *t, int32_t id, pd_err *err)
{
    if (id < 0 || (size_t)id >= t->n_ids || t->kind[id] == PD_TOK_KIND_NONE)
        return pd_err_set(err, PD_ERR_INVALID,
                          "tokenizer decode: token id %d is not in the vocabulary (size %zu)", id,
                          t->n_ids);
    return PD_OK;
}

pd_status pd_tokenizer_decode(const pd_tokenizer *t, const int32_t *ids, size_t n,
                              int skip_special, char **text_out, size_t *len_out, pd_err *err)
{
    pd_status st;
    pd_tok_buf raw = {0}, txt = {0};
    for (size_t i = 0; i < n; i++) {
        if ((st = id_check(t, ids[i], err)) != PD_OK)
            goto err_free;
        if (skip_special && (t->kind[ids[i]] & PD_TOK_KIND_SPECIAL))
            continue;
        size_t blen;
        const uint8_t *b = tok_bytes(t, ids[i], &blen);
        if (pd_tok_buf_put(&raw, b, blen) != 0) {
            st = pd_err_set(err, PD_ERR_NOMEM, "tokenizer decode: out of memory");
            goto err_free;
        }
    }
    if (pd_tok_utf8_lossy_append(&txt, raw.p, raw.n, 1) == (size_t)-1 || pd_tok_buf_reserve(&txt, 1) != 0) {
        st = pd_err_set(err, PD_ERR_NOMEM, "tokenizer decode: out of memory");
        goto err_free;
    }
    txt.p[txt.n] = '\0';
    free(raw.p);
    *text_out = (char *)txt.p;
    if (len_out != NULL)
        *len_out = txt.n;
    return PD_OK;
err_free:
    free(raw.p);
    free(txt.p);
    return st;
}

size_t pd_tokenizer_vocab_size(const pd_tokenizer *t)
{
    return t->n_ids;
}

const char *pd_tokenizer_id_to_token(const pd_tokenizer *t, int32_t id)
{
    if (id < 0 || (size_t)id >= t->n_ids || t->kind[id] == PD_TOK_KIND_NONE)
        return NULL;
    return t->strs + t->str_off[id];
}

const uint8_t *pd_tokenizer_token_bytes(const pd_tokenizer *t, int32_t id, size_t *len)
{
    *len = 0;
    if (id < 0 || (size_t)id >= t->n_ids || t->kind[id] == PD_TOK_KIND_NONE)
        return NULL;
    return tok_bytes(t, id, len);
}

int32_t pd_tokenizer_token_to_id(const pd_tokenizer *t, const char *token)
{
    if (token == NULL)
        return -1;
    size_t len = strlen(token);
    for (size_t i = 0; i < t->n_added; i++) {
        const char *s = t->strs + t->str_off[t->added[i].id];
        if (strcmp(s, token) == 0)
            return t->added[i].id;
    }
    pd_tok_buf raw = {0};
    if (token_str_to_bytes(token, t->c2b, &raw) != 0) {
        free(raw.p);
        return -1;
    }
    int32_t id = pd_tok_vocab_find(t, raw.p ? raw.p : (const uint8_t *)"", raw.n);
    free(raw.p);
    /* several strings can share raw bytes; only the exact string names the id */
    if (id >= 0 && strncmp(t->strs + t->str_off[id], token, len + 1) != 0)
        return -1;
    return id;
}

int pd_tokenizer_is_special(const pd_tokenizer *t, int32_t id)
{
    return id >= 0 && (size_t)id < t->n_ids && (t->kind[id] & PD_TOK_KIND_SPECIAL) != 0;
}

/* ---------- streaming detokenizer ---------- */

char *pd_text_nul_mark(const char *s, size_t n)
{
    size_t nul = 0;
    for (size_t i = 0; i < n; i++)
        nul += s[i] == '\0';
    char *o = malloc(n + nul + 1);
    if (o == NULL)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\0') {
            o[k++] = PD_TEXT_NUL[0];
            o[k++] = PD_TEXT_NUL[1];
        } else {
            o[k++] = s[i];
        }
    }
    o[k] = '\0';
    return o;
}

size_t pd_text_nul_unmark(char *s, size_t n, int drop)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (i + 1 < n && s[i] == PD_TEXT_NUL[0] && s[i + 1] == PD_TEXT_NUL[1]) {
            if (!drop)
                s[k++] = '\0';
            i++;
        } else {
            s[k++] = s[i];
        }
    }
    s[k] = '\0';
    return k;
}

struct pd_detok {
    const pd_tokenizer *t;
    int skip_special;
    uint8_t pend[4];      /* an incomplete UTF-8 prefix: at most 3 bytes */
    size_t n_pend;
};

pd_status pd_detok_create(const pd_tokenizer *t, pd_detok **out, pd_err *err)
{
    pd_detok *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "detok: %zu bytes", sizeof(*d));
    d->t = t;
    *out = d;
    return PD_OK;
}

void pd_detok_set_skip_special(pd_detok *d, int skip_special)
{
    d->skip_special = skip_special;
}

static pd_status detok_emit(pd_detok *d, const uint8_t *b, size_t blen, int final,
                            char **text_out, pd_err *err)
{
    pd_tok_buf in = {0}, txt = {0};
    if (pd_tok_buf_put(&in, d->pend, d->n_pend) != 0 || pd_tok_buf_put(&in, b, blen) != 0)
        goto err_nomem;
    size_t used = pd_tok_utf8_lossy_append(&txt, in.p, in.n, final);
    if (used == (size_t)-1 || pd_tok_buf_reserve(&txt, 1) != 0)
        goto err_nomem;
    PD_ASSERT(in.n - used < sizeof(d->pend));
    d->n_pend = in.n - used;
    if (d->n_pend > 0)
        memcpy(d->pend, in.p + used, d->n_pend);
    txt.p[txt.n] = '\0';
    free(in.p);
    /* the text goes out as a C string: a NUL byte (the byte-0 token) as PD_TEXT_NUL (a copy
     * only then: a token's text rarely holds one) */
    if (memchr(txt.p, 0, txt.n) != NULL) {
        char *out = pd_text_nul_mark((const char *)txt.p, txt.n);
        free(txt.p);
        if (out == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "detok: out of memory");
        *text_out = out;
        return PD_OK;
    }
    *text_out = (char *)txt.p;
    return PD_OK;
err_nomem:
    free(in.p);
    free(txt.p);
    return pd_err_set(err, PD_ERR_NOMEM, "detok: out of memory");
}

pd_status pd_detok_push(pd_detok *d, int32_t id, char **text_out, pd_err *err)
{
    pd_status st = id_check(d->t, id, err);
    if (st != PD_OK)
        return st;
    size_t blen = 0;
    const uint8_t *b = tok_bytes(d->t, id, &blen);
    if (d->skip_special && (d->t->kind[id] & PD_TOK_KIND_SPECIAL))
        blen = 0;
    return detok_emit(d, b, blen, 0, text_out, err);
}

pd_status pd_detok_flush(pd_detok *d, char **text_out, pd_err *err)
{
    return detok_emit(d, NULL, 0, 1, text_out, err);
}

void pd_detok_destroy(pd_detok *d)
{
    free(d);
}
