/* kern_cuda_kv.cu - writes K/V rows of new tokens into their paged-cache slots.
 * Owns: kern_cuda_kv_store_launch. One block per token; threads stride over the
 *   n_kv_heads * head_dim values of the slot and convert F32 -> the cache dtype (BF16 on CUDA,
 *   round to nearest even). A negative slot skips the token (padding rows).
 * Not here: page allocation and slot assignment (common/pd_kv.c); shape checks (kern_ops.c).
 * Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#define KV_THREADS 256

template <typename T>
static __device__ __forceinline__ T from_f32(float f);
template <>
__device__ __forceinline__ float from_f32<float>(float f) { return f; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float f) { return __float2half_rn(f); }

template <typename T>
__global__ void __launch_bounds__(KV_THREADS)
kv_store_kernel(T *kc, T *vc, const float *k, const float *v, int ld, const int32_t *slot, int row)
{
    size_t t = blockIdx.x;
    int32_t s = slot[t];
    if (s < 0)
        return;
    T *kd = kc + (size_t)s * row, *vd = vc + (size_t)s * row;
    const float *ks = k + t * ld, *vs = v + t * ld;
    for (int c = threadIdx.x; c < row; c += KV_THREADS) {
        kd[c] = from_f32<T>(ks[c]);
        vd[c] = from_f32<T>(vs[c]);
    }
}

extern "C" pd_status kern_cuda_kv_store_launch(kern_backend *be, const kern_kv_store_args *a,
                                               pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->n_tok <= 0)
        return PD_OK;
    int row = a->kv.n_kv_heads * a->kv.head_dim;
    switch (a->kv.dtype) {
    case KERN_DTYPE_BF16:
        kv_store_kernel<__nv_bfloat16><<<a->n_tok, KV_THREADS, 0, c->stream>>>(
            (__nv_bfloat16 *)a->kv.k, (__nv_bfloat16 *)a->kv.v, a->k, a->v, a->ld, a->slot, row);
        break;
    case KERN_DTYPE_F32:
        kv_store_kernel<float><<<a->n_tok, KV_THREADS, 0, c->stream>>>(
            (float *)a->kv.k, (float *)a->kv.v, a->k, a->v, a->ld, a->slot, row);
        break;
    case KERN_DTYPE_F16:
        kv_store_kernel<__half><<<a->n_tok, KV_THREADS, 0, c->stream>>>(
            (__half *)a->kv.k, (__half *)a->kv.v, a->k, a->v, a->ld, a->slot, row);
        break;
    default:
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "cuda kv_store: cache dtype %s",
                          kern_cuda_dtype_name(a->kv.dtype));
    }
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
