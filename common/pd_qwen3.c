/* pd_qwen3.c - Qwen3 decoder layers and the target runner on the backend ops.
 * Owns: layer order (pre-norm attention with q/k RMSNorm and RoPE, SwiGLU MLP), the activation
 *   workspace, aux capture (raw residual stream after a tap layer, as HF hidden_states[l+1]).
 * Not here: KV page allocation (pd_kv.c; callers reserve pages before a forward).
 * Threading: one thread per runner. */
#include "pd_qwen3.h"

#include "pd_graph.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pd_tp.h"

#define TRY(expr) \
    do { pd_status st_ = (expr); if (st_ != PD_OK) return st_; } while (0)

pd_status pd_act_init(pd_act *a, kern_backend *be, const pd_qwen3_config *cfg, pd_err *err)
{
    (void)err;
    memset(a, 0, sizeof(*a));
    a->be = be;
    a->hidden = cfg->hidden_size;
    a->q_dim = cfg->num_attention_heads * cfg->head_dim;
    a->kv_dim = cfg->num_key_value_heads * cfg->head_dim;
    a->inter = cfg->intermediate_size;
    return PD_OK;
}

void pd_act_cleanup(pd_act *a)
{
    kern_buf_free(a->buf);
    kern_buf_free(a->ibuf);
    kern_buf_free(a->ptbuf);
    a->buf = a->ibuf = a->ptbuf = NULL;
    a->cap_tok = 0;
    a->cap_seq_pages = 0;
}

pd_status pd_act_reserve(pd_act *a, int n_tok, int n_pt, pd_err *err)
{
    if (n_tok > a->cap_tok) {
        int cap = a->cap_tok > 0 ? a->cap_tok : 64;
        while (cap < n_tok)
            cap *= 2;
        size_t per_tok = (size_t)2 * a->hidden + (size_t)2 * a->q_dim + (size_t)2 * a->kv_dim +
                         (size_t)2 * a->inter;
        kern_buf *nb = NULL, *ni = NULL;
        TRY(kern_buf_alloc(a->be, per_tok * cap * sizeof(float), &nb, err));
        pd_status st = kern_buf_alloc(a->be, (size_t)5 * cap * sizeof(int32_t), &ni, err);
        if (st != PD_OK) {
            kern_buf_free(nb);
            return st;
        }
        kern_buf_free(a->buf);
        kern_buf_free(a->ibuf);
        a->buf = nb;
        a->ibuf = ni;
        a->cap_tok = cap;
        float *p = nb->ptr;
        a->x = p; p += (size_t)cap * a->hidden;
        a->h = p; p += (size_t)cap * a->hidden;
        a->q = p; p += (size_t)cap * a->q_dim;
        a->o = p; p += (size_t)cap * a->q_dim;
        a->k = p; p += (size_t)cap * a->kv_dim;
        a->v = p; p += (size_t)cap * a->kv_dim;
        a->g = p; p += (size_t)cap * a->inter;
        a->u = p;
        int32_t *ip = ni->ptr;
        a->ids = ip; ip += cap;
        a->pos = ip; ip += cap;
        a->seq = ip; ip += cap;
        a->kv_len = ip; ip += cap;
        a->slot = ip;
    }
    if (n_pt > a->cap_seq_pages) {
        int cap = a->cap_seq_pages > 0 ? a->cap_seq_pages : 256;
        while (cap < n_pt)
            cap *= 2;
        kern_buf *np = NULL;
        TRY(kern_buf_alloc(a->be, (size_t)cap * sizeof(int32_t), &np, err));
        kern_buf_free(a->ptbuf);
        a->ptbuf = np;
        a->page_table = np->ptr;
        a->cap_seq_pages = cap;
    }
    return PD_OK;
}

pd_status pd_act_load_batch(pd_act *a, const pd_kv_pool *pool, const pd_tok_batch *b,
                            int *pt_stride_out, int *max_kv_out, pd_err *err)
{
    int n_pad = 0;
    return pd_act_load_batch_pad(a, pool, b, 0, &n_pad, pt_stride_out, max_kv_out, err);
}

pd_status pd_act_load_batch_pad(pd_act *a, const pd_kv_pool *pool, const pd_tok_batch *b, int pad,
                                int *n_pad_out, int *pt_stride_out, int *max_kv_out, pd_err *err)
{
    int n = b->n_tok;
    int np = pad < 0 ? pd_graph_bucket(n) : pad > n ? pad : n;
    int pt_stride = 1;
    for (int s = 0; s < b->n_seq; s++)
        if (b->seqs[s]->n_pages > pt_stride)
            pt_stride = b->seqs[s]->n_pages;
    if (pad)
        pt_stride = pd_graph_bucket_pow2(pt_stride, 4);
    TRY(pd_act_reserve(a, np, pt_stride * b->n_seq, err));
    /* one host image of the int32 arrays [ids | pos | seq | kv_len | slot] (np each) and the
     * page table, uploaded in two copies; the arrays are re-pointed at this call's layout */
    int32_t *host = malloc(((size_t)5 * np + (size_t)pt_stride * b->n_seq) * sizeof(int32_t));
    if (host == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "batch metadata: %d tokens", n);
    int32_t *ids = host, *pos = host + np, *seq = host + 2 * (size_t)np;
    int32_t *kv_len = host + 3 * (size_t)np, *slot = host + 4 * (size_t)np, *pt = host + 5 * (size_t)np;
    int max_kv = 1;
    int cap_pos = 0;
    pd_status st = PD_OK;
    for (int t = 0; t < n; t++) {
        int s = b->seq[t];
        if (s < 0 || s >= b->n_seq) {
            st = pd_err_set(err, PD_ERR_INTERNAL, "token %d: sequence %d of %d", t, s, b->n_seq);
            goto out;
        }
        const pd_kv_seq *ks = b->seqs[s];
        cap_pos = ks->n_pages * pd_kv_pool_layout(pool)->page_size;
        if (b->pos[t] < 0 || b->pos[t] >= cap_pos) {
            st = pd_err_set(err, PD_ERR_INTERNAL, "token %d: position %d outside %d reserved slots", t,
                            b->pos[t], cap_pos);
            goto out;
        }
        kv_len[t] = b->kv_len != NULL ? b->kv_len[t] : b->pos[t] + 1;
        if (kv_len[t] < 1 || kv_len[t] > cap_pos) {
            st = pd_err_set(err, PD_ERR_INTERNAL, "token %d: kv length %d outside %d reserved slots",
                            t, kv_len[t], cap_pos);
            goto out;
        }
        if (kv_len[t] > max_kv)
            max_kv = kv_len[t];
        slot[t] = b->no_store ? -1 : pd_kv_seq_slot(pool, ks, b->pos[t]);
        ids[t] = b->ids != NULL ? b->ids[t] : 0;
        pos[t] = b->pos[t];
        seq[t] = s;
    }
    /* padding rows: token 0 at position 0 of sequence 0, one key, stored nowhere */
    for (int t = n; t < np; t++) {
        ids[t] = 0;
        pos[t] = 0;
        seq[t] = 0;
        kv_len[t] = 1;
        slot[t] = -1;
    }
    if (pad) {
        /* a bucket bound, never beyond what the (padded) page table can address */
        int cap_kv = pt_stride * pd_kv_pool_layout(pool)->page_size;
        max_kv = pd_graph_bucket_pow2(max_kv, 64);
        if (max_kv > cap_kv)
            max_kv = cap_kv;
    }
    for (int s = 0; s < b->n_seq; s++) {
        const pd_kv_seq *ks = b->seqs[s];
        for (int i = 0; i < pt_stride; i++)
            pt[(size_t)s * pt_stride + i] = i < ks->n_pages ? ks->pages[i] : 0;
    }
    int32_t *dev = a->ibuf->ptr;
    a->ids = dev;
    a->pos = dev + np;
    a->seq = dev + 2 * (size_t)np;
    a->kv_len = dev + 3 * (size_t)np;
    a->slot = dev + 4 * (size_t)np;
    if ((st = kern_upload(a->be, dev, host, (size_t)5 * np * 4, err)) != PD_OK ||
        (st = kern_upload(a->be, a->page_table, pt, (size_t)pt_stride * b->n_seq * 4, err)) != PD_OK)
        goto out;
    *n_pad_out = np;
    *pt_stride_out = pt_stride;
    *max_kv_out = max_kv;
out:
    free(host);
    return st;
}

static pd_status linear(kern_backend *be, const float *x, int ld_x, const kern_weight *w, float *y,
                        int ld_y, int m, int accumulate, pd_err *err)
{
    kern_matmul_args mm = {
        .x = x, .ld_x = ld_x, .w = *w, .y = y, .ld_y = ld_y,
        .m = m, .n = (int)w->rows, .k = (int)w->cols, .accumulate = accumulate,
    };
    return kern_matmul(be, &mm, err);
}

static pd_status rmsnorm(kern_backend *be, const float *x, float *out, const kern_weight *w, int rows,
                         int dim, float eps, pd_err *err)
{
    kern_rmsnorm_args r = {
        .x = x, .out = out, .w = *w, .rows = rows, .dim = dim, .ld_x = dim, .ld_out = dim, .eps = eps,
    };
    return kern_rmsnorm(be, &r, err);
}

/* k/v projections of in (2 weights), then k_norm + RoPE (+ the cache store when kv != NULL):
 * one qkv op */
static pd_status layer_kv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                          const kern_kv_layer *kv, const float *in, int n_tok, pd_err *err)
{
    kern_qkv_args qkv = {
        .lin = {
            .x = in, .ld_x = a->hidden, .m = n_tok, .k = a->hidden, .n_w = 2,
            .w = { lw->k_proj, lw->v_proj }, .y = { a->k, a->v }, .ld_y = { a->kv_dim, a->kv_dim },
            .epilogue = KERN_LINEAR_STORE,
        },
        .post = {
            .k = a->k, .v = a->v, .ld_kv = a->kv_dim, .q_norm = lw->k_norm, .k_norm = lw->k_norm,
            .eps = cfg->rms_norm_eps, .n_tok = n_tok, .n_heads = 0,
            .n_kv_heads = cfg->num_key_value_heads, .head_dim = cfg->head_dim, .pos = a->pos,
            .theta = cfg->rope_theta, .scaling = cfg->rope_scaling, .slot = a->slot,
        },
    };
    if (kv != NULL)
        qkv.post.kv = *kv;
    return kern_qkv(a->be, &qkv, err);
}

pd_status pd_layer_kv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                      const float *in, int n_tok, pd_err *err)
{
    return layer_kv(a, cfg, lw, NULL, in, n_tok, err);
}

/* k = rope(k_norm(in Wk^T)), v = in Wv^T, stored at a->slot; leaves k/v in a->k, a->v. */
pd_status pd_layer_store_kv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                            kern_kv_layer kv, const float *in, int n_tok, pd_err *err)
{
    return layer_kv(a, cfg, lw, &kv, in, n_tok, err);
}

/* input_norm + q/k/v projections, q/k norm + RoPE (+ the cache store when kv != NULL): one qkv
 * op */
static kern_qkv_args qkv_args(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                              const kern_kv_layer *kv, int n_tok)
{
    kern_qkv_args qkv = {
        .lin = {
            .x = a->x, .ld_x = a->hidden, .m = n_tok, .k = a->hidden, .norm = lw->input_norm,
            .eps = cfg->rms_norm_eps, .n_w = 3, .w = { lw->q_proj, lw->k_proj, lw->v_proj },
            .y = { a->q, a->k, a->v }, .ld_y = { a->q_dim, a->kv_dim, a->kv_dim },
            .epilogue = KERN_LINEAR_STORE,
        },
        .post = {
            .q = a->q, .ld_q = a->q_dim, .k = a->k, .v = a->v, .ld_kv = a->kv_dim,
            .q_norm = lw->q_norm, .k_norm = lw->k_norm, .eps = cfg->rms_norm_eps, .n_tok = n_tok,
            .n_heads = cfg->num_attention_heads, .n_kv_heads = cfg->num_key_value_heads,
            .head_dim = cfg->head_dim, .pos = a->pos, .theta = cfg->rope_theta,
            .scaling = cfg->rope_scaling, .slot = a->slot,
        },
    };
    if (kv != NULL)
        qkv.post.kv = *kv;
    return qkv;
}

pd_status pd_layer_qkv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw, int n_tok,
                       pd_err *err)
{
    kern_qkv_args qkv = qkv_args(a, cfg, lw, NULL, n_tok);
    return kern_qkv(a->be, &qkv, err);
}

/* The attention over the cache kv (q in a->q, output in a->o) */
static kern_attn_args attn_args(pd_act *a, const pd_qwen3_config *cfg, kern_kv_layer kv, int n_tok,
                                int n_seq, int pt_stride, int max_kv)
{
    kern_attn_args at = {
        .kv = kv, .q = a->q, .ld_q = a->q_dim, .out = a->o, .ld_out = a->q_dim, .n_tok = n_tok,
        .n_heads = cfg->num_attention_heads, .tok_seq = a->seq, .tok_kv_len = a->kv_len,
        .page_table = a->page_table, .pt_stride = pt_stride, .n_seq = n_seq, .max_kv_len = max_kv,
        .scale = (float)(1.0 / sqrt((double)cfg->head_dim)),
    };
    return at;
}

/* x += o Wo^T. Tensor parallel: o_proj and down_proj are row-parallel, rank 0 adds its partial
 * to x and the others store theirs, then the all-reduce sums them (pd_tp.h) */
static kern_linear_args o_args(pd_act *a, const pd_layer_weights *lw, int n_tok)
{
    kern_linear_args op = {
        .x = a->o, .ld_x = a->q_dim, .m = n_tok, .k = a->q_dim, .n_w = 1, .w = { lw->o_proj },
        .y = { a->x }, .ld_y = { a->hidden },
        .epilogue = pd_tp_accumulate(a->tp) ? KERN_LINEAR_ACCUMULATE : KERN_LINEAR_STORE,
    };
    return op;
}

/* after o_proj: the all-reduce of x (tensor parallel), then x += mlp(post_norm(x)) and the
 * all-reduce again */
static pd_status layer_mlp(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                           int n_tok, pd_err *err)
{
    int H = a->hidden;
    TRY(pd_tp_all_reduce(a->tp, a->x, (size_t)n_tok * H, err));
    kern_mlp_args mlp = {
        .x = a->x, .ld_x = H, .m = n_tok, .k = H, .norm = lw->post_norm, .eps = cfg->rms_norm_eps,
        .gate = lw->gate_proj, .up = lw->up_proj, .down = lw->down_proj, .g = a->g,
        .ld_g = a->inter, .y = a->x, .ld_y = H,
        .epilogue = pd_tp_accumulate(a->tp) ? KERN_LINEAR_ACCUMULATE : KERN_LINEAR_STORE,
        .tee = a->tap, .ld_tee = a->ld_tap,
    };
    TRY(kern_mlp(a->be, &mlp, err));
    return pd_tp_all_reduce(a->tp, a->x, (size_t)n_tok * H, err);
}

pd_status pd_layer_attn_mlp(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                            kern_kv_layer kv, int n_tok, int n_seq, int pt_stride, int max_kv,
                            pd_err *err)
{
    kern_attn_args at = attn_args(a, cfg, kv, n_tok, n_seq, pt_stride, max_kv);
    TRY(kern_attn(a->be, &at, err));
    kern_linear_args op = o_args(a, lw, n_tok);
    TRY(kern_linear(a->be, &op, err));
    return layer_mlp(a, cfg, lw, n_tok, err);
}

/* qkv, attention and o_proj as one attn_block op (the backend may keep q and the attention
 * output in its own form), then the MLP */
pd_status pd_layer_forward(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                           kern_kv_layer kv, int n_tok, int n_seq, int pt_stride, int max_kv,
                           pd_err *err)
{
    kern_attn_block_args blk = {
        .qkv = qkv_args(a, cfg, lw, &kv, n_tok),
        .attn = attn_args(a, cfg, kv, n_tok, n_seq, pt_stride, max_kv),
        .o = o_args(a, lw, n_tok),
    };
    TRY(kern_attn_block(a->be, &blk, err));
    return layer_mlp(a, cfg, lw, n_tok, err);
}

pd_status pd_qwen3_head(const pd_qwen3_model *m, kern_backend *be, const float *x, int ld_x,
                        const int32_t *idx, int n, float *pick, float *normed, float *logits,
                        pd_err *err)
{
    int H = m->cfg.hidden_size;
    if (n <= 0)
        return PD_OK;
    kern_copy_rows_args cp = { .src = x, .ld_src = ld_x, .idx = idx, .dst = pick, .ld_dst = H,
                               .rows = n, .cols = H };
    TRY(kern_copy_rows(be, &cp, err));
    TRY(rmsnorm(be, pick, normed, &m->final_norm, n, H, m->cfg.rms_norm_eps, err));
    return linear(be, normed, H, &m->lm_head, logits, m->cfg.vocab_size, n, 0, err);
}

/* ---- target runner ----------------------------------------------------------------------- */

struct pd_target {
    const pd_qwen3_model *m;
    pd_kv_pool *pool;
    pd_act act;
    int taps[PD_MAX_TAPS];
    int n_taps;
    int cap_aux_tok;
    kern_buf *aux;          /* [cap_aux_tok, n_taps * hidden] */
    int cap_logits;
    kern_buf *logits;       /* [cap_logits, vocab] + final hidden [cap_logits, hidden] */
    float *final_hidden;
    kern_buf *rows;         /* int32 logit rows */
    pd_graph_cache graphs;
};

pd_status pd_target_create(const pd_qwen3_model *m, pd_kv_pool *pool, const int *taps, int n_taps,
                           pd_target **out, pd_err *err)
{
    if (n_taps < 0 || n_taps > PD_MAX_TAPS)
        return pd_err_set(err, PD_ERR_INVALID, "target: %d tap layers (max %d)", n_taps, PD_MAX_TAPS);
    for (int i = 0; i < n_taps; i++)
        if (taps[i] < -1 || taps[i] >= m->cfg.num_hidden_layers - 1)
            return pd_err_set(err, PD_ERR_INVALID,
                              "target: tap layer %d outside -1..%d (the final layer is never a tap)",
                              taps[i], m->cfg.num_hidden_layers - 2);
    pd_target *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "target runner");
    t->m = m;
    t->pool = pool;
    t->n_taps = n_taps;
    if (n_taps > 0)
        memcpy(t->taps, taps, (size_t)n_taps * sizeof(int));
    pd_graph_cache_init(&t->graphs, m->be, PD_GRAPHS_AUTO);
    pd_status st = pd_act_init(&t->act, m->be, &m->cfg, err);
    if (st != PD_OK) {
        free(t);
        return st;
    }
    *out = t;
    return PD_OK;
}

void pd_target_destroy(pd_target *t)
{
    if (t == NULL)
        return;
    pd_graph_cache_clear(&t->graphs);
    pd_act_cleanup(&t->act);
    kern_buf_free(t->aux);
    kern_buf_free(t->logits);
    kern_buf_free(t->rows);
    free(t);
}

static float *tap_dst(pd_target *t, int slot) { return (float *)t->aux->ptr + (size_t)slot * t->act.hidden; }

static pd_status capture_tap(pd_target *t, int slot, int n_tok, pd_err *err)
{
    int H = t->act.hidden;
    kern_copy_rows_args cp = { .src = t->act.x, .ld_src = H, .dst = tap_dst(t, slot),
                               .ld_dst = t->n_taps * H, .rows = n_tok, .cols = H };
    return kern_copy_rows(t->m->be, &cp, err);
}

/* The device part of a forward, after pd_act_load_batch: capturable as one graph. */
typedef struct {
    pd_target *t;
    int n, n_seq, pt_stride, max_kv, n_logits;
} target_step;

static pd_status target_step_run(void *ud, pd_err *err)
{
    target_step *s = ud;
    pd_target *t = s->t;
    const pd_qwen3_model *m = t->m;
    const pd_qwen3_config *cfg = &m->cfg;
    kern_backend *be = m->be;
    pd_act *a = &t->act;
    int n = s->n, H = cfg->hidden_size;
    kern_embed_args em = { .table = m->embed, .ids = a->ids, .n = n, .out = a->x, .ld_out = H };
    TRY(kern_embed(be, &em, err));
    for (int i = 0; i < t->n_taps; i++)
        if (t->taps[i] == -1)
            TRY(capture_tap(t, i, n, err));
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        /* a tapped layer writes its output rows into the aux tensor as well (pd_act.tap); under
         * tensor parallelism the output exists only after the all-reduce: copied below */
        a->tap = NULL;
        a->ld_tap = t->n_taps * H;
        for (int i = 0; i < t->n_taps && a->tp == NULL; i++)
            if (t->taps[i] == l && a->tap == NULL)
                a->tap = tap_dst(t, i);
        pd_status st = pd_layer_forward(a, cfg, &m->layers[l], pd_kv_pool_layer(t->pool, l), n, s->n_seq,
                                        s->pt_stride, s->max_kv, err);
        float *tapped = a->tap;
        a->tap = NULL;
        TRY(st);
        for (int i = 0; i < t->n_taps; i++)   /* the slots the epilogue did not write */
            if (t->taps[i] == l && tap_dst(t, i) != tapped)
                TRY(capture_tap(t, i, n, err));
    }
    if (s->n_logits <= 0)
        return PD_OK;
    TRY(pd_qwen3_head(m, be, a->x, H, t->rows->ptr, s->n_logits, a->h, t->final_hidden,
                      t->logits->ptr, err));
    /* tensor parallel: this rank's lm_head rows are one vocab slice (host backends only, never
     * inside a graph) */
    return pd_tp_gather_vocab(a->tp, t->logits->ptr, cfg->vocab_size, s->n_logits, err);
}

pd_status pd_target_forward(pd_target *t, const pd_tok_batch *b, const int32_t *logit_rows,
                            int n_logits, pd_err *err)
{
    const pd_qwen3_model *m = t->m;
    const pd_qwen3_config *cfg = &m->cfg;
    kern_backend *be = m->be;
    int n = b->n_tok, H = cfg->hidden_size, V = cfg->vocab_size;
    if (n <= 0)
        return pd_err_set(err, PD_ERR_INVALID, "target forward: empty batch");
    for (int i = 0; i < n; i++)
        if (b->ids[i] < 0 || b->ids[i] >= V)
            return pd_err_set(err, PD_ERR_INVALID, "token id %d outside the vocabulary (0..%d)",
                              b->ids[i], V - 1);
    for (int i = 0; i < n; i++)
        if (b->pos[i] >= cfg->max_position_embeddings)
            return pd_err_set(err, PD_ERR_INVALID, "position %d exceeds the context length %d",
                              b->pos[i], cfg->max_position_embeddings);
    for (int i = 0; i < n_logits; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= n)
            return pd_err_set(err, PD_ERR_INTERNAL, "logit row %d outside batch of %d", logit_rows[i], n);
    pd_act *a = &t->act;
    /* a recompute (no_store) runs eagerly: it is rare, and its shapes would crowd the decode
     * steps' graphs out of the cache */
    int pad = !b->no_store && pd_graph_pad(&t->graphs) && n <= PD_TARGET_GRAPH_MAX_TOK;
    target_step s = { .t = t, .n_seq = b->n_seq };
    /* the head picks its rows into a->h: room for them before the metadata lands in a */
    TRY(pd_act_reserve(a, pad ? pd_graph_bucket(n_logits > n ? n_logits : n) : n_logits, 0, err));
    TRY(pd_act_load_batch_pad(a, t->pool, b, pad ? PD_ACT_PAD_BUCKET : 0, &s.n, &s.pt_stride, &s.max_kv, err));
    if (t->n_taps > 0)
        TRY(kern_buf_grow(be, &t->aux, &t->cap_aux_tok, s.n, (size_t)t->n_taps * H * sizeof(float), err));
    if (n_logits > 0) {
        /* padded: every padding row of the batch gets a logit row too (verify asks for all) */
        s.n_logits = !pad ? n_logits : n_logits == n ? s.n : pd_graph_bucket(n_logits);
        int cap_before = t->cap_logits;
        TRY(kern_buf_grow(be, &t->logits, &t->cap_logits, s.n_logits, (size_t)(V + H) * sizeof(float), err));
        if (t->cap_logits != cap_before || t->rows == NULL) {
            kern_buf_free(t->rows);
            t->rows = NULL;
            TRY(kern_buf_alloc(be, (size_t)t->cap_logits * sizeof(int32_t), &t->rows, err));
        }
        t->final_hidden = (float *)t->logits->ptr + (size_t)t->cap_logits * V;
        int32_t *rows = (int32_t *)logit_rows;
        if (s.n_logits != n_logits) {
            rows = malloc((size_t)s.n_logits * sizeof(int32_t));
            if (rows == NULL)
                return pd_err_set(err, PD_ERR_NOMEM, "logit rows");
            memcpy(rows, logit_rows, (size_t)n_logits * sizeof(int32_t));
            for (int i = n_logits; i < s.n_logits; i++)
                rows[i] = n_logits == n ? i : 0;
        }
        pd_status st = kern_upload(be, t->rows->ptr, rows, (size_t)s.n_logits * sizeof(int32_t), err);
        if (rows != logit_rows)
            free(rows);
        if (st != PD_OK)
            return st;
    }
    if (!pad)
        return target_step_run(&s, err);
    int64_t key[] = { s.n, s.n_seq, s.pt_stride, s.max_kv, s.n_logits, be->batch_invariant,
                      (int64_t)(intptr_t)a->buf->ptr, (int64_t)(intptr_t)a->ibuf->ptr,
                      (int64_t)(intptr_t)a->ptbuf->ptr,
                      (int64_t)(intptr_t)(t->aux != NULL ? t->aux->ptr : NULL),
                      (int64_t)(intptr_t)(t->logits != NULL ? t->logits->ptr : NULL),
                      (int64_t)(intptr_t)(t->rows != NULL ? t->rows->ptr : NULL), t->cap_logits };
    return pd_graph_run(&t->graphs, key, (int)(sizeof(key) / sizeof(key[0])), target_step_run, &s, err);
}

void pd_target_set_graphs(pd_target *t, int mode)
{
    pd_graph_cache_clear(&t->graphs);
    pd_graph_cache_init(&t->graphs, t->m->be, (pd_graph_mode)mode);
}

void pd_target_graph_stats(const pd_target *t, uint64_t *eager, uint64_t *captures, uint64_t *replays)
{
    if (eager != NULL)
        *eager = t->graphs.n_eager;
    if (captures != NULL)
        *captures = t->graphs.n_captures;
    if (replays != NULL)
        *replays = t->graphs.n_replays;
}

uint64_t pd_target_graph_cold(const pd_target *t) { return t->graphs.n_cold; }

const float *pd_target_logits(const pd_target *t) { return t->logits != NULL ? t->logits->ptr : NULL; }
const float *pd_target_aux(const pd_target *t) { return t->aux != NULL ? t->aux->ptr : NULL; }
const float *pd_target_final_hidden(const pd_target *t) { return t->final_hidden; }
int pd_target_aux_dim(const pd_target *t) { return t->n_taps * t->m->cfg.hidden_size; }

int pd_target_capacity(const pd_target *t)
{
    int cap = t->act.cap_tok;
    if (t->n_taps > 0 && t->cap_aux_tok < cap)
        cap = t->cap_aux_tok;
    return cap;
}
const pd_qwen3_model *pd_target_model(const pd_target *t) { return t->m; }
pd_kv_pool *pd_target_pool(const pd_target *t) { return t->pool; }
void pd_target_set_tp(pd_target *t, struct pd_tp_rank *tp) { t->act.tp = tp; }
