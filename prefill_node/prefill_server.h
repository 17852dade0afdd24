/* prefill_server.h - the prefill node: the Prefill service around a prefill engine.
 * Owns: the pd_engine in prefill mode (hold_kv, one token per request; capture_aux or
 *   capture_ctx by --aux-transfer), its engine thread (pd_loop), the prompt queue and its
 *   batching, the UCX worker, the peers of decode nodes, and the KV/aux export (every layer's K/V
 *   pages plus the drafter's payload: packed aux rows (raw), context rows (ctx) or the draft
 *   pool's context K/V pages (draft-kv), put into the decode node's registered memory, bounded in
 *   flight, flushed before the reply, which names the payload).
 * Not here: the engine math (common/), the decode side (decode_node/).
 * Threading: create/destroy on the main thread. gRPC handlers run on pd_rpc's poller thread and
 *   hand requests to the engine thread with pd_loop_post; everything else runs there. */
#ifndef PREFILL_SERVER_H
#define PREFILL_SERVER_H

#include <stdint.h>

#include "pd_rpc.h"
#include "pd_status.h"

typedef struct prefill_server prefill_server;

/* One finished Prefill call, for an observer (metrics). Times in ms from receipt; forward_ms and
 * transfer_ms are 0 unless status is PD_OK. */
typedef struct {
    const char *request_id;
    pd_status status;
    int prompt_tokens;
    int cached_tokens;              /* of them, served from the prefix cache */
    int cp_size;
    double queue_ms, forward_ms, transfer_ms, total_ms;
    uint64_t bytes;                 /* KV + aux bytes put into the decode node */
} prefill_event;

typedef struct prefill_observer {
    void (*on_done)(void *ud, const prefill_event *ev);   /* engine thread; must not block */
    void *ud;
} prefill_observer;

typedef struct {
    const char *model_dir;
    const char *draft_dir;          /* needed for any aux transfer (taps, fc, draft K/V) */
    const char *device;             /* "cpu" (default) or "cuda" */
    int f32;                        /* cuda: weights and KV cache in fp32 (--dtype f32; default
                                     * bf16; the decode nodes must use the same) */
    int cp_size;                    /* context-parallel ranks (0/1 = off) */
    const char *cp_strategy;        /* NULL = engine default */
    int kv_pages;                   /* 0 = engine default */
    double kv_mem_fraction;         /* --kv-memory-fraction: pd_engine_config.kv_mem_fraction */
    int64_t stage_bytes;            /* --stage-memory: pinned host memory for KV pages staged
                                     * before their puts (GPU memory UCX cannot read), taken as
                                     * jobs need it and kept (default 2 GiB; 0 = plain memory) */
    int page_size;                  /* 0 = 16 (must match the decode nodes) */
    int max_batch_tokens;           /* prompt tokens per batch / forward (0 = 8192) */
    int64_t transfer_timeout_ms;    /* bound on one KV+aux transfer (0 = 30000) */
    const char *aux_transfer;       /* "raw" (default), "ctx", "draft-kv" (pd_aux_mode_parse);
                                     * ctx and draft-kv need draft_dir */
    int xfer_err_mode_none;         /* UCX endpoints without peer-failure mode (same-host decode
                                     * nodes: shm/cma usable; failures seen by the timeout only) */
    int fast_kernels;               /* 1 (--fast-kernels): a GPU engine batches queued prompts into
                                     * one forward with the fastest kernels; 0 (default): one prompt
                                     * per forward, so a prompt's KV does not depend on the others
                                     * (pd_engine_config.fast_kernels) */
    int prefix_cache;               /* 1 (--prefix-cache): pd_engine_config.prefix_cache; with
                                     * --aux-transfer draft-kv or without a drafter only (raw and
                                     * ctx ship per-token rows the cache does not keep) */
    const prefill_observer *observer;   /* optional, borrowed: sees every finished call */
} prefill_config;

void prefill_config_default(prefill_config *cfg);

/* Load the models, create the engine, the UCX worker and the engine thread.
 * Errors: loading errors, PD_ERR_INVALID (bad --aux-transfer, ctx/draft-kv without a draft),
 * PD_ERR_UNSUPPORTED (device memory without
 * UCX support), PD_ERR_NOMEM, PD_ERR_INTERNAL. */
pd_status prefill_server_create(const prefill_config *cfg, prefill_server **out, pd_err *err);
/* Serve pdspark.Prefill (Prefill, CancelPrefill, Health) on addr; *out belongs to the caller
 * (pd_rpc_server_destroy it before prefill_server_destroy). */
pd_status prefill_server_listen(prefill_server *ps, const char *addr, pd_rpc_server **out,
                                pd_err *err);
typedef struct {
    int active_requests;            /* in the forward or the transfer */
    int queued_requests;
    int free_kv_pages, total_kv_pages;
} prefill_stats;

/* A snapshot (updated by the engine thread after every change). Any thread. */
void prefill_server_stats(prefill_server *ps, prefill_stats *out);
/* Graceful drain (SIGTERM): from now on new Prefill calls get UNAVAILABLE ("draining"); queued
 * and running ones finish. Any thread. */
void prefill_server_drain(prefill_server *ps);
int prefill_server_draining(const prefill_server *ps);
/* Ends every request (CANCELLED; transfers cancelled and waited for), stops the engine thread,
 * frees. NULL is a no-op. */
void prefill_server_destroy(prefill_server *ps);

#endif
