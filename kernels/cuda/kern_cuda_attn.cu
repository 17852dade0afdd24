/* kern_cuda_attn.cu - paged attention for a ragged batch of queries: causal prefill chunks,
 *   verify blocks and non-causal draft blocks all come through one op; each query token carries
 *   its own sequence id and kv length, and keys are fetched through the sequence's page table.
 * Owns: kern_cuda_attn_launch.
 * How: one block of 128 threads per (query token, kv head, group of <= 8 query heads that share
 *   the kv head), so each K/V tile is loaded once for the whole GQA group. Keys are walked in
 *   tiles of 32 (one key per lane): the tile is converted to fp32 in shared memory, scores come
 *   from fp32 dot products, the softmax is online (running max m and sum l per head, rescaling
 *   the accumulator by exp(m_old - m_new)), and P @ V accumulates in fp32 registers. The next
 *   tile's K/V (and the page ids of the one after) are loaded into registers while the current
 *   tile computes.
 *   Flash-decoding split: when the batch alone would leave the GPU idle (decode, verify, small
 *   drafts), the key range is cut into n_split chunks on grid.y; each chunk writes its partial
 *   (acc, m, l) to the workspace and a second kernel merges them. Prefill batches use one split
 *   and write the normalised output directly.
 * Not here: writing new keys (kern_cuda_kv.cu); shape checks (kern_ops.c). A kv length <= 0
 *   gives a zero output row; lengths above max_kv_len are clamped to it.
 * Threading: enqueues on the backend stream; the workspace makes one attn call at a time. */
#include "kern_cuda_internal.h"

#include <math.h>

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_TK 32       /* keys per tile: one per lane */
#define ATT_GMAX 8      /* query heads per block */
#define ATT_MIN_SPLIT_KEYS 64   /* two tiles */
#define ATT_MAX_SPLIT 1024      /* combine keeps one weight per split in shared memory */
#define ATT_INV_CHUNK 512       /* batch-invariant mode: keys per split (a multiple of ATT_TK) */
#define ATT_SPLIT_PAD(n) (((n) + 7) / 8 * 8)

template <typename T>
struct kv_vec;
/* 16-byte raw loads of cache values (kept in registers while the previous tile computes),
 * widened to 8 (bf16, f16) or 4 (f32) floats when stored to shared memory */
template <>
struct kv_vec<__nv_bfloat16> {
    static constexpr int n = 8;
    static __device__ __forceinline__ void widen(const uint4 &u, float *f)
    {
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 v = __bfloat1622float2(h[i]);
            f[2 * i] = v.x;
            f[2 * i + 1] = v.y;
        }
    }
};
template <>
struct kv_vec<__half> {
    static constexpr int n = 8;
    static __device__ __forceinline__ void widen(const uint4 &u, float *f)
    {
        const __half2 *h = (const __half2 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 v = __half22float2(h[i]);
            f[2 * i] = v.x;
            f[2 * i + 1] = v.y;
        }
    }
};
template <>
struct kv_vec<float> {
    static constexpr int n = 4;
    static __device__ __forceinline__ void widen(const uint4 &u, float *f)
    {
        f[0] = __uint_as_float(u.x);
        f[1] = __uint_as_float(u.y);
        f[2] = __uint_as_float(u.z);
        f[3] = __uint_as_float(u.w);
    }
};

struct attn_params {
    const void *kc, *vc;
    const float *q;
    float *out;
    const int32_t *tok_seq, *tok_kv_len, *page_table;
    float *part_acc;     /* [n_tok, n_heads, n_split, hd] when n_split > 1 */
    float *part_ml;      /* [n_tok, n_heads, n_split, 2] (m, l) */
    int ld_q, ld_out, n_heads, n_kv, group, hb, n_hchunk, page_size, pt_stride, max_kv_len;
    int n_split, chunk;
    float scale;
};

template <typename T, int HD>
__global__ void __launch_bounds__(ATT_THREADS)
attn_kernel(attn_params p)
{
    constexpr int D4 = HD / 4;                     /* float4 columns per head row */
    constexpr int KS = HD + 4;                     /* padded K row: conflict-free float4 reads */
    constexpr int VEC = kv_vec<T>::n;
    constexpr int TPG = ATT_THREADS / D4;          /* head rows covered per PV pass */
    constexpr int NPV = ATT_GMAX / TPG;            /* heads per thread in P @ V */
    constexpr int NSC = ATT_GMAX / ATT_WARPS;      /* heads per lane in the scores */
    constexpr int VPR = HD / VEC;                  /* 16-byte vectors per key row */
    constexpr int NLD = ATT_TK * VPR / ATT_THREADS; /* vectors per thread per tile, K and V each */
    static_assert(ATT_TK * VPR % ATT_THREADS == 0, "tile load must divide evenly");
    __shared__ __align__(16) float q_s[ATT_GMAX][HD];
    __shared__ __align__(16) float k_s[ATT_TK][KS];
    __shared__ __align__(16) float v_s[ATT_TK][HD];
    __shared__ __align__(16) float p_s[ATT_GMAX][ATT_TK];
    __shared__ float m_s[ATT_GMAX], l_s[ATT_GMAX], alpha_s[ATT_GMAX];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int bx = blockIdx.x;
    const int hc = bx % p.n_hchunk;
    bx /= p.n_hchunk;
    const int kvh = bx % p.n_kv;
    const size_t t = (size_t)(bx / p.n_kv);
    const int split = blockIdx.y;
    const int h0 = kvh * p.group + hc * p.hb;
    const int hb = p.hb;

    const int seq = p.tok_seq[t];
    int len = p.tok_kv_len[t];
    len = len < 0 ? 0 : (len > p.max_kv_len ? p.max_kv_len : len);
    const int kv_begin = split * p.chunk;
    const int kv_end = min(len, kv_begin + p.chunk);
    const int32_t *pt = p.page_table + (size_t)seq * p.pt_stride;
    const T *kc = (const T *)p.kc, *vc = (const T *)p.vc;
    const size_t row = (size_t)p.n_kv * HD;

    for (int i = tid; i < ATT_GMAX * HD; i += ATT_THREADS) {
        int g = i / HD, d = i % HD;
        q_s[g][d] = g < hb ? p.q[t * p.ld_q + (size_t)(h0 + g) * HD + d] * p.scale : 0.0f;
    }
    /* running max and sum of head warp + 4k live in that warp's registers (all lanes equal) */
    float m_r[NSC], l_r[NSC];
#pragma unroll
    for (int k = 0; k < NSC; k++) {
        m_r[k] = -INFINITY;
        l_r[k] = 0.0f;
    }
    float4 acc[NPV];
#pragma unroll
    for (int k = 0; k < NPV; k++)
        acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int d4 = tid % D4, gpv = tid / D4;
    __syncthreads();

    /* Tile loads are double-buffered through registers: tile i+1 is requested right after tile
     * i lands in shared memory, so its cache latency overlaps tile i's math. The page ids are
     * read one tile further ahead still, so no load waits on a page-table load. */
    uint4 kr[NLD], vr[NLD];
    int pg[NLD];
    auto pages = [&](int j0) {
#pragma unroll
        for (int r = 0; r < NLD; r++) {
            int j = j0 + (tid + r * ATT_THREADS) / VPR;
            pg[r] = j < kv_end ? pt[j / p.page_size] : 0;
        }
    };
    auto fetch = [&](int j0) {
#pragma unroll
        for (int r = 0; r < NLD; r++) {
            int i = tid + r * ATT_THREADS;
            int j = j0 + i / VPR, dv = (i % VPR) * VEC;
            if (j < kv_end) {
                size_t slot = (size_t)pg[r] * p.page_size + j % p.page_size;
                size_t off = slot * row + (size_t)kvh * HD + dv;
                kr[r] = *(const uint4 *)(kc + off);
                vr[r] = *(const uint4 *)(vc + off);
            } else {
                kr[r] = make_uint4(0u, 0u, 0u, 0u);   /* zero rows: their scores are masked */
                vr[r] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    if (kv_begin < kv_end) {
        pages(kv_begin);
        fetch(kv_begin);
        pages(kv_begin + ATT_TK);
    }

    for (int j0 = kv_begin; j0 < kv_end; j0 += ATT_TK) {
#pragma unroll
        for (int r = 0; r < NLD; r++) {
            int i = tid + r * ATT_THREADS;
            int jj = i / VPR, dv = (i % VPR) * VEC;
            float kf[VEC], vf[VEC];
            kv_vec<T>::widen(kr[r], kf);
            kv_vec<T>::widen(vr[r], vf);
#pragma unroll
            for (int e = 0; e < VEC; e += 4) {
                *(float4 *)&k_s[jj][dv + e] = make_float4(kf[e], kf[e + 1], kf[e + 2], kf[e + 3]);
                *(float4 *)&v_s[jj][dv + e] = make_float4(vf[e], vf[e + 1], vf[e + 2], vf[e + 3]);
            }
        }
        __syncthreads();
        if (j0 + ATT_TK < kv_end) {
            fetch(j0 + ATT_TK);
            pages(j0 + 2 * ATT_TK);
        }

        /* scores: lane = key, this warp's heads warp + 4k share each K load */
        {
            float dot[NSC];
#pragma unroll
            for (int k = 0; k < NSC; k++)
                dot[k] = 0.0f;
#pragma unroll 8
            for (int c = 0; c < D4; c++) {
                float4 kv = *(const float4 *)&k_s[lane][4 * c];
#pragma unroll
                for (int k = 0; k < NSC; k++) {
                    float4 qv = *(const float4 *)&q_s[warp + ATT_WARPS * k][4 * c];
                    dot[k] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
                }
            }
            bool valid = j0 + lane < kv_end;
#pragma unroll
            for (int k = 0; k < NSC; k++)
                p_s[warp + ATT_WARPS * k][lane] = valid ? dot[k] : -INFINITY;
        }
        __syncthreads();

        /* online softmax, one warp per head */
#pragma unroll
        for (int k = 0; k < NSC; k++) {
            int g = warp + ATT_WARPS * k;
            if (g < hb) {
                float s = p_s[g][lane];
                float m_new = fmaxf(m_r[k], kern_cuda_warp_max(s));
                float e = s == -INFINITY ? 0.0f : expf(s - m_new);
                float sum = kern_cuda_warp_sum(e);
                float alpha = m_r[k] == -INFINITY ? 0.0f : expf(m_r[k] - m_new);
                p_s[g][lane] = e;
                l_r[k] = l_r[k] * alpha + sum;
                m_r[k] = m_new;
                if (lane == 0)
                    alpha_s[g] = alpha;
            }
        }
        __syncthreads();

        /* acc[g, d4] = acc * alpha + sum_j p[g, j] v[j, d4]; one V load serves NPV heads */
        {
            float al[NPV];
#pragma unroll
            for (int k = 0; k < NPV; k++) {
                int g = gpv + TPG * k;
                al[k] = g < hb ? alpha_s[g] : 0.0f;
                acc[k].x *= al[k];
                acc[k].y *= al[k];
                acc[k].z *= al[k];
                acc[k].w *= al[k];
            }
#pragma unroll 4
            for (int j = 0; j < ATT_TK; j += 4) {
                float4 pv[NPV];
#pragma unroll
                for (int k = 0; k < NPV; k++)
                    pv[k] = *(const float4 *)&p_s[(gpv + TPG * k) % ATT_GMAX][j];
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    float4 v = *(const float4 *)&v_s[j + jj][4 * d4];
#pragma unroll
                    for (int k = 0; k < NPV; k++) {
                        float pj = jj == 0 ? pv[k].x : jj == 1 ? pv[k].y : jj == 2 ? pv[k].z : pv[k].w;
                        acc[k].x += pj * v.x;
                        acc[k].y += pj * v.y;
                        acc[k].z += pj * v.z;
                        acc[k].w += pj * v.w;
                    }
                }
            }
        }
        __syncthreads();
    }
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < NSC; k++) {
            m_s[warp + ATT_WARPS * k] = m_r[k];
            l_s[warp + ATT_WARPS * k] = l_r[k];
        }
    }
    __syncthreads();

#pragma unroll
    for (int k = 0; k < NPV; k++) {
        int g = gpv + TPG * k;
        if (g >= hb)
            continue;
        int h = h0 + g;
        if (p.n_split == 1) {
            float l = l_s[g];
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            float *o = p.out + t * p.ld_out + (size_t)h * HD + 4 * d4;
            o[0] = acc[k].x * inv;
            o[1] = acc[k].y * inv;
            o[2] = acc[k].z * inv;
            o[3] = acc[k].w * inv;
        } else {
            size_t pi = (t * p.n_heads + h) * p.n_split + split;
            *(float4 *)&p.part_acc[pi * HD + 4 * d4] = acc[k];
            if (d4 == 0) {
                p.part_ml[2 * pi] = m_s[g];
                p.part_ml[2 * pi + 1] = l_s[g];
            }
        }
    }
}

/* Reduces v over the block (blockDim.x a multiple of 32, at most 1024) with op max or sum;
 * every thread gets the result. red must hold 32 floats. */
template <bool MAX>
static __device__ __forceinline__ float block_reduce(float v, float *red)
{
    v = MAX ? kern_cuda_warp_max(v) : kern_cuda_warp_sum(v);
    int nw = blockDim.x >> 5;
    __syncthreads();   /* red may still be read from a previous reduction */
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < nw; i++)
        r = MAX ? fmaxf(r, red[i]) : r + red[i];
    return r;
}

/* Merges the n_split partial results of one (token, head): each split's weight
 * w_s = exp(m_s - M) is computed once (in parallel over splits) into shared memory, then every
 * thread sums w_s * acc_s[d] over the splits for its columns (independent loads, unrolled). */
__global__ void attn_combine_kernel(attn_params p, int hd)
{
    extern __shared__ float w_s[];        /* [n_split rounded up to 8], zero-padded: ptxas may
                                           * merge the unrolled tail's loads into 16-byte ones */
    __shared__ float red[32];
    size_t th = blockIdx.x;               /* t * n_heads + h */
    size_t t = th / p.n_heads;
    int h = (int)(th % p.n_heads);
    const int ns = p.n_split;
    const float *ml = p.part_ml + th * ns * 2;
    float m = -INFINITY;
    for (int s = threadIdx.x; s < ns; s += blockDim.x)
        m = fmaxf(m, ml[2 * s]);
    const float M = block_reduce<true>(m, red);
    float den = 0.0f;
    for (int s = threadIdx.x; s < ns; s += blockDim.x) {
        float ms = ml[2 * s];
        float w = ms == -INFINITY ? 0.0f : expf(ms - M);
        w_s[s] = w;
        den += w * ml[2 * s + 1];
    }
    for (int s = ns + threadIdx.x; s < ATT_SPLIT_PAD(ns); s += blockDim.x)
        w_s[s] = 0.0f;
    den = block_reduce<false>(den, red);   /* its barriers also publish w_s */
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    const float *acc = p.part_acc + th * ns * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float num = 0.0f;
#pragma unroll 8
        for (int s = 0; s < ns; s++)
            num += w_s[s] * acc[(size_t)s * hd + d];
        p.out[t * p.ld_out + (size_t)h * hd + d] = num * inv;
    }
}

template <typename T, int HD>
static pd_status attn_run(kern_cuda_ctx *c, attn_params *p, int n_tok, pd_err *err)
{
    dim3 grid((unsigned)((size_t)n_tok * p->n_kv * p->n_hchunk), (unsigned)p->n_split);
    attn_kernel<T, HD><<<grid, ATT_THREADS, 0, c->stream>>>(*p);
    KERN_CUDA_LAUNCH_CHECK(err);
    if (p->n_split > 1) {
        attn_combine_kernel<<<(unsigned)((size_t)n_tok * p->n_heads), HD,
                              (size_t)ATT_SPLIT_PAD(p->n_split) * sizeof(float),
                              c->stream>>>(*p, HD);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    return PD_OK;
}

extern "C" pd_status kern_cuda_attn_launch(kern_backend *be, const kern_attn_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    const kern_kv_layer *kv = &a->kv;
    int hd = kv->head_dim;
    if (a->n_tok <= 0)
        return PD_OK;
    if (hd != 64 && hd != 128)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda attn: head_dim %d (64 or 128)", hd);
    if (kv->n_kv_heads <= 0 || a->n_heads % kv->n_kv_heads != 0)
        return pd_err_set(err, PD_ERR_INVALID, "cuda attn: %d heads over %d kv heads", a->n_heads,
                          kv->n_kv_heads);
    if (((uintptr_t)kv->k | (uintptr_t)kv->v) % 16 != 0)
        return pd_err_set(err, PD_ERR_INVALID, "cuda attn: kv pages not 16-byte aligned");

    attn_params p;
    p.kc = kv->k;
    p.vc = kv->v;
    p.q = a->q;
    p.out = a->out;
    p.tok_seq = a->tok_seq;
    p.tok_kv_len = a->tok_kv_len;
    p.page_table = a->page_table;
    p.part_acc = NULL;
    p.part_ml = NULL;
    p.ld_q = a->ld_q;
    p.ld_out = a->ld_out;
    p.n_heads = a->n_heads;
    p.n_kv = kv->n_kv_heads;
    p.group = a->n_heads / kv->n_kv_heads;
    p.hb = p.group;
    while (p.hb > ATT_GMAX || p.group % p.hb != 0)
        p.hb--;
    p.n_hchunk = p.group / p.hb;
    p.page_size = kv->page_size;
    p.pt_stride = a->pt_stride;
    p.max_kv_len = a->max_kv_len;
    p.scale = a->scale;

    /* split the key range when the queries alone fill fewer than ~4 blocks per SM; aim for
     * ~8 resident blocks per SM so that the tile loads of some hide the latency of others */
    size_t base_blocks = (size_t)a->n_tok * p.n_kv * p.n_hchunk;
    int max_len = a->max_kv_len > 0 ? a->max_kv_len : 1;
    int n_split = 1;
    if (be->batch_invariant) {
        /* split boundaries at fixed multiples of ATT_INV_CHUNK keys whatever the batch: a token's
         * partials and their merge are then the same in a decode step and in a verify block (a
         * split past a token's length contributes exact zeros; one non-empty split merges to
         * the unsplit result bit for bit) */
        n_split = (max_len + ATT_INV_CHUNK - 1) / ATT_INV_CHUNK;
        if (n_split > ATT_MAX_SPLIT)
            n_split = ATT_MAX_SPLIT;
    } else if (base_blocks < (size_t)c->n_sm * 4) {
        int want = (int)(((size_t)c->n_sm * 8 + base_blocks - 1) / base_blocks);
        int by_len = (max_len + ATT_MIN_SPLIT_KEYS - 1) / ATT_MIN_SPLIT_KEYS;
        n_split = want < by_len ? want : by_len;
        if (n_split > ATT_MAX_SPLIT)
            n_split = ATT_MAX_SPLIT;
        if (n_split < 1)
            n_split = 1;
    }
    int chunk = (max_len + n_split - 1) / n_split;
    chunk = (chunk + ATT_TK - 1) / ATT_TK * ATT_TK;
    if (be->batch_invariant && n_split > 1)
        chunk = ATT_INV_CHUNK;
    n_split = (max_len + chunk - 1) / chunk;
    p.n_split = n_split;
    p.chunk = chunk;
    if (n_split > 1) {
        size_t n_part = (size_t)a->n_tok * a->n_heads * n_split;
        void *ws = NULL;
        pd_status st = kern_cuda_ws_get(c, n_part * ((size_t)hd + 2) * sizeof(float), &ws, err);
        if (st != PD_OK)
            return st;
        p.part_acc = (float *)ws;
        p.part_ml = p.part_acc + n_part * hd;
    }

    switch (kv->dtype) {
    case KERN_DTYPE_BF16:
        return hd == 64 ? attn_run<__nv_bfloat16, 64>(c, &p, a->n_tok, err)
                        : attn_run<__nv_bfloat16, 128>(c, &p, a->n_tok, err);
    case KERN_DTYPE_F16:
        return hd == 64 ? attn_run<__half, 64>(c, &p, a->n_tok, err)
                        : attn_run<__half, 128>(c, &p, a->n_tok, err);
    case KERN_DTYPE_F32:
        return hd == 64 ? attn_run<float, 64>(c, &p, a->n_tok, err)
                        : attn_run<float, 128>(c, &p, a->n_tok, err);
    default:
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda attn: cache dtype %s",
                          kern_cuda_dtype_name(kv->dtype));
    }
}
