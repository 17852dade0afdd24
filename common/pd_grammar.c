/* pd_grammar.c - grammars for structured output, their compilers (JSON schema, choices, regex)
 * and the token matcher (see pd_grammar.h).
 *
 * A compiled grammar is one array of elements: [0] refers to the root rule and [1] ends it;
 * then every rule's alternatives, each a run of elements ended by G_END. A position is an index
 * into that array. The matcher's state is a set of stacks of positions (the top is the next
 * element to match; the ones below are where each enclosing rule continues), expanded until
 * every top is a byte class: advancing by a byte keeps the stacks whose class holds it. A stack
 * that empties means the grammar may end there (complete). A reference that ends its
 * alternative replaces the caller's position instead of pushing (a tail call), so repetition
 * (X* = X X* | empty) does not grow the stacks. */
#include "pd_grammar.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { G_END = 0, G_CLASS, G_REF };

typedef struct {
    uint32_t w[8];
} gset;

typedef struct {
    uint8_t kind;
    int32_t ref;      /* G_REF: the rule */
    gset set;         /* G_CLASS: the bytes it takes */
} gel;

struct gshared;

struct pd_grammar {
    atomic_int refs;
    struct gshared *shared;   /* masks by state, shared by every matcher of the grammar */
    gel *el;
    int n_el;
    int32_t *alt;     /* alternative start positions; rule r's: alt[alt_off[r] .. alt_off[r + 1]) */
    int32_t *alt_off;
    int n_rules;
};

#define G_MAX_STACK 256      /* positions on one stack (nesting deeper is not allowed) */
#define G_MAX_CHAIN 256      /* rule references expanded without a byte between them */
#define G_MAX_STACKS 4096    /* stacks alive at once */

static void set_add(gset *s, int c) { s->w[c >> 5] |= 1u << (c & 31); }
static int set_has(const gset *s, int c) { return (s->w[c >> 5] >> (c & 31)) & 1u; }
static void set_range(gset *s, int lo, int hi)
{
    for (int c = lo; c <= hi; c++)
        set_add(s, c);
}

/* ---- building ------------------------------------------------------------------------------ */

typedef struct {
    gel *el;
    int n, cap;
} gb_seq;

typedef struct {
    gb_seq *alt;
    int n, cap;
} gb_rule;

typedef struct {
    gb_rule *r;
    int n, cap;
    pd_status st;     /* the first failure; every later call is a no-op */
    pd_err *err;
} gb;

static int gb_fail(gb *b, pd_status code, const char *what)
{
    if (b->st == PD_OK)
        b->st = pd_err_set(b->err, code, "%s", what);
    return -1;
}

static int grow(void **p, int *cap, int need, size_t sz)
{
    if (need <= *cap)
        return 0;
    int nc = *cap ? *cap * 2 : 4;
    while (nc < need)
        nc *= 2;
    void *np = realloc(*p, (size_t)nc * sz);
    if (np == NULL)
        return -1;
    *p = np;
    *cap = nc;
    return 0;
}

static int gb_rule_new(gb *b)
{
    if (b->st != PD_OK)
        return -1;
    if (b->n >= PD_GRAMMAR_MAX_RULES) {
        char m[160];
        snprintf(m, sizeof(m), "structured output: the grammar needs more than %d rules (a large "
                 "bound such as maxLength, maxItems or {m,n} unrolls into rules)", PD_GRAMMAR_MAX_RULES);
        return gb_fail(b, PD_ERR_INVALID, m);
    }
    if (grow((void **)&b->r, &b->cap, b->n + 1, sizeof(gb_rule)) != 0)
        return gb_fail(b, PD_ERR_NOMEM, "grammar rules");
    memset(&b->r[b->n], 0, sizeof(gb_rule));
    return b->n++;
}

/* a new (empty) alternative of rule r */
static int gb_alt(gb *b, int r)
{
    if (b->st != PD_OK || r < 0)
        return -1;
    gb_rule *ru = &b->r[r];
    if (grow((void **)&ru->alt, &ru->cap, ru->n + 1, sizeof(gb_seq)) != 0)
        return gb_fail(b, PD_ERR_NOMEM, "grammar alternatives");
    memset(&ru->alt[ru->n], 0, sizeof(gb_seq));
    return ru->n++;
}

static void gb_put(gb *b, int r, int a, const gel *e)
{
    if (b->st != PD_OK || r < 0 || a < 0)
        return;
    gb_seq *s = &b->r[r].alt[a];
    if (grow((void **)&s->el, &s->cap, s->n + 1, sizeof(gel)) != 0) {
        gb_fail(b, PD_ERR_NOMEM, "grammar elements");
        return;
    }
    s->el[s->n++] = *e;
}

static void gb_cls(gb *b, int r, int a, const gset *s)
{
    gel e = { .kind = G_CLASS, .set = *s };
    gb_put(b, r, a, &e);
}

static void gb_ref(gb *b, int r, int a, int rule)
{
    if (rule < 0) {
        gb_fail(b, PD_ERR_INTERNAL, "grammar: reference to a rule that failed");
        return;
    }
    gel e = { .kind = G_REF, .ref = rule };
    gb_put(b, r, a, &e);
}

static void gb_lit(gb *b, int r, int a, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        gset c = { { 0 } };
        set_add(&c, (uint8_t)s[i]);
        gb_cls(b, r, a, &c);
    }
}

/* rules made of one alternative */
static int gb_cls_rule(gb *b, const gset *s)
{
    int r = gb_rule_new(b);
    gb_cls(b, r, gb_alt(b, r), s);
    return r;
}

static int gb_lit_rule(gb *b, const char *s, size_t n)
{
    int r = gb_rule_new(b);
    gb_lit(b, r, gb_alt(b, r), s, n);
    return r;
}

/* the alternatives of rule r that take one UTF-8 sequence of two to four bytes (lead byte
 * C2-F4, continuation bytes 80-BF) */
static void gb_utf8_alts(gb *b, int r)
{
    gset cont = { { 0 } }, lead[3] = { { { 0 } }, { { 0 } }, { { 0 } } };
    set_range(&cont, 0x80, 0xbf);
    set_range(&lead[0], 0xc2, 0xdf);
    set_range(&lead[1], 0xe0, 0xef);
    set_range(&lead[2], 0xf0, 0xf4);
    for (int n = 0; n < 3; n++) {
        int a = gb_alt(b, r);
        gb_cls(b, r, a, &lead[n]);
        for (int i = 0; i <= n; i++)
            gb_cls(b, r, a, &cont);
    }
}

/* x? */
static int gb_opt(gb *b, int x)
{
    int r = gb_rule_new(b);
    gb_alt(b, r);
    gb_ref(b, r, gb_alt(b, r), x);
    return r;
}

/* x* */
static int gb_star(gb *b, int x)
{
    int r = gb_rule_new(b);
    int a = gb_alt(b, r);
    gb_ref(b, r, a, x);
    gb_ref(b, r, a, r);
    gb_alt(b, r);
    return r;
}

/* x{min,max}; max < 0: unbounded */
static int gb_rep(gb *b, int x, int min, int max)
{
    int tail = -1;   /* x{0, max - min}: t_k = empty | x t_(k-1) */
    if (max < 0)
        tail = gb_star(b, x);
    else
        for (int k = 1; k <= max - min; k++) {
            int t = gb_rule_new(b);
            gb_alt(b, t);
            int a = gb_alt(b, t);
            gb_ref(b, t, a, x);
            if (tail >= 0)
                gb_ref(b, t, a, tail);
            tail = t;
        }
    int r = gb_rule_new(b);
    int a = gb_alt(b, r);
    for (int i = 0; i < min; i++)
        gb_ref(b, r, a, x);
    if (tail >= 0)
        gb_ref(b, r, a, tail);
    return r;
}

static void gb_free(gb *b)
{
    for (int i = 0; i < b->n; i++) {
        for (int a = 0; a < b->r[i].n; a++)
            free(b->r[i].alt[a].el);
        free(b->r[i].alt);
    }
    free(b->r);
}

static int gmatch_dead(const pd_gmatch *m);
static struct gshared *gshared_new(void);

/* the flat form, rule `root` at the top */
static pd_status gb_finish(gb *b, int root, pd_grammar **out)
{
    if (b->st == PD_OK && root < 0)
        gb_fail(b, PD_ERR_INTERNAL, "grammar without a root");
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
        g->el = calloc((size_t)n_el, sizeof(gel));
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
    g->el[0] = (gel){ .kind = G_REF, .ref = root };
    g->el[1] = (gel){ .kind = G_END };
    int p = 2, k = 0;
    for (int i = 0; i < b->n; i++) {
        g->alt_off[i] = k;
        for (int a = 0; a < b->r[i].n; a++) {
            g->alt[k++] = p;
            if (b->r[i].alt[a].n > 0)
                memcpy(&g->el[p], b->r[i].alt[a].el, (size_t)b->r[i].alt[a].n * sizeof(gel));
            p += b->r[i].alt[a].n;
            g->el[p++] = (gel){ .kind = G_END };
        }
    }
    g->alt_off[b->n] = k;
    g->n_el = n_el;
    g->n_rules = b->n;
    atomic_init(&g->refs, 1);
    g->shared = gshared_new();
    gb_free(b);
    /* a grammar that cannot even start (a rule that refers to itself first) is refused here,
     * not when a request meets it */
    pd_gmatch *m = NULL;
    pd_status st = pd_gmatch_create(g, &m, b->err);
    if (st == PD_OK && gmatch_dead(m))
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

static void gshared_free(struct gshared *c);

void pd_grammar_unref(pd_grammar *g)
{
    if (g == NULL || atomic_fetch_sub(&g->refs, 1) != 1)
        return;
    gshared_free(g->shared);
    free(g->el);
    free(g->alt);
    free(g->alt_off);
    free(g);
}

/* ---- JSON ---------------------------------------------------------------------------------- */

typedef struct {
    gb *b;
    const cJSON *root;
    int ws, str_char, string, integer, number, boolean, null, value, obj_any;
    struct jref {
        char *name;
        int rule;
    } *refs;
    int n_refs, cap_refs;
} jctx;

static int j_err(jctx *j, const char *path, const char *fmt, const char *what)
{
    char m[400];
    char w[200];
    snprintf(w, sizeof(w), fmt, what);
    snprintf(m, sizeof(m), "JSON schema at %s: %s", path[0] ? path : "the root", w);
    return gb_fail(j->b, PD_ERR_INVALID, m);
}

/* whitespace between tokens: none, one space, or a newline and up to 20 spaces or tabs (a
 * bound, so that a model cannot pad forever) */
static int j_ws(jctx *j)
{
    if (j->ws >= 0)
        return j->ws;
    gb *b = j->b;
    gset ind = { { 0 } };
    set_add(&ind, ' ');
    set_add(&ind, '\t');
    int tail = gb_rep(b, gb_cls_rule(b, &ind), 0, 20);
    int r = gb_rule_new(b);
    gb_alt(b, r);
    gb_lit(b, r, gb_alt(b, r), " ", 1);
    int a = gb_alt(b, r);
    gb_lit(b, r, a, "\n", 1);
    gb_ref(b, r, a, tail);
    return j->ws = r;
}

/* one character of a JSON string: printable ASCII but " and \, an escape, or a UTF-8 sequence */
static int j_str_char(jctx *j)
{
    if (j->str_char >= 0)
        return j->str_char;
    gb *b = j->b;
    int r = gb_rule_new(b);
    gset plain = { { 0 } }, esc = { { 0 } }, hex = { { 0 } };
    set_range(&plain, 0x20, 0x7f);
    plain.w['"' >> 5] &= ~(1u << ('"' & 31));
    plain.w['\\' >> 5] &= ~(1u << ('\\' & 31));
    for (const char *c = "\"\\/bfnrt"; *c; c++)
        set_add(&esc, (uint8_t)*c);
    set_range(&hex, '0', '9');
    set_range(&hex, 'a', 'f');
    set_range(&hex, 'A', 'F');
    gb_cls(b, r, gb_alt(b, r), &plain);
    int a = gb_alt(b, r);
    gb_lit(b, r, a, "\\", 1);
    gb_cls(b, r, a, &esc);
    a = gb_alt(b, r);
    gb_lit(b, r, a, "\\u", 2);
    for (int i = 0; i < 4; i++)
        gb_cls(b, r, a, &hex);
    gb_utf8_alts(b, r);
    return j->str_char = r;
}

static int j_string_len(jctx *j, int min, int max)
{
    gb *b = j->b;
    int body = min == 0 && max < 0 ? gb_star(b, j_str_char(j)) : gb_rep(b, j_str_char(j), min, max);
    int r = gb_rule_new(b);
    int a = gb_alt(b, r);
    gb_lit(b, r, a, "\"", 1);
    gb_ref(b, r, a, body);
    gb_lit(b, r, a, "\"", 1);
    return r;
}

static int j_string(jctx *j)
{
    if (j->string < 0)
        j->string = j_string_len(j, 0, -1);
    return j->string;
}

/* -?(0|[1-9][0-9]{0,15}) */
static int j_integer(jctx *j)
{
    if (j->integer >= 0)
        return j->integer;
    gb *b = j->b;
    gset d = { { 0 } }, d19 = { { 0 } };
    set_range(&d, '0', '9');
    set_range(&d19, '1', '9');
    int digits = gb_rep(b, gb_cls_rule(b, &d), 0, 15);
    int mag = gb_rule_new(b);
    gb_lit(b, mag, gb_alt(b, mag), "0", 1);
    int a = gb_alt(b, mag);
    gb_cls(b, mag, a, &d19);
    gb_ref(b, mag, a, digits);
    int r = gb_rule_new(b);
    a = gb_alt(b, r);
    gb_ref(b, r, a, gb_opt(b, gb_lit_rule(b, "-", 1)));
    gb_ref(b, r, a, mag);
    return j->integer = r;
}

/* integer (.[0-9]{1,16})? ([eE][-+]?[0-9]{1,3})? */
static int j_number(jctx *j)
{
    if (j->number >= 0)
        return j->number;
    gb *b = j->b;
    gset d = { { 0 } }, e = { { 0 } }, sign = { { 0 } };
    set_range(&d, '0', '9');
    set_add(&e, 'e');
    set_add(&e, 'E');
    set_add(&sign, '+');
    set_add(&sign, '-');
    int dig = gb_cls_rule(b, &d);
    int frac = gb_rule_new(b);
    int a = gb_alt(b, frac);
    gb_lit(b, frac, a, ".", 1);
    gb_ref(b, frac, a, gb_rep(b, dig, 1, 16));
    int ex = gb_rule_new(b);
    a = gb_alt(b, ex);
    gb_cls(b, ex, a, &e);
    gb_ref(b, ex, a, gb_opt(b, gb_cls_rule(b, &sign)));
    gb_ref(b, ex, a, gb_rep(b, dig, 1, 3));
    int r = gb_rule_new(b);
    a = gb_alt(b, r);
    gb_ref(b, r, a, j_integer(j));
    gb_ref(b, r, a, gb_opt(b, frac));
    gb_ref(b, r, a, gb_opt(b, ex));
    return j->number = r;
}

static int j_boolean(jctx *j)
{
    if (j->boolean >= 0)
        return j->boolean;
    int r = gb_rule_new(j->b);
    gb_lit(j->b, r, gb_alt(j->b, r), "true", 4);
    gb_lit(j->b, r, gb_alt(j->b, r), "false", 5);
    return j->boolean = r;
}

static int j_null(jctx *j)
{
    if (j->null < 0)
        j->null = gb_lit_rule(j->b, "null", 4);
    return j->null;
}

/* open ws [item (ws "," ws item){min-1, max-1}] ws close, with a bound on the items (max < 0:
 * none); `item` may be made after this call (a forward reference through its rule id) */
static int j_list(jctx *j, const char *open, const char *close, int item, int min, int max)
{
    gb *b = j->b;
    int ws = j_ws(j);
    int r = gb_rule_new(b);
    int a = gb_alt(b, r);
    gb_lit(b, r, a, open, 1);
    gb_ref(b, r, a, ws);
    if (max != 0) {
        int more = gb_rule_new(b);
        int m = gb_alt(b, more);
        gb_ref(b, more, m, ws);
        gb_lit(b, more, m, ",", 1);
        gb_ref(b, more, m, ws);
        gb_ref(b, more, m, item);
        int list = gb_rule_new(b);
        int la = gb_alt(b, list);
        gb_ref(b, list, la, item);
        gb_ref(b, list, la, gb_rep(b, more, min > 1 ? min - 1 : 0, max < 0 ? -1 : max - 1));
        gb_ref(b, r, a, min == 0 ? gb_opt(b, list) : list);
        gb_ref(b, r, a, ws);
    }
    gb_lit(b, r, a, close, 1);
    return r;
}

/* string ws ":" ws value */
static int j_member(jctx *j, int value)
{
    gb *b = j->b;
    int r = gb_rule_new(b);
    int a = gb_alt(b, r);
    gb_ref(b, r, a, j_string(j));
    gb_ref(b, r, a, j_ws(j));
    gb_lit(b, r, a, ":", 1);
    gb_ref(b, r, a, j_ws(j));
    gb_ref(b, r, a, value);
    return r;
}

/* any JSON value; the object and array rules refer back to it */
static int j_value(jctx *j)
{
    if (j->value >= 0)
        return j->value;
    gb *b = j->b;
    int v = j->value = gb_rule_new(b);
    j->obj_any = j_list(j, "{", "}", j_member(j, v), 0, -1);
    int parts[6] = { j->obj_any, j_list(j, "[", "]", v, 0, -1), j_string(j), j_number(j), j_boolean(j), j_null(j) };
    for (int i = 0; i < 6; i++)
        gb_ref(b, v, gb_alt(b, v), parts[i]);
    return v;
}

static int j_literal(jctx *j, const cJSON *v, const char *path)
{
    char *s = cJSON_PrintUnformatted(v);
    if (s == NULL)
        return j_err(j, path, "%s", "a value that cannot be printed");
    int r = gb_lit_rule(j->b, s, strlen(s));
    cJSON_free(s);
    return r;
}

static int j_schema(jctx *j, const cJSON *s, const char *path, int depth);

/* the rule of a $ref, made once (recursive schemas refer to it while it is being made) */
static int j_ref(jctx *j, const char *ref, const char *path, int depth)
{
    for (int i = 0; i < j->n_refs; i++)
        if (strcmp(j->refs[i].name, ref) == 0)
            return j->refs[i].rule;
    const cJSON *target = NULL;
    if (strcmp(ref, "#") == 0)
        target = j->root;
    else if (strncmp(ref, "#/$defs/", 8) == 0)
        target = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j->root, "$defs"), ref + 8);
    else if (strncmp(ref, "#/definitions/", 14) == 0)
        target = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j->root, "definitions"),
                                                  ref + 14);
    if (target == NULL)
        return j_err(j, path, "$ref '%s' does not name #, #/$defs/NAME or #/definitions/NAME of this schema", ref);
    if (grow((void **)&j->refs, &j->cap_refs, j->n_refs + 1, sizeof(*j->refs)) != 0)
        return gb_fail(j->b, PD_ERR_NOMEM, "schema references");
    int r = gb_rule_new(j->b);
    j->refs[j->n_refs].name = strdup(ref);
    j->refs[j->n_refs].rule = r;
    if (j->refs[j->n_refs].name == NULL)
        return gb_fail(j->b, PD_ERR_NOMEM, "schema references");
    j->n_refs++;
    int body = j_schema(j, target, ref, depth + 1);
    gb_ref(j->b, r, gb_alt(j->b, r), body);
    return r;
}

static int j_count(jctx *j, const cJSON *s, const char *key, const char *path, int *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
    if (v == NULL)
        return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 100000 ||
        v->valuedouble != (double)(int)v->valuedouble)
        return j_err(j, path, "'%s' must be an integer in 0..100000", key);
    *out = (int)v->valuedouble;
    return 0;
}

/* an object: the listed properties in their order (the required ones always, the others
 * optional), then, when additionalProperties allows, any other members */
static int j_object(jctx *j, const cJSON *s, const char *path, int depth)
{
    gb *b = j->b;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *addl = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (props != NULL && !cJSON_IsObject(props))
        return j_err(j, path, "'%s' must be an object", "properties");
    if (req != NULL && !cJSON_IsArray(req))
        return j_err(j, path, "'%s' must be an array of names", "required");
    int n = props != NULL ? cJSON_GetArraySize(props) : 0;
    cJSON *it;
    cJSON_ArrayForEach(it, req) {
        if (!cJSON_IsString(it) || cJSON_GetObjectItemCaseSensitive(props, it->valuestring) == NULL)
            return j_err(j, path, "'required' names '%s', which is not in 'properties'",
                         cJSON_IsString(it) ? it->valuestring : "a non-string");
    }
    /* extra members: additionalProperties true or a schema; absent means none when properties
     * are listed (OpenAI's strict mode) and any when not */
    int extra_value = -1;
    if (addl == NULL ? n == 0 : !cJSON_IsFalse(addl)) {
        char p[256];
        snprintf(p, sizeof(p), "%s.additionalProperties", path);
        extra_value = addl == NULL || cJSON_IsTrue(addl) ? j_value(j) : j_schema(j, addl, p, depth + 1);
    }
    if (n == 0)
        return extra_value >= 0 ? j_list(j, "{", "}", j_member(j, extra_value), 0, -1) : gb_lit_rule(b, "{}", 2);
    int ws = j_ws(j);
    /* rest_i: properties i.. after at least one member; first_i: before any */
    int rest = gb_rule_new(b), first = gb_rule_new(b);
    if (extra_value >= 0) {
        int em = j_member(j, extra_value);
        int more = gb_rule_new(b);
        int a = gb_alt(b, more);
        gb_ref(b, more, a, ws);
        gb_lit(b, more, a, ",", 1);
        gb_ref(b, more, a, ws);
        gb_ref(b, more, a, em);
        int star = gb_star(b, more);
        gb_ref(b, rest, gb_alt(b, rest), star);
        a = gb_alt(b, first);
        gb_ref(b, first, a, em);
        gb_ref(b, first, a, star);
        gb_alt(b, first);
    } else {
        gb_alt(b, rest);
        gb_alt(b, first);
    }
    const cJSON **list = malloc((size_t)n * sizeof(*list));
    if (list == NULL)
        return gb_fail(b, PD_ERR_NOMEM, "schema properties");
    int k = 0;
    cJSON_ArrayForEach(it, props) list[k++] = it;
    for (int i = n - 1; i >= 0 && b->st == PD_OK; i--) {
        const cJSON *pr = list[i];
        int required = 0;
        cJSON_ArrayForEach(it, req) required |= strcmp(it->valuestring, pr->string) == 0;
        char p[256];
        snprintf(p, sizeof(p), "%s.properties.%s", path, pr->string);
        cJSON *key = cJSON_CreateString(pr->string);
        char *ks = key != NULL ? cJSON_PrintUnformatted(key) : NULL;
        cJSON_Delete(key);
        if (ks == NULL) {
            gb_fail(b, PD_ERR_NOMEM, "schema property name");
            break;
        }
        int kv = gb_rule_new(b);
        int a = gb_alt(b, kv);
        gb_lit(b, kv, a, ks, strlen(ks));
        cJSON_free(ks);
        gb_ref(b, kv, a, ws);
        gb_lit(b, kv, a, ":", 1);
        gb_ref(b, kv, a, ws);
        gb_ref(b, kv, a, j_schema(j, pr, p, depth + 1));
        int nrest = gb_rule_new(b), nfirst = gb_rule_new(b);
        a = gb_alt(b, nrest);
        gb_ref(b, nrest, a, ws);
        gb_lit(b, nrest, a, ",", 1);
        gb_ref(b, nrest, a, ws);
        gb_ref(b, nrest, a, kv);
        gb_ref(b, nrest, a, rest);
        a = gb_alt(b, nfirst);
        gb_ref(b, nfirst, a, kv);
        gb_ref(b, nfirst, a, rest);
        if (!required) {
            gb_ref(b, nrest, gb_alt(b, nrest), rest);
            gb_ref(b, nfirst, gb_alt(b, nfirst), first);
        }
        rest = nrest;
        first = nfirst;
    }
    free(list);
    int r = gb_rule_new(b);
    int a = gb_alt(b, r);
    gb_lit(b, r, a, "{", 1);
    gb_ref(b, r, a, ws);
    gb_ref(b, r, a, first);
    gb_ref(b, r, a, ws);
    gb_lit(b, r, a, "}", 1);
    return r;
}

static int j_pattern(jctx *j, const char *pat, const char *path);

/* ---- integer ranges: the decimal strings of [lo, hi] ---- */

#define J_INT_MAX 9999999999999999LL   /* 16 digits, the integer rule's bound */

/* the digit strings from lo to hi, both of n digits (leading zeros included) */
static int j_digit_range(jctx *j, const char *lo, const char *hi, int n)
{
    gb *b = j->b;
    int r = gb_rule_new(b);
    int a = gb_alt(b, r);
    gset d09 = { { 0 } };
    set_range(&d09, '0', '9');
    int all = 1;
    for (int i = 0; i < n && all; i++)
        all = lo[i] == '0' && hi[i] == '9';
    if (n == 0 || all) {
        for (int i = 0; i < n; i++)
            gb_cls(b, r, a, &d09);
        return r;
    }
    if (lo[0] == hi[0]) {
        gb_lit(b, r, a, lo, 1);
        gb_ref(b, r, a, j_digit_range(j, lo + 1, hi + 1, n - 1));
        return r;
    }
    char nines[17], zeros[17];
    memset(nines, '9', sizeof(nines));
    memset(zeros, '0', sizeof(zeros));
    gb_lit(b, r, a, lo, 1);
    gb_ref(b, r, a, j_digit_range(j, lo + 1, nines, n - 1));
    if (hi[0] - lo[0] > 1) {
        gset mid = { { 0 } };
        set_range(&mid, lo[0] + 1, hi[0] - 1);
        a = gb_alt(b, r);
        gb_cls(b, r, a, &mid);
        for (int i = 1; i < n; i++)
            gb_cls(b, r, a, &d09);
    }
    a = gb_alt(b, r);
    gb_lit(b, r, a, hi, 1);
    gb_ref(b, r, a, j_digit_range(j, zeros, hi + 1, n - 1));
    return r;
}

/* alternatives of rule r: the integers lo..hi (0 <= lo <= hi), no leading zeros */
static void j_nonneg_range(jctx *j, int r, long long lo, long long hi)
{
    long long p10 = 1;
    for (int n = 1; n <= 16; n++, p10 *= 10) {
        long long a = lo > (n == 1 ? 0 : p10) ? lo : (n == 1 ? 0 : p10), z = hi < p10 * 10 - 1 ? hi : p10 * 10 - 1;
        if (a > z)
            continue;
        char sa[24], sz[24];
        snprintf(sa, sizeof(sa), "%0*lld", n, a);
        snprintf(sz, sizeof(sz), "%0*lld", n, z);
        gb_ref(j->b, r, gb_alt(j->b, r), j_digit_range(j, sa, sz, n));
    }
}

/* an integer within minimum / maximum / exclusiveMinimum / exclusiveMaximum (16 digits at most) */
static int j_int_range(jctx *j, const cJSON *s, const char *path)
{
    long long lo = -J_INT_MAX, hi = J_INT_MAX;
    static const char *const keys[4] = { "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum" };
    for (int k = 0; k < 4; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, keys[k]);
        if (v == NULL)
            continue;
        if (!cJSON_IsNumber(v) || !(fabs(v->valuedouble) < 1e16))
            return j_err(j, path, "'%s' must be a number of at most 16 digits", keys[k]);
        double x = v->valuedouble;
        long long b = k == 0 ? (long long)ceil(x) : k == 1 ? (long long)floor(x)
                    : k == 2 ? (long long)floor(x) + 1 : (long long)ceil(x) - 1;
        if (k % 2 == 0 && b > lo)
            lo = b;
        if (k % 2 == 1 && b < hi)
            hi = b;
    }
    if (lo > hi)
        return j_err(j, path, "%s", "the integer range minimum..maximum is empty");
    gb *b = j->b;
    int r = gb_rule_new(b);
    if (hi >= 0)
        j_nonneg_range(j, r, lo > 0 ? lo : 0, hi);
    if (lo < 0) {   /* "-" and the magnitudes max(1, -hi) .. -lo */
        int neg = gb_rule_new(b);
        j_nonneg_range(j, neg, hi < 0 ? -hi : 1, -lo);
        int a = gb_alt(b, r);
        gb_lit(b, r, a, "-", 1);
        gb_ref(b, r, a, neg);
    }
    return r;
}

/* ---- number ranges: decimals between two bounds, no exponent ---- */

/* a bound's magnitude w.f: its whole part and its fraction digits (trailing zeros dropped) */
typedef struct {
    long long w;
    char f[17];
} jdec;

/* v (0 <= v < 1e15) as the shortest decimal that reads back as v; -1 past 16 fraction digits */
static int j_dec(double v, jdec *d)
{
    char s[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(s, sizeof(s), "%.*e", p - 1, v);
        if (strtod(s, NULL) == v)
            break;
    }
    char m[24];   /* the mantissa's digits: value 0.m * 10^(exp + 1) */
    size_t k = 0;
    const char *e = s;
    for (; *e != '\0' && *e != 'e'; e++)
        if (isdigit((unsigned char)*e) && k + 1 < sizeof(m))
            m[k++] = *e;
    m[k] = '\0';
    int point = 1 + (*e == 'e' ? atoi(e + 1) : 0);   /* digits of m before the point */
    d->w = 0;
    for (int i = 0; i < point; i++)
        d->w = d->w * 10 + (i < (int)k ? m[i] - '0' : 0);
    char f[64];
    size_t n = 0;
    for (int i = point; i < 0 && n + 1 < sizeof(f); i++)
        f[n++] = '0';
    for (int i = point > 0 ? point : 0; i < (int)k && n + 1 < sizeof(f); i++)
        f[n++] = m[i];
    while (n > 0 && f[n - 1] == '0')
        n--;
    if (n > 16)
        return -1;
    memcpy(d->f, f, n);
    d->f[n] = '\0';
    return 0;
}

/* Fraction digits d (0.d) against bounds: F_GE 0.d >= 0.fa (> when sa), F_LE 0.d <= 0.fb (<
 * when sb), F_BT both (0.fa <= 0.fb). A bound past its digits reads as zeros. */
enum { F_GE, F_LE, F_BT };

static int j_frac_empty_ok(int kind, const char *fa, int sa, const char *fb, int sb)
{
    int ge = fa[0] == '\0' && !sa, le = fb[0] != '\0' || !sb;
    return kind == F_GE ? ge : kind == F_LE ? le : ge && le;
}

static int j_frac_ne(jctx *j, int kind, const char *fa, int sa, const char *fb, int sb, int n);

typedef struct {
    char lo, hi;
    int kind;
} jfstep;

/* the digit strings of 0..n digits that keep the comparison, each after `lead` when it is not
 * empty ("." for a number's fraction, "" inside one); -1 when there are none */
static int j_frac_rest(jctx *j, int kind, const char *fa, int sa, const char *fb, int sb, int n, const char *lead)
{
    int ne = j_frac_ne(j, kind, fa, sa, fb, sb, n);
    int empty = j_frac_empty_ok(kind, fa, sa, fb, sb);
    if (ne < 0 && !empty)
        return -1;
    int r = gb_rule_new(j->b);
    if (empty)
        gb_alt(j->b, r);
    if (ne >= 0) {
        int a = gb_alt(j->b, r);
        gb_lit(j->b, r, a, lead, strlen(lead));
        gb_ref(j->b, r, a, ne);
    }
    return r;
}

/* the same, of 1..n digits, by the first digit */
static int j_frac_ne(jctx *j, int kind, const char *fa, int sa, const char *fb, int sb, int n)
{
    gb *b = j->b;
    if (n == 0)
        return -1;
    gset dig = { { 0 } };
    set_range(&dig, '0', '9');
    if (kind == F_GE && fa[0] == '\0' && !sa)   /* anything */
        return gb_rep(b, gb_cls_rule(b, &dig), 1, n);
    if (kind == F_LE && fb[0] == '\0')          /* zeros, or nothing */
        return sb ? -1 : gb_rep(b, gb_lit_rule(b, "0", 1), 1, n);
    int any = gb_rep(b, gb_cls_rule(b, &dig), 0, n - 1);
    const char *na = fa[0] != '\0' ? fa + 1 : fa, *nb = fb[0] != '\0' ? fb + 1 : fb;
    char a1 = fa[0] != '\0' ? fa[0] : '0', b1 = fb[0] != '\0' ? fb[0] : '0';
    int r = gb_rule_new(b), alts = 0;
    /* the first digit: a class [lo, hi] followed by any digits (kind < 0) or one digit followed
     * by what keeps the comparison (kind) */
    jfstep step[3];
    int k = 0;
    if (kind == F_GE) {
        step[k++] = (jfstep){ a1, a1, F_GE };
        step[k++] = (jfstep){ (char)(a1 + 1), '9', -1 };
    } else if (kind == F_LE) {
        step[k++] = (jfstep){ '0', (char)(b1 - 1), -1 };
        step[k++] = (jfstep){ b1, b1, F_LE };
    } else if (a1 == b1) {
        step[k++] = (jfstep){ a1, a1, F_BT };
    } else {
        step[k++] = (jfstep){ a1, a1, F_GE };
        step[k++] = (jfstep){ (char)(a1 + 1), (char)(b1 - 1), -1 };
        step[k++] = (jfstep){ b1, b1, F_LE };
    }
    for (int i = 0; i < k; i++) {
        if (step[i].lo > step[i].hi)
            continue;
        int rest = step[i].kind < 0 ? any : j_frac_rest(j, step[i].kind, na, sa, nb, sb, n - 1, "");
        if (rest < 0)
            continue;
        gset c = { { 0 } };
        set_range(&c, (uint8_t)step[i].lo, (uint8_t)step[i].hi);
        int a = gb_alt(b, r);
        gb_cls(b, r, a, &c);
        gb_ref(b, r, a, rest);
        alts++;
    }
    return alts > 0 ? r : -1;
}

/* the fraction after a whole part: none or "." and 1..fdig digits, as kind asks; -1 when none */
static int j_frac(jctx *j, int kind, const char *fa, int sa, const char *fb, int sb, int fdig)
{
    return j_frac_rest(j, kind, fa, sa, fb, sb, fdig, ".");
}

/* alternatives of r: whole part w (one integer) followed by fraction rule fr (none when < 0) */
static void j_whole_frac(jctx *j, int r, long long lo, long long hi, int fr)
{
    if (fr < 0 || lo > hi)
        return;
    int w = gb_rule_new(j->b);
    j_nonneg_range(j, w, lo, hi);
    int a = gb_alt(j->b, r);
    gb_ref(j->b, r, a, w);
    gb_ref(j->b, r, a, fr);
}

/* alternatives of r: the magnitudes x in [a, b] (0 <= a <= b; b NULL: no upper bound), either
 * end exclusive, as decimal strings with a fraction of up to fdig digits, no exponent */
static void j_mag_range(jctx *j, int r, const jdec *a, int a_ex, const jdec *b, int b_ex, int fdig)
{
    if (b != NULL && a->w == b->w) {
        j_whole_frac(j, r, a->w, a->w, j_frac(j, F_BT, a->f, a_ex, b->f, b_ex, fdig));
        return;
    }
    j_whole_frac(j, r, a->w, a->w, j_frac(j, F_GE, a->f, a_ex, "", 0, fdig));
    j_whole_frac(j, r, a->w + 1, b != NULL ? b->w - 1 : J_INT_MAX, j_frac(j, F_GE, "", 0, "", 0, fdig));
    if (b != NULL)
        j_whole_frac(j, r, b->w, b->w, j_frac(j, F_LE, "", 0, b->f, b_ex, fdig));
}

/* a number within minimum / maximum / exclusiveMinimum / exclusiveMaximum (bounds below 1e15
 * with up to 16 fraction digits; none: unbounded) with up to fdig fraction digits; written
 * without an exponent */
static int j_num_range(jctx *j, const cJSON *s, const char *path, int fdig)
{
    double lo = 0, hi = 0;
    int lo_ex = 0, hi_ex = 0, has_lo = 0, has_hi = 0;
    static const char *const keys[4] = { "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum" };
    for (int k = 0; k < 4; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, keys[k]);
        if (v == NULL)
            continue;
        jdec d;
        if (!cJSON_IsNumber(v) || !(fabs(v->valuedouble) < 1e15) || j_dec(fabs(v->valuedouble), &d) != 0)
            return j_err(j, path, "'%s' on a number must be below 1e15 with at most 16 fractional digits",
                         keys[k]);
        double x = v->valuedouble;
        int ex = k >= 2;
        if (k % 2 == 0 && (!has_lo || x > lo || (x == lo && ex))) {
            lo = x;
            lo_ex = ex;
            has_lo = 1;
        }
        if (k % 2 == 1 && (!has_hi || x < hi || (x == hi && ex))) {
            hi = x;
            hi_ex = ex;
            has_hi = 1;
        }
    }
    if (has_lo && has_hi && (lo > hi || (lo == hi && (lo_ex || hi_ex))))
        return j_err(j, path, "%s", "the number range minimum..maximum is empty");
    jdec alo, ahi, zero = { 0, "" };
    j_dec(fabs(lo), &alo);
    j_dec(fabs(hi), &ahi);
    gb *b = j->b;
    int r = gb_rule_new(b);
    if (!has_hi || hi > 0 || (hi == 0 && !hi_ex))   /* v >= 0: x = v in [max(lo, 0), hi] */
        j_mag_range(j, r, has_lo && lo > 0 ? &alo : &zero, has_lo && lo >= 0 && lo_ex, has_hi ? &ahi : NULL, hi_ex, fdig);
    if (!has_lo || lo < 0) {   /* v < 0: "-" and x = -v in (max(-hi, 0), -lo] */
        int neg = gb_rule_new(b);
        int hi_neg = has_hi && hi < 0;
        j_mag_range(j, neg, hi_neg ? &ahi : &zero, hi_neg ? hi_ex : 1, has_lo ? &alo : NULL, lo_ex, fdig);
        int a = gb_alt(b, r);
        gb_lit(b, r, a, "-", 1);
        gb_ref(b, r, a, neg);
    }
    return r;
}

/* The string formats enforced (as regular expressions over the unescaped text, none needing a
 * JSON escape); other formats are annotations, as JSON Schema has them by default. */
#define J_HEX4 "[0-9a-fA-F]{1,4}"
#define J_LABEL "[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
#define J_DATE "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
#define J_TIME "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
#define J_IPV4_PART "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
static const struct {
    const char *name, *re;
} j_formats[] = {
    { "date", "^" J_DATE "$" },
    { "time", "^" J_TIME "$" },
    { "date-time", "^" J_DATE "[Tt]" J_TIME "$" },
    { "uuid", "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$" },
    { "ipv4", "^(" J_IPV4_PART "\\.){3}" J_IPV4_PART "$" },
    { "ipv6", "^((" J_HEX4 ":){7}" J_HEX4 "|(" J_HEX4 ":){1,7}:|(" J_HEX4 ":){1,6}:" J_HEX4 "|(" J_HEX4
              ":){1,5}(:" J_HEX4 "){1,2}|(" J_HEX4 ":){1,4}(:" J_HEX4 "){1,3}|(" J_HEX4 ":){1,3}(:" J_HEX4
              "){1,4}|(" J_HEX4 ":){1,2}(:" J_HEX4 "){1,5}|" J_HEX4 ":(:" J_HEX4 "){1,6}|:((:" J_HEX4
              "){1,7}|:))$" },
    { "hostname", "^" J_LABEL "(\\." J_LABEL ")*$" },
    { "email", "^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@" J_LABEL "(\\." J_LABEL ")+$" },
    { "uri", "^[A-Za-z][A-Za-z0-9+.-]*:[!#-Z\\[\\]^-~]+$" },
};

static int j_typed(jctx *j, const cJSON *s, const char *type, const char *path, int depth)
{
    if (strcmp(type, "string") == 0) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(s, "pattern");
        const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(s, "format");
        if (fmt != NULL && !cJSON_IsString(fmt))
            return j_err(j, path, "'%s' must be a string", "format");
        for (size_t k = 0; pat == NULL && fmt != NULL && k < sizeof(j_formats) / sizeof(j_formats[0]); k++) {
            if (strcmp(fmt->valuestring, j_formats[k].name) != 0)
                continue;
            if (cJSON_GetObjectItemCaseSensitive(s, "minLength") != NULL ||
                cJSON_GetObjectItemCaseSensitive(s, "maxLength") != NULL)
                return j_err(j, path, "format '%s' with minLength or maxLength is not supported", fmt->valuestring);
            return j_pattern(j, j_formats[k].re, path);
        }
        if (pat != NULL) {
            if (!cJSON_IsString(pat))
                return j_err(j, path, "'%s' must be a string", "pattern");
            if (cJSON_GetObjectItemCaseSensitive(s, "minLength") != NULL ||
                cJSON_GetObjectItemCaseSensitive(s, "maxLength") != NULL)
                return j_err(j, path, "%s", "pattern with minLength or maxLength is not supported");
            return j_pattern(j, pat->valuestring, path);
        }
        int min = 0, max = -1;
        j_count(j, s, "minLength", path, &min);
        j_count(j, s, "maxLength", path, &max);
        if (max >= 0 && max < min)
            return j_err(j, path, "%s", "maxLength is below minLength");
        return min == 0 && max < 0 ? j_string(j) : j_string_len(j, min, max);
    }
    int ranged = cJSON_GetObjectItemCaseSensitive(s, "minimum") != NULL ||
                 cJSON_GetObjectItemCaseSensitive(s, "maximum") != NULL ||
                 cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum") != NULL ||
                 cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum") != NULL;
    /* multipleOf: a power of ten up to 1 (0.01: two decimal places at most) on a number, 1 on an
     * integer */
    int fdig = 16;
    const cJSON *mo = cJSON_GetObjectItemCaseSensitive(s, "multipleOf");
    if (mo != NULL) {
        jdec d;
        if (!cJSON_IsNumber(mo) || !(mo->valuedouble > 0 && mo->valuedouble <= 1) || j_dec(mo->valuedouble, &d) != 0)
            return j_err(j, path, "%s", "'multipleOf' must be 1 or a power of ten below it (0.1, 0.01, ...); "
                         "other steps are not supported");
        size_t k = strlen(d.f);
        if (d.w == 1)
            fdig = 0;
        else if (k > 0 && d.f[k - 1] == '1' && strspn(d.f, "0") == k - 1)
            fdig = (int)k;
        else
            return j_err(j, path, "%s", "'multipleOf' must be 1 or a power of ten below it (0.1, 0.01, ...); "
                         "other steps are not supported");
        if (strcmp(type, "integer") == 0 && fdig != 0)
            return j_err(j, path, "%s", "'multipleOf' on an integer must be 1 (other steps are not supported)");
    }
    if (strcmp(type, "integer") == 0)
        return ranged ? j_int_range(j, s, path) : j_integer(j);
    if (strcmp(type, "number") == 0)
        return ranged || mo != NULL ? j_num_range(j, s, path, fdig) : j_number(j);
    if (strcmp(type, "boolean") == 0)
        return j_boolean(j);
    if (strcmp(type, "null") == 0)
        return j_null(j);
    if (strcmp(type, "object") == 0)
        return j_object(j, s, path, depth);
    if (strcmp(type, "array") == 0) {
        int min = 0, max = -1;
        j_count(j, s, "minItems", path, &min);
        j_count(j, s, "maxItems", path, &max);
        if (max >= 0 && max < min)
            return j_err(j, path, "%s", "maxItems is below minItems");
        const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
        char p[256];
        snprintf(p, sizeof(p), "%s.items", path);
        int item = items == NULL || cJSON_IsTrue(items) ? j_value(j) : j_schema(j, items, p, depth + 1);
        return j_list(j, "[", "]", item, min, max);
    }
    return j_err(j, path, "unknown type '%s'", type);
}

static const char *const j_known[] = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions", "minLength", "multipleOf",
    "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "title", "description", "default", "examples", "$schema", "$id",
    "$comment", "format", NULL
};

static int j_schema(jctx *j, const cJSON *s, const char *path, int depth)
{
    gb *b = j->b;
    if (b->st != PD_OK)
        return -1;
    if (depth > 64)
        return j_err(j, path, "%s", "nested more than 64 deep");
    if (cJSON_IsTrue(s))
        return j_value(j);
    if (!cJSON_IsObject(s))
        return j_err(j, path, "%s", "a schema must be an object or true");
    const cJSON *it;
    cJSON_ArrayForEach(it, s) {
        int known = 0;
        for (int i = 0; j_known[i] != NULL && !known; i++)
            known = strcmp(it->string, j_known[i]) == 0;
        if (!known)
            return j_err(j, path, "keyword '%s' is not supported", it->string);
    }
    const cJSON *v;
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "$ref")) != NULL) {
        if (!cJSON_IsString(v))
            return j_err(j, path, "'%s' must be a string", "$ref");
        return j_ref(j, v->valuestring, path, depth);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "const")) != NULL)
        return j_literal(j, v, path);
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "enum")) != NULL) {
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) == 0)
            return j_err(j, path, "'%s' must be a non-empty array", "enum");
        int r = gb_rule_new(b);
        cJSON_ArrayForEach(it, v) gb_ref(b, r, gb_alt(b, r), j_literal(j, it, path));
        return r;
    }
    const char *alts[] = { "anyOf", "oneOf", "allOf" };
    for (int k = 0; k < 3; k++) {
        if ((v = cJSON_GetObjectItemCaseSensitive(s, alts[k])) == NULL)
            continue;
        if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) == 0)
            return j_err(j, path, "'%s' must be a non-empty array of schemas", alts[k]);
        if (k == 2 && cJSON_GetArraySize(v) != 1)
            return j_err(j, path, "%s", "allOf of more than one schema is not supported");
        if (cJSON_GetObjectItemCaseSensitive(s, "type") != NULL ||
            cJSON_GetObjectItemCaseSensitive(s, "properties") != NULL)
            return j_err(j, path, "'%s' beside type or properties is not supported", alts[k]);
        int r = gb_rule_new(b), i = 0;
        cJSON_ArrayForEach(it, v) {
            char p[256];
            snprintf(p, sizeof(p), "%s.%s[%d]", path, alts[k], i++);
            gb_ref(b, r, gb_alt(b, r), j_schema(j, it, p, depth + 1));
        }
        return r;
    }
    v = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (v == NULL) {
        if (cJSON_GetObjectItemCaseSensitive(s, "properties") != NULL ||
            cJSON_GetObjectItemCaseSensitive(s, "additionalProperties") != NULL)
            return j_object(j, s, path, depth);
        if (cJSON_GetObjectItemCaseSensitive(s, "items") != NULL)
            return j_typed(j, s, "array", path, depth);
        return j_value(j);
    }
    if (cJSON_IsString(v))
        return j_typed(j, s, v->valuestring, path, depth);
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) == 0)
        return j_err(j, path, "%s", "'type' must be a name or a non-empty array of names");
    int r = gb_rule_new(b);
    cJSON_ArrayForEach(it, v) {
        if (!cJSON_IsString(it))
            return j_err(j, path, "%s", "'type' lists a non-string");
        gb_ref(b, r, gb_alt(b, r), j_typed(j, s, it->valuestring, path, depth));
    }
    return r;
}

pd_status pd_grammar_json(const char *schema, size_t len, pd_grammar **out, pd_err *err)
{
    gb b = { .err = err };
    jctx j = { .b = &b, .ws = -1, .str_char = -1, .string = -1, .integer = -1, .number = -1,
               .boolean = -1, .null = -1, .value = -1, .obj_any = -1 };
    cJSON *doc = NULL;
    int root;
    if (schema == NULL) {
        j_value(&j);
        root = j.obj_any;
    } else {
        if (len > PD_GRAMMAR_MAX_SPEC)
            return pd_err_set(err, PD_ERR_INVALID, "JSON schema of %zu bytes (at most %d)", len,
                              PD_GRAMMAR_MAX_SPEC);
        doc = cJSON_ParseWithLength(schema, len);
        if (doc == NULL)
            return pd_err_set(err, PD_ERR_INVALID, "JSON schema: not valid JSON");
        j.root = doc;
        root = j_schema(&j, doc, "", 0);
    }
    for (int i = 0; i < j.n_refs; i++)
        free(j.refs[i].name);
    free(j.refs);
    cJSON_Delete(doc);
    return gb_finish(&b, root, out);
}

/* ---- tool calls ----------------------------------------------------------------------------- */

pd_status pd_grammar_tool_calls(const char *const *names, const char *const *schemas, int n, int parallel,
                                pd_grammar **out, pd_err *err)
{
    if (n < 1 || n > PD_GRAMMAR_MAX_CHOICES)
        return pd_err_set(err, PD_ERR_INVALID, "%d tools (1..%d)", n, PD_GRAMMAR_MAX_CHOICES);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (names[i] == NULL || names[i][0] == '\0')
            return pd_err_set(err, PD_ERR_INVALID, "tool %d has no name", i);
        for (const char *c = names[i]; *c; c++)
            if (*c == '"' || *c == '\\' || (uint8_t)*c < 0x20)
                return pd_err_set(err, PD_ERR_INVALID, "tool %d: its name needs JSON escapes", i);
        total += strlen(names[i]) + (schemas[i] != NULL ? strlen(schemas[i]) : 0);
    }
    if (total > PD_GRAMMAR_MAX_SPEC)
        return pd_err_set(err, PD_ERR_INVALID, "tools of %zu bytes (at most %d)", total, PD_GRAMMAR_MAX_SPEC);
    gb b = { .err = err };
    jctx j = { .b = &b, .ws = -1, .str_char = -1, .string = -1, .integer = -1, .number = -1,
               .boolean = -1, .null = -1, .value = -1, .obj_any = -1 };
    int call = gb_rule_new(&b);
    for (int i = 0; i < n && b.st == PD_OK; i++) {
        cJSON *doc = NULL;
        int args;
        if (schemas[i] == NULL) {
            j_value(&j);
            args = j.obj_any;
        } else if ((doc = cJSON_Parse(schemas[i])) == NULL) {
            args = gb_fail(&b, PD_ERR_INVALID, "JSON schema: not valid JSON");
        } else {
            j.root = doc;
            args = j_schema(&j, doc, "", 0);
        }
        for (int k = 0; k < j.n_refs; k++)   /* $refs are the tool's own */
            free(j.refs[k].name);
        j.n_refs = 0;
        cJSON_Delete(doc);
        if (b.st == PD_ERR_INVALID) {   /* which tool's parameters */
            char m[sizeof(err->msg)];
            snprintf(m, sizeof(m), "tool '%.64s' parameters: %.400s", names[i], err->msg);
            snprintf(err->msg, sizeof(err->msg), "%s", m);
        }
        int a = gb_alt(&b, call);
        static const char pre[] = "<tool_call>\n{\"name\": \"", mid[] = "\", \"arguments\": ",
                          post[] = "}\n</tool_call>";
        gb_lit(&b, call, a, pre, sizeof(pre) - 1);
        gb_lit(&b, call, a, names[i], strlen(names[i]));
        gb_lit(&b, call, a, mid, sizeof(mid) - 1);
        gb_ref(&b, call, a, args);
        gb_lit(&b, call, a, post, sizeof(post) - 1);
    }
    free(j.refs);
    int root = call;
    if (parallel) {   /* call ("\n" call)* */
        int more = gb_rule_new(&b);
        int a = gb_alt(&b, more);
        gb_lit(&b, more, a, "\n", 1);
        gb_ref(&b, more, a, call);
        int tail = gb_star(&b, more);
        root = gb_rule_new(&b);
        a = gb_alt(&b, root);
        gb_ref(&b, root, a, call);
        gb_ref(&b, root, a, tail);
    }
    return gb_finish(&b, root, out);
}

/* ---- choices -------------------------------------------------------------------------------- */

pd_status pd_grammar_choice(const char *const *choices, int n, pd_grammar **out, pd_err *err)
{
    if (n < 1 || n > PD_GRAMMAR_MAX_CHOICES)
        return pd_err_set(err, PD_ERR_INVALID, "%d choices (1..%d)", n, PD_GRAMMAR_MAX_CHOICES);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (choices[i] == NULL || choices[i][0] == '\0')
            return pd_err_set(err, PD_ERR_INVALID, "choice %d is empty", i);
        total += strlen(choices[i]);
    }
    if (total > PD_GRAMMAR_MAX_SPEC)
        return pd_err_set(err, PD_ERR_INVALID, "choices of %zu bytes (at most %d)", total, PD_GRAMMAR_MAX_SPEC);
    gb b = { .err = err };
    int r = gb_rule_new(&b);
    for (int i = 0; i < n; i++)
        gb_lit(&b, r, gb_alt(&b, r), choices[i], strlen(choices[i]));
    return gb_finish(&b, r, out);
}

/* ---- regular expressions -------------------------------------------------------------------- */

typedef struct {
    gb *b;
    const char *s;
    size_t n, i;
    int utf8;        /* rule: any UTF-8 sequence of two to four bytes */
    int json;        /* the text is a JSON string's body (a schema's pattern): characters that
                      * JSON escapes are matched as their escapes */
} rctx;

/* the JSON escape of byte c when a JSON string must escape it, else NULL */
static const char *json_escape(uint8_t c, char buf[8])
{
    switch (c) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\n': return "\\n";
    case '\t': return "\\t";
    case '\r': return "\\r";
    case '\b': return "\\b";
    case '\f': return "\\f";
    default: break;
    }
    if (c < 0x20) {
        snprintf(buf, 8, "\\u%04x", c);
        return buf;
    }
    return NULL;
}

/* a literal run of bytes (escaped where a JSON string must) */
static int r_lit(rctx *r, const char *s, size_t n)
{
    if (!r->json)
        return gb_lit_rule(r->b, s, n);
    int x = gb_rule_new(r->b);
    int a = gb_alt(r->b, x);
    for (size_t i = 0; i < n; i++) {
        char buf[8];
        const char *e = json_escape((uint8_t)s[i], buf);
        if (e != NULL)
            gb_lit(r->b, x, a, e, strlen(e));
        else
            gb_lit(r->b, x, a, s + i, 1);
    }
    return x;
}

static int r_err(rctx *r, const char *what)
{
    char m[300];
    snprintf(m, sizeof(m), "regex at offset %zu: %s", r->i, what);
    return gb_fail(r->b, PD_ERR_INVALID, m);
}

static int r_utf8(rctx *r)
{
    if (r->utf8 >= 0)
        return r->utf8;
    int u = gb_rule_new(r->b);
    gb_utf8_alts(r->b, u);
    return r->utf8 = u;
}

/* an ASCII set, plus every non-ASCII character when `wide` (negated classes, \D \W \S, .) */
static int r_set_rule(rctx *r, const gset *s, int wide)
{
    if (r->json) {   /* the bytes JSON escapes: their escapes instead */
        gset plain = *s;
        int x = gb_rule_new(r->b);
        for (int c = 0; c < 0x80; c++) {
            char buf[8];
            const char *e = json_escape((uint8_t)c, buf);
            if (e == NULL || !set_has(s, c))
                continue;
            plain.w[c >> 5] &= ~(1u << (c & 31));
            gb_lit(r->b, x, gb_alt(r->b, x), e, strlen(e));
        }
        gb_cls(r->b, x, gb_alt(r->b, x), &plain);
        if (wide)
            gb_ref(r->b, x, gb_alt(r->b, x), r_utf8(r));
        return x;
    }
    if (!wide)
        return gb_cls_rule(r->b, s);
    int u = r_utf8(r);
    int x = gb_rule_new(r->b);
    gb_cls(r->b, x, gb_alt(r->b, x), s);
    gb_ref(r->b, x, gb_alt(r->b, x), u);
    return x;
}

/* \d \w \s (and their complements within ASCII) into s; 1 when it was one of them */
static int r_class_escape(char c, gset *s, int *neg)
{
    gset t = { { 0 } };
    switch (c | 0x20) {
    case 'd': set_range(&t, '0', '9'); break;
    case 'w': set_range(&t, '0', '9'); set_range(&t, 'a', 'z'); set_range(&t, 'A', 'Z'); set_add(&t, '_'); break;
    case 's': for (const char *p = " \t\n\r\f\v"; *p; p++) set_add(&t, (uint8_t)*p); break;
    default: return 0;
    }
    *neg = c >= 'A' && c <= 'Z';
    for (int k = 0; k < 4; k++)
        s->w[k] |= *neg ? ~t.w[k] : t.w[k];
    return 1;
}

/* the byte an escape stands for, or -1 */
static int r_escape_byte(rctx *r, char c)
{
    switch (c) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case '0': return 0;
    default: break;
    }
    if (c >= '1' && c <= '9') {
        r_err(r, "backreferences are not supported");
        return -1;
    }
    if (c == 'b' || c == 'B' || c == 'A' || c == 'z' || c == 'Z') {
        r_err(r, "anchors inside the pattern (\\b \\B \\A \\z) are not supported");
        return -1;
    }
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
        r_err(r, "unknown escape");
        return -1;
    }
    return (uint8_t)c;
}

static int r_class(rctx *r)
{
    gset s = { { 0 } };
    int neg = 0, wide = 0;
    if (r->i < r->n && r->s[r->i] == '^') {
        neg = 1;
        r->i++;
    }
    int first = 1;
    while (r->i < r->n && (r->s[r->i] != ']' || first)) {
        first = 0;
        int lo;
        char c = r->s[r->i++];
        if ((uint8_t)c >= 0x80)
            return r_err(r, "non-ASCII characters in a [...] class are not supported");
        if (c == '\\') {
            if (r->i >= r->n)
                return r_err(r, "a class ends in \\");
            char e = r->s[r->i++];
            int en = 0;
            if (r_class_escape(e, &s, &en)) {
                wide |= en;
                continue;
            }
            if (e == 'x' && r->i + 2 <= r->n) {
                unsigned v;
                char h[3] = { r->s[r->i], r->s[r->i + 1], 0 };
                if (sscanf(h, "%2x", &v) != 1 || v >= 0x80)
                    return r_err(r, "\\x in a class must be ASCII (00-7f)");
                r->i += 2;
                lo = (int)v;
            } else if ((lo = r_escape_byte(r, e)) < 0)
                return -1;
        } else
            lo = (uint8_t)c;
        int hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            char h = r->s[r->i + 1];
            if ((uint8_t)h >= 0x80 || h == '\\')
                return r_err(r, "a class range must end in a plain ASCII character");
            hi = (uint8_t)h;
            r->i += 2;
            if (hi < lo)
                return r_err(r, "a class range runs backwards");
        }
        set_range(&s, lo, hi);
    }
    if (r->i >= r->n)
        return r_err(r, "unterminated [");
    r->i++;   /* ] */
    if (neg) {
        for (int k = 0; k < 4; k++)
            s.w[k] = ~s.w[k];
        wide = 1;
    }
    for (int k = 4; k < 8; k++)
        s.w[k] = 0;   /* non-ASCII bytes come only as whole UTF-8 sequences */
    return r_set_rule(r, &s, wide);
}

static int r_alt(rctx *r, int depth);

static int r_atom(rctx *r, int depth)
{
    char c = r->s[r->i++];
    if (c == '(') {
        if (r->i < r->n && r->s[r->i] == '?') {
            if (r->i + 1 < r->n && r->s[r->i + 1] == ':')
                r->i += 2;
            else if (r->i + 1 < r->n && (r->s[r->i + 1] == 'P' || r->s[r->i + 1] == '<') &&
                     r->i + 2 < r->n && r->s[r->i + 2] != '=' && r->s[r->i + 2] != '!') {
                const char *gt = memchr(r->s + r->i, '>', r->n - r->i);
                if (gt == NULL)
                    return r_err(r, "unterminated group name");
                r->i = (size_t)(gt - r->s) + 1;
            } else
                return r_err(r, "lookaround and inline flags are not supported");
        }
        int x = r_alt(r, depth + 1);
        if (r->i >= r->n || r->s[r->i] != ')')
            return r_err(r, "unterminated (");
        r->i++;
        return x;
    }
    if (c == '[')
        return r_class(r);
    if (c == '.') {
        gset s = { { 0 } };
        set_range(&s, 0, 0x7f);
        s.w['\n' >> 5] &= ~(1u << ('\n' & 31));
        return r_set_rule(r, &s, 1);
    }
    if (c == '\\') {
        if (r->i >= r->n)
            return r_err(r, "the pattern ends in \\");
        char e = r->s[r->i++];
        gset s = { { 0 } };
        int neg = 0;
        if (r_class_escape(e, &s, &neg)) {
            for (int k = 4; k < 8; k++)
                s.w[k] = 0;
            return r_set_rule(r, &s, neg);
        }
        int byte;
        if (e == 'x' && r->i + 2 <= r->n) {
            unsigned v;
            char h[3] = { r->s[r->i], r->s[r->i + 1], 0 };
            if (sscanf(h, "%2x", &v) != 1 || v >= 0x80)
                return r_err(r, "\\x must be ASCII (00-7f)");
            r->i += 2;
            byte = (int)v;
        } else if ((byte = r_escape_byte(r, e)) < 0)
            return -1;
        char ch = (char)byte;
        return r_lit(r, &ch, 1);
    }
    if (c == ')' || c == '*' || c == '+' || c == '?' || c == '{')
        return r_err(r, "a quantifier or ) with nothing before it");
    if (c == '^' || c == '$')
        return r_err(r, "^ and $ are supported only at the ends of the pattern");
    /* a literal character: a whole UTF-8 sequence */
    size_t st = r->i - 1, len = 1;
    uint8_t u = (uint8_t)c;
    if (u >= 0xc0)
        len = u >= 0xf0 ? 4 : u >= 0xe0 ? 3 : 2;
    if (st + len > r->n)
        return r_err(r, "a truncated UTF-8 character");
    r->i = st + len;
    return r_lit(r, r->s + st, len);
}

/* a repeat bound's digits at s[*i..]: 1 read (at most 100000), 0 none, -1 too large */
static int repeat_bound(const char *s, size_t n, size_t *i, int *out)
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

/* x{min,max} (max < 0: unbounded) with the smallest rules for ? and * */
static int gb_quant(gb *b, int x, int min, int max)
{
    return max == 1 && min == 0 ? gb_opt(b, x) : min == 0 && max < 0 ? gb_star(b, x) : gb_rep(b, x, min, max);
}

static int r_number(rctx *r, int *out)
{
    int rc = repeat_bound(r->s, r->n, &r->i, out);
    return rc < 0 ? r_err(r, "a repeat bound above 100000") : rc ? 0 : -1;
}

static int r_concat(rctx *r, int depth)
{
    gb *b = r->b;
    int seq = gb_rule_new(b);
    int a = gb_alt(b, seq);
    while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')' && b->st == PD_OK) {
        if (r->s[r->i] == '$' && r->i + 1 == r->n && depth == 0) {
            r->i++;
            break;
        }
        int x = r_atom(r, depth);
        for (;;) {   /* quantifiers (several in a row nest) */
            if (r->i >= r->n || b->st != PD_OK)
                break;
            char q = r->s[r->i];
            int min = 0, max = -1;
            if (q == '*' || q == '+' || q == '?') {
                r->i++;
                min = q == '+';
                max = q == '?' ? 1 : -1;
            } else if (q == '{') {
                size_t save = r->i++;
                if (r_number(r, &min) != 0) {
                    r->i = save;   /* a literal { as in most engines */
                    break;
                }
                max = min;
                if (r->i < r->n && r->s[r->i] == ',') {
                    r->i++;
                    if (r_number(r, &max) != 0)
                        max = -1;
                }
                if (r->i >= r->n || r->s[r->i] != '}')
                    return r_err(r, "unterminated {m,n}");
                r->i++;
                if (max >= 0 && max < min)
                    return r_err(r, "{m,n} with n below m");
            } else
                break;
            if (r->i < r->n && r->s[r->i] == '?')
                r->i++;   /* lazy: the same language */
            else if (r->i < r->n && r->s[r->i] == '+')
                return r_err(r, "possessive quantifiers are not supported");
            x = gb_quant(b, x, min, max);
        }
        gb_ref(b, seq, a, x);
    }
    return seq;
}

static int r_alt(rctx *r, int depth)
{
    if (depth > 64)
        return r_err(r, "groups nested more than 64 deep");
    int x = gb_rule_new(r->b);
    for (;;) {
        gb_ref(r->b, x, gb_alt(r->b, x), r_concat(r, depth));
        if (r->b->st != PD_OK || r->i >= r->n || r->s[r->i] != '|')
            break;
        r->i++;
    }
    return x;
}

pd_status pd_grammar_regex(const char *re, size_t len, pd_grammar **out, pd_err *err)
{
    if (len > PD_GRAMMAR_MAX_SPEC)
        return pd_err_set(err, PD_ERR_INVALID, "regex of %zu bytes (at most %d)", len, PD_GRAMMAR_MAX_SPEC);
    gb b = { .err = err };
    rctx r = { .b = &b, .s = re, .n = len, .utf8 = -1 };
    if (r.n > 0 && r.s[0] == '^')
        r.i = 1;
    int root = r_alt(&r, 0);
    if (b.st == PD_OK && r.i < r.n)
        r_err(&r, r.s[r.i] == ')' ? "unbalanced )" : "unexpected character");
    return gb_finish(&b, root, out);
}

/* A schema's pattern: a JSON string whose (unescaped) text the regex finds (ECMA-262 search: an
 * end without ^ or $ may have any text beyond it) */
static int j_pattern(jctx *j, const char *pat, const char *path)
{
    (void)path;
    size_t n = strlen(pat);
    if (n > PD_GRAMMAR_MAX_SPEC)
        return j_err(j, path, "%s", "a pattern longer than 64 KiB");
    int head = n > 0 && pat[0] == '^';
    int tail = n > (size_t)head && pat[n - 1] == '$' && (n < 2 || pat[n - 2] != '\\');
    rctx r = { .b = j->b, .s = pat, .n = n, .i = (size_t)head, .utf8 = -1, .json = 1 };
    int body = r_alt(&r, 0);
    if (j->b->st == PD_OK && r.i < r.n)
        r_err(&r, r.s[r.i] == ')' ? "unbalanced )" : "unexpected character");
    gb *b = j->b;
    int any = gb_star(b, j_str_char(j));
    int x = gb_rule_new(b);
    int a = gb_alt(b, x);
    gb_lit(b, x, a, "\"", 1);
    if (!head)
        gb_ref(b, x, a, any);
    gb_ref(b, x, a, body);
    if (!tail)
        gb_ref(b, x, a, any);
    gb_lit(b, x, a, "\"", 1);
    return x;
}

/* ---- EBNF grammars (GBNF, as llama.cpp and xgrammar write them) ------------------------------ */

/* Rules `name ::= body`; a body is alternatives (|) of sequences of "literals", [classes]
 * ([^...] negated; members and ranges of code points), `.` (any character), rule names and
 * (groups), each optionally followed by * + ? {m} {m,} {m,n}; # comments to the end of a line.
 * A rule's body may span lines: it ends where the next `name ::=` begins. Escapes in literals
 * and classes: \n \t \r \\ \" \] \[ \- \^ \xHH \uHHHH \UHHHHHHHH (code points). */

typedef struct {
    gb *b;
    const char *s;
    size_t n, i;
    struct erule {
        char *name;
        int rule;
        int defined;
        size_t used_at;
    } *rules;
    int n_rules, cap_rules;
} ectx;

static int e_err(ectx *e, const char *fmt, const char *what)
{
    int line = 1, col = 1;
    for (size_t k = 0; k < e->i && k < e->n; k++, col++)
        if (e->s[k] == '\n') {
            line++;
            col = 0;
        }
    char w[200], m[300];
    snprintf(w, sizeof(w), fmt, what);
    snprintf(m, sizeof(m), "grammar at line %d column %d: %s", line, col, w);
    return gb_fail(e->b, PD_ERR_INVALID, m);
}

static int e_name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
           c == '.';
}

/* spaces, tabs, comments, and newlines when `lines` */
static void e_ws(ectx *e, int lines)
{
    while (e->i < e->n) {
        char c = e->s[e->i];
        if (c == ' ' || c == '\t' || c == '\r' || (lines && c == '\n')) {
            e->i++;
        } else if (c == '#') {
            while (e->i < e->n && e->s[e->i] != '\n')
                e->i++;
        } else {
            break;
        }
    }
}

static size_t e_name_len(const ectx *e, size_t at)
{
    size_t k = at;
    while (k < e->n && e_name_char(e->s[k]))
        k++;
    return k - at;
}

/* a definition starts here: NAME ::= */
static int e_def_ahead(const ectx *e)
{
    size_t l = e_name_len(e, e->i), k = e->i + l;
    if (l == 0)
        return 0;
    while (k < e->n && (e->s[k] == ' ' || e->s[k] == '\t'))
        k++;
    return k + 3 <= e->n && memcmp(e->s + k, "::=", 3) == 0;
}

static int e_rule(ectx *e, const char *name, size_t len)
{
    for (int k = 0; k < e->n_rules; k++)
        if (strlen(e->rules[k].name) == len && memcmp(e->rules[k].name, name, len) == 0)
            return k;
    if (grow((void **)&e->rules, &e->cap_rules, e->n_rules + 1, sizeof(*e->rules)) != 0)
        return gb_fail(e->b, PD_ERR_NOMEM, "grammar rules");
    struct erule *r = &e->rules[e->n_rules];
    memset(r, 0, sizeof(*r));
    if ((r->name = malloc(len + 1)) == NULL)
        return gb_fail(e->b, PD_ERR_NOMEM, "grammar rules");
    memcpy(r->name, name, len);
    r->name[len] = '\0';
    r->rule = gb_rule_new(e->b);
    r->used_at = e->i;
    return e->n_rules++;
}

static size_t utf8_put(uint32_t cp, char *o)
{
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xc0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* one character of a literal or a class (an escape or a whole UTF-8 sequence): its code point,
 * or -1 (error set) */
static long e_char(ectx *e)
{
    uint8_t c = (uint8_t)e->s[e->i++];
    if (c == '\\') {
        if (e->i >= e->n)
            return e_err(e, "%s", "the grammar ends in \\");
        char x = e->s[e->i++];
        int digits = x == 'x' ? 2 : x == 'u' ? 4 : x == 'U' ? 8 : 0;
        if (digits > 0) {
            uint32_t v = 0;
            for (int k = 0; k < digits; k++, e->i++) {
                char h = e->i < e->n ? e->s[e->i] : 0;
                int d = h >= '0' && h <= '9' ? h - '0' : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10 : -1;
                if (d < 0)
                    return e_err(e, "\\%c needs hex digits", x == 'x' ? "x" : x == 'u' ? "u" : "U");
                v = v * 16 + (uint32_t)d;
            }
            if (v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff))
                return e_err(e, "%s", "an escape beyond Unicode (or a surrogate)");
            return (long)v;
        }
        switch (x) {
        case 'n': return '\n';
        case 't': return '\t';
        case 'r': return '\r';
        case '0': return 0;
        case '\\': case '"': case '\'': case '[': case ']': case '-': case '^': case '/': return (uint8_t)x;
        default: {
            char w[2] = { x, 0 };
            return e_err(e, "unknown escape \\%s", w);
        }
        }
    }
    if (c < 0x80)
        return c;
    int len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    if (len == 0 || e->i + (size_t)len - 1 > e->n)
        return e_err(e, "%s", "invalid UTF-8");
    uint32_t v = c & (0x7f >> len);
    for (int k = 1; k < len; k++)
        v = (v << 6) | ((uint8_t)e->s[e->i++] & 0x3f);
    return (long)v;
}

/* alternatives of rule r for the code points [lo, hi] (all of one UTF-8 length after the split) */
static void utf8_range(gb *b, int r, uint32_t lo, uint32_t hi)
{
    static const uint32_t max_of_len[3] = { 0x7f, 0x7ff, 0xffff };
    for (int k = 0; k < 3; k++)
        if (lo <= max_of_len[k] && hi > max_of_len[k]) {
            utf8_range(b, r, lo, max_of_len[k]);
            utf8_range(b, r, max_of_len[k] + 1, hi);
            return;
        }
    for (int k = 1; k < 4; k++) {
        uint32_t m = (1u << (6 * k)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_range(b, r, lo, lo | m);
                utf8_range(b, r, (lo | m) + 1, hi);
                return;
            }
            if ((hi & m) != m) {
                utf8_range(b, r, lo, (hi & ~m) - 1);
                utf8_range(b, r, hi & ~m, hi);
                return;
            }
        }
    }
    char l[4], h[4];
    size_t n = utf8_put(lo, l);
    utf8_put(hi, h);
    int a = gb_alt(b, r);
    for (size_t k = 0; k < n; k++) {
        gset s = { { 0 } };
        set_range(&s, (uint8_t)l[k], (uint8_t)h[k]);
        gb_cls(b, r, a, &s);
    }
}

static int cp_cmp(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* a rule for a set of code point ranges iv[n][2] (negated: its complement); surrogates never */
static int e_set(ectx *e, uint32_t (*iv)[2], int n, int neg)
{
    if (n > 0)   /* (an empty class: iv may be NULL) */
        qsort(iv, (size_t)n, sizeof(*iv), cp_cmp);
    uint32_t (*out)[2] = malloc(((size_t)n + 2) * 2 * sizeof(*out));   /* merged, then the complement */
    if (out == NULL)
        return gb_fail(e->b, PD_ERR_NOMEM, "grammar classes");
    int m = 0;
    for (int k = 0; k < n; k++) {
        if (m > 0 && iv[k][0] <= out[m - 1][1] + 1) {
            if (iv[k][1] > out[m - 1][1])
                out[m - 1][1] = iv[k][1];
        } else {
            out[m][0] = iv[k][0];
            out[m][1] = iv[k][1];
            m++;
        }
    }
    if (neg) {
        uint32_t (*c)[2] = out + m + 1;
        int cn = 0;
        uint32_t next = 0;
        for (int k = 0; k < m; k++) {
            if (out[k][0] > next) {
                c[cn][0] = next;
                c[cn++][1] = out[k][0] - 1;
            }
            next = out[k][1] + 1;
        }
        if (next <= 0x10ffff) {
            c[cn][0] = next;
            c[cn++][1] = 0x10ffff;
        }
        memmove(out, c, (size_t)cn * sizeof(*out));
        m = cn;
    }
    int r = gb_rule_new(e->b);
    gset ascii = { { 0 } };
    int any_ascii = 0;
    for (int k = 0; k < m; k++) {
        uint32_t lo = out[k][0], hi = out[k][1];
        if (lo < 0x80) {
            set_range(&ascii, (int)lo, (int)(hi < 0x7f ? hi : 0x7f));
            any_ascii = 1;
            lo = 0x80;
        }
        /* surrogates are not characters */
        if (lo <= hi && lo < 0xd800 && hi >= 0xd800) {
            utf8_range(e->b, r, lo, 0xd7ff);
            lo = 0xe000;
        } else if (lo >= 0xd800 && lo <= 0xdfff) {
            lo = 0xe000;
        }
        if (lo <= hi && hi >= 0x80)
            utf8_range(e->b, r, lo, hi);
    }
    if (any_ascii)
        gb_cls(e->b, r, gb_alt(e->b, r), &ascii);
    free(out);
    if (e->b->st == PD_OK && e->b->r[r].n == 0)
        return e_err(e, "%s", "a class that matches no character");
    return r;
}

static int e_class(ectx *e)
{
    int neg = 0, n = 0, cap = 0;
    uint32_t (*iv)[2] = NULL;
    if (e->i < e->n && e->s[e->i] == '^') {
        neg = 1;
        e->i++;
    }
    while (e->i < e->n && e->s[e->i] != ']') {
        long lo = e_char(e), hi = lo;
        if (lo < 0)
            goto fail;
        if (e->i + 1 < e->n && e->s[e->i] == '-' && e->s[e->i + 1] != ']') {
            e->i++;
            if ((hi = e_char(e)) < 0)
                goto fail;
            if (hi < lo) {
                e_err(e, "%s", "a class range runs backwards");
                goto fail;
            }
        }
        if (grow((void **)&iv, &cap, n + 1, sizeof(*iv)) != 0) {
            gb_fail(e->b, PD_ERR_NOMEM, "grammar classes");
            goto fail;
        }
        iv[n][0] = (uint32_t)lo;
        iv[n++][1] = (uint32_t)hi;
    }
    if (e->i >= e->n) {
        e_err(e, "%s", "unterminated [");
        goto fail;
    }
    e->i++;
    int r = e_set(e, iv, n, neg);
    free(iv);
    return r;
fail:
    free(iv);
    return -1;
}

static int e_alt(ectx *e, int depth);

static int e_atom(ectx *e, int depth)
{
    char c = e->s[e->i];
    if (c == '"' || c == '\'') {
        e->i++;
        int r = gb_rule_new(e->b), a = gb_alt(e->b, r);
        while (e->i < e->n && e->s[e->i] != c) {
            long cp = e_char(e);
            if (cp < 0)
                return -1;
            char u[4];
            gb_lit(e->b, r, a, u, utf8_put((uint32_t)cp, u));
        }
        if (e->i >= e->n)
            return e_err(e, "%s", "unterminated string");
        e->i++;
        return r;
    }
    if (c == '[') {
        e->i++;
        return e_class(e);
    }
    if (c == '(') {
        e->i++;
        int r = e_alt(e, depth + 1);
        e_ws(e, 1);
        if (e->i >= e->n || e->s[e->i] != ')')
            return e_err(e, "%s", "unterminated (");
        e->i++;
        return r;
    }
    if (c == '.') {
        e->i++;
        uint32_t all[1][2] = { { 0, 0x10ffff } };
        return e_set(e, all, 1, 0);
    }
    size_t l = e_name_len(e, e->i);
    if (l == 0) {
        char w[2] = { c, 0 };
        return e_err(e, "unexpected '%s'", w);
    }
    int k = e_rule(e, e->s + e->i, l);
    e->i += l;
    return k < 0 ? -1 : e->rules[k].rule;
}

static int e_number(ectx *e, int *out)
{
    int rc = repeat_bound(e->s, e->n, &e->i, out);
    return rc < 0 ? e_err(e, "%s", "a repeat bound above 100000") : rc ? 0 : -1;
}

static int e_seq(ectx *e, int depth)
{
    gb *b = e->b;
    int seq = gb_rule_new(b), a = gb_alt(b, seq);
    for (;;) {
        e_ws(e, 1);
        if (e->i >= e->n || e->s[e->i] == '|' || e->s[e->i] == ')' || b->st != PD_OK)
            break;
        if (depth == 0 && e_def_ahead(e))
            break;
        int x = e_atom(e, depth);
        for (;;) {
            e_ws(e, 0);
            if (e->i >= e->n || b->st != PD_OK)
                break;
            char q = e->s[e->i];
            int min = 0, max = -1;
            if (q == '*' || q == '+' || q == '?') {
                e->i++;
                min = q == '+';
                max = q == '?' ? 1 : -1;
            } else if (q == '{') {
                e->i++;
                e_ws(e, 0);
                if (e_number(e, &min) != 0)
                    return e_err(e, "%s", "{ needs a number");
                max = min;
                e_ws(e, 0);
                if (e->i < e->n && e->s[e->i] == ',') {
                    e->i++;
                    e_ws(e, 0);
                    if (e_number(e, &max) != 0)
                        max = -1;
                    e_ws(e, 0);
                }
                if (e->i >= e->n || e->s[e->i] != '}')
                    return e_err(e, "%s", "unterminated {m,n}");
                e->i++;
                if (max >= 0 && max < min)
                    return e_err(e, "%s", "{m,n} with n below m");
            } else {
                break;
            }
            x = gb_quant(b, x, min, max);
        }
        gb_ref(b, seq, a, x);
    }
    return seq;
}

static int e_alt(ectx *e, int depth)
{
    if (depth > 64)
        return e_err(e, "%s", "groups nested more than 64 deep");
    int x = gb_rule_new(e->b);
    for (;;) {
        gb_ref(e->b, x, gb_alt(e->b, x), e_seq(e, depth));
        e_ws(e, 1);
        if (e->b->st != PD_OK || e->i >= e->n || e->s[e->i] != '|')
            break;
        e->i++;
    }
    return x;
}

/* Left recursion (a rule reached again before any byte, with more to match after it: the
 * matcher's stacks would grow without end): the name of a rule on such a cycle, or NULL.
 * Tarjan's strongly connected components over "may come first" references; a reference that
 * ends its alternative is a tail call (the matcher cuts those loops), not left recursion. */
static const char *e_left_recursion(ectx *e)
{
    gb *b = e->b;
    int n = b->n;
    char *nullable = calloc((size_t)n, 1);
    int *idx = malloc((size_t)n * sizeof(int)), *low = malloc((size_t)n * sizeof(int));
    int *comp = malloc((size_t)n * sizeof(int)), *stack = malloc((size_t)n * sizeof(int));
    int *cs_rule = malloc((size_t)n * sizeof(int)), *cs_alt = malloc((size_t)n * sizeof(int));
    int *cs_el = malloc((size_t)n * sizeof(int));
    char *on = calloc((size_t)n, 1);
    const char *bad = NULL;
    if (nullable == NULL || idx == NULL || low == NULL || comp == NULL || stack == NULL || cs_rule == NULL ||
        cs_alt == NULL || cs_el == NULL || on == NULL) {
        gb_fail(b, PD_ERR_NOMEM, "grammar check");
        goto out;
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int r = 0; r < n; r++)
            for (int a = 0; a < b->r[r].n && !nullable[r]; a++) {
                const gb_seq *s = &b->r[r].alt[a];
                int all = 1;
                for (int k = 0; k < s->n && all; k++)
                    all = s->el[k].kind == G_REF && nullable[s->el[k].ref];
                if (all)
                    nullable[r] = changed = 1;
            }
    }
    /* edge (r -> ref) at alt a, element k: "may come first" when every element before k is
     * nullable; it grows the stack when k is not the alternative's last element */
    for (int r = 0; r < n; r++)
        idx[r] = -1;
    int counter = 0, sp = 0, ncomp = 0;
    for (int root = 0; root < n; root++) {
        if (idx[root] >= 0)
            continue;
        int depth = 0;
        cs_rule[0] = root;
        cs_alt[0] = 0;
        cs_el[0] = 0;
        idx[root] = low[root] = counter++;
        stack[sp++] = root;
        on[root] = 1;
        while (depth >= 0) {
            int r = cs_rule[depth];
            int pushed = 0;
            while (cs_alt[depth] < b->r[r].n && !pushed) {
                const gb_seq *s = &b->r[r].alt[cs_alt[depth]];
                int k = cs_el[depth];
                if (k >= s->n || (k > 0 && !(s->el[k - 1].kind == G_REF && nullable[s->el[k - 1].ref]))) {
                    cs_alt[depth]++;
                    cs_el[depth] = 0;
                    continue;
                }
                cs_el[depth]++;
                if (s->el[k].kind != G_REF)
                    continue;
                int v = s->el[k].ref;
                if (idx[v] < 0) {
                    idx[v] = low[v] = counter++;
                    stack[sp++] = v;
                    on[v] = 1;
                    depth++;
                    cs_rule[depth] = v;
                    cs_alt[depth] = 0;
                    cs_el[depth] = 0;
                    pushed = 1;
                } else if (on[v] && idx[v] < low[r]) {
                    low[r] = idx[v];
                }
            }
            if (pushed)
                continue;
            if (low[r] == idx[r]) {
                int w;
                do {
                    w = stack[--sp];
                    on[w] = 0;
                    comp[w] = ncomp;
                } while (w != r);
                ncomp++;
            }
            depth--;
            if (depth >= 0 && low[r] < low[cs_rule[depth]])
                low[cs_rule[depth]] = low[r];
        }
    }
    for (int r = 0; r < n && bad == NULL; r++)
        for (int a = 0; a < b->r[r].n && bad == NULL; a++) {
            const gb_seq *s = &b->r[r].alt[a];
            for (int k = 0; k + 1 < s->n; k++) {
                if (s->el[k].kind == G_REF && comp[s->el[k].ref] == comp[r]) {
                    bad = "";
                    for (int q = 0; q < e->n_rules; q++)
                        if (comp[e->rules[q].rule] == comp[r])
                            bad = e->rules[q].name;
                    break;
                }
                if (!(s->el[k].kind == G_REF && nullable[s->el[k].ref]))
                    break;
            }
        }
out:
    free(nullable);
    free(idx);
    free(low);
    free(comp);
    free(stack);
    free(cs_rule);
    free(cs_alt);
    free(cs_el);
    free(on);
    return bad;
}

pd_status pd_grammar_ebnf(const char *text, size_t len, pd_grammar **out, pd_err *err)
{
    if (len > PD_GRAMMAR_MAX_SPEC)
        return pd_err_set(err, PD_ERR_INVALID, "grammar of %zu bytes (at most %d)", len, PD_GRAMMAR_MAX_SPEC);
    gb b = { .err = err };
    ectx e = { .b = &b, .s = text, .n = len };
    for (;;) {
        e_ws(&e, 1);
        if (e.i >= e.n || b.st != PD_OK)
            break;
        size_t l = e_name_len(&e, e.i);
        if (l == 0 || !e_def_ahead(&e)) {
            e_err(&e, "%s", "expected a rule definition (name ::= ...)");
            break;
        }
        int k = e_rule(&e, e.s + e.i, l);
        if (k < 0)
            break;
        if (e.rules[k].defined) {
            e_err(&e, "rule '%s' is defined twice", e.rules[k].name);
            break;
        }
        e.rules[k].defined = 1;
        e.i += l;
        e_ws(&e, 0);
        e.i += 3;   /* ::= */
        int body = e_alt(&e, 0);
        gb_ref(&b, e.rules[k].rule, gb_alt(&b, e.rules[k].rule), body);
        if (b.st == PD_OK && e.i < e.n && !e_def_ahead(&e))
            e_err(&e, "%s", e.s[e.i] == ')' ? "unbalanced )" : "unexpected text");
    }
    int root = -1;
    for (int k = 0; k < e.n_rules && b.st == PD_OK; k++) {
        if (!e.rules[k].defined) {
            e.i = e.rules[k].used_at;
            e_err(&e, "rule '%s' is used but not defined", e.rules[k].name);
        } else if (strcmp(e.rules[k].name, "root") == 0) {
            root = e.rules[k].rule;
        }
    }
    if (b.st == PD_OK && root < 0)
        gb_fail(&b, PD_ERR_INVALID, "grammar: no rule named 'root' (where the output starts)");
    if (b.st == PD_OK) {
        const char *lr = e_left_recursion(&e);
        if (lr != NULL) {
            char m[200];
            snprintf(m, sizeof(m), "grammar: rule '%.64s' is left-recursive (write the repetition with * or +)",
                     lr[0] ? lr : "(a group)");
            gb_fail(&b, PD_ERR_INVALID, m);
        }
    }
    for (int k = 0; k < e.n_rules; k++)
        free(e.rules[k].name);
    free(e.rules);
    return gb_finish(&b, root, out);
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
        if (grow((void **)&c->e, &c->cap, c->n + 1, sizeof(*c->e)) == 0) {
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
    if (grow((void **)&s->off, &s->cap_off, s->n + 2, 4) != 0 ||
        grow((void **)&s->pos, &s->cap_pos, s->n_pos + len, 4) != 0)
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
    if (grow((void **)&d->off, &d->cap_off, s->n + 1, 4) != 0 ||
        grow((void **)&d->pos, &d->cap_pos, s->n_pos > 0 ? s->n_pos : 1, 4) != 0)
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
        const gel *e = &g->el[p];
        if (e->kind == G_END) {
            len--;
            continue;
        }
        if (e->kind == G_CLASS)
            return gs_emit(dst, w, len);
        if (chain + 1 >= G_MAX_CHAIN + 2)
            return -3;
        int base = len;
        if (g->el[p + 1].kind == G_END)
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
        const gel *e = &g->el[s[len - 1]];
        if (!set_has(&e->set, c))
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
static int gmatch_dead(const pd_gmatch *m) { return m->st.n == 0 && !m->st.complete; }

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

struct gshared {
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

static struct gshared *gshared_new(void)
{
    struct gshared *c = calloc(1, sizeof(*c));
    if (c != NULL)
        pthread_mutex_init(&c->mu, NULL);
    return c;   /* NULL: the grammar simply shares nothing */
}

static void gshared_free(struct gshared *c)
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

static int gshared_get(struct gshared *c, const gstate *st, uint64_t h, const pd_gvocab *v, uint32_t *bits)
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

static void gshared_put(struct gshared *c, const gstate *st, uint64_t h, const pd_gvocab *v, const uint32_t *bits)
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
    if (grow((void **)&c->e, &c->cap, c->n + 1, sizeof(*c->e)) == 0) {
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
