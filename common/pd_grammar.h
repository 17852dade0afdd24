/* pd_grammar.h - structured output: which tokens may come next.
 * Owns: a grammar over bytes (rules of alternatives; an alternative is a sequence of byte
 *   classes and rule references; right recursion only), built from a JSON schema, from "any JSON
 *   object" (OpenAI response_format json_object), from a list of strings (vLLM guided_choice) or
 *   from a regular expression (vLLM guided_regex); the vocabulary as a byte trie; a matcher
 *   that follows a token sequence through the grammar (a set of rule stacks, as an Earley-style
 *   recogniser without left recursion) and gives the tokens allowed next as a bitmask.
 * Not here: applying the mask to logits (kern_token_mask) and when (pd_engine_logits.c).
 * Threading: a grammar and a vocabulary are immutable once built and may be shared between
 *   threads (pd_grammar_ref / _unref are atomic); a matcher belongs to one request. */
#ifndef PD_GRAMMAR_H
#define PD_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "pd_status.h"
#include "pd_tokenizer.h"

typedef struct pd_grammar pd_grammar;
typedef struct pd_gvocab pd_gvocab;
typedef struct pd_gmatch pd_gmatch;

/* Limits of what a request may ask (PD_ERR_INVALID beyond them, naming the limit). */
#define PD_GRAMMAR_MAX_SPEC (64 * 1024)   /* bytes of a schema, a regex or all the choices */
#define PD_GRAMMAR_MAX_CHOICES 256
#define PD_GRAMMAR_MAX_RULES 20000        /* rules after compilation (bounded repeats unroll) */

/* The schema text (JSON; the schema object of OpenAI's json_schema response format or vLLM's
 * guided_json). Supported: type (one or a list), properties (in their order), required,
 * additionalProperties, items, minItems, maxItems, enum, const, anyOf, oneOf, allOf of one
 * schema, $ref to #/$defs/... or #/definitions/... (recursion allowed), minLength, maxLength,
 * pattern (the regex subset below, searched in the string's text as ECMA-262 does: unanchored
 * ends take any text; not with min/maxLength), minimum / maximum / exclusiveMinimum /
 * exclusiveMaximum on integers, and on numbers when the bounds are whole numbers (the number
 * then has no exponent);
 * title, description, default, examples, $schema, $id, $comment and format are annotations
 * (format is not enforced). Any other keyword: PD_ERR_INVALID naming it. NULL = any JSON
 * object (json_object). */
pd_status pd_grammar_json(const char *schema, size_t len, pd_grammar **out, pd_err *err);
/* Exactly one of the n strings (1..PD_GRAMMAR_MAX_CHOICES, each non-empty). */
pd_status pd_grammar_choice(const char *const *choices, int n, pd_grammar **out, pd_err *err);
/* A whole match of the regular expression: literals, ., [...] and [^...] (ASCII ranges),
 * \d \w \s \D \W \S and escaped punctuation, groups (...) and (?:...), |, * + ? {m} {m,}
 * {m,n} (a lazy ? after them is accepted: only the language matters), ^ and $ at the ends.
 * Backreferences and lookaround: PD_ERR_INVALID. */
pd_status pd_grammar_regex(const char *re, size_t len, pd_grammar **out, pd_err *err);
/* Tool calls as Qwen's (Hermes) chat templates teach them:
 *   <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>
 * NAME one of names[0..n), ARGS an object that matches schemas[i] (a JSON schema's text as for
 * pd_grammar_json; NULL = any object). parallel: one or more calls, each after the first
 * preceded by "\n"; else exactly one. A bad schema: PD_ERR_INVALID naming the tool. */
pd_status pd_grammar_tool_calls(const char *const *names, const char *const *schemas, int n, int parallel,
                                pd_grammar **out, pd_err *err);
/* A grammar in GBNF (llama.cpp's EBNF, also what vLLM's guided_grammar takes through xgrammar):
 * rules `name ::= body`, the output a whole match of `root`; bodies of "literals", [classes]
 * and [^negated] ones (code points and ranges, any Unicode), `.`, rule names, (groups), `|`,
 * `* + ? {m} {m,} {m,n}`, # comments; escapes \n \t \r \\ \" \xHH \uHHHH \UHHHHHHHH.
 * Undefined rules, left recursion (`a ::= a "x"`), a missing root: PD_ERR_INVALID naming the
 * rule; syntax errors name the line and column. */
pd_status pd_grammar_ebnf(const char *text, size_t len, pd_grammar **out, pd_err *err);
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

/* The vocabulary's token bytes (pd_tokenizer_token_bytes) as a trie, special added tokens left
 * out; eos ids are allowed exactly where the grammar is complete. n_vocab: the logits' width
 * (ids past the tokenizer's are never allowed). */
pd_status pd_gvocab_create(const pd_tokenizer *t, int n_vocab, const int32_t *eos, int n_eos,
                           pd_gvocab **out, pd_err *err);
/* The same from explicit token byte strings (tests): tok[i] of len[i] bytes, NULL = none. */
pd_status pd_gvocab_create_raw(const uint8_t *const *tok, const size_t *len, int n_vocab,
                               const int32_t *eos, int n_eos, pd_gvocab **out, pd_err *err);
void pd_gvocab_destroy(pd_gvocab *v);   /* NULL is fine */
int pd_gvocab_words(const pd_gvocab *v); /* uint32 words of a mask: (n_vocab + 31) / 32 */

/* A matcher at the grammar's start; it keeps a reference to g. */
pd_status pd_gmatch_create(pd_grammar *g, pd_gmatch **out, pd_err *err);
void pd_gmatch_destroy(pd_gmatch *m);   /* NULL is fine */
/* dst takes src's position (both of the same grammar). */
pd_status pd_gmatch_copy(pd_gmatch *dst, const pd_gmatch *src, pd_err *err);
/* Follows token tok: 1 and m moved when the grammar allows it here (an eos id: when m is
 * complete; m then stays), 0 and m unchanged when not. -1 with err set on NOMEM or when the
 * grammar's stacks exceed their bounds (PD_ERR_INVALID naming it). */
int pd_gmatch_advance(pd_gmatch *m, const pd_gvocab *v, int32_t tok, pd_err *err);
/* 1 when the text so far is a whole match (the grammar may end here). */
int pd_gmatch_complete(const pd_gmatch *m);
/* bits[pd_gvocab_words(v)]: bit t set when token t may come next (m keeps its last few masks:
 * a state met again costs a copy). */
pd_status pd_gmatch_allowed(pd_gmatch *m, const pd_gvocab *v, uint32_t *bits, pd_err *err);

#endif
