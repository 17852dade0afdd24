/* pd_tokenizer_encode.c - text to token ids with a loaded tokenizer (pd_tokenizer_encode).
 * Owns: added-token matching (leftmost-longest, lstrip/rstrip/single_word), NFC of the
 *       normalized segments, the chained regex pre-tokenizer splits, rank-ordered BPE merging
 *       (a heap of candidate pairs) and the per-call word cache.
 * Not here: loading the tokenizer and decoding (pd_tokenizer.c).
 * Threading: every call keeps its scratch (regex match data, BPE heap, word cache) in its own
 *       context, so calls from many threads need no lock. */
#include "pd_tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#define TOK_CACHE_MAX_WORD 256    /* longer words are not worth caching */
#define TOK_CACHE_MAX_ENTRIES (1u << 17)   /* bounds the per-call cache to a few MB */

typedef struct {
    int32_t id;
    int32_t prev, next;
    int alive;
} bpe_sym;

/* A queued merge: (rank << 32) | position, so one integer compare orders by rank, then
 * leftmost; the merged id comes from pd_tokenizer.rank_new_id. */
typedef uint64_t bpe_cand;

typedef struct {
    uint64_t h;
    uint32_t key_off, key_len;   /* key_len 0: empty slot */
    uint32_t ids_off, ids_n;
} cache_slot;

typedef struct {
    const pd_tokenizer *t;
    int parse_special;
    pd_tok_ids out;
    pcre2_match_data *md[PD_TOK_MAX_SPLITS];
    bpe_sym *sym;
    size_t sym_cap;
    bpe_cand *heap;
    size_t heap_n, heap_cap;
    cache_slot *cache;
    size_t cache_cap, cache_n;
    pd_tok_buf cache_keys;
    pd_tok_ids cache_ids;
    pd_err *err;
} enc_ctx;

static pd_status enc_nomem(enc_ctx *c)
{
    return pd_err_set(c->err, PD_ERR_NOMEM, "tokenizer encode: out of memory");
}

static int heap_reserve(enc_ctx *c, size_t n)
{
    if (n <= c->heap_cap)
        return 0;
    size_t cap = c->heap_cap ? c->heap_cap : 64;
    while (cap < n)
        cap *= 2;
    bpe_cand *h = realloc(c->heap, cap * sizeof(*h));
    if (h == NULL)
        return -1;
    c->heap = h;
    c->heap_cap = cap;
    return 0;
}

/* A 4-ary min-heap: half the levels of a binary one, and the four children of a node share
 * a cache line, which matters for the million-candidate heaps of a huge pre-token. */
static void heap_sift_down(bpe_cand *h, size_t n, size_t i)
{
    bpe_cand v = h[i];
    for (;;) {
        size_t first = 4 * i + 1, m = first;
        if (first >= n)
            break;
        size_t end = first + 4 < n ? first + 4 : n;
        for (size_t k = first + 1; k < end; k++)
            if (h[k] < h[m])
                m = k;
        if (h[m] >= v)
            break;
        h[i] = h[m];
        i = m;
    }
    h[i] = v;
}

static int heap_push(enc_ctx *c, bpe_cand v)
{
    if (heap_reserve(c, c->heap_n + 1) != 0)
        return -1;
    size_t i = c->heap_n++;
    while (i > 0 && v < c->heap[(i - 1) / 4]) {
        c->heap[i] = c->heap[(i - 1) / 4];
        i = (i - 1) / 4;
    }
    c->heap[i] = v;
    return 0;
}

static bpe_cand heap_pop(enc_ctx *c)
{
    bpe_cand top = c->heap[0];
    c->heap[0] = c->heap[--c->heap_n];
    if (c->heap_n > 1)
        heap_sift_down(c->heap, c->heap_n, 0);
    return top;
}

/* The candidate for merging sym[left] with its right neighbour, or 0 when there is none
 * (a real candidate is never 0: rank 0 at position 0 is stored with the +1 bias below). */
static bpe_cand pair_cand(const enc_ctx *c, int32_t left)
{
    int32_t right = c->sym[left].next;
    if (right < 0)
        return 0;
    const pd_tok_merge *m = pd_tok_merge_find(c->t, c->sym[left].id, c->sym[right].id);
    if (m == NULL)
        return 0;
    return ((uint64_t)(uint32_t)m->rank << 32 | (uint32_t)left) + 1;
}

static int push_pair(enc_ctx *c, int32_t left)
{
    bpe_cand v = pair_cand(c, left);
    return v == 0 ? 0 : heap_push(c, v);
}

/* Rank-ordered BPE over one pre-token, as HF's Word::merge_all: always apply the lowest-rank
 * applicable merge, leftmost first on ties; a queued candidate is stale when its left symbol
 * died, lost its neighbour, or the pair no longer merges to the same id. */
static pd_status bpe_word(enc_ctx *c, const uint8_t *s, size_t n, pd_tok_ids *dst)
{
    const pd_tokenizer *t = c->t;
    if (n > (size_t)INT32_MAX)
        return pd_err_set(c->err, PD_ERR_INVALID, "tokenizer encode: pre-token of %zu bytes", n);
    if (n > c->sym_cap) {
        bpe_sym *sym = realloc(c->sym, n * sizeof(*sym));
        if (sym == NULL)
            return enc_nomem(c);
        c->sym = sym;
        c->sym_cap = n;
    }
    for (size_t i = 0; i < n; i++) {
        c->sym[i].id = t->byte_id[s[i]];
        c->sym[i].prev = (int32_t)i - 1;
        c->sym[i].next = (i + 1 < n) ? (int32_t)i + 1 : -1;
        c->sym[i].alive = 1;
    }
    /* the first candidates arrive in position order: heapify them in O(n) */
    if (heap_reserve(c, n) != 0)
        return enc_nomem(c);
    c->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        bpe_cand v = pair_cand(c, (int32_t)i);
        if (v != 0)
            c->heap[c->heap_n++] = v;
    }
    for (size_t i = c->heap_n / 4 + 1; i-- > 0;)
        if (i < c->heap_n)
            heap_sift_down(c->heap, c->heap_n, i);
    while (c->heap_n > 0) {
        bpe_cand top = heap_pop(c) - 1;
        int32_t pos = (int32_t)(uint32_t)top;
        int32_t new_id = t->rank_new_id[top >> 32];
        bpe_sym *l = &c->sym[pos];
        if (!l->alive || l->next < 0)
            continue;
        bpe_sym *r = &c->sym[l->next];
        const pd_tok_merge *m = pd_tok_merge_find(t, l->id, r->id);
        if (m == NULL || m->new_id != new_id)
            continue;
        l->id = new_id;
        r->alive = 0;
        l->next = r->next;
        if (r->next >= 0)
            c->sym[r->next].prev = pos;
        if (l->prev >= 0 && push_pair(c, l->prev) != 0)
            return enc_nomem(c);
        if (push_pair(c, pos) != 0)
            return enc_nomem(c);
    }
    for (int32_t i = 0; i >= 0; i = c->sym[i].next)
        if (pd_tok_ids_push(dst, c->sym[i].id) != 0)
            return enc_nomem(c);
    return PD_OK;
}

static pd_status cache_grow(enc_ctx *c)
{
    size_t cap = c->cache_cap ? c->cache_cap * 2 : 1024;
    cache_slot *tab = calloc(cap, sizeof(*tab));
    if (tab == NULL)
        return enc_nomem(c);
    for (size_t i = 0; i < c->cache_cap; i++) {
        if (c->cache[i].key_len == 0)
            continue;
        size_t j = (size_t)c->cache[i].h & (cap - 1);
        while (tab[j].key_len != 0)
            j = (j + 1) & (cap - 1);
        tab[j] = c->cache[i];
    }
    free(c->cache);
    c->cache = tab;
    c->cache_cap = cap;
    return PD_OK;
}

/* One pre-token: the per-call cache first (text repeats words a lot), then BPE. */
static pd_status enc_word(enc_ctx *c, const uint8_t *s, size_t n)
{
    const pd_tokenizer *t = c->t;
    pd_status st;
    if (n == 0)
        return PD_OK;
    if (n == 1)
        return pd_tok_ids_push(&c->out, t->byte_id[s[0]]) == 0 ? PD_OK : enc_nomem(c);
    if (t->ignore_merges) {
        int32_t id = pd_tok_vocab_find(t, s, n);
        if (id >= 0)
            return pd_tok_ids_push(&c->out, id) == 0 ? PD_OK : enc_nomem(c);
    }
    if (n > TOK_CACHE_MAX_WORD || c->cache_n >= TOK_CACHE_MAX_ENTRIES)
        return bpe_word(c, s, n, &c->out);
    if (c->cache_cap == 0 && (st = cache_grow(c)) != PD_OK)
        return st;
    uint64_t h = pd_tok_hash_bytes(s, n);
    size_t j = (size_t)h & (c->cache_cap - 1);
    while (c->cache[j].key_len != 0) {
        cache_slot *e = &c->cache[j];
        if (e->h == h && e->key_len == n && memcmp(c->cache_keys.p + e->key_off, s, n) == 0) {
            for (uint32_t k = 0; k < e->ids_n; k++)
                if (pd_tok_ids_push(&c->out, c->cache_ids.v[e->ids_off + k]) != 0)
                    return enc_nomem(c);
            return PD_OK;
        }
        j = (j + 1) & (c->cache_cap - 1);
    }
    size_t ids_off = c->cache_ids.n;
    if ((st = bpe_word(c, s, n, &c->cache_ids)) != PD_OK)
        return st;
    for (size_t k = ids_off; k < c->cache_ids.n; k++)
        if (pd_tok_ids_push(&c->out, c->cache_ids.v[k]) != 0)
            return enc_nomem(c);
    if (c->cache_keys.n + n > UINT32_MAX || c->cache_ids.n > UINT32_MAX)
        return PD_OK;
    size_t key_off = c->cache_keys.n;
    if (pd_tok_buf_put(&c->cache_keys, s, n) != 0)
        return enc_nomem(c);
    c->cache[j] = (cache_slot){h, (uint32_t)key_off, (uint32_t)n, (uint32_t)ids_off,
                               (uint32_t)(c->cache_ids.n - ids_off)};
    c->cache_n++;
    if (c->cache_n * 2 > c->cache_cap)
        return cache_grow(c);
    return PD_OK;
}

/* Split level `level` (Isolated: matches and the gaps between them are both pieces). */
static pd_status enc_split(enc_ctx *c, size_t level, const uint8_t *s, size_t n)
{
    if (level == c->t->n_split)
        return enc_word(c, s, n);
    pd_status st;
    pcre2_code *re = c->t->split[level];
    size_t last = 0, off = 0;
    while (off < n) {
        int rc = pcre2_match(re, s, n, off, PCRE2_NO_UTF_CHECK, c->md[level], NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(rc, msg, sizeof(msg));
            return pd_err_set(c->err, PD_ERR_INTERNAL, "tokenizer encode: regex match: %s",
                              (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md[level]);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) {
            /* an empty match yields no piece; step over one character */
            off = ms + 1;
            while (off < n && (s[off] & 0xC0) == 0x80)
                off++;
            continue;
        }
        if (ms > last && (st = enc_split(c, level + 1, s + last, ms - last)) != PD_OK)
            return st;
        if ((st = enc_split(c, level + 1, s + ms, me - ms)) != PD_OK)
            return st;
        last = off = me;
    }
    if (last < n)
        return enc_split(c, level + 1, s + last, n - last);
    return PD_OK;
}

typedef pd_status (*seg_fn)(enc_ctx *c, const uint8_t *s, size_t n);

/* Finds the added tokens of `set` in s (leftmost-longest, non-overlapping, like HF's
 * Aho-Corasick pass), emits their ids and hands the text between them to fn. A match that is
 * skipped (special with parse_special off, or a single_word token inside a word) still
 * consumes its bytes, as in HF. */
static pd_status enc_added(enc_ctx *c, const pd_tok_added_set *set, const uint8_t *s, size_t n,
                           seg_fn fn)
{
    const pd_tokenizer *t = c->t;
    pd_status st;
    size_t start_off = 0, i = 0;
    if (set->start[256] == 0)
        return fn(c, s, n);
    while (i < n) {
        uint8_t b = s[i];
        const pd_tok_added *hit = NULL;
        for (uint32_t k = set->start[b]; k < set->start[b + 1]; k++) {
            const pd_tok_added *a = &t->added[set->idx[k]];
            if (a->len <= n - i && memcmp(s + i, a->content, a->len) == 0) {
                hit = a;
                break;
            }
        }
        if (hit == NULL) {
            i++;
            continue;
        }
        size_t ms = i, me = i + hit->len;
        i = me;
        if (hit->special && !c->parse_special)
            continue;
        if (hit->single_word) {
            int32_t cp;
            int word_before = ms > 0 && (pd_tok_utf8_prev(s, ms, &cp), pd_tok_is_word_char(cp));
            int word_after = me < n && utf8proc_iterate(s + me, (utf8proc_ssize_t)(n - me), &cp) > 0 &&
                             pd_tok_is_word_char(cp);
            if (word_before || word_after)
                continue;
        }
        if (hit->lstrip) {
            size_t ns = ms;
            while (ns > 0) {
                int32_t cp;
                size_t p = pd_tok_utf8_prev(s, ns, &cp);
                if (!pd_tok_is_white_space(cp))
                    break;
                ns = p;
            }
            ms = ns > start_off ? ns : start_off;
        }
        if (hit->rstrip) {
            while (me < n) {
                int32_t cp;
                utf8proc_ssize_t k = utf8proc_iterate(s + me, (utf8proc_ssize_t)(n - me), &cp);
                if (k <= 0 || !pd_tok_is_white_space(cp))
                    break;
                me += (size_t)k;
            }
            i = me;
        }
        if (ms > start_off && (st = fn(c, s + start_off, ms - start_off)) != PD_OK)
            return st;
        if (pd_tok_ids_push(&c->out, hit->id) != 0)
            return enc_nomem(c);
        start_off = me;
    }
    if (start_off < n)
        return fn(c, s + start_off, n - start_off);
    return PD_OK;
}

static pd_status enc_pretok(enc_ctx *c, const uint8_t *s, size_t n)
{
    return enc_split(c, 0, s, n);
}

/* Text between raw added tokens: NFC, then normalized added tokens, then pre-tokenize. */
static pd_status enc_segment(enc_ctx *c, const uint8_t *s, size_t n)
{
    size_t ascii = 0;
    while (ascii < n && s[ascii] < 0x80)
        ascii++;
    if (!c->t->nfc || ascii == n)   /* ASCII text is already NFC */
        return enc_added(c, &c->t->norm_set, s, n, enc_pretok);
    uint8_t *norm;
    size_t nlen;
    pd_status st = pd_tok_nfc(s, n, &norm, &nlen);
    if (st != PD_OK)
        return pd_err_set(c->err, st, "tokenizer encode: NFC normalization failed");
    st = enc_added(c, &c->t->norm_set, norm, nlen, enc_pretok);
    free(norm);
    return st;
}

pd_status pd_tokenizer_encode(const pd_tokenizer *t, const char *text, size_t len,
                              int parse_special, int32_t **ids_out, size_t *n_out, pd_err *err)
{
    pd_status st = PD_OK;
    enc_ctx c;
    memset(&c, 0, sizeof(c));
    c.t = t;
    c.parse_special = parse_special;
    c.err = err;
    uint8_t *fixed = NULL;
    const uint8_t *s = (const uint8_t *)text;
    if (len > 0 && text == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "tokenizer encode: NULL text of %zu bytes", len);
    if (pd_utf8_valid_prefix(s, len) != len) {
        pd_tok_buf b = {0};
        if (pd_tok_utf8_lossy_append(&b, s, len, 1) == (size_t)-1) {
            free(b.p);
            return enc_nomem(&c);
        }
        fixed = b.p;
        s = fixed;
        len = b.n;
    }
    for (size_t i = 0; i < t->n_split; i++) {
        c.md[i] = pcre2_match_data_create_from_pattern(t->split[i], NULL);
        if (c.md[i] == NULL) {
            st = enc_nomem(&c);
            goto out;
        }
    }
    if (pd_tok_ids_push(&c.out, 0) != 0) {   /* guarantees a non-NULL array for empty text */
        st = enc_nomem(&c);
        goto out;
    }
    c.out.n = 0;
    if (len > 0)
        st = enc_added(&c, &t->raw_set, s, len, enc_segment);
out:
    for (size_t i = 0; i < t->n_split; i++)
        pcre2_match_data_free(c.md[i]);
    free(c.sym);
    free(c.heap);
    free(c.cache);
    free(c.cache_keys.p);
    free(c.cache_ids.v);
    free(fixed);
    if (st != PD_OK) {
        free(c.out.v);
        return st;
    }
    *ids_out = c.out.v;
    *n_out = c.out.n;
    return PD_OK;
}
