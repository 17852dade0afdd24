/* kern_cuda_matmul.cu - y[M,N] = x[M,K] @ w[N,K]^T (+ y) (+ bias).
 * Owns: kern_cuda_matmul_launch, kern_cuda_gemm_cublas. BF16 weights with few rows (any m with
 *   be->batch_invariant, m <= KERN_CUDA_SKINNY_FAST_MAX_M and k >= 256 otherwise) go to the
 *   skinny tensor-core kernel of kern_cuda_linear.cu (batch-invariant by construction; it
 *   replaced the warp-per-column GEMVs, docs/BENCHMARKS.md). Otherwise cuBLAS: x is rounded to
 *   the weight dtype into the backend workspace, then cublasGemmEx with fp32 output and fp32
 *   accumulation on the tensor cores; F32 weights: cublasSgemm on x as is. Row-major y = x w^T
 *   is column-major y^T = w^T' x^T', i.e. GEMM(op_T, op_N, N, M, K) with w as A (lda = K) and x
 *   as B. accumulate maps to beta = 1; the bias is a separate broadcast add after the GEMM.
 *   k < 256 stays on cuBLAS in fast mode: the skinny kernel splits k over up to 8 warps in steps
 *   of 64 and leaves most of them idle there (the Markov head's [vocab, 64] product).
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#include <string.h>

#define MM_THREADS 256

template <typename T>
static __device__ __forceinline__ T cvt(float f);
template <>
__device__ __forceinline__ __nv_bfloat16 cvt<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }
template <>
__device__ __forceinline__ __half cvt<__half>(float f) { return __float2half_rn(f); }

template <typename T>
__global__ void pack_x_kernel(const float *x, int ld_x, T *xb, int m, int k)
{
    size_t total = (size_t)m * k;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / k, c = i % k;
        xb[i] = cvt<T>(x[r * ld_x + c]);
    }
}

__global__ void bias_add_kernel(float *y, int ld_y, const void *bias, kern_dtype bdt, int m, int n, int rnd)
{
    size_t total = (size_t)m * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / n, c = i % n;
        /* with rnd: the product rounded (idempotent after the skinny kernel, which rounds it
         * already; the cuBLAS path leaves it to this pass), then the sum */
        y[r * ld_y + c] = kern_cuda_rnd(kern_cuda_rnd(y[r * ld_y + c], rnd) + kern_cuda_ld(bias, bdt, c), rnd);
    }
}

/* y = rb(y) in place: the bf16 rounding of kern_backend.act_bf16 after a cuBLAS product */
__global__ void round_out_kernel(float *y, int ld_y, int m, int n)
{
    size_t total = (size_t)m * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / n, c = i % n;
        y[r * ld_y + c] = kern_cuda_rnd(y[r * ld_y + c], 1);
    }
}

extern "C" pd_status kern_cuda_gemm_cublas(kern_cuda_ctx *c, const kern_matmul_args *a, void *pack, int rnd,
                                           pd_err *err)
{
    const float alpha = 1.0f, beta = a->accumulate ? 1.0f : 0.0f;
    if (a->w.dtype == KERN_DTYPE_F32) {   /* x as is (pack unused) */
        PD_CUBLAS_TRY(cublasSgemm(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, a->n, a->m, a->k, &alpha,
                                  (const float *)a->w.data, a->k, a->x, a->ld_x, &beta, a->y, a->ld_y),
                      err);
    } else {
        int bf = a->w.dtype == KERN_DTYPE_BF16;
        size_t total = (size_t)a->m * a->k;
        if (bf)
            pack_x_kernel<__nv_bfloat16><<<kern_cuda_blocks(total, MM_THREADS), MM_THREADS, 0,
                                           c->stream>>>(a->x, a->ld_x, (__nv_bfloat16 *)pack, a->m,
                                                        a->k);
        else
            pack_x_kernel<__half><<<kern_cuda_blocks(total, MM_THREADS), MM_THREADS, 0, c->stream>>>(
                a->x, a->ld_x, (__half *)pack, a->m, a->k);
        KERN_CUDA_LAUNCH_CHECK(err);
        cudaDataType dt = bf ? CUDA_R_16BF : CUDA_R_16F;
        PD_CUBLAS_TRY(cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, a->n, a->m, a->k, &alpha,
                                   a->w.data, dt, a->k, pack, dt, a->k, &beta, a->y, CUDA_R_32F,
                                   a->ld_y, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                      err);
    }
    if (rnd) {
        size_t total = (size_t)a->m * a->n;
        round_out_kernel<<<kern_cuda_blocks(total, MM_THREADS), MM_THREADS, 0, c->stream>>>(
            a->y, a->ld_y, a->m, a->n);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    return PD_OK;
}

/* The product as op linear's one-weight form (the skinny kernel's arguments). */
static kern_linear_args as_linear(const kern_matmul_args *a)
{
    kern_linear_args la;
    memset(&la, 0, sizeof(la));
    la.x = a->x;
    la.ld_x = a->ld_x;
    la.m = a->m;
    la.k = a->k;
    la.n_w = 1;
    la.w[0] = a->w;
    la.y[0] = a->y;
    la.ld_y[0] = a->ld_y;
    la.epilogue = a->accumulate ? KERN_LINEAR_ACCUMULATE : KERN_LINEAR_STORE;
    return la;
}

static int skinny_wanted(kern_backend *be, const kern_matmul_args *a)
{
    if (a->w.dtype != KERN_DTYPE_BF16)
        return 0;
    if (!be->batch_invariant && (a->m > KERN_CUDA_SKINNY_FAST_MAX_M || a->k < 256))
        return 0;
    kern_linear_args la = as_linear(a);
    return kern_cuda_skinny_fits(&la);
}

extern "C" pd_status kern_cuda_matmul_launch(kern_backend *be, const kern_matmul_args *a,
                                             pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->m <= 0 || a->n <= 0)
        return PD_OK;
    if (a->k <= 0) {
        if (!a->accumulate)
            PD_CUDA_TRY(cudaMemset2DAsync(a->y, (size_t)a->ld_y * sizeof(float), 0,
                                          (size_t)a->n * sizeof(float), (size_t)a->m, c->stream),
                        err);
    } else if (skinny_wanted(be, a)) {
        kern_linear_args la = as_linear(a);
        pd_status st = kern_cuda_skinny_launch(c, &la, be->act_bf16, err);
        if (st != PD_OK)
            return st;
    } else if (a->w.dtype == KERN_DTYPE_F32 || a->w.dtype == KERN_DTYPE_BF16 || a->w.dtype == KERN_DTYPE_F16) {
        void *xb = NULL;
        pd_status st = a->w.dtype == KERN_DTYPE_F32 ? PD_OK : kern_cuda_ws_get(c, (size_t)a->m * a->k * 2, &xb, err);
        if (st == PD_OK)
            st = kern_cuda_gemm_cublas(c, a, xb, be->act_bf16 && a->bias.data == NULL, err);
        if (st != PD_OK)
            return st;
    } else {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda matmul: weight dtype %s",
                          kern_cuda_dtype_name(a->w.dtype));
    }
    if (a->bias.data != NULL) {
        size_t total = (size_t)a->m * a->n;
        bias_add_kernel<<<kern_cuda_blocks(total, MM_THREADS), MM_THREADS, 0, c->stream>>>(
            a->y, a->ld_y, a->bias.data, a->bias.dtype, a->m, a->n, be->act_bf16);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    return PD_OK;
}
