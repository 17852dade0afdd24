/* pd_jinja.c - a Jinja2 subset for Hugging Face chat templates (pd_jinja.h).
 * A template is lexed into text, output and statement pieces (whitespace control, trim_blocks,
 * lstrip_blocks applied there), parsed into a tree of nodes, and rendered by walking it. Every
 * node and value lives in an arena: the template's (parse) or the render's (freed whole at the
 * end), so nothing is reference-counted. Values follow Python's rules where templates see them
 * (truthiness, str(), ==, +, in, slices). */
#include "pd_jinja.h"

#include <ctype.h>
#include <limits.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_OUT (64u << 20)        /* a render's output */
#define MAX_STEPS 20000000L        /* loop iterations and node visits of one render */
#define MAX_ARENA (512u << 20)     /* the memory of one render's values */
#define MAX_DEPTH 200              /* nested macro calls and expression depth */

/* ---------------------------------------------------------------------------------------------
 * Arena */

typedef struct chunk {
    struct chunk *next;
    size_t used, cap;
    max_align_t data[];
} chunk;

typedef struct {
    chunk *head;
    jmp_buf *oom;                  /* where an allocation failure goes */
    size_t total, limit;           /* bytes taken; limit 0: none */
    int over;                      /* the limit, not malloc, failed it */
} arena;

static void *aalloc(arena *a, size_t n)
{
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    if (a->head == NULL || a->head->used + n > a->head->cap) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit != 0 && a->total + cap > a->limit) {
            a->over = 1;
            longjmp(*a->oom, 1);
        }
        chunk *c = malloc(sizeof(chunk) + cap);
        if (c == NULL)
            longjmp(*a->oom, 1);
        a->total += cap;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = (char *)a->head->data + a->head->used;
    a->head->used += n;
    memset(p, 0, n);
    return p;
}

static void arena_free(arena *a)
{
    for (chunk *c = a->head, *n; c != NULL; c = n) {
        n = c->next;
        free(c);
    }
    a->head = NULL;
}

static char *astrndup(arena *a, const char *s, size_t n)
{
    char *d = aalloc(a, n + 1);
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

/* ---------------------------------------------------------------------------------------------
 * Values */

typedef enum { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT, V_FUNC } vtype;

typedef struct val val;
struct node;
typedef struct rctx rctx;
typedef val *(*builtin_fn)(rctx *c, val *self, val **args, int n, char **kn, val **kv, int nk);

struct val {
    vtype t;
    int ns;                        /* V_DICT: a namespace() (attributes may be set) */
    int tuple;                     /* V_LIST: written as a tuple by str() */
    union {
        int b;
        long long i;
        double f;
        struct { const char *s; size_t n; } s;
        struct { val **a; int n, cap; } l;
        struct { const char **k; val **v; int n, cap; } d;
        struct { const struct node *macro; builtin_fn fn; val *self; const char *name; } fn;
    } u;
};

static val V_UNDEF_ = {.t = V_UNDEF}, V_NONE_ = {.t = V_NONE};
static val V_TRUE_ = {.t = V_BOOL, .u.b = 1}, V_FALSE_ = {.t = V_BOOL, .u.b = 0};

/* ---------------------------------------------------------------------------------------------
 * Nodes */

typedef enum {
    /* statements */
    N_BODY, N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_SETBLOCK, N_MACRO, N_BREAK, N_CONTINUE, N_FILTERBLOCK, N_CALLBLOCK,
    /* expressions */
    E_LIT, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_BIN, E_NEG, E_POS, E_NOT,
    E_AND, E_OR, E_COND, E_LIST, E_TUPLE, E_DICT, E_KWARG
} nkind;

typedef struct node {
    nkind k;
    int line;
    const char *s;                 /* text, name, operator, attribute, filter or test name */
    size_t n;                      /* N_TEXT: length */
    val *v;                        /* E_LIT */
    struct node **c;               /* children (meaning by kind, below) */
    int nc;
    int neg;                       /* E_TEST: "is not"; E_BIN "in": "not in" */
} node;
/* children: N_BODY statements; N_OUT [expr]; N_IF [cond, then, else?]; N_FOR [target names
 * (E_NAME or E_TUPLE of names), iterable, body, else?, filter?]; N_SET [target (E_NAME / E_ATTR
 * / E_TUPLE), value]; N_SETBLOCK [target, body]; N_MACRO [body, params (E_NAME or E_KWARG with
 * default)...] with s = name; N_FILTERBLOCK [body, args...] s = filter; N_CALLBLOCK [the body as a
 * parameterless N_MACRO named caller, the E_CALL of a macro]; E_ATTR [obj] s = name; E_ITEM [obj, index]; E_SLICE [obj, a, b,
 * step] (NULL for absent); E_CALL [callee, args...]; E_FILTER [obj, args...] s = name; E_TEST
 * [obj, args...] s = name; E_BIN [l, r] s = op; E_AND / E_OR [l, r]; E_COND [then, cond, else?];
 * E_LIST / E_TUPLE items; E_DICT [k0, v0, k1, v1, ...]; E_KWARG [value] s = name. */

struct pd_jinja {
    arena a;
    node *root;
};

/* ---------------------------------------------------------------------------------------------
 * Lexing the template into pieces */

typedef enum { P_TEXT, P_OUT, P_STMT } pkind;
typedef struct {
    pkind k;
    const char *s;
    size_t n;
    int line;
} piece;

typedef struct {
    arena *a;
    char *err;
    size_t cap;
    jmp_buf fail;
    piece *p;
    int np, cp;
    /* statement/expression tokens */
    const char *src;               /* the current piece's inside */
    size_t pos, end;
    int line;
    int depth;                     /* expressions and statements open inside each other */
    int tk;                        /* the current token's kind */
    const char *ts;                /* its text */
    size_t tn;
} parser;

static void perr(parser *ps, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4), noreturn));
static void perr(parser *ps, int line, const char *fmt, ...)
{
    int o = snprintf(ps->err, ps->cap, "line %d: ", line);
    va_list ap;
    va_start(ap, fmt);
    if (o >= 0 && (size_t)o < ps->cap)
        vsnprintf(ps->err + o, ps->cap - (size_t)o, fmt, ap);
    va_end(ap);
    longjmp(ps->fail, 1);
}

static void add_piece(parser *ps, pkind k, const char *s, size_t n, int line)
{
    if (ps->np == ps->cp) {
        int cap = ps->cp ? ps->cp * 2 : 64;
        piece *np = aalloc(ps->a, (size_t)cap * sizeof(piece));
        if (ps->np)
            memcpy(np, ps->p, (size_t)ps->np * sizeof(piece));
        ps->p = np;
        ps->cp = cap;
    }
    ps->p[ps->np++] = (piece){k, s, n, line};
}

static int count_lines(const char *s, size_t n)
{
    int l = 0;
    for (size_t i = 0; i < n; i++)
        l += s[i] == '\n';
    return l;
}

/* The pieces of src with jinja2's whitespace rules (trim_blocks and lstrip_blocks on, as
 * transformers compiles chat templates). */
static void lex_template(parser *ps, const char *src)
{
    size_t i = 0, n = strlen(src);
    /* jinja2 drops the template's last newline (keep_trailing_newline is off) */
    if (n > 0 && src[n - 1] == '\n')
        n -= n > 1 && src[n - 2] == '\r' ? 2 : 1;
    int line = 1;
    int strip_next = 0;            /* the previous tag ended with '-': leading whitespace goes */
    int trim_nl = 0;               /* the previous tag was a block or comment: one newline goes */
    while (i < n) {
        /* the text up to the next tag */
        size_t t = i;
        while (t < n && !(src[t] == '{' && t + 1 < n && (src[t + 1] == '{' || src[t + 1] == '%' || src[t + 1] == '#')))
            t++;
        size_t ts = i, te = t;
        if (strip_next)
            while (ts < te && isspace((unsigned char)src[ts]))
                ts++;
        else if (trim_nl && ts < te && src[ts] == '\n')
            ts++;
        else if (trim_nl && ts + 1 < te && src[ts] == '\r' && src[ts + 1] == '\n')
            ts += 2;
        strip_next = trim_nl = 0;
        if (t >= n) {
            if (te > ts)
                add_piece(ps, P_TEXT, src + ts, te - ts, line);
            break;
        }
        char kind = src[t + 1];
        size_t in = t + 2;
        int minus_l = in < n && src[in] == '-', plus_l = in < n && src[in] == '+';
        if (minus_l || plus_l)
            in++;
        if (minus_l) {
            while (te > ts && isspace((unsigned char)src[te - 1]))
                te--;
        } else if (!plus_l && kind != '{') {
            /* lstrip_blocks: spaces and tabs from the line's start to a block or comment tag */
            size_t b = te;
            while (b > ts && (src[b - 1] == ' ' || src[b - 1] == '\t'))
                b--;
            if (b == 0 || src[b - 1] == '\n' || (b == ts && ts > 0 && src[ts - 1] == '\n') || (b == ts && ts == 0))
                te = b;
        }
        int tline = line + count_lines(src + i, t - i);
        if (te > ts)
            add_piece(ps, P_TEXT, src + ts, te - ts, line + count_lines(src + i, ts - i));
        /* the tag's end */
        const char *close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
        size_t e = in;
        if (kind == '#') {
            const char *q = strstr(src + in, "#}");
            if (q == NULL)
                perr(ps, tline, "a comment that never ends");
            e = (size_t)(q - src);
        } else {
            /* skip strings inside the tag when looking for its end */
            char quote = 0;
            while (e + 1 < n) {
                if (quote) {
                    if (src[e] == '\\')
                        e++;
                    else if (src[e] == quote)
                        quote = 0;
                } else if (src[e] == '\'' || src[e] == '"') {
                    quote = src[e];
                } else if (src[e] == close[0] && src[e + 1] == close[1]) {
                    break;
                }
                e++;
            }
            if (e + 1 >= n)
                perr(ps, tline, "a %s tag that never ends (no '%s')", kind == '{' ? "{{" : "{%", close);
        }
        size_t ie = e;
        int minus_r = ie > in && src[ie - 1] == '-';
        if (minus_r)
            ie--;
        if (kind != '#') {
            /* {% raw %} ... {% endraw %}: the text between as it is */
            size_t a = in, b = ie;
            while (a < b && isspace((unsigned char)src[a]))
                a++;
            while (b > a && isspace((unsigned char)src[b - 1]))
                b--;
            if (kind == '%' && b - a == 3 && memcmp(src + a, "raw", 3) == 0) {
                const char *q = strstr(src + e + 2, "endraw");
                const char *open = NULL;
                for (const char *r = q; r != NULL && r > src + e + 2; r--)
                    if (r[0] == '{' && r[1] == '%') {
                        open = r;
                        break;
                    }
                if (q == NULL || open == NULL)
                    perr(ps, tline, "{%% raw %%} without {%% endraw %%}");
                size_t rs = e + 2, re = (size_t)(open - src);
                if (minus_r)
                    while (rs < re && isspace((unsigned char)src[rs]))
                        rs++;
                if (open[2] == '-')
                    while (re > rs && isspace((unsigned char)src[re - 1]))
                        re--;
                if (re > rs)
                    add_piece(ps, P_TEXT, src + rs, re - rs, tline);
                const char *q2 = strstr(q, "%}");
                if (q2 == NULL)
                    perr(ps, tline, "{%% endraw without its end");
                line = tline + count_lines(src + t, (size_t)(q2 + 2 - src) - t);
                strip_next = q2[-1] == '-';
                trim_nl = !strip_next;
                i = (size_t)(q2 + 2 - src);
                continue;
            }
            add_piece(ps, kind == '{' ? P_OUT : P_STMT, src + in, ie - in, tline);
        }
        line = tline + count_lines(src + t, e + 2 - t);
        strip_next = minus_r;
        trim_nl = !minus_r && kind != '{';
        i = e + 2;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Tokens inside a tag */

enum { T_END, T_NAME, T_INT, T_FLOAT, T_STR, T_OP };

static void next_tok(parser *ps)
{
    const char *s = ps->src;
    while (ps->pos < ps->end && isspace((unsigned char)s[ps->pos])) {
        ps->line += s[ps->pos] == '\n';
        ps->pos++;
    }
    if (ps->pos >= ps->end) {
        ps->tk = T_END;
        ps->ts = "";
        ps->tn = 0;
        return;
    }
    size_t p = ps->pos;
    char ch = s[p];
    if (isalpha((unsigned char)ch) || ch == '_') {
        while (p < ps->end && (isalnum((unsigned char)s[p]) || s[p] == '_'))
            p++;
        ps->tk = T_NAME;
    } else if (isdigit((unsigned char)ch)) {
        int flt = 0;
        while (p < ps->end && (isdigit((unsigned char)s[p]) || s[p] == '_'))
            p++;
        if (p + 1 < ps->end && s[p] == '.' && isdigit((unsigned char)s[p + 1])) {
            flt = 1;
            p++;
            while (p < ps->end && isdigit((unsigned char)s[p]))
                p++;
        }
        if (p < ps->end && (s[p] == 'e' || s[p] == 'E')) {
            size_t q = p + 1;
            if (q < ps->end && (s[q] == '+' || s[q] == '-'))
                q++;
            if (q < ps->end && isdigit((unsigned char)s[q])) {
                flt = 1;
                p = q;
                while (p < ps->end && isdigit((unsigned char)s[p]))
                    p++;
            }
        }
        ps->tk = flt ? T_FLOAT : T_INT;
    } else if (ch == '\'' || ch == '"') {
        p++;
        while (p < ps->end && s[p] != ch) {
            if (s[p] == '\\')
                p++;
            p++;
        }
        if (p >= ps->end)
            perr(ps, ps->line, "a string that never ends");
        p++;
        ps->tk = T_STR;
    } else {
        static const char *const two[] = {"==", "!=", "<=", ">=", "//", "**"};
        ps->tk = T_OP;
        p++;
        for (int k = 0; k < 6; k++)
            if (p < ps->end && s[p - 1] == two[k][0] && s[p] == two[k][1]) {
                p++;
                break;
            }
        if (!strchr("+-*/%~<>=!()[]{}.,:|", ch))
            perr(ps, ps->line, "unexpected character '%c'", ch);
    }
    ps->ts = s + ps->pos;
    ps->tn = p - ps->pos;
    ps->pos = p;
}

static int is_op(const parser *ps, const char *op)
{
    return ps->tk == T_OP && ps->tn == strlen(op) && memcmp(ps->ts, op, ps->tn) == 0;
}

static int is_name(const parser *ps, const char *nm)
{
    return ps->tk == T_NAME && ps->tn == strlen(nm) && memcmp(ps->ts, nm, ps->tn) == 0;
}

static void expect_op(parser *ps, const char *op)
{
    if (!is_op(ps, op))
        perr(ps, ps->line, "expected '%s', got '%.*s'", op, (int)ps->tn, ps->ts);
    next_tok(ps);
}

static const char *take_name(parser *ps)
{
    if (ps->tk != T_NAME)
        perr(ps, ps->line, "expected a name, got '%.*s'", (int)ps->tn, ps->ts);
    const char *nm = astrndup(ps->a, ps->ts, ps->tn);
    next_tok(ps);
    return nm;
}

static node *mk(parser *ps, nkind k, int nc)
{
    node *x = aalloc(ps->a, sizeof(node));
    x->k = k;
    x->line = ps->line;
    x->nc = nc;
    x->c = nc > 0 ? aalloc(ps->a, (size_t)nc * sizeof(node *)) : NULL;
    return x;
}

/* children grown one by one */
static void push(parser *ps, node *x, node *ch, int *cap)
{
    if (x->nc == *cap) {
        int nc = *cap ? *cap * 2 : 4;
        node **c = aalloc(ps->a, (size_t)nc * sizeof(node *));
        if (x->nc)
            memcpy(c, x->c, (size_t)x->nc * sizeof(node *));
        x->c = c;
        *cap = nc;
    }
    x->c[x->nc++] = ch;
}

static val *mkval(arena *a, vtype t)
{
    val *v = aalloc(a, sizeof(val));
    v->t = t;
    return v;
}

static val *mkstr(arena *a, const char *s, size_t n)
{
    val *v = mkval(a, V_STR);
    v->u.s.s = astrndup(a, s, n);
    v->u.s.n = n;
    return v;
}

/* a string literal's text with its escapes */
static val *str_lit(parser *ps, const char *s, size_t n)
{
    char *d = aalloc(ps->a, n + 1);
    size_t o = 0;
    for (size_t i = 1; i + 1 < n; i++) {
        if (s[i] != '\\' || i + 2 >= n) {
            d[o++] = s[i];
            continue;
        }
        char e = s[++i];
        switch (e) {
        case 'n': d[o++] = '\n'; break;
        case 't': d[o++] = '\t'; break;
        case 'r': d[o++] = '\r'; break;
        case '0': d[o++] = '\0'; break;
        case '\\': case '\'': case '"': d[o++] = e; break;
        case '\n': break;   /* a line continuation */
        case 'x': case 'u': {
            int digits = e == 'x' ? 2 : 4;
            unsigned cp = 0;
            int k = 0;
            for (; k < digits && i + 1 < n - 1 && isxdigit((unsigned char)s[i + 1]); k++, i++)
                cp = cp * 16 + (unsigned)(isdigit((unsigned char)s[i + 1]) ? s[i + 1] - '0'
                                                                           : (tolower((unsigned char)s[i + 1]) - 'a' + 10));
            if (k < digits) {   /* not an escape after all */
                d[o++] = '\\';
                d[o++] = e;
                i -= (size_t)k;
                break;
            }
            if (cp < 0x80) {
                d[o++] = (char)cp;
            } else if (cp < 0x800) {
                d[o++] = (char)(0xc0 | (cp >> 6));
                d[o++] = (char)(0x80 | (cp & 0x3f));
            } else {
                d[o++] = (char)(0xe0 | (cp >> 12));
                d[o++] = (char)(0x80 | ((cp >> 6) & 0x3f));
                d[o++] = (char)(0x80 | (cp & 0x3f));
            }
            break;
        }
        default: d[o++] = '\\'; d[o++] = e;
        }
    }
    val *v = mkval(ps->a, V_STR);
    v->u.s.s = d;
    v->u.s.n = o;
    return v;
}

static node *parse_expr(parser *ps);
static node *parse_or(parser *ps);
static node *parse_unary(parser *ps, int filters);

/* (args) of a call, filter or test: positional and name=value */
static void parse_args(parser *ps, node *x, int *cap)
{
    expect_op(ps, "(");
    while (!is_op(ps, ")")) {
        if (ps->tk == T_NAME) {
            /* name=value? */
            size_t save = ps->pos;
            int sl = ps->line;
            const char *ts = ps->ts;
            size_t tn = ps->tn;
            next_tok(ps);
            if (is_op(ps, "=")) {
                next_tok(ps);
                node *kw = mk(ps, E_KWARG, 1);
                kw->s = astrndup(ps->a, ts, tn);
                kw->c[0] = parse_expr(ps);
                push(ps, x, kw, cap);
                goto sep;
            }
            ps->pos = save - tn;
            ps->line = sl;
            next_tok(ps);
        }
        push(ps, x, parse_expr(ps), cap);
    sep:
        if (!is_op(ps, ","))
            break;
        next_tok(ps);
    }
    expect_op(ps, ")");
}

static node *parse_primary(parser *ps)
{
    node *x;
    if (ps->tk == T_STR) {
        x = mk(ps, E_LIT, 0);
        x->v = str_lit(ps, ps->ts, ps->tn);
        next_tok(ps);
        while (ps->tk == T_STR) {   /* adjacent literals join */
            val *b = str_lit(ps, ps->ts, ps->tn);
            val *j = mkval(ps->a, V_STR);
            char *d = aalloc(ps->a, x->v->u.s.n + b->u.s.n + 1);
            memcpy(d, x->v->u.s.s, x->v->u.s.n);
            memcpy(d + x->v->u.s.n, b->u.s.s, b->u.s.n);
            j->u.s.s = d;
            j->u.s.n = x->v->u.s.n + b->u.s.n;
            x->v = j;
            next_tok(ps);
        }
        return x;
    }
    if (ps->tk == T_INT || ps->tk == T_FLOAT) {
        char buf[64];
        size_t o = 0;
        for (size_t i = 0; i < ps->tn && o + 1 < sizeof(buf); i++)
            if (ps->ts[i] != '_')
                buf[o++] = ps->ts[i];
        buf[o] = '\0';
        x = mk(ps, E_LIT, 0);
        x->v = mkval(ps->a, ps->tk == T_INT ? V_INT : V_FLOAT);
        if (ps->tk == T_INT)
            x->v->u.i = strtoll(buf, NULL, 10);
        else
            x->v->u.f = strtod(buf, NULL);
        next_tok(ps);
        return x;
    }
    if (ps->tk == T_NAME) {
        static const struct { const char *n; val *v; } lits[] = {
            {"true", &V_TRUE_}, {"True", &V_TRUE_}, {"false", &V_FALSE_}, {"False", &V_FALSE_},
            {"none", &V_NONE_}, {"None", &V_NONE_},
        };
        for (size_t k = 0; k < sizeof(lits) / sizeof(lits[0]); k++)
            if (is_name(ps, lits[k].n)) {
                x = mk(ps, E_LIT, 0);
                x->v = lits[k].v;
                next_tok(ps);
                return x;
            }
        x = mk(ps, E_NAME, 0);
        x->s = take_name(ps);
        return x;
    }
    if (is_op(ps, "(")) {
        next_tok(ps);
        if (is_op(ps, ")")) {
            next_tok(ps);
            return mk(ps, E_TUPLE, 0);
        }
        node *e = parse_expr(ps);
        if (is_op(ps, ",")) {
            node *t = mk(ps, E_TUPLE, 0);
            int cap = 0;
            push(ps, t, e, &cap);
            while (is_op(ps, ",")) {
                next_tok(ps);
                if (is_op(ps, ")"))
                    break;
                push(ps, t, parse_expr(ps), &cap);
            }
            e = t;
        }
        expect_op(ps, ")");
        return e;
    }
    if (is_op(ps, "[")) {
        next_tok(ps);
        x = mk(ps, E_LIST, 0);
        int cap = 0;
        while (!is_op(ps, "]")) {
            push(ps, x, parse_expr(ps), &cap);
            if (!is_op(ps, ","))
                break;
            next_tok(ps);
        }
        expect_op(ps, "]");
        return x;
    }
    if (is_op(ps, "{")) {
        next_tok(ps);
        x = mk(ps, E_DICT, 0);
        int cap = 0;
        while (!is_op(ps, "}")) {
            push(ps, x, parse_expr(ps), &cap);
            expect_op(ps, ":");
            push(ps, x, parse_expr(ps), &cap);
            if (!is_op(ps, ","))
                break;
            next_tok(ps);
        }
        expect_op(ps, "}");
        return x;
    }
    perr(ps, ps->line, "unexpected '%.*s'", (int)ps->tn, ps->ts);
}

static node *parse_postfix(parser *ps, node *x)
{
    for (;;) {
        if (is_op(ps, ".")) {
            next_tok(ps);
            node *a = mk(ps, E_ATTR, 1);
            a->c[0] = x;
            if (ps->tk == T_INT) {   /* x.0: an item */
                a->k = E_ITEM;
                node *i = mk(ps, E_LIT, 0);
                i->v = mkval(ps->a, V_INT);
                i->v->u.i = strtoll(ps->ts, NULL, 10);
                next_tok(ps);
                a->nc = 2;
                node **c = aalloc(ps->a, 2 * sizeof(node *));
                c[0] = x;
                c[1] = i;
                a->c = c;
            } else {
                a->s = take_name(ps);
            }
            x = a;
        } else if (is_op(ps, "[")) {
            next_tok(ps);
            node *parts[3] = {NULL, NULL, NULL};
            int slice = 0;
            for (int k = 0; k < 3; k++) {
                if (!is_op(ps, ":") && !is_op(ps, "]"))
                    parts[k] = parse_expr(ps);
                if (k < 2 && is_op(ps, ":")) {
                    slice = 1;
                    next_tok(ps);
                } else {
                    break;
                }
            }
            expect_op(ps, "]");
            node *a = mk(ps, slice ? E_SLICE : E_ITEM, slice ? 4 : 2);
            a->c[0] = x;
            a->c[1] = parts[0];
            if (slice) {
                a->c[2] = parts[1];
                a->c[3] = parts[2];
            } else if (parts[0] == NULL) {
                perr(ps, ps->line, "an empty subscript");
            }
            x = a;
        } else if (is_op(ps, "(")) {
            node *cl = mk(ps, E_CALL, 0);
            int cap = 0;
            push(ps, cl, x, &cap);
            parse_args(ps, cl, &cap);
            x = cl;
        } else {
            return x;
        }
    }
}

/* x | filter(args) ... and x is [not] test(args) / x is test arg */
static node *parse_filters(parser *ps, node *x)
{
    for (;;) {
        if (is_op(ps, "|")) {
            next_tok(ps);
            node *f = mk(ps, E_FILTER, 0);
            int cap = 0;
            push(ps, f, x, &cap);
            const char *nm = take_name(ps);
            while (is_op(ps, ".")) {   /* dotted filter names are not jinja's; refuse plainly */
                perr(ps, ps->line, "filter '%s.': dotted names are not filters", nm);
            }
            f->s = nm;
            if (is_op(ps, "("))
                parse_args(ps, f, &cap);
            x = f;
        } else if (is_name(ps, "is")) {
            next_tok(ps);
            node *t = mk(ps, E_TEST, 0);
            int cap = 0;
            push(ps, t, x, &cap);
            if (is_name(ps, "not")) {
                t->neg = 1;
                next_tok(ps);
            }
            /* "none", "true", "false" and the comparison operators name tests too */
            if (ps->tk == T_NAME) {
                t->s = take_name(ps);
            } else {
                perr(ps, ps->line, "expected a test name after 'is'");
            }
            if (is_op(ps, "(")) {
                parse_args(ps, t, &cap);
            } else if (ps->tk == T_STR || ps->tk == T_INT || ps->tk == T_FLOAT || is_op(ps, "[") || is_op(ps, "{") ||
                       (ps->tk == T_NAME && !is_name(ps, "and") && !is_name(ps, "or") && !is_name(ps, "if") &&
                        !is_name(ps, "else") && !is_name(ps, "in") && !is_name(ps, "is") && !is_name(ps, "not"))) {
                push(ps, t, parse_postfix(ps, parse_primary(ps)), &cap);   /* x is divisibleby 3 */
            }
            x = t;
        } else {
            return x;
        }
    }
}

static node *parse_unary(parser *ps, int filters)
{
    if (is_op(ps, "-") || is_op(ps, "+")) {
        int neg = is_op(ps, "-");
        next_tok(ps);
        node *x = mk(ps, neg ? E_NEG : E_POS, 1);
        if (++ps->depth > MAX_DEPTH)
            perr(ps, ps->line, "expressions nested deeper than %d", MAX_DEPTH);
        x->c[0] = parse_unary(ps, 0);
        ps->depth--;
        return filters ? parse_filters(ps, x) : x;
    }
    node *x = parse_postfix(ps, parse_primary(ps));
    return filters ? parse_filters(ps, x) : x;
}

static node *bin(parser *ps, const char *op, node *l, node *r)
{
    node *x = mk(ps, E_BIN, 2);
    x->s = op;
    x->c[0] = l;
    x->c[1] = r;
    return x;
}

static node *parse_pow(parser *ps)
{
    node *l = parse_unary(ps, 1);
    while (is_op(ps, "**")) {
        next_tok(ps);
        l = bin(ps, "**", l, parse_unary(ps, 1));
    }
    return l;
}

static node *parse_math2(parser *ps)
{
    node *l = parse_pow(ps);
    for (;;) {
        const char *op = is_op(ps, "*") ? "*" : is_op(ps, "/") ? "/" : is_op(ps, "//") ? "//"
                       : is_op(ps, "%") ? "%" : NULL;
        if (op == NULL)
            return l;
        next_tok(ps);
        l = bin(ps, op, l, parse_pow(ps));
    }
}

static node *parse_concat(parser *ps)
{
    node *l = parse_math2(ps);
    while (is_op(ps, "~")) {
        next_tok(ps);
        l = bin(ps, "~", l, parse_math2(ps));
    }
    return l;
}

static node *parse_math1(parser *ps)
{
    node *l = parse_concat(ps);
    for (;;) {
        const char *op = is_op(ps, "+") ? "+" : is_op(ps, "-") ? "-" : NULL;
        if (op == NULL)
            return l;
        next_tok(ps);
        l = bin(ps, op, l, parse_concat(ps));
    }
}

static node *parse_compare(parser *ps)
{
    node *l = parse_math1(ps);
    for (;;) {
        static const char *const ops[] = {"==", "!=", "<=", ">=", "<", ">"};
        const char *op = NULL;
        for (int k = 0; k < 6 && op == NULL; k++)
            if (is_op(ps, ops[k]))
                op = ops[k];
        int neg = 0;
        if (op == NULL && is_name(ps, "in")) {
            op = "in";
        } else if (op == NULL && is_name(ps, "not")) {
            /* "not in" */
            size_t save = ps->pos;
            int sl = ps->line;
            next_tok(ps);
            if (!is_name(ps, "in")) {
                ps->pos = save - 3;
                ps->line = sl;
                next_tok(ps);
                return l;
            }
            op = "in";
            neg = 1;
        }
        if (op == NULL)
            return l;
        next_tok(ps);
        l = bin(ps, op, l, parse_math1(ps));
        l->neg = neg;
    }
}

static node *parse_not(parser *ps)
{
    if (is_name(ps, "not")) {
        next_tok(ps);
        node *x = mk(ps, E_NOT, 1);
        if (++ps->depth > MAX_DEPTH)
            perr(ps, ps->line, "expressions nested deeper than %d", MAX_DEPTH);
        x->c[0] = parse_not(ps);
        ps->depth--;
        return x;
    }
    return parse_compare(ps);
}

/* sub (word sub)*: and / or, left to right */
static node *parse_chain(parser *ps, const char *word, nkind k, node *(*sub)(parser *))
{
    node *l = sub(ps);
    while (is_name(ps, word)) {
        next_tok(ps);
        node *x = mk(ps, k, 2);
        x->c[0] = l;
        x->c[1] = sub(ps);
        l = x;
    }
    return l;
}

static node *parse_and(parser *ps)
{
    return parse_chain(ps, "and", E_AND, parse_not);
}

static node *parse_or(parser *ps)
{
    return parse_chain(ps, "or", E_OR, parse_and);
}

static node *parse_expr(parser *ps)
{
    if (++ps->depth > MAX_DEPTH)
        perr(ps, ps->line, "expressions nested deeper than %d", MAX_DEPTH);
    node *x = parse_or(ps);
    while (is_name(ps, "if")) {
        next_tok(ps);
        node *c = mk(ps, E_COND, 3);
        c->c[0] = x;
        c->c[1] = parse_or(ps);
        if (is_name(ps, "else")) {
            next_tok(ps);
            c->c[2] = parse_expr(ps);
        }
        x = c;
    }
    ps->depth--;
    return x;
}

/* a bare tuple (a, b) where a statement allows one: for targets, set targets */
static node *parse_target(parser *ps)
{
    node *x = parse_postfix(ps, parse_primary(ps));
    if (!is_op(ps, ","))
        return x;
    node *t = mk(ps, E_TUPLE, 0);
    int cap = 0;
    push(ps, t, x, &cap);
    while (is_op(ps, ",")) {
        next_tok(ps);
        push(ps, t, parse_postfix(ps, parse_primary(ps)), &cap);
    }
    return t;
}

static void start_piece(parser *ps, const piece *p)
{
    ps->src = p->s;
    ps->pos = 0;
    ps->end = p->n;
    ps->line = p->line;
    next_tok(ps);
}

static void end_piece(parser *ps)
{
    if (ps->tk != T_END)
        perr(ps, ps->line, "unexpected '%.*s'", (int)ps->tn, ps->ts);
}

/* Statements from piece *i until one whose first word is among stops (left at *i, its word in
 * *stop); NULL stops: to the end. */
static node *parse_body(parser *ps, int *i, const char *const *stops, const char **stop);

static int piece_word(parser *ps, int i, const char *const *words)
{
    if (i >= ps->np || ps->p[i].k != P_STMT)
        return -1;
    start_piece(ps, &ps->p[i]);
    for (int k = 0; words != NULL && words[k] != NULL; k++)
        if (is_name(ps, words[k]))
            return k;
    return -1;
}

static node *parse_stmt_in(parser *ps, int *i);

static node *parse_stmt(parser *ps, int *i)
{
    if (++ps->depth > MAX_DEPTH)
        perr(ps, ps->p[*i].line, "statements nested deeper than %d", MAX_DEPTH);
    node *x = parse_stmt_in(ps, i);
    ps->depth--;
    return x;
}

static node *parse_stmt_in(parser *ps, int *i)
{
    const piece *p = &ps->p[*i];
    start_piece(ps, p);
    int line = p->line;
    const char *kw = take_name(ps);
    (*i)++;
    if (strcmp(kw, "if") == 0) {
        node *x = mk(ps, N_IF, 3);
        x->c[0] = parse_expr(ps);
        end_piece(ps);
        static const char *const stops[] = {"elif", "else", "endif", NULL};
        const char *stop = NULL;
        x->c[1] = parse_body(ps, i, stops, &stop);
        if (stop == NULL)
            perr(ps, line, "{%% if %%} without {%% endif %%}");
        if (strcmp(stop, "elif") == 0) {
            /* elif: an if of its own in the else branch, ended by the same endif */
            piece *el = &ps->p[*i];   /* "elif ..." read as "if ..." */
            size_t w = 0;
            while (w < el->n && isspace((unsigned char)el->s[w]))
                w++;
            el->s += w + 2;
            el->n -= w + 2;
            node *body = mk(ps, N_BODY, 1);
            body->c[0] = parse_stmt(ps, i);
            x->c[2] = body;
            return x;
        }
        if (strcmp(stop, "else") == 0) {
            start_piece(ps, &ps->p[*i]);
            next_tok(ps);
            end_piece(ps);
            (*i)++;
            static const char *const ends[] = {"endif", NULL};
            x->c[2] = parse_body(ps, i, ends, &stop);
            if (stop == NULL)
                perr(ps, line, "{%% if %%} without {%% endif %%}");
        }
        start_piece(ps, &ps->p[*i]);
        next_tok(ps);
        end_piece(ps);
        (*i)++;
        return x;
    }
    if (strcmp(kw, "for") == 0) {
        node *x = mk(ps, N_FOR, 5);
        x->c[0] = parse_target(ps);
        if (!is_name(ps, "in"))
            perr(ps, ps->line, "expected 'in' in a for");
        next_tok(ps);
        x->c[1] = parse_or(ps);   /* not a conditional: "if" filters the loop */
        if (is_name(ps, "if")) {
            next_tok(ps);
            x->c[4] = parse_expr(ps);
        }
        if (is_name(ps, "recursive"))
            perr(ps, ps->line, "recursive loops are not supported");
        end_piece(ps);
        static const char *const stops[] = {"else", "endfor", NULL};
        const char *stop = NULL;
        int body_from = *i;
        x->c[2] = parse_body(ps, i, stops, &stop);
        /* neg marks a body that names "loop" (only then is loop.* made per iteration) */
        for (int k = body_from; k < *i && !x->neg; k++)
            if (ps->p[k].k != P_TEXT)
                for (const char *q = ps->p[k].s; (q = strstr(q, "loop")) != NULL && q < ps->p[k].s + ps->p[k].n; q += 4)
                    if ((q == ps->p[k].s || !(isalnum((unsigned char)q[-1]) || q[-1] == '_')) &&
                        !(isalnum((unsigned char)q[4]) || q[4] == '_'))
                        x->neg = 1;
        if (stop == NULL)
            perr(ps, line, "{%% for %%} without {%% endfor %%}");
        if (strcmp(stop, "else") == 0) {
            (*i)++;
            static const char *const ends[] = {"endfor", NULL};
            x->c[3] = parse_body(ps, i, ends, &stop);
            if (stop == NULL)
                perr(ps, line, "{%% for %%} without {%% endfor %%}");
        }
        (*i)++;
        return x;
    }
    if (strcmp(kw, "set") == 0) {
        node *target = parse_target(ps);
        if (is_op(ps, "=")) {
            next_tok(ps);
            node *x = mk(ps, N_SET, 2);
            x->c[0] = target;
            node *v = parse_expr(ps);
            if (is_op(ps, ",")) {   /* set a = 1, 2 */
                node *t = mk(ps, E_TUPLE, 0);
                int cap = 0;
                push(ps, t, v, &cap);
                while (is_op(ps, ",")) {
                    next_tok(ps);
                    push(ps, t, parse_expr(ps), &cap);
                }
                v = t;
            }
            x->c[1] = v;
            end_piece(ps);
            return x;
        }
        end_piece(ps);
        node *x = mk(ps, N_SETBLOCK, 2);
        x->c[0] = target;
        static const char *const stops[] = {"endset", NULL};
        const char *stop = NULL;
        x->c[1] = parse_body(ps, i, stops, &stop);
        if (stop == NULL)
            perr(ps, line, "{%% set %%} block without {%% endset %%}");
        (*i)++;
        return x;
    }
    if (strcmp(kw, "macro") == 0) {
        node *x = mk(ps, N_MACRO, 0);
        int cap = 0;
        push(ps, x, NULL, &cap);
        x->s = take_name(ps);
        expect_op(ps, "(");
        while (!is_op(ps, ")")) {
            node *pn = mk(ps, E_NAME, 0);
            pn->s = take_name(ps);
            if (is_op(ps, "=")) {
                next_tok(ps);
                node *kw2 = mk(ps, E_KWARG, 1);
                kw2->s = pn->s;
                kw2->c[0] = parse_expr(ps);
                pn = kw2;
            }
            push(ps, x, pn, &cap);
            if (!is_op(ps, ","))
                break;
            next_tok(ps);
        }
        expect_op(ps, ")");
        end_piece(ps);
        static const char *const stops[] = {"endmacro", NULL};
        const char *stop = NULL;
        x->c[0] = parse_body(ps, i, stops, &stop);
        if (stop == NULL)
            perr(ps, line, "{%% macro %%} without {%% endmacro %%}");
        (*i)++;
        return x;
    }
    if (strcmp(kw, "call") == 0) {
        /* {% call m(args) %}body{% endcall %}: m runs with caller() rendering the body */
        node *x = mk(ps, N_CALLBLOCK, 2);
        if (is_op(ps, "("))
            perr(ps, ps->line, "call blocks with caller arguments are not supported");
        x->c[1] = parse_expr(ps);
        if (x->c[1]->k != E_CALL)
            perr(ps, line, "{%% call %%} needs a macro call");
        end_piece(ps);
        static const char *const stops[] = {"endcall", NULL};
        const char *stop = NULL;
        node *m = mk(ps, N_MACRO, 1);
        m->s = "caller";
        m->c[0] = parse_body(ps, i, stops, &stop);
        if (stop == NULL)
            perr(ps, line, "{%% call %%} without {%% endcall %%}");
        x->c[0] = m;
        (*i)++;
        return x;
    }
    if (strcmp(kw, "filter") == 0) {
        node *x = mk(ps, N_FILTERBLOCK, 0);
        int cap = 0;
        push(ps, x, NULL, &cap);
        x->s = take_name(ps);
        if (is_op(ps, "("))
            parse_args(ps, x, &cap);
        end_piece(ps);
        static const char *const stops[] = {"endfilter", NULL};
        const char *stop = NULL;
        x->c[0] = parse_body(ps, i, stops, &stop);
        if (stop == NULL)
            perr(ps, line, "{%% filter %%} without {%% endfilter %%}");
        (*i)++;
        return x;
    }
    if (strcmp(kw, "generation") == 0) {
        /* transformers' assistant-mask marker: its content is rendered as it is */
        end_piece(ps);
        static const char *const stops[] = {"endgeneration", NULL};
        const char *stop = NULL;
        node *b = parse_body(ps, i, stops, &stop);
        if (stop == NULL)
            perr(ps, line, "{%% generation %%} without {%% endgeneration %%}");
        (*i)++;
        return b;
    }
    if (strcmp(kw, "break") == 0 || strcmp(kw, "continue") == 0) {
        end_piece(ps);
        return mk(ps, kw[0] == 'b' ? N_BREAK : N_CONTINUE, 0);
    }
    perr(ps, line, "unknown statement '%s' (this renderer takes if, for, set, macro, call, filter, break, "
         "continue, generation, raw)", kw);
}

static node *parse_body(parser *ps, int *i, const char *const *stops, const char **stop)
{
    node *b = mk(ps, N_BODY, 0);
    int cap = 0;
    *stop = NULL;
    while (*i < ps->np) {
        const piece *p = &ps->p[*i];
        if (p->k == P_TEXT) {
            node *t = mk(ps, N_TEXT, 0);
            t->s = p->s;
            t->n = p->n;
            push(ps, b, t, &cap);
            (*i)++;
        } else if (p->k == P_OUT) {
            start_piece(ps, p);
            node *o = mk(ps, N_OUT, 1);
            o->c[0] = parse_expr(ps);
            end_piece(ps);
            push(ps, b, o, &cap);
            (*i)++;
        } else {
            int k = piece_word(ps, *i, stops);
            if (k >= 0) {
                *stop = stops[k];
                return b;
            }
            static const char *const closers[] = {"endif", "endfor", "else", "elif", "endset", "endmacro",
                                                   "endgeneration", "endraw", "endfilter", "endcall", NULL};
            int c = piece_word(ps, *i, closers);
            if (c >= 0)
                perr(ps, p->line, "unexpected {%% %s %%}", closers[c]);
            push(ps, b, parse_stmt(ps, i), &cap);
        }
    }
    return b;
}

pd_jinja *pd_jinja_parse(const char *src, char *err, size_t cap)
{
    pd_jinja *volatile t = calloc(1, sizeof(*t));
    if (t == NULL) {
        snprintf(err, cap, "out of memory");
        return NULL;
    }
    jmp_buf oom;
    t->a.oom = &oom;
    parser ps = {.a = &t->a, .err = err, .cap = cap};
    if (setjmp(oom)) {
        snprintf(err, cap, "out of memory");
        goto fail;
    }
    if (setjmp(ps.fail))
        goto fail;
    /* the template's text nodes point into its own copy of the source */
    lex_template(&ps, astrndup(&t->a, src, strlen(src)));
    int i = 0;
    const char *stop = NULL;
    t->root = parse_body(&ps, &i, NULL, &stop);
    t->a.oom = NULL;
    return t;
fail:
    arena_free(&t->a);
    free(t);
    return NULL;
}

void pd_jinja_free(pd_jinja *t)
{
    if (t == NULL)
        return;
    arena_free(&t->a);
    free(t);
}

/* ---------------------------------------------------------------------------------------------
 * Rendering */

typedef struct frame {
    struct frame *up;
    val vars;                      /* a V_DICT: the scope's names */
} frame;

struct rctx {
    arena a;
    jmp_buf fail;
    char *err;
    size_t cap;
    char *out;
    size_t len, ocap;
    frame *top;                    /* innermost scope */
    long steps;
    int depth;
    int brk;                       /* 1 break, 2 continue: unwinding to the loop */
    int vdepth;                    /* values printed inside each other (a namespace can hold
                                    * itself: a cycle is an error, not a crash) */
};

static void rerr(rctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
static void rerr(rctx *c, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->cap, fmt, ap);
    va_end(ap);
    longjmp(c->fail, 1);
}

static void emit(rctx *c, const char *s, size_t n)
{
    if (c->len + n + 1 > c->ocap) {
        if (c->len + n + 1 > MAX_OUT)
            rerr(c, "the rendered prompt exceeds %u bytes", MAX_OUT);
        size_t cap = c->ocap ? c->ocap : 4096;
        while (cap < c->len + n + 1)
            cap *= 2;
        char *o = realloc(c->out, cap);
        if (o == NULL)
            rerr(c, "out of memory");
        c->out = o;
        c->ocap = cap;
    }
    memcpy(c->out + c->len, s, n);
    c->len += n;
    c->out[c->len] = '\0';
}

/* a growable string in the render arena */
typedef struct {
    rctx *c;
    char *s;
    size_t n, cap;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *d = aalloc(&b->c->a, cap);
        if (b->n)
            memcpy(d, b->s, b->n);
        b->s = d;
        b->cap = cap;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static void sb_str(sbuf *b, const char *s)
{
    sb_add(b, s, strlen(s));
}

static val *sb_val(sbuf *b)
{
    val *v = mkval(&b->c->a, V_STR);
    v->u.s.s = b->s != NULL ? b->s : "";
    v->u.s.n = b->n;
    return v;
}

static val *vint(rctx *c, long long i)
{
    val *v = mkval(&c->a, V_INT);
    v->u.i = i;
    return v;
}

static val *vfloat(rctx *c, double f)
{
    val *v = mkval(&c->a, V_FLOAT);
    v->u.f = f;
    return v;
}

static val *vbool(int b)
{
    return b ? &V_TRUE_ : &V_FALSE_;
}

static val *vlist(rctx *c)
{
    return mkval(&c->a, V_LIST);
}

static void list_add(rctx *c, val *l, val *x)
{
    if (l->u.l.n == l->u.l.cap) {
        int cap = l->u.l.cap ? l->u.l.cap * 2 : 8;
        val **a = aalloc(&c->a, (size_t)cap * sizeof(val *));
        if (l->u.l.n)
            memcpy(a, l->u.l.a, (size_t)l->u.l.n * sizeof(val *));
        l->u.l.a = a;
        l->u.l.cap = cap;
    }
    l->u.l.a[l->u.l.n++] = x;
}

static val *dict_get(const val *d, const char *k, size_t kn)
{
    for (int i = 0; i < d->u.d.n; i++)
        if (strlen(d->u.d.k[i]) == kn && memcmp(d->u.d.k[i], k, kn) == 0)
            return d->u.d.v[i];
    return NULL;
}

/* d[k] = x; a new key is copied, or borrowed (copy 0: a name of the template's parse, which
 * outlives the render) */
static void dict_put(rctx *c, val *d, const char *k, val *x, int copy)
{
    for (int i = 0; i < d->u.d.n; i++)
        if (strcmp(d->u.d.k[i], k) == 0) {
            d->u.d.v[i] = x;
            return;
        }
    if (d->u.d.n == d->u.d.cap) {
        int cap = d->u.d.cap ? d->u.d.cap * 2 : 8;
        const char **ks = aalloc(&c->a, (size_t)cap * sizeof(char *));
        val **vs = aalloc(&c->a, (size_t)cap * sizeof(val *));
        if (d->u.d.n) {
            memcpy(ks, d->u.d.k, (size_t)d->u.d.n * sizeof(char *));
            memcpy(vs, d->u.d.v, (size_t)d->u.d.n * sizeof(val *));
        }
        d->u.d.k = ks;
        d->u.d.v = vs;
        d->u.d.cap = cap;
    }
    d->u.d.k[d->u.d.n] = copy ? astrndup(&c->a, k, strlen(k)) : k;
    d->u.d.v[d->u.d.n++] = x;
}

static void dict_set(rctx *c, val *d, const char *k, val *x)
{
    dict_put(c, d, k, x, 1);
}

static val *from_json(rctx *c, const cJSON *j)
{
    if (j == NULL || cJSON_IsNull(j))
        return &V_NONE_;
    if (cJSON_IsBool(j))
        return vbool(cJSON_IsTrue(j));
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == floor(d) && fabs(d) < 9e15)
            return vint(c, (long long)d);
        return vfloat(c, d);
    }
    if (cJSON_IsString(j))
        return mkstr(&c->a, j->valuestring, strlen(j->valuestring));
    if (cJSON_IsArray(j)) {
        val *l = vlist(c);
        for (const cJSON *e = j->child; e != NULL; e = e->next)
            list_add(c, l, from_json(c, e));
        return l;
    }
    val *d = mkval(&c->a, V_DICT);
    for (const cJSON *e = j->child; e != NULL; e = e->next)
        if (e->string != NULL)
            dict_set(c, d, e->string, from_json(c, e));
    return d;
}

static const char *type_name(const val *v)
{
    static const char *const n[] = {"undefined", "none", "bool", "int", "float", "string", "list", "dict",
                                    "function"};
    return v->t == V_DICT && v->ns ? "namespace" : n[v->t];
}

static int truthy(const val *v)
{
    switch (v->t) {
    case V_UNDEF: case V_NONE: return 0;
    case V_BOOL: return v->u.b;
    case V_INT: return v->u.i != 0;
    case V_FLOAT: return v->u.f != 0.0;
    case V_STR: return v->u.s.n > 0;
    case V_LIST: return v->u.l.n > 0;
    case V_DICT: return v->u.d.n > 0 || v->ns;
    default: return 1;
    }
}

/* Python's repr of a float: the shortest text that reads back the same, with ".0" when integral */
static void float_text(double f, char *buf, size_t cap)
{
    if (isnan(f)) {
        snprintf(buf, cap, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, cap, f > 0 ? "inf" : "-inf");
        return;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, f);
        if (strtod(buf, NULL) == f)
            break;
    }
    /* Python writes 1e+16 as 1e+16 and 100.0 as 100.0 */
    if (strpbrk(buf, ".eni") == NULL)
        strncat(buf, ".0", cap - strlen(buf) - 1);
}

static void repr_into(rctx *c, sbuf *b, const val *v);

/* str(v) as Python writes it */
static void str_into(rctx *c, sbuf *b, const val *v)
{
    char num[64];
    switch (v->t) {
    case V_UNDEF: break;
    case V_NONE: sb_str(b, "None"); break;
    case V_BOOL: sb_str(b, v->u.b ? "True" : "False"); break;
    case V_INT: snprintf(num, sizeof(num), "%lld", v->u.i); sb_str(b, num); break;
    case V_FLOAT: float_text(v->u.f, num, sizeof(num)); sb_str(b, num); break;
    case V_STR: sb_add(b, v->u.s.s, v->u.s.n); break;
    default: repr_into(c, b, v);
    }
}

static void repr_inner(rctx *c, sbuf *b, const val *v);

static void repr_into(rctx *c, sbuf *b, const val *v)
{
    if (++c->vdepth > MAX_DEPTH)
        rerr(c, "a value nested deeper than %d (one that holds itself?)", MAX_DEPTH);
    repr_inner(c, b, v);
    c->vdepth--;
}

static void repr_inner(rctx *c, sbuf *b, const val *v)
{
    if (v->t == V_STR) {
        int dq = memchr(v->u.s.s, '\'', v->u.s.n) != NULL && memchr(v->u.s.s, '"', v->u.s.n) == NULL;
        char q = dq ? '"' : '\'';
        sb_add(b, &q, 1);
        for (size_t i = 0; i < v->u.s.n; i++) {
            char ch = v->u.s.s[i];
            if (ch == '\\' || ch == q) {
                sb_add(b, "\\", 1);
                sb_add(b, &ch, 1);
            } else if (ch == '\n') {
                sb_str(b, "\\n");
            } else if (ch == '\t') {
                sb_str(b, "\\t");
            } else if (ch == '\r') {
                sb_str(b, "\\r");
            } else {
                sb_add(b, &ch, 1);
            }
        }
        sb_add(b, &q, 1);
    } else if (v->t == V_LIST) {
        sb_str(b, v->tuple ? "(" : "[");
        for (int i = 0; i < v->u.l.n; i++) {
            if (i)
                sb_str(b, ", ");
            repr_into(c, b, v->u.l.a[i]);
        }
        sb_str(b, v->tuple ? (v->u.l.n == 1 ? ",)" : ")") : "]");
    } else if (v->t == V_DICT) {
        if (v->ns)
            sb_str(b, "<Namespace ");
        sb_str(b, "{");
        for (int i = 0; i < v->u.d.n; i++) {
            if (i)
                sb_str(b, ", ");
            val k = {.t = V_STR, .u.s = {v->u.d.k[i], strlen(v->u.d.k[i])}};
            repr_into(c, b, &k);
            sb_str(b, ": ");
            repr_into(c, b, v->u.d.v[i]);
        }
        sb_str(b, "}");
        if (v->ns)
            sb_str(b, ">");
    } else if (v->t == V_FUNC) {
        sb_str(b, "<function ");
        sb_str(b, v->u.fn.name != NULL ? v->u.fn.name : "?");
        sb_str(b, ">");
    } else {
        str_into(c, b, v);
    }
}

static val *to_str(rctx *c, const val *v)
{
    if (v->t == V_STR)
        return (val *)v;
    sbuf b = {.c = c};
    str_into(c, &b, v);
    return sb_val(&b);
}

/* json.dumps's options: indent (< 0: none), separators, sort_keys */
typedef struct {
    int indent;
    const char *item_sep, *key_sep;
    int sort_keys;
} json_opts;

/* json.dumps(v, ensure_ascii=False, ...) */
static void json_into(rctx *c, sbuf *b, const val *v, const json_opts *o, int level)
{
    const int indent = o->indent;
    if (level > MAX_DEPTH)
        rerr(c, "tojson: a value nested deeper than %d (one that holds itself?)", MAX_DEPTH);
    char num[64];
    switch (v->t) {
    case V_UNDEF: case V_NONE: sb_str(b, "null"); return;
    case V_BOOL: sb_str(b, v->u.b ? "true" : "false"); return;
    case V_INT: snprintf(num, sizeof(num), "%lld", v->u.i); sb_str(b, num); return;
    case V_FLOAT:
        float_text(v->u.f, num, sizeof(num));
        sb_str(b, strcmp(num, "nan") == 0 ? "NaN" : strcmp(num, "inf") == 0 ? "Infinity"
                  : strcmp(num, "-inf") == 0 ? "-Infinity" : num);
        return;
    case V_STR:
        sb_add(b, "\"", 1);
        for (size_t i = 0; i < v->u.s.n; i++) {
            unsigned char ch = (unsigned char)v->u.s.s[i];
            switch (ch) {
            case '"': sb_str(b, "\\\""); break;
            case '\\': sb_str(b, "\\\\"); break;
            case '\n': sb_str(b, "\\n"); break;
            case '\r': sb_str(b, "\\r"); break;
            case '\t': sb_str(b, "\\t"); break;
            case '\b': sb_str(b, "\\b"); break;
            case '\f': sb_str(b, "\\f"); break;
            default:
                if (ch < 0x20) {
                    snprintf(num, sizeof(num), "\\u%04x", ch);
                    sb_str(b, num);
                } else {
                    sb_add(b, (const char *)&ch, 1);
                }
            }
        }
        sb_add(b, "\"", 1);
        return;
    case V_FUNC: rerr(c, "tojson: a function is not JSON");
    default: break;
    }
    int list = v->t == V_LIST, n = list ? v->u.l.n : v->u.d.n;
    sb_str(b, list ? "[" : "{");
    if (n == 0) {
        sb_str(b, list ? "]" : "}");
        return;
    }
    int *order = aalloc(&c->a, (size_t)n * sizeof(int));
    for (int i = 0; i < n; i++)
        order[i] = i;
    for (int i = 1; !list && o->sort_keys && i < n; i++)   /* sort_keys: insertion sort by key */
        for (int j = i; j > 0 && strcmp(v->u.d.k[order[j - 1]], v->u.d.k[order[j]]) > 0; j--) {
            int t = order[j - 1];
            order[j - 1] = order[j];
            order[j] = t;
        }
    for (int x = 0; x < n; x++) {
        int i = order[x];
        if (x)
            sb_str(b, o->item_sep);
        if (indent >= 0) {
            sb_str(b, "\n");
            for (int s = 0; s < indent * (level + 1); s++)
                sb_add(b, " ", 1);
        }
        if (!list) {
            val k = {.t = V_STR, .u.s = {v->u.d.k[i], strlen(v->u.d.k[i])}};
            json_into(c, b, &k, o, level + 1);
            sb_str(b, o->key_sep);
        }
        json_into(c, b, list ? v->u.l.a[i] : v->u.d.v[i], o, level + 1);
    }
    if (indent >= 0) {
        sb_str(b, "\n");
        for (int s = 0; s < indent * level; s++)
            sb_add(b, " ", 1);
    }
    sb_str(b, list ? "]" : "}");
}

static int is_num(const val *v)
{
    return v->t == V_INT || v->t == V_FLOAT || v->t == V_BOOL;
}

static double num(const val *v)
{
    return v->t == V_FLOAT ? v->u.f : v->t == V_INT ? (double)v->u.i : (double)v->u.b;
}

static int equal_at(const val *a, const val *b, int depth);

static int equal(const val *a, const val *b)
{
    return equal_at(a, b, 0);
}

/* (a value that holds itself compares unequal past MAX_DEPTH instead of recursing on) */
static int equal_at(const val *a, const val *b, int depth)
{
    if (depth > MAX_DEPTH)
        return a == b;
    if (is_num(a) && is_num(b))
        return num(a) == num(b);
    if ((a->t == V_NONE || a->t == V_UNDEF) && (b->t == V_NONE || b->t == V_UNDEF))
        return a->t == b->t;
    if (a->t != b->t)
        return 0;
    switch (a->t) {
    case V_STR: return a->u.s.n == b->u.s.n && memcmp(a->u.s.s, b->u.s.s, a->u.s.n) == 0;
    case V_LIST:
        if (a->u.l.n != b->u.l.n)
            return 0;
        for (int i = 0; i < a->u.l.n; i++)
            if (!equal_at(a->u.l.a[i], b->u.l.a[i], depth + 1))
                return 0;
        return 1;
    case V_DICT:
        if (a->u.d.n != b->u.d.n)
            return 0;
        for (int i = 0; i < a->u.d.n; i++) {
            const val *o = dict_get(b, a->u.d.k[i], strlen(a->u.d.k[i]));
            if (o == NULL || !equal_at(a->u.d.v[i], o, depth + 1))
                return 0;
        }
        return 1;
    default: return a == b;
    }
}

/* <0, 0, >0; strings and numbers only */
static int compare(rctx *c, const val *a, const val *b, const char *op)
{
    if (is_num(a) && is_num(b))
        return num(a) < num(b) ? -1 : num(a) > num(b);
    if (a->t == V_STR && b->t == V_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int r = memcmp(a->u.s.s, b->u.s.s, n);
        return r != 0 ? r : (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
    }
    rerr(c, "'%s' not supported between %s and %s", op, type_name(a), type_name(b));
}

static int contains(rctx *c, const val *hay, const val *x)
{
    if (hay->t == V_STR) {
        if (x->t != V_STR)
            rerr(c, "'in <string>' needs a string on the left, not %s", type_name(x));
        if (x->u.s.n == 0)
            return 1;
        for (size_t i = 0; i + x->u.s.n <= hay->u.s.n; i++)
            if (memcmp(hay->u.s.s + i, x->u.s.s, x->u.s.n) == 0)
                return 1;
        return 0;
    }
    if (hay->t == V_LIST) {
        for (int i = 0; i < hay->u.l.n; i++)
            if (equal(hay->u.l.a[i], x))
                return 1;
        return 0;
    }
    if (hay->t == V_DICT)
        return x->t == V_STR && dict_get(hay, x->u.s.s, x->u.s.n) != NULL;
    if (hay->t == V_UNDEF)
        rerr(c, "'in' an undefined value");
    rerr(c, "argument of type %s is not iterable", type_name(hay));
}

/* ---------------------------------------------------------------------------------------------
 * Scopes */

static val *lookup(rctx *c, const char *k)
{
    for (frame *f = c->top; f != NULL; f = f->up) {
        val *v = dict_get(&f->vars, k, strlen(k));
        if (v != NULL)
            return v;
    }
    return NULL;
}

/* k (borrowed: a name from the parse or an arena copy) bound in the innermost scope */
static void bind(rctx *c, const char *k, val *v)
{
    dict_put(c, &c->top->vars, k, v, 0);
}

static void push_frame(rctx *c)
{
    frame *f = aalloc(&c->a, sizeof(frame));
    f->vars.t = V_DICT;
    f->up = c->top;
    c->top = f;
}

/* ---------------------------------------------------------------------------------------------
 * Evaluation */

static val *eval(rctx *c, const node *x);
static void exec_body(rctx *c, const node *b);

typedef struct {
    val **a;
    int n;
    char **kn;
    val **kv;
    int nk;
} argv_t;

/* children from `from` on as arguments */
static argv_t eval_args(rctx *c, const node *x, int from)
{
    argv_t a = {0};
    int n = x->nc - from;
    a.a = aalloc(&c->a, (size_t)(n > 0 ? n : 1) * sizeof(val *));
    a.kn = aalloc(&c->a, (size_t)(n > 0 ? n : 1) * sizeof(char *));
    a.kv = aalloc(&c->a, (size_t)(n > 0 ? n : 1) * sizeof(val *));
    for (int i = from; i < x->nc; i++) {
        if (x->c[i]->k == E_KWARG) {
            a.kn[a.nk] = (char *)x->c[i]->s;
            a.kv[a.nk++] = eval(c, x->c[i]->c[0]);
        } else {
            a.a[a.n++] = eval(c, x->c[i]);
        }
    }
    return a;
}

/* argument i (positional), else the keyword name, else NULL */
static val *arg(val **args, int n, char **kn, val **kv, int nk, int i, const char *name)
{
    if (i >= 0 && i < n)
        return args[i];
    for (int k = 0; name != NULL && k < nk; k++)
        if (strcmp(kn[k], name) == 0)
            return kv[k];
    return NULL;
}

static val *need_str(rctx *c, val *v, const char *what)
{
    if (v == NULL || v->t != V_STR)
        rerr(c, "%s: expected a string, got %s", what, v != NULL ? type_name(v) : "nothing");
    return v;
}

static long long need_int(rctx *c, val *v, const char *what)
{
    if (v == NULL || (v->t != V_INT && v->t != V_BOOL))
        rerr(c, "%s: expected an integer, got %s", what, v != NULL ? type_name(v) : "nothing");
    return v->t == V_INT ? v->u.i : v->u.b;
}

static int is_space(char ch, const val *chars)
{
    if (chars == NULL || chars->t == V_NONE)
        return isspace((unsigned char)ch);
    return memchr(chars->u.s.s, ch, chars->u.s.n) != NULL;
}

static val *strip(rctx *c, val *s, val *chars, int left, int right)
{
    need_str(c, s, "strip");
    if (chars != NULL && chars->t != V_NONE)
        need_str(c, chars, "strip's characters");
    size_t a = 0, b = s->u.s.n;
    while (left && a < b && is_space(s->u.s.s[a], chars))
        a++;
    while (right && b > a && is_space(s->u.s.s[b - 1], chars))
        b--;
    return mkstr(&c->a, s->u.s.s + a, b - a);
}

static val *split(rctx *c, val *s, val *sep, long long max)
{
    val *l = vlist(c);
    const char *p = s->u.s.s, *e = s->u.s.s + s->u.s.n;
    if (sep == NULL || sep->t == V_NONE) {
        while (p < e) {
            while (p < e && isspace((unsigned char)*p))
                p++;
            if (p >= e)
                break;
            const char *q = p;
            if (max >= 0 && l->u.l.n == max) {
                const char *t = e;
                while (t > p && isspace((unsigned char)t[-1]))
                    t--;
                list_add(c, l, mkstr(&c->a, p, (size_t)(t - p)));
                break;
            }
            while (q < e && !isspace((unsigned char)*q))
                q++;
            list_add(c, l, mkstr(&c->a, p, (size_t)(q - p)));
            p = q;
        }
        return l;
    }
    need_str(c, sep, "split's separator");
    if (sep->u.s.n == 0)
        rerr(c, "split: an empty separator");
    for (;;) {
        const char *q = NULL;
        if (max < 0 || l->u.l.n < max)
            for (const char *t = p; t + sep->u.s.n <= e; t++)
                if (memcmp(t, sep->u.s.s, sep->u.s.n) == 0) {
                    q = t;
                    break;
                }
        if (q == NULL) {
            list_add(c, l, mkstr(&c->a, p, (size_t)(e - p)));
            return l;
        }
        list_add(c, l, mkstr(&c->a, p, (size_t)(q - p)));
        p = q + sep->u.s.n;
    }
}

static val *replace(rctx *c, val *s, val *a, val *b, long long count)
{
    need_str(c, s, "replace");
    need_str(c, a, "replace's old");
    b = to_str(c, b);
    sbuf o = {.c = c};
    const char *p = s->u.s.s, *e = s->u.s.s + s->u.s.n;
    long long done = 0;
    while (p <= e) {
        const char *q = NULL;
        if (count < 0 || done < count) {
            if (a->u.s.n == 0)
                q = p;
            else
                for (const char *t = p; t + a->u.s.n <= e; t++)
                    if (memcmp(t, a->u.s.s, a->u.s.n) == 0) {
                        q = t;
                        break;
                    }
        }
        if (q == NULL) {
            sb_add(&o, p, (size_t)(e - p));
            break;
        }
        sb_add(&o, p, (size_t)(q - p));
        sb_add(&o, b->u.s.s, b->u.s.n);
        done++;
        if (a->u.s.n == 0) {
            if (q >= e)
                break;
            sb_add(&o, q, 1);
            p = q + 1;
        } else {
            p = q + a->u.s.n;
        }
    }
    return sb_val(&o);
}

static int prefix_of(const val *s, const val *p, int suffix)
{
    if (p->u.s.n > s->u.s.n)
        return 0;
    return memcmp(suffix ? s->u.s.s + s->u.s.n - p->u.s.n : s->u.s.s, p->u.s.s, p->u.s.n) == 0;
}

static val *case_map(rctx *c, val *s, int mode)
{
    need_str(c, s, "case");
    char *d = astrndup(&c->a, s->u.s.s, s->u.s.n);
    int start = 1;
    for (size_t i = 0; i < s->u.s.n; i++) {
        unsigned char ch = (unsigned char)d[i];
        if (mode == 0)
            d[i] = (char)tolower(ch);
        else if (mode == 1)
            d[i] = (char)toupper(ch);
        else if (mode == 2)   /* title */
            d[i] = (char)(start ? toupper(ch) : tolower(ch));
        else                  /* capitalize */
            d[i] = (char)(i == 0 ? toupper(ch) : tolower(ch));
        start = !isalpha(ch);
    }
    val *v = mkval(&c->a, V_STR);
    v->u.s.s = d;
    v->u.s.n = s->u.s.n;
    return v;
}

static val *items_of(rctx *c, const val *d)
{
    val *l = vlist(c);
    for (int i = 0; i < d->u.d.n; i++) {
        val *t = vlist(c);
        t->tuple = 1;
        list_add(c, t, mkstr(&c->a, d->u.d.k[i], strlen(d->u.d.k[i])));
        list_add(c, t, d->u.d.v[i]);
        list_add(c, l, t);
    }
    return l;
}

/* a list of v's items (for loops, list filter): lists, strings (characters), dicts (keys) */
static val *iter_list(rctx *c, val *v, const char *what)
{
    if (v->t == V_LIST)
        return v;
    val *l = vlist(c);
    if (v->t == V_STR) {
        for (size_t i = 0; i < v->u.s.n;) {   /* UTF-8 characters */
            size_t n = 1;
            unsigned char ch = (unsigned char)v->u.s.s[i];
            if (ch >= 0xf0) n = 4; else if (ch >= 0xe0) n = 3; else if (ch >= 0xc0) n = 2;
            if (i + n > v->u.s.n)
                n = v->u.s.n - i;
            list_add(c, l, mkstr(&c->a, v->u.s.s + i, n));
            i += n;
        }
        return l;
    }
    if (v->t == V_DICT) {
        for (int i = 0; i < v->u.d.n; i++)
            list_add(c, l, mkstr(&c->a, v->u.d.k[i], strlen(v->u.d.k[i])));
        return l;
    }
    if (v->t == V_UNDEF || v->t == V_NONE)
        rerr(c, "%s: %s is not iterable", what, type_name(v));
    rerr(c, "%s: %s is not iterable", what, type_name(v));
}

static val *brace_format(rctx *c, val *fmt, val **a, int n, char **kn, val **kv, int nk);

/* methods of strings, dicts and lists (the ones chat templates call) */
static val *call_method(rctx *c, val *self, const char *m, val **a, int n, char **kn, val **kv, int nk)
{
    if (self->t == V_STR) {
        if (strcmp(m, "strip") == 0 || strcmp(m, "lstrip") == 0 || strcmp(m, "rstrip") == 0)
            return strip(c, self, n > 0 ? a[0] : NULL, m[0] != 'r', m[0] != 'l');
        if (strcmp(m, "split") == 0 || strcmp(m, "rsplit") == 0) {
            val *mx = arg(a, n, kn, kv, nk, 1, "maxsplit");
            long long max = mx != NULL ? need_int(c, mx, "split's maxsplit") : -1;
            if (m[0] == 'r' && max >= 0)
                rerr(c, "rsplit with maxsplit is not supported");
            return split(c, self, arg(a, n, kn, kv, nk, 0, "sep"), max);
        }
        if (strcmp(m, "startswith") == 0 || strcmp(m, "endswith") == 0) {
            val *p = n > 0 ? a[0] : NULL;
            int suffix = m[0] == 'e';
            if (p != NULL && p->t == V_LIST) {
                for (int i = 0; i < p->u.l.n; i++)
                    if (prefix_of(self, need_str(c, p->u.l.a[i], m), suffix))
                        return &V_TRUE_;
                return &V_FALSE_;
            }
            return vbool(prefix_of(self, need_str(c, p, m), suffix));
        }
        if (strcmp(m, "lower") == 0) return case_map(c, self, 0);
        if (strcmp(m, "upper") == 0) return case_map(c, self, 1);
        if (strcmp(m, "title") == 0) return case_map(c, self, 2);
        if (strcmp(m, "capitalize") == 0) return case_map(c, self, 3);
        if (strcmp(m, "replace") == 0)
            return replace(c, self, n > 0 ? a[0] : NULL, n > 1 ? a[1] : &V_NONE_,
                           n > 2 ? need_int(c, a[2], "replace's count") : -1);
        if (strcmp(m, "find") == 0 || strcmp(m, "count") == 0 || strcmp(m, "index") == 0) {
            val *s = need_str(c, n > 0 ? a[0] : NULL, m);
            long long cnt = 0;
            for (size_t i = 0; i + s->u.s.n <= self->u.s.n; i++)
                if (memcmp(self->u.s.s + i, s->u.s.s, s->u.s.n) == 0) {
                    if (m[0] != 'c')
                        return vint(c, (long long)i);
                    cnt++;
                    if (s->u.s.n > 0)
                        i += s->u.s.n - 1;
                }
            if (m[0] == 'i')
                rerr(c, "index: substring not found");
            return vint(c, m[0] == 'c' ? cnt : -1);
        }
        if (strcmp(m, "join") == 0) {
            val *l = iter_list(c, n > 0 ? a[0] : &V_UNDEF_, "join");
            sbuf o = {.c = c};
            for (int i = 0; i < l->u.l.n; i++) {
                if (i)
                    sb_add(&o, self->u.s.s, self->u.s.n);
                val *e = need_str(c, l->u.l.a[i], "join's items");
                sb_add(&o, e->u.s.s, e->u.s.n);
            }
            return sb_val(&o);
        }
        if (strcmp(m, "format") == 0)
            return brace_format(c, self, a, n, kn, kv, nk);
        if (strcmp(m, "splitlines") == 0) {
            val *l = vlist(c);
            size_t s0 = 0;
            for (size_t i = 0; i < self->u.s.n; i++)
                if (self->u.s.s[i] == '\n') {
                    size_t e = i > s0 && self->u.s.s[i - 1] == '\r' ? i - 1 : i;
                    list_add(c, l, mkstr(&c->a, self->u.s.s + s0, e - s0));
                    s0 = i + 1;
                }
            if (s0 < self->u.s.n)
                list_add(c, l, mkstr(&c->a, self->u.s.s + s0, self->u.s.n - s0));
            return l;
        }
        if (strcmp(m, "isdigit") == 0 || strcmp(m, "isspace") == 0 || strcmp(m, "isalpha") == 0) {
            int ok = self->u.s.n > 0;
            for (size_t i = 0; i < self->u.s.n && ok; i++) {
                unsigned char ch = (unsigned char)self->u.s.s[i];
                ok = m[2] == 'd' ? isdigit(ch) != 0 : m[2] == 's' ? isspace(ch) != 0 : isalpha(ch) != 0;
            }
            return vbool(ok);
        }
    } else if (self->t == V_DICT) {
        if (strcmp(m, "items") == 0)
            return items_of(c, self);
        if (strcmp(m, "keys") == 0 || strcmp(m, "values") == 0) {
            val *l = vlist(c);
            for (int i = 0; i < self->u.d.n; i++)
                list_add(c, l, m[0] == 'k' ? mkstr(&c->a, self->u.d.k[i], strlen(self->u.d.k[i])) : self->u.d.v[i]);
            return l;
        }
        if (strcmp(m, "get") == 0) {
            val *k = n > 0 ? a[0] : NULL;
            val *r = k != NULL && k->t == V_STR ? dict_get(self, k->u.s.s, k->u.s.n) : NULL;
            return r != NULL ? r : n > 1 ? a[1] : &V_NONE_;
        }
    } else if (self->t == V_LIST && strcmp(m, "index") == 0 && n > 0) {
        for (int i = 0; i < self->u.l.n; i++)
            if (equal(self->u.l.a[i], a[0]))
                return vint(c, i);
        rerr(c, "index: the value is not in the list");
    }
    rerr(c, "%s has no method '%s' here", type_name(self), m);
}

/* the methods a value of type t has here (attribute access binds them) */
static int has_method(vtype t, const char *name)
{
    static const char *const str_m[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith",
                                        "lower", "upper", "title", "capitalize", "replace", "find", "count",
                                        "index", "join", "splitlines", "isdigit", "isspace", "isalpha", "format",
                                        NULL};
    static const char *const dict_m[] = {"items", "keys", "values", "get", NULL};
    static const char *const list_m[] = {"index", NULL};
    const char *const *m = t == V_STR ? str_m : t == V_DICT ? dict_m : t == V_LIST ? list_m : NULL;
    for (int i = 0; m != NULL && m[i] != NULL; i++)
        if (strcmp(m[i], name) == 0)
            return 1;
    return 0;
}

/* attribute access: as jinja2's getattr, a Python attribute first (a string's or dict's method,
 * bound), then a dict's member; else undefined */
static val *get_attr(rctx *c, val *o, const char *name)
{
    if (has_method(o->t, name) && !o->ns) {
        val *f = mkval(&c->a, V_FUNC);
        f->u.fn.self = o;
        f->u.fn.name = name;
        return f;
    }
    if (o->t == V_DICT) {
        val *v = dict_get(o, name, strlen(name));
        if (v != NULL)
            return v;
    }
    return &V_UNDEF_;
}

static val *get_item(rctx *c, val *o, val *k)
{
    if (o->t == V_DICT) {
        if (k->t != V_STR)
            return &V_UNDEF_;
        val *v = dict_get(o, k->u.s.s, k->u.s.n);
        return v != NULL ? v : &V_UNDEF_;
    }
    if (o->t == V_LIST || o->t == V_STR) {
        if (k->t != V_INT)
            rerr(c, "%s indices must be integers, not %s", type_name(o), type_name(k));
        long long n = o->t == V_LIST ? o->u.l.n : (long long)o->u.s.n, i = k->u.i < 0 ? k->u.i + n : k->u.i;
        if (i < 0 || i >= n)
            return &V_UNDEF_;
        return o->t == V_LIST ? o->u.l.a[i] : mkstr(&c->a, o->u.s.s + i, 1);
    }
    if (o->t == V_UNDEF)
        rerr(c, "an item of an undefined value");
    rerr(c, "%s is not subscriptable", type_name(o));
}

static val *slice(rctx *c, val *o, val *va, val *vb, val *vs)
{
    if (o->t != V_LIST && o->t != V_STR)
        rerr(c, "%s cannot be sliced", type_name(o));
    long long n = o->t == V_LIST ? o->u.l.n : (long long)o->u.s.n;
    long long step = vs != NULL && vs->t != V_NONE ? need_int(c, vs, "slice step") : 1;
    if (step == 0)
        rerr(c, "slice step cannot be zero");
    long long a, b;
    long long lo = step > 0 ? 0 : -1, hi = step > 0 ? n : n - 1;
    if (va == NULL || va->t == V_NONE) {
        a = step > 0 ? 0 : n - 1;
    } else {
        a = need_int(c, va, "slice start");
        a = a < 0 ? (a + n < lo ? lo : a + n) : (a > hi ? hi : a);
    }
    if (vb == NULL || vb->t == V_NONE) {
        b = step > 0 ? n : -1;
    } else {
        b = need_int(c, vb, "slice end");
        b = b < 0 ? (b + n < lo ? lo : b + n) : (b > hi ? hi : b);
    }
    if (o->t == V_LIST) {
        val *l = vlist(c);
        for (long long i = a; step > 0 ? i < b : i > b; i += step)
            list_add(c, l, o->u.l.a[i]);
        return l;
    }
    sbuf s = {.c = c};
    for (long long i = a; step > 0 ? i < b : i > b; i += step)
        sb_add(&s, o->u.s.s + i, 1);
    return sb_val(&s);
}

static val *call_value(rctx *c, val *f, val **a, int n, char **kn, val **kv, int nk);
static val *apply_filter(rctx *c, const char *name, val *x, val **a, int n, char **kn, val **kv, int nk);
static int apply_test(rctx *c, const char *name, val *x, val **a, int n);

/* Python's "fmt" % args: %s %r %d %i %f (with a precision) %x %%; args a tuple or one value */
static val *percent_format(rctx *c, val *fmt, val *args)
{
    int n = args->t == V_LIST && args->tuple ? args->u.l.n : 1, k = 0;
    sbuf b = {.c = c};
    for (size_t i = 0; i < fmt->u.s.n; i++) {
        char ch = fmt->u.s.s[i];
        if (ch != '%') {
            sb_add(&b, &ch, 1);
            continue;
        }
        size_t j = i + 1;
        int prec = -1;
        if (j < fmt->u.s.n && fmt->u.s.s[j] == '.') {
            prec = 0;
            for (j++; j < fmt->u.s.n && isdigit((unsigned char)fmt->u.s.s[j]); j++)
                prec = prec * 10 + (fmt->u.s.s[j] - '0');
        }
        if (j >= fmt->u.s.n)
            rerr(c, "%% format: incomplete format");
        char conv = fmt->u.s.s[j];
        i = j;
        if (conv == '%') {
            sb_add(&b, "%", 1);
            continue;
        }
        if (k >= n)
            rerr(c, "%% format: not enough arguments for format string");
        val *a = args->t == V_LIST && args->tuple ? args->u.l.a[k] : args;
        k++;
        char nb[64];
        if (conv == 's') {
            str_into(c, &b, a);
        } else if (conv == 'r') {
            repr_into(c, &b, a);
        } else if (conv == 'd' || conv == 'i' || conv == 'x') {
            if (!is_num(a))
                rerr(c, "%%%c format: a number is required, not %s", conv, type_name(a));
            snprintf(nb, sizeof(nb), conv == 'x' ? "%llx" : "%lld", (long long)num(a));
            sb_str(&b, nb);
        } else if (conv == 'f') {
            if (!is_num(a))
                rerr(c, "%%f format: a number is required, not %s", type_name(a));
            snprintf(nb, sizeof(nb), "%.*f", prec < 0 ? 6 : prec, num(a));
            sb_str(&b, nb);
        } else {
            rerr(c, "%% format: unsupported format character '%c'", conv);
        }
    }
    if (k < n)
        rerr(c, "%% format: not all arguments converted during string formatting");
    return sb_val(&b);
}

/* Python's str.format: {} / {N} / {name} fields (no format specs), {{ and }} */
static val *brace_format(rctx *c, val *fmt, val **a, int n, char **kn, val **kv, int nk)
{
    sbuf b = {.c = c};
    int next = 0;
    for (size_t i = 0; i < fmt->u.s.n; i++) {
        char ch = fmt->u.s.s[i];
        if ((ch == '{' || ch == '}') && i + 1 < fmt->u.s.n && fmt->u.s.s[i + 1] == ch) {
            sb_add(&b, &ch, 1);
            i++;
            continue;
        }
        if (ch != '{') {
            sb_add(&b, &ch, 1);
            continue;
        }
        const char *e = memchr(fmt->u.s.s + i, '}', fmt->u.s.n - i);
        if (e == NULL)
            rerr(c, "format: a '{' without its '}'");
        size_t fl = (size_t)(e - (fmt->u.s.s + i)) - 1;
        const char *f = fmt->u.s.s + i + 1;
        val *v = NULL;
        if (fl == 0) {
            v = next < n ? a[next++] : NULL;
        } else if (isdigit((unsigned char)f[0])) {
            long idx = strtol(f, NULL, 10);
            v = idx < n ? a[idx] : NULL;
        } else {
            char *name = astrndup(&c->a, f, fl);
            v = arg(a, 0, kn, kv, nk, -1, name);
        }
        if (v == NULL)
            rerr(c, "format: no value for the field '{%.*s}'", (int)fl, f);
        str_into(c, &b, v);
        i = (size_t)(e - fmt->u.s.s);
    }
    return sb_val(&b);
}

static val *arith(rctx *c, const char *op, val *l, val *r)
{
    if (strcmp(op, "~") == 0) {
        sbuf b = {.c = c};
        str_into(c, &b, l);
        str_into(c, &b, r);
        return sb_val(&b);
    }
    if (op[0] == '+' && l->t == V_STR && r->t == V_STR) {
        sbuf b = {.c = c};
        sb_add(&b, l->u.s.s, l->u.s.n);
        sb_add(&b, r->u.s.s, r->u.s.n);
        return sb_val(&b);
    }
    if (op[0] == '+' && l->t == V_LIST && r->t == V_LIST) {
        val *o = vlist(c);
        for (int i = 0; i < l->u.l.n; i++)
            list_add(c, o, l->u.l.a[i]);
        for (int i = 0; i < r->u.l.n; i++)
            list_add(c, o, r->u.l.a[i]);
        return o;
    }
    if (op[0] == '*' && op[1] == '\0' && ((l->t == V_STR && r->t == V_INT) || (l->t == V_INT && r->t == V_STR))) {
        val *s = l->t == V_STR ? l : r;
        long long k = l->t == V_INT ? l->u.i : r->u.i;
        sbuf b = {.c = c};
        for (long long i = 0; i < k && i < 1000000; i++)
            sb_add(&b, s->u.s.s, s->u.s.n);
        return sb_val(&b);
    }
    if (op[0] == '%' && l->t == V_STR)
        return percent_format(c, l, r);
    if (!is_num(l) || !is_num(r))
        rerr(c, "unsupported operand types for %s: %s and %s", op, type_name(l), type_name(r));
    int ints = l->t != V_FLOAT && r->t != V_FLOAT;
    long long li = l->t == V_INT ? l->u.i : l->t == V_BOOL ? l->u.b : 0;
    long long ri = r->t == V_INT ? r->u.i : r->t == V_BOOL ? r->u.b : 0;
    double lf = num(l), rf = num(r);
    long long res;   /* integers past 64 bits become floats (Python's are unbounded) */
    switch (op[0]) {
    case '+': return ints && !__builtin_add_overflow(li, ri, &res) ? vint(c, res) : vfloat(c, lf + rf);
    case '-': return ints && !__builtin_sub_overflow(li, ri, &res) ? vint(c, res) : vfloat(c, lf - rf);
    case '*':
        if (op[1] == '*') {
            double p = pow(lf, rf);
            return ints && ri >= 0 && fabs(p) < 9.2e18 ? vint(c, (long long)p) : vfloat(c, p);
        }
        return ints && !__builtin_mul_overflow(li, ri, &res) ? vint(c, res) : vfloat(c, lf * rf);
    case '/':
        if (rf == 0)
            rerr(c, "division by zero");
        if (op[1] == '/') {
            if (ints) {
                if (li == LLONG_MIN && ri == -1)
                    return vfloat(c, -(double)LLONG_MIN);
                long long q = li / ri;
                if ((li % ri != 0) && ((li < 0) != (ri < 0)))
                    q--;
                return vint(c, q);
            }
            return vfloat(c, floor(lf / rf));
        }
        return vfloat(c, lf / rf);
    case '%':
        if (rf == 0)
            rerr(c, "modulo by zero");
        if (ints) {
            if (ri == -1)
                return vint(c, 0);
            long long m = li % ri;
            if (m != 0 && ((m < 0) != (ri < 0)))
                m += ri;
            return vint(c, m);
        }
        return vfloat(c, lf - rf * floor(lf / rf));
    default: rerr(c, "unknown operator %s", op);
    }
}

static void assign(rctx *c, const node *target, val *v)
{
    if (target->k == E_NAME) {
        bind(c, target->s, v);
    } else if (target->k == E_ATTR) {
        val *o = eval(c, target->c[0]);
        if (o->t != V_DICT || !o->ns)
            rerr(c, "line %d: only a namespace's attributes can be set", target->line);
        dict_set(c, o, target->s, v);
    } else if (target->k == E_TUPLE) {
        val *l = iter_list(c, v, "unpacking");
        if (l->u.l.n != target->nc)
            rerr(c, "line %d: cannot unpack %d values into %d names", target->line, l->u.l.n, target->nc);
        for (int i = 0; i < target->nc; i++)
            assign(c, target->c[i], l->u.l.a[i]);
    } else {
        rerr(c, "line %d: cannot assign to that", target->line);
    }
}

static val *eval(rctx *c, const node *x)
{
    if (++c->steps > MAX_STEPS)
        rerr(c, "the template takes too many steps");
    switch (x->k) {
    case E_LIT: return x->v;
    case E_NAME: {
        val *v = lookup(c, x->s);
        return v != NULL ? v : &V_UNDEF_;
    }
    case E_ATTR: {
        val *o = eval(c, x->c[0]);
        if (o->t == V_UNDEF || o->t == V_NONE)
            rerr(c, "line %d: '%s' of %s", x->line, x->s, o->t == V_NONE ? "None" : "an undefined value");
        return get_attr(c, o, x->s);
    }
    case E_ITEM: return get_item(c, eval(c, x->c[0]), eval(c, x->c[1]));
    case E_SLICE:
        return slice(c, eval(c, x->c[0]), x->c[1] ? eval(c, x->c[1]) : NULL, x->c[2] ? eval(c, x->c[2]) : NULL,
                     x->c[3] ? eval(c, x->c[3]) : NULL);
    case E_CALL: {
        val *f = eval(c, x->c[0]);
        argv_t a = eval_args(c, x, 1);
        if (f->t != V_FUNC && x->c[0]->k == E_ATTR)
            rerr(c, "line %d: %s has no method '%s' here", x->line, type_name(eval(c, x->c[0]->c[0])), x->c[0]->s);
        if (f->t != V_FUNC)
            rerr(c, "line %d: %s is not callable", x->line, x->c[0]->k == E_NAME ? x->c[0]->s : type_name(f));
        return call_value(c, f, a.a, a.n, a.kn, a.kv, a.nk);
    }
    case E_FILTER: {
        val *o = eval(c, x->c[0]);
        argv_t a = eval_args(c, x, 1);
        return apply_filter(c, x->s, o, a.a, a.n, a.kn, a.kv, a.nk);
    }
    case E_TEST: {
        val *o;
        if (x->c[0]->k == E_NAME) {   /* an undefined name is a value here (is defined) */
            o = lookup(c, x->c[0]->s);
            o = o != NULL ? o : &V_UNDEF_;
        } else if (x->c[0]->k == E_ATTR) {
            val *p = eval(c, x->c[0]->c[0]);
            o = p->t == V_UNDEF || p->t == V_NONE ? &V_UNDEF_ : get_attr(c, p, x->c[0]->s);
        } else if (x->c[0]->k == E_ITEM) {
            val *p = eval(c, x->c[0]->c[0]);
            o = p->t == V_UNDEF ? &V_UNDEF_ : get_item(c, p, eval(c, x->c[0]->c[1]));
        } else {
            o = eval(c, x->c[0]);
        }
        argv_t a = eval_args(c, x, 1);
        int r = apply_test(c, x->s, o, a.a, a.n);
        return vbool(x->neg ? !r : r);
    }
    case E_BIN: {
        val *l = eval(c, x->c[0]), *r = eval(c, x->c[1]);
        const char *op = x->s;
        if (strcmp(op, "==") == 0) return vbool(equal(l, r));
        if (strcmp(op, "!=") == 0) return vbool(!equal(l, r));
        if (strcmp(op, "in") == 0) return vbool(contains(c, r, l) != x->neg);
        if (strcmp(op, "<") == 0) return vbool(compare(c, l, r, op) < 0);
        if (strcmp(op, ">") == 0) return vbool(compare(c, l, r, op) > 0);
        if (strcmp(op, "<=") == 0) return vbool(compare(c, l, r, op) <= 0);
        if (strcmp(op, ">=") == 0) return vbool(compare(c, l, r, op) >= 0);
        return arith(c, op, l, r);
    }
    case E_NEG: case E_POS: {
        val *v = eval(c, x->c[0]);
        if (!is_num(v))
            rerr(c, "line %d: bad operand type for unary %c: %s", x->line, x->k == E_NEG ? '-' : '+', type_name(v));
        if (x->k == E_POS)
            return v;
        if (v->t == V_FLOAT || (v->t == V_INT && v->u.i == LLONG_MIN))
            return vfloat(c, -num(v));
        return vint(c, -(v->t == V_INT ? v->u.i : v->u.b));
    }
    case E_NOT: return vbool(!truthy(eval(c, x->c[0])));
    case E_AND: {
        val *l = eval(c, x->c[0]);
        return truthy(l) ? eval(c, x->c[1]) : l;
    }
    case E_OR: {
        val *l = eval(c, x->c[0]);
        return truthy(l) ? l : eval(c, x->c[1]);
    }
    case E_COND:
        if (truthy(eval(c, x->c[1])))
            return eval(c, x->c[0]);
        return x->c[2] != NULL ? eval(c, x->c[2]) : &V_UNDEF_;
    case E_LIST: case E_TUPLE: {
        val *l = vlist(c);
        l->tuple = x->k == E_TUPLE;
        for (int i = 0; i < x->nc; i++)
            list_add(c, l, eval(c, x->c[i]));
        return l;
    }
    case E_DICT: {
        val *d = mkval(&c->a, V_DICT);
        for (int i = 0; i + 1 < x->nc; i += 2) {
            val *k = eval(c, x->c[i]);
            if (k->t != V_STR)
                rerr(c, "line %d: dict keys must be strings here", x->line);
            dict_set(c, d, astrndup(&c->a, k->u.s.s, k->u.s.n), eval(c, x->c[i + 1]));
        }
        return d;
    }
    default: rerr(c, "line %d: not an expression", x->line);
    }
}

/* body rendered into a string value instead of the output (macros, set and filter blocks) */
static val *render_capture(rctx *c, const node *body)
{
    size_t mark = c->len;
    exec_body(c, body);
    val *v = mkstr(&c->a, c->out != NULL ? c->out + mark : "", c->len - mark);
    c->len = mark;
    if (c->out != NULL)
        c->out[mark] = '\0';
    return v;
}

/* a macro's call: its parameters bound in a scope of its own, its body rendered into a string */
static val *call_macro(rctx *c, const node *m, val **a, int n, char **kn, val **kv, int nk)
{
    if (++c->depth > MAX_DEPTH)
        rerr(c, "macros nest deeper than %d", MAX_DEPTH);
    frame *saved = c->top;
    push_frame(c);
    for (int i = 1; i < m->nc; i++) {
        const node *p = m->c[i];
        val *v = arg(a, n, kn, kv, nk, i - 1, p->s);
        if (v == NULL)
            v = p->k == E_KWARG ? eval(c, p->c[0]) : &V_UNDEF_;
        bind(c, p->s, v);
    }
    val *r = render_capture(c, m->c[0]);
    c->top = saved;
    c->depth--;
    return r;
}

static val *call_value(rctx *c, val *f, val **a, int n, char **kn, val **kv, int nk)
{
    if (f->u.fn.macro != NULL)
        return call_macro(c, f->u.fn.macro, a, n, kn, kv, nk);
    if (f->u.fn.fn != NULL)
        return f->u.fn.fn(c, f->u.fn.self, a, n, kn, kv, nk);
    return call_method(c, f->u.fn.self, f->u.fn.name, a, n, kn, kv, nk);
}

/* ---------------------------------------------------------------------------------------------
 * Globals */

static val *g_raise(rctx *c, val *self, val **a, int n, char **kn, val **kv, int nk)
{
    (void)self; (void)kn; (void)kv; (void)nk;
    val *m = n > 0 ? to_str(c, a[0]) : mkstr(&c->a, "raise_exception", 15);
    rerr(c, "%.*s", (int)m->u.s.n, m->u.s.s);
}

static val *g_namespace(rctx *c, val *self, val **a, int n, char **kn, val **kv, int nk)
{
    (void)self;
    val *d = mkval(&c->a, V_DICT);
    d->ns = 1;
    for (int i = 0; i < n; i++)
        if (a[i]->t == V_DICT)
            for (int k = 0; k < a[i]->u.d.n; k++)
                dict_set(c, d, a[i]->u.d.k[k], a[i]->u.d.v[k]);
    for (int k = 0; k < nk; k++)
        dict_set(c, d, kn[k], kv[k]);
    return d;
}

static val *g_dict(rctx *c, val *self, val **a, int n, char **kn, val **kv, int nk)
{
    val *d = g_namespace(c, self, a, n, kn, kv, nk);
    d->ns = 0;
    return d;
}

static val *g_range(rctx *c, val *self, val **a, int n, char **kn, val **kv, int nk)
{
    (void)self; (void)kn; (void)kv; (void)nk;
    long long s = 0, e, st = 1;
    if (n == 1) {
        e = need_int(c, a[0], "range");
    } else if (n >= 2) {
        s = need_int(c, a[0], "range");
        e = need_int(c, a[1], "range");
        if (n > 2)
            st = need_int(c, a[2], "range");
    } else {
        rerr(c, "range: no arguments");
    }
    if (st == 0)
        rerr(c, "range: step 0");
    val *l = vlist(c);
    for (long long i = s; st > 0 ? i < e : i > e; i += st) {
        if (l->u.l.n > 1000000)
            rerr(c, "range: too long");
        list_add(c, l, vint(c, i));
    }
    return l;
}

static val *g_strftime(rctx *c, val *self, val **a, int n, char **kn, val **kv, int nk)
{
    (void)self; (void)kn; (void)kv; (void)nk;
    val *f = need_str(c, n > 0 ? a[0] : NULL, "strftime_now");
    time_t t = time(NULL);
    struct tm tm;
    localtime_r(&t, &tm);
    char buf[256];
    size_t len = strftime(buf, sizeof(buf), f->u.s.s, &tm);
    return mkstr(&c->a, buf, len);
}

/* ---------------------------------------------------------------------------------------------
 * Filters and tests */

static val *map_attr(rctx *c, val *x, const char *attr)
{
    /* "a.b" walks attributes; a number indexes */
    val *v = x;
    const char *p = attr;
    while (*p) {
        const char *q = strchr(p, '.');
        size_t len = q != NULL ? (size_t)(q - p) : strlen(p);
        if (v->t == V_DICT) {
            val *o = dict_get(v, p, len);
            v = o != NULL ? o : &V_UNDEF_;
        } else if (v->t == V_LIST && isdigit((unsigned char)*p)) {
            v = get_item(c, v, vint(c, strtoll(p, NULL, 10)));
        } else {
            v = &V_UNDEF_;
        }
        p += len + (q != NULL);
    }
    return v;
}

static val *apply_filter(rctx *c, const char *f, val *x, val **a, int n, char **kn, val **kv, int nk)
{
    if (strcmp(f, "tojson") == 0) {
        /* transformers' tojson: json.dumps(x, ensure_ascii=False, indent, separators, sort_keys) */
        val *ind = arg(a, n, kn, kv, nk, 0, "indent"), *sep = arg(a, n, kn, kv, nk, -1, "separators");
        val *sk = arg(a, n, kn, kv, nk, -1, "sort_keys");
        json_opts o = {.indent = ind != NULL && ind->t != V_NONE ? (int)need_int(c, ind, "tojson's indent") : -1,
                       .sort_keys = sk != NULL && truthy(sk)};
        o.item_sep = o.indent >= 0 ? "," : ", ";
        o.key_sep = ": ";
        if (sep != NULL && sep->t != V_NONE) {
            if (sep->t != V_LIST || sep->u.l.n != 2)
                rerr(c, "tojson: separators must be a pair of strings");
            o.item_sep = need_str(c, sep->u.l.a[0], "tojson's separators")->u.s.s;
            o.key_sep = need_str(c, sep->u.l.a[1], "tojson's separators")->u.s.s;
        }
        sbuf b = {.c = c};
        json_into(c, &b, x, &o, 0);
        return sb_val(&b);
    }
    if (strcmp(f, "trim") == 0 || strcmp(f, "strip") == 0)
        return strip(c, to_str(c, x), arg(a, n, kn, kv, nk, 0, "chars"), 1, 1);
    if (strcmp(f, "length") == 0 || strcmp(f, "count") == 0) {
        if (x->t == V_STR) {
            long long k = 0;
            for (size_t i = 0; i < x->u.s.n; i++)
                k += ((unsigned char)x->u.s.s[i] & 0xc0) != 0x80;
            return vint(c, k);
        }
        if (x->t == V_LIST)
            return vint(c, x->u.l.n);
        if (x->t == V_DICT)
            return vint(c, x->u.d.n);
        rerr(c, "length of %s", type_name(x));
    }
    if (strcmp(f, "lower") == 0) return case_map(c, to_str(c, x), 0);
    if (strcmp(f, "upper") == 0) return case_map(c, to_str(c, x), 1);
    if (strcmp(f, "title") == 0) return case_map(c, to_str(c, x), 2);
    if (strcmp(f, "capitalize") == 0) return case_map(c, to_str(c, x), 3);
    if (strcmp(f, "string") == 0) return to_str(c, x);
    if (strcmp(f, "safe") == 0) return x;
    if (strcmp(f, "int") == 0) {
        if (x->t == V_STR) {
            char *e;
            char *s = astrndup(&c->a, x->u.s.s, x->u.s.n);
            long long v = strtoll(s, &e, 10);
            return vint(c, *e == '\0' && e != s ? v : (n > 0 ? need_int(c, a[0], "int's default") : 0));
        }
        return vint(c, is_num(x) ? (long long)num(x) : 0);
    }
    if (strcmp(f, "float") == 0) {
        if (x->t == V_STR) {
            char *s = astrndup(&c->a, x->u.s.s, x->u.s.n), *e;
            double v = strtod(s, &e);
            return vfloat(c, *e == '\0' && e != s ? v : 0.0);
        }
        return vfloat(c, is_num(x) ? num(x) : 0.0);
    }
    if (strcmp(f, "abs") == 0) {
        if (!is_num(x))
            rerr(c, "abs of %s", type_name(x));
        if (x->t == V_FLOAT || (x->t == V_INT && x->u.i == LLONG_MIN))
            return vfloat(c, fabs(num(x)));
        return vint(c, llabs((long long)num(x)));
    }
    if (strcmp(f, "round") == 0) {
        long long p = n > 0 ? need_int(c, a[0], "round's precision") : 0;
        double s = pow(10.0, (double)p);
        return vfloat(c, round(num(x) * s) / s);
    }
    if (strcmp(f, "join") == 0) {
        val *l = iter_list(c, x, "join");
        val *sep = arg(a, n, kn, kv, nk, 0, "d");
        val *attr = arg(a, n, kn, kv, nk, 1, "attribute");
        sbuf b = {.c = c};
        for (int i = 0; i < l->u.l.n; i++) {
            if (i && sep != NULL)
                str_into(c, &b, sep);
            str_into(c, &b, attr != NULL ? map_attr(c, l->u.l.a[i], need_str(c, attr, "join")->u.s.s) : l->u.l.a[i]);
        }
        return sb_val(&b);
    }
    if (strcmp(f, "replace") == 0)
        return replace(c, to_str(c, x), n > 0 ? a[0] : NULL, n > 1 ? a[1] : &V_NONE_,
                       n > 2 ? need_int(c, a[2], "replace's count") : -1);
    if (strcmp(f, "first") == 0 || strcmp(f, "last") == 0) {
        val *l = iter_list(c, x, f);
        if (l->u.l.n == 0)
            return &V_UNDEF_;
        return l->u.l.a[f[0] == 'f' ? 0 : l->u.l.n - 1];
    }
    if (strcmp(f, "default") == 0 || strcmp(f, "d") == 0) {
        val *dv = arg(a, n, kn, kv, nk, 0, "default_value");
        val *bl = arg(a, n, kn, kv, nk, 1, "boolean");
        int use = x->t == V_UNDEF || (bl != NULL && truthy(bl) && !truthy(x));
        return use ? (dv != NULL ? dv : mkstr(&c->a, "", 0)) : x;
    }
    if (strcmp(f, "items") == 0) {
        if (x->t != V_DICT)
            rerr(c, "items of %s", type_name(x));
        return items_of(c, x);
    }
    if (strcmp(f, "list") == 0) {
        val *l = iter_list(c, x, "list"), *o = vlist(c);
        for (int i = 0; i < l->u.l.n; i++)
            list_add(c, o, l->u.l.a[i]);
        return o;
    }
    if (strcmp(f, "reverse") == 0) {
        if (x->t == V_STR)
            return slice(c, x, NULL, NULL, vint(c, -1));
        val *l = iter_list(c, x, "reverse"), *o = vlist(c);
        for (int i = l->u.l.n - 1; i >= 0; i--)
            list_add(c, o, l->u.l.a[i]);
        return o;
    }
    if (strcmp(f, "unique") == 0) {
        val *l = iter_list(c, x, "unique"), *o = vlist(c);
        for (int i = 0; i < l->u.l.n; i++)
            if (!contains(c, o, l->u.l.a[i]))
                list_add(c, o, l->u.l.a[i]);
        return o;
    }
    if (strcmp(f, "sum") == 0) {
        val *l = iter_list(c, x, "sum");
        val *acc = vint(c, 0);
        for (int i = 0; i < l->u.l.n; i++)
            acc = arith(c, "+", acc, l->u.l.a[i]);
        return acc;
    }
    if (strcmp(f, "min") == 0 || strcmp(f, "max") == 0) {
        val *l = iter_list(c, x, f);
        if (l->u.l.n == 0)
            return &V_UNDEF_;
        val *best = l->u.l.a[0];
        for (int i = 1; i < l->u.l.n; i++) {
            int r = compare(c, l->u.l.a[i], best, f);
            if (f[1] == 'i' ? r < 0 : r > 0)
                best = l->u.l.a[i];
        }
        return best;
    }
    if (strcmp(f, "sort") == 0) {
        val *l = iter_list(c, x, "sort"), *o = vlist(c);
        val *rev = arg(a, n, kn, kv, nk, 0, "reverse");
        val *attr = arg(a, n, kn, kv, nk, 2, "attribute");
        for (int i = 0; i < l->u.l.n; i++)
            list_add(c, o, l->u.l.a[i]);
        for (int i = 1; i < o->u.l.n; i++)   /* stable insertion sort */
            for (int j = i; j > 0; j--) {
                val *p = o->u.l.a[j - 1], *q = o->u.l.a[j];
                val *pk = attr != NULL ? map_attr(c, p, need_str(c, attr, "sort")->u.s.s) : p;
                val *qk = attr != NULL ? map_attr(c, q, attr->u.s.s) : q;
                int r = compare(c, pk, qk, "sort");
                if (rev != NULL && truthy(rev) ? r >= 0 : r <= 0)
                    break;
                o->u.l.a[j - 1] = q;
                o->u.l.a[j] = p;
            }
        return o;
    }
    if (strcmp(f, "map") == 0) {
        val *l = iter_list(c, x, "map"), *o = vlist(c);
        val *attr = arg(a, n, kn, kv, nk, -1, "attribute");
        val *dflt = arg(a, n, kn, kv, nk, -1, "default");
        for (int i = 0; i < l->u.l.n; i++) {
            if (attr != NULL) {
                val *v = map_attr(c, l->u.l.a[i], need_str(c, attr, "map")->u.s.s);
                list_add(c, o, v->t == V_UNDEF && dflt != NULL ? dflt : v);
            } else {
                val *fn = need_str(c, n > 0 ? a[0] : NULL, "map's filter");
                list_add(c, o, apply_filter(c, fn->u.s.s, l->u.l.a[i], a + 1, n - 1, NULL, NULL, 0));
            }
        }
        return o;
    }
    if (strcmp(f, "select") == 0 || strcmp(f, "reject") == 0 || strcmp(f, "selectattr") == 0 ||
        strcmp(f, "rejectattr") == 0) {
        int attr = strstr(f, "attr") != NULL, keep = f[0] == 's';
        val *l = iter_list(c, x, f), *o = vlist(c);
        int k = 0;
        const char *an = attr ? need_str(c, n > 0 ? a[k++] : NULL, f)->u.s.s : NULL;
        const char *test = n > k ? need_str(c, a[k++], f)->u.s.s : NULL;
        for (int i = 0; i < l->u.l.n; i++) {
            val *v = attr ? map_attr(c, l->u.l.a[i], an) : l->u.l.a[i];
            int r = test != NULL ? apply_test(c, test, v, a + k, n - k) : truthy(v);
            if (r == keep)
                list_add(c, o, l->u.l.a[i]);
        }
        return o;
    }
    if (strcmp(f, "e") == 0 || strcmp(f, "escape") == 0) {
        val *s = to_str(c, x);
        sbuf b = {.c = c};
        for (size_t i = 0; i < s->u.s.n; i++) {
            char ch = s->u.s.s[i];
            const char *r = ch == '&' ? "&amp;" : ch == '<' ? "&lt;" : ch == '>' ? "&gt;" : ch == '"' ? "&#34;"
                          : ch == '\'' ? "&#39;" : NULL;
            if (r != NULL)
                sb_str(&b, r);
            else
                sb_add(&b, &ch, 1);
        }
        return sb_val(&b);
    }
    if (strcmp(f, "indent") == 0) {
        val *s = to_str(c, x);
        long long w = n > 0 && a[0]->t == V_INT ? a[0]->u.i : 4;
        val *first = arg(a, n, kn, kv, nk, 1, "first");
        sbuf b = {.c = c}, pad = {.c = c};
        for (long long i = 0; i < w; i++)
            sb_add(&pad, " ", 1);
        if (first != NULL && truthy(first))
            sb_add(&b, pad.s, pad.n);
        for (size_t i = 0; i < s->u.s.n; i++) {
            sb_add(&b, s->u.s.s + i, 1);
            if (s->u.s.s[i] == '\n' && i + 1 < s->u.s.n && s->u.s.s[i + 1] != '\n')
                sb_add(&b, pad.s, pad.n);
        }
        return sb_val(&b);
    }
    if (strcmp(f, "dictsort") == 0) {
        if (x->t != V_DICT)
            rerr(c, "dictsort of %s", type_name(x));
        val *l = items_of(c, x);
        for (int i = 1; i < l->u.l.n; i++)
            for (int j = i; j > 0 && compare(c, l->u.l.a[j - 1]->u.l.a[0], l->u.l.a[j]->u.l.a[0], "dictsort") > 0; j--) {
                val *t = l->u.l.a[j - 1];
                l->u.l.a[j - 1] = l->u.l.a[j];
                l->u.l.a[j] = t;
            }
        return l;
    }
    rerr(c, "no filter named '%s'", f);
}

static int apply_test(rctx *c, const char *t, val *x, val **a, int n)
{
    val *o = n > 0 ? a[0] : NULL;
    if (strcmp(t, "defined") == 0) return x->t != V_UNDEF;
    if (strcmp(t, "undefined") == 0) return x->t == V_UNDEF;
    if (strcmp(t, "none") == 0) return x->t == V_NONE;
    if (strcmp(t, "string") == 0) return x->t == V_STR;
    if (strcmp(t, "number") == 0) return x->t == V_INT || x->t == V_FLOAT;
    if (strcmp(t, "integer") == 0) return x->t == V_INT;
    if (strcmp(t, "float") == 0) return x->t == V_FLOAT;
    if (strcmp(t, "boolean") == 0) return x->t == V_BOOL;
    if (strcmp(t, "true") == 0) return x->t == V_BOOL && x->u.b;
    if (strcmp(t, "false") == 0) return x->t == V_BOOL && !x->u.b;
    if (strcmp(t, "mapping") == 0) return x->t == V_DICT;
    if (strcmp(t, "sequence") == 0) return x->t == V_LIST || x->t == V_STR || x->t == V_DICT;
    if (strcmp(t, "iterable") == 0) return x->t == V_LIST || x->t == V_STR || x->t == V_DICT;
    if (strcmp(t, "callable") == 0) return x->t == V_FUNC;
    if (strcmp(t, "odd") == 0) return need_int(c, x, "odd") % 2 != 0;
    if (strcmp(t, "even") == 0) return need_int(c, x, "even") % 2 == 0;
    if (strcmp(t, "divisibleby") == 0) {
        long long d = need_int(c, o, "divisibleby");
        return d != 0 && need_int(c, x, "divisibleby") % d == 0;
    }
    if (strcmp(t, "lower") == 0 || strcmp(t, "upper") == 0) {
        if (x->t != V_STR)
            return 0;
        for (size_t i = 0; i < x->u.s.n; i++)
            if (t[0] == 'l' ? isupper((unsigned char)x->u.s.s[i]) : islower((unsigned char)x->u.s.s[i]))
                return 0;
        return 1;
    }
    static const char *const two[] = {"eq", "equalto", "sameas", "==", "ne", "in", "lt", "lessthan", "gt",
                                       "greaterthan", "le", "ge", NULL};
    for (int k = 0; o == NULL && two[k] != NULL; k++)
        if (strcmp(t, two[k]) == 0)
            rerr(c, "test '%s' needs an argument", t);
    if (strcmp(t, "eq") == 0 || strcmp(t, "equalto") == 0 || strcmp(t, "sameas") == 0 || strcmp(t, "==") == 0)
        return equal(x, o);
    if (strcmp(t, "ne") == 0) return !equal(x, o);
    if (strcmp(t, "in") == 0) return contains(c, o, x);
    if (o != NULL && (strcmp(t, "lt") == 0 || strcmp(t, "lessthan") == 0)) return compare(c, x, o, "<") < 0;
    if (o != NULL && (strcmp(t, "gt") == 0 || strcmp(t, "greaterthan") == 0)) return compare(c, x, o, ">") > 0;
    if (o != NULL && strcmp(t, "le") == 0) return compare(c, x, o, "<=") <= 0;
    if (o != NULL && strcmp(t, "ge") == 0) return compare(c, x, o, ">=") >= 0;
    rerr(c, "no test named '%s'", t);
}

/* ---------------------------------------------------------------------------------------------
 * Statements */

/* loop.cycle(a, b, ...): the argument the iteration's index picks, round robin */
static val *loop_cycle(rctx *c, val *self, val **a, int n, char **kn, val **kv, int nk)
{
    (void)kn; (void)kv; (void)nk;
    if (n == 0)
        rerr(c, "loop.cycle: no values");
    return a[self->u.i % n];
}

static void exec_for(rctx *c, const node *x)
{
    val *seq = eval(c, x->c[1]);
    if (seq->t == V_DICT)   /* iterating a dict gives its keys */
        seq = iter_list(c, seq, "for");
    val *l = iter_list(c, seq, "for");
    /* the loop filter applies before loop.* counts */
    val *items = l;
    if (x->c[4] != NULL) {
        items = vlist(c);
        frame *saved = c->top;
        for (int i = 0; i < l->u.l.n; i++) {
            push_frame(c);
            assign(c, x->c[0], l->u.l.a[i]);
            if (truthy(eval(c, x->c[4])))
                list_add(c, items, l->u.l.a[i]);
            c->top = saved;
        }
    }
    int n = items->u.l.n;
    if (n == 0) {
        if (x->c[3] != NULL)
            exec_body(c, x->c[3]);
        return;
    }
    frame *saved = c->top;
    push_frame(c);
    frame *f = c->top;
    for (int i = 0; i < n; i++) {
        if (++c->steps > MAX_STEPS)
            rerr(c, "the template takes too many steps");
        f->vars.u.d.n = 0;   /* the iteration's names start afresh (sets do not outlive it) */
        c->top = f;
        assign(c, x->c[0], items->u.l.a[i]);
        if (!x->neg) {   /* the body does not name "loop" */
            exec_body(c, x->c[2]);
            goto next;
        }
        val *loop = mkval(&c->a, V_DICT);
        dict_set(c, loop, "index", vint(c, i + 1));
        dict_set(c, loop, "index0", vint(c, i));
        dict_set(c, loop, "revindex", vint(c, n - i));
        dict_set(c, loop, "revindex0", vint(c, n - i - 1));
        dict_set(c, loop, "first", vbool(i == 0));
        dict_set(c, loop, "last", vbool(i == n - 1));
        dict_set(c, loop, "length", vint(c, n));
        dict_set(c, loop, "previtem", i > 0 ? items->u.l.a[i - 1] : &V_UNDEF_);
        dict_set(c, loop, "nextitem", i + 1 < n ? items->u.l.a[i + 1] : &V_UNDEF_);
        val *cyc = mkval(&c->a, V_FUNC);
        cyc->u.fn.fn = loop_cycle;
        cyc->u.fn.self = vint(c, i);
        cyc->u.fn.name = "cycle";
        dict_set(c, loop, "cycle", cyc);
        bind(c, "loop", loop);
        exec_body(c, x->c[2]);
    next:
        c->top = saved;
        int b = c->brk;
        c->brk = 0;
        if (b == 1)
            break;
    }
}

static void exec_body(rctx *c, const node *b)
{
    for (int i = 0; i < b->nc && c->brk == 0; i++) {
        const node *x = b->c[i];
        if (++c->steps > MAX_STEPS)
            rerr(c, "the template takes too many steps");
        switch (x->k) {
        case N_TEXT: emit(c, x->s, x->n); break;
        case N_OUT: {
            val *v = eval(c, x->c[0]);
            if (v->t == V_STR) {
                emit(c, v->u.s.s, v->u.s.n);
            } else {
                sbuf s = {.c = c};
                str_into(c, &s, v);
                emit(c, s.s != NULL ? s.s : "", s.n);
            }
            break;
        }
        case N_IF:
            if (truthy(eval(c, x->c[0])))
                exec_body(c, x->c[1]);
            else if (x->c[2] != NULL)
                exec_body(c, x->c[2]);
            break;
        case N_FOR: exec_for(c, x); break;
        case N_SET: assign(c, x->c[0], eval(c, x->c[1])); break;
        case N_SETBLOCK: {
            assign(c, x->c[0], render_capture(c, x->c[1]));
            break;
        }
        case N_CALLBLOCK: {
            frame *saved = c->top;
            push_frame(c);
            val *f = mkval(&c->a, V_FUNC);
            f->u.fn.macro = x->c[0];
            f->u.fn.name = "caller";
            bind(c, "caller", f);
            val *v = to_str(c, eval(c, x->c[1]));
            c->top = saved;
            emit(c, v->u.s.s, v->u.s.n);
            break;
        }
        case N_FILTERBLOCK: {
            val *v = render_capture(c, x->c[0]);
            argv_t a = eval_args(c, x, 1);
            v = to_str(c, apply_filter(c, x->s, v, a.a, a.n, a.kn, a.kv, a.nk));
            emit(c, v->u.s.s, v->u.s.n);
            break;
        }
        case N_MACRO: {
            val *f = mkval(&c->a, V_FUNC);
            f->u.fn.macro = x;
            f->u.fn.name = x->s;
            bind(c, x->s, f);
            break;
        }
        case N_BODY: exec_body(c, x); break;
        case N_BREAK: c->brk = 1; break;
        case N_CONTINUE: c->brk = 2; break;
        default: rerr(c, "line %d: not a statement", x->line);
        }
    }
}

int pd_jinja_render(const pd_jinja *t, const cJSON *ctx, char **out, size_t *len, char *err, size_t cap)
{
    rctx *volatile c = calloc(1, sizeof(*c));
    if (c == NULL) {
        snprintf(err, cap, "out of memory");
        return -1;
    }
    c->err = err;
    c->cap = cap;
    c->a.oom = &c->fail;
    c->a.limit = MAX_ARENA;
    err[0] = '\0';
    if (setjmp(c->fail)) {
        if (c->a.over)
            snprintf(err, cap, "the template needs more than %u MiB to render", MAX_ARENA >> 20);
        else if (err[0] == '\0')
            snprintf(err, cap, "out of memory");
        free(c->out);
        arena_free(&c->a);
        free(c);
        return -1;
    }
    push_frame(c);
    static const struct { const char *n; builtin_fn f; } globals[] = {
        {"raise_exception", g_raise}, {"namespace", g_namespace}, {"range", g_range},
        {"strftime_now", g_strftime}, {"dict", g_dict},
    };
    for (size_t k = 0; k < sizeof(globals) / sizeof(globals[0]); k++) {
        val *f = mkval(&c->a, V_FUNC);
        f->u.fn.fn = globals[k].f;
        f->u.fn.name = globals[k].n;
        bind(c, globals[k].n, f);
    }
    for (const cJSON *e = ctx != NULL ? ctx->child : NULL; e != NULL; e = e->next)
        if (e->string != NULL)
            bind(c, astrndup(&c->a, e->string, strlen(e->string)), from_json(c, e));
    push_frame(c);   /* the template's own sets */
    emit(c, "", 0);
    exec_body(c, t->root);
    *out = c->out;
    *len = c->len;
    arena_free(&c->a);
    free(c);
    return 0;
}
