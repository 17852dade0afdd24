/* pd_engine_sched.c - the engine's verification policies over a round: which policy a request
 *   follows (full, threshold, scheduled), how many drafts each verifies, and the scheduled
 *   policy's view of its requests: their acceptance (a discounted record per request), the
 *   probes that try a request with all drafts, and the per-round trace.
 * Owns: the reading of each request's acceptance record (acc_tok, acc_rounds and n_whole are
 *   written by the round in pd_engine.c), the probe counts (n_probed, the plain_streak reset),
 *   the trace's format.
 * Not here: the arm controller and Algorithm 1 (pd_verify_policy.c), the round that applies
 *   the choices (pd_engine.c).
 * Threading: the engine's thread only. */
#include "pd_engine_sched.h"

#include "pd_engine_ctx.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pd_verify_policy pd_engine_request_policy(const pd_engine *e, const pd_request *r)
{
    if (r->params.verify_policy != PD_VERIFY_DEFAULT)
        return r->params.verify_policy;
    return e->cfg.verify_policy != PD_VERIFY_DEFAULT ? e->cfg.verify_policy : PD_VERIFY_FULL;
}

/* Verification lengths from the drafts' confidences: scheduled requests are planned together
 * (Algorithm 1 over the step's batch), threshold requests one by one, full ones keep all. */
void pd_engine_choose_lengths(pd_engine *e, pd_round_slot **dslot, int n, const float *conf, double overhead_s,
                              int scheduled_all)
{
    int B = e->B;
    int *maxl = malloc((size_t)n * sizeof(int)), *len = malloc((size_t)n * sizeof(int));
    float *sc = malloc((size_t)n * B * sizeof(float));
    pd_round_slot **ss = malloc((size_t)n * sizeof(*ss));
    if (maxl == NULL || len == NULL || sc == NULL || ss == NULL)
        goto out;   /* keep full lengths: still lossless */
    int ns = 0;
    for (int j = 0; j < n; j++) {
        pd_request *r = dslot[j]->r;
        pd_verify_policy p = pd_engine_request_policy(e, r);
        if (p == PD_VERIFY_THRESHOLD) {
            float t = r->params.verify_threshold > 0.0f ? r->params.verify_threshold
                      : (e->cfg.verify_threshold > 0.0f ? e->cfg.verify_threshold : 0.5f);
            int ml = dslot[j]->l, l = ml;
            pd_verify_choose(p, 1, B, conf + (size_t)j * B, &ml, e->cfg.calib, t, NULL, 0.0, &l);
            dslot[j]->l = l;
        } else if (p == PD_VERIFY_SCHEDULED && !scheduled_all) {
            memcpy(sc + (size_t)ns * B, conf + (size_t)j * B, (size_t)B * sizeof(float));
            maxl[ns] = dslot[j]->l;
            ss[ns++] = dslot[j];
        }
    }
    if (ns > 0) {
        pd_verify_choose(PD_VERIFY_SCHEDULED, ns, B, sc, maxl, e->cfg.calib, 0.0f,
                         e->cfg.sps != NULL ? e->cfg.sps : &e->sps_default, overhead_s, len);
        for (int j = 0; j < ns; j++)
            ss[j]->l = len[j];
    }
out:
    free(maxl);
    free(len);
    free(sc);
    free(ss);
}

/* How the scheduled requests of this round accept drafts, for the drafting arms' estimates:
 * each request's tokens per whole-block round, with PD_REQ_ACCEPT_PRIOR rounds of the
 * all-drafts arm's own figure mixed in (a new request is average); a request named in hope
 * instead counts as accepting PD_PROBE_ACCEPT of its drafts. Their mean is what the all-drafts
 * arm is expected to give (pd_sched_set_all_tau); against the arm's record it scales Algorithm
 * 1's accepted part (pd_sched_set_accept; 1 while that record has accepted nothing). Returns 0
 * when the arm has no record yet (nothing set). */
int pd_engine_sched_accept(pd_engine *e, const pd_round_slot *slots, int m, const pd_request *hope)
{
    pd_sched_set_accept(&e->sched, 1.0);
    pd_sched_parts p;
    pd_sched_parts_of(&e->sched, PD_SCHED_ALL, m, &p);
    if (p.rate < 0.0)
        return 0;
    double sum = 0.0;
    int n = 0;
    for (int i = 0; i < m; i++) {
        const pd_request *r = slots[i].r;
        if (slots[i].l == 0 || pd_engine_request_policy(e, r) != PD_VERIFY_SCHEDULED)
            continue;
        sum += r == hope ? 1.0 + PD_PROBE_ACCEPT * e->B
                         : (PD_REQ_ACCEPT_PRIOR * p.tau + r->acc_tok) / (PD_REQ_ACCEPT_PRIOR + r->acc_rounds);
        n++;
    }
    if (n > 0) {
        double tau = sum / n;
        pd_sched_set_accept(&e->sched, p.tau > 1.0 + 1e-6 ? (tau - 1.0) / (p.tau - 1.0) : 1.0);
        pd_sched_set_all_tau(&e->sched, tau);
    }
    return 1;
}

/* A scheduled request that has decoded without verifying PD_PROBE_ROUNDS whole blocks is tried
 * with all drafts (up to PD_PROBE_ROUNDS times, the later ones only while its whole blocks gave
 * 1.5 tokens a round or more; again after PD_REPROBE_PLAIN rounds without drafts) when, were it
 * to accept most of them, the all-drafts arm would beat no drafts for this round's batch (one
 * request in a batch of many never tips it; alone it may): its own acceptance then steers
 * sched_accept, where it would otherwise start from the arm's record and wait for the
 * controller's next trial, typically most of a request at batch 1. Returns the request when this
 * round is such a probe (NULL when not); leaves the acceptance factor to the caller's
 * sched_accept. */
pd_request *pd_engine_sched_probe(pd_engine *e, const pd_round_slot *slots, int m)
{
    /* only small batches: there one request's acceptance moves the choice, and their rows wait
     * in the buffer; a probe of a batch whose rows wait as gaps recomputed them all (6.6 ms at
     * C = 32 on the tiny pair), and probing requests one by one there made them a third of
     * the rounds at C = 8 */
    if (m >= pd_engine_gap_min_batch(e))
        return NULL;
    for (int i = 0; i < m; i++)
        if (slots[i].r->n_gap > 0)
            return NULL;
    pd_request *cand = NULL;
    for (int i = 0; i < m && cand == NULL; i++) {
        pd_request *r = slots[i].r;
        if (slots[i].l > 0 && r->n_rounds >= 1 && pd_engine_request_policy(e, r) == PD_VERIFY_SCHEDULED &&
            ((r->n_probed < PD_PROBE_ROUNDS && r->n_whole < PD_PROBE_ROUNDS &&
              (r->n_whole == 0 || r->acc_tok >= 1.5 * r->acc_rounds)) ||
             r->plain_streak >= PD_REPROBE_PLAIN))
            cand = r;
    }
    if (cand == NULL)
        return NULL;
    if (!pd_engine_sched_accept(e, slots, m, cand))   /* no record yet: the controller tries the arm */
        return NULL;
    if (cand->n_probed < PD_PROBE_ROUNDS && cand->n_whole < PD_PROBE_ROUNDS)
        cand->n_probed++;   /* PD_PROBE_ROUNDS first chances, whatever the answers */
    else
        cand->plain_streak = 0;   /* and one per PD_REPROBE_PLAIN rounds without drafts (a
                                   * re-probe never counted as a first one: that had made the
                                   * count depend on timing, test_engine under load) */
    return e->cfg.sched_probe_always || pd_sched_all_wins(&e->sched, m) ? cand : NULL;
}

/* One line of the scheduled policy's trace (pd_engine_config.sched_trace): the round, its
 * requests, the arm (p = a probe), the estimates of the three arms at this batch and the
 * acceptance factor they were taken at, then what the round gave and took. */
void pd_engine_sched_trace(pd_engine *e, int arm, int probe, int m, uint64_t first_id, int tokens, int n_v,
                           double dt, double draft_s, double flush_s, int cold)
{
    FILE *f = e->cfg.sched_trace;
    if (!e->trace_head++)
        fprintf(f, "round m arm est_plain est_algo1 est_all accept_f tokens verify_tok round_us draft_us "
                   "flush_us cold pend_live first_id\n");
    static const char arm_name[PD_SCHED_ARMS] = { 'P', 'A', 'F' };
    fprintf(f, "%ld %d %c%s %.0f %.0f %.0f %.3f %d %d %.1f %.1f %.1f %d %d %llu\n", e->times.rounds, m,
            arm_name[arm], probe ? "p" : "", pd_sched_estimate(&e->sched, PD_SCHED_PLAIN, m),
            pd_sched_estimate(&e->sched, PD_SCHED_ALGO1, m), pd_sched_estimate(&e->sched, PD_SCHED_ALL, m),
            e->sched.accept_f, tokens, n_v, dt * 1e6, draft_s * 1e6, flush_s * 1e6, cold, e->pend_live,
            (unsigned long long)first_id);
}
