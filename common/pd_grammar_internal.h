/* pd_grammar_internal.h - private to the grammar's files (pd_grammar.c and the pd_grammar_*.c
 *   parts it is split into), as kern_cuda_internal.h is to the .cu files.
 * Owns: the compiled form (struct pd_grammar, described below), byte sets, array growth, the
 *   rule builder every compiler writes through (pd_gb, pd_grammar.c), and the functions one
 *   part lends another: a schema's pattern (pd_grammar_regex.c), the matcher's dead state and
 *   the masks a grammar's matchers share (pd_grammar_match.c).
 * Not here: the public API (pd_grammar.h and the parts' headers it includes).
 * Threading: a builder belongs to the call that compiles its grammar; a finished grammar is
 *   immutable but for its reference count (atomic) and its shared masks (behind their lock).
 *
 * A compiled grammar is one array of elements: [0] refers to the root rule and [1] ends it;
 * then every rule's alternatives, each a run of elements ended by PD_GEL_END. A position is an
 * index into that array. The matcher's state is a set of stacks of positions (the top is the next
 * element to match; the ones below are where each enclosing rule continues), expanded until
 * every top is a byte class: advancing by a byte keeps the stacks whose class holds it. A stack
 * that empties means the grammar may end there (complete). A reference that ends its
 * alternative replaces the caller's position instead of pushing (a tail call), so repetition
 * (X* = X X* | empty) does not grow the stacks. */
#ifndef PD_GRAMMAR_INTERNAL_H
#define PD_GRAMMAR_INTERNAL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "pd_buf.h"
#include "pd_grammar.h"

enum { PD_GEL_END = 0, PD_GEL_CLASS, PD_GEL_REF };

typedef struct {
    uint32_t w[8];
} pd_gset;

typedef struct {
    uint8_t kind;
    int32_t ref;      /* PD_GEL_REF: the rule */
    pd_gset set;      /* PD_GEL_CLASS: the bytes it takes */
} pd_gel;

struct pd_gshared;

struct pd_grammar {
    atomic_int refs;
    struct pd_gshared *shared;   /* masks by state, shared by every matcher of the grammar */
    pd_gel *el;
    int n_el;
    int32_t *alt;     /* alternative start positions; rule r's: alt[alt_off[r] .. alt_off[r + 1]) */
    int32_t *alt_off;
    int n_rules;
};

static inline void pd_gset_add(pd_gset *s, int c) { s->w[c >> 5] |= 1u << (c & 31); }
static inline int pd_gset_has(const pd_gset *s, int c) { return (s->w[c >> 5] >> (c & 31)) & 1u; }
static inline void pd_gset_range(pd_gset *s, int lo, int hi)
{
    for (int c = lo; c <= hi; c++)
        pd_gset_add(s, c);
}

/* the grammar compiler's arrays grow through pd_buf_grow (pd_buf.h) */
static inline int pd_grammar_grow(void **p, int *cap, int need, size_t sz)
{
    return pd_buf_grow(p, cap, need, sz);
}

/* ---- the builder (pd_grammar.c) -------------------------------------------------------------
 * A compiler makes rules (ids from pd_gb_rule_new; a reference may name a rule made later) and
 * appends elements to their alternatives; pd_gb_finish lays them out as above. The first
 * failure is kept in st (its message in err) and every later call is a no-op (a rule or an
 * alternative is then -1), so a compiler checks st once, at the end. */

typedef struct {
    pd_gel *el;
    int n, cap;
} pd_gb_seq;

typedef struct {
    pd_gb_seq *alt;
    int n, cap;
} pd_gb_rule;

typedef struct {
    pd_gb_rule *r;
    int n, cap;
    pd_status st;     /* the first failure; every later call is a no-op */
    pd_err *err;
} pd_gb;

/* records the first failure (message what); always -1 */
int pd_gb_fail(pd_gb *b, pd_status code, const char *what);
/* a new rule (PD_ERR_INVALID past PD_GRAMMAR_MAX_RULES) and a new alternative of rule r */
int pd_gb_rule_new(pd_gb *b);
int pd_gb_alt(pd_gb *b, int r);
/* appended to alternative a of rule r: a byte class, a reference to rule `rule`, the bytes s[0..n) */
void pd_gb_cls(pd_gb *b, int r, int a, const pd_gset *s);
void pd_gb_ref(pd_gb *b, int r, int a, int rule);
void pd_gb_lit(pd_gb *b, int r, int a, const char *s, size_t n);
/* rules of one alternative: one byte class, the bytes s[0..n) */
int pd_gb_cls_rule(pd_gb *b, const pd_gset *s);
int pd_gb_lit_rule(pd_gb *b, const char *s, size_t n);
/* the alternatives of rule r that take one UTF-8 sequence of two to four bytes */
void pd_gb_utf8_alts(pd_gb *b, int r);
/* new rules: x?, x*, x{min,max} (max < 0: unbounded), and the last with the smallest rules
 * for ? and * */
int pd_gb_opt(pd_gb *b, int x);
int pd_gb_star(pd_gb *b, int x);
int pd_gb_rep(pd_gb *b, int x, int min, int max);
int pd_gb_quant(pd_gb *b, int x, int min, int max);
/* The flat grammar with rule root at the top (*out: one reference), refused with
 * PD_ERR_INVALID when it matches no text at all; b's rules are freed either way. Returns b's
 * first failure when there was one. */
pd_status pd_gb_finish(pd_gb *b, int root, pd_grammar **out);
/* a repeat bound's digits at s[*i..] (regex and GBNF {m,n}): 1 read (at most 100000), 0 none,
 * -1 too large */
int pd_grammar_repeat_bound(const char *s, size_t n, size_t *i, int *out);

/* ---- lent by pd_grammar_regex.c ---------------------------------------------------------- */

/* A schema's pattern (pd_grammar_json.c): the rule of the regex s[start..n) over a JSON
 * string's body, the characters JSON escapes matched as their escapes; errors go to b. */
int pd_grammar_regex_json(pd_gb *b, const char *s, size_t n, size_t start);

/* ---- lent by pd_grammar_match.c ---------------------------------------------------------- */

/* 1 when m has no way on and is not complete (the grammar matches nothing from here) */
int pd_gmatch_dead(const pd_gmatch *m);
/* a grammar's shared masks: NULL when out of memory (the grammar then shares nothing);
 * pd_gshared_free(NULL) does nothing */
struct pd_gshared *pd_gshared_new(void);
void pd_gshared_free(struct pd_gshared *c);

#endif
