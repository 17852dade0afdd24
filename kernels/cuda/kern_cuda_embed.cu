/* kern_cuda_embed.cu - row gathers: token embedding lookup (BF16/F16/F32 table -> F32) and
 *   copy_rows (F32 rows, optional index gather).
 * Owns: kern_cuda_embed_launch, kern_cuda_copy_rows_launch. One block per output row, threads
 *   stride across the columns. An out-of-range token id yields a zero row (the device cannot
 *   report it without a host round trip; kern_ops.c / the caller validates ids). Programmatic
 *   dependent launches (kern_cuda_ctx.small_pdl): a block lets the next kernel start, then
 *   waits for the previous one before it reads.
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#define ROW_THREADS 256

template <typename T>
static __device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T>
__global__ void __launch_bounds__(ROW_THREADS)
embed_kernel(const T *table, int64_t vocab, int dim, const int32_t *ids, float *out, int ld_out)
{
    kern_cuda_pdl_launch_next();
    kern_cuda_pdl_wait_prev();
    size_t r = blockIdx.x;
    int32_t id = ids[r];
    float *o = out + r * ld_out;
    if (id < 0 || id >= vocab) {
        for (int c = threadIdx.x; c < dim; c += ROW_THREADS)
            o[c] = 0.0f;
        return;
    }
    const T *row = table + (size_t)id * dim;
    for (int c = threadIdx.x; c < dim; c += ROW_THREADS)
        o[c] = to_f32<T>(row[c]);
}

__global__ void __launch_bounds__(ROW_THREADS)
copy_rows_kernel(const float *src, int ld_src, const int32_t *idx, float *dst, int ld_dst, int cols)
{
    kern_cuda_pdl_launch_next();
    kern_cuda_pdl_wait_prev();
    size_t r = blockIdx.x;
    size_t s = idx != NULL ? (size_t)idx[r] : r;
    const float *in = src + s * ld_src;
    float *o = dst + r * ld_dst;
    for (int c = threadIdx.x; c < cols; c += ROW_THREADS)
        o[c] = in[c];
}

extern "C" pd_status kern_cuda_embed_launch(kern_backend *be, const kern_embed_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->n <= 0)
        return PD_OK;
    int dim = (int)a->table.cols;
    const dim3 grid((unsigned)a->n), block(ROW_THREADS);
    cudaError_t e;
    switch (a->table.dtype) {
    case KERN_DTYPE_F32:
        e = kern_cuda_launch(c->stream, grid, block, 0, c->small_pdl, embed_kernel<float>,
                             (const float *)a->table.data, a->table.rows, dim, a->ids, a->out, a->ld_out);
        break;
    case KERN_DTYPE_BF16:
        e = kern_cuda_launch(c->stream, grid, block, 0, c->small_pdl, embed_kernel<__nv_bfloat16>,
                             (const __nv_bfloat16 *)a->table.data, a->table.rows, dim, a->ids, a->out,
                             a->ld_out);
        break;
    case KERN_DTYPE_F16:
        e = kern_cuda_launch(c->stream, grid, block, 0, c->small_pdl, embed_kernel<__half>,
                             (const __half *)a->table.data, a->table.rows, dim, a->ids, a->out, a->ld_out);
        break;
    default:
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda embed: table dtype %s",
                          kern_cuda_dtype_name(a->table.dtype));
    }
    PD_CUDA_TRY(e, err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_copy_rows_launch(kern_backend *be, const kern_copy_rows_args *a,
                                                pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0 || a->cols <= 0)
        return PD_OK;
    PD_CUDA_TRY(kern_cuda_launch(c->stream, dim3((unsigned)a->rows), dim3(ROW_THREADS), 0, c->small_pdl,
                                 copy_rows_kernel, a->src, a->ld_src, a->idx, a->dst, a->ld_dst, a->cols),
                err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
