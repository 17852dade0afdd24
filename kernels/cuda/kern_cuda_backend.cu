/* kern_cuda_backend.cu - the CUDA backend object: device, stream, cuBLAS handle, workspace,
 *   buffers, host<->device copies, dtype conversion on upload, and the ops table.
 * Owns: kern_cuda_backend_create/destroy, kern_cuda_device_count, kern_cuda_ws_get.
 * Not here: the math of each op (kern_cuda_<family>.cu); shape checks (kern_ops.c).
 * Threading: one host thread at a time per backend. upload/download/upload_convert return once
 *   the host buffer has been read (it may be reused at once): downloads and large uploads after
 *   the copy completed; uploads up to KERN_CUDA_STAGE_MAX bytes are copied into a pinned staging
 *   ring and then to the device in stream order, without waiting for the stream (the engine's
 *   per-step metadata: a wait there idled the host until the GPU caught up, several times a
 *   round). download_spans / upload_spans move their small spans through the same ring, one
 *   copy kernel and one wait per ring fill (a sequence's KV pages: thousands of 32 KB pieces).
 *   Ops are asynchronous on the backend's stream until sync or download. */
#include "kern_cuda_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>
#include <sys/resource.h>

extern "C" {
#include "pd_log.h"
}

#define KERN_CUDA_CUBLAS_WS_BYTES ((size_t)32 << 20)
#define KERN_CUDA_CONVERT_CHUNK ((size_t)16 << 20)   /* values per staged chunk */
#define KERN_CUDA_STAGE_BYTES ((size_t)8 << 20)      /* pinned ring: small uploads, span copies */
#define KERN_CUDA_STAGE_MAX ((size_t)1 << 20)        /* larger uploads wait for their copy */

/* a batched copy's piece between the ring and device memory (span_copy_kernel) */
typedef struct {
    char *dst;
    const char *src;
    size_t n;
} span_desc;

#define SPAN_PIECES 1024   /* descriptors per ring fill, kept after the ring */
#define SPAN_RING_BYTES (KERN_CUDA_STAGE_BYTES + SPAN_PIECES * sizeof(span_desc))

extern "C" int kern_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();   /* clear the non-sticky error so later calls start clean */
        return 0;
    }
    return n;
}

pd_status kern_cuda_ws_get(kern_cuda_ctx *c, size_t bytes, void **out, pd_err *err)
{
    if (bytes <= c->ws_bytes && c->ws != NULL) {
        *out = c->ws;
        return PD_OK;
    }
    size_t want = bytes + bytes / 4 + ((size_t)1 << 20);
    /* kernels queued earlier may still read the old scratch */
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    if (c->ws != NULL) {
        PD_CUDA_TRY(cudaFree(c->ws), err);
        c->ws = NULL;
        c->ws_bytes = 0;
    }
    PD_CUDA_TRY(cudaMalloc(&c->ws, want), err);
    c->ws_bytes = want;
    c->ws_epoch++;
    *out = c->ws;
    return PD_OK;
}

static pd_status cuda_buf_alloc(kern_backend *be, size_t bytes, kern_buf **out, pd_err *err)
{
    kern_buf *b = (kern_buf *)calloc(1, sizeof(*b));
    if (b == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cuda buffer header");
    cudaError_t e = cudaMalloc(&b->ptr, bytes > 0 ? bytes : 1);
    if (e != cudaSuccess) {
        free(b);
        (void)cudaGetLastError();
        return pd_err_set(err, e == cudaErrorMemoryAllocation ? PD_ERR_NOMEM : PD_ERR_CUDA,
                          "cudaMalloc %zu bytes: %s", bytes, cudaGetErrorString(e));
    }
    b->be = be;
    b->bytes = bytes;
    *out = b;
    return PD_OK;
}

static void cuda_buf_free(kern_backend *be, kern_buf *b)
{
    (void)be;
    if (b == NULL)
        return;
    if (b->ptr != NULL)
        (void)cudaFree(b->ptr);   /* destructors do not fail; a sticky error shows up later */
    free(b);
}

/* The pinned ring, allocated at first use; NULL when pinned memory could not be had (copies
 * then go from pageable memory and wait for themselves). */
static char *stage_ring(kern_cuda_ctx *c)
{
    if (c->stage == NULL && !c->stage_failed &&
        cudaHostAlloc((void **)&c->stage, SPAN_RING_BYTES, cudaHostAllocDefault) != cudaSuccess) {
        (void)cudaGetLastError();
        c->stage = NULL;
        c->stage_failed = 1;
    }
    return c->stage;
}

/* Pinned host blocks handed out by host_alloc, process-wide (allocated portable, so a block one
 * rank's backend made is pinned for every device's: tensor-parallel ranks copy their parts of
 * one swap block), looked up by the batched copies to move a span in place. */
#define PINNED_MAX 256
static struct {
    pthread_mutex_t mu;
    int n;
    struct { const char *p; size_t n; } b[PINNED_MAX];
} pinned = { PTHREAD_MUTEX_INITIALIZER, 0, {} };

static pd_status cuda_host_alloc(kern_backend *be, size_t bytes, void **out, pd_err *err)
{
    (void)be;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
    if (e == cudaSuccess) {
        pthread_mutex_lock(&pinned.mu);
        int room = pinned.n < PINNED_MAX;
        if (room) {
            pinned.b[pinned.n].p = (const char *)p;
            pinned.b[pinned.n].n = bytes;
            pinned.n++;
        }
        pthread_mutex_unlock(&pinned.mu);
        if (room) {
            *out = p;
            return PD_OK;
        }
        (void)cudaFreeHost(p);   /* host_free must know it: an unregistered block would be free()d */
    } else {
        (void)cudaGetLastError();
    }
    /* pageable memory still works (through the ring); a locked-memory limit is common in
     * containers, so the first refusal says so, with the limit */
    if (posix_memalign(&p, 4096, bytes) != 0)
        return pd_err_set(err, PD_ERR_NOMEM, "host memory: %zu bytes (pinned: %s)", bytes, cudaGetErrorString(e));
    static int warned;   /* (a race only repeats the line) */
    if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED)) {
        struct rlimit rl;
        char lim[48] = "unknown";
        if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0)
            snprintf(lim, sizeof(lim), rl.rlim_cur == RLIM_INFINITY ? "unlimited" : "%.1f MiB",
                     (double)rl.rlim_cur / 1048576.0);
        PD_LOG_WARN("cuda", "pinned host memory refused for %.1f MiB (%s; locked-memory limit %s): using "
                    "pageable memory, so KV page copies through it go through the staging ring (slower); "
                    "raise the limit (ulimit -l, a container's memlock) to pin", (double)bytes / 1048576.0,
                    e == cudaSuccess ? "too many pinned blocks" : cudaGetErrorString(e), lim);
    }
    *out = p;
    return PD_OK;
}

static void cuda_host_free(kern_backend *be, void *p)
{
    (void)be;
    int found = 0;
    pthread_mutex_lock(&pinned.mu);
    for (int i = 0; i < pinned.n; i++)
        if (pinned.b[i].p == (const char *)p) {
            pinned.b[i] = pinned.b[--pinned.n];
            found = 1;
            break;
        }
    pthread_mutex_unlock(&pinned.mu);
    if (found)
        (void)cudaFreeHost(p);
    else
        free(p);
}

/* 1 when [p, p + n) lies in one pinned block of host_alloc's */
static int host_pinned(const void *p, size_t n)
{
    const char *c = (const char *)p;
    int hit = 0;
    pthread_mutex_lock(&pinned.mu);
    for (int i = 0; i < pinned.n && !hit; i++)
        hit = c >= pinned.b[i].p && n <= pinned.b[i].n && (size_t)(c - pinned.b[i].p) <= pinned.b[i].n - n;
    pthread_mutex_unlock(&pinned.mu);
    return hit;
}

static pd_status cuda_upload(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (n <= KERN_CUDA_STAGE_MAX && stage_ring(c) != NULL) {
        /* a staged copy inside a capture would be recorded and replay stale ring contents */
        if (c->capturing)
            return pd_err_set(err, PD_ERR_INTERNAL, "cuda upload of %zu bytes during a graph capture", n);
        size_t need = (n + 255) & ~(size_t)255;
        if (c->stage_head + need > KERN_CUDA_STAGE_BYTES) {
            /* the ring wraps: every copy out of it must have landed before it is written again */
            PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
            c->stage_head = 0;
        }
        char *at = c->stage + c->stage_head;
        memcpy(at, src, n);
        PD_CUDA_TRY(cudaMemcpyAsync(dst, at, n, cudaMemcpyHostToDevice, c->stream), err);
        c->stage_head += need;
        return PD_OK;
    }
    PD_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, c->stream), err);
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    return PD_OK;
}

static pd_status cuda_download(kern_backend *be, void *dst, const void *src, size_t n, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, c->stream), err);
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    return PD_OK;
}

/* Batched copies (download_spans, upload_spans): spans of <= KERN_CUDA_STAGE_MAX bytes go
 * through the pinned ring, and one launch of span_copy_kernel per ring fill moves all of them
 * between the ring and device memory (the ring is host memory the device reads and writes
 * directly: unified addressing), so a fill costs one launch and one wait instead of a
 * cudaMemcpyAsync per span (~7 us each: 9216 pages of 32 KB took 67 ms that way, H100).
 * Larger spans are copied straight (the driver stages pageable memory itself). A span whose
 * host side lies in pinned memory of host_alloc's skips the ring: its piece reads or writes the
 * host memory in place (no ring bytes, no host memcpy; only a descriptor). The fill's
 * descriptors sit after the ring; every batched copy waits for its last fill, so they are free
 * when the next one starts. */

/* CTA i copies piece i (16 bytes at a time where both ends and the size allow) */
__global__ void __launch_bounds__(256) span_copy_kernel(const span_desc *d)
{
    const span_desc s = d[blockIdx.x];
    if ((((uintptr_t)s.dst | (uintptr_t)s.src | s.n) & 15) == 0) {
        for (size_t i = (size_t)threadIdx.x * 16; i < s.n; i += (size_t)blockDim.x * 16)
            *(uint4 *)(s.dst + i) = *(const uint4 *)(s.src + i);
    } else {
        for (size_t i = threadIdx.x; i < s.n; i += blockDim.x)
            s.dst[i] = s.src[i];
    }
}

/* Runs the fill's np pieces, waits, copies downloaded pieces out to their host addresses, and
 * empties the ring (every copy queued before has finished, uploads' included). */
static pd_status span_fill(kern_cuda_ctx *c, int *np, const kern_copy_span *out, pd_err *err)
{
    if (*np > 0) {
        span_copy_kernel<<<*np, 256, 0, c->stream>>>((const span_desc *)(c->stage + KERN_CUDA_STAGE_BYTES));
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    for (int i = 0; out != NULL && i < *np; i++)
        if (out[i].n > 0)   /* 0: a pinned span, written in place */
            memcpy(out[i].dst, out[i].src, out[i].n);
    *np = 0;
    c->stage_head = 0;
    return PD_OK;
}

static pd_status spans_copy(kern_backend *be, const kern_copy_span *spans, int n, int to_host, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    if (c->capturing)
        return pd_err_set(err, PD_ERR_INTERNAL, "cuda copy of %d spans during a graph capture", n);
    if (stage_ring(c) == NULL) {
        for (int i = 0; i < n; i++)
            PD_CUDA_TRY(cudaMemcpyAsync(spans[i].dst, spans[i].src, spans[i].n, kind, c->stream), err);
        PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
        return PD_OK;
    }
    span_desc *d = (span_desc *)(c->stage + KERN_CUDA_STAGE_BYTES);
    kern_copy_span *out = NULL;   /* downloads: ring -> host once a fill has landed */
    if (to_host && (out = (kern_copy_span *)malloc(SPAN_PIECES * sizeof(*out))) == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "copy spans: piece list");
    int np = 0;
    pd_status st = PD_OK;
    for (int i = 0; i < n && st == PD_OK; i++) {
        size_t m = spans[i].n, need = (m + 255) & ~(size_t)255;
        if (m == 0)
            continue;
        if (m > KERN_CUDA_STAGE_MAX) {
            cudaError_t e = cudaMemcpyAsync(spans[i].dst, spans[i].src, m, kind, c->stream);
            if (e != cudaSuccess)
                st = pd_err_set(err, PD_ERR_CUDA, "cudaMemcpyAsync of a span: %s", cudaGetErrorString(e));
            continue;
        }
        const int direct = host_pinned(to_host ? spans[i].dst : spans[i].src, m);
        if (direct)
            need = 0;
        if ((c->stage_head + need > KERN_CUDA_STAGE_BYTES || np == SPAN_PIECES) &&
            (st = span_fill(c, &np, out, err)) != PD_OK)
            break;
        if (direct) {
            d[np] = (span_desc){ (char *)spans[i].dst, (const char *)spans[i].src, m };
            if (to_host)
                out[np] = (kern_copy_span){ NULL, NULL, 0 };
            np++;
            continue;
        }
        char *at = c->stage + c->stage_head;
        if (to_host) {
            d[np] = (span_desc){ at, (const char *)spans[i].src, m };
            out[np] = (kern_copy_span){ spans[i].dst, at, m };
        } else {
            memcpy(at, spans[i].src, m);
            d[np] = (span_desc){ (char *)spans[i].dst, at, m };
        }
        np++;
        c->stage_head += need;
    }
    if (st == PD_OK)
        st = span_fill(c, &np, out, err);
    free(out);
    return st;
}

static pd_status cuda_download_spans(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err)
{
    return spans_copy(be, spans, n, 1, err);
}

static pd_status cuda_upload_spans(kern_backend *be, const kern_copy_span *spans, int n, pd_err *err)
{
    return spans_copy(be, spans, n, 0, err);
}

/* An instantiated graph and the scratch epoch it was captured in. */
typedef struct {
    cudaGraphExec_t exec;
    unsigned ws_epoch;
} cuda_graph;

static pd_status cuda_mem_info(kern_backend *be, size_t *free_bytes, size_t *total_bytes, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaSetDevice(c->device), err);
    PD_CUDA_TRY(cudaMemGetInfo(free_bytes, total_bytes), err);
    return PD_OK;
}

static pd_status cuda_graph_begin(kern_backend *be, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal), err);
    c->capture_epoch = c->ws_epoch;
    c->capturing = 1;
    return PD_OK;
}

static pd_status cuda_graph_end(kern_backend *be, void **out, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    cudaGraph_t g = NULL;
    c->capturing = 0;
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess || g == NULL) {
        (void)cudaGetLastError();   /* an op failed inside the capture; it is discarded */
        if (g != NULL)
            (void)cudaGraphDestroy(g);
        return pd_err_set(err, PD_ERR_CUDA, "graph capture: %s", cudaGetErrorString(e));
    }
    if (c->ws_epoch != c->capture_epoch) {
        (void)cudaGraphDestroy(g);
        return pd_err_set(err, PD_ERR_BUSY, "graph capture: scratch memory moved while capturing");
    }
    cuda_graph *cg = (cuda_graph *)calloc(1, sizeof(*cg));
    if (cg == NULL) {
        (void)cudaGraphDestroy(g);
        return pd_err_set(err, PD_ERR_NOMEM, "graph");
    }
    e = cudaGraphInstantiate(&cg->exec, g, 0);
    (void)cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        free(cg);
        return pd_err_set(err, PD_ERR_CUDA, "graph instantiate: %s", cudaGetErrorString(e));
    }
    cg->ws_epoch = c->ws_epoch;
    *out = cg;
    return PD_OK;
}

static pd_status cuda_graph_launch(kern_backend *be, void *graph, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    cuda_graph *cg = (cuda_graph *)graph;
    if (cg->ws_epoch != c->ws_epoch)
        return pd_err_set(err, PD_ERR_BUSY, "graph stale: scratch memory moved since capture");
    PD_CUDA_TRY(cudaGraphLaunch(cg->exec, c->stream), err);
    return PD_OK;
}

static void cuda_graph_free(kern_backend *be, void *graph)
{
    (void)be;
    cuda_graph *cg = (cuda_graph *)graph;
    (void)cudaGraphExecDestroy(cg->exec);
    free(cg);
}

static pd_status cuda_memset0(kern_backend *be, void *dst, size_t n, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaMemsetAsync(dst, 0, n, c->stream), err);
    return PD_OK;
}

static int float_dtype(kern_dtype dt)
{
    return dt == KERN_DTYPE_F32 || dt == KERN_DTYPE_BF16 || dt == KERN_DTYPE_F16;
}

static pd_status cuda_upload_convert(kern_backend *be, void *dst, kern_dtype dst_dtype,
                                     const void *src, kern_dtype src_dtype, size_t n, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (src_dtype == dst_dtype)
        return cuda_upload(be, dst, src, n * kern_cuda_dtype_size(src_dtype), err);
    if (!float_dtype(src_dtype) || !float_dtype(dst_dtype))
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda upload_convert: %s -> %s",
                          kern_cuda_dtype_name(src_dtype), kern_cuda_dtype_name(dst_dtype));
    size_t ssz = kern_cuda_dtype_size(src_dtype), dsz = kern_cuda_dtype_size(dst_dtype);
    size_t chunk = n < KERN_CUDA_CONVERT_CHUNK ? n : KERN_CUDA_CONVERT_CHUNK;
    void *stage = NULL;
    pd_status st = kern_cuda_ws_get(c, chunk * ssz, &stage, err);
    if (st != PD_OK)
        return st;
    /* stream order makes each chunk's copy wait for the previous chunk's conversion */
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = n - off < chunk ? n - off : chunk;
        PD_CUDA_TRY(cudaMemcpyAsync(stage, (const char *)src + off * ssz, m * ssz,
                                    cudaMemcpyHostToDevice, c->stream), err);
        st = kern_cuda_convert_launch(be, (char *)dst + off * dsz, dst_dtype, stage, src_dtype, m,
                                      err);
        if (st != PD_OK)
            return st;
    }
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    return PD_OK;
}

static pd_status cuda_sync(kern_backend *be, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    return PD_OK;
}

/* Frees whatever part of the context exists; safe on a half-built context. */
static void ctx_release(kern_cuda_ctx *c)
{
    if (c == NULL)
        return;
    if (c->stream != NULL)
        (void)cudaStreamSynchronize(c->stream);
    if (c->cublas != NULL)
        (void)cublasDestroy(c->cublas);
    if (c->cublas_ws != NULL)
        (void)cudaFree(c->cublas_ws);
    if (c->ws != NULL)
        (void)cudaFree(c->ws);
    if (c->counter != NULL)
        (void)cudaFree(c->counter);
    if (c->attn_cnt != NULL)
        (void)cudaFree(c->attn_cnt);
    if (c->stage != NULL)
        (void)cudaFreeHost(c->stage);
    if (c->stream != NULL)
        (void)cudaStreamDestroy(c->stream);
    free(c);
}

static void cuda_destroy(kern_backend *be)
{
    if (be == NULL)
        return;
    ctx_release(kern_cuda_ctx_of(be));
    free(be);
}

static const kern_backend_ops cuda_ops = {
    .name = "cuda",
    .buf_alloc = cuda_buf_alloc,
    .buf_free = cuda_buf_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .download_spans = cuda_download_spans,
    .upload_spans = cuda_upload_spans,
    .memset0 = cuda_memset0,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .upload_convert = cuda_upload_convert,
    .sync = cuda_sync,
    .mem_info = cuda_mem_info,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_launch = cuda_graph_launch,
    .graph_free = cuda_graph_free,
    .embed = kern_cuda_embed_launch,
    .rmsnorm = kern_cuda_rmsnorm_launch,
    .matmul = kern_cuda_matmul_launch,
    .rope = kern_cuda_rope_launch,
    .unary = kern_cuda_unary_launch,
    .binary = kern_cuda_binary_launch,
    .copy_rows = kern_cuda_copy_rows_launch,
    .kv_store = kern_cuda_kv_store_launch,
    .attn = kern_cuda_attn_launch,
    .argmax = kern_cuda_argmax_launch,
    .linear = kern_cuda_linear_launch,
    .qk_post = kern_cuda_qk_post_launch,
    .mlp = kern_cuda_mlp_launch,
    .qkv = kern_cuda_qkv_launch,
    .attn_block = kern_cuda_attn_block_launch,
    .markov_step = kern_cuda_markov_step_launch,
    .markov_chain = kern_cuda_markov_chain_launch,
    .probs = kern_cuda_probs_launch,
    .sample = kern_cuda_sample_launch,
    .spec_verify = kern_cuda_spec_verify_launch,
    .penalty = kern_cuda_penalty_launch,
    .token_mask = kern_cuda_token_mask_launch,
    .logprobs = kern_cuda_logprobs_launch,
    .destroy = cuda_destroy,
};

extern "C" pd_status kern_cuda_bind_thread(kern_backend *be, int *device, pd_err *err)
{
    if (be == NULL || be->ops != &cuda_ops)
        return pd_err_set(err, PD_ERR_INVALID, "bind thread: not a cuda backend");
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaSetDevice(c->device), err);
    if (device != NULL)
        *device = c->device;
    return PD_OK;
}

extern "C" void *kern_cuda_stream(kern_backend *be)
{
    if (be == NULL || be->ops != &cuda_ops)
        return NULL;
    return (void *)kern_cuda_ctx_of(be)->stream;
}

#ifdef PD_KTRACE
extern "C" void kern_cuda_kt_set_linear(kern_cuda_kt_rec *b, unsigned *c, unsigned cap);
extern "C" void kern_cuda_kt_set_qkpost(kern_cuda_kt_rec *b, unsigned *c, unsigned cap);
extern "C" void kern_cuda_kt_set_attn(kern_cuda_kt_rec *b, unsigned *c, unsigned cap);
#define KT_CAP (1u << 18)
static kern_cuda_kt_rec *kt_dev;
static unsigned *kt_dcnt;

extern "C" pd_status kern_cuda_trace_begin(kern_backend *be, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    if (kt_dev == NULL) {
        PD_CUDA_TRY(cudaMalloc((void **)&kt_dev, KT_CAP * sizeof(kern_cuda_kt_rec)), err);
        PD_CUDA_TRY(cudaMalloc((void **)&kt_dcnt, sizeof(unsigned)), err);
    }
    PD_CUDA_TRY(cudaMemset(kt_dcnt, 0, sizeof(unsigned)), err);
    kern_cuda_kt_set_linear(kt_dev, kt_dcnt, KT_CAP);
    kern_cuda_kt_set_qkpost(kt_dev, kt_dcnt, KT_CAP);
    kern_cuda_kt_set_attn(kt_dev, kt_dcnt, KT_CAP);
    PD_CUDA_TRY(cudaDeviceSynchronize(), err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_trace_end(kern_backend *be, const char *path, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    unsigned n = 0;
    PD_CUDA_TRY(cudaMemcpy(&n, kt_dcnt, sizeof(n), cudaMemcpyDeviceToHost), err);
    if (n > KT_CAP)
        n = KT_CAP;
    kern_cuda_kt_rec *h = (kern_cuda_kt_rec *)malloc((size_t)n * sizeof(*h) + 1);
    if (h == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "trace records");
    cudaError_t e = cudaMemcpy(h, kt_dev, (size_t)n * sizeof(*h), cudaMemcpyDeviceToHost);
    kern_cuda_kt_set_linear(NULL, NULL, 0);
    kern_cuda_kt_set_qkpost(NULL, NULL, 0);
    kern_cuda_kt_set_attn(NULL, NULL, 0);
    FILE *f = e == cudaSuccess ? fopen(path, "w") : NULL;
    if (f != NULL) {
        fprintf(f, "kind,tag,cta,sm,t0,t1,t2,x0,x1,x2\n");
        for (unsigned i = 0; i < n; i++)
            fprintf(f, "%u,%llx,%u,%u,%llu,%llu,%llu,%llu,%llu,%llu\n", h[i].kind, h[i].tag, h[i].cta,
                    h[i].sm, h[i].t0, h[i].t1, h[i].t2, h[i].tx[0], h[i].tx[1], h[i].tx[2]);
        fclose(f);
    }
    free(h);
    PD_CUDA_TRY(e, err);
    if (f == NULL)
        return pd_err_set(err, PD_ERR_IO, "trace: cannot write %s", path);
    return PD_OK;
}
#else
extern "C" pd_status kern_cuda_trace_begin(kern_backend *be, pd_err *err)
{
    (void)be;
    return pd_err_set(err, PD_ERR_INVALID, "trace: built without PD_KTRACE");
}

extern "C" pd_status kern_cuda_trace_end(kern_backend *be, const char *path, pd_err *err)
{
    (void)be;
    (void)path;
    return pd_err_set(err, PD_ERR_INVALID, "trace: built without PD_KTRACE");
}
#endif

/* a knob that is on unless the variable is "0" */
static int env_on(const char *name)
{
    const char *v = getenv(name);
    return !(v != NULL && strcmp(v, "0") == 0);
}

static pd_status ctx_init(kern_cuda_ctx *c, int device, pd_err *err)
{
    int n = kern_cuda_device_count();
    if (device < 0 || device >= n)
        return pd_err_set(err, PD_ERR_CUDA, "cuda device %d: %d device(s) visible", device, n);
    c->device = device;
    PD_CUDA_TRY(cudaSetDevice(device), err);
    PD_CUDA_TRY(cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, device), err);
    PD_CUDA_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), err);
    PD_CUBLAS_TRY(cublasCreate(&c->cublas), err);
    PD_CUBLAS_TRY(cublasSetStream(c->cublas, c->stream), err);
    PD_CUDA_TRY(cudaMalloc(&c->cublas_ws, KERN_CUDA_CUBLAS_WS_BYTES), err);
    c->cublas_ws_bytes = KERN_CUDA_CUBLAS_WS_BYTES;
    PD_CUBLAS_TRY(cublasSetWorkspace(c->cublas, c->cublas_ws, c->cublas_ws_bytes), err);
    PD_CUDA_TRY(cudaMalloc((void **)&c->counter, sizeof(unsigned int)), err);
    PD_CUDA_TRY(cudaMemsetAsync(c->counter, 0, sizeof(unsigned int), c->stream), err);
    PD_CUDA_TRY(cudaMalloc((void **)&c->attn_cnt, KERN_CUDA_ATTN_COUNTERS * sizeof(unsigned int)), err);
    PD_CUDA_TRY(cudaMemsetAsync(c->attn_cnt, 0, KERN_CUDA_ATTN_COUNTERS * sizeof(unsigned int),
                                c->stream), err);
    PD_CUDA_TRY(cudaStreamSynchronize(c->stream), err);
    const char *mk = getenv("PD_MK_CHAIN");
    c->mk_chain_old = mk != NULL && strcmp(mk, "old") == 0;
    c->mk_chain_pdl = env_on("PD_MK_CHAIN_PDL");
    c->decode_early = env_on("PD_DECODE_EARLY");
    c->argmax_cluster = env_on("PD_ARGMAX_CLUSTER");
    c->attn_cluster = env_on("PD_ATTN_CLUSTER");
    c->sk_spread = env_on("PD_SK_SPREAD");
    c->attn_coop = env_on("PD_ATTN_COOP");
    const char *aw = getenv("PD_ATTN_WARPS");
    c->attn_warps = aw && atoi(aw) == 4 ? 4 : 8;
    c->attn_coop2 = env_on("PD_ATTN_COOP2");
    c->attn_kv_ef = env_on("PD_ATTN_KV_EF");
    c->attn_one_tile = env_on("PD_ATTN_ONE_TILE");
    const char *spc = getenv("PD_ATTN_SPC");
    int sv = spc != NULL ? atoi(spc) : 0;
    c->attn_spc = sv == 1 || sv == 2 || sv == 4 || sv == 8 || sv == 16 ? sv : 0;
    c->small_pdl = env_on("PD_SMALL_PDL");
    c->sk_batch = env_on("PD_SK_BATCH");
    c->sk_xpack = env_on("PD_SK_XPACK");
    const char *skr = getenv("PD_SK_R");
    c->sk_r = skr != NULL && atoi(skr) == 1 ? 1 : 2;
    c->sk_chunk_major = env_on("PD_SK_CHUNK_MAJOR");
    const char *stm = getenv("PD_SK_TILED_MIN");
    c->sk_tiled_min = stm != NULL ? atoi(stm) : 24;
    const char *sta = getenv("PD_SK_TILED_ANY");
    c->sk_tiled_any = sta != NULL && atoi(sta) == 1;
    const char *stt = getenv("PD_SK_TILED_TALL");
    c->sk_tiled_tall = stt != NULL ? atoi(stt) : 224;
    const char *skt = getenv("PD_SK_MAX_TILES");
    int mt = skt != NULL ? atoi(skt) : 8;
    c->sk_max_tiles = mt == 2 || mt == 4 ? mt : 8;
    const char *skw = getenv("PD_SK_WIDE_WARPS");
    int w = skw != NULL ? atoi(skw) : 2;
    c->sk_wide_warps = w == 1 || w == 2 || w == 4 || w == 8 ? w : 2;
    return PD_OK;
}

extern "C" pd_status kern_cuda_backend_create(const kern_backend_config *cfg, kern_backend **out,
                                              pd_err *err)
{
    kern_cuda_ctx *c = (kern_cuda_ctx *)calloc(1, sizeof(*c));
    if (c == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cuda backend context");
    kern_backend *be = (kern_backend *)calloc(1, sizeof(*be));
    if (be == NULL) {
        free(c);
        return pd_err_set(err, PD_ERR_NOMEM, "cuda backend");
    }
    pd_status st = ctx_init(c, cfg != NULL ? cfg->device : 0, err);
    if (st != PD_OK) {
        ctx_release(c);
        free(be);
        return st;
    }
    be->ops = &cuda_ops;
    be->impl = c;
    be->weight_dtype = cfg != NULL && cfg->f32 ? KERN_DTYPE_F32 : KERN_DTYPE_BF16;
    be->act_bf16 = be->weight_dtype == KERN_DTYPE_BF16;   /* a bf16 model's activations */
    be->kv_dtype = be->weight_dtype;
    be->is_host = 0;
    *out = be;
    return PD_OK;
}
