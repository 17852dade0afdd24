/* kern_cuda_markov.cu - one DSpark Markov-head step with its greedy pick, in one launch.
 * Owns: kern_cuda_markov_step_launch. Block b owns a fixed range of vocabulary rows v (ranges
 *   depend on V only); its threads stream w2[v, 0:R] (16-byte loads, R % 8 == 0) and form, for
 *   every row r, step[r, v] = base[rows[r], v] + sum_c w2[v, c] * bf16(vec[r, c]) (fp32, c in
 *   order; vec staged once per block in shared memory). Then each block reduces its range to a
 *   (value, index) partial per row with kern_argmax's rule (larger value, then lower index; NaN
 *   never wins) and the last block to finish (a counter in the backend context, reset by that
 *   block) reduces the partials in block order into ids.
 *   Other shapes (f32 weights, R % 8 != 0, too many rows for shared memory) run the composition:
 *   copy_rows, matmul (accumulate), argmax.
 * kern_cuda_markov_chain_launch runs every step of a greedy chain (vanilla head) in one launch:
 *   up to MK_CHAIN_PER_SM blocks per multiprocessor (all resident), each owning a fixed vocabulary range as
 *   above; per step every block gathers w1[prev] itself, writes its (value, index) partials, and
 *   waits at a grid barrier (the counter word, left zero at the end); then every block reduces
 *   all partials in block order (so every block holds the same ids) and block 0 writes them.
 *   Partials alternate between two buffers, so a block that is ahead never overwrites what a
 *   slower one still reads. The step logits are not written.
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#include <math.h>
#include <string.h>

#define MK_THREADS 256
#define MK_PER_BLOCK 512          /* vocabulary rows per block (before the SM cap) */
#define MK_SMEM_MAX (48 * 1024)
#define MK_CHAIN_PER_SM 4         /* resident blocks per SM the chain asks for at most */

static __device__ __forceinline__ bool mk_better(float v, int i, float bv, int bi)
{
    return v > bv || (v == bv && i < bi);
}

/* block-wide (value, index) reduction; result valid in thread 0 */
static __device__ void mk_block_best(float &bv, int &bi, float *sv, int *si)
{
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (mk_better(ov, oi, bv, bi))
            bv = ov, bi = oi;
    }
    __syncthreads();   /* sv/si of the previous row are read */
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = bv;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < MK_THREADS / 32; w++)
            if (mk_better(sv[w], si[w], bv, bi))
                bv = sv[w], bi = si[w];
}

/* sum_c w[c] * x[c] over one bf16 row of R values (16-byte loads), c in order, fp32. RC = R
 * known at compile time (every load issued before the first product: the common R = 64 takes
 * one L2 round trip per row instead of R / 8), 0 = R at run time. */
template <int RC>
static __device__ __forceinline__ float mk_dot(const uint4 *wr, const float *x, int R)
{
    constexpr int N8 = RC / 8 > 0 ? RC / 8 : 1;
    float dot = 0.0f;
    if constexpr (RC > 0) {
        uint4 u[N8];
#pragma unroll
        for (int c8 = 0; c8 < N8; c8++)
            u[c8] = __ldg(wr + c8);
#pragma unroll
        for (int c8 = 0; c8 < N8; c8++) {
            const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u[c8];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __bfloat1622float2(h[i]);
                dot = fmaf(f.x, x[c8 * 8 + 2 * i], dot);
                dot = fmaf(f.y, x[c8 * 8 + 2 * i + 1], dot);
            }
        }
    } else {
        for (int c8 = 0; c8 < R / 8; c8++) {
            uint4 u = __ldg(wr + c8);
            const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __bfloat1622float2(h[i]);
                dot = fmaf(f.x, x[c8 * 8 + 2 * i], dot);
                dot = fmaf(f.y, x[c8 * 8 + 2 * i + 1], dot);
            }
        }
    }
    return dot;
}

template <int RC>
__global__ void __launch_bounds__(MK_THREADS)
markov_step_kernel(kern_markov_step_args a, int V, int R, int chunk, float *part_v, int *part_i,
                   unsigned int *ctr)
{
    extern __shared__ float vs[];                  /* [n, R], bf16-rounded */
    __shared__ float sv[MK_THREADS / 32];
    __shared__ int si[MK_THREADS / 32];
    __shared__ int is_last;
    const int nb = gridDim.x;
    for (int i = threadIdx.x; i < a.n * R; i += MK_THREADS) {
        int r = i / R, c = i % R;
        vs[i] = __bfloat162float(__float2bfloat16_rn(a.vec[(size_t)r * a.ld_vec + c]));
    }
    __syncthreads();
    const int v0 = blockIdx.x * chunk, v1 = v0 + chunk < V ? v0 + chunk : V;
    const __nv_bfloat16 *w2 = (const __nv_bfloat16 *)a.w2.data;
    for (int r = 0; r < a.n; r++) {
        const float *base = a.base + (size_t)a.rows[r] * a.ld_base;
        float *step = a.step + (size_t)r * a.ld_step;
        const float *xr = vs + (size_t)r * R;
        float bv = -INFINITY;
        int bi = V;
        for (int v = v0 + threadIdx.x; v < v1; v += MK_THREADS) {
            float val = base[v] + mk_dot<RC>((const uint4 *)(w2 + (size_t)v * R), xr, R);
            step[v] = val;
            if (mk_better(val, v, bv, bi))
                bv = val, bi = v;
        }
        mk_block_best(bv, bi, sv, si);
        if (threadIdx.x == 0) {
            part_v[(size_t)r * nb + blockIdx.x] = bv;
            part_i[(size_t)r * nb + blockIdx.x] = bi;
        }
    }
    if (a.ids == NULL)
        return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        is_last = atomicAdd(ctr, 1u) == (unsigned)nb - 1;
    __syncthreads();
    if (!is_last)
        return;
    __threadfence();
    for (int r = 0; r < a.n; r++) {
        float bv = -INFINITY;
        int bi = V;
        /* volatile: written by other blocks, not through this block's L1 */
        for (int b = threadIdx.x; b < nb; b += MK_THREADS) {
            float v = ((volatile float *)part_v)[(size_t)r * nb + b];
            int i = ((volatile int *)part_i)[(size_t)r * nb + b];
            if (mk_better(v, i, bv, bi))
                bv = v, bi = i;
        }
        mk_block_best(bv, bi, sv, si);
        if (threadIdx.x == 0)
            a.ids[r] = bi < V ? bi : 0;   /* all -inf/NaN: index 0, as kern_argmax */
    }
    if (threadIdx.x == 0)
        *ctr = 0;
}

static pd_status markov_composed(kern_backend *be, const kern_markov_step_args *a, pd_err *err)
{
    int V = (int)a->w2.rows, R = (int)a->w2.cols;
    kern_copy_rows_args cp = { .src = a->base, .ld_src = a->ld_base, .idx = a->rows, .dst = a->step,
                               .ld_dst = a->ld_step, .rows = a->n, .cols = V };
    kern_matmul_args mm = { .x = a->vec, .ld_x = a->ld_vec, .w = a->w2, .bias = {}, .y = a->step,
                            .ld_y = a->ld_step, .m = a->n, .n = V, .k = R, .accumulate = 1 };
    kern_argmax_args am = { .x = a->step, .ld_x = a->ld_step, .rows = a->n, .n = V, .out = a->ids };
    pd_status st = kern_cuda_copy_rows_launch(be, &cp, err);
    if (st == PD_OK)
        st = kern_cuda_matmul_launch(be, &mm, err);
    if (st == PD_OK && a->ids != NULL)
        st = kern_cuda_argmax_launch(be, &am, err);
    return st;
}

extern "C" pd_status kern_cuda_markov_step_launch(kern_backend *be, const kern_markov_step_args *a,
                                                  pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->n <= 0)
        return PD_OK;
    int V = (int)a->w2.rows, R = (int)a->w2.cols;
    size_t smem = (size_t)a->n * R * sizeof(float);
    if (a->w2.dtype != KERN_DTYPE_BF16 || R % 8 != 0 || ((uintptr_t)a->w2.data & 15) != 0 ||
        smem > MK_SMEM_MAX)
        return markov_composed(be, a, err);
    int nb = (V + MK_PER_BLOCK - 1) / MK_PER_BLOCK;
    if (nb > 4 * c->n_sm)
        nb = 4 * c->n_sm;
    int chunk = (V + nb - 1) / nb;
    nb = (V + chunk - 1) / chunk;
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, (size_t)a->n * nb * 8, &ws, err);
    if (st != PD_OK)
        return st;
    float *pv = (float *)ws;
    int *pi = (int *)(pv + (size_t)a->n * nb);
    if (R == 64)
        markov_step_kernel<64><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter);
    else
        markov_step_kernel<0><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* all blocks of the grid arrive before any leaves; target = arrivals expected so far */
static __device__ __forceinline__ void mk_grid_barrier(unsigned int *ctr, unsigned int target)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(ctr, 1u);
        while (*(volatile unsigned int *)ctr < target)
            __nanosleep(20);
        __threadfence();
    }
    __syncthreads();
}

template <int RC>
__global__ void __launch_bounds__(MK_THREADS)
markov_chain_kernel(kern_markov_chain_args a, int V, int R, int chunk, float *part_v, int *part_i,
                    unsigned int *ctr)
{
    extern __shared__ float vs[];                  /* [n, R] w1[prev] rows | ids [n] */
    int *ids = (int *)(vs + (size_t)a.n * R);
    __shared__ float sv[MK_THREADS / 32];
    __shared__ int si[MK_THREADS / 32];
    const int nb = gridDim.x, n = a.n;
    const int v0 = blockIdx.x * chunk, v1 = v0 + chunk < V ? v0 + chunk : V;
    const __nv_bfloat16 *w1 = (const __nv_bfloat16 *)a.w1.data;
    const __nv_bfloat16 *w2 = (const __nv_bfloat16 *)a.w2.data;
    for (int r = threadIdx.x; r < n; r += MK_THREADS)
        ids[r] = a.prev[r];
    for (int k = 0; k < a.steps; k++) {
        __syncthreads();   /* ids of the previous step */
        for (int i = threadIdx.x; i < n * R; i += MK_THREADS) {
            int r = i / R, c = i % R;
            vs[i] = __bfloat162float(w1[(size_t)ids[r] * R + c]);
        }
        __syncthreads();
        float *pv = part_v + (size_t)(k & 1) * n * nb;
        int *pi = part_i + (size_t)(k & 1) * n * nb;
        for (int r = 0; r < n; r++) {
            const float *base = a.base + (size_t)a.rows[(size_t)k * a.ld_rows + r] * a.ld_base;
            const float *xr = vs + (size_t)r * R;
            float bv = -INFINITY;
            int bi = V;
            for (int v = v0 + threadIdx.x; v < v1; v += MK_THREADS) {
                float val = base[v] + mk_dot<RC>((const uint4 *)(w2 + (size_t)v * R), xr, R);
                if (mk_better(val, v, bv, bi))
                    bv = val, bi = v;
            }
            mk_block_best(bv, bi, sv, si);
            if (threadIdx.x == 0) {
                pv[(size_t)r * nb + blockIdx.x] = bv;
                pi[(size_t)r * nb + blockIdx.x] = bi;
            }
        }
        mk_grid_barrier(ctr, (unsigned int)(k + 1) * nb);
        for (int r = 0; r < n; r++) {
            float bv = -INFINITY;
            int bi = V;
            for (int b = threadIdx.x; b < nb; b += MK_THREADS) {
                float v = ((volatile float *)pv)[(size_t)r * nb + b];
                int i = ((volatile int *)pi)[(size_t)r * nb + b];
                if (mk_better(v, i, bv, bi))
                    bv = v, bi = i;
            }
            mk_block_best(bv, bi, sv, si);
            if (threadIdx.x == 0) {
                int id = bi < V ? bi : 0;   /* all -inf/NaN: index 0, as kern_argmax */
                ids[r] = id;
                if (blockIdx.x == 0)
                    a.prev[(size_t)(k + 1) * a.ld_prev + r] = id;
            }
        }
    }
    /* every block has passed its last barrier when the last one arrives here: reset */
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(ctr, 1u) == (unsigned int)(a.steps + 1) * nb - 1)
        *ctr = 0;
}

/* The chain step by step: w1 rows gathered, then markov_step with ids (scratch: vec | step). */
static pd_status markov_chain_composed(kern_backend *be, const kern_markov_chain_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    int V = (int)a->w2.rows, R = (int)a->w2.cols;
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, ((size_t)a->n * R + (size_t)a->n * V) * sizeof(float), &ws, err);
    float *vec = (float *)ws, *step = vec + (size_t)a->n * R;
    for (int k = 0; k < a->steps && st == PD_OK; k++) {
        kern_embed_args em = { .table = a->w1, .ids = a->prev + (size_t)k * a->ld_prev, .n = a->n,
                               .out = vec, .ld_out = R };
        kern_markov_step_args ms = { .base = a->base, .ld_base = a->ld_base,
                                     .rows = a->rows + (size_t)k * a->ld_rows, .w2 = a->w2, .vec = vec,
                                     .ld_vec = R, .n = a->n, .step = step, .ld_step = V,
                                     .ids = a->prev + (size_t)(k + 1) * a->ld_prev };
        st = kern_cuda_embed_launch(be, &em, err);
        if (st == PD_OK)
            st = kern_cuda_markov_step_launch(be, &ms, err);
    }
    return st;
}

extern "C" pd_status kern_cuda_markov_chain_launch(kern_backend *be, const kern_markov_chain_args *a,
                                                   pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->n <= 0)
        return PD_OK;
    int V = (int)a->w2.rows, R = (int)a->w2.cols;
    size_t smem = (size_t)a->n * R * sizeof(float) + (size_t)a->n * sizeof(int);
    if (a->w1.dtype != KERN_DTYPE_BF16 || a->w2.dtype != KERN_DTYPE_BF16 || R % 8 != 0 ||
        ((uintptr_t)a->w2.data & 15) != 0 || smem > MK_SMEM_MAX)
        return markov_chain_composed(be, a, err);
    /* every block must be resident at once (grid barrier): at most as many as fit on the
     * multiprocessors together (up to MK_CHAIN_PER_SM each), about a vocabulary row per thread */
    int per_sm = 0;
    if (R == 64)
        PD_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, markov_chain_kernel<64>, MK_THREADS,
                                                                  smem), err);
    else
        PD_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, markov_chain_kernel<0>, MK_THREADS,
                                                                  smem), err);
    if (per_sm < 1)
        return markov_chain_composed(be, a, err);
    if (per_sm > MK_CHAIN_PER_SM)
        per_sm = MK_CHAIN_PER_SM;
    int nb = (V + MK_THREADS - 1) / MK_THREADS;
    if (nb > c->n_sm * per_sm)
        nb = c->n_sm * per_sm;
    int chunk = (V + nb - 1) / nb;
    nb = (V + chunk - 1) / chunk;
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, (size_t)2 * a->n * nb * 8, &ws, err);
    if (st != PD_OK)
        return st;
    float *pv = (float *)ws;
    int *pi = (int *)(pv + (size_t)2 * a->n * nb);
    if (R == 64)
        markov_chain_kernel<64><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter);
    else
        markov_chain_kernel<0><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
