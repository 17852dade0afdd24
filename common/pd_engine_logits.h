/* pd_engine_logits.h - the engine's per-request logits pipeline (pd_engine_logits.c).
 * Owns: the stop rules of a token, penalty / logit bias / grammar state of a request, the
 *   queued penalty entries and masks applied to a forward's logits, logprobs, and the picks on
 *   the backend (argmax, sampling, the sampled verify of a round).
 * Not here: which rows a forward has and when they are picked (pd_engine.c, pd_engine_prefill.c).
 * Threading: the engine's thread only. */
#ifndef PD_ENGINE_LOGITS_H
#define PD_ENGINE_LOGITS_H

#include "pd_engine_internal.h"

/* tok ends r: an eos (unless ignore_eos) or one of its stop_ids */
int pd_engine_token_ends(const pd_engine *e, const pd_request *r, int32_t tok);

/* Admission: r's penalty state, its sorted copy of the logit bias (PD_ERR_INVALID for a token
 * named twice) and its grammar matchers or first-token mask. NOMEM otherwise. */
pd_status pd_engine_pen_init(pd_engine *e, pd_request *r, pd_err *err);
pd_status pd_engine_bias_init(pd_request *r, pd_err *err);
pd_status pd_engine_grammar_init(pd_engine *e, pd_request *r, pd_err *err);

/* Queues the penalty / bias / min_tokens entries of logits row `row` of r, whose history is its
 * output then extra[0..n_extra); pd_engine_pen_apply applies the queue to logits (backend,
 * [*, V]) and empties it. */
pd_status pd_engine_pen_row(pd_engine *e, const pd_request *r, int row, const int32_t *extra, int n_extra,
                            pd_err *err);
pd_status pd_engine_pen_apply(pd_engine *e, const float *logits, pd_err *err);
/* Structured output and allowed_token_ids: queues a mask slot for logits row `row` (*bits:
 * its words to fill), the mask of a draft step's row of r (what r->gm_row, r's allowed tokens
 * and its bad words after the output and extra[0..n) allow; nothing queued for a request
 * without any of them), or the masks of r's rows row0 ..
 * row0 + n_extra (a verify block; with force a draft where one token only is allowed becomes
 * it); pd_engine_mask_apply applies and empties the queue. */
pd_status pd_engine_mask_slot(pd_engine *e, int row, uint32_t **bits, pd_err *err);
pd_status pd_engine_mask_step(pd_engine *e, pd_request *r, int row, const int32_t *extra, int n, pd_err *err);
pd_status pd_engine_mask_rows(pd_engine *e, pd_request *r, int row0, int32_t *extra, int n_extra, int force,
                              pd_err *err);
pd_status pd_engine_mask_apply(pd_engine *e, const float *logits, pd_err *err);

/* Appends tok to r's output (lp: its logprobs, NULL: zeros), its penalty counts and grammar
 * matcher following; PD_ERR_INVALID when the grammar refuses it. */
pd_status pd_engine_push_out(pd_request *r, int32_t tok, const pd_token_logprobs *lp, pd_err *err);

/* A logprobs entry cut to want top entries, the rest zeros. */
void pd_engine_lp_cut(pd_token_logprobs *d, int want);
/* out[i] = the logprobs of toks[i] from logits row rows[i] of dev (backend, [*, V]) with the
 * n_top likeliest; the _rows form: rows row0 .. row0 + n - 1 (n <= 64) at r's top_logprobs. */
pd_status pd_engine_logprobs_entries(pd_engine *e, const float *dev, const int32_t *rows, const int32_t *toks,
                                     int n, int n_top, pd_token_logprobs *out, pd_err *err);
pd_status pd_engine_logprobs_rows(pd_engine *e, const pd_request *r, const float *dev, int row0,
                                  const int32_t *toks, int n, pd_token_logprobs *out, pd_err *err);
/* The logprobs of the committed tokens of a round's slots (slot_accept done) from the verify
 * logits vl: *lps (malloc'd, the caller frees) request after request, off[i] = slot i's first
 * (-1: none). */
pd_status pd_engine_round_logprobs(pd_engine *e, const pd_round_slot *slots, int m, const float *vl, int *off,
                                   pd_token_logprobs **lps, pd_err *err);

/* Row-wise argmax of n rows of dev (backend, [n, V]), ids into out (host). */
pd_status pd_engine_argmax_rows(pd_engine *e, const float *dev, int n, int32_t *out, pd_err *err);
/* One token per row of logits [n, V], row i owned by owner[i] (greedy owners: the argmax),
 * distributions left at probs + i * ld_probs (backend), ids into out (host). */
pd_status pd_engine_sample_rows(pd_engine *e, const float *logits, pd_request *const *owner, int n,
                                float *probs, int ld_probs, int32_t *out, pd_err *err);
/* Rejection sampling of the round's sampled slots against the verify logits vl and the round's
 * draft distributions (e->smp_q): slots[i].acc and .next. */
pd_status pd_engine_verify_sampled(pd_engine *e, const float *vl, pd_round_slot *slots, int m, pd_err *err);

#endif
