/* pd_engine_kv.h - the engine's KV pages beyond admission (pd_engine_kv.c): the prefix
 *   cache's part, page counts, and preemption (a running request's KV to host memory and back,
 *   or given up and prefilled again).
 * Owns: what a request offers to and takes from the prefix cache, the swap space's use, the
 *   preempted requests' counts.
 * Not here: the page pools and tables (pd_kv.c), the cache's index (pd_prefix.c), reserving a
 *   round's pages (pd_engine.c).
 * Threading: the engine's thread only. */
#ifndef PD_ENGINE_KV_H
#define PD_ENGINE_KV_H

#include "pd_engine_internal.h"

/* Pages of pool that hold len positions. */
int pd_engine_pages_of(const pd_kv_pool *pool, int len);

/* Recounts the pages only the prefix cache holds (e->prefix_free: free for the asking). */
void pd_engine_prefix_count(pd_engine *e);
/* A new request takes the cached full pages its prompt starts with (r->cached, r->prefilled). */
pd_status pd_engine_prefix_take(pd_engine *e, pd_request *r, pd_err *err);
/* Offers r's full pages whose target and draft K/V are final to the prefix cache. */
void pd_engine_prefix_offer(pd_engine *e, pd_request *r);

/* r runs decode rounds (prefilled, a first token, not preempted). */
int pd_engine_request_decoding(const pd_request *r);
/* The victim when the pool runs out for reqs[i]: the running request admitted last (from i on);
 * NULL: none. */
pd_request *pd_engine_swap_victim(pd_engine *e, int i);
/* Preempts r to host memory (its waiting draft rows added first); PD_ERR_BUSY when the swap
 * space cannot take it (nothing changed then). */
pd_status pd_engine_swap_out(pd_engine *e, pd_request *r, pd_err *err);
/* Preempts r without a host copy: its KV is given up and prefilled again later. */
void pd_engine_recompute_out(pd_engine *e, pd_request *r);
/* Preempted requests resume (or get pages for their recompute) in admission order while the
 * pools have room. */
pd_status pd_engine_swap_in_waiting(pd_engine *e, pd_err *err);
/* r is preempted no more (resumed, ended or freed): its host copy goes, its counts drop. */
void pd_engine_preempt_clear(pd_engine *e, pd_request *r);

#endif
