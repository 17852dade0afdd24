/* kern_cuda_norm.cu - RMSNorm with the fused residual add of a pre-norm block.
 * Owns: kern_cuda_rmsnorm_launch, kern_cuda_rmsnorm_to (output stored as F32, BF16 or F16).
 *   One block per row: pass 1 forms s = x (+ residual), writes sum_out and reduces sum(s^2) in
 *   fp32 per thread then across the block; pass 2 scales.
 *   Every element is read and written by the same thread in both passes, which is what makes
 *   the allowed aliasing (out == x, sum_out == residual) safe. Programmatic dependent launches
 *   (kern_cuda_ctx.small_pdl): a block lets the next kernel start, then waits for the previous
 *   one before it reads.
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#define NORM_THREADS 256

template <typename W>
static __device__ __forceinline__ float wload(const W *w, int i);
template <>
__device__ __forceinline__ float wload<float>(const float *w, int i) { return w[i]; }
template <>
__device__ __forceinline__ float wload<__nv_bfloat16>(const __nv_bfloat16 *w, int i)
{
    return __bfloat162float(w[i]);
}
template <>
__device__ __forceinline__ float wload<__half>(const __half *w, int i) { return __half2float(w[i]); }

template <typename O>
static __device__ __forceinline__ void ostore(O *p, float v);
template <>
__device__ __forceinline__ void ostore<float>(float *p, float v) { *p = v; }
template <>
__device__ __forceinline__ void ostore<__nv_bfloat16>(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ void ostore<__half>(__half *p, float v) { *p = __float2half_rn(v); }

/* The block's sum of squares of one row (every thread gets it) */
static __device__ __forceinline__ float block_sum(float ss, float *part)
{
    __shared__ float tot_s;
    ss = kern_cuda_warp_sum(ss);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < NORM_THREADS / 32 ? part[threadIdx.x] : 0.0f;
        v = kern_cuda_warp_sum(v);
        if (threadIdx.x == 0)
            tot_s = v;
    }
    __syncthreads();
    return tot_s;
}

/* No residual, 4 columns per thread (dim % 4 == 0, rows 16-byte aligned): the prefill's norm
 * into the packed GEMM operand */
template <typename W, typename O>
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm4_kernel(const float *x, O *out, const W *w, int dim, int ld_x, int ld_out, float eps, int rnd)
{
    __shared__ float part[NORM_THREADS / 32];
    kern_cuda_pdl_launch_next();
    kern_cuda_pdl_wait_prev();
    size_t r = blockIdx.x;
    const float *xr = x + r * ld_x;
    float ss = 0.0f;
    for (int c = 4 * threadIdx.x; c < dim; c += 4 * NORM_THREADS) {
        float4 v = kern_cuda_ld4(xr + c);
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    const float inv = rsqrtf(block_sum(ss, part) / (float)dim + eps);
    O *orow = out + r * ld_out;
    for (int c = 4 * threadIdx.x; c < dim; c += 4 * NORM_THREADS) {
        float4 v = kern_cuda_ld4(xr + c);
        v.x = kern_cuda_rnd(wload<W>(w, c) * kern_cuda_rnd(v.x * inv, rnd), rnd);
        v.y = kern_cuda_rnd(wload<W>(w, c + 1) * kern_cuda_rnd(v.y * inv, rnd), rnd);
        v.z = kern_cuda_rnd(wload<W>(w, c + 2) * kern_cuda_rnd(v.z * inv, rnd), rnd);
        v.w = kern_cuda_rnd(wload<W>(w, c + 3) * kern_cuda_rnd(v.w * inv, rnd), rnd);
        kern_cuda_st4(orow + c, v);
    }
}

template <typename W, typename O>
__global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_kernel(const float *x, const float *res, float *sum_out, O *out, const W *w, int dim,
               int ld_x, int ld_out, float eps, int rnd)
{
    __shared__ float part[NORM_THREADS / 32];
    kern_cuda_pdl_launch_next();
    kern_cuda_pdl_wait_prev();
    size_t r = blockIdx.x;
    const float *xr = x + r * ld_x;
    const float *rr = res != NULL ? res + r * ld_x : NULL;
    float *sr = sum_out != NULL ? sum_out + r * ld_x : NULL;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += NORM_THREADS) {
        float s = xr[c];
        if (rr != NULL)
            s = kern_cuda_rnd(s + rr[c], rnd);
        if (sr != NULL)
            sr[c] = s;
        ss += s * s;
    }
    const float inv = rsqrtf(block_sum(ss, part) / (float)dim + eps);
    O *orow = out + r * ld_out;
    for (int c = threadIdx.x; c < dim; c += NORM_THREADS) {
        float s;
        if (sr != NULL)
            s = sr[c];
        else
            s = rr != NULL ? kern_cuda_rnd(xr[c] + rr[c], rnd) : xr[c];
        ostore<O>(&orow[c], kern_cuda_rnd(wload<W>(w, c) * kern_cuda_rnd(s * inv, rnd), rnd));
    }
}

template <typename W, typename O>
static cudaError_t launch_wo(kern_cuda_ctx *c, const kern_rmsnorm_args *a, const void *w, void *out, int rnd)
{
    const dim3 grid((unsigned)a->rows), block(NORM_THREADS);
    if (a->residual == NULL && a->sum_out == NULL && kern_cuda_vec4_ok(a->dim, a->x, a->ld_x) &&
        kern_cuda_vec4_ok(a->dim, out, a->ld_out))
        return kern_cuda_launch(c->stream, grid, block, 0, c->small_pdl, rmsnorm4_kernel<W, O>, a->x, (O *)out,
                                (const W *)w, a->dim, a->ld_x, a->ld_out, a->eps, rnd);
    return kern_cuda_launch(c->stream, grid, block, 0, c->small_pdl, rmsnorm_kernel<W, O>, a->x,
                            a->residual, a->sum_out, (O *)out, (const W *)w, a->dim, a->ld_x, a->ld_out,
                            a->eps, rnd);
}

template <typename W>
static cudaError_t launch_w(kern_cuda_ctx *c, const kern_rmsnorm_args *a, const void *w, void *out,
                            kern_dtype odt, int rnd)
{
    if (odt == KERN_DTYPE_BF16)
        return launch_wo<W, __nv_bfloat16>(c, a, w, out, rnd);
    if (odt == KERN_DTYPE_F16)
        return launch_wo<W, __half>(c, a, w, out, rnd);
    return launch_wo<W, float>(c, a, w, out, rnd);
}

extern "C" pd_status kern_cuda_rmsnorm_to(kern_backend *be, const kern_rmsnorm_args *a, void *out,
                                          kern_dtype out_dtype, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0)
        return PD_OK;
    cudaError_t e;
    switch (a->w.dtype) {
    case KERN_DTYPE_F32: e = launch_w<float>(c, a, a->w.data, out, out_dtype, be->act_bf16); break;
    case KERN_DTYPE_BF16: e = launch_w<__nv_bfloat16>(c, a, a->w.data, out, out_dtype, be->act_bf16); break;
    case KERN_DTYPE_F16: e = launch_w<__half>(c, a, a->w.data, out, out_dtype, be->act_bf16); break;
    default:
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda rmsnorm: weight dtype %s",
                          kern_cuda_dtype_name(a->w.dtype));
    }
    PD_CUDA_TRY(e, err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_rmsnorm_launch(kern_backend *be, const kern_rmsnorm_args *a,
                                              pd_err *err)
{
    return kern_cuda_rmsnorm_to(be, a, a->out, KERN_DTYPE_F32, err);
}
