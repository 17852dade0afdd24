/* pd_engine_ctx.h - the draft context rows the engine has committed but not yet added to the
 *   draft KV (pd_engine_ctx.c).
 * Owns: deferring context rows (the deferred buffer, a request's gap of positions), adding them
 *   before a drafting round (flush), dropping them when their request ends.
 * Not here: when a round drafts (pd_engine.c, pd_engine_sched.c).
 * Threading: the engine's thread only. */
#ifndef PD_ENGINE_CTX_H
#define PD_ENGINE_CTX_H

#include "pd_engine_internal.h"

/* Which waiting rows a flush adds (pd_engine_pend_flush). */
typedef enum {
    PD_FLUSH_DRAFTING,      /* the rows of requests that draft this round (pd_request.drafting) */
    PD_FLUSH_REQUEST,       /* the rows of one request */
    PD_FLUSH_BUFFER,        /* the buffer's rows (it is full), no gaps */
} pd_flush_mode;

/* Rounds of at least this many requests leave their waiting rows as gaps (cfg.gap_min_batch,
 * default PD_GAP_MIN_BATCH). */
int pd_engine_gap_min_batch(const pd_engine *e);
/* The token at position p of r (prompt, then output). */
int32_t pd_engine_token_at(const pd_request *r, int p);

/* Adds context rows rows[0..n) of the target's aux tensor aux (at positions pos of owner[i]) to
 * the draft KV, except those of scheduled requests that do not draft now (prompt: prompt rows),
 * which wait: as their request's gap when gaps is set, else in the deferred buffer. */
pd_status pd_engine_extend_or_defer(pd_engine *e, const float *aux, const int32_t *rows, const int32_t *pos,
                                    pd_request *const *owner, int n, int prompt, int gaps, pd_err *err);
/* Adds the waiting rows mode takes (one: the request of PD_FLUSH_REQUEST) to the draft KV. */
pd_status pd_engine_pend_flush(pd_engine *e, pd_flush_mode mode, const pd_request *one, pd_err *err);
/* Forgets r's waiting rows: r ended and its draft KV goes back unread. */
void pd_engine_pend_drop(pd_engine *e, pd_request *r);
/* Seconds that adding every waiting row would take now (the scheduler's switch cost). */
double pd_engine_switch_cost(const pd_engine *e);

#endif
