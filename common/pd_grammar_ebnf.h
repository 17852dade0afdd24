/* pd_grammar_ebnf.h - grammars written in GBNF (pd_grammar_ebnf.c); pd_grammar.h includes it.
 * Owns: pd_grammar_ebnf.
 * Not here: references to a grammar and the limits (pd_grammar.h).
 * Threading: any thread; each call makes a new grammar (one reference, the caller's). */
#ifndef PD_GRAMMAR_EBNF_H
#define PD_GRAMMAR_EBNF_H

#include <stddef.h>

#include "pd_status.h"

typedef struct pd_grammar pd_grammar;

/* A grammar in GBNF (llama.cpp's EBNF, also what vLLM's guided_grammar takes through xgrammar):
 * rules `name ::= body`, the output a whole match of `root`; bodies of "literals", [classes]
 * and [^negated] ones (code points and ranges, any Unicode), `.`, rule names, (groups), `|`,
 * `* + ? {m} {m,} {m,n}`, # comments; escapes \n \t \r \\ \" \xHH \uHHHH \UHHHHHHHH.
 * Undefined rules, left recursion (`a ::= a "x"`), a missing root: PD_ERR_INVALID naming the
 * rule; syntax errors name the line and column. */
pd_status pd_grammar_ebnf(const char *text, size_t len, pd_grammar **out, pd_err *err);

#endif
