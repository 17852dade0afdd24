/* pd_sample.h - sampling and speculative verification on host logits.
 * Owns: the seeded RNG, temperature / min-p / top-k / top-p / typical-p filtering (the rule is
 *   kern_probs's, kern_backend.h), greedy argmax (lowest index wins ties), and the lossless acceptance rules
 *   (greedy prefix match; rejection sampling with residual resampling for temperature > 0).
 * Not here: producing logits (pd_qwen3.c, pd_dspark.c). The engine samples with the backend ops
 *   kern_probs / kern_sample / kern_spec_verify (kern_backend.h), which follow these rules; the
 *   functions here are their reference (test_sampling holds the CPU ops to them bit for bit).
 * Threading: pure functions; an rng belongs to one request. */
#ifndef PD_SAMPLE_H
#define PD_SAMPLE_H

#include <stdint.h>

#include "kern_backend.h"
#include "pd_status.h"

typedef struct {
    float temperature;   /* < 1e-5 means greedy */
    int top_k;           /* 0 = off */
    float top_p;         /* >= 1 = off */
    float min_p;         /* 0 = off; tokens below min_p times the most likely one's p drop */
    float typical_p;     /* 0 and 1 = off; else locally typical sampling keeps the tokens whose
                          * surprisal is nearest the entropy, typical_p of the mass (after the
                          * others; transformers' typical_p) */
    uint64_t seed;
} pd_sample_params;

typedef struct { uint64_t s[4]; } pd_rng;

void pd_rng_seed(pd_rng *r, uint64_t seed);
uint64_t pd_rng_next(pd_rng *r);
double pd_rng_uniform(pd_rng *r);   /* [0, 1) */

/* PD_ERR_INVALID naming the field when out of range (temperature < 0 or not finite, top_k < 0,
 * top_p <= 0 or > 1, min_p outside [0, 1], typical_p outside [0, 1]). */
pd_status pd_sample_params_check(const pd_sample_params *p, pd_err *err);
int pd_sample_is_greedy(const pd_sample_params *p);
/* PD_ERR_INVALID naming the field unless presence and frequency are in [-2, 2] and repetition
 * in [0, 10] (0 and 1 = off; the meaning: kern_penalty_entry). */
pd_status pd_penalties_check(float presence, float frequency, float repetition, pd_err *err);

int32_t pd_argmax(const float *x, int n);
/* probs[n] = the filtered, tempered distribution of logits (greedy: one-hot at the argmax), by
 * kern_probs's rule (kern_probs_row_host). scratch must hold n ints; dscratch n doubles when
 * typical_p is on (in (0, 1)), else it may be NULL. */
void pd_probs_from_logits(const float *logits, int n, const pd_sample_params *p, float *probs,
                          int32_t *scratch, double *dscratch);
int32_t pd_sample_from_probs(const float *probs, int n, pd_rng *rng);
/* One token from logits (argmax when greedy). scratch: n floats + n ints (+ n doubles when
 * typical_p is on, else dscratch may be NULL). */
int32_t pd_sample_logits(const float *logits, int n, const pd_sample_params *p, pd_rng *rng,
                         float *fscratch, int32_t *iscratch, double *dscratch);

/* OpenAI logit_bias: added to the token's logit before anything else (kern_penalty_entry). */
#define PD_MAX_LOGIT_BIAS 1024
typedef struct {
    int32_t tok;
    float bias;              /* [-100, 100] */
} pd_logit_bias;

/* PD_ERR_INVALID naming the entry unless n is 0..PD_MAX_LOGIT_BIAS, every token in 0..vocab-1
 * and every bias in [-100, 100] (a token named twice: pd_engine_add). */
pd_status pd_logit_bias_check(const pd_logit_bias *b, int n, int vocab, pd_err *err);

/* PD_ERR_INVALID naming the entry unless n is 0..max and every id in 0..vocab-1 (vLLM's
 * stop_token_ids). */
pd_status pd_stop_ids_check(const int32_t *ids, int n, int max, int vocab, pd_err *err);

/* Log-probabilities of one position for a request that asks for them (the OpenAI `logprobs`):
 * the model's own distribution, log_softmax(logits) before temperature and top-k/top-p (as
 * vLLM's default raw logprobs), so a greedy and a sampled request report the same numbers;
 * kern_logprobs computes them on the backend. */
#define PD_MAX_TOP_LOGPROBS KERN_MAX_TOP_LOGPROBS
/* logprob: of the token that was committed; rank: its rank (vLLM's: how many logits are >= its
 * own, itself included; kern_backend.h); top_id / top_logprob[0..n_top): the most likely
 * tokens, most likely first (a tie: lower id first, as the argmax) */
typedef kern_logprobs_row pd_token_logprobs;

#endif
