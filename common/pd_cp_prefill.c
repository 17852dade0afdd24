/* pd_cp_prefill.c - the context-parallel prefill forward and its in-process group driver
 *   (see pd_cp_prefill.h).
 * Owns: per-rank scratch (the rank's pd_act, gathered K/V, the local and gathered final rows,
 *   global hidden/aux, logits), the order of a CP layer (qkv of the local slots, all-gather K/V,
 *   store at the gathered rows' global slots, attention of the local queries over the global
 *   causal prefix, o_proj, MLP), the final all-gather + re-range, the aux hand-off guard, rank
 *   threads and communicator (re)building for a group.
 * Not here: the layer math (pd_qwen3.c), split plans (pd_cp.c), collectives (pd_comm*.c).
 * Threading: a rank object is touched only by the thread running its forward; the group's
 *   driver thread starts and joins the rank threads, so it reads rank results only after the
 *   join. */
#include "pd_cp_prefill.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "pd_log.h"
#include "pd_qwen3.h"

#ifdef PD_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#define TRY(expr) \
    do { pd_status st_ = (expr); if (st_ != PD_OK) return st_; } while (0)

struct pd_cp_rank {
    kern_backend *be;
    const pd_qwen3_model *m;
    pd_kv_pool *pool;
    pd_comm *comm;
    int taps[PD_MAX_TAPS];
    int n_taps;
    int H, V, kv_dim, aux_dim;
    int fin_dim;               /* a final row: hidden | aux taps */
    pd_act act;
    /* backend float scratch, carved per forward from fbuf */
    kern_buf *fbuf;
    float *gk, *gv;            /* [n_slots, kv_dim] all-gathered K/V of one layer */
    float *loc;                /* [n_local, fin_dim] this rank's final rows (split plans) */
    float *gath;               /* [n_slots, fin_dim] everybody's, rank-major */
    float *hid;                /* [T, H] pre-norm hidden, global order (split plans) */
    float *aux;                /* [T, aux_dim] packed aux, global order */
    float *pick, *normed;      /* [n_logits, H] */
    float *logits;             /* [n_logits, V] */
    /* backend int32 scratch */
    kern_buf *ibuf;
    int32_t *gslot;            /* [n_slots] KV slot of each gathered row, -1 for padding */
    int32_t *perm;             /* [T] global_to_gathered */
    int32_t *lrows;            /* [n_logits] */
    int32_t *first_dev;        /* [n_logits] */
    int32_t *first;            /* host [n_logits] */
    int cap_first;
    /* last forward */
    int n_tok;
    int n_logits;
    const float *hidden_out;
};

/* ---- rank -------------------------------------------------------------------------------- */

pd_status pd_cp_rank_create(const pd_cp_rank_config *cfg, pd_cp_rank **out, pd_err *err)
{
    if (cfg == NULL || cfg->be == NULL || cfg->model == NULL || cfg->pool == NULL ||
        cfg->comm == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp rank: missing backend, model, pool or comm");
    const pd_qwen3_config *mc = &cfg->model->cfg;
    if (cfg->n_taps < 0 || cfg->n_taps > PD_MAX_TAPS || (cfg->n_taps > 0 && cfg->taps == NULL))
        return pd_err_set(err, PD_ERR_INVALID, "cp rank: %d tap layers (max %d)", cfg->n_taps,
                          PD_MAX_TAPS);
    for (int i = 0; i < cfg->n_taps; i++)
        if (cfg->taps[i] < -1 || cfg->taps[i] >= mc->num_hidden_layers - 1)
            return pd_err_set(err, PD_ERR_INVALID,
                              "cp rank: tap layer %d outside -1..%d (the final layer is never a tap)",
                              cfg->taps[i], mc->num_hidden_layers - 2);
    const pd_kv_layout *lay = pd_kv_pool_layout(cfg->pool);
    if (lay->n_layers != mc->num_hidden_layers || lay->n_kv_heads != mc->num_key_value_heads ||
        lay->head_dim != mc->head_dim)
        return pd_err_set(err, PD_ERR_INVALID,
                          "cp rank: kv pool of %d layers x %d heads x %d, model has %d x %d x %d",
                          lay->n_layers, lay->n_kv_heads, lay->head_dim, mc->num_hidden_layers,
                          mc->num_key_value_heads, mc->head_dim);
    pd_cp_rank *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cp rank");
    r->be = cfg->be;
    r->m = cfg->model;
    r->pool = cfg->pool;
    r->comm = cfg->comm;
    r->n_taps = cfg->n_taps;
    if (cfg->n_taps > 0)
        memcpy(r->taps, cfg->taps, (size_t)cfg->n_taps * sizeof(int));
    r->H = mc->hidden_size;
    r->V = mc->vocab_size;
    r->kv_dim = mc->num_key_value_heads * mc->head_dim;
    r->aux_dim = r->n_taps * r->H;
    r->fin_dim = r->H + r->aux_dim;
    pd_status st = pd_act_init(&r->act, r->be, mc, err);
    if (st != PD_OK) {
        free(r);
        return st;
    }
    *out = r;
    return PD_OK;
}

void pd_cp_rank_destroy(pd_cp_rank *r)
{
    if (r == NULL)
        return;
    pd_act_cleanup(&r->act);
    kern_buf_free(r->fbuf);
    kern_buf_free(r->ibuf);
    free(r->first);
    free(r);
}

pd_cp_aux pd_cp_rank_aux(const pd_cp_rank *r)
{
    pd_cp_aux a = { .data = r->aux_dim > 0 ? r->aux : NULL, .rows = r->n_tok, .cols = r->aux_dim,
                    .ld = r->aux_dim };
    return a;
}

const float *pd_cp_rank_hidden(const pd_cp_rank *r) { return r->hidden_out; }
const float *pd_cp_rank_logits(const pd_cp_rank *r) { return r->logits; }
const int32_t *pd_cp_rank_first_tokens(const pd_cp_rank *r) { return r->first; }
int pd_cp_rank_n_tokens(const pd_cp_rank *r) { return r->n_tok; }
int pd_cp_rank_aux_dim(const pd_cp_rank *r) { return r->aux_dim; }
pd_kv_pool *pd_cp_rank_pool(const pd_cp_rank *r) { return r->pool; }

pd_status pd_cp_aux_check(const pd_cp_aux *aux, int n_tokens, int aux_dim, const float *hidden,
                          pd_err *err)
{
    pd_status st = PD_OK;
    if (aux == NULL || aux->data == NULL)
        st = pd_err_set(err, PD_ERR_INTERNAL, "dspark hand-off: no aux tensor (want [%d, %d])",
                        n_tokens, aux_dim);
    else if (aux->rows != n_tokens || aux->cols != aux_dim || aux->ld < aux->cols)
        st = pd_err_set(err, PD_ERR_INTERNAL,
                        "dspark hand-off: got a [%d, %d] tensor (ld %d), want the packed aux "
                        "[%d, %d] (the pre-norm hidden state is [T, hidden])",
                        aux->rows, aux->cols, aux->ld, n_tokens, aux_dim);
    else if (hidden != NULL && aux->data == hidden)
        st = pd_err_set(err, PD_ERR_INTERNAL,
                        "dspark hand-off: got the pre-norm hidden state instead of the packed aux");
    if (st != PD_OK)
        PD_LOG_ERROR("cp", "%s", err != NULL ? err->msg : "dspark hand-off: bad aux tensor");
    return st;
}

/* Carves the per-forward scratch; buffers only grow. */
static pd_status rank_scratch(pd_cp_rank *r, const pd_cp_plan *p, int n_logits, pd_err *err)
{
    size_t ns = (size_t)p->n_slots, nl = (size_t)p->n_local, T = (size_t)p->n_tokens;
    size_t nlog = (size_t)(n_logits > 0 ? n_logits : 1);
    size_t split = p->split != 0;
    size_t nf = split * (2 * ns * r->kv_dim + nl * r->fin_dim + ns * r->fin_dim + T * r->H) +
                T * r->aux_dim + 2 * nlog * r->H + nlog * r->V;
    size_t fbytes = nf * sizeof(float) + 64 * 8;   /* each carve rounds up to 64 bytes */
    if (r->fbuf == NULL || r->fbuf->bytes < fbytes) {
        kern_buf *nb = NULL;
        TRY(kern_buf_alloc(r->be, fbytes, &nb, err));
        kern_buf_free(r->fbuf);
        r->fbuf = nb;
    }
    size_t ni = split * ns + T + 2 * nlog;
    size_t ibytes = ni * sizeof(int32_t) + 64 * 4;
    if (r->ibuf == NULL || r->ibuf->bytes < ibytes) {
        kern_buf *nb = NULL;
        TRY(kern_buf_alloc(r->be, ibytes, &nb, err));
        kern_buf_free(r->ibuf);
        r->ibuf = nb;
    }
    if ((int)nlog > r->cap_first) {
        int32_t *nf32 = realloc(r->first, nlog * sizeof(int32_t));
        if (nf32 == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "cp first tokens: %zu", nlog);
        r->first = nf32;
        r->cap_first = (int)nlog;
    }
    char *f = r->fbuf->ptr;
#define CARVE(ptr, n)                                                                            \
    do {                                                                                         \
        (ptr) = (void *)f;                                                                       \
        f += (((n) * sizeof(float)) + 63) & ~(size_t)63;                                         \
    } while (0)
    r->gk = r->gv = r->loc = r->gath = r->hid = NULL;
    if (split) {
        CARVE(r->gk, ns * r->kv_dim);
        CARVE(r->gv, ns * r->kv_dim);
        CARVE(r->loc, nl * r->fin_dim);
        CARVE(r->gath, ns * r->fin_dim);
        CARVE(r->hid, T * r->H);
    }
    CARVE(r->aux, T * r->aux_dim);
    CARVE(r->pick, nlog * r->H);
    CARVE(r->normed, nlog * r->H);
    CARVE(r->logits, nlog * r->V);
    f = r->ibuf->ptr;
    r->gslot = NULL;
    if (split)
        CARVE(r->gslot, ns);
    CARVE(r->perm, T);
    CARVE(r->lrows, nlog);
    CARVE(r->first_dev, nlog);
#undef CARVE
    return PD_OK;
}

/* A collective on backend buffers: the send rows must be complete before another rank (or
 * NCCL's stream) reads them, and an asynchronous communicator must have finished before this
 * rank's backend reads recv. */
static pd_status gather(pd_cp_rank *r, const void *send, void *recv, size_t bytes, pd_err *err)
{
    TRY(kern_sync(r->be, err));
    TRY(pd_comm_all_gather(r->comm, send, recv, bytes, err));
    if (strcmp(pd_comm_name(r->comm), "nccl") == 0)
        TRY(pd_comm_barrier(r->comm, err));
    return PD_OK;
}

static pd_status capture(pd_cp_rank *r, int tap_i, float *dst, int ld_dst, int n, pd_err *err)
{
    kern_copy_rows_args cp = { .src = r->act.x, .ld_src = r->H, .dst = dst + (size_t)tap_i * r->H,
                               .ld_dst = ld_dst, .rows = n, .cols = r->H };
    return kern_copy_rows(r->be, &cp, err);
}

static pd_status capture_taps(pd_cp_rank *r, int layer, float *dst, int ld_dst, int n, pd_err *err)
{
    for (int i = 0; i < r->n_taps; i++)
        if (r->taps[i] == layer)
            TRY(capture(r, i, dst, ld_dst, n, err));
    return PD_OK;
}

/* Input checks, identical on every rank given the same input. */
static pd_status check_input(const pd_cp_rank *r, const pd_cp_plan *p, const pd_cp_batch *b,
                             pd_err *err)
{
    if (p == NULL || p->n_tokens < 1 || p->n_seqs < 1)
        return pd_err_set(err, PD_ERR_INVALID, "cp prefill: empty batch");
    int rank = pd_comm_rank(r->comm), size = pd_comm_size(r->comm);
    if (p->cp_size != size || rank < 0 || rank >= size)
        return pd_err_set(err, PD_ERR_INVALID, "cp prefill: plan for %d ranks, communicator rank %d of %d",
                          p->cp_size, rank, size);
    if (b == NULL || b->ids == NULL || b->seqs == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp prefill: missing ids or page tables");
    if (b->n_logits < 0 || b->n_logits > p->n_tokens || (b->n_logits > 0 && b->logit_rows == NULL))
        return pd_err_set(err, PD_ERR_INVALID, "cp prefill: %d logit rows for %d tokens",
                          b->n_logits, p->n_tokens);
    for (int i = 0; i < b->n_logits; i++)
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= p->n_tokens)
            return pd_err_set(err, PD_ERR_INVALID, "cp prefill: logit row %d outside the batch of %d",
                              b->logit_rows[i], p->n_tokens);
    for (int t = 0; t < p->n_tokens; t++)
        if (b->ids[t] < 0 || b->ids[t] >= r->V)
            return pd_err_set(err, PD_ERR_INVALID, "token id %d outside the vocabulary (0..%d)",
                              b->ids[t], r->V - 1);
    int page = pd_kv_pool_layout(r->pool)->page_size;
    for (int s = 0; s < p->n_seqs; s++) {
        int end = p->prefix_lens[s] + p->seq_start[s + 1] - p->seq_start[s];
        if (end > r->m->cfg.max_position_embeddings)
            return pd_err_set(err, PD_ERR_INVALID, "position %d exceeds the context length %d",
                              end - 1, r->m->cfg.max_position_embeddings);
        const pd_kv_seq *ks = b->seqs[s];
        if (ks == NULL || (int64_t)ks->n_pages * page < end)
            return pd_err_set(err, PD_ERR_INVALID,
                              "cp prefill rank %d: sequence %d needs %d reserved positions, has %d",
                              rank, s, end, ks != NULL ? ks->n_pages * page : 0);
    }
    return PD_OK;
}

/* Sequence of packed token t (binary search over seq_start). */
static int seq_of(const pd_cp_plan *p, int t)
{
    int lo = 0, hi = p->n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (p->seq_start[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The plain path of a replicated plan: the whole batch, no collectives. */
static pd_status forward_plain(pd_cp_rank *r, const pd_cp_plan *p, const pd_cp_batch *b,
                               pd_err *err)
{
    const pd_qwen3_config *cfg = &r->m->cfg;
    int T = p->n_tokens;
    int32_t *meta = malloc((size_t)2 * T * sizeof(int32_t));
    if (meta == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cp prefill metadata: %d tokens", T);
    int32_t *pos = meta, *seq = meta + T;
    for (int t = 0; t < T; t++) {
        int s = seq_of(p, t);
        seq[t] = s;
        pos[t] = p->prefix_lens[s] + t - p->seq_start[s];
    }
    pd_tok_batch gb = { .n_tok = T, .ids = b->ids, .pos = pos, .seq = seq, .n_seq = p->n_seqs,
                        .seqs = b->seqs };
    int pt_stride = 0, max_kv = 0;
    pd_status st = pd_act_load_batch(&r->act, r->pool, &gb, &pt_stride, &max_kv, err);
    free(meta);
    if (st != PD_OK)
        return st;
    pd_act *a = &r->act;
    kern_embed_args em = { .table = r->m->embed, .ids = a->ids, .n = T, .out = a->x, .ld_out = r->H };
    TRY(kern_embed(r->be, &em, err));
    TRY(capture_taps(r, -1, r->aux, r->aux_dim, T, err));
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        TRY(pd_layer_forward(a, cfg, &r->m->layers[l], pd_kv_pool_layer(r->pool, l), T, p->n_seqs,
                             pt_stride, max_kv, err));
        TRY(capture_taps(r, l, r->aux, r->aux_dim, T, err));
    }
    r->hidden_out = a->x;
    return PD_OK;
}

/* The split path: local slots through every layer, K/V and final rows all-gathered. */
static pd_status forward_split(pd_cp_rank *r, const pd_cp_plan *p, const pd_cp_batch *b,
                               pd_err *err)
{
    const pd_qwen3_config *cfg = &r->m->cfg;
    int rank = pd_comm_rank(r->comm);
    int T = p->n_tokens, nl = p->n_local, ns = p->n_slots;
    int32_t *meta = malloc(((size_t)3 * nl + (size_t)ns) * sizeof(int32_t));
    if (meta == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cp prefill metadata: %d slots", ns);
    int32_t *ids = meta, *pos = meta + nl, *seq = meta + 2 * (size_t)nl, *gslot = meta + 3 * (size_t)nl;
    const int32_t *sg = pd_cp_plan_rank_row(p, p->slot_global, rank);
    const int32_t *ss = pd_cp_plan_rank_row(p, p->slot_seq, rank);
    const int32_t *sp = pd_cp_plan_rank_row(p, p->slot_pos, rank);
    for (int s = 0; s < nl; s++) {
        /* padding: a valid dummy token at position 0 of sequence 0 (always reserved); it
         * attends one real key and its rows are dropped by the gathered maps */
        int pad = sg[s] < 0;
        ids[s] = pad ? 0 : b->ids[sg[s]];
        pos[s] = pad ? 0 : sp[s];
        seq[s] = pad ? 0 : ss[s];
    }
    /* gathered row j is rank-major slot j, so the plan's slot arrays describe it directly */
    for (int j = 0; j < ns; j++)
        gslot[j] = p->slot_seq[j] < 0 ? -1
                                      : pd_kv_seq_slot(r->pool, b->seqs[p->slot_seq[j]], p->slot_pos[j]);
    pd_tok_batch lb = { .n_tok = nl, .ids = ids, .pos = pos, .seq = seq, .n_seq = p->n_seqs,
                        .seqs = b->seqs };
    int pt_stride = 0, max_kv = 0;
    pd_status st = pd_act_load_batch(&r->act, r->pool, &lb, &pt_stride, &max_kv, err);
    if (st == PD_OK)
        st = kern_upload(r->be, r->gslot, gslot, (size_t)ns * sizeof(int32_t), err);
    free(meta);
    if (st != PD_OK)
        return st;
    pd_act *a = &r->act;
    int H = r->H, fd = r->fin_dim;
    float *loc_aux = r->loc + H;
    kern_embed_args em = { .table = r->m->embed, .ids = a->ids, .n = nl, .out = a->x, .ld_out = H };
    TRY(kern_embed(r->be, &em, err));
    TRY(capture_taps(r, -1, loc_aux, fd, nl, err));
    size_t kv_bytes = (size_t)nl * r->kv_dim * sizeof(float);
    for (int l = 0; l < cfg->num_hidden_layers; l++) {
        const pd_layer_weights *lw = &r->m->layers[l];
        kern_kv_layer kv = pd_kv_pool_layer(r->pool, l);
        TRY(pd_layer_qkv(a, cfg, lw, nl, err));
        /* a->k/a->v rows 0..nl-1 are contiguous (row stride kv_dim) */
        TRY(gather(r, a->k, r->gk, kv_bytes, err));
        TRY(gather(r, a->v, r->gv, kv_bytes, err));
        kern_kv_store_args ks = { .kv = kv, .k = r->gk, .v = r->gv, .ld = r->kv_dim,
                                  .slot = r->gslot, .n_tok = ns };
        TRY(kern_kv_store(r->be, &ks, err));
        TRY(pd_layer_attn_mlp(a, cfg, lw, kv, nl, p->n_seqs, pt_stride, max_kv, err));
        TRY(capture_taps(r, l, loc_aux, fd, nl, err));
    }
    kern_copy_rows_args cx = { .src = a->x, .ld_src = H, .dst = r->loc, .ld_dst = fd, .rows = nl,
                               .cols = H };
    TRY(kern_copy_rows(r->be, &cx, err));
    TRY(gather(r, r->loc, r->gath, (size_t)nl * fd * sizeof(float), err));
    /* one permutation restores global order; padding rows are never selected */
    kern_copy_rows_args ph = { .src = r->gath, .ld_src = fd, .idx = r->perm, .dst = r->hid,
                               .ld_dst = H, .rows = T, .cols = H };
    TRY(kern_copy_rows(r->be, &ph, err));
    if (r->aux_dim > 0) {
        kern_copy_rows_args pa = { .src = r->gath + H, .ld_src = fd, .idx = r->perm, .dst = r->aux,
                                   .ld_dst = r->aux_dim, .rows = T, .cols = r->aux_dim };
        TRY(kern_copy_rows(r->be, &pa, err));
    }
    r->hidden_out = r->hid;
    return PD_OK;
}

static pd_status forward(pd_cp_rank *r, const pd_cp_plan *p, const pd_cp_batch *b, pd_err *err)
{
    TRY(rank_scratch(r, p, b->n_logits, err));
    TRY(kern_upload(r->be, r->perm, p->global_to_gathered, (size_t)p->n_tokens * sizeof(int32_t),
                    err));
    if (b->n_logits > 0)
        TRY(kern_upload(r->be, r->lrows, b->logit_rows, (size_t)b->n_logits * sizeof(int32_t), err));
    TRY(p->split ? forward_split(r, p, b, err) : forward_plain(r, p, b, err));
    if (b->n_logits == 0)
        return PD_OK;
    TRY(pd_qwen3_head(r->m, r->be, r->hidden_out, r->H, r->lrows, b->n_logits, r->pick, r->normed,
                      r->logits, err));
    kern_argmax_args am = { .x = r->logits, .ld_x = r->V, .rows = b->n_logits, .n = r->V,
                            .out = r->first_dev };
    TRY(kern_argmax(r->be, &am, err));
    return kern_download(r->be, r->first, r->first_dev, (size_t)b->n_logits * sizeof(int32_t), err);
}

pd_status pd_cp_rank_forward(pd_cp_rank *r, const pd_cp_plan *plan, const pd_cp_batch *b,
                             pd_err *err)
{
    r->n_tok = 0;
    r->n_logits = 0;
    r->hidden_out = NULL;
    pd_status st = check_input(r, plan, b, err);
    if (st == PD_OK)
        st = forward(r, plan, b, err);
    if (st != PD_OK) {
        /* the other ranks may be waiting (or about to wait) in a collective */
        if (plan != NULL && plan->split)
            pd_comm_abort(r->comm, err != NULL ? err->msg : "cp rank failed");
        return st;
    }
    r->n_tok = plan->n_tokens;
    r->n_logits = b->n_logits;
    return PD_OK;
}

/* ---- group ------------------------------------------------------------------------------- */

struct pd_cp_group {
    int n;
    pd_cp_opts opts;
    pd_cp_comm_kind kind;
    int timeout_ms;
    pd_comm_copy_fn copy;
    void *copy_ud;
    pd_cp_rank_res *res;       /* [n] */
    pd_comm **comms;           /* [n] */
    pd_cp_rank **ranks;        /* [n] */
    pd_cp_plan *plan;
    int broken;                /* a prefill failed: rebuild the communicators first */
};

static void comms_destroy(pd_cp_group *g)
{
    for (int r = 0; r < g->n; r++) {
        pd_comm_destroy(g->comms[r]);
        g->comms[r] = NULL;
    }
}

static pd_status comms_create(pd_cp_group *g, pd_err *err)
{
    pd_status st;
    if (g->kind == PD_CP_COMM_NCCL) {
        pd_comm_nccl_opts *o = calloc((size_t)g->n, sizeof(*o));
        if (o == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "cp group: nccl options");
        for (int r = 0; r < g->n; r++) {
            o[r].device = g->res[r].device;
            o[r].timeout_ms = g->timeout_ms;
        }
#ifdef PD_HAVE_CUDA
        /* creating the ranks switches this thread's device; the caller keeps its own */
        int dev = 0;
        int have_dev = cudaGetDevice(&dev) == cudaSuccess;
#endif
        st = pd_comm_nccl_create_all(g->n, o, g->comms, err);
#ifdef PD_HAVE_CUDA
        if (have_dev)
            (void)cudaSetDevice(dev);
#endif
        free(o);
    } else {
        pd_comm_local_opts lo = { .copy = g->copy, .copy_ud = g->copy_ud,
                                  .timeout_ms = g->timeout_ms };
        pd_comm_local_group *lg = NULL;
        st = pd_comm_local_group_create(g->n, &lo, &lg, err);
        for (int r = 0; r < g->n && st == PD_OK; r++)
            st = pd_comm_local_create(lg, r, &g->comms[r], err);
        pd_comm_local_group_destroy(lg);   /* the handles keep the group alive */
        if (st != PD_OK)
            comms_destroy(g);
    }
    if (st != PD_OK)
        return st;
    for (int r = 0; r < g->n; r++)
        if (g->ranks[r] != NULL)
            g->ranks[r]->comm = g->comms[r];
    g->broken = 0;
    return PD_OK;
}

pd_status pd_cp_group_create(const pd_cp_group_config *cfg, pd_cp_group **out, pd_err *err)
{
    if (cfg == NULL || cfg->opts.cp_size < 1 || cfg->opts.cp_size > PD_CP_MAX_SIZE ||
        cfg->ranks == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp group: cp_size %d",
                          cfg != NULL ? cfg->opts.cp_size : 0);
    if (cfg->opts.strategy < 0 || cfg->opts.strategy >= PD_CP_STRATEGY_COUNT)
        return pd_err_set(err, PD_ERR_INVALID, "cp group: unknown strategy %d", (int)cfg->opts.strategy);
    int n = cfg->opts.cp_size;
    for (int r = 0; r < n; r++) {
        const pd_cp_rank_res *rr = &cfg->ranks[r];
        if (rr->be == NULL || rr->model == NULL || rr->pool == NULL)
            return pd_err_set(err, PD_ERR_INVALID, "cp group: rank %d has no backend, model or pool", r);
        if (cfg->comm == PD_CP_COMM_LOCAL && cfg->copy == NULL && !rr->be->is_host)
            return pd_err_set(err, PD_ERR_INVALID,
                              "cp group: rank %d uses device memory (%s); a local group needs a "
                              "copy function, or use NCCL", r, rr->be->ops->name);
    }
    if (cfg->comm == PD_CP_COMM_NCCL && !pd_comm_nccl_available())
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cp group: NCCL needs a CUDA build");
    pd_cp_group *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cp group");
    pd_status st;
    g->n = n;
    g->opts = cfg->opts;
    g->kind = cfg->comm;
    g->timeout_ms = cfg->timeout_ms;
    g->copy = cfg->copy;
    g->copy_ud = cfg->copy_ud;
    g->res = calloc((size_t)n, sizeof(*g->res));
    g->comms = calloc((size_t)n, sizeof(*g->comms));
    g->ranks = calloc((size_t)n, sizeof(*g->ranks));
    if (g->res == NULL || g->comms == NULL || g->ranks == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "cp group: %d ranks", n);
        goto err_destroy;
    }
    memcpy(g->res, cfg->ranks, (size_t)n * sizeof(*g->res));
    st = comms_create(g, err);
    if (st != PD_OK)
        goto err_destroy;
    for (int r = 0; r < n; r++) {
        pd_cp_rank_config rc = { .be = g->res[r].be, .model = g->res[r].model,
                                 .pool = g->res[r].pool, .comm = g->comms[r], .taps = cfg->taps,
                                 .n_taps = cfg->n_taps };
        st = pd_cp_rank_create(&rc, &g->ranks[r], err);
        if (st != PD_OK)
            goto err_destroy;
    }
    *out = g;
    return PD_OK;
err_destroy:
    pd_cp_group_destroy(g);
    return st;
}

void pd_cp_group_destroy(pd_cp_group *g)
{
    if (g == NULL)
        return;
    for (int r = 0; g->ranks != NULL && r < g->n; r++)
        pd_cp_rank_destroy(g->ranks[r]);
    if (g->comms != NULL)
        comms_destroy(g);
    pd_cp_plan_destroy(g->plan);
    free(g->ranks);
    free(g->comms);
    free(g->res);
    free(g);
}

int pd_cp_group_size(const pd_cp_group *g) { return g->n; }
pd_cp_rank *pd_cp_group_rank(pd_cp_group *g, int rank)
{
    return rank >= 0 && rank < g->n ? g->ranks[rank] : NULL;
}
const pd_cp_plan *pd_cp_group_plan(const pd_cp_group *g) { return g->plan; }

typedef struct {
    pd_cp_group *g;
    int rank;
    const pd_cp_group_batch *b;
    pd_status st;
    pd_err err;
} rank_job;

static void *rank_main(void *arg)
{
    rank_job *j = arg;
    pd_cp_group *g = j->g;
    /* a device backend's calls go to the calling thread's current device */
    j->st = kern_backend_bind_thread(g->res[j->rank].be, NULL, &j->err);
    if (j->st != PD_OK) {
        pd_comm_abort(g->comms[j->rank], j->err.msg);
        return NULL;
    }
    pd_cp_batch rb = { .ids = j->b->ids, .seqs = j->b->seqs[j->rank], .logit_rows = j->b->logit_rows,
                       .n_logits = j->b->n_logits };
    j->st = pd_cp_rank_forward(g->ranks[j->rank], g->plan, &rb, &j->err);
    return NULL;
}

pd_status pd_cp_group_prefill(pd_cp_group *g, const pd_cp_group_batch *b, pd_err *err)
{
    if (b == NULL || b->n_seqs < 1 || b->seq_lens == NULL || b->ids == NULL || b->seqs == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp prefill: empty batch");
    for (int r = 0; r < g->n; r++)
        if (b->seqs[r] == NULL)
            return pd_err_set(err, PD_ERR_INVALID, "cp prefill: no page tables for rank %d", r);
    if (g->broken) {
        comms_destroy(g);
        TRY(comms_create(g, err));
    }
    pd_cp_plan *plan = NULL;
    TRY(pd_cp_plan_create(b->seq_lens, b->prefix_lens, b->n_seqs, &g->opts, &plan, err));
    pd_cp_plan_destroy(g->plan);
    g->plan = plan;
    rank_job *jobs = calloc((size_t)g->n, sizeof(*jobs));
    pthread_t *th = calloc((size_t)g->n, sizeof(*th));
    unsigned char *started = calloc((size_t)g->n, 1);
    pd_status st = PD_OK;
    if (jobs == NULL || th == NULL || started == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "cp prefill: %d rank threads", g->n);
        goto out;
    }
    for (int r = 0; r < g->n; r++) {
        jobs[r] = (rank_job){ .g = g, .rank = r, .b = b, .st = PD_OK };
        if (pthread_create(&th[r], NULL, rank_main, &jobs[r]) != 0) {
            st = pd_err_set(err, PD_ERR_INTERNAL, "cp prefill: cannot start rank thread %d", r);
            /* the ranks already running must not wait for this one */
            for (int q = 0; q < r; q++)
                pd_comm_abort(g->comms[q], "a rank thread could not start");
            break;
        }
        started[r] = 1;
    }
    for (int r = 0; r < g->n; r++)
        if (started[r])
            pthread_join(th[r], NULL);
    if (st == PD_OK) {
        /* report the root cause: a rank's own failure before the PD_ERR_PEER it caused */
        int first = -1;
        for (int r = 0; r < g->n; r++)
            if (jobs[r].st != PD_OK && (first < 0 || (jobs[first].st == PD_ERR_PEER &&
                                                      jobs[r].st != PD_ERR_PEER)))
                first = r;
        if (first >= 0) {
            st = jobs[first].st;
            if (err != NULL)
                *err = jobs[first].err;
        }
    }
    if (st != PD_OK)
        g->broken = 1;
out:
    free(jobs);
    free(th);
    free(started);
    return st;
}
