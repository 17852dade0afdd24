/* pd_cp_prefill.h - the context-parallel (CP) prefill forward of the Qwen3 target (DESIGN.md §3).
 * Owns: one rank's CP forward (its slots of a split plan through every layer, K/V all-gathered
 *   before attention and stored into the rank's own KV replica, hidden + aux all-gathered and
 *   re-ranged to global order after the last layer, final norm + lm_head at the wanted rows,
 *   greedy first tokens), the guard on the aux handed to the DSpark path, and a group driver
 *   that runs all ranks of one process as threads (local communicator, or NCCL with one GPU
 *   per rank).
 * Not here: the split plans (pd_cp.h), the collectives (pd_comm.h), the layer math (pd_qwen3.c:
 *   pd_layer_qkv / pd_layer_attn_mlp / pd_layer_forward are shared with the plain path),
 *   scheduling (pd_engine_prefill.c).
 * Threading: a pd_cp_rank is used by one thread at a time, the worker of its rank; every rank of
 *   a group calls pd_cp_rank_forward with the same plan and the same batch (except seqs, which
 *   are the rank's own page tables) - the collectives require it. A pd_cp_group is driven by
 *   one thread; it starts one thread per rank for each prefill and joins them before returning.
 *
 * Data movement: ranks share nothing but what goes through pd_comm: each rank has its own
 * backend handle, pd_act workspace, and KV pool replica, so the same code runs with NCCL ranks
 * on separate GPUs. After a forward, every rank holds every layer's K/V of the whole batch in
 * its pages, the packed aux [T, K*hidden] and the pre-norm hidden [T, hidden] in global token
 * order, and the logits of the wanted rows. Padding slots embed token 0 and attend one key; they
 * never reach KV pages (slot -1), aux, hidden or logits.
 *
 * A replicated plan (plan->split == 0: cp_size 1, or a batch the strategy does not apply to)
 * runs the plain single-rank path on every rank: the whole batch through pd_layer_forward, no
 * collectives; results are the same as pd_target_forward's.
 *
 * Failure: a rank that fails aborts its communicator, so the other ranks leave their collective
 * with PD_ERR_PEER (or PD_ERR_TIMEOUT) instead of waiting; the group then rebuilds its
 * communicators before the next prefill. */
#ifndef PD_CP_PREFILL_H
#define PD_CP_PREFILL_H

#include <stdint.h>

#include "kern_backend.h"
#include "pd_comm.h"
#include "pd_cp.h"
#include "pd_kv.h"
#include "pd_model.h"
#include "pd_status.h"

/* ---- one rank --------------------------------------------------------------------------- */

typedef struct pd_cp_rank pd_cp_rank;

typedef struct {
    kern_backend *be;             /* this rank's backend (borrowed; only this rank uses it) */
    const pd_qwen3_model *model;  /* weights readable by be (borrowed; ranks of a host backend
                                   * may share one model) */
    pd_kv_pool *pool;             /* this rank's KV replica, on be, the model's layer shapes
                                   * (borrowed) */
    pd_comm *comm;                /* this rank's communicator handle (borrowed); rank and size
                                   * must match the plans it is given */
    const int *taps;              /* aux tap layers (-1 = embedding output), copied */
    int n_taps;                   /* 0..PD_MAX_TAPS; 0 = no aux */
} pd_cp_rank_config;

/* Checks cfg (taps inside -1..L-2, pool layout against the model) and allocates nothing on the
 * backend yet. PD_ERR_INVALID, PD_ERR_NOMEM. */
pd_status pd_cp_rank_create(const pd_cp_rank_config *cfg, pd_cp_rank **out, pd_err *err);
void pd_cp_rank_destroy(pd_cp_rank *r);

/* One prefill batch, host memory, borrowed for the call. */
typedef struct {
    const int32_t *ids;           /* [plan->n_tokens] packed token ids (sequences in order) */
    pd_kv_seq *const *seqs;       /* [plan->n_seqs] this rank's page tables, reserved to cover
                                   * prefix_lens[s] + the new tokens; the prefix's K/V must
                                   * already be in them */
    const int32_t *logit_rows;    /* [n_logits] packed (global) rows whose logits are wanted */
    int n_logits;                 /* 0..n_tokens */
} pd_cp_batch;

/* Runs this rank's part of the CP forward of `plan` (borrowed; the same plan object or an equal
 * one on every rank). Called concurrently by every rank of the communicator. Errors:
 * PD_ERR_INVALID (no tokens, a plan for another group size, an id outside the vocabulary, a
 * position past the context, a logit row outside the batch, a page table that does not cover
 * its positions), PD_ERR_NOMEM, backend errors, and PD_ERR_PEER / PD_ERR_TIMEOUT from the
 * collectives when another rank failed. Input errors are found before the first collective, so
 * ranks given the same input fail alike; any other failure aborts the communicator. */
pd_status pd_cp_rank_forward(pd_cp_rank *r, const pd_cp_plan *plan, const pd_cp_batch *b,
                             pd_err *err);

/* A row-major tensor in backend memory. */
typedef struct {
    const float *data;
    int rows;
    int cols;
    int ld;                       /* row stride in elements (>= cols) */
} pd_cp_aux;

/* Results of the last forward, valid until the next one (backend memory unless noted). */
pd_cp_aux pd_cp_rank_aux(const pd_cp_rank *r);          /* packed aux [T, K*hidden], global order;
                                                         * data NULL without taps */
const float *pd_cp_rank_hidden(const pd_cp_rank *r);    /* [T, hidden] pre-norm, global order */
const float *pd_cp_rank_logits(const pd_cp_rank *r);    /* [n_logits, vocab] */
const int32_t *pd_cp_rank_first_tokens(const pd_cp_rank *r); /* host [n_logits]: greedy argmax */
int pd_cp_rank_n_tokens(const pd_cp_rank *r);
int pd_cp_rank_aux_dim(const pd_cp_rank *r);            /* K * hidden */
pd_kv_pool *pd_cp_rank_pool(const pd_cp_rank *r);

/* The guard on the hand-off to the DSpark path: aux must be the packed aux of the last forward's
 * T tokens, [T, aux_dim] with ld >= aux_dim, and not the pre-norm hidden state (shapes alone
 * cannot tell them apart when K = 1, so `hidden`, if not NULL, is the pointer it must differ
 * from). PD_ERR_INTERNAL with both shapes in the message (and an error log line) otherwise: a
 * caller that hands the drafter the wrong tensor fails loudly instead of drafting garbage. */
pd_status pd_cp_aux_check(const pd_cp_aux *aux, int n_tokens, int aux_dim, const float *hidden,
                          pd_err *err);

/* ---- a group of ranks in this process ----------------------------------------------------- */

typedef enum {
    PD_CP_COMM_LOCAL = 0,         /* ranks are threads, collectives are copies (pd_comm_local) */
    PD_CP_COMM_NCCL               /* one GPU per rank (pd_comm_nccl; CUDA builds only) */
} pd_cp_comm_kind;

typedef struct {
    kern_backend *be;             /* borrowed; see pd_cp_rank_config */
    const pd_qwen3_model *model;  /* borrowed */
    pd_kv_pool *pool;             /* borrowed */
    int device;                   /* NCCL: the CUDA device of be (the rank thread selects it) */
} pd_cp_rank_res;

typedef struct {
    pd_cp_opts opts;              /* strategy, cp_size, align, force_split */
    pd_cp_comm_kind comm;
    const pd_cp_rank_res *ranks;  /* [opts.cp_size], copied */
    const int *taps;              /* copied */
    int n_taps;
    int timeout_ms;               /* longest wait in a collective; 0: the communicator default */
    pd_comm_copy_fn copy;         /* local: how a rank reads another's buffer; NULL = memcpy,
                                   * which needs host backends */
    void *copy_ud;                /* borrowed */
} pd_cp_group_config;

typedef struct pd_cp_group pd_cp_group;

/* Creates the ranks and their communicators. PD_ERR_INVALID (cp_size < 1, a NULL resource, a
 * local group of device backends without a copy function), PD_ERR_UNSUPPORTED (NCCL without
 * CUDA), communicator errors. */
pd_status pd_cp_group_create(const pd_cp_group_config *cfg, pd_cp_group **out, pd_err *err);
void pd_cp_group_destroy(pd_cp_group *g);

typedef struct {
    int n_seqs;
    const int32_t *seq_lens;      /* [n_seqs] new tokens, each >= 1 */
    const int32_t *prefix_lens;   /* [n_seqs] tokens already in the pages, or NULL for none */
    const int32_t *ids;           /* [sum of seq_lens] packed token ids */
    pd_kv_seq *const *const *seqs; /* seqs[r][s]: rank r's page table of sequence s */
    const int32_t *logit_rows;    /* [n_logits] packed rows whose logits are wanted */
    int n_logits;
} pd_cp_group_batch;

/* Builds the plan of the batch, runs every rank on its own thread, joins them. On success every
 * rank's results are in place (pd_cp_group_rank); rank 0's are the ones a single consumer reads.
 * Errors: PD_ERR_INVALID for an empty batch (no sequence, a length < 1) and the input errors of
 * pd_cp_rank_forward; the first failing rank's error otherwise. Never waits longer than the
 * collectives' timeout for a rank that is gone. */
pd_status pd_cp_group_prefill(pd_cp_group *g, const pd_cp_group_batch *b, pd_err *err);
int pd_cp_group_size(const pd_cp_group *g);
pd_cp_rank *pd_cp_group_rank(pd_cp_group *g, int rank);
/* The plan of the last prefill (NULL before the first); owned by the group. */
const pd_cp_plan *pd_cp_group_plan(const pd_cp_group *g);

#endif
