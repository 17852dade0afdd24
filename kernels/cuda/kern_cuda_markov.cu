/* kern_cuda_markov.cu - the DSpark Markov head on the GPU: one step, or a whole greedy chain,
 *   in one launch.
 * Owns: kern_cuda_markov_step_launch (one step). Block b owns a fixed range of vocabulary rows v
 *   (ranges depend on V only); its threads stream w2[v, 0:R] (16-byte loads, R % 8 == 0) and
 *   form, for every row r, step[r, v] = base[rows[r], v] + sum_c w2[v, c] * bf16(vec[r, c])
 *   (fp32, c in order; vec staged once per block in shared memory). Then each block reduces its
 *   range to a (value, index) partial per row with kern_argmax's rule (larger value, then lower
 *   index; NaN never wins) and the last block to finish (a counter in the backend context, reset
 *   by that block) reduces the partials in block order into ids.
 *   Other shapes (f32 weights, R % 8 != 0, too many rows for shared memory) run the composition:
 *   copy_rows, matmul (accumulate), argmax.
 * kern_cuda_markov_chain_launch runs every step of a greedy chain in one launch, with the dot
 *   arithmetic of markov_step (so a vanilla chain's ids are the step-by-step path's):
 *   - markov_chain_res_kernel (first choice, every head): one block per multiprocessor whose
 *     slice of w2 stays in shared memory for the whole chain; partials published with step
 *     tags, so the publication is the grid barrier (see the comment above the kernel). The
 *     step's base rows are staged next to the slice, in groups when they do not fit at once. A gated
 *     or rnn head's product with h (which does not depend on the previous token) is one matmul
 *     for all steps before the launch (markov_head_in_kernel builds its input rows); in the
 *     chain every block computes the R-wide rest of the head itself (mk_res_head_vec). It is a
 *     programmatic dependent launch (PD_MK_CHAIN_PDL=0 at backend creation: a plain one): the
 *     w2 slice is copied before griddepcontrol.wait, so it overlaps the drain of the kernel
 *     before (the drafter's lm_head); nothing else is read or written before the wait.
 *   - markov_chain_kernel (vanilla, when that slice with one staged base row does not fit in
 *     shared memory, or PD_MK_CHAIN=old): up to MK_CHAIN_PER_SM blocks per multiprocessor (all
 *     resident), each owning a fixed vocabulary range as above and streaming its w2 rows from L2
 *     every step; per step every block gathers w1[prev] itself, writes its (value, index)
 *     partials, and waits at a grid barrier (the counter word, left zero at the end); then every
 *     block reduces all partials in block order (so every block holds the same ids) and block 0
 *     writes them. Partials alternate between two buffers, so a block that is ahead never
 *     overwrites what a slower one still reads.
 *   Both need every block resident at once (a grid sized from the occupancy API). The
 *   step logits are not written. Other shapes (f32 weights, R % 8 != 0, a gated or rnn head
 *   that does not fit the resident kernel) run the step-by-step ops, as the CPU reference.
 * Not here: shape checks (kern_ops.c). Threading: enqueues on the backend stream. */
#include "kern_cuda_internal.h"

#include <math.h>
#include <string.h>

#define MK_THREADS 256
#define MK_PER_BLOCK 512          /* vocabulary rows per block (before the SM cap) */
#define MK_SMEM_MAX (48 * 1024)
#define MK_CHAIN_PER_SM 4         /* resident blocks per SM the chain asks for at most */

/* base logit + the head's bias: with rnd (kern_backend.act_bf16) the bias is rounded to bf16,
 * then the sum, as a bf16 model adds two bf16 tensors */
static __device__ __forceinline__ float mk_add(float base, float dot, int rnd)
{
    return rnd ? kern_cuda_rnd(base + kern_cuda_rnd(dot, 1), 1) : base + dot;
}

/* block-wide (value, index) reduction; result valid in thread 0 */
static __device__ void mk_block_best(float &bv, int &bi, float *sv, int *si)
{
    kern_cuda_warp_best(bv, bi);
    __syncthreads();   /* sv/si of the previous row are read */
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = bv;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int w = 1; w < MK_THREADS / 32; w++)
            if (kern_cuda_better(sv[w], si[w], bv, bi))
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
                   unsigned int *ctr, int rnd)
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
            float val = mk_add(base[v], mk_dot<RC>((const uint4 *)(w2 + (size_t)v * R), xr, R), rnd);
            step[v] = val;
            if (kern_cuda_better(val, v, bv, bi))
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
            if (kern_cuda_better(v, i, bv, bi))
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
        markov_step_kernel<64><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter, be->act_bf16);
    else
        markov_step_kernel<0><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter, be->act_bf16);
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
                    unsigned int *ctr, int rnd)
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
                float val = mk_add(base[v], mk_dot<RC>((const uint4 *)(w2 + (size_t)v * R), xr, R), rnd);
                if (kern_cuda_better(val, v, bv, bi))
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
                if (kern_cuda_better(v, i, bv, bi))
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

/* ---- the chain with w2 resident in shared memory --------------------------------------------
 * One block per multiprocessor (MK_RES_THREADS threads), each owning `chunk` vocabulary rows:
 * its slice of w2 is copied into shared memory once per launch, so a step reads only base (fp32,
 * staged into shared memory with cp.async while the previous step waits for the other blocks)
 * and the n rows of w1[prev]. A block publishes its (value, index) partial of each row as one
 * 64-bit word with a 2-bit step tag, and every block polls all partials of the row until their
 * tags are the step's: the publication is the barrier, one global round trip instead of an
 * atomic arrival, a poll of the counter and a read of the partials. Slots alternate between two
 * parities; a block writes step k + 2 only after it read every partial of step k + 1, which each
 * block published after reading step k's, so a slot is never overwritten before all have read
 * it, and tag(k) = 1 + ((k >> 1) & 1) tells step k from step k - 2 in the same slot. The slots
 * live in the op scratch (other ops leave anything there): each block zeroes its own at the
 * start and arrives on the counter word; no block polls before all have arrived. Each block
 * arrives once more at its end; the last one leaves the counter zero. */
#define MK_RES_THREADS 512
#define MK_RES_WARPS (MK_RES_THREADS / 32)
#define MK_RES_MAX_BLOCKS 256   /* partials of a row one warp polls: 8 a lane */

/* byte offsets of the dynamic shared memory of markov_chain_res_kernel */
typedef struct {
    int chunk;          /* vocabulary rows per block (the last block may have fewer) */
    int rg;             /* rows whose base bs holds at once (n, or fewer for many rows: a step
                         * then takes its rows in groups) */
    size_t bs;          /* float [rg, chunk]: step base, then the step logits in place */
    size_t xs;          /* float [n, R]: the step's vec rows */
    size_t rows;        /* int [steps, n]: rows of base */
    size_t ids;         /* int [n]: previous tokens */
    size_t red;         /* float [n, MK_RES_WARPS] | int [n, MK_RES_WARPS]: warp partials */
    size_t es;          /* gated, rnn: float [n, R]: w1[prev] */
    size_t ss;          /* rnn: float [n, R]: the state */
    size_t ps;          /* gated, rnn: float [n, J]: the head's products */
    size_t bytes;
} mk_res_layout;

static size_t mk_align16(size_t x)
{
    return (x + 15) & ~(size_t)15;
}

/* J = rows of the head's weight (0: vanilla); rg = rows of the staged base */
static mk_res_layout mk_res_layout_of(int chunk, int n, int R, int steps, int J, int rg)
{
    mk_res_layout l;
    l.chunk = chunk;
    l.rg = rg;
    size_t o = mk_align16((size_t)chunk * R * sizeof(__nv_bfloat16));   /* w2 slice at 0 */
    l.bs = o;
    o = mk_align16(o + (size_t)rg * chunk * sizeof(float));
    l.xs = o;
    o = mk_align16(o + (size_t)n * R * sizeof(float));
    l.rows = o;
    o = mk_align16(o + (size_t)steps * n * sizeof(int));
    l.ids = o;
    o = mk_align16(o + (size_t)n * sizeof(int));
    l.red = o;
    o = mk_align16(o + (size_t)n * MK_RES_WARPS * (sizeof(float) + sizeof(int)));
    l.es = o;
    o += J > 0 ? (size_t)n * R * sizeof(float) : 0;
    l.ss = o;
    o += J > R ? (size_t)n * R * sizeof(float) : 0;
    l.ps = o;
    l.bytes = o + (size_t)n * J * sizeof(float);
    return l;
}

static __device__ __forceinline__ unsigned long long mk_ld_relaxed(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void mk_st_relaxed(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ unsigned int mk_ld_acquire(const unsigned int *p)
{
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void mk_red_release(unsigned int *p, unsigned int v)
{
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ void mk_cp_async16(void *smem, const void *gmem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

static __device__ __forceinline__ void mk_cp_async4(void *smem, const void *gmem)
{
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
}

static __device__ __forceinline__ void mk_cp_async_commit_wait(void)
{
    asm volatile("cp.async.commit_group;\n\tcp.async.wait_all;" ::: "memory");
}

static __device__ __forceinline__ void mk_cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}

static __device__ __forceinline__ void mk_cp_async_wait(void)
{
    asm volatile("cp.async.wait_all;" ::: "memory");
}

/* The chain waits with kern_cuda_pdl_wait_prev and never executes
 * griddepcontrol.launch_dependents: the next kernel starts only when every chain block has
 * exited, i.e. after the ids are written. */
/* A partial as one word: value bits | index << 2 | tag (index <= V < 2^30). */
static __device__ __forceinline__ unsigned long long mk_pack(float v, int i, unsigned tag)
{
    return (unsigned long long)__float_as_uint(v) << 32 | ((unsigned)i << 2 | tag);
}

/* Where 16-byte piece c8 of slice row lv sits: rotated by the row, so the 8 threads of a quarter
 * warp that read piece c8 of 8 consecutive rows hit 8 different bank groups. */
template <int RC>
static __device__ __forceinline__ int mk_swz(int lv, int c8, int n8)
{
    if constexpr (RC > 0) {
        static_assert((RC / 8 & (RC / 8 - 1)) == 0, "RC / 8 must be a power of two");
        return lv * (RC / 8) + ((c8 + lv) & (RC / 8 - 1));
    } else {
        return lv * n8 + (c8 + lv) % n8;
    }
}

/* Step logits of the block's slice for every row, in place of the staged base: bs[r, lv] =
 * base + sum_c w2[v0 + lv, c] * x[r, c], fp32 with c in order (mk_dot's arithmetic). RC = 64:
 * a thread converts its w2 row once into registers and reuses it for every row r. */
template <int RC>
static __device__ __forceinline__ void mk_res_logits(const uint4 *w2s, float *bs, const float *xs, int n,
                                                     int R, int cnt, int chunk, int rnd)
{
    for (int lv = threadIdx.x; lv < cnt; lv += MK_RES_THREADS) {
        if constexpr (RC > 0) {
            float wf[RC];
#pragma unroll
            for (int c8 = 0; c8 < RC / 8; c8++) {
                uint4 u = w2s[mk_swz<RC>(lv, c8, RC / 8)];
                const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float2 f = __bfloat1622float2(h[i]);
                    wf[c8 * 8 + 2 * i] = f.x;
                    wf[c8 * 8 + 2 * i + 1] = f.y;
                }
            }
            for (int r = 0; r < n; r++) {
                const float4 *x4 = (const float4 *)(xs + (size_t)r * RC);
                float dot = 0.0f;
#pragma unroll
                for (int c4 = 0; c4 < RC / 4; c4++) {
                    float4 xv = x4[c4];
                    dot = fmaf(wf[4 * c4], xv.x, dot);
                    dot = fmaf(wf[4 * c4 + 1], xv.y, dot);
                    dot = fmaf(wf[4 * c4 + 2], xv.z, dot);
                    dot = fmaf(wf[4 * c4 + 3], xv.w, dot);
                }
                bs[(size_t)r * chunk + lv] = mk_add(bs[(size_t)r * chunk + lv], dot, rnd);
            }
        } else {
            const int n8 = R / 8;
            for (int r = 0; r < n; r++) {
                const float *x = xs + (size_t)r * R;
                float dot = 0.0f;
                for (int c8 = 0; c8 < n8; c8++) {
                    uint4 u = w2s[mk_swz<0>(lv, c8, n8)];
                    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        float2 f = __bfloat1622float2(h[i]);
                        dot = fmaf(f.x, x[c8 * 8 + 2 * i], dot);
                        dot = fmaf(f.y, x[c8 * 8 + 2 * i + 1], dot);
                    }
                }
                bs[(size_t)r * chunk + lv] = mk_add(bs[(size_t)r * chunk + lv], dot, rnd);
            }
        }
    }
}

/* base rows r0 .. r0 + nr - 1 of step k for the block's slice, into bs rows 0 .. nr - 1
 * (asynchronous; the caller waits) */
static __device__ __forceinline__ void mk_res_stage_base(const kern_markov_chain_args &a, const int *rows,
                                                         float *bs, int k, int v0, int cnt, int chunk, int r0,
                                                         int nr)
{
    for (int i = threadIdx.x; i < nr * cnt; i += MK_RES_THREADS) {
        int r = i / cnt, lv = i - r * cnt;
        mk_cp_async4(bs + (size_t)r * chunk + lv,
                     a.base + (size_t)rows[k * a.n + r0 + r] * a.ld_base + v0 + lv);
    }
}

/* What the chain kernel needs of a gated or rnn head: the h part of every step's product (with
 * the bias) computed before the chain, and the columns of the head weight that multiply s and e
 * (rnn: [s ; e] = columns 0 .. 2R; gated: e = columns H .. H + R). */
typedef struct {
    const float *pre;             /* [steps n, J], row k n + r */
    const __nv_bfloat16 *w;       /* first column of the s/e part of row 0 */
    int ld_w;                     /* K */
    int rnd;                      /* kern_backend.act_bf16 (every head): the bias and the biased
                                   * logits rounded to bf16, and each op of a gated/rnn head's
                                   * R-wide arithmetic as the composition's ops round it */
    int vec16;                    /* w and ld_w allow 16-byte loads of a row */
} mk_head;

/* One product of the head's s/e part, acc over [bf16(s) ;] e against the row's R (gated) or 2R
 * (rnn) weights, fp32 in column order. R = 64 with 16-byte rows: the row's loads are all issued
 * before the first product (one L2 round trip instead of one per element); the same
 * operations in the same order either way. */
template <int RNN>
static __device__ __forceinline__ float mk_head_dot(const mk_head &hd, int j, int R, const float *s, const float *e)
{
    const __nv_bfloat16 *w = hd.w + (size_t)j * hd.ld_w;
    float acc = 0.0f;
    if (R == 64 && hd.vec16) {
        constexpr int NQ = RNN ? 16 : 8;
        uint4 u[NQ];
#pragma unroll
        for (int q = 0; q < NQ; q++)
            u[q] = __ldg((const uint4 *)w + q);
#pragma unroll
        for (int q = 0; q < NQ; q++) {
            const __nv_bfloat16 *h = (const __nv_bfloat16 *)&u[q];
            const bool sp = RNN && q < 8;   /* s part (rnn), then e */
            const int c0 = (sp ? q : q - (RNN ? 8 : 0)) * 8;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float x = sp ? __bfloat162float(__float2bfloat16_rn(s[c0 + i])) : e[c0 + i];
                acc = fmaf(__bfloat162float(h[i]), x, acc);
            }
        }
        return acc;
    }
    if (RNN) {
#pragma unroll 8
        for (int c = 0; c < R; c++)
            acc = fmaf(__bfloat162float(w[c]), __bfloat162float(__float2bfloat16_rn(s[c])), acc);
        w += R;
    }
#pragma unroll 8
    for (int c = 0; c < R; c++)
        acc = fmaf(__bfloat162float(w[c]), e[c], acc);
    return acc;
}

static __device__ __forceinline__ float mk_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));   /* kern_unary's */
}

/* vec rows of step k into xs (bf16-rounded, as markov_step rounds vec) from e = w1[prev] in es.
 * Every block computes them (the same arithmetic everywhere, so every block holds the same
 * vec). The products accumulate in fp32 with s rounded to bf16 (as matmul rounds its input);
 * the elementwise part is the composition's, one rounding per op (no contraction). Ends with a
 * block barrier. */
template <int HEAD>
static __device__ void mk_res_head_vec(const mk_head &hd, int k, int n, int R, const float *es, float *ss,
                                       float *ps, float *xs)
{
    constexpr int rnn = HEAD == KERN_MARKOV_RNN;
    const int J = rnn ? 3 * R : R;
    for (int i = threadIdx.x; i < n * J; i += MK_RES_THREADS) {
        int r = i / J, j = i - r * J;
        const float acc = mk_head_dot<rnn>(hd, j, R, ss + (size_t)r * R, es + (size_t)r * R);
        ps[i] = kern_cuda_rnd(__fadd_rn(hd.pre[((size_t)k * n + r) * J + j], acc), hd.rnd);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n * R; i += MK_RES_THREADS) {
        int r = i / R, j = i - r * R;
        float v;
        if (rnn) {
            const float *p = ps + (size_t)r * J;
            const int q = hd.rnd;
            float g = kern_cuda_rnd(mk_sigmoid(p[j]), q), ct = kern_cuda_rnd(tanhf(p[R + j]), q);
            ss[i] = kern_cuda_rnd(__fadd_rn(kern_cuda_rnd(__fmul_rn(kern_cuda_rnd(__fsub_rn(ss[i], ct), q), g), q), ct), q);
            v = kern_cuda_rnd(tanhf(p[2 * R + j]), q);
        } else {
            v = kern_cuda_rnd(__fmul_rn(kern_cuda_rnd(mk_sigmoid(ps[i]), hd.rnd), es[i]), hd.rnd);
        }
        xs[i] = __bfloat162float(__float2bfloat16_rn(v));
    }
    __syncthreads();
}

template <int RC, int HEAD>
__global__ void __launch_bounds__(MK_RES_THREADS, 1)
markov_chain_res_kernel(kern_markov_chain_args a, int V, int R, mk_res_layout lay, mk_head hd,
                        unsigned long long *slots, unsigned int *ctr)
{
    extern __shared__ __align__(16) unsigned char smem[];
    uint4 *w2s = (uint4 *)smem;
    float *bs = (float *)(smem + lay.bs);
    float *xs = (float *)(smem + lay.xs);
    int *rows = (int *)(smem + lay.rows);
    int *ids = (int *)(smem + lay.ids);
    float *red_v = (float *)(smem + lay.red);
    int *red_i = (int *)(red_v + (size_t)a.n * MK_RES_WARPS);
    float *es = (float *)(smem + lay.es), *ss = (float *)(smem + lay.ss), *ps = (float *)(smem + lay.ps);
    const int nb = gridDim.x, n = a.n, chunk = lay.chunk, n8 = R / 8;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int v0 = blockIdx.x * chunk, cnt = v0 + chunk < V ? chunk : V - v0;
    const __nv_bfloat16 *w1 = (const __nv_bfloat16 *)a.w1.data;
    const __nv_bfloat16 *w2 = (const __nv_bfloat16 *)a.w2.data;

    /* Only the weight slice before griddepcontrol.wait (see markov_chain_res): w2 never depends
     * on an earlier kernel, and this touches shared memory only. Its copies stay in flight
     * through the wait; the first cp.async wait below covers them. */
    for (int i = threadIdx.x; i < cnt * n8; i += MK_RES_THREADS) {
        int lv = i / n8, c8 = i - lv * n8;
        mk_cp_async16(w2s + mk_swz<RC>(lv, c8, n8), w2 + ((size_t)(v0 + lv) * R + c8 * 8));
    }
    mk_cp_async_commit();
    kern_cuda_pdl_wait_prev();
    for (int i = threadIdx.x; i < 2 * n; i += MK_RES_THREADS)
        mk_st_relaxed(slots + (size_t)i * nb + blockIdx.x, 0ull);
    for (int i = threadIdx.x; i < a.steps * n; i += MK_RES_THREADS)
        rows[i] = a.rows[(size_t)(i / n) * a.ld_rows + i % n];
    for (int r = threadIdx.x; r < n; r += MK_RES_THREADS)
        ids[r] = a.prev[r];
    if (HEAD == KERN_MARKOV_RNN)
        for (int i = threadIdx.x; i < n * R; i += MK_RES_THREADS)
            ss[i] = 0.0f;
    __syncthreads();   /* the zeroed slots and the rows */
    if (threadIdx.x == 0) {
        __threadfence();   /* the zeroes of the whole block before the arrival */
        mk_red_release(ctr, 1u);
    }
    const int rg = lay.rg;
    mk_res_stage_base(a, rows, bs, 0, v0, cnt, chunk, 0, min(rg, n));
    mk_cp_async_commit_wait();
    __syncthreads();
    for (int k = 0; k < a.steps; k++) {
        for (int i = threadIdx.x; i < n * n8; i += MK_RES_THREADS) {
            int r = i / n8, c8 = i - r * n8;
            uint4 u = __ldg((const uint4 *)(w1 + (size_t)ids[r] * R) + c8);
            const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
            float *x = (HEAD == KERN_MARKOV_VANILLA ? xs : es) + (size_t)r * R + c8 * 8;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float2 f = __bfloat1622float2(h[j]);
                x[2 * j] = f.x;
                x[2 * j + 1] = f.y;
            }
        }
        __syncthreads();
        if (HEAD != KERN_MARKOV_VANILLA)
            mk_res_head_vec<HEAD>(hd, k, n, R, es, ss, ps, xs);
        /* the rows in groups of rg (one group unless many rows): logits of the block's slice,
         * then each row's best of it per warp */
        for (int g0 = 0; g0 < n; g0 += rg) {
            const int nr = min(rg, n - g0);
            if (g0 > 0) {   /* this group's base: bs is free once every warp read the last */
                __syncthreads();
                mk_res_stage_base(a, rows, bs, k, v0, cnt, chunk, g0, nr);
                mk_cp_async_commit_wait();
                __syncthreads();
            }
            mk_res_logits<RC>(w2s, bs, xs + (size_t)g0 * R, nr, R, cnt, chunk, hd.rnd);
            for (int r = 0; r < nr; r++) {
                float bv = -INFINITY;
                int bi = V;
                for (int lv = threadIdx.x; lv < cnt; lv += MK_RES_THREADS) {
                    float val = bs[(size_t)r * chunk + lv];
                    if (kern_cuda_better(val, v0 + lv, bv, bi))
                        bv = val, bi = v0 + lv;
                }
                kern_cuda_warp_best(bv, bi);
                if (lane == 0) {
                    red_v[(g0 + r) * MK_RES_WARPS + warp] = bv;
                    red_i[(g0 + r) * MK_RES_WARPS + warp] = bi;
                }
            }
        }
        __syncthreads();   /* every read of bs is done: the next step's base may land there */
        if (k + 1 < a.steps) {
            mk_res_stage_base(a, rows, bs, k + 1, v0, cnt, chunk, 0, min(rg, n));
            mk_cp_async_commit();
        }
        const unsigned tag = 1u + ((unsigned)(k >> 1) & 1u);
        if (k == 0 && warp < n) {
            if (lane == 0) {
                while (mk_ld_acquire(ctr) < (unsigned)nb)
                    ;
                __threadfence();
            }
            __syncwarp();
        }
        for (int r = warp; r < n; r += MK_RES_WARPS) {
            float bv = lane < MK_RES_WARPS ? red_v[r * MK_RES_WARPS + lane] : -INFINITY;
            int bi = lane < MK_RES_WARPS ? red_i[r * MK_RES_WARPS + lane] : V;
            kern_cuda_warp_best(bv, bi);
            unsigned long long *sl = slots + ((size_t)(k & 1) * n + r) * nb;
            if (lane == 0)
                mk_st_relaxed(sl + blockIdx.x, mk_pack(bv, bi, tag));
            unsigned long long w[MK_RES_MAX_BLOCKS / 32];
            for (;;) {
                bool fresh = true;
#pragma unroll
                for (int m = 0; m < MK_RES_MAX_BLOCKS / 32; m++) {
                    int b = lane + 32 * m;
                    if (b < nb) {
                        w[m] = mk_ld_relaxed(sl + b);
                        fresh = fresh && ((unsigned)w[m] & 3u) == tag;
                    }
                }
                if (__all_sync(0xffffffffu, fresh))
                    break;
            }
            bv = -INFINITY;
            bi = V;
#pragma unroll
            for (int m = 0; m < MK_RES_MAX_BLOCKS / 32; m++) {
                if (lane + 32 * m < nb) {
                    float v = __uint_as_float((unsigned)(w[m] >> 32));
                    int i = (int)((unsigned)w[m] >> 2);
                    if (kern_cuda_better(v, i, bv, bi))
                        bv = v, bi = i;
                }
            }
            kern_cuda_warp_best(bv, bi);
            if (lane == 0) {
                int id = bi < V ? bi : 0;   /* all -inf/NaN: index 0, as kern_argmax */
                ids[r] = id;
                if (blockIdx.x == 0)
                    a.prev[(size_t)(k + 1) * a.ld_prev + r] = id;
            }
        }
        mk_cp_async_wait();
        __syncthreads();   /* ids and the next base */
    }
    /* the last block to arrive here knows every block is past its first poll: reset */
    if (threadIdx.x == 0 && atomicAdd(ctr, 1u) == 2u * (unsigned)nb - 1u)
        atomicExch(ctr, 0u);
}

/* A vanilla chain step by step (kern_markov_chain_by_steps) in the workspace (vec | step). */
static pd_status markov_chain_composed(kern_backend *be, const kern_markov_chain_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    int V = (int)a->w2.rows, R = (int)a->w2.cols;
    /* vec and step sit past what the launches below take from the same scratch (markov_step's
     * partials: n nb 8 bytes with nb <= 4 n_sm; a composed step's bf16 copy of vec: n R 2 bytes),
     * so those never overwrite them */
    size_t skip = (size_t)a->n * 4 * c->n_sm * 8;
    if (skip < (size_t)a->n * R * 2)
        skip = (size_t)a->n * R * 2;
    skip = (skip + 255) & ~(size_t)255;
    void *ws = NULL;
    size_t bytes = skip + ((size_t)a->n * R + (size_t)a->n * V) * sizeof(float);
    pd_status st = kern_cuda_ws_get(c, bytes, &ws, err);
    if (st != PD_OK)
        return st;
    float *vec = (float *)((char *)ws + skip);
    return kern_markov_chain_by_steps(be, a, vec, vec + (size_t)a->n * R, err);
}

/* Rows of the head's input with h in place and zeros for s and e: in[k n + r, :] = [h ; 0]
 * (gated) or [0 ; 0 ; h] (rnn), h = hidden[rows[k, r], 0:H] at column h0 of K. */
__global__ void markov_head_in_kernel(const float *hidden, int ld_hidden, const int32_t *rows, int ld_rows,
                                      int n, int steps, int K, int H, int h0, float *in)
{
    size_t total = (size_t)steps * n * K;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += stride) {
        int q = (int)(i / K), c = (int)(i % K), k = q / n, r = q % n;
        const float *h = hidden + (size_t)rows[(size_t)k * ld_rows + r] * ld_hidden;
        in[i] = c >= h0 && c < h0 + H ? h[c - h0] : 0.0f;
    }
}

typedef void (*mk_res_fn)(kern_markov_chain_args, int, int, mk_res_layout, mk_head, unsigned long long *,
                          unsigned int *);

template <int RC>
static mk_res_fn mk_res_pick(kern_markov_head head)
{
    switch (head) {
    case KERN_MARKOV_GATED: return markov_chain_res_kernel<RC, KERN_MARKOV_GATED>;
    case KERN_MARKOV_RNN: return markov_chain_res_kernel<RC, KERN_MARKOV_RNN>;
    default: return markov_chain_res_kernel<RC, KERN_MARKOV_VANILLA>;
    }
}

/* The resident kernel when its shared memory fits with one block per multiprocessor (a gated
 * or rnn head's h products computed first, into scratch); *ran = 0 leaves the chain to the
 * caller. */
static pd_status markov_chain_res(kern_backend *be, const kern_markov_chain_args *a, int *ran, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    int V = (int)a->w2.rows, R = (int)a->w2.cols, n = a->n;
    int head = a->head != KERN_MARKOV_VANILLA;
    int J = head ? (int)a->head_w.rows : 0, K = head ? (int)a->head_w.cols : 0;
    *ran = 0;
    if (c->mk_chain_old || V >= (1 << 30) || ((uintptr_t)a->w1.data & 15) != 0 ||
        (head && a->head_w.dtype != KERN_DTYPE_BF16))
        return PD_OK;
    int nb = (V + MK_RES_THREADS - 1) / MK_RES_THREADS;
    if (nb > c->n_sm)
        nb = c->n_sm;
    if (nb > MK_RES_MAX_BLOCKS)
        nb = MK_RES_MAX_BLOCKS;
    int chunk = (V + nb - 1) / nb;
    nb = (V + chunk - 1) / chunk;
    int optin = 0;
    PD_CUDA_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->device), err);
    /* the base of as many rows as fit next to the slice (many rows: a step takes them in
     * groups, each staged in turn; H100, 32 rows: 1.76 ms in the L2-streaming kernel) */
    mk_res_layout lay = mk_res_layout_of(chunk, n, R, a->steps, J, 0);
    if (lay.bytes + (size_t)chunk * sizeof(float) > (size_t)optin)
        return PD_OK;   /* the slice does not fit with one row of base */
    int rg = (int)(((size_t)optin - lay.bytes) / ((size_t)chunk * sizeof(float)));
    rg = rg < n ? rg : n;
    lay = mk_res_layout_of(chunk, n, R, a->steps, J, rg);
    while (rg > 1 && lay.bytes > (size_t)optin)   /* alignment padding */
        lay = mk_res_layout_of(chunk, n, R, a->steps, J, --rg);
    if (lay.bytes > (size_t)optin)
        return PD_OK;
    mk_res_fn kern = R == 64 ? mk_res_pick<64>(a->head) : mk_res_pick<0>(a->head);
    /* on every launch: the attribute belongs to the current device (a host call) */
    PD_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)lay.bytes), err);
    int per_sm = 0;
    PD_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, MK_RES_THREADS, lay.bytes), err);
    if (per_sm < 1)
        return PD_OK;
    mk_head hd = { NULL, NULL, 0, be->act_bf16, 0 };
    if (head) {
        int gated = a->head == KERN_MARKOV_GATED, H = K - (gated ? R : 2 * R);
        float *in = a->scratch, *pre = in + (size_t)a->steps * n * K;
        size_t total = (size_t)a->steps * n * K;
        markov_head_in_kernel<<<kern_cuda_blocks(total, 256), 256, 0, c->stream>>>(
            a->hidden, a->ld_hidden, a->rows, a->ld_rows, n, a->steps, K, H, gated ? 0 : 2 * R, in);
        KERN_CUDA_LAUNCH_CHECK(err);
        kern_matmul_args mm = { .x = in, .ld_x = K, .w = a->head_w, .bias = a->head_b, .y = pre, .ld_y = J,
                                .m = a->steps * n, .n = J, .k = K, .accumulate = 0 };
        pd_status st = kern_cuda_matmul_launch(be, &mm, err);
        if (st != PD_OK)
            return st;
        hd.pre = pre;
        hd.w = (const __nv_bfloat16 *)a->head_w.data + (gated ? H : 0);
        hd.ld_w = K;
        hd.vec16 = ((uintptr_t)hd.w & 15) == 0 && K % 8 == 0;
    }
    void *ws = NULL;
    pd_status st = kern_cuda_ws_get(c, (size_t)2 * n * nb * sizeof(unsigned long long), &ws, err);
    if (st != PD_OK)
        return st;
    /* Programmatic dependent launch (unless PD_MK_CHAIN_PDL=0): once every block of the previous
     * kernel has started and executed launch_dependents (the skinny GEMM of the drafter's
     * lm_head does so at its start), the chain's blocks may start on the multiprocessors that
     * kernel leaves free and copy their w2 slice while it drains; everything else (base, rows,
     * prev, hidden products, the slots in the shared workspace, the counter) comes after
     * griddepcontrol.wait, which returns once that kernel has completed and its writes are
     * visible. Captured into graphs as a programmatic edge, as the skinny kernel's launch.
     * No deadlock at the grid barrier: the early start happens only once every block of the
     * earlier kernel is already running (so the chain never takes a multiprocessor one of them
     * still needs), that kernel never waits for the chain, and before the wait a chain block
     * only copies. A block spins on other blocks only after its own wait returned, i.e. once
     * the earlier kernel has completed and freed every multiprocessor; then the blocks not yet
     * started fit, since the grid was sized to be resident at once (nb <= n_sm, one block per
     * multiprocessor, checked above). The kernel after the chain cannot start early either:
     * the chain never triggers it, so it starts when every chain block has exited. */
    PD_CUDA_TRY(kern_cuda_launch(c->stream, dim3((unsigned)nb), dim3(MK_RES_THREADS), lay.bytes, c->mk_chain_pdl,
                                 kern, *a, V, R, lay, hd, (unsigned long long *)ws, c->counter),
                err);
    KERN_CUDA_LAUNCH_CHECK(err);
    *ran = 1;
    return PD_OK;
}

extern "C" pd_status kern_cuda_markov_chain_launch(kern_backend *be, const kern_markov_chain_args *a,
                                                   pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->n <= 0)
        return PD_OK;
    int V = (int)a->w2.rows, R = (int)a->w2.cols;
    int head = a->head != KERN_MARKOV_VANILLA;
    size_t smem = (size_t)a->n * R * sizeof(float) + (size_t)a->n * sizeof(int);
    if (a->w1.dtype != KERN_DTYPE_BF16 || a->w2.dtype != KERN_DTYPE_BF16 || R % 8 != 0 ||
        ((uintptr_t)a->w2.data & 15) != 0 || smem > MK_SMEM_MAX)
        return head ? kern_markov_chain_by_steps(be, a, NULL, NULL, err) : markov_chain_composed(be, a, err);
    int ran = 0;
    pd_status st = markov_chain_res(be, a, &ran, err);
    if (st != PD_OK || ran)
        return st;
    if (head)   /* the L2-streaming kernel has the vanilla head only */
        return kern_markov_chain_by_steps(be, a, NULL, NULL, err);
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
    st = kern_cuda_ws_get(c, (size_t)2 * a->n * nb * 8, &ws, err);
    if (st != PD_OK)
        return st;
    float *pv = (float *)ws;
    int *pi = (int *)(pv + (size_t)2 * a->n * nb);
    if (R == 64)
        markov_chain_kernel<64><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter, be->act_bf16);
    else
        markov_chain_kernel<0><<<nb, MK_THREADS, smem, c->stream>>>(*a, V, R, chunk, pv, pi, c->counter, be->act_bf16);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
