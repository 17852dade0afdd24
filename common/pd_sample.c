/* pd_sample.c - sampling and lossless verification (see pd_sample.h).
 * The RNG is xoshiro256** seeded through splitmix64, so a seed reproduces a run exactly. */
#include "pd_sample.h"

#include "kern_backend.h"

#include <math.h>
#include <stdlib.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void pd_rng_seed(pd_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t pd_rng_next(pd_rng *r)
{
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double pd_rng_uniform(pd_rng *r)
{
    return (double)(pd_rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

pd_status pd_sample_params_check(const pd_sample_params *p, pd_err *err)
{
    if (!isfinite(p->temperature) || p->temperature < 0.0f)
        return pd_err_set(err, PD_ERR_INVALID, "temperature %g must be a finite number >= 0",
                          (double)p->temperature);
    if (p->top_k < 0)
        return pd_err_set(err, PD_ERR_INVALID, "top_k %d must be >= 0", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return pd_err_set(err, PD_ERR_INVALID, "top_p %g must be in (0, 1]", (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return pd_err_set(err, PD_ERR_INVALID, "min_p %g must be in [0, 1] (0 = off)", (double)p->min_p);
    if (!(p->typical_p >= 0.0f && p->typical_p <= 1.0f))
        return pd_err_set(err, PD_ERR_INVALID, "typical_p %g must be in [0, 1] (0 and 1 = off)",
                          (double)p->typical_p);
    return PD_OK;
}

int pd_sample_is_greedy(const pd_sample_params *p) { return p->temperature < 1e-5f; }

pd_status pd_penalties_check(float presence, float frequency, float repetition, pd_err *err)
{
    if (!(presence >= -2.0f && presence <= 2.0f))
        return pd_err_set(err, PD_ERR_INVALID, "presence_penalty %g must be in [-2, 2]", (double)presence);
    if (!(frequency >= -2.0f && frequency <= 2.0f))
        return pd_err_set(err, PD_ERR_INVALID, "frequency_penalty %g must be in [-2, 2]", (double)frequency);
    if (!(repetition >= 0.0f && repetition <= 10.0f))
        return pd_err_set(err, PD_ERR_INVALID, "repetition_penalty %g must be in (0, 10] (0 = off)",
                          (double)repetition);
    return PD_OK;
}

pd_status pd_logit_bias_check(const pd_logit_bias *b, int n, int vocab, pd_err *err)
{
    if (n < 0 || n > PD_MAX_LOGIT_BIAS || (n > 0 && b == NULL))
        return pd_err_set(err, PD_ERR_INVALID, "logit_bias: %d entries (at most %d)", n, PD_MAX_LOGIT_BIAS);
    for (int i = 0; i < n; i++) {
        if (b[i].tok < 0 || b[i].tok >= vocab)
            return pd_err_set(err, PD_ERR_INVALID, "logit_bias: token %d is outside the vocabulary "
                              "(0..%d)", b[i].tok, vocab - 1);
        if (!(b[i].bias >= -100.0f && b[i].bias <= 100.0f))
            return pd_err_set(err, PD_ERR_INVALID, "logit_bias: the bias of token %d, %g, must be "
                              "in [-100, 100]", b[i].tok, (double)b[i].bias);
    }
    return PD_OK;
}

pd_status pd_stop_ids_check(const int32_t *ids, int n, int max, int vocab, pd_err *err)
{
    if (n < 0 || n > max)
        return pd_err_set(err, PD_ERR_INVALID, "stop_token_ids: %d (at most %d)", n, max);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return pd_err_set(err, PD_ERR_INVALID, "stop_token_ids: %d is outside the vocabulary (0..%d)",
                              ids[i], vocab - 1);
    return PD_OK;
}

int32_t pd_argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

void pd_probs_from_logits(const float *logits, int n, const pd_sample_params *p, float *probs,
                          int32_t *scratch, double *dscratch)
{
    kern_sample_cfg c = { .temperature = pd_sample_is_greedy(p) ? 0.0f : p->temperature,
                          .top_k = p->top_k, .top_p = p->top_p, .min_p = p->min_p,
                          .typical_p = p->typical_p };
    kern_probs_row_host(logits, n, &c, probs, scratch, dscratch);
}

int32_t pd_sample_from_probs(const float *probs, int n, pd_rng *rng)
{
    return kern_sample_row_host(probs, n, pd_rng_uniform(rng));
}

int32_t pd_sample_logits(const float *logits, int n, const pd_sample_params *p, pd_rng *rng,
                         float *fscratch, int32_t *iscratch, double *dscratch)
{
    if (pd_sample_is_greedy(p))
        return pd_argmax(logits, n);
    pd_probs_from_logits(logits, n, p, fscratch, iscratch, dscratch);
    return pd_sample_from_probs(fscratch, n, rng);
}
