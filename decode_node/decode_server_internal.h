/* decode_server_internal.h - what the decode node's engine-thread modules share
 *   (decode_server.c, decode_prefill.c): the request handle, the prefill-node record, the server
 *   struct, and the server functions the prefill side calls.
 * Owns: declarations only.
 * Not here: the public API (decode_api.h), the prefill side's functions (decode_prefill.h).
 * Threading: fields marked "engine thread" and every function below belong to the engine thread
 *   (decode_server.c says which other fields are shared and how). */
#ifndef DECODE_SERVER_INTERNAL_H
#define DECODE_SERVER_INTERNAL_H

#include "decode_api.h"

#include <pthread.h>
#include <stdatomic.h>

#include "pd_loop.h"
#include "pd_rpc.h"
#include "pd_grammar.h"
#include "pd_tokenizer.h"
#include "pd_xfer.h"
#include "pd_xfer_thread.h"

#define TICK_MS 20
#define NODE_DOWN_MS 1000.0      /* a failed prefill node is tried last for this long */

typedef enum {
    H_QUEUED = 0,   /* waiting for KV pages (or a batch slot) */
    H_PREFILL,      /* pages reserved, Prefill in flight */
    H_RUNNING,      /* in the engine's decode rounds (or its in-process prefill) */
    H_ZOMBIE,       /* ended for the caller, pages held until the Prefill reply */
    H_HOLD,         /* ended, pages held until hold_until (a put may still land) */
    H_GONE          /* nothing left on the engine thread */
} handle_state;

typedef struct prefill_node {
    struct decode_server *s;
    char addr[160];
    char host[128];          /* the name --prefill gave for addr: what its TLS certificate must name */
    pd_rpc_channel *ch;
    int inflight;            /* Prefill calls */
    int calls;               /* every call in flight on ch (Prefill + CancelPrefill) */
    double down_until;
    int reset;               /* recreate the channel once idle (after a failure; also
                              * done after a TLS reload) */
    int gone;                /* no longer among the addresses --prefill resolves to: not picked */
} prefill_node;

struct decode_handle {
    atomic_int refs;                 /* caller + server */
    atomic_int cancel_asked;
    decode_server *s;
    char id[96];
    uint64_t eid;
    uint64_t group;                  /* decode_req.group */
    int32_t *prompt;
    pd_logit_bias *bias;             /* the request's logit_bias (gp.logit_bias points here) */
    uint32_t *allow;                 /* allowed_token_ids as bits (gp.allow points here) */
    int32_t *bad;                    /* bad_words' token sequences (gp.bad points here) */
    pd_grammar *grammar;             /* structured output (gp.grammar points here), or NULL */
    int cached_remote;               /* disaggregated: prompt tokens the prefill node's cache served */
    int n_prompt;
    pd_gen_params gp;
    decode_token_fn on_token;
    decode_done_fn on_done;
    void *ud;
    double t_submit, t_first, deadline;  /* deadline 0 = none */
    double t_admit, t_sent, t_reply;     /* admitted; the last Prefill sent; its reply (0 = not yet) */
    double t_last;                   /* engine thread: the previous chunk (observer's gap) */
    /* engine thread only below */
    handle_state state;
    int done_called;
    pd_request *r;
    pd_detok *detok;
    prefill_node *node;
    int prefill_by_deadline;         /* its Prefill call is bounded by the request's deadline */
    pd_rpc_pending *pending;
    int aux_row;                     /* first row in the aux arena, -1 = none */
    int32_t *stage_pages;            /* staging: the staging page of each prompt page, from its
                                      * Prefill until no put of it can land (NULL = none) */
    int n_stage;
    int stage_waited;                /* it waited for staging pages (counted once) */
    double hold_until;
    pd_status fail_st;               /* status for an engine-side PD_FINISH_ERROR */
    int retries;                     /* Prefill re-sent after a node that was never reached */
    struct decode_handle *prev, *next;
};

typedef struct { int start, n; } aux_seg;

struct decode_server {
    decode_config cfg;
    char *model_dir, *draft_dir, *device, *prefill;
    pd_chat_template chat;          /* decode_server_chat_template, when chat_ok */
    decode_gen_defaults gen;        /* decode_server_gen_defaults */
    int chat_ok;
    char chat_why[256];
    kern_backend *be;
    pd_qwen3_model *tm;
    pd_cp_targets cp_targets;   /* --colocated CP on a device backend: the targets of ranks 1.. */
    pd_dspark_model *dm;
    pd_tokenizer *tok;
    pd_gvocab *gvocab;              /* the vocabulary for structured output's token masks */
    pd_gcache *grammars;            /* compiled structured-output grammars by spec */
    pd_engine *eng;
    pd_calib calib;                 /* confidence calibration (identity when none is shipped) */
    pd_sps sps;                     /* scheduled verification: this device's step-time curve */
    int vocab, max_ctx, page_size, total_pages, block_size, aux_dim, hidden;
    pd_loop *loop;
    pthread_t thread;
    int thread_started;
    pd_loop_timer *step_timer, *tick_timer;
    int step_armed;
    int admit_blocked;               /* the queue head waits for pages: retry on a change/tick */
    atomic_int accepting;
    atomic_int draining;             /* decode_server_drain was called */
    atomic_int n_waiting;            /* QUEUED handles (submit-side bound) */
    atomic_ullong next_id;
    /* engine thread */
    decode_handle *head, *tail;
    int n_running, n_prefill, n_queued;
    int stopping;
    double stop_deadline;
    /* disaggregated */
    pd_xfer *x;
    pd_xfer_thread *xt;         /* progresses x: puts land while the engine thread computes */
    pd_xfer_mem *kv_mem, *aux_mem;
    void *kv_rkey, *aux_rkey;
    size_t kv_rkey_len, aux_rkey_len;
    const void *waddr;
    size_t waddr_len;
    float *aux_arena;
    /* staging (device KV that UCX cannot reach, or PD_XFER_FORCE_STAGING=1): prefill nodes put
     * a prompt's pages into stage_n host pages of the pools' layouts (kv_stage, dkv_stage), the
     * Prefill naming staging page ids; the reply uploads them into the request's pool pages */
    void *kv_stage;                  /* target layout, stage_n pages; NULL = no staging */
    int stage_n, stage_used;
    uint8_t *stage_busy;             /* [stage_n]: 1 = held by a request */
    uint64_t stage_waits;            /* requests that waited for staging pages (queue heads) */
    /* draft pool (--aux-transfer draft-kv on a prefill node puts the draft context K/V here) */
    pd_xfer_mem *dkv_mem;
    void *dkv_rkey;
    size_t dkv_rkey_len;
    void *dkv_stage;                 /* draft layout, stage_n pages (with kv_stage) */
    int aux_rows;
    aux_seg *segs;
    int n_segs, cap_segs;
    prefill_node **nodes;            /* stable pointers (handles keep theirs); gone ones stay */
    int n_nodes;
    /* --prefill re-resolution (cfg.prefill_refresh_ms > 0): a thread resolves the list and posts
     * the addresses to the engine thread */
    pthread_t resolver;
    int resolver_started;
    pthread_mutex_t res_mu;
    pthread_cond_t res_cv;
    int res_stop;                    /* guarded by res_mu */
    /* snapshot */
    pthread_mutex_t stats_mu;
    decode_stats stats;
};

/* Refresh the stats snapshot (decode_server_stats) from the engine thread's state. */
void decode_server_update_stats(decode_server *s);
/* n consecutive rows of the aux arena (first fit): the first row, or -1 when no run is free
 * (or out of memory). */
int decode_server_aux_alloc(decode_server *s, int n);
/* Give back the run decode_server_aux_alloc returned at start. */
void decode_server_aux_free(decode_server *s, int start);
/* Hand h's new tokens (detokenized) to its caller. */
void decode_server_emit_new(decode_server *s, decode_handle *h);
/* Call on_done once. The request's engine state is left to the caller. */
void decode_server_call_done(decode_server *s, decode_handle *h, pd_status st, const char *msg);
/* Drop the server's hold on h: engine request, aux rows, list entry, reference. */
void decode_server_handle_retire(decode_server *s, decode_handle *h);
/* Arm the step timer (once) when a request runs or a queued one could be admitted. */
void decode_server_kick(decode_server *s);

#endif
