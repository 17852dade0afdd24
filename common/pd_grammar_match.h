/* pd_grammar_match.h - the vocabulary as a byte trie, and the matcher that follows a request's
 *   tokens through a grammar and gives the tokens allowed next (pd_grammar_match.c);
 *   pd_grammar.h includes it.
 * Owns: pd_gvocab and pd_gmatch.
 * Not here: making grammars (pd_grammar.h and the compilers' headers), applying a mask to
 *   logits (kern_token_mask, pd_engine_logits.c).
 * Threading: a vocabulary is immutable once built and may be shared between threads; a
 *   matcher belongs to one request. */
#ifndef PD_GRAMMAR_MATCH_H
#define PD_GRAMMAR_MATCH_H

#include <stddef.h>
#include <stdint.h>

#include "pd_status.h"
#include "pd_tokenizer.h"

typedef struct pd_grammar pd_grammar;
typedef struct pd_gvocab pd_gvocab;
typedef struct pd_gmatch pd_gmatch;

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
