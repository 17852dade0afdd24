/* pd_grammar_regex.h - grammars from a list of choices and from a regular expression
 *   (pd_grammar_regex.c); pd_grammar.h includes it.
 * Owns: pd_grammar_choice and pd_grammar_regex.
 * Not here: references to a grammar and the limits (pd_grammar.h).
 * Threading: any thread; each call makes a new grammar (one reference, the caller's). */
#ifndef PD_GRAMMAR_REGEX_H
#define PD_GRAMMAR_REGEX_H

#include <stddef.h>

#include "pd_status.h"

typedef struct pd_grammar pd_grammar;

/* Exactly one of the n strings (1..PD_GRAMMAR_MAX_CHOICES, each non-empty). */
pd_status pd_grammar_choice(const char *const *choices, int n, pd_grammar **out, pd_err *err);
/* A whole match of the regular expression: literals, ., [...] and [^...] (ASCII ranges),
 * \d \w \s \D \W \S and escaped punctuation, groups (...) and (?:...), |, * + ? {m} {m,}
 * {m,n} (a lazy ? after them is accepted: only the language matters), ^ and $ at the ends.
 * Backreferences and lookaround: PD_ERR_INVALID. */
pd_status pd_grammar_regex(const char *re, size_t len, pd_grammar **out, pd_err *err);

#endif
