/* pd_tp.h - tensor-parallel decode (--tp N): how a Qwen3 target and its DSpark drafter are split
 *   over N ranks, the collectives the forward calls at the split points, and the group of rank
 *   threads an engine drives.
 * Owns: the shard arithmetic (attention heads, KV heads, MLP columns, vocab slices) and its
 *   checks; a rank's sharded weights, built from a loaded model; the per-rank context
 *   (communicator + gather scratch) that pd_qwen3.c and pd_dspark.c consult at o_proj,
 *   down_proj, lm_head and markov_w2; the worker threads of ranks 1..N-1 and the hand-off of
 *   every forward from rank 0 to them.
 * Not here: the layer math (pd_qwen3.c), the drafter math (pd_dspark.c); scheduling, sampling,
 *   acceptance and verification lengths (pd_engine*.c, on rank 0 only).
 * Threading: a pd_tp_rank is used by the thread of its rank. A pd_tp_group is driven by one
 *   thread (the engine's, which is rank 0); its workers touch only their own rank's state.
 *
 * The split (Megatron style): q/k/v/gate/up are column-parallel (a rank holds the output rows of
 * its heads / MLP columns), o_proj and down_proj row-parallel: each rank's partial product is
 * summed by an all-reduce before the residual add (rank 0 adds its partial to the residual,
 * the others contribute theirs alone, so the sum is residual + sum of partials). KV heads are
 * split like the query heads; when there are fewer KV heads than ranks, each KV head is
 * replicated over tp / num_kv_heads ranks. lm_head and markov_w2 are split by vocabulary rows
 * into slices of ceil(V / tp) (the last one shorter); each rank computes the logits of its slice
 * and an all-gather puts the whole rows together on every rank, at every Markov step. The
 * embedding table, the norms and the drafter's decoder layers are replicated (the drafter's
 * lm_head/markov_w2 products use the vocab slices of the same group).
 *
 * Commands: rank 0 decides everything (batch composition, verification lengths, sampling) and
 * hands each forward to the workers as a pd_tp_cmd that points at rank 0's own host metadata
 * (ranks are threads of this process); the workers read that one copy, so no rank can run a
 * different batch shape. Rank 0 returns from pd_tp_group_run only after every worker finished
 * the command, so the metadata only has to live for the call.
 *
 * Failure: a rank whose forward fails aborts the communicator, so the others leave their
 * collective with PD_ERR_PEER instead of waiting; pd_tp_group_run then returns the first
 * rank's own error (named by rank) and the group stays broken: every later run fails at once
 * with PD_ERR_PEER. */
#ifndef PD_TP_H
#define PD_TP_H

#include <stddef.h>
#include <stdint.h>

#include "kern_backend.h"
#include "pd_comm.h"
#include "pd_dspark.h"
#include "pd_model.h"
#include "pd_qwen3.h"
#include "pd_status.h"

#define PD_TP_MAX_SIZE 64

/* ---- shard arithmetic -------------------------------------------------------------------- */

/* What rank `rank` of `size` holds. */
typedef struct {
    int rank, size;
    int q_head0, n_q_heads;       /* attention heads [q_head0, q_head0 + n_q_heads) */
    int kv_head0, n_kv_heads;     /* KV heads [kv_head0, kv_head0 + n_kv_heads) */
    int inter0, n_inter;          /* MLP intermediate columns */
    int vocab0, n_vocab;          /* lm_head / markov_w2 rows */
    int vocab_slice;              /* ceil(V / size): the slice width every rank gathers */
} pd_tp_shard;

/* PD_ERR_INVALID, naming the problem, unless c can be split over tp ranks: 1 <= tp <=
 * PD_TP_MAX_SIZE, tp <= and divides the attention heads, the KV heads divide or are divided by
 * tp, at least tp MLP columns, every vocab slice non-empty. */
pd_status pd_tp_check(const pd_qwen3_config *c, int tp, pd_err *err);
/* The shard of rank `rank` (c must pass pd_tp_check for size). */
void pd_tp_shard_of(const pd_qwen3_config *c, int size, int rank, pd_tp_shard *out);

/* Rank `rank`'s weights of full (borrowed for the call) on be: the config's head counts and
 * intermediate_size are the rank's own (vocab_size stays the whole vocabulary: logits rows
 * keep their full width); every tensor, sliced or replicated, is copied into one allocation on
 * be. Free with pd_qwen3_free. */
pd_status pd_tp_qwen3_shard(const pd_qwen3_model *full, kern_backend *be, int size, int rank,
                            pd_qwen3_model **out, pd_err *err);
/* The drafter of rank `rank`: decoder layers, fc, norms and heads replicated; lm_head and
 * markov_w2 cut to the rank's vocab slice. Tensors the full drafter borrows from full_target
 * (embed, lm_head) are taken from target_shard (rank `rank`'s shard of full_target, which must
 * outlive the result). Free with pd_dspark_free. */
pd_status pd_tp_dspark_shard(const pd_dspark_model *full, const pd_qwen3_model *full_target,
                             const pd_qwen3_model *target_shard, kern_backend *be, int size,
                             int rank, pd_dspark_model **out, pd_err *err);

/* ---- the per-rank context the forward consults ------------------------------------------- */

typedef struct pd_tp_rank pd_tp_rank;

/* 1 when this rank adds its row-parallel partial product to the residual (no TP, or rank 0),
 * 0 when it writes its partial alone (the all-reduce adds it). tp may be NULL. */
int pd_tp_accumulate(const pd_tp_rank *tp);
/* Sums x [n] over the ranks in place (a no-op for tp == NULL). */
pd_status pd_tp_all_reduce(pd_tp_rank *tp, float *x, size_t n, pd_err *err);
/* logits [rows, ld] (backend memory) holds this rank's vocab slice in its columns
 * [0, n_vocab); afterwards every rank holds all V columns (a no-op for tp == NULL). */
pd_status pd_tp_gather_vocab(pd_tp_rank *tp, float *logits, int ld, int rows, pd_err *err);
int pd_tp_rank_index(const pd_tp_rank *tp);

/* ---- the group of ranks an engine drives ------------------------------------------------- */

typedef enum {
    PD_TP_TARGET_FORWARD = 1,     /* pd_target_forward(b, rows, n_rows) */
    PD_TP_DRAFT_EXTEND,           /* rank 0's aux [b->n_tok, ld_aux] is broadcast, then
                                   * pd_draft_extend on every rank */
    PD_TP_DRAFT_BLOCK,            /* pd_draft_block(n_req, anchor, start, seqs) */
    PD_TP_MARKOV_STEP,            /* pd_draft_markov_step(k, prev); conf_out on rank 0 only */
    PD_TP_KV_COPY                 /* the workers copy the first n_tpages / n_dpages pages of
                                   * tseq / dseq (rank 0's tables) between their pools and
                                   * host[rank] (pd_kv_seq_copy: target pages, then draft
                                   * pages); rank 0's pools are the engine's, copied by it */
} pd_tp_op;

/* One forward for every rank; pointers are rank 0's, borrowed for pd_tp_group_run. Page tables
 * are rank 0's: the workers' pools have the same pages, allocated by rank 0 only. */
typedef struct {
    pd_tp_op op;
    int batch_invariant;          /* copied into every worker backend first */
    const pd_tok_batch *b;        /* TARGET_FORWARD, DRAFT_EXTEND */
    const int32_t *rows;          /* TARGET_FORWARD: logit rows */
    int n_rows;
    const float *aux;             /* DRAFT_EXTEND: rank 0's backend rows */
    int ld_aux;
    int n_req;                    /* DRAFT_BLOCK */
    const int32_t *anchor, *start;
    pd_kv_seq *const *seqs;
    int k;                        /* MARKOV_STEP */
    const int32_t *prev;
    float *conf_out;
    const pd_kv_seq *tseq, *dseq; /* KV_COPY */
    int n_tpages, n_dpages;
    char *const *host;            /* [size]; [0] unused */
    int to_host;
} pd_tp_cmd;

typedef struct {
    const pd_qwen3_model *target;    /* the whole model (borrowed; must outlive the group) */
    const pd_dspark_model *draft;    /* the whole drafter or NULL (borrowed, likewise) */
    int size;                        /* ranks, 2..PD_TP_MAX_SIZE */
    int page_size, n_pages, draft_n_pages;   /* pools of the workers (as rank 0's); draft 0:
                                              * n_pages */
    double kv_mem_fraction;          /* in (0, 1) with n_pages 0: every rank's pools together
                                      * take this fraction of their devices' free memory, once
                                      * the shards are there (pd_kv_pages_from_memory) */
    const int *taps;                 /* the target's aux taps (copied) */
    int n_taps;
    int timeout_ms;                  /* longest wait in a collective; 0: 60000 */
    int debug_fail_rank;             /* tests only: rank debug_fail_rank - 1 fails command number
                                      * debug_fail_cmd (from 1) before running it; 0 = never */
    int debug_fail_cmd;
} pd_tp_group_config;

typedef struct pd_tp_group pd_tp_group;

/* Checks the split (pd_tp_check), builds every rank's shards, sizes the pools (n_pages, or
 * kv_mem_fraction once every shard is on its device), and starts ranks 1..size-1 as threads,
 * each with its own backend handle of the target's kind, KV pools and runners. A host backend
 * gets the local communicator; cuda one GPU per rank and NCCL (PD_ERR_UNSUPPORTED without).
 * PD_ERR_INVALID, PD_ERR_NOMEM, backend errors. */
pd_status pd_tp_group_create(const pd_tp_group_config *cfg, pd_tp_group **out, pd_err *err);
/* Stops the workers and frees everything the group owns (rank 0's shards included: destroy
 * the runners that use them first). NULL is a no-op. */
void pd_tp_group_destroy(pd_tp_group *g);
/* Rank 0's shards, owned by the group, on the target's backend. */
const pd_qwen3_model *pd_tp_group_target(const pd_tp_group *g);
const pd_dspark_model *pd_tp_group_draft(const pd_tp_group *g);
/* Rank 0's runners (the engine's, built on the shards above; borrowed): they get the group's
 * rank-0 context. draft may be NULL when the group has no drafter. */
void pd_tp_group_attach(pd_tp_group *g, pd_target *target, pd_draft *draft);
/* Runs c on every rank; rank 0's part on the calling thread. See "Failure" above. */
pd_status pd_tp_group_run(pd_tp_group *g, const pd_tp_cmd *c, pd_err *err);
int pd_tp_group_size(const pd_tp_group *g);
/* The pages of each rank's target and draft pools (rank 0's pools take the same). */
void pd_tp_group_pages(const pd_tp_group *g, int *n_pages, int *draft_n_pages);
/* Host bytes rank (1..size-1) needs for n_t target and n_d draft pages of its own pools (the
 * PD_TP_KV_COPY layout). */
size_t pd_tp_group_kv_bytes(const pd_tp_group *g, int rank, int n_t, int n_d);

#endif
