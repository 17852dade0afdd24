/* pd_cp.h - context-parallel (CP) split strategies as pure index maps.
 * Owns: the strategy enum and its names, the split plan (which rank holds which token of a
 *       packed batch, in which local slot, with which sequence id and position), its inverse,
 *       the "gathered order" maps used to re-range all-gathered rows into global order, host
 *       helpers that apply those maps to rows, and a causal-work counter for balance checks.
 * Not here: moving bytes between ranks (pd_comm.h), the CP forward itself, device kernels
 *       (the forward uploads these int32 arrays and runs one gather/permute kernel).
 * Threading: pure functions; a plan is immutable after _create and may be read by any number
 *       of threads at once.
 *
 * Semantics follow sglang's CP v1/v2 (python/sglang/srt/layers/utils/cp_utils.py,
 * layers/cp/{zigzag,interleave,padding}.py, attention/dsa/utils.py):
 *
 *  round-robin-split (v1, DSA/NSA): packed token g goes to rank g mod cp, local slot g / cp.
 *      The token count is padded to a multiple of cp (padding = the tail of the last row), so
 *      every rank has ceil(T/cp) slots and the all-gathered [cp, n_local] buffer is restored to
 *      global order by one transpose. Applies when cp > 1 and T >= cp.
 *  interleave (v2): rank r owns x[r::cp] of the whole packed batch (sequences concatenated).
 *      Per-rank counts are padded to the maximum, rounded up to `align` (sglang's
 *      pad_logical_token_to_physical; default align = cp): 10 tokens on cp 4 give real counts
 *      [3,3,2,2] and 4 slots on every rank. Applies when cp > 1 and T >= cp.
 *  zigzag (v1 in-seq-split, v2 zigzag): each sequence of length L is cut into 2*cp blocks, the
 *      first L mod 2cp blocks one token longer; rank r owns blocks r and 2cp-1-r of every
 *      sequence. Local order (sglang's zigzag_index): block r of seq 0, of seq 1, ..., then
 *      block 2cp-1-r of seq 0, of seq 1, ..., then padding. Slots per rank = max real count
 *      rounded up to align (default 2*cp, sglang's in-seq-split alignment). Applies when cp > 1
 *      and every sequence has at least 2*cp tokens (sglang's can_cp_split / can_apply: a
 *      sub-threshold extend, e.g. after a prefix-cache hit, runs without CP).
 *
 * When a strategy does not apply (and force_split is off) the plan is a *replicated* plan,
 * sglang's non-CP fallback: plan->split == 0, every rank holds the whole batch in global order
 * (n_local = T, no padding) and computes it redundantly. The owner of each token (inverse map,
 * gathered maps) is rank 0, so a forward that always all-gathers and permutes stays correct;
 * one that checks plan->split can skip the collectives instead. cp_size == 1 is replicated by
 * the same rule (one rank holding everything is both).
 */
#ifndef PD_CP_H
#define PD_CP_H

#include <stddef.h>
#include <stdint.h>

#include "pd_status.h"

typedef enum {
    PD_CP_STRATEGY_ROUND_ROBIN = 0, /* "round-robin-split" */
    PD_CP_STRATEGY_INTERLEAVE,      /* "interleave" */
    PD_CP_STRATEGY_ZIGZAG,          /* "zigzag" */
    PD_CP_STRATEGY_COUNT
} pd_cp_strategy;

/* "round-robin-split", "interleave" or "zigzag" (exact, case-sensitive, as on sglang's command
 * line). PD_ERR_INVALID (message lists the valid names) for anything else or s == NULL. */
pd_status pd_cp_strategy_parse(const char *s, pd_cp_strategy *out, pd_err *err);
/* The name above, or "unknown" for a value out of range. Static string. */
const char *pd_cp_strategy_name(pd_cp_strategy s);

/* The largest cp_size and total token count a plan accepts (int32 indices everywhere). */
#define PD_CP_MAX_SIZE 4096
#define PD_CP_MAX_TOKENS (INT32_MAX / 2)

typedef struct {
    pd_cp_strategy strategy;
    int32_t cp_size;     /* ranks in the CP group, 1..PD_CP_MAX_SIZE */
    int32_t align;       /* slots per rank are rounded up to a multiple of this; 0 = strategy
                          * default (round-robin 1, interleave cp, zigzag 2*cp) */
    int force_split;     /* nonzero: split even where sglang would fall back to no CP (T < cp,
                          * or a zigzag sequence shorter than 2*cp; blocks may then be empty
                          * and ranks may hold only padding). For tests and experiments. */
} pd_cp_opts;

/* A split plan. Created by pd_cp_plan_create, read-only to callers, freed by
 * pd_cp_plan_destroy. Every array is owned by the plan. Slot-indexed arrays are rank-major:
 * rank r's local slot s is element r * n_local + s (the layout of an all-gather of equal-sized
 * per-rank buffers). */
typedef struct pd_cp_plan {
    pd_cp_strategy strategy;
    int32_t cp_size;
    int32_t split;          /* 1: tokens are divided over ranks; 0: replicated (see above) */
    int32_t n_seqs;
    int32_t n_tokens;       /* T: real tokens in the packed batch */
    int32_t n_local;        /* slots per rank, real + padding, the same on every rank */
    int32_t n_slots;        /* cp_size * n_local */

    const int32_t *seq_start;   /* [n_seqs + 1] packed offset of each sequence; [n_seqs] = T */
    const int32_t *prefix_lens; /* [n_seqs] cached tokens before each sequence (0 if none) */
    const int32_t *n_real;      /* [cp_size] real (non-padding) slots of each rank; they come
                                 * first in every strategy, padding fills slots n_real[r].. */

    /* Per slot [n_slots]: what rank r's local row s holds. Padding: -1 in all three; a padding
     * row attends to nothing, its output is ignored, and it never reaches KV pages, aux or
     * logits (the gathered maps skip it). */
    const int32_t *slot_global; /* packed global token index */
    const int32_t *slot_seq;    /* sequence id */
    const int32_t *slot_pos;    /* position in its sequence counting the prefix (RoPE, mask) */

    /* Inverse [n_tokens]: the owner of global token g (rank 0 in a replicated plan). */
    const int32_t *global_rank;
    const int32_t *global_slot;

    /* Gathered order: after an all-gather of the n_local-row buffers of all ranks (rank-major,
     * n_slots rows), row j holds global token gathered_to_global[j] (or -1: padding, or a
     * non-owner copy in a replicated plan), and global token g sits at row
     * global_to_gathered[g] = global_rank[g] * n_local + global_slot[g]. One gather kernel
     * out[g] = gathered[global_to_gathered[g]] restores global order. */
    const int32_t *gathered_to_global; /* [n_slots] */
    const int32_t *global_to_gathered; /* [n_tokens] */
} pd_cp_plan;

/* Build the plan for a packed batch of n_seqs sequences: seq_lens[i] > 0 new tokens each,
 * packed in order; prefix_lens[i] >= 0 tokens already cached before them (positions start
 * there), or prefix_lens == NULL for none. Both arrays are borrowed for the call only.
 * Errors: PD_ERR_INVALID for n_seqs < 1, a length < 1, a negative prefix, a total over
 * PD_CP_MAX_TOKENS, cp_size outside 1..PD_CP_MAX_SIZE, align < 0, an unknown strategy, or a
 * plan too large for int32 slots; PD_ERR_NOMEM. *out is set only on success. */
pd_status pd_cp_plan_create(const int32_t *seq_lens, const int32_t *prefix_lens, int32_t n_seqs,
                            const pd_cp_opts *opts, pd_cp_plan **out, pd_err *err);
void pd_cp_plan_destroy(pd_cp_plan *plan);

/* Whether `opts` would really split this batch (plan->split) without building a plan: the
 * sglang applicability rule above. Invalid input answers 0. */
int pd_cp_plan_would_split(const int32_t *seq_lens, int32_t n_seqs, const pd_cp_opts *opts);

/* Rank r's row of a slot-indexed array: n_local entries. r must be < cp_size. */
static inline const int32_t *pd_cp_plan_rank_row(const pd_cp_plan *p, const int32_t *arr,
                                                 int32_t r)
{
    return arr + (size_t)r * (size_t)p->n_local;
}

/* Host helpers that apply the maps to rows of row_bytes bytes (the reference for the device
 * kernels). Buffers are borrowed; none may overlap.
 * shard:  local[s] = global[slot_global[r * n_local + s]]; padding rows are zeroed.
 *         global has n_tokens rows, local n_local rows.
 * gather: out[g] = gathered[global_to_gathered[g]]; gathered has n_slots rows (all ranks'
 *         local buffers, rank-major), out n_tokens rows.
 * PD_ERR_INVALID for a NULL buffer (with nonzero size) or rank out of range. */
pd_status pd_cp_shard_rows(const pd_cp_plan *plan, int32_t rank, const void *global,
                           void *local, size_t row_bytes, pd_err *err);
pd_status pd_cp_gather_rows(const pd_cp_plan *plan, const void *gathered, void *out,
                            size_t row_bytes, pd_err *err);

/* Causal attention work per rank: for every real slot of rank r, the number of keys it
 * attends, i.e. (query, key) pairs with key position <= query position within the same
 * sequence, counting the cached prefix (slot_pos + 1). out_work has cp_size entries. */
void pd_cp_plan_attn_work(const pd_cp_plan *plan, int64_t *out_work);

#endif
