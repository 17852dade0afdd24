/* pd_engine_sched.h - the engine's verification policies over a round (pd_engine_sched.c):
 *   each request's policy, verification lengths from the drafts' confidences, and the scheduled
 *   policy's per-request acceptance, probes and trace around its arm controller
 *   (pd_verify_policy.h).
 * Not here: the arm controller and Algorithm 1 (pd_verify_policy.c), the round (pd_engine.c).
 * Threading: the engine's thread only. */
#ifndef PD_ENGINE_SCHED_H
#define PD_ENGINE_SCHED_H

#include "pd_engine_internal.h"

/* The scheduled policy's per-request acceptance (pd_engine_sched_accept): discount per
 * whole-block round of the request, and the rounds of the arm's own figure a request starts
 * from. */
#define PD_REQ_ACCEPT_DECAY 0.9
#define PD_REQ_ACCEPT_PRIOR 2.0
/* the share of its drafts a probed request is hoped to accept, and the whole-block rounds a
 * request is probed for (pd_engine_sched_probe): one round's acceptance says little (a request that
 * accepts 3 of 7 drafts on average accepts none in about a third of its rounds) */
#define PD_PROBE_ACCEPT 0.75
#define PD_PROBE_ROUNDS 3
/* a request that ran this many rounds in a row without drafts is probed again: without drafts
 * its record never changes, and a few unlucky rounds had kept well-accepting requests off
 * drafts for the rest of their lives (batch 1 on the H200) */
#define PD_REPROBE_PLAIN 16

/* r's verification policy: its own, else the engine's, else full. */
pd_verify_policy pd_engine_request_policy(const pd_engine *e, const pd_request *r);
/* Verification lengths (dslot[j]->l) of the n drafting slots from their confidences conf
 * ([n, B]): threshold requests one by one, scheduled ones together by Algorithm 1 (unless
 * scheduled_all: every draft), full ones keep all. */
void pd_engine_choose_lengths(pd_engine *e, pd_round_slot **dslot, int n, const float *conf, double overhead_s,
                              int scheduled_all);
/* Sets the arm controller's acceptance factor and all-drafts tau from the round's scheduled
 * requests (hope: a probed request, counted as accepting PD_PROBE_ACCEPT); 0 when the
 * all-drafts arm has no record yet (nothing set). */
int pd_engine_sched_accept(pd_engine *e, const pd_round_slot *slots, int m, const pd_request *hope);
/* The request this round probes with all drafts, or NULL. */
pd_request *pd_engine_sched_probe(pd_engine *e, const pd_round_slot *slots, int m);
/* One line of cfg.sched_trace for a round of scheduled requests. */
void pd_engine_sched_trace(pd_engine *e, int arm, int probe, int m, uint64_t first_id, int tokens, int n_v,
                           double dt, double draft_s, double flush_s, int cold);

#endif
