/* mma_probe.cu - do wgmma and mma.sync give the same bits? (issue #3 and the large-batch gap:
 *   the batch-invariant products are built on mma.sync m16n8k16 so that every row count gets the
 *   decode step's bits; a wgmma form of the products at many rows could keep those bits only if
 *   the two instructions round alike.)
 * Every trial is one 64 x NB output tile: A (64 x K bf16, the weights), B (NB x K bf16, the rows),
 *   C0 (64 x NB fp32, the running sums), D = C0 + A B^T accumulated over K / 16 chunks of 16 k in
 *   order, each chunk one instruction; the value distribution spans 2^-12..2^12 with random
 *   signs (cancellation and exponent alignment inside an instruction), C0 the same range.
 * Forms compared, each against `mma` (mma.sync m16n8k16, natural k slots):
 *   mma-swap,   mma.sync with the chunk's 16 k in another slot order (halves swapped; reversed;
 *   mma-rev     A and B alike): does the order inside one instruction matter?
 *   mma-k8      two m16n8k8 per chunk (k 0..7 then 8..15)
 *   wg8 / wg64  wgmma m64n8k16 / m64n64k16 from shared memory (no swizzle, K-major core
 *               matrices), C0 loaded into the accumulators; wg64's columns 0..7 also against wg8
 *   wg64-rs     wgmma m64n64k16 with A from registers in mma.sync's A fragment layout
 *   wg8x        wg8 with the descriptor's two byte offsets exchanged (which reading is right is
 *               told by the fp64 reference below, not assumed; on sm_90 it faults, so it runs only
 *               when asked for by index)
 *   Each form is also checked against fp64 C0 + A B^T (max relative error over the tile's norm),
 *   so a layout mistake shows as a large error, not as a bit mismatch.
 * Run: pdspark-mma-probe [trials [form]] (default 2048 trials, every form but wg8x; a form index
 *   runs it and mma only, so that a fault names its form: 1 mma-swap, 2 mma-rev, 3 mma-k8, 4 wg8,
 *   5 wg8x, 6 wg64, 7 wg64-rs). Prints per form: elements that differ from
 *   `mma` in any bit, the largest difference in units of the last place, and the fp64 error.
 * Not part of the engine; a probe only. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

enum { M = 64, NB = 64, J = 8, K = 16 * J };

static __device__ __forceinline__ uint32_t pk(__nv_bfloat16 lo, __nv_bfloat16 hi)
{
    return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}

/* slot -> k offset inside a chunk, per permutation form */
static __device__ __forceinline__ int slot_k(int perm, int s)
{
    if (perm == 1)
        return s ^ 8;                       /* halves swapped */
    if (perm == 2)
        return 15 - s;                      /* reversed */
    return s;
}

/* The accumulators (a warpgroup's, or the 4 warps' of mma_kernel) of columns 0..N-1 of a 64 x NB
 * tile, in mma.sync's C layout per warp: d[4 nt + r] is row 16 w + g (+ 8 for r >= 2), column
 * 8 nt + 2 t (+ 1 for odd r) */
static __device__ __forceinline__ int acc_at(int nt, int r)
{
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    return (16 * w + g + (r >= 2 ? 8 : 0)) * NB + 8 * nt + 2 * t + (r & 1);
}

template <int N>
static __device__ __forceinline__ void acc_load(float *d, const float *tile)
{
#pragma unroll
    for (int i = 0; i < N / 2; i++)
        d[i] = tile[acc_at(i / 4, i % 4)];
}

template <int N>
static __device__ __forceinline__ void acc_store(const float *d, float *tile)
{
#pragma unroll
    for (int i = 0; i < N / 2; i++)
        tile[acc_at(i / 4, i % 4)] = d[i];
}

/* mma.sync's A fragment of rows r0, r0 + 8 (a0/a1 at k slots k0, k1; a2/a3 at k2, k3) */
static __device__ __forceinline__ void frag_a(const __nv_bfloat16 *A, int r0, int k0, int k1, int k2, int k3,
                                              uint32_t *a)
{
    const int r1 = r0 + 8;
    a[0] = pk(A[r0 * K + k0], A[r0 * K + k1]);
    a[1] = pk(A[r1 * K + k0], A[r1 * K + k1]);
    a[2] = pk(A[r0 * K + k2], A[r0 * K + k3]);
    a[3] = pk(A[r1 * K + k2], A[r1 * K + k3]);
}

/* mma.sync over all chunks; 4 warps, warp w rows 16w.., every n tile of NB. form 0..2: one
 * m16n8k16 per chunk with slot_k's order; 3: two m16n8k8 per chunk (k 0..7, then 8..15). */
__global__ void mma_kernel(const __nv_bfloat16 *A, const __nv_bfloat16 *B, const float *C0, float *D,
                           int form)
{
    const size_t tr = blockIdx.x;
    A += tr * M * K; B += tr * NB * K; C0 += tr * M * NB; D += tr * M * NB;
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    const int r0 = 16 * w + g, r1 = r0 + 8;
    for (int nt = 0; nt < NB / 8; nt++) {
        const int bn = 8 * nt + g;
        float d[4];
        for (int r = 0; r < 4; r++)
            d[r] = C0[acc_at(nt, r)];
        for (int j = 0; j < J; j++) {
            const int kb = 16 * j;
            if (form == 3) {
                for (int h = 0; h < 2; h++) {
                    const int k0 = kb + 8 * h + 2 * t;
                    uint32_t a0 = pk(A[r0 * K + k0], A[r0 * K + k0 + 1]);
                    uint32_t a1 = pk(A[r1 * K + k0], A[r1 * K + k0 + 1]);
                    uint32_t b0 = pk(B[bn * K + k0], B[bn * K + k0 + 1]);
                    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                                 "{%4,%5}, {%6}, {%0,%1,%2,%3};"
                                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                                 : "r"(a0), "r"(a1), "r"(b0));
                }
                continue;
            }
            const int k0 = kb + slot_k(form, 2 * t), k1 = kb + slot_k(form, 2 * t + 1);
            const int k2 = kb + slot_k(form, 2 * t + 8), k3 = kb + slot_k(form, 2 * t + 9);
            uint32_t a[4];
            frag_a(A, r0, k0, k1, k2, k3, a);
            uint32_t b0 = pk(B[bn * K + k0], B[bn * K + k1]), b1 = pk(B[bn * K + k2], B[bn * K + k3]);
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                         "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        }
        for (int r = 0; r < 4; r++)
            D[acc_at(nt, r)] = d[r];
    }
}

/* Shared-memory image of a K-major operand of R rows: chunk j, core matrix (row group i, k half
 * kc) of 8 rows x 16 bytes at j * R * 32 + i * 256 + kc * 128. */
static __device__ __forceinline__ int core_off(int R, int row, int k)
{
    const int j = k >> 4, kc = (k >> 3) & 1, i = row >> 3;
    return j * R * 32 + i * 256 + kc * 128 + (row & 7) * 16 + (k & 7) * 2;
}

static __device__ __forceinline__ uint64_t desc(const void *p, int lbo, int sbo)
{
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    return (uint64_t)((a >> 4) & 0x3FFF) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}

/* An operand of R rows into shared memory as core_off's K-major image (the caller fences it for
 * wgmma's async-proxy reads) */
template <int R>
static __device__ __forceinline__ void stage(__nv_bfloat16 *dst, const __nv_bfloat16 *src)
{
    for (int e = threadIdx.x; e < R * K; e += blockDim.x)
        dst[core_off(R, e / K, e % K) / 2] = src[e];
}

/* the 32 accumulators of an m64n64 wgmma: the asm's outputs and their register list */
#define WG_D32 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), \
    "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
    "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), \
    "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), \
    "+f"(d[31])
#define WG_D32_REGS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "

template <int N>
static __device__ __forceinline__ void wg_mma(float *d, uint64_t da, uint64_t db);

template <>
__device__ __forceinline__ void wg_mma<8>(float *d, uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db), "r"(1));
}

template <>
__device__ __forceinline__ void wg_mma<64>(float *d, uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 WG_D32_REGS
                 "%32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_D32
                 : "l"(da), "l"(db), "r"(1));
}

/* wgmma m64nNk16 over all chunks, one warpgroup; lbo/sbo as given to the descriptors (the image
 * always has k halves 128 bytes apart and row groups 256 apart). */
template <int N>
__global__ void wg_kernel(const __nv_bfloat16 *A, const __nv_bfloat16 *B, const float *C0, float *D,
                          int lbo, int sbo)
{
    __shared__ __align__(128) __nv_bfloat16 sa[M * K];
    __shared__ __align__(128) __nv_bfloat16 sb[N * K];
    const size_t tr = blockIdx.x;
    A += tr * M * K; B += tr * NB * K; C0 += tr * M * NB; D += tr * M * NB;
    stage<M>(sa, A);
    stage<N>(sb, B);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    float d[N / 2];
    acc_load<N>(d, C0);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int j = 0; j < J; j++)
        wg_mma<N>(d, desc(sa + j * M * 16, lbo, sbo), desc(sb + j * N * 16, lbo, sbo));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    acc_store<N>(d, D);
}

/* wgmma m64n64k16 with A from registers: warp w of the warpgroup holds rows 16 w.. in mma.sync's
 * A fragment layout (a0 row g k 2t.., a1 row g + 8, a2 row g k 2t + 8.., a3 row g + 8 k 2t + 8..) */
__global__ void wg_rs_kernel(const __nv_bfloat16 *A, const __nv_bfloat16 *B, const float *C0, float *D)
{
    __shared__ __align__(128) __nv_bfloat16 sb[NB * K];
    const size_t tr = blockIdx.x;
    A += tr * M * K; B += tr * NB * K; C0 += tr * M * NB; D += tr * M * NB;
    stage<NB>(sb, B);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    const int r0 = 16 * w + g;
    float d[NB / 2];
    acc_load<NB>(d, C0);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int k0 = 16 * j + 2 * t, k2 = k0 + 8;
        uint32_t a[4];
        frag_a(A, r0, k0, k0 + 1, k2, k2 + 1, a);
        uint64_t db = desc(sb + j * NB * 16, 128, 256);
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     WG_D32_REGS
                     "{%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
                     : WG_D32
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    acc_store<NB>(d, D);
}

static uint64_t rng = 0x243f6a8885a308d3ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}
static float wide(void)                       /* sign x 2^[-12, 12) x [1, 2) */
{
    float m = 1.0f + (float)(rnd() & 0xFFFF) / 65536.0f;
    float v = ldexpf(m, (int)(rnd() % 24) - 12);
    return (rnd() & 1) ? -v : v;
}

static long ulp_diff(float a, float b)
{
    int32_t ia, ib;
    memcpy(&ia, &a, 4); memcpy(&ib, &b, 4);
    if (ia < 0) ia = (int32_t)0x80000000 - ia;
    if (ib < 0) ib = (int32_t)0x80000000 - ib;
    return labs((long)ia - (long)ib);
}

struct cmp { long diff, maxulp; };

/* elements of D (cols < ncols) that differ from R in any bit */
static cmp compare(const float *D, const float *R, int trials, int ncols)
{
    cmp c = {0, 0};
    for (int tr = 0; tr < trials; tr++)
        for (int r = 0; r < M; r++)
            for (int n = 0; n < ncols; n++) {
                size_t i = (size_t)tr * M * NB + r * NB + n;
                if (memcmp(&D[i], &R[i], 4) != 0) {
                    c.diff++;
                    long u = ulp_diff(D[i], R[i]);
                    if (u > c.maxulp) c.maxulp = u;
                }
            }
    return c;
}

/* largest |D - ref| / (|C0| + sum |a b|) over elements (cols < ncols) */
static double ref_err(const float *D, const float *A, const float *B, const float *C0, int trials, int ncols)
{
    double worst = 0;
    for (int tr = 0; tr < trials; tr++)
        for (int r = 0; r < M; r++)
            for (int n = 0; n < ncols; n++) {
                double s = C0[(size_t)tr * M * NB + r * NB + n], mag = fabs(s);
                for (int k = 0; k < K; k++) {
                    double p = (double)A[((size_t)tr * M + r) * K + k] * B[((size_t)tr * NB + n) * K + k];
                    s += p; mag += fabs(p);
                }
                double e = fabs(D[(size_t)tr * M * NB + r * NB + n] - s) / (mag > 0 ? mag : 1);
                if (e > worst) worst = e;
            }
    return worst;
}

int main(int argc, char **argv)
{
    int trials = argc > 1 ? atoi(argv[1]) : 2048;
    if (trials < 1 || trials > 65536) {
        fprintf(stderr, "pdspark-mma-probe: trials must be 1..65536, got %s\n", argv[1]);
        return 2;
    }
    int only = argc > 2 ? atoi(argv[2]) : -1;          /* run mma and this form only */
    if (argc > 2 && (only < 1 || only > 7)) {
        fprintf(stderr, "pdspark-mma-probe: form must be 1..7, got %s\n", argv[2]);
        return 2;
    }
    int dev = 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s (sm_%d%d), trials %d, tile %d x %d, K %d (%d chunks of 16)\n", prop.name,
           prop.major, prop.minor, trials, M, NB, K, J);
    size_t na = (size_t)trials * M * K, nb = (size_t)trials * NB * K, nc = (size_t)trials * M * NB;
    float *fa = (float *)malloc(na * 4), *fb = (float *)malloc(nb * 4), *fc = (float *)malloc(nc * 4);
    __nv_bfloat16 *ha = (__nv_bfloat16 *)malloc(na * 2), *hb = (__nv_bfloat16 *)malloc(nb * 2);
    for (size_t i = 0; i < na; i++) { ha[i] = __float2bfloat16(wide()); fa[i] = __bfloat162float(ha[i]); }
    for (size_t i = 0; i < nb; i++) { hb[i] = __float2bfloat16(wide()); fb[i] = __bfloat162float(hb[i]); }
    for (size_t i = 0; i < nc; i++) fc[i] = wide() * 16.0f;
    __nv_bfloat16 *dA, *dB;
    float *dC, *dD;
    CK(cudaMalloc(&dA, na * 2)); CK(cudaMalloc(&dB, nb * 2));
    CK(cudaMalloc(&dC, nc * 4)); CK(cudaMalloc(&dD, nc * 4));
    CK(cudaMemcpy(dA, ha, na * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, hb, nb * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dC, fc, nc * 4, cudaMemcpyHostToDevice));

    const char *names[] = {"mma", "mma-swap", "mma-rev", "mma-k8", "wg8", "wg8x", "wg64", "wg64-rs"};
    const int ncols[] = {NB, NB, NB, NB, 8, 8, NB, NB};
    float *out[8] = {0};
    for (int f = 0; f < 8; f++) {
        if ((only >= 0 && f != 0 && f != only) || (only < 0 && f == 5))
            continue;
        fprintf(stderr, "form %s\n", names[f]);
        CK(cudaMemset(dD, 0xFF, nc * 4));
        if (f <= 3)
            mma_kernel<<<trials, 128>>>(dA, dB, dC, dD, f);
        else if (f == 4)
            wg_kernel<8><<<trials, 128>>>(dA, dB, dC, dD, 128, 256);
        else if (f == 5)
            wg_kernel<8><<<trials, 128>>>(dA, dB, dC, dD, 256, 128);
        else if (f == 6)
            wg_kernel<64><<<trials, 128>>>(dA, dB, dC, dD, 128, 256);
        else
            wg_rs_kernel<<<trials, 128>>>(dA, dB, dC, dD);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        out[f] = (float *)malloc(nc * 4);
        CK(cudaMemcpy(out[f], dD, nc * 4, cudaMemcpyDeviceToHost));
    }
    int ref_trials = trials < 64 ? trials : 64;
    printf("%-9s %8s %14s %10s %12s\n", "form", "cols", "differ-from-mma", "max-ulp", "fp64-rel-err");
    for (int f = 0; f < 8; f++) {
        if (out[f] == NULL)
            continue;
        cmp c = compare(out[f], out[0], trials, ncols[f]);
        double e = ref_err(out[f], fa, fb, fc, ref_trials, ncols[f]);
        printf("%-9s %8d %14ld %10ld %12.3e\n", names[f], ncols[f], c.diff, c.maxulp, e);
    }
    if (out[6] == NULL || out[4] == NULL)
        return 0;
    cmp c = compare(out[6], out[4], trials, 8);
    printf("wg64 cols 0..7 against wg8: %ld elements differ (max %ld ulp) of %ld\n", c.diff, c.maxulp,
           (long)trials * M * 8);
    printf("elements per full comparison: %ld\n", (long)trials * M * NB);
    return 0;
}
