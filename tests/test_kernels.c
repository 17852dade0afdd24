/* test_kernels.c - every backend op: the CPU reference against the CUDA backend.
 * Each case of the table draws fresh random inputs from its own seed, runs the op on both
 * backends and compares the outputs by relative L2 error (after ggml's test-backend-ops).
 * Weights and KV pages are rounded to bf16 on the host first, so the CPU reference sees exactly
 * the values the CUDA backend stores and the tolerance measures the kernel, not the storage.
 * Every output buffer is pre-filled with a sentinel and carries guard elements after it: the
 * parts an op must not touch (row padding, guards, unused KV slots) have to come back bit-equal.
 * Usage: test_kernels [--op NAME] [--case TEXT] [--perf] [--perf-only] [--seed N]
 *   --op NAME  run only cases of op NAME (embed, rmsnorm, matmul, rope, unary, binary,
 *              copy_rows, kv_store, attn, argmax, convert, linear, mlp, qkv, attn_block, qk_post,
 *              markov_step, markov_chain, probs, sample, spec_verify; invariance: only the
 *              bit-for-bit batch-invariance checks)
 *   --perf     also run the large perf cases and time every case on CUDA (median of 5 runs of
 *              20 back-to-back calls), printing GB/s, TFLOP/s and the fraction of the roofline;
 *              linear cases also as a CUDA graph of 100 calls, with the weights hot in the L2
 *              and cold (rotated copies), see perf_linear_graph
 *   --case TEXT  run only cases whose printed name contains TEXT (e.g. "m 64 n 2560 k 4096")
 *   --perf-only  --perf with the perf-only cases alone
 *   --invariant  run the cases with be->batch_invariant set on the CUDA backend (the kernels of
 *              decode rounds; e.g. linear uses the skinny kernel for every m, not only m = 1)
 *   --self     compare the CPU backend with itself (checks this harness on a machine without
 *              a GPU; not a test of anything else)
 * Without a GPU (or a build without CUDA) it prints why and exits 77 (skipped). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kern_backend.h"
#include "test_util.h"
#ifdef PD_HAVE_CUDA
#include "kern_cuda.h"
#endif

#define GUARD 64                       /* guard elements after every output */
#define SENTINEL (-12345.678f)
#define ROOF_BW 4.3e12                 /* H200 device copy, bytes/s (measured, KINDS.md) */
#define ROOF_BF16 790e12               /* H200 bf16 matrix rate, FLOP/s (measured, KINDS.md) */
#define MAX_BUFS 64
#define MAX_SEQ 64

/* ---- random numbers ---------------------------------------------------------------------- */

static uint64_t rng_state;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_uniform(float lo, float hi)
{
    return lo + (hi - lo) * (float)((rng_next() >> 40) * (1.0 / 16777216.0));
}

static int rng_int(int n)
{
    return (int)(rng_next() % (uint64_t)n);
}

static float bf16_round(float f)
{
    return kern_bf16_to_f32(kern_f32_to_bf16(f));
}

static float *host_rand(size_t n, float lo, float hi, int round_bf16)
{
    float *h = calloc(n > 0 ? n : 1, sizeof(float));
    if (h == NULL) {
        fprintf(stderr, "out of host memory (%zu floats)\n", n);
        exit(1);
    }
    for (size_t i = 0; i < n; i++) {
        float f = rng_uniform(lo, hi);
        h[i] = round_bf16 ? bf16_round(f) : f;
    }
    return h;
}

/* ---- one backend's view of a case: its buffers, freed together ----------------------------- */

typedef struct {
    kern_backend *be;
    kern_buf *bufs[MAX_BUFS];
    int nbuf;
} side;

static int fatal_status(pd_status st, const pd_err *err, const char *what)
{
    if (st == PD_OK)
        return 0;
    fprintf(stderr, "FAIL %s: %s: %s\n", what, pd_status_str(st), err->msg);
    return 1;
}

static void side_free(side *s)
{
    for (int i = 0; i < s->nbuf; i++)
        kern_buf_free(s->bufs[i]);
    s->nbuf = 0;
}

static void *side_alloc(side *s, size_t bytes)
{
    pd_err err;
    kern_buf *b = NULL;
    if (s->nbuf == MAX_BUFS || fatal_status(kern_buf_alloc(s->be, bytes, &b, &err), &err, "alloc"))
        exit(1);
    s->bufs[s->nbuf++] = b;
    return b->ptr;
}

/* Uploads n bytes from host; the buffer is exactly n bytes long. */
static void *side_bytes(side *s, const void *h, size_t n)
{
    pd_err err;
    void *d = side_alloc(s, n);
    if (fatal_status(kern_upload(s->be, d, h, n, &err), &err, "upload"))
        exit(1);
    return d;
}

/* Uploads n F32 values converted to dtype (weights: the backend's weight dtype). */
static void *side_conv(side *s, const float *h, size_t n, kern_dtype dt)
{
    pd_err err;
    void *d = side_alloc(s, n * kern_dtype_size(dt));
    if (fatal_status(kern_upload_convert(s->be, d, dt, h, KERN_DTYPE_F32, n, &err), &err,
                     "upload_convert"))
        exit(1);
    return d;
}

static void *side_download(side *s, const void *d, size_t bytes)
{
    pd_err err;
    void *h = malloc(bytes);
    if (h == NULL || fatal_status(kern_download(s->be, h, d, bytes, &err), &err, "download"))
        exit(1);
    return h;
}

static kern_weight side_weight(side *s, const float *h, int64_t rows, int64_t cols)
{
    kern_weight w;
    w.dtype = s->be->weight_dtype;
    w.data = side_conv(s, h, (size_t)(rows * cols), w.dtype);
    w.rows = rows;
    w.cols = cols;
    return w;
}

/* ---- case table ---------------------------------------------------------------------------- */

typedef struct {
    const char *op;
    int rows, cols, pad;     /* [rows, cols] views; pad = extra row stride */
    int m, n, k;             /* matmul */
    int sub;                 /* unary/binary op; rmsnorm: 1 = residual; matmul: 1 acc, 2 bias,
                                4 f32 weights; embed: table rows */
    int n_heads, n_kv, hd, page_size;
    const char *spec;        /* attn / kv_store: the ragged batch, see parse_spec */
    double tol;
    int perf_only;           /* 1: only with --perf; 2: also no CPU reference (attn) */
} kcase;

typedef struct {
    int opt_perf;
    const char *opt_case;    /* --case: only cases whose name contains it */
    int opt_perf_only;       /* --perf-only: only the perf-only cases */
    int opt_self;
    int opt_invariant;
    int opt_f32;             /* the CUDA backend keeps weights and KV in fp32 (--dtype f32) */
    const char *opt_op;
    uint64_t seed;
} options;

static options opts;
static char perf_note[1024];
/* 1 in the bf16-activation pass: every element an op wrote must be a bf16 value */
static int expect_bf16;

static int is_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return (u & 0xffffu) == 0;
}   /* --perf line(s) of the current case, printed after its result */

typedef pd_status (*op_fn)(kern_backend *be, const void *args, pd_err *err);

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Times an op on be: 3 warm-up calls, then the median over 5 runs of 20 back-to-back calls. */
static void perf_report(kern_backend *be, op_fn fn, const void *args, double bytes, double flops)
{
    if (!opts.opt_perf)
        return;
    pd_err err;
    for (int i = 0; i < 3; i++)
        if (fatal_status(fn(be, args, &err), &err, "perf warm-up"))
            return;
    kern_sync(be, &err);
    double t[5];
    for (int r = 0; r < 5; r++) {
        double t0 = test_now_s();
        for (int i = 0; i < 20; i++)
            fn(be, args, &err);
        if (fatal_status(kern_sync(be, &err), &err, "perf sync"))
            return;
        t[r] = (test_now_s() - t0) / 20.0;
    }
    qsort(t, 5, sizeof(double), cmp_double);
    double s = t[2];
    double floor_s = bytes / ROOF_BW > flops / ROOF_BF16 ? bytes / ROOF_BW : flops / ROOF_BF16;
    size_t used = strlen(perf_note);
    snprintf(perf_note + used, sizeof(perf_note) - used,
             "      perf: %9.2f us  %8.1f GB/s  %7.2f TFLOP/s  roofline %5.1f%% (floor %.2f us, %s)\n",
             s * 1e6, bytes / s * 1e-9, flops / s * 1e-12, 100.0 * floor_s / s, floor_s * 1e6,
             bytes / ROOF_BW > flops / ROOF_BF16 ? "bytes" : "flops");
}

/* --perf of an op as a graph replays it: 20 calls captured once, the median of 5 replays, so
 * the host's launch cost drops out (skipped on host backends) */
static void perf_graph(kern_backend *be, op_fn fn, const void *args, double bytes)
{
    if (!opts.opt_perf || kern_backend_stream(be) == NULL)
        return;
    enum { CALLS = 20 };
    pd_err err;
    void *graph = NULL;
    if (fatal_status(kern_graph_begin(be, &err), &err, "perf capture"))
        return;
    for (int i = 0; i < CALLS; i++)
        if (fn(be, args, &err) != PD_OK)
            break;
    if (fatal_status(kern_graph_end(be, &graph, &err), &err, "perf capture"))
        return;
    double t[5];
    for (int r = -1; r < 5; r++) {
        double t0 = test_now_s();
        if (fatal_status(kern_graph_launch(be, graph, &err), &err, "perf replay") ||
            fatal_status(kern_sync(be, &err), &err, "perf sync")) {
            kern_graph_free(be, graph);
            return;
        }
        if (r >= 0)
            t[r] = (test_now_s() - t0) / CALLS;
    }
    kern_graph_free(be, graph);
    qsort(t, 5, sizeof(double), cmp_double);
    size_t used = strlen(perf_note);
    snprintf(perf_note + used, sizeof(perf_note) - used, "      graph: %9.2f us  %8.1f GB/s  roofline %5.1f%%\n",
             t[2] * 1e6, bytes / t[2] * 1e-9, 100.0 * bytes / ROOF_BW / t[2]);
}

/* --perf for the linear op, as a decode step runs it: 100 calls captured in one graph (each a
 * programmatic dependent launch of the previous, as in the engine), replayed; median of 5
 * replays over 100. "hot" repeats the same weights, so weights that fit the L2 (50 MB on an
 * H200) come from it; "cold" rotates through copies of them (>= 256 MB in all, or 1 copy of a
 * larger weight), so every call reads its weights from DRAM as a step's layers do. Skipped on
 * host backends (--self). */
static void perf_linear_graph(kern_backend *be, const kern_linear_args *ag, double wbytes, double bytes)
{
    if (!opts.opt_perf || kern_backend_stream(be) == NULL)
        return;
    enum { CALLS = 100, MAX_COPIES = 32 };
    int copies = wbytes >= 256e6 ? 1 : (int)(256e6 / wbytes) + 1;
    copies = copies > MAX_COPIES ? MAX_COPIES : copies;
    kern_linear_args a[MAX_COPIES];
    kern_buf *bufs[MAX_COPIES * KERN_LINEAR_MAX_W] = {0};
    int nb = 0;
    pd_err err;
    a[0] = *ag;
    for (int r = 1; r < copies; r++) {
        a[r] = *ag;
        for (int i = 0; i < ag->n_w; i++) {
            size_t n = (size_t)(ag->w[i].rows * ag->w[i].cols) * kern_dtype_size(ag->w[i].dtype);
            void *h = malloc(n);
            kern_buf *b = NULL;
            if (h == NULL || fatal_status(kern_buf_alloc(be, n, &b, &err), &err, "perf copy alloc") ||
                fatal_status(kern_download(be, h, ag->w[i].data, n, &err), &err, "perf copy") ||
                fatal_status(kern_upload(be, b->ptr, h, n, &err), &err, "perf copy"))
                exit(1);
            free(h);
            bufs[nb++] = b;
            a[r].w[i].data = b->ptr;
        }
    }
    double med[2];
    for (int cold = 0; cold < 2; cold++) {
        void *graph = NULL;
        if (fatal_status(kern_graph_begin(be, &err), &err, "perf capture"))
            exit(1);
        for (int i = 0; i < CALLS; i++)
            if (kern_linear(be, &a[cold ? i % copies : 0], &err) != PD_OK)
                break;
        if (fatal_status(kern_graph_end(be, &graph, &err), &err, "perf capture"))
            exit(1);
        double t[5];
        for (int r = -1; r < 5; r++) {
            double t0 = test_now_s();
            if (fatal_status(kern_graph_launch(be, graph, &err), &err, "perf replay") ||
                fatal_status(kern_sync(be, &err), &err, "perf sync"))
                exit(1);
            if (r >= 0)
                t[r] = (test_now_s() - t0) / CALLS;
        }
        kern_graph_free(be, graph);
        qsort(t, 5, sizeof(double), cmp_double);
        med[cold] = t[2];
    }
    for (int i = 0; i < nb; i++)
        kern_buf_free(bufs[i]);
    size_t used = strlen(perf_note);
    snprintf(perf_note + used, sizeof(perf_note) - used,
             "      graph: hot %8.2f us %7.1f GB/s | cold (%d copies) %8.2f us %7.1f GB/s  roofline %5.1f%%\n",
             med[0] * 1e6, bytes / med[0] * 1e-9, copies, med[1] * 1e6, bytes / med[1] * 1e-9,
             100.0 * bytes / ROOF_BW / med[1]);
}

/* Compares an F32 output of n_total elements (valid region: rows x cols with stride ld starting
 * at 0; everything else must still hold init). Returns the relative L2 error, or a huge value
 * when an untouched element changed or the output has a NaN. */
static double compare_out(const char *what, const float *init, const float *cpu, const float *gpu,
                          size_t n_total, int rows, int cols, int ld)
{
    double num = 0.0, den = 0.0;
    size_t bad_cpu = 0, bad_gpu = 0, nan = 0, unrounded = 0;
    for (size_t i = 0; i < n_total; i++) {
        size_t r = i / (size_t)ld, c = i % (size_t)ld;
        int valid = r < (size_t)rows && c < (size_t)cols;
        if (valid) {
            if (expect_bf16 && ((memcmp(&gpu[i], &init[i], sizeof(float)) != 0 && !is_bf16(gpu[i])) ||
                                (memcmp(&cpu[i], &init[i], sizeof(float)) != 0 && !is_bf16(cpu[i]))))
                unrounded++;
            double d = (double)gpu[i] - (double)cpu[i];
            if (gpu[i] != gpu[i] || cpu[i] != cpu[i])
                nan++;
            num += d * d;
            den += (double)cpu[i] * cpu[i];
        } else {
            if (memcmp(&gpu[i], &init[i], sizeof(float)) != 0)
                bad_gpu++;
            if (memcmp(&cpu[i], &init[i], sizeof(float)) != 0)
                bad_cpu++;
        }
    }
    if (bad_gpu || bad_cpu || nan) {
        printf("      %s: %zu cuda and %zu cpu writes outside the output, %zu NaN\n", what,
               bad_gpu, bad_cpu, nan);
        return 1e30;
    }
    if (unrounded) {
        printf("      %s: %zu written values are not bf16 with bf16 activations\n", what, unrounded);
        return 1e30;
    }
    return sqrt(num) / (den > 1e-30 ? sqrt(den) : 1e-15);
}

/* An output buffer on both sides, pre-filled with the sentinel (or given contents). */
typedef struct {
    float *init;
    float *cpu, *gpu;
    size_t n_total;
} outbuf;

static outbuf out_make(side *sc, side *sg, size_t n_valid_span, const float *contents)
{
    outbuf o;
    o.n_total = n_valid_span + GUARD;
    o.init = malloc(o.n_total * sizeof(float));
    if (o.init == NULL)
        exit(1);
    for (size_t i = 0; i < o.n_total; i++)
        o.init[i] = contents != NULL && i < n_valid_span ? contents[i] : SENTINEL;
    o.cpu = side_bytes(sc, o.init, o.n_total * sizeof(float));
    o.gpu = side_bytes(sg, o.init, o.n_total * sizeof(float));
    return o;
}

static double out_check(side *sc, side *sg, outbuf *o, const char *what, int rows, int cols, int ld)
{
    float *hc = side_download(sc, o->cpu, o->n_total * sizeof(float));
    float *hg = side_download(sg, o->gpu, o->n_total * sizeof(float));
    double e = compare_out(what, o->init, hc, hg, o->n_total, rows, cols, ld);
    free(hc);
    free(hg);
    free(o->init);
    o->init = NULL;
    return e;
}

/* ---- op runners: each returns the relative error (or 1e30 on failure) ----------------------- */

typedef struct {
    side *cpu, *gpu;
    const kcase *c;
} run_ctx;

static double run_both(run_ctx *x, op_fn fn, const void *a_cpu, const void *a_gpu)
{
    pd_err err;
    if (fatal_status(fn(x->cpu->be, a_cpu, &err), &err, "cpu op") ||
        fatal_status(fn(x->gpu->be, a_gpu, &err), &err, "cuda op"))
        return 1e30;
    if (fatal_status(kern_sync(x->gpu->be, &err), &err, "cuda sync"))
        return 1e30;
    return 0.0;
}

static pd_status fn_embed(kern_backend *be, const void *a, pd_err *e) { return kern_embed(be, a, e); }
static pd_status fn_rmsnorm(kern_backend *be, const void *a, pd_err *e) { return kern_rmsnorm(be, a, e); }
static pd_status fn_matmul(kern_backend *be, const void *a, pd_err *e) { return kern_matmul(be, a, e); }
static pd_status fn_rope(kern_backend *be, const void *a, pd_err *e) { return kern_rope(be, a, e); }
static pd_status fn_unary(kern_backend *be, const void *a, pd_err *e) { return kern_unary(be, a, e); }
static pd_status fn_binary(kern_backend *be, const void *a, pd_err *e) { return kern_binary(be, a, e); }
static pd_status fn_copy_rows(kern_backend *be, const void *a, pd_err *e) { return kern_copy_rows(be, a, e); }
static pd_status fn_kv_store(kern_backend *be, const void *a, pd_err *e) { return kern_kv_store(be, a, e); }
static pd_status fn_attn(kern_backend *be, const void *a, pd_err *e) { return kern_attn(be, a, e); }
static pd_status fn_argmax(kern_backend *be, const void *a, pd_err *e) { return kern_argmax(be, a, e); }
static pd_status fn_linear(kern_backend *be, const void *a, pd_err *e) { return kern_linear(be, a, e); }
static pd_status fn_qk_post(kern_backend *be, const void *a, pd_err *e) { return kern_qk_post(be, a, e); }
static pd_status fn_mlp(kern_backend *be, const void *a, pd_err *e) { return kern_mlp(be, a, e); }
static pd_status fn_qkv(kern_backend *be, const void *a, pd_err *e) { return kern_qkv(be, a, e); }
static pd_status fn_attn_block(kern_backend *be, const void *a, pd_err *e) { return kern_attn_block(be, a, e); }
static pd_status fn_markov_step(kern_backend *be, const void *a, pd_err *e) { return kern_markov_step(be, a, e); }
static pd_status fn_markov_chain(kern_backend *be, const void *a, pd_err *e) { return kern_markov_chain(be, a, e); }

static double run_embed(run_ctx *x)
{
    const kcase *c = x->c;
    int vocab = c->sub, dim = c->cols, n = c->rows, ld = c->cols + c->pad;
    float *table = host_rand((size_t)vocab * dim, -2.0f, 2.0f, 1);
    int32_t *ids = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++)
        ids[i] = i == 0 ? vocab - 1 : rng_int(vocab);
    kern_embed_args ac = {0}, ag;
    ac.n = n;
    ac.ld_out = ld;
    ag = ac;
    ac.table = side_weight(x->cpu, table, vocab, dim);
    ag.table = side_weight(x->gpu, table, vocab, dim);
    ac.ids = side_bytes(x->cpu, ids, (size_t)n * sizeof(int32_t));
    ag.ids = side_bytes(x->gpu, ids, (size_t)n * sizeof(int32_t));
    outbuf o = out_make(x->cpu, x->gpu, (size_t)n * ld, NULL);
    ac.out = o.cpu;
    ag.out = o.gpu;
    double e = run_both(x, fn_embed, &ac, &ag);
    if (e == 0.0)
        e = out_check(x->cpu, x->gpu, &o, "out", n, dim, ld);
    perf_report(x->gpu->be, fn_embed, &ag, (double)n * dim * (2 + 4), 0);
    free(table);
    free(ids);
    return e;
}

static double run_rmsnorm(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, dim = c->cols, ld = c->cols + c->pad;
    int residual = c->sub & 1;
    size_t span = (size_t)rows * ld;
    float *xin = host_rand(span, -3.0f, 3.0f, 0);
    float *res = host_rand(span, -3.0f, 3.0f, 0);
    float *w = host_rand((size_t)dim, 0.5f, 1.5f, 1);
    kern_rmsnorm_args ac = {0}, ag;
    ac.rows = rows;
    ac.dim = dim;
    ac.ld_x = ld;
    ac.ld_out = ld;
    ac.eps = 1e-6f;
    ag = ac;
    ac.w = side_weight(x->cpu, w, 1, dim);
    ag.w = side_weight(x->gpu, w, 1, dim);
    /* in-place form of a pre-norm block: out aliases x, sum_out aliases residual */
    outbuf ox = out_make(x->cpu, x->gpu, span, xin);
    outbuf orr = out_make(x->cpu, x->gpu, span, res);
    ac.x = ox.cpu;
    ag.x = ox.gpu;
    ac.out = ox.cpu;
    ag.out = ox.gpu;
    if (residual) {
        ac.residual = orr.cpu;
        ag.residual = orr.gpu;
        ac.sum_out = orr.cpu;
        ag.sum_out = orr.gpu;
    }
    double e = run_both(x, fn_rmsnorm, &ac, &ag);
    if (e == 0.0) {
        double e1 = out_check(x->cpu, x->gpu, &ox, "out", rows, dim, ld);
        double e2 = out_check(x->cpu, x->gpu, &orr, "sum_out", rows, dim, ld);
        e = e1 > e2 ? e1 : e2;
    } else {
        free(ox.init);
        free(orr.init);
    }
    perf_report(x->gpu->be, fn_rmsnorm, &ag, (double)rows * dim * 4 * (residual ? 4 : 2), 0);
    free(xin);
    free(res);
    free(w);
    return e;
}

static double run_matmul(run_ctx *x)
{
    const kcase *c = x->c;
    int m = c->m, n = c->n, k = c->k, ld_x = k + c->pad, ld_y = n + c->pad;
    int acc = c->sub & 1, bias = c->sub & 2, f32w = c->sub & 4;
    float *xin = host_rand((size_t)m * ld_x, -1.0f, 1.0f, 0);
    float *w = host_rand((size_t)n * k, -1.0f, 1.0f, 1);
    float *b = host_rand((size_t)n, -1.0f, 1.0f, 1);
    float *y0 = host_rand((size_t)m * ld_y, -1.0f, 1.0f, 0);
    kern_matmul_args ac = {0}, ag;
    ac.ld_x = ld_x;
    ac.ld_y = ld_y;
    ac.m = m;
    ac.n = n;
    ac.k = k;
    ac.accumulate = acc;
    ag = ac;
    ac.x = side_bytes(x->cpu, xin, (size_t)m * ld_x * sizeof(float));
    ag.x = side_bytes(x->gpu, xin, (size_t)m * ld_x * sizeof(float));
    ac.w = side_weight(x->cpu, w, n, k);
    if (f32w) {
        ag.w = ac.w;
        ag.w.dtype = KERN_DTYPE_F32;
        ag.w.data = side_conv(x->gpu, w, (size_t)n * k, KERN_DTYPE_F32);
    } else {
        ag.w = side_weight(x->gpu, w, n, k);
    }
    if (bias) {
        ac.bias = side_weight(x->cpu, b, 1, n);
        ag.bias = side_weight(x->gpu, b, 1, n);
    }
    /* with accumulate the padding of y holds data the op must keep; without, the sentinel */
    outbuf o = out_make(x->cpu, x->gpu, (size_t)m * ld_y, acc ? y0 : NULL);
    ac.y = o.cpu;
    ag.y = o.gpu;
    double e = run_both(x, fn_matmul, &ac, &ag);
    if (e == 0.0)
        e = out_check(x->cpu, x->gpu, &o, "y", m, n, ld_y);
    perf_report(x->gpu->be, fn_matmul, &ag,
                (double)n * k * (f32w ? 4 : 2) + (double)m * k * 4 + (double)m * n * 4 * (acc ? 2 : 1),
                2.0 * m * n * k);
    free(xin);
    free(w);
    free(b);
    free(y0);
    return e;
}

/* linear: m rows of k; c->n_heads weights (weight i has n rows for i = 0, n / 4 + 5 i after, so
 * QKV-like and not multiples of 16); c->sub = epilogue | 4 (RMSNorm prologue) | 8 (tee: y[0]'s
 * rows also written to a second buffer, which must equal y[0] bit for bit on each backend). */
static int linear_rows(const kcase *c, int i)
{
    return i == 0 || (c->sub & 3) == KERN_LINEAR_SWIGLU ? c->n : c->n / 4 + 5 * i;
}

static double run_linear(run_ctx *x)
{
    const kcase *c = x->c;
    int m = c->m, k = c->k, n_w = c->n_heads, ld_x = k + c->pad;
    kern_linear_epilogue epi = (kern_linear_epilogue)(c->sub & 3);
    float *xin = host_rand((size_t)m * ld_x, -1.0f, 1.0f, 0);
    float *g = host_rand((size_t)k, 0.5f, 1.5f, 1);
    kern_linear_args ac = {0}, ag;
    ac.ld_x = ld_x;
    ac.m = m;
    ac.k = k;
    ac.n_w = n_w;
    ac.eps = 1e-6f;
    ac.epilogue = epi;
    ag = ac;
    ac.x = side_bytes(x->cpu, xin, (size_t)m * ld_x * sizeof(float));
    ag.x = side_bytes(x->gpu, xin, (size_t)m * ld_x * sizeof(float));
    if (c->sub & 4) {
        ac.norm = side_weight(x->cpu, g, 1, k);
        ag.norm = side_weight(x->gpu, g, 1, k);
    }
    outbuf o[KERN_LINEAR_MAX_W];
    int n_out = epi == KERN_LINEAR_SWIGLU ? 1 : n_w;
    double wbytes = 0.0, ybytes = 0.0;
    for (int i = 0; i < n_w; i++) {
        int n = linear_rows(c, i);
        float *w = host_rand((size_t)n * k, -1.0f, 1.0f, 1);
        ac.w[i] = side_weight(x->cpu, w, n, k);
        ag.w[i] = side_weight(x->gpu, w, n, k);
        free(w);
        wbytes += (double)n * k * 2;
        if (i >= n_out)
            continue;
        int ld_y = n + c->pad;
        float *y0 = host_rand((size_t)m * ld_y, -1.0f, 1.0f, 0);
        o[i] = out_make(x->cpu, x->gpu, (size_t)m * ld_y, epi == KERN_LINEAR_ACCUMULATE ? y0 : NULL);
        free(y0);
        ac.y[i] = o[i].cpu;
        ag.y[i] = o[i].gpu;
        ac.ld_y[i] = ag.ld_y[i] = ld_y;
        ybytes += (double)m * n * 4 * (epi == KERN_LINEAR_ACCUMULATE ? 2 : 1);
    }
    outbuf ot = {0};
    int n0 = linear_rows(c, 0), ld_tee = n0 + 2 + c->pad;
    if (c->sub & 8) {
        ot = out_make(x->cpu, x->gpu, (size_t)m * ld_tee, NULL);
        ac.tee = ot.cpu;
        ag.tee = ot.gpu;
        ac.ld_tee = ag.ld_tee = ld_tee;
    }
    double ran = run_both(x, fn_linear, &ac, &ag), e = ran;
    if ((c->sub & 8) && ran == 0.0) {
        side *sd[2] = { x->cpu, x->gpu };
        float *yv[2] = { o[0].cpu, o[0].gpu }, *tv[2] = { ot.cpu, ot.gpu };
        for (int b = 0; b < 2; b++) {
            float *hy = side_download(sd[b], yv[b], (size_t)m * ac.ld_y[0] * sizeof(float));
            float *ht = side_download(sd[b], tv[b], (size_t)m * ld_tee * sizeof(float));
            int same = 1;
            for (int r = 0; r < m && same; r++)
                same = memcmp(hy + (size_t)r * ac.ld_y[0], ht + (size_t)r * ld_tee, (size_t)n0 * 4) == 0;
            if (!same) {
                fprintf(stderr, "  linear tee: rows differ from y on the %s side\n", b ? "second" : "cpu");
                e = 1e30;
            }
            free(hy);
            free(ht);
        }
        double et = out_check(x->cpu, x->gpu, &ot, "tee", m, n0, ld_tee);
        if (et > e || et != et)
            e = et;
    } else if (c->sub & 8) {
        free(ot.init);
    }
    for (int i = 0; i < n_out; i++) {
        double ei = ran == 0.0 ? out_check(x->cpu, x->gpu, &o[i], "y", m, linear_rows(c, i), ac.ld_y[i])
                               : 1e30;
        if (o[i].init != NULL)
            free(o[i].init);
        if (ei > e || ei != ei)
            e = ei;
    }
    perf_report(x->gpu->be, fn_linear, &ag, wbytes + (double)m * k * 4 + ybytes,
                2.0 * m * k * (wbytes / 2.0 / k));
    perf_linear_graph(x->gpu->be, &ag, wbytes, wbytes + (double)m * k * 4 + ybytes);
    free(xin);
    free(g);
    return e;
}

/* mlp: m rows of hidden k, intermediate c->n; c->sub = 1 (accumulate into y, else store) | 4
 * (RMSNorm prologue) | 8 (tee) | 16 (y is x: the residual stream, as a decoder layer calls it).
 * Checked: y and tee (g is the backend's scratch). */
static double run_mlp(run_ctx *x)
{
    const kcase *c = x->c;
    int m = c->m, k = c->k, n = c->n, ld_x = k + c->pad, ld_g = n + c->pad, ld_tee = k + 3;
    int in_place = (c->sub & 16) != 0;
    float *xin = host_rand((size_t)m * ld_x, -1.0f, 1.0f, 0);
    float *nw = host_rand((size_t)k, 0.5f, 1.5f, 1);
    float *wg = host_rand((size_t)n * k, -1.0f, 1.0f, 1), *wu = host_rand((size_t)n * k, -1.0f, 1.0f, 1);
    float *wd = host_rand((size_t)k * n, -1.0f, 1.0f, 1);
    kern_mlp_args ac = { .ld_x = ld_x, .m = m, .k = k, .eps = 1e-6f, .ld_g = ld_g,
                         .epilogue = (c->sub & 1) ? KERN_LINEAR_ACCUMULATE : KERN_LINEAR_STORE };
    kern_mlp_args ag = ac;
    side *sd[2] = { x->cpu, x->gpu };
    kern_mlp_args *av[2] = { &ac, &ag };
    for (int b = 0; b < 2; b++) {
        if (c->sub & 4)
            av[b]->norm = side_weight(sd[b], nw, 1, k);
        av[b]->gate = side_weight(sd[b], wg, n, k);
        av[b]->up = side_weight(sd[b], wu, n, k);
        av[b]->down = side_weight(sd[b], wd, k, n);
        av[b]->g = side_alloc(sd[b], (size_t)m * ld_g * sizeof(float));
    }
    outbuf o = out_make(x->cpu, x->gpu, (size_t)m * ld_x, in_place || (c->sub & 1) ? xin : NULL);
    for (int b = 0; b < 2; b++) {
        av[b]->y = b ? o.gpu : o.cpu;
        av[b]->ld_y = ld_x;
        av[b]->x = in_place ? av[b]->y : side_bytes(sd[b], xin, (size_t)m * ld_x * sizeof(float));
    }
    outbuf ot = {0};
    if (c->sub & 8) {
        ot = out_make(x->cpu, x->gpu, (size_t)m * ld_tee, NULL);
        ac.tee = ot.cpu;
        ag.tee = ot.gpu;
        ac.ld_tee = ag.ld_tee = ld_tee;
    }
    double ran = run_both(x, fn_mlp, &ac, &ag);
    double e = ran == 0.0 ? out_check(x->cpu, x->gpu, &o, "y", m, k, ld_x) : 1e30;
    if (c->sub & 8) {
        double et = ran == 0.0 ? out_check(x->cpu, x->gpu, &ot, "tee", m, k, ld_tee) : 1e30;
        if (et > e || et != et)
            e = et;
        free(ot.init);
    }
    free(o.init);
    double wbytes = 3.0 * n * k * 2;
    perf_report(x->gpu->be, fn_mlp, &ag, wbytes + (double)m * k * 8, 2.0 * m * 3.0 * n * k);
    free(xin);
    free(nw);
    free(wg);
    free(wu);
    free(wd);
    return e;
}

/* A RoPE scaling for the rope / qk_post cases: 0 none, 1 yarn as Qwen3's model card sets it up
 * (factor 4 over 32768 positions, head_dim 128: pairs 23..40, attention factor 1 + 0.1 ln 4),
 * 2 linear (factor 2) */
static kern_rope_scaling case_scaling(int which)
{
    kern_rope_scaling sc = {0};
    if (which == 1)
        sc = (kern_rope_scaling){ .type = KERN_ROPE_YARN, .factor = 4.0f, .low = 23.0f, .span = 17.0f,
                                  .attn = 1.13862944f };
    else if (which == 2)
        sc = (kern_rope_scaling){ .type = KERN_ROPE_LINEAR, .factor = 2.0f };
    return sc;
}

static double run_rope(run_ctx *x)
{
    const kcase *c = x->c;
    int n_tok = c->rows, nh = c->n_heads, hd = c->hd, ld = nh * hd + c->pad;
    size_t span = (size_t)n_tok * ld;
    float *xin = host_rand(span, -2.0f, 2.0f, 0);
    int32_t *pos = malloc((size_t)n_tok * sizeof(int32_t));
    for (int i = 0; i < n_tok; i++)
        pos[i] = i == n_tok - 1 ? 40000 : rng_int(8192);
    kern_rope_args ac = {0}, ag;
    ac.n_tok = n_tok;
    ac.n_heads = nh;
    ac.head_dim = hd;
    ac.ld = ld;
    ac.theta = 1000000.0f;
    ac.scaling = case_scaling(c->sub);   /* sub: the scaling */
    ag = ac;
    ac.pos = side_bytes(x->cpu, pos, (size_t)n_tok * sizeof(int32_t));
    ag.pos = side_bytes(x->gpu, pos, (size_t)n_tok * sizeof(int32_t));
    outbuf o = out_make(x->cpu, x->gpu, span, xin);
    ac.x = o.cpu;
    ag.x = o.gpu;
    /* padding columns hold input data that must survive: compare the whole row span */
    double e = run_both(x, fn_rope, &ac, &ag);
    if (e == 0.0)
        e = out_check(x->cpu, x->gpu, &o, "x", n_tok, ld, ld);
    perf_report(x->gpu->be, fn_rope, &ag, (double)n_tok * nh * hd * 8, 0);
    free(xin);
    free(pos);
    return e;
}

static double run_elementwise(run_ctx *x, int binary)
{
    const kcase *c = x->c;
    int rows = c->rows, cols = c->cols, ld = cols + c->pad;
    size_t span = (size_t)rows * ld;
    float *a = host_rand(span, -6.0f, 6.0f, 0);
    float *b = host_rand(span, -6.0f, 6.0f, 0);
    float *bc = side_bytes(x->cpu, b, span * sizeof(float));
    float *bg = side_bytes(x->gpu, b, span * sizeof(float));
    outbuf o = out_make(x->cpu, x->gpu, span, a);    /* in place: out aliases the input */
    double e;
    if (binary) {
        kern_binary_args ac = {(kern_binary_op)c->sub, o.cpu, ld, bc, ld, o.cpu, ld, rows, cols};
        kern_binary_args ag = {(kern_binary_op)c->sub, o.gpu, ld, bg, ld, o.gpu, ld, rows, cols};
        e = run_both(x, fn_binary, &ac, &ag);
        if (e == 0.0)
            e = out_check(x->cpu, x->gpu, &o, "out", rows, ld, ld);
        perf_report(x->gpu->be, fn_binary, &ag, (double)rows * cols * 12, 0);
    } else {
        kern_unary_args ac = {(kern_unary_op)c->sub, o.cpu, ld, o.cpu, ld, rows, cols};
        kern_unary_args ag = {(kern_unary_op)c->sub, o.gpu, ld, o.gpu, ld, rows, cols};
        e = run_both(x, fn_unary, &ac, &ag);
        if (e == 0.0)
            e = out_check(x->cpu, x->gpu, &o, "out", rows, ld, ld);
        perf_report(x->gpu->be, fn_unary, &ag, (double)rows * cols * 8, 0);
    }
    if (o.init != NULL)
        free(o.init);
    free(a);
    free(b);
    return e;
}

static double run_unary(run_ctx *x) { return run_elementwise(x, 0); }
static double run_binary(run_ctx *x) { return run_elementwise(x, 1); }

static double run_copy_rows(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, cols = c->cols, ld_src = cols + 3, ld_dst = cols + c->pad;
    int n_src = rows * 2 + 1;
    float *src = host_rand((size_t)n_src * ld_src, -1.0f, 1.0f, 0);
    int32_t *idx = malloc((size_t)rows * sizeof(int32_t));
    for (int i = 0; i < rows; i++)
        idx[i] = rng_int(n_src);
    kern_copy_rows_args ac = {0}, ag;
    ac.ld_src = ld_src;
    ac.ld_dst = ld_dst;
    ac.rows = rows;
    ac.cols = cols;
    ag = ac;
    ac.src = side_bytes(x->cpu, src, (size_t)n_src * ld_src * sizeof(float));
    ag.src = side_bytes(x->gpu, src, (size_t)n_src * ld_src * sizeof(float));
    if (c->sub) {
        ac.idx = side_bytes(x->cpu, idx, (size_t)rows * sizeof(int32_t));
        ag.idx = side_bytes(x->gpu, idx, (size_t)rows * sizeof(int32_t));
    }
    outbuf o = out_make(x->cpu, x->gpu, (size_t)rows * ld_dst, NULL);
    ac.dst = o.cpu;
    ag.dst = o.gpu;
    double e = run_both(x, fn_copy_rows, &ac, &ag);
    if (e == 0.0)
        e = out_check(x->cpu, x->gpu, &o, "dst", rows, cols, ld_dst);
    perf_report(x->gpu->be, fn_copy_rows, &ag, (double)rows * cols * 8, 0);
    free(src);
    free(idx);
    return e;
}

static double run_argmax(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, n = c->cols, ld = n + c->pad;
    float *v = host_rand((size_t)rows * ld, -4.0f, 4.0f, 0);
    /* coarse values so that ties are common; row 0 ties at both ends */
    for (size_t i = 0; i < (size_t)rows * ld; i++)
        v[i] = (float)(int)(v[i] * 2.0f);
    v[0] = 100.0f;
    v[n - 1] = 100.0f;
    kern_argmax_args ac = {0}, ag;
    ac.ld_x = ld;
    ac.rows = rows;
    ac.n = n;
    ag = ac;
    ac.x = side_bytes(x->cpu, v, (size_t)rows * ld * sizeof(float));
    ag.x = side_bytes(x->gpu, v, (size_t)rows * ld * sizeof(float));
    ac.out = side_alloc(x->cpu, (size_t)rows * sizeof(int32_t));
    ag.out = side_alloc(x->gpu, (size_t)rows * sizeof(int32_t));
    double e = run_both(x, fn_argmax, &ac, &ag);
    if (e == 0.0) {
        int32_t *ic = side_download(x->cpu, ac.out, (size_t)rows * sizeof(int32_t));
        int32_t *ig = side_download(x->gpu, ag.out, (size_t)rows * sizeof(int32_t));
        int mism = 0;
        for (int r = 0; r < rows; r++)
            mism += ic[r] != ig[r];
        if (mism)
            printf("      %d of %d rows differ (row 0: cpu %d cuda %d)\n", mism, rows, ic[0], ig[0]);
        e = mism ? 1.0 : 0.0;
        free(ic);
        free(ig);
    }
    perf_report(x->gpu->be, fn_argmax, &ag, (double)rows * n * 4, 0);
    free(v);
    return e;
}

/* upload_convert and download: F32/BF16/F16 host sources into BF16 and F32 device buffers. */
static double run_convert(run_ctx *x)
{
    const kcase *c = x->c;
    size_t n = (size_t)c->cols;
    float *f = host_rand(n, -70000.0f, 70000.0f, 0);
    for (size_t i = 0; i < n; i += 7)
        f[i] *= 1e-6f;
    uint16_t *hb = malloc(n * 2), *hh = malloc(n * 2);
    pd_err err;
    kern_convert_host(hb, KERN_DTYPE_BF16, f, KERN_DTYPE_F32, n, &err);
    for (size_t i = 0; i < n; i++)
        f[i] = i % 3 == 0 ? f[i] * 1e-4f : f[i];
    kern_convert_host(hh, KERN_DTYPE_F16, f, KERN_DTYPE_F32, n, &err);
    const struct { kern_dtype src, dst; const void *data; } cv[] = {
        {KERN_DTYPE_F32, KERN_DTYPE_BF16, f}, {KERN_DTYPE_BF16, KERN_DTYPE_BF16, hb},
        {KERN_DTYPE_F16, KERN_DTYPE_BF16, hh}, {KERN_DTYPE_F32, KERN_DTYPE_F32, f},
        {KERN_DTYPE_BF16, KERN_DTYPE_F32, hb}, {KERN_DTYPE_F16, KERN_DTYPE_F32, hh},
        {KERN_DTYPE_F32, KERN_DTYPE_F16, f},
    };
    double worst = 0.0;
    for (size_t i = 0; i < sizeof(cv) / sizeof(cv[0]); i++) {
        size_t dsz = kern_dtype_size(cv[i].dst);
        void *d = side_alloc(x->gpu, n * dsz);
        void *want = malloc(n * dsz);
        if (fatal_status(kern_upload_convert(x->gpu->be, d, cv[i].dst, cv[i].data, cv[i].src, n,
                                             &err), &err, "upload_convert"))
            return 1e30;
        kern_convert_host(want, cv[i].dst, cv[i].data, cv[i].src, n, &err);
        void *got = side_download(x->gpu, d, n * dsz);
        size_t diff = 0;
        for (size_t j = 0; j < n * dsz; j++)
            diff += ((unsigned char *)got)[j] != ((unsigned char *)want)[j];
        if (diff) {
            printf("      %s -> %s: %zu bytes differ from the host conversion\n",
                   kern_dtype_name(cv[i].src), kern_dtype_name(cv[i].dst), diff);
            worst = 1.0;
        }
        free(want);
        free(got);
    }
    free(f);
    free(hb);
    free(hh);
    return worst;
}

/* download_spans: c->rows spans of random sizes (c->cols the largest; sizes 0, 1, odd, 32 KB
 * pages, ring-sized and larger ones mixed in) at random places of a device buffer, each to its
 * own place of a host buffer; every byte must equal a whole-buffer download's, the gaps between
 * destinations untouched. upload_spans: as many of those as fit back to disjoint places of the
 * device buffer, the gaps untouched. --perf: the KV pages of one 2048-token sequence of
 * Qwen3-4B (36 layers x K, V x 128 pages of 32 KB, the pages scattered) each way, as one call
 * against one kern_download / kern_upload per page. Both for malloc'ed host memory and for the
 * backend's (kern_host_alloc: pinned on cuda), with one contiguous copy each way as the link's
 * ceiling there. */
/* host memory for the span tests: malloc'ed, or the backend's (pinned on cuda: spans moved in
 * place instead of through the ring) */
static void *spans_host(run_ctx *x, int pin, size_t bytes)
{
    if (!pin)
        return malloc(bytes);
    void *p = NULL;
    pd_err err;
    return fatal_status(kern_host_alloc(x->gpu->be, bytes, &p, &err), &err, "host_alloc") ? NULL : p;
}

static void spans_host_free(run_ctx *x, int pin, void *p)
{
    if (pin)
        kern_host_free(x->gpu->be, p);
    else
        free(p);
}

static double spans_case(run_ctx *x, int pin)
{
    const kcase *c = x->c;
    const int n = c->rows;
    const size_t dev_bytes = (size_t)24 << 20;
    unsigned char *h = malloc(dev_bytes);
    for (size_t i = 0; i < dev_bytes; i++)
        h[i] = (unsigned char)(rng_next() >> 56);
    unsigned char *d = side_bytes(x->gpu, h, dev_bytes);
    kern_copy_span *sp = malloc((size_t)n * sizeof(*sp));
    size_t *at = malloc((size_t)n * sizeof(*at)), host_bytes = 0;
    const size_t sizes[] = { 0, 1, 255, 256, 4097, 32768, 32768, 32768, (size_t)1 << 20, ((size_t)1 << 20) + 1 };
    for (int i = 0; i < n; i++) {
        size_t m = i % 499 == 5 ? (size_t)c->cols : sizes[rng_int((int)(sizeof(sizes) / sizeof(sizes[0])))];
        sp[i].n = m;
        sp[i].src = d + (size_t)rng_int((int)(dev_bytes - m + 1));
        at[i] = host_bytes;
        host_bytes += m + 16;   /* a 16-byte gap after each destination */
    }
    unsigned char *got = spans_host(x, pin, host_bytes);
    if (got == NULL)
        return 1e30;
    memset(got, 0xa5, host_bytes);
    for (int i = 0; i < n; i++)
        sp[i].dst = got + at[i];
    pd_err err;
    double e = 0.0;
    if (fatal_status(kern_download_spans(x->gpu->be, sp, n, &err), &err, "download_spans")) {
        e = 1e30;
    } else {
        size_t bad = 0;
        for (int i = 0; i < n; i++) {
            size_t off = (size_t)((const unsigned char *)sp[i].src - d);
            bad += memcmp(got + at[i], h + off, sp[i].n) != 0;
            for (int g = 0; g < 16; g++)
                bad += got[at[i] + sp[i].n + (size_t)g] != 0xa5;
        }
        if (bad > 0) {
            printf("      %zu spans or gaps differ\n", bad);
            e = 1.0;
        }
        /* upload_spans: the same sizes from the host buffer to disjoint places of the device
         * buffer (as many as fit), then the whole buffer back */
        int nu = 0;
        size_t off = 0;
        for (; nu < n && off + sp[nu].n <= dev_bytes; nu++) {
            sp[nu].src = got + at[nu];
            sp[nu].dst = d + off;
            off += sp[nu].n + 16;
        }
        if (fatal_status(kern_upload_spans(x->gpu->be, sp, nu, &err), &err, "upload_spans")) {
            e = 1e30;
        } else {
            unsigned char *back = side_download(x->gpu, d, dev_bytes);
            bad = 0;
            for (int i = 0; i < nu; i++)
                bad += memcmp((unsigned char *)sp[i].dst - d + back, sp[i].src, sp[i].n) != 0;
            for (size_t i = 0, o = 0; i < (size_t)nu; o += sp[i].n + 16, i++)
                for (int g = 0; g < 16 && o + sp[i].n + (size_t)g < dev_bytes; g++)
                    bad += back[o + sp[i].n + (size_t)g] != h[o + sp[i].n + (size_t)g];
            if (bad > 0) {
                printf("      upload: %zu of %d spans or gaps differ\n", bad, nu);
                e = 1.0;
            }
            free(back);
        }
    }
    if (opts.opt_perf && e == 0.0) {
        /* one sequence's pages: 72 layer halves x 128 pages of 32 KB, each from a random page
         * slot of the 24 MB buffer (a scattered pool) */
        const int halves = 72, pages = 128, np = halves * pages;
        const size_t pb = 32768;
        kern_copy_span *ps = malloc((size_t)np * sizeof(*ps));
        unsigned char *dst = spans_host(x, pin, (size_t)np * pb);
        int slots = (int)(dev_bytes / pb);
        for (int i = 0; i < np; i++)
            ps[i] = (kern_copy_span){ dst + (size_t)i * pb, d + (size_t)rng_int(slots) * pb, pb };
        double t[4][5];   /* download one by one, download_spans, upload one by one (then a
                           * sync: uploads may return before landing), upload_spans */
        for (int r = 0; r < 6; r++) {
            double t0 = test_now_s();
            for (int i = 0; i < np; i++)
                kern_download(x->gpu->be, ps[i].dst, ps[i].src, pb, &err);
            double t1 = test_now_s();
            kern_download_spans(x->gpu->be, ps, np, &err);
            double t2 = test_now_s();
            /* the same pages back (sources now host, destinations the device slots) */
            for (int i = 0; i < np; i++) {
                void *dv = (void *)ps[i].src;
                ps[i].src = ps[i].dst;
                ps[i].dst = dv;
            }
            for (int i = 0; i < np; i++)
                kern_upload(x->gpu->be, ps[i].dst, ps[i].src, pb, &err);
            kern_sync(x->gpu->be, &err);
            double t3 = test_now_s();
            kern_upload_spans(x->gpu->be, ps, np, &err);
            double t4 = test_now_s();
            for (int i = 0; i < np; i++) {
                void *hv = (void *)ps[i].src;
                ps[i].src = ps[i].dst;
                ps[i].dst = hv;
            }
            if (r > 0) {   /* the first is a warm-up */
                t[0][r - 1] = t1 - t0;
                t[1][r - 1] = t2 - t1;
                t[2][r - 1] = t3 - t2;
                t[3][r - 1] = t4 - t3;
            }
        }
        for (int k = 0; k < 4; k++)
            qsort(t[k], 5, sizeof(double), cmp_double);
        double bytes = (double)np * (double)pb;
        size_t used = strlen(perf_note);
        snprintf(perf_note + used, sizeof(perf_note) - used,
                 "      perf: %d pages of 32 KB (%.0f MB, %s host memory): download one each %.2f ms "
                 "(%.1f GB/s), download_spans %.2f ms (%.1f GB/s); upload one each %.2f ms (%.1f GB/s), "
                 "upload_spans %.2f ms (%.1f GB/s)\n", np, bytes / 1e6, pin ? "the backend's" : "malloc'ed",
                 t[0][2] * 1e3, bytes / t[0][2] * 1e-9,
                 t[1][2] * 1e3, bytes / t[1][2] * 1e-9, t[2][2] * 1e3, bytes / t[2][2] * 1e-9,
                 t[3][2] * 1e3, bytes / t[3][2] * 1e-9);
        if (pin) {
            /* the link's ceiling: the whole 24 MB buffer as one copy each way (pinned memory,
             * cudaMemcpyAsync), median of 5 */
            double cl[2][5];
            for (int r = 0; r < 6; r++) {
                double t0 = test_now_s();
                kern_download(x->gpu->be, dst, d, dev_bytes, &err);
                double t1 = test_now_s();
                kern_upload(x->gpu->be, d, dst, dev_bytes, &err);
                kern_sync(x->gpu->be, &err);
                double t2 = test_now_s();
                if (r > 0) {
                    cl[0][r - 1] = t1 - t0;
                    cl[1][r - 1] = t2 - t1;
                }
            }
            qsort(cl[0], 5, sizeof(double), cmp_double);
            qsort(cl[1], 5, sizeof(double), cmp_double);
            used = strlen(perf_note);
            snprintf(perf_note + used, sizeof(perf_note) - used,
                     "      perf: one copy of 24 MB, pinned host memory: to host %.1f GB/s, to the device "
                     "%.1f GB/s\n", (double)dev_bytes / cl[0][2] * 1e-9, (double)dev_bytes / cl[1][2] * 1e-9);
        }
        free(ps);
        spans_host_free(x, pin, dst);
    }
    free(h);
    free(sp);
    free(at);
    spans_host_free(x, pin, got);
    return e;
}

/* both kinds of host memory (malloc'ed: through the CUDA ring; the backend's: in place) */
static double run_download_spans(run_ctx *x)
{
    double a = spans_case(x, 0), b = spans_case(x, 1);
    return a > b ? a : b;
}

/* ---- paged KV: ragged batches -------------------------------------------------------------- */

/* spec: comma-separated sequences "K:CTX+N" (K: d decode, p prefill chunk, v verify block,
 * x non-causal draft block), optionally prefixed "R*" to repeat. Causal kinds (d, p, v) give
 * token i kv_len CTX+i+1; x gives every token CTX+N. */
typedef struct {
    int n_seq;
    char kind[MAX_SEQ];
    int ctx[MAX_SEQ], n[MAX_SEQ];
} batch_spec;

static int parse_spec(const char *s, batch_spec *b)
{
    b->n_seq = 0;
    while (*s) {
        int rep = 1, ctx, n, used = 0;
        char kind;
        if (sscanf(s, "%d*%n", &rep, &used) == 1 && used > 0)
            s += used;
        else
            rep = 1;
        if (sscanf(s, "%c:%d+%d%n", &kind, &ctx, &n, &used) != 3)
            return -1;
        s += used;
        for (int r = 0; r < rep; r++) {
            if (b->n_seq == MAX_SEQ)
                return -1;
            b->kind[b->n_seq] = kind;
            b->ctx[b->n_seq] = ctx;
            b->n[b->n_seq] = n;
            b->n_seq++;
        }
        if (*s == ',')
            s++;
    }
    return 0;
}

typedef struct {
    int n_tok, max_len, n_pages, pt_stride;
    int32_t *tok_seq, *tok_kv_len, *page_table;
} batch;

static void batch_build(const batch_spec *b, int page_size, batch *out)
{
    memset(out, 0, sizeof(*out));
    int total_pages = 0;
    for (int s = 0; s < b->n_seq; s++) {
        int len = b->ctx[s] + b->n[s];
        int np = (len + page_size - 1) / page_size;
        out->n_tok += b->n[s];
        total_pages += np;
        if (np + 1 > out->pt_stride)
            out->pt_stride = np + 1;
        if (len > out->max_len)
            out->max_len = len;
    }
    out->n_pages = total_pages + 3;    /* spare pages nobody references */
    int *perm = malloc((size_t)out->n_pages * sizeof(int));
    for (int i = 0; i < out->n_pages; i++)
        perm[i] = i;
    for (int i = out->n_pages - 1; i > 0; i--) {
        int j = rng_int(i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    out->tok_seq = malloc((size_t)out->n_tok * sizeof(int32_t));
    out->tok_kv_len = malloc((size_t)out->n_tok * sizeof(int32_t));
    out->page_table = malloc((size_t)b->n_seq * out->pt_stride * sizeof(int32_t));
    int t = 0, next = 0;
    for (int s = 0; s < b->n_seq; s++) {
        int len = b->ctx[s] + b->n[s];
        int np = (len + page_size - 1) / page_size;
        for (int p = 0; p < out->pt_stride; p++)
            out->page_table[s * out->pt_stride + p] = p < np ? perm[next++] : -1;
        for (int i = 0; i < b->n[s]; i++, t++) {
            out->tok_seq[t] = s;
            out->tok_kv_len[t] = b->kind[s] == 'x' ? len : b->ctx[s] + i + 1;
        }
    }
    free(perm);
}

static void batch_free(batch *b)
{
    free(b->tok_seq);
    free(b->tok_kv_len);
    free(b->page_table);
}

/* The ragged batch of an attention case's spec; -1 (after saying why) when the spec is bad */
static int case_batch(const kcase *c, batch_spec *bs, batch *b)
{
    if (parse_spec(c->spec, bs) != 0) {
        printf("      bad spec %s\n", c->spec);
        return -1;
    }
    batch_build(bs, c->page_size, b);
    return 0;
}

/* Uploads an attention case's cache, queries and batch tables to one backend (a->kv.dtype,
 * n_tok, n_seq and pt_stride already set). */
static void attn_upload(side *s, kern_attn_args *a, const float *k, const float *v, size_t cache_n,
                        const float *q, size_t qb, const batch *b)
{
    size_t ib = (size_t)a->n_tok * sizeof(int32_t);
    size_t pb = (size_t)a->n_seq * a->pt_stride * sizeof(int32_t);
    a->kv.k = side_conv(s, k, cache_n, a->kv.dtype);
    a->kv.v = side_conv(s, v, cache_n, a->kv.dtype);
    a->q = side_bytes(s, q, qb);
    a->tok_seq = side_bytes(s, b->tok_seq, ib);
    a->tok_kv_len = side_bytes(s, b->tok_kv_len, ib);
    a->page_table = side_bytes(s, b->page_table, pb);
}

static double run_attn(run_ctx *x)
{
    const kcase *c = x->c;
    batch_spec bs;
    batch b;
    if (case_batch(c, &bs, &b) != 0)
        return 1e30;
    int nh = c->n_heads, nkv = c->n_kv, hd = c->hd;
    size_t cache_n = (size_t)b.n_pages * c->page_size * nkv * hd;
    int ld_q = nh * hd + c->pad, ld_out = nh * hd + 2 * c->pad;
    float *k = host_rand(cache_n, -1.0f, 1.0f, 1);
    float *v = host_rand(cache_n, -1.0f, 1.0f, 1);
    /* larger queries make the softmax peaky, so wrong keys show */
    float *q = host_rand((size_t)b.n_tok * ld_q, -2.5f, 2.5f, 0);
    /* perf_only 2: too large for the CPU reference; timed on CUDA only, output checked finite */
    const int ref = c->perf_only != 2;
    kern_attn_args ac = {0}, ag;
    ac.kv.page_size = c->page_size;
    ac.kv.n_kv_heads = nkv;
    ac.kv.head_dim = hd;
    ac.ld_q = ld_q;
    ac.ld_out = ld_out;
    ac.n_tok = b.n_tok;
    ac.n_heads = nh;
    ac.pt_stride = b.pt_stride;
    ac.n_seq = bs.n_seq;
    ac.max_kv_len = b.max_len;
    ac.scale = 1.0f / sqrtf((float)hd);
    ag = ac;
    ac.kv.dtype = x->cpu->be->kv_dtype;
    ag.kv.dtype = x->gpu->be->kv_dtype;
    size_t qb = (size_t)b.n_tok * ld_q * sizeof(float);
    if (ref)
        attn_upload(x->cpu, &ac, k, v, cache_n, q, qb, &b);
    attn_upload(x->gpu, &ag, k, v, cache_n, q, qb, &b);
    double e;
    if (ref) {
        outbuf o = out_make(x->cpu, x->gpu, (size_t)b.n_tok * ld_out, NULL);
        ac.out = o.cpu;
        ag.out = o.gpu;
        e = run_both(x, fn_attn, &ac, &ag);
        if (e == 0.0)
            e = out_check(x->cpu, x->gpu, &o, "out", b.n_tok, nh * hd, ld_out);
    } else {
        size_t n_out = (size_t)b.n_tok * ld_out;
        ag.out = side_alloc(x->gpu, n_out * sizeof(float));
        pd_err err;
        e = 1e30;
        if (!fatal_status(fn_attn(x->gpu->be, &ag, &err), &err, "cuda op") &&
            !fatal_status(kern_sync(x->gpu->be, &err), &err, "cuda sync")) {
            float *h = side_download(x->gpu, ag.out, n_out * sizeof(float));
            size_t bad = 0;
            for (int t = 0; t < b.n_tok; t++)
                for (int i = 0; i < nh * hd; i++) {
                    float f = h[(size_t)t * ld_out + i];
                    bad += !(f == f && f > -2.0f && f < 2.0f);   /* |v| <= 1: a mean stays inside */
                }
            if (bad)
                printf("      %zu outputs not finite or outside [-2, 2] (no CPU reference)\n", bad);
            e = bad ? 1e30 : 0.0;
            free(h);
        }
    }
    if (opts.opt_perf) {
        /* bytes: each sequence's K/V prefix read once (the floor, whatever the kernel re-reads),
         * plus q and out; flops: QK^T and PV for every query row */
        double kv_bytes = 0.0, flops = 0.0;
        int seq_len[MAX_SEQ] = {0};
        for (int t = 0; t < b.n_tok; t++) {
            if (b.tok_kv_len[t] > seq_len[b.tok_seq[t]])
                seq_len[b.tok_seq[t]] = b.tok_kv_len[t];
            flops += 4.0 * b.tok_kv_len[t] * nh * hd;
        }
        for (int s = 0; s < bs.n_seq; s++)
            kv_bytes += 2.0 * seq_len[s] * nkv * hd * kern_dtype_size(ag.kv.dtype);
        double io = (double)b.n_tok * nh * hd * 8;
        snprintf(perf_note, sizeof(perf_note),
                 "      attn: %d tokens, %d sequences, max kv %d, %.1f MB of K/V\n", b.n_tok,
                 bs.n_seq, b.max_len, kv_bytes * 1e-6);
        perf_report(x->gpu->be, fn_attn, &ag, kv_bytes + io, flops);
    }
    free(k);
    free(v);
    free(q);
    batch_free(&b);
    return e;
}

/* kv_store: scatter bf16-exact rows into random slots; the whole cache must match exactly. */
static double run_kv_store(run_ctx *x)
{
    const kcase *c = x->c;
    int nkv = c->n_kv, hd = c->hd, ps = c->page_size, n_tok = c->rows;
    int row = nkv * hd, ld = row + c->pad;
    int n_pages = (n_tok + ps - 1) / ps + 2;
    size_t n_slots = (size_t)n_pages * ps, cache_n = n_slots * row;
    float *k = host_rand((size_t)n_tok * ld, -3.0f, 3.0f, 1);
    float *v = host_rand((size_t)n_tok * ld, -3.0f, 3.0f, 1);
    float *init = host_rand(cache_n + GUARD, -1.0f, 1.0f, 1);
    int32_t *slot = malloc((size_t)n_tok * sizeof(int32_t));
    int *perm = malloc(n_slots * sizeof(int));
    for (size_t i = 0; i < n_slots; i++)
        perm[i] = (int)i;
    for (size_t i = n_slots - 1; i > 0; i--) {
        size_t j = (size_t)rng_int((int)i + 1);
        int t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int i = 0; i < n_tok; i++)
        slot[i] = perm[i];
    kern_kv_store_args ac = {0}, ag;
    ac.kv.page_size = ps;
    ac.kv.n_kv_heads = nkv;
    ac.kv.head_dim = hd;
    ac.ld = ld;
    ac.n_tok = n_tok;
    ag = ac;
    ac.kv.dtype = x->cpu->be->kv_dtype;
    ag.kv.dtype = x->gpu->be->kv_dtype;
    ac.kv.k = side_conv(x->cpu, init, cache_n + GUARD, ac.kv.dtype);
    ac.kv.v = side_conv(x->cpu, init, cache_n + GUARD, ac.kv.dtype);
    ag.kv.k = side_conv(x->gpu, init, cache_n + GUARD, ag.kv.dtype);
    ag.kv.v = side_conv(x->gpu, init, cache_n + GUARD, ag.kv.dtype);
    size_t rb = (size_t)n_tok * ld * sizeof(float);
    ac.k = side_bytes(x->cpu, k, rb);
    ag.k = side_bytes(x->gpu, k, rb);
    ac.v = side_bytes(x->cpu, v, rb);
    ag.v = side_bytes(x->gpu, v, rb);
    ac.slot = side_bytes(x->cpu, slot, (size_t)n_tok * sizeof(int32_t));
    ag.slot = side_bytes(x->gpu, slot, (size_t)n_tok * sizeof(int32_t));
    double e = run_both(x, fn_kv_store, &ac, &ag);
    for (int kvi = 0; kvi < 2 && e == 0.0; kvi++) {
        size_t n = cache_n + GUARD;
        void *rc = side_download(x->cpu, kvi ? ac.kv.v : ac.kv.k, n * kern_dtype_size(ac.kv.dtype));
        void *rg = side_download(x->gpu, kvi ? ag.kv.v : ag.kv.k, n * kern_dtype_size(ag.kv.dtype));
        float *fc = malloc(n * sizeof(float)), *fg = malloc(n * sizeof(float));
        pd_err err;
        kern_convert_host(fc, KERN_DTYPE_F32, rc, ac.kv.dtype, n, &err);
        kern_convert_host(fg, KERN_DTYPE_F32, rg, ag.kv.dtype, n, &err);
        size_t diff = 0;
        for (size_t i = 0; i < n; i++)
            diff += fc[i] != fg[i];
        if (diff) {
            printf("      %s cache: %zu of %zu values differ\n", kvi ? "v" : "k", diff, n);
            e = 1.0;
        }
        free(rc);
        free(rg);
        free(fc);
        free(fg);
    }
    perf_report(x->gpu->be, fn_kv_store, &ag,
                (double)n_tok * row * 2 * (4 + kern_dtype_size(ag.kv.dtype)), 0);
    free(k);
    free(v);
    free(init);
    free(slot);
    free(perm);
    return e;
}

/* qk_post: c->rows tokens, heads/kv heads/head_dim, page size; c->sub bit 0: also store into the
 * paged cache (one token gets slot -1), bits 1-2: the RoPE scaling (case_scaling). q/k compared by rel L2 against the tolerance; the caches
 * (bf16 on CUDA, f32 on the CPU) by rel L2 over every value against 8e-3. */
/* The k and v caches of the two sides agree to bf16 storage precision (rel_l2 <= 8e-3) */
static int cache_same(run_ctx *x, const kern_kv_layer *kc, const kern_kv_layer *kg, size_t cache_n)
{
    int same = 1;
    for (int kvi = 0; kvi < 2; kvi++) {
        void *rc = side_download(x->cpu, kvi ? kc->v : kc->k, cache_n * kern_dtype_size(kc->dtype));
        void *rg = side_download(x->gpu, kvi ? kg->v : kg->k, cache_n * kern_dtype_size(kg->dtype));
        float *fc = malloc(cache_n * sizeof(float)), *fg = malloc(cache_n * sizeof(float));
        pd_err err;
        kern_convert_host(fc, KERN_DTYPE_F32, rc, kc->dtype, cache_n, &err);
        kern_convert_host(fg, KERN_DTYPE_F32, rg, kg->dtype, cache_n, &err);
        double num = 0.0, den = 0.0;
        for (size_t i = 0; i < cache_n; i++) {
            num += ((double)fc[i] - fg[i]) * ((double)fc[i] - fg[i]);
            den += (double)fc[i] * fc[i];
        }
        double ec = sqrt(num / (den > 0 ? den : 1));
        if (ec > 8e-3) {    /* a bf16 cache holds the values to ~4e-3 relative */
            printf("      %s cache: rel_l2 %.3e > 8e-3\n", kvi ? "v" : "k", ec);
            same = 0;
        }
        free(rc);
        free(rg);
        free(fc);
        free(fg);
    }
    return same;
}

static double run_qk_post(run_ctx *x)
{
    const kcase *c = x->c;
    int n_tok = c->rows, nh = c->n_heads, nkv = c->n_kv, hd = c->hd, ps = c->page_size;
    int ld_q = nh * hd + c->pad, ld_kv = nkv * hd + c->pad, row = nkv * hd, store = c->sub & 1;
    int n_pages = (n_tok + ps - 1) / ps + 1;
    size_t cache_n = (size_t)n_pages * ps * row;
    float *q = host_rand((size_t)n_tok * ld_q, -2.0f, 2.0f, 0);
    float *k = host_rand((size_t)n_tok * ld_kv, -2.0f, 2.0f, 0);
    float *v = host_rand((size_t)n_tok * ld_kv, -2.0f, 2.0f, 1);
    float *qn = host_rand((size_t)hd, 0.5f, 1.5f, 1), *kn = host_rand((size_t)hd, 0.5f, 1.5f, 1);
    float *init = host_rand(cache_n, -1.0f, 1.0f, 1);
    int32_t *pos = malloc((size_t)n_tok * sizeof(int32_t)), *slot = malloc((size_t)n_tok * sizeof(int32_t));
    for (int i = 0; i < n_tok; i++) {
        pos[i] = i == n_tok - 1 ? 40000 : rng_int(8192);
        slot[i] = i == 1 ? -1 : (int32_t)((i * 7 + 3) % (n_pages * ps));
    }
    for (int i = 0; i < n_tok; i++)            /* distinct slots */
        for (int j = 0; j < i; j++)
            if (slot[i] >= 0 && slot[i] == slot[j])
                slot[i] = -1;
    kern_qk_post_args ac = {0}, ag;
    ac.ld_q = ld_q;
    ac.ld_kv = ld_kv;
    ac.eps = 1e-6f;
    ac.n_tok = n_tok;
    ac.n_heads = nh;
    ac.n_kv_heads = nkv;
    ac.head_dim = hd;
    ac.theta = 1000000.0f;
    ac.scaling = case_scaling(c->sub >> 1);   /* sub: bit 0 stores into the cache, bits 1-2 the scaling */
    ag = ac;
    ac.q_norm = side_weight(x->cpu, qn, 1, hd);
    ag.q_norm = side_weight(x->gpu, qn, 1, hd);
    ac.k_norm = side_weight(x->cpu, kn, 1, hd);
    ag.k_norm = side_weight(x->gpu, kn, 1, hd);
    ac.pos = side_bytes(x->cpu, pos, (size_t)n_tok * 4);
    ag.pos = side_bytes(x->gpu, pos, (size_t)n_tok * 4);
    ac.v = side_bytes(x->cpu, v, (size_t)n_tok * ld_kv * 4);
    ag.v = side_bytes(x->gpu, v, (size_t)n_tok * ld_kv * 4);
    if (store) {
        ac.slot = side_bytes(x->cpu, slot, (size_t)n_tok * 4);
        ag.slot = side_bytes(x->gpu, slot, (size_t)n_tok * 4);
        kern_kv_layer kv = { .page_size = ps, .n_kv_heads = nkv, .head_dim = hd };
        ac.kv = ag.kv = kv;
        ac.kv.dtype = x->cpu->be->kv_dtype;
        ag.kv.dtype = x->gpu->be->kv_dtype;
        ac.kv.k = side_conv(x->cpu, init, cache_n, ac.kv.dtype);
        ac.kv.v = side_conv(x->cpu, init, cache_n, ac.kv.dtype);
        ag.kv.k = side_conv(x->gpu, init, cache_n, ag.kv.dtype);
        ag.kv.v = side_conv(x->gpu, init, cache_n, ag.kv.dtype);
    }
    outbuf oq = out_make(x->cpu, x->gpu, (size_t)n_tok * ld_q, q);
    outbuf ok = out_make(x->cpu, x->gpu, (size_t)n_tok * ld_kv, k);
    ac.q = oq.cpu;
    ag.q = oq.gpu;
    ac.k = ok.cpu;
    ag.k = ok.gpu;
    double e = run_both(x, fn_qk_post, &ac, &ag);
    double eq = e == 0.0 ? out_check(x->cpu, x->gpu, &oq, "q", n_tok, ld_q, ld_q) : 1e30;
    double ek = e == 0.0 ? out_check(x->cpu, x->gpu, &ok, "k", n_tok, ld_kv, ld_kv) : 1e30;
    e = eq > ek ? eq : ek;
    if (store && e < 1e29 && !cache_same(x, &ac.kv, &ag.kv, cache_n))
        e = 1e30;
    perf_report(x->gpu->be, fn_qk_post, &ag, (double)n_tok * (nh + 2 * nkv) * hd * 8, 0);
    free(oq.init);
    free(ok.init);
    free(q);
    free(k);
    free(v);
    free(qn);
    free(kn);
    free(init);
    free(pos);
    free(slot);
    return e;
}

/* qkv: the fused linear + qk_post of a layer's attention input, m tokens of hidden c->k;
 * c->n_heads q heads (0: k/v only), c->n_kv kv heads of c->hd; c->sub = 1 (store the cache) |
 * 4 (RMSNorm prologue). Checked: q, k, v and the cache. */
static double run_qkv(run_ctx *x)
{
    const kcase *c = x->c;
    int m = c->m, k = c->k, nh = c->n_heads, nkv = c->n_kv, hd = c->hd, ps = c->page_size;
    int ld_x = k + c->pad, ld_q = nh * hd + c->pad, ld_kv = nkv * hd + c->pad, row = nkv * hd;
    int nw = nh > 0 ? 3 : 2, n_pages = (m + ps - 1) / ps + 1;
    size_t cache_n = (size_t)n_pages * ps * row;
    float *xin = host_rand((size_t)m * ld_x, -1.0f, 1.0f, 0);
    float *nw_h = host_rand((size_t)k, 0.5f, 1.5f, 1);
    float *qn = host_rand((size_t)hd, 0.5f, 1.5f, 1), *kn = host_rand((size_t)hd, 0.5f, 1.5f, 1);
    float *init = host_rand(cache_n, -1.0f, 1.0f, 1);
    int32_t *pos = malloc((size_t)m * sizeof(int32_t)), *slot = malloc((size_t)m * sizeof(int32_t));
    for (int i = 0; i < m; i++) {
        pos[i] = rng_int(8192);
        slot[i] = i == 1 ? -1 : (int32_t)((i * 7 + 3) % (n_pages * ps));
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < i; j++)
            if (slot[i] >= 0 && slot[i] == slot[j])
                slot[i] = -1;
    kern_qkv_args ac, ag;
    memset(&ac, 0, sizeof(ac));
    ac.lin.ld_x = ld_x;
    ac.lin.m = m;
    ac.lin.k = k;
    ac.lin.eps = 1e-6f;
    ac.lin.n_w = nw;
    ac.lin.epilogue = KERN_LINEAR_STORE;
    ac.post.ld_q = ld_q;
    ac.post.ld_kv = ld_kv;
    ac.post.eps = 1e-6f;
    ac.post.n_tok = m;
    ac.post.n_heads = nh;
    ac.post.n_kv_heads = nkv;
    ac.post.head_dim = hd;
    ac.post.theta = 1000000.0f;
    ag = ac;
    side *sd[2] = { x->cpu, x->gpu };
    kern_qkv_args *av[2] = { &ac, &ag };
    outbuf o[3];
    int rows[3] = { nh * hd, row, row }, lds[3] = { ld_q, ld_kv, ld_kv };
    for (int i = 3 - nw; i < 3; i++)
        o[i] = out_make(x->cpu, x->gpu, (size_t)m * lds[i], NULL);
    for (int i = 3 - nw; i < 3; i++) {
        float *w = host_rand((size_t)rows[i] * k, -1.0f, 1.0f, 1);
        for (int b = 0; b < 2; b++) {
            kern_linear_args *l = &av[b]->lin;
            l->w[i - (3 - nw)] = side_weight(sd[b], w, rows[i], k);
            l->y[i - (3 - nw)] = b ? o[i].gpu : o[i].cpu;
            l->ld_y[i - (3 - nw)] = lds[i];
        }
        free(w);
    }
    for (int b = 0; b < 2; b++) {
        kern_qkv_args *a = av[b];
        a->lin.x = side_bytes(sd[b], xin, (size_t)m * ld_x * sizeof(float));
        if (c->sub & 4)
            a->lin.norm = side_weight(sd[b], nw_h, 1, k);
        a->post.q = nh > 0 ? (b ? o[0].gpu : o[0].cpu) : NULL;
        a->post.k = b ? o[1].gpu : o[1].cpu;
        a->post.v = b ? o[2].gpu : o[2].cpu;
        a->post.q_norm = side_weight(sd[b], qn, 1, hd);
        a->post.k_norm = side_weight(sd[b], kn, 1, hd);
        a->post.pos = side_bytes(sd[b], pos, (size_t)m * 4);
        if (c->sub & 1) {
            a->post.slot = side_bytes(sd[b], slot, (size_t)m * 4);
            kern_kv_layer kv = { .page_size = ps, .n_kv_heads = nkv, .head_dim = hd,
                                 .dtype = sd[b]->be->kv_dtype };
            kv.k = side_conv(sd[b], init, cache_n, kv.dtype);
            kv.v = side_conv(sd[b], init, cache_n, kv.dtype);
            a->post.kv = kv;
        }
    }
    double ran = run_both(x, fn_qkv, &ac, &ag), e = ran;
    static const char *const names[3] = { "q", "k", "v" };
    for (int i = 3 - nw; i < 3; i++) {
        double ei = ran == 0.0 ? out_check(x->cpu, x->gpu, &o[i], names[i], m, rows[i], lds[i]) : 1e30;
        free(o[i].init);
        if (ei > e || ei != ei)
            e = ei;
    }
    if ((c->sub & 1) && e < 1e29 && !cache_same(x, &ac.post.kv, &ag.post.kv, cache_n))
        e = 1e30;
    double wbytes = ((double)nh * hd + 2.0 * row) * k * 2;
    perf_report(x->gpu->be, fn_qkv, &ag, wbytes + (double)m * k * 4, 2.0 * m * wbytes / 2.0);
    free(xin);
    free(nw_h);
    free(qn);
    free(kn);
    free(init);
    free(pos);
    free(slot);
    return e;
}

/* attn_block: a layer's attention half (qkv with the input norm and the cache store, attention,
 * o projection) on the ragged batch c->spec (new tokens at positions ctx.., the context keys
 * from a random cache), hidden c->k, c->n_heads / c->n_kv heads of c->hd, c->pad extra row
 * stride on q/o; c->sub 1: o accumulates into y. Checked: y and the cache against the CPU, then
 * the same op on CUDA against the three ops it stands for on CUDA (kern_qkv, kern_attn,
 * kern_linear), which must give y and the cache bit for bit. */
static double run_attn_block(run_ctx *x)
{
    const kcase *c = x->c;
    batch_spec bs;
    batch b;
    if (case_batch(c, &bs, &b) != 0)
        return 1e30;
    const int m = b.n_tok, k = c->k, nh = c->n_heads, nkv = c->n_kv, hd = c->hd, ps = c->page_size;
    const int qd = nh * hd, row = nkv * hd, ld_q = qd + c->pad, ld_kv = row;
    size_t cache_n = (size_t)b.n_pages * ps * row;
    float *xin = host_rand((size_t)m * k, -1.0f, 1.0f, 0);
    float *yin = host_rand((size_t)m * k, -1.0f, 1.0f, 1);
    float *nw_h = host_rand((size_t)k, 0.5f, 1.5f, 1);
    float *qn = host_rand((size_t)hd, 0.5f, 1.5f, 1), *kn = host_rand((size_t)hd, 0.5f, 1.5f, 1);
    float *init = host_rand(cache_n, -1.0f, 1.0f, 1);
    float *wh[4];
    int wr[4] = { qd, row, row, k }, wc[4] = { k, k, k, qd };
    for (int i = 0; i < 4; i++)
        wh[i] = host_rand((size_t)wr[i] * wc[i], -0.2f, 0.2f, 1);
    int32_t *pos = malloc((size_t)m * sizeof(int32_t)), *slot = malloc((size_t)m * sizeof(int32_t));
    for (int t = 0; t < m; t++) {
        int s = b.tok_seq[t], p = b.tok_kv_len[t] - 1;
        if (bs.kind[s] == 'x') {   /* non-causal block: position from the token's index in it */
            int first = t;
            while (first > 0 && b.tok_seq[first - 1] == s)
                first--;
            p = bs.ctx[s] + (t - first);
        }
        pos[t] = p;
        slot[t] = b.page_table[s * b.pt_stride + p / ps] * ps + p % ps;
    }
    kern_attn_block_args ab[2];
    side *sd[2] = { x->cpu, x->gpu };
    outbuf oy = out_make(x->cpu, x->gpu, (size_t)m * k, yin);
    float *scratch[2][4];
    for (int sI = 0; sI < 2; sI++) {
        side *d = sd[sI];
        kern_attn_block_args *a = &ab[sI];
        memset(a, 0, sizeof(*a));
        kern_kv_layer kv = { .page_size = ps, .n_kv_heads = nkv, .head_dim = hd, .dtype = d->be->kv_dtype };
        kv.k = side_conv(d, init, cache_n, kv.dtype);
        kv.v = side_conv(d, init, cache_n, kv.dtype);
        scratch[sI][0] = side_alloc(d, (size_t)m * ld_q * sizeof(float));    /* q */
        scratch[sI][1] = side_alloc(d, (size_t)m * ld_kv * sizeof(float));   /* k */
        scratch[sI][2] = side_alloc(d, (size_t)m * ld_kv * sizeof(float));   /* v */
        scratch[sI][3] = side_alloc(d, (size_t)m * ld_q * sizeof(float));    /* attention out */
        kern_linear_args *l = &a->qkv.lin;
        l->x = side_bytes(d, xin, (size_t)m * k * sizeof(float));
        l->ld_x = k;
        l->m = m;
        l->k = k;
        l->norm = side_weight(d, nw_h, 1, k);
        l->eps = 1e-6f;
        l->n_w = 3;
        for (int i = 0; i < 3; i++) {
            l->w[i] = side_weight(d, wh[i], wr[i], wc[i]);
            l->y[i] = scratch[sI][i];
            l->ld_y[i] = i == 0 ? ld_q : ld_kv;
        }
        l->epilogue = KERN_LINEAR_STORE;
        kern_qk_post_args *p = &a->qkv.post;
        p->q = scratch[sI][0];
        p->ld_q = ld_q;
        p->k = scratch[sI][1];
        p->v = scratch[sI][2];
        p->ld_kv = ld_kv;
        p->q_norm = side_weight(d, qn, 1, hd);
        p->k_norm = side_weight(d, kn, 1, hd);
        p->eps = 1e-6f;
        p->n_tok = m;
        p->n_heads = nh;
        p->n_kv_heads = nkv;
        p->head_dim = hd;
        p->pos = side_bytes(d, pos, (size_t)m * 4);
        p->theta = 1000000.0f;
        p->kv = kv;
        p->slot = side_bytes(d, slot, (size_t)m * 4);
        kern_attn_args *at = &a->attn;
        at->kv = kv;
        at->q = scratch[sI][0];
        at->ld_q = ld_q;
        at->out = scratch[sI][3];
        at->ld_out = ld_q;
        at->n_tok = m;
        at->n_heads = nh;
        at->tok_seq = side_bytes(d, b.tok_seq, (size_t)m * 4);
        at->tok_kv_len = side_bytes(d, b.tok_kv_len, (size_t)m * 4);
        at->page_table = side_bytes(d, b.page_table, (size_t)bs.n_seq * b.pt_stride * 4);
        at->pt_stride = b.pt_stride;
        at->n_seq = bs.n_seq;
        at->max_kv_len = b.max_len;
        at->scale = 1.0f / sqrtf((float)hd);
        kern_linear_args *o = &a->o;
        o->x = scratch[sI][3];
        o->ld_x = ld_q;
        o->m = m;
        o->k = qd;
        o->n_w = 1;
        o->w[0] = side_weight(d, wh[3], wr[3], wc[3]);
        o->y[0] = sI ? oy.gpu : oy.cpu;
        o->ld_y[0] = k;
        o->epilogue = (c->sub & 1) ? KERN_LINEAR_ACCUMULATE : KERN_LINEAR_STORE;
    }
    double e = run_both(x, fn_attn_block, &ab[0], &ab[1]);
    float *y_op = e == 0.0 ? side_download(x->gpu, oy.gpu, (size_t)m * k * sizeof(float)) : NULL;
    if (e == 0.0)
        e = out_check(x->cpu, x->gpu, &oy, "y", m, k, k);
    if (e < 1e29 && !cache_same(x, &ab[0].qkv.post.kv, &ab[1].qkv.post.kv, cache_n))
        e = 1e30;
    if (e < 1e29) {
        /* the three ops on CUDA from the same inputs into a fresh y and cache */
        kern_attn_block_args a3 = ab[1];
        kern_kv_layer kv = a3.attn.kv;
        kv.k = side_conv(x->gpu, init, cache_n, kv.dtype);
        kv.v = side_conv(x->gpu, init, cache_n, kv.dtype);
        a3.qkv.post.kv = a3.attn.kv = kv;
        a3.o.y[0] = side_bytes(x->gpu, yin, (size_t)m * k * sizeof(float));
        pd_err err;
        kern_backend *be = x->gpu->be;
        if (fatal_status(kern_qkv(be, &a3.qkv, &err), &err, "cuda qkv") ||
            fatal_status(kern_attn(be, &a3.attn, &err), &err, "cuda attn") ||
            fatal_status(kern_linear(be, &a3.o, &err), &err, "cuda linear") ||
            fatal_status(kern_sync(be, &err), &err, "cuda sync")) {
            e = 1e30;
        } else {
            float *y3 = side_download(x->gpu, a3.o.y[0], (size_t)m * k * sizeof(float));
            size_t cb = cache_n * kern_dtype_size(kv.dtype);
            int same = memcmp(y3, y_op, (size_t)m * k * sizeof(float)) == 0;
            if (!same)
                printf("      y differs from kern_qkv + kern_attn + kern_linear on CUDA\n");
            for (int kvi = 0; kvi < 2; kvi++) {
                void *c1 = side_download(x->gpu, kvi ? ab[1].attn.kv.v : ab[1].attn.kv.k, cb);
                void *c3 = side_download(x->gpu, kvi ? kv.v : kv.k, cb);
                if (memcmp(c1, c3, cb) != 0) {
                    printf("      %s cache differs from kern_qkv's on CUDA\n", kvi ? "v" : "k");
                    same = 0;
                }
                free(c1);
                free(c3);
            }
            e = same ? e : 1e30;
            free(y3);
        }
    }
    if (opts.opt_perf) {
        double wbytes = 0.0, flops = 0.0;
        for (int i = 0; i < 4; i++)
            wbytes += (double)wr[i] * wc[i] * 2;
        for (int t = 0; t < m; t++)
            flops += 4.0 * b.tok_kv_len[t] * qd;
        perf_report(x->gpu->be, fn_attn_block, &ab[1], wbytes + (double)m * k * 8,
                    flops + 2.0 * m * wbytes / 2.0);
    }
    free(y_op);
    free(xin);
    free(yin);
    free(nw_h);
    free(qn);
    free(kn);
    free(init);
    for (int i = 0; i < 4; i++)
        free(wh[i]);
    free(pos);
    free(slot);
    batch_free(&b);
    return e;
}

/* markov_step: c->rows rows, V = c->n, R = c->k; base has 2 rows + 1 per row, picked scattered.
 * vec is bf16-valued so both sides see the same inputs; ids must match (a mismatch is allowed
 * only between values equal within 1e-6 relative on the CPU side). */
static double run_markov_step(run_ctx *x)
{
    const kcase *c = x->c;
    int n = c->rows, V = c->n, R = c->k, nbase = n + 2, ld = V + c->pad;
    float *base = host_rand((size_t)nbase * ld, -3.0f, 3.0f, 0);
    float *w2 = host_rand((size_t)V * R, -0.5f, 0.5f, 1);
    float *vec = host_rand((size_t)n * (R + c->pad), -1.0f, 1.0f, 1);
    int32_t *rows = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++)
        rows[i] = (i * 5 + 1) % nbase;
    kern_markov_step_args ac = {0}, ag;
    ac.ld_base = ld;
    ac.ld_vec = R + c->pad;
    ac.n = n;
    ac.ld_step = ld;
    ag = ac;
    ac.base = side_bytes(x->cpu, base, (size_t)nbase * ld * 4);
    ag.base = side_bytes(x->gpu, base, (size_t)nbase * ld * 4);
    ac.rows = side_bytes(x->cpu, rows, (size_t)n * 4);
    ag.rows = side_bytes(x->gpu, rows, (size_t)n * 4);
    ac.w2 = side_weight(x->cpu, w2, V, R);
    ag.w2 = side_weight(x->gpu, w2, V, R);
    ac.vec = side_bytes(x->cpu, vec, (size_t)n * (R + c->pad) * 4);
    ag.vec = side_bytes(x->gpu, vec, (size_t)n * (R + c->pad) * 4);
    ac.ids = side_alloc(x->cpu, (size_t)n * 4);
    ag.ids = side_alloc(x->gpu, (size_t)n * 4);
    outbuf o = out_make(x->cpu, x->gpu, (size_t)n * ld, NULL);
    ac.step = o.cpu;
    ag.step = o.gpu;
    double e = run_both(x, fn_markov_step, &ac, &ag);
    float *hs = e == 0.0 ? side_download(x->cpu, o.cpu, (size_t)n * ld * 4) : NULL;
    if (e == 0.0)
        e = out_check(x->cpu, x->gpu, &o, "step", n, V, ld);
    if (hs != NULL) {
        int32_t *ic = side_download(x->cpu, ac.ids, (size_t)n * 4), *ig = side_download(x->gpu, ag.ids, (size_t)n * 4);
        for (int r = 0; r < n; r++) {
            const float *sr = hs + (size_t)r * ld;
            if (ic[r] != ig[r] && (ig[r] < 0 || ig[r] >= V ||
                                   fabs((double)sr[ig[r]] - sr[ic[r]]) > 1e-6 * fabs((double)sr[ic[r]]))) {
                printf("      row %d: argmax cpu %d (%g) cuda %d\n", r, ic[r], (double)sr[ic[r]], ig[r]);
                e = 1e30;
            }
        }
        free(ic);
        free(ig);
        free(hs);
    }
    if (o.init != NULL)
        free(o.init);
    perf_report(x->gpu->be, fn_markov_step, &ag, (double)V * R * 2 + (double)n * V * 8, 2.0 * n * V * R);
    free(base);
    free(w2);
    free(vec);
    free(rows);
    return e;
}

/* ---- sampling ops ------------------------------------------------------------------------- */

static pd_status fn_probs(kern_backend *be, const void *a, pd_err *e) { return kern_probs(be, a, e); }
static pd_status fn_sample(kern_backend *be, const void *a, pd_err *e) { return kern_sample(be, a, e); }
static pd_status fn_spec_verify(kern_backend *be, const void *a, pd_err *e) { return kern_spec_verify(be, a, e); }
static pd_status fn_penalty(kern_backend *be, const void *a, pd_err *e) { return kern_penalty(be, a, e); }

/* The sampling parameters of row r of a case: every kind (greedy, plain, top-k, top-p, both,
 * k = 1, k above n, min-p alone and with the others, typical-p alone, with each of the others,
 * tiny (one token) and 1 (off), low and high temperature) in turn; 24 kinds. */
static kern_sample_cfg case_cfg(int r, int n)
{
    static const kern_sample_cfg kinds[] = {
        {0.0f, 0, 1.0f, 0.0f, 0.0f},    {1.0f, 0, 1.0f, 0.0f, 0.0f},     {0.7f, 50, 1.0f, 0.0f, 0.0f},
        {1.3f, 0, 0.9f, 0.0f, 0.0f},    {0.8f, 200, 0.95f, 0.0f, 0.0f},  {1.0f, 1, 1.0f, 0.0f, 0.0f},
        {2.0f, 0, 0.5f, 0.0f, 0.0f},    {0.5f, -1, 1.0f, 0.0f, 0.0f},    {1.0f, -2, 0.999f, 0.0f, 0.0f},
        {0.05f, 0, 0.9f, 0.0f, 0.0f},   {1.0f, 7, 0.3f, 0.0f, 0.0f},     {0.9f, 1000, 0.99f, 0.0f, 0.0f},
        {1.0f, 0, 1.0f, 0.05f, 0.0f},   {1.5f, 100, 0.9f, 0.01f, 0.0f},  {0.8f, 0, 0.95f, 0.2f, 0.0f},
        {2.0f, 30, 1.0f, 0.5f, 0.0f},   {1.0f, 0, 1.0f, 0.0f, 0.9f},     {1.2f, 0, 1.0f, 0.0f, 0.2f},
        {0.7f, 50, 1.0f, 0.0f, 0.5f},   {1.3f, 0, 0.9f, 0.0f, 0.95f},    {1.0f, 0, 1.0f, 0.05f, 0.7f},
        {0.8f, 200, 0.95f, 0.01f, 0.8f}, {2.0f, 0, 1.0f, 0.0f, 1e-6f},   {1.5f, 0, 1.0f, 0.0f, 1.0f},
    };
    kern_sample_cfg c = kinds[r % (int)(sizeof(kinds) / sizeof(kinds[0]))];
    if (c.top_k == -1)
        c.top_k = n - 1;
    else if (c.top_k == -2)
        c.top_k = n + 5;
    return c;
}

/* Logits rows like a language model's: a flat bulk with a few strong tokens; odd rows are
 * coarse (multiples of 0.5) so that probabilities tie, also at the top-k / top-p boundary. */
static float *sample_logits(int rows, int n, int ld)
{
    float *v = host_rand((size_t)rows * ld, -4.0f, 4.0f, 0);
    for (int r = 0; r < rows; r++) {
        float *x = v + (size_t)r * ld;
        for (int t = 0; t < 8; t++)
            x[rng_int(n)] += 6.0f + (float)t;
        if (r % 2 == 1)
            for (int i = 0; i < n; i++)
                x[i] = (float)(int)(x[i] * 2.0f) * 0.5f;
    }
    return v;
}

/* Sampling parameters every row of a case shares (probs, sub >> 3): Qwen3's generation_config
 * defaults (the engine applies them by default), top-p, min-p and typical-p alone, greedy. */
static const kern_sample_cfg probs_presets[] = {
    {0.0f, 0, 1.0f, 0.0f, 0.0f},   /* 0: none, rows cycle through case_cfg */
    {0.6f, 20, 0.95f, 0.0f, 0.0f}, {1.0f, 0, 0.9f, 0.0f, 0.0f}, {1.0f, 0, 1.0f, 0.05f, 0.0f},
    {1.0f, 0, 1.0f, 0.0f, 0.9f},   {0.0f, 0, 1.0f, 0.0f, 0.0f},
};
static const char *const probs_preset_names[] = {"", " qwen3 (T .6 k 20 p .95)", " top_p .9", " min_p .05",
                                                 " typical_p .9", " greedy"};
#define N_PROBS_PRESETS ((int)(sizeof(probs_presets) / sizeof(probs_presets[0])))

/* Rows at the filters' edges (probs sub 2), kind r % 9 of a row from sample_logits: a NaN (never
 * at index 0, where the CPU's argmax starts), a +inf, all -inf, 90 % masked to -inf, three
 * values only (ties everywhere, also at every cut), all equal, one dominant token, two tied
 * dominant tokens, the plain row. */
static void special_logits(float *x, int n, int kind)
{
    switch (kind) {
    case 0:
        x[n > 1 ? 1 + rng_int(n - 1) : 0] = NAN;
        break;
    case 1:
        x[rng_int(n)] = INFINITY;
        break;
    case 2:
        for (int i = 0; i < n; i++)
            x[i] = -INFINITY;
        break;
    case 3: {
        int keep = rng_int(n);
        for (int i = 0; i < n; i++)
            if (i != keep && rng_int(10) < 9)
                x[i] = -INFINITY;
        break;
    }
    case 4:
        for (int i = 0; i < n; i++)
            x[i] = 0.5f * (float)rng_int(3);
        break;
    case 5:
        for (int i = 0; i < n; i++)
            x[i] = 0.25f;
        break;
    case 6:
        x[rng_int(n)] = 40.0f;
        break;
    case 7: {
        int t1 = rng_int(n), t2 = rng_int(n);
        x[t1] = x[t2] = 20.0f;
        break;
    }
    default:
        break;
    }
}

/* 1 when the softmax of row x is NaN everywhere (a NaN or +inf logit, or nothing but -inf),
 * which the reference leaves undefined past the softmax (its sort meets NaN) */
static int probs_nan_row(const float *x, int n)
{
    int finite_or_minf = 0;
    for (int i = 0; i < n; i++) {
        if (x[i] != x[i] || x[i] == INFINITY)
            return 1;
        finite_or_minf += x[i] != -INFINITY;
    }
    return finite_or_minf == 0;
}

static int probs_filters_on(const kern_sample_cfg *c, int n)
{
    return (c->top_k > 0 && c->top_k < n) || c->top_p < 1.0f || c->min_p > 0.0f ||
           (c->typical_p > 0.0f && c->typical_p < 1.0f);
}

/* The distance of two non-negative floats in ulps (their bits are ordered as their values) */
static long long ulp_dist(float a, float b)
{
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    return ua > ub ? (long long)(ua - ub) : (long long)(ub - ua);
}

/* probs: rows x n logits (pad = extra stride of x and out); sub 1 = rows gathered through idx,
 * sub 2 = special_logits rows (row r of kind r % 9 with parameters case_cfg(5 (r / 9) + r % 9):
 * at 216 rows every kind meets every parameter set), sub >> 3 = a probs_presets entry for all
 * rows (else they cycle through case_cfg). Checks, besides the relative error: the same tokens
 * survive on both sides; every probability equals the CPU's or is within 4 ulps of it (a sum
 * of 10^5 doubles in another order moves a float by an ulp now and then; the count is
 * printed); a greedy row is one-hot at the host argmax (kern_argmax's rule); a row whose
 * softmax is NaN is NaN everywhere on CUDA without a filter and 0 everywhere with one (the CPU
 * side runs such rows without filters: its sort is undefined on NaN); row padding and guards
 * untouched; and each row computed again alone (other cluster sizes, kern_cuda_sample.cu) is
 * bit-equal to its row in the batch. */
static double run_probs(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, n = c->cols, ld = n + c->pad, n_src = c->sub & 1 ? rows + 3 : rows;
    int special = c->sub & 2, preset = c->sub >> 3;
    float *v = sample_logits(n_src, n, ld);
    kern_sample_cfg *cfg = malloc((size_t)rows * sizeof(*cfg)), *cfg_cpu = malloc((size_t)rows * sizeof(*cfg));
    int32_t *idx = malloc((size_t)rows * sizeof(int32_t));
    int *nan_row = calloc((size_t)rows, sizeof(int));
    for (int r = 0; r < rows; r++) {
        idx[r] = (r * 7 + 2) % n_src;
        cfg[r] = preset > 0 && preset < N_PROBS_PRESETS ? probs_presets[preset]
                 : special                              ? case_cfg(5 * (r / 9) + r % 9, n)
                                                        : case_cfg(r, n);
    }
    if (special)
        for (int r = 0; r < n_src; r++)
            special_logits(v + (size_t)r * ld, n, r % 9);
    for (int r = 0; r < rows; r++) {
        const float *xr = v + (size_t)(c->sub & 1 ? idx[r] : r) * ld;
        cfg_cpu[r] = cfg[r];
        nan_row[r] = cfg[r].temperature >= 1e-5f && probs_nan_row(xr, n);
        if (nan_row[r])
            cfg_cpu[r] = (kern_sample_cfg){cfg[r].temperature, 0, 1.0f, 0.0f, 0.0f};
    }
    kern_probs_args ac = {0}, ag;
    ac.ld_x = ld;
    ac.rows = rows;
    ac.n = n;
    ac.ld_out = ld;
    ag = ac;
    ac.x = side_bytes(x->cpu, v, (size_t)n_src * ld * 4);
    ag.x = side_bytes(x->gpu, v, (size_t)n_src * ld * 4);
    ac.cfg = side_bytes(x->cpu, cfg_cpu, (size_t)rows * sizeof(*cfg));
    ag.cfg = side_bytes(x->gpu, opts.opt_self ? cfg_cpu : cfg, (size_t)rows * sizeof(*cfg));
    if (c->sub & 1) {
        ac.idx = side_bytes(x->cpu, idx, (size_t)rows * 4);
        ag.idx = side_bytes(x->gpu, idx, (size_t)rows * 4);
    }
    outbuf o = out_make(x->cpu, x->gpu, (size_t)rows * ld, NULL);
    ac.out = o.cpu;
    ag.out = o.gpu;
    /* perf_only 2: timed on CUDA only, nothing compared */
    pd_err perr;
    double e = c->perf_only == 2 ? (fatal_status(kern_probs(x->gpu->be, &ag, &perr), &perr, "cuda op") ? 1e30 : 0.0)
                                 : run_both(x, fn_probs, &ac, &ag);
    float *hc = e == 0.0 && c->perf_only != 2 ? side_download(x->cpu, o.cpu, o.n_total * 4) : NULL;
    float *hg = e == 0.0 && c->perf_only != 2 ? side_download(x->gpu, o.gpu, o.n_total * 4) : NULL;
    double num = 0.0, den = 0.0;
    long long n_diff = 0, max_ulp = 0;
    for (size_t i = (size_t)rows * ld; hc != NULL && i < o.n_total; i++)
        if (memcmp(&hc[i], &o.init[i], 4) != 0 || memcmp(&hg[i], &o.init[i], 4) != 0) {
            printf("      guard %zu written\n", i - (size_t)rows * ld);
            e = 1e30;
            break;
        }
    for (int r = 0; hc != NULL && r < rows; r++) {
        const float *pc = hc + (size_t)r * ld, *pg = hg + (size_t)r * ld;
        const float *xr = v + (size_t)(c->sub & 1 ? idx[r] : r) * ld;
        for (int i = n; i < ld; i++)
            if (memcmp(&pc[i], &o.init[(size_t)r * ld + i], 4) != 0 ||
                memcmp(&pg[i], &o.init[(size_t)r * ld + i], 4) != 0) {
                printf("      row %d: padding %d written\n", r, i - n);
                e = 1e30;
                break;
            }
        if (nan_row[r] && opts.opt_self)
            continue;
        if (nan_row[r]) {
            /* the CUDA rule (the reference has none past the softmax): NaN everywhere without a
             * filter, 0 everywhere with one */
            int filt = probs_filters_on(&cfg[r], n), bad = 0;
            for (int i = 0; i < n; i++)
                bad += filt ? !(pg[i] == 0.0f) : pg[i] == pg[i];
            if (bad) {
                printf("      row %d (NaN softmax, filters %s): %d entries are not %s\n", r, filt ? "on" : "off", bad,
                       filt ? "0" : "NaN");
                e = 1e30;
            }
            continue;
        }
        int kept_c = 0, kept_g = 0, differ = 0, first = -1, nans = 0;
        for (int i = 0; i < n; i++) {
            kept_c += pc[i] > 0.0f;
            kept_g += pg[i] > 0.0f;
            if ((pc[i] > 0.0f) != (pg[i] > 0.0f) && differ++ == 0)
                first = i;
            if (pc[i] != pc[i] || pg[i] != pg[i]) {
                nans++;
                continue;
            }
            if (memcmp(&pc[i], &pg[i], 4) != 0) {
                long long d = ulp_dist(pc[i], pg[i]);
                n_diff++;
                max_ulp = d > max_ulp ? d : max_ulp;
            }
            double dd = (double)pg[i] - (double)pc[i];
            num += dd * dd;
            den += (double)pc[i] * pc[i];
        }
        if (differ) {
            printf("      row %d (T %g k %d p %g min_p %g typical_p %g): %d tokens kept on one side only "
                   "(cpu %d, cuda %d; first %d: cpu %g cuda %g)\n", r, (double)cfg[r].temperature, cfg[r].top_k,
                   (double)cfg[r].top_p, (double)cfg[r].min_p, (double)cfg[r].typical_p, differ, kept_c, kept_g,
                   first, (double)pc[first], (double)pg[first]);
            e = 1e30;
        }
        if (nans) {
            printf("      row %d: %d NaN probabilities\n", r, nans);
            e = 1e30;
        }
        if (cfg[r].temperature < 1e-5f) {
            int best = 0;
            for (int i = 1; i < n; i++)
                if (xr[i] > xr[best])
                    best = i;
            if (pg[best] != 1.0f || kept_g != 1) {
                printf("      greedy row %d: cuda is not one-hot at the argmax %d\n", r, best);
                e = 1e30;
            }
        }
    }
    if (n_diff > 0)
        printf("      %lld of %lld probabilities differ from the cpu's, by %lld ulp at most\n", n_diff,
               (long long)rows * n, max_ulp);
    if (max_ulp > 4)
        e = 1e30;
    if (hc != NULL && e == 0.0)
        e = sqrt(num) / (den > 1e-30 ? sqrt(den) : 1e-15);
    /* each row again alone: bit-equal to the batch's (on CUDA the row then spreads over a
     * cluster of CTAs; in the batch, depending on the rows, over fewer) */
    if (hg != NULL && !opts.opt_self && !c->perf_only) {
        float *one = side_alloc(x->gpu, (size_t)n * 4);
        int bad_rows = 0;
        for (int r = 0; r < rows; r++) {
            kern_probs_args a1 = ag;
            a1.rows = 1;
            a1.cfg = ag.cfg + r;
            if (ag.idx != NULL)
                a1.idx = ag.idx + r;
            else
                a1.x = ag.x + (size_t)r * ld;
            a1.out = one;
            a1.ld_out = n;
            pd_err err;
            if (fatal_status(kern_probs(x->gpu->be, &a1, &err), &err, "cuda probs, one row")) {
                e = 1e30;
                break;
            }
            float *h1 = side_download(x->gpu, one, (size_t)n * 4);
            if (memcmp(h1, hg + (size_t)r * ld, (size_t)n * 4) != 0 && bad_rows++ == 0)
                printf("      row %d alone differs from the batch's\n", r);
            free(h1);
        }
        if (bad_rows) {
            printf("      %d of %d rows alone differ from the batch's\n", bad_rows, rows);
            e = 1e30;
        }
    }
    /* captured in a CUDA graph (a launch neither syncs nor allocates): the same bits */
    if (hg != NULL && kern_backend_stream(x->gpu->be) != NULL && !c->perf_only) {
        kern_probs_args a2 = ag;
        a2.out = side_alloc(x->gpu, (size_t)rows * ld * 4);
        void *graph = NULL;
        pd_err err;
        pd_status st = kern_graph_begin(x->gpu->be, &err);
        if (st == PD_OK) {
            pd_status st2 = kern_probs(x->gpu->be, &a2, &err);
            pd_err eerr;
            st = kern_graph_end(x->gpu->be, &graph, &eerr);
            if (st2 != PD_OK)
                st = st2;
            else if (st != PD_OK)
                err = eerr;
        }
        if (st == PD_OK)
            st = kern_graph_launch(x->gpu->be, graph, &err);
        if (st == PD_OK)
            st = kern_sync(x->gpu->be, &err);
        if (fatal_status(st, &err, "cuda probs in a graph")) {
            e = 1e30;
        } else {
            float *h2 = side_download(x->gpu, a2.out, (size_t)rows * ld * 4);
            for (int r = 0; r < rows; r++)
                if (memcmp(h2 + (size_t)r * ld, hg + (size_t)r * ld, (size_t)n * 4) != 0) {
                    printf("      row %d from a graph replay differs from the eager launch's\n", r);
                    e = 1e30;
                    break;
                }
            free(h2);
        }
        kern_graph_free(x->gpu->be, graph);
    }
    free(o.init);
    perf_report(x->gpu->be, fn_probs, &ag, (double)rows * n * 8, 0);
    perf_graph(x->gpu->be, fn_probs, &ag, (double)rows * n * 8);
    free(hc);
    free(hg);
    free(v);
    free(cfg);
    free(cfg_cpu);
    free(idx);
    free(nan_row);
    return e;
}

/* The running-sum interval [lo, hi) of token t in a probability row (entries <= 0 skipped). */
static void cdf_interval(const float *p, int t, double *lo, double *hi)
{
    double cum = 0.0;
    for (int i = 0; i < t; i++)
        if (p[i] > 0.0f)
            cum += p[i];
    *lo = cum;
    *hi = cum + (p[t] > 0.0f ? p[t] : 0.0f);
}

/* A token differing from the CPU's is accepted only when u lies in its CDF interval (under
 * the CPU's distribution ref) within tol, or u is beyond the total and it is the last token
 * with mass. Returns 1 when t is acceptable. */
static int token_ok(const float *ref, int n, int t_cpu, int t_gpu, double u, double tol, int *near)
{
    if (t_gpu == t_cpu)
        return 1;
    if (t_gpu < 0 || t_gpu >= n || !(ref[t_gpu] > 0.0f))
        return 0;
    double lo, hi;
    cdf_interval(ref, t_gpu, &lo, &hi);
    if (u >= lo - tol && u < hi + tol) {
        (*near)++;
        return 1;
    }
    return 0;
}

/* sample: rows x n probability rows (pad = extra stride) and one uniform per row.
 * sub 0: the same host rows on both sides (rows with zeros, one-hot rows, rows whose float
 *   total is not 1, uniforms 0, just below 1 and exactly on CDF boundaries); tokens must match
 *   except where u is within 1e-9 of the boundary of the token the GPU picked.
 * sub 1: the whole pipeline, kern_probs then kern_sample on each side from the same logits; the
 *   distributions agree to float rounding, so the tolerance is 1e-5. */
static double run_sample(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, n = c->cols, ld = n + c->pad, pipeline = c->sub & 1;
    double tol = pipeline ? 1e-5 : 1e-9;
    float *p = NULL;
    double *u = malloc((size_t)rows * sizeof(double));
    kern_sample_args ac = {0}, ag;
    ac.ld = ld;
    ac.rows = rows;
    ac.n = n;
    ag = ac;
    if (pipeline) {
        float *v = sample_logits(rows, n, ld);
        kern_sample_cfg *cfg = malloc((size_t)rows * sizeof(*cfg));
        for (int r = 0; r < rows; r++)
            cfg[r] = case_cfg(r, n);
        kern_probs_args pc = { .ld_x = ld, .rows = rows, .n = n, .ld_out = ld }, pg;
        pg = pc;
        pc.x = side_bytes(x->cpu, v, (size_t)rows * ld * 4);
        pg.x = side_bytes(x->gpu, v, (size_t)rows * ld * 4);
        pc.cfg = side_bytes(x->cpu, cfg, (size_t)rows * sizeof(*cfg));
        pg.cfg = side_bytes(x->gpu, cfg, (size_t)rows * sizeof(*cfg));
        pc.out = side_alloc(x->cpu, (size_t)rows * ld * 4);
        pg.out = side_alloc(x->gpu, (size_t)rows * ld * 4);
        if (run_both(x, fn_probs, &pc, &pg) != 0.0) {
            free(v);
            free(cfg);
            free(u);
            return 1e30;
        }
        ac.probs = pc.out;
        ag.probs = pg.out;
        p = side_download(x->cpu, pc.out, (size_t)rows * ld * 4);
        free(v);
        free(cfg);
    } else {
        p = host_rand((size_t)rows * ld, 0.0f, 1.0f, 0);
        for (int r = 0; r < rows; r++) {
            float *pr = p + (size_t)r * ld;
            int kind = r % 4;
            if (kind == 1) {   /* one-hot */
                memset(pr, 0, (size_t)n * 4);
                pr[rng_int(n)] = 1.0f;
                continue;
            }
            double s = 0.0;
            for (int i = 0; i < n; i++) {
                if (kind == 2 && rng_int(10) < 7)
                    pr[i] = 0.0f;   /* filtered away */
                else if (kind == 3)
                    pr[i] = pr[i] * pr[i] * pr[i] * pr[i];
                s += pr[i];
            }
            if (s <= 0.0) {   /* everything cut away: keep one token */
                pr[rng_int(n)] = 1.0f;
                s = 1.0;
            }
            for (int i = 0; i < n; i++)
                pr[i] = (float)(pr[i] / s);
        }
        ac.probs = side_bytes(x->cpu, p, (size_t)rows * ld * 4);
        ag.probs = side_bytes(x->gpu, p, (size_t)rows * ld * 4);
    }
    for (int r = 0; r < rows; r++) {
        const float *pr = p + (size_t)r * ld;
        u[r] = (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0);
        if (r == 0)
            u[r] = 0.0;
        else if (r == 1)
            u[r] = 1.0 - 1e-16;   /* above a total that rounds below 1: the last token with mass */
        else if (r % 5 == 2) {   /* exactly on a boundary of the CPU's running sum */
            double lo, hi;
            int t = rng_int(n);
            while (t > 0 && !(pr[t] > 0.0f))
                t--;
            cdf_interval(pr, t, &lo, &hi);
            u[r] = hi < 1.0 ? hi : lo;
        }
    }
    ac.u = side_bytes(x->cpu, u, (size_t)rows * sizeof(double));
    ag.u = side_bytes(x->gpu, u, (size_t)rows * sizeof(double));
    ac.out = side_alloc(x->cpu, (size_t)rows * 4);
    ag.out = side_alloc(x->gpu, (size_t)rows * 4);
    double e = run_both(x, fn_sample, &ac, &ag);
    if (e == 0.0) {
        int32_t *ic = side_download(x->cpu, ac.out, (size_t)rows * 4);
        int32_t *ig = side_download(x->gpu, ag.out, (size_t)rows * 4);
        int near = 0;
        for (int r = 0; r < rows; r++)
            if (!token_ok(p + (size_t)r * ld, n, ic[r], ig[r], u[r], tol, &near)) {
                printf("      row %d: u %.17g: cpu token %d, cuda %d outside its CDF interval\n", r, u[r],
                       ic[r], ig[r]);
                e = 1e30;
            }
        if (near > 0)
            printf("      %d of %d rows picked the neighbour of a CDF boundary within %.0e\n", near, rows, tol);
        free(ic);
        free(ig);
    }
    perf_report(x->gpu->be, fn_sample, &ag, (double)rows * n * 4, 0);
    perf_graph(x->gpu->be, fn_sample, &ag, (double)rows * n * 4);
    free(p);
    free(u);
    return e;
}

/* host softmax of random logits (T = 1) into a row; zeros: that fraction in tenths is cut away */
static void rand_dist(float *p, int n, int zeros)
{
    double s = 0.0;
    for (int i = 0; i < n; i++) {
        double e = exp(rng_uniform(-3.0f, 3.0f));
        p[i] = rng_int(10) < zeros ? 0.0f : (float)e;
        s += p[i];
    }
    if (s <= 0.0) {
        p[0] = 1.0f;
        s = 1.0;
    }
    for (int i = 0; i < n; i++)
        p[i] = (float)(p[i] / s);
}

/* spec_verify: c->rows requests over vocabulary c->cols, at most c->k drafts each (lengths
 * 0..k in turn). Request kinds: drafts sampled from q (the usual case), q a hair above p
 * everywhere (a rejection leaves no residual mass: the p fallback), a draft token q never
 * proposed (q = 0: the 1e-8 floor). Accepted counts must be equal; next tokens as in sample
 * (tolerance 1e-6: the residual's normaliser is summed in another order). */
static double run_spec_verify(run_ctx *x)
{
    const kcase *c = x->c;
    int nr = c->rows, n = c->cols, L = c->k, ldp = n + c->pad, ldd = L > 0 ? L : 1, ldu = L + 1;
    int np = nr * (L + 1) + 1, nq = nr * L + 1;
    float *p = calloc((size_t)np * ldp, 4), *q = calloc((size_t)nq * ldp, 4);
    int32_t *prow = malloc((size_t)nr * 4), *qrow = malloc((size_t)nr * 4), *len = malloc((size_t)nr * 4);
    int32_t *d = malloc((size_t)nr * ldd * 4);
    double *u = malloc((size_t)nr * ldu * sizeof(double));
    for (int r = 0; r < nr; r++) {
        int l = r % (L + 1), kind = r % 3;
        prow[r] = 1 + r * (L + 1);   /* row 0 unused: offsets must be honoured */
        qrow[r] = 1 + r * L;
        len[r] = l;
        for (int i = 0; i <= l; i++)
            rand_dist(p + (size_t)(prow[r] + i) * ldp, n, kind == 1 ? 5 : 0);
        for (int i = 0; i < l; i++) {
            float *qi = q + (size_t)(qrow[r] + i) * ldp;
            const float *pi = p + (size_t)(prow[r] + i) * ldp;
            if (kind == 2 && i == 0) {
                for (int j = 0; j < n; j++)
                    qi[j] = pi[j] * 1.0000002f;
            } else {
                rand_dist(qi, n, kind == 1 ? 3 : 0);
            }
            double uu = (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0), cum = 0.0;
            int t = 0;
            for (int j = 0; j < n; j++)
                if (qi[j] > 0.0f) {
                    cum += qi[j];
                    t = j;
                    if (uu < cum)
                        break;
                }
            if (kind == 1 && i == l - 1)
                for (t = 0; t < n - 1 && qi[t] > 0.0f; t++)
                    ;   /* a token q gave no mass */
            d[(size_t)r * ldd + i] = t;
        }
        for (int i = 0; i <= l; i++)
            u[(size_t)r * ldu + i] = (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0);
        if (kind == 2 && l > 0)
            u[(size_t)r * ldu] = 1.0 - 1e-12;   /* reject draft 0 (its p / q is just under 1) */
    }
    kern_spec_verify_args ac = {0}, ag;
    ac.ld_p = ldp;
    ac.ld_q = ldp;
    ac.n = n;
    ac.n_req = nr;
    ac.ld_draft = ldd;
    ac.ld_u = ldu;
    ag = ac;
    ac.p = side_bytes(x->cpu, p, (size_t)np * ldp * 4);
    ag.p = side_bytes(x->gpu, p, (size_t)np * ldp * 4);
    ac.q = side_bytes(x->cpu, q, (size_t)nq * ldp * 4);
    ag.q = side_bytes(x->gpu, q, (size_t)nq * ldp * 4);
    ac.p_row = side_bytes(x->cpu, prow, (size_t)nr * 4);
    ag.p_row = side_bytes(x->gpu, prow, (size_t)nr * 4);
    ac.q_row = side_bytes(x->cpu, qrow, (size_t)nr * 4);
    ag.q_row = side_bytes(x->gpu, qrow, (size_t)nr * 4);
    ac.len = side_bytes(x->cpu, len, (size_t)nr * 4);
    ag.len = side_bytes(x->gpu, len, (size_t)nr * 4);
    ac.draft = side_bytes(x->cpu, d, (size_t)nr * ldd * 4);
    ag.draft = side_bytes(x->gpu, d, (size_t)nr * ldd * 4);
    ac.u = side_bytes(x->cpu, u, (size_t)nr * ldu * sizeof(double));
    ag.u = side_bytes(x->gpu, u, (size_t)nr * ldu * sizeof(double));
    ac.out = side_alloc(x->cpu, (size_t)nr * 8);
    ag.out = side_alloc(x->gpu, (size_t)nr * 8);
    double e = run_both(x, fn_spec_verify, &ac, &ag);
    if (e == 0.0) {
        int32_t *oc = side_download(x->cpu, ac.out, (size_t)nr * 8);
        int32_t *og = side_download(x->gpu, ag.out, (size_t)nr * 8);
        float *res = malloc((size_t)n * 4);
        int near = 0, rejected = 0, fallback = 0;
        for (int r = 0; r < nr; r++) {
            int a = oc[2 * r], l = len[r];
            if (og[2 * r] != a) {
                printf("      request %d: accepted cpu %d cuda %d\n", r, a, og[2 * r]);
                e = 1e30;
                continue;
            }
            const float *pa = p + (size_t)(prow[r] + a) * ldp, *ref = pa;
            if (a < l) {
                const float *qa = q + (size_t)(qrow[r] + a) * ldp;
                double mass = 0.0;
                for (int j = 0; j < n; j++) {
                    float v = pa[j] - qa[j];
                    res[j] = v > 0.0f ? v : 0.0f;
                    mass += res[j];
                }
                rejected++;
                if (mass > 1e-8) {
                    for (int j = 0; j < n; j++)
                        res[j] = (float)(res[j] / mass);
                    ref = res;
                } else {
                    fallback++;
                }
            }
            if (!token_ok(ref, n, oc[2 * r + 1], og[2 * r + 1], u[(size_t)r * ldu + l], 1e-6, &near)) {
                printf("      request %d (l %d, accepted %d): next cpu %d cuda %d outside its CDF interval\n",
                       r, l, a, oc[2 * r + 1], og[2 * r + 1]);
                e = 1e30;
            }
        }
        printf("      %d requests: %d rejected a draft (%d with no residual mass), %d next tokens at a "
               "CDF boundary\n", nr, rejected, fallback, near);
        free(res);
        free(oc);
        free(og);
    }
    perf_report(x->gpu->be, fn_spec_verify, &ag, (double)nr * n * 4 * 3, 0);
    free(p);
    free(q);
    free(prow);
    free(qrow);
    free(len);
    free(d);
    free(u);
    return e;
}

/* The reference Markov head of a chain in double: a gated or rnn head's weights hw [J, K] and
 * bias hb [J], the block hidden rows h [*, H] (H = K - R gated, K - 2R rnn). bf: the CUDA side's
 * rounding (the head's inputs h and s, and vec, to bf16, as its matmul and markov_step round). */
typedef struct {
    int head, R, H, K, bf;
    const float *w1, *hw, *hb, *hid;
} chain_ref;

static double chain_bf(const chain_ref *h, double v)
{
    return h->bf ? (double)kern_bf16_to_f32(kern_f32_to_bf16((float)v)) : v;
}

/* vec [R] of one step from previous token p and hidden row hrow; s [R] is the row's rnn state */
static void chain_vec(const chain_ref *h, int p, int hrow, double *s, double *z, double *vec)
{
    int R = h->R, K = h->K, H = h->H, J = h->head == 1 ? R : 3 * R;
    const float *e = h->w1 + (size_t)p * R, *hr = h->hid + (size_t)hrow * H;
    if (h->head == 0) {
        for (int c = 0; c < R; c++)
            vec[c] = e[c];
        return;
    }
    for (int j = 0; j < J; j++) {
        const float *w = h->hw + (size_t)j * K;
        double d = h->hb[j];
        if (h->head == 1) {
            for (int c = 0; c < H; c++)
                d += (double)w[c] * chain_bf(h, hr[c]);
            for (int c = 0; c < R; c++)
                d += (double)w[H + c] * e[c];
        } else {
            for (int c = 0; c < R; c++)
                d += (double)w[c] * chain_bf(h, s[c]) + (double)w[R + c] * e[c];
            for (int c = 0; c < H; c++)
                d += (double)w[2 * R + c] * chain_bf(h, hr[c]);
        }
        z[j] = d;
    }
    for (int c = 0; c < R; c++) {
        double v;
        if (h->head == 1) {
            v = e[c] / (1.0 + exp(-z[c]));
        } else {
            double g = 1.0 / (1.0 + exp(-z[c])), ct = tanh(z[R + c]);
            s[c] = (s[c] - ct) * g + ct;
            v = tanh(z[2 * R + c]);
        }
        vec[c] = chain_bf(h, v);
    }
}

/* markov_chain: c->rows rows, c->m steps, V = c->n, R = c->k, head c->sub (0 vanilla, 1 gated,
 * 2 rnn) with H = c->cols; base has 2 rows + 1 per (step, row), picked scattered (the hidden
 * rows by the same index); row strides of rows/prev padded by c->pad. Each side's chain must
 * pick, at every step, the argmax of the step its own previous ids give (recomputed here in
 * double with that side's rounding, within 1e-5 relative for vanilla, 1e-3 for a head, whose
 * fp32 sigmoid/tanh may move a bf16 rounding of vec: a near tie may go either way), and for
 * vanilla the two sides must agree except after such a tie (a head's bf16 vec on CUDA moves
 * near ties that the fp32 CPU side does not: there the count is only reported). */
static int chain_check(const char *side_name, const int32_t *ids, int n, int steps, int ldp, int V,
                       const float *base, int ld, const int32_t *rows, const float *w2, const chain_ref *h,
                       int *ties)
{
    int R = h->R;
    double *lg = malloc((size_t)V * sizeof(double));
    double *s = calloc((size_t)n * R, sizeof(double)), *z = malloc((size_t)3 * R * sizeof(double));
    double *vec = malloc((size_t)R * sizeof(double));
    double tol = h->head == 0 ? 1e-5 : 1e-3;
    int bad = 0;
    for (int k = 0; k < steps && !bad; k++)
        for (int r = 0; r < n && !bad; r++) {
            int p = ids[(size_t)k * ldp + r], got = ids[(size_t)(k + 1) * ldp + r];
            int row = rows[(size_t)k * ldp + r];
            const float *b = base + (size_t)row * ld;
            chain_vec(h, p, row, s + (size_t)r * R, z, vec);
            double best = -INFINITY;
            int arg = 0;
            for (int v = 0; v < V; v++) {
                double d = b[v];
                for (int c = 0; c < R; c++)
                    d += (double)w2[(size_t)v * R + c] * vec[c];
                lg[v] = d;
                if (d > best) {
                    best = d;
                    arg = v;
                }
            }
            if (got < 0 || got >= V || lg[got] < best - tol * (fabs(best) + 1.0)) {
                printf("      %s: step %d row %d picked %d (%g), argmax %d (%g)\n", side_name, k, r, got,
                       got >= 0 && got < V ? lg[got] : 0.0, arg, best);
                bad = 1;
            } else if (got != arg) {
                (*ties)++;
            }
        }
    free(lg);
    free(s);
    free(z);
    free(vec);
    return bad;
}

static double run_markov_chain(run_ctx *x)
{
    const kcase *c = x->c;
    int n = c->rows, steps = c->m, V = c->n, R = c->k, ld = V, ldp = n + c->pad;
    int head = c->sub, H = c->cols, K = head == 1 ? H + R : head == 2 ? 2 * R + H : 0;
    int J = head == 1 ? R : 3 * R;
    int nbase = steps * n + 2;
    float *base = host_rand((size_t)nbase * ld, -3.0f, 3.0f, 0);
    float *w1 = host_rand((size_t)V * R, -1.0f, 1.0f, 1);
    float *w2 = host_rand((size_t)V * R, -0.5f, 0.5f, 1);
    /* head inputs of unit scale, so the gates and tanh stay away from saturation */
    float *hid = head ? host_rand((size_t)nbase * H, -1.0f, 1.0f, 0) : NULL;
    float *hw = head ? host_rand((size_t)J * K, -1.0f / sqrtf((float)K), 1.0f / sqrtf((float)K), 1) : NULL;
    float *hb = head ? host_rand((size_t)J, -0.5f, 0.5f, 1) : NULL;
    int32_t *rows = calloc((size_t)steps * ldp, sizeof(int32_t));
    int32_t *prev = calloc((size_t)(steps + 1) * ldp, sizeof(int32_t));
    for (int k = 0; k < steps; k++)
        for (int r = 0; r < n; r++)
            rows[(size_t)k * ldp + r] = (int32_t)(((size_t)k * n + r) * 7 % nbase);
    for (int r = 0; r < n; r++)
        prev[r] = r == 0 ? V - 1 : rng_int(V);
    kern_markov_chain_args ac = { .ld_base = ld, .ld_rows = ldp, .ld_prev = ldp, .n = n, .steps = steps,
                                  .head = (kern_markov_head)head, .ld_hidden = H }, ag;
    ag = ac;
    ac.base = side_bytes(x->cpu, base, (size_t)nbase * ld * 4);
    ag.base = side_bytes(x->gpu, base, (size_t)nbase * ld * 4);
    ac.rows = side_bytes(x->cpu, rows, (size_t)steps * ldp * 4);
    ag.rows = side_bytes(x->gpu, rows, (size_t)steps * ldp * 4);
    ac.w1 = side_weight(x->cpu, w1, V, R);
    ag.w1 = side_weight(x->gpu, w1, V, R);
    ac.w2 = side_weight(x->cpu, w2, V, R);
    ag.w2 = side_weight(x->gpu, w2, V, R);
    ac.prev = side_bytes(x->cpu, prev, (size_t)(steps + 1) * ldp * 4);
    ag.prev = side_bytes(x->gpu, prev, (size_t)(steps + 1) * ldp * 4);
    if (head) {
        ac.hidden = side_bytes(x->cpu, hid, (size_t)nbase * H * 4);
        ag.hidden = side_bytes(x->gpu, hid, (size_t)nbase * H * 4);
        ac.head_w = side_weight(x->cpu, hw, J, K);
        ag.head_w = side_weight(x->gpu, hw, J, K);
        ac.head_b = side_weight(x->cpu, hb, 1, J);
        ag.head_b = side_weight(x->gpu, hb, 1, J);
        size_t scr = kern_markov_chain_scratch(&ac);
        ac.scratch = side_alloc(x->cpu, scr * sizeof(float));
        ag.scratch = side_alloc(x->gpu, scr * sizeof(float));
    }
    double e = run_both(x, fn_markov_chain, &ac, &ag);
    if (e == 0.0) {
        int32_t *ic = side_download(x->cpu, ac.prev, (size_t)(steps + 1) * ldp * 4);
        int32_t *ig = side_download(x->gpu, ag.prev, (size_t)(steps + 1) * ldp * 4);
        chain_ref hc = { head, R, H, K, 0, w1, hw, hb, hid }, hg = hc;
        hg.bf = head != 0 && x->gpu->be->weight_dtype == KERN_DTYPE_BF16;
        int ties_c = 0, ties_g = 0, differ = 0;
        if (chain_check("cpu", ic, n, steps, ldp, V, base, ld, rows, w2, &hc, &ties_c) ||
            chain_check(x->gpu->be->ops->name, ig, n, steps, ldp, V, base, ld, rows, w2, &hg, &ties_g))
            e = 1e30;
        for (int r = 0; r < n; r++)
            for (int k = 1; k <= steps; k++)
                if (ic[(size_t)k * ldp + r] != ig[(size_t)k * ldp + r]) {
                    differ++;
                    break;   /* later steps follow from different ids */
                }
        if (differ > ties_c + ties_g && !hg.bf) {
            printf("      %d rows differ between the sides, %d near ties\n", differ, ties_c + ties_g);
            e = 1e30;
        } else if (differ > 0) {
            snprintf(perf_note + strlen(perf_note), sizeof(perf_note) - strlen(perf_note),
                     "      %d of %d rows differ between the sides (%d near ties)\n", differ, n,
                     ties_c + ties_g);
        }
        free(ic);
        free(ig);
    }
    perf_report(x->gpu->be, fn_markov_chain, &ag, steps * ((double)V * R * 2 + (double)n * V * 4),
                2.0 * steps * n * V * R);
    free(base);
    free(w1);
    free(w2);
    free(hid);
    free(hw);
    free(hb);
    free(rows);
    free(prev);
    return e;
}

/* penalty: random distinct (row, token) entries with every mix of count / seen / parameters
 * over random logits of both signs; the op is elementwise, so both sides must agree exactly
 * (the entries' own arithmetic is kern_penalize_one), and an untouched logit must stay. */
static double run_penalty(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, n = c->cols, ld = n + c->pad, ne = c->m;
    float *v = host_rand((size_t)rows * ld, -8.0f, 8.0f, 0);
    kern_penalty_entry *en = calloc((size_t)ne, sizeof(*en));
    char *used = calloc((size_t)rows * n, 1);
    for (int i = 0; i < ne; i++) {
        int r, t;
        do {
            r = rng_int(rows);
            t = rng_int(n);
        } while (used[(size_t)r * n + t]);
        used[(size_t)r * n + t] = 1;
        en[i] = (kern_penalty_entry){ .row = r, .tok = t, .count = rng_int(4), .seen = 1,
                                      .rep = i % 3 == 0 ? 1.0f : rng_uniform(0.5f, 2.0f),
                                      .freq = rng_uniform(-2.0f, 2.0f), .pres = rng_uniform(-2.0f, 2.0f),
                                      .bias = i % 5 == 0 ? 0.0f : i % 7 == 0 ? -INFINITY
                                                                : rng_uniform(-100.0f, 100.0f) };
        if (i % 4 == 1) {   /* a bias alone: not seen, no count */
            en[i].seen = 0;
            en[i].count = 0;
        }
    }
    kern_penalty_args ac = { .ld_x = ld, .n = n, .n_entries = ne }, ag = ac;
    outbuf o = out_make(x->cpu, x->gpu, (size_t)rows * ld, v);
    ac.x = o.cpu;
    ag.x = o.gpu;
    ac.e = side_bytes(x->cpu, en, (size_t)ne * sizeof(*en));
    ag.e = side_bytes(x->gpu, en, (size_t)ne * sizeof(*en));
    double e = run_both(x, fn_penalty, &ac, &ag);
    if (e == 0.0) {
        float *hc = side_download(x->cpu, o.cpu, (size_t)rows * ld * sizeof(float));
        float *hg = side_download(x->gpu, o.gpu, (size_t)rows * ld * sizeof(float));
        int mism = 0;
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < n; t++) {
                size_t k = (size_t)r * ld + t;
                mism += memcmp(&hc[k], &hg[k], sizeof(float)) != 0;
                mism += !used[(size_t)r * n + t] && memcmp(&hc[k], &v[k], sizeof(float)) != 0;
            }
        for (int i = 0; i < ne; i++) {
            size_t k = (size_t)en[i].row * ld + en[i].tok;
            mism += hc[k] != kern_penalize_one(v[k], &en[i]);
        }
        if (mism)
            printf("      %d logits differ\n", mism);
        e = mism ? 1.0 : 0.0;
        free(hc);
        free(hg);
    }
    free(o.init);
    free(v);
    free(en);
    free(used);
    return e;
}

/* token_mask: random bit masks on distinct rows (some all-clear, some all-set words): both sides
 * exact, masked logits -inf, the rest and the rows without a mask untouched */
static pd_status fn_token_mask(kern_backend *be, const void *a, pd_err *e) { return kern_token_mask(be, a, e); }

static double run_token_mask(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, n = c->cols, ld = n + c->pad, nm = c->m, words = (n + 31) / 32 + c->k;
    float *v = host_rand((size_t)rows * ld, -8.0f, 8.0f, 0);
    int32_t *mrow = malloc((size_t)nm * sizeof(int32_t));
    uint32_t *bits = malloc((size_t)nm * words * sizeof(uint32_t));
    char *used = calloc((size_t)rows, 1);
    for (int i = 0; i < nm; i++) {
        int r;
        do
            r = rng_int(rows);
        while (used[r]);
        used[r] = 1;
        mrow[i] = r;
        for (int w = 0; w < words; w++) {
            uint32_t b = (uint32_t)rng_int(1 << 16) << 16 | (uint32_t)rng_int(1 << 16);
            bits[(size_t)i * words + w] = w % 7 == 3 ? 0u : w % 11 == 5 ? ~0u : b;
        }
    }
    kern_token_mask_args ac = { .ld_x = ld, .n = n, .n_rows = nm, .words = words }, ag = ac;
    outbuf o = out_make(x->cpu, x->gpu, (size_t)rows * ld, v);
    ac.x = o.cpu;
    ag.x = o.gpu;
    ac.rows = side_bytes(x->cpu, mrow, (size_t)nm * sizeof(int32_t));
    ag.rows = side_bytes(x->gpu, mrow, (size_t)nm * sizeof(int32_t));
    ac.bits = side_bytes(x->cpu, bits, (size_t)nm * words * sizeof(uint32_t));
    ag.bits = side_bytes(x->gpu, bits, (size_t)nm * words * sizeof(uint32_t));
    double e = run_both(x, fn_token_mask, &ac, &ag);
    if (e == 0.0) {
        float *hc = side_download(x->cpu, o.cpu, (size_t)rows * ld * sizeof(float));
        float *hg = side_download(x->gpu, o.gpu, (size_t)rows * ld * sizeof(float));
        int mism = 0;
        for (int r = 0; r < rows; r++) {
            int mi = -1;
            for (int i = 0; i < nm; i++)
                mi = mrow[i] == r ? i : mi;
            for (int t = 0; t < ld; t++) {
                size_t k = (size_t)r * ld + t;
                int allowed = mi < 0 || t >= n || ((bits[(size_t)mi * words + t / 32] >> (t % 32)) & 1u);
                float want = allowed ? v[k] : -INFINITY;
                mism += memcmp(&hc[k], &hg[k], sizeof(float)) != 0 || memcmp(&hc[k], &want, sizeof(float)) != 0;
            }
        }
        if (mism)
            printf("      %d logits differ\n", mism);
        e = mism ? 1.0 : 0.0;
        free(hc);
        free(hg);
    }
    free(o.init);
    free(v);
    free(mrow);
    free(bits);
    free(used);
    return e;
}

static pd_status fn_logprobs(kern_backend *be, const void *a, pd_err *e) { return kern_logprobs(be, a, e); }

/* logprobs: m entries (row, token) over rows x cols logits (pad = extra stride), n_top = sub;
 * logits like a model's with ties on odd rows and a masked (-inf) stretch on every third row
 * (some entries' tokens fall in it: rank = every token). The top ids and every token's rank
 * must be the same on both sides; the values agree to tol. */
static double run_logprobs(run_ctx *x)
{
    const kcase *c = x->c;
    int rows = c->rows, n = c->cols, ld = n + c->pad, m = c->m, n_top = c->sub;
    float *v = sample_logits(rows, n, ld);
    for (int r = 2; r < rows; r += 3)
        for (int t = n / 4; t < n / 2; t++)
            v[(size_t)r * ld + t] = -INFINITY;
    int32_t *er = malloc((size_t)m * sizeof(int32_t)), *tok = malloc((size_t)m * sizeof(int32_t));
    for (int i = 0; i < m; i++) {
        er[i] = rng_int(rows);
        const float *xr = v + (size_t)er[i] * ld;
        int best = 0;
        for (int t = 1; t < n; t++)
            best = xr[t] > xr[best] ? t : best;
        tok[i] = i % 4 == 0 ? best : rng_int(n);
    }
    kern_logprobs_args ac = { .ld_x = ld, .n = n, .n_rows = m, .n_top = n_top }, ag = ac;
    ac.x = side_bytes(x->cpu, v, (size_t)rows * ld * sizeof(float));
    ag.x = side_bytes(x->gpu, v, (size_t)rows * ld * sizeof(float));
    ac.rows = side_bytes(x->cpu, er, (size_t)m * sizeof(int32_t));
    ag.rows = side_bytes(x->gpu, er, (size_t)m * sizeof(int32_t));
    ac.tok = side_bytes(x->cpu, tok, (size_t)m * sizeof(int32_t));
    ag.tok = side_bytes(x->gpu, tok, (size_t)m * sizeof(int32_t));
    ac.out = side_alloc(x->cpu, (size_t)m * sizeof(kern_logprobs_row));
    ag.out = side_alloc(x->gpu, (size_t)m * sizeof(kern_logprobs_row));
    double e = run_both(x, fn_logprobs, &ac, &ag);
    if (e == 0.0) {
        kern_logprobs_row *hc = side_download(x->cpu, ac.out, (size_t)m * sizeof(kern_logprobs_row));
        kern_logprobs_row *hg = side_download(x->gpu, ag.out, (size_t)m * sizeof(kern_logprobs_row));
        int bad = 0, bad_rank = 0;
        for (int i = 0; i < m; i++) {
            double d = fabs((double)hc[i].logprob - hg[i].logprob);
            if (hc[i].rank != hg[i].rank && bad_rank++ < 3)
                printf("      entry %d (row %d, token %d): rank cpu %d, cuda %d\n", i, er[i], tok[i], hc[i].rank,
                       hg[i].rank);
            int same = hc[i].n_top == hg[i].n_top;
            for (int j = 0; same && j < hc[i].n_top; j++) {
                same = hc[i].top_id[j] == hg[i].top_id[j];
                double dj = fabs((double)hc[i].top_logprob[j] - hg[i].top_logprob[j]);
                d = dj > d ? dj : d;
            }
            e = d > e ? d : e;
            if (!same && bad++ < 3)
                printf("      entry %d (row %d): top lists differ (cpu %d entries, first %d; cuda %d, first %d)\n",
                       i, er[i], hc[i].n_top, hc[i].n_top > 0 ? hc[i].top_id[0] : -1, hg[i].n_top,
                       hg[i].n_top > 0 ? hg[i].top_id[0] : -1);
        }
        if (bad || bad_rank)
            e = 1e30;
        free(hc);
        free(hg);
    }
    free(v);
    free(er);
    free(tok);
    return e;
}

typedef double (*runner)(run_ctx *x);

static const struct {
    const char *op;
    runner fn;
} runners[] = {
    {"embed", run_embed}, {"rmsnorm", run_rmsnorm}, {"matmul", run_matmul},
    {"rope", run_rope}, {"unary", run_unary}, {"binary", run_binary},
    {"copy_rows", run_copy_rows}, {"kv_store", run_kv_store}, {"attn", run_attn},
    {"argmax", run_argmax}, {"convert", run_convert}, {"linear", run_linear},
    {"qk_post", run_qk_post}, {"mlp", run_mlp}, {"qkv", run_qkv}, {"attn_block", run_attn_block}, {"markov_step", run_markov_step}, {"markov_chain", run_markov_chain}, {"probs", run_probs},
    {"sample", run_sample}, {"spec_verify", run_spec_verify}, {"penalty", run_penalty},
    {"token_mask", run_token_mask}, {"logprobs", run_logprobs}, {"download_spans", run_download_spans},
};

/* Shapes are odd on purpose; F32 paths are held to ~1e-5, bf16 GEMMs (x rounded to bf16 on the
 * GPU) to 1e-2; embed, copy_rows, kv_store, argmax and convert must be exact. */
static const kcase cases[] = {
    /* op          rows  cols pad  m n k sub  heads kv hd ps spec tol */
    {"convert", 0, 100003, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    /* download_spans: rows spans, cols the largest (> the CUDA ring of 8 MB) */
    {"download_spans", 3000, 9 << 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"download_spans", 7, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"embed", 37, 257, 5, 0, 0, 0, 1000, 0, 0, 0, 0, NULL, 0, 0},
    {"embed", 300, 4096, 0, 0, 0, 0, 151, 0, 0, 0, 0, NULL, 0, 0},
    {"rmsnorm", 1, 4096, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"rmsnorm", 33, 1000, 7, 0, 0, 0, 1, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"rmsnorm", 513, 5120, 0, 0, 0, 0, 1, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"rmsnorm", 64, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"matmul", 0, 0, 0, 1, 1000, 257, 0, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"matmul", 0, 0, 3, 7, 513, 1024, 1, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"matmul", 0, 0, 0, 16, 4096, 1024, 2, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"matmul", 0, 0, 5, 129, 300, 333, 3, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"matmul", 0, 0, 0, 512, 1536, 2048, 0, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"matmul", 0, 0, 1, 33, 65, 97, 7, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"rope", 1, 0, 0, 0, 0, 0, 0, 32, 0, 128, 0, NULL, 1e-5, 0},
    {"rope", 77, 0, 3, 0, 0, 0, 0, 8, 0, 64, 0, NULL, 1e-5, 0},
    {"rope", 300, 0, 0, 0, 0, 0, 0, 40, 0, 128, 0, NULL, 1e-5, 0},
    {"rope", 77, 0, 3, 0, 0, 0, 1, 8, 0, 128, 0, NULL, 1e-5, 0},   /* yarn */
    {"rope", 9, 0, 0, 0, 0, 0, 2, 4, 0, 64, 0, NULL, 1e-5, 0},     /* linear */
    {"unary", 17, 1000, 3, 0, 0, 0, KERN_UNARY_SIGMOID, 0, 0, 0, 0, NULL, 1e-6, 0},
    {"unary", 5, 4099, 0, 0, 0, 0, KERN_UNARY_TANH, 0, 0, 0, 0, NULL, 1e-6, 0},
    {"unary", 64, 3000, 1, 0, 0, 0, KERN_UNARY_SILU, 0, 0, 0, 0, NULL, 1e-6, 0},
    {"binary", 17, 1000, 3, 0, 0, 0, KERN_BINARY_ADD, 0, 0, 0, 0, NULL, 1e-6, 0},
    {"binary", 3, 777, 0, 0, 0, 0, KERN_BINARY_SUB, 0, 0, 0, 0, NULL, 1e-6, 0},
    {"binary", 9, 513, 2, 0, 0, 0, KERN_BINARY_MUL, 0, 0, 0, 0, NULL, 1e-6, 0},
    {"binary", 33, 3072, 0, 0, 0, 0, KERN_BINARY_SWIGLU, 0, 0, 0, 0, NULL, 1e-6, 0},
    {"copy_rows", 19, 333, 4, 0, 0, 0, 1, 0, 0, 0, 0, NULL, 0, 0},
    {"copy_rows", 64, 4096, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"kv_store", 1, 0, 0, 0, 0, 0, 0, 0, 8, 128, 16, NULL, 0, 0},
    {"kv_store", 77, 0, 5, 0, 0, 0, 0, 0, 4, 64, 64, NULL, 0, 0},
    {"kv_store", 300, 0, 0, 0, 0, 0, 0, 0, 8, 128, 16, NULL, 0, 0},
    {"argmax", 1, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"argmax", 17, 1001, 3, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    /* a cluster per row (aligned rows of 16-byte loads, and a padded row of scalar ones), and
     * more rows than a cluster each may take */
    {"argmax", 8, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"argmax", 3, 40001, 1, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"argmax", 64, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    /* linear: m n k pad, sub = epilogue (0 store, 1 accumulate, 2 swiglu) | 4 rmsnorm, n_heads = weights */
    {"linear", 0, 0, 0, 1, 1000, 256, 4, 1, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 3, 3, 517, 1000, 4, 3, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 8, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 1, 17, 333, 520, 1, 1, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 64, 2560, 4096, 1, 2, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 2, 100, 700, 1032, 6, 2, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 1, 1536, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 8, 257, 64, 0, 1, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 300, 1000, 512, 5, 3, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 33, 520, 2048, 2, 2, 0, 0, 0, NULL, 1e-2, 0},
    /* many tiles: fewer warps per CTA (K split 4, 2, 1 on a 132-SM H200), k tails, x ring */
    {"linear", 0, 0, 1, 5, 5000, 264, 4, 3, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 2, 1, 9000, 200, 6, 2, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 8, 9000, 200, 6, 2, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 12, 9000, 200, 6, 2, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 3, 3, 20000, 136, 1, 1, 0, 0, 0, NULL, 1e-2, 0},
    /* tee: store and accumulate, few rows (skinny) and many (cuBLAS in fast mode) */
    {"linear", 0, 0, 2, 3, 300, 256, 9, 1, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 0, 8, 256, 768, 13, 1, 0, 0, 0, NULL, 1e-2, 0},
    {"linear", 0, 0, 1, 200, 520, 256, 8, 1, 0, 0, 0, NULL, 1e-2, 0},
    /* qk_post: tokens, heads, kv heads, head_dim, page size; sub 1 = store into the cache */
    {"mlp", 0, 0, 0, 1, 512, 256, 5, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"mlp", 0, 0, 0, 8, 1000, 520, 4, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"mlp", 0, 0, 3, 37, 768, 256, 13, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"mlp", 0, 0, 0, 300, 1536, 512, 21, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"mlp", 0, 0, 0, 100, 520, 260, 0, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"qkv", 0, 0, 0, 1, 0, 512, 5, 8, 2, 64, 16, NULL, 1e-2, 0},
    {"qkv", 0, 0, 0, 8, 0, 256, 1, 4, 2, 128, 16, NULL, 1e-2, 0},
    {"qkv", 0, 0, 2, 77, 0, 520, 5, 6, 2, 64, 16, NULL, 1e-2, 0},
    {"qkv", 0, 0, 0, 300, 0, 512, 4, 8, 4, 128, 64, NULL, 1e-2, 0},
    {"qkv", 0, 0, 0, 65, 0, 256, 1, 0, 2, 128, 16, NULL, 1e-2, 0},
    /* attn_block: hidden k, heads, kv heads, head_dim, page size, batch; sub 1 = accumulate.
     * The first three take the CUDA prefill path (bf16 q and attention output; the third with a
     * key split), the others the three ops (odd row stride, decode-sized batch); with
     * --invariant every one takes the skinny projection and the early attention */
    {"attn_block", 0, 0, 0, 0, 0, 256, 1, 4, 2, 128, 16, "p:0+300", 1e-2, 0},
    {"attn_block", 0, 0, 8, 0, 0, 512, 0, 8, 2, 64, 64, "p:100+200,p:0+77,x:37+40", 1e-2, 0},
    {"attn_block", 0, 0, 0, 0, 0, 256, 1, 4, 1, 128, 16, "p:2000+64", 1e-2, 0},
    {"attn_block", 0, 0, 2, 0, 0, 256, 1, 4, 2, 64, 16, "p:20+150", 1e-2, 0},
    {"attn_block", 0, 0, 0, 0, 0, 512, 1, 8, 2, 128, 16, "d:500+1,d:9+1", 1e-2, 0},
    /* with --invariant, the early attention on rounds the engine runs: verify-like blocks,
     * draft blocks with a long decode whose new key sits past the tiles loaded before the
     * wait, a ragged batch whose sequences straddle the CTAs' token groups, decodes at tile
     * edges */
    {"attn_block", 0, 0, 0, 0, 0, 256, 0, 8, 2, 128, 16, "p:1000+8,p:300+8", 1e-2, 0},
    {"attn_block", 0, 0, 0, 0, 0, 256, 1, 8, 2, 64, 16, "x:700+7,x:50+7,d:3000+1", 1e-2, 0},
    {"attn_block", 0, 0, 4, 0, 0, 256, 0, 4, 2, 128, 16, "p:900+3,p:400+5,d:77+1,p:5+9", 1e-2, 0},
    {"attn_block", 0, 0, 0, 0, 0, 256, 1, 8, 2, 128, 16, "d:4000+1,d:63+1,d:64+1,d:0+1", 1e-2, 0},
    {"qk_post", 1, 0, 0, 0, 0, 0, 1, 32, 8, 128, 16, NULL, 1e-5, 0},
    {"qk_post", 9, 0, 3, 0, 0, 0, 1, 16, 4, 64, 16, NULL, 1e-5, 0},
    {"qk_post", 77, 0, 0, 0, 0, 0, 0, 32, 8, 128, 64, NULL, 1e-5, 0},
    {"qk_post", 9, 0, 3, 0, 0, 0, 3, 32, 8, 128, 16, NULL, 1e-5, 0},   /* yarn, stored */
    {"qk_post", 33, 0, 0, 0, 0, 0, 4, 16, 4, 64, 16, NULL, 1e-5, 0},   /* linear */
    /* markov_step: rows n, V = n, R = k */
    {"markov_step", 1, 0, 0, 0, 151936, 64, 0, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"markov_step", 3, 0, 5, 0, 1001, 64, 0, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"markov_step", 17, 0, 0, 0, 50000, 32, 0, 0, 0, 0, 0, NULL, 1e-2, 0},
    {"markov_step", 2, 0, 0, 0, 3000, 12, 0, 0, 0, 0, 0, NULL, 1e-2, 0},
    /* markov_chain: rows n, steps m, V = n, R = k. CUDA kernel by shape (H200, 227 KB of shared
     * memory a block): w2 slice resident in shared memory (R = 64 unrolled, R = 32 generic, one
     * block when V < 512), L2-streaming (R = 128: the 294 KB slice does not fit; 24 rows: their
     * staged base does not), step by step (R % 8 != 0) */
    {"markov_chain", 1, 0, 0, 7, 151936, 64, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 3, 0, 5, 7, 1001, 64, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 17, 0, 0, 4, 50000, 32, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 2, 0, 1, 6, 300, 64, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 2, 0, 0, 7, 151936, 128, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 24, 0, 3, 3, 151936, 64, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 2, 0, 0, 3, 3000, 12, 0, 0, 0, 0, 0, NULL, 0, 0},
    /* markov_chain, gated (sub 1) and rnn (sub 2) heads, H = cols: one launch (R 64 and 32,
     * 8 rows), step by step (R 128: the slice does not fit; R 12) */
    {"markov_chain", 1, 256, 0, 7, 151936, 64, 1, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 1, 256, 0, 7, 151936, 64, 2, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 8, 200, 3, 5, 20000, 32, 1, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 8, 200, 3, 5, 20000, 32, 2, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 2, 96, 1, 4, 151936, 128, 2, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 3, 40, 0, 3, 3000, 12, 1, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 3, 40, 0, 3, 3000, 12, 2, 0, 0, 0, 0, NULL, 0, 0},
    /* more rows than the resident kernel's shared memory holds base for: a step takes them in
     * groups (vanilla and gated) */
    {"markov_chain", 40, 0, 1, 5, 151936, 64, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"markov_chain", 20, 256, 0, 4, 151936, 64, 1, 0, 0, 0, 0, NULL, 0, 0},
    /* probs: rows x vocab, pad, sub 1 = rows gathered through idx (per-row parameters cycle
     * through every kind: greedy, plain, top-k, top-p, both, k = 1, k >= n, min-p, typical-p
     * alone and with the others, T 0.05..2; 24 rows see them all) */
    {"probs", 24, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 37, 1001, 3, 0, 0, 0, 1, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 24, 8192, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 26, 50, 1, 0, 0, 0, 1, 0, 0, 0, 0, NULL, 1e-5, 0},
    /* sub 2: rows at the filters' edges (NaN, +inf, all -inf, masked, ties, equal, dominant);
     * many rows (one CTA each on CUDA), tiny and huge vocabularies */
    {"probs", 216, 1000, 2, 0, 0, 0, 2, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 27, 151936, 0, 0, 0, 0, 2, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 70, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 18, 1, 0, 0, 0, 0, 2, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 27, 3, 1, 0, 0, 0, 3, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"probs", 9, 600000, 0, 0, 0, 0, 2, 0, 0, 0, 0, NULL, 1e-5, 0},
    /* sample: rows x vocab, pad, sub 1 = probs then sample from the same logits on each side */
    {"sample", 40, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"sample", 64, 1001, 5, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"sample", 7, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"sample", 24, 151936, 0, 0, 0, 0, 1, 0, 0, 0, 0, NULL, 0, 0},
    {"sample", 36, 8192, 2, 0, 0, 0, 1, 0, 0, 0, 0, NULL, 0, 0},
    /* spec_verify: requests, vocab, pad, k = most drafts per request */
    {"spec_verify", 24, 151936, 0, 0, 0, 7, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"spec_verify", 50, 1001, 3, 0, 0, 5, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"spec_verify", 9, 8192, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"penalty", 8, 151936, 0, 3000, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"penalty", 5, 1001, 3, 700, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    /* token_mask: rows x vocab, pad, m masks, k extra words per mask */
    {"token_mask", 9, 151936, 0, 6, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"token_mask", 4, 1001, 3, 4, 0, 2, 0, 0, 0, 0, 0, NULL, 0, 0},
    {"logprobs", 7, 151936, 0, 24, 0, 0, 20, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"logprobs", 9, 8192, 5, 33, 0, 0, 5, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"logprobs", 4, 50, 1, 6, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 0},
    {"logprobs", 3, 17, 0, 5, 0, 0, 17, 0, 0, 0, 0, NULL, 1e-5, 0},
    /* attention: heads, kv heads, head_dim, page size, ragged batch */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "d:4095+1", 1e-4, 0},
    {"attn", 0, 0, 4, 0, 0, 0, 0, 32, 8, 128, 16, "d:0+1,d:15+1,d:998+1,d:2999+1,d:63+1", 1e-4, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 32, 128, 64, "p:0+100", 1e-2, 0},
    {"attn", 0, 0, 2, 0, 0, 0, 0, 16, 8, 64, 16, "p:37+90,p:0+33", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 4, 128, 64, "v:1200+16,v:5+2,v:2999+7", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 40, 8, 128, 16, "x:500+16,x:0+8", 1e-2, 0},
    {"attn", 0, 0, 1, 0, 0, 0, 0, 64, 4, 64, 64, "x:2984+16,d:17+1", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 16, 8, 128, 16,
     "p:0+300,p:1000+100,v:250+4,x:64+16,d:2999+1,v:0+16", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 16, 4, 128, 64, "p:1500+128", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 8, 8, 64, 16, "4*v:100+5,3*x:7+9", 1e-4, 0},
    /* batch-invariant path (attn_inv_kernel under --invariant; hi/lo bf16 Q and P keep the
     * decode tolerance): verify blocks across the 1024/1025 split-size step, lengths 1..2049,
     * GQA 1/4/5/8, odd pages */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "d:0+1,d:63+1,d:64+1,d:1023+1,d:1024+1,d:2048+1", 1e-4, 0},
    /* long contexts: decode queries around 16384 keys and up to 70000, a verify block and a
     * draft block past 16384 keys, a 33000-key query (the split rule at its cap) */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "d:16383+1,d:16384+1,d:20000+1,d:70000+1", 1e-4, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 16, 4, 64, 16, "v:16378+8,x:17000+7,d:33000+1", 1e-2, 0},
    {"attn", 0, 0, 1, 0, 0, 0, 0, 64, 8, 64, 7, "d:5+1,d:127+1,d:1500+1,d:2000+1", 1e-4, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 8, 8, 128, 3, "d:700+1,d:31+1,d:1100+1", 1e-4, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "v:1019+8,v:0+8,d:64+1,v:2040+8", 1e-2, 0},
    {"attn", 0, 0, 3, 0, 0, 0, 0, 40, 8, 64, 5, "3*v:1017+8,d:9+1", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 16, 16, 128, 1, "v:300+8,v:1+16", 1e-2, 0},
    /* tensor-core path (bf16 Q and P: tol 1e-2): >= 8 queries per sequence on average, not
     * batch-invariant. Chunk lengths 1..2049, GQA 1/4/8, head_dim 128 and 64, pages 16/7/1,
     * ragged tiles spanning 2-4 sequences, non-causal blocks, key splits (few tiles, long kv) */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+1", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:40+15", 1e-2, 0},
    {"attn", 0, 0, 3, 0, 0, 0, 0, 8, 8, 128, 7, "p:0+64", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 16, 4, 128, 1, "p:130+100", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 16, 2, 128, 16, "p:0+1000", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 8, 2, 128, 16, "p:0+2049", 1e-2, 0},
    {"attn", 0, 0, 1, 0, 0, 0, 0, 16, 2, 64, 7, "p:300+200", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 4, 2, 64, 16, "p:5+33,p:0+100", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+70,p:500+37,x:200+16", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "x:1000+16,x:33+16,x:0+16,x:64+16", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 32, 128, 1, "p:3000+20", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 7, "v:2000+16,x:1500+16,p:9+9", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 16, 4, 64, 16, "p:0+20,p:3+30,p:0+13,p:77+40", 1e-2, 0},
    /* (>= 128 queries per sequence and >= 2 CTAs per SM on an H200: 128-row tiles) */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+1100", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+300,p:50+150,x:300+16", 1e-2, 0},
    {"attn", 0, 0, 2, 0, 0, 0, 0, 80, 8, 64, 7, "p:0+300,p:50+150,x:300+16", 1e-2, 0},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 64, 8, 128, 16, "8*v:300+16,4*x:100+16,p:0+90", 1e-2, 0},
    /* perf-only shapes (--perf): decode attention and GEMMs at Qwen3-8B-like sizes */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "16*d:4095+1", 1e-4, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "32*d:4095+1", 1e-4, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "4*v:4080+16", 1e-2, 1},
    /* ... and at Qwen3-4B decode/verify shape, 1k keys: batch 1 and 8, decode and verify-8 */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "d:1023+1", 1e-4, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "v:1016+8", 1e-2, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "8*d:1023+1", 1e-4, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "8*v:1016+8", 1e-2, 1},
    /* ... and at the batches where speculation loses to plain decoding (16-64 sequences) */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "16*d:1023+1", 1e-4, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "32*d:1023+1", 1e-4, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "64*d:1023+1", 1e-4, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "2*v:1016+8", 1e-2, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "4*v:1016+8", 1e-2, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "16*v:1016+8", 1e-2, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "8*x:1016+7", 1e-2, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "32*x:1016+7", 1e-2, 1},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "64*v:1016+8", 1e-2, 1},
    /* prefill attention at Qwen3-4B/8B shape, timed on CUDA only (perf_only 2: no CPU reference) */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+1024", 1e-2, 2},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+4096", 1e-2, 2},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+8192", 1e-2, 2},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+16384", 1e-2, 2},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:4096+512", 1e-2, 2},
    /* the same 2k chunk on 128-row tiles and, with 31 one-token sequences pulling the average
     * under 128 queries per sequence, on 64-row tiles (1k and 4096+512 take 64-row tiles) */
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+2048", 1e-2, 2},
    {"attn", 0, 0, 0, 0, 0, 0, 0, 32, 8, 128, 16, "p:0+2048,31*d:0+1", 1e-2, 2},
    /* perf-only: the decode linears of Qwen3-4B (norm+QKV, o_proj, norm+gate/up, down, lm_head) */
    {"linear", 0, 0, 0, 1, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 1, 2560, 4096, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 1, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    /* down-sized products of exactly one and two tiles per SM (132 SMs): balance vs rate */
    {"linear", 0, 0, 0, 1, 2112, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 1, 4224, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 1, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 1, 151936, 2560, 0, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 7, 151936, 2560, 0, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 8, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 8, 2560, 4096, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 8, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 8, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 16, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 32, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 64, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    /* the other products at 16-64 rows (batched decode, verify and draft blocks) */
    {"linear", 0, 0, 0, 16, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 64, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 16, 2560, 4096, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 64, 2560, 4096, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 16, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 64, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 64, 151936, 2560, 0, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 32, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 32, 2560, 4096, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 32, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 128, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 128, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 128, 2560, 4096, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 128, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    /* ... and the rows of DSpark rounds of 32 and 64 requests: draft blocks (7 tokens each,
     * with the drafter's lm_head) and verify blocks of 8 */
    {"linear", 0, 0, 0, 224, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 224, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 224, 151936, 2560, 0, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 448, 151936, 2560, 0, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 256, 4096, 2560, 4, 3, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 256, 2560, 4096, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 256, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 256, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 512, 9728, 2560, 6, 2, 0, 0, 0, NULL, 1e-2, 1},
    {"linear", 0, 0, 0, 512, 2560, 9728, 1, 1, 0, 0, 0, NULL, 1e-2, 1},
    {"matmul", 0, 0, 0, 1, 12288, 4096, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"qk_post", 1, 0, 0, 0, 0, 0, 1, 32, 8, 128, 16, NULL, 1e-5, 1},
    {"qk_post", 8, 0, 0, 0, 0, 0, 1, 32, 8, 128, 16, NULL, 1e-5, 1},
    {"markov_step", 1, 0, 0, 0, 151936, 64, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"markov_step", 8, 0, 0, 0, 151936, 64, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"markov_chain", 1, 0, 0, 7, 151936, 64, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"markov_chain", 8, 0, 0, 7, 151936, 64, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"markov_chain", 1, 2560, 0, 7, 151936, 64, 1, 0, 0, 0, 0, NULL, 0, 1},
    {"markov_chain", 1, 2560, 0, 7, 151936, 64, 2, 0, 0, 0, 0, NULL, 0, 1},
    {"markov_chain", 8, 2560, 0, 7, 151936, 64, 2, 0, 0, 0, 0, NULL, 0, 1},
    {"markov_chain", 32, 0, 0, 7, 151936, 64, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"markov_chain", 64, 0, 0, 7, 151936, 64, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"probs", 8, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 64, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 1e-5, 1},
    /* probs with one parameter set for all rows (sub >> 3: probs_presets) at 1, 8 and 64 rows
     * (64: timed only, the CPU reference's sorts would take seconds) */
    {"probs", 1, 151936, 0, 0, 0, 0, 1 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 8, 151936, 0, 0, 0, 0, 1 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 64, 151936, 0, 0, 0, 0, 1 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    /* rows between (a verify of 2-32 requests): timed only, for the cluster-size choice */
    {"probs", 16, 151936, 0, 0, 0, 0, 1 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    {"probs", 32, 151936, 0, 0, 0, 0, 1 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    {"probs", 128, 151936, 0, 0, 0, 0, 1 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    {"probs", 256, 151936, 0, 0, 0, 0, 1 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    {"probs", 1, 151936, 0, 0, 0, 0, 2 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 8, 151936, 0, 0, 0, 0, 2 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 64, 151936, 0, 0, 0, 0, 2 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    {"probs", 1, 151936, 0, 0, 0, 0, 3 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 8, 151936, 0, 0, 0, 0, 3 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 64, 151936, 0, 0, 0, 0, 3 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    {"probs", 1, 151936, 0, 0, 0, 0, 4 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 8, 151936, 0, 0, 0, 0, 4 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 64, 151936, 0, 0, 0, 0, 4 << 3, 0, 0, 0, 0, NULL, 1e-5, 2},
    {"probs", 1, 151936, 0, 0, 0, 0, 5 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"probs", 8, 151936, 0, 0, 0, 0, 5 << 3, 0, 0, 0, 0, NULL, 1e-5, 1},
    {"sample", 1, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"sample", 8, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"sample", 64, 151936, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"spec_verify", 32, 151936, 0, 0, 0, 7, 0, 0, 0, 0, 0, NULL, 0, 1},
    {"matmul", 0, 0, 0, 17, 9728, 2560, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"matmul", 0, 0, 0, 32, 9728, 2560, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"matmul", 0, 0, 0, 64, 9728, 2560, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"matmul", 0, 0, 0, 16, 12288, 4096, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"matmul", 0, 0, 0, 4096, 4096, 4096, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
    {"matmul", 0, 0, 0, 8192, 8192, 8192, 0, 0, 0, 0, 0, NULL, 1e-2, 1},
};

static void case_name(const kcase *c, char *buf, size_t n)
{
    if (strcmp(c->op, "attn") == 0)
        snprintf(buf, n, "heads %d/%d hd %d page %d pad %d [%s]", c->n_heads, c->n_kv, c->hd,
                 c->page_size, c->pad, c->spec);
    else if (strcmp(c->op, "kv_store") == 0)
        snprintf(buf, n, "tok %d kv_heads %d hd %d page %d pad %d", c->rows, c->n_kv, c->hd,
                 c->page_size, c->pad);
    else if (strcmp(c->op, "rope") == 0)
        snprintf(buf, n, "tok %d heads %d hd %d pad %d%s", c->rows, c->n_heads, c->hd, c->pad,
                 c->sub == 1 ? " yarn" : c->sub == 2 ? " linear" : "");
    else if (strcmp(c->op, "qk_post") == 0)
        snprintf(buf, n, "tok %d heads %d/%d hd %d page %d pad %d%s%s", c->rows, c->n_heads, c->n_kv,
                 c->hd, c->page_size, c->pad, c->sub & 1 ? " store" : "",
                 c->sub >> 1 == 1 ? " yarn" : c->sub >> 1 == 2 ? " linear" : "");
    else if (strcmp(c->op, "markov_step") == 0)
        snprintf(buf, n, "rows %d V %d R %d pad %d", c->rows, c->n, c->k, c->pad);
    else if (strcmp(c->op, "markov_chain") == 0)
        snprintf(buf, n, "rows %d steps %d V %d R %d pad %d%s", c->rows, c->m, c->n, c->k, c->pad,
                 c->sub == 1 ? " gated" : c->sub == 2 ? " rnn" : "");
    else if (strcmp(c->op, "spec_verify") == 0)
        snprintf(buf, n, "requests %d V %d drafts <= %d pad %d", c->rows, c->cols, c->k, c->pad);
    else if (strcmp(c->op, "probs") == 0)
        snprintf(buf, n, "rows %d V %d pad %d%s%s%s", c->rows, c->cols, c->pad, c->sub & 1 ? " idx" : "",
                 c->sub & 2 ? " edges" : "", c->sub >> 3 < N_PROBS_PRESETS ? probs_preset_names[c->sub >> 3] : " ?");
    else if (strcmp(c->op, "sample") == 0)
        snprintf(buf, n, "rows %d V %d pad %d%s", c->rows, c->cols, c->pad, c->sub & 1 ? " from probs" : "");
    else if (strcmp(c->op, "linear") == 0)
        snprintf(buf, n, "m %d n %d k %d pad %d w %d %s%s%s", c->m, c->n, c->k, c->pad, c->n_heads,
                 (c->sub & 3) == 0 ? "store" : (c->sub & 3) == 1 ? "acc" : "swiglu",
                 c->sub & 4 ? " norm" : "", c->sub & 8 ? " tee" : "");
    else if (strcmp(c->op, "qkv") == 0)
        snprintf(buf, n, "m %d hidden %d pad %d heads %d/%d hd %d%s%s", c->m, c->k, c->pad, c->n_heads,
                 c->n_kv, c->hd, c->sub & 4 ? " norm" : "", c->sub & 1 ? " store" : "");
    else if (strcmp(c->op, "mlp") == 0)
        snprintf(buf, n, "m %d inter %d hidden %d pad %d %s%s%s%s", c->m, c->n, c->k, c->pad,
                 c->sub & 1 ? "acc" : "store", c->sub & 4 ? " norm" : "", c->sub & 8 ? " tee" : "",
                 c->sub & 16 ? " in-place" : "");
    else if (strcmp(c->op, "matmul") == 0)
        snprintf(buf, n, "m %d n %d k %d pad %d%s%s%s", c->m, c->n, c->k, c->pad,
                 c->sub & 1 ? " acc" : "", c->sub & 2 ? " bias" : "", c->sub & 4 ? " f32w" : "");
    else
        snprintf(buf, n, "%d x %d pad %d sub %d", c->rows, c->cols, c->pad, c->sub);
}

/* kern_linear with be->batch_invariant, every epilogue: rows s..s+b-1 computed as a batch of b
 * (b = 1..100, rows at every position of the 8-row tiles and 64-row chunks) must equal bit for
 * bit the same rows of one batch of 100. */
static int linear_invariance_one(kern_backend *g, kern_linear_epilogue epi, int norm, int n_w,
                                 const int *ns, int k)
{
    enum { M = 100 };
    pd_err err;
    side sg = {g, {0}, 0};
    float *x = host_rand((size_t)M * k, -1.0f, 1.0f, 0), *gh = host_rand((size_t)k, 0.5f, 1.5f, 1);
    kern_linear_args a = {0};
    a.ld_x = k;
    a.k = k;
    a.n_w = n_w;
    a.eps = 1e-6f;
    a.epilogue = epi;
    float *xd = side_bytes(&sg, x, (size_t)M * k * 4);
    if (norm)
        a.norm = side_weight(&sg, gh, 1, k);
    int n_out = epi == KERN_LINEAR_SWIGLU ? 1 : n_w;
    float *y0[KERN_LINEAR_MAX_W] = {0}, *full[KERN_LINEAR_MAX_W] = {0};
    for (int i = 0; i < n_w; i++) {
        float *w = host_rand((size_t)ns[i] * k, -0.05f, 0.05f, 1);
        a.w[i] = side_weight(&sg, w, ns[i], k);
        free(w);
        if (i < n_out) {
            y0[i] = host_rand((size_t)M * ns[i], -1.0f, 1.0f, 0);
            a.y[i] = side_bytes(&sg, y0[i], (size_t)M * ns[i] * 4);
            a.ld_y[i] = ns[i];
        }
    }
    /* one batch of M, then sub-batches; y reloaded with y0 before each launch (ACCUMULATE) */
    static const int sizes[] = {100, 1, 2, 3, 7, 8, 9, 17, 63, 64, 65, 99};
    int same = 1, launches = 0;
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        int b = sizes[si];
        for (int s0 = 0; s0 + b <= M; s0 += b == 1 ? 1 : (b < 10 ? 13 : (M - b > 0 ? M - b : M))) {
            kern_linear_args ab = a;
            ab.m = b;
            ab.x = xd + (size_t)s0 * k;
            for (int i = 0; i < n_out; i++) {
                TEST_CHECK(kern_upload(g, a.y[i], y0[i], (size_t)M * ns[i] * 4, &err) == PD_OK);
                ab.y[i] = a.y[i] + (size_t)s0 * ns[i];
            }
            TEST_CHECK(kern_linear(g, &ab, &err) == PD_OK);
            launches++;
            for (int i = 0; i < n_out; i++) {
                float *h = side_download(&sg, a.y[i], (size_t)M * ns[i] * 4);
                if (b == M)
                    full[i] = h;
                else {
                    same &= memcmp(h + (size_t)s0 * ns[i], full[i] + (size_t)s0 * ns[i],
                                   (size_t)b * ns[i] * 4) == 0;
                    free(h);
                }
            }
        }
    }
    printf("%s batch-invariant linear %s%s, %d weight(s), k %d: %d launches of 1..100 rows equal bit for bit\n",
           same ? "ok  " : "FAIL", epi == KERN_LINEAR_STORE ? "store" : epi == KERN_LINEAR_ACCUMULATE ? "acc" : "swiglu",
           norm ? " + rmsnorm" : "", n_w, k, launches);
    for (int i = 0; i < n_out; i++) {
        free(y0[i]);
        free(full[i]);
    }
    free(x);
    free(gh);
    side_free(&sg);
    return same;
}

/* be->batch_invariant attention, one shape: every token of a mixed batch (a verify block of 8
 * whose lengths cross a split-size step at 1024/1025 keys, interleaved sequences, 1, 0 and 2049
 * keys) computed with 14, 1 and 5 sequences claimed (so 1, 14 and 3 tokens share a CTA), and
 * the verify block on its own, must equal bit for bit that token computed alone. longer: the
 * verify block crosses 16384/16385 keys instead and the 2049-key sequence has 33000 (the key
 * splits at their cap of 16, each split a long walk). */
static int attn_invariance_one(kern_backend *g, int nh, int nkv, int hd, int ps, int longer)
{
    enum { NT = 14, NS = 5 };
    static const int seq[NT] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 1, 3, 4, 2};
    int kvl[NT] = {1020, 1021, 1022, 1023, 1024, 1025, 1026, 1027, 700, 40, 699, 1, 2049, 0};
    if (longer) {
        for (int t = 0; t < 8; t++)
            kvl[t] += 16380 - 1020;
        kvl[12] = 33000;
    }
    int max_len = longer ? 33000 : 2049, stride = (max_len + ps - 1) / ps, n_pages = NS * stride + 3;
    size_t kv_n = (size_t)n_pages * ps * nkv * hd, qn = (size_t)NT * nh * hd;
    float *kh = host_rand(kv_n, -1.0f, 1.0f, 1), *vh = host_rand(kv_n, -1.0f, 1.0f, 1);
    float *q = host_rand(qn, -2.5f, 2.5f, 0);
    int32_t *pt = malloc((size_t)NS * stride * sizeof(int32_t));
    for (int i = 0; i < NS * stride; i++)
        pt[i] = (int32_t)(((size_t)i * 7919 + 5) % (size_t)n_pages);   /* scattered pages */
    side sg = {g, {0}, 0};
    pd_err err;
    kern_kv_layer kv = { .k = side_conv(&sg, kh, kv_n, KERN_DTYPE_BF16),
                         .v = side_conv(&sg, vh, kv_n, KERN_DTYPE_BF16), .dtype = KERN_DTYPE_BF16,
                         .page_size = ps, .n_kv_heads = nkv, .head_dim = hd };
    int32_t *seqd = side_bytes(&sg, seq, sizeof(seq)), *kvld = side_bytes(&sg, kvl, sizeof(kvl));
    int32_t *ptd = side_bytes(&sg, pt, (size_t)NS * stride * sizeof(int32_t));
    float *qd = side_bytes(&sg, q, qn * 4), *od = side_alloc(&sg, qn * 4);
    kern_attn_args ab = { .kv = kv, .q = qd, .ld_q = nh * hd, .out = od, .ld_out = nh * hd,
                          .n_tok = NT, .n_heads = nh, .tok_seq = seqd, .tok_kv_len = kvld,
                          .page_table = ptd, .pt_stride = stride, .n_seq = 1, .max_kv_len = max_len,
                          .scale = 1.0f / sqrtf((float)hd) };
    size_t row = (size_t)nh * hd;
    float *alone = malloc(qn * 4);
    for (int t = 0; t < NT; t++) {
        kern_attn_args a1 = ab;
        a1.q = qd + t * row;
        a1.out = od + t * row;
        a1.n_tok = 1;
        a1.tok_seq = seqd + t;
        a1.tok_kv_len = kvld + t;
        a1.max_kv_len = kvl[t] > 0 ? kvl[t] : 1;
        TEST_CHECK(kern_attn(g, &a1, &err) == PD_OK);
    }
    float *h = side_download(&sg, od, qn * 4);
    memcpy(alone, h, qn * 4);
    free(h);
    int same = 1;
    static const int n_seq_claim[3] = {NT, 1, NS};
    for (int v = 0; v < 4; v++) {
        kern_attn_args a = ab;
        if (v < 3) {
            a.n_seq = n_seq_claim[v];
        } else {   /* the verify block alone: 8 tokens of one sequence */
            a.n_tok = 8;
            a.max_kv_len = kvl[7];
        }
        TEST_CHECK(kern_memset0(g, od, qn * 4, &err) == PD_OK);
        TEST_CHECK(kern_attn(g, &a, &err) == PD_OK);
        h = side_download(&sg, od, qn * 4);
        int ok = memcmp(h, alone, (size_t)a.n_tok * row * 4) == 0;
        if (!ok)
            printf("      heads %d/%d hd %d page %d%s: variant %d differs\n", nh, nkv, hd, ps,
                   longer ? " (long)" : "", v);
        same &= ok;
        free(h);
    }
    side_free(&sg);
    free(alone);
    free(kh);
    free(vh);
    free(q);
    free(pt);
    return same;
}

/* be->batch_invariant: a row computed inside a batch is bit-identical to the same row computed
 * alone (matmul: verify block vs decode step; attention: one query among many, with other kv
 * lengths in the batch). This is what keeps greedy speculative decoding lossless in bf16. */
static int linear_invariance_all(kern_backend *g);

/* check on another batch-invariant CUDA backend made with the knobs env (name, value pairs, NULL
 * ended; they are read when a backend is made, and unset again after), act_bf16 as g's; 1 when
 * the check passed (or the backend could not be made, a failure reported by itself) */
static int invariance_with_env(kern_backend *g, const char *const *env, int (*check)(kern_backend *),
                               const char *what)
{
    for (int i = 0; env[i] != NULL; i += 2)
        setenv(env[i], env[i + 1], 1);
    kern_backend_config bc = { .name = "cuda" };
    kern_backend *b = NULL;
    pd_err err;
    char why[96];
    snprintf(why, sizeof(why), "cuda backend (%s)", what);
    int same = 1;
    if (!fatal_status(kern_backend_create(&bc, &b, &err), &err, why)) {
        b->batch_invariant = 1;
        b->act_bf16 = g->act_bf16;
        same = check(b);
        kern_backend_destroy(b);
    }
    for (int i = 0; env[i] != NULL; i += 2)
        unsetenv(env[i]);
    return same;
}

/* attn_invariance_one over GQA 4/8/1/5, head_dim 128/64, pages 16/7/1/3, up to 33000 keys */
static int attn_invariance_all(kern_backend *g)
{
    int same = attn_invariance_one(g, 8, 2, 128, 16, 0);
    same &= attn_invariance_one(g, 32, 4, 64, 7, 0);
    same &= attn_invariance_one(g, 4, 4, 128, 1, 0);
    same &= attn_invariance_one(g, 40, 8, 128, 3, 0);
    same &= attn_invariance_one(g, 8, 2, 128, 16, 1);
    same &= attn_invariance_one(g, 16, 2, 64, 7, 1);
    return same;
}

static void test_batch_invariance(kern_backend *g)
{
    pd_err err;
    enum { N = 1024, K = 512, M = 75, NKV = 2, HD = 128, NH = 8, PS = 16 };   /* M > one 64-row chunk */
    float *w = host_rand((size_t)N * K, -0.05f, 0.05f, 1), *x = host_rand((size_t)M * K, -1.0f, 1.0f, 0);
    side sg = {g, {0}, 0};
    kern_weight wd = side_weight(&sg, w, N, K);
    float *xd = side_bytes(&sg, x, (size_t)M * K * 4);
    float *y_all = side_alloc(&sg, (size_t)M * N * 4), *y_one = side_alloc(&sg, (size_t)N * 4);
    g->batch_invariant = 1;
    kern_matmul_args all = { .x = xd, .ld_x = K, .w = wd, .y = y_all, .ld_y = N, .m = M, .n = N, .k = K };
    TEST_CHECK(kern_matmul(g, &all, &err) == PD_OK);
    float *ha = side_download(&sg, y_all, (size_t)M * N * 4);
    int same = 1;
    for (int r = 0; r < M; r++) {
        kern_matmul_args one = { .x = xd + (size_t)r * K, .ld_x = K, .w = wd, .y = y_one, .ld_y = N, .m = 1,
                                 .n = N, .k = K };
        TEST_CHECK(kern_matmul(g, &one, &err) == PD_OK);
        float *ho = side_download(&sg, y_one, (size_t)N * 4);
        same &= memcmp(ho, ha + (size_t)r * N, (size_t)N * 4) == 0;
        free(ho);
    }
    free(ha);
    TEST_CHECK_MSG(same, "batch-invariant matmul: a row differs from the same row computed alone");
    printf("%s batch-invariant matmul: %d rows equal bit for bit to single-row results\n", same ? "ok  " : "FAIL", M);
    /* attention: 3 sequences of 1500, 700 and 40 keys; query 0 alone vs in a batch of 9 */
    int lens[3] = {1500, 700, 40}, pages_per = (1500 + PS - 1) / PS, n_pages = 3 * pages_per;
    size_t kv_n = (size_t)n_pages * PS * NKV * HD;
    float *kh = host_rand(kv_n, -1.0f, 1.0f, 1), *vh = host_rand(kv_n, -1.0f, 1.0f, 1);
    void *kd = side_conv(&sg, kh, kv_n, KERN_DTYPE_BF16), *vd = side_conv(&sg, vh, kv_n, KERN_DTYPE_BF16);
    int32_t pt[3 * 94];
    for (int i = 0; i < 3 * pages_per; i++)
        pt[i] = (i * 37) % n_pages;   /* scattered pages */
    int32_t seq[9] = {0, 1, 2, 0, 1, 2, 0, 1, 2}, kvl[9];
    for (int t = 0; t < 9; t++)
        kvl[t] = lens[seq[t]] - t / 3;
    float *q = host_rand((size_t)9 * NH * HD, -1.0f, 1.0f, 0);
    int32_t *ptd = side_bytes(&sg, pt, sizeof(pt)), *seqd = side_bytes(&sg, seq, sizeof(seq)),
            *kvld = side_bytes(&sg, kvl, sizeof(kvl));
    float *qd = side_bytes(&sg, q, (size_t)9 * NH * HD * 4);
    float *od = side_alloc(&sg, (size_t)9 * NH * HD * 4), *o1 = side_alloc(&sg, (size_t)NH * HD * 4);
    kern_kv_layer kv = { .k = kd, .v = vd, .dtype = KERN_DTYPE_BF16, .page_size = PS, .n_kv_heads = NKV,
                         .head_dim = HD };
    kern_attn_args ab = { .kv = kv, .q = qd, .ld_q = NH * HD, .out = od, .ld_out = NH * HD, .n_tok = 9,
                          .n_heads = NH, .tok_seq = seqd, .tok_kv_len = kvld, .page_table = ptd,
                          .pt_stride = pages_per, .n_seq = 3, .max_kv_len = 1500, .scale = 0.088f };
    TEST_CHECK(kern_attn(g, &ab, &err) == PD_OK);
    float *hb = side_download(&sg, od, (size_t)9 * NH * HD * 4);
    int same_a = 1;
    for (int t = 0; t < 9; t++) {
        kern_attn_args a1 = ab;
        a1.q = qd + (size_t)t * NH * HD;
        a1.out = o1;
        a1.n_tok = 1;
        a1.tok_seq = seqd + t;
        a1.tok_kv_len = kvld + t;
        a1.max_kv_len = kvl[t];
        TEST_CHECK(kern_attn(g, &a1, &err) == PD_OK);
        float *h1 = side_download(&sg, o1, (size_t)NH * HD * 4);
        same_a &= memcmp(h1, hb + (size_t)t * NH * HD, (size_t)NH * HD * 4) == 0;
        free(h1);
    }
    free(hb);
    TEST_CHECK_MSG(same_a, "batch-invariant attention: a query differs from the same query alone");
    printf("%s batch-invariant attention: 9 queries equal bit for bit to single-query results\n",
           same_a ? "ok  " : "FAIL");
    int same_v = attn_invariance_all(g);
    /* again with every key split of the batched launches taken by one CTA in turn, and with
     * whole verify blocks per CTA (PD_ATTN_SPC, PD_ATTN_ONE_TILE, read when a CUDA backend is
     * made): the default rule takes those only in large grids, which the single-token runs
     * never are, so here both CTA layouts meet the single-token results */
    static const char *const spc_env[] = { "PD_ATTN_SPC", "16", "PD_ATTN_ONE_TILE", "0", NULL };
    same_v &= invariance_with_env(g, spc_env, attn_invariance_all, "key splits per CTA");
    /* and with the four-warp form of the one-m-tile CTAs (PD_ATTN_WARPS=4; eight by default) */
    static const char *const w4_env[] = { "PD_ATTN_WARPS", "4", NULL };
    same_v &= invariance_with_env(g, w4_env, attn_invariance_all, "four-warp one-tile CTAs");
    /* and with whole verify blocks per CTA in both forms of two-m-tile CTAs: warp pairs
     * (the default) and two warps computing while two only load (PD_ATTN_COOP2=0) */
    static const char *const c2_env[] = { "PD_ATTN_ONE_TILE", "0", NULL };
    same_v &= invariance_with_env(g, c2_env, attn_invariance_all, "warp pairs on two m-tiles");
    static const char *const c1_env[] = { "PD_ATTN_COOP2", "0", "PD_ATTN_ONE_TILE", "0", NULL };
    same_v &= invariance_with_env(g, c1_env, attn_invariance_all, "two working warps on two m-tiles");
    TEST_CHECK_MSG(same_v, "batch-invariant attention: a token of a verify block or mixed batch "
                           "differs from the same token alone");
    printf("%s batch-invariant attention: verify blocks and mixed batches (GQA 1/4/5/8; up to 33000 "
           "keys) equal bit for bit to single-token results\n", same_v ? "ok  " : "FAIL");
    int lin = linear_invariance_all(g);
    /* again with the tiled form taken for every K split from its first row count on
     * (PD_SK_TILED_ANY, read when a CUDA backend is made): the default takes it only for some
     * splits and row counts, so here every product's two forms meet across the batch sizes */
    static const char *const tiled_env[] = { "PD_SK_TILED_ANY", "1", NULL };
    lin &= invariance_with_env(g, tiled_env, linear_invariance_all, "tiled");
    /* and with its CTAs of 128 x rows from the same row count (PD_SK_TILED_TALL; by default
     * only from 224 rows, past the batch sizes here) */
    static const char *const tall_env[] = { "PD_SK_TILED_ANY", "1", "PD_SK_TILED_TALL", "24", NULL };
    lin &= invariance_with_env(g, tall_env, linear_invariance_all, "tiled 64 x 128");
    TEST_CHECK_MSG(lin, "batch-invariant linear: a row differs between batch sizes");
    g->batch_invariant = 0;
    side_free(&sg);
    free(w);
    free(x);
    free(kh);
    free(vh);
    free(q);
}

/* linear_invariance_one for every epilogue over the K splits of 1..8 warps and Qwen3-4B's shapes;
 * 1 when every row came out the same */
static int linear_invariance_all(kern_backend *g)
{
    static const int qkv[3] = {517, 134, 139}, one[1] = {333}, gu[2] = {700, 700};
    int lin = linear_invariance_one(g, KERN_LINEAR_STORE, 1, 3, qkv, 1000);
    lin &= linear_invariance_one(g, KERN_LINEAR_ACCUMULATE, 0, 1, one, 520);
    lin &= linear_invariance_one(g, KERN_LINEAR_SWIGLU, 1, 2, gu, 1032);
    lin &= linear_invariance_one(g, KERN_LINEAR_STORE, 0, 1, one, 64);
    /* many tiles: the K split over fewer warps per CTA (chosen from the tile count only) */
    static const int qkv4[3] = {5000, 1003, 1003}, gu2[2] = {9000, 9000}, wide[1] = {20000};
    lin &= linear_invariance_one(g, KERN_LINEAR_STORE, 1, 3, qkv4, 264);
    lin &= linear_invariance_one(g, KERN_LINEAR_SWIGLU, 1, 2, gu2, 200);
    lin &= linear_invariance_one(g, KERN_LINEAR_ACCUMULATE, 0, 1, wide, 136);
    /* Qwen3-4B's products (the K split of each: QKV 4 warps, o_proj and down 8, gate/up 2) */
    static const int q4b[3] = {4096, 1024, 1024}, gu4b[2] = {9728, 9728}, h4b[1] = {2560};
    lin &= linear_invariance_one(g, KERN_LINEAR_STORE, 1, 3, q4b, 2560);
    lin &= linear_invariance_one(g, KERN_LINEAR_ACCUMULATE, 0, 1, h4b, 4096);
    lin &= linear_invariance_one(g, KERN_LINEAR_SWIGLU, 1, 2, gu4b, 2560);
    lin &= linear_invariance_one(g, KERN_LINEAR_ACCUMULATE, 0, 1, h4b, 9728);
    return lin;
}

int main(int argc, char **argv)
{
    opts.seed = 1234;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--perf") == 0) {
            opts.opt_perf = 1;
        } else if (strcmp(argv[i], "--perf-only") == 0) {
            opts.opt_perf = opts.opt_perf_only = 1;
        } else if (strcmp(argv[i], "--invariant") == 0) {
            opts.opt_invariant = 1;
        } else if (strcmp(argv[i], "--f32") == 0) {
            opts.opt_f32 = 1;
        } else if (strcmp(argv[i], "--self") == 0) {
            opts.opt_self = 1;
        } else if (strcmp(argv[i], "--op") == 0 && i + 1 < argc) {
            opts.opt_op = argv[++i];
        } else if (strcmp(argv[i], "--case") == 0 && i + 1 < argc) {
            opts.opt_case = argv[++i];
        } else if (strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
            opts.seed = strtoull(argv[++i], NULL, 10);
        } else {
            fprintf(stderr, "usage: %s [--op NAME] [--case TEXT] [--perf] [--perf-only] [--seed N] [--self] [--invariant] [--f32]\n", argv[0]);
            return 2;
        }
    }
#ifndef PD_HAVE_CUDA
    if (!opts.opt_self)
        TEST_SKIP("built without CUDA (PD_WITH_CUDA=OFF): nothing to compare the CPU backend with");
#else
    if (!opts.opt_self && kern_cuda_device_count() == 0)
        TEST_SKIP("no CUDA device visible");
#endif
    pd_err err;
    kern_backend *cpu = NULL, *gpu = NULL;
    kern_backend_config cc = { .name = "cpu" }, gc = { .name = opts.opt_self ? "cpu" : "cuda",
                                                              .f32 = opts.opt_f32 };
    if (fatal_status(kern_backend_create(&cc, &cpu, &err), &err, "cpu backend") ||
        fatal_status(kern_backend_create(&gc, &gpu, &err), &err, "cuda backend"))
        return 1;
    gpu->batch_invariant = opts.opt_invariant;
    const int gpu_act = gpu->act_bf16;
    /* Two passes: every op with fp32 activations (the arithmetic itself, held to the tolerances
     * of the table), then the ops that round activations with bf16 activations on both sides
     * (kern_backend.act_bf16, the CUDA default with bf16 weights): every value they write must be
     * a bf16 value, and the two sides may part by a bf16 step where a value sits on a rounding
     * boundary (tolerance 1e-2). */
    static const char *const rounding_ops[] = { "rmsnorm", "matmul", "rope", "unary", "binary", "attn",
                                                "linear", "mlp", "qkv", "qk_post", "markov_step" };
    int ran = 0;
    for (size_t i = 0; i < 2 * (sizeof(cases) / sizeof(cases[0])); i++) {
        size_t n_cases = sizeof(cases) / sizeof(cases[0]);
        int pass = i >= n_cases;
        kcase cb = cases[i % n_cases];
        const kcase *c = &cb;
        if (opts.opt_op != NULL && strcmp(opts.opt_op, c->op) != 0)
            continue;
        if ((c->perf_only && (!opts.opt_perf || pass)) || (!c->perf_only && opts.opt_perf_only))
            continue;
        if (pass) {
            int rounds = 0;
            for (size_t k = 0; k < sizeof(rounding_ops) / sizeof(rounding_ops[0]); k++)
                rounds |= strcmp(rounding_ops[k], c->op) == 0;
            if (!rounds || opts.opt_f32)
                continue;
            cb.tol = cb.tol > 1e-2 ? cb.tol : 1e-2;
        }
        cpu->act_bf16 = gpu->act_bf16 = expect_bf16 = pass;
        runner fn = NULL;
        for (size_t r = 0; r < sizeof(runners) / sizeof(runners[0]); r++)
            if (strcmp(runners[r].op, c->op) == 0)
                fn = runners[r].fn;
        if (fn == NULL) {
            TEST_CHECK_MSG(fn != NULL, "no runner for op %s", c->op);
            continue;
        }
        rng_state = opts.seed * 1000003ull + i % n_cases;
        side sc = {cpu, {0}, 0}, sg = {gpu, {0}, 0};
        run_ctx x = {&sc, &sg, c};
        char name[160];
        case_name(c, name, sizeof(name));
        if (opts.opt_case != NULL && strstr(name, opts.opt_case) == NULL)
            continue;
        if (pass)
            strncat(name, " bf16-act", sizeof(name) - strlen(name) - 1);
        double t0 = test_now_s();
        perf_note[0] = '\0';
        double e = fn(&x);
        int ok = e <= c->tol && e == e;
        printf("%s %-9s %-64s rel_l2 %.3e (tol %.0e) %.2fs\n", ok ? "ok  " : "FAIL", c->op, name, e,
               c->tol, test_now_s() - t0);
        fputs(perf_note, stdout);
        fflush(stdout);
        TEST_CHECK_MSG(ok, "case %zu: %s %s: rel_l2 %.3e > %.0e", i, c->op, name, e, c->tol);
        side_free(&sc);
        side_free(&sg);
        ran++;
    }
    cpu->act_bf16 = expect_bf16 = 0;
    gpu->act_bf16 = gpu_act;   /* the invariance test runs the backend's own mode */
    if (ran == 0)
        printf("no case matches --op %s\n", opts.opt_op != NULL ? opts.opt_op : "");
    /* the batch-invariant kernels are bf16 ones: fp32 weights go through cuBLAS SGEMM (--f32) */
    if (!opts.opt_self && !opts.opt_f32 && (opts.opt_op == NULL || strcmp(opts.opt_op, "invariance") == 0))
        test_batch_invariance(gpu);
    kern_backend_destroy(gpu);
    kern_backend_destroy(cpu);
    TEST_DONE();
}
