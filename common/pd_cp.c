/* pd_cp.c - context-parallel split strategies as pure index maps (see pd_cp.h for the
 * semantics of each strategy and of replicated plans).
 * Owns: building a pd_cp_plan (forward maps, inverse, gathered order) and the host helpers that
 *       apply it to rows.
 * Not here: communication (pd_comm.c), device kernels, the CP forward.
 * Threading: pure; a plan is immutable once built, so any thread may read it. */
#include "pd_cp.h"

#include <stdlib.h>
#include <string.h>

static const char *const strategy_names[PD_CP_STRATEGY_COUNT] = {
    [PD_CP_STRATEGY_ROUND_ROBIN] = "round-robin-split",
    [PD_CP_STRATEGY_INTERLEAVE] = "interleave",
    [PD_CP_STRATEGY_ZIGZAG] = "zigzag",
};

pd_status pd_cp_strategy_parse(const char *s, pd_cp_strategy *out, pd_err *err)
{
    if (s != NULL) {
        for (int i = 0; i < PD_CP_STRATEGY_COUNT; i++) {
            if (strcmp(s, strategy_names[i]) == 0) {
                *out = (pd_cp_strategy)i;
                return PD_OK;
            }
        }
    }
    return pd_err_set(err, PD_ERR_INVALID,
                      "cp strategy '%s': expected round-robin-split, interleave or zigzag",
                      s != NULL ? s : "(null)");
}

const char *pd_cp_strategy_name(pd_cp_strategy s)
{
    if ((int)s < 0 || s >= PD_CP_STRATEGY_COUNT)
        return "unknown";
    return strategy_names[s];
}

/* The plan as allocated: the public part first so a pd_cp_plan * is also a plan_impl *. All
 * int32 arrays live in one arena so destroy is two frees and the arrays are contiguous. */
typedef struct {
    pd_cp_plan pub;
    int32_t *arena;
} plan_impl;

/* Zigzag block b (0..2cp-1) of a sequence of length len: the first len mod 2cp blocks carry one
 * extra token, as sglang's split_list does. */
static void zigzag_block(int32_t len, int32_t cp, int32_t b, int32_t *start, int32_t *size)
{
    int32_t nblk = 2 * cp;
    int32_t base = len / nblk, rem = len % nblk;
    *start = b * base + (b < rem ? b : rem);
    *size = base + (b < rem ? 1 : 0);
}

static int32_t default_align(pd_cp_strategy s, int32_t cp)
{
    switch (s) {
    case PD_CP_STRATEGY_INTERLEAVE: return cp;
    case PD_CP_STRATEGY_ZIGZAG: return 2 * cp;
    default: return 1;
    }
}

static pd_status check_input(const int32_t *seq_lens, const int32_t *prefix_lens, int32_t n_seqs,
                             const pd_cp_opts *opts, int64_t *total_out, pd_err *err)
{
    if (opts == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp plan: no options");
    if ((int)opts->strategy < 0 || opts->strategy >= PD_CP_STRATEGY_COUNT)
        return pd_err_set(err, PD_ERR_INVALID, "cp plan: unknown strategy %d", (int)opts->strategy);
    if (opts->cp_size < 1 || opts->cp_size > PD_CP_MAX_SIZE)
        return pd_err_set(err, PD_ERR_INVALID, "cp plan: cp size %d outside 1..%d",
                          (int)opts->cp_size, PD_CP_MAX_SIZE);
    if (opts->align < 0)
        return pd_err_set(err, PD_ERR_INVALID, "cp plan: align %d < 0", (int)opts->align);
    if (n_seqs < 1 || seq_lens == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp plan: empty batch (%d sequences)", (int)n_seqs);
    int64_t total = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        if (seq_lens[i] < 1)
            return pd_err_set(err, PD_ERR_INVALID, "cp plan: sequence %d has length %d",
                              (int)i, (int)seq_lens[i]);
        int32_t pre = prefix_lens != NULL ? prefix_lens[i] : 0;
        if (pre < 0 || (int64_t)pre + seq_lens[i] > INT32_MAX)
            return pd_err_set(err, PD_ERR_INVALID, "cp plan: sequence %d has prefix %d, length %d",
                              (int)i, (int)pre, (int)seq_lens[i]);
        total += seq_lens[i];
        if (total > PD_CP_MAX_TOKENS)
            return pd_err_set(err, PD_ERR_INVALID, "cp plan: more than %d tokens",
                              (int)PD_CP_MAX_TOKENS);
    }
    *total_out = total;
    return PD_OK;
}

/* sglang's applicability rule; input already validated. */
static int rule_applies(const int32_t *seq_lens, int32_t n_seqs, int64_t total,
                        const pd_cp_opts *opts)
{
    int32_t cp = opts->cp_size;
    if (cp <= 1)
        return 0;
    if (opts->strategy == PD_CP_STRATEGY_ZIGZAG) {
        for (int32_t i = 0; i < n_seqs; i++)
            if (seq_lens[i] < 2 * cp)
                return 0;
        return 1;
    }
    return total >= cp;
}

int pd_cp_plan_would_split(const int32_t *seq_lens, int32_t n_seqs, const pd_cp_opts *opts)
{
    int64_t total = 0;
    if (check_input(seq_lens, NULL, n_seqs, opts, &total, NULL) != PD_OK)
        return 0;
    return opts->force_split || rule_applies(seq_lens, n_seqs, total, opts);
}

/* Real tokens per rank for a split plan. */
static void count_real(const int32_t *seq_lens, int32_t n_seqs, int32_t total,
                       const pd_cp_opts *opts, int32_t *n_real)
{
    int32_t cp = opts->cp_size;
    if (opts->strategy == PD_CP_STRATEGY_ZIGZAG) {
        for (int32_t r = 0; r < cp; r++) {
            int64_t sum = 0;
            for (int32_t i = 0; i < n_seqs; i++) {
                int32_t st, a, b;
                zigzag_block(seq_lens[i], cp, r, &st, &a);
                zigzag_block(seq_lens[i], cp, 2 * cp - 1 - r, &st, &b);
                sum += a + b;
            }
            n_real[r] = (int32_t)sum; /* <= total, which fits int32 */
        }
        return;
    }
    for (int32_t r = 0; r < cp; r++)
        n_real[r] = total / cp + (r < total % cp ? 1 : 0);
}

static void place(pd_cp_plan *p, int32_t *slot_global, int32_t *global_rank,
                  int32_t *global_slot, int32_t g, int32_t r, int32_t s)
{
    slot_global[(size_t)r * (size_t)p->n_local + (size_t)s] = g;
    global_rank[g] = r;
    global_slot[g] = s;
}

pd_status pd_cp_plan_create(const int32_t *seq_lens, const int32_t *prefix_lens, int32_t n_seqs,
                            const pd_cp_opts *opts, pd_cp_plan **out, pd_err *err)
{
    int64_t total64 = 0;
    pd_status st = check_input(seq_lens, prefix_lens, n_seqs, opts, &total64, err);
    if (st != PD_OK)
        return st;
    int32_t T = (int32_t)total64;
    int32_t cp = opts->cp_size;
    int split = opts->force_split || rule_applies(seq_lens, n_seqs, total64, opts);

    /* n_real is computed before the arena exists: it decides n_local, which sizes the arena. */
    int32_t *n_real_tmp = malloc((size_t)cp * sizeof(int32_t));
    if (n_real_tmp == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "cp plan: %d ranks", (int)cp);
    int64_t n_local;
    if (split) {
        count_real(seq_lens, n_seqs, T, opts, n_real_tmp);
        int32_t mx = 0;
        for (int32_t r = 0; r < cp; r++)
            if (n_real_tmp[r] > mx)
                mx = n_real_tmp[r];
        int64_t align = opts->align > 0 ? opts->align : default_align(opts->strategy, cp);
        n_local = (mx + align - 1) / align * align;
    } else {
        for (int32_t r = 0; r < cp; r++)
            n_real_tmp[r] = T;
        n_local = T;
    }
    int64_t n_slots = n_local * cp;
    if (n_slots > INT32_MAX / 4) {
        st = pd_err_set(err, PD_ERR_INVALID, "cp plan: %lld slots (%d ranks x %lld) too many",
                        (long long)n_slots, (int)cp, (long long)n_local);
        goto err_free_tmp;
    }

    plan_impl *impl = calloc(1, sizeof(*impl));
    if (impl == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "cp plan: %zu bytes", sizeof(*impl));
        goto err_free_tmp;
    }
    /* arena: seq_start, prefix, n_real, 4 slot arrays, 3 token arrays, 2 token scratch */
    size_t n_words = (size_t)(n_seqs + 1) + (size_t)n_seqs + (size_t)cp + 4 * (size_t)n_slots +
                     5 * (size_t)T;
    int32_t *a = malloc(n_words * sizeof(int32_t));
    if (a == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "cp plan: %zu index words", n_words);
        goto err_free_impl;
    }
    impl->arena = a;
    int32_t *seq_start = a;            a += n_seqs + 1;
    int32_t *prefix = a;               a += n_seqs;
    int32_t *n_real = a;               a += cp;
    int32_t *slot_global = a;          a += n_slots;
    int32_t *slot_seq = a;             a += n_slots;
    int32_t *slot_pos = a;             a += n_slots;
    int32_t *g2j_rev = a;              a += n_slots; /* gathered_to_global */
    int32_t *global_rank = a;          a += T;
    int32_t *global_slot = a;          a += T;
    int32_t *global_to_gathered = a;   a += T;
    int32_t *tok_seq = a;              a += T;       /* scratch kept in the arena: cheap */
    int32_t *tok_pos = a;

    pd_cp_plan *p = &impl->pub;
    p->strategy = opts->strategy;
    p->cp_size = cp;
    p->split = split;
    p->n_seqs = n_seqs;
    p->n_tokens = T;
    p->n_local = (int32_t)n_local;
    p->n_slots = (int32_t)n_slots;

    memcpy(n_real, n_real_tmp, (size_t)cp * sizeof(int32_t));
    seq_start[0] = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        seq_start[i + 1] = seq_start[i] + seq_lens[i];
        prefix[i] = prefix_lens != NULL ? prefix_lens[i] : 0;
        for (int32_t t = 0; t < seq_lens[i]; t++) {
            tok_seq[seq_start[i] + t] = i;
            tok_pos[seq_start[i] + t] = prefix[i] + t;
        }
    }
    for (int64_t j = 0; j < n_slots; j++)
        slot_global[j] = -1;

    if (!split) {
        for (int32_t r = 0; r < cp; r++)
            for (int32_t g = 0; g < T; g++)
                slot_global[(size_t)r * (size_t)T + (size_t)g] = g;
        for (int32_t g = 0; g < T; g++) {
            global_rank[g] = 0;
            global_slot[g] = g;
        }
    } else if (opts->strategy == PD_CP_STRATEGY_ZIGZAG) {
        for (int32_t r = 0; r < cp; r++) {
            int32_t s = 0;
            /* sglang's zigzag_index: the early block of every sequence, then the late ones */
            for (int half = 0; half < 2; half++) {
                int32_t b = half == 0 ? r : 2 * cp - 1 - r;
                for (int32_t i = 0; i < n_seqs; i++) {
                    int32_t bst, bsz;
                    zigzag_block(seq_lens[i], cp, b, &bst, &bsz);
                    for (int32_t t = 0; t < bsz; t++)
                        place(p, slot_global, global_rank, global_slot, seq_start[i] + bst + t,
                              r, s++);
                }
            }
            PD_ASSERT(s == n_real[r]);
        }
    } else {
        for (int32_t g = 0; g < T; g++)
            place(p, slot_global, global_rank, global_slot, g, g % cp, g / cp);
    }

    for (int64_t j = 0; j < n_slots; j++) {
        int32_t g = slot_global[j];
        slot_seq[j] = g >= 0 ? tok_seq[g] : -1;
        slot_pos[j] = g >= 0 ? tok_pos[g] : -1;
        /* a replicated plan's non-owner copies are not part of the gathered order */
        g2j_rev[j] = (split || j < T) ? g : -1;
    }
    for (int32_t g = 0; g < T; g++)
        global_to_gathered[g] = global_rank[g] * (int32_t)n_local + global_slot[g];

    p->seq_start = seq_start;
    p->prefix_lens = prefix;
    p->n_real = n_real;
    p->slot_global = slot_global;
    p->slot_seq = slot_seq;
    p->slot_pos = slot_pos;
    p->global_rank = global_rank;
    p->global_slot = global_slot;
    p->gathered_to_global = g2j_rev;
    p->global_to_gathered = global_to_gathered;
    free(n_real_tmp);
    *out = p;
    return PD_OK;

err_free_impl:
    free(impl);
err_free_tmp:
    free(n_real_tmp);
    return st;
}

void pd_cp_plan_destroy(pd_cp_plan *plan)
{
    if (plan == NULL)
        return;
    plan_impl *impl = (plan_impl *)plan;
    free(impl->arena);
    free(impl);
}

pd_status pd_cp_shard_rows(const pd_cp_plan *plan, int32_t rank, const void *global,
                           void *local, size_t row_bytes, pd_err *err)
{
    if (plan == NULL || rank < 0 || rank >= plan->cp_size)
        return pd_err_set(err, PD_ERR_INVALID, "cp shard: rank %d of %d", (int)rank,
                          plan != NULL ? (int)plan->cp_size : 0);
    if (row_bytes == 0)
        return PD_OK;
    if (global == NULL || local == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp shard: null buffer");
    const int32_t *sg = pd_cp_plan_rank_row(plan, plan->slot_global, rank);
    const unsigned char *src = global;
    unsigned char *dst = local;
    for (int32_t s = 0; s < plan->n_local; s++) {
        if (sg[s] >= 0)
            memcpy(dst + (size_t)s * row_bytes, src + (size_t)sg[s] * row_bytes, row_bytes);
        else
            memset(dst + (size_t)s * row_bytes, 0, row_bytes);
    }
    return PD_OK;
}

pd_status pd_cp_gather_rows(const pd_cp_plan *plan, const void *gathered, void *out,
                            size_t row_bytes, pd_err *err)
{
    if (plan == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp gather: no plan");
    if (row_bytes == 0)
        return PD_OK;
    if (gathered == NULL || out == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "cp gather: null buffer");
    const unsigned char *src = gathered;
    unsigned char *dst = out;
    for (int32_t g = 0; g < plan->n_tokens; g++)
        memcpy(dst + (size_t)g * row_bytes, src + (size_t)plan->global_to_gathered[g] * row_bytes,
               row_bytes);
    return PD_OK;
}

void pd_cp_plan_attn_work(const pd_cp_plan *plan, int64_t *out_work)
{
    for (int32_t r = 0; r < plan->cp_size; r++) {
        const int32_t *pos = pd_cp_plan_rank_row(plan, plan->slot_pos, r);
        int64_t w = 0;
        for (int32_t s = 0; s < plan->n_local; s++)
            if (pos[s] >= 0)
                w += (int64_t)pos[s] + 1;
        out_work[r] = w;
    }
}
