/* kern_cuda_internal.h - private to the .cu files of kernels/cuda: the backend state,
 *   PD_CUDA_TRY and the host launchers behind the ops table.
 * Owns: struct kern_cuda_ctx (device, stream, cuBLAS handle, workspace), error macros, small
 *   device helpers shared by several op families (dtype loads, warp reductions).
 * Not here: shape checks (kern_ops.c runs them before any launcher), public API (kern_cuda.h).
 * Threading: a context is used by one host thread at a time; all work goes to ctx->stream. */
#ifndef KERN_CUDA_INTERNAL_H
#define KERN_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "kern_backend.h"
#include "pd_status.h"
}

#include "kern_cuda.h"

#define KERN_CUDA_SK_FORMS 30   /* skinny_kernel forms: 4 tile counts x 3 epilogues x 2 load forms,
                                   then 3 tile counts x 2 epilogues with two W tiles per CTA */

typedef struct kern_cuda_ctx {
    int device;
    int n_sm;                  /* multiprocessors, sizes split-K grids */
    cudaStream_t stream;       /* every op and copy of this backend runs here, in order */
    cublasHandle_t cublas;     /* bound to stream */
    void *cublas_ws;           /* fixed cuBLAS workspace (keeps GEMMs graph-capturable) */
    size_t cublas_ws_bytes;
    void *ws;                  /* op scratch, grown on demand; one op uses it at a time */
    unsigned int *counter;     /* zeroed device word for last-block-done reductions; an op that
                                  uses it leaves it zero again (markov_step, markov_chain) */
    unsigned int *attn_cnt;    /* KERN_CUDA_ATTN_COUNTERS zeroed words: arrival counters of the
                                  batch-invariant attention merge, left zero by each launch */
    int attn_inv_smem_set;     /* attn_inv_kernel's shared-memory limit raised on this device */
    int attn_cluster;          /* 1 unless PD_ATTN_CLUSTER=0 at creation: attn_inv_kernel merges
                                  its splits through a thread-block cluster where it fits */
    int sk_spread;             /* 1 unless PD_SK_SPREAD=0 at creation: a one-wave skinny GEMM
                                  takes idle warps so that no SM holds more than ceil(CTAs / SMs)
                                  of its CTAs (the block scheduler fills SMs one by one) */
    int attn_one_tile;         /* 1 unless PD_ATTN_ONE_TILE=0 at creation: a batch-invariant
                                  attention of verify/draft blocks puts one m-tile of rows in a
                                  CTA (attn_inv_launch) */
    int attn_spc;              /* PD_ATTN_SPC at creation (1..16): key splits per CTA of the
                                  batch-invariant attention outside clusters; 0: by grid size */
    int attn_coop;             /* 1 unless PD_ATTN_COOP=0 at creation: a batch-invariant attention
                                  CTA of one m-tile spreads it over all its warps */
    int attn_warps;            /* 8 unless PD_ATTN_WARPS=4 at creation: such a coop CTA has eight
                                  warps at head_dim 128 (attn_inv_launch) */
    int attn_coop2;            /* 1 unless PD_ATTN_COOP2=0 at creation: a CTA of two m-tiles has
                                  its four warps in a pair per m-tile (attn_inv_launch) */
    int attn_kv_ef;            /* 1 unless PD_ATTN_KV_EF=0 at creation: the batch-invariant
                                  attention loads K/V under an L2 evict-first policy */
    signed char attn_cluster_ok[2][17][5];   /* [hd 64][splits][rows / 16]: 1 such a cluster
                                  fits on this device, -1 not, 0 not asked yet */
    int mk_chain_old;          /* PD_MK_CHAIN=old at creation: markov_chain keeps its L2-streaming
                                  kernel (A/B against the shared-memory one) */
    int mk_chain_pdl;          /* 1 unless PD_MK_CHAIN_PDL=0 at creation: the shared-memory chain
                                  kernel is a programmatic dependent launch (fills its w2 slice
                                  while the previous kernel drains) */
    int decode_early;          /* 1 unless PD_DECODE_EARLY=0 at creation: after a skinny QKV
                                  projection (batch-invariant rounds) qk_post and the attention
                                  start early (kern_cuda_attn_launch_after_store) */
    int small_pdl;             /* 1 unless PD_SMALL_PDL=0 at creation: the row kernels (embed,
                                  copy_rows, rmsnorm) are programmatic dependent launches that let
                                  the next kernel start at once (a skinny GEMM after them fills
                                  its weight ring while they run) */
    int sk_wide_warps;         /* K-split warps (1, 2, 4, 8) of the skinny GEMM for shapes whose
                                  tiles need several waves (lm_head): PD_SK_WIDE_WARPS at
                                  creation, 2 without it */
    signed char sk_occ[KERN_CUDA_SK_FORMS][9][9];   /* skinny GEMM CTAs per SM on this device, per
                                  kernel form, K-split warps and block warps (0: not asked yet;
                                  kern_cuda_linear.cu) */
    int sk_batch;              /* 1 unless PD_SK_BATCH=0 at creation: a one-tile skinny GEMM other
                                  than SwiGLU loads W and x in batches of 2 steps instead of its
                                  3-step register ring (skinny_kernel's BT form) */
    int sk_xpack;              /* 1 unless PD_SK_XPACK=0 at creation: a skinny GEMM of more than
                                  one 8-row tile reads x packed once to bf16 (norm applied, each
                                  row's sums of squares made the kernel's way) by a prologue
                                  kernel, a step ahead, instead of f32 x and the norm at use */
    int sk_r;                  /* 2 unless PD_SK_R=1 at creation: W tiles per CTA of the skinny
                                  GEMM's XB form at >= 4 x tiles (kern_cuda_linear.cu) */
    int sk_max_tiles;          /* 8-row x tiles per chunk of the skinny GEMM (2, 4 or 8):
                                  PD_SK_MAX_TILES at creation, 8 without it */
    int sk_tiled_min;          /* rows from which a batch-invariant product may run the tiled
                                  form (sk_tiled_kernel, same bits; tiled_wanted): PD_SK_TILED_MIN
                                  at creation (0: never), 24 without it */
    int sk_tiled_any;          /* PD_SK_TILED_ANY=1 at creation: the tiled form from sk_tiled_min
                                  rows whatever the K split */
    int argmax_cluster;        /* 1 unless PD_ARGMAX_CLUSTER=0 at creation: an argmax of few long
                                  rows spreads each over a cluster of 8 CTAs (kern_cuda_argmax.cu) */
    int sk_tiled_tall;         /* rows from which the tiled form takes CTAs of 64 weight x 128
                                  x rows instead of 64 x 64 (same bits; tiled_launch): where the
                                  K split is at most 2, and for any split from 512 rows (or with
                                  sk_tiled_any); PD_SK_TILED_TALL at creation (0: never), 224
                                  without it */
    int sk_tiled_smem;         /* bit: a sk_tiled_kernel form's shared-memory limit raised */
    int sk_chunk_major;        /* 1 unless PD_SK_CHUNK_MAJOR=0 at creation: a skinny GEMM of
                                  several 64-row chunks runs a tile's chunks side by side */
    int probs_setup;           /* probs/sample kernels: limits asked on this device (kern_cuda_sample.cu,
                                  at their first launch) */
    int probs_smem_max;        /* opt-in shared memory of one CTA, bytes */
    int probs_cl_max[5];       /* [l]: clusters of 2^l probs CTAs (1024 threads each) the device runs
                                  at once (0: none); [0] the SM count */
    int probs_cl_force;        /* PD_PROBS_CLUSTER at their first launch: 1, 2, 4, 8 or 16 CTAs per
                                  row for every probs/sample launch (A/B runs, tests), 0 chosen per
                                  launch from the rows */
    int probs_gather;          /* PD_PROBS_GATHER=1 at their first launch (default 0): once at
                                  most PR_GATHER tokens of a row survive, each CTA of its cluster
                                  gathers them and finishes alone */
    size_t ws_bytes;
    unsigned ws_epoch;         /* bumped whenever ws moves: graphs captured before are stale */
    unsigned capture_epoch;    /* ws_epoch when the capture in progress began */
    int capturing;             /* between graph_begin and graph_end */
    char *stage;               /* pinned ring of small uploads (kern_cuda_backend.cu) */
    size_t stage_head;
    int stage_failed;
} kern_cuda_ctx;

#define KERN_CUDA_ATTN_COUNTERS 65536

static inline kern_cuda_ctx *kern_cuda_ctx_of(kern_backend *be)
{
    return (kern_cuda_ctx *)be->impl;
}

/* Wraps a CUDA runtime call: on failure sets PD_ERR_CUDA with the call text, file and line and
 * returns it from the enclosing function (which must return pd_status). */
#define PD_CUDA_TRY(expr, err) \
    do { \
        cudaError_t pd_cuda_e_ = (expr); \
        if (pd_cuda_e_ != cudaSuccess) \
            return pd_err_set((err), PD_ERR_CUDA, "%s: %s (%s:%d)", #expr, \
                              cudaGetErrorString(pd_cuda_e_), __FILE__, __LINE__); \
    } while (0)

/* The same for cuBLAS status codes. */
#define PD_CUBLAS_TRY(expr, err) \
    do { \
        cublasStatus_t pd_cublas_s_ = (expr); \
        if (pd_cublas_s_ != CUBLAS_STATUS_SUCCESS) \
            return pd_err_set((err), PD_ERR_CUDA, "%s: %s (%s:%d)", #expr, \
                              cublasGetStatusString(pd_cublas_s_), __FILE__, __LINE__); \
    } while (0)

/* After a kernel launch: reports a bad launch configuration (not asynchronous faults). */
#define KERN_CUDA_LAUNCH_CHECK(err) PD_CUDA_TRY(cudaGetLastError(), err)

/* Returns scratch of at least bytes on the device (contents undefined), growing ctx->ws. A grow
 * waits for the stream first, so it must not happen while a graph is being captured. */
pd_status kern_cuda_ws_get(kern_cuda_ctx *c, size_t bytes, void **out, pd_err *err);

/* Local copies of kern_dtype_size/kern_dtype_name: this library links below pd_kernels and must
 * not call back into it (static libraries, one link order). */
static inline size_t kern_cuda_dtype_size(kern_dtype dt)
{
    return dt == KERN_DTYPE_BF16 || dt == KERN_DTYPE_F16 ? 2 : 4;
}

static inline const char *kern_cuda_dtype_name(kern_dtype dt)
{
    switch (dt) {
    case KERN_DTYPE_F32: return "f32";
    case KERN_DTYPE_BF16: return "bf16";
    case KERN_DTYPE_F16: return "f16";
    case KERN_DTYPE_I32: return "i32";
    }
    return "?";
}

/* Grid helper: blocks of `threads` covering n items, capped (kernels use grid-stride loops). */
static inline unsigned kern_cuda_blocks(size_t n, unsigned threads)
{
    size_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    if (b > 65535u * 8u)
        b = 65535u * 8u;
    return (unsigned)b;
}

/* n rounded up to a multiple of 256 bytes: where one scratch buffer holds several arrays */
static inline size_t kern_cuda_align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Grid of an elementwise kernel over a [rows, cols] view walked with KERN_CUDA_FOR_RC: x covers
 * the columns (`threads` per block), y the rows (grid-stride past 65535). Row and column come
 * from the grid, not from dividing a flat index: a 64-bit division per element made the
 * elementwise passes of an 8k prefill 3-4x slower than their bytes (ncu, docs/BENCHMARKS.md). */
static inline dim3 kern_cuda_grid_rc(int rows, int cols, unsigned threads)
{
    unsigned gx = (unsigned)((cols + (int)threads - 1) / (int)threads);
    unsigned gy = rows < 65535 ? (unsigned)rows : 65535u;
    return dim3(gx < 1 ? 1 : gx, gy < 1 ? 1 : gy);
}

#define KERN_CUDA_FOR_RC(r, c, rows, cols) \
    for (int r = (int)blockIdx.y; r < (rows); r += (int)gridDim.y) \
        for (int c = (int)(blockIdx.x * blockDim.x + threadIdx.x); c < (cols); \
             c += (int)(gridDim.x * blockDim.x))

/* The same, 4 columns per thread (cols % 4 == 0; grid from kern_cuda_grid_rc(rows, cols / 4, ..)):
 * one 16-byte (F32) or 8-byte (BF16/F16) access per array per step, which the elementwise passes
 * of a prefill need to come near the copy rate (docs/BENCHMARKS.md). */
#define KERN_CUDA_FOR_RC4(r, c, rows, cols) \
    for (int r = (int)blockIdx.y; r < (rows); r += (int)gridDim.y) \
        for (int c = 4 * (int)(blockIdx.x * blockDim.x + threadIdx.x); c < (cols); \
             c += 4 * (int)(gridDim.x * blockDim.x))

/* 1 when an array of a [rows, cols] view may be walked by KERN_CUDA_FOR_RC4: cols and the row
 * stride (elements) multiples of 4, the base 16-byte aligned */
static inline int kern_cuda_vec4_ok(int cols, const void *p, int ld)
{
    return cols % 4 == 0 && ld % 4 == 0 && ((uintptr_t)p & 15) == 0;
}

/* ---- device helpers ---------------------------------------------------------------------- */

/* Programmatic dependent launch (PDL). A kernel launched with kern_cuda_pdl_cfg may start while
 * the previous kernel of the stream still runs, once that kernel has executed
 * kern_cuda_pdl_launch_next in every CTA (or exited); kern_cuda_pdl_wait_prev returns when the
 * previous kernel has completed and its writes are visible. Both are no-ops for a launch
 * without the attribute. Before the wait a kernel may only read what earlier, completed work
 * wrote, and write nothing the previous kernel reads: constant data and host uploads always,
 * and the writes of the kernels before the previous one when the previous one triggers only
 * after its own wait (the skinny QKV projection before the early attention does; the other skinny
 * launches, qk_post and the row kernels trigger first). */
static __device__ __forceinline__ void kern_cuda_pdl_launch_next(void)
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

static __device__ __forceinline__ void kern_cuda_pdl_wait_prev(void)
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

/* A launch configuration on the backend stream; pdl != 0 adds the programmatic-serialization
 * attribute (at: storage for it, alive until the launch). Graph capture records the edge. */
static inline cudaLaunchConfig_t kern_cuda_pdl_cfg(cudaStream_t s, dim3 grid, dim3 block, size_t smem,
                                                   int pdl, cudaLaunchAttribute *at)
{
    at->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at->val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
}

/* 16 bytes global -> shared by cp.async (L2 only; dst a generic pointer, or for ..16s a shared
 * address); !valid: zero-filled, nothing read (src must still be a mapped address). Completion
 * by commit groups: kern_cuda_cp_wait<N> returns once at
 * most N of this thread's committed groups are still in flight. */
static __device__ __forceinline__ void kern_cuda_cp_async16s(unsigned dst, const void *src, bool valid)
{
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}

static __device__ __forceinline__ void kern_cuda_cp_async16(void *dst, const void *src, bool valid)
{
    kern_cuda_cp_async16s((unsigned)__cvta_generic_to_shared(dst), src, valid);
}

/* kern_cuda_cp_async16 with an L2 cache policy (kern_cuda_l2_evict_first's) */
static __device__ __forceinline__ void kern_cuda_cp_async16_pol(void *dst, const void *src, bool valid, uint64_t pol)
{
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(
                     (unsigned)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(n), "l"(pol));
}

/* an L2 policy under which the lines a load brings in go first (data streamed once) */
static __device__ __forceinline__ uint64_t kern_cuda_l2_evict_first(void)
{
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}

/* 16 bytes from a shared-memory address (as __cvta_generic_to_shared makes it) */
static __device__ __forceinline__ uint4 kern_cuda_lds16(unsigned a)
{
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

static __device__ __forceinline__ void kern_cuda_cp_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N>
static __device__ __forceinline__ void kern_cuda_cp_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* kern<<<grid, block, smem, s>>>(args...), a programmatic dependent launch when pdl != 0 */
template <typename... K, typename... A>
static inline cudaError_t kern_cuda_launch(cudaStream_t s, dim3 grid, dim3 block, size_t smem, int pdl,
                                           void (*kern)(K...), A... args)
{
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = kern_cuda_pdl_cfg(s, grid, block, smem, pdl, &at);
    return cudaLaunchKernelEx(&cfg, kern, args...);
}

static __device__ __forceinline__ float kern_cuda_ld(const void *p, kern_dtype dt, size_t i)
{
    switch (dt) {
    case KERN_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case KERN_DTYPE_F16: return __half2float(((const __half *)p)[i]);
    case KERN_DTYPE_I32: return (float)((const int32_t *)p)[i];
    default: return ((const float *)p)[i];
    }
}

static __device__ __forceinline__ void kern_cuda_st(void *p, kern_dtype dt, size_t i, float f)
{
    switch (dt) {
    case KERN_DTYPE_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(f); break;
    case KERN_DTYPE_F16: ((__half *)p)[i] = __float2half_rn(f); break;
    case KERN_DTYPE_I32: ((int32_t *)p)[i] = (int32_t)f; break;
    default: ((float *)p)[i] = f; break;
    }
}

/* 4 consecutive values at p as floats, and 4 floats stored at p (BF16/F16 rounded to nearest) */
static __device__ __forceinline__ float4 kern_cuda_ld4(const float *p) { return *(const float4 *)p; }
static __device__ __forceinline__ float4 kern_cuda_ld4(const __nv_bfloat16 *p)
{
    uint2 u = *(const uint2 *)p;
    float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&u.x);
    float2 b = __bfloat1622float2(*(const __nv_bfloat162 *)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}
static __device__ __forceinline__ void kern_cuda_st4(float *p, float4 v) { *(float4 *)p = v; }
static __device__ __forceinline__ void kern_cuda_st4(__nv_bfloat16 *p, float4 v)
{
    __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *(const unsigned *)&a;
    u.y = *(const unsigned *)&b;
    *(uint2 *)p = u;
}
static __device__ __forceinline__ void kern_cuda_st4(__half *p, float4 v)
{
    __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
    uint2 u;
    u.x = *(const unsigned *)&a;
    u.y = *(const unsigned *)&b;
    *(uint2 *)p = u;
}

/* f rounded to bf16 and widened back when rnd (kern_backend.act_bf16), f itself otherwise */
static __device__ __forceinline__ float kern_cuda_rnd(float f, int rnd)
{
    return rnd ? __bfloat162float(__float2bfloat16_rn(f)) : f;
}


/* One rotate-half pair of RoPE: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). With rnd, as a bf16
 * model computes x cos + rotate_half(x) sin: cos/sin rounded, each product and sum rounded. */
static __device__ __forceinline__ void kern_cuda_rope_pair(float x1, float x2, float c, float s, int rnd,
                                                           float *o1, float *o2)
{
    if (!rnd) {
        *o1 = x1 * c - x2 * s;
        *o2 = x2 * c + x1 * s;
        return;
    }
    c = kern_cuda_rnd(c, 1);
    s = kern_cuda_rnd(s, 1);
    *o1 = kern_cuda_rnd(kern_cuda_rnd(x1 * c, 1) + kern_cuda_rnd(-x2 * s, 1), 1);
    *o2 = kern_cuda_rnd(kern_cuda_rnd(x2 * c, 1) + kern_cuda_rnd(x1 * s, 1), 1);
}

/* SwiGLU of one (gate, up) pair: silu(gate) * up. With rnd, as a bf16 model computes
 * act_fn(gate_proj(x)) * up_proj(x): both products rounded, silu rounded, the product rounded. */
static __device__ __forceinline__ float kern_cuda_swiglu(float g, float u, int rnd)
{
    if (!rnd)
        return g * (1.0f / (1.0f + expf(-g))) * u;
    g = kern_cuda_rnd(g, 1);
    return kern_cuda_rnd(kern_cuda_rnd(g * (1.0f / (1.0f + expf(-g))), 1) * kern_cuda_rnd(u, 1), 1);
}

static __device__ __forceinline__ float kern_cuda_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float kern_cuda_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* The argmax rule of kern_argmax (and of every device argmax: greedy sampling, the Markov chain,
 * the sampling filters): (v, i) beats (bv, bi) when larger, or equal with a lower index; NaN
 * never wins. A total order, so any reduction order finds the CPU scan's index. */
static __device__ __forceinline__ bool kern_cuda_better(float v, int i, float bv, int bi)
{
    return v > bv || (v == bv && i < bi);
}

/* warp-wide (value, index) reduction by kern_cuda_better; every lane ends with the result */
static __device__ __forceinline__ void kern_cuda_warp_best(float &bv, int &bi)
{
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (kern_cuda_better(ov, oi, bv, bi))
            bv = ov, bi = oi;
    }
}

/* ---- timeline trace (diagnostic builds only: -DPD_KTRACE) ---------------------------------
 * Thread 0 of every CTA of an instrumented kernel appends one record: the CTA's start, the
 * return of its wait for the previous kernel (0: none) and its end, on %globaltimer, with a tag
 * that tells the launches of one step apart (a weight or output pointer). Each .cu that traces
 * has its own copy of the buffer pointer (static device symbols), set by its KT_TU_SETTER. */
typedef struct {
    unsigned long long tag, t0, t1, t2, tx[3];
    unsigned kind, cta, sm, pad;
} kern_cuda_kt_rec;

#ifdef PD_KTRACE
static __device__ kern_cuda_kt_rec *kt_buf;
static __device__ unsigned *kt_cnt;
static __device__ unsigned kt_cap;
static __device__ __forceinline__ unsigned long long kt_now(void)
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
static __device__ __noinline__ void kt_emit(unsigned kind, unsigned long long tag, unsigned long long t0,
                                            unsigned long long t1, const unsigned long long *tx)
{
    if (threadIdx.x != 0 || kt_buf == NULL)
        return;
    unsigned i = atomicAdd(kt_cnt, 1u);
    if (i >= kt_cap)
        return;
    kern_cuda_kt_rec r;
    r.tag = tag;
    r.t0 = t0;
    r.t1 = t1;
    r.t2 = kt_now();
    r.kind = kind;
    r.cta = blockIdx.x + blockIdx.y * gridDim.x;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(r.sm));
    r.pad = 0;
    for (int k = 0; k < 3; k++)
        r.tx[k] = tx[k];
    kt_buf[i] = r;
}
#define KT_DECL unsigned long long kt_t0 = kt_now(), kt_t1 = 0, kt_tx[3] = {0ull, 0ull, 0ull}
#define KT_WAITED do { if (kt_t1 == 0) kt_t1 = kt_now(); } while (0)
#define KT_MARK(i) do { if (kt_tx[i] == 0) kt_tx[i] = kt_now(); } while (0)
#define KT_EMIT(kind, tag) kt_emit((kind), (unsigned long long)(tag), kt_t0, kt_t1, kt_tx)
#define KT_TU_SETTER(name) \
    extern "C" void kern_cuda_kt_set_##name(kern_cuda_kt_rec *b, unsigned *c, unsigned cap) \
    { \
        cudaMemcpyToSymbol(kt_buf, &b, sizeof(b)); \
        cudaMemcpyToSymbol(kt_cnt, &c, sizeof(c)); \
        cudaMemcpyToSymbol(kt_cap, &cap, sizeof(cap)); \
    }
#else
#define KT_DECL do { } while (0)
#define KT_WAITED do { } while (0)
#define KT_MARK(i) do { } while (0)
#define KT_EMIT(kind, tag) do { } while (0)
#define KT_TU_SETTER(name)
#endif

/* ---- host launchers: one per op, each in its family's .cu; all enqueue on ctx->stream ------- */
extern "C" {
pd_status kern_cuda_embed_launch(kern_backend *be, const kern_embed_args *a, pd_err *err);
pd_status kern_cuda_copy_rows_launch(kern_backend *be, const kern_copy_rows_args *a, pd_err *err);
pd_status kern_cuda_rmsnorm_launch(kern_backend *be, const kern_rmsnorm_args *a, pd_err *err);
/* RMSNorm with its output stored as out_dtype (F32, BF16 or F16) at out (row stride a->ld_out),
 * a->out ignored: the prefill path writes the normed rows straight into the packed GEMM operand. */
pd_status kern_cuda_rmsnorm_to(kern_backend *be, const kern_rmsnorm_args *a, void *out,
                               kern_dtype out_dtype, pd_err *err);
pd_status kern_cuda_rope_launch(kern_backend *be, const kern_rope_args *a, pd_err *err);
pd_status kern_cuda_unary_launch(kern_backend *be, const kern_unary_args *a, pd_err *err);
pd_status kern_cuda_binary_launch(kern_backend *be, const kern_binary_args *a, pd_err *err);
pd_status kern_cuda_kv_store_launch(kern_backend *be, const kern_kv_store_args *a, pd_err *err);
pd_status kern_cuda_attn_launch(kern_backend *be, const kern_attn_args *a, pd_err *err);
pd_status kern_cuda_matmul_launch(kern_backend *be, const kern_matmul_args *a, pd_err *err);
pd_status kern_cuda_argmax_launch(kern_backend *be, const kern_argmax_args *a, pd_err *err);
pd_status kern_cuda_linear_launch(kern_backend *be, const kern_linear_args *a, pd_err *err);
pd_status kern_cuda_qk_post_launch(kern_backend *be, const kern_qk_post_args *a, pd_err *err);
pd_status kern_cuda_mlp_launch(kern_backend *be, const kern_mlp_args *a, pd_err *err);
pd_status kern_cuda_qkv_launch(kern_backend *be, const kern_qkv_args *a, pd_err *err);
/* qk_post reading q/k/v from bf16 products (rows of ld_q / ld_kv; q unused without q heads)
 * instead of a->q/k/v and storing the cache as the op does: the fused qkv op's second half.
 * Outputs: q to q_out in bf16 (rows of a->ld_q; it may be the q products themselves when ld_q
 * is a->ld_q) or, q_out NULL, to a->q as the op does; k to a->k as the op does when k_rows;
 * v copied to v_out (fp32, a->ld_kv) unless v_out is NULL. */
pd_status kern_cuda_qk_post_from(kern_backend *be, const kern_qk_post_args *a, const __nv_bfloat16 *q,
                                 const __nv_bfloat16 *k, const __nv_bfloat16 *v, int ld_q, int ld_kv,
                                 __nv_bfloat16 *q_out, int k_rows, float *v_out, pd_err *err);
/* The batch would run the tensor-core prefill attention, which can read q from and write its
 * output to bf16 rows (ld_q a multiple of 8, ld_out of 2) */
int kern_cuda_attn_bf16_fits(const kern_backend *be, const kern_attn_args *a);
/* kern_cuda_attn_launch with q read from bf16 rows q (a->ld_q, 16-byte aligned, instead of
 * a->q) and the output written to bf16 rows out (a->ld_out, instead of a->out); only where
 * kern_cuda_attn_bf16_fits */
pd_status kern_cuda_attn_launch_bf16(kern_backend *be, const kern_attn_args *a,
                                     const __nv_bfloat16 *q, __nv_bfloat16 *out, pd_err *err);
pd_status kern_cuda_attn_block_launch(kern_backend *be, const kern_attn_block_args *a, pd_err *err);
/* The two kernels after a skinny QKV projection of a batch-invariant round, as programmatic
 * dependent launches (kern_cuda_ctx.decode_early): qk_post (forms its RoPE angles while the
 * projection runs, and lets the attention start), then the attention, whose previous kernel
 * stores this round's keys, at most n_new per sequence at its last positions (row setup and
 * its first key tiles before that kernel ends). Same results as the plain launches. The keys
 * stored before the projection are visible to the attention's early loads because that
 * projection lets its dependents start only after its own wait. */
pd_status kern_cuda_qk_post_launch_pdl(kern_backend *be, const kern_qk_post_args *a, pd_err *err);
pd_status kern_cuda_attn_launch_after_store(kern_backend *be, const kern_attn_args *a, int n_new,
                                            pd_err *err);
pd_status kern_cuda_markov_step_launch(kern_backend *be, const kern_markov_step_args *a, pd_err *err);
pd_status kern_cuda_markov_chain_launch(kern_backend *be, const kern_markov_chain_args *a, pd_err *err);
pd_status kern_cuda_probs_launch(kern_backend *be, const kern_probs_args *a, pd_err *err);
pd_status kern_cuda_sample_launch(kern_backend *be, const kern_sample_args *a, pd_err *err);
pd_status kern_cuda_spec_verify_launch(kern_backend *be, const kern_spec_verify_args *a, pd_err *err);
pd_status kern_cuda_penalty_launch(kern_backend *be, const kern_penalty_args *a, pd_err *err);
pd_status kern_cuda_token_mask_launch(kern_backend *be, const kern_token_mask_args *a, pd_err *err);
pd_status kern_cuda_logprobs_launch(kern_backend *be, const kern_logprobs_args *a, pd_err *err);
/* The skinny tensor-core GEMM behind op linear (kern_cuda_linear.cu), also used by matmul:
 * fits = bf16 weights, k % 8 == 0, 16-byte aligned x/weights/norm and ld_x % 4 == 0. Without
 * be->batch_invariant it is used up to KERN_CUDA_SKINNY_FAST_MAX_M rows, cuBLAS above: after
 * the weight ring and PDL (2026-12-03) the four Qwen3-4B decode linears at m = 8 take 71.6 us on
 * the skinny kernel against ~132 us for rmsnorm + pack + cuBLAS (H200); 16 rows still stream
 * the weights once per two 8-row tiles. */
#define KERN_CUDA_SKINNY_FAST_MAX_M 16
int kern_cuda_skinny_fits(const kern_linear_args *a);
/* rnd: kern_backend.act_bf16 (the caller's backend) */
pd_status kern_cuda_skinny_launch(kern_cuda_ctx *c, const kern_linear_args *a, int rnd, pd_err *err);
/* The cuBLAS path (many rows): x packed once to the weight dtype, then per weight
 *   kern_cuda_gemm_packed. With rnd (kern_backend.act_bf16) a product is formed in bf16 scratch
 *   (cuBLAS rounds its fp32 accumulators) and one pass stores it (y = p) or adds it
 *   (y = rb(y + p)), as a bf16 model rounds a linear output and then a residual sum. */
/* xb[m, k] = x converted to dtype (BF16 or F16), rows packed (row stride k). */
pd_status kern_cuda_pack_x(kern_cuda_ctx *c, const float *x, int ld_x, int m, int k, kern_dtype dtype,
                           void *xb, pd_err *err);
/* Scratch kern_cuda_gemm_packed needs for an [m, n] product (0 without rnd). */
size_t kern_cuda_gemm_tmp_bytes(const kern_weight *w, int m, int n, int rnd);
/* y[m, n] = xp w^T (+ y with accumulate): xp is x packed to w's dtype (F32 weights: x itself),
 * row stride ld_xp; tmp holds kern_cuda_gemm_tmp_bytes. Without rnd the product goes to y in
 * fp32 directly (accumulate as beta = 1). */
pd_status kern_cuda_gemm_packed(kern_cuda_ctx *c, const kern_weight *w, const void *xp, int ld_xp,
                                int m, int n, int k, float *y, int ld_y, int accumulate, int rnd,
                                void *tmp, pd_err *err);
/* One cuBLAS product out[m, n] = xp w^T + beta out, out in F32 or BF16 (F32 weights: F32). */
pd_status kern_cuda_cublas_product(kern_cuda_ctx *c, const kern_weight *w, const void *xp, int ld_xp,
                                   int m, int n, int k, void *out, kern_dtype out_dtype, int ld_out,
                                   float beta, pd_err *err);
/* Converts n values already on the device (src_dtype -> dst_dtype); used by upload_convert. */
pd_status kern_cuda_convert_launch(kern_backend *be, void *dst, kern_dtype dst_dtype,
                                   const void *src, kern_dtype src_dtype, size_t n, pd_err *err);
}

#endif
