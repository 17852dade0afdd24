/* pd_grammar.h - structured output: which tokens may come next.
 * Owns: a grammar over bytes (rules of alternatives; an alternative is a sequence of byte
 *   classes and rule references; right recursion only), built from a JSON schema, from "any JSON
 *   object" (OpenAI response_format json_object), from a list of strings (vLLM guided_choice) or
 *   from a regular expression (vLLM guided_regex); the vocabulary as a byte trie; a matcher
 *   that follows a token sequence through the grammar (a set of rule stacks, as an Earley-style
 *   recogniser without left recursion) and gives the tokens allowed next as a bitmask.
 * Not here: applying the mask to logits (kern_token_mask) and when (pd_engine_logits.c).
 * Threading: a grammar and a vocabulary are immutable once built and may be shared between
 *   threads (pd_grammar_ref / _unref are atomic); a matcher belongs to one request.
 *
 * This header declares the whole API: the limits, a grammar's references, the cache of
 * compiled grammars and a request's spec here (pd_grammar.c), the rest in the parts' headers
 * it includes: pd_grammar_json.h (JSON schema, json_object, tool calls), pd_grammar_regex.h
 * (choices, regex), pd_grammar_ebnf.h (GBNF), pd_grammar_match.h (vocabulary, matcher). */
#ifndef PD_GRAMMAR_H
#define PD_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "pd_grammar_ebnf.h"
#include "pd_grammar_json.h"
#include "pd_grammar_match.h"
#include "pd_grammar_regex.h"
#include "pd_status.h"

typedef struct pd_grammar pd_grammar;

/* Limits of what a request may ask (PD_ERR_INVALID beyond them, naming the limit). */
#define PD_GRAMMAR_MAX_SPEC (64 * 1024)   /* bytes of a schema, a regex or all the choices */
#define PD_GRAMMAR_MAX_CHOICES 256
#define PD_GRAMMAR_MAX_RULES 20000        /* rules after compilation (bounded repeats unroll) */

pd_grammar *pd_grammar_ref(pd_grammar *g);
void pd_grammar_unref(pd_grammar *g);   /* NULL is fine */

/* Compiled grammars kept by their spec: a service that sends one schema (or one set of tools)
 * with every request compiles it once, and its matchers share the masks of the states they
 * met (a grammar keeps up to 4 MiB of masks, least recently used dropped). Thread-safe. */
typedef struct pd_gcache pd_gcache;
typedef pd_status (*pd_gcompile_fn)(void *ud, pd_grammar **out, pd_err *err);
pd_status pd_gcache_create(int max_entries, pd_gcache **out, pd_err *err);   /* 0 = 64 */
void pd_gcache_destroy(pd_gcache *c);   /* NULL is fine; grammars in use live on */
/* *out: a new reference to the grammar kept under key[0..len), else compile(ud)'s, kept (the
 * least recently used entry goes past max_entries; a failed compile is not kept). c NULL:
 * compile only. */
pd_status pd_gcache_get(pd_gcache *c, const void *key, size_t len, pd_gcompile_fn compile, void *ud,
                        pd_grammar **out, pd_err *err);
void pd_gcache_stats(pd_gcache *c, uint64_t *hits, uint64_t *misses);

/* One request's structured output as the front ends take it (at most one kind set; the first
 * set of json_object, json_schema, choices, regex, ebnf is compiled). */
typedef struct {
    int json_object;
    const char *json_schema;
    size_t json_schema_len;
    const char *const *choices;
    int n_choices;
    const char *regex;
    size_t regex_len;
    const char *ebnf;
    size_t ebnf_len;
} pd_grammar_spec;
/* How many kinds s sets (0: no structured output asked). */
int pd_grammar_spec_kinds(const pd_grammar_spec *s);
/* s compiled, or taken from cache (NULL: compile only) under a key of its kind and text. */
pd_status pd_grammar_compile(const pd_grammar_spec *s, pd_gcache *cache, pd_grammar **out, pd_err *err);

#endif
