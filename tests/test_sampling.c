/* test_sampling.c - sampling and lossless speculative sampling.
 * 1. pd_sample units: params validation, greedy tie rule, top-k / top-p filtering, seeded
 *    reproducibility.
 * 2. pd_verify_sampled on synthetic distributions: the first committed token of a round is
 *    distributed as the target p, whatever the draft q (chi-square, fixed seed).
 * 3. End to end on the tiny pair at temperature 1: the second generated token (the first one a
 *    speculative round commits) follows the target's softmax given the first, over many seeded
 *    runs (chi-square, fixed seeds); the first token follows the prefill softmax. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_engine.h"
#include "pd_sample.h"
#include "test_util.h"

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
    pd_probs_from_logits(logits, 6, &k2, probs, scratch);
    TEST_CHECK(probs[0] == 0.0f && probs[3] == 0.0f && probs[4] > 0.0f && probs[5] > probs[4]);
    TEST_CHECK(fabsf(probs[4] + probs[5] - 1.0f) < 1e-6f);
    pd_sample_params p5 = { .temperature = 1.0f, .top_k = 0, .top_p = 0.5f };
    pd_probs_from_logits(logits, 6, &p5, probs, scratch);
    TEST_CHECK(probs[5] == 1.0f);   /* the top token alone holds 0.63 >= 0.5 */
    pd_sample_params g = { .temperature = 0.0f, .top_p = 1.0f };
    pd_probs_from_logits(logits, 6, &g, probs, scratch);
    TEST_CHECK(probs[5] == 1.0f && probs[0] == 0.0f);

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

/* The committed token of a round with one draft token follows p (rejection sampling). */
static void test_sampling_verify_synthetic(void)
{
    enum { N = 8, L = 2 };
    float p[(L + 1) * N], q[L * N], res[N];
    pd_rng rng;
    pd_rng_seed(&rng, 7);
    for (int trial = 0; trial < 3; trial++) {
        for (int r = 0; r <= L; r++) {
            double s = 0.0;
            for (int i = 0; i < N; i++) {
                p[r * N + i] = (float)(pd_rng_uniform(&rng) + (i == trial ? 2.0 : 0.0));
                s += p[r * N + i];
            }
            for (int i = 0; i < N; i++)
                p[r * N + i] = (float)(p[r * N + i] / s);
        }
        for (int r = 0; r < L; r++) {
            double s = 0.0;
            for (int i = 0; i < N; i++) {
                q[r * N + i] = (float)(pd_rng_uniform(&rng) * (i + 1));
                s += q[r * N + i];
            }
            for (int i = 0; i < N; i++)
                q[r * N + i] = (float)(q[r * N + i] / s);
        }
        long hist[N] = {0};
        const long runs = 2000000;
        for (long t = 0; t < runs; t++) {
            int32_t d[L], next;
            d[0] = pd_sample_from_probs(q, N, &rng);
            d[1] = pd_sample_from_probs(q + N, N, &rng);
            int a = pd_verify_sampled(d, L, p, q, N, &rng, res, &next);
            hist[a > 0 ? d[0] : next]++;
        }
        double pp[N];
        for (int i = 0; i < N; i++)
            pp[i] = p[i];
        int df;
        double chi = chi_square(hist, pp, N, runs, &df);
        printf("synthetic verify trial %d: chi2 %.2f (df %d, critical %.2f)\n", trial, chi, df, chi_crit(df));
        TEST_CHECK_MSG(chi < chi_crit(df), "first committed token does not follow p: chi2 %.2f", chi);
        /* power check: the same histogram against q must be rejected */
        double qq[N];
        for (int i = 0; i < N; i++)
            qq[i] = q[i];
        double chi_q = chi_square(hist, qq, N, runs, &df);
        TEST_CHECK_MSG(chi_q > chi_crit(df), "test has no power: chi2 vs q %.2f", chi_q);
    }
}

static void softmax(const float *l, int n, double *p)
{
    float mx = l[0];
    for (int i = 1; i < n; i++)
        if (l[i] > mx)
            mx = l[i];
    double s = 0.0;
    for (int i = 0; i < n; i++) {
        p[i] = exp((double)l[i] - mx);
        s += p[i];
    }
    for (int i = 0; i < n; i++)
        p[i] /= s;
}

/* target softmax at the last position of ids (temperature 1) */
static int target_probs(const pd_qwen3_model *tm, const int32_t *ids, int n, double *p)
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
            float *l = malloc((size_t)V * 4);
            kern_download(tm->be, l, pd_target_logits(pd_engine_target(e)), (size_t)V * 4, &err);
            softmax(l, V, p);
            free(l);
            rc = 0;
        }
        pd_kv_seq_release(pool, &seq);
    }
    pd_engine_destroy(e);
    return rc;
}

/* policy: the verification-length policy of the speculative rounds (any is lossless) */
static void test_sampling_end_to_end(pd_verify_policy policy, int waves)
{
    printf("end to end, verify %s\n", pd_verify_policy_name(policy));
    pd_err err;
    kern_backend *be = NULL;
    kern_backend_config bc = { .name = "cpu" };
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
    TEST_CHECK(target_probs(tm, prompt, n, p1) == 0);
    int mode = 0;
    for (int i = 1; i < V; i++)
        if (p1[i] > p1[mode])
            mode = i;
    int32_t ext[64];
    memcpy(ext, prompt, sizeof(prompt));
    ext[n] = mode;
    TEST_CHECK(target_probs(tm, ext, n + 1, p2) == 0);
    printf("end to end: first-token mode %d (p %.3f)\n", mode, p1[mode]);
    long *h1 = calloc((size_t)V, sizeof(long)), *h2 = calloc((size_t)V, sizeof(long));
    long runs = 0, runs2 = 0;
    const int wave = 64;
    pd_engine *e = NULL;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = 16, .n_pages = 1024 };
    TEST_CHECK(pd_engine_create(&ec, &e, &err) == PD_OK);
    for (int w = 0; w < waves && e != NULL; w++) {
        pd_request *rq[64];
        for (int i = 0; i < wave; i++) {
            pd_gen_params gp = { .sample = { .temperature = 1.0f, .top_p = 1.0f, .seed = (uint64_t)(w * wave + i) * 7919u + 1 },
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

int main(void)
{
    test_sampling_units();
    test_sampling_verify_synthetic();
    test_sampling_end_to_end(PD_VERIFY_FULL, 40);
    /* shorter verification (fewer drafts checked per round) must keep the distribution too */
    test_sampling_end_to_end(PD_VERIFY_THRESHOLD, 16);
    test_sampling_end_to_end(PD_VERIFY_SCHEDULED, 16);
    TEST_DONE();
}
