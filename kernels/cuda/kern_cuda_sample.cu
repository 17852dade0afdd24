/* kern_cuda_sample.cu - sampling on the device: tempered / filtered probabilities, inverse-CDF
 *   sampling and rejection-sampling verification (the rules of pd_sample.h, kern_backend.h).
 * Owns: kern_cuda_probs_launch, kern_cuda_sample_launch, kern_cuda_spec_verify_launch,
 *   kern_cuda_logprobs_launch (a block per
 *   row: log-sum-exp in double, the token's rank as a count of the logits at or above its own,
 *   the top entries by a radix select over the logits' order keys, ties at the cut by lowest
 *   index, then sorted as the reference's list).
 *   A row of probs or sample spreads over C CTAs of 1024 threads (1, 2, 4, 8 or 16: the most
 *   whose clusters all run at once for the launch's rows, so a lone row uses 16 SMs and a
 *   batch that fills the device one CTA a row; pr_cluster_size), C > 1 being a thread-block
 *   cluster that exchanges through distributed shared memory; spec_verify is one block per
 *   request. Every sum is an integer or runs in a fixed order, so a result depends only on its
 *   inputs, not on C, the batch or the schedule (seeds reproduce on the device too).
 *   probs: softmax with exp in double as the CPU reference; its denominator is the sum of the
 *     e's rounded to integers in units of 2^-96 (pr_fix96), exact in any order, so the float
 *     probabilities match the reference's (a sequential double sum) to an ulp and the same
 *     tokens survive the filter. min-p / top-k / top-p / typical-p need no sort: each stage's
 *     survivors are a prefix of an order over a key of p alone (p's bits descending for the
 *     first three; typical-p's score ascending, its double's bits reversed) with index
 *     ascending, found by radix selects over the key's bits (11 a pass: 3 passes for p, 6 for a
 *     score) whose histograms count tokens and their mass. Masses are integers in units of
 *     2^-60 (two 32-bit words per bin, lanes with equal p adding once), as the rule defines
 *     them, so the sums are the same whatever order the atomics land in. A select stops at the
 *     highest key t whose "tokens >= t" reach k (top-k: its ties stay) or carry ceil(top_p or
 *     typical_p * the survivors' mass); of the tokens at t the lowest indices are kept (their
 *     masses scanned in index order) until the mass is reached, as the reference's sorted scan
 *     does. Each stage leaves its survivors undivided and the rest 0, and lists them (slice
 *     positions in shared memory) for the next; one pass divides at the end. typical-p's
 *     entropy is a sum of integer terms and its logarithms kern_typical_log's (kern_backend.h),
 *     the host's arithmetic, so the scores are the reference's bits; a token's logarithm is
 *     taken once and kept for the select's passes. Tokens with p = 0 stay out of the
 *     histograms: whether one is kept changes no output.
 *     With C CTAs, CTA q holds the slice [q seg, (q + 1) seg) in shared memory (the out row
 *     when it does not fit): the row is read once and written once. A pass's histograms are
 *     summed over the cluster by range (rank q the bins [q per, (q + 1) per)); every CTA then
 *     finds the cut from the same integers. With PD_PROBS_GATHER=1, once at most PR_GATHER
 *     tokens survive min-p / top-k (or top-p, before typical-p), every CTA gathers them in index
 *     order and finishes the row alone, with no further exchange (off by default: on an H100
 *     it took 106 / 118 us against 91 / 99 us at 1 / 8 rows with Qwen3's defaults, the same
 *     elsewhere; same results either way).
 *   sample: the running sum in index order is split over 1024 (virtual) threads in contiguous
 *     segments (double, an exclusive scan over them); the first token whose running sum
 *     exceeds u wins. With C CTAs each runs 1024 / C of those threads with the same sums in the
 *     same order and the same scan, so the token does not depend on C. Sums differ from the
 *     CPU's sequential ones by rounding, so a u within ~1e-15 of a CDF boundary may pick the
 *     neighbour.
 * Not here: shape checks (kern_ops.c), drawing uniforms (the caller's rng).
 * Threading: enqueues on the backend stream; no workspace (shared memory only) and no host
 *   sync, so launches can be captured; the first probs or sample launch of a context asks the
 *   device's limits (pr_setup), outside any capture in the engine (its graphs warm up eagerly). */
#include "kern_cuda_internal.h"

#include <cooperative_groups.h>
#include <math.h>
#include <stdlib.h>

namespace cg = cooperative_groups;

#define SP_THREADS 1024
#define SP_WARPS (SP_THREADS / 32)
#define SP_BINS 2048
#define SP_FIX_SCALE 1152921504606846976.0   /* 2^60: masses as integers */

typedef unsigned long long ull;

/* ---- block-wide helpers (every thread of the block must call them) ------------------------- */

static __device__ float sp_block_max(float v, float *sh)
{
    v = kern_cuda_warp_max(v);
    if ((threadIdx.x & 31) == 0)
        sh[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = kern_cuda_warp_max(sh[threadIdx.x]);
        if (threadIdx.x == 0)
            sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

static __device__ double sp_warp_sum_d(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ double sp_block_sum_d(double v, double *sh)
{
    v = sp_warp_sum_d(v);
    if ((threadIdx.x & 31) == 0)
        sh[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = sp_warp_sum_d(sh[threadIdx.x]);
        if (threadIdx.x == 0)
            sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

/* Exclusive prefix sum over the block in thread order (double: the sampling CDF; ull: integer
 * masses); *total (nullable) gets the block's sum. sh: 2 * SP_WARPS values. */
template <class T>
static __device__ T sp_block_excl_scan(T v, T *sh, T *total)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        T t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o)
            incl += t;
    }
    T excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0)
        excl = 0;
    if (lane == 31)
        sh[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        T w = sh[lane], wi = w;
        for (int o = 1; o < 32; o <<= 1) {
            T t = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o)
                wi += t;
        }
        T we = __shfl_up_sync(0xffffffffu, wi, 1);
        sh[32 + lane] = lane == 0 ? 0 : we;
    }
    __syncthreads();
    T r = sh[32 + warp] + excl;
    if (total != NULL)
        *total = sh[32 + SP_WARPS - 1] + sh[SP_WARPS - 1];
    __syncthreads();
    return r;
}

static __device__ int sp_block_min_i(int v, int *sh)
{
    for (int o = 16; o > 0; o >>= 1)
        v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0)
        sh[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = sh[threadIdx.x];
        for (int o = 16; o > 0; o >>= 1)
            v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (threadIdx.x == 0)
            sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

static __device__ int sp_block_max_i(int v, int *sh)
{
    return -sp_block_min_i(-v, sh);
}

/* One tile of a block-wide rank in thread order: *rank = how many threads below this one have
 * flag set; returns how many threads have it. sh: SP_WARPS + 1 ints. */
static __device__ int sp_block_rank(bool flag, int *rank, int *sh)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned int bal = __ballot_sync(0xffffffffu, flag);
    if (lane == 0)
        sh[warp] = __popc(bal);
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int w = 0; w < SP_WARPS; w++) {
            int cnt = sh[w];
            sh[w] = acc;
            acc += cnt;
        }
        sh[SP_WARPS] = acc;
    }
    __syncthreads();
    *rank = sh[warp] + __popc(bal & ((1u << lane) - 1u));
    int total = sh[SP_WARPS];
    __syncthreads();
    return total;
}

/* Inverse CDF over val(0..n-1) in index order (entries <= 0 skipped): the first i whose running
 * sum exceeds u, else the last i with mass (0 when none). Thread t owns a contiguous segment. */
template <class F>
static __device__ int sp_block_icdf(F val, int n, double u, double *shd, int *shi)
{
    int seg = (n + SP_THREADS - 1) / SP_THREADS;
    int lo = threadIdx.x * seg, hi = lo + seg < n ? lo + seg : n;
    double s = 0.0;
    int last = -1;
    for (int i = lo; i < hi; i++) {
        float v = val(i);
        if (!(v <= 0.0f)) {   /* as the reference: a NaN counts (and poisons the sums after it) */
            s += (double)v;
            last = i;
        }
    }
    double cum = sp_block_excl_scan(s, shd, (double *)NULL);
    int found = n;
    if (last >= 0 && !(u >= cum + s)) {
        for (int i = lo; i < hi; i++) {
            float v = val(i);
            if (v <= 0.0f)
                continue;
            cum += (double)v;
            if (u < cum) {
                found = i;
                break;
            }
        }
    }
    found = sp_block_min_i(found, shi);
    if (found < n)
        return found;
    last = sp_block_max_i(last, shi);
    return last >= 0 ? last : 0;
}

/* the values sp_block_icdf walks: a probability row, or a normalised residual max(0, p - q) */
struct sp_row {
    const float *p;
    __device__ float operator()(int i) const { return p[i]; }
};

struct sp_residual {
    const float *p, *q;
    double mass;
    __device__ float operator()(int i) const
    {
        float v = p[i] - q[i];
        return v > 0.0f ? (float)((double)v / mass) : 0.0f;
    }
};

/* ---- probs ---------------------------------------------------------------------------------- */

#define PR_MIN_SLICE 2048    /* a row is split only into slices of at least this many tokens */
#define PR_SLOTS 16          /* exchanges in one launch, each with its own mailbox */
#define PR_GATHER 1024       /* survivors a CTA gathers to finish a row alone (one per thread) */

static __device__ __forceinline__ ull sp_fix(float p)
{
    return __double2ull_rn((double)p * SP_FIX_SCALE);
}

/* A mass bin as two 32-bit words (64-bit shared atomics spin on a compare-and-swap), the low
 * one first (read together as one 64-bit value): the low word's wrap-arounds carry into the
 * high one, so the sum stays exact in any order. */
static __device__ __forceinline__ void sp_mass_add(ull *bin, ull v)
{
    unsigned int *w = (unsigned int *)bin;
    unsigned int l = (unsigned int)v, h = (unsigned int)(v >> 32);
    unsigned int old = atomicAdd(&w[0], l);
    if (old + l < old)
        h++;
    if (h != 0)
        atomicAdd(&w[1], h);
}

static __device__ ull sp_block_sum_u(ull v, ull *sh)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0)
        sh[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = sh[threadIdx.x];
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0)
            sh[0] = v;
    }
    __syncthreads();
    v = sh[0];
    __syncthreads();
    return v;
}

static __device__ __forceinline__ ull sp_warp_sum_u(ull v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* The softmax denominator as an integer in units of 2^-96, two 64-bit words (hi, lo): each
 * e in [0, 1] is rounded to the nearest unit, so the sum is the same in any order and for any
 * split of the row (2^31 terms of at most 2^32 cannot wrap the high word). */
static __device__ __forceinline__ void pr_add128(ull *hi, ull *lo, ull h, ull l)
{
    *lo += l;
    *hi += h + (*lo < l ? 1ull : 0ull);
}

static __device__ __forceinline__ void pr_fix96(double e, ull *hi, ull *lo)
{
    const double two64 = 18446744073709551616.0;
    const double v = e * 79228162514264337593543950336.0;   /* 2^96: exact */
    if (v < two64) {
        *hi = 0;
        *lo = __double2ull_rn(v);
    } else {   /* v >= 2^64 is an integer: both parts are exact */
        const double h = floor(v * (1.0 / two64));
        *hi = (ull)h;
        *lo = (ull)(v - h * two64);
    }
}

static __device__ __forceinline__ void pr_warp_sum128(ull *hi, ull *lo)
{
    for (int o = 16; o > 0; o >>= 1) {
        const ull h = __shfl_xor_sync(0xffffffffu, *hi, o), l = __shfl_xor_sync(0xffffffffu, *lo, o);
        pr_add128(hi, lo, h, l);
    }
}

/* The CTAs of one row: C of them (a thread-block cluster when C > 1), this one of rank `rank`.
 * Every function below is called by all threads of all C CTAs in the same order. */
static __device__ __forceinline__ void pr_sync(int C)
{
    if (C > 1)
        cg::this_cluster().sync();   /* also a barrier of this CTA, with release/acquire */
    else
        __syncthreads();
}

/* p in the shared memory of rank r of the cluster */
template <class T>
static __device__ __forceinline__ T *pr_at(T *p, int r, int C)
{
    return C > 1 ? cg::this_cluster().map_shared_rank(p, (unsigned int)r) : p;
}

/* The shared memory of a probs CTA besides its slice (dynamic: more than 48 KiB) */
struct pr_smem {
    unsigned int hc[SP_BINS];        /* this CTA's histogram of a pass (counts, masses); after */
    ull hm[SP_BINS];                 /*   the merge, a copy of the range that holds the cut */
    unsigned int mc[SP_BINS];        /* the cluster's counts and masses of the bins of this rank's */
    ull mm[SP_BINS];                 /*   range (bin rank * per + j at j) */
    ull rng_m;                       /* and their totals */
    unsigned int rng_c;
    int found, fg, digit, cnt_t;     /* a pass's answer */
    unsigned int fac, cnt_above;
    ull fam, mass_above;
    ull xch[PR_SLOTS][3];            /* mailboxes: each exchange of a launch writes its own */
    float gp[PR_GATHER];             /* the gathered survivors: p, */
    int gi[PR_GATHER];               /*   index in the row, */
    unsigned short gl[2][PR_GATHER]; /*   and lists of them */
    float shf[SP_WARPS];
    int shi[SP_WARPS + 1];
    ull shu[SP_WARPS], shs[2 * SP_WARPS];
};

/* Where the dynamic shared memory of a probs CTA puts its parts (host and device agree) */
struct pr_layout {
    size_t lq, pv, l0, l1, bytes;
};

static __host__ __device__ size_t pr_align16(size_t n) { return (n + 15) & ~(size_t)15; }

static __host__ __device__ pr_layout pr_layout_of(int seg, int pv_smem, int lists, int lq_smem)
{
    pr_layout l;
    size_t o = pr_align16(sizeof(pr_smem));
    l.lq = o;
    o += lq_smem ? pr_align16((size_t)seg * sizeof(double)) : 0;
    l.pv = o;
    o += pv_smem ? pr_align16((size_t)seg * sizeof(float)) : 0;
    l.l0 = o;
    o += lists ? pr_align16((size_t)seg * sizeof(unsigned short)) : 0;
    l.l1 = o;
    o += lists ? pr_align16((size_t)seg * sizeof(unsigned short)) : 0;
    l.bytes = o;
    return l;
}

/* One probs launch: the op's args and the split of a row over its CTAs */
struct pr_params {
    kern_probs_args a;
    int C;           /* CTAs per row; the CTAs of row r are r C .. r C + C - 1 (one cluster) */
    int seg;         /* rank q owns the tokens [q seg, min(n, (q + 1) seg)) of its row */
    int pv_smem;     /* 1: the slice's probabilities in shared memory; 0: in its out row */
    int lists;       /* 1: each stage's survivors listed in shared memory (pv_smem, seg <= 65536) */
    int lq_smem;     /* 1: typical-p's logarithms kept per token (lists) */
    int gather;      /* 1: few survivors are gathered into every CTA, which finishes alone */
};

/* Exchanges: thread 0 of every CTA writes mailbox s, then lane r of every warp reads rank r's
 * (so a CTA's reads of all C go out at once) and the warp reduces them */
static __device__ void pr_publish(pr_smem *sm, int s, ull v0, ull v1, ull v2, int C)
{
    if (threadIdx.x == 0) {
        sm->xch[s][0] = v0;
        sm->xch[s][1] = v1;
        sm->xch[s][2] = v2;
    }
    pr_sync(C);
}

static __device__ __forceinline__ ull pr_box(pr_smem *sm, int s, int r, int j, int C)
{
    return pr_at(&sm->xch[s][0], r, C)[j];
}

/* rank `lane`'s word j of mailbox s, 0 in the lanes past the ranks (and past `below`) */
static __device__ __forceinline__ ull pr_lane_box(pr_smem *sm, int s, int j, int C, int below)
{
    const int lane = threadIdx.x & 31;
    return lane < C && lane < below ? pr_box(sm, s, lane, j, C) : 0ull;
}

static __device__ float pr_cl_max(float v, pr_smem *sm, int *s, int C)
{
    v = sp_block_max(v, sm->shf);
    pr_publish(sm, *s, __float_as_uint(v), 0, 0, C);
    float w = (threadIdx.x & 31) < C ? __uint_as_float((unsigned int)pr_box(sm, *s, threadIdx.x & 31, 0, C))
                                     : -INFINITY;
    ++*s;
    return fmaxf(v, kern_cuda_warp_max(w));
}

/* the cluster's sums of a and b; *slot gets the mailbox holding each rank's */
static __device__ void pr_cl_sum2(ull a, ull b, pr_smem *sm, int *s, int C, ull *sa, ull *sb, int *slot)
{
    a = sp_block_sum_u(a, sm->shu);
    b = sp_block_sum_u(b, sm->shu);
    pr_publish(sm, *s, a, b, 0, C);
    *sa = sp_warp_sum_u(pr_lane_box(sm, *s, 0, C, C));
    *sb = sp_warp_sum_u(pr_lane_box(sm, *s, 1, C, C));
    if (slot != NULL)
        *slot = *s;
    ++*s;
}

static __device__ ull pr_cl_sum(ull v, pr_smem *sm, int *s, int C)
{
    v = sp_block_sum_u(v, sm->shu);
    pr_publish(sm, *s, v, 0, 0, C);
    v = sp_warp_sum_u(pr_lane_box(sm, *s, 0, C, C));
    ++*s;
    return v;
}

/* The row's argmax with kern_argmax's rule (larger value, then lower index; NaN never wins;
 * all NaN -> 0) from each thread's (bv, bi); a total order, so any reduction order agrees */
static __device__ int pr_cl_argmax(float bv, int bi, int n, pr_smem *sm, int *s, int C)
{
    kern_cuda_warp_best(bv, bi);
    if ((threadIdx.x & 31) == 0) {
        sm->shf[threadIdx.x >> 5] = bv;
        sm->shi[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        bv = sm->shf[threadIdx.x];
        bi = sm->shi[threadIdx.x];
        kern_cuda_warp_best(bv, bi);
    }
    pr_publish(sm, *s, __float_as_uint(bv), (ull)(unsigned int)bi, 0, C);   /* thread 0's */
    const int lane = threadIdx.x & 31;
    bv = lane < C ? __uint_as_float((unsigned int)pr_box(sm, *s, lane, 0, C)) : -INFINITY;
    bi = lane < C ? (int)pr_box(sm, *s, lane, 1, C) : n;
    kern_cuda_warp_best(bv, bi);
    ++*s;
    return bi < n ? bi : 0;
}

/* A select's answer: the highest key t whose tokens "key >= t" number at least k or carry at
 * least mass (tokens with p = 0 never count); found = 0 when none does. */
struct sp_cut {
    int found;
    ull t;                    /* the key t */
    unsigned int cnt_above;   /* tokens with key > t */
    ull mass_above;           /* and their mass */
    int cnt_t;                /* tokens with key == t */
};

/* The order keys of a select, functions of p alone (so lanes with equal p hold equal keys):
 * p's own bits (31 of them: p >= 0), for min-p / top-k / top-p, whose order is p descending ... */
struct sp_key_p {
    static constexpr int bits = 31;
    __device__ ull operator()(float p, int) const { return __float_as_uint(p); }
};

/* ... and typical-p's (63 bits): the score's bits reversed, so the highest key is the lowest
 * score (a score is >= 0, its bits are ordered as its value). The score is
 * kern_typical_score(p, kept, h); its logarithm comes from lq[i] where the entropy pass left it
 * (the same operations on the same q, so the same bits). */
struct sp_key_typical {
    static constexpr int bits = 63;
    double kept, h;
    const double *lq;   /* nullable: then computed */
    __device__ ull operator()(float p, int i) const
    {
        const double l = lq != NULL ? lq[i] : kern_typical_log((double)p / kept);
        return 0x7fffffffffffffffull - (ull)__double_as_longlong(fabs(l + h));
    }
};

/* The tokens a stage runs over, in index order: the listed slice positions, or all of them */
struct pr_list {
    const unsigned short *ix;   /* NULL: positions 0 .. len - 1 */
    int len;
    __device__ int at(int j) const { return ix != NULL ? (int)ix[j] : j; }
};

/* This thread's contiguous share [*j0, *j1) of n items (blocked: an exclusive scan over the
 * threads then keeps their order) */
static __device__ __forceinline__ void pr_share(int n, int *j0, int *j1)
{
    const int e = (n + SP_THREADS - 1) / SP_THREADS, a = (int)threadIdx.x * e;
    *j0 = a < n ? a : n;
    *j1 = a + e < n ? a + e : n;
}

/* Radix select over the keys of the listed tokens with p > 0 of the row (every CTA its
 * slice), 11 bits a pass from the top. A pass: each CTA's histogram; rank q sums the bins of
 * its range [q per, (q + 1) per) over the cluster (integers, any order); every CTA finds the
 * range that holds the cut from the ranges' totals (rank C - 1 has the highest bins), copies
 * its bins and walks them from the top, so all reach the same answer. */
template <class K>
static __device__ sp_cut pr_select(const float *pv, pr_list L, unsigned int k, ull mass, K key, pr_smem *sm,
                                   int C, int rank)
{
    sp_cut cut = {1, 0, 0, 0, 0};
    ull pref_mask = 0;
    const int lane = threadIdx.x & 31;
#pragma unroll 1
    for (int hi = K::bits; hi > 0; hi -= 11) {
        const int width = hi < 11 ? hi : 11, shift = hi - width, nb = 1 << width;
        for (int b = threadIdx.x; b < nb; b += SP_THREADS) {
            sm->hc[b] = 0;
            sm->hm[b] = 0;
        }
        __syncthreads();
        for (int j0 = 0; j0 < L.len; j0 += SP_THREADS) {
            const int j = j0 + threadIdx.x;
            const int i = j < L.len ? L.at(j) : 0;
            const float p = j < L.len ? pv[i] : 0.0f;
            const ull kv = p > 0.0f ? key(p, i) : 0;
            const bool in = p > 0.0f && (kv & pref_mask) == cut.t;
            /* lanes holding the same value add once (rows with many equal probabilities would
             * otherwise queue on a few bins); 0xffffffff is a NaN, never a value that is in */
            const unsigned int peers = __match_any_sync(0xffffffffu, in ? __float_as_uint(p) : 0xffffffffu);
            if (in && lane == __ffs(peers) - 1) {
                const unsigned int cnt = __popc(peers), d = (unsigned int)(kv >> shift) & (unsigned int)(nb - 1);
                atomicAdd(&sm->hc[d], cnt);
                sp_mass_add(&sm->hm[d], (ull)cnt * sp_fix(p));
            }
        }
        pr_sync(C);   /* every CTA's histogram is complete */
        const int per = nb / C, b0 = rank * per;
        unsigned int tc = 0;
        ull tm = 0;
        for (int j = threadIdx.x; j < per; j += SP_THREADS) {
            unsigned int c = 0;
            ull m = 0;
            for (int r0 = 0; r0 < C; r0 += 4) {   /* four ranks' loads in flight at once */
                unsigned int c4[4];
                ull m4[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    c4[u] = r0 + u < C ? pr_at(sm->hc, r0 + u, C)[b0 + j] : 0u;
                    m4[u] = r0 + u < C ? pr_at(sm->hm, r0 + u, C)[b0 + j] : 0ull;
                }
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    c += c4[u];
                    m += m4[u];
                }
            }
            sm->mc[j] = c;
            sm->mm[j] = m;
            tc += c;
            tm += m;
        }
        tc = (unsigned int)sp_block_sum_u(tc, sm->shu);
        tm = sp_block_sum_u(tm, sm->shu);
        if (threadIdx.x == 0) {
            sm->rng_c = tc;
            sm->rng_m = tm;
        }
        pr_sync(C);   /* every range is merged; no histogram of this pass is read again */
        if (threadIdx.x < 32) {
            const unsigned int gc = lane < C ? *pr_at(&sm->rng_c, C - 1 - lane, C) : 0u;
            const ull gm = lane < C ? *pr_at(&sm->rng_m, C - 1 - lane, C) : 0ull;
            unsigned int ic = gc;
            ull im = gm;
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned int t1 = __shfl_up_sync(0xffffffffu, ic, o);
                const ull t2 = __shfl_up_sync(0xffffffffu, im, o);
                if (lane >= o) {
                    ic += t1;
                    im += t2;
                }
            }
            const unsigned int ac = cut.cnt_above + ic - gc;
            const ull am = cut.mass_above + im - gm;
            const unsigned int hit = __ballot_sync(0xffffffffu, lane < C && (ac + gc >= k || am + gm >= mass));
            if (lane == 0)
                sm->found = hit != 0;
            if (hit != 0 && lane == __ffs(hit) - 1) {
                sm->fg = C - 1 - lane;
                sm->fac = ac;
                sm->fam = am;
            }
        }
        __syncthreads();
        if (!sm->found) {
            cut.found = 0;   /* only in pass 0: no value reaches the limits */
            __syncthreads();
            return cut;
        }
        const int g = sm->fg;
        const unsigned int *mc = sm->mc;
        const ull *mm = sm->mm;
        if (C > 1) {   /* range g's bins into this CTA (the histogram's place is free now) */
            for (int j = threadIdx.x; j < per; j += SP_THREADS) {
                sm->hc[j] = pr_at(sm->mc, g, C)[j];
                sm->hm[j] = pr_at(sm->mm, g, C)[j];
            }
            __syncthreads();
            mc = sm->hc;
            mm = sm->hm;
        }
        if (threadIdx.x < 32) {
            /* lane l takes the l-th run of the range's bins from its top; the running totals of
             * the runs above come from a warp scan, then each lane walks its run downwards */
            const int run = (per + 31) / 32, top = per - 1 - lane * run;
            unsigned int lc = 0;
            ull lm = 0;
            for (int j = top; j > top - run && j >= 0; j--) {
                lc += mc[j];
                lm += mm[j];
            }
            unsigned int ic = lc;
            ull im = lm;
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned int t1 = __shfl_up_sync(0xffffffffu, ic, o);
                const ull t2 = __shfl_up_sync(0xffffffffu, im, o);
                if (lane >= o) {
                    ic += t1;
                    im += t2;
                }
            }
            unsigned int rc = sm->fac + ic - lc;
            ull rm = sm->fam + im - lm;
            int digit = -1;
            for (int j = top; j > top - run && j >= 0; j--) {
                if (rc + mc[j] >= k || rm + mm[j] >= mass) {
                    digit = j;
                    break;
                }
                rc += mc[j];
                rm += mm[j];
            }
            const unsigned int hit = __ballot_sync(0xffffffffu, digit >= 0);
            if (hit == 0) {   /* not reached: range g holds the cut */
                if (lane == 0)
                    sm->found = 0;
            } else if (lane == __ffs(hit) - 1) {
                sm->digit = g * per + digit;
                sm->cnt_above = rc;
                sm->mass_above = rm;
                sm->cnt_t = (int)mc[digit];
            }
        }
        __syncthreads();
        if (!sm->found) {
            cut.found = 0;
            __syncthreads();
            return cut;
        }
        pref_mask |= (ull)(nb - 1) << shift;
        cut.t |= (ull)sm->digit << shift;
        cut.cnt_above = sm->cnt_above;
        cut.mass_above = sm->mass_above;
        cut.cnt_t = sm->cnt_t;
        __syncthreads();
    }
    return cut;
}

/* After a select for target that found its cut: keeps of the listed tokens with p > 0 those
 * whose key is above the cut's and, of those at it, the lowest indices while the mass before
 * them (the ones above, then the ones at the cut in index order) is short of target, as the
 * reference's scan in (key, index) order keeps them; zeroes the rest, leaves the kept
 * undivided and, with spare, lists them there in index order (L then names it). Returns the
 * kept mass in *kept and their count in *count, and in *slot the mailbox with each rank's.
 * The tokens at the cut are ranked (the mass at it in the ranks before this one, then an
 * exclusive scan of the threads' shares, then each share in order) only when there are
 * several: equal keys may carry unequal masses (typical-p: one token above the typical
 * probability and one below). */
template <class K>
static __device__ void pr_keep(float *pv, pr_list *L, unsigned short *spare, K key, const sp_cut &cut, ull target,
                               pr_smem *sm, int *s, int C, int rank, ull *kept, ull *count, int *slot)
{
    const ull need = target - cut.mass_above;   /* > 0: the tokens above the cut fall short */
    const bool ties = cut.cnt_t > 1;            /* the same in every CTA */
    int j0, j1;
    pr_share(L->len, &j0, &j1);
    ull base = 0;   /* the mass at the cut before this thread's next token at it */
    if (ties) {
        ull mine = 0, all;
        for (int j = j0; j < j1; j++) {
            const int i = L->at(j);
            const float p = pv[i];
            if (p > 0.0f && key(p, i) == cut.t)
                mine += sp_fix(p);
        }
        base = sp_block_excl_scan(mine, sm->shs, &all);
        pr_publish(sm, *s, all, 0, 0, C);
        base += sp_warp_sum_u(pr_lane_box(sm, *s, 0, C, rank));
        ++*s;
    }
    ull mass = 0, cnt = 0;
    for (int j = j0; j < j1; j++) {
        const int i = L->at(j);
        const float p = pv[i];
        const ull kv = p > 0.0f ? key(p, i) : 0;
        const bool at = p > 0.0f && kv == cut.t;
        const bool keep = p > 0.0f && (kv > cut.t || (at && base < need));
        if (at)
            base += sp_fix(p);
        if (keep) {
            mass += sp_fix(p);
            cnt++;
        } else {
            pv[i] = 0.0f;
        }
    }
    ull n_list = 0;
    if (spare != NULL) {   /* the kept are the listed tokens still > 0 */
        int pos = (int)sp_block_excl_scan(cnt, sm->shs, &n_list);
        for (int j = j0; j < j1; j++) {
            const int i = L->at(j);
            if (pv[i] > 0.0f)
                spare[pos++] = (unsigned short)i;
        }
    }
    pr_cl_sum2(mass, cnt, sm, s, C, kept, count, slot);   /* its barriers publish the list */
    if (spare != NULL) {
        L->ix = spare;
        L->len = (int)n_list;
    }
}

/* Every rank's listed tokens (count in word 1 of mailbox gs) gathered into sm->gp / sm->gi,
 * rank after rank, so in index order; returns how many. pv and list are this CTA's, the same
 * places in every rank's shared memory. */
static __device__ int pr_gather(pr_smem *sm, int gs, const float *pv, const unsigned short *list, int seg, int C)
{
    const int lane = threadIdx.x & 31;
    int incl = (int)pr_lane_box(sm, gs, 1, C, C);
    for (int o = 1; o < 32; o <<= 1) {
        const int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o)
            incl += t;
    }
    int ends[16];   /* rank r's tokens end at ends[r] */
#pragma unroll
    for (int r = 0; r < 16; r++)
        ends[r] = __shfl_sync(0xffffffffu, incl, r);
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    for (int j = threadIdx.x; j < total; j += SP_THREADS) {
        int r = 0, start = 0;
#pragma unroll
        for (int q = 0; q < 16; q++)
            if (q < C && j >= ends[q]) {
                r = q + 1;
                start = ends[q];
            }
        const int li = (int)pr_at(list, r, C)[j - start];
        sm->gp[j] = pr_at(pv, r, C)[li];
        sm->gi[j] = r * seg + li;
    }
    return total;
}

/* One row over C CTAs, each a contiguous slice of it, every stage as the one-block form (the
 * file's header) with the histograms and sums exchanged through distributed shared memory;
 * once at most PR_GATHER tokens survive, every CTA gathers them and finishes the row alone. */
__global__ void __launch_bounds__(SP_THREADS, 1)
probs_kernel(pr_params P)
{
    extern __shared__ __align__(16) unsigned char pr_dyn[];
    pr_smem *sm = (pr_smem *)pr_dyn;
    const kern_probs_args &a = P.a;
    const int C = P.C, rank = (int)(blockIdx.x % (unsigned int)C), row = (int)(blockIdx.x / (unsigned int)C);
    const int n = a.n, lo = rank * P.seg;
    const int len = n - lo < P.seg ? (n - lo > 0 ? n - lo : 0) : P.seg;
    const int xr = a.idx != NULL ? a.idx[row] : row;
    const float *x = a.x + (size_t)xr * a.ld_x + lo;
    float *out = a.out + (size_t)row * a.ld_out + lo;
    const pr_layout lay = pr_layout_of(P.seg, P.pv_smem, P.lists, P.lq_smem);
    float *pv = P.pv_smem ? (float *)(pr_dyn + lay.pv) : out;
    const kern_sample_cfg c = a.cfg[row];
    int s = 0;   /* the next mailbox */

    if (c.temperature < 1e-5f) {
        float bv = -INFINITY;
        int bi = n;
        for (int i = threadIdx.x; i < len; i += SP_THREADS) {
            const float v = x[i];
            if (kern_cuda_better(v, lo + i, bv, bi))
                bv = v, bi = lo + i;
        }
        const int best = pr_cl_argmax(bv, bi, n, sm, &s, C) - lo;
        for (int i = threadIdx.x; i < len; i += SP_THREADS)
            out[i] = i == best ? 1.0f : 0.0f;
        if (C > 1)
            pr_sync(C);   /* no CTA leaves while another may read its mailboxes */
        return;
    }
    /* softmax as the reference: e in double, p = float(float(e) / sum of the e's); the sum is
     * an integer (pr_fix96), so a row's p do not depend on how it is split or batched */
    float mx = -INFINITY;
    for (int i0 = threadIdx.x; i0 < len; i0 += 4 * SP_THREADS) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            v[u] = i0 + u * SP_THREADS < len ? x[i0 + u * SP_THREADS] : -INFINITY;
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i0 + u * SP_THREADS < len) {
                pv[i0 + u * SP_THREADS] = v[u];
                mx = fmaxf(mx, v[u]);
            }
    }
    mx = pr_cl_max(mx, sm, &s, C);
    const double temp = (double)c.temperature;
    ull shi = 0, slo = 0;
    int nan = 0;
    for (int i = threadIdx.x; i < len; i += SP_THREADS) {
        const double e = exp(((double)pv[i] - (double)mx) / temp);
        pv[i] = (float)e;
        if (e != e) {
            nan = 1;
        } else {
            ull h, l;
            pr_fix96(e, &h, &l);
            pr_add128(&shi, &slo, h, l);
        }
    }
    nan = __syncthreads_or(nan);
    pr_warp_sum128(&shi, &slo);
    if ((threadIdx.x & 31) == 0) {
        sm->shs[threadIdx.x >> 5] = shi;
        sm->shs[SP_WARPS + (threadIdx.x >> 5)] = slo;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        shi = sm->shs[threadIdx.x];
        slo = sm->shs[SP_WARPS + threadIdx.x];
        pr_warp_sum128(&shi, &slo);
    }
    pr_publish(sm, s, shi, slo, (ull)nan, C);   /* thread 0's sums */
    shi = pr_lane_box(sm, s, 0, C, C);
    slo = pr_lane_box(sm, s, 1, C, C);
    pr_warp_sum128(&shi, &slo);
    nan = __any_sync(0xffffffffu, pr_lane_box(sm, s, 2, C, C) != 0);
    s++;
    const double sum = nan ? (double)NAN
                           : ldexp(__ull2double_rn(shi) * 18446744073709551616.0 + __ull2double_rn(slo), -96);
    float pmax = 0.0f;
    for (int i = threadIdx.x; i < len; i += SP_THREADS) {
        const float p = (float)((double)pv[i] / sum);
        pv[i] = p;
        pmax = fmaxf(pmax, p);
    }
    const int k = c.top_k > 0 && c.top_k < n ? c.top_k : n;
    /* top_p >= 1 and typical_p outside (0, 1) are off */
    const bool use_p = c.top_p < 1.0f, use_m = c.min_p > 0.0f;
    const bool use_t = c.typical_p > 0.0f && c.typical_p < 1.0f;
    if (k == n && !use_p && !use_m && !use_t) {
        if (P.pv_smem)
            for (int i = threadIdx.x; i < len; i += SP_THREADS)
                out[i] = pv[i];
        if (C > 1)
            pr_sync(C);
        return;
    }
    pmax = pr_cl_max(pmax, sm, &s, C);   /* its barriers also put every p in pv before reads */

    /* Each stage leaves its survivors in pv undivided and the rest 0, and their mass in kept;
     * the next runs over them (over their list when there are lists). The candidates: p >= the
     * k-th largest p (its ties too) and p >= min_p * max p */
    unsigned int tk_bits = 0;
    if (k < n) {
        const sp_cut ck = pr_select(pv, pr_list{NULL, len}, (unsigned int)k, ~0ull, sp_key_p{}, sm, C, rank);
        if (ck.found)
            tk_bits = (unsigned int)ck.t;   /* else fewer than k tokens have mass: all are candidates */
    }
    const double thr_m = use_m ? (double)c.min_p * (double)pmax : 0.0;
    /* the stages' state: the survivors' p, their list and its two buffers (the survivors of a
     * stage go to the one L does not use), logarithms, the CTAs */
    float *spv = pv;
    unsigned short *sl0 = (unsigned short *)(pr_dyn + lay.l0), *sl1 = (unsigned short *)(pr_dyn + lay.l1);
    double *slq = P.lq_smem ? (double *)(pr_dyn + lay.lq) : NULL;
    int sC = C, srank = rank, lists = P.lists;
    const bool compact = lists && (k < n || use_m);
    ull mass = 0, cnt = 0, kept, total;
    int gs;
    int i0, i1;
    pr_share(len, &i0, &i1);
    for (int i = i0; i < i1; i++) {
        const float p = pv[i];
        if (p > 0.0f && __float_as_uint(p) >= tk_bits && (double)p >= thr_m) {
            mass += sp_fix(p);
            cnt++;
        } else {
            pv[i] = 0.0f;
        }
    }
    ull n_list = 0;
    if (compact) {
        int pos = (int)sp_block_excl_scan(cnt, sm->shs, &n_list);
        for (int i = i0; i < i1; i++)
            if (pv[i] > 0.0f)
                sl0[pos++] = (unsigned short)i;
    }
    pr_cl_sum2(mass, cnt, sm, &s, C, &kept, &total, &gs);   /* its barriers publish the zeros, the list */
    pr_list L = compact ? pr_list{sl0, (int)n_list} : pr_list{NULL, len};
    /* few survivors: every CTA gathers them (pr_gather) and finishes the row alone, as one
     * CTA of a row would (the same tokens in the same order); n_g of them */
    bool local = false;
    int n_g = 0;
    if (P.gather && C > 1 && compact && total <= PR_GATHER && (use_p || use_t)) {
        n_g = pr_gather(sm, gs, pv, sl0, P.seg, C);
        local = true;
    }
    if (local) {
        pr_sync(C);   /* every rank has gathered: from here on nothing is read across CTAs */
        L = pr_list{NULL, n_g};
        spv = sm->gp;
        sl0 = sm->gl[0];
        sl1 = sm->gl[1];
        slq = NULL;
        sC = 1;
        srank = 0;
    }

    /* top-p: the tokens of p > t and the first of those with p == t in index order, t found by
     * a select for ceil(top_p * kept) */
    if (use_p) {
        const ull target = (ull)ceil((double)c.top_p * (double)kept);
        const sp_cut cp = pr_select(spv, L, ~0u, target, sp_key_p{}, sm, sC, srank);
        if (cp.found) {
            unsigned short *spare = lists ? (L.ix == sl0 ? sl1 : sl0) : NULL;
            pr_keep(spv, &L, spare, sp_key_p{}, cp, target, sm, &s, sC, srank, &kept, &total, &gs);
            if (P.gather && !local && sC > 1 && lists && use_t && total <= PR_GATHER) {
                n_g = pr_gather(sm, gs, pv, L.ix, P.seg, C);
                local = true;
                pr_sync(C);
                L = pr_list{NULL, n_g};
                spv = sm->gp;
                sl0 = sm->gl[0];
                sl1 = sm->gl[1];
                slq = NULL;
                sC = 1;
                srank = 0;
            }
        }
    }
    /* typical-p: the entropy of the survivors (integer terms: the sum has no order), then the
     * same over the score keys for ceil(typical_p * kept); a token's logarithm is taken once,
     * here: kern_typical_term(p, kd) and kern_typical_score(p, kd, h) on its q */
    if (use_t) {
        const double kd = (double)kept / SP_FIX_SCALE;
        long long hs = 0;
        for (int j = threadIdx.x; j < L.len; j += SP_THREADS) {
            const int i = L.at(j);
            const float p = spv[i];
            if (p > 0.0f) {
                const double q = (double)p / kd, l = kern_typical_log(q);
                if (slq != NULL)
                    slq[i] = l;
                hs += llrint(ldexp(-q * l, 56));
            }
        }
        /* the int64 sum as ull: two's complement gives the same bits */
        const sp_key_typical key = {kd, kern_typical_entropy((long long)pr_cl_sum((ull)hs, sm, &s, sC)), slq};
        const ull target = (ull)ceil((double)c.typical_p * (double)kept);
        const sp_cut ct = pr_select(spv, L, ~0u, target, key, sm, sC, srank);
        if (ct.found) {
            unsigned short *spare = lists ? (L.ix == sl0 ? sl1 : sl0) : NULL;
            pr_keep(spv, &L, spare, key, ct, target, sm, &s, sC, srank, &kept, &total, &gs);
        }
    }
    if (local) {   /* the gathered tokens' fate back into this CTA's slice (the rest is 0) */
        for (int j = threadIdx.x; j < n_g; j += SP_THREADS) {
            const int gi = sm->gi[j];
            if (gi >= lo && gi < lo + len)
                pv[gi - lo] = sm->gp[j];
        }
        __syncthreads();
    }
    const double kd = (double)kept / SP_FIX_SCALE;
    for (int i = threadIdx.x; i < len; i += SP_THREADS) {
        const float p = pv[i];
        out[i] = p > 0.0f ? (float)((double)p / kd) : 0.0f;
    }
    if (C > 1)
        pr_sync(C);
}

/* ---- sample --------------------------------------------------------------------------------- */

__global__ void __launch_bounds__(SP_THREADS)
sample_kernel(kern_sample_args a)
{
    __shared__ double shd[2 * SP_WARPS];
    __shared__ int shi[SP_WARPS];
    const float *p = a.probs + (size_t)blockIdx.x * a.ld;
    int tok = sp_block_icdf(sp_row{p}, a.n, a.u[blockIdx.x], shd, shi);
    if (threadIdx.x == 0)
        a.out[blockIdx.x] = tok;
}

/* sample_kernel's arithmetic over a cluster of C CTAs: sp_block_icdf's 1024 threads become
 * virtual, rank q running those of [q V, (q + 1) V) (V = 1024 / C) with its first V threads on
 * its tokens (staged in shared memory when stage). Each segment is summed and walked in the same
 * order, the warp scans are the same shuffles of the same values and every CTA scans the 32 warp
 * totals as warp 0 did, so the token is sample_kernel's bit for bit, for any C. */
__global__ void __launch_bounds__(SP_THREADS, 1)
sample_cl_kernel(kern_sample_args a, int C, int stage)
{
    extern __shared__ __align__(16) unsigned char sa_dyn[];
    __shared__ double shd[2 * SP_WARPS];
    __shared__ double wtot[SP_WARPS];
    __shared__ int shi[SP_WARPS];
    __shared__ int box[2];
    const int rank = (int)(blockIdx.x % (unsigned int)C), row = (int)(blockIdx.x / (unsigned int)C);
    const int V = SP_THREADS / C, n = a.n, seg = (n + SP_THREADS - 1) / SP_THREADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float *p = a.probs + (size_t)row * a.ld;
    const double u = a.u[row];
    const int t = rank * V + (int)threadIdx.x;   /* the virtual thread (threadIdx.x < V) */
    const int e0 = rank * V * seg < n ? rank * V * seg : n;
    const int e1 = (rank + 1) * V * seg < n ? (rank + 1) * V * seg : n;
    const float *src = p;   /* token i at src[i - off] */
    int off = 0;
    if (stage) {
        float *sv = (float *)sa_dyn;
        for (int i = threadIdx.x; i < e1 - e0; i += SP_THREADS)
            sv[i] = p[e0 + i];
        __syncthreads();
        src = sv;
        off = e0;
    }
    const bool mine = (int)threadIdx.x < V;
    const int lo = t * seg, hi = lo + seg < n ? lo + seg : n;
    double s = 0.0;
    int last = -1;
    if (mine) {
#pragma unroll 8
        for (int i = lo; i < hi; i++) {
            float v = src[i - off];
            if (!(v <= 0.0f)) {   /* as the reference: a NaN counts (and poisons the sums after it) */
                s += (double)v;
                last = i;
            }
        }
    }
    /* sp_block_excl_scan's steps: within each (virtual) warp, then over the warp totals */
    double incl = s;
    for (int o = 1; o < 32; o <<= 1) {
        double tt = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o)
            incl += tt;
    }
    double excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0)
        excl = 0;
    if (lane == 31 && mine)
        wtot[warp] = incl;
    pr_sync(C);
    const int wpc = V / 32;   /* warps per CTA: virtual warp w lives in rank w / wpc */
    if (warp == 0) {
        double wv = *pr_at(&wtot[lane % wpc], lane / wpc, C), wi = wv;
        for (int o = 1; o < 32; o <<= 1) {
            double tt = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o)
                wi += tt;
        }
        double we = __shfl_up_sync(0xffffffffu, wi, 1);
        shd[32 + lane] = lane == 0 ? 0 : we;
    }
    __syncthreads();
    double cum = (mine ? shd[32 + rank * wpc + warp] : 0.0) + excl;
    int found = n;
    if (mine && last >= 0 && !(u >= cum + s)) {
        for (int i = lo; i < hi; i++) {
            float v = src[i - off];
            if (v <= 0.0f)
                continue;
            cum += (double)v;
            if (u < cum) {
                found = i;
                break;
            }
        }
    }
    found = sp_block_min_i(found, shi);
    last = sp_block_max_i(mine ? last : -1, shi);
    if (threadIdx.x == 0) {
        box[0] = found;
        box[1] = last;
    }
    pr_sync(C);
    found = lane < C ? *pr_at(&box[0], lane, C) : n;   /* lane r reads rank r's */
    last = lane < C ? *pr_at(&box[1], lane, C) : -1;
    for (int o = 16; o > 0; o >>= 1) {
        found = min(found, __shfl_xor_sync(0xffffffffu, found, o));
        last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    }
    if (rank == 0 && threadIdx.x == 0)
        a.out[row] = found < n ? found : last >= 0 ? last : 0;
    pr_sync(C);
}

/* ---- launches of probs and sample ------------------------------------------------------------- */

/* The device's limits, asked once per context: the opt-in shared memory of a CTA, how many
 * clusters of 2..16 such CTAs (one per SM: 1024 threads) run at once, PD_PROBS_CLUSTER. */
static pd_status pr_setup(kern_cuda_ctx *c, pd_err *err)
{
    if (c->probs_setup)
        return PD_OK;
    int smax = 0;
    PD_CUDA_TRY(cudaDeviceGetAttribute(&smax, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->device), err);
    PD_CUDA_TRY(cudaFuncSetAttribute(probs_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smax), err);
    PD_CUDA_TRY(cudaFuncSetAttribute(probs_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), err);
    PD_CUDA_TRY(cudaFuncSetAttribute(sample_cl_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smax - 1024), err);
    PD_CUDA_TRY(cudaFuncSetAttribute(sample_cl_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), err);
    c->probs_smem_max = smax;
    c->probs_cl_max[0] = c->n_sm;
    for (int l = 1; l < 5; l++) {
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 1u << l;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(1u << l);
        cfg.blockDim = dim3(SP_THREADS);
        cfg.dynamicSmemBytes = (size_t)smax;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        int n_cl = 0;
        cudaError_t e = cudaOccupancyMaxActiveClusters(&n_cl, probs_kernel, &cfg);
        c->probs_cl_max[l] = e == cudaSuccess ? n_cl : 0;
        (void)cudaGetLastError();   /* a refusal is an answer, not an error */
    }
    const char *f = getenv("PD_PROBS_CLUSTER");
    int force = f != NULL ? atoi(f) : 0;
    c->probs_cl_force = force == 1 || force == 2 || force == 4 || force == 8 || force == 16 ? force : 0;
    const char *g = getenv("PD_PROBS_GATHER");
    c->probs_gather = g != NULL && atoi(g) != 0;
    c->probs_setup = 1;
    return PD_OK;
}

/* CTAs per row: the most (16, 8, 4) whose clusters all run at once for this many rows, with
 * slices of PR_MIN_SLICE tokens at least; past that 4, in several waves: at 32-256 rows four
 * CTAs a row in waves beat two or one in fewer (H100, Qwen3's defaults, V 151936: 32 rows 314.6
 * against 563.0 us, 64 475.4 / 723.3, 128 795.2 / 1472.4, 256 1425.5 / 2856.7;
 * docs/BENCHMARKS.md) */
static int pr_cluster_size(const kern_cuda_ctx *c, int rows, int n)
{
    if (c->probs_cl_force != 0) {
        int l = __builtin_ctz((unsigned int)c->probs_cl_force);
        return c->probs_cl_max[l] > 0 ? c->probs_cl_force : 1;
    }
    for (int l = 4; l >= 2; l--)
        if (n >= (PR_MIN_SLICE << l) && rows <= c->probs_cl_max[l])
            return 1 << l;
    for (int l = 2; l >= 1; l--)
        if (n >= (PR_MIN_SLICE << l) && c->probs_cl_max[l] > 0)
            return 1 << l;
    return 1;
}

static cudaLaunchConfig_t pr_launch_cfg(cudaStream_t st, int C, int rows, size_t smem, cudaLaunchAttribute *at)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned int)C * (unsigned int)rows);
    cfg.blockDim = dim3(SP_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    if (C > 1) {
        at->id = cudaLaunchAttributeClusterDimension;
        at->val.clusterDim.x = (unsigned int)C;
        at->val.clusterDim.y = 1;
        at->val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
    }
    return cfg;
}

extern "C" pd_status kern_cuda_probs_launch(kern_backend *be, const kern_probs_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0)
        return PD_OK;
    pd_status st = pr_setup(c, err);
    if (st != PD_OK)
        return st;
    pr_params P;
    P.a = *a;
    P.C = pr_cluster_size(c, a->rows, a->n);
    P.seg = (a->n + P.C - 1) / P.C;
    const size_t smax = (size_t)c->probs_smem_max;
    P.pv_smem = pr_layout_of(P.seg, 1, 0, 0).bytes <= smax;
    P.lists = P.pv_smem && P.seg <= 65536 && pr_layout_of(P.seg, 1, 1, 0).bytes <= smax;
    P.lq_smem = P.lists && pr_layout_of(P.seg, 1, 1, 1).bytes <= smax;
    P.gather = c->probs_gather;
    const size_t smem = pr_layout_of(P.seg, P.pv_smem, P.lists, P.lq_smem).bytes;
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = pr_launch_cfg(c->stream, P.C, a->rows, smem, &at);
    PD_CUDA_TRY(cudaLaunchKernelEx(&cfg, probs_kernel, P), err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

extern "C" pd_status kern_cuda_sample_launch(kern_backend *be, const kern_sample_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0)
        return PD_OK;
    pd_status st = pr_setup(c, err);
    if (st != PD_OK)
        return st;
    const int C = pr_cluster_size(c, a->rows, a->n);
    if (C == 1) {
        sample_kernel<<<a->rows, SP_THREADS, 0, c->stream>>>(*a);
        KERN_CUDA_LAUNCH_CHECK(err);
        return PD_OK;
    }
    const int seg = (a->n + SP_THREADS - 1) / SP_THREADS;
    const size_t bytes = (size_t)(SP_THREADS / C) * (size_t)seg * sizeof(float);
    const int stage = bytes + 1024 <= (size_t)c->probs_smem_max;   /* 1 KiB: the static arrays */
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = pr_launch_cfg(c->stream, C, a->rows, stage ? bytes : 0, &at);
    PD_CUDA_TRY(cudaLaunchKernelEx(&cfg, sample_cl_kernel, *a, C, stage), err);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* ---- spec_verify ---------------------------------------------------------------------------- */

__global__ void __launch_bounds__(SP_THREADS)
spec_verify_kernel(kern_spec_verify_args a)
{
    __shared__ double shd[2 * SP_WARPS];
    __shared__ int shi[SP_WARPS];
    __shared__ int s_acc;
    const int r = blockIdx.x, n = a.n, l = a.len[r];
    const float *p0 = a.p + (size_t)a.p_row[r] * a.ld_p;
    const int32_t *d = a.draft + (size_t)r * a.ld_draft;
    const double *u = a.u + (size_t)r * a.ld_u;
    if (threadIdx.x == 0) {
        int acc = 0;
        for (; acc < l; acc++) {
            const float *p = p0 + (size_t)acc * a.ld_p;
            const float *q = a.q + (size_t)(a.q_row[r] + acc) * a.ld_q;
            int t = d[acc];
            float pv = t >= 0 && t < n ? p[t] : 0.0f, qv = t >= 0 && t < n ? q[t] : 0.0f;
            double pq = pv, qq = qv > 1e-8f ? (double)qv : 1e-8;
            double accept = pq / qq < 1.0 ? pq / qq : 1.0;
            if (!(u[acc] < accept))
                break;
        }
        s_acc = acc;
    }
    __syncthreads();
    const int acc = s_acc;
    int tok;
    if (acc < l) {
        const float *p = p0 + (size_t)acc * a.ld_p;
        const float *q = a.q + (size_t)(a.q_row[r] + acc) * a.ld_q;
        double s = 0.0;
        for (int i = threadIdx.x; i < n; i += SP_THREADS) {
            float v = p[i] - q[i];
            s += v > 0.0f ? (double)v : 0.0;
        }
        double mass = sp_block_sum_d(s, shd);
        if (mass <= 1e-8)   /* p and q agree: sample p itself, as the reference */
            tok = sp_block_icdf(sp_row{p}, n, u[l], shd, shi);
        else
            tok = sp_block_icdf(sp_residual{p, q, mass}, n, u[l], shd, shi);
    } else {
        const float *p = p0 + (size_t)l * a.ld_p;
        tok = sp_block_icdf(sp_row{p}, n, u[l], shd, shi);
    }
    if (threadIdx.x == 0) {
        a.out[2 * r] = acc;
        a.out[2 * r + 1] = tok;
    }
}

extern "C" pd_status kern_cuda_spec_verify_launch(kern_backend *be, const kern_spec_verify_args *a,
                                                  pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->n_req <= 0)
        return PD_OK;
    spec_verify_kernel<<<a->n_req, SP_THREADS, 0, c->stream>>>(*a);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}

/* ---- logprobs ------------------------------------------------------------------------------ */

/* a float's order as an unsigned key (larger float, larger key; -0 as +0, as the comparisons) */
static __device__ __forceinline__ unsigned int lp_key(float v)
{
    unsigned int u = v == 0.0f ? 0u : __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

__global__ void __launch_bounds__(SP_THREADS)
logprobs_kernel(kern_logprobs_args a)
{
    __shared__ unsigned int hist[SP_BINS];
    __shared__ float shf[SP_WARPS];
    __shared__ double shd[2 * SP_WARPS];
    __shared__ int s_digit, s_rank[SP_WARPS + 1];
    __shared__ unsigned int s_above;
    __shared__ int s_n_list;
    __shared__ int s_list[KERN_MAX_TOP_LOGPROBS];

    const int n = a.n;
    const float *x = a.x + (size_t)a.rows[blockIdx.x] * a.ld_x;
    kern_logprobs_row *out = a.out + blockIdx.x;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += SP_THREADS)
        mx = fmaxf(mx, x[i]);
    mx = sp_block_max(mx, shf);
    const int tok = a.tok[blockIdx.x];
    const bool tok_ok = tok >= 0 && tok < n;
    /* in the same pass: the rank, the logits >= the token's (kern_backend.h; no token: none
     * is, as NaN compares), counted as a double sum (exact) */
    const float xt = tok_ok ? x[tok] : NAN;
    double s = 0.0, n_ge = 0.0;
    for (int i = threadIdx.x; i < n; i += SP_THREADS) {
        s += exp((double)x[i] - (double)mx);
        n_ge += x[i] >= xt ? 1.0 : 0.0;
    }
    const double lse = (double)mx + log(sp_block_sum_d(s, shd));
    n_ge = sp_block_sum_d(n_ge, shd);
    if (threadIdx.x == 0) {
        out->logprob = tok_ok ? (float)((double)x[tok] - lse) : NAN;
        out->rank = (int32_t)n_ge;
        out->n_top = a.n_top;
    }
    const int k = a.n_top;
    if (k == 0)
        return;
    /* the k-th largest key t by a radix select (11, 11, 10 bits), counting tokens only */
    unsigned int pref = 0, mask = 0, above = 0;
    const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
#pragma unroll 1
    for (int pass = 0; pass < 3; pass++) {
        const int shift = shifts[pass], nb = 1 << widths[pass];
        for (int b = threadIdx.x; b < nb; b += SP_THREADS)
            hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += SP_THREADS) {
            unsigned int key = lp_key(x[i]);
            if ((key & mask) == pref)
                atomicAdd(&hist[(key >> shift) & (unsigned)(nb - 1)], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            /* lane l sums the l-th run of bins from the top; a warp scan gives the counts above
             * each run, and the lane whose run holds the k-th key walks it */
            const int lane = threadIdx.x, per = nb / 32, top = nb - 1 - lane * per;
            unsigned int lc = 0;
            for (int b = top; b > top - per; b--)
                lc += hist[b];
            unsigned int ic = lc;
            for (int o = 1; o < 32; o <<= 1) {
                unsigned int t = __shfl_up_sync(0xffffffffu, ic, o);
                if (lane >= o)
                    ic += t;
            }
            unsigned int run = above + ic - lc;
            if (run < (unsigned)k && run + lc >= (unsigned)k) {
                int d = top;
                for (; d > top - per + 1 && run + hist[d] < (unsigned)k; d--)
                    run += hist[d];
                s_digit = d;
                s_above = run;
            }
        }
        __syncthreads();
        pref |= (unsigned)s_digit << shift;
        mask |= (unsigned)(nb - 1) << shift;
        above = s_above;
        __syncthreads();
    }
    /* the list: every key > t (fewer than k), then the lowest indices with key == t */
    if (threadIdx.x == 0)
        s_n_list = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += SP_THREADS)
        if (lp_key(x[i]) > pref)
            s_list[atomicAdd(&s_n_list, 1)] = i;
    __syncthreads();
    int have = (int)above;
    for (int i0 = 0; i0 < n && have < k; i0 += SP_THREADS) {
        int i = i0 + threadIdx.x, rank;
        bool tie = i < n && lp_key(x[i]) == pref;
        int tiles = sp_block_rank(tie, &rank, s_rank);
        if (tie && have + rank < k)
            s_list[have + rank] = i;
        have += tiles;
    }
    if (threadIdx.x == 0) {
        /* at most 20 entries: insertion sort by (value desc, index asc) */
        for (int a1 = 1; a1 < k; a1++) {
            int id = s_list[a1], j = a1;
            float v = x[id];
            while (j > 0 && (x[s_list[j - 1]] < v || (x[s_list[j - 1]] == v && s_list[j - 1] > id))) {
                s_list[j] = s_list[j - 1];
                j--;
            }
            s_list[j] = id;
        }
        for (int j = 0; j < k; j++) {
            out->top_id[j] = s_list[j];
            out->top_logprob[j] = (float)((double)x[s_list[j]] - lse);
        }
    }
}

extern "C" pd_status kern_cuda_logprobs_launch(kern_backend *be, const kern_logprobs_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    logprobs_kernel<<<a->n_rows, SP_THREADS, 0, c->stream>>>(*a);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
}
