/* kern_cuda_attn.cu - paged attention for a ragged batch of queries: causal prefill chunks,
 *   verify blocks and non-causal draft blocks all come through one op; each query token carries
 *   its own sequence id and kv length, and keys are fetched through the sequence's page table.
 * Owns: kern_cuda_attn_launch.
 * Three kernels: batch-invariant rounds on a bf16 cache run attn_inv_kernel (split-KV on the
 *   tensor cores, the split merge in the same launch, every query's arithmetic its own; described
 *   at its definition); prefill-like batches (on average >= TC_MIN_Q_PER_SEQ queries per
 *   sequence, bf16 cache, not batch-invariant) run attn_tc_kernel, a Q-tiled flash attention on
 *   the tensor cores; everything else (decode, short verify blocks, batch-invariant rounds on
 *   f16/f32 caches) runs the CUDA-core attn_kernel below.
 * How (CUDA-core kernel): one block of 128 threads per (query token, kv head, group of <= 8
 *   query heads that share the kv head), so each K/V tile is loaded once for the whole GQA group. Keys are walked in
 *   tiles of 32 (one key per lane): the tile is converted to fp32 in shared memory, scores come
 *   from fp32 dot products, the softmax is online (running max m and sum l per head, rescaling
 *   the accumulator by exp(m_old - m_new)), and P @ V accumulates in fp32 registers. The next
 *   tile's K/V (and the page ids of the one after) are loaded into registers while the current
 *   tile computes.
 *   Flash-decoding split: when the batch alone would leave the GPU idle (decode, verify, small
 *   drafts), the key range is cut into n_split chunks on grid.y; each chunk writes its partial
 *   (acc, m, l) to the workspace and a second kernel merges them (the TC kernel uses the same
 *   workspace layout and merge). Large batches use one split and write the output directly.
 * Not here: writing new keys (kern_cuda_kv.cu); shape checks (kern_ops.c). A kv length <= 0
 *   gives a zero output row; lengths above max_kv_len are clamped to it.
 * Threading: enqueues on the backend stream; the workspace and ctx->attn_cnt make one attn call
 *   at a time. */
#include "kern_cuda_internal.h"

#include <math.h>

#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#define ATT_THREADS 128
#define ATT_WARPS (ATT_THREADS / 32)
#define ATT_TK 32       /* keys per tile: one per lane */
#define ATT_GMAX 8      /* query heads per block */
#define ATT_MIN_SPLIT_KEYS 64   /* two tiles */
#define ATT_MAX_SPLIT 1024      /* combine keeps one weight per split in shared memory */
#define ATT_INV_SPLITS 16       /* batch-invariant mode: splits per query, cut from its own length */
#define ATT_INV_MIN_CHUNK 64    /* ... at least this many keys each (a multiple of ATT_TK) */
#define ATT_ONE_TILE_QPS 16     /* batch-invariant mode: up to this many queries per sequence, a
                                 * CTA takes one m-tile of rows (attn_inv_launch) */
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
    const __nv_bfloat16 *qb;   /* attn_tc_kernel: q in bf16 instead of q (kern_cuda_attn_launch_bf16) */
    __nv_bfloat16 *outb;       /* attn_tc_kernel, attn_combine_kernel: the output in bf16 instead */
    const int32_t *tok_seq, *tok_kv_len, *page_table;
    float *part_acc;     /* [n_tok, n_heads, n_split, hd] when n_split > 1 */
    float *part_ml;      /* [n_tok, n_heads, n_split, 2] (m, l) */
    int n_tok, ld_q, ld_out, n_heads, n_kv, group, hb, n_hchunk, page_size, pt_stride, max_kv_len;
    int ps_shift;        /* log2(page_size) when it is a power of two, else -1 */
    int n_split, chunk;
    int inv_splits;      /* > 0 (batch-invariant mode): a query's chunk comes from its own length */
    int qg, grp0;        /* attn_inv_kernel: tokens per CTA, first token group of this launch */
    unsigned *cnt;       /* attn_inv_kernel: arrival counter per CTA column (zero between launches) */
    int cluster;         /* attn_inv_kernel: the launch's splits form one thread-block cluster
                          * per CTA column, merged through distributed shared memory */
    int coop;            /* attn_inv_kernel: a CTA of one m-tile spreads it over all its warps
                          * (same bits; PD_ATTN_COOP=0 turns it off) */
    int spc;             /* attn_inv_kernel: key splits per CTA (grid.y = ceil(n_split / spc));
                          * 1 in a cluster */
    int kv_ef;           /* attn_inv_kernel: K/V loads under an L2 evict-first policy, so that a
                          * large grid's streamed keys do not push the split partials (written
                          * early, merged late) out of the L2 */
    int n_new;           /* attn_inv_kernel: > 0 in a programmatic dependent launch whose previous
                          * kernel stores this round's keys: a row's keys from its length - n_new
                          * on may be new, every earlier one was stored before (0: none early) */
    float scale;
    int rnd;             /* kern_backend.act_bf16: outputs rounded to bf16 */
};

/* Cache slot of key j of a sequence with page table pt: shifts for a power-of-two page size
 * (the tile loaders run this for every row of every key tile; a division by the runtime page
 * size costs tens of instructions) */
static __device__ __forceinline__ size_t attn_slot(const attn_params &p, const int32_t *pt, int j)
{
    if (p.ps_shift >= 0)
        return ((size_t)pt[j >> p.ps_shift] << p.ps_shift) + (size_t)(j & (p.page_size - 1));
    return (size_t)pt[j / p.page_size] * p.page_size + j % p.page_size;
}

/* Keys per split of a query with len keys in batch-invariant mode: len cut into inv_splits
 * chunks of a multiple of ATT_INV_MIN_CHUNK keys. It depends on the query alone, never on the
 * batch, so a query's partials and their merge are the same in a decode step and a verify
 * block (splits past its length contribute exact zeros). */
static __device__ __forceinline__ int attn_inv_chunk(int len, int inv_splits)
{
    int c = (len + inv_splits - 1) / inv_splits;
    c = (c + ATT_INV_MIN_CHUNK - 1) / ATT_INV_MIN_CHUNK * ATT_INV_MIN_CHUNK;
    return c > ATT_INV_MIN_CHUNK ? c : ATT_INV_MIN_CHUNK;
}

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
    const int chunk = p.inv_splits > 0 ? attn_inv_chunk(len, p.inv_splits) : p.chunk;
    const int kv_begin = split * chunk;
    const int kv_end = min(len, kv_begin + chunk);
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
            o[0] = kern_cuda_rnd(acc[k].x * inv, p.rnd);
            o[1] = kern_cuda_rnd(acc[k].y * inv, p.rnd);
            o[2] = kern_cuda_rnd(acc[k].z * inv, p.rnd);
            o[3] = kern_cuda_rnd(acc[k].w * inv, p.rnd);
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
        if (p.outb != NULL)
            p.outb[t * p.ld_out + (size_t)h * hd + d] = __float2bfloat16_rn(num * inv);
        else
            p.out[t * p.ld_out + (size_t)h * hd + d] = kern_cuda_rnd(num * inv, p.rnd);
    }
}

/* ---- tensor-core path: Q-tiled flash attention for prefill-like batches ---------------------
 * A CTA of 4 warps takes 64 * MT consecutive query tokens of one query head; each warp owns
 * 16 * MT of those rows (MT 16-row m-tiles). Keys come in tiles of BN (64; 32 when MT is 2)
 * through the page table into shared memory by cp.async, two stages deep (tile i+1 streams in while tile i computes).
 * S = Q K^T and O += P V run on mma.sync m16n8k16 (bf16 in, fp32 accumulate); Q is stored once
 * as bf16, P goes from the S accumulators straight into A fragments. The online softmax keeps
 * the running max of raw scores and forms p = 2^(s * scale * log2 e - max * scale * log2 e) with
 * one FFMA and one EX2 per score; each thread keeps the max and a partial sum for its rows, the
 * sum reduced over the 4 lanes of a row once at the end.
 * Masking is per row (key j is seen iff j < that row's kv_len), which covers causal chunks,
 * verify blocks and non-causal draft blocks alike; a pass walks keys only up to the largest
 * kv_len of its rows, so the causal upper triangle is skipped a whole tile at a time.
 * Ragged tiles: rows of the tile may belong to several sequences. The tile is processed once
 * per distinct sequence in it (in order of first appearance), rows of other sequences masked
 * out and not written; a tile of one sequence (the common case) takes one pass.
 * Split-KV: when the tiles alone leave SMs idle (short chunk after a long context), grid.z cuts
 * the key range into chunks and the partials go through attn_combine_kernel, exactly as for the
 * CUDA-core kernel (m is stored in natural-log units there). */
#define TC_BN 64
#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
#define TC_MIN_Q_PER_SEQ 8      /* dispatch: average queries per sequence for the TC path */
#define TC_MT2_MIN_Q_PER_SEQ 128 /* ... and for 128-row tiles (MT 2) */
#define TC_MIN_SPLIT_KEYS 256

/* element offset of 16-byte chunk c of row r in a [rows][hd] bf16 tile: chunks are XOR-swizzled
 * by the row's low 3 bits, so the 8 row addresses of one ldmatrix phase hit 8 distinct bank
 * groups (plain 256- or 128-byte rows would all land on the same banks) */
static __device__ __forceinline__ int tc_swz(int r, int c, int hd)
{
    return r * hd + ((c ^ (r & 7)) << 3);
}

static __device__ __forceinline__ void tc_ldsm_x4(unsigned (&r)[4], const void *p)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

static __device__ __forceinline__ void tc_ldsm_x2(unsigned (&r)[2], const void *p)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

static __device__ __forceinline__ void tc_ldsm_x4_t(unsigned (&r)[4], const void *p)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* d += a(16x16, row) * b(16x8, col), bf16 inputs, fp32 accumulators */
static __device__ __forceinline__ void tc_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                              unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ unsigned tc_pack_bf16(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);   /* .x (lo) is the lower 16 bits */
    return *(unsigned *)&h;
}

static __device__ __forceinline__ float tc_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));   /* ex2(-inf) = +0 */
    return y;
}

/* MT: 16-row m-tiles per warp (CTA rows TC_WARPS * 16 * MT). MT 1 keeps the warp's Q fragments
 * in registers for the whole CTA; MT 2 reads them from shared memory at every k-step instead
 * (registers go to the second tile's accumulators) and reuses each K/V fragment for both
 * tiles, halving the shared-memory reads per mma. */
template <int HD, int MT, int BN>
__global__ void __launch_bounds__(TC_THREADS, 2)
attn_tc_kernel(attn_params p)
{
    constexpr int BM = TC_WARPS * 16 * MT;
    constexpr int CH = HD / 8;        /* 16-byte chunks per row */
    constexpr int KD = HD / 16;       /* k-steps over head_dim in Q K^T */
    constexpr int NS = BN / 8;        /* score n-tiles per m-tile */
    constexpr int ND = HD / 8;        /* output n-tiles per m-tile */
    constexpr int RPL = BM / 32;      /* rows per lane when warp 0 scans the tile */
    constexpr bool QREG = MT == 1;
    constexpr int LD_ITERS = BN * CH / TC_THREADS;
    static_assert(BN * CH % TC_THREADS == 0 && TC_THREADS % CH == 0, "tile load split");
    static_assert(TC_BN % BN == 0, "split chunks (multiples of TC_BN) must hold whole key tiles");
    static_assert(BN % 16 == 0, "key tiles of whole mma k-steps");
    extern __shared__ __align__(128) unsigned char tc_smem[];
    __nv_bfloat16 *q_s = (__nv_bfloat16 *)tc_smem;   /* [BM][HD] */
    __nv_bfloat16 *k_s = q_s + BM * HD;               /* [2][BN][HD] */
    __nv_bfloat16 *v_s = k_s + 2 * BN * HD;           /* [2][BN][HD] */
    __shared__ int seq_s[BM], len_s[BM];
    __shared__ int cur_s, kvmax_s;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int h = blockIdx.x, kvh = h / p.group;
    /* longest (last) tiles first: under causal masking they carry the most keys */
    const int tile = (int)(gridDim.y - 1 - blockIdx.y);
    const int split = blockIdx.z;
    const size_t t0 = (size_t)tile * BM;
    const __nv_bfloat16 *kc = (const __nv_bfloat16 *)p.kc, *vc = (const __nv_bfloat16 *)p.vc;
    const size_t krow = (size_t)p.n_kv * HD;

    for (int r = tid; r < BM; r += TC_THREADS) {
        size_t t = t0 + r;
        int s = -1, len = 0;
        if (t < (size_t)p.n_tok) {
            s = p.tok_seq[t];
            len = p.tok_kv_len[t];
            len = len < 0 ? 0 : (len > p.max_kv_len ? p.max_kv_len : len);
        }
        seq_s[r] = s;
        len_s[r] = len;
    }
    /* Q: F32 rows -> bf16 (or bf16 rows as they are), swizzled; rows past n_tok are zero
     * (they are never written) */
    for (int i = tid; i < BM * CH; i += TC_THREADS) {
        int r = i / CH, c = i % CH;
        size_t t = t0 + r;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (t < (size_t)p.n_tok && p.qb != NULL) {
            w = __ldg((const uint4 *)(p.qb + t * p.ld_q + (size_t)h * HD + c * 8));
        } else if (t < (size_t)p.n_tok) {
            const float *src = p.q + t * p.ld_q + (size_t)h * HD + c * 8;
            w.x = tc_pack_bf16(__ldg(src), __ldg(src + 1));
            w.y = tc_pack_bf16(__ldg(src + 2), __ldg(src + 3));
            w.z = tc_pack_bf16(__ldg(src + 4), __ldg(src + 5));
            w.w = tc_pack_bf16(__ldg(src + 6), __ldg(src + 7));
        }
        *(uint4 *)&q_s[tc_swz(r, c, HD)] = w;
    }
    __syncthreads();

    const int wrow = warp * 16 * MT;          /* this warp's first row */
    unsigned qf[QREG ? KD : 1][4];
    if (QREG) {
#pragma unroll
        for (int kk = 0; kk < (QREG ? KD : 1); kk++)
            tc_ldsm_x4(qf[kk], &q_s[tc_swz(wrow + (lane & 15), kk * 2 + (lane >> 4), HD)]);
    }

    const int g = lane >> 2, qc = lane & 3;   /* fragment row within 8, column pair */
    const float sl2 = p.scale * 1.4426950408889634f;

    for (;;) {
        /* next sequence: the first row not yet done; its pass walks keys up to its longest row */
        if (warp == 0) {
            int cur = -1;
#pragma unroll
            for (int i = RPL - 1; i >= 0; i--) {
                int si = seq_s[lane + 32 * i];
                unsigned b = __ballot_sync(0xffffffffu, si >= 0);
                if (b != 0u)
                    cur = __shfl_sync(0xffffffffu, si, __ffs(b) - 1);
            }
            int mx = 0;
#pragma unroll
            for (int i = 0; i < RPL; i++)
                mx = max(mx, seq_s[lane + 32 * i] == cur ? len_s[lane + 32 * i] : 0);
            mx = __reduce_max_sync(0xffffffffu, mx);
            if (lane == 0) {
                cur_s = cur;
                kvmax_s = mx;
            }
        }
        __syncthreads();
        const int cur = cur_s;
        if (cur < 0)
            break;
        /* rows of this thread: wrow + 16 mt + g + 8 hf (hf 0, 1 = accumulator halves) */
        int lim[MT][2];
        int lim_lo = 0x7fffffff;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                int r = wrow + 16 * mt + g + 8 * hf;
                lim[mt][hf] = seq_s[r] == cur ? len_s[r] : 0;
                lim_lo = min(lim_lo, lim[mt][hf]);
            }
        /* chunk is a multiple of BN, so a key tile never straddles the split's end: keys
         * past ke in the last tile are past kvmax, hence past every row's kv_len (masked) */
        const int kb = split * p.chunk;
        const int ke = min(kvmax_s, kb + p.chunk);
        const int32_t *pt = p.page_table + (size_t)cur * p.pt_stride;

        /* m: running max of raw (unscaled) scores; l: this thread's partial row sums */
        float m[MT][2], l[MT][2];
        float acc[MT][ND][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            m[mt][0] = m[mt][1] = -INFINITY;
            l[mt][0] = l[mt][1] = 0.0f;
#pragma unroll
            for (int n = 0; n < ND; n++)
                acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;
        }

        /* each thread copies chunk (tid % CH) of rows tid / CH + i * (TC_THREADS / CH) */
        auto load_tile = [&](int j0, int stage) {
            const int c = tid % CH;
#pragma unroll
            for (int i = 0; i < LD_ITERS; i++) {
                int r = tid / CH + i * (TC_THREADS / CH);
                int j = j0 + r;
                bool ok = j < ke;
                size_t off = 0;
                if (ok) {
                    size_t slot = attn_slot(p, pt, j);
                    off = slot * krow + (size_t)kvh * HD + c * 8;
                }
                int so = stage * BN * HD + tc_swz(r, c, HD);
                kern_cuda_cp_async16(&k_s[so], kc + off, ok);
                kern_cuda_cp_async16(&v_s[so], vc + off, ok);
            }
        };

        if (kb < ke)
            load_tile(kb, 0);
        kern_cuda_cp_commit();
        for (int j0 = kb, it = 0; j0 < ke; j0 += BN, it++) {
            const int st = it & 1;
            if (j0 + BN < ke)
                load_tile(j0 + BN, st ^ 1);
            kern_cuda_cp_commit();
            kern_cuda_cp_wait<1>();   /* everything but the group just committed: tile j0 is here */
            __syncthreads();
            const __nv_bfloat16 *ks = k_s + st * BN * HD, *vs = v_s + st * BN * HD;
            {
                const int js = j0, ro = 0;   /* first key, its row in the tile */

                float s[MT][NS][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int n = 0; n < NS; n++)
                        s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
#pragma unroll
                for (int kk = 0; kk < KD; kk++) {
                    unsigned a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        if (QREG) {
#pragma unroll
                            for (int e = 0; e < 4; e++)
                                a[mt][e] = qf[QREG ? kk : 0][e];
                        } else {
                            tc_ldsm_x4(a[mt], &q_s[tc_swz(wrow + 16 * mt + (lane & 15),
                                                          kk * 2 + (lane >> 4), HD)]);
                        }
                    }
#pragma unroll
                    for (int np = 0; np < NS / 2; np++) {
                        unsigned b[4];
                        int key = ro + np * 16 + ((lane >> 4) << 3) + (lane & 7);
                        tc_ldsm_x4(b, &ks[tc_swz(key, kk * 2 + ((lane >> 3) & 1), HD)]);
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            tc_mma(s[mt][2 * np], a[mt], b[0], b[1]);
                            tc_mma(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                        }
                    }
                }

                /* mask keys at or past each row's kv_len (only tiles that reach some row's end) */
                if (js + BN > lim_lo) {
#pragma unroll
                    for (int mt = 0; mt < MT; mt++)
#pragma unroll
                        for (int n = 0; n < NS; n++) {
                            int j = js + n * 8 + 2 * qc;
#pragma unroll
                            for (int e = 0; e < 4; e++)
                                if (j + (e & 1) >= lim[mt][e >> 1])
                                    s[mt][n][e] = -INFINITY;
                        }
                }
                /* online softmax in base 2 on raw scores: p = 2^(s sl2 - m sl2), one FFMA + EX2 */
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        float mx = m[mt][hf];
#pragma unroll
                        for (int n = 0; n < NS; n++)
                            mx = fmaxf(mx, fmaxf(s[mt][n][2 * hf], s[mt][n][2 * hf + 1]));
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                        /* a row with no key seen yet keeps max -inf: subtract 0 (every p is 0) */
                        const float base = mx == -INFINITY ? 0.0f : mx * sl2;
                        const float al = tc_ex2(m[mt][hf] * sl2 - base);
                        m[mt][hf] = mx;
                        float ps = 0.0f;
#pragma unroll
                        for (int n = 0; n < NS; n++) {
                            s[mt][n][2 * hf] = tc_ex2(fmaf(s[mt][n][2 * hf], sl2, -base));
                            s[mt][n][2 * hf + 1] = tc_ex2(fmaf(s[mt][n][2 * hf + 1], sl2, -base));
                            ps += s[mt][n][2 * hf] + s[mt][n][2 * hf + 1];
                        }
                        l[mt][hf] = l[mt][hf] * al + ps;
#pragma unroll
                        for (int n = 0; n < ND; n++) {
                            acc[mt][n][2 * hf] *= al;
                            acc[mt][n][2 * hf + 1] *= al;
                        }
                    }
                }

                /* O += P V: P's accumulator layout is the A fragment layout of the next mma */
#pragma unroll
                for (int kk = 0; kk < BN / 16; kk++) {
                    unsigned a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        a[mt][0] = tc_pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                        a[mt][1] = tc_pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                        a[mt][2] = tc_pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                        a[mt][3] = tc_pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
                    }
#pragma unroll
                    for (int dp = 0; dp < ND / 2; dp++) {
                        unsigned b[4];
                        int key = ro + kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
                        tc_ldsm_x4_t(b, &vs[tc_swz(key, dp * 2 + (lane >> 4), HD)]);
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) {
                            tc_mma(acc[mt][2 * dp], a[mt], b[0], b[1]);
                            tc_mma(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
                        }
                    }
                }
            }
            __syncthreads();   /* the next iteration's load overwrites this stage */
        }

#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float lr = l[mt][hf];   /* the row's 4 lanes each hold part of its sum */
                lr += __shfl_xor_sync(0xffffffffu, lr, 1);
                lr += __shfl_xor_sync(0xffffffffu, lr, 2);
                const int r = wrow + 16 * mt + g + 8 * hf;
                if (seq_s[r] != cur)   /* seq_s changes only after this pass */
                    continue;
                const size_t t = t0 + r;
                if (p.n_split == 1 && p.outb != NULL) {
                    const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
                    __nv_bfloat16 *o = p.outb + t * p.ld_out + (size_t)h * HD + 2 * qc;
#pragma unroll
                    for (int n = 0; n < ND; n++)
                        *(unsigned *)&o[n * 8] = tc_pack_bf16(acc[mt][n][2 * hf] * inv,
                                                              acc[mt][n][2 * hf + 1] * inv);
                } else if (p.n_split == 1) {
                    const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
                    float *o = p.out + t * p.ld_out + (size_t)h * HD + 2 * qc;
#pragma unroll
                    for (int n = 0; n < ND; n++) {
                        o[n * 8] = kern_cuda_rnd(acc[mt][n][2 * hf] * inv, p.rnd);
                        o[n * 8 + 1] = kern_cuda_rnd(acc[mt][n][2 * hf + 1] * inv, p.rnd);
                    }
                } else {
                    const size_t pi = (t * p.n_heads + h) * p.n_split + split;
                    float *o = p.part_acc + pi * HD + 2 * qc;
#pragma unroll
                    for (int n = 0; n < ND; n++)
                        *(float2 *)&o[n * 8] = make_float2(acc[mt][n][2 * hf], acc[mt][n][2 * hf + 1]);
                    if (qc == 0) {
                        /* natural-log units for attn_combine_kernel */
                        p.part_ml[2 * pi] = m[mt][hf] == -INFINITY ? -INFINITY : m[mt][hf] * p.scale;
                        p.part_ml[2 * pi + 1] = lr;
                    }
                }
            }
        __syncthreads();   /* every thread has read seq_s and cur_s for this pass */
        for (int r = tid; r < BM; r += TC_THREADS)
            if (seq_s[r] == cur)
                seq_s[r] = -1;
        __syncthreads();
    }
}

/* ---- batch-invariant path: split-KV tensor-core attention with an in-launch merge ------------
 * Used for every query of a batch-invariant round on a bf16 cache (decode, verify, draft and any
 * prefill chunk alike), so a query's bits are the same whatever batch it is in and whatever path
 * its neighbours take.
 * A CTA of 4 warps takes one kv head (or a chunk of <= 64 of its query heads), QG consecutive
 * query tokens and one key split (in a large grid spc splits in turn, each with its own state
 * and partial, the tile pipeline running on across them; attn_inv_launch): its rows are (token, query head) pairs, up to 64, one 16-row
 * m-tile per warp, so each K/V tile is loaded once for the whole GQA group of all QG tokens
 * (decode: 4 rows; verify and draft blocks: as many tokens as fill one m-tile, 16 rows at
 * GQA 4, so the four warps share it; longer chunks: up to 64 rows). A CTA of one m-tile takes
 * eight warps at head_dim 128 instead (attn_inv_launch), all sharing it. Keys come through the page table in
 * tiles of 64 by cp.async, two stages deep; S = Q K^T and O += P V run on mma.sync with Q and P
 * each split into two bf16 terms (hi + lo, 16 significant bits) against the exact bf16 K/V, so
 * the result keeps about fp32 accuracy at twice the (small) mma count.
 * Invariance by construction: a row's keys are cut into ATT_INV_SPLITS chunks by attn_inv_chunk
 * of its own length, key tiles sit at multiples of 64 from key 0, and every score, softmax step
 * and P V product of a row is computed from that row alone (mma rows are independent; a tile a
 * row does not see leaves its state unchanged bit for bit). Tokens of other sequences in the
 * CTA are handled in extra passes (one per sequence, rows of other sequences idle).
 * Merge: each CTA writes its rows' partials (acc, raw max, sum) to the workspace; the CTA that
 * arrives last at its counter (ctx->attn_cnt, one per CTA column, reset by that CTA) merges
 * every split of its rows in split order, so no second launch and no dependence on arrival
 * order. When the grid is at most one CTA per SM and the device holds a cluster of all splits,
 * a CTA column is one thread-block cluster instead: the partials stay in each CTA's shared
 * memory and every CTA merges a share of the items from the others' (distributed shared
 * memory), with the same arithmetic (H200: verify 8 3.90 against 4.05 ms, draft block 0.47
 * against 0.49 ms, decode unchanged).
 * Early start (attn_params.n_new): see the first pass below and kern_cuda_attn_launch_after_store. */
#define INV_BN 64
#define INV_ROWS 64
static_assert(sizeof(((kern_cuda_ctx *)0)->attn_cluster_ok[0]) / sizeof(((kern_cuda_ctx *)0)->attn_cluster_ok[0][0]) >
                  ATT_INV_SPLITS &&
              sizeof(((kern_cuda_ctx *)0)->attn_cluster_ok[0][0]) > INV_ROWS / 16,
              "kern_cuda_ctx.attn_cluster_ok holds every split count and row bucket");
static_assert(ATT_INV_MIN_CHUNK % INV_BN == 0, "split chunks must hold whole key tiles");

/* hi + lo bf16 pair of (x, y): hi = bf16(x), lo = bf16(x - hi); packed as mma operands */
static __device__ __forceinline__ void tc_split_bf16(float x, float y, unsigned &hi, unsigned &lo)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    float2 f = __bfloat1622float2(h);
    __nv_bfloat162 l = __floats2bfloat162_rn(x - f.x, y - f.y);
    hi = *(unsigned *)&h;
    lo = *(unsigned *)&l;
}

/* minimum of v over the CTA (NW warps); red holds NW ints; every thread gets it */
template <int NW>
static __device__ __forceinline__ int inv_block_min(int v, int *red)
{
    v = __reduce_min_sync(0xffffffffu, v);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x >> 5] = v;
    __syncthreads();
    int r = red[0];
#pragma unroll
    for (int w = 1; w < NW; w++)
        r = min(r, red[w]);
    __syncthreads();   /* red is written again by the next call */
    return r;
}

template <int HD, int NW, int CW>
__global__ void __launch_bounds__(NW * 32, NW == 4 ? 1 : 2)
attn_inv_kernel(attn_params p)
{
    KT_DECL;
    constexpr int NT = NW * 32;       /* threads */
    /* coop: CW warps share an m-tile (NW / CW m-tiles); score and output n-tiles per warp */
    constexpr int NG = NW / CW, SPW = INV_BN / 8 / CW, OPW = HD / 8 / CW;
    static_assert((NW == 4 && CW == 4) || (HD == 128 && ((NW == 8 && CW == 8) || (NW == 4 && CW == 2))),
                  "coop forms: four warps, or at head_dim 128 eight on one m-tile or two pairs on two");
    constexpr int CH = HD / 8;        /* 16-byte chunks per row */
    constexpr int KD = HD / 16;       /* k-steps over head_dim in Q K^T */
    constexpr int NS = INV_BN / 8;    /* score n-tiles */
    constexpr int ND = HD / 8;        /* output n-tiles */
    constexpr int D4 = HD / 4;
    constexpr int LD_ITERS = INV_BN * CH / NT;
    static_assert(INV_BN * CH % NT == 0 && NT % CH == 0, "tile load split");
    extern __shared__ __align__(128) unsigned char inv_smem[];
    __nv_bfloat16 *k_s = (__nv_bfloat16 *)inv_smem;   /* [2][BN][HD] */
    __nv_bfloat16 *v_s = k_s + 2 * INV_BN * HD;        /* [2][BN][HD] */
    __nv_bfloat16 *qh_s = v_s + 2 * INV_BN * HD;       /* [rows_pad][HD], hi terms */
    __shared__ int seq_s[INV_ROWS], len_s[INV_ROWS];
    __shared__ int cur_s, last_s, red_s[NW];
    __shared__ int ns_s[INV_ROWS], slo_s[ATT_INV_SPLITS], shi_s[ATT_INV_SPLITS];
    __shared__ float w_s[INV_ROWS][ATT_INV_SPLITS], inv_s[INV_ROWS];   /* counter-mode merge */
    __shared__ float cm_s[NW][16], ts_s[NG][INV_BN / 8][2][32];   /* coop exchange */
    __shared__ unsigned pv_s[NG][INV_BN / 8][4][32];   /* coop: P's n-tiles as bf16 pairs, hi then lo terms */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint64_t l2_pol = p.kv_ef ? kern_cuda_l2_evict_first() : 0;
    int bx = blockIdx.x;
    const int hc = bx % p.n_hchunk;
    bx /= p.n_hchunk;
    const int kvh = bx % p.n_kv;
    const size_t t0 = (size_t)(bx / p.n_kv + p.grp0) * p.qg;
    const int h0 = kvh * p.group + hc * p.hb;
    const int hb = p.hb, n_rows = p.qg * hb, rows_pad = (n_rows + 15) / 16 * 16;
    /* this CTA's key splits [sp0, sp1): one, or p.spc in turn in a large grid (each its own
     * partial, as one split per CTA would make it) */
    const int sp0 = blockIdx.y * p.spc, sp1 = min(sp0 + p.spc, p.n_split);
    __nv_bfloat16 *ql_s = qh_s + rows_pad * HD;          /* [rows_pad][HD], lo terms */
    float *part_s = (float *)(ql_s + rows_pad * HD);        /* cluster: [rows_pad][HD] acc */
    float2 *ml_s = (float2 *)(part_s + rows_pad * HD);      /* cluster: [rows_pad] (max, sum) */
    const __nv_bfloat16 *kc = (const __nv_bfloat16 *)p.kc, *vc = (const __nv_bfloat16 *)p.vc;
    const size_t krow = (size_t)p.n_kv * HD;

    /* row r: token t0 + r / hb, query head h0 + r % hb */
    if (tid < INV_ROWS) {
        const size_t t = t0 + tid / hb;
        int s = -1, len = 0;
        if (tid < n_rows && t < (size_t)p.n_tok) {
            s = p.tok_seq[t];
            len = p.tok_kv_len[t];
            len = len < 0 ? 0 : (len > p.max_kv_len ? p.max_kv_len : len);
        }
        seq_s[tid] = s;
        len_s[tid] = len;
    }
    /* q of the rows as hi + lo bf16 terms into shared memory (read through the L2: with an early
     * start the previous kernel wrote it while this CTA was resident), then into fragments */
    auto load_q = [&]() {
        for (int i = tid; i < rows_pad * CH; i += NT) {
            const int r = i / CH, c = i % CH;
            const size_t t = t0 + r / hb;
            unsigned wh[4] = {0u, 0u, 0u, 0u}, wl[4] = {0u, 0u, 0u, 0u};
            if (r < n_rows && t < (size_t)p.n_tok) {
                /* scalar loads: ld_q need not keep rows 16-byte aligned */
                const float *src = p.q + t * p.ld_q + (size_t)(h0 + r % hb) * HD + c * 8;
#pragma unroll
                for (int e = 0; e < 4; e++)
                    tc_split_bf16(__ldcg(src + 2 * e), __ldcg(src + 2 * e + 1), wh[e], wl[e]);
            }
            *(uint4 *)&qh_s[tc_swz(r, c, HD)] = make_uint4(wh[0], wh[1], wh[2], wh[3]);
            *(uint4 *)&ql_s[tc_swz(r, c, HD)] = make_uint4(wl[0], wl[1], wl[2], wl[3]);
        }
    };
    /* coop: the CTA's rows fit its NG m-tiles, and CW warps work on each (the tile loop; eight
     * warps are launched only for such CTAs); else warp w takes rows 16w..16w+15 alone, and
     * warps past the rows only load. gw: warp w's m-tile group, wl: its place in it */
    const bool coop = CW != 4 || (p.coop && n_rows <= 16);
    const int gw = NG == 1 ? 0 : warp / CW, wl = NG == 1 ? warp : warp % CW;
    const int wrow = coop ? gw * 16 : warp * 16;
    const bool active = coop || wrow < n_rows;
    unsigned qh[KD][4], ql[KD][4];
    bool q_lo = true;   /* some lo term of q is not zero (q not bf16-exact: fp32 mode) */
    auto frag_q = [&]() {
        if (active) {
            unsigned nz = 0u;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                tc_ldsm_x4(qh[kk], &qh_s[tc_swz(wrow + (lane & 15), kk * 2 + (lane >> 4), HD)]);
                tc_ldsm_x4(ql[kk], &ql_s[tc_swz(wrow + (lane & 15), kk * 2 + (lane >> 4), HD)]);
                nz |= ql[kk][0] | ql[kk][1] | ql[kk][2] | ql[kk][3];
            }
            /* an all-zero lo term adds exact zeros to the scores: leaving its mmas out gives
             * the same bits (bf16 activations: q is bf16 already) */
            q_lo = __any_sync(0xffffffffu, nz != 0u);
        }
    };
    /* early start (p.n_new > 0, a programmatic dependent launch): q comes after the wait, in
     * the first pass, once the pass's first key tile is on its way */
    bool q_ready = p.n_new <= 0;
    if (q_ready)
        load_q();
    __syncthreads();
    if (q_ready)
        frag_q();
    const int g = lane >> 2, qc = lane & 3;   /* fragment row within 8, column pair */
    const float sl2 = p.scale * 1.4426950408889634f;

    for (;;) {
        /* next sequence: that of the first row not done yet */
        if (warp == 0) {
            const int s0 = seq_s[lane], s1 = seq_s[lane + 32];
            const unsigned b0 = __ballot_sync(0xffffffffu, s0 >= 0);
            const unsigned b1 = __ballot_sync(0xffffffffu, s1 >= 0);
            int cur = -1;
            if (b0 != 0u)
                cur = __shfl_sync(0xffffffffu, s0, __ffs(b0) - 1);
            else if (b1 != 0u)
                cur = __shfl_sync(0xffffffffu, s1, __ffs(b1) - 1);
            if (lane == 0)
                cur_s = cur;
        }
        __syncthreads();
        const int cur = cur_s;
        if (cur < 0)
            break;
        /* split sp's keys [rb, re) of row r of the pass (empty for the other rows) */
        auto row_range = [&](int r, int sp, int &rb, int &re) {
            rb = re = 0;
            if (seq_s[r] == cur) {
                const int len = len_s[r], ch = attn_inv_chunk(len, ATT_INV_SPLITS);
                rb = sp * ch;
                re = min(len, rb + ch);
                re = re > rb ? re : rb;
            }
        };
        /* each split's keys over the pass's rows that have some in it: [slo_s, shi_s), once
         * per pass (split starts are multiples of INV_BN, so slo_s is a tile start) */
        static_assert(INV_ROWS == 64, "warp 0's lane l takes rows l and l + 32");
        if (warp == 0) {
            for (int sp = sp0; sp < sp1; sp++) {
                int rb0, re0, rb1, re1;
                row_range(lane, sp, rb0, re0);
                row_range(lane + 32, sp, rb1, re1);
                const int lo = __reduce_min_sync(0xffffffffu, min(re0 > rb0 ? rb0 : INT_MAX, re1 > rb1 ? rb1 : INT_MAX));
                const int hi = __reduce_max_sync(0xffffffffu, max(re0 > rb0 ? re0 : 0, re1 > rb1 ? re1 : 0));
                if (lane == 0) {
                    slo_s[sp] = lo;
                    shi_s[sp] = hi;
                }
            }
        }
        __syncthreads();
        /* the pass's tiles, split by split: the first tile at or after j of split sp within its
         * keys, else the first of a later split of this CTA (INT_MAX: none). spo gets its split
         * and km its kmax: keys below it exist in the sequence's pages, later ones of the tile
         * are zero-filled. Rows whose keys in the split start later (ragged lengths) see none
         * of a tile before their start: the mask leaves their state unchanged, bit for bit */
        auto next_pos = [&](int sp, int j, int &spo, int &km) -> int {
            for (; sp < sp1; sp++, j = 0) {
                const int v = max(j, slo_s[sp]), e = shi_s[sp];
                if (v < e) {
                    spo = sp;
                    km = e;
                    return v;
                }
            }
            spo = sp1;
            km = 0;
            return INT_MAX;
        };
        /* this thread's fragment rows' keys [lo, hi) in split sp */
        int lo[2], hi[2];
        auto frag_range = [&](int sp) {
#pragma unroll
            for (int hf = 0; hf < 2; hf++)
                row_range(wrow + g + 8 * hf, sp, lo[hf], hi[hf]);
        };
        const int32_t *pt = p.page_table + (size_t)cur * p.pt_stride;
        /* tile j0 into stage; only its keys from j_from on when given (the reload above) */
        auto load_tile = [&](int j0, int stage, int kmax, int j_from = 0) {
            const int c = tid % CH;
            /* every row's cache slot first, so that the page-table loads are in flight together
             * (each copy waits for its row's entry) */
            size_t slot[LD_ITERS];
#pragma unroll
            for (int i = 0; i < LD_ITERS; i++) {
                const int j = j0 + tid / CH + i * (NT / CH);
                slot[i] = j >= j_from && j < kmax ? attn_slot(p, pt, j) : 0;
            }
#pragma unroll
            for (int i = 0; i < LD_ITERS; i++) {
                const int r = tid / CH + i * (NT / CH);
                const int j = j0 + r;
                if (j < j_from)
                    continue;
                const bool ok = j < kmax;
                const size_t off = ok ? slot[i] * krow + (size_t)kvh * HD + c * 8 : 0;
                const int so = stage * INV_BN * HD + tc_swz(r, c, HD);
                if (p.kv_ef) {
                    kern_cuda_cp_async16_pol(&k_s[so], kc + off, ok, l2_pol);
                    kern_cuda_cp_async16_pol(&v_s[so], vc + off, ok, l2_pol);
                } else {
                    kern_cuda_cp_async16(&k_s[so], kc + off, ok);
                    kern_cuda_cp_async16(&v_s[so], vc + off, ok);
                }
            }
        };

        float m[2], l[2], acc[ND][4];
        auto reset = [&]() {
            m[0] = m[1] = -INFINITY;
            l[0] = l[1] = 0.0f;
#pragma unroll
            for (int n = 0; n < ND; n++)
                acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        };

        int sc, kc;   /* the current tile's split and kmax */
        int jc = next_pos(sp0, 0, sc, kc);
        if (jc != INT_MAX)
            load_tile(jc, 0, kc);
        kern_cuda_cp_commit();
        /* the second tile when it was loaded here, into stage 1, its split and kmax */
        int jpre = INT_MAX, spre = sp1, kpre = 0;
        if (!q_ready) {
            /* keys below len - n_new of each row were stored before the previous kernel, so the
             * pass's first two tiles are loaded before it ends; after the wait, their rows that
             * may hold this round's keys are loaded again (each thread its own rows, once its
             * first copies have landed), then q */
            if (jc != INT_MAX) {
                jpre = next_pos(sc, jc + INV_BN, spre, kpre);
                if (jpre != INT_MAX)
                    load_tile(jpre, 1, kpre);
            }
            kern_cuda_cp_commit();
            int nl = INT_MAX;
            if (tid < INV_ROWS && seq_s[tid] == cur)
                nl = max(len_s[tid] - p.n_new, 0);
            const int new_lo = inv_block_min<NW>(nl, red_s);
            kern_cuda_pdl_wait_prev();
            KT_WAITED;
            kern_cuda_cp_wait<0>();
            if (jc != INT_MAX && jc + INV_BN > new_lo)
                load_tile(jc, 0, kc, new_lo);
            if (jpre != INT_MAX && jpre + INV_BN > new_lo)
                load_tile(jpre, 1, kpre, new_lo);
            kern_cuda_cp_commit();
            load_q();
            __syncthreads();
            frag_q();
            q_ready = true;
        }
        reset();
        frag_range(sc);
        /* the pieces both forms of the tile's math below use (the same operations, so the
         * same bits): the scores of keys 16 np .. 16 np + 15 (n-tiles 2 np, 2 np + 1), the hi
         * then the lo term of q per k-step; -inf where row g + 8 hf does not see a key of
         * n-tile n (lo <= j < hi: its split, its length); P's keys 16 kk .. as hi + lo A
         * fragments; O's column pair dp += (P_hi + P_lo) V over those keys */
        auto score_pair = [&](const __nv_bfloat16 *ks, int np, float (&s0)[4], float (&s1)[4]) {
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                unsigned b[4];
                const int key = np * 16 + ((lane >> 4) << 3) + (lane & 7);
                tc_ldsm_x4(b, &ks[tc_swz(key, kk * 2 + ((lane >> 3) & 1), HD)]);
                tc_mma(s0, qh[kk], b[0], b[1]);
                tc_mma(s1, qh[kk], b[2], b[3]);
                if (q_lo) {
                    tc_mma(s0, ql[kk], b[0], b[1]);
                    tc_mma(s1, ql[kk], b[2], b[3]);
                }
            }
        };
        /* the scores of keys 8 n .. 8 n + 7 alone: score_pair's operations for one n-tile */
        auto score_one = [&](const __nv_bfloat16 *ks, int n, float (&s0)[4]) {
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                unsigned b[2];
                tc_ldsm_x2(b, &ks[tc_swz(n * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1), HD)]);
                tc_mma(s0, qh[kk], b[0], b[1]);
                if (q_lo)
                    tc_mma(s0, ql[kk], b[0], b[1]);
            }
        };
        auto mask_ntile = [&](float (&sn)[4], int j0, int n) {
            const int j = j0 + n * 8 + 2 * qc;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int jj = j + (e & 1), hf = e >> 1;
                if (jj < lo[hf] || jj >= hi[hf])
                    sn[e] = -INFINITY;
            }
        };
        auto split_p = [&](const float (&p0)[4], const float (&p1)[4], unsigned (&ah)[4], unsigned (&alo)[4]) {
            tc_split_bf16(p0[0], p0[1], ah[0], alo[0]);
            tc_split_bf16(p0[2], p0[3], ah[1], alo[1]);
            tc_split_bf16(p1[0], p1[1], ah[2], alo[2]);
            tc_split_bf16(p1[2], p1[3], ah[3], alo[3]);
        };
        auto pv_pair = [&](const __nv_bfloat16 *vs, int kk, const unsigned (&ah)[4], const unsigned (&alo)[4],
                           int dp, float (&a0)[4], float (&a1)[4]) {
            unsigned b[4];
            const int key = kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
            tc_ldsm_x4_t(b, &vs[tc_swz(key, dp * 2 + (lane >> 4), HD)]);
            tc_mma(a0, ah, b[0], b[1]);
            tc_mma(a1, ah, b[2], b[3]);
            tc_mma(a0, alo, b[0], b[1]);
            tc_mma(a1, alo, b[2], b[3]);
        };
        /* split sp's partials of the rows that have keys in it: (acc, raw max, sum) */
        auto flush = [&](int sp) {
            if (coop) {
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float lr = l[hf];   /* the row's 4 lanes each hold part of its sum */
                    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
                    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
                    const int r = (NG == 1 ? 0 : gw * 16) + g + 8 * hf;
                    if (hi[hf] <= lo[hf])   /* not in this pass, or nothing in this split */
                        continue;
                    const size_t t = t0 + r / hb;
                    const size_t pi = (t * p.n_heads + h0 + r % hb) * p.n_split + sp;
                    float *o = (p.cluster ? part_s + (size_t)r * HD : p.part_acc + pi * HD) + 2 * qc +
                               wl * OPW * 8;
#pragma unroll
                    for (int nn = 0; nn < OPW; nn++)
                        *(float2 *)&o[nn * 8] = make_float2(acc[nn][2 * hf], acc[nn][2 * hf + 1]);
                    if (qc == 0 && wl == 0) {   /* the raw score max and the sum */
                        if (p.cluster)
                            ml_s[r] = make_float2(m[hf], lr);
                        else
                            *(float2 *)&p.part_ml[2 * pi] = make_float2(m[hf], lr);
                    }
                }
            } else if (active) {
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float lr = l[hf];   /* the row's 4 lanes each hold part of its sum */
                    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
                    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
                    const int r = wrow + g + 8 * hf;
                    if (hi[hf] <= lo[hf])   /* not in this pass, or nothing in this split */
                        continue;
                    const size_t t = t0 + r / hb;
                    const size_t pi = (t * p.n_heads + h0 + r % hb) * p.n_split + sp;
                    float *o = (p.cluster ? part_s + (size_t)r * HD : p.part_acc + pi * HD) + 2 * qc;
#pragma unroll
                    for (int n = 0; n < ND; n++)
                        *(float2 *)&o[n * 8] = make_float2(acc[n][2 * hf], acc[n][2 * hf + 1]);
                    if (qc == 0) {   /* the raw score max and the sum */
                        if (p.cluster)
                            ml_s[r] = make_float2(m[hf], lr);
                        else
                            *(float2 *)&p.part_ml[2 * pi] = make_float2(m[hf], lr);
                    }
                }
            }
        };
        for (int it = 0; jc != INT_MAX; it++) {
            const int st = it & 1;
            int jn, sn, kn;
            if (it == 0 && jpre != INT_MAX) {
                jn = jpre;   /* in stage 1 already */
                sn = spre;
                kn = kpre;
            } else {
                jn = next_pos(sc, jc + INV_BN, sn, kn);
                if (jn != INT_MAX)
                    load_tile(jn, st ^ 1, kn);
            }
            kern_cuda_cp_commit();
            kern_cuda_cp_wait<1>();   /* everything but the group just committed: tile jc is here */
            __syncthreads();
            if (coop) {
                /* an m-tile, CW warps: warp w of its group forms the scores of the original's
                 * n-tiles SPW w .. SPW w + SPW - 1 (4 warps: keys 16w..16w+15; 8 warps: 8w..8w+7),
                 * the row max and the P row sums are exchanged through shared memory, and warp w
                 * accumulates output n-tiles OPW w .. (4 warps: columns 32w..32w+31; 8 warps:
                 * 16w..16w+15) over all 64 keys. Every value is formed by the same operations in
                 * the same order as in one warp (below), so the bits are the same. */
                const __nv_bfloat16 *ks = k_s + st * INV_BN * HD, *vs = v_s + st * INV_BN * HD;
                float s[SPW][4];
#pragma unroll
                for (int n = 0; n < SPW; n++)
                    s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
                if constexpr (SPW == 1) {
                    score_one(ks, wl, s[0]);
                } else {
#pragma unroll
                    for (int np = 0; np < SPW / 2; np++)   /* n-tiles SPW wl + 2 np, + 1 */
                        score_pair(ks, SPW / 2 * wl + np, s[2 * np], s[2 * np + 1]);
                }
#pragma unroll
                for (int n = 0; n < SPW; n++)
                    mask_ntile(s[n], jc, SPW * wl + n);
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float pm = fmaxf(s[0][2 * hf], s[0][2 * hf + 1]);
#pragma unroll
                    for (int n = 1; n < SPW; n++)
                        pm = fmaxf(pm, fmaxf(s[n][2 * hf], s[n][2 * hf + 1]));
                    pm = fmaxf(pm, __shfl_xor_sync(0xffffffffu, pm, 1));
                    pm = fmaxf(pm, __shfl_xor_sync(0xffffffffu, pm, 2));
                    if (qc == 0)
                        cm_s[warp][g + 8 * hf] = pm;
                }
                __syncthreads();
                float al[2];
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float mx = m[hf];
#pragma unroll
                    for (int w = 0; w < CW; w++)
                        mx = fmaxf(mx, cm_s[gw * CW + w][g + 8 * hf]);
                    const float base = mx == -INFINITY ? 0.0f : mx * sl2;
                    al[hf] = mx == m[hf] ? 1.0f : tc_ex2(m[hf] * sl2 - base);
                    m[hf] = mx;
#pragma unroll
                    for (int n = 0; n < SPW; n++) {
                        s[n][2 * hf] = tc_ex2(fmaf(s[n][2 * hf], sl2, -base));
                        s[n][2 * hf + 1] = tc_ex2(fmaf(s[n][2 * hf + 1], sl2, -base));
                        ts_s[gw][SPW * wl + n][hf][lane] = s[n][2 * hf] + s[n][2 * hf + 1];
                    }
#pragma unroll
                    for (int nn = 0; nn < OPW; nn++) {
                        acc[nn][2 * hf] *= al[hf];
                        acc[nn][2 * hf + 1] *= al[hf];
                    }
                }
                /* each warp splits its own n-tiles of P into the hi + lo A-fragment words
                 * (split_p's operations, once instead of in every warp) */
#pragma unroll
                for (int n = 0; n < SPW; n++) {
                    unsigned h0, l0, h1, l1;
                    tc_split_bf16(s[n][0], s[n][1], h0, l0);
                    tc_split_bf16(s[n][2], s[n][3], h1, l1);
                    pv_s[gw][SPW * wl + n][0][lane] = h0;
                    pv_s[gw][SPW * wl + n][1][lane] = h1;
                    pv_s[gw][SPW * wl + n][2][lane] = l0;
                    pv_s[gw][SPW * wl + n][3][lane] = l1;
                }
                __syncthreads();
                if (wl == 0) {   /* the row sums: only each group's first warp's are written out (flush) */
#pragma unroll
                    for (int hf = 0; hf < 2; hf++) {
                        float ps = 0.0f;
#pragma unroll
                        for (int n = 0; n < NS; n++)
                            ps += ts_s[gw][n][hf][lane];
                        l[hf] = l[hf] * al[hf] + ps;
                    }
                }
#pragma unroll
                for (int kk = 0; kk < INV_BN / 16; kk++) {
                    const unsigned ah[4] = {pv_s[gw][2 * kk][0][lane], pv_s[gw][2 * kk][1][lane],
                                            pv_s[gw][2 * kk + 1][0][lane], pv_s[gw][2 * kk + 1][1][lane]};
                    const unsigned alo[4] = {pv_s[gw][2 * kk][2][lane], pv_s[gw][2 * kk][3][lane],
                                             pv_s[gw][2 * kk + 1][2][lane], pv_s[gw][2 * kk + 1][3][lane]};
#pragma unroll
                    for (int dq = 0; dq < OPW / 2; dq++)
                        pv_pair(vs, kk, ah, alo, wl * (OPW / 2) + dq, acc[2 * dq], acc[2 * dq + 1]);
                }
            } else if (active) {
                const __nv_bfloat16 *ks = k_s + st * INV_BN * HD, *vs = v_s + st * INV_BN * HD;
                float s[NS][4];
#pragma unroll
                for (int n = 0; n < NS; n++)
                    s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
                for (int np = 0; np < NS / 2; np++)
                    score_pair(ks, np, s[2 * np], s[2 * np + 1]);
#pragma unroll
                for (int n = 0; n < NS; n++)
                    mask_ntile(s[n], jc, n);
                /* online softmax in base 2 on raw scores, as in attn_tc_kernel */
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    float mx = m[hf];
#pragma unroll
                    for (int n = 0; n < NS; n++)
                        mx = fmaxf(mx, fmaxf(s[n][2 * hf], s[n][2 * hf + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float base = mx == -INFINITY ? 0.0f : mx * sl2;
                    /* an unchanged max rescales by exactly 1 (m * sl2 - base may contract to
                     * an FMA whose residue is not 0), so a tile with none of the row's keys
                     * leaves the row's state as it was, bit for bit */
                    const float al = mx == m[hf] ? 1.0f : tc_ex2(m[hf] * sl2 - base);
                    m[hf] = mx;
                    float ps = 0.0f;
#pragma unroll
                    for (int n = 0; n < NS; n++) {
                        s[n][2 * hf] = tc_ex2(fmaf(s[n][2 * hf], sl2, -base));
                        s[n][2 * hf + 1] = tc_ex2(fmaf(s[n][2 * hf + 1], sl2, -base));
                        ps += s[n][2 * hf] + s[n][2 * hf + 1];
                    }
                    l[hf] = l[hf] * al + ps;
#pragma unroll
                    for (int n = 0; n < ND; n++) {
                        acc[n][2 * hf] *= al;
                        acc[n][2 * hf + 1] *= al;
                    }
                }
                /* O += (P_hi + P_lo) V */
#pragma unroll
                for (int kk = 0; kk < INV_BN / 16; kk++) {
                    unsigned ah[4], alo[4];
                    split_p(s[2 * kk], s[2 * kk + 1], ah, alo);
#pragma unroll
                    for (int dp = 0; dp < ND / 2; dp++)
                        pv_pair(vs, kk, ah, alo, dp, acc[2 * dp], acc[2 * dp + 1]);
                }
            }
            __syncthreads();   /* the next iteration's load overwrites this stage */
            if (jn == INT_MAX || sn != sc) {   /* split sc done: its partials, a new state */
                flush(sc);
                reset();
                if (jn != INT_MAX)
                    frag_range(sn);
            }
            jc = jn;
            sc = sn;
            kc = kn;
        }
        __syncthreads();   /* every thread has read seq_s and cur_s for this pass */
        if (tid < INV_ROWS && seq_s[tid] == cur)
            seq_s[tid] = -1;
        __syncthreads();
    }

    /* a CTA with no rows never waited above, and must before it writes */
    kern_cuda_pdl_wait_prev();
    KT_WAITED;
    kern_cuda_cp_wait<0>();
    /* Merge. Counter mode: arrive; the last CTA of this column merges every item (the fences
     * make every CTA's partials visible before its arrival is counted, and the counted arrivals
     * before the reads). Cluster mode: the cluster barrier publishes each CTA's partials in its
     * shared memory; CTA s merges items s, s + n_split, ... reading every split's partials from
     * the other CTAs' shared memory, and a second barrier keeps them until all have read. The
     * arithmetic is the same either way. */
    const int last_split = p.n_split - 1;
    cg::cluster_group cl = cg::this_cluster();
    int first = tid, step = NT;
    if (p.cluster) {
        cl.sync();
        first = tid * p.n_split + sp0;   /* one split per CTA in a cluster */
        step = NT * p.n_split;
    } else {
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            unsigned prev = atomicAdd(&p.cnt[blockIdx.x], 1u);
            last_s = prev == gridDim.y - 1;
        }
        __syncthreads();
        if (!last_s) {
            KT_EMIT(30, p.out);
            return;
        }
        __threadfence();
    }
    KT_MARK(2);
    /* row r's 4 outputs at column 4 d4 (token t): num / den, rounded as the op rounds */
    auto store_out = [&](int r, size_t t, int d4, float4 num, float inv) {
        float *o = p.out + t * p.ld_out + (size_t)(h0 + r % hb) * HD + 4 * d4;   /* any ld_out */
        o[0] = kern_cuda_rnd(num.x * inv, p.rnd);
        o[1] = kern_cuda_rnd(num.y * inv, p.rnd);
        o[2] = kern_cuda_rnd(num.z * inv, p.rnd);
        o[3] = kern_cuda_rnd(num.w * inv, p.rnd);
    };
    /* num += w a: a split's weighted acc partial, as both merge forms add it */
    auto add_w = [&](float4 &num, float w, const float4 &a) {
        num.x = fmaf(w, a.x, num.x);
        num.y = fmaf(w, a.y, num.y);
        num.z = fmaf(w, a.z, num.z);
        num.w = fmaf(w, a.w, num.w);
    };
    /* Row r's (max, sum) of every split into v, its acc at [d4 * 4, d4 * 4 + 4) into a (token
     * t, clamped). Split s's address is this CTA's own mapped to cluster rank s, or the row's
     * first partial in the workspace plus s partials: formed once per row and item, so the
     * loads leave one after another (index arithmetic per split made each round of 16 loads
     * take ~2.5 us, H200 timeline 2026-12-04). */
    auto load_ml = [&](int r, size_t t, float2 (&v)[ATT_INV_SPLITS]) {
        if (p.cluster) {
            const float2 *lp = ml_s + r;
#pragma unroll
            for (int s = 0; s < ATT_INV_SPLITS; s++)
                v[s] = *cl.map_shared_rank(lp, min(s, last_split));
        } else {
            const float2 *gp = (const float2 *)p.part_ml + (t * p.n_heads + h0 + r % hb) * p.n_split;
#pragma unroll
            for (int s = 0; s < ATT_INV_SPLITS; s++)
                v[s] = __ldcg(gp + min(s, last_split));
        }
    };
    auto load_acc = [&](int r, size_t t, int d4, float4 (&a)[ATT_INV_SPLITS]) {
        if (p.cluster) {
            const float4 *lp = (const float4 *)(part_s + (size_t)r * HD) + d4;
#pragma unroll
            for (int s = 0; s < ATT_INV_SPLITS; s++)
                a[s] = *cl.map_shared_rank(lp, min(s, last_split));
        } else {
            const float4 *gp = (const float4 *)(p.part_acc + (t * p.n_heads + h0 + r % hb) * p.n_split * HD) + d4;
#pragma unroll
            for (int s = 0; s < ATT_INV_SPLITS; s++)
                a[s] = __ldcg(gp + (size_t)min(s, last_split) * (HD / 4));
        }
    };
    /* Row r's splits merged: out = sum over its splits in order of w_s acc_s, times 1 / den,
     * with w_s = 2^((max_s - max) scale) and den = sum of w_s sum_s. Split indices are clamped
     * into the launched range (in bounds; values past a row's own splits are never used), so
     * every load of a round is in flight at once. */
    const int n_items = n_rows * D4;
    /* the splits row r uses (0 past the launch's tokens), and the largest max among them */
    auto row_splits = [&](int r) -> int {
        const size_t t = t0 + r / hb;
        const int len = len_s[r];
        if (t >= (size_t)p.n_tok || len <= 0)
            return 0;
        const int ch = attn_inv_chunk(len, ATT_INV_SPLITS);
        return (len + ch - 1) / ch;
    };
    auto split_max = [&](const float2 (&v)[ATT_INV_SPLITS], int ns) -> float {
        float mx = -INFINITY;
#pragma unroll
        for (int s = 0; s < ATT_INV_SPLITS; s++)
            if (s < ns)
                mx = fmaxf(mx, v[s].x);
        return mx;
    };
    if (p.cluster) {
        /* a few items per thread: an item loads its row's (max, sum) of every split together
         * with its acc partials (one round trip) and forms w and den itself, the same
         * arithmetic as the per-row pass below */
        if (tid < n_rows)
            ns_s[tid] = row_splits(tid);
        __syncthreads();
        KT_MARK(0);
        for (int i = first; i < n_items; i += step) {
            const int r = i / D4, d4 = i % D4;
            const size_t tr = t0 + r / hb;
            const size_t t = tr < (size_t)p.n_tok ? tr : 0;
            float2 v[ATT_INV_SPLITS];
            float4 a[ATT_INV_SPLITS];
            load_ml(r, t, v);
            load_acc(r, t, d4, a);
            if (tr >= (size_t)p.n_tok)
                continue;
            const int ns = ns_s[r];
            const float mx = split_max(v, ns);
            float den = 0.0f;
            float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int s = 0; s < ATT_INV_SPLITS; s++) {
                if (s < ns) {
                    const float w = tc_ex2((v[s].x - mx) * sl2);
                    den += w * v[s].y;
                    add_w(num, w, a[s]);
                }
            }
            store_out(r, t, d4, num, den > 0.0f ? 1.0f / den : 0.0f);
        }
    } else {
        /* the last CTA of a column merges every item: w and 1 / den once per row into shared
         * memory, then two items per thread at a time keep 32 acc loads in flight */
        if (tid < n_rows) {
            const size_t tr = t0 + tid / hb;
            const int ns = row_splits(tid);
            float2 v[ATT_INV_SPLITS];
            load_ml(tid, tr < (size_t)p.n_tok ? tr : 0, v);
            const float mx = split_max(v, ns);
            float den = 0.0f;
#pragma unroll
            for (int s = 0; s < ATT_INV_SPLITS; s++) {
                if (s < ns) {
                    const float w = tc_ex2((v[s].x - mx) * sl2);
                    w_s[tid][s] = w;
                    den += w * v[s].y;
                }
            }
            ns_s[tid] = ns;
            inv_s[tid] = den > 0.0f ? 1.0f / den : 0.0f;
        }
        __syncthreads();
        KT_MARK(0);
        auto merge_item = [&](int i, const float4 (&a)[ATT_INV_SPLITS]) {
            const int r = i / D4, d4 = i % D4;
            const size_t t = t0 + r / hb;
            if (t >= (size_t)p.n_tok)
                return;
            const int ns = ns_s[r];
            float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (int s = 0; s < ATT_INV_SPLITS; s++) {
                if (s < ns)
                    add_w(num, w_s[r][s], a[s]);
            }
            store_out(r, t, d4, num, inv_s[r]);
        };
        auto item_t = [&](int i) {
            const size_t t = t0 + (i / D4) / hb;
            return t < (size_t)p.n_tok ? t : (size_t)0;
        };
        if constexpr (NW == 8) {   /* twice the threads: one item each holds as many loads */
            for (int i = first; i < n_items; i += step) {
                float4 a0[ATT_INV_SPLITS];
                load_acc(i / D4, item_t(i), i % D4, a0);
                merge_item(i, a0);
            }
        } else {
            for (int i = first; i < n_items; i += 2 * step) {
                float4 a0[ATT_INV_SPLITS], a1[ATT_INV_SPLITS];
                const int i1 = i + step;
                load_acc(i / D4, item_t(i), i % D4, a0);
                if (i1 < n_items)
                    load_acc(i1 / D4, item_t(i1), i1 % D4, a1);
                merge_item(i, a0);
                if (i1 < n_items)
                    merge_item(i1, a1);
            }
        }
    }
    KT_MARK(1);
    if (p.cluster)
        cl.sync();   /* the other CTAs may still read this one's partials */
    else if (tid == 0)
        p.cnt[blockIdx.x] = 0u;   /* ready for the next launch (and graph replay) */
    KT_EMIT(p.cluster ? 32 : 31, p.out);
}

KT_TU_SETTER(attn)

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

/* Launches the tensor-core kernel (bf16 cache) and, with n_split > 1, the merge of partials.
 * Tiles: 128 rows (MT 2) compute and load 32-key tiles: the second m-tile's accumulators need
 * the registers that 64-key scores would take (ptxas spills otherwise); 64 rows (MT 1) take
 * 64-key tiles. (64-row tiles of 32 keys at three CTAs per SM ran the 8k prefill at 186-187 ms
 * against 173-174 ms for 128-row tiles, H200 2026-12-03 21:49 UTC.) */
template <int HD, int MT>
static pd_status attn_tc_run(kern_cuda_ctx *c, attn_params *p, pd_err *err)
{
    constexpr int BN = MT == 2 ? TC_BN / 2 : TC_BN;
    const int bm = TC_WARPS * 16 * MT;
    const size_t smem = (size_t)(bm + 4 * BN) * HD * sizeof(__nv_bfloat16);
    void (*kern)(attn_params) = attn_tc_kernel<HD, MT, BN>;
    /* set on every launch: the attribute belongs to the current device, and several backends
     * of one process may sit on different devices (a host call, not a stream operation) */
    PD_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), err);
    unsigned n_tiles = (unsigned)((p->n_tok + bm - 1) / bm);
    dim3 grid((unsigned)p->n_heads, n_tiles, (unsigned)p->n_split);
    kern<<<grid, TC_THREADS, smem, c->stream>>>(*p);
    KERN_CUDA_LAUNCH_CHECK(err);
    if (p->n_split > 1) {
        attn_combine_kernel<<<(unsigned)((size_t)p->n_tok * p->n_heads), HD,
                              (size_t)ATT_SPLIT_PAD(p->n_split) * sizeof(float),
                              c->stream>>>(*p, HD);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    return PD_OK;
}

/* Sizes the TC kernel's key split (partials in the workspace) and launches it. */
static pd_status attn_tc_launch(kern_cuda_ctx *c, attn_params *p, int hd, int n_seq, pd_err *err)
{
    /* 128-row tiles when sequences are long enough to fill them and the grid still gives two
     * CTAs per SM without a key split; 64 rows otherwise, so a tile of short blocks (verify,
     * draft) makes fewer per-sequence passes and a mid-size chunk fills the GPU unsplit
     * (H200, 1k-token causal chunk x 32 heads: 128 rows + 2 splits 72 TFLOP/s, 64 rows 119) */
    int mt = 1;
    if (p->n_tok >= TC_MT2_MIN_Q_PER_SEQ * n_seq &&
        (size_t)((p->n_tok + 127) / 128) * p->n_heads >= (size_t)c->n_sm * 2)
        mt = 2;
    const int bm = TC_WARPS * 16 * mt;
    /* two CTAs fit on an SM: split the keys when the tiles alone give fewer than that, keeping
     * at least TC_MIN_SPLIT_KEYS keys per chunk */
    size_t ctas = (size_t)((p->n_tok + bm - 1) / bm) * p->n_heads;
    int max_len = p->max_kv_len > 0 ? p->max_kv_len : 1;
    int n_split = 1;
    if (ctas < (size_t)c->n_sm * 2) {
        int want = (int)(((size_t)c->n_sm * 2 + ctas - 1) / ctas);
        int by_len = (max_len + TC_MIN_SPLIT_KEYS - 1) / TC_MIN_SPLIT_KEYS;
        n_split = want < by_len ? want : by_len;
        n_split = n_split > ATT_MAX_SPLIT ? ATT_MAX_SPLIT : (n_split < 1 ? 1 : n_split);
    }
    int chunk = (max_len + n_split - 1) / n_split;
    chunk = (chunk + TC_BN - 1) / TC_BN * TC_BN;
    p->n_split = (max_len + chunk - 1) / chunk;
    p->chunk = chunk;
    if (p->n_split > 1) {
        size_t n_part = (size_t)p->n_tok * p->n_heads * p->n_split;
        void *ws = NULL;
        pd_status st = kern_cuda_ws_get(c, n_part * ((size_t)hd + 2) * sizeof(float), &ws, err);
        if (st != PD_OK)
            return st;
        p->part_acc = (float *)ws;
        p->part_ml = p->part_acc + n_part * hd;
    }
    if (mt == 2)
        return hd == 64 ? attn_tc_run<64, 2>(c, p, err) : attn_tc_run<128, 2>(c, p, err);
    return hd == 64 ? attn_tc_run<64, 1>(c, p, err) : attn_tc_run<128, 1>(c, p, err);
}

/* Batch-invariant rounds on a bf16 cache: sizes and launches attn_inv_kernel. The grouping of
 * tokens into CTAs (QG) and the number of splits launched follow the batch, but no row's
 * arithmetic does (see the kernel's comment). */
static pd_status attn_inv_launch(kern_cuda_ctx *c, attn_params *p, int hd, int n_seq, pd_err *err)
{
    /* query heads per CTA: the whole GQA group when it fits in the 64 rows */
    p->hb = p->group;
    while (p->hb > INV_ROWS || p->group % p->hb != 0)
        p->hb--;
    p->n_hchunk = p->group / p->hb;
    const int max_len = p->max_kv_len > 0 ? p->max_kv_len : 1;
    /* every split any row can use: a row of len keys uses ceil(len / chunk) <= ceil(len / 64) */
    int n_split = (max_len + ATT_INV_MIN_CHUNK - 1) / ATT_INV_MIN_CHUNK;
    p->n_split = n_split > ATT_INV_SPLITS ? ATT_INV_SPLITS : n_split;
    /* fewer CTAs than this leave SMs idle (the key-split rule below) */
    const size_t min_ctas = (size_t)c->n_sm * 3 / 2;
    /* tokens per CTA: a sequence's queries (verify/draft blocks are consecutive tokens) */
    int qps = (p->n_tok + n_seq - 1) / n_seq;
    int qg_max = INV_ROWS / p->hb;
    /* blocks of few tokens per sequence (verify, draft) in a small grid: as many tokens as fill
     * one m-tile of rows, so that all four warps share it (coop) instead of one warp per
     * m-tile (H200, verify 8 at GQA 4: 3.44 against 3.72 ms with 8 tokens, 32 rows, per CTA).
     * Where whole blocks per CTA already give min_ctas CTAs, the keys are read once per block
     * instead (H100, verify blocks of 8 at 1k keys, 8 / 16 / 64 sequences: 44.6 / 74.6 / 261.8
     * against 49.9 / 91.8 / 340.0 us). A row's arithmetic does not depend on its CTA, so the
     * bits are the same either way. */
    if (c->attn_one_tile && qps <= ATT_ONE_TILE_QPS) {
        const int qg_whole = qps < 1 ? 1 : (qps < qg_max ? qps : qg_max);
        const size_t whole = (size_t)p->n_kv * p->n_hchunk * (((size_t)p->n_tok + qg_whole - 1) / qg_whole) *
                             (size_t)p->n_split;
        const int one = 16 / p->hb;
        if (whole < min_ctas)
            qg_max = min(qg_max, one < 1 ? 1 : one);
    }
    p->qg = qps < 1 ? 1 : (qps > qg_max ? qg_max : qps);
    p->chunk = 0;
    p->inv_splits = ATT_INV_SPLITS;
    size_t n_part = (size_t)p->n_tok * p->n_heads * p->n_split;
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, n_part * ((size_t)hd + 2) * sizeof(float), &ws, err);
    if (st != PD_OK)
        return st;
    p->part_acc = (float *)ws;
    p->part_ml = p->part_acc + n_part * hd;

    const int rows_pad = (p->qg * p->hb + 15) / 16 * 16;
    const size_t smem_base = ((size_t)4 * INV_BN + 2 * rows_pad) * hd * sizeof(__nv_bfloat16);
    /* the shared-memory limit belongs to a device: raised to the largest CTA once per context
     * (a context is one device), not per launch, to keep the host cost of a call small */
    if (!c->attn_inv_smem_set) {
        void (*const kerns[4])(attn_params) = {attn_inv_kernel<64, 4, 4>, attn_inv_kernel<128, 4, 4>,
                                               attn_inv_kernel<128, 8, 8>, attn_inv_kernel<128, 4, 2>};
        for (int k = 0; k < 4; k++) {
            const size_t rows = k == 2 ? 16 : (k == 3 ? 32 : INV_ROWS), d = k == 0 ? 64 : 128;
            PD_CUDA_TRY(cudaFuncSetAttribute(kerns[k], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)(((size_t)4 * INV_BN + 2 * rows) * d * sizeof(__nv_bfloat16) +
                                                   rows * (d + 2) * sizeof(float))),
                        err);
            /* clusters of up to ATT_INV_SPLITS CTAs (16: beyond the portable 8) */
            PD_CUDA_TRY(cudaFuncSetAttribute(kerns[k], cudaFuncAttributeNonPortableClusterSizeAllowed, 1), err);
        }
        c->attn_inv_smem_set = 1;
    }
    /* a CTA of one m-tile of rows (decode: a sequence's GQA group) shared by all its warps
     * (coop) takes eight warps at head_dim 128: each forms one score n-tile and two output
     * n-tiles, so the kernel needs fewer registers a thread and an SM holds twice the warps
     * (same operations per value, same bits; PD_ATTN_WARPS=4 keeps four). A CTA of two
     * m-tiles (verify blocks of 8 at GQA 4 in large grids) has its four warps in two pairs, a
     * pair per m-tile, instead of two warps working and two only loading (PD_ATTN_COOP2=0
     * keeps the latter). */
    const int n_rows = p->qg * p->hb;
    const int nw = hd == 128 && c->attn_coop && c->attn_warps == 8 && n_rows <= 16 ? 8 : 4;
    const int coop2 = hd == 128 && c->attn_coop && c->attn_coop2 && n_rows > 16 && n_rows <= 32;
    void (*kern)(attn_params) = hd == 64 ? attn_inv_kernel<64, 4, 4>
                                : nw == 8 ? attn_inv_kernel<128, 8, 8>
                                : coop2 ? attn_inv_kernel<128, 4, 2> : attn_inv_kernel<128, 4, 4>;
    /* the splits of a CTA column as one cluster, merged on chip (the merge of many rows then
     * spreads over the column's CTAs instead of running in its last one), where the device can
     * hold such a cluster (asked once per split count and row bucket) and the whole grid is
     * one CTA per SM at most: clusters of a larger grid wait for whole free groups of SMs
     * (H200, batch 8 decode: 5.75 ms against 4.41) */
    const size_t smem_cl = smem_base + (size_t)rows_pad * (hd + 2) * sizeof(float);
    const size_t n_col = (size_t)p->n_kv * p->n_hchunk * (((size_t)p->n_tok + p->qg - 1) / p->qg);
    p->cluster = 0;
    if (c->attn_cluster && p->n_split <= ATT_INV_SPLITS && n_col * p->n_split <= (size_t)c->n_sm) {
        signed char *ok = &c->attn_cluster_ok[hd == 64][p->n_split][rows_pad / 16];
        if (*ok == 0) {
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeClusterDimension;
            at[0].val.clusterDim.x = 1;
            at[0].val.clusterDim.y = (unsigned)p->n_split;
            at[0].val.clusterDim.z = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3(1, (unsigned)p->n_split);
            cfg.blockDim = dim3((unsigned)(32 * nw));
            cfg.dynamicSmemBytes = smem_cl;
            cfg.attrs = at;
            cfg.numAttrs = 1;
            int n_cl = 0;
            cudaError_t e = cudaOccupancyMaxActiveClusters(&n_cl, kern, &cfg);
            *ok = e == cudaSuccess && n_cl > 0 ? 1 : -1;
            (void)cudaGetLastError();   /* a refusal is an answer, not an error */
        }
        p->cluster = *ok > 0;
    }
    p->coop = c->attn_coop;
    p->kv_ef = c->attn_kv_ef;
    const size_t smem = p->cluster ? smem_cl : smem_base;
    /* Key splits per CTA. A large grid of one split per CTA (decode of 64 sequences at 1k keys:
     * 8192 CTAs of 2 key tiles each, ~30 waves) pays every CTA's start, row set-up and arrival
     * for little streaming, and its wait for the first tiles is not overlapped; a CTA that takes
     * spc splits in turn keeps its tile pipeline running across them (each split its own state
     * and partial, so the same bits). spc is the largest power of two that leaves at least 1.5
     * CTAs per SM (H100, 8-64 sequences: the fastest of 1..16 within 2 %; fewer CTAs leave SMs
     * idle); PD_ATTN_SPC forces it. */
    p->spc = 1;
    if (!p->cluster) {
        if (c->attn_spc > 0)
            p->spc = c->attn_spc;
        else
            while (p->spc < p->n_split &&
                   n_col * (size_t)((p->n_split + 2 * p->spc - 1) / (2 * p->spc)) >= min_ctas)
                p->spc *= 2;
    }
    const int n_y = (p->n_split + p->spc - 1) / p->spc;
    /* one arrival counter per CTA column; launches cover at most KERN_CUDA_ATTN_COUNTERS */
    const size_t cols_per_grp = (size_t)p->n_kv * p->n_hchunk;
    const size_t n_grp = ((size_t)p->n_tok + p->qg - 1) / p->qg;
    const size_t grp_per_launch = KERN_CUDA_ATTN_COUNTERS / cols_per_grp;
    if (grp_per_launch == 0)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda attn: %zu kv head columns", cols_per_grp);
    p->cnt = c->attn_cnt;
    for (size_t g0 = 0; g0 < n_grp; g0 += grp_per_launch) {
        size_t ng = n_grp - g0 < grp_per_launch ? n_grp - g0 : grp_per_launch;
        p->grp0 = (int)g0;
        dim3 grid((unsigned)(ng * cols_per_grp), (unsigned)n_y);
        /* n_new > 0: a programmatic dependent launch (row setup and the first key tiles while
         * the previous kernel runs); the kernel never triggers its own dependents early, so the
         * next kernel starts when it ends */
        cudaLaunchAttribute at[2];
        cudaLaunchConfig_t cfg = kern_cuda_pdl_cfg(c->stream, grid, dim3((unsigned)(32 * nw)), smem, p->n_new > 0, &at[0]);
        if (p->cluster) {
            at[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
            at[cfg.numAttrs].val.clusterDim.x = 1;
            at[cfg.numAttrs].val.clusterDim.y = (unsigned)p->n_split;
            at[cfg.numAttrs].val.clusterDim.z = 1;
            cfg.numAttrs++;
        }
        PD_CUDA_TRY(cudaLaunchKernelEx(&cfg, kern, *p), err);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    return PD_OK;
}

/* The batch goes to attn_tc_kernel (see kern_cuda_attn_launch) */
static int tc_route(const kern_backend *be, const kern_attn_args *a)
{
    int n_seq = a->n_seq > 0 ? a->n_seq : 1;
    return !be->batch_invariant && a->kv.dtype == KERN_DTYPE_BF16 &&
           (a->kv.head_dim == 64 || a->kv.head_dim == 128) && a->n_tok >= TC_MIN_Q_PER_SEQ * n_seq;
}

extern "C" int kern_cuda_attn_bf16_fits(const kern_backend *be, const kern_attn_args *a)
{
    return tc_route(be, a) && a->ld_q % 8 == 0 && a->ld_out % 2 == 0;
}

/* qb, outb: NULL, or (tc_route only) q read from / the output written to bf16 rows; n_new > 0:
 * the previous kernel stores this round's keys, at most n_new per sequence, the last positions
 * of each (the batch-invariant kernel then starts early, attn_params.n_new) */
static pd_status attn_launch(kern_backend *be, const kern_attn_args *a, const __nv_bfloat16 *qb,
                             __nv_bfloat16 *outb, int n_new, pd_err *err)
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
    p.inv_splits = 0;
    p.qg = 1;
    p.grp0 = 0;
    p.cnt = NULL;
    p.kv_ef = 0;
    p.n_new = n_new;
    p.cluster = 0;
    p.kc = kv->k;
    p.vc = kv->v;
    p.q = a->q;
    p.out = a->out;
    p.qb = qb;
    p.outb = outb;
    p.rnd = be->act_bf16;
    p.tok_seq = a->tok_seq;
    p.tok_kv_len = a->tok_kv_len;
    p.page_table = a->page_table;
    p.part_acc = NULL;
    p.part_ml = NULL;
    p.n_tok = a->n_tok;
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
    p.ps_shift = -1;
    for (int sh = 0; sh < 31; sh++)
        if (p.page_size == 1 << sh)
            p.ps_shift = sh;
    p.pt_stride = a->pt_stride;
    p.max_kv_len = a->max_kv_len;
    p.scale = a->scale;

    /* prefill-like batches (several queries per sequence on average) go to the tensor cores;
     * decode-like ones and batch-invariant rounds keep the CUDA-core kernel below, whose fixed
     * splits make a query's bits independent of its batch */
    int n_seq = a->n_seq > 0 ? a->n_seq : 1;
    if ((qb != NULL || outb != NULL) &&
        (!kern_cuda_attn_bf16_fits(be, a) || (uintptr_t)qb % 16 != 0 || (uintptr_t)outb % 4 != 0))
        return pd_err_set(err, PD_ERR_INVALID, "cuda attn: bf16 q/out off the tensor-core path");
    if (be->batch_invariant && kv->dtype == KERN_DTYPE_BF16)
        return attn_inv_launch(c, &p, hd, n_seq, err);
    if (tc_route(be, a))
        return attn_tc_launch(c, &p, hd, n_seq, err);

    /* split the key range when the queries alone fill fewer than ~4 blocks per SM; aim for
     * ~8 resident blocks per SM so that the tile loads of some hide the latency of others */
    size_t base_blocks = (size_t)a->n_tok * p.n_kv * p.n_hchunk;
    int max_len = a->max_kv_len > 0 ? a->max_kv_len : 1;
    int n_split = 1;
    if (be->batch_invariant) {
        /* every query's keys in ATT_INV_SPLITS chunks sized from its own length (attn_inv_chunk):
         * a token's partials and their merge are then the same in a decode step and in a
         * verify block (a split past a token's length contributes exact zeros; one non-empty
         * split merges to the unsplit result bit for bit), and a batch of one still spreads
         * over ~n_kv * 16 blocks */
        n_split = max_len > ATT_INV_MIN_CHUNK ? ATT_INV_SPLITS : 1;
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
    if (be->batch_invariant && n_split > 1) {
        p.inv_splits = n_split;   /* the kernel sizes each query's chunk itself */
        chunk = max_len;          /* (unused) */
    } else {
        n_split = (max_len + chunk - 1) / chunk;
    }
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

extern "C" pd_status kern_cuda_attn_launch(kern_backend *be, const kern_attn_args *a, pd_err *err)
{
    return attn_launch(be, a, NULL, NULL, 0, err);
}

extern "C" pd_status kern_cuda_attn_launch_after_store(kern_backend *be, const kern_attn_args *a, int n_new,
                                                       pd_err *err)
{
    return attn_launch(be, a, NULL, NULL, n_new, err);
}

extern "C" pd_status kern_cuda_attn_launch_bf16(kern_backend *be, const kern_attn_args *a,
                                                const __nv_bfloat16 *q, __nv_bfloat16 *out, pd_err *err)
{
    return attn_launch(be, a, q, out, 0, err);
}
