/* kern_ops.c - the checked wrappers: every shape and dtype rule of the ops, in one place.
 * Owns: argument validation, then dispatch to be->ops->X.
 * Not here: math. A failed check is a caller bug or bad input the caller forwarded, so it
 *   returns PD_ERR_INVALID with the op and the offending value instead of asserting.
 * Threading: as the backend. */
#include "kern_backend.h"

#define CHECK(cond, ...) \
    do { if (!(cond)) return pd_err_set(err, PD_ERR_INVALID, __VA_ARGS__); } while (0)

static int weight_ok(const kern_weight *w)
{
    return w->data != NULL && w->rows > 0 && w->cols > 0 &&
           (w->dtype == KERN_DTYPE_F32 || w->dtype == KERN_DTYPE_BF16 || w->dtype == KERN_DTYPE_F16);
}

pd_status kern_buf_alloc(kern_backend *be, size_t bytes, kern_buf **out, pd_err *err)
{
    CHECK(be != NULL && out != NULL, "buf_alloc: NULL backend or out");
    return be->ops->buf_alloc(be, bytes == 0 ? 1 : bytes, out, err);
}

void kern_buf_free(kern_buf *buf)
{
    if (buf != NULL)
        buf->be->ops->buf_free(buf->be, buf);
}

pd_status kern_buf_grow(kern_backend *be, kern_buf **buf, int *cap, int need, size_t per, pd_err *err)
{
    if (need <= *cap && *buf != NULL)
        return PD_OK;
    int c = *cap > 0 ? *cap : 16;
    while (c < need)
        c *= 2;
    kern_buf *nb = NULL;
    pd_status st = kern_buf_alloc(be, per * (size_t)c, &nb, err);
    if (st != PD_OK)
        return st;
    kern_buf_free(*buf);
    *buf = nb;
    *cap = c;
    return PD_OK;
}

pd_status kern_upload(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err)
{
    if (n == 0)
        return PD_OK;
    CHECK(dst != NULL && src != NULL, "upload: NULL pointer");
    return be->ops->upload(be, dst, src, n, err);
}

pd_status kern_download(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err)
{
    if (n == 0)
        return PD_OK;
    CHECK(dst != NULL && src != NULL, "download: NULL pointer");
    return be->ops->download(be, dst, src, n, err);
}

static pd_status spans_check(const kern_copy_span *spans, int n, const char *op, pd_err *err)
{
    CHECK(n >= 0 && (n == 0 || spans != NULL), "%s: %d spans", op, n);
    for (int i = 0; i < n; i++)
        CHECK(spans[i].n == 0 || (spans[i].dst != NULL && spans[i].src != NULL),
              "%s: span %d has a NULL pointer", op, i);
    return PD_OK;
}

pd_status kern_download_spans(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err)
{
    pd_status st = spans_check(spans, n, "download_spans", err);
    return st != PD_OK || n == 0 ? st : be->ops->download_spans(be, spans, n, err);
}

pd_status kern_upload_spans(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err)
{
    pd_status st = spans_check(spans, n, "upload_spans", err);
    return st != PD_OK || n == 0 ? st : be->ops->upload_spans(be, spans, n, err);
}

pd_status kern_memset0(kern_backend *be, void *dst, size_t n, pd_err *err)
{
    if (n == 0)
        return PD_OK;
    CHECK(dst != NULL, "memset0: NULL pointer");
    return be->ops->memset0(be, dst, n, err);
}

pd_status kern_host_alloc(kern_backend *be, size_t bytes, void **out, pd_err *err)
{
    CHECK(out != NULL, "host_alloc: NULL result");
    *out = NULL;
    return be->ops->host_alloc(be, bytes > 0 ? bytes : 1, out, err);
}

void kern_host_free(kern_backend *be, void *p)
{
    if (p != NULL)
        be->ops->host_free(be, p);
}

pd_status kern_upload_convert(kern_backend *be, void *dst, kern_dtype dst_dtype, const void *src,
                              kern_dtype src_dtype, size_t n, pd_err *err)
{
    if (n == 0)
        return PD_OK;
    CHECK(dst != NULL && src != NULL, "upload_convert: NULL pointer");
    CHECK((dst_dtype == KERN_DTYPE_I32) == (src_dtype == KERN_DTYPE_I32),
          "upload_convert: %s -> %s", kern_dtype_name(src_dtype), kern_dtype_name(dst_dtype));
    return be->ops->upload_convert(be, dst, dst_dtype, src, src_dtype, n, err);
}

pd_status kern_sync(kern_backend *be, pd_err *err)
{
    return be->ops->sync(be, err);
}

pd_status kern_mem_info(kern_backend *be, size_t *free_bytes, size_t *total_bytes, pd_err *err)
{
    *free_bytes = *total_bytes = 0;
    return be->ops->mem_info(be, free_bytes, total_bytes, err);
}

pd_status kern_graph_begin(kern_backend *be, pd_err *err) { return be->ops->graph_begin(be, err); }

pd_status kern_graph_end(kern_backend *be, void **out, pd_err *err)
{
    *out = NULL;
    return be->ops->graph_end(be, out, err);
}

pd_status kern_graph_launch(kern_backend *be, void *graph, pd_err *err)
{
    if (graph == NULL)
        return pd_err_set(err, PD_ERR_INTERNAL, "graph launch: no graph");
    return be->ops->graph_launch(be, graph, err);
}

void kern_graph_free(kern_backend *be, void *graph)
{
    if (graph != NULL)
        be->ops->graph_free(be, graph);
}

pd_status kern_embed(kern_backend *be, const kern_embed_args *a, pd_err *err)
{
    if (a->n == 0)
        return PD_OK;
    CHECK(a->n > 0 && a->ids != NULL && a->out != NULL, "embed: n %d", a->n);
    CHECK(weight_ok(&a->table), "embed: bad table");
    CHECK(a->ld_out >= a->table.cols, "embed: ld_out %d < dim %lld", a->ld_out,
          (long long)a->table.cols);
    return be->ops->embed(be, a, err);
}

pd_status kern_rmsnorm(kern_backend *be, const kern_rmsnorm_args *a, pd_err *err)
{
    if (a->rows == 0)
        return PD_OK;
    CHECK(a->rows > 0 && a->dim > 0, "rmsnorm: rows %d dim %d", a->rows, a->dim);
    CHECK(a->x != NULL && a->out != NULL, "rmsnorm: NULL x/out");
    CHECK(a->ld_x >= a->dim && a->ld_out >= a->dim, "rmsnorm: ld_x %d ld_out %d < dim %d",
          a->ld_x, a->ld_out, a->dim);
    CHECK(weight_ok(&a->w) && a->w.rows * a->w.cols == a->dim, "rmsnorm: weight size %lld != dim %d",
          (long long)(a->w.rows * a->w.cols), a->dim);
    CHECK(a->sum_out == NULL || a->residual != NULL, "rmsnorm: sum_out without residual");
    CHECK(a->eps > 0.0f, "rmsnorm: eps %g", (double)a->eps);
    return be->ops->rmsnorm(be, a, err);
}

pd_status kern_matmul(kern_backend *be, const kern_matmul_args *a, pd_err *err)
{
    if (a->m == 0)
        return PD_OK;
    CHECK(a->m > 0 && a->n > 0 && a->k > 0, "matmul: m %d n %d k %d", a->m, a->n, a->k);
    CHECK(a->x != NULL && a->y != NULL, "matmul: NULL x/y");
    CHECK(weight_ok(&a->w), "matmul: bad weight");
    CHECK(a->w.rows == a->n && a->w.cols == a->k, "matmul: weight [%lld, %lld] != [n %d, k %d]",
          (long long)a->w.rows, (long long)a->w.cols, a->n, a->k);
    CHECK(a->ld_x >= a->k && a->ld_y >= a->n, "matmul: ld_x %d (k %d) ld_y %d (n %d)", a->ld_x,
          a->k, a->ld_y, a->n);
    CHECK(a->bias.data == NULL || a->bias.rows * a->bias.cols == a->n, "matmul: bias size");
    return be->ops->matmul(be, a, err);
}

/* A rope scaling the backends know, with usable parameters (kern_rope.h) */
static int rope_scaling_ok(const kern_rope_scaling *sc)
{
    if (sc->type == KERN_ROPE_DEFAULT)
        return 1;
    if ((sc->type != KERN_ROPE_LINEAR && sc->type != KERN_ROPE_YARN) || !(sc->factor >= 1.0f) || !isfinite(sc->factor))
        return 0;
    return sc->type == KERN_ROPE_LINEAR ||
           (sc->span > 0.0f && isfinite(sc->span) && isfinite(sc->low) && sc->attn > 0.0f && isfinite(sc->attn));
}

pd_status kern_rope(kern_backend *be, const kern_rope_args *a, pd_err *err)
{
    if (a->n_tok == 0)
        return PD_OK;
    CHECK(a->x != NULL && a->pos != NULL, "rope: NULL x/pos");
    CHECK(a->n_tok > 0 && a->n_heads > 0 && a->head_dim > 0 && a->head_dim % 2 == 0,
          "rope: n_tok %d n_heads %d head_dim %d", a->n_tok, a->n_heads, a->head_dim);
    CHECK(a->ld >= a->n_heads * a->head_dim, "rope: ld %d", a->ld);
    CHECK(a->theta > 0.0f, "rope: theta %g", (double)a->theta);
    CHECK(rope_scaling_ok(&a->scaling), "rope: scaling type %d factor %g span %g attn %g", a->scaling.type,
          (double)a->scaling.factor, (double)a->scaling.span, (double)a->scaling.attn);
    return be->ops->rope(be, a, err);
}

pd_status kern_unary(kern_backend *be, const kern_unary_args *a, pd_err *err)
{
    if (a->rows == 0)
        return PD_OK;
    CHECK(a->x != NULL && a->out != NULL && a->rows > 0 && a->cols > 0, "unary: bad view");
    CHECK(a->ld_x >= a->cols && a->ld_out >= a->cols, "unary: ld < cols");
    CHECK(a->op >= KERN_UNARY_SIGMOID && a->op <= KERN_UNARY_SILU, "unary: op %d", (int)a->op);
    return be->ops->unary(be, a, err);
}

pd_status kern_binary(kern_backend *be, const kern_binary_args *a, pd_err *err)
{
    if (a->rows == 0)
        return PD_OK;
    CHECK(a->a != NULL && a->b != NULL && a->out != NULL && a->rows > 0 && a->cols > 0,
          "binary: bad view");
    CHECK(a->ld_a >= a->cols && a->ld_b >= a->cols && a->ld_out >= a->cols, "binary: ld < cols");
    CHECK(a->op >= KERN_BINARY_ADD && a->op <= KERN_BINARY_SWIGLU, "binary: op %d", (int)a->op);
    return be->ops->binary(be, a, err);
}

pd_status kern_copy_rows(kern_backend *be, const kern_copy_rows_args *a, pd_err *err)
{
    if (a->rows == 0)
        return PD_OK;
    CHECK(a->src != NULL && a->dst != NULL && a->rows > 0 && a->cols > 0, "copy_rows: bad view");
    CHECK(a->ld_src >= a->cols && a->ld_dst >= a->cols, "copy_rows: ld < cols");
    return be->ops->copy_rows(be, a, err);
}

static pd_status kv_layer_check(const kern_kv_layer *kv, pd_err *err)
{
    CHECK(kv->k != NULL && kv->v != NULL, "kv: NULL pages");
    CHECK(kv->page_size > 0 && kv->n_kv_heads > 0 && kv->head_dim > 0,
          "kv: page_size %d n_kv_heads %d head_dim %d", kv->page_size, kv->n_kv_heads, kv->head_dim);
    CHECK(kv->dtype == KERN_DTYPE_F32 || kv->dtype == KERN_DTYPE_BF16 || kv->dtype == KERN_DTYPE_F16,
          "kv: dtype %s", kern_dtype_name(kv->dtype));
    return PD_OK;
}

pd_status kern_kv_store(kern_backend *be, const kern_kv_store_args *a, pd_err *err)
{
    if (a->n_tok == 0)
        return PD_OK;
    pd_status st = kv_layer_check(&a->kv, err);
    if (st != PD_OK)
        return st;
    CHECK(a->k != NULL && a->v != NULL && a->slot != NULL && a->n_tok > 0, "kv_store: bad args");
    CHECK(a->ld >= a->kv.n_kv_heads * a->kv.head_dim, "kv_store: ld %d", a->ld);
    return be->ops->kv_store(be, a, err);
}

static pd_status attn_check(const kern_attn_args *a, pd_err *err)
{
    pd_status st = kv_layer_check(&a->kv, err);
    if (st != PD_OK)
        return st;
    CHECK(a->q != NULL && a->out != NULL && a->tok_seq != NULL && a->tok_kv_len != NULL &&
              a->page_table != NULL, "attn: NULL pointer");
    CHECK(a->n_tok > 0 && a->n_heads > 0 && a->n_seq > 0 && a->pt_stride > 0,
          "attn: n_tok %d n_heads %d n_seq %d pt_stride %d", a->n_tok, a->n_heads, a->n_seq,
          a->pt_stride);
    CHECK(a->n_heads % a->kv.n_kv_heads == 0, "attn: n_heads %d not a multiple of n_kv_heads %d",
          a->n_heads, a->kv.n_kv_heads);
    CHECK(a->ld_q >= a->n_heads * a->kv.head_dim && a->ld_out >= a->n_heads * a->kv.head_dim,
          "attn: ld_q %d ld_out %d", a->ld_q, a->ld_out);
    CHECK(a->max_kv_len > 0 && a->max_kv_len <= a->pt_stride * a->kv.page_size,
          "attn: max_kv_len %d exceeds page table capacity %d", a->max_kv_len,
          a->pt_stride * a->kv.page_size);
    return PD_OK;
}

pd_status kern_attn(kern_backend *be, const kern_attn_args *a, pd_err *err)
{
    if (a->n_tok == 0)
        return PD_OK;
    pd_status st = attn_check(a, err);
    return st != PD_OK ? st : be->ops->attn(be, a, err);
}

pd_status kern_argmax(kern_backend *be, const kern_argmax_args *a, pd_err *err)
{
    if (a->rows == 0)
        return PD_OK;
    CHECK(a->x != NULL && a->out != NULL && a->rows > 0 && a->n > 0 && a->ld_x >= a->n,
          "argmax: bad view");
    return be->ops->argmax(be, a, err);
}

static pd_status linear_check(const kern_linear_args *a, pd_err *err)
{
    CHECK(a->m > 0 && a->k > 0, "linear: m %d k %d", a->m, a->k);
    CHECK(a->x != NULL && a->ld_x >= a->k, "linear: NULL x or ld_x %d < k %d", a->ld_x, a->k);
    CHECK(a->n_w >= 1 && a->n_w <= KERN_LINEAR_MAX_W, "linear: %d weights", a->n_w);
    CHECK(a->epilogue >= KERN_LINEAR_STORE && a->epilogue <= KERN_LINEAR_SWIGLU,
          "linear: epilogue %d", (int)a->epilogue);
    CHECK(a->epilogue != KERN_LINEAR_SWIGLU || a->n_w == 2,
          "linear: swiglu needs 2 weights (gate, up), got %d", a->n_w);
    if (a->norm.data != NULL) {
        CHECK(weight_ok(&a->norm) && a->norm.rows * a->norm.cols == a->k,
              "linear: norm weight size %lld != k %d", (long long)(a->norm.rows * a->norm.cols), a->k);
        CHECK(a->eps > 0.0f, "linear: eps %g", (double)a->eps);
    }
    for (int i = 0; i < a->n_w; i++) {
        const kern_weight *w = &a->w[i];
        CHECK(weight_ok(w), "linear: bad weight %d", i);
        CHECK(w->cols == a->k && w->rows <= (int64_t)1 << 30,
              "linear: weight %d is [%lld, %lld], k %d", i, (long long)w->rows, (long long)w->cols, a->k);
        if (a->epilogue == KERN_LINEAR_SWIGLU) {
            CHECK(w->rows == a->w[0].rows, "linear: swiglu gate %lld rows, up %lld",
                  (long long)a->w[0].rows, (long long)w->rows);
            continue;   /* y[0] only */
        }
        CHECK(a->y[i] != NULL && a->ld_y[i] >= w->rows, "linear: y[%d] NULL or ld_y %d < n %lld",
              i, a->ld_y[i], (long long)w->rows);
        CHECK((const float *)a->y[i] != a->x, "linear: y[%d] aliases x", i);
    }
    if (a->tee != NULL) {
        CHECK(a->n_w == 1 && a->epilogue != KERN_LINEAR_SWIGLU, "linear: tee with %d weights, epilogue %d",
              a->n_w, (int)a->epilogue);
        CHECK(a->ld_tee >= a->w[0].rows && a->tee != a->y[0] && (const float *)a->tee != a->x,
              "linear: tee aliasing x or y, or ld_tee %d < n %lld", a->ld_tee, (long long)a->w[0].rows);
    }
    if (a->epilogue == KERN_LINEAR_SWIGLU)
        CHECK(a->y[0] != NULL && a->ld_y[0] >= a->w[0].rows && (const float *)a->y[0] != a->x,
              "linear: swiglu y NULL, aliasing x or ld_y %d < n %lld", a->ld_y[0],
              (long long)a->w[0].rows);
    return PD_OK;
}

pd_status kern_linear(kern_backend *be, const kern_linear_args *a, pd_err *err)
{
    if (a->m == 0)
        return PD_OK;
    pd_status st = linear_check(a, err);
    return st != PD_OK ? st : be->ops->linear(be, a, err);
}

pd_status kern_mlp(kern_backend *be, const kern_mlp_args *a, pd_err *err)
{
    if (a->m == 0)
        return PD_OK;
    CHECK(a->epilogue == KERN_LINEAR_STORE || a->epilogue == KERN_LINEAR_ACCUMULATE,
          "mlp: epilogue %d", (int)a->epilogue);
    CHECK(a->down.rows == a->k && a->down.cols == a->gate.rows,
          "mlp: down is [%lld, %lld], want [%d, %lld]", (long long)a->down.rows,
          (long long)a->down.cols, a->k, (long long)a->gate.rows);
    CHECK(a->g != NULL && (const float *)a->g != a->x && a->g != a->y, "mlp: g NULL or aliasing x or y");
    kern_linear_args gu, dn;
    kern_mlp_split(a, &gu, &dn);
    pd_status st = linear_check(&gu, err);
    if (st == PD_OK)
        st = linear_check(&dn, err);
    return st != PD_OK ? st : be->ops->mlp(be, a, err);
}

static pd_status qk_post_check(const kern_qk_post_args *a, pd_err *err)
{
    CHECK(a->n_tok > 0 && a->n_heads >= 0 && a->n_kv_heads > 0 && a->head_dim > 0 &&
              a->head_dim % 2 == 0, "qk_post: n_tok %d heads %d/%d head_dim %d", a->n_tok,
          a->n_heads, a->n_kv_heads, a->head_dim);
    CHECK((a->q != NULL || a->n_heads == 0) && a->k != NULL && a->pos != NULL,
          "qk_post: NULL q/k/pos");
    CHECK(a->ld_q >= a->n_heads * a->head_dim && a->ld_kv >= a->n_kv_heads * a->head_dim,
          "qk_post: ld_q %d ld_kv %d", a->ld_q, a->ld_kv);
    CHECK(weight_ok(&a->q_norm) && a->q_norm.rows * a->q_norm.cols == a->head_dim &&
              weight_ok(&a->k_norm) && a->k_norm.rows * a->k_norm.cols == a->head_dim,
          "qk_post: q_norm/k_norm size != head_dim %d", a->head_dim);
    CHECK(a->eps > 0.0f && a->theta > 0.0f, "qk_post: eps %g theta %g", (double)a->eps,
          (double)a->theta);
    CHECK(rope_scaling_ok(&a->scaling), "qk_post: rope scaling type %d factor %g span %g attn %g",
          a->scaling.type, (double)a->scaling.factor, (double)a->scaling.span, (double)a->scaling.attn);
    if (a->kv.k != NULL) {
        pd_status st = kv_layer_check(&a->kv, err);
        if (st != PD_OK)
            return st;
        CHECK(a->v != NULL && a->slot != NULL, "qk_post: kv store without v or slot");
        CHECK(a->kv.n_kv_heads == a->n_kv_heads && a->kv.head_dim == a->head_dim,
              "qk_post: kv layer %d x %d heads, args %d x %d", a->kv.n_kv_heads, a->kv.head_dim,
              a->n_kv_heads, a->head_dim);
    }
    return PD_OK;
}

pd_status kern_qk_post(kern_backend *be, const kern_qk_post_args *a, pd_err *err)
{
    if (a->n_tok == 0)
        return PD_OK;
    pd_status st = qk_post_check(a, err);
    return st != PD_OK ? st : be->ops->qk_post(be, a, err);
}

static pd_status qkv_check(const kern_qkv_args *a, pd_err *err)
{
    const kern_linear_args *l = &a->lin;
    const kern_qk_post_args *p = &a->post;
    CHECK(l->m == p->n_tok, "qkv: %d rows, %d tokens", l->m, p->n_tok);
    CHECK(l->epilogue == KERN_LINEAR_STORE && l->tee == NULL, "qkv: epilogue %d or a tee",
          (int)l->epilogue);
    int q = p->n_heads > 0;
    CHECK(l->n_w == 2 + q, "qkv: %d weights for %d q heads", l->n_w, p->n_heads);
    CHECK((!q || (l->y[0] == p->q && l->ld_y[0] == p->ld_q)) && l->y[q] == p->k &&
              (const float *)l->y[q + 1] == p->v && l->ld_y[q] == p->ld_kv && l->ld_y[q + 1] == p->ld_kv,
          "qkv: the linear's outputs are not qk_post's q, k, v");
    pd_status st = linear_check(l, err);
    return st != PD_OK ? st : qk_post_check(p, err);
}

pd_status kern_qkv(kern_backend *be, const kern_qkv_args *a, pd_err *err)
{
    if (a->lin.m == 0 && a->post.n_tok == 0)
        return PD_OK;
    pd_status st = qkv_check(a, err);
    return st != PD_OK ? st : be->ops->qkv(be, a, err);
}

/* spans [p, p + n) and [q, q + m) of floats overlap */
static int spans_overlap(const float *p, size_t n, const float *q, size_t m)
{
    return p < q + m && q < p + n;
}

pd_status kern_attn_block(kern_backend *be, const kern_attn_block_args *a, pd_err *err)
{
    const kern_qk_post_args *p = &a->qkv.post;
    const kern_attn_args *at = &a->attn;
    const kern_linear_args *o = &a->o;
    if (a->qkv.lin.m == 0 && p->n_tok == 0 && at->n_tok == 0 && o->m == 0)
        return PD_OK;
    pd_status st = qkv_check(&a->qkv, err);
    if (st == PD_OK)
        st = attn_check(at, err);
    if (st == PD_OK)
        st = linear_check(o, err);
    if (st != PD_OK)
        return st;
    CHECK(at->n_tok == p->n_tok && o->m == p->n_tok, "attn_block: %d / %d / %d tokens", p->n_tok,
          at->n_tok, o->m);
    CHECK(p->n_heads == at->n_heads && at->q == p->q && at->ld_q == p->ld_q,
          "attn_block: the attention's q is not qk_post's");
    CHECK(p->kv.k != NULL && p->kv.k == at->kv.k && p->kv.v == at->kv.v &&
              p->kv.dtype == at->kv.dtype && p->kv.page_size == at->kv.page_size,
          "attn_block: qk_post does not store into the attention's cache");
    CHECK(o->n_w == 1 && o->norm.data == NULL && o->epilogue != KERN_LINEAR_SWIGLU &&
              o->x == at->out && o->ld_x == at->ld_out && o->k == at->n_heads * at->kv.head_dim,
          "attn_block: o is not one weight on the attention output");
    size_t n = (size_t)p->n_tok, ny = (n - 1) * o->ld_y[0] + (size_t)o->w[0].rows;
    size_t nkv = (n - 1) * p->ld_kv + (size_t)p->n_kv_heads * p->head_dim;
    CHECK(!spans_overlap(o->y[0], ny, p->q, (n - 1) * p->ld_q + (size_t)p->n_heads * p->head_dim) &&
              !spans_overlap(o->y[0], ny, p->k, nkv) && !spans_overlap(o->y[0], ny, p->v, nkv) &&
              !spans_overlap(o->y[0], ny, at->out, (n - 1) * at->ld_out + (size_t)o->k),
          "attn_block: o.y overlaps q, k, v or the attention output");
    return be->ops->attn_block(be, a, err);
}

pd_status kern_markov_step(kern_backend *be, const kern_markov_step_args *a, pd_err *err)
{
    if (a->n == 0)
        return PD_OK;
    CHECK(a->n > 0 && a->base != NULL && a->rows != NULL && a->vec != NULL && a->step != NULL,
          "markov_step: n %d or NULL pointer", a->n);
    CHECK(weight_ok(&a->w2), "markov_step: bad w2");
    CHECK(a->ld_base >= a->w2.rows && a->ld_step >= a->w2.rows && a->ld_vec >= a->w2.cols,
          "markov_step: ld_base %d ld_step %d (V %lld) ld_vec %d (R %lld)", a->ld_base, a->ld_step,
          (long long)a->w2.rows, a->ld_vec, (long long)a->w2.cols);
    CHECK(a->w2.rows <= (int64_t)1 << 30, "markov_step: V %lld", (long long)a->w2.rows);
    return be->ops->markov_step(be, a, err);
}

pd_status kern_markov_chain(kern_backend *be, const kern_markov_chain_args *a, pd_err *err)
{
    if (a->n == 0)
        return PD_OK;
    CHECK(a->n > 0 && a->steps > 0 && a->base != NULL && a->rows != NULL && a->prev != NULL,
          "markov_chain: n %d steps %d or NULL pointer", a->n, a->steps);
    CHECK(weight_ok(&a->w1) && weight_ok(&a->w2), "markov_chain: bad w1/w2");
    CHECK(a->w1.rows == a->w2.rows && a->w1.cols == a->w2.cols,
          "markov_chain: w1 [%lld, %lld] and w2 [%lld, %lld] differ", (long long)a->w1.rows,
          (long long)a->w1.cols, (long long)a->w2.rows, (long long)a->w2.cols);
    CHECK(a->ld_base >= a->w2.rows && a->ld_rows >= a->n && a->ld_prev >= a->n,
          "markov_chain: ld_base %d (V %lld) ld_rows %d ld_prev %d (n %d)", a->ld_base,
          (long long)a->w2.rows, a->ld_rows, a->ld_prev, a->n);
    CHECK(a->w2.rows <= (int64_t)1 << 30, "markov_chain: V %lld", (long long)a->w2.rows);
    if (a->head != KERN_MARKOV_VANILLA) {
        CHECK(a->head == KERN_MARKOV_GATED || a->head == KERN_MARKOV_RNN, "markov_chain: head %d",
              (int)a->head);
        int64_t R = a->w2.cols, J = a->head == KERN_MARKOV_GATED ? R : 3 * R,
                in_e = a->head == KERN_MARKOV_GATED ? R : 2 * R;   /* columns besides h */
        CHECK(weight_ok(&a->head_w) && a->head_w.rows == J && a->head_w.cols > in_e,
              "markov_chain: head_w [%lld, %lld] for R %lld", (long long)a->head_w.rows,
              (long long)a->head_w.cols, (long long)R);
        CHECK(weight_ok(&a->head_b) && a->head_b.rows * a->head_b.cols == J,
              "markov_chain: head_b of %lld values, head_w has %lld rows",
              (long long)(a->head_b.rows * a->head_b.cols), (long long)J);
        CHECK(a->hidden != NULL && a->ld_hidden >= a->head_w.cols - in_e && a->scratch != NULL,
              "markov_chain: hidden %p ld_hidden %d (H %lld) scratch %p", (const void *)a->hidden,
              a->ld_hidden, (long long)(a->head_w.cols - in_e), (void *)a->scratch);
    }
    return be->ops->markov_chain(be, a, err);
}

/* The vec of step k of a gated or rnn head for n rows by the step-by-step ops, in the order of
 * pd_dspark.c's Markov step (scratch: e | in | out | state | tmp | gate, e = w1[prev] in place);
 * *vec = the tmp rows. */
static pd_status markov_head_vec(kern_backend *be, const kern_markov_chain_args *a, int k, float *scr,
                                 float **vec, pd_err *err)
{
    int n = a->n, R = (int)a->w2.cols, K = (int)a->head_w.cols, J = (int)a->head_w.rows;
    float *e = scr, *in = e + (size_t)n * R, *out = in + (size_t)n * K, *state = out + (size_t)n * J;
    float *tmp = state + (size_t)n * R, *gate = tmp + (size_t)n * R;
    const int32_t *rows = a->rows + (size_t)k * a->ld_rows;
    int gated = a->head == KERN_MARKOV_GATED, H = K - (gated ? R : 2 * R);
    /* [h ; e] (gated) or [s ; e ; h] (rnn) */
    kern_copy_rows_args ch = { .src = a->hidden, .ld_src = a->ld_hidden, .idx = rows,
                               .dst = in + (gated ? 0 : 2 * R), .ld_dst = K, .rows = n, .cols = H };
    kern_copy_rows_args ce = { .src = e, .ld_src = R, .dst = in + (gated ? H : R), .ld_dst = K, .rows = n,
                               .cols = R };
    kern_copy_rows_args cs = { .src = state, .ld_src = R, .dst = in, .ld_dst = K, .rows = n, .cols = R };
    kern_matmul_args mm = { .x = in, .ld_x = K, .w = a->head_w, .bias = a->head_b,
                            .y = gated ? gate : out, .ld_y = J, .m = n, .n = J, .k = K };
    pd_status st = PD_OK;
    if (!gated && k == 0)
        st = kern_memset0(be, state, (size_t)n * R * sizeof(float), err);
    if (st == PD_OK && gated) {
        st = kern_copy_rows(be, &ch, err);
        if (st == PD_OK)
            st = kern_copy_rows(be, &ce, err);
    } else if (st == PD_OK) {
        st = kern_copy_rows(be, &cs, err);
        if (st == PD_OK)
            st = kern_copy_rows(be, &ce, err);
        if (st == PD_OK)
            st = kern_copy_rows(be, &ch, err);
    }
    if (st == PD_OK)
        st = kern_matmul(be, &mm, err);
    if (st != PD_OK)
        return st;
    if (gated) {
        /* vec = sigmoid(gate) * e */
        kern_unary_args sg = { .op = KERN_UNARY_SIGMOID, .x = gate, .ld_x = R, .out = gate, .ld_out = R,
                               .rows = n, .cols = R };
        kern_binary_args mul = { .op = KERN_BINARY_MUL, .a = gate, .ld_a = R, .b = e, .ld_b = R, .out = tmp,
                                 .ld_out = R, .rows = n, .cols = R };
        st = kern_unary(be, &sg, err);
        if (st == PD_OK)
            st = kern_binary(be, &mul, err);
    } else {
        /* s' = ((s - c~) * sigmoid(a)) + c~, c~ = tanh(c); vec = tanh(o) */
        kern_unary_args ga = { .op = KERN_UNARY_SIGMOID, .x = out, .ld_x = J, .out = gate, .ld_out = R,
                               .rows = n, .cols = R };
        kern_unary_args ca = { .op = KERN_UNARY_TANH, .x = out + R, .ld_x = J, .out = tmp, .ld_out = R,
                               .rows = n, .cols = R };
        kern_binary_args diff = { .op = KERN_BINARY_SUB, .a = state, .ld_a = R, .b = tmp, .ld_b = R,
                                  .out = state, .ld_out = R, .rows = n, .cols = R };
        kern_binary_args scale = { .op = KERN_BINARY_MUL, .a = state, .ld_a = R, .b = gate, .ld_b = R,
                                   .out = state, .ld_out = R, .rows = n, .cols = R };
        kern_binary_args add = { .op = KERN_BINARY_ADD, .a = state, .ld_a = R, .b = tmp, .ld_b = R,
                                 .out = state, .ld_out = R, .rows = n, .cols = R };
        kern_unary_args oa = { .op = KERN_UNARY_TANH, .x = out + 2 * R, .ld_x = J, .out = tmp, .ld_out = R,
                               .rows = n, .cols = R };
        st = kern_unary(be, &ga, err);
        if (st == PD_OK)
            st = kern_unary(be, &ca, err);
        if (st == PD_OK)
            st = kern_binary(be, &diff, err);
        if (st == PD_OK)
            st = kern_binary(be, &scale, err);
        if (st == PD_OK)
            st = kern_binary(be, &add, err);
        if (st == PD_OK)
            st = kern_unary(be, &oa, err);
    }
    *vec = tmp;
    return st;
}

pd_status kern_markov_chain_by_steps(kern_backend *be, const kern_markov_chain_args *a, float *e, float *step,
                                     pd_err *err)
{
    int V = (int)a->w2.rows, R = (int)a->w2.cols, n = a->n;
    int head = a->head != KERN_MARKOV_VANILLA;
    if (head) {   /* scratch: e | in | out | state | tmp | gate | step */
        e = a->scratch;
        step = e + (size_t)n * (a->head_w.cols + a->head_w.rows + 4 * R);
    }
    pd_status st = PD_OK;
    for (int k = 0; k < a->steps && st == PD_OK; k++) {
        kern_embed_args em = { .table = a->w1, .ids = a->prev + (size_t)k * a->ld_prev, .n = n, .out = e,
                               .ld_out = R };
        float *vec = e;
        st = kern_embed(be, &em, err);
        if (st == PD_OK && head)
            st = markov_head_vec(be, a, k, e, &vec, err);
        kern_markov_step_args ms = { .base = a->base, .ld_base = a->ld_base,
                                     .rows = a->rows + (size_t)k * a->ld_rows, .w2 = a->w2, .vec = vec,
                                     .ld_vec = R, .n = n, .step = step, .ld_step = V,
                                     .ids = a->prev + (size_t)(k + 1) * a->ld_prev };
        if (st == PD_OK)
            st = kern_markov_step(be, &ms, err);
    }
    return st;
}

size_t kern_markov_chain_scratch(const kern_markov_chain_args *a)
{
    if (a->head == KERN_MARKOV_VANILLA)
        return 0;
    /* one launch: every step's head input rows [steps n, K] and h products [steps n, J]; step by
     * step: w1 rows, head input, head output, state, tmp, gate [n, R each] and the logits [n, V] */
    size_t n = (size_t)(a->n > 0 ? a->n : 0), K = (size_t)a->head_w.cols, J = (size_t)a->head_w.rows;
    size_t R = (size_t)a->w2.cols, V = (size_t)a->w2.rows;
    size_t chain = (size_t)(a->steps > 0 ? a->steps : 0) * n * (K + J);
    size_t stepwise = n * (V + K + J + 4 * R);
    return chain > stepwise ? chain : stepwise;
}

pd_status kern_probs(kern_backend *be, const kern_probs_args *a, pd_err *err)
{
    if (a->rows == 0)
        return PD_OK;
    CHECK(a->rows > 0 && a->n > 0, "probs: rows %d n %d", a->rows, a->n);
    CHECK(a->x != NULL && a->out != NULL && a->cfg != NULL, "probs: NULL x/out/cfg");
    CHECK(a->ld_x >= a->n && a->ld_out >= a->n, "probs: ld_x %d ld_out %d < n %d", a->ld_x,
          a->ld_out, a->n);
    CHECK((const float *)a->out != a->x, "probs: out aliases x");
    return be->ops->probs(be, a, err);
}

pd_status kern_sample(kern_backend *be, const kern_sample_args *a, pd_err *err)
{
    if (a->rows == 0)
        return PD_OK;
    CHECK(a->rows > 0 && a->n > 0, "sample: rows %d n %d", a->rows, a->n);
    CHECK(a->probs != NULL && a->u != NULL && a->out != NULL, "sample: NULL probs/u/out");
    CHECK(a->ld >= a->n, "sample: ld %d < n %d", a->ld, a->n);
    return be->ops->sample(be, a, err);
}

pd_status kern_spec_verify(kern_backend *be, const kern_spec_verify_args *a, pd_err *err)
{
    if (a->n_req == 0)
        return PD_OK;
    CHECK(a->n_req > 0 && a->n > 0, "spec_verify: n_req %d n %d", a->n_req, a->n);
    CHECK(a->p != NULL && a->p_row != NULL && a->q_row != NULL && a->len != NULL &&
              a->draft != NULL && a->u != NULL && a->out != NULL, "spec_verify: NULL pointer");
    CHECK(a->ld_p >= a->n && (a->q == NULL || a->ld_q >= a->n), "spec_verify: ld_p %d ld_q %d < n %d",
          a->ld_p, a->ld_q, a->n);
    CHECK(a->ld_draft >= 1 && a->ld_u >= 1, "spec_verify: ld_draft %d ld_u %d", a->ld_draft, a->ld_u);
    return be->ops->spec_verify(be, a, err);
}

pd_status kern_penalty(kern_backend *be, const kern_penalty_args *a, pd_err *err)
{
    if (a->n_entries == 0)
        return PD_OK;
    CHECK(a->x != NULL && a->e != NULL && a->n_entries > 0 && a->n > 0 && a->ld_x >= a->n,
          "penalty: bad view (%d entries, n %d, ld %d)", a->n_entries, a->n, a->ld_x);
    return be->ops->penalty(be, a, err);
}

pd_status kern_token_mask(kern_backend *be, const kern_token_mask_args *a, pd_err *err)
{
    if (a->n_rows == 0)
        return PD_OK;
    CHECK(a->x != NULL && a->rows != NULL && a->bits != NULL && a->n_rows > 0 && a->n > 0 &&
              a->ld_x >= a->n && a->words >= (a->n + 31) / 32,
          "token_mask: bad view (%d rows, n %d, ld %d, %d words)", a->n_rows, a->n, a->ld_x, a->words);
    return be->ops->token_mask(be, a, err);
}

pd_status kern_logprobs(kern_backend *be, const kern_logprobs_args *a, pd_err *err)
{
    if (a->n_rows == 0)
        return PD_OK;
    CHECK(a->x != NULL && a->rows != NULL && a->tok != NULL && a->out != NULL && a->n_rows > 0 &&
              a->n > 0 && a->ld_x >= a->n,
          "logprobs: bad view (%d rows, n %d, ld %d)", a->n_rows, a->n, a->ld_x);
    CHECK(a->n_top >= 0 && a->n_top <= KERN_MAX_TOP_LOGPROBS && a->n_top <= a->n,
          "logprobs: n_top %d must be in 0..%d", a->n_top, KERN_MAX_TOP_LOGPROBS);
    return be->ops->logprobs(be, a, err);
}
