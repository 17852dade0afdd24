/* pd_verify_policy.h - how many draft tokens each request verifies per step.
 * Owns: the policies (full, threshold, scheduled = the DSpark paper's Algorithm 1 "hardware-aware
 *   prefix scheduler"), the steps-per-second curve SPS(B) they use (profiled, smoothed, cached),
 *   and the per-position confidence calibration (Sequential Temperature Scaling) with its JSON
 *   file.
 * Losslessness: any verification length is lossless (verification accepts a prefix of what it
 *   checks); the scheduler only decides how many tokens to check, from draft-side confidences.
 * Threading: pure functions on caller-owned data; a pd_sps / pd_calib is immutable once built. */
#ifndef PD_VERIFY_POLICY_H
#define PD_VERIFY_POLICY_H

#include <stdint.h>

#include "pd_status.h"

#define PD_CALIB_MAX 32

/* DEFAULT (0, what zero-initialised params hold) defers to the engine's policy, then full. */
typedef enum { PD_VERIFY_DEFAULT = 0, PD_VERIFY_FULL, PD_VERIFY_THRESHOLD, PD_VERIFY_SCHEDULED } pd_verify_policy;

pd_status pd_verify_policy_parse(const char *s, pd_verify_policy *out, pd_err *err);
const char *pd_verify_policy_name(pd_verify_policy p);

/* Per-position temperatures of the confidence logits: c_k = sigmoid(logit_k / T_k). */
typedef struct {
    int n;                       /* positions (the draft's block size); 0 = identity */
    float temp[PD_CALIB_MAX];
} pd_calib;

void pd_calib_identity(pd_calib *c, int n);
/* Reads <dir>/dspark_calibration.json when it exists: PD_ERR_NOT_FOUND when absent (callers
 * then use identity), PD_ERR_INVALID naming the field when malformed. */
pd_status pd_calib_load(const char *draft_dir, pd_calib *out, pd_err *err);
pd_status pd_calib_save(const char *path, const pd_calib *c, const double *ece_before,
                        const double *ece_after, int n_rounds_fit, pd_err *err);

/* One observation for calibration: position k's confidence logit and whether draft k was
 * accepted given that drafts 0..k-1 were (only positions reached are recorded). */
typedef struct {
    int k;
    float logit;
    int survived;
} pd_calib_obs;

/* Fits T_k per position by minimising the binary cross-entropy of sigmoid(logit / T_k) on the
 * observations of position k (golden-section search over log T in [0.05, 20]). */
void pd_calib_fit(const pd_calib_obs *obs, int n_obs, int n_pos, pd_calib *out);
/* Expected calibration error of prefix survival per position: rounds[r] holds the n_pos
 * confidence logits of a round and accepted[r] the drafts it accepted; for each k the predicted
 * a_k = prod_{i<=k} c_i is binned (10 bins) against the event "accepted > k". */
void pd_calib_ece(const float *logits, const int *accepted, int n_rounds, int n_pos, const pd_calib *c,
                  double *ece_out);

/* Steps per second of a verify step with B tokens, B = 1..max_tokens. */
typedef struct {
    int max_tokens;
    double *sps;                 /* [max_tokens + 1], sps[0] unused */
} pd_sps;

/* From measured step times (seconds) t[1..n]: the lower convex hull of (B, t(B)) made
 * non-decreasing, so jagged steps of the curve do not trap the greedy search. */
pd_status pd_sps_from_times(const double *t, int n, pd_sps *out, pd_err *err);
/* A linear model t(B) = t0 + t1 * B (used when no profile exists). */
pd_status pd_sps_linear(double t0, double t1, int n, pd_sps *out, pd_err *err);
pd_status pd_sps_load(const char *path, const char *key, pd_sps *out, pd_err *err);
pd_status pd_sps_save(const char *path, const char *key, const double *times, int n, pd_err *err);
void pd_sps_cleanup(pd_sps *s);
double pd_sps_at(const pd_sps *s, int b);

/* Chooses verification lengths. conf_logits[r * B + k]: confidence logit of draft k of request
 * r; max_len[r]: the most request r may verify (block size, or less near the context end);
 * out_len[r] in 0..max_len[r]. threshold: longest prefix with a_{r,j} >= t. scheduled:
 * Algorithm 1 - candidates (r, j) by a_{r,j} descending, admitted while the expected
 * throughput (sum_r (1 + sum_{j<=l_r} a_{r,j})) / (overhead_s + 1 / SPS(sum_r (l_r + 1)))
 * rises; stop at the first drop. overhead_s is the round's cost besides the verify step (the
 * draft round; 0 gives the paper's tau * SPS(B)). full: out_len = max_len. Returns the expected
 * accepted tokens of the chosen plan. */
double pd_verify_choose(pd_verify_policy p, int n_req, int B, const float *conf_logits, const int *max_len,
                        const pd_calib *calib, float threshold, const pd_sps *sps, double overhead_s,
                        int *out_len);

/* ---- the scheduled policy's arms ----------------------------------------------------------
 * Per round, the scheduled requests take one arm: no drafts at all (plain decoding), Algorithm
 * 1's lengths, or every draft. Algorithm 1 ranks drafts by predicted survival against the verify
 * step's cost, but a round also pays the draft round and host work, and calibration is
 * imperfect; so the controller measures what each arm really gives and takes the one with the
 * best expected tokens/s. With an SPS profile the estimate is a model fitted to those
 * measurements:
 *   rate(arm, m) = m * tau / (t_verify(m * v) + d(m) + y)
 * with tau the committed tokens and v the verify tokens per request per round of that arm,
 * t_verify = 1 / SPS, d(m) the draft round's seconds (drafting arms), and y the rest of the
 * round (draft context, host work). All four come from the arm's rounds at this batch-size class
 * (log2 of the requests in the round); a class without data takes tau, v and y interpolated in m
 * between the nearest classes below and above that have some (or the nearest one), and d from
 * the draft rounds measured nearest to m by any arm, so a batch size seen for the first time (a
 * load change, the tail of a burst) needs no trial rounds. Without a profile each class
 * measures tokens/s directly. An arm never measured is tried first; another arm is retried once
 * the time run since its last round reaches PD_SCHED_EXPLORE_K times what one of its rounds is
 * expected to lose against the best (at least a quarter of its round), so the estimates follow
 * the workload at about 1 / PD_SCHED_EXPLORE_K of the time per arm: a close runner-up every
 * few dozen rounds, a far one (a drafting round that costs many plain ones) rarely. Rounds that
 * captured a graph are kept apart (pd_sched_add). Every arm is lossless: arms only choose how
 * many drafts are verified. */
#define PD_SCHED_CLASSES 16
#define PD_SCHED_EXPLORE_K 1024.0    /* exploration: time run per expected loss of a trial (a
                                     * trial's real cost was several times its expected loss on
                                     * the tiny pair: captures, the deferred context) */
#define PD_SCHED_DECAY 0.85         /* weight of the past per recorded round: times */
#define PD_SCHED_DECAY_TAU 0.97     /* the same for tokens per request: acceptance varies a lot
                                     * from round to round, and a short memory made a drafting
                                     * arm look worse than no drafts after a few bad rounds */

typedef enum { PD_SCHED_PLAIN = 0, PD_SCHED_ALGO1, PD_SCHED_ALL, PD_SCHED_ARMS } pd_sched_arm;

/* What the recorded rounds of one arm at one class gave, as sums discounted per round: with
 * PD_SCHED_DECAY wall seconds, requests, the verify step's seconds the SPS profile predicts,
 * the draft round's seconds and rounds; with PD_SCHED_DECAY_TAU committed tokens, verify tokens
 * and requests (treq, their denominator). */
typedef struct {
    double tok, sec, req, vtok, vsec, dsec, rounds, treq;
    int n;                          /* rounds recorded */
} pd_sched_stat;

typedef struct {
    const pd_sps *sps;              /* borrowed; NULL: no model, measured rates per class */
    pd_sched_stat st[PD_SCHED_ARMS][PD_SCHED_CLASSES];
    /* the draft round per class: discounted sums of seconds, requests, rounds */
    double d_sec[PD_SCHED_CLASSES], d_req[PD_SCHED_CLASSES], d_rounds[PD_SCHED_CLASSES];
    int d_n[PD_SCHED_CLASSES];
    pd_sched_stat st_cold[PD_SCHED_ARMS][PD_SCHED_CLASSES];   /* rounds that captured or warmed
                                                               * up a graph, kept apart */
    double credit[PD_SCHED_ARMS];   /* seconds recorded since the arm's last round */
    long n_picks;
    long n_arm[PD_SCHED_ARMS];      /* picks of each arm (diagnostics) */
    long n_probes;                  /* all-drafts rounds the caller chose to try a new request
                                     * (pd_engine_sched_probe; counted in n_arm too) */
    double accept_f;                /* the round's requests' acceptance against the arms' (1: as
                                     * recorded); see pd_sched_set_accept */
    double all_tau;                 /* tokens per request the all-drafts arm is expected to give
                                     * this round's requests (< 1: its record x accept_f) */
    double switch_s;                /* what a drafting round costs now on top of its own rounds'
                                     * (pd_sched_set_switch) */
} pd_sched_ctl;

void pd_sched_init(pd_sched_ctl *c, const pd_sps *sps);
int pd_sched_class(int m);
/* The arm for a round of m requests (counted in n_arm by the caller's pd_sched_pick). */
pd_sched_arm pd_sched_pick(pd_sched_ctl *c, int m);
/* Acceptance differs a lot between requests (by content): f scales the accepted-draft part of
 * the drafting arms' tokens per request (tau' = 1 + (tau - 1) f) for the picks that follow, so
 * the caller can say how this round's requests accepted drafts so far against the arms' own
 * record (pd_engine_sched.c: each request's record, pulled toward the arm's by a prior). */
void pd_sched_set_accept(pd_sched_ctl *c, double f);
/* The all-drafts arm's tokens per request for the picks that follow, as the caller expects them
 * from the round's requests' own records (pd_engine_sched.c); it replaces the arm's record
 * scaled by f, which says nothing when that record is one token (a first round that accepted
 * nothing).
 * Reset by pd_sched_set_accept; tau < 1 unsets it. */
void pd_sched_set_all_tau(pd_sched_ctl *c, double tau);
/* A drafting round picked now first adds the context rows that rounds without drafts put off
 * (pd_engine_ctx.c); s seconds of that count in the loss of trying a drafting arm, so exploration
 * waits longer while much context waits. */
void pd_sched_set_switch(pd_sched_ctl *c, double s);
/* 1 when, at the acceptance factor set now, the all-drafts arm is expected to beat no drafts
 * for a round of m requests (both estimates known); how the engine decides to try a new
 * request with all drafts once, at the factor it would have if it accepted most drafts. */
int pd_sched_all_wins(const pd_sched_ctl *c, int m);
/* Expected tokens/s of arm a for a round of m requests; < 0 when nothing is known yet. */
double pd_sched_estimate(const pd_sched_ctl *c, pd_sched_arm a, int m);
/* What an estimate is made of (diagnostics): tokens per request per round, verify tokens per
 * round and the seconds the SPS profile gives them, the rest of the round (measured round minus
 * predicted verify minus draft), the draft round, the round and the rate (< 0: unknown), and
 * the rounds recorded in the classes used. */
typedef struct {
    double tau, verify_tok, verify_s, rest_s, draft_s, round_s, rate;
    int n;
} pd_sched_parts;
void pd_sched_parts_of(const pd_sched_ctl *c, pd_sched_arm a, int m, pd_sched_parts *p);
/* Records one round of arm a: tok committed tokens of m requests in sec seconds, of which
 * draft_sec in the draft round, v_tok tokens verified. cold: the round captured or warmed up a
 * graph; such rounds are kept apart and estimate the arm only while it has no steady round at
 * any class, and with a profile their time is the profile's verify step plus the steady draft
 * round (a batch growing one request at a time makes every round of a warm-up cold, and
 * counting their times made the arm that ran them look slow for long after). */
void pd_sched_add(pd_sched_ctl *c, pd_sched_arm a, int m, double tok, double sec, double draft_sec,
                  int v_tok, int cold);
/* One draft round of m requests took sec seconds (any policy: Algorithm 1 counts it as the
 * round's fixed cost); the seconds to expect at m (0 before any measurement). */
void pd_sched_add_draft(pd_sched_ctl *c, int m, double sec);
double pd_sched_draft_s(const pd_sched_ctl *c, int m);

#endif
