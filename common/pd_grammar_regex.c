/* pd_grammar_regex.c - lists of choices and regular expressions compiled into grammars
 *   (pd_grammar_regex.h).
 * Owns: choices as literal alternatives; the regex parser (literals, . and [...] classes,
 *   escapes, groups, |, quantifiers; non-ASCII as whole UTF-8 sequences) and its JSON-string
 *   form, in which the characters JSON escapes are matched as their escapes (a schema's
 *   pattern: pd_grammar_regex_json).
 * Not here: the rule builder (pd_grammar.c), what a pattern means in a schema
 *   (pd_grammar_json.c).
 * Threading: each call builds its own grammar; any thread. */
#include "pd_grammar_regex.h"

#include <stdio.h>
#include <string.h>

#include "pd_grammar_internal.h"

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
    pd_gb b = { .err = err };
    int r = pd_gb_rule_new(&b);
    for (int i = 0; i < n; i++)
        pd_gb_lit(&b, r, pd_gb_alt(&b, r), choices[i], strlen(choices[i]));
    return pd_gb_finish(&b, r, out);
}

/* ---- regular expressions -------------------------------------------------------------------- */

typedef struct {
    pd_gb *b;
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
        return pd_gb_lit_rule(r->b, s, n);
    int x = pd_gb_rule_new(r->b);
    int a = pd_gb_alt(r->b, x);
    for (size_t i = 0; i < n; i++) {
        char buf[8];
        const char *e = json_escape((uint8_t)s[i], buf);
        if (e != NULL)
            pd_gb_lit(r->b, x, a, e, strlen(e));
        else
            pd_gb_lit(r->b, x, a, s + i, 1);
    }
    return x;
}

static int r_err(rctx *r, const char *what)
{
    char m[300];
    snprintf(m, sizeof(m), "regex at offset %zu: %s", r->i, what);
    return pd_gb_fail(r->b, PD_ERR_INVALID, m);
}

static int r_utf8(rctx *r)
{
    if (r->utf8 >= 0)
        return r->utf8;
    int u = pd_gb_rule_new(r->b);
    pd_gb_utf8_alts(r->b, u);
    return r->utf8 = u;
}

/* an ASCII set, plus every non-ASCII character when `wide` (negated classes, \D \W \S, .) */
static int r_set_rule(rctx *r, const pd_gset *s, int wide)
{
    if (r->json) {   /* the bytes JSON escapes: their escapes instead */
        pd_gset plain = *s;
        int x = pd_gb_rule_new(r->b);
        for (int c = 0; c < 0x80; c++) {
            char buf[8];
            const char *e = json_escape((uint8_t)c, buf);
            if (e == NULL || !pd_gset_has(s, c))
                continue;
            plain.w[c >> 5] &= ~(1u << (c & 31));
            pd_gb_lit(r->b, x, pd_gb_alt(r->b, x), e, strlen(e));
        }
        pd_gb_cls(r->b, x, pd_gb_alt(r->b, x), &plain);
        if (wide)
            pd_gb_ref(r->b, x, pd_gb_alt(r->b, x), r_utf8(r));
        return x;
    }
    if (!wide)
        return pd_gb_cls_rule(r->b, s);
    int u = r_utf8(r);
    int x = pd_gb_rule_new(r->b);
    pd_gb_cls(r->b, x, pd_gb_alt(r->b, x), s);
    pd_gb_ref(r->b, x, pd_gb_alt(r->b, x), u);
    return x;
}

/* \d \w \s (and their complements within ASCII) into s; 1 when it was one of them */
static int r_class_escape(char c, pd_gset *s, int *neg)
{
    pd_gset t = { { 0 } };
    switch (c | 0x20) {
    case 'd': pd_gset_range(&t, '0', '9'); break;
    case 'w':
        pd_gset_range(&t, '0', '9'); pd_gset_range(&t, 'a', 'z'); pd_gset_range(&t, 'A', 'Z'); pd_gset_add(&t, '_');
        break;
    case 's': for (const char *p = " \t\n\r\f\v"; *p; p++) pd_gset_add(&t, (uint8_t)*p); break;
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
    pd_gset s = { { 0 } };
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
        pd_gset_range(&s, lo, hi);
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
        pd_gset s = { { 0 } };
        pd_gset_range(&s, 0, 0x7f);
        s.w['\n' >> 5] &= ~(1u << ('\n' & 31));
        return r_set_rule(r, &s, 1);
    }
    if (c == '\\') {
        if (r->i >= r->n)
            return r_err(r, "the pattern ends in \\");
        char e = r->s[r->i++];
        pd_gset s = { { 0 } };
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

static int r_number(rctx *r, int *out)
{
    int rc = pd_grammar_repeat_bound(r->s, r->n, &r->i, out);
    return rc < 0 ? r_err(r, "a repeat bound above 100000") : rc ? 0 : -1;
}

static int r_concat(rctx *r, int depth)
{
    pd_gb *b = r->b;
    int seq = pd_gb_rule_new(b);
    int a = pd_gb_alt(b, seq);
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
            x = pd_gb_quant(b, x, min, max);
        }
        pd_gb_ref(b, seq, a, x);
    }
    return seq;
}

static int r_alt(rctx *r, int depth)
{
    if (depth > 64)
        return r_err(r, "groups nested more than 64 deep");
    int x = pd_gb_rule_new(r->b);
    for (;;) {
        pd_gb_ref(r->b, x, pd_gb_alt(r->b, x), r_concat(r, depth));
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
    pd_gb b = { .err = err };
    rctx r = { .b = &b, .s = re, .n = len, .utf8 = -1 };
    if (r.n > 0 && r.s[0] == '^')
        r.i = 1;
    int root = r_alt(&r, 0);
    if (b.st == PD_OK && r.i < r.n)
        r_err(&r, r.s[r.i] == ')' ? "unbalanced )" : "unexpected character");
    return pd_gb_finish(&b, root, out);
}

/* A schema's pattern (pd_grammar_json.c): the rule of s[start..n) with the characters JSON
 * escapes matched as their escapes */
int pd_grammar_regex_json(pd_gb *b, const char *s, size_t n, size_t start)
{
    rctx r = { .b = b, .s = s, .n = n, .i = start, .utf8 = -1, .json = 1 };
    int body = r_alt(&r, 0);
    if (b->st == PD_OK && r.i < r.n)
        r_err(&r, r.s[r.i] == ')' ? "unbalanced )" : "unexpected character");
    return body;
}
