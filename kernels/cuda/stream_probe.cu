/* stream_probe.cu - how fast can one persistent CTA per SM stream read-only bytes, and by which
 *   mechanism? (issue #3: a persistent decode-step kernel needs a weight stream near the copy
 *   rate; the shared-memory rings built so far moved 16-22 GB/s per SM).
 * Every case reads the same 1 GiB buffer once per run (no L2 reuse: the L2 is 50-60 MB), folds
 *   what it read into one word per CTA (so no load is dead), and is timed with CUDA events:
 *   median of 9 runs after 2 warm-ups. The ceiling is a device-to-device cudaMemcpyAsync of
 *   the same size, counted as bytes read + written, in the same process.
 * Cases (grid = one CTA per SM unless named):
 *   ldg T U      T threads, each loads U x 16 bytes (unrolled, all in flight), then folds them
 *   ldg-many     8 CTAs of 256 threads per SM, U = 4 (a non-persistent reference)
 *   bulk C S P   one warp's P lanes each copy C bytes per stage with cp.async.bulk into S stages
 *                (a stage = P x C bytes, one mbarrier); 8 consumer warps wait for a stage, read
 *                all of it from shared memory (16 bytes a lane), then free it
 *   cpasync S U  16 warps, each its own ring of S stages of U x 512 bytes (16-byte cp.async per
 *                lane, commit/wait_group), reading back its own stages
 * Built as pdspark-stream-probe (kernels/cuda/CMakeLists.txt). Run: pdspark-stream-probe [skel]
 *   (skel: the skeleton cases only).
 * Not part of the engine; bench only. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

static __device__ __forceinline__ uint4 ldg_nc(const uint4 *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

/* Each CTA streams a contiguous slice [begin, end) of 16-byte words. */
template <int U>
__global__ void ldg_kernel(const uint4 *buf, size_t words, unsigned *out)
{
    size_t per = (words + gridDim.x - 1) / gridDim.x;
    size_t begin = per * blockIdx.x, end = begin + per < words ? begin + per : words;
    unsigned acc = 0;
    for (size_t i = begin + threadIdx.x; i < end; i += (size_t)blockDim.x * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            size_t j = i + (size_t)u * blockDim.x;
            v[u] = j < end ? ldg_nc(buf + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++)
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u)
        out[blockIdx.x] = acc;
}

static __device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void mbar_init(uint64_t *b, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count));
}

static __device__ __forceinline__ void mbar_expect_tx(uint64_t *b, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void mbar_arrive(uint64_t *b)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}

static __device__ __forceinline__ void mbar_wait(uint64_t *b, unsigned parity)
{
    asm volatile("{\n .reg .pred p;\n WAIT_%=:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 " @!p bra WAIT_%=;\n}" ::"r"(smem_addr(b)), "r"(parity) : "memory");
}

static __device__ __forceinline__ void bulk_copy(void *dst, const void *src, unsigned bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

#define BULK_CONSUMERS 8

/* A ring of S stages: full[s] completes when stage s's bytes landed (one arrival with the byte
 * count, then the copies), empty[s] when every consumer warp freed it. Whole CTA. */
static __device__ void ring_init(uint64_t *full, uint64_t *empty, int S)
{
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], BULK_CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

/* The producer warp's stage i (stage bytes from src, its lanes < P copying C bytes each) into
 * ring slot i % S, once the consumers freed it. */
static __device__ __forceinline__ void ring_produce(uint64_t *full, uint64_t *empty, char *ring, int S, long i,
                                                    const char *src, int C, int P)
{
    const int lane = threadIdx.x & 31;
    const size_t stage = (size_t)C * P;
    int s = (int)(i % S);
    if (i >= S)
        mbar_wait(&empty[s], (unsigned)((i / S - 1) & 1));
    if (lane == 0)
        mbar_expect_tx(&full[s], (unsigned)stage);
    __syncwarp();
    if (lane < P)
        bulk_copy(ring + (size_t)s * stage + (size_t)lane * C, src + (size_t)lane * C, (unsigned)C, &full[s]);
}

/* One producer warp (lanes < P copy C bytes each per stage) and BULK_CONSUMERS consumer warps. */
__global__ void bulk_kernel(const char *buf, size_t bytes, int C, int S, int P, unsigned *out)
{
    extern __shared__ __align__(128) char smem[];
    uint64_t *full = (uint64_t *)smem, *empty = full + S;
    char *ring = smem + 128 * ((16 * S + 127) / 128 + 1) - 128 + 128;
    const size_t stage = (size_t)C * P;
    size_t per = (bytes / gridDim.x) / stage * stage;
    const char *src = buf + per * blockIdx.x;
    const long nst = (long)(per / stage);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    ring_init(full, empty, S);
    unsigned acc = 0;
    if (warp == BULK_CONSUMERS) {
        for (long i = 0; i < nst; i++)
            ring_produce(full, empty, ring, S, i, src + (size_t)i * stage, C, P);
    } else {
        for (long i = 0; i < nst; i++) {
            int s = (int)(i % S);
            mbar_wait(&full[s], (unsigned)((i / S) & 1));
            const uint4 *st = (const uint4 *)(ring + (size_t)s * stage);
            for (size_t j = threadIdx.x; j < stage / 16; j += BULK_CONSUMERS * 32) {
                uint4 v = st[j];
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
            }
            __syncwarp();
            if (lane == 0)
                mbar_arrive(&empty[s]);
        }
    }
    if (acc == 0x9e3779b9u)
        out[blockIdx.x] = acc;
}

/* 16 warps, each with its own ring of S stages of U x 512 bytes. RING 0 waits for every copy in
 * flight before it reads a stage (wait_group 0), RING 1 only for the oldest (wait_group S - 1). */
template <int U, int S, int RING>
__global__ void cpasync_kernel(const char *buf, size_t bytes, unsigned *out)
{
    extern __shared__ __align__(128) char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const size_t stage = (size_t)U * 512;
    char *ring = smem + (size_t)warp * S * stage;
    size_t per = (bytes / gridDim.x / nw) / stage * stage;
    const char *src = buf + per * ((size_t)blockIdx.x * nw + warp);
    const long nst = (long)(per / stage);
    unsigned acc = 0;
    for (long i = 0; i < nst + S - 1; i++) {
        if (i < nst) {
            char *dst = ring + (size_t)(i % S) * stage;
#pragma unroll
            for (int u = 0; u < U; u++)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst + u * 512 + lane * 16)),
                             "l"(src + (size_t)i * stage + u * 512 + lane * 16) : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
        long c = i - (S - 1);
        if (c >= 0) {
            asm volatile("cp.async.wait_group %0;" ::"n"(RING ? S - 1 : 0) : "memory");
            const char *st = ring + (size_t)(c % S) * stage;
#pragma unroll
            for (int u = 0; u < U; u++) {
                uint4 v = *(const uint4 *)(st + u * 512 + lane * 16);
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
            }
        }
    }
    if (acc == 0x9e3779b9u)
        out[blockIdx.x] = acc;
}

/* ---- the decode step's skeleton: 36 layers of phases separated by grid barriers ----------
 * Phases of a Qwen3-4B layer at batch 1: QKV 31.5 MB, attention (no weight bytes: CTAs < 64 spin
 * for att_ns, standing in for its latency chain), o_proj 21 MB, gate/up 99.6 MB, down 49.8 MB.
 * Each layer's weights are fresh bytes (36 x 202 MB). After every phase all CTAs meet at a grid
 * barrier (a monotonic counter), and the first thing a CTA does after one is to read a word
 * another CTA wrote before it (x). Modes:
 *   0 coupled: all 16 warps load their slice with ldg (U = 4), loads stop at each barrier
 *   1 coupled + the first batch of the next phase's loads issued before the barrier
 *   2 decoupled: one producer warp streams every phase's slices into a ring of 16 KB stages
 *     with cp.async.bulk and never waits for a barrier; 8 consumer warps read the stages
 *   3 no barriers at all (the stream alone, same slices) */
#define SK_PHASES 5
struct skel_cfg {
    const char *w;            /* 36 layers x layer_bytes */
    size_t layer_bytes;
    size_t phase_off[SK_PHASES], phase_bytes[SK_PHASES];
    int layers;
    long att_ns;
    int att_ctas;
    unsigned *bar;            /* grid barrier counter, zeroed before the launch */
    unsigned *xword;          /* x: written before a barrier, read after */
    unsigned *out;
    int ring_stages;
};

static __device__ __forceinline__ void grid_barrier(unsigned *bar, unsigned target)
{
    __threadfence();
    atomicAdd(bar, 1u);
    unsigned v;
    do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
    } while (v < target);
}

static __device__ __forceinline__ void spin_ns(long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long)(t - t0) < ns);
}

/* this CTA's slice of a phase, in 16 KB units */
static __device__ __forceinline__ void skel_slice(const skel_cfg &c, int layer, int ph, const char **p, long *units)
{
    size_t per = (c.phase_bytes[ph] / gridDim.x) / 16384 * 16384;
    *p = c.w + (size_t)layer * c.layer_bytes + c.phase_off[ph] + per * blockIdx.x;
    *units = (long)(per / 16384);
}

/* The grid barrier after a phase (number gen), for the CTA's first `threads` threads (named
 * barrier 1): CTA 0 writes x before it, every CTA reads x after it (the next phase's input). */
static __device__ __forceinline__ unsigned skel_meet(const skel_cfg &c, unsigned gen, unsigned *red, int threads)
{
    asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0)
            atomicExch(c.xword, gen);
        grid_barrier(c.bar, gen * gridDim.x);
        red[0] = *(volatile unsigned *)c.xword;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
    return red[0];
}

/* Phase ph of layer l: the attention stand-in (0 returned: CTAs < att_ctas spin for att_ns), or
 * this CTA's slice of the phase's weights (1). */
static __device__ __forceinline__ int skel_phase(const skel_cfg &c, int l, int ph, const char **p, long *units)
{
    if (c.phase_bytes[ph] == 0) {
        if ((int)blockIdx.x < c.att_ctas && threadIdx.x == 0)
            spin_ns(c.att_ns);
        return 0;
    }
    skel_slice(c, l, ph, p, units);
    return 1;
}

template <int MODE>
__global__ void __launch_bounds__(512, 1) skel_coupled(skel_cfg c)
{
    __shared__ unsigned red[16];
    unsigned acc = 0, gen = 0;
    uint4 pre[4];
    bool have_pre = false;
    for (int l = 0; l < c.layers; l++)
        for (int ph = 0; ph < SK_PHASES; ph++) {
            const char *p;
            long units;
            if (skel_phase(c, l, ph, &p, &units)) {
                const uint4 *w = (const uint4 *)p;
                long words = units * 1024;
                long i0 = threadIdx.x;
                if (have_pre) {
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        acc ^= pre[u].x ^ pre[u].w;
                    i0 += 4 * 512;
                    have_pre = false;
                }
                for (long i = i0; i < words; i += 4 * 512) {
                    uint4 v[4];
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        v[u] = i + u * 512 < words ? ldg_nc(w + i + u * 512) : make_uint4(0, 0, 0, 0);
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        acc ^= v[u].x ^ v[u].w;
                }
            }
            if (MODE == 3)
                continue;
            /* the next phase's first batch, before the barrier */
            int nl = l, np = ph + 1;
            if (np == SK_PHASES) { np = 0; nl++; }
            if (MODE == 1 && nl < c.layers && c.phase_bytes[np] != 0) {
                const char *p;
                long units;
                skel_slice(c, nl, np, &p, &units);
#pragma unroll
                for (int u = 0; u < 4; u++)
                    pre[u] = ldg_nc((const uint4 *)p + threadIdx.x + u * 512);
                have_pre = true;
            }
            acc ^= skel_meet(c, ++gen, red, 512);
        }
    if (acc == 0x9e3779b9u)
        c.out[blockIdx.x] = acc;
}

/* MATH: each consumer warp takes its 128 of a stage's 1024 16-byte words as the A fragments of
 * 4 mma.m16n8k16 (weights pre-packed in fragment order: a lane's 16 bytes at lane * 16), with a
 * fixed B fragment (x) in registers: the instruction mix of a one-row product per stage */
template <int MATH>
__global__ void __launch_bounds__(288, 1) skel_decoupled(skel_cfg c)
{
    extern __shared__ __align__(128) char smem[];
    const int S = c.ring_stages;
    uint64_t *full = (uint64_t *)smem, *empty = full + S;
    char *ring = smem + 1024;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __shared__ unsigned red[1];
    ring_init(full, empty, S);
    unsigned acc = 0;
    if (warp == BULK_CONSUMERS) {
        long i = 0;
        for (int l = 0; l < c.layers; l++)
            for (int ph = 0; ph < SK_PHASES; ph++) {
                if (c.phase_bytes[ph] == 0)
                    continue;
                const char *p;
                long units;
                skel_slice(c, l, ph, &p, &units);
                for (long u = 0; u < units; u++, i++)
                    ring_produce(full, empty, ring, S, i, p + u * 16384, 4096, 4);
            }
        return;
    }
    long i = 0;
    unsigned gen = 0;
    float mac[4] = {0, 0, 0, 0};
    const uint32_t bx0 = 0x3f803f80u ^ lane, bx1 = 0x3f803f80u ^ (lane << 1);
    for (int l = 0; l < c.layers; l++)
        for (int ph = 0; ph < SK_PHASES; ph++) {
            const char *p;
            long units;
            if (skel_phase(c, l, ph, &p, &units)) {
                for (long u = 0; u < units; u++, i++) {
                    int s = (int)(i % S);
                    mbar_wait(&full[s], (unsigned)((i / S) & 1));
                    const uint4 *st = (const uint4 *)(ring + (size_t)s * 16384);
                    if (MATH) {
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            uint4 a = st[warp * 128 + j * 32 + lane];
                            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                                         : "+f"(mac[0]), "+f"(mac[1]), "+f"(mac[2]), "+f"(mac[3])
                                         : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(bx0), "r"(bx1));
                        }
                    } else {
#pragma unroll
                        for (int j = 0; j < 4; j++) {
                            uint4 v = st[threadIdx.x + j * 256];
                            acc ^= v.x ^ v.w;
                        }
                    }
                    __syncwarp();
                    if (lane == 0)
                        mbar_arrive(&empty[s]);
                }
            }
            acc ^= skel_meet(c, ++gen, red, 256);
        }
    if (acc == 0x9e3779b9u || mac[0] + mac[1] + mac[2] + mac[3] == 1.2345f)
        c.out[blockIdx.x] = acc;
}

typedef void (*runner)(void);
static const char *g_buf;
static size_t g_bytes;
static unsigned *g_out;
static int g_sm;

static float median_ms(void (*launch)(void *), void *arg)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 2; i++)
        launch(arg);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int i = 0; i < 9; i++) {
        CK(cudaEventRecord(a));
        launch(arg);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

struct ldg_arg { int threads, u, ctas_per_sm; };
static void run_ldg(void *p)
{
    ldg_arg *a = (ldg_arg *)p;
    size_t words = g_bytes / 16;
    dim3 grid((unsigned)(g_sm * a->ctas_per_sm));
    switch (a->u) {
    case 1: ldg_kernel<1><<<grid, a->threads>>>((const uint4 *)g_buf, words, g_out); break;
    case 2: ldg_kernel<2><<<grid, a->threads>>>((const uint4 *)g_buf, words, g_out); break;
    case 4: ldg_kernel<4><<<grid, a->threads>>>((const uint4 *)g_buf, words, g_out); break;
    default: ldg_kernel<8><<<grid, a->threads>>>((const uint4 *)g_buf, words, g_out); break;
    }
}

struct bulk_arg { int c, s, p; };
static void run_bulk(void *p)
{
    bulk_arg *a = (bulk_arg *)p;
    size_t smem = 128 * ((16 * a->s + 127) / 128 + 1) + (size_t)a->c * a->p * a->s;
    bulk_kernel<<<g_sm, (BULK_CONSUMERS + 1) * 32, smem>>>(g_buf, g_bytes, a->c, a->s, a->p, g_out);
}

struct cpa_arg { int s, u, ring; };
template <int U, int S, int RING>
static void launch_cpa(void)
{
    static bool attr = false;
    if (!attr) {
        CK(cudaFuncSetAttribute(cpasync_kernel<U, S, RING>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
        attr = true;
    }
    cpasync_kernel<U, S, RING><<<g_sm, 512, (size_t)16 * S * U * 512>>>(g_buf, g_bytes, g_out);
}
static void run_cpa(void *p)
{
    cpa_arg *a = (cpa_arg *)p;
    int key = (a->u * 10 + a->s) * 2 + a->ring;
    switch (key) {
    case (24 * 2): launch_cpa<2, 4, 0>(); break;
    case (24 * 2 + 1): launch_cpa<2, 4, 1>(); break;
    case (26 * 2): launch_cpa<2, 6, 0>(); break;
    case (26 * 2 + 1): launch_cpa<2, 6, 1>(); break;
    case (42 * 2): launch_cpa<4, 2, 0>(); break;
    case (42 * 2 + 1): launch_cpa<4, 2, 1>(); break;
    case (43 * 2): launch_cpa<4, 3, 0>(); break;
    default: launch_cpa<4, 3, 1>(); break;
    }
}

struct skel_arg { int mode; long att_ns; int stages; skel_cfg c; };
static void run_skel(void *p)
{
    skel_arg *a = (skel_arg *)p;
    CK(cudaMemsetAsync(a->c.bar, 0, sizeof(unsigned)));
    a->c.ring_stages = a->stages;
    a->c.att_ns = a->att_ns;
    void *args[] = {&a->c};
    switch (a->mode) {
    case 0: CK(cudaLaunchCooperativeKernel((void *)skel_coupled<0>, g_sm, 512, args, 0, 0)); break;
    case 1: CK(cudaLaunchCooperativeKernel((void *)skel_coupled<1>, g_sm, 512, args, 0, 0)); break;
    case 3: CK(cudaLaunchCooperativeKernel((void *)skel_coupled<3>, g_sm, 512, args, 0, 0)); break;
    case 4:
        CK(cudaLaunchCooperativeKernel((void *)skel_decoupled<1>, g_sm, (BULK_CONSUMERS + 1) * 32, args,
                                       1024 + (size_t)a->stages * 16384, 0));
        break;
    default:
        CK(cudaLaunchCooperativeKernel((void *)skel_decoupled<0>, g_sm, (BULK_CONSUMERS + 1) * 32, args,
                                       1024 + (size_t)a->stages * 16384, 0));
    }
}

static void skel_cases(double copy_tbs)
{
    skel_cfg c;
    memset(&c, 0, sizeof c);
    const double mb = 1e6;
    double ph[SK_PHASES] = {31.5 * mb, 0, 21.0 * mb, 99.6 * mb, 49.8 * mb};
    size_t off = 0;
    for (int i = 0; i < SK_PHASES; i++) {
        c.phase_off[i] = off;
        c.phase_bytes[i] = (size_t)ph[i];
        off += (c.phase_bytes[i] + 4095) / 4096 * 4096;
    }
    c.layer_bytes = off;
    c.layers = 36;
    c.att_ctas = 64;
    char *w;
    CK(cudaMalloc(&w, c.layer_bytes * c.layers));
    CK(cudaMemset(w, 0x5b, c.layer_bytes * c.layers));
    c.w = w;
    CK(cudaMalloc(&c.bar, 256));
    CK(cudaMalloc(&c.xword, 256));
    CK(cudaMemset(c.xword, 0, 256));
    c.out = g_out;
    CK(cudaFuncSetAttribute(skel_decoupled<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    CK(cudaFuncSetAttribute(skel_decoupled<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    /* bytes actually read: each CTA's slice is rounded down to 16 KB units */
    double read = 0;
    for (int i = 0; i < SK_PHASES; i++)
        read += (double)((c.phase_bytes[i] / g_sm) / 16384 * 16384) * g_sm;
    read *= c.layers;
    double floor_ms = read / (copy_tbs * 1e12) * 1e3;
    printf("\nskeleton: %d layers, %.1f MB read per layer, floor at the copy rate %.3f ms (%.2f us per layer)\n",
           c.layers, read / c.layers / 1e6, floor_ms, floor_ms * 1e3 / c.layers);
    printf("%-44s %10s %12s %10s\n", "case", "ms", "us/layer", "x floor");
    struct { int mode; long att; int st; const char *name; } cs[] = {
        {3, 0, 0, "stream only (no barriers)"},
        {0, 0, 0, "coupled ldg, barriers, no attention"},
        {0, 8000, 0, "coupled ldg, attention 8 us"},
        {1, 0, 0, "coupled + prefetch, no attention"},
        {1, 8000, 0, "coupled + prefetch, attention 8 us"},
        {2, 0, 12, "decoupled bulk 192 KB, no attention"},
        {2, 8000, 12, "decoupled bulk 192 KB, attention 8 us"},
        {2, 8000, 8, "decoupled bulk 128 KB, attention 8 us"},
        {2, 8000, 6, "decoupled bulk 96 KB, attention 8 us"},
        {2, 8000, 13, "decoupled bulk 208 KB, attention 8 us"},
        {4, 0, 12, "decoupled + mma, 192 KB, no attention"},
        {4, 8000, 12, "decoupled + mma, 192 KB, attention 8 us"},
        {2, 12000, 12, "decoupled bulk 192 KB, attention 12 us"},
        {0, 12000, 0, "coupled ldg, attention 12 us"},
    };
    for (auto &k : cs) {
        skel_arg a;
        a.mode = k.mode;
        a.att_ns = k.att;
        a.stages = k.st;
        a.c = c;
        float ms = median_ms(run_skel, &a);
        printf("%-44s %10.3f %12.2f %10.3f\n", k.name, ms, ms * 1e3 / c.layers, ms / floor_ms);
    }
    CK(cudaFree(w));
}

static char *g_dst;
static void run_copy(void *p)
{
    (void)p;
    CK(cudaMemcpyAsync(g_dst, g_buf, g_bytes, cudaMemcpyDeviceToDevice));
}

int main(int argc, char **argv)
{
    int only_skel = argc > 1 && strcmp(argv[1], "skel") == 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    g_sm = prop.multiProcessorCount;
    g_bytes = (size_t)1 << 30;
    char *buf;
    CK(cudaMalloc(&buf, g_bytes));
    CK(cudaMalloc(&g_dst, g_bytes));
    CK(cudaMalloc(&g_out, 4096 * sizeof(unsigned)));
    /* fresh non-zero contents */
    std::vector<uint32_t> h(1 << 20);
    for (size_t i = 0; i < h.size(); i++)
        h[i] = (uint32_t)(i * 2654435761u) | 1u;
    for (size_t off = 0; off < g_bytes; off += h.size() * 4)
        CK(cudaMemcpy(buf + off, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    g_buf = buf;
    CK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));

    float cms = median_ms(run_copy, NULL);
    double copy_tbs = 2.0 * g_bytes / (cms * 1e-3) / 1e12;
    printf("device %s, %d SMs; copy %.3f ms = %.3f TB/s (read + written)\n", prop.name, g_sm, cms, copy_tbs);
    printf("%-28s %10s %10s %10s %12s\n", "case", "ms", "TB/s", "of copy", "GB/s per SM");
#define TBS(ms) (g_bytes / ((ms) * 1e-3) / 1e12)
#define REPORT(name, ms) printf("%-28s %10.3f %10.3f %9.1f%% %12.1f\n", name, ms, TBS(ms), \
                                100.0 * TBS(ms) / copy_tbs, TBS(ms) * 1e3 / g_sm)
    char name[64];
    if (only_skel) {
        skel_cases(copy_tbs);
        return 0;
    }
    {
        ldg_arg a = {256, 4, 8};
        REPORT("ldg-many 8x256 U4", median_ms(run_ldg, &a));
    }
    int th[] = {256, 512, 1024}, us[] = {1, 2, 4, 8};
    for (int ti = 0; ti < 3; ti++)
        for (int ui = 0; ui < 4; ui++) {
            ldg_arg a = {th[ti], us[ui], 1};
            snprintf(name, sizeof name, "ldg T%d U%d (%dKB)", th[ti], us[ui], th[ti] * us[ui] * 16 / 1024);
            REPORT(name, median_ms(run_ldg, &a));
        }
    int cs[] = {1024, 2048, 4096, 8192, 16384, 32768};
    for (int ci = 0; ci < 6; ci++)
        for (int p = 1; p <= 8; p *= 2) {
            int c = cs[ci];
            int stage = c * p;
            if (stage > 64 * 1024 || stage < 4096)
                continue;
            int s = (192 * 1024) / stage;
            if (s > 32)
                s = 32;
            bulk_arg a = {c, s, p};
            snprintf(name, sizeof name, "bulk C%d P%d S%d (%dKB)", c, p, s, s * stage / 1024);
            REPORT(name, median_ms(run_bulk, &a));
            if (s > 4) {
                bulk_arg b = {c, 4, p};
                snprintf(name, sizeof name, "bulk C%d P%d S4 (%dKB)", c, p, 4 * stage / 1024);
                REPORT(name, median_ms(run_bulk, &b));
            }
        }
    cpa_arg ca[] = {{4, 2, 0}, {6, 2, 0}, {2, 4, 0}, {3, 4, 0}, {4, 2, 1}, {6, 2, 1}, {2, 4, 1}, {3, 4, 1}};
    for (auto &a : ca) {
        snprintf(name, sizeof name, "cpasync%s S%d U%d (%dKB)", a.ring ? "-ring" : "", a.s, a.u, 16 * a.s * a.u / 2);
        REPORT(name, median_ms(run_cpa, &a));
    }
    skel_cases(copy_tbs);
    return 0;
}
