/* pd_qwen3.c - Qwen3 decoder layers and the target runner on the backend ops.
 * Owns: layer order (pre-norm attention with q/k RMSNorm and RoPE, SwiGLU MLP), the activation
 *   workspace, aux capture (raw residual stream after a tap layer, as HF hidden_states[l+1]).
 * Not here: KV page allocation (pd_kv.c; callers reserve pages before a forward).
 * Threading: one thread per runner. */
#include "pd_qwen3.h"

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
    int n = b->n_tok;
    int pt_stride = 1;
    for (int s = 0; s < b->n_seq; s++)
        if (b->seqs[s]->n_pages > pt_stride)
            pt_stride = b->seqs[s]->n_pages;
    TRY(pd_act_reserve(a, n, pt_stride * b->n_seq, err));
    int32_t *host = malloc(((size_t)3 * n + (size_t)pt_stride * b->n_seq) * sizeof(int32_t));
    if (host == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "batch metadata: %d tokens", n);
    int32_t *kv_len = host, *slot = host + n, *pt = host + 2 * (size_t)n;
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
        slot[t] = pd_kv_seq_slot(pool, ks, b->pos[t]);
    }
    for (int s = 0; s < b->n_seq; s++) {
        const pd_kv_seq *ks = b->seqs[s];
        for (int i = 0; i < pt_stride; i++)
            pt[(size_t)s * pt_stride + i] = i < ks->n_pages ? ks->pages[i] : 0;
    }
    if (b->ids != NULL && (st = kern_upload(a->be, a->ids, b->ids, (size_t)n * 4, err)) != PD_OK)
        goto out;
    if ((st = kern_upload(a->be, a->pos, b->pos, (size_t)n * 4, err)) != PD_OK ||
        (st = kern_upload(a->be, a->seq, b->seq, (size_t)n * 4, err)) != PD_OK ||
        (st = kern_upload(a->be, a->kv_len, kv_len, (size_t)n * 4, err)) != PD_OK ||
        (st = kern_upload(a->be, a->slot, slot, (size_t)n * 4, err)) != PD_OK ||
        (st = kern_upload(a->be, a->page_table, pt, (size_t)pt_stride * b->n_seq * 4, err)) != PD_OK)
        goto out;
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

pd_status pd_layer_kv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                      const float *in, int n_tok, pd_err *err)
{
    kern_backend *be = a->be;
    int hd = cfg->head_dim, nkv = cfg->num_key_value_heads;
    TRY(linear(be, in, a->hidden, &lw->k_proj, a->k, a->kv_dim, n_tok, 0, err));
    TRY(linear(be, in, a->hidden, &lw->v_proj, a->v, a->kv_dim, n_tok, 0, err));
    TRY(rmsnorm(be, a->k, a->k, &lw->k_norm, n_tok * nkv, hd, cfg->rms_norm_eps, err));
    kern_rope_args rk = { .x = a->k, .n_tok = n_tok, .n_heads = nkv, .head_dim = hd, .ld = a->kv_dim,
                          .pos = a->pos, .theta = cfg->rope_theta };
    return kern_rope(be, &rk, err);
}

/* k = rope(k_norm(in Wk^T)), v = in Wv^T, stored at a->slot; leaves k/v in a->k, a->v. */
pd_status pd_layer_store_kv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                            kern_kv_layer kv, const float *in, int n_tok, pd_err *err)
{
    TRY(pd_layer_kv(a, cfg, lw, in, n_tok, err));
    kern_kv_store_args ks = { .kv = kv, .k = a->k, .v = a->v, .ld = a->kv_dim, .slot = a->slot,
                              .n_tok = n_tok };
    return kern_kv_store(a->be, &ks, err);
}

pd_status pd_layer_qkv(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw, int n_tok,
                       pd_err *err)
{
    kern_backend *be = a->be;
    int H = a->hidden, hd = cfg->head_dim, nh = cfg->num_attention_heads;
    float eps = cfg->rms_norm_eps;
    TRY(rmsnorm(be, a->x, a->h, &lw->input_norm, n_tok, H, eps, err));
    TRY(linear(be, a->h, H, &lw->q_proj, a->q, a->q_dim, n_tok, 0, err));
    TRY(rmsnorm(be, a->q, a->q, &lw->q_norm, n_tok * nh, hd, eps, err));
    kern_rope_args rq = { .x = a->q, .n_tok = n_tok, .n_heads = nh, .head_dim = hd, .ld = a->q_dim,
                          .pos = a->pos, .theta = cfg->rope_theta };
    TRY(kern_rope(be, &rq, err));
    return pd_layer_kv(a, cfg, lw, a->h, n_tok, err);
}

pd_status pd_layer_attn_mlp(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                            kern_kv_layer kv, int n_tok, int n_seq, int pt_stride, int max_kv,
                            pd_err *err)
{
    kern_backend *be = a->be;
    int H = a->hidden, hd = cfg->head_dim, nh = cfg->num_attention_heads;
    float eps = cfg->rms_norm_eps;
    kern_attn_args at = {
        .kv = kv, .q = a->q, .ld_q = a->q_dim, .out = a->o, .ld_out = a->q_dim, .n_tok = n_tok,
        .n_heads = nh, .tok_seq = a->seq, .tok_kv_len = a->kv_len, .page_table = a->page_table,
        .pt_stride = pt_stride, .n_seq = n_seq, .max_kv_len = max_kv,
        .scale = (float)(1.0 / sqrt((double)hd)),
    };
    TRY(kern_attn(be, &at, err));
    /* tensor parallel: row-parallel o_proj, partials summed across the ranks */
    TRY(linear(be, a->o, a->q_dim, &lw->o_proj, a->x, H, n_tok, pd_tp_accumulate(a->tp), err));
    TRY(pd_tp_all_reduce(a->tp, a->x, (size_t)n_tok * H, err));
    TRY(rmsnorm(be, a->x, a->h, &lw->post_norm, n_tok, H, eps, err));
    TRY(linear(be, a->h, H, &lw->gate_proj, a->g, a->inter, n_tok, 0, err));
    TRY(linear(be, a->h, H, &lw->up_proj, a->u, a->inter, n_tok, 0, err));
    kern_binary_args sw = { .op = KERN_BINARY_SWIGLU, .a = a->g, .ld_a = a->inter, .b = a->u,
                            .ld_b = a->inter, .out = a->g, .ld_out = a->inter, .rows = n_tok,
                            .cols = a->inter };
    TRY(kern_binary(be, &sw, err));
    TRY(linear(be, a->g, a->inter, &lw->down_proj, a->x, H, n_tok, pd_tp_accumulate(a->tp), err));
    return pd_tp_all_reduce(a->tp, a->x, (size_t)n_tok * H, err);
}

pd_status pd_layer_forward(pd_act *a, const pd_qwen3_config *cfg, const pd_layer_weights *lw,
                           kern_kv_layer kv, int n_tok, int n_seq, int pt_stride, int max_kv,
                           pd_err *err)
{
    TRY(pd_layer_qkv(a, cfg, lw, n_tok, err));
    kern_kv_store_args ks = { .kv = kv, .k = a->k, .v = a->v, .ld = a->kv_dim, .slot = a->slot,
                              .n_tok = n_tok };
    TRY(kern_kv_store(a->be, &ks, err));
    return pd_layer_attn_mlp(a, cfg, lw, kv, n_tok, n_seq, pt_stride, max_kv, err);
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
    pd_act_cleanup(&t->act);
    kern_buf_free(t->aux);
    kern_buf_free(t->logits);
    kern_buf_free(t->rows);
    free(t);
}

static pd_status capture_tap(pd_target *t, int slot, int n_tok, pd_err *err)
{
    int H = t->act.hidden;
    kern_copy_rows_args cp = { .src = t->act.x, .ld_src = H,
                               .dst = (float *)t->aux->ptr + (size_t)slot * H,
                               .ld_dst = t->n_taps * H, .rows = n_tok, .cols = H };
    return kern_copy_rows(t->m->be, &cp, err);
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
    pd_act *a = &t->act;
    int pt_stride = 0, max_kv = 0;
    TRY(pd_act_load_batch(a, t->pool, b, &pt_stride, &max_kv, err));
    if (t->n_taps > 0)
        TRY(kern_buf_grow(be, &t->aux, &t->cap_aux_tok, n, (size_t)t->n_taps * H * sizeof(float), err));
    kern_embed_args em = { .table = m->embed, .ids = a->ids, .n = n, .out = a->x, .ld_out = H };
    TRY(kern_embed(be, &em, err));
    for (int i = 0; i < t->n_taps; i++)
        if (t->taps[i] == -1)
            TRY(capture_tap(t, i, n, err));
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        TRY(pd_layer_forward(a, cfg, &m->layers[l], pd_kv_pool_layer(t->pool, l), n, b->n_seq,
                             pt_stride, max_kv, err));
        for (int i = 0; i < t->n_taps; i++)
            if (t->taps[i] == l)
                TRY(capture_tap(t, i, n, err));
    }
    if (n_logits <= 0)
        return PD_OK;
    for (int i = 0; i < n_logits; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= n)
            return pd_err_set(err, PD_ERR_INTERNAL, "logit row %d outside batch of %d", logit_rows[i], n);
    TRY(pd_act_reserve(a, n_logits, 0, err));
    int cap_before = t->cap_logits;
    TRY(kern_buf_grow(be, &t->logits, &t->cap_logits, n_logits, (size_t)(V + H) * sizeof(float), err));
    if (t->cap_logits != cap_before || t->rows == NULL) {
        kern_buf_free(t->rows);
        t->rows = NULL;
        TRY(kern_buf_alloc(be, (size_t)t->cap_logits * sizeof(int32_t), &t->rows, err));
    }
    t->final_hidden = (float *)t->logits->ptr + (size_t)t->cap_logits * V;
    TRY(kern_upload(be, t->rows->ptr, logit_rows, (size_t)n_logits * sizeof(int32_t), err));
    TRY(pd_qwen3_head(m, be, a->x, H, t->rows->ptr, n_logits, a->h, t->final_hidden,
                      t->logits->ptr, err));
    /* tensor parallel: this rank's lm_head rows are one vocab slice */
    return pd_tp_gather_vocab(a->tp, t->logits->ptr, V, n_logits, err);
}

const float *pd_target_logits(const pd_target *t) { return t->logits != NULL ? t->logits->ptr : NULL; }
const float *pd_target_aux(const pd_target *t) { return t->aux != NULL ? t->aux->ptr : NULL; }
const float *pd_target_final_hidden(const pd_target *t) { return t->final_hidden; }
int pd_target_aux_dim(const pd_target *t) { return t->n_taps * t->m->cfg.hidden_size; }
const pd_qwen3_model *pd_target_model(const pd_target *t) { return t->m; }
pd_kv_pool *pd_target_pool(const pd_target *t) { return t->pool; }
void pd_target_set_tp(pd_target *t, struct pd_tp_rank *tp) { t->act.tp = tp; }
