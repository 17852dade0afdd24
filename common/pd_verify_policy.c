/* pd_verify_policy.c - verification-length policies, SPS curve, confidence calibration.
 * See pd_verify_policy.h. The scheduler follows the DSpark paper's Algorithm 1: prefix survival
 *   a_{r,j} = prod_{i<=j} c_{r,i}; candidates sorted by a_{r,j}; greedy admission while
 *   tau * SPS(B) rises; early stop at the first drop.
 * Threading: pure. */
#include "pd_verify_policy.h"
#include "pd_json.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pd_status pd_verify_policy_parse(const char *s, pd_verify_policy *out, pd_err *err)
{
    if (strcmp(s, "full") == 0)
        *out = PD_VERIFY_FULL;
    else if (strcmp(s, "threshold") == 0)
        *out = PD_VERIFY_THRESHOLD;
    else if (strcmp(s, "scheduled") == 0)
        *out = PD_VERIFY_SCHEDULED;
    else
        return pd_err_set(err, PD_ERR_INVALID, "verify policy '%s' (expected full, threshold or scheduled)", s);
    return PD_OK;
}

const char *pd_verify_policy_name(pd_verify_policy p)
{
    switch (p) {
    case PD_VERIFY_DEFAULT: return "default";
    case PD_VERIFY_FULL: return "full";
    case PD_VERIFY_THRESHOLD: return "threshold";
    case PD_VERIFY_SCHEDULED: return "scheduled";
    }
    return "?";
}

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

void pd_calib_identity(pd_calib *c, int n)
{
    c->n = n < PD_CALIB_MAX ? n : PD_CALIB_MAX;
    for (int i = 0; i < PD_CALIB_MAX; i++)
        c->temp[i] = 1.0f;
}

static double calib_c(const pd_calib *c, int k, float logit)
{
    double t = (c != NULL && k < c->n && c->temp[k] > 0.0f) ? c->temp[k] : 1.0;
    return sigm(logit / t);
}

pd_status pd_calib_load(const char *dir, pd_calib *out, pd_err *err)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/dspark_calibration.json", dir);
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return pd_err_set(err, PD_ERR_NOT_FOUND, "%s: %s", path, strerror(errno));
    char buf[65536];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    cJSON *o = pd_json_parse_str(buf, NULL);
    cJSON *t = cJSON_GetObjectItem(o, "temperatures");
    if (o == NULL || !cJSON_IsArray(t) || cJSON_GetArraySize(t) < 1 || cJSON_GetArraySize(t) > PD_CALIB_MAX) {
        cJSON_Delete(o);
        return pd_err_set(err, PD_ERR_INVALID, "%s: expected an object with \"temperatures\": [1..%d numbers]",
                          path, PD_CALIB_MAX);
    }
    pd_calib c;
    pd_calib_identity(&c, cJSON_GetArraySize(t));
    for (int i = 0; i < c.n; i++) {
        cJSON *v = cJSON_GetArrayItem(t, i);
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0.0) || !isfinite(v->valuedouble)) {
            cJSON_Delete(o);
            return pd_err_set(err, PD_ERR_INVALID, "%s: temperatures[%d] must be a positive number", path, i);
        }
        c.temp[i] = (float)v->valuedouble;
    }
    cJSON_Delete(o);
    *out = c;
    return PD_OK;
}

pd_status pd_calib_save(const char *path, const pd_calib *c, const double *ece_before, const double *ece_after,
                        int n_rounds_fit, pd_err *err)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "version", 1);
    cJSON_AddStringToObject(o, "method", "sequential temperature scaling of the confidence logits, per position");
    cJSON *t = cJSON_AddArrayToObject(o, "temperatures");
    for (int i = 0; i < c->n; i++)
        cJSON_AddItemToArray(t, cJSON_CreateNumber(c->temp[i]));
    cJSON_AddNumberToObject(o, "rounds_fitted", n_rounds_fit);
    if (ece_before != NULL && ece_after != NULL) {
        cJSON *b = cJSON_AddArrayToObject(o, "heldout_ece_before"), *a = cJSON_AddArrayToObject(o, "heldout_ece_after");
        for (int i = 0; i < c->n; i++) {
            cJSON_AddItemToArray(b, cJSON_CreateNumber(ece_before[i]));
            cJSON_AddItemToArray(a, cJSON_CreateNumber(ece_after[i]));
        }
    }
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        free(s);
        return pd_err_set(err, PD_ERR_IO, "%s: %s", path, strerror(errno));
    }
    int ok = fputs(s, f) >= 0 && fputc('\n', f) != EOF;
    ok &= fclose(f) == 0;
    free(s);
    return ok ? PD_OK : pd_err_set(err, PD_ERR_IO, "%s: write failed", path);
}

static double bce(const pd_calib_obs *obs, int n, int k, double t)
{
    double s = 0.0;
    for (int i = 0; i < n; i++) {
        if (obs[i].k != k)
            continue;
        double p = sigm(obs[i].logit / t);
        p = p < 1e-12 ? 1e-12 : (p > 1.0 - 1e-12 ? 1.0 - 1e-12 : p);
        s -= obs[i].survived ? log(p) : log(1.0 - p);
    }
    return s;
}

void pd_calib_fit(const pd_calib_obs *obs, int n_obs, int n_pos, pd_calib *out)
{
    pd_calib_identity(out, n_pos);
    const double gr = (sqrt(5.0) - 1.0) / 2.0;
    for (int k = 0; k < out->n; k++) {
        int cnt = 0;
        for (int i = 0; i < n_obs; i++)
            cnt += obs[i].k == k;
        if (cnt < 10)
            continue;   /* too little evidence: keep T = 1 */
        double lo = log(0.05), hi = log(20.0);
        double x1 = hi - gr * (hi - lo), x2 = lo + gr * (hi - lo);
        double f1 = bce(obs, n_obs, k, exp(x1)), f2 = bce(obs, n_obs, k, exp(x2));
        for (int it = 0; it < 80; it++) {
            if (f1 < f2) {
                hi = x2;
                x2 = x1;
                f2 = f1;
                x1 = hi - gr * (hi - lo);
                f1 = bce(obs, n_obs, k, exp(x1));
            } else {
                lo = x1;
                x1 = x2;
                f1 = f2;
                x2 = lo + gr * (hi - lo);
                f2 = bce(obs, n_obs, k, exp(x2));
            }
        }
        out->temp[k] = (float)exp((lo + hi) / 2.0);
    }
}

void pd_calib_ece(const float *logits, const int *accepted, int n_rounds, int n_pos, const pd_calib *c,
                  double *ece_out)
{
    enum { BINS = 10 };
    for (int k = 0; k < n_pos; k++) {
        double sp[BINS] = {0}, sy[BINS] = {0};
        int cnt[BINS] = {0};
        for (int r = 0; r < n_rounds; r++) {
            double a = 1.0;
            for (int i = 0; i <= k; i++)
                a *= calib_c(c, i, logits[(size_t)r * n_pos + i]);
            int b = (int)(a * BINS);
            b = b >= BINS ? BINS - 1 : b;
            sp[b] += a;
            sy[b] += accepted[r] > k;
            cnt[b]++;
        }
        double e = 0.0;
        for (int b = 0; b < BINS; b++)
            if (cnt[b] > 0)
                e += fabs(sp[b] - sy[b]) / (n_rounds > 0 ? n_rounds : 1);
        ece_out[k] = e;
    }
}

/* ---- SPS ---------------------------------------------------------------------------------- */

pd_status pd_sps_from_times(const double *t, int n, pd_sps *out, pd_err *err)
{
    if (n < 1)
        return pd_err_set(err, PD_ERR_INVALID, "sps: no step times");
    double *h = malloc((size_t)(n + 1) * sizeof(double));
    int *hull = malloc((size_t)(n + 1) * sizeof(int));
    if (h == NULL || hull == NULL) {
        free(h);
        free(hull);
        return pd_err_set(err, PD_ERR_NOMEM, "sps table");
    }
    for (int b = 1; b <= n; b++)
        if (!(t[b] > 0.0) || !isfinite(t[b])) {
            free(h);
            free(hull);
            return pd_err_set(err, PD_ERR_INVALID, "sps: step time for %d tokens is %g", b, t[b]);
        }
    /* lower convex hull of (b, t[b]) (monotone chain) */
    int m = 0;
    for (int b = 1; b <= n; b++) {
        while (m >= 2) {
            int i = hull[m - 2], j = hull[m - 1];
            double cross = (j - i) * (t[b] - t[i]) - (t[j] - t[i]) * (b - i);
            if (cross <= 0.0)
                m--;
            else
                break;
        }
        hull[m++] = b;
    }
    for (int s = 0; s + 1 < m; s++) {
        int i = hull[s], j = hull[s + 1];
        for (int b = i; b <= j; b++)
            h[b] = t[i] + (t[j] - t[i]) * (double)(b - i) / (double)(j - i);
    }
    h[hull[m - 1]] = t[hull[m - 1]];
    /* a bigger batch never takes less time */
    for (int b = 2; b <= n; b++)
        if (h[b] < h[b - 1])
            h[b] = h[b - 1];
    out->max_tokens = n;
    out->sps = h;
    for (int b = 1; b <= n; b++)
        h[b] = 1.0 / h[b];
    free(hull);
    return PD_OK;
}

pd_status pd_sps_linear(double t0, double t1, int n, pd_sps *out, pd_err *err)
{
    double *t = malloc((size_t)(n + 1) * sizeof(double));
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "sps table");
    for (int b = 1; b <= n; b++)
        t[b] = t0 + t1 * b;
    pd_status st = pd_sps_from_times(t, n, out, err);
    free(t);
    return st;
}

pd_status pd_sps_save(const char *path, const char *key, const double *times, int n, pd_err *err)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "key", key);
    cJSON *a = cJSON_AddArrayToObject(o, "step_seconds");
    for (int b = 1; b <= n; b++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(times[b]));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    FILE *f = fopen(path, "wb");
    if (f == NULL) {
        free(s);
        return pd_err_set(err, PD_ERR_IO, "%s: %s", path, strerror(errno));
    }
    fputs(s, f);
    free(s);
    return fclose(f) == 0 ? PD_OK : pd_err_set(err, PD_ERR_IO, "%s: write failed", path);
}

pd_status pd_sps_load(const char *path, const char *key, pd_sps *out, pd_err *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return pd_err_set(err, PD_ERR_NOT_FOUND, "%s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = len > 0 && len < (64 << 20) ? malloc((size_t)len + 1) : NULL;
    size_t got = buf != NULL ? fread(buf, 1, (size_t)len, f) : 0;
    fclose(f);
    if (buf == NULL || got != (size_t)len) {
        free(buf);
        return pd_err_set(err, PD_ERR_INVALID, "%s: unreadable sps cache", path);
    }
    buf[len] = '\0';
    cJSON *o = pd_json_parse_str(buf, NULL);
    free(buf);
    cJSON *k = cJSON_GetObjectItem(o, "key"), *a = cJSON_GetObjectItem(o, "step_seconds");
    if (o == NULL || !cJSON_IsString(k) || !cJSON_IsArray(a) || cJSON_GetArraySize(a) < 1) {
        cJSON_Delete(o);
        return pd_err_set(err, PD_ERR_INVALID, "%s: malformed sps cache", path);
    }
    if (strcmp(k->valuestring, key) != 0) {
        cJSON_Delete(o);
        return pd_err_set(err, PD_ERR_NOT_FOUND, "%s: cached for another model/device/build", path);
    }
    int n = cJSON_GetArraySize(a);
    double *t = malloc((size_t)(n + 1) * sizeof(double));
    if (t == NULL) {
        cJSON_Delete(o);
        return pd_err_set(err, PD_ERR_NOMEM, "sps table");
    }
    for (int b = 1; b <= n; b++)
        t[b] = cJSON_GetArrayItem(a, b - 1)->valuedouble;
    cJSON_Delete(o);
    pd_status st = pd_sps_from_times(t, n, out, err);
    free(t);
    return st;
}

void pd_sps_cleanup(pd_sps *s)
{
    free(s->sps);
    s->sps = NULL;
    s->max_tokens = 0;
}

double pd_sps_at(const pd_sps *s, int b)
{
    if (s == NULL || s->sps == NULL || b < 1)
        return 1.0;
    if (b > s->max_tokens)   /* beyond the profile: time grows linearly from the last point */
        return s->sps[s->max_tokens] * s->max_tokens / b;
    return s->sps[b];
}

/* ---- choosing lengths ---------------------------------------------------------------------- */

typedef struct {
    double a;
    int r, j;
} cand;

static int cand_cmp(const void *x, const void *y)
{
    const cand *p = x, *q = y;
    if (p->a != q->a)
        return p->a < q->a ? 1 : -1;
    if (p->j != q->j)
        return p->j - q->j;
    return p->r - q->r;
}

/* Expected tokens per second of a round verifying `tokens` tokens in total. */
static double round_rate(double tau, const pd_sps *sps, int tokens, double overhead_s)
{
    return tau / (overhead_s + 1.0 / pd_sps_at(sps, tokens));
}

double pd_verify_choose(pd_verify_policy p, int n_req, int B, const float *conf_logits, const int *max_len,
                        const pd_calib *calib, float threshold, const pd_sps *sps, double overhead_s,
                        int *out_len)
{
    double expected = 0.0;
    if (p == PD_VERIFY_FULL || p == PD_VERIFY_DEFAULT || conf_logits == NULL) {
        for (int r = 0; r < n_req; r++)
            out_len[r] = max_len[r];
        return -1.0;
    }
    if (p == PD_VERIFY_THRESHOLD) {
        for (int r = 0; r < n_req; r++) {
            double a = 1.0;
            int l = 0;
            for (int j = 0; j < max_len[r]; j++) {
                a *= calib_c(calib, j, conf_logits[(size_t)r * B + j]);
                if (a < threshold)
                    break;
                l = j + 1;
                expected += a;
            }
            out_len[r] = l;
            expected += 1.0;
        }
        return expected;
    }
    /* scheduled */
    int n_c = 0;
    for (int r = 0; r < n_req; r++)
        n_c += max_len[r];
    cand *c = malloc((size_t)(n_c > 0 ? n_c : 1) * sizeof(cand));
    if (c == NULL) {   /* no memory for the plan: verify everything (still lossless) */
        for (int r = 0; r < n_req; r++)
            out_len[r] = max_len[r];
        return -1.0;
    }
    int i = 0;
    for (int r = 0; r < n_req; r++) {
        double a = 1.0;
        for (int j = 0; j < max_len[r]; j++) {
            a *= calib_c(calib, j, conf_logits[(size_t)r * B + j]);
            c[i++] = (cand){ .a = a, .r = r, .j = j + 1 };
        }
        out_len[r] = 0;
    }
    qsort(c, (size_t)n_c, sizeof(cand), cand_cmp);
    double tau = n_req;   /* every request gets its bonus token */
    int tokens = n_req;
    if (!(overhead_s >= 0.0))
        overhead_s = 0.0;
    double best = round_rate(tau, sps, tokens, overhead_s);
    for (i = 0; i < n_c; i++) {
        if (c[i].j != out_len[c[i].r] + 1)
            continue;   /* not the next prefix position (cannot happen with sorted a; kept safe) */
        double next = round_rate(tau + c[i].a, sps, tokens + 1, overhead_s);
        if (next <= best)
            break;      /* the first drop ends the search */
        best = next;
        tau += c[i].a;
        tokens++;
        out_len[c[i].r] = c[i].j;
    }
    free(c);
    return tau;
}

/* ---- the scheduled policy's arms ----------------------------------------------------------- */

void pd_sched_init(pd_sched_ctl *c, const pd_sps *sps)
{
    memset(c, 0, sizeof(*c));
    c->sps = sps;
    c->accept_f = 1.0;
    c->all_tau = -1.0;
}

void pd_sched_set_switch(pd_sched_ctl *c, double s) { c->switch_s = s > 0.0 ? s : 0.0; }

void pd_sched_set_accept(pd_sched_ctl *c, double f)
{
    c->accept_f = f >= 0.0 && f < 8.0 ? f : f >= 8.0 ? 8.0 : 1.0;
    c->all_tau = -1.0;
}

void pd_sched_set_all_tau(pd_sched_ctl *c, double tau) { c->all_tau = tau >= 1.0 ? tau : -1.0; }

int pd_sched_class(int m)
{
    int cl = 0;
    while (m > 1 && cl < PD_SCHED_CLASSES - 1) {
        m >>= 1;
        cl++;
    }
    return cl;
}

static double verify_s(const pd_sched_ctl *c, double n_tok)
{
    int n = (int)(n_tok + 0.5);
    return 1.0 / pd_sps_at(c->sps, n < 1 ? 1 : n);
}

/* A class's value for m: the class's own when it has data (has(cl)), else interpolated
 * linearly in m between the nearest classes below and above with data, or the nearest one.
 * val(cl, &mean_m) gives a class's value and mean batch size. Returns 0 when no class has data. */
typedef struct {
    const pd_sched_ctl *c;
    int a;                          /* arm, or -1: the draft round */
    const pd_sched_stat (*st)[PD_SCHED_CLASSES];   /* the arms' warm or cold rounds */
} near_ctx;

static int near_has(const near_ctx *n, int cl)
{
    return n->a < 0 ? n->c->d_n[cl] > 1 : n->st[n->a][cl].n > 0;
}

static int near_lookup(const near_ctx *n, int m, int *lo, int *hi)
{
    int cl = pd_sched_class(m);
    *lo = *hi = -1;
    if (near_has(n, cl)) {
        *lo = cl;
        return 1;
    }
    for (int d = cl - 1; d >= 0 && *lo < 0; d--)
        if (near_has(n, d))
            *lo = d;
    for (int d = cl + 1; d < PD_SCHED_CLASSES && *hi < 0; d++)
        if (near_has(n, d))
            *hi = d;
    return *lo >= 0 || *hi >= 0;
}

/* weight of class hi when interpolating between lo and hi at m (0 when only lo is used) */
static double near_weight(double m_lo, double m_hi, int m)
{
    if (m_hi <= m_lo)
        return 0.0;
    double w = (m - m_lo) / (m_hi - m_lo);
    return w < 0.0 ? 0.0 : w > 1.0 ? 1.0 : w;
}

double pd_sched_draft_s(const pd_sched_ctl *c, int m)
{
    near_ctx n = { c, -1, NULL };
    int lo, hi;
    if (!near_lookup(&n, m, &lo, &hi))
        return 0.0;
    if (lo < 0 || hi < 0) {
        int k = lo >= 0 ? lo : hi;
        return c->d_sec[k] / c->d_rounds[k];
    }
    double w = near_weight(c->d_req[lo] / c->d_rounds[lo], c->d_req[hi] / c->d_rounds[hi], m);
    return (1.0 - w) * c->d_sec[lo] / c->d_rounds[lo] + w * c->d_sec[hi] / c->d_rounds[hi];
}

/* tokens per request of arm a: as recorded, with the accepted part scaled by accept_f, or the
 * all-drafts arm's expectation for this round's requests when one is set */
static double arm_tau(const pd_sched_ctl *c, pd_sched_arm a, double tau)
{
    if (a == PD_SCHED_PLAIN)
        return tau;
    if (a == PD_SCHED_ALL && c->all_tau >= 1.0)
        return c->all_tau;
    return 1.0 + (tau - 1.0) * c->accept_f;
}

void pd_sched_parts_of(const pd_sched_ctl *c, pd_sched_arm a, int m, pd_sched_parts *p)
{
    memset(p, 0, sizeof(*p));
    p->rate = -1.0;
    if (c->sps == NULL) {   /* no model: this class's measured rate, nothing carries over */
        const pd_sched_stat *s = &c->st[a][pd_sched_class(m)];
        if (s->n == 0)
            s = &c->st_cold[a][pd_sched_class(m)];
        if (s->n == 0 || s->sec <= 0.0)
            return;
        p->n = s->n;
        p->tau = arm_tau(c, a, s->tok / s->treq);
        p->round_s = s->sec / s->rounds;
        p->rest_s = p->round_s;
        p->rate = p->tau * (s->req / s->rounds) / p->round_s;   /* tokens per request x requests */
        return;
    }
    /* the arm's steady rounds wherever it has some; its cold ones only when it has none */
    near_ctx n = { c, (int)a, c->st };
    int lo, hi;
    if (!near_lookup(&n, m, &lo, &hi)) {
        n.st = c->st_cold;
        if (!near_lookup(&n, m, &lo, &hi))
            return;
    }
    int k[2] = { lo, hi };
    double w[2] = { 1.0, 0.0 };
    if (lo < 0 || hi < 0) {
        k[0] = lo >= 0 ? lo : hi;
        k[1] = -1;
    } else {
        const pd_sched_stat *sl = &n.st[a][lo], *sh = &n.st[a][hi];
        w[1] = near_weight(sl->req / sl->rounds, sh->req / sh->rounds, m);
        w[0] = 1.0 - w[1];
    }
    /* per round: the rest besides verify and draft and the draft round; from larger batches
     * only (nothing known at m or below) the rest is taken per request: much of it is (batch
     * metadata, commits, prompts of new requests), and as a whole it made no drafts look slow
     * at m = 8 from rounds at m = 128, so a batch ramping up drafted */
    double v = 0.0;
    for (int i = 0; i < 2; i++) {
        if (k[i] < 0)
            continue;
        const pd_sched_stat *s = &n.st[a][k[i]];
        double mean_m = s->req / s->rounds;
        double per = k[1] < 0 && k[i] > pd_sched_class(m) && mean_m > m ? m / mean_m : 1.0;
        p->n += s->n;
        p->tau += w[i] * s->tok / s->treq;
        v += w[i] * s->vtok / s->treq;
        p->rest_s += w[i] * per * (s->sec - s->vsec - s->dsec) / s->rounds;
        p->draft_s += w[i] * s->dsec / s->rounds;
    }
    /* at another class the draft round is the one measured nearest to m, by any arm */
    double dm = pd_sched_draft_s(c, m);
    if (k[0] != pd_sched_class(m) && a != PD_SCHED_PLAIN && dm > 0.0)
        p->draft_s = dm;
    p->tau = arm_tau(c, a, p->tau);
    p->verify_tok = m * v;
    p->verify_s = verify_s(c, p->verify_tok);
    p->round_s = p->verify_s + p->rest_s + p->draft_s;
    p->rate = p->round_s > 0.0 ? m * p->tau / p->round_s : -1.0;
}

/* tokens/s of arm a at m, and the seconds of one of its rounds (*t_round) */
static double estimate(const pd_sched_ctl *c, pd_sched_arm a, int m, double *t_round)
{
    pd_sched_parts p;
    pd_sched_parts_of(c, a, m, &p);
    *t_round = p.round_s;
    return p.rate;
}

int pd_sched_all_wins(const pd_sched_ctl *c, int m)
{
    double all = pd_sched_estimate(c, PD_SCHED_ALL, m), plain = pd_sched_estimate(c, PD_SCHED_PLAIN, m);
    return all > 0.0 && plain > 0.0 && all > plain;
}

double pd_sched_estimate(const pd_sched_ctl *c, pd_sched_arm a, int m)
{
    double t;
    return estimate(c, a, m, &t);
}

static pd_sched_arm pick(pd_sched_ctl *c, int m);

pd_sched_arm pd_sched_pick(pd_sched_ctl *c, int m)
{
    pd_sched_arm a = pick(c, m);
    c->n_arm[a]++;
    return a;
}

static pd_sched_arm pick(pd_sched_ctl *c, int m)
{
    static const pd_sched_arm first[PD_SCHED_ARMS] = { PD_SCHED_ALGO1, PD_SCHED_ALL, PD_SCHED_PLAIN };
    c->n_picks++;
    double est[PD_SCHED_ARMS], t[PD_SCHED_ARMS];
    for (int i = 0; i < PD_SCHED_ARMS; i++) {
        est[first[i]] = estimate(c, first[i], m, &t[first[i]]);
        if (est[first[i]] < 0.0)
            return first[i];
    }
    /* a drafting arm picked now first pays the switch (switch_s): charged to its round, so a
     * drafting arm ahead by less than that does not take over */
    if (c->switch_s > 0.0)
        for (int a = 0; a < PD_SCHED_ARMS; a++)
            if (a != PD_SCHED_PLAIN && t[a] > 0.0)
                est[a] *= t[a] / (t[a] + c->switch_s);
    int best = 0;
    for (int a = 1; a < PD_SCHED_ARMS; a++)
        if (est[a] > est[best])
            best = a;
    /* another arm is tried again once the time run since its last round reaches
     * PD_SCHED_EXPLORE_K times what one of its rounds is expected to lose against the best arm
     * (at least a quarter of its round): exploring costs about 1 / K of the time per arm */
    int pickx = -1;
    double most = 1.0;
    for (int a = 0; a < PD_SCHED_ARMS; a++) {
        if (a == best)
            continue;
        double loss = t[a] * (1.0 - est[a] / est[best]);
        if (loss < 0.25 * t[a])
            loss = 0.25 * t[a];
        if (a != PD_SCHED_PLAIN)
            loss += c->switch_s;
        double r = loss > 0.0 ? c->credit[a] / (PD_SCHED_EXPLORE_K * loss) : 0.0;
        if (r >= most) {
            most = r;
            pickx = a;
        }
    }
    return (pd_sched_arm)(pickx >= 0 ? pickx : best);
}

void pd_sched_add(pd_sched_ctl *c, pd_sched_arm a, int m, double tok, double sec, double draft_sec,
                  int v_tok, int cold)
{
    int cl = pd_sched_class(m);
    for (int i = 0; i < PD_SCHED_ARMS; i++)
        c->credit[i] = i == (int)a ? 0.0 : c->credit[i] + sec;
    if (cold && c->sps != NULL) {
        /* its tokens are real, its time is not: the profile's verify step plus the steady
         * draft round measured nearest to m (this round's own when none is) */
        double d = a == PD_SCHED_PLAIN ? 0.0 : pd_sched_draft_s(c, m);
        draft_sec = a == PD_SCHED_PLAIN ? 0.0 : d > 0.0 ? d : draft_sec;
        sec = verify_s(c, v_tok) + draft_sec;
    }
    pd_sched_stat *s = cold ? &c->st_cold[a][cl] : &c->st[a][cl];
    const double k = PD_SCHED_DECAY, kt = PD_SCHED_DECAY_TAU;
    s->tok = kt * s->tok + tok;
    s->treq = kt * s->treq + m;
    s->vtok = kt * s->vtok + v_tok;
    s->sec = k * s->sec + sec;
    s->req = k * s->req + m;
    s->vsec = k * s->vsec + (c->sps != NULL ? verify_s(c, v_tok) : 0.0);
    s->dsec = k * s->dsec + draft_sec;
    s->rounds = k * s->rounds + 1.0;
    s->n++;
}

void pd_sched_add_draft(pd_sched_ctl *c, int m, double sec)
{
    int cl = pd_sched_class(m);
    const double k = PD_SCHED_DECAY;
    if (c->d_n[cl]++ == 0)
        return;   /* the first one carries warm-up: graph capture, scratch growth */
    c->d_sec[cl] = k * c->d_sec[cl] + sec;
    c->d_req[cl] = k * c->d_req[cl] + m;
    c->d_rounds[cl] = k * c->d_rounds[cl] + 1.0;
}
