/* kern_cpu.c - CPU reference implementation of every backend op.
 * Owns: host buffers (64-byte aligned), the reference math: fp32 values, double accumulators
 *   for long sums (norms, softmax, attention), OpenBLAS sgemm for matmul.
 * Not here: shape checks (kern_ops.c runs them before any entry here).
 * Threading: ops run on the calling thread (OpenBLAS may use its own pool inside sgemm). */
#define _GNU_SOURCE   /* qsort_r */
#include "kern_cpu.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sysinfo.h>

static float load(const void *p, kern_dtype dt, size_t i)
{
    switch (dt) {
    case KERN_DTYPE_F32: return ((const float *)p)[i];
    case KERN_DTYPE_BF16: return kern_bf16_to_f32(((const uint16_t *)p)[i]);
    case KERN_DTYPE_F16: return kern_f16_to_f32(((const uint16_t *)p)[i]);
    case KERN_DTYPE_I32: return (float)((const int32_t *)p)[i];
    }
    return 0.0f;
}

static void store(void *p, kern_dtype dt, size_t i, float f)
{
    switch (dt) {
    case KERN_DTYPE_F32: ((float *)p)[i] = f; break;
    case KERN_DTYPE_BF16: ((uint16_t *)p)[i] = kern_f32_to_bf16(f); break;
    case KERN_DTYPE_F16: ((uint16_t *)p)[i] = kern_f32_to_f16(f); break;
    case KERN_DTYPE_I32: ((int32_t *)p)[i] = (int32_t)f; break;
    }
}

static pd_status cpu_buf_alloc(kern_backend *be, size_t bytes, kern_buf **out, pd_err *err)
{
    kern_buf *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cpu buffer header");
    size_t rounded = (bytes + 63) & ~(size_t)63;
    b->ptr = aligned_alloc(64, rounded);
    if (b->ptr == NULL) {
        free(b);
        return pd_err_set(err, PD_ERR_NOMEM, "cpu buffer: %zu bytes", bytes);
    }
    b->be = be;
    b->bytes = bytes;
    *out = b;
    return PD_OK;
}

static void cpu_buf_free(kern_backend *be, kern_buf *b)
{
    (void)be;
    if (b == NULL)
        return;
    free(b->ptr);
    free(b);
}

static pd_status cpu_copy(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err)
{
    (void)be;
    (void)err;
    memmove(dst, src, n);
    return PD_OK;
}

/* download_spans and upload_spans: host memory both ways */
static pd_status cpu_copy_spans(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err)
{
    (void)be;
    (void)err;
    for (int i = 0; i < n; i++)
        memmove(spans[i].dst, spans[i].src, spans[i].n);
    return PD_OK;
}

static pd_status cpu_host_alloc(kern_backend *be, size_t bytes, void **out, pd_err *err)
{
    (void)be;
    /* page-aligned, as pinned memory is */
    if (posix_memalign(out, 4096, bytes) != 0) {
        *out = NULL;
        return pd_err_set(err, PD_ERR_NOMEM, "host memory: %zu bytes", bytes);
    }
    return PD_OK;
}

static void cpu_host_free(kern_backend *be, void *p)
{
    (void)be;
    free(p);
}

static pd_status cpu_memset0(kern_backend *be, void *dst, size_t n, pd_err *err)
{
    (void)be;
    (void)err;
    memset(dst, 0, n);
    return PD_OK;
}

static pd_status cpu_upload_convert(kern_backend *be, void *dst, kern_dtype dst_dtype, const void *src,
                                    kern_dtype src_dtype, size_t n, pd_err *err)
{
    (void)be;
    return kern_convert_host(dst, dst_dtype, src, src_dtype, n, err);
}

static pd_status cpu_sync(kern_backend *be, pd_err *err)
{
    (void)be;
    (void)err;
    return PD_OK;
}

/* No graphs on the host: callers run their ops eagerly. */
static pd_status cpu_graph_begin(kern_backend *be, pd_err *err)
{
    (void)be;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "backend cpu: no graph capture");
}

static pd_status cpu_graph_end(kern_backend *be, void **out, pd_err *err)
{
    (void)be;
    *out = NULL;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "backend cpu: no graph capture");
}

static pd_status cpu_graph_launch(kern_backend *be, void *graph, pd_err *err)
{
    (void)be;
    (void)graph;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "backend cpu: no graph capture");
}

/* The host's memory: MemAvailable of /proc/meminfo (what can be allocated without swapping:
 * free memory plus the page cache it may drop), else sysinfo's free RAM; a cgroup's limit is
 * not consulted. */
static pd_status cpu_mem_info(kern_backend *be, size_t *free_bytes, size_t *total_bytes, pd_err *err)
{
    (void)be;
    struct sysinfo si;
    if (sysinfo(&si) != 0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "the host's memory: sysinfo failed");
    *total_bytes = (size_t)si.totalram * si.mem_unit;
    *free_bytes = (size_t)si.freeram * si.mem_unit;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f != NULL) {
        char line[128];
        unsigned long long kb;
        while (fgets(line, sizeof(line), f) != NULL)
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                *free_bytes = (size_t)kb * 1024;
                break;
            }
        fclose(f);
    }
    return PD_OK;
}

static void cpu_graph_free(kern_backend *be, void *graph)
{
    (void)be;
    (void)graph;
}

static pd_status cpu_embed(kern_backend *be, const kern_embed_args *a, pd_err *err)
{
    (void)be;
    int dim = (int)a->table.cols;
    for (int i = 0; i < a->n; i++) {
        int32_t id = a->ids[i];
        if (id < 0 || id >= a->table.rows)
            return pd_err_set(err, PD_ERR_INVALID, "embed: token id %d outside vocab %lld", id,
                              (long long)a->table.rows);
        for (int c = 0; c < dim; c++)
            a->out[(size_t)i * a->ld_out + c] = load(a->table.data, a->table.dtype, (size_t)id * dim + c);
    }
    return PD_OK;
}

static pd_status cpu_rmsnorm(kern_backend *be, const kern_rmsnorm_args *a, pd_err *err)
{
    (void)err;
    const int rnd = be->act_bf16;
    float *row = malloc((size_t)a->dim * sizeof(float));
    if (row == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "rmsnorm scratch");
    for (int r = 0; r < a->rows; r++) {
        const float *x = a->x + (size_t)r * a->ld_x;
        for (int c = 0; c < a->dim; c++)
            row[c] = a->residual != NULL ? kern_act_round(x[c] + a->residual[(size_t)r * a->ld_x + c], rnd)
                                         : x[c];
        if (a->sum_out != NULL)
            memcpy(a->sum_out + (size_t)r * a->ld_x, row, (size_t)a->dim * sizeof(float));
        double ss = 0.0;
        for (int c = 0; c < a->dim; c++)
            ss += (double)row[c] * row[c];
        float inv = (float)(1.0 / sqrt(ss / a->dim + (double)a->eps));
        float *o = a->out + (size_t)r * a->ld_out;
        for (int c = 0; c < a->dim; c++)
            o[c] = kern_act_round(load(a->w.data, a->w.dtype, (size_t)c) * kern_act_round(row[c] * inv, rnd), rnd);
    }
    free(row);
    return PD_OK;
}

static pd_status cpu_matmul(kern_backend *be, const kern_matmul_args *a, pd_err *err)
{
    const int rnd = be->act_bf16;
    const float *w = a->w.data;
    float *wtmp = NULL, *prod = NULL;
    if (a->w.dtype != KERN_DTYPE_F32) {
        /* reference path for non-F32 weights (parity tests): widen once, then sgemm */
        size_t n = (size_t)a->n * a->k;
        wtmp = malloc(n * sizeof(float));
        if (wtmp == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "matmul: widen %zu weights", n);
        for (size_t i = 0; i < n; i++)
            wtmp[i] = load(a->w.data, a->w.dtype, i);
        w = wtmp;
    }
    if (!rnd) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a->m, a->n, a->k, 1.0f, a->x, a->ld_x,
                    w, a->k, a->accumulate ? 1.0f : 0.0f, a->y, a->ld_y);
        if (a->bias.data != NULL)
            for (int r = 0; r < a->m; r++)
                for (int c = 0; c < a->n; c++)
                    a->y[(size_t)r * a->ld_y + c] += load(a->bias.data, a->bias.dtype, (size_t)c);
        free(wtmp);
        return PD_OK;
    }
    /* bf16 activations: the product (with its bias, as one addmm) is rounded, then the sum */
    prod = malloc((size_t)a->m * a->n * sizeof(float));
    if (prod == NULL) {
        free(wtmp);
        return pd_err_set(err, PD_ERR_NOMEM, "matmul: %d x %d product", a->m, a->n);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a->m, a->n, a->k, 1.0f, a->x, a->ld_x,
                w, a->k, 0.0f, prod, a->n);
    for (int r = 0; r < a->m; r++)
        for (int c = 0; c < a->n; c++) {
            float v = prod[(size_t)r * a->n + c];
            if (a->bias.data != NULL)
                v += load(a->bias.data, a->bias.dtype, (size_t)c);
            float *y = a->y + (size_t)r * a->ld_y + c;
            *y = a->accumulate ? kern_act_round(*y + kern_act_round(v, 1), 1) : kern_act_round(v, 1);
        }
    free(prod);
    free(wtmp);
    return PD_OK;
}

static pd_status cpu_rope(kern_backend *be, const kern_rope_args *a, pd_err *err)
{
    (void)err;
    const int rnd = be->act_bf16;
    int half = a->head_dim / 2;
    for (int t = 0; t < a->n_tok; t++) {
        int pos = a->pos[t];
        for (int i = 0; i < half; i++) {
            float c, s;
            kern_rope_cs(pos, a->theta, &a->scaling, i, a->head_dim, &c, &s);
            c = kern_act_round(c, rnd);
            s = kern_act_round(s, rnd);
            for (int h = 0; h < a->n_heads; h++) {
                float *x = a->x + (size_t)t * a->ld + (size_t)h * a->head_dim;
                float x1 = x[i], x2 = x[i + half];
                if (rnd) {   /* x cos + rotate_half(x) sin, each product and the sum rounded */
                    x[i] = kern_act_round(kern_act_round(x1 * c, 1) + kern_act_round(-x2 * s, 1), 1);
                    x[i + half] = kern_act_round(kern_act_round(x2 * c, 1) + kern_act_round(x1 * s, 1), 1);
                } else {
                    x[i] = x1 * c - x2 * s;
                    x[i + half] = x2 * c + x1 * s;
                }
            }
        }
    }
    return PD_OK;
}

static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

static pd_status cpu_unary(kern_backend *be, const kern_unary_args *a, pd_err *err)
{
    (void)err;
    for (int r = 0; r < a->rows; r++)
        for (int c = 0; c < a->cols; c++) {
            float x = a->x[(size_t)r * a->ld_x + c], y = x;
            switch (a->op) {
            case KERN_UNARY_SIGMOID: y = sigmoidf_(x); break;
            case KERN_UNARY_TANH: y = tanhf(x); break;
            case KERN_UNARY_SILU: y = x * sigmoidf_(x); break;
            }
            a->out[(size_t)r * a->ld_out + c] = kern_act_round(y, be->act_bf16);
        }
    return PD_OK;
}

static pd_status cpu_binary(kern_backend *be, const kern_binary_args *a, pd_err *err)
{
    (void)err;
    const int rnd = be->act_bf16;
    for (int r = 0; r < a->rows; r++)
        for (int c = 0; c < a->cols; c++) {
            float x = a->a[(size_t)r * a->ld_a + c], y = a->b[(size_t)r * a->ld_b + c], z = 0.0f;
            switch (a->op) {
            case KERN_BINARY_ADD: z = x + y; break;
            case KERN_BINARY_SUB: z = x - y; break;
            case KERN_BINARY_MUL: z = x * y; break;
            case KERN_BINARY_SWIGLU:   /* act_fn(gate) * up, both products of a linear */
                x = kern_act_round(x, rnd);
                z = kern_act_round(x * sigmoidf_(x), rnd) * kern_act_round(y, rnd);
                break;
            }
            a->out[(size_t)r * a->ld_out + c] = kern_act_round(z, rnd);
        }
    return PD_OK;
}

static pd_status cpu_copy_rows(kern_backend *be, const kern_copy_rows_args *a, pd_err *err)
{
    (void)be;
    (void)err;
    for (int r = 0; r < a->rows; r++) {
        int s = a->idx != NULL ? a->idx[r] : r;
        memmove(a->dst + (size_t)r * a->ld_dst, a->src + (size_t)s * a->ld_src,
                (size_t)a->cols * sizeof(float));
    }
    return PD_OK;
}

static pd_status cpu_kv_store(kern_backend *be, const kern_kv_store_args *a, pd_err *err)
{
    (void)be;
    (void)err;
    size_t row = (size_t)a->kv.n_kv_heads * a->kv.head_dim;
    for (int t = 0; t < a->n_tok; t++) {
        if (a->slot[t] < 0)
            continue;
        size_t base = (size_t)a->slot[t] * row;
        for (size_t c = 0; c < row; c++) {
            store(a->kv.k, a->kv.dtype, base + c, a->k[(size_t)t * a->ld + c]);
            store(a->kv.v, a->kv.dtype, base + c, a->v[(size_t)t * a->ld + c]);
        }
    }
    return PD_OK;
}

static pd_status cpu_attn(kern_backend *be, const kern_attn_args *a, pd_err *err)
{
    const kern_kv_layer *kv = &a->kv;
    int hd = kv->head_dim;
    int group = a->n_heads / kv->n_kv_heads;
    size_t row = (size_t)kv->n_kv_heads * hd;
    double *score = malloc((size_t)a->max_kv_len * sizeof(double));
    double *acc = malloc((size_t)hd * sizeof(double));
    if (score == NULL || acc == NULL) {
        free(score);
        free(acc);
        return pd_err_set(err, PD_ERR_NOMEM, "attn scratch: %d keys", a->max_kv_len);
    }
    pd_status st = PD_OK;
    for (int t = 0; t < a->n_tok && st == PD_OK; t++) {
        int s = a->tok_seq[t], len = a->tok_kv_len[t];
        if (s < 0 || s >= a->n_seq || len <= 0 || len > a->max_kv_len) {
            st = pd_err_set(err, PD_ERR_INVALID, "attn: token %d seq %d kv_len %d (max %d)", t, s,
                            len, a->max_kv_len);
            break;
        }
        const int32_t *pt = a->page_table + (size_t)s * a->pt_stride;
        for (int h = 0; h < a->n_heads; h++) {
            const float *q = a->q + (size_t)t * a->ld_q + (size_t)h * hd;
            int g = h / group;
            double mx = -INFINITY;
            for (int j = 0; j < len; j++) {
                size_t slot = (size_t)pt[j / kv->page_size] * kv->page_size + j % kv->page_size;
                size_t base = slot * row + (size_t)g * hd;
                double d = 0.0;
                if (kv->dtype == KERN_DTYPE_F32 && hd % 8 == 0) {
                    /* eight independent lanes vectorise without reassociating one sum */
                    const float *kr = (const float *)kv->k + base;
                    float lane[8] = {0};
                    for (int c = 0; c < hd; c += 8)
                        for (int u = 0; u < 8; u++)
                            lane[u] += q[c + u] * kr[c + u];
                    for (int u = 0; u < 8; u++)
                        d += lane[u];
                } else {
                    for (int c = 0; c < hd; c++)
                        d += (double)q[c] * load(kv->k, kv->dtype, base + c);
                }
                score[j] = d * a->scale;
                if (score[j] > mx)
                    mx = score[j];
            }
            double sum = 0.0;
            for (int j = 0; j < len; j++) {
                score[j] = exp(score[j] - mx);
                sum += score[j];
            }
            for (int c = 0; c < hd; c++)
                acc[c] = 0.0;
            for (int j = 0; j < len; j++) {
                size_t slot = (size_t)pt[j / kv->page_size] * kv->page_size + j % kv->page_size;
                size_t base = slot * row + (size_t)g * hd;
                double p = score[j] / sum;
                if (kv->dtype == KERN_DTYPE_F32) {
                    const float *vr = (const float *)kv->v + base;
                    for (int c = 0; c < hd; c++)
                        acc[c] += p * vr[c];
                } else {
                    for (int c = 0; c < hd; c++)
                        acc[c] += p * load(kv->v, kv->dtype, base + c);
                }
            }
            float *o = a->out + (size_t)t * a->ld_out + (size_t)h * hd;
            for (int c = 0; c < hd; c++)
                o[c] = kern_act_round((float)acc[c], be->act_bf16);
        }
    }
    free(score);
    free(acc);
    return st;
}

static pd_status cpu_argmax(kern_backend *be, const kern_argmax_args *a, pd_err *err)
{
    (void)be;
    (void)err;
    for (int r = 0; r < a->rows; r++) {
        const float *x = a->x + (size_t)r * a->ld_x;
        int best = 0;
        for (int i = 1; i < a->n; i++)
            if (x[i] > x[best])
                best = i;
        a->out[r] = best;
    }
    return PD_OK;
}

/* The reference of the fused linear op, by composition: rmsnorm into a scratch copy of x, one
 * matmul per weight (accumulate as asked), and for SWIGLU the two products then the binary op. */
static pd_status cpu_linear(kern_backend *be, const kern_linear_args *a, pd_err *err)
{
    const float *x = a->x;
    int ld_x = a->ld_x;
    float *xn = NULL, *gu = NULL;
    pd_status st = PD_OK;
    if (a->norm.data != NULL) {
        xn = malloc((size_t)a->m * a->k * sizeof(float));
        if (xn == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "linear: norm scratch %d x %d", a->m, a->k);
        kern_rmsnorm_args rn = { .x = a->x, .out = xn, .w = a->norm, .rows = a->m, .dim = a->k,
                                 .ld_x = a->ld_x, .ld_out = a->k, .eps = a->eps };
        if ((st = cpu_rmsnorm(be, &rn, err)) != PD_OK)
            goto out;
        x = xn;
        ld_x = a->k;
    }
    if (a->epilogue == KERN_LINEAR_SWIGLU) {
        int n = (int)a->w[0].rows;
        gu = malloc((size_t)2 * a->m * n * sizeof(float));
        if (gu == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "linear: swiglu scratch %d x %d", a->m, n);
            goto out;
        }
        for (int i = 0; i < 2 && st == PD_OK; i++) {
            kern_matmul_args mm = { .x = x, .ld_x = ld_x, .w = a->w[i], .y = gu + (size_t)i * a->m * n,
                                    .ld_y = n, .m = a->m, .n = n, .k = a->k };
            st = cpu_matmul(be, &mm, err);
        }
        kern_binary_args sw = { .op = KERN_BINARY_SWIGLU, .a = gu, .ld_a = n, .b = gu + (size_t)a->m * n,
                                .ld_b = n, .out = a->y[0], .ld_out = a->ld_y[0], .rows = a->m, .cols = n };
        if (st == PD_OK)
            st = cpu_binary(be, &sw, err);
        goto out;
    }
    for (int i = 0; i < a->n_w && st == PD_OK; i++) {
        kern_matmul_args mm = { .x = x, .ld_x = ld_x, .w = a->w[i], .y = a->y[i], .ld_y = a->ld_y[i],
                                .m = a->m, .n = (int)a->w[i].rows, .k = a->k,
                                .accumulate = a->epilogue == KERN_LINEAR_ACCUMULATE };
        st = cpu_matmul(be, &mm, err);
    }
    if (st == PD_OK && a->tee != NULL) {
        kern_copy_rows_args cp = { .src = a->y[0], .ld_src = a->ld_y[0], .dst = a->tee,
                                   .ld_dst = a->ld_tee, .rows = a->m, .cols = (int)a->w[0].rows };
        st = cpu_copy_rows(be, &cp, err);
    }
out:
    free(xn);
    free(gu);
    return st;
}

/* q/k post-processing by composition: per-head rmsnorm of each token's q and k rows (in place),
 * rope of both, then kv_store. */
static pd_status cpu_mlp(kern_backend *be, const kern_mlp_args *a, pd_err *err)
{
    kern_linear_args gu, dn;
    kern_mlp_split(a, &gu, &dn);
    pd_status st = cpu_linear(be, &gu, err);
    return st != PD_OK ? st : cpu_linear(be, &dn, err);
}

static pd_status cpu_qk_post(kern_backend *be, const kern_qk_post_args *a, pd_err *err)
{
    pd_status st = PD_OK;
    int hd = a->head_dim;
    for (int t = 0; t < a->n_tok && st == PD_OK; t++) {
        float *q = a->q + (size_t)t * a->ld_q, *k = a->k + (size_t)t * a->ld_kv;
        kern_rmsnorm_args rq = { .x = q, .out = q, .w = a->q_norm, .rows = a->n_heads, .dim = hd,
                                 .ld_x = hd, .ld_out = hd, .eps = a->eps };
        kern_rmsnorm_args rk = { .x = k, .out = k, .w = a->k_norm, .rows = a->n_kv_heads, .dim = hd,
                                 .ld_x = hd, .ld_out = hd, .eps = a->eps };
        st = cpu_rmsnorm(be, &rq, err);
        if (st == PD_OK)
            st = cpu_rmsnorm(be, &rk, err);
    }
    kern_rope_args pq = { .x = a->q, .n_tok = a->n_tok, .n_heads = a->n_heads, .head_dim = hd,
                          .ld = a->ld_q, .pos = a->pos, .theta = a->theta, .scaling = a->scaling };
    kern_rope_args pk = { .x = a->k, .n_tok = a->n_tok, .n_heads = a->n_kv_heads, .head_dim = hd,
                          .ld = a->ld_kv, .pos = a->pos, .theta = a->theta, .scaling = a->scaling };
    if (st == PD_OK)
        st = cpu_rope(be, &pq, err);
    if (st == PD_OK)
        st = cpu_rope(be, &pk, err);
    if (st != PD_OK || a->kv.k == NULL)
        return st;
    kern_kv_store_args ks = { .kv = a->kv, .k = a->k, .v = a->v, .ld = a->ld_kv, .slot = a->slot,
                              .n_tok = a->n_tok };
    return cpu_kv_store(be, &ks, err);
}

/* Markov step by composition: copy the base rows, matmul-accumulate w2 @ vec, argmax. */
static pd_status cpu_markov_step(kern_backend *be, const kern_markov_step_args *a, pd_err *err)
{
    int V = (int)a->w2.rows, R = (int)a->w2.cols;
    kern_copy_rows_args cp = { .src = a->base, .ld_src = a->ld_base, .idx = a->rows, .dst = a->step,
                               .ld_dst = a->ld_step, .rows = a->n, .cols = V };
    pd_status st = cpu_copy_rows(be, &cp, err);
    kern_matmul_args mm = { .x = a->vec, .ld_x = a->ld_vec, .w = a->w2, .y = a->step, .ld_y = a->ld_step,
                            .m = a->n, .n = V, .k = R, .accumulate = 1 };
    if (st == PD_OK)
        st = cpu_matmul(be, &mm, err);
    kern_argmax_args am = { .x = a->step, .ld_x = a->ld_step, .rows = a->n, .n = V, .out = a->ids };
    if (st == PD_OK && a->ids != NULL)
        st = cpu_argmax(be, &am, err);
    return st;
}

/* The chained Markov steps by composition (kern_markov_chain_by_steps); a vanilla chain's work
 * memory is allocated here, a head's comes with the args. */
static pd_status cpu_markov_chain(kern_backend *be, const kern_markov_chain_args *a, pd_err *err)
{
    if (a->head != KERN_MARKOV_VANILLA)
        return kern_markov_chain_by_steps(be, a, NULL, NULL, err);
    int V = (int)a->w2.rows, R = (int)a->w2.cols, n = a->n;
    float *own = malloc(((size_t)n * R + (size_t)n * V) * sizeof(float));
    if (own == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "markov chain scratch: %d rows of %d", n, V);
    pd_status st = kern_markov_chain_by_steps(be, a, own, own + (size_t)n * R, err);
    free(own);
    return st;
}

/* ---- sampling: the rules of pd_sample.c, row by row (see kern_backend.h) ------------------ */

/* a probability in integer units of 2^-60, rounded to the nearest (even on a tie); the
 * product by 2^60 is exact (ldexp's value, without its call) */
static uint64_t mass_fix(float p)
{
    return (uint64_t)llrint((double)p * 0x1p60);
}

/* The two orders the cuts take tokens in, both total (the index breaks ties): the candidates'
 * (p descending) and typical-p's (score ascending). */
typedef struct {
    const float *p;
    const double *score;
    int by_score;
} probs_order;

static int probs_before(const probs_order *o, int32_t a, int32_t b)
{
    if (o->by_score) {
        const double sa = o->score[a], sb = o->score[b];
        return sa < sb || (sa == sb && a < b);
    }
    const float pa = o->p[a], pb = o->p[b];
    return pa > pb || (pa == pb && a < b);
}

/* a token's weight in a prefix's sum: its mass, or 1 (a count) */
static uint64_t probs_weight(const probs_order *o, int by_mass, int32_t t)
{
    return by_mass ? mass_fix(o->p[t]) : 1u;
}

/* Every cut keeps a prefix of an order: the shortest whose weights (masses, or 1 each) sum to
 * target. Reorders t[0..n) so that t[0..m) is that prefix, t[m - 1] its last token, and returns
 * m with the prefix's sum in *reached, without sorting: a quickselect whose Hoare partitions
 * (around a median of three) keep the part where the running sum crosses target. total is the
 * sum over all n; a target above it keeps all n. */
static int select_prefix(int32_t *t, int n, uint64_t target, uint64_t total, const probs_order *o, int by_mass,
                         uint64_t *reached)
{
    if (target > total) {
        *reached = total;
        return n;
    }
    if (target == 0) {   /* the order's first token reaches it */
        int f = 0;
        for (int i = 1; i < n; i++)
            f = probs_before(o, t[i], t[f]) ? i : f;
        const int32_t x = t[0];
        t[0] = t[f];
        t[f] = x;
        *reached = probs_weight(o, by_mass, t[0]);
        return 1;
    }
    /* invariant: t[0..lo) precede t[lo..hi] in the order, sum acc < target <= acc + sum(t[lo..hi]) */
    uint64_t acc = 0;
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int32_t a = t[lo], b = t[lo + (hi - lo) / 2], c = t[hi];
        int32_t piv;
        if (probs_before(o, a, b))
            piv = probs_before(o, b, c) ? b : probs_before(o, a, c) ? c : a;
        else
            piv = probs_before(o, a, c) ? a : probs_before(o, b, c) ? c : b;
        int i = lo, j = hi;
        while (i <= j) {
            while (probs_before(o, t[i], piv))
                i++;
            while (probs_before(o, piv, t[j]))
                j--;
            if (i <= j) {
                const int32_t x = t[i];
                t[i++] = t[j];
                t[j--] = x;
            }
        }
        /* t[lo..j] precede the pivot, t[i..hi] follow it, and t[j + 1] is the pivot if j + 1 < i */
        uint64_t left = 0;
        for (int q = lo; q <= j; q++)
            left += probs_weight(o, by_mass, t[q]);
        if (acc + left >= target) {
            hi = j;
            continue;
        }
        acc += left;
        if (j + 1 < i) {
            acc += probs_weight(o, by_mass, t[j + 1]);
            if (acc >= target) {
                *reached = acc;
                return j + 2;
            }
        }
        lo = i;
    }
    *reached = acc + probs_weight(o, by_mass, t[lo]);
    return lo + 1;
}

/* typical-p over the tokens order[0..keep) of mass *kept (kern_backend.h): leaves the ones that
 * stay (a prefix of the order by score) in order[0..m), returns m and sets *kept to their mass.
 * score: n doubles, indexed by token. */
static int typical_cut(const float *p, int32_t *order, int keep, float typical_p, uint64_t *kept,
                       double *score)
{
    const double kd = ldexp((double)*kept, -60);
    long long hsum = 0;
    for (int i = 0; i < keep; i++)
        if (p[order[i]] > 0.0f)
            hsum += kern_typical_term(p[order[i]], kd);
    const double h = kern_typical_entropy(hsum);
    for (int i = 0; i < keep; i++) {
        const float pi = p[order[i]];
        score[order[i]] = pi > 0.0f ? kern_typical_score(pi, kd, h) : INFINITY;
    }
    const uint64_t target = (uint64_t)ceil((double)typical_p * (double)*kept);
    const probs_order o = { .p = p, .score = score, .by_score = 1 };
    return select_prefix(order, keep, target, *kept, &o, 1, kept);
}

/* Each cut (top-k with the k-th's ties, min-p, top-p, typical-p) keeps a prefix of an order,
 * i.e. a set, so no row is sorted: the k-th largest p comes from a quickselect, the candidates
 * from one pass against it and min-p's bound, and top-p's and typical-p's prefixes from
 * select_prefix. Masses are integers, so no sum depends on the order it is taken in. */
void kern_probs_row_host(const float *x, int n, const kern_sample_cfg *c, float *p, int32_t *order,
                         double *score)
{
    if (c->temperature < 1e-5f) {
        int best = 0;
        for (int i = 1; i < n; i++)
            if (x[i] > x[best])
                best = i;
        memset(p, 0, (size_t)n * sizeof(float));
        p[best] = 1.0f;
        return;
    }
    float mx = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > mx)
            mx = x[i];
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        double e = exp(((double)x[i] - mx) / c->temperature);
        p[i] = (float)e;
        sum += e;
    }
    float pmax = 0.0f;
    for (int i = 0; i < n; i++) {
        p[i] = (float)(p[i] / sum);
        pmax = p[i] > pmax ? p[i] : pmax;
    }
    const int k = c->top_k > 0 && c->top_k < n ? c->top_k : n;
    const int use_p = c->top_p < 1.0f, use_m = c->min_p > 0.0f;
    const int use_t = c->typical_p > 0.0f && c->typical_p < 1.0f;
    if (k == n && !use_p && !use_m && !use_t)
        return;
    const probs_order by_p = { .p = p };
    /* the candidates: p >= the k-th largest p (its ties stay), and p >= min_p * max(p) */
    float pk = 0.0f;
    if (k < n) {
        uint64_t got;
        for (int i = 0; i < n; i++)
            order[i] = i;
        select_prefix(order, n, (uint64_t)k, (uint64_t)n, &by_p, 0, &got);
        pk = p[order[k - 1]];
    }
    const double thr = use_m ? (double)c->min_p * (double)pmax : 0.0;
    int cand = 0;
    uint64_t mass = 0;
    for (int i = 0; i < n; i++)
        if ((k == n || p[i] >= pk) && (!use_m || (double)p[i] >= thr)) {
            order[cand++] = i;
            mass += mass_fix(p[i]);
        }
    int keep = cand;
    uint64_t kept = mass;
    if (use_p)
        keep = select_prefix(order, cand, (uint64_t)ceil((double)c->top_p * (double)mass), mass, &by_p, 1, &kept);
    if (use_t)
        keep = typical_cut(p, order, keep, c->typical_p, &kept, score);
    /* the kept tokens renormalised, the others 0: kept values are marked by their sign first */
    const double kept_d = ldexp((double)kept, -60);
    for (int i = 0; i < keep; i++)
        p[order[i]] = -(float)((double)p[order[i]] / kept_d);
    for (int i = 0; i < n; i++)
        p[i] = p[i] < 0.0f ? -p[i] : 0.0f;
}

static pd_status cpu_probs(kern_backend *be, const kern_probs_args *a, pd_err *err)
{
    (void)be;
    int typical = 0;
    for (int r = 0; r < a->rows; r++)
        typical |= a->cfg[r].typical_p > 0.0f && a->cfg[r].typical_p < 1.0f;
    int32_t *order = malloc((size_t)a->n * sizeof(int32_t));
    double *score = typical ? malloc((size_t)a->n * sizeof(double)) : NULL;
    if (order == NULL || (typical && score == NULL)) {
        free(order);
        free(score);
        return pd_err_set(err, PD_ERR_NOMEM, "probs: scratch of %d ints and doubles", a->n);
    }
    for (int r = 0; r < a->rows; r++) {
        int xr = a->idx != NULL ? a->idx[r] : r;
        kern_probs_row_host(a->x + (size_t)xr * a->ld_x, a->n, &a->cfg[r], a->out + (size_t)r * a->ld_out, order,
                            score);
    }
    free(order);
    free(score);
    return PD_OK;
}

int32_t kern_sample_row_host(const float *p, int n, double u)
{
    double cum = 0.0;
    int last = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] <= 0.0f)
            continue;
        cum += p[i];
        last = i;
        if (u < cum)
            return i;
    }
    return last;   /* rounding left u above the total: the last token with mass */
}

static pd_status cpu_sample(kern_backend *be, const kern_sample_args *a, pd_err *err)
{
    (void)be;
    (void)err;
    for (int r = 0; r < a->rows; r++)
        a->out[r] = kern_sample_row_host(a->probs + (size_t)r * a->ld, a->n, a->u[r]);
    return PD_OK;
}

static pd_status cpu_penalty(kern_backend *be, const kern_penalty_args *a, pd_err *err)
{
    (void)be;
    for (int i = 0; i < a->n_entries; i++) {
        const kern_penalty_entry *e = &a->e[i];
        if (e->tok < 0 || e->tok >= a->n || e->row < 0)
            return pd_err_set(err, PD_ERR_INVALID, "penalty: entry %d: token %d row %d (vocabulary %d)",
                              i, e->tok, e->row, a->n);
        float *v = &a->x[(size_t)e->row * a->ld_x + e->tok];
        *v = kern_penalize_one(*v, e);
    }
    return PD_OK;
}

static pd_status cpu_token_mask(kern_backend *be, const kern_token_mask_args *a, pd_err *err)
{
    (void)be;
    for (int i = 0; i < a->n_rows; i++) {
        if (a->rows[i] < 0)
            return pd_err_set(err, PD_ERR_INVALID, "token_mask: mask %d names row %d", i, a->rows[i]);
        float *x = a->x + (size_t)a->rows[i] * a->ld_x;
        const uint32_t *b = a->bits + (size_t)i * a->words;
        for (int t = 0; t < a->n; t++)
            if (!((b[t >> 5] >> (t & 31)) & 1u))
                x[t] = -INFINITY;
    }
    return PD_OK;
}

void kern_logprobs_row_host(const float *x, int n, int32_t tok, int n_top, kern_logprobs_row *out)
{
    float mx = x[0];
    for (int i = 1; i < n; i++)
        if (x[i] > mx)
            mx = x[i];
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += exp((double)x[i] - mx);
    double lse = mx + log(sum);
    out->logprob = (float)((double)x[tok] - lse);
    int32_t rank = 0;
    for (int i = 0; i < n; i++)
        rank += x[i] >= x[tok];
    out->rank = rank;
    /* insertion into a short sorted list: (value descending, id ascending); a later id with an
     * equal value never displaces an earlier one */
    int k = 0;
    for (int i = 0; i < n && n_top > 0; i++) {
        float v = x[i];
        if (k == n_top && !(v > x[out->top_id[k - 1]]))
            continue;
        int j = k < n_top ? k++ : k - 1;
        while (j > 0 && v > x[out->top_id[j - 1]]) {
            out->top_id[j] = out->top_id[j - 1];
            j--;
        }
        out->top_id[j] = i;
    }
    out->n_top = k;
    for (int j = 0; j < k; j++)
        out->top_logprob[j] = (float)((double)x[out->top_id[j]] - lse);
}

static pd_status cpu_logprobs(kern_backend *be, const kern_logprobs_args *a, pd_err *err)
{
    (void)be;
    for (int i = 0; i < a->n_rows; i++) {
        if (a->rows[i] < 0 || a->tok[i] < 0 || a->tok[i] >= a->n)
            return pd_err_set(err, PD_ERR_INVALID, "logprobs: entry %d names row %d, token %d (vocabulary %d)",
                              i, a->rows[i], a->tok[i], a->n);
        kern_logprobs_row_host(a->x + (size_t)a->rows[i] * a->ld_x, a->n, a->tok[i], a->n_top, &a->out[i]);
    }
    return PD_OK;
}

/* kern_spec_verify per request, its uniforms taken in order from u[r, :] */
static pd_status cpu_spec_verify(kern_backend *be, const kern_spec_verify_args *a, pd_err *err)
{
    (void)be;
    int n = a->n;
    float *res = malloc((size_t)n * sizeof(float));
    if (res == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "spec_verify: scratch of %d floats", n);
    for (int r = 0; r < a->n_req; r++) {
        const float *prow = a->p + (size_t)a->p_row[r] * a->ld_p;
        const int32_t *d = a->draft + (size_t)r * a->ld_draft;
        const double *u = a->u + (size_t)r * a->ld_u;
        int l = a->len[r], acc = 0;
        int32_t next = -1;
        for (; acc < l; acc++) {
            const float *p = prow + (size_t)acc * a->ld_p;
            const float *q = a->q + (size_t)(a->q_row[r] + acc) * a->ld_q;
            double pq = p[d[acc]], qq = q[d[acc]] > 1e-8f ? q[d[acc]] : 1e-8;
            double accept = pq / qq < 1.0 ? pq / qq : 1.0;
            if (u[acc] < accept)
                continue;
            double mass = 0.0;
            for (int j = 0; j < n; j++) {
                float v = p[j] - q[j];
                res[j] = v > 0.0f ? v : 0.0f;
                mass += res[j];
            }
            if (mass <= 1e-8) {
                memcpy(res, p, (size_t)n * sizeof(float));
                mass = 1.0;
            }
            for (int j = 0; j < n; j++)
                res[j] = (float)(res[j] / mass);
            next = kern_sample_row_host(res, n, u[l]);
            break;
        }
        if (next < 0)
            next = kern_sample_row_host(prow + (size_t)l * a->ld_p, n, u[l]);
        a->out[2 * r] = acc;
        a->out[2 * r + 1] = next;
    }
    free(res);
    return PD_OK;
}

static void cpu_destroy(kern_backend *be)
{
    free(be);
}

static pd_status cpu_qkv(kern_backend *be, const kern_qkv_args *a, pd_err *err)
{
    pd_status st = cpu_linear(be, &a->lin, err);
    return st != PD_OK ? st : cpu_qk_post(be, &a->post, err);
}

static pd_status cpu_attn_block(kern_backend *be, const kern_attn_block_args *a, pd_err *err)
{
    pd_status st = cpu_qkv(be, &a->qkv, err);
    if (st == PD_OK)
        st = cpu_attn(be, &a->attn, err);
    return st != PD_OK ? st : cpu_linear(be, &a->o, err);
}

static const kern_backend_ops cpu_ops = {
    .name = "cpu",
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .download_spans = cpu_copy_spans,
    .upload_spans = cpu_copy_spans,
    .memset0 = cpu_memset0,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .upload_convert = cpu_upload_convert,
    .sync = cpu_sync,
    .mem_info = cpu_mem_info,
    .graph_begin = cpu_graph_begin,
    .graph_end = cpu_graph_end,
    .graph_launch = cpu_graph_launch,
    .graph_free = cpu_graph_free,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .unary = cpu_unary,
    .binary = cpu_binary,
    .copy_rows = cpu_copy_rows,
    .kv_store = cpu_kv_store,
    .attn = cpu_attn,
    .argmax = cpu_argmax,
    .linear = cpu_linear,
    .qk_post = cpu_qk_post,
    .mlp = cpu_mlp,
    .qkv = cpu_qkv,
    .attn_block = cpu_attn_block,
    .markov_step = cpu_markov_step,
    .markov_chain = cpu_markov_chain,
    .probs = cpu_probs,
    .sample = cpu_sample,
    .spec_verify = cpu_spec_verify,
    .penalty = cpu_penalty,
    .token_mask = cpu_token_mask,
    .logprobs = cpu_logprobs,
    .destroy = cpu_destroy,
};

pd_status kern_cpu_backend_create(const kern_backend_config *cfg, kern_backend **out, pd_err *err)
{
    kern_backend *be = calloc(1, sizeof(*be));
    if (be == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cpu backend");
    if (cfg != NULL && cfg->threads > 0)
        openblas_set_num_threads(cfg->threads);
    be->ops = &cpu_ops;
    be->weight_dtype = KERN_DTYPE_F32;
    be->kv_dtype = KERN_DTYPE_F32;
    be->is_host = 1;
    be->act_bf16 = cfg != NULL && cfg->act_bf16;
    *out = be;
    return PD_OK;
}
