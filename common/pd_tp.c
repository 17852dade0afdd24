/* pd_tp.c - tensor-parallel decode: shard arithmetic, sharded weights, the collectives at the
 *   split points, and the rank threads of a group (see pd_tp.h).
 * Owns: pd_tp_shard, the per-rank context, the group (workers, command hand-off, failure).
 * Not here: where the split points are in a layer (pd_qwen3.c, pd_dspark.c call in here).
 * Threading: a rank's state is touched only by its thread; the hand-off (cmd, seq, n_done,
 *   quit) is guarded by the group mutex. */
#include "pd_tp.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_graph.h"
#include "pd_log.h"

#define TRY(expr) \
    do { pd_status st_ = (expr); if (st_ != PD_OK) return st_; } while (0)

/* ---- shard arithmetic -------------------------------------------------------------------- */

pd_status pd_tp_check(const pd_qwen3_config *c, int tp, pd_err *err)
{
    int nh = c->num_attention_heads, nkv = c->num_key_value_heads;
    if (tp < 1 || tp > PD_TP_MAX_SIZE)
        return pd_err_set(err, PD_ERR_INVALID, "tp %d outside 1..%d", tp, PD_TP_MAX_SIZE);
    if (tp > nh)
        return pd_err_set(err, PD_ERR_INVALID, "tp %d exceeds the model's %d attention heads", tp,
                          nh);
    if (nh % tp != 0)
        return pd_err_set(err, PD_ERR_INVALID,
                          "tp %d does not divide the model's %d attention heads", tp, nh);
    if (nkv % tp != 0 && tp % nkv != 0)
        return pd_err_set(err, PD_ERR_INVALID,
                          "tp %d and the model's %d KV heads: one must divide the other (KV "
                          "heads are split over the ranks, or replicated when there are fewer)",
                          tp, nkv);
    if (c->intermediate_size < tp)
        return pd_err_set(err, PD_ERR_INVALID, "tp %d exceeds the model's %d MLP columns", tp,
                          c->intermediate_size);
    int slice = (c->vocab_size + tp - 1) / tp;
    if (c->vocab_size - (tp - 1) * slice < 1)
        return pd_err_set(err, PD_ERR_INVALID,
                          "tp %d leaves the last rank no vocab rows (vocab %d in slices of %d)",
                          tp, c->vocab_size, slice);
    return PD_OK;
}

void pd_tp_shard_of(const pd_qwen3_config *c, int size, int rank, pd_tp_shard *out)
{
    int nh = c->num_attention_heads, nkv = c->num_key_value_heads, I = c->intermediate_size;
    int V = c->vocab_size;
    pd_tp_shard s = { .rank = rank, .size = size };
    s.n_q_heads = nh / size;
    s.q_head0 = rank * s.n_q_heads;
    /* fewer KV heads than ranks: rank r uses the KV head its query heads belong to */
    s.n_kv_heads = nkv >= size ? nkv / size : 1;
    s.kv_head0 = nkv >= size ? rank * s.n_kv_heads : rank * nkv / size;
    s.inter0 = (int)((long)rank * I / size);
    s.n_inter = (int)((long)(rank + 1) * I / size) - s.inter0;
    s.vocab_slice = (V + size - 1) / size;
    s.vocab0 = rank * s.vocab_slice;
    s.n_vocab = V - s.vocab0 < s.vocab_slice ? V - s.vocab0 : s.vocab_slice;
    *out = s;
}

/* ---- sharded weights --------------------------------------------------------------------- */

/* dst = src[row0 .. row0 + rows, col0 .. col0 + cols] */
typedef struct {
    kern_weight *dst;
    kern_weight src;
    int64_t row0, rows, col0, cols;
} slice;

typedef struct {
    slice *s;
    int n, cap;
} slice_plan;

static pd_status plan_slice(slice_plan *p, kern_weight *dst, const kern_weight *src, int64_t row0,
                            int64_t rows, int64_t col0, int64_t cols, pd_err *err)
{
    if (src->data == NULL) {   /* an absent optional tensor stays absent */
        *dst = *src;
        return PD_OK;
    }
    if (p->n == p->cap) {
        int c = p->cap > 0 ? 2 * p->cap : 64;
        slice *ns = realloc(p->s, (size_t)c * sizeof(*ns));
        if (ns == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "tp shard plan: %d tensors", c);
        p->s = ns;
        p->cap = c;
    }
    p->s[p->n++] = (slice){ .dst = dst, .src = *src, .row0 = row0, .rows = rows, .col0 = col0,
                            .cols = cols };
    return PD_OK;
}

static pd_status plan_whole(slice_plan *p, kern_weight *dst, const kern_weight *src, pd_err *err)
{
    return plan_slice(p, dst, src, 0, src->rows, 0, src->cols, err);
}

/* One allocation on be for every slice; each is read from src_be a row block at a time. */
static pd_status plan_copy(slice_plan *p, kern_backend *src_be, kern_backend *be, kern_buf **out,
                           pd_err *err)
{
    size_t total = 0, max_block = 0;
    for (int i = 0; i < p->n; i++) {
        const slice *s = &p->s[i];
        size_t es = kern_dtype_size(s->src.dtype);
        total += ((size_t)(s->rows * s->cols) * es + 255) & ~(size_t)255;
        size_t block = (size_t)(s->rows * s->src.cols) * es;
        if (block > max_block)
            max_block = block;
    }
    kern_buf *buf = NULL;
    /* GPU ranks: source and destination may sit on different devices; each copy runs with its
     * backend's device current (no-ops on host backends) */
    TRY(kern_backend_bind_thread(be, NULL, err));
    TRY(kern_buf_alloc(be, total > 0 ? total : 256, &buf, err));
    unsigned char *tmp = malloc(max_block > 0 ? max_block : 1);
    if (tmp == NULL) {
        kern_buf_free(buf);
        return pd_err_set(err, PD_ERR_NOMEM, "tp shard staging: %zu bytes", max_block);
    }
    pd_status st = PD_OK;
    size_t off = 0;
    for (int i = 0; i < p->n && st == PD_OK; i++) {
        const slice *s = &p->s[i];
        size_t es = kern_dtype_size(s->src.dtype);
        size_t row_bytes = (size_t)s->src.cols * es, out_row = (size_t)s->cols * es;
        st = kern_backend_bind_thread(src_be, NULL, err);
        if (st == PD_OK)
            st = kern_download(src_be, tmp, (const unsigned char *)s->src.data + (size_t)s->row0 * row_bytes,
                               (size_t)s->rows * row_bytes, err);
        if (st == PD_OK)
            st = kern_backend_bind_thread(be, NULL, err);
        if (st != PD_OK)
            break;
        if (s->cols != s->src.cols)   /* pack the column range to the front of each row */
            for (int64_t r = 0; r < s->rows; r++)
                memmove(tmp + (size_t)r * out_row, tmp + (size_t)r * row_bytes + (size_t)s->col0 * es,
                        out_row);
        unsigned char *dst = (unsigned char *)buf->ptr + off;
        st = kern_upload(be, dst, tmp, (size_t)s->rows * out_row, err);
        *s->dst = (kern_weight){ .data = dst, .dtype = s->src.dtype, .rows = s->rows, .cols = s->cols };
        off += ((size_t)s->rows * out_row + 255) & ~(size_t)255;
    }
    free(tmp);
    if (st != PD_OK) {
        kern_buf_free(buf);
        return st;
    }
    *out = buf;
    return PD_OK;
}

static pd_status plan_layer(slice_plan *p, const pd_layer_weights *src, pd_layer_weights *dst,
                            const pd_tp_shard *sh, int head_dim, pd_err *err)
{
    int64_t q0 = (int64_t)sh->q_head0 * head_dim, nq = (int64_t)sh->n_q_heads * head_dim;
    int64_t k0 = (int64_t)sh->kv_head0 * head_dim, nk = (int64_t)sh->n_kv_heads * head_dim;
    TRY(plan_whole(p, &dst->input_norm, &src->input_norm, err));
    TRY(plan_whole(p, &dst->post_norm, &src->post_norm, err));
    TRY(plan_whole(p, &dst->q_norm, &src->q_norm, err));
    TRY(plan_whole(p, &dst->k_norm, &src->k_norm, err));
    TRY(plan_slice(p, &dst->q_proj, &src->q_proj, q0, nq, 0, src->q_proj.cols, err));
    TRY(plan_slice(p, &dst->k_proj, &src->k_proj, k0, nk, 0, src->k_proj.cols, err));
    TRY(plan_slice(p, &dst->v_proj, &src->v_proj, k0, nk, 0, src->v_proj.cols, err));
    TRY(plan_slice(p, &dst->o_proj, &src->o_proj, 0, src->o_proj.rows, q0, nq, err));
    TRY(plan_slice(p, &dst->gate_proj, &src->gate_proj, sh->inter0, sh->n_inter, 0,
                   src->gate_proj.cols, err));
    TRY(plan_slice(p, &dst->up_proj, &src->up_proj, sh->inter0, sh->n_inter, 0, src->up_proj.cols,
                   err));
    return plan_slice(p, &dst->down_proj, &src->down_proj, 0, src->down_proj.rows, sh->inter0,
                      sh->n_inter, err);
}

static pd_status plan_vocab(slice_plan *p, kern_weight *dst, const kern_weight *src,
                            const pd_tp_shard *sh, pd_err *err)
{
    return plan_slice(p, dst, src, sh->vocab0, sh->n_vocab, 0, src->cols, err);
}

pd_status pd_tp_qwen3_shard(const pd_qwen3_model *full, kern_backend *be, int size, int rank,
                            pd_qwen3_model **out, pd_err *err)
{
    const pd_qwen3_config *c = &full->cfg;
    TRY(pd_tp_check(c, size, err));
    if (rank < 0 || rank >= size)
        return pd_err_set(err, PD_ERR_INVALID, "tp rank %d of %d", rank, size);
    pd_tp_shard sh;
    pd_tp_shard_of(c, size, rank, &sh);
    pd_qwen3_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "tp shard model");
    m->cfg = *c;
    m->cfg.num_attention_heads = sh.n_q_heads;
    m->cfg.num_key_value_heads = sh.n_kv_heads;
    m->cfg.intermediate_size = sh.n_inter;
    m->be = be;
    pd_status st = PD_OK;
    slice_plan p = { 0 };
    m->layers = calloc((size_t)c->num_hidden_layers, sizeof(*m->layers));
    if (m->layers == NULL)
        st = pd_err_set(err, PD_ERR_NOMEM, "tp shard: %d layers", c->num_hidden_layers);
    if (st == PD_OK)
        st = plan_whole(&p, &m->embed, &full->embed, err);
    if (st == PD_OK)
        st = plan_whole(&p, &m->final_norm, &full->final_norm, err);
    if (st == PD_OK)
        st = plan_vocab(&p, &m->lm_head, &full->lm_head, &sh, err);
    for (int l = 0; l < c->num_hidden_layers && st == PD_OK; l++)
        st = plan_layer(&p, &full->layers[l], &m->layers[l], &sh, c->head_dim, err);
    if (st == PD_OK)
        st = plan_copy(&p, full->be, be, &m->storage, err);
    free(p.s);
    if (st != PD_OK) {
        pd_qwen3_free(m);
        return st;
    }
    *out = m;
    return PD_OK;
}

pd_status pd_tp_dspark_shard(const pd_dspark_model *full, const pd_qwen3_model *full_target,
                             const pd_qwen3_model *target_shard, kern_backend *be, int size,
                             int rank, pd_dspark_model **out, pd_err *err)
{
    /* only the vocab is split (the decoder layers are replicated), and the vocab is the
     * target's, which pd_tp_check has accepted */
    const pd_qwen3_config *c = &full->cfg.base;
    if (rank < 0 || rank >= size || c->vocab_size != full_target->cfg.vocab_size)
        return pd_err_set(err, PD_ERR_INVALID, "tp draft shard: rank %d of %d, vocab %d vs %d",
                          rank, size, c->vocab_size, full_target->cfg.vocab_size);
    pd_tp_shard sh;
    pd_tp_shard_of(c, size, rank, &sh);
    pd_dspark_model *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "tp draft shard");
    *m = *full;
    m->be = be;
    m->storage = NULL;
    pd_status st = PD_OK;
    slice_plan p = { 0 };
    m->layers = calloc((size_t)c->num_hidden_layers, sizeof(*m->layers));
    if (m->layers == NULL)
        st = pd_err_set(err, PD_ERR_NOMEM, "tp draft shard: %d layers", c->num_hidden_layers);
    /* what the drafter borrows from the target comes from the target's shard: lm_head is then
     * the same vocab slice the target uses */
    if (full->embed.data == full_target->embed.data)
        m->embed = target_shard->embed;
    else if (st == PD_OK)
        st = plan_whole(&p, &m->embed, &full->embed, err);
    if (full->lm_head.data == full_target->lm_head.data)
        m->lm_head = target_shard->lm_head;
    else if (st == PD_OK)
        st = plan_vocab(&p, &m->lm_head, &full->lm_head, &sh, err);
    if (st == PD_OK)
        st = plan_vocab(&p, &m->markov_w2, &full->markov_w2, &sh, err);
    const kern_weight *whole_src[] = { &full->fc, &full->hidden_norm, &full->final_norm,
                                       &full->markov_w1, &full->gate_w, &full->gate_b,
                                       &full->joint_w, &full->joint_b, &full->conf_w,
                                       &full->conf_b };
    kern_weight *whole_dst[] = { &m->fc, &m->hidden_norm, &m->final_norm, &m->markov_w1,
                                 &m->gate_w, &m->gate_b, &m->joint_w, &m->joint_b, &m->conf_w,
                                 &m->conf_b };
    for (size_t i = 0; i < sizeof(whole_src) / sizeof(whole_src[0]) && st == PD_OK; i++)
        st = plan_whole(&p, whole_dst[i], whole_src[i], err);
    /* replicated decoder layers: a one-rank shard of each is the whole layer */
    pd_tp_shard whole;
    pd_tp_shard_of(c, 1, 0, &whole);
    for (int l = 0; l < c->num_hidden_layers && st == PD_OK; l++)
        st = plan_layer(&p, &full->layers[l], &m->layers[l], &whole, c->head_dim, err);
    if (st == PD_OK)
        st = plan_copy(&p, full->be, be, &m->storage, err);
    free(p.s);
    if (st != PD_OK) {
        pd_dspark_free(m);
        return st;
    }
    *out = m;
    return PD_OK;
}

/* ---- per-rank context -------------------------------------------------------------------- */

struct pd_tp_rank {
    int rank, size;
    pd_comm *comm;                /* owned */
    kern_backend *be;             /* borrowed */
    pd_tp_shard shard[PD_TP_MAX_SIZE];   /* every rank's vocab slice, for the re-ranging */
    kern_buf *stage, *gathered;   /* [rows, slice], [size, rows, slice] */
    int cap_stage, cap_gathered;
    kern_buf *parts;              /* all-reduce: [size, n] partials */
    int cap_parts;
};

int pd_tp_accumulate(const pd_tp_rank *tp) { return tp == NULL || tp->rank == 0; }
int pd_tp_rank_index(const pd_tp_rank *tp) { return tp != NULL ? tp->rank : 0; }

pd_status pd_tp_all_reduce(pd_tp_rank *tp, float *x, size_t n, pd_err *err)
{
    if (tp == NULL || n == 0)
        return PD_OK;
    /* an all-gather of the partials, then every rank adds them in rank order on its backend:
     * the same bits whatever the message size (NCCL's all-reduce picks ring or tree and its
     * chunking by size, so a verify block and a decode step would round differently and bf16
     * speculative decoding would lose its equality with greedy decoding) */
    if (n > (size_t)INT_MAX / (size_t)tp->size)
        return pd_err_set(err, PD_ERR_INVALID, "tp all-reduce of %zu values", n);
    TRY(kern_buf_grow(tp->be, &tp->parts, &tp->cap_parts, (int)n * tp->size, sizeof(float), err));
    const float *parts = tp->parts->ptr;
    TRY(pd_comm_all_gather(tp->comm, x, tp->parts->ptr, n * sizeof(float), err));
    kern_binary_args add = { .op = KERN_BINARY_ADD, .a = parts, .ld_a = (int)n, .b = parts + n,
                             .ld_b = (int)n, .out = x, .ld_out = (int)n, .rows = 1, .cols = (int)n };
    TRY(kern_binary(tp->be, &add, err));
    for (int r = 2; r < tp->size; r++) {
        add.a = x;
        add.b = parts + (size_t)r * n;
        TRY(kern_binary(tp->be, &add, err));
    }
    return PD_OK;
}

pd_status pd_tp_gather_vocab(pd_tp_rank *tp, float *logits, int ld, int rows, pd_err *err)
{
    if (tp == NULL || rows <= 0)
        return PD_OK;
    const pd_tp_shard *me = &tp->shard[tp->rank];
    int w = me->vocab_slice;
    TRY(kern_buf_grow(tp->be, &tp->stage, &tp->cap_stage, rows, (size_t)w * sizeof(float), err));
    TRY(kern_buf_grow(tp->be, &tp->gathered, &tp->cap_gathered, rows * tp->size,
                      (size_t)w * sizeof(float), err));
    kern_copy_rows_args in = { .src = logits, .ld_src = ld, .dst = tp->stage->ptr, .ld_dst = w,
                               .rows = rows, .cols = me->n_vocab };
    TRY(kern_copy_rows(tp->be, &in, err));
    size_t bytes = (size_t)rows * w * sizeof(float);
    TRY(pd_comm_all_gather(tp->comm, tp->stage->ptr, tp->gathered->ptr, bytes, err));
    for (int r = 0; r < tp->size; r++) {
        const pd_tp_shard *s = &tp->shard[r];
        kern_copy_rows_args back = { .src = (const float *)tp->gathered->ptr + (size_t)r * rows * w,
                                     .ld_src = w, .dst = logits + s->vocab0, .ld_dst = ld,
                                     .rows = rows, .cols = s->n_vocab };
        TRY(kern_copy_rows(tp->be, &back, err));
    }
    return PD_OK;
}

static void rank_ctx_cleanup(pd_tp_rank *tp)
{
    pd_comm_destroy(tp->comm);
    kern_buf_free(tp->stage);
    kern_buf_free(tp->gathered);
    kern_buf_free(tp->parts);
    tp->comm = NULL;
    tp->stage = tp->gathered = tp->parts = NULL;
}

/* ---- the group --------------------------------------------------------------------------- */

typedef struct {
    pd_tp_group *g;
    int rank;
    kern_backend *be;             /* rank 0: the target's (borrowed); else owned */
    pd_qwen3_model *tm;           /* owned shards */
    pd_dspark_model *dm;
    pd_kv_pool *tpool, *dpool;    /* workers only (rank 0's are the engine's) */
    pd_target *target;            /* workers: owned; rank 0: the engine's */
    pd_draft *draft;
    pd_tp_rank ctx;
    kern_buf *aux;                /* workers: DRAFT_EXTEND rows from rank 0 */
    int cap_aux;
    pthread_t th;
    int started;
    pd_status st;                 /* the last command's result, and its message */
    pd_err err;
} tp_rank;

struct pd_tp_group {
    int n;
    tp_rank *ranks;               /* [n] */
    pd_comm_local_group *lg;      /* host backends: ranks are threads sharing this group */
    int gpu;                      /* cuda: rank r on its own device, NCCL between them */
    pthread_mutex_t mu;
    pthread_cond_t cv_cmd, cv_done;
    const pd_tp_cmd *cmd;
    unsigned long seq;            /* bumps with every command */
    int n_done;
    int quit;
    int broken;
    int debug_fail_rank, debug_fail_cmd;
    int n_pages, draft_n_pages;   /* every rank's pools */
    char broken_msg[sizeof(((pd_err *)0)->msg) + 32];
};

static pd_status rank_exec(tp_rank *rs, const pd_tp_cmd *c, unsigned long seq, pd_err *err)
{
    int me = rs->rank;
    if (rs->g->debug_fail_rank == me + 1 && seq == (unsigned long)rs->g->debug_fail_cmd)
        return pd_err_set(err, PD_ERR_INTERNAL, "injected failure at command %lu", seq);
    if (me > 0)
        rs->be->batch_invariant = c->batch_invariant;
    switch (c->op) {
    case PD_TP_TARGET_FORWARD:
        return pd_target_forward(rs->target, c->b, c->rows, c->n_rows, err);
    case PD_TP_DRAFT_EXTEND: {
        float *aux = (float *)c->aux;
        size_t row = (size_t)c->ld_aux * sizeof(float);
        if (me > 0) {
            TRY(kern_buf_grow(rs->be, &rs->aux, &rs->cap_aux, c->b->n_tok, row, err));
            aux = rs->aux->ptr;
        }
        TRY(pd_comm_broadcast(rs->ctx.comm, aux, (size_t)c->b->n_tok * row, 0, err));
        return pd_draft_extend(rs->draft, aux, c->ld_aux, c->b, err);
    }
    case PD_TP_DRAFT_BLOCK:
        return pd_draft_block(rs->draft, c->n_req, c->anchor, c->start, c->seqs, err);
    case PD_TP_MARKOV_STEP:
        return pd_draft_markov_step(rs->draft, c->k, c->prev, me == 0 ? c->conf_out : NULL, err);
    case PD_TP_KV_COPY:
        if (me == 0)
            return PD_OK;
        return pd_kv_pair_copy(rs->tpool, c->tseq, c->n_tpages, rs->dpool, c->dseq, c->n_dpages, c->host[me],
                               c->to_host, err);
    }
    return pd_err_set(err, PD_ERR_INTERNAL, "tp command %d unknown", (int)c->op);
}

static void *worker_main(void *p)
{
    tp_rank *rs = p;
    pd_tp_group *g = rs->g;
    unsigned long seen = 0;
    pd_err berr;
    if (kern_backend_bind_thread(rs->be, NULL, &berr) != PD_OK)   /* this rank's GPU */
        PD_LOG_ERROR("tp", "rank %d: %s", rs->rank, berr.msg);
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while (g->seq == seen && !g->quit)
            pthread_cond_wait(&g->cv_cmd, &g->mu);
        if (g->quit)
            break;
        seen = g->seq;
        const pd_tp_cmd *c = g->cmd;
        pthread_mutex_unlock(&g->mu);
        pd_err e = { 0 };
        pd_status st = rank_exec(rs, c, seen, &e);
        if (st != PD_OK)
            pd_comm_abort(rs->ctx.comm, e.msg);   /* nobody waits for this rank in vain */
        pthread_mutex_lock(&g->mu);
        rs->st = st;
        rs->err = e;
        g->n_done++;
        pthread_cond_signal(&g->cv_done);
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

/* Rank r's backend: rank 0 uses the target's; a host worker gets its own handle; a GPU worker
 * its own device, the r-th after rank 0's (one GPU per rank). */
static pd_status rank_backend(pd_tp_group *g, const pd_tp_group_config *cfg, int r, int dev0, int n_dev,
                              int *device, pd_err *err)
{
    tp_rank *rs = &g->ranks[r];
    *device = dev0;
    if (r == 0) {
        rs->be = cfg->target->be;
        return PD_OK;
    }
    kern_backend_config bc = { .name = cfg->target->be->ops->name,
                               .f32 = cfg->target->be->weight_dtype == KERN_DTYPE_F32,
                               .act_bf16 = cfg->target->be->act_bf16 };
    if (g->gpu)
        bc.device = *device = (dev0 + r) % n_dev;
    return kern_backend_create(&bc, &rs->be, err);
}

/* The rank's context and shards. */
static pd_status rank_build(pd_tp_group *g, const pd_tp_group_config *cfg, int r, pd_err *err)
{
    tp_rank *rs = &g->ranks[r];
    rs->g = g;
    rs->rank = r;
    rs->ctx.rank = r;
    rs->ctx.size = g->n;
    for (int q = 0; q < g->n; q++)
        pd_tp_shard_of(&cfg->target->cfg, g->n, q, &rs->ctx.shard[q]);
    if (!g->gpu)
        TRY(pd_comm_local_create(g->lg, r, &rs->ctx.comm, err));   /* (NCCL: made for all at once) */
    rs->ctx.be = rs->be;   /* created by rank_backend */
    TRY(pd_tp_qwen3_shard(cfg->target, rs->be, g->n, r, &rs->tm, err));
    if (cfg->draft != NULL)
        TRY(pd_tp_dspark_shard(cfg->draft, cfg->target, rs->tm, rs->be, g->n, r, &rs->dm, err));
    return PD_OK;
}

/* The layout of a rank's pool of n pages for the model config c (its target or draft shard) */
static pd_kv_layout rank_layout(const tp_rank *rs, const pd_qwen3_config *c, int page_size, int n)
{
    return (pd_kv_layout){ .n_layers = c->num_hidden_layers, .n_kv_heads = c->num_key_value_heads,
                           .head_dim = c->head_dim, .page_size = page_size, .n_pages = n,
                           .dtype = rs->be->kv_dtype };
}

/* The pages kv_mem_fraction gives every rank's pools, now that the shards are on the devices */
static pd_status group_pages(pd_tp_group *g, const pd_tp_group_config *cfg, pd_err *err)
{
    kern_backend *be[PD_TP_MAX_SIZE];
    double per[PD_TP_MAX_SIZE];
    for (int r = 0; r < g->n; r++) {
        const tp_rank *rs = &g->ranks[r];
        pd_kv_layout one = rank_layout(rs, &rs->tm->cfg, cfg->page_size, 1);
        be[r] = rs->be;
        per[r] = (double)pd_kv_pool_bytes(&one);
        if (rs->dm != NULL) {
            one = rank_layout(rs, &rs->dm->cfg.base, cfg->page_size, 1);
            per[r] += (double)pd_kv_pool_bytes(&one);
        }
    }
    return pd_kv_pages_from_memory(cfg->kv_mem_fraction, g->n, be, per, cfg->page_size,
                                   "the tp ranks' pools", &g->n_pages, err);
}

/* A worker's pools and runners, and its thread. */
static pd_status rank_start(pd_tp_group *g, const pd_tp_group_config *cfg, int r, pd_err *err)
{
    tp_rank *rs = &g->ranks[r];
    TRY(kern_backend_bind_thread(rs->be, NULL, err));
    pd_kv_layout tl = rank_layout(rs, &rs->tm->cfg, cfg->page_size, g->n_pages);
    TRY(pd_kv_pool_create(rs->be, &tl, &rs->tpool, err));
    TRY(pd_target_create(rs->tm, rs->tpool, cfg->taps, cfg->n_taps, &rs->target, err));
    pd_target_set_tp(rs->target, &rs->ctx);
    /* workers run rank 0's batches as given, eagerly: a worker graph could not hold the
     * collectives in step with rank 0 */
    pd_target_set_graphs(rs->target, PD_GRAPHS_OFF);
    if (rs->dm != NULL) {
        pd_kv_layout dl = rank_layout(rs, &rs->dm->cfg.base, cfg->page_size, g->draft_n_pages);
        TRY(pd_kv_pool_create(rs->be, &dl, &rs->dpool, err));
        TRY(pd_draft_create(rs->dm, rs->dpool, &rs->draft, err));
        pd_draft_set_tp(rs->draft, &rs->ctx);
        pd_draft_set_graphs(rs->draft, PD_GRAPHS_OFF);
    }
    if (pthread_create(&rs->th, NULL, worker_main, rs) != 0)
        return pd_err_set(err, PD_ERR_INTERNAL, "tp: cannot start the thread of rank %d", r);
    rs->started = 1;
    return PD_OK;
}

pd_status pd_tp_group_create(const pd_tp_group_config *cfg, pd_tp_group **out, pd_err *err)
{
    if (cfg->target == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "tp group: no target model");
    TRY(pd_tp_check(&cfg->target->cfg, cfg->size, err));
    if (cfg->size < 2)
        return pd_err_set(err, PD_ERR_INVALID, "tp group of %d ranks: use no group for tp 1",
                          cfg->size);
    kern_backend *be0 = cfg->target->be;
    int gpu = !be0->is_host, dev0 = 0, n_dev = 0;
    if (gpu) {
        /* one GPU per rank, NCCL between them (the local communicator adds on the host) */
        if (strcmp(be0->ops->name, "cuda") != 0 || !pd_comm_nccl_available())
            return pd_err_set(err, PD_ERR_UNSUPPORTED, "tp %d on backend %s needs CUDA with NCCL "
                              "(one GPU per rank)", cfg->size, be0->ops->name);
        TRY(kern_backend_bind_thread(be0, &dev0, err));
        n_dev = kern_backend_device_count(be0->ops->name);
        if (n_dev < cfg->size)
            return pd_err_set(err, PD_ERR_INVALID, "tp %d on cuda needs %d GPUs (one per rank); "
                              "%d visible", cfg->size, cfg->size, n_dev);
    }
    pd_tp_group *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "tp group");
    g->n = cfg->size;
    g->gpu = gpu;
    g->debug_fail_rank = cfg->debug_fail_rank;
    g->debug_fail_cmd = cfg->debug_fail_cmd;
    pd_status st = PD_OK;
    g->ranks = calloc((size_t)g->n, sizeof(*g->ranks));
    if (g->ranks == NULL) {
        free(g);
        return pd_err_set(err, PD_ERR_NOMEM, "tp group of %d ranks", cfg->size);
    }
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv_cmd, NULL);
    pthread_cond_init(&g->cv_done, NULL);
    int devs[PD_TP_MAX_SIZE];
    for (int r = 0; r < g->n && st == PD_OK; r++)
        st = rank_backend(g, cfg, r, dev0, n_dev, &devs[r], err);
    if (st == PD_OK && !gpu) {
        pd_comm_local_opts lo = { .timeout_ms = cfg->timeout_ms };
        st = pd_comm_local_group_create(g->n, &lo, &g->lg, err);
    } else if (st == PD_OK) {
        pd_comm_nccl_opts no[PD_TP_MAX_SIZE];
        pd_comm *comms[PD_TP_MAX_SIZE];
        for (int r = 0; r < g->n; r++)
            no[r] = (pd_comm_nccl_opts){ .device = devs[r], .stream = kern_backend_stream(g->ranks[r].be),
                                         .timeout_ms = cfg->timeout_ms };
        st = pd_comm_nccl_create_all(g->n, no, comms, err);
        for (int r = 0; r < g->n && st == PD_OK; r++)
            g->ranks[r].ctx.comm = comms[r];
    }
    for (int r = 0; r < g->n && st == PD_OK; r++)
        st = rank_build(g, cfg, r, err);
    g->n_pages = cfg->n_pages;
    if (st == PD_OK && g->n_pages <= 0 && cfg->kv_mem_fraction > 0.0)
        st = group_pages(g, cfg, err);
    else if (st == PD_OK && g->n_pages <= 0)
        st = pd_err_set(err, PD_ERR_INVALID, "tp group: pools of %d pages", g->n_pages);
    g->draft_n_pages = cfg->draft_n_pages > 0 ? cfg->draft_n_pages : g->n_pages;
    for (int r = 1; r < g->n && st == PD_OK; r++)
        st = rank_start(g, cfg, r, err);
    if (gpu) {
        pd_err berr;   /* the engine thread goes on with rank 0's device */
        pd_status bs = kern_backend_bind_thread(be0, NULL, &berr);
        if (st == PD_OK && bs != PD_OK) {
            *err = berr;
            st = bs;
        }
    }
    if (st != PD_OK) {
        pd_tp_group_destroy(g);
        return st;
    }
    PD_LOG_INFO("tp", "tensor-parallel group of %d ranks (%s backend, %s)", g->n, be0->ops->name,
                gpu ? "NCCL, one GPU per rank" : "local communicator");
    *out = g;
    return PD_OK;
}

void pd_tp_group_destroy(pd_tp_group *g)
{
    if (g == NULL)
        return;
    pthread_mutex_lock(&g->mu);
    g->quit = 1;
    pthread_cond_broadcast(&g->cv_cmd);
    pthread_mutex_unlock(&g->mu);
    for (int r = 0; r < g->n; r++) {
        tp_rank *rs = &g->ranks[r];
        if (rs->started)
            pthread_join(rs->th, NULL);
        if (rs->be != NULL)
            (void)kern_backend_bind_thread(rs->be, NULL, NULL);   /* its GPU, to free on it */
        if (r > 0) {
            pd_draft_destroy(rs->draft);
            pd_target_destroy(rs->target);
            pd_kv_pool_destroy(rs->dpool);
            pd_kv_pool_destroy(rs->tpool);
        }
        kern_buf_free(rs->aux);
        rank_ctx_cleanup(&rs->ctx);
        pd_dspark_free(rs->dm);
        pd_qwen3_free(rs->tm);
        if (r > 0)
            kern_backend_destroy(rs->be);
    }
    if (g->n > 0 && g->ranks[0].be != NULL)
        (void)kern_backend_bind_thread(g->ranks[0].be, NULL, NULL);
    pd_comm_local_group_destroy(g->lg);
    pthread_cond_destroy(&g->cv_done);
    pthread_cond_destroy(&g->cv_cmd);
    pthread_mutex_destroy(&g->mu);
    free(g->ranks);
    free(g);
}

const pd_qwen3_model *pd_tp_group_target(const pd_tp_group *g) { return g->ranks[0].tm; }
const pd_dspark_model *pd_tp_group_draft(const pd_tp_group *g) { return g->ranks[0].dm; }
int pd_tp_group_size(const pd_tp_group *g) { return g->n; }

void pd_tp_group_pages(const pd_tp_group *g, int *n_pages, int *draft_n_pages)
{
    *n_pages = g->n_pages;
    *draft_n_pages = g->draft_n_pages;
}

size_t pd_tp_group_kv_bytes(const pd_tp_group *g, int rank, int n_t, int n_d)
{
    return pd_kv_pair_bytes(g->ranks[rank].tpool, n_t, g->ranks[rank].dpool, n_d);
}

void pd_tp_group_attach(pd_tp_group *g, pd_target *target, pd_draft *draft)
{
    tp_rank *r0 = &g->ranks[0];
    r0->target = target;
    r0->draft = draft;
    pd_target_set_tp(target, &r0->ctx);
    if (draft != NULL)
        pd_draft_set_tp(draft, &r0->ctx);
}

pd_status pd_tp_group_run(pd_tp_group *g, const pd_tp_cmd *c, pd_err *err)
{
    if (g->broken)
        return pd_err_set(err, PD_ERR_PEER, "tp group broken by an earlier failure: %s",
                          g->broken_msg);
    pthread_mutex_lock(&g->mu);
    g->cmd = c;
    g->n_done = 0;
    g->seq++;
    pthread_cond_broadcast(&g->cv_cmd);
    pthread_mutex_unlock(&g->mu);

    tp_rank *r0 = &g->ranks[0];
    r0->err = (pd_err){ 0 };
    r0->st = rank_exec(r0, c, g->seq, &r0->err);
    if (r0->st != PD_OK)
        pd_comm_abort(r0->ctx.comm, r0->err.msg);

    pthread_mutex_lock(&g->mu);
    while (g->n_done < g->n - 1)
        pthread_cond_wait(&g->cv_done, &g->mu);
    g->cmd = NULL;
    pthread_mutex_unlock(&g->mu);

    /* the cause is the first rank that failed by itself; the others only saw the abort */
    int cause = -1;
    for (int r = 0; r < g->n && cause < 0; r++)
        if (g->ranks[r].st != PD_OK && g->ranks[r].st != PD_ERR_PEER)
            cause = r;
    for (int r = 0; r < g->n && cause < 0; r++)
        if (g->ranks[r].st != PD_OK)
            cause = r;
    if (cause < 0)
        return PD_OK;
    const tp_rank *rc = &g->ranks[cause];
    g->broken = 1;
    snprintf(g->broken_msg, sizeof(g->broken_msg), "rank %d: %s", cause, rc->err.msg);
    PD_LOG_ERROR("tp", "tp group of %d ranks failed: %s", g->n, g->broken_msg);
    return pd_err_set(err, rc->st, "tp %s", g->broken_msg);
}
