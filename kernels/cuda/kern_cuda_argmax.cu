/* kern_cuda_argmax.cu - row-wise argmax (greedy sampling over logits).
 * Owns: kern_cuda_argmax_launch. One block per row; each thread keeps its best (value, index)
 *   with the lowest index winning ties (and NaN never winning), then a warp-shuffle and a
 *   shared-memory reduction apply the same rule, matching the CPU reference's strict '>' scan.
 * Not here: sampling with temperature (kern_cuda_sample.cu). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#include <math.h>

#define ARGMAX_THREADS 512

/* true when (v, i) beats (bv, bi): larger value, or equal value and lower index */
static __device__ __forceinline__ bool better(float v, int i, float bv, int bi)
{
    return v > bv || (v == bv && i < bi);
}

__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_kernel(const float *x, int ld_x, int n, int32_t *out)
{
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const float *row = x + (size_t)blockIdx.x * ld_x;
    float bv = -INFINITY;
    int bi = n;   /* "none yet": loses to any real index on a tie */
    for (int i = threadIdx.x; i < n; i += ARGMAX_THREADS) {
        float v = row[i];
        if (better(v, i, bv, bi))
            bv = v, bi = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (better(ov, oi, bv, bi))
            bv = ov, bi = oi;
    }
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = bv;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        bv = threadIdx.x < ARGMAX_THREADS / 32 ? sv[threadIdx.x] : -INFINITY;
        bi = threadIdx.x < ARGMAX_THREADS / 32 ? si[threadIdx.x] : n;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (better(ov, oi, bv, bi))
                bv = ov, bi = oi;
        }
        if (threadIdx.x == 0)
            out[blockIdx.x] = bi < n ? bi : 0;   /* all -inf/NaN: index 0, as the CPU scan */
    }
}

extern "C" pd_status kern_cuda_argmax_launch(kern_backend *be, const kern_argmax_args *a,
                                             pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0)
        return PD_OK;
    argmax_kernel<<<a->rows, ARGMAX_THREADS, 0, c->stream>>>(a->x, a->ld_x, a->n, a->out);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
