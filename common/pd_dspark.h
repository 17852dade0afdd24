/* pd_dspark.h - the DSpark drafter on the backend (DESIGN.md §2).
 * Owns: the draft context KV ("KV injector": k/v projections of hidden_norm(fc(aux)) per draft
 *   layer), the non-causal draft block forward, the Markov head step (vanilla, gated, rnn) and
 *   the confidence head.
 * Not here: sampling of draft tokens (pd_sample.c), acceptance (pd_engine.c).
 * Threading: a runner is used by one thread at a time. */
#ifndef PD_DSPARK_H
#define PD_DSPARK_H

#include <stdint.h>

#include "pd_kv.h"
#include "pd_model.h"
#include "pd_qwen3.h"

typedef struct pd_draft pd_draft;

/* pool: the draft KV pool (num draft layers), borrowed. */
pd_status pd_draft_create(const pd_dspark_model *d, pd_kv_pool *pool, pd_draft **out, pd_err *err);
void pd_draft_destroy(pd_draft *d);
const pd_dspark_model *pd_draft_model(const pd_draft *d);
pd_kv_pool *pd_draft_pool(const pd_draft *d);

/* Adds context rows: aux [b->n_tok, K*hidden] (backend memory, row stride ld_aux) of the
 * committed tokens at b->pos of sequences b->seq; their k/v go into every draft layer's pages.
 * b->ids is ignored. Pages must be reserved. Up to PD_DRAFT_EXTEND_GRAPH_MAX rows are padded to a
 * graph bucket and replayed as a graph when the runner's graphs are on. */
#define PD_DRAFT_EXTEND_GRAPH_MAX 1024
pd_status pd_draft_extend(pd_draft *d, const float *aux, int ld_aux, const pd_tok_batch *b,
                          pd_err *err);
/* Like pd_draft_extend, from context features already computed elsewhere (a prefill node's
 * `ctx` aux transfer): ctx_host [b->n_tok, hidden] = hidden_norm(fc(aux)) rows in host memory. */
pd_status pd_draft_extend_ctx(pd_draft *d, const float *ctx_host, const pd_tok_batch *b, pd_err *err);
/* The draft block of n_req requests: request r's block is [anchor[r], MASK x (B-1)] at positions
 * start[r]..start[r]+B-1 over its context (positions < start[r]); pages must be reserved up to
 * start[r] + B. The block's own K/V are written into the pages at the block positions (they are
 * overwritten by context rows once tokens commit). Produces block hidden and base logits. */
pd_status pd_draft_block(pd_draft *d, int n_req, const int32_t *anchor, const int32_t *start,
                         pd_kv_seq *const *seqs, pd_err *err);
/* Markov step k (0 <= k < B) for every request of the last block: corrected logits of row k
 * given prev[r] (the anchor for k = 0, else the draft token k-1), and, when the draft has a
 * confidence head, its logits into conf_out[n_req] (host; may be NULL). The rnn state is reset
 * at k = 0. */
pd_status pd_draft_markov_step(pd_draft *d, int k, const int32_t *prev, float *conf_out, pd_err *err);

/* A whole greedy draft round on the device: the block (as pd_draft_block), then B Markov steps
 * where step k's argmax is step k+1's previous token, with one download at the end: ids_out
 * [n_req, B] (row r = request r's drafts), conf_out [n_req, B] confidence logits (nullable;
 * zeros without a confidence head). The same tokens as pd_draft_block + B x
 * (pd_draft_markov_step, argmax). Padded to a graph bucket and replayed as one graph per shape
 * when graphs are on (pd_draft_set_graphs). */
pd_status pd_draft_round_greedy(pd_draft *d, int n_req, const int32_t *anchor, const int32_t *start,
                                pd_kv_seq *const *seqs, int32_t *ids_out, float *conf_out, pd_err *err);
/* pd_graph_mode of the chained rounds (default PD_GRAPHS_AUTO). */
void pd_draft_set_graphs(pd_draft *d, int mode);
/* Adds this runner's eager runs, captures and replays to the counters. */
void pd_draft_graph_stats(const pd_draft *d, uint64_t *eager, uint64_t *captures, uint64_t *replays);
/* Runs so far that were a graph warm-up, capture or stale re-run (pd_graph_cache.n_cold). */
uint64_t pd_draft_graph_cold(const pd_draft *d);

/* Backend pointers, valid until the next call that produces them. */
const float *pd_draft_ctx_feature(const pd_draft *d);   /* [n_tok of last extend, hidden] */
const float *pd_draft_block_hidden(const pd_draft *d);  /* [n_req * B, hidden], after final norm */
const float *pd_draft_base_logits(const pd_draft *d);   /* [n_req * B, vocab] */
const float *pd_draft_step_logits(const pd_draft *d);   /* [n_req, vocab] of the last step */
/* int32 [n_req]: argmax of each row of the last step's logits (lowest index wins a tie, as
 * kern_argmax), computed in the same launch as the logits (kern_markov_step); a caller that
 * chains the Markov loop on the device can take prev from here instead of its own argmax. */
const int32_t *pd_draft_step_ids(const pd_draft *d);
/* Head internals of the last step (for tests): gated gate [n_req, rank]; rnn state [n_req, rank]. */
const float *pd_draft_head_gate(const pd_draft *d);
/* Makes d rank tp's part of a tensor-parallel group (pd_tp.h; borrowed): its model's lm_head
 * and markov_w2 are that rank's vocab slice, the step logits are all-gathered after each Markov
 * step (base logits keep only the slice); the decoder layers stay whole on every rank. */
struct pd_tp_rank;
void pd_draft_set_tp(pd_draft *d, struct pd_tp_rank *tp);
const float *pd_draft_head_state(const pd_draft *d);

#endif
