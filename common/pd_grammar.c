/* pd_grammar.c - the grammar object (pd_grammar.h): the rule builder every compiler writes
 *   through, its flat form, references, the cache of compiled grammars and a request's spec.
 * Owns: pd_gb (rules of alternatives while a compiler makes them), pd_gb_finish (the flat
 *   pd_grammar laid out as pd_grammar_internal.h describes, refused when it matches no text),
 *   pd_grammar_ref / _unref, pd_gcache (compiled grammars by spec), pd_grammar_compile.
 * Not here: the compilers (pd_grammar_json.c, pd_grammar_regex.c, pd_grammar_ebnf.c), the
 *   vocabulary, the matcher and its masks (pd_grammar_match.c).
 * Threading: a builder belongs to the call that compiles its grammar; pd_grammar_ref / _unref
 *   are atomic and a pd_gcache takes its own lock, so those may be called from any thread. */
#include "pd_grammar.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_grammar_internal.h"

/* ---- building ------------------------------------------------------------------------------ */

int pd_gb_fail(pd_gb *b, pd_status code, const char *what)
{
    if (b->st == PD_OK)
        b->st = pd_err_set(b->err, code, "%s", what);
    return -1;
}

int pd_gb_rule_new(pd_gb *b)
{
    if (b->st != PD_OK)
        return -1;
    if (b->n >= PD_GRAMMAR_MAX_RULES) {
        char m[160];
        snprintf(m, sizeof(m), "structured output: the grammar needs more than %d rules (a large "
                 "bound such as maxLength, maxItems or {m,n} unrolls into rules)", PD_GRAMMAR_MAX_RULES);
        return pd_gb_fail(b, PD_ERR_INVALID, m);
    }
    if (pd_grammar_grow((void **)&b->r, &b->cap, b->n + 1, sizeof(pd_gb_rule)) != 0)
        return pd_gb_fail(b, PD_ERR_NOMEM, "grammar rules");
    memset(&b->r[b->n], 0, sizeof(pd_gb_rule));
    return b->n++;
}

/* a new (empty) alternative of rule r */
int pd_gb_alt(pd_gb *b, int r)
{
    if (b->st != PD_OK || r < 0)
        return -1;
    pd_gb_rule *ru = &b->r[r];
    if (pd_grammar_grow((void **)&ru->alt, &ru->cap, ru->n + 1, sizeof(pd_gb_seq)) != 0)
        return pd_gb_fail(b, PD_ERR_NOMEM, "grammar alternatives");
    memset(&ru->alt[ru->n], 0, sizeof(pd_gb_seq));
    return ru->n++;
}

static void gb_put(pd_gb *b, int r, int a, const pd_gel *e)
{
    if (b->st != PD_OK || r < 0 || a < 0)
        return;
    pd_gb_seq *s = &b->r[r].alt[a];
    if (pd_grammar_grow((void **)&s->el, &s->cap, s->n + 1, sizeof(pd_gel)) != 0) {
        pd_gb_fail(b, PD_ERR_NOMEM, "grammar elements");
        return;
    }
    s->el[s->n++] = *e;
}

void pd_gb_cls(pd_gb *b, int r, int a, const pd_gset *s)
{
    pd_gel e = { .kind = PD_GEL_CLASS, .set = *s };
    gb_put(b, r, a, &e);
}

void pd_gb_ref(pd_gb *b, int r, int a, int rule)
{
    if (rule < 0) {
        pd_gb_fail(b, PD_ERR_INTERNAL, "grammar: reference to a rule that failed");
        return;
    }
    pd_gel e = { .kind = PD_GEL_REF, .ref = rule };
    gb_put(b, r, a, &e);
}

void pd_gb_lit(pd_gb *b, int r, int a, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        pd_gset c = { { 0 } };
        pd_gset_add(&c, (uint8_t)s[i]);
        pd_gb_cls(b, r, a, &c);
    }
}

/* rules made of one alternative */
int pd_gb_cls_rule(pd_gb *b, const pd_gset *s)
{
    int r = pd_gb_rule_new(b);
    pd_gb_cls(b, r, pd_gb_alt(b, r), s);
    return r;
}

int pd_gb_lit_rule(pd_gb *b, const char *s, size_t n)
{
    int r = pd_gb_rule_new(b);
    pd_gb_lit(b, r, pd_gb_alt(b, r), s, n);
    return r;
}

/* the alternatives of rule r that take one UTF-8 sequence of two to four bytes (lead byte
 * C2-F4, continuation bytes 80-BF) */
void pd_gb_utf8_alts(pd_gb *b, int r)
{
    pd_gset cont = { { 0 } }, lead[3] = { { { 0 } }, { { 0 } }, { { 0 } } };
    pd_gset_range(&cont, 0x80, 0xbf);
    pd_gset_range(&lead[0], 0xc2, 0xdf);
    pd_gset_range(&lead[1], 0xe0, 0xef);
    pd_gset_range(&lead[2], 0xf0, 0xf4);
    for (int n = 0; n < 3; n++) {
        int a = pd_gb_alt(b, r);
        pd_gb_cls(b, r, a, &lead[n]);
        for (int i = 0; i <= n; i++)
            pd_gb_cls(b, r, a, &cont);
    }
}

/* x? */
int pd_gb_opt(pd_gb *b, int x)
{
    int r = pd_gb_rule_new(b);
    pd_gb_alt(b, r);
    pd_gb_ref(b, r, pd_gb_alt(b, r), x);
    return r;
}

/* x* */
int pd_gb_star(pd_gb *b, int x)
{
    int r = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, r);
    pd_gb_ref(b, r, a, x);
    pd_gb_ref(b, r, a, r);
    pd_gb_alt(b, r);
    return r;
}

/* x{min,max}; max < 0: unbounded */
int pd_gb_rep(pd_gb *b, int x, int min, int max)
{
    int tail = -1;   /* x{0, max - min}: t_k = empty | x t_(k-1) */
    if (max < 0)
        tail = pd_gb_star(b, x);
    else
        for (int k = 1; k <= max - min; k++) {
            int t = pd_gb_rule_new(b);
            pd_gb_alt(b, t);
            int a = pd_gb_alt(b, t);
            pd_gb_ref(b, t, a, x);
            if (tail >= 0)
                pd_gb_ref(b, t, a, tail);
            tail = t;
        }
    int r = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, r);
    for (int i = 0; i < min; i++)
        pd_gb_ref(b, r, a, x);
    if (tail >= 0)
        pd_gb_ref(b, r, a, tail);
    return r;
}

static void gb_free(pd_gb *b)
{
    for (int i = 0; i < b->n; i++) {
        for (int a = 0; a < b->r[i].n; a++)
            free(b->r[i].alt[a].el);
        free(b->r[i].alt);
    }
    free(b->r);
}

/* x{min,max} (max < 0: unbounded) with the smallest rules for ? and * */
int pd_gb_quant(pd_gb *b, int x, int min, int max)
{
    return max == 1 && min == 0 ? pd_gb_opt(b, x)
         : min == 0 && max < 0 ? pd_gb_star(b, x) : pd_gb_rep(b, x, min, max);
}

/* a repeat bound's digits at s[*i..]: 1 read (at most 100000), 0 none, -1 too large */
int pd_grammar_repeat_bound(const char *s, size_t n, size_t *i, int *out)
{
    int v = 0, any = 0;
    while (*i < n && s[*i] >= '0' && s[*i] <= '9') {
        v = v * 10 + (s[(*i)++] - '0');
        if (v > 100000)
            return -1;
        any = 1;
    }
    *out = v;
    return any;
}

/* the flat form, rule `root` at the top */
pd_status pd_gb_finish(pd_gb *b, int root, pd_grammar **out)
{
    if (b->st == PD_OK && root < 0)
        pd_gb_fail(b, PD_ERR_INTERNAL, "grammar without a root");
    if (b->st != PD_OK) {
        gb_free(b);
        return b->st;
    }
    int n_el = 2, n_alt = 0;
    for (int i = 0; i < b->n; i++) {
        n_alt += b->r[i].n;
        for (int a = 0; a < b->r[i].n; a++)
            n_el += b->r[i].alt[a].n + 1;
    }
    pd_grammar *g = calloc(1, sizeof(*g));
    if (g != NULL) {
        g->el = calloc((size_t)n_el, sizeof(pd_gel));
        g->alt = malloc((size_t)(n_alt + 1) * sizeof(int32_t));
        g->alt_off = malloc((size_t)(b->n + 1) * sizeof(int32_t));
    }
    if (g == NULL || g->el == NULL || g->alt == NULL || g->alt_off == NULL) {
        if (g != NULL) {
            free(g->el);
            free(g->alt);
            free(g->alt_off);
            free(g);
        }
        gb_free(b);
        return pd_err_set(b->err, PD_ERR_NOMEM, "grammar of %d elements", n_el);
    }
    g->el[0] = (pd_gel){ .kind = PD_GEL_REF, .ref = root };
    g->el[1] = (pd_gel){ .kind = PD_GEL_END };
    int p = 2, k = 0;
    for (int i = 0; i < b->n; i++) {
        g->alt_off[i] = k;
        for (int a = 0; a < b->r[i].n; a++) {
            g->alt[k++] = p;
            if (b->r[i].alt[a].n > 0)
                memcpy(&g->el[p], b->r[i].alt[a].el, (size_t)b->r[i].alt[a].n * sizeof(pd_gel));
            p += b->r[i].alt[a].n;
            g->el[p++] = (pd_gel){ .kind = PD_GEL_END };
        }
    }
    g->alt_off[b->n] = k;
    g->n_el = n_el;
    g->n_rules = b->n;
    atomic_init(&g->refs, 1);
    g->shared = pd_gshared_new();
    gb_free(b);
    /* a grammar that cannot even start (a rule that refers to itself first) is refused here,
     * not when a request meets it */
    pd_gmatch *m = NULL;
    pd_status st = pd_gmatch_create(g, &m, b->err);
    if (st == PD_OK && pd_gmatch_dead(m))
        st = pd_err_set(b->err, PD_ERR_INVALID, "structured output: the grammar matches no text at all");
    pd_gmatch_destroy(m);
    if (st != PD_OK) {
        pd_grammar_unref(g);
        return st;
    }
    *out = g;
    return PD_OK;
}

pd_grammar *pd_grammar_ref(pd_grammar *g)
{
    if (g != NULL)
        atomic_fetch_add(&g->refs, 1);
    return g;
}

void pd_grammar_unref(pd_grammar *g)
{
    if (g == NULL || atomic_fetch_sub(&g->refs, 1) != 1)
        return;
    pd_gshared_free(g->shared);
    free(g->el);
    free(g->alt);
    free(g->alt_off);
    free(g);
}

/* ---- compiled grammars by spec ------------------------------------------------------------ */

struct pd_gcache {
    pthread_mutex_t mu;
    struct gentry {
        void *key;
        size_t len;
        pd_grammar *g;
        uint64_t used;
    } *e;
    int n, cap, max;
    uint64_t tick, hits, misses;
};

pd_status pd_gcache_create(int max_entries, pd_gcache **out, pd_err *err)
{
    pd_gcache *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "grammar cache");
    pthread_mutex_init(&c->mu, NULL);
    c->max = max_entries > 0 ? max_entries : 64;
    *out = c;
    return PD_OK;
}

void pd_gcache_destroy(pd_gcache *c)
{
    if (c == NULL)
        return;
    for (int i = 0; i < c->n; i++) {
        free(c->e[i].key);
        pd_grammar_unref(c->e[i].g);
    }
    free(c->e);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

void pd_gcache_stats(pd_gcache *c, uint64_t *hits, uint64_t *misses)
{
    pthread_mutex_lock(&c->mu);
    *hits = c->hits;
    *misses = c->misses;
    pthread_mutex_unlock(&c->mu);
}

static pd_grammar *gcache_find(pd_gcache *c, const void *key, size_t len)
{
    for (int i = 0; i < c->n; i++)
        if (c->e[i].len == len && memcmp(c->e[i].key, key, len) == 0) {
            c->e[i].used = ++c->tick;
            return pd_grammar_ref(c->e[i].g);
        }
    return NULL;
}

pd_status pd_gcache_get(pd_gcache *c, const void *key, size_t len, pd_gcompile_fn compile, void *ud,
                        pd_grammar **out, pd_err *err)
{
    *out = NULL;
    if (c == NULL)
        return compile(ud, out, err);
    pthread_mutex_lock(&c->mu);
    pd_grammar *g = gcache_find(c, key, len);
    if (g != NULL)
        c->hits++;
    else
        c->misses++;
    pthread_mutex_unlock(&c->mu);
    if (g != NULL) {
        *out = g;
        return PD_OK;
    }
    pd_status st = compile(ud, &g, err);   /* outside the lock: compiling may take a while */
    if (st != PD_OK)
        return st;   /* failures are not kept: the next request gets the same message */
    void *k = malloc(len > 0 ? len : 1);
    pthread_mutex_lock(&c->mu);
    pd_grammar *other = gcache_find(c, key, len);   /* another thread was faster */
    if (other == NULL && k != NULL) {
        if (c->n >= c->max) {   /* the least recently used goes */
            int lru = 0;
            for (int i = 1; i < c->n; i++)
                if (c->e[i].used < c->e[lru].used)
                    lru = i;
            free(c->e[lru].key);
            pd_grammar_unref(c->e[lru].g);
            c->e[lru] = c->e[--c->n];
        }
        if (pd_grammar_grow((void **)&c->e, &c->cap, c->n + 1, sizeof(*c->e)) == 0) {
            memcpy(k, key, len);
            c->e[c->n++] = (struct gentry){ .key = k, .len = len, .g = pd_grammar_ref(g), .used = ++c->tick };
            k = NULL;
        }
    }
    pthread_mutex_unlock(&c->mu);
    free(k);
    if (other != NULL) {
        pd_grammar_unref(g);
        g = other;
    }
    *out = g;
    return PD_OK;
}

/* ---- a request's spec ---------------------------------------------------------------------- */

int pd_grammar_spec_kinds(const pd_grammar_spec *s)
{
    return (s->json_object != 0) + (s->json_schema != NULL) + (s->n_choices > 0) + (s->regex != NULL) +
           (s->ebnf != NULL);
}

static pd_status spec_compile(void *ud, pd_grammar **out, pd_err *err)
{
    const pd_grammar_spec *s = ud;
    return s->json_object ? pd_grammar_json(NULL, 0, out, err)
         : s->json_schema != NULL ? pd_grammar_json(s->json_schema, s->json_schema_len, out, err)
         : s->n_choices > 0 ? pd_grammar_choice(s->choices, s->n_choices, out, err)
         : s->regex != NULL ? pd_grammar_regex(s->regex, s->regex_len, out, err)
         : s->ebnf != NULL ? pd_grammar_ebnf(s->ebnf, s->ebnf_len, out, err)
         : pd_err_set(err, PD_ERR_INVALID, "no structured output asked");
}

pd_status pd_grammar_compile(const pd_grammar_spec *s, pd_gcache *cache, pd_grammar **out, pd_err *err)
{
    *out = NULL;
    if (cache == NULL)
        return spec_compile((void *)s, out, err);
    /* the key: the kind, then its text (choices each ended by a NUL) */
    char kind = s->json_object ? 'o' : s->json_schema != NULL ? 'j' : s->n_choices > 0 ? 'c'
              : s->regex != NULL ? 'r' : 'e';
    const char *text = kind == 'j' ? s->json_schema : kind == 'r' ? s->regex : kind == 'e' ? s->ebnf : NULL;
    size_t text_len = kind == 'j' ? s->json_schema_len : kind == 'r' ? s->regex_len : kind == 'e' ? s->ebnf_len : 0;
    size_t len = 1 + text_len;
    for (int i = 0; kind == 'c' && i < s->n_choices; i++)
        len += (s->choices[i] != NULL ? strlen(s->choices[i]) : 0) + 1;
    char *key = malloc(len);
    if (key == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "grammar key");
    key[0] = kind;
    size_t at = 1;
    if (text != NULL)
        memcpy(key + at, text, text_len);
    for (int i = 0; kind == 'c' && i < s->n_choices; i++) {
        const char *c = s->choices[i] != NULL ? s->choices[i] : "";
        size_t l = strlen(c) + 1;
        memcpy(key + at, c, l);
        at += l;
    }
    pd_status st = pd_gcache_get(cache, key, len, spec_compile, (void *)s, out, err);
    free(key);
    return st;
}
