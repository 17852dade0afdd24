/* test_sampling.c - sampling and lossless speculative sampling.
 * 1. pd_sample units: params validation, greedy tie rule, min-p / top-k / top-p filtering
 *    (vLLM's meaning: top-k keeps the k-th's ties, top-p runs over the candidates renormalised;
 *    held to a plain rewrite of vLLM's steps on random rows), typical-p after them (held to a
 *    plain rewrite of transformers' TypicalLogitsWarper on the same rows; 1 is off, a tiny one
 *    keeps the most typical token alone, ties go by index, the mode can drop), the logarithm
 *    typical-p shares between backends against libm's, seeded reproducibility; the CPU
 *    backend's sampling ops (kern_probs, kern_sample) give bit for bit what pd_sample.c gives,
 *    and its row rule (no whole-row sort) bit for bit what a whole-row sort gives;
 *    kern_logprobs' rank on the backend under test is a brute-force count.
 * 2. kern_spec_verify on the backend under test, on synthetic distributions: the first
 *    committed token of a round is distributed as the target p, whatever the draft q, and the
 *    second as p_1 given the first draft token's acceptance (chi-square, fixed seed).
 * 3. End to end on the tiny pair on the backend under test (the engine samples with the
 *    backend's ops): the second generated token (the first one a speculative round commits)
 *    follows the target's distribution given the first, over many seeded runs (chi-square,
 *    fixed seeds), at temperature 1, with top-k / top-p, with min-p and with typical-p; the first
 *    token follows the prefill distribution.
 * Usage: test_sampling [--backend cpu|cuda]; cuda without a GPU exits 77 (skipped).
 *        test_sampling --perf-probs: the CPU row rule's time per row at Qwen3's vocabulary. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kern_backend.h"
#include "pd_engine.h"
#include "pd_sample.h"
#include "test_util.h"

static const char *backend_name = "cpu";

/* chi-square statistic over bins with expectation >= 5; the rest pooled into one bin */
static double chi_square(const long *obs, const double *p, int n, long total, int *df_out)
{
    double chi = 0.0, rest_e = 0.0;
    long rest_o = 0;
    int bins = 0;
    for (int i = 0; i < n; i++) {
        double e = p[i] * total;
        if (e >= 5.0) {
            chi += (obs[i] - e) * (obs[i] - e) / e;
            bins++;
        } else {
            rest_e += e;
            rest_o += obs[i];
        }
    }
    if (rest_e >= 5.0) {
        chi += (rest_o - rest_e) * (rest_o - rest_e) / rest_e;
        bins++;
    } else if (rest_o > 10) {
        chi += 1e9;   /* mass where the reference has almost none */
    }
    *df_out = bins - 1;
    return chi;
}

/* critical value of chi-square at alpha = 1e-3 (Wilson-Hilferty) */
static double chi_crit(int df)
{
    if (df < 1)
        return 0.0;
    double z = 3.090, a = 2.0 / (9.0 * df);
    double c = 1.0 - a + z * sqrt(a);
    return df * c * c * c;
}

static void test_sampling_units(void)
{
    pd_err err;
    pd_sample_params ok = { .temperature = 0.7f, .top_k = 0, .top_p = 1.0f };
    TEST_CHECK(pd_sample_params_check(&ok, &err) == PD_OK);
    pd_sample_params bad = ok;
    bad.temperature = -1.0f;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "temperature"));
    bad = ok;
    bad.top_p = 0.0f;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "top_p"));
    bad = ok;
    bad.top_k = -2;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "top_k"));
    bad = ok;
    bad.temperature = NAN;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID);

    float tie[5] = {1.0f, 3.0f, 2.0f, 3.0f, 0.0f};
    TEST_CHECK(pd_argmax(tie, 5) == 1);   /* lowest index wins a tie */

    float logits[6] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f}, probs[6];
    int32_t scratch[6];
    pd_sample_params k2 = { .temperature = 1.0f, .top_k = 2, .top_p = 1.0f };
    pd_probs_from_logits(logits, 6, &k2, probs, scratch, NULL);
    TEST_CHECK(probs[0] == 0.0f && probs[3] == 0.0f && probs[4] > 0.0f && probs[5] > probs[4]);
    TEST_CHECK(fabsf(probs[4] + probs[5] - 1.0f) < 1e-6f);
    pd_sample_params p5 = { .temperature = 1.0f, .top_k = 0, .top_p = 0.5f };
    pd_probs_from_logits(logits, 6, &p5, probs, scratch, NULL);
    TEST_CHECK(probs[5] == 1.0f);   /* the top token alone holds 0.63 >= 0.5 */
    pd_sample_params g = { .temperature = 0.0f, .top_p = 1.0f };
    pd_probs_from_logits(logits, 6, &g, probs, scratch, NULL);
    TEST_CHECK(probs[5] == 1.0f && probs[0] == 0.0f);
    /* top-k keeps the k-th's ties (vLLM, transformers): 5, and both 3s for k = 2 */
    float tied[6] = {0.0f, 1.0f, 2.0f, 3.0f, 3.0f, 5.0f};
    pd_probs_from_logits(tied, 6, &k2, probs, scratch, NULL);
    TEST_CHECK(probs[3] > 0.0f && probs[3] == probs[4] && probs[5] > probs[3] && probs[2] == 0.0f);
    TEST_CHECK(fabsf(probs[3] + probs[4] + probs[5] - 1.0f) < 1e-6f);
    /* top-p over the top-k candidates renormalised: 5 alone holds e / (e + 1) = 0.731 of the
     * two, but only 0.717 of the whole row; top_p 0.72 keeps it alone */
    pd_sample_params kp = { .temperature = 1.0f, .top_k = 2, .top_p = 0.72f };
    pd_probs_from_logits(logits, 6, &kp, probs, scratch, NULL);
    TEST_CHECK(probs[5] == 1.0f && probs[4] == 0.0f);
    kp.top_p = 0.74f;
    pd_probs_from_logits(logits, 6, &kp, probs, scratch, NULL);
    TEST_CHECK(probs[5] > 0.7f && probs[4] > 0.2f && probs[3] == 0.0f);
    /* min_p: p_4 / p_5 = e^-1 = 0.37 stays at 0.3, p_3 / p_5 = 0.14 goes */
    pd_sample_params mp = { .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.3f };
    pd_probs_from_logits(logits, 6, &mp, probs, scratch, NULL);
    TEST_CHECK(probs[5] > 0.0f && probs[4] > 0.0f && probs[3] == 0.0f && probs[0] == 0.0f);
    TEST_CHECK(fabsf(probs[4] + probs[5] - 1.0f) < 1e-6f);
    mp.min_p = 0.37f;   /* just above e^-1: the top token alone */
    pd_probs_from_logits(logits, 6, &mp, probs, scratch, NULL);
    TEST_CHECK(probs[5] == 1.0f);
    bad = ok;
    bad.min_p = 1.5f;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "min_p"));
    bad.min_p = -0.1f;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "min_p"));
    bad = ok;
    bad.typical_p = 1.5f;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "typical_p"));
    bad.typical_p = -0.1f;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "typical_p"));
    bad.typical_p = NAN;
    TEST_CHECK(pd_sample_params_check(&bad, &err) == PD_ERR_INVALID && strstr(err.msg, "typical_p"));
    pd_sample_params typ = ok;
    for (int i = 0; i < 3; i++) {
        typ.typical_p = (float[]){ 0.0f, 0.5f, 1.0f }[i];   /* 0 = unset, 1 = off */
        TEST_CHECK(pd_sample_params_check(&typ, &err) == PD_OK);
    }

    pd_rng a, b;
    pd_rng_seed(&a, 42);
    pd_rng_seed(&b, 42);
    int same = 1;
    for (int i = 0; i < 100; i++)
        same &= pd_rng_next(&a) == pd_rng_next(&b);
    TEST_CHECK(same);
    double u = pd_rng_uniform(&a);
    TEST_CHECK(u >= 0.0 && u < 1.0);
}

/* transformers' TypicalLogitsWarper as it reads, independently of the engine's, on a
 * distribution q (the filters before it applied, renormalised), in place: the entropy
 * H = -sum q log q (libm's log, double), each token's score |-log q - H|, a sort by (score,
 * index), then the tokens up to and including the first whose running sum (of q over their
 * total, long double) reaches typical_p, renormalised. */
typedef struct { double score; int32_t tok; } plain_scored;
static int plain_score_asc(const void *a, const void *b)
{
    const plain_scored *x = a, *y = b;
    if (x->score != y->score)
        return x->score < y->score ? -1 : 1;
    return x->tok - y->tok;
}

static void typical_plain(float *q, int n, float typical_p)
{
    plain_scored *s = malloc((size_t)n * sizeof(*s));
    double h = 0.0;
    long double total = 0.0L;
    int m = 0;
    for (int i = 0; i < n; i++)
        if (q[i] > 0.0f) {
            h -= (double)q[i] * log((double)q[i]);
            total += q[i];
        }
    for (int i = 0; i < n; i++)
        if (q[i] > 0.0f)
            s[m++] = (plain_scored){ fabs(-log((double)q[i]) - h), i };
    qsort(s, (size_t)m, sizeof(*s), plain_score_asc);
    long double run = 0.0L;
    int keep = m;
    for (int i = 0; i < m; i++) {
        run += q[s[i].tok];
        if (run / total >= (long double)typical_p) {
            keep = i + 1;
            break;
        }
    }
    for (int i = keep; i < m; i++)
        q[s[i].tok] = 0.0f;
    for (int i = 0; i < keep; i++)
        q[s[i].tok] = (float)(q[s[i].tok] / run);
    free(s);
}

/* vLLM's filters as vLLM writes them, independently of the engine's: a mask per step over the
 * whole row (min-p against the max p, top-k against the k-th largest value, both in p), then
 * top-p over the candidates renormalised, by an ascending sort and a running sum of the
 * normalised values that drops what stays <= 1 - top_p (the largest never); long double; then
 * typical_plain when typical_p is on. p: the tempered softmax (no filter); out: the result;
 * order: n ints. */
static const float *plain_p;
static int plain_asc(const void *a, const void *b)
{
    int ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    if (plain_p[ia] != plain_p[ib])
        return plain_p[ia] < plain_p[ib] ? -1 : 1;
    return ib - ia;   /* equal values: the higher index first, so the lower survives longer */
}

static void probs_plain(const float *p, int n, const pd_sample_params *sp, float *out, int32_t *order)
{
    float pmax = 0.0f;
    for (int i = 0; i < n; i++)
        pmax = p[i] > pmax ? p[i] : pmax;
    plain_p = p;
    for (int i = 0; i < n; i++)
        order[i] = i;
    qsort(order, (size_t)n, sizeof(int32_t), plain_asc);
    float kth = sp->top_k > 0 && sp->top_k < n ? p[order[n - sp->top_k]] : 0.0f;
    int m = 0;
    for (int i = 0; i < n; i++) {
        int t = order[i];
        int cand = p[t] >= kth && (sp->min_p <= 0.0f || (double)p[t] >= (double)sp->min_p * pmax);
        if (cand)
            order[m++] = t;   /* still ascending */
        out[t] = 0.0f;
    }
    long double mass = 0.0L, run = 0.0L, kept = 0.0L;
    for (int i = 0; i < m; i++)
        mass += p[order[i]];
    int first = 0;
    if (sp->top_p < 1.0f)
        for (; first < m - 1; first++) {
            run += p[order[first]] / mass;
            if (run > 1.0L - (long double)sp->top_p)
                break;
        }
    for (int i = first; i < m; i++)
        kept += p[order[i]];
    for (int i = first; i < m; i++)
        out[order[i]] = (float)(p[order[i]] / kept);
    if (sp->typical_p > 0.0f && sp->typical_p < 1.0f)
        typical_plain(out, n, sp->typical_p);
}

/* typical-p's edge cases on pd_probs_from_logits (the host rule), and kern_typical_log (the
 * logarithm every backend shares) against libm's */
static void test_sampling_typical(void)
{
    enum { N = 2000 };
    pd_rng rng;
    pd_rng_seed(&rng, 7);
    double worst = 0.0;
    for (int i = 0; i < 200000; i++) {
        /* q over (0, 2): the typical-p arguments, from 2^-60 up, a few ulps above 1 included */
        double x = i % 4 == 0 ? pd_rng_uniform(&rng) * 2.0 : ldexp(pd_rng_uniform(&rng) + 0.5, -(i % 61));
        if (x <= 0.0)
            continue;
        double a = kern_typical_log(x), b = log(x);
        double err = fabs(a - b) / fmax(fabs(b), 1e-300);
        if (b == 0.0)
            err = fabs(a);
        worst = fmax(worst, err);
    }
    printf("kern_typical_log: worst relative error %.3g against libm over (0, 2)\n", worst);
    TEST_CHECK_MSG(worst < 1e-15, "kern_typical_log is off libm's log by %.3g", worst);
    TEST_CHECK(kern_typical_log(1.0) == 0.0 && kern_typical_log(0.5) == -log(2.0));

    float *x = malloc((size_t)N * sizeof(float)), *a = malloc((size_t)N * sizeof(float));
    float *b = malloc((size_t)N * sizeof(float));
    int32_t *scratch = malloc((size_t)N * sizeof(int32_t));
    double *dscratch = malloc((size_t)N * sizeof(double));
    for (int i = 0; i < N; i++)
        x[i] = (float)(pd_rng_uniform(&rng) * 8.0 - 4.0);
    /* 1 and 0 (unset) are off: the same bits as no typical_p, with and without other filters */
    static const pd_sample_params base[3] = {
        { .temperature = 1.0f, .top_p = 1.0f }, { .temperature = 0.8f, .top_k = 100, .top_p = 0.9f },
        { .temperature = 1.3f, .top_p = 1.0f, .min_p = 0.05f },
    };
    for (int k = 0; k < 3; k++) {
        pd_sample_params off = base[k], one = base[k];
        one.typical_p = 1.0f;
        pd_probs_from_logits(x, N, &off, a, scratch, NULL);
        pd_probs_from_logits(x, N, &one, b, scratch, dscratch);
        TEST_CHECK_MSG(memcmp(a, b, (size_t)N * sizeof(float)) == 0, "typical_p 1 changes kind %d", k);
    }
    /* a tiny typical_p keeps exactly one token: the one whose surprisal is nearest the entropy */
    pd_sample_params tiny = { .temperature = 1.0f, .top_p = 1.0f, .typical_p = 1e-7f };
    pd_probs_from_logits(x, N, &tiny, a, scratch, dscratch);
    pd_sample_params soft = { .temperature = 1.0f, .top_p = 1.0f };
    pd_probs_from_logits(x, N, &soft, b, scratch, NULL);
    double h = 0.0;
    for (int i = 0; i < N; i++)
        h -= (double)b[i] * log((double)b[i]);
    int kept = 0, one_tok = -1, best = 0;
    for (int i = 0; i < N; i++) {
        if (a[i] > 0.0f) {
            kept++;
            one_tok = i;
        }
        if (fabs(-log((double)b[i]) - h) < fabs(-log((double)b[best]) - h))
            best = i;
    }
    TEST_CHECK_MSG(kept == 1 && one_tok == best && a[one_tok] == 1.0f,
                   "typical_p 1e-7 keeps %d tokens (token %d), the most typical is %d", kept, one_tok, best);
    /* greedy stays greedy */
    pd_sample_params g = { .temperature = 0.0f, .top_p = 1.0f, .typical_p = 0.3f };
    pd_probs_from_logits(x, N, &g, a, scratch, dscratch);
    TEST_CHECK(a[pd_argmax(x, N)] == 1.0f);
    /* ties go by index: a uniform row has every score equal, so typical_p 0.5 of 4 (masses
     * exact) keeps tokens 0 and 1; of 8, 0.25 keeps 0 and 1 too */
    float flat[8] = {2.0f, 2.0f, 2.0f, 2.0f, 2.0f, 2.0f, 2.0f, 2.0f}, pf[8];
    pd_sample_params half = { .temperature = 1.0f, .top_p = 1.0f, .typical_p = 0.5f };
    pd_probs_from_logits(flat, 4, &half, pf, scratch, dscratch);
    TEST_CHECK(pf[0] == 0.5f && pf[1] == 0.5f && pf[2] == 0.0f && pf[3] == 0.0f);
    half.typical_p = 0.25f;
    pd_probs_from_logits(flat, 8, &half, pf, scratch, dscratch);
    TEST_CHECK(pf[0] == 0.5f && pf[1] == 0.5f && pf[2] == 0.0f && pf[7] == 0.0f);
    /* unlike top-p it may drop the mode: logit 3 and fifty 0s give the mode q 0.287
     * (surprisal 1.25) and the rest 0.0143 each (4.25) around H = 3.39, so the flat tokens
     * come first and 36 of them (the lowest indices) reach 0.5 (35 hold 0.499) */
    float mode[51];
    mode[0] = 3.0f;
    for (int i = 1; i < 51; i++)
        mode[i] = 0.0f;
    half.typical_p = 0.5f;
    pd_probs_from_logits(mode, 51, &half, a, scratch, dscratch);
    kept = 0;
    for (int i = 0; i < 51; i++)
        kept += a[i] > 0.0f;
    TEST_CHECK_MSG(a[0] == 0.0f && kept == 36 && a[36] > 0.0f && a[37] == 0.0f && fabsf(a[1] - 1.0f / 36) < 1e-6f,
                   "typical_p 0.5 over a mode and a flat bulk: mode %g, %d kept", (double)a[0], kept);
    free(x);
    free(a);
    free(b);
    free(scratch);
    free(dscratch);
}

/* kern_probs (cpu, which pd_probs_from_logits is) against probs_plain on random rows, ties
 * included: the same tokens kept, the same values to rounding; the CPU backend's other sampling
 * ops against pd_sample.c bit for bit (they are the reference the CUDA ops are held to). */
static void test_sampling_cpu_ops(void)
{
    enum { N = 3001, KINDS = 13, ROWS = 2 * KINDS };
    pd_err err;
    kern_backend *cpu = NULL;
    kern_backend_config bc = { .name = "cpu" };
    if (kern_backend_create(&bc, &cpu, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "cpu backend: %s", err.msg);
        return;
    }
    static const pd_sample_params kinds[KINDS] = {
        { .temperature = 0.0f, .top_p = 1.0f }, { .temperature = 1.0f, .top_p = 1.0f },
        { .temperature = 0.7f, .top_k = 40, .top_p = 1.0f }, { .temperature = 1.2f, .top_p = 0.8f },
        { .temperature = 0.9f, .top_k = 300, .top_p = 0.95f }, { .temperature = 2.0f, .top_k = 1, .top_p = 0.5f },
        { .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.05f },
        { .temperature = 0.8f, .top_k = 50, .top_p = 0.9f, .min_p = 0.1f },
        { .temperature = 1.0f, .top_p = 1.0f, .typical_p = 0.9f },
        { .temperature = 1.5f, .top_p = 1.0f, .typical_p = 0.2f },
        { .temperature = 0.9f, .top_k = 300, .top_p = 0.95f, .typical_p = 0.5f },
        { .temperature = 1.2f, .top_p = 1.0f, .min_p = 0.02f, .typical_p = 0.8f },
        { .temperature = 0.0f, .top_p = 1.0f, .typical_p = 0.3f },   /* greedy stays greedy */
    };
    pd_rng rng;
    pd_rng_seed(&rng, 99);
    float *x = malloc((size_t)ROWS * N * sizeof(float)), *ref = malloc((size_t)ROWS * N * sizeof(float));
    float *got = malloc((size_t)ROWS * N * sizeof(float));
    float *base = malloc((size_t)N * sizeof(float));
    int32_t *scratch = malloc((size_t)N * sizeof(int32_t)), ids[ROWS];
    double *dscratch = malloc((size_t)N * sizeof(double));
    kern_sample_cfg cfg[ROWS];
    double u[ROWS];
    int plain_same = 1;
    for (int r = 0; r < ROWS; r++) {
        for (int i = 0; i < N; i++) {
            float v = (float)(pd_rng_uniform(&rng) * 8.0 - 4.0);
            x[(size_t)r * N + i] = r % 2 ? (float)(int)(v * 2.0f) * 0.5f : v;   /* odd rows tie */
        }
        const pd_sample_params *sp = &kinds[(r / 2) % KINDS];
        cfg[r] = (kern_sample_cfg){ .temperature = pd_sample_is_greedy(sp) ? 0.0f : sp->temperature,
                                    .top_k = sp->top_k, .top_p = sp->top_p, .min_p = sp->min_p,
                                    .typical_p = sp->typical_p };
        pd_probs_from_logits(x + (size_t)r * N, N, sp, ref + (size_t)r * N, scratch, dscratch);
        u[r] = pd_rng_uniform(&rng);
        if (pd_sample_is_greedy(sp))
            continue;
        pd_sample_params soft = { .temperature = sp->temperature, .top_p = 1.0f };
        pd_probs_from_logits(x + (size_t)r * N, N, &soft, base, scratch, NULL);
        probs_plain(base, N, sp, got, scratch);
        int kept = 0;
        for (int i = 0; i < N; i++) {
            float a = ref[(size_t)r * N + i], b = got[i];
            kept += a > 0.0f;
            if ((a > 0.0f) != (b > 0.0f) || fabsf(a - b) > 1e-6f * b) {
                TEST_CHECK_MSG(0, "row %d (T %g k %d p %g min_p %g typical_p %g) token %d: %g, vLLM's and "
                               "transformers' steps %g", r, (double)sp->temperature, sp->top_k, (double)sp->top_p,
                               (double)sp->min_p, (double)sp->typical_p, i, (double)a, (double)b);
                plain_same = 0;
                break;
            }
        }
        if (sp->top_k != 1 && (sp->top_k > 1 || sp->top_p < 1.0f || sp->min_p > 0.0f || sp->typical_p > 0.0f))
            TEST_CHECK_MSG(kept > 1 && kept < N, "row %d keeps %d of %d: the filter is not exercised", r, kept, N);
    }
    TEST_CHECK_MSG(plain_same, "pd_probs_from_logits differs from vLLM's and transformers' steps");
    free(base);
    kern_probs_args pa = { .x = x, .ld_x = N, .cfg = cfg, .rows = ROWS, .n = N, .out = got, .ld_out = N };
    TEST_CHECK(kern_probs(cpu, &pa, &err) == PD_OK);
    TEST_CHECK_MSG(memcmp(got, ref, (size_t)ROWS * N * sizeof(float)) == 0,
                   "kern_probs (cpu) differs from pd_probs_from_logits");
    kern_sample_args sa = { .probs = ref, .ld = N, .rows = ROWS, .n = N, .u = u, .out = ids };
    TEST_CHECK(kern_sample(cpu, &sa, &err) == PD_OK);
    int same = 1;
    for (int r = 0; r < ROWS; r++) {
        pd_rng a, b;
        pd_rng_seed(&a, 1000 + r);
        b = a;
        double ur = pd_rng_uniform(&b);
        int32_t want = pd_sample_from_probs(ref + (size_t)r * N, N, &a), t;
        kern_sample_args one = { .probs = ref + (size_t)r * N, .ld = N, .rows = 1, .n = N, .u = &ur, .out = &t };
        TEST_CHECK(kern_sample(cpu, &one, &err) == PD_OK);
        same &= t == want;
    }
    TEST_CHECK_MSG(same, "kern_sample (cpu) differs from pd_sample_from_probs");
    free(x);
    free(ref);
    free(got);
    free(scratch);
    free(dscratch);
    kern_backend_destroy(cpu);
}

/* The fixed-point rule of kern_backend.h in its first form, which sorted every row whole by
 * (p descending, index ascending) before each cut: kern_probs_row_host now finds the same cuts
 * with one quickselect and a bucketed sort of top-p's head, and must give these bits. */
static const float *sorted_p;
static int sorted_desc(const void *a, const void *b)
{
    int ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    if (sorted_p[ia] != sorted_p[ib])
        return sorted_p[ia] < sorted_p[ib] ? 1 : -1;
    return ia - ib;
}
static const double *sorted_score;
static int sorted_score_asc(const void *a, const void *b)
{
    int ia = *(const int32_t *)a, ib = *(const int32_t *)b;
    if (sorted_score[ia] != sorted_score[ib])
        return sorted_score[ia] < sorted_score[ib] ? -1 : 1;
    return ia - ib;
}
static uint64_t sorted_mass(float p)
{
    return (uint64_t)llrint(ldexp((double)p, 60));
}

static void probs_sorted(const float *x, int n, const kern_sample_cfg *c, float *p, int32_t *order, double *score)
{
    if (c->temperature < 1e-5f) {
        int best = 0;
        for (int i = 1; i < n; i++)
            best = x[i] > x[best] ? i : best;
        memset(p, 0, (size_t)n * sizeof(float));
        p[best] = 1.0f;
        return;
    }
    float mx = x[0];
    for (int i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        double e = exp(((double)x[i] - mx) / c->temperature);
        p[i] = (float)e;
        sum += e;
    }
    for (int i = 0; i < n; i++)
        p[i] = (float)(p[i] / sum);
    const int k = c->top_k > 0 && c->top_k < n ? c->top_k : n;
    const int use_p = c->top_p < 1.0f, use_m = c->min_p > 0.0f, use_t = c->typical_p > 0.0f && c->typical_p < 1.0f;
    if (k == n && !use_p && !use_m && !use_t)
        return;
    for (int i = 0; i < n; i++)
        order[i] = i;
    sorted_p = p;
    qsort(order, (size_t)n, sizeof(int32_t), sorted_desc);
    int cand = n;
    if (k < n)
        for (cand = k; cand < n && p[order[cand]] == p[order[k - 1]]; cand++)
            ;
    if (use_m) {
        const double thr = (double)c->min_p * (double)p[order[0]];
        int m = 0;
        while (m < cand && (double)p[order[m]] >= thr)
            m++;
        cand = m;
    }
    uint64_t mass = 0, kept, run = 0;
    for (int i = 0; i < cand; i++)
        mass += sorted_mass(p[order[i]]);
    int keep = cand;
    kept = mass;
    if (use_p) {
        const uint64_t target = (uint64_t)ceil((double)c->top_p * (double)mass);
        for (int i = 0; i < cand; i++) {
            run += sorted_mass(p[order[i]]);
            if (run >= target) {
                keep = i + 1;
                kept = run;
                break;
            }
        }
    }
    if (use_t) {
        const double kd = ldexp((double)kept, -60);
        long long hsum = 0;
        for (int i = 0; i < keep; i++)
            if (p[order[i]] > 0.0f)
                hsum += kern_typical_term(p[order[i]], kd);
        const double h = kern_typical_entropy(hsum);
        for (int i = 0; i < keep; i++)
            score[order[i]] = p[order[i]] > 0.0f ? kern_typical_score(p[order[i]], kd, h) : INFINITY;
        sorted_score = score;
        qsort(order, (size_t)keep, sizeof(int32_t), sorted_score_asc);
        const uint64_t target = (uint64_t)ceil((double)c->typical_p * (double)kept);
        run = 0;
        for (int i = 0; i < keep; i++) {
            run += sorted_mass(p[order[i]]);
            if (run >= target) {
                kept = run;
                keep = i + 1;
                break;
            }
        }
    }
    const double kept_d = ldexp((double)kept, -60);
    for (int i = keep; i < n; i++)
        p[order[i]] = 0.0f;
    for (int i = 0; i < keep; i++)
        p[order[i]] = (float)((double)p[order[i]] / kept_d);
}

/* kern_probs_row_host against the whole-row sort, bit for bit: rows of 1 to 5000 tokens
 * (logits spread, tied on a grid, or mostly equal), every filter alone and together at random
 * settings and at their edges (top_k 1 and n - 1, top_p just under 1, min_p 1) */
static void test_sampling_probs_sorted(void)
{
    enum { NMAX = 5000, ROWS = 600 };
    float *x = malloc(NMAX * sizeof(float)), *a = malloc(NMAX * sizeof(float)), *b = malloc(NMAX * sizeof(float));
    int32_t *order = malloc(NMAX * sizeof(int32_t));
    double *score = malloc(NMAX * sizeof(double));
    pd_rng rng;
    pd_rng_seed(&rng, 2026);
    int same = 0, filtered = 0;
    for (int r = 0; r < ROWS; r++) {
        const int n = r < 40 ? 1 + r : 1 + (int)(pd_rng_uniform(&rng) * NMAX);
        const int shape = r % 3;
        for (int i = 0; i < n; i++) {
            float v = (float)(pd_rng_uniform(&rng) * 12.0 - 6.0);
            x[i] = shape == 0 ? v : shape == 1 ? (float)(int)(v * 2.0f) * 0.5f : (pd_rng_uniform(&rng) < 0.9 ? 1.0f : v);
        }
        kern_sample_cfg c = { .temperature = (float)(0.3 + pd_rng_uniform(&rng) * 1.7), .top_p = 1.0f };
        const int f = (int)(pd_rng_uniform(&rng) * 16);   /* which filters: bits k, p, min-p, typical */
        if (f & 1)
            c.top_k = r % 7 == 0 ? 1 : r % 7 == 1 ? n - 1 : 1 + (int)(pd_rng_uniform(&rng) * n);
        if (f & 2)
            c.top_p = r % 5 == 0 ? 0.99999994f : (float)(0.05 + pd_rng_uniform(&rng) * 0.94);
        if (f & 4)
            c.min_p = r % 11 == 0 ? 1.0f : (float)(pd_rng_uniform(&rng) * 0.3);
        if (f & 8)
            c.typical_p = (float)(0.05 + pd_rng_uniform(&rng) * 0.9);
        kern_probs_row_host(x, n, &c, a, order, score);
        probs_sorted(x, n, &c, b, order, score);
        int eq = memcmp(a, b, (size_t)n * sizeof(float)) == 0;
        same += eq;
        int kept = 0;
        for (int i = 0; i < n; i++)
            kept += a[i] > 0.0f;
        filtered += kept < n;
        if (!eq)
            TEST_CHECK_MSG(0, "row %d (n %d, T %g, k %d, p %.8g, min_p %g, typical_p %g) differs from the whole-row sort",
                           r, n, (double)c.temperature, c.top_k, (double)c.top_p, (double)c.min_p,
                           (double)c.typical_p);
    }
    printf("kern_probs_row_host: %d of %d rows equal to the whole-row sort bit for bit (%d filtered)\n", same,
           ROWS, filtered);
    TEST_CHECK(same == ROWS && filtered > ROWS / 2);
    free(x);
    free(a);
    free(b);
    free(order);
    free(score);
}

/* --perf-probs: kern_probs_row_host's time per row over Qwen3's vocabulary (151936 tokens,
 * Gumbel-spread logits, fresh each run, best of 15), per filter, against the whole-row sort it
 * replaced (probs_sorted); prints only (timings are not asserted: docs/BENCHMARKS.md holds
 * them). */
static void perf_probs(void)
{
    enum { N = 151936, RUNS = 15 };
    float *x = malloc(N * sizeof(float)), *p = malloc(N * sizeof(float));
    int32_t *order = malloc(N * sizeof(int32_t));
    double *score = malloc(N * sizeof(double));
    const kern_sample_cfg cfgs[] = { { .temperature = 0.8f, .top_p = 0.95f },
                                     { .temperature = 0.7f, .top_k = 50, .top_p = 1.0f },
                                     { .temperature = 1.0f, .top_p = 1.0f, .min_p = 0.05f },
                                     { .temperature = 1.0f, .top_p = 1.0f, .typical_p = 0.9f } };
    const char *names[] = { "top_p 0.95", "top_k 50", "min_p 0.05", "typical_p 0.9" };
    pd_rng rng;
    pd_rng_seed(&rng, 7);
    for (int c = 0; c < 4; c++) {
        double best = 1e9, best_sorted = 1e9;
        for (int r = 0; r < RUNS; r++) {
            for (int i = 0; i < N; i++)
                x[i] = (float)(-3.0 * log(-log(pd_rng_uniform(&rng) * (1.0 - 1e-12) + 1e-12)));
            double t0 = test_now_ms();
            kern_probs_row_host(x, N, &cfgs[c], p, order, score);
            double t1 = test_now_ms();
            probs_sorted(x, N, &cfgs[c], p, order, score);
            double t2 = test_now_ms();
            best = t1 - t0 < best ? t1 - t0 : best;
            best_sorted = t2 - t1 < best_sorted ? t2 - t1 : best_sorted;
        }
        printf("%d tokens, %-13s: kern_probs_row_host %6.2f ms per row, the whole-row sort %6.2f ms (best of %d)\n",
               N, names[c], best, best_sorted, RUNS);
    }
    free(x);
    free(p);
    free(order);
    free(score);
}

/* kern_logprobs on the backend under test: each entry's rank against a brute-force count of the
 * row's logits at or above the token's (kern_backend.h: ties rank the token behind all of them,
 * -inf tokens rank last), and its logprob against a plain log_softmax in double. Rows with ties
 * (odd) and a masked stretch (every third); per row the argmax, a token tied with another, a
 * masked one and random ones, so each case of the rule is met. */
static void test_sampling_logprobs_rank(void)
{
    enum { N = 3001, ROWS = 12, PER = 6, M = ROWS * PER, TOP = 5 };
    pd_err err;
    kern_backend *be = NULL;
    kern_backend_config bc = { .name = backend_name };
    if (kern_backend_create(&bc, &be, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "backend %s: %s", backend_name, err.msg);
        return;
    }
    pd_rng rng;
    pd_rng_seed(&rng, 2718);
    float *x = malloc((size_t)ROWS * N * sizeof(float));
    int32_t rows[M], toks[M];
    for (int r = 0; r < ROWS; r++) {
        float *xr = x + (size_t)r * N;
        for (int i = 0; i < N; i++) {
            float v = (float)(pd_rng_uniform(&rng) * 8.0 - 4.0);
            xr[i] = r % 2 ? (float)(int)(v * 4.0f) * 0.25f : v;
        }
        if (r % 3 == 2)
            for (int i = N / 4; i < N / 2; i++)
                xr[i] = -INFINITY;
        int best = 0;
        for (int i = 1; i < N; i++)
            best = xr[i] > xr[best] ? i : best;
        for (int k = 0; k < PER; k++) {
            int t = (int)(pd_rng_uniform(&rng) * N) % N;
            if (k == 0)
                t = best;
            else if (k == 1 && r % 3 == 2)
                t = N / 3;   /* masked */
            else if (k == 2)
                t = (best + 1) % N, xr[t] = xr[(t + 7) % N];   /* tied with another token */
            rows[r * PER + k] = r;
            toks[r * PER + k] = t;
        }
    }
    kern_buf *bx = NULL, *bi = NULL, *bo = NULL;
    kern_logprobs_row *out = calloc(M, sizeof(*out));
    pd_status st = kern_buf_alloc(be, (size_t)ROWS * N * sizeof(float), &bx, &err);
    if (st == PD_OK)
        st = kern_buf_alloc(be, 2 * M * sizeof(int32_t), &bi, &err);
    if (st == PD_OK)
        st = kern_buf_alloc(be, M * sizeof(kern_logprobs_row), &bo, &err);
    if (st == PD_OK)
        st = kern_upload(be, bx->ptr, x, (size_t)ROWS * N * sizeof(float), &err);
    if (st == PD_OK)
        st = kern_upload(be, bi->ptr, rows, M * sizeof(int32_t), &err);
    if (st == PD_OK)
        st = kern_upload(be, (int32_t *)bi->ptr + M, toks, M * sizeof(int32_t), &err);
    if (st == PD_OK) {
        kern_logprobs_args la = { .x = bx->ptr, .ld_x = N, .n = N, .n_rows = M, .rows = bi->ptr,
                                  .tok = (const int32_t *)bi->ptr + M, .n_top = TOP, .out = bo->ptr };
        st = kern_logprobs(be, &la, &err);
    }
    if (st == PD_OK)
        st = kern_download(be, out, bo->ptr, M * sizeof(kern_logprobs_row), &err);
    TEST_CHECK_MSG(st == PD_OK, "kern_logprobs on %s: %s", backend_name, err.msg);
    int wrong = 0, tied = 0, masked = 0, first = 0;
    double worst = 0.0;
    for (int e = 0; st == PD_OK && e < M; e++) {
        const float *xr = x + (size_t)rows[e] * N;
        float xt = xr[toks[e]];
        int ge = 0, gt = 0;
        double mx = -INFINITY, sum = 0.0;
        for (int i = 0; i < N; i++) {
            ge += xr[i] >= xt;
            gt += xr[i] > xt;
            mx = xr[i] > mx ? xr[i] : mx;
        }
        for (int i = 0; i < N; i++)
            sum += exp((double)xr[i] - mx);
        if (out[e].rank != ge && wrong++ < 3)
            fprintf(stderr, "entry %d (row %d, token %d): rank %d, %d logits >= its own\n", e, rows[e], toks[e],
                    out[e].rank, ge);
        tied += ge > gt + 1;
        masked += xt == -INFINITY && ge == N;
        first += ge == 1;
        if (xt > -INFINITY)
            worst = fmax(worst, fabs(out[e].logprob - (xt - (mx + log(sum)))));
    }
    TEST_CHECK_MSG(wrong == 0, "%d of %d ranks on %s differ from the brute-force count", wrong, M, backend_name);
    TEST_CHECK_MSG(tied > 0 && masked > 0 && first > 0, "the cases are not all met: %d tied, %d masked, %d first",
                   tied, masked, first);
    TEST_CHECK_MSG(worst < 1e-5, "logprobs on %s differ from log_softmax by %.3g", backend_name, worst);
    printf("kern_logprobs on %s: %d ranks as counted (%d with ties, %d masked, %d first), logprobs within %.2g\n",
           backend_name, M - wrong, tied, masked, first, worst);
    kern_buf_free(bx);
    kern_buf_free(bi);
    kern_buf_free(bo);
    free(out);
    free(x);
    kern_backend_destroy(be);
}

/* kern_spec_verify on the backend under test: REQ requests per launch share one p (L + 1 rows)
 * and one q (L rows, a third of q's tokens cut away as top-k would), their drafts sampled from
 * q on the host. The first committed token of each must follow p_0, and given that draft 0 was
 * accepted (a > 0 with d_0 = its most likely token), the second must follow p_1. */
static void test_sampling_verify_op(void)
{
    enum { N = 48, L = 3, REQ = 50000, LAUNCHES = 20 };
    pd_err err;
    kern_backend *be = NULL;
    kern_backend_config bc = { .name = backend_name };
    if (kern_backend_create(&bc, &be, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "backend %s: %s", backend_name, err.msg);
        return;
    }
    pd_rng rng;
    pd_rng_seed(&rng, 4242);
    float pq[(2 * L + 1) * N];
    float *p = pq, *q = pq + (L + 1) * N;
    for (int r = 0; r < 2 * L + 1; r++) {
        float *row = pq + (size_t)r * N;
        double s = 0.0;
        for (int i = 0; i < N; i++) {
            double v = exp(pd_rng_uniform(&rng) * 4.0);
            row[i] = r > L && i % 3 == 1 ? 0.0f : (float)v;
            s += row[i];
        }
        for (int i = 0; i < N; i++)
            row[i] = (float)(row[i] / s);
    }
    int32_t *meta = calloc((size_t)3 * REQ, sizeof(int32_t)), *d = malloc((size_t)REQ * L * sizeof(int32_t));
    int32_t *out = malloc((size_t)REQ * 2 * sizeof(int32_t));
    double *u = malloc((size_t)REQ * (L + 1) * sizeof(double));
    kern_buf *bp = NULL, *bm = NULL, *bd = NULL, *bu = NULL, *bo = NULL;
    pd_status st = kern_buf_alloc(be, sizeof(pq), &bp, &err);
    if (st == PD_OK)
        st = kern_buf_alloc(be, (size_t)3 * REQ * sizeof(int32_t), &bm, &err);
    if (st == PD_OK)
        st = kern_buf_alloc(be, (size_t)REQ * L * sizeof(int32_t), &bd, &err);
    if (st == PD_OK)
        st = kern_buf_alloc(be, (size_t)REQ * (L + 1) * sizeof(double), &bu, &err);
    if (st == PD_OK)
        st = kern_buf_alloc(be, (size_t)REQ * 2 * sizeof(int32_t), &bo, &err);
    if (st == PD_OK)
        st = kern_upload(be, bp->ptr, pq, sizeof(pq), &err);
    for (int i = 0; i < REQ; i++)
        meta[2 * REQ + i] = L;   /* p_row = q_row = 0 for all */
    if (st == PD_OK)
        st = kern_upload(be, bm->ptr, meta, (size_t)3 * REQ * sizeof(int32_t), &err);
    int mode0 = 0;
    for (int i = 1; i < N; i++)
        if (q[i] > q[mode0])
            mode0 = i;
    long h1[N] = {0}, h2[N] = {0}, runs = 0, runs2 = 0;
    for (int it = 0; it < LAUNCHES && st == PD_OK; it++) {
        for (int r = 0; r < REQ; r++) {
            for (int i = 0; i < L; i++)
                d[(size_t)r * L + i] = pd_sample_from_probs(q + (size_t)i * N, N, &rng);
            for (int i = 0; i <= L; i++)
                u[(size_t)r * (L + 1) + i] = pd_rng_uniform(&rng);
        }
        st = kern_upload(be, bd->ptr, d, (size_t)REQ * L * sizeof(int32_t), &err);
        if (st == PD_OK)
            st = kern_upload(be, bu->ptr, u, (size_t)REQ * (L + 1) * sizeof(double), &err);
        const int32_t *dm = bm->ptr;
        kern_spec_verify_args va = { .p = (const float *)bp->ptr, .ld_p = N, .q = (const float *)bp->ptr + (L + 1) * N,
                                     .ld_q = N, .n = N, .n_req = REQ, .p_row = dm, .q_row = dm + REQ,
                                     .len = dm + 2 * REQ, .draft = bd->ptr, .ld_draft = L, .u = bu->ptr,
                                     .ld_u = L + 1, .out = bo->ptr };
        if (st == PD_OK)
            st = kern_spec_verify(be, &va, &err);
        if (st == PD_OK)
            st = kern_download(be, out, bo->ptr, (size_t)REQ * 2 * sizeof(int32_t), &err);
        for (int r = 0; r < REQ && st == PD_OK; r++) {
            int a = out[2 * r], next = out[2 * r + 1];
            const int32_t *dr = d + (size_t)r * L;
            h1[a > 0 ? dr[0] : next]++;
            runs++;
            if (a > 0 && dr[0] == mode0) {
                h2[a > 1 ? dr[1] : next]++;
                runs2++;
            }
        }
    }
    TEST_CHECK_MSG(st == PD_OK, "spec_verify on %s: %s", backend_name, err.msg);
    double pp[N];
    int df;
    for (int i = 0; i < N; i++)
        pp[i] = p[i];
    double chi = chi_square(h1, pp, N, runs, &df);
    printf("kern_spec_verify on %s, first committed token: %ld runs, chi2 %.2f (df %d, critical %.2f)\n",
           backend_name, runs, chi, df, chi_crit(df));
    TEST_CHECK_MSG(chi < chi_crit(df), "first committed token does not follow p: chi2 %.2f", chi);
    double qq[N];
    for (int i = 0; i < N; i++)
        qq[i] = q[i];
    double chi_q = chi_square(h1, qq, N, runs, &df);
    TEST_CHECK_MSG(chi_q > chi_crit(df), "test has no power: chi2 vs q %.2f", chi_q);
    for (int i = 0; i < N; i++)
        pp[i] = p[N + i];
    chi = chi_square(h2, pp, N, runs2, &df);
    printf("kern_spec_verify on %s, second token after an accepted draft: %ld runs, chi2 %.2f (df %d, "
           "critical %.2f)\n", backend_name, runs2, chi, df, chi_crit(df));
    TEST_CHECK_MSG(chi < chi_crit(df), "second committed token does not follow p_1: chi2 %.2f", chi);
    kern_buf_free(bp);
    kern_buf_free(bm);
    kern_buf_free(bd);
    kern_buf_free(bu);
    kern_buf_free(bo);
    free(meta);
    free(d);
    free(out);
    free(u);
    kern_backend_destroy(be);
}

/* the target's sampling distribution under sp at the last position of ids (pd_sample.c's rules
 * on logits from the backend under test) */
static int target_probs(const pd_qwen3_model *tm, const int32_t *ids, int n, const pd_sample_params *sp,
                        double *p)
{
    pd_err err;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .page_size = 16, .n_pages = 16 };
    if (pd_engine_create(&ec, &e, &err) != PD_OK)
        return -1;
    pd_kv_pool *pool = pd_target_pool(pd_engine_target(e));
    pd_kv_seq seq;
    pd_kv_seq_init(&seq);
    int rc = -1;
    if (pd_kv_seq_reserve(pool, &seq, n, &err) == PD_OK) {
        int32_t pos[64], sq[64], last = n - 1;
        for (int i = 0; i < n; i++) {
            pos[i] = i;
            sq[i] = 0;
        }
        pd_kv_seq *seqs[1] = {&seq};
        pd_tok_batch b = { .n_tok = n, .ids = ids, .pos = pos, .seq = sq, .n_seq = 1, .seqs = seqs };
        if (pd_target_forward(pd_engine_target(e), &b, &last, 1, &err) == PD_OK) {
            int V = tm->cfg.vocab_size;
            float *l = malloc((size_t)V * 4), *pf = malloc((size_t)V * 4);
            int32_t *scratch = malloc((size_t)V * 4);
            double *dscratch = malloc((size_t)V * sizeof(double));
            if (kern_download(tm->be, l, pd_target_logits(pd_engine_target(e)), (size_t)V * 4, &err) == PD_OK) {
                pd_probs_from_logits(l, V, sp, pf, scratch, dscratch);
                for (int i = 0; i < V; i++)
                    p[i] = pf[i];
                rc = 0;
            }
            free(l);
            free(pf);
            free(scratch);
            free(dscratch);
        }
        pd_kv_seq_release(pool, &seq);
    }
    pd_engine_destroy(e);
    return rc;
}

/* policy: the verification-length policy of the speculative rounds (any is lossless); sp: the
 * requests' sampling parameters (the seed is set per run) */
static void test_sampling_end_to_end(pd_verify_policy policy, int waves, pd_sample_params sp)
{
    printf("end to end on %s, verify %s, temperature %g top-k %d top-p %g min-p %g typical-p %g\n",
           backend_name, pd_verify_policy_name(policy), (double)sp.temperature, sp.top_k, (double)sp.top_p,
           (double)sp.min_p, (double)sp.typical_p);
    pd_err err;
    kern_backend *be = NULL;
    kern_backend_config bc = { .name = backend_name };
    pd_qwen3_model *tm = NULL;
    pd_dspark_model *dm = NULL;
    if (kern_backend_create(&bc, &be, &err) != PD_OK || pd_qwen3_load(be, PD_MODELS "/tiny-code-qwen3", &tm, &err) != PD_OK ||
        pd_dspark_load(be, PD_MODELS "/tiny-code-dspark", tm, &dm, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "load: %s", err.msg);
        return;
    }
    /* "import numpy as np\n" style short code context */
    const int32_t prompt[] = {519, 747, 4048, 466, 470, 3764, 2794, 834, 1493, 371, 482, 793};
    int n = (int)(sizeof(prompt) / sizeof(prompt[0]));
    int V = tm->cfg.vocab_size;
    double *p1 = malloc((size_t)V * sizeof(double)), *p2 = malloc((size_t)V * sizeof(double));
    TEST_CHECK(target_probs(tm, prompt, n, &sp, p1) == 0);
    int mode = 0;
    for (int i = 1; i < V; i++)
        if (p1[i] > p1[mode])
            mode = i;
    int32_t ext[64];
    memcpy(ext, prompt, sizeof(prompt));
    ext[n] = mode;
    TEST_CHECK(target_probs(tm, ext, n + 1, &sp, p2) == 0);
    printf("end to end: first-token mode %d (p %.3f)\n", mode, p1[mode]);
    long *h1 = calloc((size_t)V, sizeof(long)), *h2 = calloc((size_t)V, sizeof(long));
    long runs = 0, runs2 = 0;
    const int wave = 64;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 1024 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    for (int w = 0; w < waves && e != NULL; w++) {
        pd_request *rq[64];
        pd_sample_params gp_sample = sp;
        for (int i = 0; i < wave; i++) {
            gp_sample.seed = (uint64_t)(w * wave + i) * 7919u + 1;
            pd_gen_params gp = { .sample = gp_sample,
                                 .verify_policy = policy, .verify_threshold = 0.4f,
                                 .max_new_tokens = 2, .ignore_eos = 1 };
            TEST_CHECK(pd_engine_add(e, (uint64_t)i, prompt, n, &gp, &rq[i], &err) == PD_OK);
        }
        while (pd_engine_active(e) > 0)
            if (pd_engine_step(e, &err) != PD_OK) {
                TEST_CHECK_MSG(0, "step: %s", err.msg);
                break;
            }
        for (int i = 0; i < wave; i++) {
            TEST_CHECK(rq[i]->n_out == 2);
            h1[rq[i]->out[0]]++;
            runs++;
            if (rq[i]->out[0] == mode) {
                h2[rq[i]->out[1]]++;
                runs2++;
            }
            pd_engine_release(e, rq[i]);
        }
    }
    int df;
    double chi1 = chi_square(h1, p1, V, runs, &df);
    printf("first token: %ld runs, chi2 %.2f (df %d, critical %.2f)\n", runs, chi1, df, chi_crit(df));
    TEST_CHECK_MSG(chi1 < chi_crit(df), "first token does not follow the target softmax: chi2 %.2f", chi1);
    double chi2 = chi_square(h2, p2, V, runs2, &df);
    printf("second token (speculative round) given the mode: %ld runs, chi2 %.2f (df %d, critical %.2f)\n", runs2,
           chi2, df, chi_crit(df));
    TEST_CHECK_MSG(runs2 >= 200, "too few runs with the modal first token: %ld", runs2);
    TEST_CHECK_MSG(chi2 < chi_crit(df), "speculative sampling does not follow the target: chi2 %.2f", chi2);
    pd_engine_destroy(e);
    free(p1);
    free(p2);
    free(h1);
    free(h2);
    pd_dspark_free(dm);
    pd_qwen3_free(tm);
    kern_backend_destroy(be);
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
            backend_name = argv[++i];
        } else if (strcmp(argv[i], "--perf-probs") == 0) {
            perf_probs();
            return 0;
        } else {
            fprintf(stderr, "usage: %s [--backend cpu|cuda] | --perf-probs\n", argv[0]);
            return 2;
        }
    }
    if (strcmp(backend_name, "cpu") != 0 && strcmp(backend_name, "cuda") != 0) {
        fprintf(stderr, "unknown backend '%s' (expected cpu or cuda)\n", backend_name);
        return 2;
    }
    if (kern_backend_device_count(backend_name) == 0)
        TEST_SKIP("no device for the backend under test (a GPU for cuda)");
    test_sampling_units();
    test_sampling_typical();
    test_sampling_cpu_ops();
    test_sampling_probs_sorted();
    test_sampling_logprobs_rank();
    test_sampling_verify_op();
    pd_sample_params t1 = { .temperature = 1.0f, .top_p = 1.0f };
    test_sampling_end_to_end(PD_VERIFY_FULL, 40, t1);
    /* shorter verification (fewer drafts checked per round) must keep the distribution too */
    test_sampling_end_to_end(PD_VERIFY_THRESHOLD, 16, t1);
    test_sampling_end_to_end(PD_VERIFY_SCHEDULED, 16, t1);
    /* top-k and top-p: speculative sampling follows the filtered target distribution */
    pd_sample_params filt = { .temperature = 1.5f, .top_k = 12, .top_p = 0.9f };
    test_sampling_end_to_end(PD_VERIFY_FULL, 12, filt);
    pd_sample_params minp = { .temperature = 1.5f, .top_p = 1.0f, .min_p = 0.1f };
    test_sampling_end_to_end(PD_VERIFY_FULL, 12, minp);
    pd_sample_params typ = { .temperature = 1.5f, .top_p = 1.0f, .typical_p = 0.9f };
    test_sampling_end_to_end(PD_VERIFY_FULL, 12, typ);
    TEST_DONE();
}
