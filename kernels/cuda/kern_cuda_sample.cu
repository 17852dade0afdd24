/* kern_cuda_sample.cu - sampling on the device: tempered / filtered probabilities, inverse-CDF
 *   sampling and rejection-sampling verification (the rules of pd_sample.h, kern_backend.h).
 * Owns: kern_cuda_probs_launch, kern_cuda_sample_launch, kern_cuda_spec_verify_launch,
 *   kern_cuda_penalty_launch (one thread per entry: the entries are distinct logits),
 *   kern_cuda_token_mask_launch (a row of CTAs per mask), kern_cuda_logprobs_launch (a block per
 *   row: log-sum-exp in double, the token's rank as a count of the logits at or above its own,
 *   the top entries by a radix select over the logits' order keys, ties at the cut by lowest
 *   index, then sorted as the reference's list).
 *   One block per row (probs, sample) or per request (spec_verify); every sum runs in a fixed
 *   order, so a result depends only on its inputs (seeds reproduce on the device too).
 *   probs: softmax with exp in double as the CPU reference (the float probabilities then match
 *     it to an ulp, so the same tokens survive the filter). min-p / top-k / top-p / typical-p
 *     need no sort: each stage's survivors are a prefix of an order over a key of p alone (p's
 *     bits descending for the first three; typical-p's score ascending, its double's bits
 *     reversed) with index ascending, found by radix selects over the key's bits (11 a pass:
 *     3 passes for p, 6 for a score) whose histograms count tokens and their mass. Masses are
 *     integers in units of 2^-60 (two 32-bit words per bin, lanes with equal p adding once), as
 *     the rule defines them, so the sums are the same whatever order the atomics land in. A
 *     select stops at the highest key t whose "tokens >= t" reach k (top-k: its ties stay) or
 *     carry ceil(top_p or typical_p * the survivors' mass); of the tokens at t the lowest
 *     indices are kept (a block-wide scan of their masses in index order) until the mass is
 *     reached, as the reference's sorted scan does. Each stage leaves its survivors undivided
 *     and the rest 0 for the next; one pass divides at the end. typical-p's entropy is a sum
 *     of integer terms and its logarithms kern_typical_log's (kern_backend.h), the host's
 *     arithmetic, so the scores are the reference's bits. Tokens with p = 0 stay out of the
 *     histograms: whether one is kept changes no output.
 *   sample: the running sum in index order is split over the block in contiguous segments
 *     (double, block-wide exclusive scan); the first token whose running sum exceeds u wins.
 *     Sums differ from the CPU's sequential ones by rounding, so a u within ~1e-15 of a CDF
 *     boundary may pick the neighbour.
 * Not here: shape checks (kern_ops.c), drawing uniforms (the caller's rng).
 * Threading: enqueues on the backend stream; no workspace, so launches can be captured. */
#include "kern_cuda_internal.h"

#include <math.h>

#define SP_THREADS 1024
#define SP_WARPS (SP_THREADS / 32)
#define SP_BINS 2048
#define SP_FIX_SCALE 1152921504606846976.0   /* 2^60: masses as integers */

typedef unsigned long long ull;

/* ---- block-wide helpers (every thread of the block must call them) ------------------------- */

static __device__ __forceinline__ bool sp_better(float v, int i, float bv, int bi)
{
    return v > bv || (v == bv && i < bi);
}

/* argmax with kern_argmax's rule: larger value, then lower index; NaN never wins; all NaN -> 0 */
static __device__ int sp_block_argmax(const float *x, int n, float *sv, int *si)
{
    float bv = -INFINITY;
    int bi = n;
    for (int i = threadIdx.x; i < n; i += SP_THREADS) {
        float v = x[i];
        if (sp_better(v, i, bv, bi))
            bv = v, bi = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (sp_better(ov, oi, bv, bi))
            bv = ov, bi = oi;
    }
    if ((threadIdx.x & 31) == 0) {
        sv[threadIdx.x >> 5] = bv;
        si[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        bv = sv[threadIdx.x];
        bi = si[threadIdx.x];
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (sp_better(ov, oi, bv, bi))
                bv = ov, bi = oi;
        }
        if (threadIdx.x == 0)
            si[0] = bi < n ? bi : 0;
    }
    __syncthreads();
    int best = si[0];
    __syncthreads();
    return best;
}

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

static __device__ __forceinline__ ull sp_fix(float p)
{
    return __double2ull_rn((double)p * SP_FIX_SCALE);
}

/* A mass bin as two 32-bit words (64-bit shared atomics spin on a compare-and-swap): the low
 * word's wrap-arounds carry into the high one, so the sum stays exact in any order. */
static __device__ __forceinline__ void sp_mass_add(unsigned int *lo, unsigned int *hi, ull v)
{
    unsigned int l = (unsigned int)v, h = (unsigned int)(v >> 32);
    unsigned int old = atomicAdd(lo, l);
    if (old + l < old)
        h++;
    if (h != 0)
        atomicAdd(hi, h);
}

static __device__ __forceinline__ ull sp_mass(const unsigned int *lo, const unsigned int *hi, int b)
{
    return ((ull)hi[b] << 32) + lo[b];
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

/* The shared memory of one radix select. */
struct sp_select_smem {
    unsigned int hc[SP_BINS], hml[SP_BINS], hmh[SP_BINS];
    int digit, found, cnt_t;
    unsigned int cnt_above;
    ull mass_above;
};

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
    __device__ ull operator()(float p) const { return __float_as_uint(p); }
};

/* ... and typical-p's (63 bits): the score's bits reversed, so the highest key is the lowest
 * score (a score is >= 0, its bits are ordered as its value) */
struct sp_key_typical {
    static constexpr int bits = 63;
    double kept, h;
    __device__ ull operator()(float p) const
    {
        return 0x7fffffffffffffffull - (ull)__double_as_longlong(kern_typical_score(p, kept, h));
    }
};

/* Radix select over the keys of the tokens with p > 0, 11 bits a pass from the top. */
template <class K>
static __device__ sp_cut sp_select(const float *p_row, int n, unsigned int k, ull mass, K key, sp_select_smem *sm)
{
    sp_cut cut = {1, 0, 0, 0, 0};
    ull pref_mask = 0;
#pragma unroll 1
    for (int hi = K::bits; hi > 0; hi -= 11) {
        const int width = hi < 11 ? hi : 11, shift = hi - width, nb = 1 << width;
        for (int b = threadIdx.x; b < nb; b += SP_THREADS) {
            sm->hc[b] = 0;
            sm->hml[b] = 0;
            sm->hmh[b] = 0;
        }
        __syncthreads();
        for (int i0 = 0; i0 < n; i0 += SP_THREADS) {
            int i = i0 + threadIdx.x;
            float p = i < n ? p_row[i] : 0.0f;
            unsigned int bits = __float_as_uint(p);
            ull kv = p > 0.0f ? key(p) : 0;
            bool in = p > 0.0f && (kv & pref_mask) == cut.t;
            /* lanes holding the same value add once (rows with many equal probabilities would
             * otherwise queue on a few bins); 0xffffffff is a NaN, never a value that is in */
            unsigned int peers = __match_any_sync(0xffffffffu, in ? bits : 0xffffffffu);
            if (in && (threadIdx.x & 31) == __ffs(peers) - 1) {
                unsigned int cnt = __popc(peers), d = (unsigned int)(kv >> shift) & (unsigned)(nb - 1);
                atomicAdd(&sm->hc[d], cnt);
                sp_mass_add(&sm->hml[d], &sm->hmh[d], (ull)cnt * sp_fix(p));
            }
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            /* lane l takes the l-th run of bins from the top; the running totals of the runs
             * above come from a warp scan, then each lane walks its run downwards */
            const int lane = threadIdx.x, per = nb / 32;
            const int top = nb - 1 - lane * per;
            unsigned int lc = 0;
            ull lm = 0;
            for (int b = top; b > top - per; b--) {
                lc += sm->hc[b];
                lm += sp_mass(sm->hml, sm->hmh, b);
            }
            unsigned int ic = lc;
            ull im = lm;
            for (int o = 1; o < 32; o <<= 1) {
                unsigned int tc = __shfl_up_sync(0xffffffffu, ic, o);
                ull tm = __shfl_up_sync(0xffffffffu, im, o);
                if (lane >= o) {
                    ic += tc;
                    im += tm;
                }
            }
            unsigned int rc = cut.cnt_above + ic - lc;
            ull rm = cut.mass_above + im - lm;
            int digit = -1;
            for (int b = top; b > top - per; b--) {
                ull mb = sp_mass(sm->hml, sm->hmh, b);
                if (rc + sm->hc[b] >= k || rm + mb >= mass) {
                    digit = b;
                    break;
                }
                rc += sm->hc[b];
                rm += mb;
            }
            unsigned int hit = __ballot_sync(0xffffffffu, digit >= 0);
            if (hit == 0) {
                if (lane == 0)
                    sm->found = 0;
            } else if (lane == __ffs(hit) - 1) {
                sm->found = 1;
                sm->digit = digit;
                sm->cnt_above = rc;
                sm->mass_above = rm;
                sm->cnt_t = (int)sm->hc[digit];
            }
        }
        __syncthreads();
        if (!sm->found) {
            cut.found = 0;   /* only in pass 0: no value reaches the limits */
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

/* After a select for target that found its cut: keeps of the tokens with p > 0 in out those
 * whose key is above the cut's and, of those at it, the lowest indices while the mass before
 * them (the ones above, then the ones at the cut in index order) is short of target, as the
 * reference's scan in (key, index) order keeps them; zeroes the rest and leaves the kept
 * undivided. Returns the kept mass. The tokens at the cut are ranked (an exclusive scan of
 * their masses in index order, tile by tile) only when there are several: equal keys may carry
 * unequal masses (typical-p: one token above the typical probability and one below). */
template <class K>
static __device__ ull sp_keep(float *out, int n, K key, const sp_cut &cut, ull target, ull *shu, ull *shs)
{
    const ull need = target - cut.mass_above;   /* > 0: the tokens above the cut fall short */
    const bool rank = cut.cnt_t > 1;            /* block-uniform */
    ull base = 0, mine = 0;
    for (int i0 = 0; i0 < n; i0 += SP_THREADS) {
        int i = i0 + threadIdx.x;
        float p = i < n ? out[i] : 0.0f;
        ull kv = p > 0.0f ? key(p) : 0;
        bool at = p > 0.0f && kv == cut.t;
        ull before = 0, tile = 0;
        if (rank)
            before = sp_block_excl_scan(at ? sp_fix(p) : 0ull, shs, &tile);
        bool keep = p > 0.0f && (kv > cut.t || (at && base + before < need));
        if (keep)
            mine += sp_fix(p);
        else if (i < n)
            out[i] = 0.0f;
        base += tile;
    }
    return sp_block_sum_u(mine, shu);
}

__global__ void __launch_bounds__(SP_THREADS)
probs_kernel(kern_probs_args a)
{
    __shared__ sp_select_smem sm;
    __shared__ float shf[SP_WARPS];
    __shared__ int shi[SP_WARPS];
    __shared__ double shd[2 * SP_WARPS];
    __shared__ ull shu[SP_WARPS], shs[2 * SP_WARPS];

    const int n = a.n;
    const int xr = a.idx != NULL ? a.idx[blockIdx.x] : (int)blockIdx.x;
    const float *x = a.x + (size_t)xr * a.ld_x;
    float *out = a.out + (size_t)blockIdx.x * a.ld_out;
    const kern_sample_cfg c = a.cfg[blockIdx.x];

    if (c.temperature < 1e-5f) {
        int best = sp_block_argmax(x, n, shf, shi);
        for (int i = threadIdx.x; i < n; i += SP_THREADS)
            out[i] = i == best ? 1.0f : 0.0f;
        return;
    }
    /* softmax as the reference: e in double, p = float(float(e) / sum of the double e's) */
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += SP_THREADS)
        mx = fmaxf(mx, x[i]);
    mx = sp_block_max(mx, shf);
    const double temp = (double)c.temperature;
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += SP_THREADS) {
        double e = exp(((double)x[i] - (double)mx) / temp);
        out[i] = (float)e;
        s += e;
    }
    const double sum = sp_block_sum_d(s, shd);
    float pmax = 0.0f;
    for (int i = threadIdx.x; i < n; i += SP_THREADS) {
        out[i] = (float)((double)out[i] / sum);
        pmax = fmaxf(pmax, out[i]);
    }
    const int k = c.top_k > 0 && c.top_k < n ? c.top_k : n;
    /* top_p >= 1 and typical_p outside (0, 1) are off */
    const bool use_p = c.top_p < 1.0f, use_m = c.min_p > 0.0f;
    const bool use_t = c.typical_p > 0.0f && c.typical_p < 1.0f;
    if (k == n && !use_p && !use_m && !use_t)
        return;
    pmax = sp_block_max(pmax, shf);   /* its barriers also put every p in out before reads */

    /* Each stage leaves its survivors in out undivided and the rest 0, and their mass in kept;
     * the next runs over them. The candidates: p >= the k-th largest p (its ties too) and
     * p >= min_p * max p */
    unsigned int tk_bits = 0;
    if (k < n) {
        sp_cut ck = sp_select(out, n, (unsigned)k, ~0ull, sp_key_p{}, &sm);
        if (ck.found)
            tk_bits = (unsigned int)ck.t;   /* else fewer than k tokens have mass: all are candidates */
    }
    const double thr_m = use_m ? (double)c.min_p * (double)pmax : 0.0;
    ull mass = 0;
    for (int i = threadIdx.x; i < n; i += SP_THREADS) {
        float p = out[i];
        if (p > 0.0f && __float_as_uint(p) >= tk_bits && (double)p >= thr_m)
            mass += sp_fix(p);
        else
            out[i] = 0.0f;
    }
    ull kept = sp_block_sum_u(mass, shu);   /* its barriers publish the zeros */

    /* top-p: the tokens of p > t and the first of those with p == t in index order, t found by
     * a select for ceil(top_p * kept) */
    if (use_p) {
        const ull target = (ull)ceil((double)c.top_p * (double)kept);
        sp_cut cp = sp_select(out, n, ~0u, target, sp_key_p{}, &sm);
        if (cp.found)
            kept = sp_keep(out, n, sp_key_p{}, cp, target, shu, shs);
    }
    /* typical-p: the entropy of the survivors (integer terms: the sum has no order), then the
     * same over the score keys for ceil(typical_p * kept) */
    if (use_t) {
        const double kd = (double)kept / SP_FIX_SCALE;
        long long hs = 0;
        for (int i = threadIdx.x; i < n; i += SP_THREADS) {
            float p = out[i];
            if (p > 0.0f)
                hs += kern_typical_term(p, kd);
        }
        /* the int64 sum as ull: two's complement gives the same bits */
        const sp_key_typical key = {kd, kern_typical_entropy((long long)sp_block_sum_u((ull)hs, shu))};
        const ull target = (ull)ceil((double)c.typical_p * (double)kept);
        sp_cut ct = sp_select(out, n, ~0u, target, key, &sm);
        if (ct.found)
            kept = sp_keep(out, n, key, ct, target, shu, shs);
    }
    const double kd = (double)kept / SP_FIX_SCALE;
    for (int i = threadIdx.x; i < n; i += SP_THREADS) {
        float p = out[i];
        out[i] = p > 0.0f ? (float)((double)p / kd) : 0.0f;
    }
}

extern "C" pd_status kern_cuda_probs_launch(kern_backend *be, const kern_probs_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0)
        return PD_OK;
    probs_kernel<<<a->rows, SP_THREADS, 0, c->stream>>>(*a);
    KERN_CUDA_LAUNCH_CHECK(err);
    return PD_OK;
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

extern "C" pd_status kern_cuda_sample_launch(kern_backend *be, const kern_sample_args *a, pd_err *err)
{
    kern_cuda_ctx *c = kern_cuda_ctx_of(be);
    if (a->rows <= 0)
        return PD_OK;
    sample_kernel<<<a->rows, SP_THREADS, 0, c->stream>>>(*a);
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
