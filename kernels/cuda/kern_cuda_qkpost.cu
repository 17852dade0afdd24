/* kern_cuda_qkpost.cu - Qwen3 q/k post-processing of a QKV projection in one launch.
 * Owns: kern_cuda_qk_post_launch, kern_cuda_qk_post_launch_pdl (the same as a programmatic
 *   dependent launch that forms its angles before it waits for the projection),
 *   kern_cuda_qk_post_from (the second half of the fused qkv op: q/k/v read from bf16
 *   products). Block (token, group of heads), a warp per head of the concatenated list
 *   [q heads, k heads] at a time: the lane holds the rotate-half pairs (i, i + hd/2) for
 *   i = lane, lane + 32, ...; sum of squares over the head in fp32 (fixed
 *   order: lane partials, then a butterfly), x = w * (x * inv), RoPE with the angle formed as
 *   kern_cuda_rope.cu forms it (kern_rope_cs), written back in place;
 *   a k-head warp also stores its k and v head into the paged cache at slot[t] (negative slot:
 *   skipped). Each token is processed on its own, so the op is batch-invariant.
 * Not here: shape checks (kern_ops.c); the unfused ops (kern_cuda_norm.cu, kern_cuda_rope.cu).
 * Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#define QK_WARPS 8
#define QK_MAX_PAIRS 8          /* head_dim up to 2 * 32 * 8 = 512 */
#define QK_WIDE_MIN_TOK 64      /* from this many tokens a block takes every head of its token */

/* Where the kernel reads q, k and v: in place (T = float, the op's own q/k/v) or the bf16
 * products of the fused qkv op (kern_cuda_qk_post_from); where it writes them besides the
 * cache: q to a.q or, q_out set, to q_out in bf16 (row stride a.ld_q); k to a.k when k_rows;
 * v to v_out (fp32, row stride a.ld_kv) when set */
template <typename T>
struct qk_src {
    const T *q, *k, *v;
    int ld_q, ld_kv;
    __nv_bfloat16 *q_out;
    int k_rows;
    float *v_out;
};

static __device__ __forceinline__ float qk_ld(const float *p) { return *p; }
static __device__ __forceinline__ float qk_ld(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

/* The rotate-half pairs (i, i + half) of one head for i = lane + 32 j, zero past half */
template <int NP, typename T>
static __device__ __forceinline__ void load_head(const T *x, int n_half, int lane, float *x1, float *x2)
{
#pragma unroll
    for (int j = 0; j < NP; j++) {
        int i = lane + 32 * j;
        x1[j] = i < n_half ? qk_ld(x + i) : 0.0f;
        x2[j] = i < n_half ? qk_ld(x + i + n_half) : 0.0f;
    }
}

/* The RoPE angles of token t, pairs 0..hd/2-1, into cs/sn (shared memory) by the whole block,
 * formed as kern_cuda_rope.cu forms them; the block's barrier publishes them */
static __device__ __forceinline__ void rope_angles(const kern_qk_post_args &a, size_t t, int hd,
                                                   float *cs, float *sn)
{
    for (int i = threadIdx.x; i < hd / 2; i += blockDim.x)
        kern_rope_cs(a.pos[t], a.theta, &a.scaling, i, hd, &cs[i], &sn[i]);
    __syncthreads();
}

/* Block (token, group of heads_per_block heads); its warps walk the group's heads, each loading
 * its next head while it finishes the current one. The RoPE angles of the token are formed once
 * per block into shared memory, after the first loads are issued: they depend on the position
 * and the pair only, and each costs a double pow and sincos (forming them per head made this op
 * ~5x its bytes at an 8k prefill). Launch bounds: 4 blocks per SM leave 64 registers (at 6,
 * head_dim 128 spilled 16 bytes; H200 2026-12-04: the same step time either way, within 0.4 %). */
template <int NP, typename T>   /* pairs per lane: head_dim <= 64 NP */
__global__ void __launch_bounds__(QK_WARPS * 32, 4)
qk_post_kernel(kern_qk_post_args a, qk_src<T> src, int heads_per_block, int rnd, int pdl)
{
    KT_DECL;
    __shared__ float cs_s[QK_MAX_PAIRS * 32], sn_s[QK_MAX_PAIRS * 32];
    const int lane = threadIdx.x & 31;
    const size_t t = blockIdx.x;
    const int hd = a.head_dim, half = hd / 2;
    const int h_end = min(a.n_heads + a.n_kv_heads, (int)(blockIdx.y + 1) * heads_per_block);
    auto head_ptr = [&](int head) -> float * {
        return head >= a.n_heads ? a.k + t * a.ld_kv + (size_t)(head - a.n_heads) * hd
                                 : a.q + t * a.ld_q + (size_t)head * hd;
    };
    auto head_src = [&](int head) -> const T * {
        return head >= a.n_heads ? src.k + t * src.ld_kv + (size_t)(head - a.n_heads) * hd
                                 : src.q + t * src.ld_q + (size_t)head * hd;
    };
    int head = blockIdx.y * heads_per_block + (threadIdx.x >> 5);
    float x1[NP], x2[NP];
    /* a head's norm weights, pairs as load_head's (constant data: a programmatic dependent
     * launch loads its first head's before it waits, so they are no DRAM trip after it) */
    float g1[NP], g2[NP];
    auto load_norm = [&](int hh) {
        const kern_weight *nw = hh >= a.n_heads ? &a.k_norm : &a.q_norm;
#pragma unroll
        for (int j = 0; j < NP; j++) {
            int i = lane + 32 * j;
            g1[j] = i < half ? kern_cuda_ld(nw->data, nw->dtype, i) : 0.0f;
            g2[j] = i < half ? kern_cuda_ld(nw->data, nw->dtype, i + half) : 0.0f;
        }
    };
    if (pdl) {
        /* a programmatic dependent launch: let the next kernel (the attention) start, load the
         * first head's norm weights and form the angles (positions are host data) while the
         * projection still runs, then wait for it */
        kern_cuda_pdl_launch_next();
        if (head < h_end)
            load_norm(head);
        rope_angles(a, t, hd, cs_s, sn_s);
        kern_cuda_pdl_wait_prev();
        KT_WAITED;
    }
    if (head < h_end)
        load_head<NP>(head_src(head), half, lane, x1, x2);
    if (!pdl)
        rope_angles(a, t, hd, cs_s, sn_s);
    const int32_t slot = a.kv.k != NULL ? a.slot[t] : -1;
    const size_t row = (size_t)a.n_kv_heads * hd;
    for (bool first = true; head < h_end; head += QK_WARPS, first = false) {
        const int is_k = head >= a.n_heads;
        const int h = is_k ? head - a.n_heads : head;
        float *x = head_ptr(head);
        if (!(first && pdl))
            load_norm(head);
        /* a k head's v, loaded with its x rather than after the arithmetic */
        const int need_v = is_k && (slot >= 0 || src.v_out != NULL);
        float v1[NP], v2[NP];
        if (need_v) {
            const T *v = src.v + t * src.ld_kv + (size_t)h * hd;
#pragma unroll
            for (int j = 0; j < NP; j++) {
                int i = lane + 32 * j;
                v1[j] = i < half ? qk_ld(v + i) : 0.0f;
                v2[j] = i < half ? qk_ld(v + i + half) : 0.0f;
            }
        }
        float y1[NP], y2[NP];
#pragma unroll
        for (int j = 0; j < NP; j++) {
            y1[j] = x1[j];
            y2[j] = x2[j];
        }
        if (head + QK_WARPS < h_end)
            load_head<NP>(head_src(head + QK_WARPS), half, lane, x1, x2);
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < NP; j++)
            ss += y1[j] * y1[j] + y2[j] * y2[j];
        ss = kern_cuda_warp_sum(ss);
        const float inv = rsqrtf(ss / (float)hd + a.eps);
#pragma unroll
        for (int j = 0; j < NP; j++) {
            int i = lane + 32 * j;
            if (i >= half)
                break;
            float u1 = kern_cuda_rnd(g1[j] * kern_cuda_rnd(y1[j] * inv, rnd), rnd);
            float u2 = kern_cuda_rnd(g2[j] * kern_cuda_rnd(y2[j] * inv, rnd), rnd);
            float r1, r2;
            kern_cuda_rope_pair(u1, u2, cs_s[i], sn_s[i], rnd, &r1, &r2);
            if (!is_k && src.q_out != NULL) {
                __nv_bfloat16 *qo = src.q_out + t * a.ld_q + (size_t)h * hd;
                qo[i] = __float2bfloat16_rn(r1);
                qo[i + half] = __float2bfloat16_rn(r2);
            } else if (!is_k || src.k_rows) {
                x[i] = r1;
                x[i + half] = r2;
            }
            if (need_v) {
                if (slot >= 0) {
                    size_t base = (size_t)slot * row + (size_t)h * hd;
                    kern_cuda_st(a.kv.k, a.kv.dtype, base + i, r1);
                    kern_cuda_st(a.kv.k, a.kv.dtype, base + i + half, r2);
                    kern_cuda_st(a.kv.v, a.kv.dtype, base + i, v1[j]);
                    kern_cuda_st(a.kv.v, a.kv.dtype, base + i + half, v2[j]);
                }
                if (src.v_out != NULL) {
                    float *vo = src.v_out + t * a.ld_kv + (size_t)h * hd;
                    vo[i] = v1[j];
                    vo[i + half] = v2[j];
                }
            }
        }
    }
    KT_EMIT(20, a.q);
}

KT_TU_SETTER(qkpost)

/* the 4 bf16 of u as floats (a bf16 is the high half of its float) */
static __device__ __forceinline__ void unpack4(uint2 u, float *f)
{
    f[0] = __uint_as_float(u.x << 16);
    f[1] = __uint_as_float(u.x & 0xffff0000u);
    f[2] = __uint_as_float(u.y << 16);
    f[3] = __uint_as_float(u.y & 0xffff0000u);
}

/* The bf16-products form for head_dim HD (64 or 128), 8-byte rows: LPH = HD / 8 lanes per head,
 * each holding 4 rotate-half pairs (elements i0..i0+3 and i0+half..i0+half+3, i0 = 4 (lane %
 * LPH)) loaded and stored 8 bytes at a time, so a warp takes 32 / LPH heads at once and keeps
 * the next ones in flight while it finishes these (the per-head form above holds a quarter of
 * the bytes in flight per warp and ran an 8k prefill at about half the copy rate). The same
 * arithmetic per element; the sum of squares in its own fixed order (lane partials of 8, then a
 * butterfly over the head's lanes). */
template <int HD>
__global__ void __launch_bounds__(QK_WARPS * 32, 6)
qk_post_vec_kernel(kern_qk_post_args a, qk_src<__nv_bfloat16> src, int heads_per_block, int rnd)
{
    constexpr int HALF = HD / 2, LPH = HD / 8, HPW = 32 / LPH;
    __shared__ float cs_s[HALF], sn_s[HALF];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane / LPH, i0 = 4 * (lane % LPH);
    const size_t t = blockIdx.x;
    const int h_first = blockIdx.y * heads_per_block;
    const int h_end = min(a.n_heads + a.n_kv_heads, h_first + heads_per_block);
    auto head_src = [&](int head) -> const __nv_bfloat16 * {
        return head >= a.n_heads ? src.k + t * src.ld_kv + (size_t)(head - a.n_heads) * HD
                                 : src.q + t * src.ld_q + (size_t)head * HD;
    };
    uint2 n1 = make_uint2(0u, 0u), n2 = n1;   /* the next heads' raw bf16 */
    auto load = [&](int head) {
        if (head < h_end) {
            const __nv_bfloat16 *x = head_src(head);
            n1 = *(const uint2 *)(x + i0);
            n2 = *(const uint2 *)(x + i0 + HALF);
        }
    };
    int base = h_first + warp * HPW;
    load(base + sub);
    rope_angles(a, t, HD, cs_s, sn_s);
    const int32_t slot = a.kv.k != NULL ? a.slot[t] : -1;
    const size_t row = (size_t)a.n_kv_heads * HD;
    for (; base < h_end; base += QK_WARPS * HPW) {   /* warp-uniform: the shuffles need it */
        const int head = base + sub;
        const int is_k = head >= a.n_heads, live = head < h_end;
        const int h = is_k ? head - a.n_heads : head;
        float y1[4], y2[4];
        unpack4(n1, y1);
        unpack4(n2, y2);
        load(base + QK_WARPS * HPW + sub);
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++)
            ss += y1[j] * y1[j] + y2[j] * y2[j];
#pragma unroll
        for (int o = LPH / 2; o > 0; o >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (!live)
            continue;
        const float inv = rsqrtf(ss / (float)HD + a.eps);
        const kern_weight *nw = is_k ? &a.k_norm : &a.q_norm;
        float r1[4], r2[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = i0 + j;
            float u1 = kern_cuda_rnd(kern_cuda_ld(nw->data, nw->dtype, i) * kern_cuda_rnd(y1[j] * inv, rnd), rnd);
            float u2 = kern_cuda_rnd(kern_cuda_ld(nw->data, nw->dtype, i + HALF) * kern_cuda_rnd(y2[j] * inv, rnd), rnd);
            kern_cuda_rope_pair(u1, u2, cs_s[i], sn_s[i], rnd, &r1[j], &r2[j]);
        }
        if (!is_k && src.q_out != NULL) {
            __nv_bfloat16 *qo = src.q_out + t * a.ld_q + (size_t)h * HD + i0;
            kern_cuda_st4(qo, make_float4(r1[0], r1[1], r1[2], r1[3]));
            kern_cuda_st4(qo + HALF, make_float4(r2[0], r2[1], r2[2], r2[3]));
        } else if (!is_k || src.k_rows) {
            float *x = is_k ? a.k + t * a.ld_kv + (size_t)h * HD : a.q + t * a.ld_q + (size_t)h * HD;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                x[i0 + j] = r1[j];
                x[i0 + j + HALF] = r2[j];
            }
        }
        if (!is_k || (slot < 0 && src.v_out == NULL))
            continue;
        const __nv_bfloat16 *v = src.v + t * src.ld_kv + (size_t)h * HD + i0;
        const uint2 v1 = *(const uint2 *)v, v2 = *(const uint2 *)(v + HALF);
        if (slot >= 0 && a.kv.dtype == KERN_DTYPE_BF16) {
            /* v is a bf16 product: its bits are the values the cache stores */
            const size_t b = (size_t)slot * row + (size_t)h * HD + i0;
            __nv_bfloat16 *kc = (__nv_bfloat16 *)a.kv.k + b, *vc = (__nv_bfloat16 *)a.kv.v + b;
            kern_cuda_st4(kc, make_float4(r1[0], r1[1], r1[2], r1[3]));
            kern_cuda_st4(kc + HALF, make_float4(r2[0], r2[1], r2[2], r2[3]));
            *(uint2 *)vc = v1;
            *(uint2 *)(vc + HALF) = v2;
        }
        float f1[4], f2[4];
        unpack4(v1, f1);
        unpack4(v2, f2);
        if (slot >= 0 && a.kv.dtype != KERN_DTYPE_BF16) {
            const size_t b = (size_t)slot * row + (size_t)h * HD + i0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                kern_cuda_st(a.kv.k, a.kv.dtype, b + j, r1[j]);
                kern_cuda_st(a.kv.k, a.kv.dtype, b + j + HALF, r2[j]);
                kern_cuda_st(a.kv.v, a.kv.dtype, b + j, f1[j]);
                kern_cuda_st(a.kv.v, a.kv.dtype, b + j + HALF, f2[j]);
            }
        }
        if (src.v_out != NULL) {
            float *vo = src.v_out + t * a.ld_kv + (size_t)h * HD + i0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                vo[j] = f1[j];
                vo[j + HALF] = f2[j];
            }
        }
    }
}

/* the vector form's 8-byte accesses line up: rows and bases of the products, q_out and the cache */
static int vec_fits(const kern_qk_post_args *a, const qk_src<__nv_bfloat16> &src)
{
    uintptr_t al = (uintptr_t)src.q | (uintptr_t)src.k | (uintptr_t)src.v | (uintptr_t)src.q_out;
    if (a->kv.k != NULL && a->kv.dtype == KERN_DTYPE_BF16)
        al |= (uintptr_t)a->kv.k | (uintptr_t)a->kv.v;
    return (a->head_dim == 64 || a->head_dim == 128) && al % 8 == 0 && src.ld_q % 4 == 0 &&
           src.ld_kv % 4 == 0 && (src.q_out == NULL || a->ld_q % 4 == 0);
}

template <typename T>
static pd_status launch(kern_backend *be, const kern_qk_post_args *a, const qk_src<T> &src, int pdl, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->n_tok <= 0)
        return PD_OK;
    if (a->head_dim > 2 * 32 * QK_MAX_PAIRS)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda qk_post: head_dim %d > %d", a->head_dim,
                          2 * 32 * QK_MAX_PAIRS);
    /* few tokens (decode, verify): a block per 8 heads spreads the heads over SMs; many tokens:
     * a block per token forms its angles once for all heads */
    int heads = a->n_heads + a->n_kv_heads;
    int per = a->n_tok >= QK_WIDE_MIN_TOK ? heads : QK_WARPS;
    dim3 grid((unsigned)a->n_tok, (unsigned)((heads + per - 1) / per));
    int np = (a->head_dim / 2 + 31) / 32;
    void (*kern)(kern_qk_post_args, qk_src<T>, int, int, int) =
        np <= 1 ? qk_post_kernel<1, T> : np <= 2 ? qk_post_kernel<2, T> : np <= 4 ? qk_post_kernel<4, T>
                                                                                : qk_post_kernel<QK_MAX_PAIRS, T>;
    PD_CUDA_TRY(kern_cuda_launch(c->stream, grid, dim3(QK_WARPS * 32), 0, pdl, kern, *a, src, per,
                                 be->act_bf16, pdl), err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* the op on its own q/k/v rows (fp32, in place) */
static pd_status launch_op(kern_backend *be, const kern_qk_post_args *a, int pdl, pd_err *err)
{
    qk_src<float> src = { a->q, a->k, a->v, a->ld_q, a->ld_kv, NULL, 1, NULL };
    return launch<float>(be, a, src, pdl, err);
}

extern "C" pd_status kern_cuda_qk_post_launch(kern_backend *be, const kern_qk_post_args *a,
                                              pd_err *err)
{
    return launch_op(be, a, 0, err);
}

extern "C" pd_status kern_cuda_qk_post_launch_pdl(kern_backend *be, const kern_qk_post_args *a,
                                                  pd_err *err)
{
    return launch_op(be, a, 1, err);
}

extern "C" pd_status kern_cuda_qk_post_from(kern_backend *be, const kern_qk_post_args *a,
                                            const __nv_bfloat16 *q, const __nv_bfloat16 *k,
                                            const __nv_bfloat16 *v, int ld_q, int ld_kv,
                                            __nv_bfloat16 *q_out, int k_rows, float *v_out, pd_err *err)
{
    qk_src<__nv_bfloat16> src = { q, k, v, ld_q, ld_kv, q_out, k_rows, v_out };
    if (a->n_tok <= 0 || !vec_fits(a, src))
        return launch<__nv_bfloat16>(be, a, src, 0, err);
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    const int heads = a->n_heads + a->n_kv_heads, hpw = 32 / (a->head_dim / 8);
    const int per = a->n_tok >= QK_WIDE_MIN_TOK ? heads : QK_WARPS * hpw;
    dim3 grid((unsigned)a->n_tok, (unsigned)((heads + per - 1) / per));
    if (a->head_dim == 64)
        qk_post_vec_kernel<64><<<grid, QK_WARPS * 32, 0, c->stream>>>(*a, src, per, be->act_bf16);
    else
        qk_post_vec_kernel<128><<<grid, QK_WARPS * 32, 0, c->stream>>>(*a, src, per, be->act_bf16);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
