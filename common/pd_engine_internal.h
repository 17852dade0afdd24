/* pd_engine_internal.h - private to the engine's files (pd_engine.c and the pd_engine_*.c
 *   parts it is split into), as kern_cuda_internal.h is to the .cu files.
 * Owns: struct pd_engine (the state of an engine), pd_round_slot (one request's part of a decode
 *   round), TRY, and the helpers of pd_engine.c the parts share: host scratch growth, the clock,
 *   and the forwards that run on this thread or on every rank of the tensor-parallel group.
 * Not here: the public API (pd_engine.h); each part's own functions are declared in its own
 *   header (pd_engine_logits.h, ...).
 * Threading: one thread drives an engine (pd_engine.h); nothing here is shared between threads. */
#ifndef PD_ENGINE_INTERNAL_H
#define PD_ENGINE_INTERNAL_H

#include <stdint.h>
#include <time.h>

#include "pd_cp_prefill.h"
#include "pd_engine.h"
#include "pd_host_arena.h"
#include "pd_prefix.h"

#define TRY(expr) \
    do { pd_status st_ = (expr); if (st_ != PD_OK) return st_; } while (0)

struct pd_engine {
    pd_engine_config cfg;
    const pd_qwen3_model *tm;
    const pd_dspark_model *dm;
    int B;                      /* drafts per round (0 without a draft) */
    int V, H, aux_dim;
    pd_kv_pool *tpool, *dpool;
    pd_target *target;
    pd_draft *draft;
    pd_request **reqs;
    int n_reqs, cap_reqs;
    /* sampled requests: distributions on the backend (target rows, and the round's drafts at
     * row j * B + k), the small inputs of each launch staged on the host and uploaded at once */
    kern_buf *smp_p;            /* [cap_smp_p, V] */
    int cap_smp_p;
    kern_buf *smp_q;            /* [cap_smp_q, V] */
    int cap_smp_q;
    kern_buf *smp_dev;          /* staging, bytes */
    int cap_smp_dev;
    void *smp_host;
    int cap_smp_host;
    /* backend scratch */
    kern_buf *ids_dev;          /* int32 argmax outputs */
    kern_buf *pen_dev;          /* [cap_pen] kern_penalty_entry of a step's penalised rows ... */
    int cap_pen;
    kern_penalty_entry *pen_host;  /* ... and their host copy */
    int n_pen, cap_pen_host;
    kern_buf *mask_dev;         /* structured output: a step's masks, [n_mask] rows then
                                 * [n_mask, (V + 31) / 32] bits ... */
    int cap_mask;
    int32_t *mask_rows;         /* ... and their host copies */
    uint32_t *mask_bits;
    int n_mask, cap_mask_rows, cap_mask_bits;
    int cap_ids;
    kern_buf *aux_dev;          /* compacted aux rows for draft extension */
    int cap_aux;
    kern_buf *idx_dev;
    int cap_idx;
    /* deferred draft context: context rows of scheduled requests that do not draft wait here
     * (aux rows on the backend, positions and owners on the host) or, among 8+ requests, only
     * as positions (pd_request.gap_lo) that are recomputed; either way they are added to the
     * draft KV before their request's next drafting round. A round without drafts then costs
     * what a target-only step costs. */
    kern_buf *pend_aux;         /* [cap_pend, aux_dim] */
    int cap_pend;
    int n_pend;                 /* entries, rows of ended requests (owner NULL) included */
    int pend_live;              /* rows still wanted, gaps included (the sum of the requests' n_pend) */
    int32_t *pend_pos;          /* [cap_pend_host] */
    pd_request **pend_owner;
    int cap_pend_host;
    uint64_t ext_epoch;         /* extend_draft calls so far (pd_request.ext_epoch) */
    double flush_row_s;         /* host seconds per buffer row added, smoothed over flushes */
    int gap_live;               /* rows in the requests' gaps (part of pend_live) */
    double gap_row_s;           /* seconds per gap row recomputed and added, smoothed (0: none
                                 * yet; pd_engine_switch_cost takes the profile's forward then) */
    pd_sps sps_default;         /* linear step-time model when no profile is given */
    pd_sched_ctl sched;         /* the scheduled policy's arms (pd_verify_policy.h) */
    int trace_head;             /* the trace's header line was written */
    pd_engine_times times;      /* host time per part of a step (diagnostics) */
    /* context-parallel prefill (cp_size > 1): ranks 1.. have their own backend handle and KV
     * replica; rank 0 is the target's backend and pool */
    int cp_n;
    kern_backend **cp_be;       /* [cp_n], [0] borrowed; 1.. owned when cp_owns_be (host
                                 * handles), else the cp_targets' backends */
    int cp_owns_be;
    pd_kv_pool **cp_pool;       /* [cp_n], [0] = tpool */
    pd_cp_group *cp;
    /* tensor-parallel decode (tp_size > 1): tm/dm are rank 0's shards, owned by the group */
    pd_tp_group *tp;
    pd_host_arena *swap_arena;  /* NULL: preempted requests' KV in malloc'ed blocks */
    size_t swap_used;           /* host bytes of preempted requests' KV (cfg.swap_bytes) */
    int n_swapped;              /* requests preempted now, KV in host memory ... */
    int n_recompute;            /* ... or KV given up (the swap space full): prefilled again */
    uint64_t n_preempt;         /* preemptions so far */
    pd_prefix *prefix;          /* cfg.prefix_cache */
    int prefix_free;            /* pages only the cache holds (pd_engine_prefix_count) */
    uint64_t prefix_hits;       /* prompt tokens served from it */
};

typedef struct {
    pd_request *r;
    int l;            /* drafts verified this round */
    int base;         /* first row of this request in the verify batch */
    int32_t d[32];    /* draft tokens */
    int qrow;         /* sampled drafts: row of d[0]'s distribution in e->smp_q */
    int acc;          /* sampled requests: drafts accepted (pd_engine_verify_sampled) ... */
    int32_t next;     /* ... and the token after them */
    int n_acc;        /* slot_accept: drafts accepted, */
    int32_t bonus;    /* the token after them, */
    int stop_at;      /* the first accepted draft that ends the request (-1: none) */
} pd_round_slot;

/* monotonic host seconds (phase times, the scheduler's round timings) */
static inline double pd_engine_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Grows the host array *p (capacity *cap elements of per bytes, doubling from 8) to hold need
 * elements; contents kept. PD_ERR_NOMEM leaves *p and *cap as they were. */
pd_status pd_engine_grow_host(void **p, int *cap, int need, size_t per, pd_err *err);

/* The forwards of the engine's models: on this thread, or handed to every rank of the
 * tensor-parallel group (the same batch on each). */
pd_status pd_engine_target_forward(pd_engine *e, const pd_tok_batch *b, const int32_t *rows, int n,
                                   pd_err *err);
pd_status pd_engine_draft_extend(pd_engine *e, const float *aux, const pd_tok_batch *b, pd_err *err);
/* Runs c on every rank of the tensor-parallel group (e->tp), rank 0's batch_invariant set. */
pd_status pd_engine_tp_run(pd_engine *e, pd_tp_cmd *c, pd_err *err);

#endif
