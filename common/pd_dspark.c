/* pd_dspark.c - DSpark drafter forward: context KV injection, non-causal draft block, Markov
 *   head (vanilla / gated / rnn) and confidence head, all on backend ops.
 * Semantics follow DeepSpec's Qwen3DSparkModel: the context rows are hidden_norm(fc(aux)) and
 *   enter every draft layer's attention only through that layer's k_proj/v_proj (+ k_norm,
 *   RoPE at the row's position) - never through input_layernorm; the block tokens see the whole
 *   context and the whole block (no causal mask inside the block).
 * Threading: one thread per runner. */
#include "pd_dspark.h"

#include "pd_graph.h"

#include <stdlib.h>
#include <string.h>

#include "pd_tp.h"

#define TRY(expr) \
    do { pd_status st_ = (expr); if (st_ != PD_OK) return st_; } while (0)

struct pd_draft {
    const pd_dspark_model *m;
    pd_kv_pool *pool;
    pd_act act;
    int B, H, V, R;
    /* context features */
    int cap_ctx;
    kern_buf *ctx;              /* [cap_ctx, H] */
    int n_ctx;
    kern_buf *ext_in;           /* [cap_ext_in, taps * H]: aux rows of a graph-replayed extension */
    int cap_ext_in;
    /* block outputs */
    int cap_req;
    int n_req;
    kern_buf *blk;              /* block hidden [cap_req*B, H] | base logits [cap_req*B, V] */
    float *block_hidden, *base_logits;
    kern_buf *step;             /* per-step scratch, see step_layout() */
    float *step_logits, *w1prev, *feat, *proj, *state, *tmp, *gate, *conf;
    kern_buf *ibuf;             /* int32: row idx [cap_req] | chain rows [B][cap_req] | prev [cap_req]
                                 * | chain ids [B][cap_req] | step ids [cap_req]: prev and chain ids
                                 * are adjacent, so step k's previous tokens sit at prev + k cap */
    int32_t *prev_dev, *rows_dev, *chain_rows, *chain_ids, *ids_dev;
    float *chain_conf;          /* [B][cap_req] confidence logits of a chained round */
    float *chain_feat;          /* [B][cap_req] rows of the confidence head's input (H + R) */
    pd_graph_cache graphs;
    struct pd_tp_rank *tp;      /* vocab-sharded lm_head/markov_w2 (pd_tp.h); NULL: whole */
};

pd_status pd_draft_create(const pd_dspark_model *m, pd_kv_pool *pool, pd_draft **out, pd_err *err)
{
    pd_draft *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "draft runner");
    d->m = m;
    d->pool = pool;
    d->B = m->cfg.block_size;
    d->H = m->cfg.base.hidden_size;
    d->V = m->cfg.base.vocab_size;
    d->R = m->cfg.markov_rank;
    pd_graph_cache_init(&d->graphs, m->be, PD_GRAPHS_AUTO);
    pd_status st = pd_act_init(&d->act, m->be, &m->cfg.base, err);
    if (st != PD_OK) {
        free(d);
        return st;
    }
    *out = d;
    return PD_OK;
}

void pd_draft_destroy(pd_draft *d)
{
    if (d == NULL)
        return;
    pd_graph_cache_clear(&d->graphs);
    pd_act_cleanup(&d->act);
    kern_buf_free(d->ctx);
    kern_buf_free(d->ext_in);
    kern_buf_free(d->blk);
    kern_buf_free(d->step);
    kern_buf_free(d->ibuf);
    free(d);
}

const pd_dspark_model *pd_draft_model(const pd_draft *d) { return d->m; }
pd_kv_pool *pd_draft_pool(const pd_draft *d) { return d->pool; }
const float *pd_draft_ctx_feature(const pd_draft *d) { return d->ctx != NULL ? d->ctx->ptr : NULL; }
const float *pd_draft_block_hidden(const pd_draft *d) { return d->block_hidden; }
const float *pd_draft_base_logits(const pd_draft *d) { return d->base_logits; }
const float *pd_draft_step_logits(const pd_draft *d) { return d->step_logits; }
const int32_t *pd_draft_step_ids(const pd_draft *d) { return d->ids_dev; }
const float *pd_draft_head_gate(const pd_draft *d) { return d->gate; }
const float *pd_draft_head_state(const pd_draft *d) { return d->state; }
void pd_draft_set_tp(pd_draft *d, struct pd_tp_rank *tp) { d->tp = tp; }

static pd_status linear(kern_backend *be, const float *x, int ld_x, const kern_weight *w,
                        const kern_weight *bias, float *y, int ld_y, int m, int accumulate, pd_err *err)
{
    kern_matmul_args mm = {
        .x = x, .ld_x = ld_x, .w = *w, .y = y, .ld_y = ld_y,
        .m = m, .n = (int)w->rows, .k = (int)w->cols, .accumulate = accumulate,
    };
    if (bias != NULL)
        mm.bias = *bias;
    return kern_matmul(be, &mm, err);
}

static pd_status copy_cols(kern_backend *be, const float *src, int ld_src, float *dst, int ld_dst,
                           int rows, int cols, const int32_t *idx, pd_err *err)
{
    kern_copy_rows_args cp = { .src = src, .ld_src = ld_src, .idx = idx, .dst = dst, .ld_dst = ld_dst,
                               .rows = rows, .cols = cols };
    return kern_copy_rows(be, &cp, err);
}

static pd_status ensure_ctx(pd_draft *d, int n, pd_err *err)
{
    return kern_buf_grow(d->m->be, &d->ctx, &d->cap_ctx, n, (size_t)d->H * sizeof(float), err);
}

/* k/v of context rows for every draft layer, stored at the batch's slots */
static pd_status store_ctx(pd_draft *d, const float *ctx, int n, pd_err *err)
{
    const pd_dspark_model *m = d->m;
    for (int l = 0; l < m->cfg.base.num_hidden_layers; l++)
        TRY(pd_layer_store_kv(&d->act, &m->cfg.base, &m->layers[l], pd_kv_pool_layer(d->pool, l), ctx, n,
                              err));
    return PD_OK;
}

/* The device part of a context extension: fc over the aux rows, hidden norm, then every draft
 * layer's k/v stored at the batch's slots (padding rows: slot -1, stored nowhere). Capturable. */
typedef struct {
    pd_draft *d;
    const float *aux;
    int ld_aux, n;
} extend_step;

static pd_status extend_step_run(void *ud, pd_err *err)
{
    extend_step *s = ud;
    pd_draft *d = s->d;
    const pd_dspark_model *m = d->m;
    kern_backend *be = m->be;
    int H = d->H;
    float *ctx = d->ctx->ptr;
    TRY(linear(be, s->aux, s->ld_aux, &m->fc, NULL, d->act.x, H, s->n, 0, err));
    kern_rmsnorm_args rn = { .x = d->act.x, .out = ctx, .w = m->hidden_norm, .rows = s->n, .dim = H,
                             .ld_x = H, .ld_out = H, .eps = m->cfg.base.rms_norm_eps };
    TRY(kern_rmsnorm(be, &rn, err));
    return store_ctx(d, ctx, s->n, err);
}

pd_status pd_draft_extend(pd_draft *d, const float *aux, int ld_aux, const pd_tok_batch *b, pd_err *err)
{
    const pd_dspark_model *m = d->m;
    kern_backend *be = m->be;
    int n = b->n_tok, H = d->H;
    int K = m->cfg.n_target_layers;
    if (n <= 0)
        return PD_OK;
    if (ld_aux < K * H)
        return pd_err_set(err, PD_ERR_INVALID, "draft context: aux row of %d values, need %d (%d taps x %d)",
                          ld_aux, K * H, K, H);
    /* decode rounds add a few rows per request: padded to a bucket and replayed as a graph, the
     * rows first copied into the runner's own input buffer (the graph reads a fixed address) */
    int pad = pd_graph_pad(&d->graphs) && n <= PD_DRAFT_EXTEND_GRAPH_MAX;
    int n_pad = n, pt_stride = 0, max_kv = 0;
    TRY(ensure_ctx(d, pad ? pd_graph_bucket(n) : n, err));
    TRY(pd_act_load_batch_pad(&d->act, d->pool, b, pad ? PD_ACT_PAD_BUCKET : 0, &n_pad, &pt_stride, &max_kv, err));
    d->n_ctx = n;
    extend_step s = { .d = d, .aux = aux, .ld_aux = ld_aux, .n = n_pad };
    if (!pad)
        return extend_step_run(&s, err);
    int dim = K * H;
    TRY(kern_buf_grow(be, &d->ext_in, &d->cap_ext_in, n_pad, (size_t)dim * sizeof(float), err));
    kern_copy_rows_args cp = { .src = aux, .ld_src = ld_aux, .dst = d->ext_in->ptr, .ld_dst = dim,
                               .rows = n, .cols = dim };
    TRY(kern_copy_rows(be, &cp, err));
    s.aux = d->ext_in->ptr;
    s.ld_aux = dim;
    int64_t key[] = { -1 /* extension, not a round */, n_pad, be->batch_invariant,
                      (int64_t)(intptr_t)d->ext_in->ptr, (int64_t)(intptr_t)d->ctx->ptr,
                      (int64_t)(intptr_t)d->act.buf->ptr, (int64_t)(intptr_t)d->act.ibuf->ptr };
    return pd_graph_run(&d->graphs, key, (int)(sizeof(key) / sizeof(key[0])), extend_step_run, &s, err);
}

pd_status pd_draft_extend_ctx(pd_draft *d, const float *ctx_host, const pd_tok_batch *b, pd_err *err)
{
    int n = b->n_tok;
    if (n <= 0)
        return PD_OK;
    TRY(ensure_ctx(d, n, err));
    int pt_stride = 0, max_kv = 0;
    TRY(pd_act_load_batch(&d->act, d->pool, b, &pt_stride, &max_kv, err));
    TRY(kern_upload(d->m->be, d->ctx->ptr, ctx_host, (size_t)n * d->H * sizeof(float), err));
    d->n_ctx = n;
    return store_ctx(d, d->ctx->ptr, n, err);
}

/* The Markov chain op of a chained round: every step in one op (one launch on CUDA) when the
 * head has one and the vocabulary is whole; rows and ids as markov_step_dev's, scratch = the
 * step scratch (free during a chained round: the confidence pass fills its part after). */
static kern_markov_chain_args chain_args(const pd_draft *d, int *ok)
{
    const pd_dspark_model *m = d->m;
    int cap = d->cap_req;
    kern_markov_chain_args mc = { .base = d->base_logits, .ld_base = d->V, .rows = d->chain_rows,
                                  .ld_rows = cap, .w1 = m->markov_w1, .w2 = m->markov_w2,
                                  .prev = d->prev_dev, .ld_prev = cap, .n = d->n_req, .steps = d->B,
                                  .hidden = d->block_hidden, .ld_hidden = d->H,
                                  .scratch = d->step != NULL ? d->step->ptr : NULL };
    *ok = d->tp == NULL;
    switch (m->cfg.markov_type) {
    case PD_MARKOV_VANILLA: mc.head = KERN_MARKOV_VANILLA; break;
    case PD_MARKOV_GATED:
        mc.head = KERN_MARKOV_GATED;
        mc.head_w = m->gate_w;
        mc.head_b = m->gate_b;
        break;
    case PD_MARKOV_RNN:
        mc.head = KERN_MARKOV_RNN;
        mc.head_w = m->joint_w;
        mc.head_b = m->joint_b;
        break;
    default: *ok = 0; break;
    }
    return mc;
}

/* floats of chain-op scratch a request row needs (it grows linearly with the rows; whatever the
 * tensor parallelism: no head without a chain op needs any) */
static size_t chain_scratch_per_row(const pd_draft *d)
{
    int ok = 0;
    kern_markov_chain_args mc = chain_args(d, &ok);
    mc.n = 1;
    return kern_markov_chain_scratch(&mc);
}

static pd_status ensure_req(pd_draft *d, int n_req, pd_err *err)
{
    if (n_req <= d->cap_req && d->blk != NULL)
        return PD_OK;
    kern_backend *be = d->m->be;
    int cap = d->cap_req > 0 ? d->cap_req : 8;
    while (cap < n_req)
        cap *= 2;
    int B = d->B, H = d->H, V = d->V, R = d->R > 0 ? d->R : 1;
    kern_buf *blk = NULL, *step = NULL, *ib = NULL;
    pd_status st = kern_buf_alloc(be, (size_t)cap * B * (H + V) * sizeof(float), &blk, err);
    /* step scratch: logits V | w1prev R | feat (H + 2R) | proj 3R | state R | tmp R | gate R | conf 1
     * | chain conf B | chain confidence-head inputs B (H + R) */
    size_t per = (size_t)V + R + (H + 2 * R) + 3 * R + R + R + R + 1 + B + (size_t)B * (H + R);
    /* a chained round of a gated or rnn head lends the whole step scratch to the chain op */
    size_t chain = chain_scratch_per_row(d);
    if (per < chain)
        per = chain;
    if (st == PD_OK)
        st = kern_buf_alloc(be, per * cap * sizeof(float), &step, err);
    if (st == PD_OK)
        st = kern_buf_alloc(be, (size_t)(3 + 2 * B) * cap * sizeof(int32_t), &ib, err);
    if (st != PD_OK) {
        kern_buf_free(blk);
        kern_buf_free(step);
        kern_buf_free(ib);
        return st;
    }
    kern_buf_free(d->blk);
    kern_buf_free(d->step);
    kern_buf_free(d->ibuf);
    d->blk = blk;
    d->step = step;
    d->ibuf = ib;
    d->cap_req = cap;
    d->block_hidden = blk->ptr;
    d->base_logits = (float *)blk->ptr + (size_t)cap * B * H;
    float *p = step->ptr;
    d->step_logits = p; p += (size_t)cap * V;
    d->w1prev = p; p += (size_t)cap * R;
    d->feat = p; p += (size_t)cap * (H + 2 * R);
    d->proj = p; p += (size_t)cap * 3 * R;
    d->state = p; p += (size_t)cap * R;
    d->tmp = p; p += (size_t)cap * R;
    d->gate = p; p += (size_t)cap * R;
    d->conf = p; p += cap;
    d->chain_conf = p; p += (size_t)B * cap;
    d->chain_feat = p;
    d->rows_dev = ib->ptr;
    d->chain_rows = d->rows_dev + cap;
    d->prev_dev = d->chain_rows + (size_t)B * cap;
    d->chain_ids = d->prev_dev + cap;
    d->ids_dev = d->chain_ids + (size_t)B * cap;
    /* chain ids past a round's requests are read by the batched confidence head: token 0 */
    return kern_memset0(be, ib->ptr, (size_t)(3 + 2 * B) * cap * sizeof(int32_t), err);
}

/* Block metadata of n_req requests (padded to n_pad requests when n_pad > n_req: padding rows
 * are graph-bucket padding, see pd_act_load_batch_pad) loaded into d->act. */
static pd_status block_load(pd_draft *d, int n_req, int n_pad, const int32_t *anchor, const int32_t *start,
                            pd_kv_seq *const *seqs, int *pt_stride, int *max_kv, pd_err *err)
{
    const pd_dspark_model *m = d->m;
    int B = d->B, n = n_req * B;
    int32_t *meta = malloc((size_t)4 * n * sizeof(int32_t));
    if (meta == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "draft block metadata");
    int32_t *ids = meta, *pos = meta + n, *seq = meta + 2 * n, *kv_len = meta + 3 * n;
    for (int r = 0; r < n_req; r++)
        for (int k = 0; k < B; k++) {
            int i = r * B + k;
            ids[i] = k == 0 ? anchor[r] : m->cfg.mask_token_id;
            pos[i] = start[r] + k;
            seq[i] = r;
            kv_len[i] = start[r] + B;
        }
    pd_tok_batch tb = { .n_tok = n, .ids = ids, .pos = pos, .seq = seq, .kv_len = kv_len,
                        .n_seq = n_req, .seqs = seqs };
    int n_rows = 0;
    /* n_pad > 0 (graphs): rows padded to n_pad requests, and the page-table stride and key
     * bound bucketed, even when n_req is a bucket itself (else every round is a new shape) */
    pd_status st = pd_act_load_batch_pad(&d->act, d->pool, &tb, n_pad > 0 ? n_pad * B : 0, &n_rows,
                                         pt_stride, max_kv, err);
    free(meta);
    return st;
}

/* The block forward on the device over n_rows token rows of n_seq sequences. */
static pd_status block_dev(pd_draft *d, int n_rows, int n_seq, int pt_stride, int max_kv, pd_err *err)
{
    const pd_dspark_model *m = d->m;
    const pd_qwen3_config *cfg = &m->cfg.base;
    kern_backend *be = m->be;
    pd_act *a = &d->act;
    int H = d->H;
    kern_embed_args em = { .table = m->embed, .ids = a->ids, .n = n_rows, .out = a->x, .ld_out = H };
    TRY(kern_embed(be, &em, err));
    for (int l = 0; l < cfg->num_hidden_layers; l++)
        TRY(pd_layer_forward(a, cfg, &m->layers[l], pd_kv_pool_layer(d->pool, l), n_rows, n_seq,
                             pt_stride, max_kv, err));
    kern_rmsnorm_args rn = { .x = a->x, .out = d->block_hidden, .w = m->final_norm, .rows = n_rows,
                             .dim = H, .ld_x = H, .ld_out = H, .eps = cfg->rms_norm_eps };
    TRY(kern_rmsnorm(be, &rn, err));
    return linear(be, d->block_hidden, H, &m->lm_head, NULL, d->base_logits, d->V, n_rows, 0, err);
}

pd_status pd_draft_block(pd_draft *d, int n_req, const int32_t *anchor, const int32_t *start,
                         pd_kv_seq *const *seqs, pd_err *err)
{
    if (n_req <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "draft block: no requests");
    TRY(ensure_req(d, n_req, err));
    int pt_stride = 0, max_kv = 0;
    TRY(block_load(d, n_req, 0, anchor, start, seqs, &pt_stride, &max_kv, err));
    d->n_req = n_req;
    return block_dev(d, n_req * d->B, n_req, pt_stride, max_kv, err);
}

/* Markov step k on the device for the n_req rows of the last block: prev_dev [n] the previous
 * tokens, rows_dev [n] the block rows r * B + k (backend memory); the step logits' argmax ids
 * into ids_dev [n]; confidence logits into conf_dev [n] when it is set and the draft has the
 * head. Capturable (no host round trips). */
static pd_status markov_step_dev(pd_draft *d, int k, const int32_t *prev_dev, const int32_t *rows_dev,
                                 int32_t *ids_dev, float *conf_dev, pd_err *err)
{
    const pd_dspark_model *m = d->m;
    kern_backend *be = m->be;
    int n = d->n_req, H = d->H, V = d->V, R = d->R;
    /* h_k rows of every request, and the base logits row k as the starting point */
    float *hk = d->feat;  /* feat layout depends on the head; h_k is placed where each needs it */
    /* step_logits = base_logits row k + W2 vec, with the argmax ids, in one markov_step launch;
     * vec is w1[prev] (vanilla), gate * w1[prev] (gated) or tanh(o) (rnn) */
    kern_markov_step_args ms = { .base = d->base_logits, .ld_base = V, .rows = rows_dev,
                                 .w2 = m->markov_w2, .ld_vec = R, .n = n, .step = d->step_logits,
                                 .ld_step = V, .ids = ids_dev };
    if (m->cfg.markov_type != PD_MARKOV_NONE) {
        kern_embed_args em = { .table = m->markov_w1, .ids = prev_dev, .n = n, .out = d->w1prev,
                               .ld_out = R };
        TRY(kern_embed(be, &em, err));
    }
    switch (m->cfg.markov_type) {
    case PD_MARKOV_NONE: {
        TRY(copy_cols(be, d->base_logits, V, d->step_logits, V, n, V, rows_dev, err));
        kern_argmax_args am = { .x = d->step_logits, .ld_x = V, .rows = n, .n = V, .out = ids_dev };
        TRY(kern_argmax(be, &am, err));
        break;
    }
    case PD_MARKOV_VANILLA:
        ms.vec = d->w1prev;
        TRY(kern_markov_step(be, &ms, err));
        break;
    case PD_MARKOV_GATED: {
        /* gate = sigmoid(W_g [h_k ; w1[prev]] + b_g); bias = W2 (gate * w1[prev]) */
        int ld = H + R;
        TRY(copy_cols(be, d->block_hidden, H, hk, ld, n, H, rows_dev, err));
        TRY(copy_cols(be, d->w1prev, R, hk + H, ld, n, R, NULL, err));
        TRY(linear(be, hk, ld, &m->gate_w, &m->gate_b, d->gate, R, n, 0, err));
        kern_unary_args sg = { .op = KERN_UNARY_SIGMOID, .x = d->gate, .ld_x = R, .out = d->gate,
                               .ld_out = R, .rows = n, .cols = R };
        TRY(kern_unary(be, &sg, err));
        kern_binary_args mul = { .op = KERN_BINARY_MUL, .a = d->gate, .ld_a = R, .b = d->w1prev,
                                 .ld_b = R, .out = d->tmp, .ld_out = R, .rows = n, .cols = R };
        TRY(kern_binary(be, &mul, err));
        ms.vec = d->tmp;
        TRY(kern_markov_step(be, &ms, err));
        break;
    }
    case PD_MARKOV_RNN: {
        /* [a; c; o] = W_j [s ; w1[prev] ; h_k] + b; s' = c~ + sigmoid(a) (s - c~), c~ = tanh(c);
         * bias = W2 tanh(o) */
        int ld = 2 * R + H;
        if (k == 0)
            TRY(kern_memset0(be, d->state, (size_t)n * R * sizeof(float), err));
        TRY(copy_cols(be, d->state, R, hk, ld, n, R, NULL, err));
        TRY(copy_cols(be, d->w1prev, R, hk + R, ld, n, R, NULL, err));
        TRY(copy_cols(be, d->block_hidden, H, hk + 2 * R, ld, n, H, rows_dev, err));
        TRY(linear(be, hk, ld, &m->joint_w, &m->joint_b, d->proj, 3 * R, n, 0, err));
        kern_unary_args ga = { .op = KERN_UNARY_SIGMOID, .x = d->proj, .ld_x = 3 * R, .out = d->gate,
                               .ld_out = R, .rows = n, .cols = R };
        TRY(kern_unary(be, &ga, err));
        kern_unary_args ca = { .op = KERN_UNARY_TANH, .x = d->proj + R, .ld_x = 3 * R, .out = d->tmp,
                               .ld_out = R, .rows = n, .cols = R };
        TRY(kern_unary(be, &ca, err));
        kern_binary_args diff = { .op = KERN_BINARY_SUB, .a = d->state, .ld_a = R, .b = d->tmp,
                                  .ld_b = R, .out = d->state, .ld_out = R, .rows = n, .cols = R };
        TRY(kern_binary(be, &diff, err));
        kern_binary_args scale = { .op = KERN_BINARY_MUL, .a = d->state, .ld_a = R, .b = d->gate,
                                   .ld_b = R, .out = d->state, .ld_out = R, .rows = n, .cols = R };
        TRY(kern_binary(be, &scale, err));
        kern_binary_args add = { .op = KERN_BINARY_ADD, .a = d->state, .ld_a = R, .b = d->tmp,
                                 .ld_b = R, .out = d->state, .ld_out = R, .rows = n, .cols = R };
        TRY(kern_binary(be, &add, err));
        kern_unary_args oa = { .op = KERN_UNARY_TANH, .x = d->proj + 2 * R, .ld_x = 3 * R, .out = d->tmp,
                               .ld_out = R, .rows = n, .cols = R };
        TRY(kern_unary(be, &oa, err));
        ms.vec = d->tmp;
        TRY(kern_markov_step(be, &ms, err));
        break;
    }
    }
    /* tensor parallel: every rank computed its vocab slice of the step; the ids of the fused
     * kernel covered the slice only, so they are taken again over the gathered row */
    if (d->tp != NULL) {
        TRY(pd_tp_gather_vocab(d->tp, d->step_logits, V, n, err));
        kern_argmax_args am = { .x = d->step_logits, .ld_x = V, .rows = n, .n = V, .out = ids_dev };
        TRY(kern_argmax(be, &am, err));
    }
    if (m->cfg.enable_confidence_head && m->conf_w.data != NULL && conf_dev != NULL) {
        int with_markov = m->cfg.confidence_head_with_markov && R > 0;
        int ld = H + (with_markov ? R : 0);
        float *cf = d->feat;   /* free again once the head above is done */
        TRY(copy_cols(be, d->block_hidden, H, cf, ld, n, H, rows_dev, err));
        if (with_markov)
            TRY(copy_cols(be, d->w1prev, R, cf + H, ld, n, R, NULL, err));
        TRY(linear(be, cf, ld, &m->conf_w, &m->conf_b, conf_dev, 1, n, 0, err));
    }
    return PD_OK;
}

pd_status pd_draft_markov_step(pd_draft *d, int k, const int32_t *prev, float *conf_out, pd_err *err)
{
    kern_backend *be = d->m->be;
    int n = d->n_req, B = d->B, V = d->V;
    if (k < 0 || k >= B || n <= 0)
        return pd_err_set(err, PD_ERR_INTERNAL, "markov step %d of block %d (%d requests)", k, B, n);
    for (int r = 0; r < n; r++)
        if (prev[r] < 0 || prev[r] >= V)
            return pd_err_set(err, PD_ERR_INVALID, "markov step: previous token %d outside vocab", prev[r]);
    int32_t rows[256];
    int32_t *rows_h = n <= 256 ? rows : malloc((size_t)n * sizeof(int32_t));
    if (rows_h == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "markov rows");
    for (int r = 0; r < n; r++)
        rows_h[r] = r * B + k;
    pd_status st = kern_upload(be, d->rows_dev, rows_h, (size_t)n * sizeof(int32_t), err);
    if (rows_h != rows)
        free(rows_h);
    if (st != PD_OK)
        return st;
    TRY(kern_upload(be, d->prev_dev, prev, (size_t)n * sizeof(int32_t), err));
    TRY(markov_step_dev(d, k, d->prev_dev, d->rows_dev, d->ids_dev, conf_out != NULL ? d->conf : NULL, err));
    if (conf_out != NULL && d->m->cfg.enable_confidence_head && d->m->conf_w.data != NULL)
        TRY(kern_download(be, conf_out, d->conf, (size_t)n * sizeof(float), err));
    return PD_OK;
}

/* The device part of a chained round: block forward, then B Markov steps whose argmax feeds the
 * next step. Capturable. */
typedef struct {
    pd_draft *d;
    int n_rows, n_seq, pt_stride, max_kv, conf;
} round_step;

static pd_status round_step_run(void *ud, pd_err *err)
{
    round_step *s = ud;
    pd_draft *d = s->d;
    const pd_dspark_model *m = d->m;
    kern_backend *be = m->be;
    int cap = d->cap_req, B = d->B, H = d->H, R = d->R;
    TRY(block_dev(d, s->n_rows, s->n_seq, s->pt_stride, s->max_kv, err));
    int chained = 0;
    kern_markov_chain_args mc = chain_args(d, &chained);
    if (chained) {
        /* the ids of step k are the previous tokens of step k + 1 (chain_ids = prev_dev + cap) */
        TRY(kern_markov_chain(be, &mc, err));
    } else {
        for (int k = 0; k < B; k++)
            TRY(markov_step_dev(d, k, d->prev_dev + (size_t)k * cap, d->chain_rows + (size_t)k * cap,
                                d->chain_ids + (size_t)k * cap, NULL, err));
    }
    if (!s->conf)
        return PD_OK;
    /* the confidence head of every step in one pass after the chain (its inputs, h_k and
     * w1[previous token], are all known by then): three launches instead of three per step */
    int with_markov = m->cfg.confidence_head_with_markov && R > 0;
    int ld = H + (with_markov ? R : 0), n = B * cap;
    TRY(copy_cols(be, d->block_hidden, H, d->chain_feat, ld, n, H, d->chain_rows, err));
    if (with_markov) {
        kern_embed_args em = { .table = m->markov_w1, .ids = d->prev_dev, .n = n,
                               .out = d->chain_feat + H, .ld_out = ld };
        TRY(kern_embed(be, &em, err));
    }
    return linear(be, d->chain_feat, ld, &m->conf_w, &m->conf_b, d->chain_conf, 1, n, 0, err);
}

pd_status pd_draft_round_greedy(pd_draft *d, int n_req, const int32_t *anchor, const int32_t *start,
                                pd_kv_seq *const *seqs, int32_t *ids_out, float *conf_out, pd_err *err)
{
    const pd_dspark_model *m = d->m;
    kern_backend *be = m->be;
    int B = d->B, V = d->V;
    if (n_req <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "draft round: no requests");
    for (int r = 0; r < n_req; r++)
        if (anchor[r] < 0 || anchor[r] >= V)
            return pd_err_set(err, PD_ERR_INVALID, "draft round: anchor token %d outside vocab", anchor[r]);
    int pad = pd_graph_pad(&d->graphs);
    int n_pad = pad ? pd_graph_bucket(n_req) : n_req;
    TRY(ensure_req(d, n_pad, err));
    round_step s = { .d = d, .n_rows = n_pad * B, .n_seq = n_req,
                     .conf = conf_out != NULL && m->cfg.enable_confidence_head && m->conf_w.data != NULL };
    TRY(block_load(d, n_req, pad ? n_pad : 0, anchor, start, seqs, &s.pt_stride, &s.max_kv, err));
    d->n_req = n_pad;
    /* anchors (padding rows: token 0) and the block row of every request at every step */
    int cap = d->cap_req;
    int32_t *h = malloc((size_t)(2 + B) * cap * sizeof(int32_t));
    if (h == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "draft round metadata");
    /* [row idx (zeros) | chain rows | prev], as laid out from d->rows_dev */
    memset(h, 0, (size_t)cap * sizeof(int32_t));
    int32_t *rows = h + cap;
    for (int k = 0; k < B; k++)
        for (int r = 0; r < cap; r++)
            rows[(size_t)k * cap + r] = r < n_pad ? r * B + k : 0;
    int32_t *prev = rows + (size_t)B * cap;
    for (int r = 0; r < cap; r++)
        prev[r] = r < n_req ? anchor[r] : 0;
    pd_status st = kern_upload(be, d->rows_dev, h, (size_t)(2 + B) * cap * sizeof(int32_t), err);
    free(h);
    if (st != PD_OK)
        return st;
    if (pad) {
        int64_t key[] = { n_pad, n_req, s.pt_stride, s.max_kv, s.conf, be->batch_invariant,
                          (int64_t)(intptr_t)d->act.buf->ptr, (int64_t)(intptr_t)d->act.ibuf->ptr,
                          (int64_t)(intptr_t)d->act.ptbuf->ptr, (int64_t)(intptr_t)d->blk->ptr,
                          (int64_t)(intptr_t)d->step->ptr, (int64_t)(intptr_t)d->ibuf->ptr, cap };
        TRY(pd_graph_run(&d->graphs, key, (int)(sizeof(key) / sizeof(key[0])), round_step_run, &s, err));
    } else {
        TRY(round_step_run(&s, err));
    }
    /* one download of ids (and confidences) [B][cap], transposed to [n_req][B] */
    int32_t *ids = malloc((size_t)B * cap * sizeof(int32_t));
    float *conf = s.conf ? malloc((size_t)B * cap * sizeof(float)) : NULL;
    if (ids == NULL || (s.conf && conf == NULL)) {
        free(ids);
        free(conf);
        return pd_err_set(err, PD_ERR_NOMEM, "draft round ids");
    }
    st = kern_download(be, ids, d->chain_ids, (size_t)B * cap * sizeof(int32_t), err);
    if (st == PD_OK && s.conf)
        st = kern_download(be, conf, d->chain_conf, (size_t)B * cap * sizeof(float), err);
    if (st == PD_OK)
        for (int r = 0; r < n_req; r++)
            for (int k = 0; k < B; k++) {
                ids_out[(size_t)r * B + k] = ids[(size_t)k * cap + r];
                if (conf_out != NULL)
                    conf_out[(size_t)r * B + k] = s.conf ? conf[(size_t)k * cap + r] : 0.0f;
            }
    free(ids);
    free(conf);
    return st;
}

void pd_draft_set_graphs(pd_draft *d, int mode)
{
    pd_graph_cache_clear(&d->graphs);
    pd_graph_cache_init(&d->graphs, d->m->be, (pd_graph_mode)mode);
}

void pd_draft_graph_stats(const pd_draft *d, uint64_t *eager, uint64_t *captures, uint64_t *replays)
{
    *eager += d->graphs.n_eager;
    *captures += d->graphs.n_captures;
    *replays += d->graphs.n_replays;
}

uint64_t pd_draft_graph_cold(const pd_draft *d) { return d->graphs.n_cold; }
