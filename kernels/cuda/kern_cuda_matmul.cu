/* kern_cuda_matmul.cu - y[M,N] = x[M,K] @ w[N,K]^T (+ y) (+ bias) through cuBLAS.
 * Owns: kern_cuda_matmul_launch. BF16 (or F16) weights: x is rounded to the weight dtype into
 *   the backend workspace, then cublasGemmEx with fp32 output and fp32 accumulation on the
 *   tensor cores. F32 weights: cublasSgemm on x as is. Row-major y = x w^T is column-major
 *   y^T = w^T' x^T', i.e. GEMM(op_T, op_N, N, M, K) with w as A (lda = K) and x as B.
 *   accumulate maps to beta = 1; the bias is a separate broadcast add after the GEMM.
 *   A single row (m = 1: a decode step of one request) with BF16 weights skips cuBLAS and the
 *   pack launch: gemv_bf16_kernel, a warp per output column (x rounded to bf16 as for cuBLAS,
 *   fp32 accumulation). On an H200 it took the synthetic Qwen3-4B batch-1 decode step from
 *   5.34 to 4.74 ms (graph replay; docs/BENCHMARKS.md).
 *   be->batch_invariant (decode rounds): gemv_rows_bf16_kernel for every m, so a row's result
 *   does not depend on the batch (lossless greedy speculative decoding in bf16).
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

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

__global__ void bias_add_kernel(float *y, int ld_y, const void *bias, kern_dtype bdt, int m, int n)
{
    size_t total = (size_t)m * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / n, c = i % n;
        y[r * ld_y + c] += kern_cuda_ld(bias, bdt, c);
    }
}

#define GEMV_THREADS 256
#define GEMV_DEPTH 4

/* y[0, col] (+)= sum_k x[k] w[col, k]: one warp per column streams its weight row with 16-byte
 * loads; x is read as fp32 (L1-resident, K <= 12288 floats) and rounded through bf16 exactly as
 * pack_x_kernel does for cuBLAS. Needs k % 8 == 0 and 16-byte aligned w rows and x. */
__global__ void __launch_bounds__(GEMV_THREADS)
gemv_bf16_kernel(const float *__restrict__ x, int k, const __nv_bfloat16 *__restrict__ w,
                 float *__restrict__ y, int n, int accumulate)
{
    int col = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    if (col >= n)
        return;
    const __nv_bfloat16 *wr = w + (size_t)col * k;
    float acc = 0.0f;
    /* GEMV_DEPTH 16-byte weight loads in flight per lane before any is used: small matrices
     * (k/v projections: 128 blocks) leave too few warps per SM to hide HBM latency otherwise */
    for (int k0 = lane * 8; k0 < k; k0 += GEMV_DEPTH * 256) {
        uint4 u[GEMV_DEPTH];
#pragma unroll
        for (int j = 0; j < GEMV_DEPTH; j++) {
            int kk = k0 + j * 256;
            u[j] = kk < k ? __ldg((const uint4 *)(wr + kk)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < GEMV_DEPTH; j++) {
            int kk = k0 + j * 256;
            if (kk >= k)
                break;
            const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u[j];
            float4 a = *(const float4 *)(x + kk), b = *(const float4 *)(x + kk + 4);
            float xf[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 v = __bfloat1622float2(h[i]);
                acc = fmaf(v.x, __bfloat162float(__float2bfloat16_rn(xf[2 * i])), acc);
                acc = fmaf(v.y, __bfloat162float(__float2bfloat16_rn(xf[2 * i + 1])), acc);
            }
        }
    }
    acc = kern_cuda_warp_sum(acc);
    if (lane == 0)
        y[col] = accumulate ? y[col] + acc : acc;
}

/* Batch-invariant GEMV for any m (be->batch_invariant): the m = 1 kernel's exact arithmetic for
 * every row - lane l of the warp of column c accumulates row r over the same k positions in the
 * same order and the warp sum is the same - while each weight chunk is loaded once for up to
 * GEMV_ROWS rows (grid.y walks the row groups). So a verify block of 8 tokens produces, row by
 * row, the bits a single-token decode step would. Needs k % 8 == 0, 16-byte aligned w rows, x and
 * ld_x % 4 == 0. */
#define GEMV_ROWS 8
__global__ void __launch_bounds__(GEMV_THREADS)
gemv_rows_bf16_kernel(const float *__restrict__ x, int ld_x, int m, int k,
                      const __nv_bfloat16 *__restrict__ w, float *__restrict__ y, int ld_y, int n,
                      int accumulate)
{
    int col = (int)((blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5);
    int lane = threadIdx.x & 31;
    int r0 = blockIdx.y * GEMV_ROWS;
    if (col >= n)
        return;
    int nr = m - r0 < GEMV_ROWS ? m - r0 : GEMV_ROWS;
    const __nv_bfloat16 *wr = w + (size_t)col * k;
    float acc[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++)
        acc[r] = 0.0f;
    for (int k0 = lane * 8; k0 < k; k0 += GEMV_DEPTH * 256) {
        uint4 u[GEMV_DEPTH];
#pragma unroll
        for (int j = 0; j < GEMV_DEPTH; j++) {
            int kk = k0 + j * 256;
            u[j] = kk < k ? __ldg((const uint4 *)(wr + kk)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < GEMV_DEPTH; j++) {
            int kk = k0 + j * 256;
            if (kk >= k)
                break;
            const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u[j];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) {
                if (r >= nr)
                    break;
                const float *xr = x + (size_t)(r0 + r) * ld_x + kk;
                float4 a = *(const float4 *)xr, b = *(const float4 *)(xr + 4);
                float xf[8] = { a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w };
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float2 v = __bfloat1622float2(h[i]);
                    acc[r] = fmaf(v.x, __bfloat162float(__float2bfloat16_rn(xf[2 * i])), acc[r]);
                    acc[r] = fmaf(v.y, __bfloat162float(__float2bfloat16_rn(xf[2 * i + 1])), acc[r]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        if (r >= nr)
            break;
        float v = kern_cuda_warp_sum(acc[r]);
        if (lane == 0) {
            float *yo = y + (size_t)(r0 + r) * ld_y + col;
            *yo = accumulate ? *yo + v : v;
        }
    }
}

static int gemv_rows_fits(const kern_matmul_args *a)
{
    return a->w.dtype == KERN_DTYPE_BF16 && a->k % 8 == 0 && a->ld_x % 4 == 0 &&
           (uintptr_t)a->w.data % 16 == 0 && (uintptr_t)a->x % 16 == 0;
}

/* m = 1 with BF16 weights and k >= 256 (decode steps of one request). m > 1 stays on cuBLAS: a
 * first version of this kernel for m <= 8 re-read x per column from L1/L2 and ran 2x slower
 * than cuBLAS there; k < 256 leaves lanes idle (the Markov head's [vocab, 64] product ran
 * slower than on cuBLAS) (docs/BENCHMARKS.md). */
static int gemv_fits(const kern_matmul_args *a)
{
    return a->m == 1 && a->k >= 256 && a->w.dtype == KERN_DTYPE_BF16 && a->k % 8 == 0 &&
           (uintptr_t)a->w.data % 16 == 0 && (uintptr_t)a->x % 16 == 0;
}

extern "C" pd_status kern_cuda_matmul_launch(kern_backend *be, const kern_matmul_args *a,
                                             pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->m <= 0 || a->n <= 0)
        return PD_OK;
    const float alpha = 1.0f, beta = a->accumulate ? 1.0f : 0.0f;
    if (a->k <= 0) {
        if (!a->accumulate)
            PD_CUDA_TRY(cudaMemset2DAsync(a->y, (size_t)a->ld_y * sizeof(float), 0,
                                          (size_t)a->n * sizeof(float), (size_t)a->m, c->stream),
                        err);
    } else if (a->w.dtype == KERN_DTYPE_F32) {
        PD_CUBLAS_TRY(cublasSgemm(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, a->n, a->m, a->k, &alpha,
                                  (const float *)a->w.data, a->k, a->x, a->ld_x, &beta, a->y,
                                  a->ld_y),
                      err);
    } else if (be->batch_invariant && gemv_rows_fits(a)) {
        dim3 grid((unsigned)(((size_t)a->n * 32 + GEMV_THREADS - 1) / GEMV_THREADS),
                  (unsigned)((a->m + GEMV_ROWS - 1) / GEMV_ROWS));
        gemv_rows_bf16_kernel<<<grid, GEMV_THREADS, 0, c->stream>>>(
            a->x, a->ld_x, a->m, a->k, (const __nv_bfloat16 *)a->w.data, a->y, a->ld_y, a->n,
            a->accumulate);
        KERN_CUDA_LAUNCH_CHECK(err);
    } else if (gemv_fits(a)) {
        unsigned blocks = (unsigned)(((size_t)a->n * 32 + GEMV_THREADS - 1) / GEMV_THREADS);
        gemv_bf16_kernel<<<blocks, GEMV_THREADS, 0, c->stream>>>(
            a->x, a->k, (const __nv_bfloat16 *)a->w.data, a->y, a->n, a->accumulate);
        KERN_CUDA_LAUNCH_CHECK(err);
    } else if (a->w.dtype == KERN_DTYPE_BF16 || a->w.dtype == KERN_DTYPE_F16) {
        int bf = a->w.dtype == KERN_DTYPE_BF16;
        void *xb = NULL;
        pd_status st = kern_cuda_ws_get(c, (size_t)a->m * a->k * 2, &xb, err);
        if (st != PD_OK)
            return st;
        size_t total = (size_t)a->m * a->k;
        if (bf)
            pack_x_kernel<__nv_bfloat16><<<kern_cuda_blocks(total, MM_THREADS), MM_THREADS, 0,
                                           c->stream>>>(a->x, a->ld_x, (__nv_bfloat16 *)xb, a->m,
                                                        a->k);
        else
            pack_x_kernel<__half><<<kern_cuda_blocks(total, MM_THREADS), MM_THREADS, 0,
                                    c->stream>>>(a->x, a->ld_x, (__half *)xb, a->m, a->k);
        KERN_CUDA_LAUNCH_CHECK(err);
        cudaDataType dt = bf ? CUDA_R_16BF : CUDA_R_16F;
        PD_CUBLAS_TRY(cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, a->n, a->m, a->k, &alpha,
                                   a->w.data, dt, a->k, xb, dt, a->k, &beta, a->y, CUDA_R_32F,
                                   a->ld_y, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                      err);
    } else {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda matmul: weight dtype %s",
                          kern_cuda_dtype_name(a->w.dtype));
    }
    if (a->bias.data != NULL) {
        size_t total = (size_t)a->m * a->n;
        bias_add_kernel<<<kern_cuda_blocks(total, MM_THREADS), MM_THREADS, 0, c->stream>>>(
            a->y, a->ld_y, a->bias.data, a->bias.dtype, a->m, a->n);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    return PD_OK;
}
