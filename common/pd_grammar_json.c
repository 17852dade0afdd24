/* pd_grammar_json.c - JSON schemas, "any JSON object" and tool calls compiled into grammars
 *   (pd_grammar_json.h).
 * Owns: JSON's tokens as rules (whitespace, strings, numbers, any value), the schema keywords
 *   (type, properties, items, enum, const, anyOf / oneOf / allOf, $ref), integer and number
 *   ranges as decimal strings, the string formats enforced, a pattern as a search in the
 *   string's text, and the Hermes tool-call wrapper around each tool's arguments.
 * Not here: the regex parser a pattern goes through (pd_grammar_regex.c), the rule builder
 *   (pd_grammar.c).
 * Threading: each call builds its own grammar; any thread. */
#include "pd_grammar_json.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_grammar_internal.h"
#include "pd_json.h"

/* ---- JSON ---------------------------------------------------------------------------------- */

typedef struct {
    pd_gb *b;
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
    return pd_gb_fail(j->b, PD_ERR_INVALID, m);
}

/* whitespace between tokens: none, one space, or a newline and up to 20 spaces or tabs (a
 * bound, so that a model cannot pad forever) */
static int j_ws(jctx *j)
{
    if (j->ws >= 0)
        return j->ws;
    pd_gb *b = j->b;
    pd_gset ind = { { 0 } };
    pd_gset_add(&ind, ' ');
    pd_gset_add(&ind, '\t');
    int tail = pd_gb_rep(b, pd_gb_cls_rule(b, &ind), 0, 20);
    int r = pd_gb_rule_new(b);
    pd_gb_alt(b, r);
    pd_gb_lit(b, r, pd_gb_alt(b, r), " ", 1);
    int a = pd_gb_alt(b, r);
    pd_gb_lit(b, r, a, "\n", 1);
    pd_gb_ref(b, r, a, tail);
    return j->ws = r;
}

/* one character of a JSON string: printable ASCII but " and \, an escape, or a UTF-8 sequence */
static int j_str_char(jctx *j)
{
    if (j->str_char >= 0)
        return j->str_char;
    pd_gb *b = j->b;
    int r = pd_gb_rule_new(b);
    pd_gset plain = { { 0 } }, esc = { { 0 } }, hex = { { 0 } };
    pd_gset_range(&plain, 0x20, 0x7f);
    plain.w['"' >> 5] &= ~(1u << ('"' & 31));
    plain.w['\\' >> 5] &= ~(1u << ('\\' & 31));
    for (const char *c = "\"\\/bfnrt"; *c; c++)
        pd_gset_add(&esc, (uint8_t)*c);
    pd_gset_range(&hex, '0', '9');
    pd_gset_range(&hex, 'a', 'f');
    pd_gset_range(&hex, 'A', 'F');
    pd_gb_cls(b, r, pd_gb_alt(b, r), &plain);
    int a = pd_gb_alt(b, r);
    pd_gb_lit(b, r, a, "\\", 1);
    pd_gb_cls(b, r, a, &esc);
    a = pd_gb_alt(b, r);
    pd_gb_lit(b, r, a, "\\u", 2);
    for (int i = 0; i < 4; i++)
        pd_gb_cls(b, r, a, &hex);
    pd_gb_utf8_alts(b, r);
    return j->str_char = r;
}

static int j_string_len(jctx *j, int min, int max)
{
    pd_gb *b = j->b;
    int body = min == 0 && max < 0 ? pd_gb_star(b, j_str_char(j)) : pd_gb_rep(b, j_str_char(j), min, max);
    int r = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, r);
    pd_gb_lit(b, r, a, "\"", 1);
    pd_gb_ref(b, r, a, body);
    pd_gb_lit(b, r, a, "\"", 1);
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
    pd_gb *b = j->b;
    pd_gset d = { { 0 } }, d19 = { { 0 } };
    pd_gset_range(&d, '0', '9');
    pd_gset_range(&d19, '1', '9');
    int digits = pd_gb_rep(b, pd_gb_cls_rule(b, &d), 0, 15);
    int mag = pd_gb_rule_new(b);
    pd_gb_lit(b, mag, pd_gb_alt(b, mag), "0", 1);
    int a = pd_gb_alt(b, mag);
    pd_gb_cls(b, mag, a, &d19);
    pd_gb_ref(b, mag, a, digits);
    int r = pd_gb_rule_new(b);
    a = pd_gb_alt(b, r);
    pd_gb_ref(b, r, a, pd_gb_opt(b, pd_gb_lit_rule(b, "-", 1)));
    pd_gb_ref(b, r, a, mag);
    return j->integer = r;
}

/* integer (.[0-9]{1,16})? ([eE][-+]?[0-9]{1,3})? */
static int j_number(jctx *j)
{
    if (j->number >= 0)
        return j->number;
    pd_gb *b = j->b;
    pd_gset d = { { 0 } }, e = { { 0 } }, sign = { { 0 } };
    pd_gset_range(&d, '0', '9');
    pd_gset_add(&e, 'e');
    pd_gset_add(&e, 'E');
    pd_gset_add(&sign, '+');
    pd_gset_add(&sign, '-');
    int dig = pd_gb_cls_rule(b, &d);
    int frac = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, frac);
    pd_gb_lit(b, frac, a, ".", 1);
    pd_gb_ref(b, frac, a, pd_gb_rep(b, dig, 1, 16));
    int ex = pd_gb_rule_new(b);
    a = pd_gb_alt(b, ex);
    pd_gb_cls(b, ex, a, &e);
    pd_gb_ref(b, ex, a, pd_gb_opt(b, pd_gb_cls_rule(b, &sign)));
    pd_gb_ref(b, ex, a, pd_gb_rep(b, dig, 1, 3));
    int r = pd_gb_rule_new(b);
    a = pd_gb_alt(b, r);
    pd_gb_ref(b, r, a, j_integer(j));
    pd_gb_ref(b, r, a, pd_gb_opt(b, frac));
    pd_gb_ref(b, r, a, pd_gb_opt(b, ex));
    return j->number = r;
}

static int j_boolean(jctx *j)
{
    if (j->boolean >= 0)
        return j->boolean;
    int r = pd_gb_rule_new(j->b);
    pd_gb_lit(j->b, r, pd_gb_alt(j->b, r), "true", 4);
    pd_gb_lit(j->b, r, pd_gb_alt(j->b, r), "false", 5);
    return j->boolean = r;
}

static int j_null(jctx *j)
{
    if (j->null < 0)
        j->null = pd_gb_lit_rule(j->b, "null", 4);
    return j->null;
}

/* open ws [item (ws "," ws item){min-1, max-1}] ws close, with a bound on the items (max < 0:
 * none); `item` may be made after this call (a forward reference through its rule id) */
static int j_list(jctx *j, const char *open, const char *close, int item, int min, int max)
{
    pd_gb *b = j->b;
    int ws = j_ws(j);
    int r = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, r);
    pd_gb_lit(b, r, a, open, 1);
    pd_gb_ref(b, r, a, ws);
    if (max != 0) {
        int more = pd_gb_rule_new(b);
        int m = pd_gb_alt(b, more);
        pd_gb_ref(b, more, m, ws);
        pd_gb_lit(b, more, m, ",", 1);
        pd_gb_ref(b, more, m, ws);
        pd_gb_ref(b, more, m, item);
        int list = pd_gb_rule_new(b);
        int la = pd_gb_alt(b, list);
        pd_gb_ref(b, list, la, item);
        pd_gb_ref(b, list, la, pd_gb_rep(b, more, min > 1 ? min - 1 : 0, max < 0 ? -1 : max - 1));
        pd_gb_ref(b, r, a, min == 0 ? pd_gb_opt(b, list) : list);
        pd_gb_ref(b, r, a, ws);
    }
    pd_gb_lit(b, r, a, close, 1);
    return r;
}

/* string ws ":" ws value */
static int j_member(jctx *j, int value)
{
    pd_gb *b = j->b;
    int r = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, r);
    pd_gb_ref(b, r, a, j_string(j));
    pd_gb_ref(b, r, a, j_ws(j));
    pd_gb_lit(b, r, a, ":", 1);
    pd_gb_ref(b, r, a, j_ws(j));
    pd_gb_ref(b, r, a, value);
    return r;
}

/* any JSON value; the object and array rules refer back to it */
static int j_value(jctx *j)
{
    if (j->value >= 0)
        return j->value;
    pd_gb *b = j->b;
    int v = j->value = pd_gb_rule_new(b);
    j->obj_any = j_list(j, "{", "}", j_member(j, v), 0, -1);
    int parts[6] = { j->obj_any, j_list(j, "[", "]", v, 0, -1), j_string(j), j_number(j), j_boolean(j), j_null(j) };
    for (int i = 0; i < 6; i++)
        pd_gb_ref(b, v, pd_gb_alt(b, v), parts[i]);
    return v;
}

static int j_literal(jctx *j, const cJSON *v, const char *path)
{
    char *s = cJSON_PrintUnformatted(v);
    if (s == NULL)
        return j_err(j, path, "%s", "a value that cannot be printed");
    int r = pd_gb_lit_rule(j->b, s, strlen(s));
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
    if (pd_grammar_grow((void **)&j->refs, &j->cap_refs, j->n_refs + 1, sizeof(*j->refs)) != 0)
        return pd_gb_fail(j->b, PD_ERR_NOMEM, "schema references");
    int r = pd_gb_rule_new(j->b);
    j->refs[j->n_refs].name = strdup(ref);
    j->refs[j->n_refs].rule = r;
    if (j->refs[j->n_refs].name == NULL)
        return pd_gb_fail(j->b, PD_ERR_NOMEM, "schema references");
    j->n_refs++;
    int body = j_schema(j, target, ref, depth + 1);
    pd_gb_ref(j->b, r, pd_gb_alt(j->b, r), body);
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
    pd_gb *b = j->b;
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
        return extra_value >= 0 ? j_list(j, "{", "}", j_member(j, extra_value), 0, -1) : pd_gb_lit_rule(b, "{}", 2);
    int ws = j_ws(j);
    /* rest_i: properties i.. after at least one member; first_i: before any */
    int rest = pd_gb_rule_new(b), first = pd_gb_rule_new(b);
    if (extra_value >= 0) {
        int em = j_member(j, extra_value);
        int more = pd_gb_rule_new(b);
        int a = pd_gb_alt(b, more);
        pd_gb_ref(b, more, a, ws);
        pd_gb_lit(b, more, a, ",", 1);
        pd_gb_ref(b, more, a, ws);
        pd_gb_ref(b, more, a, em);
        int star = pd_gb_star(b, more);
        pd_gb_ref(b, rest, pd_gb_alt(b, rest), star);
        a = pd_gb_alt(b, first);
        pd_gb_ref(b, first, a, em);
        pd_gb_ref(b, first, a, star);
        pd_gb_alt(b, first);
    } else {
        pd_gb_alt(b, rest);
        pd_gb_alt(b, first);
    }
    const cJSON **list = malloc((size_t)n * sizeof(*list));
    if (list == NULL)
        return pd_gb_fail(b, PD_ERR_NOMEM, "schema properties");
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
            pd_gb_fail(b, PD_ERR_NOMEM, "schema property name");
            break;
        }
        int kv = pd_gb_rule_new(b);
        int a = pd_gb_alt(b, kv);
        pd_gb_lit(b, kv, a, ks, strlen(ks));
        cJSON_free(ks);
        pd_gb_ref(b, kv, a, ws);
        pd_gb_lit(b, kv, a, ":", 1);
        pd_gb_ref(b, kv, a, ws);
        pd_gb_ref(b, kv, a, j_schema(j, pr, p, depth + 1));
        int nrest = pd_gb_rule_new(b), nfirst = pd_gb_rule_new(b);
        a = pd_gb_alt(b, nrest);
        pd_gb_ref(b, nrest, a, ws);
        pd_gb_lit(b, nrest, a, ",", 1);
        pd_gb_ref(b, nrest, a, ws);
        pd_gb_ref(b, nrest, a, kv);
        pd_gb_ref(b, nrest, a, rest);
        a = pd_gb_alt(b, nfirst);
        pd_gb_ref(b, nfirst, a, kv);
        pd_gb_ref(b, nfirst, a, rest);
        if (!required) {
            pd_gb_ref(b, nrest, pd_gb_alt(b, nrest), rest);
            pd_gb_ref(b, nfirst, pd_gb_alt(b, nfirst), first);
        }
        rest = nrest;
        first = nfirst;
    }
    free(list);
    int r = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, r);
    pd_gb_lit(b, r, a, "{", 1);
    pd_gb_ref(b, r, a, ws);
    pd_gb_ref(b, r, a, first);
    pd_gb_ref(b, r, a, ws);
    pd_gb_lit(b, r, a, "}", 1);
    return r;
}

static int j_pattern(jctx *j, const char *pat, const char *path);

/* ---- integer ranges: the decimal strings of [lo, hi] ---- */

#define J_INT_MAX 9999999999999999LL   /* 16 digits, the integer rule's bound */

/* the digit strings from lo to hi, both of n digits (leading zeros included) */
static int j_digit_range(jctx *j, const char *lo, const char *hi, int n)
{
    pd_gb *b = j->b;
    int r = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, r);
    pd_gset d09 = { { 0 } };
    pd_gset_range(&d09, '0', '9');
    int all = 1;
    for (int i = 0; i < n && all; i++)
        all = lo[i] == '0' && hi[i] == '9';
    if (n == 0 || all) {
        for (int i = 0; i < n; i++)
            pd_gb_cls(b, r, a, &d09);
        return r;
    }
    if (lo[0] == hi[0]) {
        pd_gb_lit(b, r, a, lo, 1);
        pd_gb_ref(b, r, a, j_digit_range(j, lo + 1, hi + 1, n - 1));
        return r;
    }
    char nines[17], zeros[17];
    memset(nines, '9', sizeof(nines));
    memset(zeros, '0', sizeof(zeros));
    pd_gb_lit(b, r, a, lo, 1);
    pd_gb_ref(b, r, a, j_digit_range(j, lo + 1, nines, n - 1));
    if (hi[0] - lo[0] > 1) {
        pd_gset mid = { { 0 } };
        pd_gset_range(&mid, lo[0] + 1, hi[0] - 1);
        a = pd_gb_alt(b, r);
        pd_gb_cls(b, r, a, &mid);
        for (int i = 1; i < n; i++)
            pd_gb_cls(b, r, a, &d09);
    }
    a = pd_gb_alt(b, r);
    pd_gb_lit(b, r, a, hi, 1);
    pd_gb_ref(b, r, a, j_digit_range(j, zeros, hi + 1, n - 1));
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
        pd_gb_ref(j->b, r, pd_gb_alt(j->b, r), j_digit_range(j, sa, sz, n));
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
    pd_gb *b = j->b;
    int r = pd_gb_rule_new(b);
    if (hi >= 0)
        j_nonneg_range(j, r, lo > 0 ? lo : 0, hi);
    if (lo < 0) {   /* "-" and the magnitudes max(1, -hi) .. -lo */
        int neg = pd_gb_rule_new(b);
        j_nonneg_range(j, neg, hi < 0 ? -hi : 1, -lo);
        int a = pd_gb_alt(b, r);
        pd_gb_lit(b, r, a, "-", 1);
        pd_gb_ref(b, r, a, neg);
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
    int r = pd_gb_rule_new(j->b);
    if (empty)
        pd_gb_alt(j->b, r);
    if (ne >= 0) {
        int a = pd_gb_alt(j->b, r);
        pd_gb_lit(j->b, r, a, lead, strlen(lead));
        pd_gb_ref(j->b, r, a, ne);
    }
    return r;
}

/* the same, of 1..n digits, by the first digit */
static int j_frac_ne(jctx *j, int kind, const char *fa, int sa, const char *fb, int sb, int n)
{
    pd_gb *b = j->b;
    if (n == 0)
        return -1;
    pd_gset dig = { { 0 } };
    pd_gset_range(&dig, '0', '9');
    if (kind == F_GE && fa[0] == '\0' && !sa)   /* anything */
        return pd_gb_rep(b, pd_gb_cls_rule(b, &dig), 1, n);
    if (kind == F_LE && fb[0] == '\0')          /* zeros, or nothing */
        return sb ? -1 : pd_gb_rep(b, pd_gb_lit_rule(b, "0", 1), 1, n);
    int any = pd_gb_rep(b, pd_gb_cls_rule(b, &dig), 0, n - 1);
    const char *na = fa[0] != '\0' ? fa + 1 : fa, *nb = fb[0] != '\0' ? fb + 1 : fb;
    char a1 = fa[0] != '\0' ? fa[0] : '0', b1 = fb[0] != '\0' ? fb[0] : '0';
    int r = pd_gb_rule_new(b), alts = 0;
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
        pd_gset c = { { 0 } };
        pd_gset_range(&c, (uint8_t)step[i].lo, (uint8_t)step[i].hi);
        int a = pd_gb_alt(b, r);
        pd_gb_cls(b, r, a, &c);
        pd_gb_ref(b, r, a, rest);
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
    int w = pd_gb_rule_new(j->b);
    j_nonneg_range(j, w, lo, hi);
    int a = pd_gb_alt(j->b, r);
    pd_gb_ref(j->b, r, a, w);
    pd_gb_ref(j->b, r, a, fr);
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
    pd_gb *b = j->b;
    int r = pd_gb_rule_new(b);
    if (!has_hi || hi > 0 || (hi == 0 && !hi_ex))   /* v >= 0: x = v in [max(lo, 0), hi] */
        j_mag_range(j, r, has_lo && lo > 0 ? &alo : &zero, has_lo && lo >= 0 && lo_ex, has_hi ? &ahi : NULL, hi_ex, fdig);
    if (!has_lo || lo < 0) {   /* v < 0: "-" and x = -v in (max(-hi, 0), -lo] */
        int neg = pd_gb_rule_new(b);
        int hi_neg = has_hi && hi < 0;
        j_mag_range(j, neg, hi_neg ? &ahi : &zero, hi_neg ? hi_ex : 1, has_lo ? &alo : NULL, lo_ex, fdig);
        int a = pd_gb_alt(b, r);
        pd_gb_lit(b, r, a, "-", 1);
        pd_gb_ref(b, r, a, neg);
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
    pd_gb *b = j->b;
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
        int r = pd_gb_rule_new(b);
        cJSON_ArrayForEach(it, v) pd_gb_ref(b, r, pd_gb_alt(b, r), j_literal(j, it, path));
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
        int r = pd_gb_rule_new(b), i = 0;
        cJSON_ArrayForEach(it, v) {
            char p[256];
            snprintf(p, sizeof(p), "%s.%s[%d]", path, alts[k], i++);
            pd_gb_ref(b, r, pd_gb_alt(b, r), j_schema(j, it, p, depth + 1));
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
    int r = pd_gb_rule_new(b);
    cJSON_ArrayForEach(it, v) {
        if (!cJSON_IsString(it))
            return j_err(j, path, "%s", "'type' lists a non-string");
        pd_gb_ref(b, r, pd_gb_alt(b, r), j_typed(j, s, it->valuestring, path, depth));
    }
    return r;
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
    int body = pd_grammar_regex_json(j->b, pat, n, (size_t)head);
    pd_gb *b = j->b;
    int any = pd_gb_star(b, j_str_char(j));
    int x = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, x);
    pd_gb_lit(b, x, a, "\"", 1);
    if (!head)
        pd_gb_ref(b, x, a, any);
    pd_gb_ref(b, x, a, body);
    if (!tail)
        pd_gb_ref(b, x, a, any);
    pd_gb_lit(b, x, a, "\"", 1);
    return x;
}

pd_status pd_grammar_json(const char *schema, size_t len, pd_grammar **out, pd_err *err)
{
    pd_gb b = { .err = err };
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
        size_t bad = 0;
        doc = pd_json_parse(schema, len, &bad);
        if (doc == NULL)
            return pd_err_set(err, PD_ERR_INVALID, "JSON schema: not valid JSON (at byte %zu)", bad);
        j.root = doc;
        root = j_schema(&j, doc, "", 0);
    }
    for (int i = 0; i < j.n_refs; i++)
        free(j.refs[i].name);
    free(j.refs);
    cJSON_Delete(doc);
    return pd_gb_finish(&b, root, out);
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
    pd_gb b = { .err = err };
    jctx j = { .b = &b, .ws = -1, .str_char = -1, .string = -1, .integer = -1, .number = -1,
               .boolean = -1, .null = -1, .value = -1, .obj_any = -1 };
    int call = pd_gb_rule_new(&b);
    for (int i = 0; i < n && b.st == PD_OK; i++) {
        cJSON *doc = NULL;
        int args;
        if (schemas[i] == NULL) {
            j_value(&j);
            args = j.obj_any;
        } else if ((doc = pd_json_parse_str(schemas[i], NULL)) == NULL) {
            args = pd_gb_fail(&b, PD_ERR_INVALID, "JSON schema: not valid JSON");
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
        int a = pd_gb_alt(&b, call);
        static const char pre[] = "<tool_call>\n{\"name\": \"", mid[] = "\", \"arguments\": ",
                          post[] = "}\n</tool_call>";
        pd_gb_lit(&b, call, a, pre, sizeof(pre) - 1);
        pd_gb_lit(&b, call, a, names[i], strlen(names[i]));
        pd_gb_lit(&b, call, a, mid, sizeof(mid) - 1);
        pd_gb_ref(&b, call, a, args);
        pd_gb_lit(&b, call, a, post, sizeof(post) - 1);
    }
    free(j.refs);
    int root = call;
    if (parallel) {   /* call ("\n" call)* */
        int more = pd_gb_rule_new(&b);
        int a = pd_gb_alt(&b, more);
        pd_gb_lit(&b, more, a, "\n", 1);
        pd_gb_ref(&b, more, a, call);
        int tail = pd_gb_star(&b, more);
        root = pd_gb_rule_new(&b);
        a = pd_gb_alt(&b, root);
        pd_gb_ref(&b, root, a, call);
        pd_gb_ref(&b, root, a, tail);
    }
    return pd_gb_finish(&b, root, out);
}
