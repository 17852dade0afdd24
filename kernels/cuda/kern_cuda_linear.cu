/* kern_cuda_linear.cu - the skinny tensor-core GEMM for few rows (decode steps, verify and draft
 *   blocks) and the fused linear op built on it.
 * Owns: kern_cuda_linear_launch (op linear), kern_cuda_skinny_fits / kern_cuda_skinny_launch (also
 *   used by kern_cuda_matmul_launch).
 *   skinny_kernel: y[M, N] = x'[M, K] @ W[N, K]^T with mma.sync m16n8k16 (bf16 in, fp32
 *   accumulate). W is the A operand: a CTA owns 16 output features; x is the B operand: 8 rows
 *   (tokens) per n8 tile, NT tiles per 8 * NT-row chunk (grid.y walks the chunks), and every W
 *   fragment is used for all NT tiles once loaded. The K loop is split over the CTA's
 *   SK_WARPS warps at a fixed step of 64: warp w takes steps w, w + 8, w + 16, ... in order, and
 *   the warps' partial sums are added in warp order. Inside a step lane (g, t) owns the 16
 *   consecutive k at 64 s + 16 t of both W rows g, g + 8 and of x row g of each tile: it loads
 *   them straight from global memory (2 x 16 bytes per W row, no shared memory) and feeds them to
 *   4 mmas, quad q of its 16 k into mma q's k slots (2t, 2t+1, 2t+8, 2t+9). The products are
 *   a permutation of k that W and x share, so the sum is the same dot product.
 *   Batch invariance by construction: a row's value depends on its own x row, W, K and the step
 *   split (a function of K only); the mma computes each output element from its own column of B
 *   only, so neither the number of rows nor where a row sits in its tile changes its bits. M > 64
 *   streams W once per 64-row chunk; each row's arithmetic is unchanged.
 *   RMSNorm prologue: every CTA computes its chunk's per-row 1/rms itself (all threads over k,
 *   fixed order), x' = norm[k] * (x * inv) rounded to bf16 as the fragments are built.
 *   Epilogues: STORE, ACCUMULATE (y += v), SWIGLU (gate and up tiles in the same CTA).
 * Not here: shape checks (kern_ops.c), cuBLAS (kern_cuda_matmul.cu, the fallback for many rows).
 * Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#include <string.h>

#define SK_WARPS 8
#define SK_THREADS (SK_WARPS * 32)
#define SK_STEP 64
#define SK_MAX_TILES 8                      /* n8 token tiles per chunk: 64 rows */

typedef struct {
    const float *x;
    int ld_x, m, k;
    const void *norm;                        /* NULL: no RMSNorm prologue */
    int norm_bf16;                           /* norm dtype: 1 bf16, 0 f32 */
    float eps;
    int n_w;
    const __nv_bfloat16 *w[KERN_LINEAR_MAX_W];
    int n[KERN_LINEAR_MAX_W];
    int tile0[KERN_LINEAR_MAX_W + 1];        /* first CTA of weight i; tile0[n_w] = all tiles */
    float *y[KERN_LINEAR_MAX_W];
    int ld_y[KERN_LINEAR_MAX_W];
} sk_params;

static __device__ __forceinline__ uint4 ld_stream(const __nv_bfloat16 *p)
{
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
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

/* One W row's 16 k of a step: two 16-byte loads, zero past k (k % 8 == 0). */
struct wfrag {
    uint4 lo, hi;
};

static __device__ __forceinline__ wfrag load_w(const __nv_bfloat16 *row, int kk, int k)
{
    wfrag f;
    f.lo = kk < k ? ld_stream(row + kk) : make_uint4(0, 0, 0, 0);
    f.hi = kk + 8 < k ? ld_stream(row + kk + 8) : make_uint4(0, 0, 0, 0);
    return f;
}

/* B fragments of one x row's 16 k (x' = norm * (x * inv) when norm): b[2q], b[2q+1] feed mma q. */
static __device__ __forceinline__ void load_x(const sk_params &p, const float *xr, float inv,
                                              const float *gk, int kk, uint32_t *b)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float v[8];
        if (xr != NULL && kk + 8 * h < p.k) {
            float4 u0 = __ldg((const float4 *)(xr + kk + 8 * h));
            float4 u1 = __ldg((const float4 *)(xr + kk + 8 * h + 4));
            v[0] = u0.x; v[1] = u0.y; v[2] = u0.z; v[3] = u0.w;
            v[4] = u1.x; v[5] = u1.y; v[6] = u1.z; v[7] = u1.w;
            if (p.norm != NULL) {
#pragma unroll
                for (int i = 0; i < 8; i++)
                    v[i] = gk[8 * h + i] * (v[i] * inv);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++)
                v[i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
            b[4 * h + i] = pack_bf16(v[2 * i], v[2 * i + 1]);
    }
}

/* The RMSNorm weight at the lane's 16 k (zero past k), bf16 or f32, as 16-byte loads. */
static __device__ __forceinline__ void load_norm(const sk_params &p, int kk, float *gk)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int k0 = kk + 8 * h;
        if (k0 >= p.k) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                gk[8 * h + i] = 0.0f;
        } else if (p.norm_bf16) {
            uint4 u = __ldg((const uint4 *)((const __nv_bfloat16 *)p.norm + k0));
            const __nv_bfloat162 *hv = (const __nv_bfloat162 *)&u;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __bfloat1622float2(hv[i]);
                gk[8 * h + 2 * i] = f.x;
                gk[8 * h + 2 * i + 1] = f.y;
            }
        } else {
            float4 a = __ldg((const float4 *)((const float *)p.norm + k0));
            float4 c = __ldg((const float4 *)((const float *)p.norm + k0 + 4));
            gk[8 * h + 0] = a.x; gk[8 * h + 1] = a.y; gk[8 * h + 2] = a.z; gk[8 * h + 3] = a.w;
            gk[8 * h + 4] = c.x; gk[8 * h + 5] = c.y; gk[8 * h + 6] = c.z; gk[8 * h + 7] = c.w;
        }
    }
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

/* NT: n8 tiles per chunk; EPI: kern_linear_epilogue; U: steps whose W loads are in flight together
 * (load scheduling only: the mma order is the step order whatever U is). */
template <int NT, int EPI, int U>
__global__ void __launch_bounds__(SK_THREADS, NT <= 2 ? 2 : 1)
skinny_kernel(sk_params p)
{
    constexpr int NWT = EPI == KERN_LINEAR_SWIGLU ? 2 : 1;   /* W tiles per CTA */
    __shared__ float red[SK_WARPS][NT * 4][32];
    __shared__ float inv_s[SK_MAX_TILES * 8];
    __shared__ float part[SK_WARPS][SK_MAX_TILES * 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int chunk0 = blockIdx.y * NT * 8;
    const int rows = p.m - chunk0 < NT * 8 ? p.m - chunk0 : NT * 8;

    int wi = 0;
#pragma unroll
    for (int i = 1; i < KERN_LINEAR_MAX_W; i++)
        if (i < p.n_w && (int)blockIdx.x >= p.tile0[i])
            wi = i;
    const int n = p.n[wi], row0 = ((int)blockIdx.x - p.tile0[wi]) * 16;
    const int ra = row0 + g < n ? row0 + g : n - 1;          /* clamped: results dropped */
    const int rb = row0 + g + 8 < n ? row0 + g + 8 : n - 1;
    const __nv_bfloat16 *wrow[NWT][2];
#pragma unroll
    for (int j = 0; j < NWT; j++) {
        const __nv_bfloat16 *w = p.w[EPI == KERN_LINEAR_SWIGLU ? j : wi];
        wrow[j][0] = w + (size_t)ra * p.k;
        wrow[j][1] = w + (size_t)rb * p.k;
    }
    const int nsteps = (p.k + SK_STEP - 1) / SK_STEP;

    /* start the first weight bytes on their way to L2 while the prologue runs */
#pragma unroll
    for (int u = 0; u < U; u++) {
        int kk = (warp + u * SK_WARPS) * SK_STEP + t * 16;
        if (kk < p.k)
#pragma unroll
            for (int j = 0; j < NWT; j++) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow[j][0] + kk));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow[j][1] + kk));
            }
    }

    if (p.norm != NULL) {
        for (int r = 0; r < rows; r++) {
            const float *xr = p.x + (size_t)(chunk0 + r) * p.ld_x;
            float ss = 0.0f;
            for (int c = threadIdx.x * 4; c < p.k; c += SK_THREADS * 4) {
                float4 v = __ldg((const float4 *)(xr + c));
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
            ss = kern_cuda_warp_sum(ss);
            if (lane == 0)
                part[warp][r] = ss;
        }
        __syncthreads();
        if (threadIdx.x < rows) {
            float ss = 0.0f;
            for (int w = 0; w < SK_WARPS; w++)
                ss += part[w][threadIdx.x];
            inv_s[threadIdx.x] = rsqrtf(ss / (float)p.k + p.eps);
        }
        __syncthreads();
    }

    float acc[NWT][NT][4];
#pragma unroll
    for (int j = 0; j < NWT; j++)
#pragma unroll
        for (int i = 0; i < NT; i++)
#pragma unroll
            for (int r = 0; r < 4; r++)
                acc[j][i][r] = 0.0f;

    const float *xrow[NT];
    float inv[NT];
#pragma unroll
    for (int i = 0; i < NT; i++) {
        int r = i * 8 + g;
        xrow[i] = r < rows ? p.x + (size_t)(chunk0 + r) * p.ld_x : NULL;
        inv[i] = p.norm != NULL && r < rows ? inv_s[r] : 1.0f;
    }

    /* per iteration: all W loads of U steps, then all x (and norm weight) loads and their bf16
     * fragments, then the mmas in step order - so both kinds of loads are in flight together */
    for (int s0 = warp; s0 < nsteps; s0 += SK_WARPS * U) {
        wfrag wf[U][NWT][2];
        uint32_t b[U][NT][8];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int kk = (s0 + u * SK_WARPS) * SK_STEP + t * 16;
#pragma unroll
            for (int j = 0; j < NWT; j++) {
                wf[u][j][0] = load_w(wrow[j][0], kk, p.k);
                wf[u][j][1] = load_w(wrow[j][1], kk, p.k);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int kk = (s0 + u * SK_WARPS) * SK_STEP + t * 16;
            float gk[16];
            if (p.norm != NULL)
                load_norm(p, kk, gk);
#pragma unroll
            for (int i = 0; i < NT; i++)
                load_x(p, kk < p.k ? xrow[i] : NULL, inv[i], gk, kk, b[u][i]);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (s0 + u * SK_WARPS >= nsteps)
                break;
#pragma unroll
            for (int i = 0; i < NT; i++)
#pragma unroll
                for (int j = 0; j < NWT; j++)
                    mma_step(acc[j][i], wf[u][j][0], wf[u][j][1], b[u][i]);
        }
    }

    /* partial sums of the warps, added in warp order; element e = (tile * 4 + reg) * 32 + lane */
    constexpr int NE = NT * 4 * 32;
    constexpr int PER = (NE + SK_THREADS - 1) / SK_THREADS;
    float out[NWT][PER];
#pragma unroll
    for (int j = 0; j < NWT; j++) {
        if (j > 0)
            __syncthreads();
#pragma unroll
        for (int i = 0; i < NT; i++)
#pragma unroll
            for (int r = 0; r < 4; r++)
                red[warp][i * 4 + r][lane] = acc[j][i][r];
        __syncthreads();
#pragma unroll
        for (int q = 0; q < PER; q++) {
            int e = threadIdx.x + q * SK_THREADS;
            float v = 0.0f;
            if (e < NE)
                for (int w = 0; w < SK_WARPS; w++)
                    v += red[w][e >> 5][e & 31];
            out[j][q] = v;
        }
    }
#pragma unroll
    for (int q = 0; q < PER; q++) {
        int e = threadIdx.x + q * SK_THREADS;
        if (e >= NE)
            break;
        int l = e & 31, reg = (e >> 5) & 3, tile = e >> 7;
        int feat = row0 + (l >> 2) + (reg >= 2 ? 8 : 0);
        int r = tile * 8 + 2 * (l & 3) + (reg & 1);
        if (feat >= n || r >= rows)
            continue;
        float *yo = p.y[wi] + (size_t)(chunk0 + r) * p.ld_y[wi] + feat;
        if (EPI == KERN_LINEAR_SWIGLU)
            *yo = silu_f(out[0][q]) * out[NWT - 1][q];
        else if (EPI == KERN_LINEAR_ACCUMULATE)
            *yo += out[0][q];
        else
            *yo = out[0][q];
    }
}

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

template <int NT, int EPI>
static void launch_nt(const sk_params &p, dim3 grid, cudaStream_t s)
{
    /* steps whose loads are in flight together: 3 (12 x 16 bytes of W per thread) for one tile,
     * fewer where registers go to more tiles or to two weights (swiglu) - sized so that NT <= 2
     * fits 2 CTAs per SM without spills (launch bounds) */
    constexpr int U = EPI == KERN_LINEAR_SWIGLU ? (NT == 1 ? 2 : 1) : (NT == 1 ? 3 : NT == 2 ? 2 : 1);
    skinny_kernel<NT, EPI, U><<<grid, SK_THREADS, 0, s>>>(p);
}

template <int EPI>
static void launch_epi(const sk_params &p, int nt, dim3 grid, cudaStream_t s)
{
    switch (nt) {
    case 1: launch_nt<1, EPI>(p, grid, s); break;
    case 2: launch_nt<2, EPI>(p, grid, s); break;
    case 4: launch_nt<4, EPI>(p, grid, s); break;
    default: launch_nt<8, EPI>(p, grid, s); break;
    }
}

extern "C" pd_status kern_cuda_skinny_launch(kern_cuda_ctx *c, const kern_linear_args *a, pd_err *err)
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
    int rows = a->m < SK_MAX_TILES * 8 ? a->m : SK_MAX_TILES * 8;
    int nt = 1;
    while (nt * 8 < rows)
        nt *= 2;
    dim3 grid((unsigned)tiles, (unsigned)((a->m + nt * 8 - 1) / (nt * 8)));
    switch (a->epilogue) {
    case KERN_LINEAR_STORE: launch_epi<KERN_LINEAR_STORE>(p, nt, grid, c->stream); break;
    case KERN_LINEAR_ACCUMULATE: launch_epi<KERN_LINEAR_ACCUMULATE>(p, nt, grid, c->stream); break;
    default: launch_epi<KERN_LINEAR_SWIGLU>(p, nt, grid, c->stream); break;
    }
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* Many rows (prefill, fast mode): RMSNorm into scratch, cuBLAS per weight, SwiGLU. */
static pd_status linear_unfused(kern_backend *be, const kern_linear_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    int swiglu = a->epilogue == KERN_LINEAR_SWIGLU;
    int n0 = (int)a->w[0].rows;
    size_t xn_n = a->norm.data != NULL ? (size_t)a->m * a->k : 0;
    size_t gu_n = swiglu ? (size_t)2 * a->m * n0 : 0;
    size_t pack_bytes = (size_t)a->m * a->k * 2;
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, (xn_n + gu_n) * sizeof(float) + pack_bytes + 256, &ws, err);
    if (st != PD_OK)
        return st;
    float *xn = (float *)ws, *gu = xn + xn_n;
    void *pack = (void *)(((uintptr_t)(gu + gu_n) + 255) & ~(uintptr_t)255);
    const float *x = a->x;
    int ld_x = a->ld_x;
    if (xn_n > 0) {
        kern_rmsnorm_args rn = { .x = a->x, .residual = NULL, .sum_out = NULL, .out = xn, .w = a->norm,
                                 .rows = a->m, .dim = a->k, .ld_x = a->ld_x, .ld_out = a->k, .eps = a->eps };
        if ((st = kern_cuda_rmsnorm_launch(be, &rn, err)) != PD_OK)
            return st;
        x = xn;
        ld_x = a->k;
    }
    for (int i = 0; i < a->n_w; i++) {
        kern_matmul_args mm;
        memset(&mm, 0, sizeof(mm));
        mm.x = x;
        mm.ld_x = ld_x;
        mm.w = a->w[i];
        mm.y = swiglu ? gu + (size_t)i * a->m * n0 : a->y[i];
        mm.ld_y = swiglu ? n0 : a->ld_y[i];
        mm.m = a->m;
        mm.n = (int)a->w[i].rows;
        mm.k = a->k;
        mm.accumulate = a->epilogue == KERN_LINEAR_ACCUMULATE;
        if ((st = kern_cuda_gemm_cublas(c, &mm, pack, err)) != PD_OK)
            return st;
    }
    if (!swiglu)
        return PD_OK;
    kern_binary_args sw = { .op = KERN_BINARY_SWIGLU, .a = gu, .ld_a = n0, .b = gu + (size_t)a->m * n0,
                            .ld_b = n0, .out = a->y[0], .ld_out = a->ld_y[0], .rows = a->m, .cols = n0 };
    return kern_cuda_binary_launch(be, &sw, err);
}

extern "C" pd_status kern_cuda_linear_launch(kern_backend *be, const kern_linear_args *a, pd_err *err)
{
    if (a->m <= 0)
        return PD_OK;
    if (kern_cuda_skinny_fits(a) && (be->batch_invariant || a->m <= KERN_CUDA_SKINNY_FAST_MAX_M))
        return kern_cuda_skinny_launch(kern_cuda_ctx_of(be), a, err);
    return linear_unfused(be, a, err);
}
