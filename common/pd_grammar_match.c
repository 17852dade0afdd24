/* pd_grammar_match.c - following text through a grammar, and the tokens it allows next
 *   (pd_grammar_match.h).
 * Owns: the vocabulary as a byte trie (pd_gvocab), the matcher (a set of rule stacks, expanded
 *   until every top is a byte class; the layout in pd_grammar_internal.h), advancing it by a
 *   token, and the allowed-token mask: a walk of the trie over interned states, the matcher's
 *   own recent masks, and the masks every matcher of a grammar shares (struct pd_gshared).
 * Not here: building grammars (pd_grammar.c and the compilers), applying a mask to logits
 *   (kern_token_mask, pd_engine_logits.c).
 * Threading: a vocabulary is immutable once built and may be shared between threads; a
 *   matcher belongs to one request; a grammar's shared masks are behind their own lock. */
#include "pd_grammar_match.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pd_grammar_internal.h"

#define G_MAX_STACK 256      /* positions on one stack (nesting deeper is not allowed) */
#define G_MAX_CHAIN 256      /* rule references expanded without a byte between them */
#define G_MAX_STACKS 4096    /* stacks alive at once */

/* ---- the vocabulary ------------------------------------------------------------------------- */

struct pd_gvocab {
    int n_vocab, words;
    int n_nodes, cap_nodes;
    int32_t *child, *sib, *tok_head;   /* per trie node: first child, next sibling, first token
                                        * (while building; then breadth-first order, ... */
    int32_t *first, *nchild;           /* ... a node's children at first .. first + nchild) */
    uint8_t *byte;                     /* per node: the byte that leads to it */
    int32_t *tok_next;                 /* per token: the next token of the same node */
    int32_t *tok_node;                 /* per token: its node, -1 when not in the trie */
    uint8_t *bytes;                    /* every token's bytes, token t's at boff[t] .. boff[t + 1] */
    size_t *boff;
    int32_t *eos;
    int n_eos;
    int max_len;
    uint64_t id;                       /* unique in the process (the shared mask cache's key) */
};

static atomic_ullong next_vocab_id = 1;

static int v_node(pd_gvocab *v, int parent, uint8_t c)
{
    for (int k = v->child[parent]; k >= 0; k = v->sib[k])
        if (v->byte[k] == c)
            return k;
    if (v->n_nodes == v->cap_nodes) {
        int nc = v->cap_nodes * 2;
        int32_t *a = realloc(v->child, (size_t)nc * 4), *b2 = a ? realloc(v->sib, (size_t)nc * 4) : NULL;
        if (a) v->child = a;
        if (b2) v->sib = b2;
        int32_t *c3 = b2 ? realloc(v->tok_head, (size_t)nc * 4) : NULL;
        if (c3) v->tok_head = c3;
        uint8_t *d = c3 ? realloc(v->byte, (size_t)nc) : NULL;
        if (d == NULL)
            return -1;
        v->byte = d;
        v->cap_nodes = nc;
    }
    int k = v->n_nodes++;
    v->child[k] = -1;
    v->tok_head[k] = -1;
    v->byte[k] = c;
    v->sib[k] = v->child[parent];
    v->child[parent] = k;
    return k;
}

pd_status pd_gvocab_create_raw(const uint8_t *const *tok, const size_t *len, int n_vocab,
                               const int32_t *eos, int n_eos, pd_gvocab **out, pd_err *err)
{
    if (n_vocab <= 0 || n_eos < 0)
        return pd_err_set(err, PD_ERR_INVALID, "grammar vocabulary of %d tokens", n_vocab);
    pd_gvocab *v = calloc(1, sizeof(*v));
    if (v == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "grammar vocabulary");
    v->n_vocab = n_vocab;
    v->words = (n_vocab + 31) / 32;
    v->id = atomic_fetch_add(&next_vocab_id, 1);
    v->cap_nodes = 1024;
    v->child = malloc((size_t)v->cap_nodes * 4);
    v->sib = malloc((size_t)v->cap_nodes * 4);
    v->tok_head = malloc((size_t)v->cap_nodes * 4);
    v->byte = malloc((size_t)v->cap_nodes);
    v->tok_next = malloc((size_t)n_vocab * 4);
    v->tok_node = malloc((size_t)n_vocab * 4);
    v->eos = malloc((size_t)(n_eos + 1) * 4);
    v->boff = calloc((size_t)n_vocab + 1, sizeof(size_t));
    size_t total = 0;
    for (int t = 0; t < n_vocab; t++)
        total += tok[t] != NULL ? len[t] : 0;
    v->bytes = malloc(total + 1);
    int ok = v->child && v->sib && v->tok_head && v->byte && v->tok_next && v->tok_node && v->eos &&
             v->boff && v->bytes;
    if (ok) {
        v->n_nodes = 1;
        v->child[0] = -1;
        v->sib[0] = -1;
        v->tok_head[0] = -1;
        v->byte[0] = 0;
        memcpy(v->eos, eos, (size_t)n_eos * 4);
        v->n_eos = n_eos;
    }
    for (int t = 0; t < n_vocab && ok; t++) {
        v->tok_node[t] = -1;
        v->boff[t + 1] = v->boff[t];
        int is_eos = 0;
        for (int e = 0; e < n_eos; e++)
            is_eos |= eos[e] == t;
        if (tok[t] == NULL || len[t] == 0 || is_eos)
            continue;
        int node = 0;
        for (size_t i = 0; i < len[t] && node >= 0; i++)
            node = v_node(v, node, tok[t][i]);
        if (node < 0) {
            ok = 0;
            break;
        }
        memcpy(v->bytes + v->boff[t], tok[t], len[t]);
        v->boff[t + 1] += len[t];
        v->tok_node[t] = node;
        v->tok_next[t] = v->tok_head[node];
        v->tok_head[node] = t;
        if ((int)len[t] > v->max_len)
            v->max_len = (int)len[t];
    }
    /* breadth-first renumbering: a node's children side by side (the mask walk reads them in
     * order instead of chasing sibling links) */
    int32_t *order = ok ? malloc((size_t)v->n_nodes * 4) : NULL, *newid = ok ? malloc((size_t)v->n_nodes * 4) : NULL;
    v->first = ok ? malloc((size_t)v->n_nodes * 4) : NULL;
    v->nchild = ok ? malloc((size_t)v->n_nodes * 4) : NULL;
    uint8_t *nbyte = ok ? malloc((size_t)v->n_nodes) : NULL;
    int32_t *nhead = ok ? malloc((size_t)v->n_nodes * 4) : NULL;
    ok = ok && order && newid && v->first && v->nchild && nbyte && nhead;
    if (ok) {
        int n = 1;
        order[0] = 0;
        newid[0] = 0;
        for (int q = 0; q < n; q++) {
            int old = order[q];
            v->first[q] = n;
            int c = 0;
            for (int k = v->child[old]; k >= 0; k = v->sib[k], c++) {
                newid[k] = n;
                order[n++] = k;
            }
            v->nchild[q] = c;
        }
        for (int q = 0; q < n; q++) {
            nbyte[q] = v->byte[order[q]];
            nhead[q] = v->tok_head[order[q]];
        }
        for (int t = 0; t < n_vocab; t++)
            if (v->tok_node[t] >= 0)
                v->tok_node[t] = newid[v->tok_node[t]];
        free(v->byte);
        free(v->tok_head);
        v->byte = nbyte;
        v->tok_head = nhead;
        nbyte = NULL;
        nhead = NULL;
    }
    free(order);
    free(newid);
    free(nbyte);
    free(nhead);
    free(v->child);
    free(v->sib);
    v->child = v->sib = NULL;
    if (!ok) {
        pd_gvocab_destroy(v);
        return pd_err_set(err, PD_ERR_NOMEM, "grammar vocabulary trie");
    }
    *out = v;
    return PD_OK;
}

pd_status pd_gvocab_create(const pd_tokenizer *t, int n_vocab, const int32_t *eos, int n_eos,
                           pd_gvocab **out, pd_err *err)
{
    const uint8_t **tok = calloc((size_t)(n_vocab > 0 ? n_vocab : 1), sizeof(*tok));
    size_t *len = calloc((size_t)(n_vocab > 0 ? n_vocab : 1), sizeof(*len));
    if (tok == NULL || len == NULL) {
        free(tok);
        free(len);
        return pd_err_set(err, PD_ERR_NOMEM, "grammar vocabulary");
    }
    for (int i = 0; i < n_vocab; i++)
        if (!pd_tokenizer_is_special(t, i))
            tok[i] = pd_tokenizer_token_bytes(t, i, &len[i]);
    pd_status st = pd_gvocab_create_raw(tok, len, n_vocab, eos, n_eos, out, err);
    free(tok);
    free(len);
    return st;
}

void pd_gvocab_destroy(pd_gvocab *v)
{
    if (v == NULL)
        return;
    free(v->child);
    free(v->sib);
    free(v->first);
    free(v->nchild);
    free(v->tok_head);
    free(v->byte);
    free(v->tok_next);
    free(v->tok_node);
    free(v->eos);
    free(v->bytes);
    free(v->boff);
    free(v);
}

int pd_gvocab_words(const pd_gvocab *v) { return v->words; }

/* ---- matching ------------------------------------------------------------------------------- */

typedef struct {
    int32_t *pos;     /* stack i: pos[off[i] .. off[i + 1]), its top last */
    int32_t *off;     /* [n + 1] */
    int n, cap_off, n_pos, cap_pos;
    int complete;     /* a stack emptied: the grammar may end here */
} gstate;

struct pd_gmatch {
    pd_grammar *g;
    gstate st, a, b;
    int32_t *scratch; /* [G_MAX_CHAIN + 2][G_MAX_STACK] stacks, then [G_MAX_CHAIN + 2][2]
                       * (rule, stack length) of each chain level (expand) */
    struct {          /* pd_gmatch_allowed's recent masks, by state */
        gstate key;
        uint64_t hash;
        const pd_gvocab *vocab;
        uint32_t *bits;
        int words;
    } cache[8];
    int cache_next;
};

static void gs_free(gstate *s)
{
    free(s->pos);
    free(s->off);
}

static void gs_clear(gstate *s)
{
    s->n = 0;
    s->n_pos = 0;
    s->complete = 0;
    if (s->off != NULL)
        s->off[0] = 0;
}

/* -1 NOMEM, -2 too many stacks */
static int gs_emit(gstate *s, const int32_t *w, int len)
{
    if (len == 0) {
        s->complete = 1;
        return 0;
    }
    for (int i = 0; i < s->n; i++)
        if (s->off[i + 1] - s->off[i] == len && memcmp(s->pos + s->off[i], w, (size_t)len * 4) == 0)
            return 0;
    if (s->n >= G_MAX_STACKS)
        return -2;
    if (pd_grammar_grow((void **)&s->off, &s->cap_off, s->n + 2, 4) != 0 ||
        pd_grammar_grow((void **)&s->pos, &s->cap_pos, s->n_pos + len, 4) != 0)
        return -1;
    if (s->n == 0)
        s->off[0] = 0;
    memcpy(s->pos + s->n_pos, w, (size_t)len * 4);
    s->n_pos += len;
    s->off[++s->n] = s->n_pos;
    return 0;
}

static int gs_copy(gstate *d, const gstate *s)
{
    gs_clear(d);
    if (pd_grammar_grow((void **)&d->off, &d->cap_off, s->n + 1, 4) != 0 ||
        pd_grammar_grow((void **)&d->pos, &d->cap_pos, s->n_pos > 0 ? s->n_pos : 1, 4) != 0)
        return -1;
    d->off[0] = 0;
    if (s->n > 0) {
        memcpy(d->off, s->off, (size_t)(s->n + 1) * 4);
        memcpy(d->pos, s->pos, (size_t)s->n_pos * 4);
    }
    d->n = s->n;
    d->n_pos = s->n_pos;
    d->complete = s->complete;
    return 0;
}

/* expand the stack w[0..len) (scratch row `chain`, which it may overwrite) until its top is a
 * byte class, into dst. -1 NOMEM, -2 too many stacks, -3 references chain without bytes */
static int expand(const pd_grammar *g, gstate *dst, int32_t *scratch, int chain, int len)
{
    int32_t *w = scratch + (size_t)chain * G_MAX_STACK;
    for (;;) {
        if (len == 0)
            return gs_emit(dst, w, 0);
        int p = w[len - 1];
        const pd_gel *e = &g->el[p];
        if (e->kind == PD_GEL_END) {
            len--;
            continue;
        }
        if (e->kind == PD_GEL_CLASS)
            return gs_emit(dst, w, len);
        if (chain + 1 >= G_MAX_CHAIN + 2)
            return -3;
        int base = len;
        if (g->el[p + 1].kind == PD_GEL_END)
            base = len - 1;      /* a tail call */
        else
            w[len - 1] = p + 1;
        if (base + 1 > G_MAX_STACK)
            return 0;            /* nested too deep: this way is not taken */
        /* the same rule over the same stack earlier in this chain, no byte between: a loop
         * through rules that can be empty ((a?)*, (a*)*); what it leads to was found there */
        int32_t *seen = scratch + (size_t)(G_MAX_CHAIN + 2) * G_MAX_STACK;   /* [chain][2] */
        for (int c = 0; c < chain; c++)
            if (seen[2 * c] == e->ref && seen[2 * c + 1] == base &&
                memcmp(scratch + (size_t)c * G_MAX_STACK, w, (size_t)base * 4) == 0)
                return 0;
        seen[2 * chain] = e->ref;
        seen[2 * chain + 1] = base;
        int32_t *nw = w + G_MAX_STACK;
        for (int k = g->alt_off[e->ref]; k < g->alt_off[e->ref + 1]; k++) {
            memcpy(nw, w, (size_t)base * 4);
            nw[base] = g->alt[k];
            int rc = expand(g, dst, scratch, chain + 1, base + 1);
            if (rc != 0)
                return rc;
        }
        return 0;
    }
}

static int advance_byte(const pd_grammar *g, gstate *dst, const gstate *src, uint8_t c, int32_t *scratch)
{
    gs_clear(dst);
    for (int i = 0; i < src->n; i++) {
        int len = src->off[i + 1] - src->off[i];
        const int32_t *s = src->pos + src->off[i];
        const pd_gel *e = &g->el[s[len - 1]];
        if (!pd_gset_has(&e->set, c))
            continue;
        memcpy(scratch, s, (size_t)len * 4);
        scratch[len - 1]++;
        int rc = expand(g, dst, scratch, 0, len);
        if (rc != 0)
            return rc;
    }
    return 0;
}

static pd_status match_err(int rc, pd_err *err)
{
    if (rc == -1)
        return pd_err_set(err, PD_ERR_NOMEM, "grammar matcher stacks");
    if (rc == -2)
        return pd_err_set(err, PD_ERR_INVALID, "structured output: the grammar is too ambiguous "
                          "(more than %d ways to read the text at once)", G_MAX_STACKS);
    return pd_err_set(err, PD_ERR_INVALID, "structured output: the grammar chains more than %d rules "
                      "without text (left recursion?)", G_MAX_CHAIN);
}

pd_status pd_gmatch_create(pd_grammar *g, pd_gmatch **out, pd_err *err)
{
    pd_gmatch *m = calloc(1, sizeof(*m));
    if (m == NULL || (m->scratch = malloc((size_t)(G_MAX_CHAIN + 2) * (G_MAX_STACK + 2) * 4)) == NULL) {
        free(m);
        return pd_err_set(err, PD_ERR_NOMEM, "grammar matcher");
    }
    m->g = pd_grammar_ref(g);
    m->scratch[0] = 0;   /* the root reference */
    int rc = expand(g, &m->st, m->scratch, 0, 1);
    if (rc != 0) {
        pd_gmatch_destroy(m);
        return match_err(rc, err);
    }
    *out = m;
    return PD_OK;
}

void pd_gmatch_destroy(pd_gmatch *m)
{
    if (m == NULL)
        return;
    gs_free(&m->st);
    gs_free(&m->a);
    gs_free(&m->b);
    for (int i = 0; i < 8; i++) {
        gs_free(&m->cache[i].key);
        free(m->cache[i].bits);
    }
    free(m->scratch);
    pd_grammar_unref(m->g);
    free(m);
}

pd_status pd_gmatch_copy(pd_gmatch *dst, const pd_gmatch *src, pd_err *err)
{
    if (gs_copy(&dst->st, &src->st) != 0)
        return pd_err_set(err, PD_ERR_NOMEM, "grammar matcher copy");
    return PD_OK;
}

int pd_gmatch_complete(const pd_gmatch *m) { return m->st.complete; }

/* no way on and not complete: the text so far (or the grammar) matches nothing */
int pd_gmatch_dead(const pd_gmatch *m) { return m->st.n == 0 && !m->st.complete; }

static int is_eos(const pd_gvocab *v, int32_t t)
{
    for (int i = 0; i < v->n_eos; i++)
        if (v->eos[i] == t)
            return 1;
    return 0;
}

int pd_gmatch_advance(pd_gmatch *m, const pd_gvocab *v, int32_t tok, pd_err *err)
{
    if (tok < 0 || tok >= v->n_vocab)
        return 0;
    if (is_eos(v, tok))
        return m->st.complete ? 1 : 0;
    if (v->tok_node[tok] < 0)
        return 0;
    const uint8_t *bytes = v->bytes + v->boff[tok];
    int depth = (int)(v->boff[tok + 1] - v->boff[tok]);
    gstate *cur = &m->st, *nx = &m->a;
    int ok = depth > 0, rc = 0;
    for (int i = 0; i < depth && ok; i++) {
        rc = advance_byte(m->g, nx, cur, bytes[i], m->scratch);
        if (rc != 0)
            break;
        ok = nx->n > 0 || (nx->complete && i == depth - 1);
        cur = nx;
        nx = cur == &m->a ? &m->b : &m->a;
    }
    if (rc != 0) {
        match_err(rc, err);
        return -1;
    }
    if (!ok)
        return 0;
    if (gs_copy(&m->st, cur) != 0) {
        pd_err_set(err, PD_ERR_NOMEM, "grammar matcher");
        return -1;
    }
    return 1;
}

/* ---- the allowed mask ----------------------------------------------------------------------
 * A walk of the vocabulary trie in which every distinct matcher state met is interned once and
 * each (state, byte) transition computed once: inside a JSON string most bytes lead back to the
 * same state, so a node costs a table lookup instead of a stack expansion. Masks are kept per
 * state in a small cache of the matcher (a string's body repeats its state token after token). */

#define MASK_CACHE 8
#define T_UNKNOWN (-2)
#define T_DEAD (-1)

typedef struct {
    gstate *st;         /* interned states */
    uint64_t *hash;
    int32_t *trans;     /* [n, 256] */
    int n, cap;
    int32_t *scratch;
    const pd_grammar *g;
} intern_tab;

static uint64_t gs_hash(const gstate *s)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)s->complete;
    for (int i = 0; i <= s->n && s->n > 0; i++)
        h = (h ^ (uint64_t)(uint32_t)s->off[i]) * 1099511628211ull;
    for (int i = 0; i < s->n_pos; i++)
        h = (h ^ (uint64_t)(uint32_t)s->pos[i]) * 1099511628211ull;
    return h;
}

static int gs_equal(const gstate *a, const gstate *b)
{
    return a->complete == b->complete && a->n == b->n && a->n_pos == b->n_pos &&
           (a->n == 0 || (memcmp(a->off, b->off, (size_t)(a->n + 1) * 4) == 0 &&
                          memcmp(a->pos, b->pos, (size_t)a->n_pos * 4) == 0));
}

/* the id of state s (copied in when new); -1 NOMEM */
static int intern(intern_tab *t, const gstate *s)
{
    uint64_t h = gs_hash(s);
    for (int i = 0; i < t->n; i++)
        if (t->hash[i] == h && gs_equal(&t->st[i], s))
            return i;
    if (t->n == t->cap) {
        int nc = t->cap ? t->cap * 2 : 16;
        gstate *ns = realloc(t->st, (size_t)nc * sizeof(gstate));
        if (ns == NULL)
            return -1;
        t->st = ns;
        uint64_t *nh = realloc(t->hash, (size_t)nc * sizeof(uint64_t));
        if (nh == NULL)
            return -1;
        t->hash = nh;
        int32_t *ntr = realloc(t->trans, (size_t)nc * 256 * sizeof(int32_t));
        if (ntr == NULL)
            return -1;
        t->trans = ntr;
        t->cap = nc;
    }
    gstate *d = &t->st[t->n];
    memset(d, 0, sizeof(*d));
    if (gs_copy(d, s) != 0) {
        gs_free(d);
        return -1;
    }
    t->hash[t->n] = h;
    for (int c = 0; c < 256; c++)
        t->trans[(size_t)t->n * 256 + c] = T_UNKNOWN;
    return t->n++;
}

/* the state after byte c from state id; T_DEAD when nothing matches; < T_DEAD on an error */
static int transition(intern_tab *t, gstate *tmp, int id, uint8_t c, int *rc)
{
    int32_t *slot = &t->trans[(size_t)id * 256 + c];
    if (*slot != T_UNKNOWN)
        return *slot;
    if ((*rc = advance_byte(t->g, tmp, &t->st[id], c, t->scratch)) != 0)
        return -3;
    int nid = T_DEAD;
    if (tmp->n > 0 || tmp->complete) {
        nid = intern(t, tmp);
        if (nid < 0) {
            *rc = -1;
            return -3;
        }
    }
    t->trans[(size_t)id * 256 + c] = nid;   /* re-read: intern may have moved the table */
    return nid;
}

static int allowed_walk(intern_tab *t, gstate *tmp, const pd_gvocab *v, int node, int id, uint32_t *bits)
{
    int rc = 0;
    for (int k = v->first[node], end = k + v->nchild[node]; k < end; k++) {
        int nid = transition(t, tmp, id, v->byte[k], &rc);
        if (nid == T_DEAD)
            continue;
        if (nid < T_DEAD)
            return rc;
        for (int tk = v->tok_head[k]; tk >= 0; tk = v->tok_next[tk])
            bits[tk >> 5] |= 1u << (tk & 31);
        if (v->nchild[k] > 0 && t->st[nid].n > 0 && (rc = allowed_walk(t, tmp, v, k, nid, bits)) != 0)
            return rc;
    }
    return 0;
}

/* ---- masks shared by every matcher of a grammar ------------------------------------------- */

/* A grammar used by many requests (one schema for all of a service's calls, through
 * pd_gcache) meets the same states again: their masks are kept here, least recently used
 * dropped past SHARED_MASK_BYTES. */
#define SHARED_MASK_BYTES ((size_t)4 << 20)   /* ~200 masks of a 152k vocabulary; 64 grammars cached: 256 MiB at most */

struct pd_gshared {
    pthread_mutex_t mu;
    struct smask {
        gstate key;
        uint64_t hash, vocab, used;
        uint32_t *bits;
        size_t bytes;
    } *e;
    int n, cap;
    size_t bytes;
    uint64_t tick;
};

struct pd_gshared *pd_gshared_new(void)
{
    struct pd_gshared *c = calloc(1, sizeof(*c));
    if (c != NULL)
        pthread_mutex_init(&c->mu, NULL);
    return c;   /* NULL: the grammar simply shares nothing */
}

void pd_gshared_free(struct pd_gshared *c)
{
    if (c == NULL)
        return;
    for (int i = 0; i < c->n; i++) {
        gs_free(&c->e[i].key);
        free(c->e[i].bits);
    }
    free(c->e);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static int gshared_get(struct pd_gshared *c, const gstate *st, uint64_t h, const pd_gvocab *v, uint32_t *bits)
{
    if (c == NULL)
        return 0;
    int hit = 0;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n && !hit; i++)
        if (c->e[i].hash == h && c->e[i].vocab == v->id && gs_equal(&c->e[i].key, st)) {
            memcpy(bits, c->e[i].bits, c->e[i].bytes);
            c->e[i].used = ++c->tick;
            hit = 1;
        }
    pthread_mutex_unlock(&c->mu);
    return hit;
}

static void gshared_put(struct pd_gshared *c, const gstate *st, uint64_t h, const pd_gvocab *v, const uint32_t *bits)
{
    size_t bytes = (size_t)v->words * 4;
    if (c == NULL || bytes > SHARED_MASK_BYTES)
        return;
    struct smask e = { .hash = h, .vocab = v->id, .bytes = bytes, .bits = malloc(bytes) };
    if (e.bits == NULL || gs_copy(&e.key, st) != 0) {
        free(e.bits);
        gs_free(&e.key);
        return;   /* not shared: only slower */
    }
    memcpy(e.bits, bits, bytes);
    pthread_mutex_lock(&c->mu);
    while (c->n > 0 && c->bytes + bytes > SHARED_MASK_BYTES) {   /* the least recently used go */
        int lru = 0;
        for (int i = 1; i < c->n; i++)
            if (c->e[i].used < c->e[lru].used)
                lru = i;
        c->bytes -= c->e[lru].bytes;
        gs_free(&c->e[lru].key);
        free(c->e[lru].bits);
        c->e[lru] = c->e[--c->n];
    }
    if (pd_grammar_grow((void **)&c->e, &c->cap, c->n + 1, sizeof(*c->e)) == 0) {
        e.used = ++c->tick;
        c->e[c->n++] = e;
        c->bytes += bytes;
        e.bits = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (e.bits != NULL) {
        gs_free(&e.key);
        free(e.bits);
    }
}

pd_status pd_gmatch_allowed(pd_gmatch *m, const pd_gvocab *v, uint32_t *bits, pd_err *err)
{
    size_t bytes = (size_t)v->words * 4;
    uint64_t h = gs_hash(&m->st);
    for (int i = 0; i < MASK_CACHE; i++)
        if (m->cache[i].bits != NULL && m->cache[i].hash == h && m->cache[i].vocab == v &&
            gs_equal(&m->cache[i].key, &m->st)) {
            memcpy(bits, m->cache[i].bits, bytes);
            return PD_OK;
        }
    if (gshared_get(m->g->shared, &m->st, h, v, bits))
        goto keep;
    memset(bits, 0, bytes);
    if (m->st.complete)
        for (int i = 0; i < v->n_eos; i++)
            if (v->eos[i] >= 0 && v->eos[i] < v->n_vocab)
                bits[v->eos[i] >> 5] |= 1u << (v->eos[i] & 31);
    int rc = 0;
    if (m->st.n > 0) {
        intern_tab t = { .scratch = m->scratch, .g = m->g };
        gstate tmp = { 0 };
        int id = intern(&t, &m->st);
        rc = id < 0 ? -1 : allowed_walk(&t, &tmp, v, 0, id, bits);
        for (int i = 0; i < t.n; i++)
            gs_free(&t.st[i]);
        free(t.st);
        free(t.hash);
        free(t.trans);
        gs_free(&tmp);
    }
    if (rc != 0)
        return match_err(rc, err);
    gshared_put(m->g->shared, &m->st, h, v, bits);
keep:;   /* in the matcher's own cache too (round robin) */
    int slot = m->cache_next;
    m->cache_next = (m->cache_next + 1) % MASK_CACHE;
    if (m->cache[slot].bits == NULL || m->cache[slot].words != v->words) {
        free(m->cache[slot].bits);
        m->cache[slot].bits = malloc(bytes);
        m->cache[slot].words = v->words;
    }
    if (m->cache[slot].bits != NULL && gs_copy(&m->cache[slot].key, &m->st) == 0) {
        memcpy(m->cache[slot].bits, bits, bytes);
        m->cache[slot].hash = h;
        m->cache[slot].vocab = v;
    } else if (m->cache[slot].bits != NULL) {
        free(m->cache[slot].bits);
        m->cache[slot].bits = NULL;
    }
    return PD_OK;
}
