/* kern_cuda_matmul.cu - y[M,N] = x[M,K] @ w[N,K]^T (+ y) (+ bias).
 * Owns: kern_cuda_matmul_launch and the cuBLAS path shared with op linear (kern_cuda_pack_x,
 *   kern_cuda_cublas_product, kern_cuda_gemm_packed). BF16 weights with few rows (any m with
 *   be->batch_invariant, m <= KERN_CUDA_SKINNY_FAST_MAX_M and k >= 256 otherwise) go to the
 *   skinny tensor-core kernel of kern_cuda_linear.cu (batch-invariant by construction; it
 *   replaced the warp-per-column GEMVs, docs/BENCHMARKS.md). Otherwise cuBLAS: x is rounded to
 *   the weight dtype into the backend workspace, then cublasGemmEx with fp32 accumulation on the
 *   tensor cores; F32 weights: cublasSgemm on x as is. Without act_bf16 the product lands in y
 *   in fp32 (accumulate = beta 1); with it, in bf16 scratch (cuBLAS rounds), and one pass stores
 *   it into y or adds it (rb(y + p)), as a bf16 model rounds a product, then a residual sum.
 *   Row-major y = x w^T is column-major y^T = w^T' x^T', i.e. GEMM(op_T, op_N, N, M, K) with w
 *   as A (lda = K) and x as B. The bias is a separate broadcast add after the GEMM.
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

template <typename T, int V>
__global__ void pack_x_kernel(const float *x, int ld_x, T *xb, int m, int k)
{
    if (V == 4) {
        KERN_CUDA_FOR_RC4(r, c, m, k)
            kern_cuda_st4(xb + (size_t)r * k + c, kern_cuda_ld4(x + (size_t)r * ld_x + c));
    } else {
        KERN_CUDA_FOR_RC(r, c, m, k)
            xb[(size_t)r * k + c] = cvt<T>(x[(size_t)r * ld_x + c]);
    }
}

__global__ void bias_add_kernel(float *y, int ld_y, const void *bias, kern_dtype bdt, int m, int n, int rnd)
{
    /* with rnd: the product rounded (idempotent after the skinny kernel, which rounds it
     * already; the cuBLAS path leaves it to this pass), then the sum */
    KERN_CUDA_FOR_RC(r, c, m, n) {
        float *yp = y + (size_t)r * ld_y + c;
        *yp = kern_cuda_rnd(kern_cuda_rnd(*yp, rnd) + kern_cuda_ld(bias, bdt, c), rnd);
    }
}

/* The rounded product p (bf16 from cuBLAS, or fp32 from an F32-weight product) into y: y = rb(p),
 * or y = rb(y + rb(p)) with accumulate */
static __device__ __forceinline__ float product_out(float y, float p, int accumulate)
{
    p = kern_cuda_rnd(p, 1);
    return accumulate ? kern_cuda_rnd(y + p, 1) : p;
}

template <typename T, int V>
__global__ void product_out_kernel(float *y, int ld_y, const T *p, int m, int n, int accumulate)
{
    if (V == 4) {
        KERN_CUDA_FOR_RC4(r, c, m, n) {
            float *yp = y + (size_t)r * ld_y + c;
            float4 v = kern_cuda_ld4(p + (size_t)r * n + c);
            float4 o = accumulate ? *(const float4 *)yp : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            *(float4 *)yp = make_float4(product_out(o.x, v.x, accumulate), product_out(o.y, v.y, accumulate),
                                        product_out(o.z, v.z, accumulate), product_out(o.w, v.w, accumulate));
        }
    } else {
        KERN_CUDA_FOR_RC(r, c, m, n) {
            float *yp = y + (size_t)r * ld_y + c;
            float v = kern_cuda_ld(p, sizeof(T) == 2 ? KERN_DTYPE_BF16 : KERN_DTYPE_F32, (size_t)r * n + c);
            *yp = product_out(accumulate ? *yp : 0.0f, v, accumulate);
        }
    }
}

/* One launch of product_out_kernel (p [m, n] packed): 4 columns per thread when the rows allow it */
template <typename T>
static void launch_product_out(cudaStream_t s, float *y, int ld_y, const T *p, int m, int n, int accumulate)
{
    if (kern_cuda_vec4_ok(n, y, ld_y) && kern_cuda_vec4_ok(n, p, n))
        product_out_kernel<T, 4><<<kern_cuda_grid_rc(m, n / 4, MM_THREADS), MM_THREADS, 0, s>>>(
            y, ld_y, p, m, n, accumulate);
    else
        product_out_kernel<T, 1><<<kern_cuda_grid_rc(m, n, MM_THREADS), MM_THREADS, 0, s>>>(
            y, ld_y, p, m, n, accumulate);
}

/* One launch of pack_x_kernel: 4 columns per thread when the rows allow it */
template <typename T>
static void launch_pack_x(cudaStream_t s, const float *x, int ld_x, T *xb, int m, int k)
{
    if (kern_cuda_vec4_ok(k, x, ld_x) && kern_cuda_vec4_ok(k, xb, k))
        pack_x_kernel<T, 4><<<kern_cuda_grid_rc(m, k / 4, MM_THREADS), MM_THREADS, 0, s>>>(
            x, ld_x, xb, m, k);
    else
        pack_x_kernel<T, 1><<<kern_cuda_grid_rc(m, k, MM_THREADS), MM_THREADS, 0, s>>>(
            x, ld_x, xb, m, k);
}

extern "C" pd_status kern_cuda_pack_x(kern_cuda_ctx *c, const float *x, int ld_x, int m, int k,
                                      kern_dtype dtype, void *xb, pd_err *err)
{
    if (dtype == KERN_DTYPE_BF16)
        launch_pack_x<__nv_bfloat16>(c->stream, x, ld_x, (__nv_bfloat16 *)xb, m, k);
    else
        launch_pack_x<__half>(c->stream, x, ld_x, (__half *)xb, m, k);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_cublas_product(kern_cuda_ctx *c, const kern_weight *w, const void *xp,
                                              int ld_xp, int m, int n, int k, void *out,
                                              kern_dtype out_dtype, int ld_out, float beta, pd_err *err)
{
    const float alpha = 1.0f;
    if (w->dtype == KERN_DTYPE_F32) {
        PD_CUBLAS_TRY(cublasSgemm(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha,
                                  (const float *)w->data, k, (const float *)xp, ld_xp, &beta,
                                  (float *)out, ld_out),
                      err);
        return PD_OK;
    }
    cudaDataType dt = w->dtype == KERN_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    cudaDataType ot = out_dtype == KERN_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    PD_CUBLAS_TRY(cublasGemmEx(c->cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w->data, dt, k,
                               xp, dt, ld_xp, &beta, out, ot, ld_out, CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT),
                  err);
    return PD_OK;
}

extern "C" size_t kern_cuda_gemm_tmp_bytes(const kern_weight *w, int m, int n, int rnd)
{
    return rnd ? (size_t)m * n * (w->dtype == KERN_DTYPE_F32 ? 4 : 2) : 0;
}

extern "C" pd_status kern_cuda_gemm_packed(kern_cuda_ctx *c, const kern_weight *w, const void *xp,
                                           int ld_xp, int m, int n, int k, float *y, int ld_y,
                                           int accumulate, int rnd, void *tmp, pd_err *err)
{
    if (!rnd)
        return kern_cuda_cublas_product(c, w, xp, ld_xp, m, n, k, y, KERN_DTYPE_F32, ld_y,
                                        accumulate ? 1.0f : 0.0f, err);
    int f32 = w->dtype == KERN_DTYPE_F32;
    pd_status st = kern_cuda_cublas_product(c, w, xp, ld_xp, m, n, k, tmp,
                                            f32 ? KERN_DTYPE_F32 : KERN_DTYPE_BF16, n, 0.0f, err);
    if (st != PD_OK)
        return st;
    if (f32)
        launch_product_out<float>(c->stream, y, ld_y, (const float *)tmp, m, n, accumulate);
    else
        launch_product_out<__nv_bfloat16>(c->stream, y, ld_y, (const __nv_bfloat16 *)tmp, m, n,
                                          accumulate);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* y = x w^T (+ y), no bias, through the calls above; scratch holds m * k * 2 bytes (the packed
 * x; none for F32 weights) followed, 256-aligned, by kern_cuda_gemm_tmp_bytes. */
static size_t gemm_cublas_scratch(const kern_matmul_args *a, int rnd)
{
    size_t pack = a->w.dtype == KERN_DTYPE_F32 ? 0 : (size_t)a->m * a->k * 2;
    return kern_cuda_align256(pack) + kern_cuda_gemm_tmp_bytes(&a->w, a->m, a->n, rnd);
}

static pd_status gemm_cublas(kern_cuda_ctx *c, const kern_matmul_args *a, void *scratch, int rnd,
                             pd_err *err)
{
    const void *xp = a->x;
    int ld_xp = a->ld_x;
    size_t pack = 0;
    if (a->w.dtype != KERN_DTYPE_F32) {
        pd_status st = kern_cuda_pack_x(c, a->x, a->ld_x, a->m, a->k, a->w.dtype, scratch, err);
        if (st != PD_OK)
            return st;
        xp = scratch;
        ld_xp = a->k;
        pack = (size_t)a->m * a->k * 2;
    }
    return kern_cuda_gemm_packed(c, &a->w, xp, ld_xp, a->m, a->n, a->k, a->y, a->ld_y, a->accumulate,
                                 rnd, (char *)scratch + kern_cuda_align256(pack), err);
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
        int rnd = be->act_bf16 && a->bias.data == NULL;
        void *scratch = NULL;
        pd_status st = kern_cuda_ws_get(c, gemm_cublas_scratch(a, rnd) + 256, &scratch, err);
        if (st == PD_OK)
            st = gemm_cublas(c, a, scratch, rnd, err);
        if (st != PD_OK)
            return st;
    } else {
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda matmul: weight dtype %s",
                          kern_cuda_dtype_name(a->w.dtype));
    }
    if (a->bias.data != NULL) {
        bias_add_kernel<<<kern_cuda_grid_rc(a->m, a->n, MM_THREADS), MM_THREADS, 0, c->stream>>>(
            a->y, a->ld_y, a->bias.data, a->bias.dtype, a->m, a->n, be->act_bf16);
        KERN_CUDA_LAUNCH_CHECK(err);
    }
    return PD_OK;
}
