/* kern_cuda_argmax.cu - row-wise argmax (greedy sampling over logits).
 * Owns: kern_cuda_argmax_launch. A row goes to a thread-block cluster of CL CTAs (8 for rows of
 *   at least 8192 while the rows' clusters take at most two CTAs per SM, else 1): each CTA scans
 *   a slice of the row (16-byte loads where the row is aligned) keeping per thread its best
 *   (value, index) by kern_cuda_better (larger, then lower index; NaN never wins), a warp
 *   shuffle and a shared-memory reduction apply the same rule, and the cluster's first CTA takes
 *   the best of the slices through distributed shared memory. The rule is a total order, so the
 *   result is the CPU reference's strict '>' scan whatever the split. Why: one CTA per row took
 *   22.4 us for a 151936-float row on an H100 (the latency of its few loads in flight; 5.9 us
 *   with 8, docs/BENCHMARKS.md), in every greedy decode step. A programmatic dependent launch
 *   (it waits before reading). PD_ARGMAX_CLUSTER=0: one CTA per row.
 * Not here: sampling with temperature (kern_cuda_sample.cu). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#include <cooperative_groups.h>
#include <math.h>

namespace cg = cooperative_groups;

#define ARGMAX_THREADS 512
#define ARGMAX_CL 8

template <int CL>
__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_kernel(const float *x, int ld_x, int n, int32_t *out)
{
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    kern_cuda_pdl_wait_prev();
    const int row = (int)blockIdx.x / CL, part = (int)blockIdx.x % CL;
    const float *r = x + (size_t)row * ld_x;
    /* the slice: a multiple of 4 elements, so an aligned row's 16-byte loads stay aligned */
    const int per = ((n + CL - 1) / CL + 3) & ~3, lo = part * per, hi = min(n, lo + per);
    const bool vec = ((uintptr_t)r & 15) == 0;
    float bv = -INFINITY;
    int bi = n;   /* "none yet": loses to any real index on a tie */
    for (int i = lo + 4 * (int)threadIdx.x; i < hi; i += 4 * ARGMAX_THREADS) {
        if (vec && i + 3 < hi) {
            const float4 q = __ldg((const float4 *)(r + i));
            const float e[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (kern_cuda_better(e[j], i + j, bv, bi))
                    bv = e[j], bi = i + j;
        } else {
            for (int j = i; j < hi && j < i + 4; j++)
                if (kern_cuda_better(r[j], j, bv, bi))
                    bv = r[j], bi = j;
        }
    }
    kern_cuda_warp_best(bv, bi);
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = bv;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        bv = threadIdx.x < ARGMAX_THREADS / 32 ? sv[threadIdx.x] : -INFINITY;
        bi = threadIdx.x < ARGMAX_THREADS / 32 ? si[threadIdx.x] : n;
        kern_cuda_warp_best(bv, bi);
    }
    if (CL > 1) {
        /* slot 0 holds the CTA's best; the first CTA reads every CTA's after the cluster barrier,
         * and the second barrier keeps the others' shared memory alive until it has */
        __syncthreads();
        if (threadIdx.x == 0)
            sv[0] = bv, si[0] = bi;
        cg::cluster_group cl = cg::this_cluster();
        cl.sync();
        if (part == 0 && threadIdx.x < 32) {
            bv = -INFINITY;
            bi = n;
            if ((int)threadIdx.x < CL) {
                bv = *cl.map_shared_rank(&sv[0], threadIdx.x);
                bi = *cl.map_shared_rank(&si[0], threadIdx.x);
            }
            kern_cuda_warp_best(bv, bi);
        }
        cl.sync();
    }
    if (part == 0 && threadIdx.x == 0)
        out[row] = bi < n ? bi : 0;   /* all -inf/NaN: index 0, as the CPU scan */
}

extern "C" pd_status kern_cuda_argmax_launch(kern_backend *be, const kern_argmax_args *a,
                                             pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0)
        return PD_OK;
    /* a cluster per row while the rows leave SMs free (and the row is long enough to split) */
    const int cl = c->argmax_cluster && a->n >= 8 * 1024 && (long)a->rows * ARGMAX_CL <= 2L * c->n_sm ? ARGMAX_CL : 1;
    cudaLaunchAttribute at[2];
    cudaLaunchConfig_t cfg = kern_cuda_pdl_cfg(c->stream, dim3((unsigned)(a->rows * cl)), dim3(ARGMAX_THREADS), 0, 1, at);
    if (cl > 1) {
        at[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
        at[cfg.numAttrs].val.clusterDim.x = (unsigned)cl;
        at[cfg.numAttrs].val.clusterDim.y = 1;
        at[cfg.numAttrs].val.clusterDim.z = 1;
        cfg.numAttrs++;
    }
    void (*kern)(const float *, int, int, int32_t *) = cl > 1 ? argmax_kernel<ARGMAX_CL> : argmax_kernel<1>;
    PD_CUDA_TRY(cudaLaunchKernelEx(&cfg, kern, a->x, a->ld_x, a->n, a->out), err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
