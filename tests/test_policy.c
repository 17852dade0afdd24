/* test_policy.c - verification-length policies, the SPS curve and confidence calibration. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd_sample.h"
#include "pd_verify_policy.h"
#include "test_util.h"

static float logit(double p) { return (float)log(p / (1.0 - p)); }

static void test_policy_threshold(void)
{
    /* c = 0.9, 0.8, 0.5, 0.9 -> a = 0.9, 0.72, 0.36, 0.324 */
    float conf[4] = {logit(0.9), logit(0.8), logit(0.5), logit(0.9)};
    int maxl = 4, l = -1;
    pd_verify_choose(PD_VERIFY_THRESHOLD, 1, 4, conf, &maxl, NULL, 0.7f, NULL, 0.0, &l);
    TEST_CHECK(l == 2);
    pd_verify_choose(PD_VERIFY_THRESHOLD, 1, 4, conf, &maxl, NULL, 0.95f, NULL, 0.0, &l);
    TEST_CHECK(l == 0);
    pd_verify_choose(PD_VERIFY_THRESHOLD, 1, 4, conf, &maxl, NULL, 0.3f, NULL, 0.0, &l);
    TEST_CHECK(l == 4);
    maxl = 3;
    pd_verify_choose(PD_VERIFY_THRESHOLD, 1, 4, conf, &maxl, NULL, 0.3f, NULL, 0.0, &l);
    TEST_CHECK(l == 3);   /* never past the cap */
    pd_verify_choose(PD_VERIFY_FULL, 1, 4, conf, &maxl, NULL, 0.0f, NULL, 0.0, &l);
    TEST_CHECK(l == 3);
    /* a calibration temperature changes the decision: T = 0.5 sharpens c_0 to 0.988 */
    pd_calib c;
    pd_calib_identity(&c, 4);
    c.temp[1] = 0.25f;   /* c_1 = sigmoid(4 * logit(0.8)) = 0.996 */
    maxl = 4;
    pd_verify_choose(PD_VERIFY_THRESHOLD, 1, 4, conf, &maxl, &c, 0.85f, NULL, 0.0, &l);
    TEST_CHECK(l == 2);
}

static double plan_value(int n, int B, const float *conf, const int *len, const pd_sps *s)
{
    double tau = 0.0;
    int tokens = 0;
    for (int r = 0; r < n; r++) {
        double a = 1.0;
        tau += 1.0;
        tokens += len[r] + 1;
        for (int j = 0; j < len[r]; j++) {
            a /= 1.0 + exp(-conf[r * B + j]);
            a *= 1.0;   /* a_{r,j} = prod sigmoid */
            tau += a;
        }
    }
    return tau * pd_sps_at(s, tokens);
}

static void test_policy_scheduled(void)
{
    enum { N = 6, B = 7 };
    float conf[N * B];
    pd_rng rng;
    pd_rng_seed(&rng, 3);
    for (int i = 0; i < N * B; i++)
        conf[i] = (float)(pd_rng_uniform(&rng) * 6.0 - 1.0);
    int maxl[N], len[N], none[N] = {0};
    for (int r = 0; r < N; r++)
        maxl[r] = B - (r == 5 ? 4 : 0);
    pd_err err;
    pd_sps cheap, steep, mid;
    TEST_CHECK(pd_sps_linear(1.0, 1e-4, 256, &cheap, &err) == PD_OK);
    TEST_CHECK(pd_sps_linear(0.001, 10.0, 256, &steep, &err) == PD_OK);
    TEST_CHECK(pd_sps_linear(1.0, 0.05, 256, &mid, &err) == PD_OK);
    pd_verify_choose(PD_VERIFY_SCHEDULED, N, B, conf, maxl, NULL, 0.0f, &cheap, 0.0, len);
    int all = 1;
    for (int r = 0; r < N; r++)
        all &= len[r] == maxl[r];
    TEST_CHECK_MSG(all, "cheap verification: every draft should be checked");
    pd_verify_choose(PD_VERIFY_SCHEDULED, N, B, conf, maxl, NULL, 0.0f, &steep, 0.0, len);
    int zero = 1;
    for (int r = 0; r < N; r++)
        zero &= len[r] == 0;
    TEST_CHECK_MSG(zero, "expensive verification: no draft should be checked");
    pd_verify_choose(PD_VERIFY_SCHEDULED, N, B, conf, maxl, NULL, 0.0f, &mid, 0.0, len);
    int total = 0, ok = 1;
    for (int r = 0; r < N; r++) {
        ok &= len[r] >= 0 && len[r] <= maxl[r];
        total += len[r];
    }
    TEST_CHECK(ok && total > 0 && total < 7 * N - 4);
    int full[N];
    memcpy(full, maxl, sizeof(full));
    double v = plan_value(N, B, conf, len, &mid), vf = plan_value(N, B, conf, full, &mid),
           v0 = plan_value(N, B, conf, none, &mid);
    printf("scheduled plan: %d tokens, value %.4f (full %.4f, none %.4f)\n", total, v, vf, v0);
    TEST_CHECK(v >= vf - 1e-9 && v >= v0 - 1e-9);
    /* a fixed round cost besides verification (the draft round) makes each admission relatively
     * cheaper: never fewer drafts, and with a huge overhead every draft with a_{r,j} > 0 */
    int len_oh[N], total_oh = 0;
    pd_verify_choose(PD_VERIFY_SCHEDULED, N, B, conf, maxl, NULL, 0.0f, &mid, 2.0, len_oh);
    for (int r = 0; r < N; r++)
        total_oh += len_oh[r];
    TEST_CHECK_MSG(total_oh >= total, "overhead 2 s: %d drafts, none: %d", total_oh, total);
    pd_verify_choose(PD_VERIFY_SCHEDULED, N, B, conf, maxl, NULL, 0.0f, &mid, 1e6, len_oh);
    all = 1;
    for (int r = 0; r < N; r++)
        all &= len_oh[r] == maxl[r];
    TEST_CHECK_MSG(all, "dominant round overhead: every draft should be checked");
    /* the admitted set is prefix-closed and ordered by survival: every admitted a_{r,j} is >=
     * every rejected first-next candidate's a (greedy by a, stopping at the first drop) */
    double min_in = 1e9, max_out = -1.0;
    for (int r = 0; r < N; r++) {
        double a = 1.0;
        for (int j = 0; j < maxl[r]; j++) {
            a /= 1.0 + exp(-conf[r * B + j]);
            if (j < len[r])
                min_in = a < min_in ? a : min_in;
            else if (j == len[r])
                max_out = a > max_out ? a : max_out;
        }
    }
    TEST_CHECK(min_in >= max_out);
    pd_sps_cleanup(&cheap);
    pd_sps_cleanup(&steep);
    pd_sps_cleanup(&mid);
}

static void test_policy_sps_smoothing(void)
{
    /* jagged: a step at 9 tokens and a dip at 12 */
    double t[17];
    for (int b = 1; b <= 16; b++)
        t[b] = 1.0 + 0.01 * b + (b >= 9 ? 0.3 : 0.0) - (b == 12 ? 0.25 : 0.0);
    pd_sps s;
    pd_err err;
    TEST_CHECK(pd_sps_from_times(t, 16, &s, &err) == PD_OK);
    int mono = 1, convex = 1;
    for (int b = 2; b <= 16; b++)
        mono &= 1.0 / s.sps[b] >= 1.0 / s.sps[b - 1] - 1e-12;
    for (int b = 2; b < 16; b++)
        convex &= (1.0 / s.sps[b + 1] - 1.0 / s.sps[b]) >= (1.0 / s.sps[b] - 1.0 / s.sps[b - 1]) - 1e-9;
    TEST_CHECK(mono);
    TEST_CHECK(convex);
    for (int b = 1; b <= 16; b++)
        TEST_CHECK(1.0 / s.sps[b] <= t[b] + 1e-12);   /* a lower envelope */
    pd_sps_cleanup(&s);
    t[3] = -1.0;
    TEST_CHECK(pd_sps_from_times(t, 16, &s, &err) == PD_ERR_INVALID);
    /* cache round trip with a key */
    char path[] = "/tmp/pd_sps_XXXXXX";
    int fd = mkstemp(path);
    TEST_CHECK(fd >= 0);
    close(fd);
    t[3] = 1.03;
    TEST_CHECK(pd_sps_save(path, "model=a device=cpu build=1", t, 16, &err) == PD_OK);
    TEST_CHECK(pd_sps_load(path, "model=a device=cpu build=1", &s, &err) == PD_OK && s.max_tokens == 16);
    pd_sps_cleanup(&s);
    TEST_CHECK(pd_sps_load(path, "model=b device=cpu build=1", &s, &err) == PD_ERR_NOT_FOUND);
    unlink(path);
}

static void test_policy_calibration(void)
{
    /* observations drawn from c = sigmoid(logit / 2.5): the fit must find T near 2.5 */
    enum { N = 20000, P = 3 };
    pd_calib_obs *obs = malloc(N * sizeof(*obs));
    pd_rng rng;
    pd_rng_seed(&rng, 11);
    for (int i = 0; i < N; i++) {
        float l = (float)(pd_rng_uniform(&rng) * 12.0 - 6.0);
        double p = 1.0 / (1.0 + exp(-l / 2.5));
        obs[i] = (pd_calib_obs){ .k = i % P, .logit = l, .survived = pd_rng_uniform(&rng) < p };
    }
    pd_calib c;
    pd_calib_fit(obs, N, P, &c);
    for (int k = 0; k < P; k++)
        TEST_CHECK_MSG(fabs(c.temp[k] - 2.5) < 0.25, "position %d: T %.3f, want ~2.5", k, c.temp[k]);
    /* ECE of prefix survival drops after the fit */
    enum { R = 4000 };
    float *lg = malloc(R * P * sizeof(float));
    int *acc = malloc(R * sizeof(int));
    for (int r = 0; r < R; r++) {
        int a = 0, alive = 1;
        for (int k = 0; k < P; k++) {
            lg[r * P + k] = (float)(pd_rng_uniform(&rng) * 12.0 - 6.0);
            double p = 1.0 / (1.0 + exp(-lg[r * P + k] / 2.5));
            if (alive && pd_rng_uniform(&rng) < p)
                a++;
            else
                alive = 0;
        }
        acc[r] = a;
    }
    pd_calib id;
    pd_calib_identity(&id, P);
    double before[P], after[P];
    pd_calib_ece(lg, acc, R, P, &id, before);
    pd_calib_ece(lg, acc, R, P, &c, after);
    for (int k = 0; k < P; k++) {
        printf("position %d: ECE %.4f -> %.4f (T %.3f)\n", k, before[k], after[k], c.temp[k]);
        TEST_CHECK(after[k] < before[k]);
    }
    /* file round trip and a malformed file */
    char dir[] = "/tmp/pd_calib_XXXXXX";
    TEST_CHECK(mkdtemp(dir) != NULL);
    char path[256];
    snprintf(path, sizeof(path), "%s/dspark_calibration.json", dir);
    pd_err err;
    pd_calib back;
    TEST_CHECK(pd_calib_load(dir, &back, &err) == PD_ERR_NOT_FOUND);
    TEST_CHECK(pd_calib_save(path, &c, before, after, N, &err) == PD_OK);
    TEST_CHECK(pd_calib_load(dir, &back, &err) == PD_OK && back.n == P &&
               fabsf(back.temp[1] - c.temp[1]) < 1e-4f);
    FILE *f = fopen(path, "w");
    fputs("{\"temperatures\": [1.0, -2]}", f);
    fclose(f);
    TEST_CHECK(pd_calib_load(dir, &back, &err) == PD_ERR_INVALID && strstr(err.msg, "temperatures[1]"));
    unlink(path);
    rmdir(dir);
    free(obs);
    free(lg);
    free(acc);
}

/* ---- the scheduled policy's arms on a simulated device -------------------------------------
 * Verify step t(n) = 0.2 + 0.01 n, draft round 0.3 + 0.005 m (seconds, any unit); plain
 * decoding commits 1 token per request, Algorithm 1 verifies 4 tokens for 2.6, all drafts 8 for
 * 3. Drafting wins at small batches, plain decoding at large ones (the crossing is near m = 4).
 * Measured times carry +-5 % noise. */
static const double sim_tau[PD_SCHED_ARMS] = {1.0, 2.6, 3.0};
static const double sim_v[PD_SCHED_ARMS] = {1.0, 4.0, 8.0};

static double sim_draft(int m) { return 0.3 + 0.005 * m; }

static double sim_time(int a, int m)
{
    double t = 0.2 + 0.01 * m * sim_v[a] + 0.01;
    return a == PD_SCHED_PLAIN ? t : t + sim_draft(m) + 0.01;
}

/* one round of arm a at m requests taking dt, as the engine records it */
static void sim_record(pd_sched_ctl *c, pd_sched_arm a, int m, double dt, double noise)
{
    double d = a == PD_SCHED_PLAIN ? 0.0 : sim_draft(m) * noise;
    if (d > 0.0)
        pd_sched_add_draft(c, m, d);
    pd_sched_add(c, a, m, m * sim_tau[a], dt, d, (int)(m * sim_v[a]), 0);
}

static double sim_rate(int a, int m) { return m * sim_tau[a] / sim_time(a, m); }

/* Runs the controller over a load: m(round) from loads[], returns its time over the time of
 * always taking the best arm (1.0 = perfect); *bad = rounds on an arm >= 25 % slower than the
 * best. */
static double sim_run(const pd_sps *sps, const int *loads, int n, int *bad)
{
    pd_sched_ctl c;
    pd_sched_init(&c, sps);
    unsigned x = 12345;
    double t_ctl = 0.0, t_best = 0.0;
    *bad = 0;
    for (int i = 0; i < n; i++) {
        int m = loads[i];
        pd_sched_arm a = pd_sched_pick(&c, m);
        x = x * 1103515245u + 12345u;
        double noise = 1.0 + 0.05 * (((x >> 16) & 0x7fff) / 16383.5 - 1.0);
        double dt = sim_time(a, m) * noise, tok = m * sim_tau[a];
        sim_record(&c, a, m, dt, noise);
        double best = 0.0;
        for (int b = 0; b < PD_SCHED_ARMS; b++)
            best = sim_rate(b, m) > best ? sim_rate(b, m) : best;
        t_ctl += dt;
        t_best += tok / best;   /* the best arm's time for the same tokens */
        *bad += sim_rate(a, m) < 0.75 * best;
    }
    return t_ctl / t_best;
}

static void test_policy_sched_arms(void)
{
    /* a burst: 400 rounds at 128 requests, then a drain to 1 (one request fewer every 3 rounds),
     * then 200 rounds at 1 */
    int loads[400 + 3 * 127 + 200], n = 0;
    for (int i = 0; i < 400; i++)
        loads[n++] = 128;
    for (int m = 127; m >= 1; m--)
        for (int k = 0; k < 3; k++)
            loads[n++] = m;
    for (int i = 0; i < 200; i++)
        loads[n++] = 1;
    pd_sps prof;
    TEST_CHECK(pd_sps_linear(0.2, 0.01, 2048, &prof, NULL) == PD_OK);
    int bad_model = 0, bad_plain = 0;
    double r_model = sim_run(&prof, loads, n, &bad_model);
    double r_plain = sim_run(NULL, loads, n, &bad_plain);
    printf("scheduled arms, simulated burst + drain (%d rounds): time %.3fx the best arm's with the "
           "profile model (%d rounds on a poor arm), %.3fx measuring per batch class (%d)\n",
           n, r_model, bad_model, r_plain, bad_plain);
    TEST_CHECK_MSG(r_model < 1.05, "controller with a profile is %.3fx the best arm's time", r_model);
    TEST_CHECK_MSG(r_plain < 1.25, "controller without a profile is %.3fx the best arm's time", r_plain);
    TEST_CHECK_MSG(bad_model < bad_plain, "the profile model should need fewer trial rounds (%d vs %d)",
                   bad_model, bad_plain);
    /* it settles on the right arm at both ends of the load */
    pd_sched_ctl c;
    pd_sched_init(&c, &prof);
    for (int i = 0; i < 50; i++) {
        int m = i % 2 ? 128 : 1;
        pd_sched_arm a = pd_sched_pick(&c, m);
        sim_record(&c, a, m, sim_time(a, m), 1.0);
    }
    double e128[PD_SCHED_ARMS], e1[PD_SCHED_ARMS];
    for (int a = 0; a < PD_SCHED_ARMS; a++) {
        e128[a] = pd_sched_estimate(&c, (pd_sched_arm)a, 128);
        e1[a] = pd_sched_estimate(&c, (pd_sched_arm)a, 1);
    }
    TEST_CHECK(e128[PD_SCHED_PLAIN] > e128[PD_SCHED_ALGO1] && e128[PD_SCHED_PLAIN] > e128[PD_SCHED_ALL]);
    TEST_CHECK(e1[PD_SCHED_ALL] > e1[PD_SCHED_PLAIN]);
    TEST_CHECK(fabs(e128[PD_SCHED_PLAIN] / sim_rate(PD_SCHED_PLAIN, 128) - 1.0) < 0.02);
    /* a class never visited is predicted from its neighbours through the profile: m = 12 */
    double p12 = pd_sched_estimate(&c, PD_SCHED_ALL, 12);
    printf("all-drafts arm at m = 12, never run there: predicted %.2f, true %.2f\n", p12, sim_rate(PD_SCHED_ALL, 12));
    TEST_CHECK(p12 > 0.0 && fabs(p12 / sim_rate(PD_SCHED_ALL, 12) - 1.0) < 0.15);
    /* a batch ramping up after rounds at m = 128 only: at m = 8 the no-drafts arm's rest
     * (0.005 per request here, besides the verify step) is taken per request, so no drafts
     * (8 / 0.32 = 25 tokens/s) beats all drafts (24 / 1.22 = 19.7) where it is never run */
    pd_sched_ctl rp;
    pd_sched_init(&rp, &prof);
    for (int i = 0; i < 20; i++) {
        pd_sched_add(&rp, PD_SCHED_PLAIN, 128, 128.0, 0.2 + 0.01 * 128 + 0.005 * 128, 0.0, 128, 0);
        pd_sched_add_draft(&rp, 8, sim_draft(8));
        pd_sched_add(&rp, PD_SCHED_ALL, 8, 24.0, 0.2 + 0.01 * 64 + sim_draft(8) + 0.005 * 8, sim_draft(8), 64, 0);
    }
    double plain8 = pd_sched_estimate(&rp, PD_SCHED_PLAIN, 8), all8 = pd_sched_estimate(&rp, PD_SCHED_ALL, 8);
    printf("ramp to m = 8 from no-drafts rounds at 128: no drafts %.2f (true 25), all drafts %.2f\n", plain8,
           all8);
    TEST_CHECK_MSG(fabs(plain8 / 25.0 - 1.0) < 0.02 && plain8 > all8, "no drafts at m = 8: %.2f, all %.2f",
                   plain8, all8);
    /* a drafting arm ahead of no drafts by less than the switch (the waiting rows a drafting
     * round must add first) is not picked: here all drafts gives 5 % more per round of 1.0 */
    pd_sched_ctl sw;
    pd_sched_init(&sw, NULL);
    pd_sched_add(&sw, PD_SCHED_PLAIN, 8, 8.0, 1.0, 0.0, 8, 0);
    pd_sched_add(&sw, PD_SCHED_ALL, 8, 8.4, 1.0, 0.5, 64, 0);
    pd_sched_add(&sw, PD_SCHED_ALGO1, 8, 6.0, 1.0, 0.5, 32, 0);
    TEST_CHECK(pd_sched_pick(&sw, 8) == PD_SCHED_ALL);
    pd_sched_set_switch(&sw, 0.5);
    TEST_CHECK_MSG(pd_sched_pick(&sw, 8) == PD_SCHED_PLAIN, "picked a drafting arm 5 %% ahead with a switch of "
                   "half a round");
    /* cold rounds (graph captures) estimate an arm only while it has no steady round anywhere,
     * timed by the profile (verify step + draft round), not by the clock: a cold round at
     * m = 8 of 4 s or of 40 s gives the same estimate; then a steady one at m = 2 (another
     * class) gives the estimate at m = 8 too, and more cold rounds change nothing */
    pd_sched_ctl k, k2;
    pd_sched_init(&k, &prof);
    pd_sched_init(&k2, &prof);
    TEST_CHECK(pd_sched_estimate(&k, PD_SCHED_ALGO1, 8) < 0.0);
    pd_sched_add(&k, PD_SCHED_ALGO1, 8, 20.0, 4.0, 0.3, 32, 1);
    pd_sched_add(&k2, PD_SCHED_ALGO1, 8, 20.0, 40.0, 0.3, 32, 1);
    double cold8 = pd_sched_estimate(&k, PD_SCHED_ALGO1, 8);
    double want8 = 20.0 / (1.0 / pd_sps_at(&prof, 32) + 0.3);
    TEST_CHECK_MSG(fabs(cold8 - want8) < 1e-6 * want8 && cold8 == pd_sched_estimate(&k2, PD_SCHED_ALGO1, 8),
                   "estimate from the cold round %.4f, want %.4f", cold8, want8);
    TEST_CHECK(k.st[PD_SCHED_ALGO1][3].n == 0 && k.st_cold[PD_SCHED_ALGO1][3].n == 1);
    pd_sched_add(&k, PD_SCHED_ALGO1, 2, 5.0, 1.0, 0.1, 8, 0);
    double warm8 = pd_sched_estimate(&k, PD_SCHED_ALGO1, 8);
    pd_sched_add(&k, PD_SCHED_ALGO1, 8, 20.0, 9.0, 0.3, 32, 1);
    TEST_CHECK_MSG(warm8 != cold8 && pd_sched_estimate(&k, PD_SCHED_ALGO1, 8) == warm8,
                   "steady round at m = 2: estimate at 8 %.4f (cold %.4f), after another cold round %.4f",
                   warm8, cold8, pd_sched_estimate(&k, PD_SCHED_ALGO1, 8));
    /* the estimate at a measured class is that class's measured rate, whether or not the draft
     * rounds were timed separately (none were here) */
    pd_sched_add(&k, PD_SCHED_ALGO1, 8, 20.0, 1.0, 0.3, 32, 0);
    double est8 = pd_sched_estimate(&k, PD_SCHED_ALGO1, 8);
    TEST_CHECK_MSG(fabs(est8 - 20.0) < 1e-6, "estimate at the measured class %.4f vs measured 20", est8);
    /* the round's requests accept drafts better or worse than the arm's record: the accepted
     * part of a drafting arm's tokens per request scales by the factor, no-drafts stays */
    pd_sched_parts base, plain0, scaled, plain2;
    pd_sched_parts_of(&c, PD_SCHED_ALL, 1, &base);
    pd_sched_parts_of(&c, PD_SCHED_PLAIN, 1, &plain0);
    pd_sched_set_accept(&c, 2.0);
    pd_sched_parts_of(&c, PD_SCHED_ALL, 1, &scaled);
    pd_sched_parts_of(&c, PD_SCHED_PLAIN, 1, &plain2);
    TEST_CHECK_MSG(fabs(scaled.tau - (1.0 + 2.0 * (base.tau - 1.0))) < 1e-9 && scaled.rate > base.rate,
                   "accept factor 2: tau %.4f from %.4f", scaled.tau, base.tau);
    TEST_CHECK(plain2.tau == plain0.tau && plain2.rate == plain0.rate);
    pd_sched_set_accept(&c, 0.0);   /* requests that accept nothing: drafting loses at m = 1 */
    TEST_CHECK(pd_sched_estimate(&c, PD_SCHED_ALL, 1) < pd_sched_estimate(&c, PD_SCHED_PLAIN, 1));
    /* a new request hoped to accept most drafts is worth one all-drafts round alone (m = 1),
     * not when it is one of 128 (the engine's factor there stays near 1); a request that
     * accepts nothing never tips it */
    pd_sched_set_accept(&c, 0.0);
    TEST_CHECK(!pd_sched_all_wins(&c, 1));
    pd_sched_set_accept(&c, 4.0);
    TEST_CHECK(pd_sched_all_wins(&c, 1));
    pd_sched_set_accept(&c, 1.0 + 3.0 / 128.0);
    TEST_CHECK(!pd_sched_all_wins(&c, 128));
    pd_sched_set_accept(&c, 1.0);
    /* an all-drafts record of one token per request (a first round that accepted nothing): no
     * factor lifts it, the round's own expectation does */
    {
        pd_sched_ctl z;
        pd_sched_init(&z, &prof);
        pd_sched_add(&z, PD_SCHED_PLAIN, 1, 1.0, sim_time(PD_SCHED_PLAIN, 1), 0.0, 1, 0);
        pd_sched_add(&z, PD_SCHED_ALL, 1, 1.0, sim_time(PD_SCHED_ALL, 1), 0.3 * sim_time(PD_SCHED_ALL, 1), 8, 0);
        pd_sched_set_accept(&z, 8.0);
        TEST_CHECK(!pd_sched_all_wins(&z, 1));
        pd_sched_set_all_tau(&z, 1.0 + 0.75 * 7);
        pd_sched_parts zp;
        pd_sched_parts_of(&z, PD_SCHED_ALL, 1, &zp);
        TEST_CHECK_MSG(pd_sched_all_wins(&z, 1) && fabs(zp.tau - 6.25) < 1e-9, "all-drafts tau %.4f", zp.tau);
        pd_sched_set_accept(&z, 1.0);   /* resets it */
        pd_sched_parts_of(&z, PD_SCHED_ALL, 1, &zp);
        TEST_CHECK(fabs(zp.tau - 1.0) < 1e-9);
    }
    /* deferred context that a drafting round would add first makes trying one dearer: at
     * m = 128 (no drafts best) the next drafting trial comes later with a switch cost */
    int first_trial[2];
    for (int w = 0; w < 2; w++) {
        pd_sched_ctl cc = c;
        pd_sched_set_switch(&cc, w == 0 ? 0.0 : sim_time(PD_SCHED_ALL, 128));
        first_trial[w] = -1;
        for (int i = 0; i < 50000 && first_trial[w] < 0; i++) {
            pd_sched_arm a = pd_sched_pick(&cc, 128);
            if (a != PD_SCHED_PLAIN)
                first_trial[w] = i;
            sim_record(&cc, a, 128, sim_time(a, 128), 1.0);
        }
    }
    printf("first drafting trial at m = 128 after %d rounds, %d with a switch cost of one drafting round\n",
           first_trial[0], first_trial[1]);
    TEST_CHECK(first_trial[0] >= 0 && first_trial[1] > first_trial[0]);
    pd_sps_cleanup(&prof);
}

int main(void)
{
    pd_verify_policy p;
    TEST_CHECK(pd_verify_policy_parse("scheduled", &p, NULL) == PD_OK && p == PD_VERIFY_SCHEDULED);
    TEST_CHECK(pd_verify_policy_parse("nope", &p, NULL) == PD_ERR_INVALID);
    test_policy_threshold();
    test_policy_scheduled();
    test_policy_sps_smoothing();
    test_policy_calibration();
    test_policy_sched_arms();
    TEST_DONE();
}
