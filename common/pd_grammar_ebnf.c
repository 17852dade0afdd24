/* pd_grammar_ebnf.c - GBNF grammars (llama.cpp's EBNF, what vLLM's guided_grammar takes)
 *   compiled into grammars (pd_grammar_ebnf.h).
 * Owns: the GBNF parser (rule definitions, literals, classes of code points as UTF-8 byte
 *   ranges, groups, quantifiers, comments) and the checks of the whole: rules used but not
 *   defined, a missing root, left recursion.
 * Not here: the rule builder (pd_grammar.c).
 * Threading: each call builds its own grammar; any thread. */
#include "pd_grammar_ebnf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_grammar_internal.h"

/* ---- EBNF grammars (GBNF, as llama.cpp and xgrammar write them) ------------------------------ */

/* Rules `name ::= body`; a body is alternatives (|) of sequences of "literals", [classes]
 * ([^...] negated; members and ranges of code points), `.` (any character), rule names and
 * (groups), each optionally followed by * + ? {m} {m,} {m,n}; # comments to the end of a line.
 * A rule's body may span lines: it ends where the next `name ::=` begins. Escapes in literals
 * and classes: \n \t \r \\ \" \] \[ \- \^ \xHH \uHHHH \UHHHHHHHH (code points). */

typedef struct {
    pd_gb *b;
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
    return pd_gb_fail(e->b, PD_ERR_INVALID, m);
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
    if (pd_grammar_grow((void **)&e->rules, &e->cap_rules, e->n_rules + 1, sizeof(*e->rules)) != 0)
        return pd_gb_fail(e->b, PD_ERR_NOMEM, "grammar rules");
    struct erule *r = &e->rules[e->n_rules];
    memset(r, 0, sizeof(*r));
    if ((r->name = malloc(len + 1)) == NULL)
        return pd_gb_fail(e->b, PD_ERR_NOMEM, "grammar rules");
    memcpy(r->name, name, len);
    r->name[len] = '\0';
    r->rule = pd_gb_rule_new(e->b);
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
static void utf8_range(pd_gb *b, int r, uint32_t lo, uint32_t hi)
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
    int a = pd_gb_alt(b, r);
    for (size_t k = 0; k < n; k++) {
        pd_gset s = { { 0 } };
        pd_gset_range(&s, (uint8_t)l[k], (uint8_t)h[k]);
        pd_gb_cls(b, r, a, &s);
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
        return pd_gb_fail(e->b, PD_ERR_NOMEM, "grammar classes");
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
    int r = pd_gb_rule_new(e->b);
    pd_gset ascii = { { 0 } };
    int any_ascii = 0;
    for (int k = 0; k < m; k++) {
        uint32_t lo = out[k][0], hi = out[k][1];
        if (lo < 0x80) {
            pd_gset_range(&ascii, (int)lo, (int)(hi < 0x7f ? hi : 0x7f));
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
        pd_gb_cls(e->b, r, pd_gb_alt(e->b, r), &ascii);
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
        if (pd_grammar_grow((void **)&iv, &cap, n + 1, sizeof(*iv)) != 0) {
            pd_gb_fail(e->b, PD_ERR_NOMEM, "grammar classes");
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
        int r = pd_gb_rule_new(e->b), a = pd_gb_alt(e->b, r);
        while (e->i < e->n && e->s[e->i] != c) {
            long cp = e_char(e);
            if (cp < 0)
                return -1;
            char u[4];
            pd_gb_lit(e->b, r, a, u, utf8_put((uint32_t)cp, u));
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
    int rc = pd_grammar_repeat_bound(e->s, e->n, &e->i, out);
    return rc < 0 ? e_err(e, "%s", "a repeat bound above 100000") : rc ? 0 : -1;
}

static int e_seq(ectx *e, int depth)
{
    pd_gb *b = e->b;
    int seq = pd_gb_rule_new(b), a = pd_gb_alt(b, seq);
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
            x = pd_gb_quant(b, x, min, max);
        }
        pd_gb_ref(b, seq, a, x);
    }
    return seq;
}

static int e_alt(ectx *e, int depth)
{
    if (depth > 64)
        return e_err(e, "%s", "groups nested more than 64 deep");
    int x = pd_gb_rule_new(e->b);
    for (;;) {
        pd_gb_ref(e->b, x, pd_gb_alt(e->b, x), e_seq(e, depth));
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
    pd_gb *b = e->b;
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
        pd_gb_fail(b, PD_ERR_NOMEM, "grammar check");
        goto out;
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int r = 0; r < n; r++)
            for (int a = 0; a < b->r[r].n && !nullable[r]; a++) {
                const pd_gb_seq *s = &b->r[r].alt[a];
                int all = 1;
                for (int k = 0; k < s->n && all; k++)
                    all = s->el[k].kind == PD_GEL_REF && nullable[s->el[k].ref];
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
                const pd_gb_seq *s = &b->r[r].alt[cs_alt[depth]];
                int k = cs_el[depth];
                if (k >= s->n || (k > 0 && !(s->el[k - 1].kind == PD_GEL_REF && nullable[s->el[k - 1].ref]))) {
                    cs_alt[depth]++;
                    cs_el[depth] = 0;
                    continue;
                }
                cs_el[depth]++;
                if (s->el[k].kind != PD_GEL_REF)
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
            const pd_gb_seq *s = &b->r[r].alt[a];
            for (int k = 0; k + 1 < s->n; k++) {
                if (s->el[k].kind == PD_GEL_REF && comp[s->el[k].ref] == comp[r]) {
                    bad = "";
                    for (int q = 0; q < e->n_rules; q++)
                        if (comp[e->rules[q].rule] == comp[r])
                            bad = e->rules[q].name;
                    break;
                }
                if (!(s->el[k].kind == PD_GEL_REF && nullable[s->el[k].ref]))
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
    pd_gb b = { .err = err };
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
        pd_gb_ref(&b, e.rules[k].rule, pd_gb_alt(&b, e.rules[k].rule), body);
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
        pd_gb_fail(&b, PD_ERR_INVALID, "grammar: no rule named 'root' (where the output starts)");
    if (b.st == PD_OK) {
        const char *lr = e_left_recursion(&e);
        if (lr != NULL) {
            char m[200];
            snprintf(m, sizeof(m), "grammar: rule '%.64s' is left-recursive (write the repetition with * or +)",
                     lr[0] ? lr : "(a group)");
            pd_gb_fail(&b, PD_ERR_INVALID, m);
        }
    }
    for (int k = 0; k < e.n_rules; k++)
        free(e.rules[k].name);
    free(e.rules);
    return pd_gb_finish(&b, root, out);
}
