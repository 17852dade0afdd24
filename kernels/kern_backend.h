/* kern_backend.h - the compute backend interface: buffers and the ops the models need.
 * Owns: dtypes, kern_buf, the op argument structs, the ops table and the checked wrappers.
 * Not here: any model knowledge (layer order, weights names) - that is common/pd_qwen3.c and
 *   common/pd_dspark.c; shape rules live in kern_ops.c; math lives in cpu/ and cuda/.
 * Conventions:
 *   - Every pointer inside an args struct is backend memory (host memory for the CPU backend,
 *     device memory for CUDA), index arrays (ids, positions, page tables) included, so a
 *     CUDA graph can capture a step without host round trips.
 *   - Activations are always F32. Weights carry their own dtype (F32 on the CPU backend, BF16 on
 *     CUDA); the KV cache dtype is the backend's kv_dtype.
 *   - Matrices are row-major. A weight W of a linear layer is [out, in] as in Hugging Face.
 * Threading: a backend (and its stream) is used by one thread at a time. */
#ifndef KERN_BACKEND_H
#define KERN_BACKEND_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kern_rope.h"
#include "pd_status.h"

typedef enum { KERN_DTYPE_F32 = 0, KERN_DTYPE_BF16, KERN_DTYPE_F16, KERN_DTYPE_I32 } kern_dtype;

size_t kern_dtype_size(kern_dtype dt);
const char *kern_dtype_name(kern_dtype dt);

typedef struct kern_backend kern_backend;
typedef struct kern_backend_ops kern_backend_ops;

/* A block of backend memory. ptr is a host pointer (cpu) or a device pointer (cuda). */
typedef struct kern_buf {
    kern_backend *be;
    void *ptr;
    size_t bytes;
} kern_buf;

/* A weight matrix or vector in backend memory; data is borrowed from a kern_buf. */
typedef struct {
    const void *data;
    kern_dtype dtype;
    int64_t rows;   /* [rows, cols]; vectors have rows = 1 */
    int64_t cols;
} kern_weight;

/* ---- op arguments ------------------------------------------------------------------------ */

/* out[i, :] = table[ids[i], :] converted to F32. */
typedef struct {
    kern_weight table;       /* [vocab, dim] */
    const int32_t *ids;      /* [n] */
    int n;
    float *out;              /* [n, ld_out] */
    int ld_out;              /* row stride of out in elements (>= dim) */
} kern_embed_args;

/* y = rmsnorm(x (+ residual)) * w over rows of length dim.
 * If residual != NULL: s = x + residual is formed first and, if sum_out != NULL, written there
 * (the fused residual add of a pre-norm block). out may alias x; sum_out may alias residual. */
typedef struct {
    const float *x;          /* [rows, ld_x] */
    const float *residual;   /* nullable, [rows, ld_x] */
    float *sum_out;          /* nullable, [rows, ld_x] */
    float *out;              /* [rows, ld_out] */
    kern_weight w;           /* [dim] */
    int rows;
    int dim;
    int ld_x;
    int ld_out;
    float eps;
} kern_rmsnorm_args;

/* y[M, N] = x[M, K] @ w[N, K]^T (+ y if accumulate) (+ bias[N] if bias.data). */
typedef struct {
    const float *x;
    int ld_x;
    kern_weight w;           /* [N, K] */
    kern_weight bias;        /* nullable data, [N] */
    float *y;
    int ld_y;
    int m;
    int n;
    int k;
    int accumulate;
} kern_matmul_args;

/* Rotate-half RoPE in place on x viewed as [n_tok, n_heads, head_dim] with row stride ld
 * (elements between tokens). pos[t] is the absolute position of token t. */
typedef struct {
    float *x;
    int n_tok;
    int n_heads;
    int head_dim;
    int ld;
    const int32_t *pos;
    float theta;
    kern_rope_scaling scaling;   /* zero: plain RoPE */
} kern_rope_args;

typedef enum { KERN_UNARY_SIGMOID = 0, KERN_UNARY_TANH, KERN_UNARY_SILU } kern_unary_op;
typedef enum { KERN_BINARY_ADD = 0, KERN_BINARY_SUB, KERN_BINARY_MUL,
               KERN_BINARY_SWIGLU /* out = silu(a) * b */ } kern_binary_op;

/* out = op(x), elementwise over a [rows, cols] view; out may alias x. */
typedef struct {
    kern_unary_op op;
    const float *x;
    int ld_x;
    float *out;
    int ld_out;
    int rows;
    int cols;
} kern_unary_args;

/* out = a op b, elementwise over a [rows, cols] view; out may alias a or b. */
typedef struct {
    kern_binary_op op;
    const float *a;
    int ld_a;
    const float *b;
    int ld_b;
    float *out;
    int ld_out;
    int rows;
    int cols;
} kern_binary_args;

/* dst[r, 0:cols] = src[idx ? idx[r] : r, 0:cols] (F32 rows; gather, concat and views). */
typedef struct {
    const float *src;
    int ld_src;
    const int32_t *idx;      /* nullable, [rows] */
    float *dst;
    int ld_dst;
    int rows;
    int cols;
} kern_copy_rows_args;

/* A paged KV layer: pages of page_size token slots, each slot n_kv_heads * head_dim values. */
typedef struct {
    void *k;                 /* [n_pages, page_size, n_kv_heads, head_dim] */
    void *v;
    kern_dtype dtype;
    int page_size;
    int n_kv_heads;
    int head_dim;
} kern_kv_layer;

/* Write k/v rows of n_tok tokens into their slots: slot = page * page_size + offset.
 * A negative slot skips its row (padding rows of a context-parallel batch). */
typedef struct {
    kern_kv_layer kv;
    const float *k;          /* [n_tok, ld] with n_kv_heads * head_dim values per row */
    const float *v;
    int ld;
    const int32_t *slot;     /* [n_tok] */
    int n_tok;
} kern_kv_store_args;

/* Paged attention for a ragged batch of queries (prefill chunks, verify blocks, draft blocks).
 * Query t belongs to sequence tok_seq[t] and attends keys at positions 0..tok_kv_len[t]-1 of
 * that sequence, fetched through its page table row. Causal prefill sets kv_len = pos + 1;
 * a non-causal draft block gives every query the same kv_len (context + whole block).
 * GQA: query head h reads kv head h / (n_heads / n_kv_heads). */
typedef struct {
    kern_kv_layer kv;
    const float *q;          /* [n_tok, ld_q], n_heads * head_dim values */
    int ld_q;
    float *out;              /* [n_tok, ld_out] */
    int ld_out;
    int n_tok;
    int n_heads;
    const int32_t *tok_seq;      /* [n_tok] */
    const int32_t *tok_kv_len;   /* [n_tok] */
    const int32_t *page_table;   /* [n_seq, pt_stride] page ids */
    int pt_stride;
    int n_seq;
    int max_kv_len;              /* upper bound of tok_kv_len (host-known; sizes scratch) */
    float scale;
} kern_attn_args;

/* out[r] = argmax over x[r, 0:n] (lowest index wins a tie). */
typedef struct {
    const float *x;
    int ld_x;
    int rows;
    int n;
    int32_t *out;
} kern_argmax_args;

/* Fused linear layer of a decoder block: n_w weights that share one input x [m, k].
 *   x' = norm.data ? rmsnorm(x) * norm (per row, eps) : x
 *   STORE:      y[i][r, 0:n_i]  = x'[r] @ w[i]^T            for i < n_w (QKV in one op: 3 weights)
 *   ACCUMULATE: y[i][r, 0:n_i] += x'[r] @ w[i]^T            (the residual add of o_proj/down_proj)
 *   SWIGLU:     y[0][r, 0:n]    = silu(x'[r] @ w[0]^T) * (x'[r] @ w[1]^T)   (n_w = 2: gate, up)
 * On CUDA (bf16 weights) x' is rounded to bf16 and products accumulate in fp32, as kern_matmul.
 * With be->batch_invariant each row's result is bit-identical whatever else is in the batch.
 * No y[i] may overlap x (rows of y are written while other rows of x are still being read).
 * tee (nullable; one weight, STORE or ACCUMULATE): the final rows of y[0] are also written to
 * tee [m, ld_tee], bit-equal to y[0] (how a model taps its residual stream without a copy). */
typedef enum { KERN_LINEAR_STORE = 0, KERN_LINEAR_ACCUMULATE, KERN_LINEAR_SWIGLU } kern_linear_epilogue;
#define KERN_LINEAR_MAX_W 3
typedef struct {
    const float *x;          /* [m, ld_x] */
    int ld_x;
    int m;
    int k;
    kern_weight norm;        /* nullable data, [k] */
    float eps;
    int n_w;                 /* 1..KERN_LINEAR_MAX_W; SWIGLU: 2 */
    kern_weight w[KERN_LINEAR_MAX_W];     /* [n_i, k] */
    float *y[KERN_LINEAR_MAX_W];          /* [m, ld_y[i]]; SWIGLU writes y[0] only */
    int ld_y[KERN_LINEAR_MAX_W];
    kern_linear_epilogue epilogue;
    float *tee;              /* nullable, [m, ld_tee] */
    int ld_tee;
} kern_linear_args;

/* The SwiGLU MLP of a decoder block in one op: g = silu(x' Wg^T) * (x' Wu^T) over x' =
 * rmsnorm(x) * norm (norm nullable) as kern_linear's SWIGLU, then y = g Wd^T (STORE) or
 * y += g Wd^T (ACCUMULATE), tee as kern_linear's. Equal to those two kern_linear calls (which
 * kern_mlp_split forms); one op so a backend may keep g in its own form between them (the CUDA
 * prefill path keeps it in packed bf16 and never writes g). y may be x (the residual stream:
 * all of x is read before y is written); g must alias neither. After the call g holds the
 * SwiGLU output or is undefined. */
typedef struct {
    const float *x;          /* [m, ld_x] */
    int ld_x;
    int m;
    int k;                   /* hidden size: x's width and y's */
    kern_weight norm;        /* nullable data, [k] */
    float eps;
    kern_weight gate, up;    /* [n, k] */
    kern_weight down;        /* [k, n] */
    float *g;                /* [m, ld_g] scratch (see above) */
    int ld_g;
    float *y;                /* [m, ld_y] */
    int ld_y;
    kern_linear_epilogue epilogue;   /* STORE or ACCUMULATE */
    float *tee;              /* nullable, [m, ld_tee] */
    int ld_tee;
} kern_mlp_args;

/* Qwen3 q/k post-processing of a QKV projection, per token t:
 *   every q head and k head: x = norm_w * rmsnorm(x) over head_dim (q_norm / k_norm, eps), then
 *   rotate-half RoPE at pos[t] (theta, scaling), both written back in place (q [n_tok, ld_q] stays the
 *   attention's query rows, k [n_tok, ld_kv] the rows a context-parallel prefill gathers);
 *   if kv.k != NULL, k and v (v [n_tok, ld_kv], unchanged) are also stored at slot[t] of the
 *   paged cache as kern_kv_store does (a negative slot skips the token). n_heads may be 0 (k/v
 *   only; q may then be NULL). */
typedef struct {
    float *q;
    int ld_q;
    float *k;
    const float *v;
    int ld_kv;
    kern_weight q_norm;      /* [head_dim] */
    kern_weight k_norm;      /* [head_dim] */
    float eps;
    int n_tok;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    const int32_t *pos;      /* [n_tok] */
    float theta;
    kern_rope_scaling scaling;   /* zero: plain RoPE */
    kern_kv_layer kv;        /* kv.k == NULL: store nothing */
    const int32_t *slot;     /* [n_tok], needed when kv.k != NULL */
} kern_qk_post_args;

/* The attention input of a decoder block in one op: kern_linear `lin` (STORE, no tee; the
 * q/k/v weights, or k/v only) then kern_qk_post `post` on its outputs: lin.y[] must be post.q
 * (when post.n_heads > 0), post.k and post.v in that order, with lin.ld_y[] = ld_q, ld_kv,
 * ld_kv. Equal to those two calls; one op so a backend may keep the products in its own form
 * between them (the CUDA prefill path reads them from bf16 scratch and writes q, k and v once). */
typedef struct {
    kern_linear_args lin;
    kern_qk_post_args post;
} kern_qkv_args;

/* The self-attention half of a decoder block in one op: kern_qkv `qkv` (its qk_post storing
 * k/v into the cache attn.kv), kern_attn `attn` on the q it leaves (attn.q = qkv.post.q, same
 * ld), then kern_linear `o` (one weight, no norm, STORE or ACCUMULATE: the o projection and
 * the residual add) on the attention output (o.x = attn.out, same ld). Equal to those three
 * calls; one op so a backend may keep q and the attention output in its own form between them
 * (the CUDA prefill path writes q and the attention output in packed bf16 into the memory of
 * qkv.post.q and attn.out, and never writes k/v rows outside the cache). After the call q, k, v
 * and attn.out hold undefined values; o.y[0] may not overlap any of them. The keys qkv stores
 * are appended: each sequence's new keys (at most qkv.lin.m) are the last ones any of its
 * attention rows sees, every earlier key was in the cache before the call (decode, verify and
 * draft blocks, prefill chunks; the CUDA backend loads those early). */
typedef struct {
    kern_qkv_args qkv;
    kern_attn_args attn;
    kern_linear_args o;
} kern_attn_block_args;

/* One step of the DSpark Markov head for n rows, with the greedy pick:
 *   step[r, :] = base[rows[r], :] + w2 @ vec[r, :]   (w2 [V, R], vec [n, ld_vec] with R values)
 *   ids[r] = argmax step[r, :] (lowest index wins a tie, as kern_argmax). ids is nullable.
 * On CUDA vec is rounded to bf16 (as matmul rounds x) and the dots accumulate in fp32. */
typedef struct {
    const float *base;       /* [*, ld_base] */
    int ld_base;
    const int32_t *rows;     /* [n] rows of base */
    kern_weight w2;          /* [V, R] */
    const float *vec;        /* [n, ld_vec] */
    int ld_vec;
    int n;
    float *step;             /* [n, ld_step] */
    int ld_step;
    int32_t *ids;            /* [n], nullable */
} kern_markov_step_args;

/* The DSpark Markov heads (pd_model.h's markov_type without "none"). */
typedef enum { KERN_MARKOV_VANILLA = 0, KERN_MARKOV_GATED, KERN_MARKOV_RNN } kern_markov_head;

/* steps chained greedy steps of a DSpark Markov head for n rows, in one op:
 *   for k = 0..steps-1, r < n, with i = rows[k * ld_rows + r], p = prev[k * ld_prev + r]:
 *     e = w1[p, :], h = hidden[i, 0:H]
 *     vec = e                                                          (vanilla)
 *         = sigmoid(head_w [h ; e] + head_b) * e                       (gated: head_w [R, H + R])
 *         = tanh(o) where [a ; c ; o] = head_w [s ; e ; h] + head_b,   (rnn: head_w [3R, 2R + H];
 *           s' = c~ + sigmoid(a) (s - c~), c~ = tanh(c), s = 0 at k = 0   s is per row)
 *     step = base[i, :] + w2 @ vec
 *     prev[(k + 1) * ld_prev + r] = argmax step (lowest index wins a tie, as kern_argmax)
 * prev[0..n) holds the anchors (valid token ids); the step logits and the rnn state are not
 * kept. The same arithmetic as the step-by-step ops (kern_embed of w1, kern_copy_rows,
 * kern_matmul with bias, kern_unary, kern_binary, then kern_markov_step with ids) on the CPU; on
 * CUDA one launch for the chain when w1/w2 are bf16 with R % 8 == 0 and the shapes fit, where a
 * gated/rnn head splits head_w's product into its h part (one matmul for every step before the
 * chain) and its e/s part (in the chain), which moves results within fp32 rounding; the
 * step-by-step ops otherwise. scratch (gated, rnn; nullable for vanilla) is work memory of
 * kern_markov_chain_scratch(args) floats, left undefined. */
typedef struct {
    const float *base;       /* [*, ld_base] */
    int ld_base;
    const int32_t *rows;     /* [steps, ld_rows] rows of base (and of hidden) */
    int ld_rows;
    kern_weight w1;          /* [V, R] */
    kern_weight w2;          /* [V, R] */
    int32_t *prev;           /* [steps + 1, ld_prev] */
    int ld_prev;
    int n, steps;
    kern_markov_head head;
    const float *hidden;     /* gated, rnn: [*, ld_hidden] block hidden rows h */
    int ld_hidden;
    kern_weight head_w;      /* gated: gate_w [R, H + R]; rnn: joint_w [3R, 2R + H] */
    kern_weight head_b;      /* [head_w.rows] */
    float *scratch;          /* gated, rnn: [kern_markov_chain_scratch(args)] */
} kern_markov_chain_args;

/* ---- sampling (temperature / min-p / top-k / top-p / typical-p) and speculative verification
 * The rules are pd_sample.h's, so a sampled request gives the same tokens on every backend up
 * to float rounding: the CPU entries are the host functions below (kern_probs_row_host,
 * kern_sample_row_host), which pd_probs_from_logits and pd_sample_from_probs call. Uniforms come
 * from the caller (drawn from the request's seeded rng on the host), so seeds reproduce. */

/* Sampling parameters of one row (backend memory; the caller validated them with
 * pd_sample_params_check). */
typedef struct {
    float temperature;       /* < 1e-5: greedy, the row becomes one-hot at its argmax */
    int32_t top_k;           /* <= 0 or >= n: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float typical_p;         /* <= 0 or >= 1: off */
} kern_sample_cfg;

/* out[r, 0:n] = the sampling distribution of logits row x[idx ? idx[r] : r] under cfg[r], in
 * vLLM's order and meaning:
 *   greedy: one-hot at the argmax (lowest index wins a tie, as kern_argmax);
 *   else p = softmax(x / T) (exp in double, as the reference); then the candidates are the
 *   tokens with p >= min_p * max(p) (in double) and p >= the k-th largest p (ties with it stay,
 *   as vLLM's and transformers' top-k keep them); then top-p runs over the candidates'
 *   renormalised distribution: in order of (p descending, index ascending) they are kept up to
 *   and including the first whose running mass reaches top_p times theirs. Masses are integers
 *   in units of 2^-60 (p rounded to the nearest unit), so every backend keeps the same tokens:
 *   the first whose running mass m satisfies m >= ceil((double)top_p * (double)M), M the
 *   candidates' mass; then, when 0 < typical_p < 1, locally typical sampling (transformers'
 *   TypicalLogitsWarper) runs over the tokens top-p kept, of mass K (an integer) and
 *   distribution q = p / (K / 2^60) (doubles): their entropy H is the sum of
 *   kern_typical_term(p, K / 2^60) (integers in units of 2^-56, so the sum has no order) over
 *   2^56, each token's score is kern_typical_score(p, K / 2^60, H) = |log q + H| (the distance
 *   of its surprisal from H; a function of p alone), and in order of (score ascending, index
 *   ascending) they are kept up to and including the first whose running mass m satisfies
 *   m >= ceil((double)typical_p * (double)K). Logarithms are kern_typical_log's, the same
 *   arithmetic on every backend, so the scores and the kept tokens are too. The kept ones are
 *   divided by their mass (the integer over 2^60, a double) and the rest set to 0. out must not
 *   overlap x. */
typedef struct {
    const float *x;          /* [*, ld_x] logits */
    int ld_x;
    const int32_t *idx;      /* nullable, [rows] */
    const kern_sample_cfg *cfg;   /* [rows] */
    int rows;
    int n;
    float *out;              /* [rows, ld_out] */
    int ld_out;
} kern_probs_args;

/* One row of kern_probs on the host, as the CPU backend computes it (pd_probs_from_logits is
 * this). order: n ints of scratch; score: n doubles of scratch when typical-p is on (0 <
 * c->typical_p < 1), else unused (NULL is fine). */
void kern_probs_row_host(const float *x, int n, const kern_sample_cfg *c, float *p, int32_t *order,
                         double *score);

/* typical-p's arithmetic (kern_probs), one body for every backend: each step is a single IEEE
 * operation (fma where a product meets a sum, so no compiler contracts it differently), so the
 * host and the device get the same bits. */
#ifdef __CUDACC__
#define KERN_SAMPLE_HD __host__ __device__
#else
#define KERN_SAMPLE_HD
#endif

/* The natural logarithm of a finite x > 0 to a few ulps, without libm's log (whose last bit
 * differs between the host and the device): x = m 2^e with m in [sqrt(1/2), sqrt(2)), and
 * log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by its series through s^19. */
KERN_SAMPLE_HD static inline double kern_typical_log(double x)
{
    int e;
    double m = frexp(x, &e);
    if (m < 0.70710678118654757) {
        m = m * 2.0;
        e = e - 1;
    }
    const double s = (m - 1.0) / (m + 1.0), z = s * s;
    double a = 0.052631578947368418131;                 /* 1/19 */
    a = fma(a, z, 0.058823529411764705066);             /* 1/17 */
    a = fma(a, z, 0.066666666666666665741);             /* 1/15 */
    a = fma(a, z, 0.076923076923076927347);             /* 1/13 */
    a = fma(a, z, 0.090909090909090911614);             /* 1/11 */
    a = fma(a, z, 0.11111111111111110494);              /* 1/9 */
    a = fma(a, z, 0.14285714285714284921);              /* 1/7 */
    a = fma(a, z, 0.2000000000000000111);               /* 1/5 */
    a = fma(a, z, 0.33333333333333331483);              /* 1/3 */
    const double r = 2.0 * fma(s * z, a, s);
    /* ln 2 split as fdlibm's: e * hi is exact for |e| < 2^11 */
    return fma((double)e, 6.93147180369123816490e-01, fma((double)e, 1.90821492927058770002e-10, r));
}

/* -q log q for q = p / kept, in integer units of 2^-56 (the entropy of a distribution over at
 * most 2^31 tokens, < 22, fits an int64). p > 0. */
KERN_SAMPLE_HD static inline long long kern_typical_term(float p, double kept)
{
    const double q = (double)p / kept;
    return llrint(ldexp(-q * kern_typical_log(q), 56));
}

/* H = the sum of the kern_typical_term's over 2^56 */
KERN_SAMPLE_HD static inline double kern_typical_entropy(long long sum)
{
    return ldexp((double)sum, -56);
}

/* |log q + H| for q = p / kept, p > 0: a token's typical-p score (lower is kept first) */
KERN_SAMPLE_HD static inline double kern_typical_score(float p, double kept, double h)
{
    return fabs(kern_typical_log((double)p / kept) + h);
}

/* out[r] = the token that inverse-CDF sampling of probs row r picks for u[r] in [0, 1): the
 * first token i (index order, zero entries skipped) whose running mass exceeds u[r]; when
 * rounding leaves u[r] above the total, the last token with mass. */
typedef struct {
    const float *probs;      /* [rows, ld] */
    int ld;
    int rows;
    int n;
    const double *u;         /* [rows] */
    int32_t *out;            /* [rows] */
} kern_sample_args;

/* One row of kern_sample on the host, as the CPU backend computes it (pd_sample_from_probs is
 * this with a uniform from its generator). */
int32_t kern_sample_row_host(const float *p, int n, double u);

/* Rejection-sampling verification of n_req requests in one launch (Leviathan et al.):
 * request r checked drafts d = draft[r, 0:len[r]] against target rows p[p_row[r] + i] and draft
 * rows q[q_row[r] + i]: draft i is accepted when u[r, i] < min(1, p_i[d_i] / max(q_i[d_i], 1e-8));
 * at the first rejection a the next token is sampled (with u[r, len[r]]) from
 * normalise(max(0, p_a - q_a)) (p_a itself when that mass is <= 1e-8), else from p[p_row + len].
 * out[r, 0] = accepted count, out[r, 1] = next token. */
typedef struct {
    const float *p;          /* [*, ld_p] target distributions */
    int ld_p;
    const float *q;          /* [*, ld_q] draft distributions (may be NULL when every len is 0) */
    int ld_q;
    int n;                   /* vocabulary */
    int n_req;
    const int32_t *p_row;    /* [n_req] */
    const int32_t *q_row;    /* [n_req] */
    const int32_t *len;      /* [n_req], 0 <= len <= ld_draft, len < ld_u */
    const int32_t *draft;    /* [n_req, ld_draft] */
    int ld_draft;
    const double *u;         /* [n_req, ld_u] */
    int ld_u;
    int32_t *out;            /* [n_req, 2] */
} kern_spec_verify_args;

/* Logit processing, in place, before the argmax / kern_probs (vLLM's order and meaning): for
 * each entry, with v = x[row * ld_x + tok]:
 *   the bias first (OpenAI logit_bias; -inf masks the token, as min_tokens does the stop tokens):
 *   v += bias;
 *   the repetition penalty (HF / vLLM; 1 = off) when the token is in the prompt or the output
 *   so far (seen): v = v > 0 ? v / rep : v * rep;
 *   then the OpenAI penalties on its count in the output so far: v -= freq * count, and
 *   v -= pres once when count > 0.
 * Entries name distinct (row, tok) pairs (the caller merges them), so the op is a scatter. */
typedef struct {
    int32_t row, tok;
    int32_t count;           /* occurrences in the output so far (incl. earlier drafts of the
                              * same verify block) */
    int32_t seen;            /* 1: in the prompt or the output */
    float rep, freq, pres;
    float bias;              /* 0 = none */
} kern_penalty_entry;

typedef struct {
    float *x;                /* [*, ld_x] logits, changed in place */
    int ld_x;
    int n;                   /* vocabulary: tok < n */
    int n_entries;
    const kern_penalty_entry *e;   /* [n_entries], backend memory */
} kern_penalty_args;

/* Structured output: every logit of row rows[i] whose bit in mask i is clear becomes -inf
 * (bit t of mask i: bits[i * words + t / 32] >> (t % 32) & 1; pd_grammar's mask). */
typedef struct {
    float *x;                /* [*, ld_x] logits, changed in place */
    int ld_x;
    int n;                   /* vocabulary: the masks cover tokens 0..n-1 */
    int n_rows;
    const int32_t *rows;     /* [n_rows], backend memory */
    const uint32_t *bits;    /* [n_rows, words], backend memory */
    int words;               /* >= (n + 31) / 32 */
} kern_token_mask_args;

/* Log-probabilities (the OpenAI `logprobs`): for row i, the logits x[rows[i]] (log_softmax
 * with lse = max + log(sum of exp(x - max) in double)): out[i].logprob = x[tok[i]] - lse, its
 * rank, and the n_top most likely tokens with theirs, most likely first (equal logits: lower id
 * first, as the argmax). Only the entries come back to the host, not the rows.
 * rank (vLLM's token rank): how many of the n logits are >= x[tok[i]], tok[i] itself included:
 * 1 + the tokens above it, plus every other token tied with it (a tie ranks behind all of its
 * ties, whatever their ids); 0 when x[tok[i]] is NaN. Counted on the logits, so it orders as
 * the logprobs do before their rounding to float. */
#define KERN_MAX_TOP_LOGPROBS 20
typedef struct {
    float logprob;                              /* of tok[i] */
    int32_t rank;                               /* of tok[i]: 1..n (above) */
    int32_t n_top;                              /* entries below */
    int32_t top_id[KERN_MAX_TOP_LOGPROBS];
    float top_logprob[KERN_MAX_TOP_LOGPROBS];
} kern_logprobs_row;

typedef struct {
    const float *x;          /* [*, ld_x] logits */
    int ld_x;
    int n;                   /* vocabulary */
    int n_rows;
    const int32_t *rows;     /* [n_rows] rows of x, backend memory */
    const int32_t *tok;      /* [n_rows] tokens in 0..n-1, backend memory */
    int n_top;               /* 0..KERN_MAX_TOP_LOGPROBS (at most n) */
    kern_logprobs_row *out;  /* [n_rows], backend memory */
} kern_logprobs_args;

/* One row of kern_logprobs on the host, as the CPU backend computes it (pd_logprobs_row is
 * this). */
void kern_logprobs_row_host(const float *x, int n, int32_t tok, int n_top, kern_logprobs_row *out);

/* One logit under one entry's penalties: the arithmetic of every backend (float, this order). */
#ifdef __CUDACC__
__host__ __device__
#endif
static inline float kern_penalize_one(float v, const kern_penalty_entry *e)
{
#ifdef __CUDA_ARCH__
    /* each operation rounded on its own, as the host does (nvcc would fuse a multiply-add) */
    if (e->bias != 0.0f)
        v = __fadd_rn(v, e->bias);
    if (e->seen && e->rep != 1.0f)
        v = v > 0.0f ? __fdiv_rn(v, e->rep) : __fmul_rn(v, e->rep);
    if (e->count > 0)
        v = __fsub_rn(__fsub_rn(v, __fmul_rn(e->freq, (float)e->count)), e->pres);
#else
    if (e->bias != 0.0f)
        v = v + e->bias;
    if (e->seen && e->rep != 1.0f)
        v = v > 0.0f ? v / e->rep : v * e->rep;
    if (e->count > 0)
        v = v - e->freq * (float)e->count - e->pres;
#endif
    return v;
}

/* ---- the backend ------------------------------------------------------------------------- */

/* One piece of a batched copy: n bytes from src to dst. */
typedef struct {
    void *dst;
    const void *src;
    size_t n;
} kern_copy_span;

struct kern_backend_ops {
    const char *name;
    pd_status (*buf_alloc)(kern_backend *be, size_t bytes, kern_buf **out, pd_err *err);
    void (*buf_free)(kern_backend *be, kern_buf *buf);
    pd_status (*upload)(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err);
    pd_status (*download)(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err);
    /* n downloads at once (backend memory to host), all landed when it returns; a backend may
     * batch them (cuda: through its pinned ring, one copy kernel and one wait per ring fill
     * instead of a copy and a wait per span). For many small scattered pieces: a sequence's KV
     * pages. */
    pd_status (*download_spans)(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err);
    /* n uploads at once (host memory to the backend's); the host buffers may be reused when it
     * returns */
    pd_status (*upload_spans)(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err);
    pd_status (*memset0)(kern_backend *be, void *dst, size_t n, pd_err *err);
    /* Page-aligned host memory that this backend copies to and from fastest (cuda: pinned,
     * which the batched copies above read and write in place instead of through their ring;
     * cpu: plain memory). Not zeroed. For buffers that live long (a staging pool, the swap
     * arena): pinning is slow (~a second per few GB). host_free takes NULL; nothing queued may
     * still use the block. */
    pd_status (*host_alloc)(kern_backend *be, size_t bytes, void **out, pd_err *err);
    void (*host_free)(kern_backend *be, void *p);
    /* Converts n values of src_dtype (host memory) into dst (backend memory, dst_dtype). */
    pd_status (*upload_convert)(kern_backend *be, void *dst, kern_dtype dst_dtype,
                                const void *src, kern_dtype src_dtype, size_t n, pd_err *err);
    pd_status (*sync)(kern_backend *be, pd_err *err);
    /* The backend device's memory: what is free now and its total (bytes); on the cpu backend
     * the host's (available memory, total RAM). */
    pd_status (*mem_info)(kern_backend *be, size_t *free_bytes, size_t *total_bytes, pd_err *err);
    /* Stream capture (CUDA graphs, DESIGN.md section 6). graph_begin: the ops that follow are
     * recorded, not run, until graph_end, which instantiates them as *out (the caller then runs
     * it with graph_launch: nothing recorded has run yet). PD_ERR_UNSUPPORTED from graph_begin:
     * this backend has no graphs (cpu); run the ops eagerly. graph_end after a failed op ends
     * the capture and discards it (*out = NULL). graph_launch answers PD_ERR_BUSY when the graph
     * is stale (the backend's scratch memory moved since its capture): free it and capture
     * again. */
    pd_status (*graph_begin)(kern_backend *be, pd_err *err);
    pd_status (*graph_end)(kern_backend *be, void **out, pd_err *err);
    pd_status (*graph_launch)(kern_backend *be, void *graph, pd_err *err);
    void (*graph_free)(kern_backend *be, void *graph);
    pd_status (*embed)(kern_backend *be, const kern_embed_args *a, pd_err *err);
    pd_status (*rmsnorm)(kern_backend *be, const kern_rmsnorm_args *a, pd_err *err);
    pd_status (*matmul)(kern_backend *be, const kern_matmul_args *a, pd_err *err);
    pd_status (*rope)(kern_backend *be, const kern_rope_args *a, pd_err *err);
    pd_status (*unary)(kern_backend *be, const kern_unary_args *a, pd_err *err);
    pd_status (*binary)(kern_backend *be, const kern_binary_args *a, pd_err *err);
    pd_status (*copy_rows)(kern_backend *be, const kern_copy_rows_args *a, pd_err *err);
    pd_status (*kv_store)(kern_backend *be, const kern_kv_store_args *a, pd_err *err);
    pd_status (*attn)(kern_backend *be, const kern_attn_args *a, pd_err *err);
    pd_status (*argmax)(kern_backend *be, const kern_argmax_args *a, pd_err *err);
    pd_status (*linear)(kern_backend *be, const kern_linear_args *a, pd_err *err);
    pd_status (*qk_post)(kern_backend *be, const kern_qk_post_args *a, pd_err *err);
    pd_status (*mlp)(kern_backend *be, const kern_mlp_args *a, pd_err *err);
    pd_status (*qkv)(kern_backend *be, const kern_qkv_args *a, pd_err *err);
    pd_status (*attn_block)(kern_backend *be, const kern_attn_block_args *a, pd_err *err);
    pd_status (*markov_step)(kern_backend *be, const kern_markov_step_args *a, pd_err *err);
    pd_status (*markov_chain)(kern_backend *be, const kern_markov_chain_args *a, pd_err *err);
    pd_status (*probs)(kern_backend *be, const kern_probs_args *a, pd_err *err);
    pd_status (*sample)(kern_backend *be, const kern_sample_args *a, pd_err *err);
    pd_status (*spec_verify)(kern_backend *be, const kern_spec_verify_args *a, pd_err *err);
    pd_status (*penalty)(kern_backend *be, const kern_penalty_args *a, pd_err *err);
    pd_status (*token_mask)(kern_backend *be, const kern_token_mask_args *a, pd_err *err);
    pd_status (*logprobs)(kern_backend *be, const kern_logprobs_args *a, pd_err *err);
    void (*destroy)(kern_backend *be);
};

struct kern_backend {
    const kern_backend_ops *ops;
    void *impl;                 /* backend-private state */
    kern_dtype weight_dtype;    /* dtype weights are stored in */
    kern_dtype kv_dtype;        /* dtype of KV pages */
    int is_host;                /* 1 when buffers are plain host memory (cpu) */
    /* 1: matmul and attention compute each row exactly as they would in a batch of one, so a
     * token's result never depends on what else is in the batch (the decode steps set it: a
     * verify block then gives bit-identical logits to single-token decoding, which keeps greedy
     * speculative decoding lossless in bf16). 0: fastest kernels (prefill). The CPU reference
     * ignores it. Set by the thread that uses the backend. */
    int batch_invariant;
    /* 1: every op rounds the activations it writes to bf16 (stored as F32) where a bf16 model
     * stores them in Hugging Face transformers: linear outputs (a residual add rounds the
     * product, then the sum), RMSNorm as w * bf16(x / rms) then rounded, RoPE with bf16 cos/sin
     * and each product and sum rounded, SwiGLU's silu and product, attention outputs, the
     * elementwise ops, the Markov head's bias and the biased logits. The logits are then bf16
     * values, so greedy decoding sees the reference's exact ties (lowest id wins, as
     * torch.argmax) instead of fp32 near-ties that fall either way; tau and the greedy text
     * follow a bf16 reference run much more closely (docs/GPU_TESTS.md). The skinny GEMM keeps
     * its fused RMSNorm (bf16(w * x) into the tensor cores, 1/rms on the fp32 sums, the product
     * rounded). Set by the backend: CUDA with bf16 weights; the CPU reference when its config asks
     * (the oracle of that path in tests). Read by the ops at launch. */
    int act_bf16;
};

typedef struct {
    const char *name;   /* "cpu" or "cuda" */
    int device;         /* cuda device ordinal */
    int threads;        /* cpu: BLAS threads (0 = library default) */
    int f32;            /* cuda: weights and KV cache in fp32 instead of bf16 (twice the bytes;
                         * the results of the CPU reference, which always is fp32) */
    int act_bf16;       /* cpu: round activations as a bf16 model does (kern_backend.act_bf16);
                         * cuda: ignored (on exactly when the weights are bf16) */
} kern_backend_config;

/* Creates a backend by name. Refuses an ops table with a NULL entry. Errors: PD_ERR_INVALID
 * (unknown name), PD_ERR_UNSUPPORTED (cuda not built), PD_ERR_CUDA (no device). */
pd_status kern_backend_create(const kern_backend_config *cfg, kern_backend **out, pd_err *err);
void kern_backend_destroy(kern_backend *be);
/* For a thread other than the creator that is about to use be: binds it to be's device (cuda;
 * *device = its ordinal) or does nothing (host backends; *device = -1). device may be NULL. */
pd_status kern_backend_bind_thread(kern_backend *be, int *device, pd_err *err);
/* Devices a backend of this name can use: cuda = visible GPUs (0 without CUDA support or a
 * driver), cpu = 1, anything else 0. */
int kern_backend_device_count(const char *name);
/* The backend's stream (cudaStream_t behind void *) or NULL for host backends. */
void *kern_backend_stream(kern_backend *be);
/* Checks that every op of a table is set (used by kern_backend_create and tests). */
pd_status kern_backend_check_ops(const kern_backend_ops *ops, pd_err *err);

/* ---- checked wrappers (kern_ops.c): shape rules in one place, then be->ops->X ------------ */
pd_status kern_buf_alloc(kern_backend *be, size_t bytes, kern_buf **out, pd_err *err);
void kern_buf_free(kern_buf *buf);
/* Makes *buf hold at least need items of per bytes: when it is smaller (or NULL), a buffer of
 * the next power-of-two capacity >= need (min 16) replaces it and *cap is updated. The old
 * contents are not kept. */
pd_status kern_buf_grow(kern_backend *be, kern_buf **buf, int *cap, int need, size_t per, pd_err *err);
pd_status kern_upload(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err);
pd_status kern_download(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err);
pd_status kern_download_spans(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err);
pd_status kern_upload_spans(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err);
pd_status kern_memset0(kern_backend *be, void *dst, size_t n, pd_err *err);
pd_status kern_host_alloc(kern_backend *be, size_t bytes, void **out, pd_err *err);
void kern_host_free(kern_backend *be, void *p);
pd_status kern_upload_convert(kern_backend *be, void *dst, kern_dtype dst_dtype, const void *src,
                              kern_dtype src_dtype, size_t n, pd_err *err);
pd_status kern_sync(kern_backend *be, pd_err *err);
pd_status kern_mem_info(kern_backend *be, size_t *free_bytes, size_t *total_bytes, pd_err *err);
pd_status kern_graph_begin(kern_backend *be, pd_err *err);
pd_status kern_graph_end(kern_backend *be, void **out, pd_err *err);
pd_status kern_graph_launch(kern_backend *be, void *graph, pd_err *err);
void kern_graph_free(kern_backend *be, void *graph);   /* NULL graph: no-op */
pd_status kern_embed(kern_backend *be, const kern_embed_args *a, pd_err *err);
pd_status kern_rmsnorm(kern_backend *be, const kern_rmsnorm_args *a, pd_err *err);
pd_status kern_matmul(kern_backend *be, const kern_matmul_args *a, pd_err *err);
pd_status kern_rope(kern_backend *be, const kern_rope_args *a, pd_err *err);
pd_status kern_unary(kern_backend *be, const kern_unary_args *a, pd_err *err);
pd_status kern_binary(kern_backend *be, const kern_binary_args *a, pd_err *err);
pd_status kern_copy_rows(kern_backend *be, const kern_copy_rows_args *a, pd_err *err);
pd_status kern_kv_store(kern_backend *be, const kern_kv_store_args *a, pd_err *err);
pd_status kern_attn(kern_backend *be, const kern_attn_args *a, pd_err *err);
pd_status kern_argmax(kern_backend *be, const kern_argmax_args *a, pd_err *err);
pd_status kern_linear(kern_backend *be, const kern_linear_args *a, pd_err *err);
pd_status kern_qk_post(kern_backend *be, const kern_qk_post_args *a, pd_err *err);
pd_status kern_mlp(kern_backend *be, const kern_mlp_args *a, pd_err *err);
pd_status kern_qkv(kern_backend *be, const kern_qkv_args *a, pd_err *err);
pd_status kern_attn_block(kern_backend *be, const kern_attn_block_args *a, pd_err *err);

/* The two kern_linear calls kern_mlp equals: gate/up SWIGLU into g, then down from g into y.
 * Inline: the backends below kern_ops.c use it too. */
static inline void kern_mlp_split(const kern_mlp_args *a, kern_linear_args *gate_up,
                                  kern_linear_args *down)
{
    memset(gate_up, 0, sizeof(*gate_up));
    gate_up->x = a->x;
    gate_up->ld_x = a->ld_x;
    gate_up->m = a->m;
    gate_up->k = a->k;
    gate_up->norm = a->norm;
    gate_up->eps = a->eps;
    gate_up->n_w = 2;
    gate_up->w[0] = a->gate;
    gate_up->w[1] = a->up;
    gate_up->y[0] = a->g;
    gate_up->ld_y[0] = a->ld_g;
    gate_up->epilogue = KERN_LINEAR_SWIGLU;
    memset(down, 0, sizeof(*down));
    down->x = a->g;
    down->ld_x = a->ld_g;
    down->m = a->m;
    down->k = (int)a->gate.rows;
    down->n_w = 1;
    down->w[0] = a->down;
    down->y[0] = a->y;
    down->ld_y[0] = a->ld_y;
    down->epilogue = a->epilogue;
    down->tee = a->tee;
    down->ld_tee = a->ld_tee;
}
pd_status kern_markov_step(kern_backend *be, const kern_markov_step_args *a, pd_err *err);
pd_status kern_markov_chain(kern_backend *be, const kern_markov_chain_args *a, pd_err *err);
/* Floats of scratch kern_markov_chain needs for these shapes and head (0 for vanilla). */
size_t kern_markov_chain_scratch(const kern_markov_chain_args *a);
/* For backends: the chain by the step-by-step ops (kern_embed, then for gated/rnn heads
 * kern_copy_rows, kern_matmul, kern_unary, kern_binary, then kern_markov_step), the arithmetic
 * kern_markov_chain defines. Vanilla: e [n, R] and step [n, V] are the caller's work memory on
 * the backend; gated/rnn: both come from a->scratch (e and step are ignored). */
pd_status kern_markov_chain_by_steps(kern_backend *be, const kern_markov_chain_args *a, float *e, float *step,
                                     pd_err *err);
pd_status kern_probs(kern_backend *be, const kern_probs_args *a, pd_err *err);
pd_status kern_sample(kern_backend *be, const kern_sample_args *a, pd_err *err);
pd_status kern_spec_verify(kern_backend *be, const kern_spec_verify_args *a, pd_err *err);
pd_status kern_penalty(kern_backend *be, const kern_penalty_args *a, pd_err *err);
pd_status kern_token_mask(kern_backend *be, const kern_token_mask_args *a, pd_err *err);
pd_status kern_logprobs(kern_backend *be, const kern_logprobs_args *a, pd_err *err);

/* Host helpers for dtype conversion (used by loaders and the CPU backend). */
float kern_bf16_to_f32(uint16_t h);
uint16_t kern_f32_to_bf16(float f);   /* round to nearest even */
/* f rounded to bf16 and widened back when on (kern_backend.act_bf16), f itself otherwise */
float kern_act_round(float f, int on);
float kern_f16_to_f32(uint16_t h);
uint16_t kern_f32_to_f16(float f);
/* Converts n values between host buffers; src and dst must not overlap. */
pd_status kern_convert_host(void *dst, kern_dtype dst_dtype, const void *src, kern_dtype src_dtype,
                            size_t n, pd_err *err);

#endif
