/* kern_cuda_linear.cu - the skinny tensor-core GEMM for few rows (decode steps, verify and draft
 *   blocks) and the fused linear op built on it.
 * Owns: kern_cuda_linear_launch (op linear), kern_cuda_mlp_launch (op mlp), kern_cuda_skinny_fits /
 *   kern_cuda_skinny_launch (also used by kern_cuda_matmul_launch); many rows go through the
 *   cuBLAS path of kern_cuda_matmul.cu (linear_unfused below).
 *   skinny_kernel: y[M, N] = x'[M, K] @ W[N, K]^T with mma.sync m16n8k16 (bf16 in, fp32
 *   accumulate). W is the A operand: a CTA owns 16 output features; x is the B operand: 8 rows
 *   (tokens) per n8 tile, NT tiles per 8 * NT-row chunk (grid.y walks the chunks), and every W
 *   fragment is used for all NT tiles once loaded. The K loop is split over the CTA's W warps
 *   (1, 2, 4 or 8, chosen from the tile count: as many as still let all CTAs be resident at
 *   once) at a fixed step of 64: warp w takes steps w, w + W, w + 2W, ... in order, and the
 *   warps' partial sums are added in warp order. Inside a step lane (g, t) owns k = 64 s + 8 t
 *   + {0..7, 32..39} of both W rows g, g + 8 and of x row g of each tile (the four lanes of a row
 *   read 64 contiguous bytes per 16-byte load); it loads them straight from global memory (no
 *   shared memory) into a ring of D steps in registers, refilled as soon as a step's 4 mmas have
 *   used it, so W loads stay in flight while x is converted and the mmas run; x (and the norm)
 *   come one step ahead. One-tile products other than SwiGLU load W and x in batches of two
 *   steps instead (launch_nt says why). Word q of its 16 k goes to mma q's k slots (2t, 2t+1,
 *   2t+8, 2t+9): a permutation of k that W and x share, so the sum is the same dot product.
 *   Batch invariance by construction: a row's value depends on its own x row, W, K and the step
 *   split (a function of K and the tile count only); the mma computes each output element from
 *   its own column of B only, so neither the number of rows nor where a row sits in its tile
 *   changes its bits. M > 64 streams W once per 64-row chunk; each row's arithmetic is unchanged.
 *   Several tiles (M > 8): every CTA reads the whole x of its chunk, so f32 x (and the norm) at
 *   64 rows moved 8x the weights' bytes through the L2, loaded when used; there (the XB form,
 *   PD_SK_XPACK) a prologue kernel (sk_xpack_kernel) first packs x once into bf16 fragments with
 *   the norm applied and each row's per-warp sums of squares made exactly as the kernel makes
 *   them, and the CTAs read those 16-byte fragments a step ahead: the same operands and sums,
 *   so the same bits. At >= 4 x tiles a CTA also takes two W tiles of one weight (R = 2, where
 *   every weight's tile count is even) that share x's fragments, halving x's traffic again; and
 *   a grid of several 64-row chunks runs chunk-major, a tile's chunks side by side, so its
 *   weights come from DRAM once. Which CTA computes a tile never changes its arithmetic.
 *   RMSNorm: the fragments are bf16(norm[k] * x) and each lane also sums x^2 over its k; the
 *   row's sum of squares (its 4 lanes, then the warps in warp order) gives 1/rms, applied to the
 *   fp32 sums in the epilogue - no prologue pass over x before the weights stream.
 *   Launch: programmatic dependent launch. The weight ring is filled before griddepcontrol.wait
 *   (weights never depend on the previous kernel), so the first weight bytes are in flight while
 *   the previous kernel drains; x, y and the norm are touched only after the wait, and every CTA
 *   waits. launch_dependents at the start lets the next kernel's CTAs start (and fill their own
 *   weight rings) once all of this grid's CTAs run; their wait still waits for this grid to end.
 *   The QKV projection before the early qk_post and attention (op attn_block) triggers right
 *   after its wait instead: when they start, every kernel before the projection has completed
 *   and its writes are visible, so the attention may load the keys those stored before its own
 *   wait (triggering after the wait in every launch cost ~1 % of a decode step, H200).
 *   Placement: the block scheduler fills an SM up to its occupancy before it moves on, so a
 *   one-wave grid of small CTAs (gate/up: 608 CTAs of 2 warps) landed on ~80 of 132 SMs, 8 CTAs
 *   each, and ran long on them (H200 timeline, docs/BENCHMARKS.md); such a grid gets idle warps
 *   per CTA so that an SM takes at most ceil(CTAs / SMs) (kern_cuda_ctx.sk_spread). Padding
 *   the shared memory would cap it too, but made the decode step ~30 % slower (measured; the
 *   cause not established: the L1 that a larger carveout leaves is one candidate).
 *   Epilogues: STORE, ACCUMULATE (y += v), SWIGLU (gate and up tiles in the same CTA).
 * Not here: shape checks (kern_ops.c), cuBLAS (kern_cuda_matmul.cu, the fallback for many rows).
 * Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#include <string.h>

#define SK_MAX_WARPS 8                      /* K-split warps per CTA: 1, 2, 4 or 8 */
static_assert(sizeof(((kern_cuda_ctx *)0)->sk_occ[0]) == (SK_MAX_WARPS + 1) * (SK_MAX_WARPS + 1),
              "kern_cuda_ctx.sk_occ is [form][warps][block warps]");
#define SK_STEP 64
#define SK_MAX_TILES 8                      /* n8 token tiles per chunk: 64 rows */
#define SK_WARPS_PER_SM 16                  /* what 2 CTAs of 256 threads at <= 128 registers hold */

typedef struct {
    const float *x;
    int ld_x, m, k;
    int warps;                               /* warps per CTA = K split (weights' shapes only) */
    const void *norm;                        /* NULL: no RMSNorm */
    int norm_bf16;                           /* norm dtype: 1 bf16, 0 f32 */
    float eps;
    int n_w;
    const __nv_bfloat16 *w[KERN_LINEAR_MAX_W];
    int n[KERN_LINEAR_MAX_W];
    int tile0[KERN_LINEAR_MAX_W + 1];        /* first CTA of weight i; tile0[n_w] = all tiles */
    float *y[KERN_LINEAR_MAX_W];
    int ld_y[KERN_LINEAR_MAX_W];
    float *tee;                              /* NULL or a copy of y[0]'s final rows */
    int ld_tee;
    int trigger_late;                        /* let the next kernel start after the wait */
    int spread_cap;                          /* > 0: idle warps are added to each CTA so that
                                              * an SM holds at most this many (launch_one) */
    int rnd;                                 /* kern_backend.act_bf16: products (and SwiGLU, the
                                              * residual sum) rounded to bf16 */
    int batch;                               /* kern_cuda_ctx.sk_batch: one-tile products other
                                              * than SwiGLU load in batches of 2 steps (BT) */
    signed char (*occ)[SK_MAX_WARPS + 1][SK_MAX_WARPS + 1];   /* host only: kern_cuda_ctx.sk_occ */
    const __nv_bfloat16 *xb;                 /* XB form: x packed by sk_xpack_kernel, [m][ld_xb] */
    int ld_xb;                               /* the steps' k, nsteps * 64 (zeros past k) */
    const float *xss;                        /* XB form with a norm: [m][warps] sums of squares */
    int r;                                   /* XB form: W tiles per CTA (1, 2; not SwiGLU) */
    int chunk_major;                         /* grid (chunks, tiles) instead of (tiles, chunks) */
    /* the tiled form (sk_tiled_kernel) */
    int fb0[KERN_LINEAR_MAX_W + 1];          /* first block of weight i (tl_shape WR rows; SwiGLU
                                              * half of gate, half of up); fb0[n_w] = all */
    int pc0[KERN_LINEAR_MAX_W];              /* first column of weight i's sums in part */
    int np;                                  /* columns of part (SwiGLU: gate's, then up's) */
    int nch;                                 /* chunks of tl_shape XR rows */
    int tl_all;                              /* 1: a CTA runs every split of its block and stores
                                              * y; 0: two splits, their sums to part */
    float *part;                             /* tl_all 0: [warps][m][np] each split's sums */
} sk_params;

/* Weight loads bypass the L1 and carry the L2 fetch-size hint: the first 64-byte load of a row's
 * 128-byte line asks the L2 for 256 bytes from DRAM (the lane group's next load and the next
 * step's). A cache hint only: the bits are unchanged. PD_SK_L2_FETCH=0 builds the plain load, 128
 * the 128-byte hint (H100: 1.6-2.4 % off the decode step, docs/BENCHMARKS.md 2026-12-07). */
#ifndef PD_SK_L2_FETCH
#define PD_SK_L2_FETCH 256
#endif
static __device__ __forceinline__ uint4 ld_stream(const __nv_bfloat16 *p)
{
    uint4 v;
#if PD_SK_L2_FETCH == 256
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#elif PD_SK_L2_FETCH == 128
    asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#endif
    return v;
}

static __device__ __forceinline__ void mma_bf16(float *c, uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&h;
}

static __device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

/* 1/rms of a row from its sum of squares (the warps' sums added in warp order) */
static __device__ __forceinline__ float sk_inv(const sk_params &p, float s2)
{
    return rsqrtf(s2 / (float)p.k + p.eps);
}

/* One output element of weight wi: v (and SwiGLU's gate) the K split's sums added in split
 * order, inv the row's 1/rms (1 without a norm). Both forms of the product end here, so their
 * epilogues are the same operations; the products are __fmul_rn so that no compiler contracts
 * one into an add in one form and not in the other. */
template <int EPI>
static __device__ __forceinline__ void sk_out(const sk_params &p, int wi, int row, int feat, float v,
                                              float gate, float inv)
{
    float *yo = p.y[wi] + (size_t)row * p.ld_y[wi] + feat;
    const float vi = __fmul_rn(v, inv);
    float out;
    if (EPI == KERN_LINEAR_SWIGLU && p.rnd) {
        float gv = kern_cuda_rnd(__fmul_rn(gate, inv), 1);
        out = kern_cuda_rnd(kern_cuda_rnd(silu_f(gv), 1) * kern_cuda_rnd(vi, 1), 1);
    } else if (EPI == KERN_LINEAR_SWIGLU) {
        out = silu_f(__fmul_rn(gate, inv)) * vi;
    } else if (EPI == KERN_LINEAR_ACCUMULATE) {
        out = kern_cuda_rnd(*yo + kern_cuda_rnd(vi, p.rnd), p.rnd);
    } else {
        out = kern_cuda_rnd(vi, p.rnd);
    }
    *yo = out;
    if (p.tee != NULL)
        p.tee[(size_t)row * p.ld_tee + feat] = out;
}

/* A lane's 16 k of a step: [kk, kk + 8) and [kk + 32, kk + 40), kk = 64 s + 8 t, so the four
 * lanes of a row read 64 contiguous bytes per load (whole sectors). Zero past k (k % 8 == 0). */
struct wfrag {
    uint4 lo, hi;
};

static __device__ __forceinline__ wfrag load_w(const __nv_bfloat16 *row, int kk, int k)
{
    wfrag f;
    f.lo = kk < k ? ld_stream(row + kk) : make_uint4(0, 0, 0, 0);
    f.hi = kk + 32 < k ? ld_stream(row + kk + 32) : make_uint4(0, 0, 0, 0);
    return f;
}

/* The same 16 k of one x row and of a bf16 RMSNorm weight, as loaded (converted when used, so
 * the loads stay in flight): v[0..1] = [kk, kk + 8), v[2..3] = [kk + 32, kk + 40); g[0], g[1]
 * the norm's two 8s. An f32 norm is read when used (tests only: models store norms as bf16). */
struct xraw {
    float4 v[4];
    uint4 g[2];
};

static __device__ __forceinline__ void load_xraw(const sk_params &p, const float *xr, int kk, xraw &r)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int k0 = kk + 32 * h;
        bool in = xr != NULL && k0 < p.k;
        r.v[2 * h] = in ? __ldg((const float4 *)(xr + k0)) : make_float4(0.f, 0.f, 0.f, 0.f);
        r.v[2 * h + 1] = in ? __ldg((const float4 *)(xr + k0 + 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
        if (p.norm != NULL && p.norm_bf16)
            r.g[h] = in ? __ldg((const uint4 *)((const __nv_bfloat16 *)p.norm + k0)) : make_uint4(0, 0, 0, 0);
    }
}

/* load_xraw without branches (batched kernels: every load of a batch is issued before the
 * first is used): out-of-range pieces load a valid address and are zeroed after */
static __device__ __forceinline__ void load_xraw_nb(const sk_params &p, const float *xr, int kk, xraw &r)
{
    const float *xb = xr != NULL ? xr : p.x;
    const __nv_bfloat16 *nb = (const __nv_bfloat16 *)(p.norm != NULL ? p.norm : (const void *)p.x);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int k0 = kk + 32 * h;
        bool in = xr != NULL && k0 < p.k;
        int kc = in ? k0 : 0;
        float4 a = __ldg((const float4 *)(xb + kc)), c = __ldg((const float4 *)(xb + kc + 4));
        uint4 gq = __ldg((const uint4 *)(nb + kc));
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        r.v[2 * h] = in ? a : z;
        r.v[2 * h + 1] = in ? c : z;
        r.g[h] = in ? gq : make_uint4(0, 0, 0, 0);
    }
}

/* B fragments b[0..3] of 8 of the lane's k (x v0, v1 at k0..k0 + 7; bf16 norm gr): bf16(norm * x),
 * or bf16(x) without a norm; ss += x^2 over them (the row's RMS, applied to the fp32 sums at the
 * end). An f32 norm is read here. */
static __device__ __forceinline__ void build_half(const sk_params &p, float4 v0, float4 v1, uint4 gr,
                                                  int k0, uint32_t *b, float &ss)
{
    float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    if (p.norm != NULL) {
        float gk[8];
        if (p.norm_bf16) {
            const __nv_bfloat162 *hv = (const __nv_bfloat162 *)&gr;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __bfloat1622float2(hv[i]);
                gk[2 * i] = f.x;
                gk[2 * i + 1] = f.y;
            }
        } else {
            float4 a = make_float4(0.f, 0.f, 0.f, 0.f), c = a;
            if (k0 < p.k) {
                a = __ldg((const float4 *)((const float *)p.norm + k0));
                c = __ldg((const float4 *)((const float *)p.norm + k0 + 4));
            }
            gk[0] = a.x; gk[1] = a.y; gk[2] = a.z; gk[3] = a.w;
            gk[4] = c.x; gk[5] = c.y; gk[6] = c.z; gk[7] = c.w;
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            ss = fmaf(v[i], v[i], ss);
            v[i] *= gk[i];
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
        b[i] = pack_bf16(v[2 * i], v[2 * i + 1]);
}

/* All 8 B fragments of the loaded 16 k at kk (b[2q], b[2q+1] feed mma q). */
static __device__ __forceinline__ void build_b(const sk_params &p, const xraw &r, int kk, uint32_t *b,
                                               float &ss)
{
    build_half(p, r.v[0], r.v[1], r.g[0], kk, b, ss);
    build_half(p, r.v[2], r.v[3], r.g[1], kk + 32, b + 4, ss);
}

/* acc += W rows (g, g+8) x the tile's 16 k: mma q takes words 2q, 2q+1 of each W row. */
static __device__ __forceinline__ void mma_step(float *acc, const wfrag &ra, const wfrag &rb,
                                                const uint32_t *b)
{
    const uint32_t *wa = (const uint32_t *)&ra, *wb = (const uint32_t *)&rb;
#pragma unroll
    for (int q = 0; q < 4; q++)
        mma_bf16(acc, wa[2 * q], wb[2 * q], wa[2 * q + 1], wb[2 * q + 1], b[2 * q], b[2 * q + 1]);
}

/* The XB form's prologue: row blockIdx.x of x packed to bf16 as build_b makes its fragments
 * (bf16(norm * x), or bf16(x); zeros from k to ld_xb), and with a norm the sum of squares that
 * warp w of the skinny kernel would find for the row: lane t of it adds x^2 over k = 64 s + 8 t
 * + {0..7, 32..39} for its steps s = w, w + W, ... in order (build_half's fmaf chain), then the
 * xor butterfly over the row's 4 lanes - the same operations in the same order, so the same
 * bits. Thread w * 4 + t of warp 0 runs lane t of warp w (W <= 8: 32 threads). */
__global__ void __launch_bounds__(256) sk_xpack_kernel(sk_params p)
{
    kern_cuda_pdl_wait_prev();
    kern_cuda_pdl_launch_next();
    const int row = blockIdx.x;
    const float *xr = p.x + (size_t)row * p.ld_x;
    __nv_bfloat16 *out = (__nv_bfloat16 *)p.xb + (size_t)row * p.ld_xb;
    for (int k0 = (int)threadIdx.x * 8; k0 < p.ld_xb; k0 += (int)blockDim.x * 8) {
        const bool in = k0 < p.k;
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        float4 v0 = in ? __ldg((const float4 *)(xr + k0)) : z, v1 = in ? __ldg((const float4 *)(xr + k0 + 4)) : z;
        uint4 gr = make_uint4(0, 0, 0, 0);
        if (p.norm != NULL && p.norm_bf16 && in)
            gr = __ldg((const uint4 *)((const __nv_bfloat16 *)p.norm + k0));
        uint32_t b[4];
        float ss = 0.0f;
        build_half(p, v0, v1, gr, k0, b, ss);
        *(uint4 *)(out + k0) = make_uint4(b[0], b[1], b[2], b[3]);
    }
    if (p.norm == NULL || threadIdx.x >= 32)
        return;
    const int w = (int)threadIdx.x >> 2, t = (int)threadIdx.x & 3, W = p.warps;
    const int nsteps = (p.k + SK_STEP - 1) / SK_STEP;
    float ss = 0.0f;
    if (w < W)
        for (int s0 = w; s0 < nsteps; s0 += W) {
            int kk = s0 * SK_STEP + t * 8;
            xraw r;
            load_xraw(p, xr, kk, r);
            uint32_t b[8];
            build_b(p, r, kk, b, ss);
        }
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    if (w < W && t == 0)
        ((float *)p.xss)[(size_t)row * W + w] = ss;
}

/* NT: n8 tiles per chunk; EPI: kern_linear_epilogue; D: steps of W loads in flight per warp (a
 * ring of registers, refilled right after each step's mmas); XP: 1 loads x (and the norm) one
 * step ahead (one tile only: registers), 0 when used; BT: 1 (one tile) loads W and x in
 * batches of D steps instead (below). Load scheduling only: the arithmetic is the same
 * whatever D, XP and BT. */
template <int NT, int EPI, int D, int XP, int BT = 0, int XB = 0, int R = 1>
__global__ void __launch_bounds__(SK_MAX_WARPS * 32, NT <= 2 ? 2 : 1)
skinny_kernel(sk_params p)
{
    KT_DECL;
    /* W tiles per CTA: SwiGLU's gate and up, or R consecutive tiles of one weight */
    constexpr int NWT = EPI == KERN_LINEAR_SWIGLU ? 2 : R;
    constexpr int NE = NT * 4 * 32;                          /* accumulators per warp */
    extern __shared__ float sk_smem[];                       /* red[warps][NE], gate[NE] */
    __shared__ float part[SK_MAX_WARPS][SK_MAX_TILES * 8];   /* sums of squares per warp, row */
    const int W = p.warps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    /* chunk-major grids (several 64-row chunks): a tile's chunks run side by side, so its
     * weights come from DRAM once and from the L2 for the other chunks */
    const int bx = p.chunk_major ? (int)blockIdx.y : (int)blockIdx.x;
    const int by = p.chunk_major ? (int)blockIdx.x : (int)blockIdx.y;
    const int chunk0 = by * NT * 8;
    const int rows = p.m - chunk0 < NT * 8 ? p.m - chunk0 : NT * 8;

    const int tile = bx * R;   /* R > 1: every weight's tile count is a multiple */
    int wi = 0;
#pragma unroll
    for (int i = 1; i < KERN_LINEAR_MAX_W; i++)
        if (i < p.n_w && tile >= p.tile0[i])
            wi = i;
    const int n = p.n[wi], row0 = (tile - p.tile0[wi]) * 16;
    const __nv_bfloat16 *wrow[NWT][2];
#pragma unroll
    for (int j = 0; j < NWT; j++) {
        const __nv_bfloat16 *w = p.w[EPI == KERN_LINEAR_SWIGLU ? j : wi];
        const int rj = row0 + (EPI == KERN_LINEAR_SWIGLU ? 0 : 16 * j);
        const int ra = rj + g < n ? rj + g : n - 1;          /* clamped: results dropped */
        const int rb = rj + g + 8 < n ? rj + g + 8 : n - 1;
        wrow[j][0] = w + (size_t)ra * p.k;
        wrow[j][1] = w + (size_t)rb * p.k;
    }
    const int nsteps = (p.k + SK_STEP - 1) / SK_STEP;
    const int stride = W * SK_STEP;                           /* k between a warp's steps */

    /* the weights never depend on the previous kernel: fill the ring before waiting for it.
     * Warps past W (added by launch_one to spread the grid over the SMs) load and compute
     * nothing, but take part in every barrier. */
    const bool busy = warp < W;
    wfrag wf[D][NWT][2];
    int kk = warp * SK_STEP + t * 8;
#pragma unroll
    for (int r = 0; r < D; r++)
#pragma unroll
        for (int j = 0; j < NWT; j++) {
            wf[r][j][0] = busy ? load_w(wrow[j][0], kk + r * stride, p.k) : wfrag{};
            wf[r][j][1] = busy ? load_w(wrow[j][1], kk + r * stride, p.k) : wfrag{};
        }
    if (!p.trigger_late)
        kern_cuda_pdl_launch_next();
    kern_cuda_pdl_wait_prev();
    KT_WAITED;
    if (p.trigger_late)
        kern_cuda_pdl_launch_next();

    float acc[NWT][NT][4], ss[NT];
#pragma unroll
    for (int i = 0; i < NT; i++) {
        ss[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < NWT; j++)
#pragma unroll
            for (int r = 0; r < 4; r++)
                acc[j][i][r] = 0.0f;
    }
    const float *xrow[NT];
#pragma unroll
    for (int i = 0; i < NT; i++) {
        int r = i * 8 + g;
        xrow[i] = r < rows ? p.x + (size_t)(chunk0 + r) * p.ld_x : NULL;
    }
    /* XB: the packed rows (NULL past the chunk's rows: zero fragments), a step ahead */
    const __nv_bfloat16 *xbrow[XB ? NT : 1];
    uint4 xq[XB ? NT : 1][2];
    if (XB) {
#pragma unroll
        for (int i = 0; i < NT; i++) {
            int r = i * 8 + g;
            xbrow[i] = r < rows ? p.xb + (size_t)(chunk0 + r) * p.ld_xb : NULL;
            xq[i][0] = xq[i][1] = make_uint4(0, 0, 0, 0);
            if (busy && xbrow[i] != NULL && kk < p.ld_xb) {
                xq[i][0] = __ldg((const uint4 *)(xbrow[i] + kk));
                xq[i][1] = __ldg((const uint4 *)(xbrow[i] + kk + 32));
            }
        }
    }

    /* warp w takes steps w, w + W, w + 2W, ... in order; ring slot r holds the step r ahead */
    if (BT) {
        /* batches of D steps: x of the whole batch, then its D steps, then W of the next batch
         * (a wait for any load waits for all of them: one scoreboard, H200 SASS). No branch
         * inside a batch: a step past the warp's last has zero W and x, and adding its zero
         * products leaves the sums' bits (they start at +0, so they are never -0) */
        const int mine = busy ? (nsteps - warp + W - 1) / W : 0;
        for (int i0 = 0; i0 < mine; i0 += D) {
            xraw xb[D];
#pragma unroll
            for (int r = 0; r < D; r++)
                load_xraw_nb(p, xrow[0], kk + r * stride, xb[r]);
#pragma unroll
            for (int r = 0; r < D; r++) {
                uint32_t b[8];
                build_b(p, xb[r], kk + r * stride, b, ss[0]);
#pragma unroll
                for (int j = 0; j < NWT; j++)
                    mma_step(acc[j][0], wf[r][j][0], wf[r][j][1], b);
            }
#pragma unroll
            for (int r = 0; r < D; r++)
#pragma unroll
                for (int j = 0; j < NWT; j++) {
                    wf[r][j][0] = load_w(wrow[j][0], kk + (D + r) * stride, p.k);
                    wf[r][j][1] = load_w(wrow[j][1], kk + (D + r) * stride, p.k);
                }
            kk += D * stride;
        }
    }
    xraw xn;
    if (XP && !BT && busy)
        load_xraw(p, xrow[0], kk, xn);
    for (int s0 = busy && !BT ? warp : nsteps; s0 < nsteps; s0 += D * W) {
#pragma unroll
        for (int r = 0; r < D; r++) {
            if (s0 + r * W >= nsteps)
                break;
            uint32_t b[NT][8];
            if (XB) {
                /* tile by tile: its fragments, the next step's load, its mmas */
#pragma unroll
                for (int i = 0; i < NT; i++) {
                    uint32_t bi[8];
                    const uint32_t *q0 = (const uint32_t *)&xq[i][0], *q1 = (const uint32_t *)&xq[i][1];
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        bi[u] = q0[u];
                        bi[4 + u] = q1[u];
                    }
                    const int kn = kk + stride;
                    xq[i][0] = xq[i][1] = make_uint4(0, 0, 0, 0);
                    if (xbrow[i] != NULL && kn < p.ld_xb) {
                        xq[i][0] = __ldg((const uint4 *)(xbrow[i] + kn));
                        xq[i][1] = __ldg((const uint4 *)(xbrow[i] + kn + 32));
                    }
#pragma unroll
                    for (int j = 0; j < NWT; j++)
                        mma_step(acc[j][i], wf[r][j][0], wf[r][j][1], bi);
                }
            } else if (XP) {
                build_b(p, xn, kk, b[0], ss[0]);
                load_xraw(p, xrow[0], kk + stride, xn);
            } else {
#pragma unroll
                for (int i = 0; i < NT; i++) {
                    xraw xi;
                    load_xraw(p, xrow[i], kk, xi);
                    build_b(p, xi, kk, b[i], ss[i]);
                }
            }
            if (!XB)
#pragma unroll
                for (int i = 0; i < NT; i++)
#pragma unroll
                    for (int j = 0; j < NWT; j++)
                        mma_step(acc[j][i], wf[r][j][0], wf[r][j][1], b[i]);
#pragma unroll
            for (int j = 0; j < NWT; j++) {
                wf[r][j][0] = load_w(wrow[j][0], kk + D * stride, p.k);
                wf[r][j][1] = load_w(wrow[j][1], kk + D * stride, p.k);
            }
            kk += stride;
        }
    }

    /* a row's sum of squares: its 4 lanes (xor butterfly: every lane gets the same bits), then
     * the warps in warp order (below); the partial sums of the warps, also in warp order */
    if (p.norm != NULL && XB) {
        /* made by sk_xpack_kernel the same way */
        for (int e = threadIdx.x; e < W * rows; e += blockDim.x)
            part[e % W][e / W] = p.xss[(size_t)(chunk0 + e / W) * W + e % W];
    } else if (p.norm != NULL) {
#pragma unroll
        for (int i = 0; i < NT; i++) {
            float v = ss[i];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (t == 0 && busy)
                part[warp][i * 8 + g] = v;
        }
    }
    float *red = sk_smem, *gate = sk_smem + W * NE;
#pragma unroll
    for (int j = 0; j < NWT; j++) {
        if (j > 0)
            __syncthreads();
        if (busy)
#pragma unroll
            for (int i = 0; i < NT; i++)
#pragma unroll
                for (int r = 0; r < 4; r++)
                    red[(warp * NT * 4 + i * 4 + r) * 32 + lane] = acc[j][i][r];
        __syncthreads();
        /* element e = (tile * 4 + reg) * 32 + lane */
        for (int e = busy ? (int)threadIdx.x : NE; e < NE; e += W * 32) {
            float v = 0.0f;
            for (int w = 0; w < W; w++)
                v += red[w * NE + e];
            if (EPI == KERN_LINEAR_SWIGLU && j + 1 < NWT) {
                gate[e] = v;                  /* read back by this thread only */
                continue;
            }
            int l = e & 31, reg = (e >> 5) & 3, xt = e >> 7;
            int feat = row0 + (EPI == KERN_LINEAR_SWIGLU ? 0 : 16 * j) + (l >> 2) + (reg >= 2 ? 8 : 0);
            int r = xt * 8 + 2 * (l & 3) + (reg & 1);
            if (feat >= n || r >= rows)
                continue;
            float inv = 1.0f;
            if (p.norm != NULL) {
                float s2 = 0.0f;
                for (int w = 0; w < W; w++)
                    s2 += part[w][r];
                inv = sk_inv(p, s2);
            }
            sk_out<EPI>(p, wi, chunk0 + r, feat, v, EPI == KERN_LINEAR_SWIGLU ? gate[e] : 0.0f, inv);
        }
    }
    KT_EMIT(10 + EPI, p.w[0]);
}

/* ---- the tiled form: many rows -------------------------------------------------------------
 * From a few 8-row tiles up, skinny_kernel's CTAs each read their x fragments from the L2 (every
 * CTA all of its chunk's x) and keep them in registers, so a batch of 64 ran at a fraction of
 * the weight stream. sk_tiled_kernel computes the same sums from shared memory: a CTA takes
 * WR weight rows (SwiGLU: WR / 2 features of gate and the same of up) and an XR-row chunk of the
 * packed x (sk_xpack_kernel's fragments), and streams the steps of 64 k of both through a
 * TL_STAGES-deep cp.async ring; its 8 warps form a WG x (8 / WG) grid, warp (wg, xg) multiplying
 * TW 16-row weight tiles with TX 8-row x tiles. Two shapes (tl_shape): 64 x 64 (WG 4, TW 1, TX 4;
 * three CTAs per SM) and, from more rows, 64 x 128 (TX 8; two CTAs per SM at 128 registers).
 * H100, Qwen3-4B's products (docs/BENCHMARKS.md, 2026-12-06 18:44 UTC): 64 x 128 is 2-7 % faster
 * where the K split is 2 (gate/up, lm_head) from 224 rows and for the others at 512, slower
 * below; 128 x 128 (one CTA per SM) was slower at every size measured. The arithmetic is
 * skinny_kernel's, operand for operand, whatever the shape: lane (g, t) builds its W and x
 * fragments from the same 16 k of the step (pieces t and t + 4), the four mmas of a step run in
 * the same order, split w's steps are w, w + W, ... in order on one accumulator starting at +0,
 * and the splits' sums are added in split order to +0 (W = p.warps, skinny_warps of the tile
 * count, as there). So every row's bits equal skinny_kernel's for any batch and shape;
 * `test_kernels --op invariance` compares the forms across batch sizes 1..100.
 * Splits: a CTA runs two consecutive splits side by side (steps s of both in increasing order,
 * each on its own accumulators); where that is the whole K split (W <= 2: gate/up, lm_head) it
 * adds them and stores y itself (tl_all), otherwise every pair writes its sums to part and
 * sk_tiled_epi_kernel adds the W sums in split order and stores y. Shared addresses are formed
 * once (ncu, H100: a first form spent 20 integer instructions per mma re-forming them, and ran at
 * half its present rate). Where each is taken: tiled_wanted, tiled_launch. */
#define TL_STAGES 4
#define TL_TALL_SPLIT_MIN 512   /* rows from which a K split of 4 or 8 takes the 64 x 128 shape */

/* a row's piece c (k 8c .. 8c + 7 of the step) in a stage: odd rows swap their halves, so the
 * eight lanes of a 16-byte load phase (rows g, g + 1, pieces t or t + 4) hit 32 distinct banks */
static __device__ __forceinline__ int tl_at(int row, int c)
{
    return row * 8 + (c ^ ((row & 1) << 2));
}

/* A CTA's shape: WG x (8 / WG) warps, TW weight tiles and TX x tiles per warp. */
template <int WG_, int TW_, int TX_>
struct tl_shape {
    static constexpr int WG = WG_, TW = TW_, TX = TX_;
    static constexpr int WR = WG * TW * 16;            /* weight rows per CTA */
    static constexpr int XR = (8 / WG) * TX * 8;       /* x rows per CTA (its chunk) */
    static constexpr int STAGE = (WR + XR) * 8 * 16;   /* bytes: W and x rows, 8 pieces of 16 */
    static constexpr int SMEM = TL_STAGES * STAGE;
    static constexpr int MINB = WR * XR >= 64 * 128 ? 2 : 3;   /* CTAs per SM its registers allow */
    static_assert(WR % 64 == 0 && XR % 32 == 0 && XR * (WR + 1) * 4 <= SMEM, "tl_shape");
};
typedef tl_shape<4, 1, 4> tl_small;
typedef tl_shape<4, 1, 8> tl_tall;

/* The CTA's steps: those of its NS consecutive splits w0 .. w0 + NS - 1 (s % W among them), in
 * increasing order, so a weight row is read front to back; step s goes to accumulator s - base. */
struct tl_cursor {
    int base, j;   /* step base + j; base = w0 + W * i */
};

template <int NS>
static __device__ __forceinline__ void tl_next(tl_cursor &c, int W)
{
    if (++c.j == NS) {
        c.j = 0;
        c.base += W;
    }
}

/* NS: splits per CTA (1 or 2; p.warps / NS CTAs per block and chunk, tl_all when that is 1),
 * run side by side on accumulators of their own, so a K split of 2 (gate/up, lm_head) needs no
 * scratch and every CTA reads its weight rows in order. S: the CTA's shape (tl_shape). */
template <int EPI, int NS, class S>
__global__ void __launch_bounds__(256, S::MINB) sk_tiled_kernel(sk_params p)
{
    constexpr int WR = S::WR, XR = S::XR, TW = S::TW, TX = S::TX;
    constexpr int PER = EPI == KERN_LINEAR_SWIGLU ? WR / 2 : WR;   /* features per block */
    extern __shared__ uint4 tl_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3, wg = warp % S::WG, xg = warp / S::WG;
    const int W = p.warps, groups = W / NS;
    int b = (int)blockIdx.x;
    const int chunk = b % p.nch;
    b /= p.nch;
    const int w0 = b % groups * NS, fb = b / groups;
    int wi = 0;
#pragma unroll
    for (int i = 1; i < KERN_LINEAR_MAX_W; i++)
        if (i < p.n_w && fb >= p.fb0[i])
            wi = i;
    const int n = p.n[wi], f0 = (fb - p.fb0[wi]) * PER;
    const int chunk0 = chunk * XR, rows = p.m - chunk0 < XR ? p.m - chunk0 : XR;
    const int ntv = (rows + 7) >> 3, nsteps = (p.k + SK_STEP - 1) / SK_STEP;

    /* loads: thread i copies piece i % 8 of rows i / 8 + 32 h of W and of x; rows past n or the
     * chunk, and k past p.k, are zero-filled (x is zero past k already). SwiGLU: rows below PER
     * are gate's, the others up's (PER is a multiple of 32: a row group is one weight's) */
    const int lr = threadIdx.x >> 3, lc = threadIdx.x & 7;
    const __nv_bfloat16 *wsrc[WR / 32], *xsrc[XR / 32];
    bool wok[WR / 32], xok[XR / 32];
#pragma unroll
    for (int h = 0; h < WR / 32; h++) {
        const int r = lr + 32 * h, up = EPI == KERN_LINEAR_SWIGLU && r >= PER;
        const int feat = f0 + (up ? r - PER : r);
        const __nv_bfloat16 *w = p.w[EPI == KERN_LINEAR_SWIGLU ? up : wi];
        wok[h] = feat < n;
        wsrc[h] = w + (size_t)(wok[h] ? feat : 0) * p.k + lc * 8;
    }
#pragma unroll
    for (int h = 0; h < XR / 32; h++) {
        const int r = lr + 32 * h;
        xok[h] = r < rows;
        xsrc[h] = p.xb + (size_t)(chunk0 + (xok[h] ? r : 0)) * p.ld_xb + lc * 8;
    }
    int T = 0;                                   /* the CTA's steps */
    for (int j = 0; j < NS; j++)
        if (w0 + j < nsteps)
            T += (nsteps - w0 - j + W - 1) / W;

    /* shared addresses, formed once: this thread's copy targets and its fragments' pieces
     * within a stage, and the stages' base */
    const unsigned s0 = (unsigned)__cvta_generic_to_shared(tl_smem);
    constexpr unsigned STAGE = S::STAGE, XOFF = WR * 8 * 16;
    /* rows 8 apart share their swizzle: a fragment row's pieces t and t + 4 sit at fa and fa +
     * dh (dh = +-64: the odd rows' halves are swapped), row + 8 at +1024, weight tile i at
     * +2048 i, x tile i at +1024 i; a copy's rows + 32 h at +4096 h */
    const unsigned cw = (unsigned)tl_at(lr, lc) * 16;
    const unsigned fa = (unsigned)tl_at(wg * TW * 16 + g, t) * 16;
    const unsigned fx = XOFF + (unsigned)tl_at(xg * TX * 8 + g, t) * 16;
    const int dh = (g & 1) ? -64 : 64;
    /* step st's copies into the stage at sb: W (zero past n and k) and x (zero past the chunk) */
    const int kw = p.k - lc * 8;
    auto copy_w = [&](unsigned sb, int st) {
#pragma unroll
        for (int h = 0; h < WR / 32; h++)
            kern_cuda_cp_async16s(sb + cw + 4096 * h, wsrc[h] + st * SK_STEP, wok[h] && st * SK_STEP < kw);
    };
    auto copy_x = [&](unsigned sb, int st) {
#pragma unroll
        for (int h = 0; h < XR / 32; h++)
            kern_cuda_cp_async16s(sb + XOFF + cw + 4096 * h, xsrc[h] + st * SK_STEP, xok[h]);
    };

    tl_cursor ld = {w0, 0};
    int first[TL_STAGES - 1];
    /* the weights never depend on the previous kernel: their first stages before the wait */
#pragma unroll
    for (int j = 0; j < TL_STAGES - 1; j++) {
        first[j] = ld.base + ld.j;
        if (j < T) {
            copy_w(s0 + j * STAGE, first[j]);
            tl_next<NS>(ld, W);
        }
    }
    kern_cuda_cp_commit();
    if (!p.trigger_late)
        kern_cuda_pdl_launch_next();
    kern_cuda_pdl_wait_prev();
    if (p.trigger_late)
        kern_cuda_pdl_launch_next();
#pragma unroll
    for (int j = 0; j < TL_STAGES - 1; j++) {
        if (j < T)
            copy_x(s0 + j * STAGE, first[j]);
        kern_cuda_cp_commit();
    }

    float acc[NS][TW][TX][4];
#pragma unroll
    for (int a = 0; a < NS; a++)
#pragma unroll
        for (int u = 0; u < TW; u++)
#pragma unroll
            for (int i = 0; i < TX; i++)
#pragma unroll
                for (int r = 0; r < 4; r++)
                    acc[a][u][i][r] = 0.0f;
    const int nt_mine = ntv - xg * TX;           /* x tiles of this warp with rows (<= 0: none) */
    unsigned sc = s0, sl = s0 + (TL_STAGES - 1) * STAGE;   /* stage computed, stage loaded */
    int acur = 0;                                /* accumulator of the step computed */
    for (int j = 0; j < T; j++) {
        kern_cuda_cp_wait<TL_STAGES - 2>();
        __syncthreads();
        /* the stage computed last iteration is free again: the step TL_STAGES - 1 ahead into it */
        if (j + TL_STAGES - 1 < T) {
            const int st = ld.base + ld.j;
            copy_w(sl, st);
            copy_x(sl, st);
            tl_next<NS>(ld, W);
        }
        kern_cuda_cp_commit();
        sl = sl + STAGE == s0 + TL_STAGES * STAGE ? s0 : sl + STAGE;
        /* mma q takes words 2q, 2q + 1 of both W rows' 16 k and of each x tile's: pieces t (mmas
         * 0, 1), then t + 4 (2, 3); the W fragments of the step first, x's a half at a time, and
         * every A fragment made once for all x tiles. Every accumulator still takes its step's
         * mmas in the order 0..3. */
        const unsigned pa = sc + fa, px = sc + fx;
        uint4 wa[2][TW], wb[2][TW];              /* [piece t, t + 4][tile]: rows g and g + 8 */
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int u = 0; u < TW; u++) {
                wa[h][u] = kern_cuda_lds16(pa + (h ? dh : 0) + 2048 * u);
                wb[h][u] = kern_cuda_lds16(pa + (h ? dh : 0) + 2048 * u + 1024);
            }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint4 q[TX];
#pragma unroll
            for (int i = 0; i < TX; i++)
                if (i < nt_mine)
                    q[i] = kern_cuda_lds16(px + (h ? dh : 0) + 1024 * i);
#pragma unroll
            for (int qq = 0; qq < 2; qq++)
#pragma unroll
                for (int a = 0; a < NS; a++) {
                    if (a != acur)
                        continue;
#pragma unroll
                    for (int u = 0; u < TW; u++) {
                        const uint4 &ra = wa[h][u], &rb = wb[h][u];
                        const uint32_t a0 = qq ? ra.z : ra.x, a1 = qq ? rb.z : rb.x;
                        const uint32_t a2 = qq ? ra.w : ra.y, a3 = qq ? rb.w : rb.y;
#pragma unroll
                        for (int i = 0; i < TX; i++)
                            if (i < nt_mine)
                                mma_bf16(acc[a][u][i], a0, a1, a2, a3, qq ? q[i].z : q[i].x, qq ? q[i].w : q[i].y);
                    }
                }
        }
        sc = sc + STAGE == s0 + TL_STAGES * STAGE ? s0 : sc + STAGE;
        acur = NS == 1 || acur == NS - 1 ? 0 : acur + 1;
    }

    /* accumulator r of (weight tile u, x tile i): weight row (wg TW + u) 16 + g (+ 8 for r >=
     * 2), x row (xg TX + i) 8 + 2 t (+ 1 for odd r) */
    if (!p.tl_all) {
#pragma unroll
        for (int u = 0; u < TW; u++)
#pragma unroll
            for (int i = 0; i < TX; i++) {
                if (xg * TX + i >= ntv)
                    continue;
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const int fl = (wg * TW + u) * 16 + g + (r >= 2 ? 8 : 0);
                    const int xr = (xg * TX + i) * 8 + 2 * t + (r & 1);
                    const int up = EPI == KERN_LINEAR_SWIGLU && fl >= PER;
                    const int feat = f0 + (up ? fl - PER : fl);
                    if (xr >= rows || feat >= n)
                        continue;
                    const int col = EPI == KERN_LINEAR_SWIGLU ? (up ? n : 0) + feat : p.pc0[wi] + feat;
#pragma unroll
                    for (int a = 0; a < NS; a++)
                        p.part[((size_t)(w0 + a) * p.m + chunk0 + xr) * p.np + col] = acc[a][u][i][r];
                }
            }
        return;
    }
    kern_cuda_cp_wait<0>();
    __syncthreads();                             /* the ring's memory holds the sums now */
    float *tot_s = (float *)tl_smem;             /* [XR][WR + 1] */
#pragma unroll
    for (int u = 0; u < TW; u++)
#pragma unroll
        for (int i = 0; i < TX; i++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int fl = (wg * TW + u) * 16 + g + (r >= 2 ? 8 : 0);
                const int xr = (xg * TX + i) * 8 + 2 * t + (r & 1);
                float v = 0.0f;                  /* the splits in split order, from +0 */
#pragma unroll
                for (int a = 0; a < NS; a++)
                    v += acc[a][u][i][r];
                tot_s[xr * (WR + 1) + fl] = v;
            }
    __syncthreads();
    for (int e = (int)threadIdx.x; e < rows * PER; e += (int)blockDim.x) {
        const int r = e / PER, fo = e % PER, feat = f0 + fo;
        if (feat >= n)
            continue;
        float inv = 1.0f;
        if (p.norm != NULL) {
            float s2 = 0.0f;
            for (int w = 0; w < W; w++)
                s2 += p.xss[(size_t)(chunk0 + r) * W + w];
            inv = sk_inv(p, s2);
        }
        const float *tr = tot_s + r * (WR + 1);
        if (EPI == KERN_LINEAR_SWIGLU)
            sk_out<EPI>(p, wi, chunk0 + r, feat, tr[PER + fo], tr[fo], inv);
        else
            sk_out<EPI>(p, wi, chunk0 + r, feat, tr[fo], 0.0f, inv);
    }
}

/* The split form's end: element (row blockIdx.y, output column c) adds the splits' sums in
 * split order to +0 (SwiGLU: gate's and up's) and stores as skinny_kernel does. It triggers
 * the next kernel only after its wait, so the early attention after a QKV projection starts
 * with every kernel before the projection complete (as skinny_kernel's trigger_late). */
template <int EPI>
__global__ void __launch_bounds__(256) sk_tiled_epi_kernel(sk_params p)
{
    kern_cuda_pdl_wait_prev();
    kern_cuda_pdl_launch_next();
    const int row = (int)blockIdx.y, c = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    const int nout = EPI == KERN_LINEAR_SWIGLU ? p.n[0] : p.np;
    if (c >= nout)
        return;
    int wi = 0;
#pragma unroll
    for (int i = 1; i < KERN_LINEAR_MAX_W; i++)
        if (i < p.n_w && c >= p.pc0[i])
            wi = i;
    const int feat = c - p.pc0[wi], W = p.warps;
    float v = 0.0f, gate = 0.0f, s2 = 0.0f;
    for (int w = 0; w < W; w++) {
        const float *pr = p.part + ((size_t)w * p.m + row) * p.np;
        if (EPI == KERN_LINEAR_SWIGLU) {
            gate += pr[feat];
            v += pr[p.n[0] + feat];
        } else {
            v += pr[c];
        }
        if (p.norm != NULL)
            s2 += p.xss[(size_t)row * W + w];
    }
    sk_out<EPI>(p, wi, row, feat, v, gate, p.norm != NULL ? sk_inv(p, s2) : 1.0f);
}

KT_TU_SETTER(linear)

static int aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

extern "C" int kern_cuda_skinny_fits(const kern_linear_args *a)
{
    if (a->k % 8 != 0 || a->ld_x % 4 != 0 || !aligned16(a->x))
        return 0;
    if (a->norm.data != NULL && ((a->norm.dtype != KERN_DTYPE_BF16 && a->norm.dtype != KERN_DTYPE_F32) ||
                                 !aligned16(a->norm.data)))
        return 0;
    for (int i = 0; i < a->n_w; i++)
        if (a->w[i].dtype != KERN_DTYPE_BF16 || !aligned16(a->w[i].data))
            return 0;
    return 1;
}

template <int NT, int EPI, int D, int XP, int BT = 0, int XB = 0, int R = 1>
static cudaError_t launch_one(const sk_params &p, dim3 grid, cudaStream_t s)
{
    constexpr int NWT = EPI == KERN_LINEAR_SWIGLU ? 2 : R;
    /* the warps' partial sums (and SWIGLU's gate sums): at most 36 KB, under the default limit */
    size_t smem = ((size_t)p.warps * NT * 128 + (NWT > 1 ? NT * 128 : 0)) * sizeof(float);
    /* idle warps: the block scheduler fills an SM to its occupancy before the next, so a grid
     * of small CTAs sits on few SMs; extra warps (registers held, no work) lower the CTAs an SM
     * takes to spread_cap, chosen by the occupancy calculator (cached in the device's context
     * per kernel form and block size) */
    int threads = p.warps * 32;
    if (p.spread_cap > 0) {
        /* BT (one tile) and XB (several) never meet: one load-form bit */
        constexpr int form = R == 1 ? ((NT == 1 ? 0 : NT == 2 ? 1 : NT == 4 ? 2 : 3) * 3 + EPI) * 2 + (BT | XB)
                                    : 24 + (NT == 2 ? 0 : NT == 4 ? 1 : 2) * 2 + EPI;
        static_assert(form < KERN_CUDA_SK_FORMS, "kern_cuda_ctx.sk_occ holds every form");
        for (int wq = p.warps; wq <= SK_MAX_WARPS; wq++) {
            signed char *oc = &p.occ[form][p.warps][wq];
            if (*oc == 0) {
                int occ = 0;
                if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, skinny_kernel<NT, EPI, D, XP, BT, XB, R>, wq * 32,
                                                                  smem) != cudaSuccess)
                    occ = -1;
                (void)cudaGetLastError();
                *oc = (signed char)(occ > 0 ? (occ > 100 ? 100 : occ) : -1);
            }
            if (*oc < p.spread_cap)
                break;
            threads = wq * 32;
            if (*oc == p.spread_cap)
                break;
        }
    }
    /* programmatic dependent launch: this kernel's weight loads start while the previous kernel
     * drains (griddepcontrol.wait in the kernel; captured into graphs as programmatic edges) */
    return kern_cuda_launch(s, grid, dim3((unsigned)threads), smem, 1, skinny_kernel<NT, EPI, D, XP, BT, XB, R>, p);
}

/* W loads in flight per warp: 3 steps (12 x 16 bytes per thread) with x one step ahead for one
 * tile, 1 for swiglu's two weights; fewer where registers go to more tiles. Sized so that
 * NT <= 2 fits 2 CTAs of 256 threads per SM (128 registers) without spills. ptxas puts every
 * global load of the ring on one scoreboard and waits for all of them at a step's first use
 * (H200 SASS of the one-tile kernel), so a step also waits for the steps loaded after it and
 * the ring's depth buys little (one tile at 1 / 2 / 3 steps timed the same within 1 %); one-tile
 * products other than SwiGLU therefore load in batches of 2 steps (BT: a batch's x and W in
 * flight together, no branch between them; Qwen3-4B decode 3.255 -> 3.17-3.19 ms, same bits;
 * 3 steps spill, as does SwiGLU at 2, both slower). (H200, Qwen3-4B decode, 2026-12-04: swiglu
 * at 1 step took the decode step from 3.30-3.32 to 3.22-3.24 ms against 2 (which spilled 28
 * bytes), and 3 spilled 452 bytes and took 3.91 ms. More loads in flight lost every time: an L2
 * prefetch 2 / 4 / 8 / 16 steps past the ring, 3.39 / 3.49 / 3.69 / 3.78 against 3.34 ms.) */
template <int NT, int EPI>
static cudaError_t launch_nt(const sk_params &p, dim3 grid, cudaStream_t s)
{
    if constexpr (NT == 1) {
        if constexpr (EPI != KERN_LINEAR_SWIGLU)
            if (p.batch)
                return launch_one<NT, EPI, 2, 1, 1>(p, grid, s);
        return launch_one<NT, EPI, EPI == KERN_LINEAR_SWIGLU ? 1 : 3, 1>(p, grid, s);
    } else {
        constexpr int D = NT == 2 ? (EPI == KERN_LINEAR_SWIGLU ? 1 : 2) : NT == 4 ? 2 : 1;
        if constexpr (EPI != KERN_LINEAR_SWIGLU)   /* SwiGLU's CTA holds gate and up: R 1 */
            if (p.xb != NULL && p.r == 2)
                return launch_one<NT, EPI, D, 0, 0, 1, 2>(p, grid, s);
        if (p.xb != NULL)
            return launch_one<NT, EPI, D, 0, 0, 1>(p, grid, s);
        return launch_one<NT, EPI, D, 0>(p, grid, s);
    }
}

template <int EPI>
static cudaError_t launch_epi(const sk_params &p, int nt, dim3 grid, cudaStream_t s)
{
    switch (nt) {
    case 1: return launch_nt<1, EPI>(p, grid, s);
    case 2: return launch_nt<2, EPI>(p, grid, s);
    case 4: return launch_nt<4, EPI>(p, grid, s);
    default: return launch_nt<8, EPI>(p, grid, s);
    }
}

/* Warps per CTA (the K split) from the tile count only, so a row's arithmetic never depends on
 * m: the most warps (up to 8) that still let every tile's CTA be resident at once, since the
 * CTAs of a second wave would stream with the machine half empty; when the tiles need many
 * waves anyway (lm_head) c->sk_wide_warps, 2 unless PD_SK_WIDE_WARPS says otherwise: a CTA
 * then streams 20 steps per warp instead of 5, so its ring fill and reduction weigh less
 * (H200, 1 x 151936 x 2560: 210.4 us with 8 warps, 195.8 with 4, 191.8 with 2 = 94 % of the
 * copy rate, 206.3 with 1; 7 rows: 219.4 / 204.6 / 196.5 / 209.1 us). */
static int skinny_warps(const kern_cuda_ctx *c, int tiles)
{
    int w = SK_MAX_WARPS;
    while (w > 1 && tiles > c->n_sm * (SK_WARPS_PER_SM / w))
        w /= 2;
    if (tiles > c->n_sm * SK_WARPS_PER_SM)
        w = c->sk_wide_warps;
    return w;
}

/* The XB form's operand: sk_xpack_kernel packs x (and each row's per-warp sums of squares) into
 * scratch, p->xb and p->xss; extra bytes after them for the caller (*extra). */
static pd_status pack_x(kern_cuda_ctx *c, const kern_linear_args *a, sk_params *p, size_t extra, void **out,
                        pd_err *err)
{
    p->ld_xb = (a->k + SK_STEP - 1) / SK_STEP * SK_STEP;
    size_t xb_bytes = kern_cuda_align256((size_t)a->m * p->ld_xb * 2);
    size_t ss_bytes = kern_cuda_align256((size_t)a->m * p->warps * sizeof(float));
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, xb_bytes + ss_bytes + extra + 256, &ws, err);
    if (st != PD_OK)
        return st;
    p->xb = (const __nv_bfloat16 *)ws;
    p->xss = (const float *)((char *)ws + xb_bytes);
    if (out != NULL)
        *out = (char *)ws + xb_bytes + ss_bytes;
    PD_CUDA_TRY(kern_cuda_launch(c->stream, dim3((unsigned)a->m), dim3(256), 0, 1, sk_xpack_kernel, *p), err);
    return PD_OK;
}

template <int EPI, class S>
static cudaError_t tiled_launch_epi(kern_cuda_ctx *c, const sk_params &p, int blocks)
{
    const int ns = p.warps >= 2 ? 2 : 1;
    const int bit = 1 << ((EPI * 2 + ns - 1) * 2 + (S::XR == tl_tall::XR));
    void (*kern)(sk_params) = ns == 2 ? sk_tiled_kernel<EPI, 2, S> : sk_tiled_kernel<EPI, 1, S>;
    if (!(c->sk_tiled_smem & bit)) {
        cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, S::SMEM);
        if (e != cudaSuccess)
            return e;
        c->sk_tiled_smem |= bit;
    }
    cudaError_t e = kern_cuda_launch(c->stream, dim3((unsigned)blocks), dim3(256), S::SMEM, 1, kern, p);
    if (e != cudaSuccess || p.tl_all)
        return e;
    const int nout = EPI == KERN_LINEAR_SWIGLU ? p.n[0] : p.np;
    return kern_cuda_launch(c->stream, dim3((unsigned)((nout + 255) / 256), (unsigned)p.m), dim3(256), 0, 1,
                            sk_tiled_epi_kernel<EPI>, p);
}

template <class S>
static cudaError_t tiled_launch_shape(kern_cuda_ctx *c, kern_linear_epilogue epi, const sk_params &p, int blocks)
{
    switch (epi) {
    case KERN_LINEAR_STORE: return tiled_launch_epi<KERN_LINEAR_STORE, S>(c, p, blocks);
    case KERN_LINEAR_ACCUMULATE: return tiled_launch_epi<KERN_LINEAR_ACCUMULATE, S>(c, p, blocks);
    default: return tiled_launch_epi<KERN_LINEAR_SWIGLU, S>(c, p, blocks);
    }
}

/* Which form a batch-invariant product of m rows and a K split over W warps takes (the bits are
 * the same either way). The tiled form wins where a CTA runs all splits (W <= 2: gate/up,
 * lm_head) from a few tiles of x up; with W = 4 or 8 its CTAs hold split pairs and their sums
 * go through scratch, which pays only at more rows (H100, Qwen3-4B products: docs/BENCHMARKS.md,
 * "The tiled form"). PD_SK_TILED_MIN sets the first row count (0: never), PD_SK_TILED_ANY=1
 * takes it for every W from there. With W > 2 the splits' sums go through scratch, W x m x cols
 * floats: past TL_PART_MAX bytes (a verify of many long blocks) the skinny form takes the product,
 * so the scratch stays bounded. */
#define TL_PART_MAX ((size_t)128 << 20)

static int tiled_wanted(const kern_cuda_ctx *c, int m, int W, int cols)
{
    const int m0 = c->sk_tiled_min;
    if (!c->sk_xpack || m0 <= 0 || m < m0)
        return 0;
    if (W > 2 && (size_t)W * m * cols * sizeof(float) > TL_PART_MAX)
        return 0;
    return c->sk_tiled_any || W <= 2 || (W == 4 && m >= 2 * m0) || m >= 5 * m0;
}

/* The tiled form (sk_tiled_kernel) for p, whose weights, outputs and K split skinny_launch has
 * set: blocks of a shape's weight rows per weight, x packed, and one CTA per block and chunk
 * when they fill the machine, else one per block, chunk and split (their sums in scratch). The
 * shape: 64 x 128 from c->sk_tiled_tall rows where W <= 2 and from TL_TALL_SPLIT_MIN for any W,
 * else 64 x 64 (the same bits either way). */
static pd_status tiled_launch(kern_cuda_ctx *c, const kern_linear_args *a, sk_params *p, int swiglu, pd_err *err)
{
    const int T = c->sk_tiled_tall;
    const int tall = T > 0 && a->m >= T && (p->warps <= 2 || c->sk_tiled_any || a->m >= TL_TALL_SPLIT_MIN);
    const int wr = tall ? tl_tall::WR : tl_small::WR, xr = tall ? tl_tall::XR : tl_small::XR;
    const int per = swiglu ? wr / 2 : wr;
    int blocks = 0, cols = 0;
    for (int i = 0; i < p->n_w; i++) {
        p->fb0[i] = blocks;
        p->pc0[i] = cols;
        blocks += (p->n[i] + per - 1) / per;
        cols += p->n[i];
    }
    p->fb0[p->n_w] = blocks;
    p->np = swiglu ? 2 * p->n[0] : cols;
    p->nch = (a->m + xr - 1) / xr;
    /* two splits per CTA (one where W is 1): all of them where that is the K split */
    p->tl_all = p->warps <= 2;
    size_t part = p->tl_all ? 0 : (size_t)p->warps * a->m * p->np * sizeof(float);
    void *pp = NULL;
    pd_status st = pack_x(c, a, p, part, &pp, err);
    if (st != PD_OK)
        return st;
    p->part = (float *)pp;
    const int ctas = blocks * p->nch * (p->warps >= 2 ? p->warps / 2 : 1);
    PD_CUDA_TRY(tall ? tiled_launch_shape<tl_tall>(c, a->epilogue, *p, ctas)
                     : tiled_launch_shape<tl_small>(c, a->epilogue, *p, ctas), err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

static pd_status skinny_launch(kern_cuda_ctx *c, const kern_linear_args *a, int rnd, int trigger_late, pd_err *err)
{
    sk_params p;
    memset(&p, 0, sizeof(p));
    p.x = a->x;
    p.ld_x = a->ld_x;
    p.m = a->m;
    p.k = a->k;
    p.norm = a->norm.data;
    p.norm_bf16 = a->norm.dtype == KERN_DTYPE_BF16;
    p.eps = a->eps;
    p.tee = a->tee;
    p.ld_tee = a->ld_tee;
    p.rnd = rnd;
    p.trigger_late = trigger_late;
    p.batch = c->sk_batch;
    p.occ = c->sk_occ;
    int swiglu = a->epilogue == KERN_LINEAR_SWIGLU;
    p.n_w = swiglu ? 1 : a->n_w;     /* swiglu: one output; the kernel reads both weights */
    int tiles = 0;
    for (int i = 0; i < a->n_w; i++) {
        p.w[i] = (const __nv_bfloat16 *)a->w[i].data;
        p.n[i] = (int)a->w[i].rows;
        p.y[i] = a->y[i];
        p.ld_y[i] = a->ld_y[i];
    }
    for (int i = 0; i < p.n_w; i++) {
        p.tile0[i] = tiles;
        tiles += (p.n[i] + 15) / 16;
    }
    p.tile0[p.n_w] = tiles;
    p.warps = skinny_warps(c, tiles);
    int rows = a->m < c->sk_max_tiles * 8 ? a->m : c->sk_max_tiles * 8;
    int nt = 1;
    while (nt * 8 < rows)
        nt *= 2;
    dim3 grid((unsigned)tiles, (unsigned)((a->m + nt * 8 - 1) / (nt * 8)));
    if (tiled_wanted(c, a->m, p.warps, tiles * 16 * (swiglu ? 2 : 1)))
        return tiled_launch(c, a, &p, swiglu, err);
    if (nt > 1 && c->sk_xpack) {
        /* XB: every CTA reads x as bf16 fragments, a step ahead, instead of f32 x and the norm
         * at use (the CTAs of all tiles read all of x: at 64 rows, 8x the weights' bytes in f32) */
        pd_status st = pack_x(c, a, &p, 0, NULL, err);
        if (st != PD_OK)
            return st;
        /* two tiles of one weight per CTA share x's fragments (half the L2 traffic of x), where
         * every weight's tile count is even */
        p.r = c->sk_r == 2 && !swiglu && nt >= 4 ? 2 : 1;
        for (int i = 0; i < p.n_w; i++)
            if ((p.tile0[i + 1] - p.tile0[i]) % 2 != 0)
                p.r = 1;
        grid.x = (unsigned)(tiles / p.r);
    }
    if (grid.y > 1 && c->sk_chunk_major) {
        p.chunk_major = 1;
        grid = dim3(grid.y, grid.x);
    }
    /* a one-wave grid: at most ceil(CTAs / SMs) CTAs per SM (launch_one) */
    const long ctas = (long)grid.x * grid.y, wave = (long)c->n_sm * (SK_WARPS_PER_SM / p.warps);
    if (c->sk_spread && ctas <= wave)
        p.spread_cap = (int)((ctas + c->n_sm - 1) / c->n_sm);
    cudaError_t e;
    switch (a->epilogue) {
    case KERN_LINEAR_STORE: e = launch_epi<KERN_LINEAR_STORE>(p, nt, grid, c->stream); break;
    case KERN_LINEAR_ACCUMULATE: e = launch_epi<KERN_LINEAR_ACCUMULATE>(p, nt, grid, c->stream); break;
    default: e = launch_epi<KERN_LINEAR_SWIGLU>(p, nt, grid, c->stream); break;
    }
    PD_CUDA_TRY(e, err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_skinny_launch(kern_cuda_ctx *c, const kern_linear_args *a, int rnd, pd_err *err)
{
    return skinny_launch(c, a, rnd, 0, err);
}

/* y = swiglu(gate, up) from the two products of the cuBLAS path, [m, n] each with row stride n
 * (bf16 when the backend rounds activations: cuBLAS stored them rounded) */
template <typename T, typename O, int V>
__global__ void swiglu_out_kernel(const T *g, const T *u, int m, int n, O *y, int ld_y, int rnd)
{
    if (V == 4) {
        KERN_CUDA_FOR_RC4(r, c, m, n) {
            size_t i = (size_t)r * n + c;
            float4 a = kern_cuda_ld4(g + i), b = kern_cuda_ld4(u + i);
            kern_cuda_st4(y + (size_t)r * ld_y + c,
                          make_float4(kern_cuda_swiglu(a.x, b.x, rnd), kern_cuda_swiglu(a.y, b.y, rnd),
                                      kern_cuda_swiglu(a.z, b.z, rnd), kern_cuda_swiglu(a.w, b.w, rnd)));
        }
    } else {
        const kern_dtype dt = sizeof(T) == 2 ? KERN_DTYPE_BF16 : KERN_DTYPE_F32;
        KERN_CUDA_FOR_RC(r, c, m, n) {
            size_t i = (size_t)r * n + c;
            kern_cuda_st(y, sizeof(O) == 2 ? KERN_DTYPE_BF16 : KERN_DTYPE_F32, (size_t)r * ld_y + c,
                         kern_cuda_swiglu(kern_cuda_ld(g, dt, i), kern_cuda_ld(u, dt, i), rnd));
        }
    }
}

/* y [m, n] (row stride ld_y, F32 or, rounded values only, BF16) = SwiGLU of the gate and up
 * products at gu ([2][m, n], T) */
template <typename T, typename O>
static void swiglu_out(cudaStream_t s, const void *gu, int m, int n, O *y, int ld_y, int rnd)
{
    const T *g = (const T *)gu, *u = g + (size_t)m * n;
    if (kern_cuda_vec4_ok(n, y, ld_y) && kern_cuda_vec4_ok(n, g, n) && kern_cuda_vec4_ok(n, u, n))
        swiglu_out_kernel<T, O, 4><<<kern_cuda_grid_rc(m, n / 4, 256), 256, 0, s>>>(g, u, m, n, y, ld_y, rnd);
    else
        swiglu_out_kernel<T, O, 1><<<kern_cuda_grid_rc(m, n, 256), 256, 0, s>>>(g, u, m, n, y, ld_y, rnd);
}

/* The GEMM operand of the cuBLAS path: x normed (a->norm) and/or packed to the weight dtype at
 * xs (m * k * 2 bytes; F32 weights: normed rows in fp32, m * k * 4, or x itself) */
static pd_status operand_x(kern_backend *be, const kern_linear_args *a, void *xs, const void **xp,
                           int *ld_xp, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    const kern_dtype wdt = a->w[0].dtype;
    *xp = a->x;
    *ld_xp = a->ld_x;
    if (a->norm.data == NULL && wdt == KERN_DTYPE_F32)
        return PD_OK;
    *xp = xs;
    *ld_xp = a->k;
    if (a->norm.data == NULL)
        return kern_cuda_pack_x(c, a->x, a->ld_x, a->m, a->k, wdt, xs, err);
    kern_rmsnorm_args rn = { .x = a->x, .residual = NULL, .sum_out = NULL, .out = NULL, .w = a->norm,
                             .rows = a->m, .dim = a->k, .ld_x = a->ld_x, .ld_out = a->k, .eps = a->eps };
    return kern_cuda_rmsnorm_to(be, &rn, xs, wdt, err);
}

/* Many rows (prefill, fast mode): x normed and packed to the weight dtype once (one kernel when
 * there is a norm), one cuBLAS product per weight into y (kern_cuda_gemm_packed: with bf16
 * activations a product is rounded by cuBLAS into bf16 scratch and stored or added by one
 * pass), SwiGLU from the two products. F32 weights: x (or its norm) in fp32, cublasSgemm. */
static pd_status linear_unfused(kern_backend *be, const kern_linear_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    const int swiglu = a->epilogue == KERN_LINEAR_SWIGLU, rnd = be->act_bf16;
    const kern_dtype wdt = a->w[0].dtype;
    const int f32 = wdt == KERN_DTYPE_F32;
    const int m = a->m, k = a->k, n0 = (int)a->w[0].rows;
    /* scratch: [x packed (or normed, f32 weights)] [gate | up products, or one product's tmp] */
    size_t xs = f32 ? (a->norm.data != NULL ? (size_t)m * k * 4 : 0) : (size_t)m * k * 2;
    size_t gu_el = swiglu ? (rnd && !f32 ? 2 : 4) : 0;
    size_t tmp = 0;
    for (int i = 0; i < a->n_w && !swiglu; i++) {
        size_t t = kern_cuda_gemm_tmp_bytes(&a->w[i], m, (int)a->w[i].rows, rnd);
        tmp = t > tmp ? t : tmp;
    }
    size_t rest = swiglu ? (size_t)2 * m * n0 * gu_el : tmp;
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, kern_cuda_align256(xs) + rest + 256, &ws, err);
    if (st != PD_OK)
        return st;
    void *rb = (char *)ws + kern_cuda_align256(xs);
    const void *xp = NULL;
    int ld_xp = 0;
    if ((st = operand_x(be, a, ws, &xp, &ld_xp, err)) != PD_OK)
        return st;
    for (int i = 0; i < a->n_w; i++) {
        int n = (int)a->w[i].rows;
        if (swiglu) {
            /* the products as a bf16 model stores them; the SwiGLU pass rounds what it reads */
            kern_dtype odt = gu_el == 2 ? KERN_DTYPE_BF16 : KERN_DTYPE_F32;
            st = kern_cuda_cublas_product(c, &a->w[i], xp, ld_xp, m, n, k,
                                          (char *)rb + (size_t)i * m * n0 * gu_el, odt, n, 0.0f, err);
        } else {
            st = kern_cuda_gemm_packed(c, &a->w[i], xp, ld_xp, m, n, k, a->y[i], a->ld_y[i],
                                       a->epilogue == KERN_LINEAR_ACCUMULATE, rnd, rb, err);
        }
        if (st != PD_OK)
            return st;
    }
    if (swiglu) {
        if (gu_el == 2)
            swiglu_out<__nv_bfloat16, float>(c->stream, rb, m, n0, a->y[0], a->ld_y[0], rnd);
        else
            swiglu_out<float, float>(c->stream, rb, m, n0, a->y[0], a->ld_y[0], rnd);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    if (a->tee != NULL) {
        kern_copy_rows_args cp = { .src = a->y[0], .ld_src = a->ld_y[0], .idx = NULL, .dst = a->tee,
                                   .ld_dst = a->ld_tee, .rows = m, .cols = n0 };
        return kern_cuda_copy_rows_launch(be, &cp, err);
    }
    return PD_OK;
}

static int uses_skinny(kern_backend *be, const kern_linear_args *a)
{
    return kern_cuda_skinny_fits(a) && (be->batch_invariant || a->m <= KERN_CUDA_SKINNY_FAST_MAX_M);
}

extern "C" pd_status kern_cuda_linear_launch(kern_backend *be, const kern_linear_args *a, pd_err *err)
{
    if (a->m <= 0)
        return PD_OK;
    if (uses_skinny(be, a))
        return kern_cuda_skinny_launch(kern_cuda_ctx_of(be), a, be->act_bf16, err);
    return linear_unfused(be, a, err);
}

/* The MLP: few rows (skinny kernels) or no bf16 rounding run the two linears. The cuBLAS path
 * with bf16 activations keeps the SwiGLU output in packed bf16 scratch (the values a bf16 model
 * stores, so the down product's operand is exact) and never writes g: an 8k prefill saves the
 * fp32 g pass and the down product's packing pass, ~1.3 GB per layer (docs/BENCHMARKS.md). */
extern "C" pd_status kern_cuda_mlp_launch(kern_backend *be, const kern_mlp_args *a, pd_err *err)
{
    kern_linear_args gu, dn;
    kern_mlp_split(a, &gu, &dn);
    if (a->m <= 0)
        return PD_OK;
    if (!be->act_bf16 || a->gate.dtype != KERN_DTYPE_BF16 || a->up.dtype != KERN_DTYPE_BF16 ||
        a->down.dtype != KERN_DTYPE_BF16 || uses_skinny(be, &gu) || uses_skinny(be, &dn)) {
        pd_status st = kern_cuda_linear_launch(be, &gu, err);
        return st != PD_OK ? st : kern_cuda_linear_launch(be, &dn, err);
    }
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    const int m = a->m, k = a->k, n = (int)a->gate.rows;
    /* scratch: [x packed] [gate | up products] [SwiGLU packed] [down product] */
    size_t xs = kern_cuda_align256((size_t)m * k * 2), prod = kern_cuda_align256((size_t)2 * m * n * 2);
    size_t gp = kern_cuda_align256((size_t)m * n * 2), tmp = kern_cuda_gemm_tmp_bytes(&a->down, m, k, 1);
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, xs + prod + gp + tmp + 256, &ws, err);
    if (st != PD_OK)
        return st;
    char *pprod = (char *)ws + xs, *pg = pprod + prod, *ptmp = pg + gp;
    const void *xp = NULL;
    int ld_xp = 0;
    if ((st = operand_x(be, &gu, ws, &xp, &ld_xp, err)) != PD_OK)
        return st;
    for (int i = 0; i < 2; i++)
        if ((st = kern_cuda_cublas_product(c, &gu.w[i], xp, ld_xp, m, n, k, pprod + (size_t)i * m * n * 2,
                                           KERN_DTYPE_BF16, n, 0.0f, err)) != PD_OK)
            return st;
    swiglu_out<__nv_bfloat16, __nv_bfloat16>(c->stream, pprod, m, n, (__nv_bfloat16 *)pg, n, 1);
    KERN_CUDA_LAUNCH_CHECK(err);
    if ((st = kern_cuda_gemm_packed(c, &a->down, pg, n, m, k, n, a->y, a->ld_y,
                                    a->epilogue == KERN_LINEAR_ACCUMULATE, 1, ptmp, err)) != PD_OK)
        return st;
    if (a->tee == NULL)
        return PD_OK;
    kern_copy_rows_args cp = { .src = a->y, .ld_src = a->ld_y, .idx = NULL, .dst = a->tee,
                               .ld_dst = a->ld_tee, .rows = m, .cols = k };
    return kern_cuda_copy_rows_launch(be, &cp, err);
}

/* every weight of l is bf16 */
static int weights_bf16(const kern_linear_args *l)
{
    int bf = 1;
    for (int i = 0; i < l->n_w; i++)
        bf &= l->w[i].dtype == KERN_DTYPE_BF16;
    return bf;
}

/* The first half of ops qkv and attn_block on the cuBLAS path: x normed and packed once, then
 * the q/k/v products (the linear's weights in order) into bf16 scratch, prod[i] [m, n_i] */
static pd_status qkv_products(kern_backend *be, const kern_linear_args *l, const __nv_bfloat16 **prod,
                              pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    const int m = l->m, k = l->k;
    size_t xs = kern_cuda_align256((size_t)m * k * 2), off[KERN_LINEAR_MAX_W], total = xs;
    for (int i = 0; i < l->n_w; i++) {
        off[i] = total;
        total += kern_cuda_align256((size_t)m * l->w[i].rows * 2);
    }
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, total + 256, &ws, err);
    if (st != PD_OK)
        return st;
    const void *xp = NULL;
    int ld_xp = 0;
    if ((st = operand_x(be, l, ws, &xp, &ld_xp, err)) != PD_OK)
        return st;
    for (int i = 0; i < l->n_w; i++) {
        int n = (int)l->w[i].rows;
        prod[i] = (const __nv_bfloat16 *)((char *)ws + off[i]);
        if ((st = kern_cuda_cublas_product(c, &l->w[i], xp, ld_xp, m, n, k, (void *)prod[i],
                                           KERN_DTYPE_BF16, n, 0.0f, err)) != PD_OK)
            return st;
    }
    return PD_OK;
}

/* Few rows or no bf16 rounding: the linear, then qk_post. The cuBLAS path with bf16
 * activations keeps the products in bf16 scratch ([q | k | v], each [m, n_i]) and qk_post reads
 * them there, writing q, k and v once (the products are the values the linear would store). */
extern "C" pd_status kern_cuda_qkv_launch(kern_backend *be, const kern_qkv_args *a, pd_err *err)
{
    const kern_linear_args *l = &a->lin;
    if (l->m <= 0)
        return PD_OK;
    if (!be->act_bf16 || !weights_bf16(l) || uses_skinny(be, l)) {
        pd_status st = kern_cuda_linear_launch(be, l, err);
        return st != PD_OK ? st : kern_cuda_qk_post_launch(be, &a->post, err);
    }
    const int nq = l->n_w - 2;
    const __nv_bfloat16 *prod[KERN_LINEAR_MAX_W];
    pd_status st = qkv_products(be, l, prod, err);
    if (st != PD_OK)
        return st;
    return kern_cuda_qk_post_from(be, &a->post, nq ? prod[0] : NULL, prod[nq], prod[nq + 1],
                                  nq ? (int)l->w[0].rows : 0, (int)l->w[nq].rows, NULL, 1,
                                  l->y[nq + 1], err);
}

/* The attention half of a layer. Few rows, no bf16 rounding, or a batch the tensor-core
 * attention does not take: the three ops. Else the q/k/v products go to bf16 scratch, qk_post
 * writes q in bf16 into the memory of qkv.post.q and k/v into the cache only, the attention
 * reads that q and writes its output in bf16 into the memory of attn.out, and the o projection
 * multiplies that packed output directly: every value is the one the three ops would pass on (q,
 * k, v and the attention output are bf16-rounded there too), so the result is the same bit for bit,
 * without the fp32 q/k/v rows, the fp32 attention output and its packing pass (~0.4 GB per
 * layer at an 8k prefill of Qwen3-4B). */
extern "C" pd_status kern_cuda_attn_block_launch(kern_backend *be, const kern_attn_block_args *a,
                                                 pd_err *err)
{
    const kern_linear_args *l = &a->qkv.lin, *o = &a->o;
    const kern_qk_post_args *p = &a->qkv.post;
    const int m = l->m;
    if (m <= 0)
        return PD_OK;
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (c->decode_early && be->batch_invariant && uses_skinny(be, l) && p->kv.k != NULL) {
        /* decode, verify and draft rounds: the skinny projection, then qk_post (storing every
         * new key of the round, at most m per sequence) and the attention starting early */
        pd_status st = skinny_launch(c, l, be->act_bf16, 1, err);
        if (st == PD_OK)
            st = kern_cuda_qk_post_launch_pdl(be, p, err);
        if (st == PD_OK)
            st = kern_cuda_attn_launch_after_store(be, &a->attn, m, err);
        return st != PD_OK ? st : kern_cuda_linear_launch(be, o, err);
    }
    if (!be->act_bf16 || !weights_bf16(l) || !weights_bf16(o) || p->n_heads == 0 ||
        uses_skinny(be, l) || uses_skinny(be, o) || !kern_cuda_attn_bf16_fits(be, &a->attn) ||
        (uintptr_t)p->q % 16 != 0 || (uintptr_t)a->attn.out % 16 != 0 || o->ld_x % 8 != 0) {
        pd_status st = kern_cuda_qkv_launch(be, &a->qkv, err);
        if (st == PD_OK)
            st = kern_cuda_attn_launch(be, &a->attn, err);
        return st != PD_OK ? st : kern_cuda_linear_launch(be, o, err);
    }
    const __nv_bfloat16 *prod[KERN_LINEAR_MAX_W];
    pd_status st = qkv_products(be, l, prod, err);
    if (st != PD_OK)
        return st;
    /* q in bf16 (rows of ld_q) in the first half of q's own memory; the attention output in
     * bf16 (rows of ld_out) in attn.out's */
    __nv_bfloat16 *qb = (__nv_bfloat16 *)p->q, *ob = (__nv_bfloat16 *)a->attn.out;
    if ((st = kern_cuda_qk_post_from(be, p, prod[0], prod[1], prod[2], (int)l->w[0].rows,
                                     (int)l->w[1].rows, qb, 0, NULL, err)) != PD_OK)
        return st;
    if ((st = kern_cuda_attn_launch_bf16(be, &a->attn, qb, ob, err)) != PD_OK)
        return st;
    /* the o projection's operand is the packed output itself; scratch for its product only */
    const int n = (int)o->w[0].rows;
    void *ws = NULL;
    if ((st = kern_cuda_ws_get(c, kern_cuda_gemm_tmp_bytes(&o->w[0], m, n, 1) + 256, &ws, err)) != PD_OK)
        return st;
    if ((st = kern_cuda_gemm_packed(c, &o->w[0], ob, o->ld_x, m, n, o->k, o->y[0], o->ld_y[0],
                                    o->epilogue == KERN_LINEAR_ACCUMULATE, 1, ws, err)) != PD_OK)
        return st;
    if (o->tee == NULL)
        return PD_OK;
    kern_copy_rows_args cp = { .src = o->y[0], .ld_src = o->ld_y[0], .idx = NULL, .dst = o->tee,
                               .ld_dst = o->ld_tee, .rows = m, .cols = n };
    return kern_cuda_copy_rows_launch(be, &cp, err);
}

