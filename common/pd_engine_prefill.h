/* pd_engine_prefill.h - the engine's prefill (pd_engine_prefill.c): its own prompts (chunked,
 *   ragged, context-parallel when cp_size > 1) and recomputes, and the completion of prompts
 *   prefilled elsewhere.
 * Owns: the CP group's creation and a request's CP page tables; the public prefill functions
 *   are declared in pd_engine.h.
 * Not here: the CP forward itself (pd_cp_prefill.c), the draft context of the rows
 *   (pd_engine_ctx.c).
 * Threading: the engine's thread only (the CP ranks' threads run inside pd_cp_group_prefill). */
#ifndef PD_ENGINE_PREFILL_H
#define PD_ENGINE_PREFILL_H

#include "pd_engine_internal.h"

/* The CP group of cfg.cp_size ranks (e->cp, cp_be, cp_pool) over a target pool of layout tl,
 * the drafter's taps captured; this thread stays on rank 0's device. Freed by
 * pd_engine_destroy, also after a failure. */
pd_status pd_engine_cp_create(pd_engine *e, const pd_kv_layout *tl, const int *taps, int n_taps,
                              pd_err *err);
/* Gives back r's pages in the CP ranks' KV replicas (held only while it is prefilled). */
void pd_engine_cp_release(pd_engine *e, pd_request *r);
/* Pages for n_tok positions of r on every CP rank but 0 (none when cp_size is 1): a prompt's at
 * admission, a recomputed request's context when it resumes. On an error none stay reserved
 * (PD_ERR_BUSY: a rank's pool is full now). */
pd_status pd_engine_cp_reserve(pd_engine *e, pd_request *r, int n_tok, pd_err *err);
/* The prefill work of one engine step, about cfg.max_prefill_tokens tokens. */
pd_status pd_engine_prefill_step(pd_engine *e, pd_err *err);

#endif
