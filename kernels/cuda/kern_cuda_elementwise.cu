/* kern_cuda_elementwise.cu - unary (sigmoid, tanh, silu) and binary (add, sub, mul, swiglu) ops
 *   over strided [rows, cols] views, the device-side dtype conversion behind upload_convert, and
 *   the two in-place edits of logits before sampling (penalties, allowed-token masks).
 * Owns: kern_cuda_unary_launch, kern_cuda_binary_launch, kern_cuda_convert_launch,
 *   kern_cuda_penalty_launch (one thread per entry: the entries are distinct logits),
 *   kern_cuda_token_mask_launch (a row of CTAs per mask).
 *   One element per iteration over the [rows, cols] grid (KERN_CUDA_FOR_RC); each output element is written by the thread
 *   that read its inputs, so out may alias an input.
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#define EW_THREADS 256

static __device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

template <int OP>
__global__ void unary_kernel(const float *x, int ld_x, float *out, int ld_out, int rows, int cols, int rnd)
{
    KERN_CUDA_FOR_RC(r, c, rows, cols) {
        float v = x[(size_t)r * ld_x + c], y;
        if (OP == KERN_UNARY_SIGMOID)
            y = sigmoid_f(v);
        else if (OP == KERN_UNARY_TANH)
            y = tanhf(v);
        else
            y = v * sigmoid_f(v);
        out[(size_t)r * ld_out + c] = kern_cuda_rnd(y, rnd);
    }
}

template <int OP>
__global__ void binary_kernel(const float *a, int ld_a, const float *b, int ld_b, float *out,
                              int ld_out, int rows, int cols, int rnd)
{
    KERN_CUDA_FOR_RC(r, c, rows, cols) {
        float x = a[(size_t)r * ld_a + c], y = b[(size_t)r * ld_b + c], z;
        if (OP == KERN_BINARY_ADD)
            z = kern_cuda_rnd(x + y, rnd);
        else if (OP == KERN_BINARY_SUB)
            z = kern_cuda_rnd(x - y, rnd);
        else if (OP == KERN_BINARY_MUL)
            z = kern_cuda_rnd(x * y, rnd);
        else
            z = kern_cuda_swiglu(x, y, rnd);
        out[(size_t)r * ld_out + c] = z;
    }
}

__global__ void convert_kernel(void *dst, kern_dtype dt_dst, const void *src, kern_dtype dt_src,
                               size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        kern_cuda_st(dst, dt_dst, i, kern_cuda_ld(src, dt_src, i));
}

extern "C" pd_status kern_cuda_unary_launch(kern_backend *be, const kern_unary_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0 || a->cols <= 0)
        return PD_OK;
    dim3 g = kern_cuda_grid_rc(a->rows, a->cols, EW_THREADS);
    switch (a->op) {
    case KERN_UNARY_SIGMOID:
        unary_kernel<KERN_UNARY_SIGMOID><<<g, EW_THREADS, 0, c->stream>>>(
            a->x, a->ld_x, a->out, a->ld_out, a->rows, a->cols, be->act_bf16);
        break;
    case KERN_UNARY_TANH:
        unary_kernel<KERN_UNARY_TANH><<<g, EW_THREADS, 0, c->stream>>>(
            a->x, a->ld_x, a->out, a->ld_out, a->rows, a->cols, be->act_bf16);
        break;
    case KERN_UNARY_SILU:
        unary_kernel<KERN_UNARY_SILU><<<g, EW_THREADS, 0, c->stream>>>(
            a->x, a->ld_x, a->out, a->ld_out, a->rows, a->cols, be->act_bf16);
        break;
    default:
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda unary: op %d", (int)a->op);
    }
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_binary_launch(kern_backend *be, const kern_binary_args *a,
                                             pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0 || a->cols <= 0)
        return PD_OK;
    dim3 g = kern_cuda_grid_rc(a->rows, a->cols, EW_THREADS);
    switch (a->op) {
    case KERN_BINARY_ADD:
        binary_kernel<KERN_BINARY_ADD><<<g, EW_THREADS, 0, c->stream>>>(
            a->a, a->ld_a, a->b, a->ld_b, a->out, a->ld_out, a->rows, a->cols, be->act_bf16);
        break;
    case KERN_BINARY_SUB:
        binary_kernel<KERN_BINARY_SUB><<<g, EW_THREADS, 0, c->stream>>>(
            a->a, a->ld_a, a->b, a->ld_b, a->out, a->ld_out, a->rows, a->cols, be->act_bf16);
        break;
    case KERN_BINARY_MUL:
        binary_kernel<KERN_BINARY_MUL><<<g, EW_THREADS, 0, c->stream>>>(
            a->a, a->ld_a, a->b, a->ld_b, a->out, a->ld_out, a->rows, a->cols, be->act_bf16);
        break;
    case KERN_BINARY_SWIGLU:
        binary_kernel<KERN_BINARY_SWIGLU><<<g, EW_THREADS, 0, c->stream>>>(
            a->a, a->ld_a, a->b, a->ld_b, a->out, a->ld_out, a->rows, a->cols, be->act_bf16);
        break;
    default:
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda binary: op %d", (int)a->op);
    }
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_convert_launch(kern_backend *be, void *dst, kern_dtype dst_dtype,
                                              const void *src, kern_dtype src_dtype, size_t n,
                                              pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (n == 0)
        return PD_OK;
    convert_kernel<<<kern_cuda_blocks(n, EW_THREADS), EW_THREADS, 0, c->stream>>>(
        dst, dst_dtype, src, src_dtype, n);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* ---- penalty ---------------------------------------------------------------------------------- */

__global__ void __launch_bounds__(256)
penalty_kernel(kern_penalty_args a)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < a.n_entries; i += gridDim.x * blockDim.x) {
        kern_penalty_entry e = a.e[i];
        if (e.tok < 0 || e.tok >= a.n || e.row < 0)
            continue;   /* the engine builds valid entries; the CPU op names a bad one */
        float *v = a.x + (size_t)e.row * a.ld_x + e.tok;
        *v = kern_penalize_one(*v, &e);
    }
}

extern "C" pd_status kern_cuda_penalty_launch(kern_backend *be, const kern_penalty_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    int blocks = (a->n_entries + 255) / 256;
    penalty_kernel<<<blocks < 1024 ? blocks : 1024, 256, 0, c->stream>>>(*a);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* ---- token mask ------------------------------------------------------------------------------- */

__global__ void __launch_bounds__(256)
token_mask_kernel(kern_token_mask_args a)
{
    int i = blockIdx.y;
    int row = a.rows[i];
    if (row < 0)
        return;   /* the engine builds valid rows; the CPU op names a bad one */
    float *x = a.x + (size_t)row * a.ld_x;
    const uint32_t *b = a.bits + (size_t)i * a.words;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < a.n; t += gridDim.x * blockDim.x)
        if (!((b[t >> 5] >> (t & 31)) & 1u))
            x[t] = -INFINITY;
}

extern "C" pd_status kern_cuda_token_mask_launch(kern_backend *be, const kern_token_mask_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    int blocks = (a->n + 255) / 256;
    dim3 grid(blocks < 64 ? blocks : 64, a->n_rows);
    token_mask_kernel<<<grid, 256, 0, c->stream>>>(*a);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
