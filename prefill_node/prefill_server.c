/* prefill_server.c - the prefill node's service and engine thread (prefill_server.h).
 * Owns: request validation (the destination descriptor against our own KV layout), the job
 *   table (queued -> forward -> transfer -> answered), batching of queued prompts into engine
 *   steps, the KV + aux puts, deadlines, CancelPrefill, Health, and the decode-node peer cache.
 * Not here: the forward (common/pd_engine_prefill.c, CP inside it), the wire contract (proto/).
 * Threading: handlers on pd_rpc's poller thread (validation only, then pd_loop_post); the rest
 *   on the engine thread, except the puts: the pd_xfer, its peers and remote keys live on a
 *   transfer thread (pd_xfer_thread), to which a job goes for its transfer and from which it
 *   comes back. A job is reference counted: the engine thread and the call's on-done callback
 *   each hold one, and so does each post of it between the two threads. */
#define _GNU_SOURCE   /* pthread_setname_np */
#include "prefill_server.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd_engine.h"
#include "pd_host_arena.h"
#include "pd_log.h"
#include "pd_wire.h"
#include "pd_loop.h"
#include "pd_proto_version.h"
#include "pd_xfer.h"
#include "pd_xfer_thread.h"
#include "pdspark.pb-c.h"

#define TICK_MS 20
#define STAGE_CHUNK_BYTES ((size_t)256 << 20)   /* the stage arena's chunks (cfg.stage_bytes) */

typedef enum { J_QUEUED = 0, J_FORWARD, J_XFER, J_DONE } job_state;

typedef struct peer_ent {
    void *addr;
    size_t len;
    pd_xfer_peer *peer;
    int users;
    struct peer_ent *next;
} peer_ent;

typedef struct job {
    atomic_int refs;
    atomic_int client_gone;
    struct prefill_server *ps;
    pd_rpc_call *call;
    char id[128];
    int32_t *ids;
    int n;
    pd_gen_params gp;
    pd_logit_bias *bias;     /* gp.logit_bias points here */
    uint32_t *first_allow;   /* gp.first_allow points here (SamplingParams.first_token_mask) */
    /* destination */
    void *waddr;
    size_t waddr_len;
    uint32_t *pages;
    int n_pages;
    void *kv_rkey, *aux_rkey;
    size_t kv_rkey_len, aux_rkey_len;
    uint64_t kv_base, kv_len, aux_base, aux_len, aux_off;
    uint64_t remote_pool_pages;
    int want_aux;               /* an aux payload goes out (raw/ctx rows, or draft K/V pages) */
    pd_aux_mode aux_mode;       /* which one (the node's --aux-transfer) */
    /* draft-kv: the decode node's draft pool and the request's draft pages there */
    void *dkv_rkey;
    size_t dkv_rkey_len;
    uint64_t dkv_base, dkv_len, remote_dpool_pages;
    uint32_t *dpages;
    double t_recv, t_fwd, t_xfer, deadline;
    /* engine thread */
    job_state state;
    pd_request *r;
    pd_status cancel_st;        /* why the transfer was cancelled (TIMEOUT, CANCELLED) */
    char cancel_msg[600];
    uint64_t bytes;
    char *stage;                /* host copy of the pages being put (staging), owned */
    /* the transfer: spans made on the engine thread (sp[0..n_kv) the KV pages, then n_aux of
     * the aux payload), handed to the transfer thread with the job */
    pd_xfer_span *sp;
    size_t n_kv, n_aux;
    /* transfer thread, from xfer_start until xfer_end is posted back */
    peer_ent *pe;
    pd_xfer_rkey *rk_kv, *rk_aux;
    pd_xfer_op *op_kv, *op_aux;    /* op_aux: the aux/ctx rows or the draft K/V pages */
    int ops_left;
    int xfer_cancelled;         /* a cancel reached the running puts: cancel_st answers */
    pd_status xfer_st;
    char xfer_msg[600];
    struct job *prev, *next;
} job;

struct prefill_server {
    prefill_config cfg;
    char *model_dir, *draft_dir, *device, *cp_strategy;
    kern_backend *be;
    pd_qwen3_model *tm;
    pd_dspark_model *dm;
    pd_cp_targets cp_targets;   /* CP on a device backend: the targets of ranks 1.. */
    pd_engine *eng;
    pd_kv_layout lay;           /* our pool's layout */
    size_t page_bytes;
    pd_aux_mode aux_mode;       /* --aux-transfer */
    pd_kv_layout dlay;          /* our draft pool's layout (with a draft) */
    size_t dpage_bytes;
    int hidden;
    int stage;                  /* stage KV pages through host memory before the puts */
    pd_host_arena *stage_arena; /* with stage (and cfg.stage_bytes): the backend's (pinned) host
                                 * memory for the staged pages of the jobs in transfer, kept
                                 * between jobs; a job it cannot hold (or NULL) stages into
                                 * malloc'ed memory. Engine thread. */
    int vocab, max_ctx, aux_dim, cp_n;
    pd_loop *loop;
    pthread_t thread;
    int thread_started;
    pd_loop_timer *step_timer, *tick_timer;
    int step_armed;
    pd_xfer *x;
    pd_xfer_thread *xt;         /* owns x and the peers once started: puts advance during forwards */
    atomic_int torn_down;       /* prefill_server_destroy joined the engine thread */
    peer_ent *peers;
    job *head, *tail;
    int n_queued, n_forward, n_xfer;
    int stopping;
    atomic_int draining;        /* set by prefill_server_drain from any thread */
    double stop_deadline;
    atomic_ullong next_eid;
    pthread_mutex_t stats_mu;
    int st_active, st_queued, st_free, st_total;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

void prefill_config_default(prefill_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->device = "cpu";
    cfg->page_size = 16;
    cfg->max_batch_tokens = 8192;
    cfg->transfer_timeout_ms = 30000;
    cfg->aux_transfer = "raw";
    cfg->stage_bytes = (int64_t)2 << 30;
}

static void job_unref(job *j)
{
    if (atomic_fetch_sub(&j->refs, 1) != 1)
        return;
    free(j->ids);
    free(j->bias);
    free(j->first_allow);
    free(j->waddr);
    free(j->pages);
    free(j->kv_rkey);
    free(j->aux_rkey);
    free(j->dkv_rkey);
    free(j->dpages);
    free(j->stage);
    free(j->sp);
    free(j);
}

static void update_stats(prefill_server *ps)
{
    pthread_mutex_lock(&ps->stats_mu);
    ps->st_active = ps->n_forward + ps->n_xfer;
    ps->st_queued = ps->n_queued;
    ps->st_free = pd_engine_kv_free_pages(ps->eng);
    ps->st_total = ps->lay.n_pages;
    pthread_mutex_unlock(&ps->stats_mu);
}

void prefill_server_stats(prefill_server *ps, prefill_stats *out)
{
    pthread_mutex_lock(&ps->stats_mu);
    out->active_requests = ps->st_active;
    out->queued_requests = ps->st_queued;
    out->free_kv_pages = ps->st_free;
    out->total_kv_pages = ps->st_total;
    pthread_mutex_unlock(&ps->stats_mu);
}

/* ---------------------------------------------------------------------------------------------
 * Peers */

static void peer_put(prefill_server *ps, peer_ent *pe)
{
    if (pe == NULL)
        return;
    pe->users--;
    if (pe->users > 0 || !pd_xfer_peer_failed(pe->peer))
        return;
    for (peer_ent **pp = &ps->peers; *pp != NULL; pp = &(*pp)->next)
        if (*pp == pe) {
            *pp = pe->next;
            break;
        }
    pd_xfer_peer_destroy(pe->peer);
    free(pe->addr);
    free(pe);
}

static pd_status peer_get(prefill_server *ps, const void *addr, size_t len, peer_ent **out,
                          pd_err *err)
{
    for (peer_ent *pe = ps->peers; pe != NULL; pe = pe->next)
        if (pe->len == len && memcmp(pe->addr, addr, len) == 0 && !pd_xfer_peer_failed(pe->peer)) {
            pe->users++;
            *out = pe;
            return PD_OK;
        }
    peer_ent *pe = calloc(1, sizeof(*pe));
    if (pe == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "peer");
    pe->addr = malloc(len);
    if (pe->addr == NULL) {
        free(pe);
        return pd_err_set(err, PD_ERR_NOMEM, "peer address");
    }
    memcpy(pe->addr, addr, len);
    pe->len = len;
    pd_status st = pd_xfer_peer_create(ps->x, addr, len, &pe->peer, err);
    if (st != PD_OK) {
        free(pe->addr);
        free(pe);
        return st;
    }
    pe->users = 1;
    pe->next = ps->peers;
    ps->peers = pe;
    *out = pe;
    return PD_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Job end */

static void kick(prefill_server *ps);

static void list_remove(prefill_server *ps, job *j)
{
    if (j->prev != NULL)
        j->prev->next = j->next;
    else
        ps->head = j->next;
    if (j->next != NULL)
        j->next->prev = j->prev;
    else
        ps->tail = j->prev;
    j->prev = j->next = NULL;
}

/* Answer the call (reply on success, status otherwise) and tell the observer; a job answered
 * already (its transfer's end did, on the transfer thread) is not answered again. Runs on the
 * engine thread, or on the transfer thread for a job whose transfer just ended (the engine
 * thread then only retires it). */
static void job_answer(prefill_server *ps, job *j, pd_status st, const char *msg)
{
    if (j->call == NULL)
        return;
    prefill_event ev = { .request_id = j->id, .status = st, .prompt_tokens = j->n,
                         .cached_tokens = j->r != NULL ? j->r->cached : 0, .cp_size = ps->cp_n };
    if (st == PD_OK) {
        double now = now_ms();
        ev.queue_ms = j->t_fwd - j->t_recv;
        ev.forward_ms = j->t_xfer - j->t_fwd;
        ev.transfer_ms = now - j->t_xfer;
        ev.total_ms = now - j->t_recv;
        ev.bytes = j->bytes;
        Pdspark__PrefillTimings tm = PDSPARK__PREFILL_TIMINGS__INIT;
        tm.version = PD_PROTO_VERSION;
        tm.queue_us = (uint64_t)((j->t_fwd - j->t_recv) * 1e3);
        tm.forward_us = (uint64_t)((j->t_xfer - j->t_fwd) * 1e3);
        tm.transfer_us = (uint64_t)((now - j->t_xfer) * 1e3);
        tm.total_us = (uint64_t)((now - j->t_recv) * 1e3);
        tm.bytes_transferred = j->bytes;
        Pdspark__PrefillReply rep = PDSPARK__PREFILL_REPLY__INIT;
        rep.version = PD_PROTO_VERSION;
        rep.request_id = j->id;
        rep.first_token_id = (uint32_t)j->r->out[0];
        uint32_t top_ids[PD_MAX_TOP_LOGPROBS];
        if (j->gp.logprobs && j->r->lps != NULL) {
            const pd_token_logprobs *lp = &j->r->lps[0];
            rep.first_token_logprob = lp->logprob;
            rep.first_token_rank = lp->rank > 0 ? (uint32_t)lp->rank : 0;
            for (int i = 0; i < lp->n_top; i++)
                top_ids[i] = (uint32_t)lp->top_id[i];
            rep.n_first_top_ids = rep.n_first_top_logprobs = (size_t)lp->n_top;
            rep.first_top_ids = top_ids;
            rep.first_top_logprobs = (float *)lp->top_logprob;
        }
        Pdspark__TokenLogprobs *plm = NULL, **plp = NULL;
        if (j->gp.prompt_logprobs && j->r->prompt_lps != NULL) {
            plm = calloc((size_t)j->n, sizeof(*plm));
            plp = calloc((size_t)j->n, sizeof(*plp));
            if (plm != NULL && plp != NULL) {
                pd_wire_logprobs_out(j->r->prompt_lps, j->ids, j->n, plm, plp);
                rep.n_prompt_logprobs = (size_t)j->n;
                rep.prompt_logprobs = plp;
            }
        }
        rep.prompt_tokens = (uint32_t)j->n;
        rep.cached_tokens = (uint32_t)j->r->cached;
        rep.cp_size = (uint32_t)ps->cp_n;
        rep.timings = &tm;
        rep.aux_mode = !j->want_aux ? PDSPARK__AUX_MODE__AUX_MODE_NONE
                       : j->aux_mode == PD_AUX_CTX ? PDSPARK__AUX_MODE__AUX_MODE_CTX
                       : j->aux_mode == PD_AUX_DRAFT_KV ? PDSPARK__AUX_MODE__AUX_MODE_DRAFT_KV
                       : PDSPARK__AUX_MODE__AUX_MODE_RAW;
        PD_LOG_DEBUG("prefill", "%s: done, %d tokens, %llu bytes, forward %.1f ms, transfer %.1f ms",
                     j->id, j->n, (unsigned long long)j->bytes, j->t_xfer - j->t_fwd, now - j->t_xfer);
        pd_rpc_reply(j->call, &rep.base);
        free(plm);
        free(plp);
    } else {
        PD_LOG_DEBUG("prefill", "%s: ended %s: %s", j->id, pd_status_str(st), msg);
        pd_rpc_finish(j->call, st, msg);
        ev.total_ms = now_ms() - j->t_recv;
    }
    if (ps->cfg.observer != NULL && ps->cfg.observer->on_done != NULL)
        ps->cfg.observer->on_done(ps->cfg.observer->ud, &ev);
    j->call = NULL;
}

/* Engine thread: free the job's engine state and drop the engine thread's reference. Only for
 * jobs with no transfer running. */
static void job_retire(prefill_server *ps, job *j)
{
    switch (j->state) {
    case J_QUEUED: ps->n_queued--; break;
    case J_FORWARD: ps->n_forward--; break;
    case J_XFER: ps->n_xfer--; break;
    default: break;
    }
    if (j->r != NULL) {
        pd_engine_release(ps->eng, j->r);
        j->r = NULL;
    }
    pd_host_arena_give(ps->stage_arena, j->stage);   /* no put reads it now */
    j->stage = NULL;
    j->state = J_DONE;
    list_remove(ps, j);
    job_unref(j);
    update_stats(ps);
}

static void job_finish(prefill_server *ps, job *j, pd_status st, const char *msg)
{
    job_answer(ps, j, st, msg);
    job_retire(ps, j);
}

/* ---------------------------------------------------------------------------------------------
 * Transfers. The engine thread makes a job's spans (downloading staged pages) and posts the job
 * to the transfer thread (xfer_start), which owns the peers, remote keys and puts, and answers
 * the call when they end (xfer_finished); the job then comes back to the engine thread to be
 * retired (xfer_end). A cancel is posted after the start, so it finds the puts running or
 * already ended. Each post holds a job reference. */

static void xfer_end(void *arg);

/* Run fn(j) on the engine thread; once that loop has ended (destroy) the caller owns everything
 * and runs it itself. */
static void to_engine(prefill_server *ps, pd_loop_fn fn, job *j)
{
    if (pd_loop_post(ps->loop, fn, j) != PD_OK)
        fn(j);
}

/* transfer thread: the puts are over (or never started). Give back what they held and answer
 * the call now (the decode node waits for it; the engine thread may be inside a long forward):
 * a cancel that came first decides the status. The engine thread retires the job after. */
static void xfer_finished(job *j)
{
    prefill_server *ps = j->ps;
    pd_xfer_rkey_destroy(j->rk_kv);
    pd_xfer_rkey_destroy(j->rk_aux);
    j->rk_kv = j->rk_aux = NULL;
    peer_put(ps, j->pe);
    j->pe = NULL;
    pd_status fst = j->xfer_st;
    char msg[700];
    if (j->xfer_cancelled) {
        /* written by the engine thread once, before it posted xfer_cancel */
        fst = j->cancel_st;
        snprintf(msg, sizeof(msg), "%s", j->cancel_msg);
    } else if (fst != PD_OK) {
        if (fst == PD_ERR_CANCELLED)
            fst = PD_ERR_PEER;
        snprintf(msg, sizeof(msg), "kv transfer to the decode node failed: %s", j->xfer_msg);
        PD_LOG_WARN("prefill", "%s: %s", j->id, msg);
    } else {
        msg[0] = '\0';
    }
    job_answer(ps, j, fst, msg);
    to_engine(ps, xfer_end, j);
}

static void xfer_done(job *j, pd_status st, const pd_err *err)
{
    if (st != PD_OK && j->xfer_st == PD_OK) {
        j->xfer_st = st;
        snprintf(j->xfer_msg, sizeof(j->xfer_msg), "%s", err != NULL ? err->msg : pd_status_str(st));
    }
    if (--j->ops_left == 0)
        xfer_finished(j);
}

/* an op's handle is gone once its done runs: a later cancel must not reach it */
static void xfer_done_kv(void *ud, pd_status st, const pd_err *err)
{
    job *j = ud;
    j->op_kv = NULL;
    xfer_done(j, st, err);
}

static void xfer_done_aux(void *ud, pd_status st, const pd_err *err)
{
    job *j = ud;
    j->op_aux = NULL;
    xfer_done(j, st, err);
}

/* transfer thread */
static void xfer_start(void *arg)
{
    job *j = arg;
    prefill_server *ps = j->ps;
    pd_err err = {0};
    pd_status st;
    int dkv = j->want_aux && j->aux_mode == PD_AUX_DRAFT_KV;
    if ((st = peer_get(ps, j->waddr, j->waddr_len, &j->pe, &err)) != PD_OK)
        goto fail;
    if ((st = pd_xfer_rkey_unpack(j->pe->peer, j->kv_rkey, j->kv_rkey_len, j->kv_base, j->kv_len,
                                  &j->rk_kv, &err)) != PD_OK)
        goto fail;
    if (j->want_aux && !dkv &&
        (st = pd_xfer_rkey_unpack(j->pe->peer, j->aux_rkey, j->aux_rkey_len, j->aux_base,
                                  j->aux_len, &j->rk_aux, &err)) != PD_OK)
        goto fail;
    if (dkv && (st = pd_xfer_rkey_unpack(j->pe->peer, j->dkv_rkey, j->dkv_rkey_len, j->dkv_base,
                                         j->dkv_len, &j->rk_aux, &err)) != PD_OK)
        goto fail;
    j->ops_left = j->want_aux ? 2 : 1;
    if ((st = pd_xfer_put(j->rk_kv, NULL, j->sp, j->n_kv, xfer_done_kv, j, &j->op_kv, &err)) != PD_OK)
        goto fail;
    if (j->want_aux) {
        st = pd_xfer_put(j->rk_aux, NULL, j->sp + j->n_kv, j->n_aux, xfer_done_aux, j, &j->op_aux, &err);
        if (st != PD_OK) {
            /* the KV put runs: end through its done, as a failure */
            j->ops_left = 1;
            j->xfer_st = st;
            snprintf(j->xfer_msg, sizeof(j->xfer_msg), "%s", err.msg);
            pd_xfer_op_cancel(j->op_kv);
        }
    }
    PD_LOG_TRACE("prefill", "%s: put %zu + %zu spans (%s), %llu bytes", j->id, j->n_kv, j->n_aux,
                 j->want_aux ? pd_aux_mode_name(j->aux_mode) : "no aux", (unsigned long long)j->bytes);
    return;
fail:
    /* nothing was put: no peer, a bad remote key, or a put refused */
    j->xfer_st = st == PD_ERR_INVALID || st == PD_ERR_NOMEM ? st : PD_ERR_PEER;
    snprintf(j->xfer_msg, sizeof(j->xfer_msg), "%s", err.msg);
    xfer_finished(j);
}

/* transfer thread: a cancel that finds the puts running decides the job's answer */
static void xfer_cancel(void *arg)
{
    job *j = arg;
    if (j->op_kv != NULL || j->op_aux != NULL)
        j->xfer_cancelled = 1;
    if (j->op_kv != NULL)
        pd_xfer_op_cancel(j->op_kv);
    if (j->op_aux != NULL)
        pd_xfer_op_cancel(j->op_aux);
    job_unref(j);
}

/* engine thread: the transfer's end, answered already (the reference xfer_start was posted
 * with comes back) */
static void xfer_end(void *arg)
{
    job *j = arg;
    prefill_server *ps = j->ps;
    if (j->state != J_DONE)   /* else retired by prefill_server_destroy before this ran */
        job_retire(ps, j);
    job_unref(j);
    if (!atomic_load(&ps->torn_down))
        kick(ps);
}

/* Stop a job for st: queued/forward end now; a transfer is cancelled and ends in xfer_end. */
static void job_abort(prefill_server *ps, job *j, pd_status st, const char *msg)
{
    if (j->state == J_XFER) {
        if (j->cancel_st == PD_OK) {
            j->cancel_st = st;
            snprintf(j->cancel_msg, sizeof(j->cancel_msg), "%s", msg);
            atomic_fetch_add(&j->refs, 1);
            if (pd_xfer_thread_post(ps->xt, xfer_cancel, j) != PD_OK)
                job_unref(j);
        }
        return;
    }
    if (j->state == J_FORWARD && j->r != NULL)
        pd_engine_cancel(ps->eng, j->r);
    job_finish(ps, j, st, msg);
}

/* Spans for every layer's K and V of pages[0..np) of pool, to the remote pool at rbase of
 * rpages pages per layer half (pd_kv.h layout), remote page ids rids. With stage set, the pages
 * are to be downloaded there first (stage advances): their copies, a run of consecutive page ids
 * in one, are added to dl[*ndl] for one kern_download_spans before the puts. Runs contiguous on
 * both sides are merged. */
static void page_spans(pd_kv_pool *pool, const int32_t *pages, int np, uint64_t rbase, uint64_t rpages,
                       const uint32_t *rids, char **stage, kern_copy_span *dl, size_t *ndl, pd_xfer_span *sp,
                       size_t *n)
{
    const pd_kv_layout *lay = pd_kv_pool_layout(pool);
    size_t pb = pd_kv_page_bytes(lay);
    for (int l = 0; l < lay->n_layers; l++) {
        kern_kv_layer kv = pd_kv_pool_layer(pool, l);
        for (int half = 0; half < 2; half++) {
            const char *base = half == 0 ? (const char *)kv.k : (const char *)kv.v;
            int run = 0;   /* pages left in the current staged run */
            for (int p = 0; p < np; p++) {
                const char *s = base + (size_t)pages[p] * pb;
                if (*stage != NULL) {
                    if (run == 0) {
                        while (p + run < np && pages[p + run] == pages[p] + run)
                            run++;
                        dl[(*ndl)++] = (kern_copy_span){ *stage, s, (size_t)run * pb };
                    }
                    run--;
                    s = *stage;
                    *stage += pb;
                }
                uint64_t ra = rbase + ((uint64_t)(2 * l + half) * rpages + rids[p]) * pb;
                if (*n > 0 && (const char *)sp[*n - 1].src + sp[*n - 1].len == s &&
                    sp[*n - 1].raddr + sp[*n - 1].len == ra) {
                    sp[*n - 1].len += pb;
                    continue;
                }
                sp[(*n)++] = (pd_xfer_span){ .src = s, .raddr = ra, .len = pb };
            }
        }
    }
}

/* engine thread: the job's forward is done; make its spans and hand it to the transfer thread */
static void start_transfer(prefill_server *ps, job *j)
{
    pd_err err = {0};
    pd_status st;
    j->t_xfer = now_ms();
    ps->n_forward--;
    ps->n_xfer++;
    j->state = J_XFER;
    int dkv = j->want_aux && j->aux_mode == PD_AUX_DRAFT_KV;
    PD_ASSERT(j->r->tkv.n_pages >= j->n_pages);
    PD_ASSERT(!dkv || j->r->dkv.n_pages >= j->n_pages);
    size_t t_spans = (size_t)ps->lay.n_layers * 2 * (size_t)j->n_pages;
    size_t d_spans = dkv ? (size_t)ps->dlay.n_layers * 2 * (size_t)j->n_pages : 0;
    j->sp = malloc((t_spans + d_spans + 1) * sizeof(*j->sp));
    if (j->sp == NULL) {
        st = pd_err_set(&err, PD_ERR_NOMEM, "spans");
        goto fail;
    }
    size_t stage_bytes = t_spans * ps->page_bytes + d_spans * ps->dpage_bytes;
    /* the arena's pinned memory when it has room (the pages are downloaded in place) */
    if (ps->stage && (j->stage = pd_host_arena_take(ps->stage_arena, stage_bytes)) == NULL) {
        st = pd_err_set(&err, PD_ERR_NOMEM, "kv staging: %zu bytes", stage_bytes);
        goto fail;
    }
    char *stage = j->stage;
    kern_copy_span *dl = NULL;
    if (ps->stage && (dl = malloc((t_spans + d_spans) * sizeof(*dl))) == NULL) {
        st = pd_err_set(&err, PD_ERR_NOMEM, "kv staging: %zu copies", t_spans + d_spans);
        goto fail;
    }
    size_t n = 0, nd = 0, ndl = 0;
    page_spans(pd_engine_target_pool(ps->eng), j->r->tkv.pages, j->n_pages, j->kv_base, j->remote_pool_pages,
               j->pages, &stage, dl, &ndl, j->sp, &n);
    pd_xfer_span *asp = j->sp + n;
    if (dkv)
        page_spans(pd_engine_draft_pool(ps->eng), j->r->dkv.pages, j->n_pages, j->dkv_base,
                   j->remote_dpool_pages, j->dpages, &stage, dl, &ndl, asp, &nd);
    /* every staged page in one batch of downloads (target and draft pools share the backend) */
    st = ndl > 0 ? kern_download_spans(ps->be, dl, (int)ndl, &err) : PD_OK;
    free(dl);
    if (st != PD_OK)
        goto fail;
    if (!dkv && j->want_aux) {
        /* raw: [n, K*hidden] rows; ctx: [n, hidden] rows, packed from the request's offset */
        int ctx = j->aux_mode == PD_AUX_CTX;
        asp[0] = (pd_xfer_span){ .src = ctx ? j->r->ctx : j->r->aux, .raddr = j->aux_base + j->aux_off,
                                 .len = (size_t)j->n * (size_t)(ctx ? ps->hidden : ps->aux_dim) * sizeof(float) };
        nd = 1;
    }
    j->n_kv = n;
    j->n_aux = nd;
    j->bytes = (uint64_t)t_spans * ps->page_bytes;
    for (size_t i = 0; i < nd; i++)
        j->bytes += asp[i].len;
    atomic_fetch_add(&j->refs, 1);
    if (pd_xfer_thread_post(ps->xt, xfer_start, j) == PD_OK)
        return;
    job_unref(j);
    st = pd_err_set(&err, PD_ERR_CANCELLED, "prefill node shutting down");
fail:
    PD_LOG_WARN("prefill", "%s: transfer: %s", j->id, err.msg);
    {
        char msg[600];
        snprintf(msg, sizeof(msg), "kv transfer to the decode node: %s", err.msg);
        job_finish(ps, j, st == PD_ERR_INVALID || st == PD_ERR_NOMEM || st == PD_ERR_CANCELLED ? st : PD_ERR_PEER, msg);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Engine loop */

static void admit(prefill_server *ps)
{
    int budget = ps->cfg.max_batch_tokens;
    for (job *j = ps->head; j != NULL; j = j->next)
        if (j->state == J_FORWARD)
            budget -= j->n;
    for (job *j = ps->head, *next; j != NULL; j = next) {
        next = j->next;
        if (j->state != J_QUEUED)
            continue;
        if (j->n > budget && ps->n_forward > 0)
            break;
        pd_err err = {0};
        uint64_t eid = atomic_fetch_add(&ps->next_eid, 1);
        pd_status st = pd_engine_add(ps->eng, eid, j->ids, j->n, &j->gp, &j->r, &err);
        if (st == PD_ERR_BUSY)
            break;
        if (st != PD_OK) {
            job_finish(ps, j, st, err.msg);
            continue;
        }
        j->state = J_FORWARD;
        j->t_fwd = now_ms();
        ps->n_queued--;
        ps->n_forward++;
        budget -= j->n;
    }
    update_stats(ps);
}

static void step_cb(void *arg)
{
    prefill_server *ps = arg;
    ps->step_armed = 0;
    admit(ps);
    if (ps->n_forward == 0)
        return;
    pd_err err = {0};
    pd_status st = pd_engine_step(ps->eng, &err);
    for (job *j = ps->head, *next; j != NULL; j = next) {
        next = j->next;
        if (j->state != J_FORWARD)
            continue;
        if (st != PD_OK) {
            job_abort(ps, j, st == PD_ERR_INVALID ? PD_ERR_INTERNAL : st, err.msg);
            continue;
        }
        pd_request *r = j->r;
        if (r->finish == PD_FINISH_NONE)
            continue;
        if (r->finish == PD_FINISH_ERROR || r->n_out < 1) {
            char msg[600];
            snprintf(msg, sizeof(msg), "prefill failed: %s", r->error);
            job_finish(ps, j, PD_ERR_INTERNAL, msg);
            continue;
        }
        start_transfer(ps, j);
    }
    update_stats(ps);
    kick(ps);
}

static void kick(prefill_server *ps)
{
    if (ps->step_armed)
        return;
    if (ps->n_forward > 0 || ps->n_queued > 0) {
        ps->step_armed = 1;
        pd_loop_timer_start(ps->step_timer, ps->n_forward > 0 ? 0 : TICK_MS, false);
    }
}

static void check_jobs(prefill_server *ps)
{
    double now = now_ms();
    for (job *j = ps->head, *next; j != NULL; j = next) {
        next = j->next;
        if (ps->stopping)
            job_abort(ps, j, PD_ERR_CANCELLED, "prefill node shutting down");
        else if (atomic_load(&j->client_gone))
            job_abort(ps, j, PD_ERR_CANCELLED, "cancelled by the decode node");
        else if (j->deadline > 0 && now >= j->deadline)
            job_abort(ps, j, PD_ERR_TIMEOUT, "prefill deadline exceeded");
    }
}

static void tick_cb(void *arg)
{
    prefill_server *ps = arg;
    check_jobs(ps);
    if (ps->stopping && (ps->head == NULL || now_ms() > ps->stop_deadline))
        pd_loop_stop(ps->loop);
    kick(ps);
}

static void submit_cb(void *arg)
{
    job *j = arg;
    prefill_server *ps = j->ps;
    j->prev = ps->tail;
    if (ps->tail != NULL)
        ps->tail->next = j;
    else
        ps->head = j;
    ps->tail = j;
    j->state = J_QUEUED;
    ps->n_queued++;
    if (ps->stopping) {
        job_finish(ps, j, PD_ERR_CANCELLED, "prefill node shutting down");
        return;
    }
    admit(ps);
    kick(ps);
}

typedef struct {
    prefill_server *ps;
    pd_rpc_call *call;
    char id[128];
} cancel_msg;

static void cancel_cb(void *arg)
{
    cancel_msg *m = arg;
    prefill_server *ps = m->ps;
    job *j = ps->head;
    while (j != NULL && strcmp(j->id, m->id) != 0)
        j = j->next;
    if (j == NULL) {
        char msg[200];
        snprintf(msg, sizeof(msg), "no prefill request with id '%s'", m->id);
        pd_rpc_finish(m->call, PD_ERR_NOT_FOUND, msg);
    } else {
        Pdspark__CancelPrefillReply rep = PDSPARK__CANCEL_PREFILL_REPLY__INIT;
        rep.version = PD_PROTO_VERSION;
        rep.was_running = j->state != J_QUEUED;
        PD_LOG_DEBUG("prefill", "%s: cancel (%s)", j->id, rep.was_running ? "running" : "queued");
        job_abort(ps, j, PD_ERR_CANCELLED, "cancelled by the decode node");
        pd_rpc_reply(m->call, &rep.base);
        kick(ps);
    }
    free(m);
}

static void shutdown_cb(void *arg)
{
    prefill_server *ps = arg;
    ps->stopping = 1;
    ps->stop_deadline = now_ms() + (double)ps->cfg.transfer_timeout_ms + 1000.0;
    tick_cb(ps);
}

static void *engine_thread(void *arg)
{
    prefill_server *ps = arg;
    pd_err err;
    pthread_setname_np(pthread_self(), "pd-engine");
    /* the engine's device work goes to this thread's current device: the backend's */
    if (kern_backend_bind_thread(ps->be, NULL, &err) != PD_OK) {
        PD_LOG_ERROR("prefill", "engine thread: %s", err.msg);
        return NULL;
    }
    if (pd_loop_run(ps->loop, &err) != PD_OK)
        PD_LOG_ERROR("prefill", "engine loop: %s", err.msg);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Handlers (poller thread) */

static pd_status check_version(const ProtobufCMessage *m, const char *what, pd_err *err)
{
    if (m == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "%s missing", what);
    return pd_proto_version_check(m, err);
}

static int dtype_from_proto(Pdspark__KvDtype d)
{
    switch (d) {
    case PDSPARK__KV_DTYPE__KV_DTYPE_F32: return KERN_DTYPE_F32;
    case PDSPARK__KV_DTYPE__KV_DTYPE_BF16: return KERN_DTYPE_BF16;
    case PDSPARK__KV_DTYPE__KV_DTYPE_F16: return KERN_DTYPE_F16;
    default: return -1;
    }
}

static const char *dtype_name(int d)
{
    switch (d) {
    case KERN_DTYPE_F32: return "f32";
    case KERN_DTYPE_BF16: return "bf16";
    case KERN_DTYPE_F16: return "f16";
    default: return "unspecified";
    }
}

/* Raw or ctx rows into the aux buffer: it must be sized for at least our rows. */
static pd_status validate_rows(prefill_server *ps, const Pdspark__PrefillRequest *rq, pd_err *err)
{
    const Pdspark__Destination *d = rq->dest;
    const Pdspark__AuxLayout *al = d->aux_layout;
    pd_status st;
    int ctx = ps->aux_mode == PD_AUX_CTX;
    uint64_t row = (uint64_t)(ctx ? ps->hidden : ps->aux_dim) * sizeof(float);
    if (al->mode == PDSPARK__AUX_MODE__AUX_MODE_DRAFT_KV || (!ctx && al->mode == PDSPARK__AUX_MODE__AUX_MODE_CTX))
        return pd_err_set(err, PD_ERR_INVALID, "aux transfer mismatch: the decode node reserved an aux buffer for %s, "
                          "this prefill node ships %s (--aux-transfer %s)",
                          al->mode == PDSPARK__AUX_MODE__AUX_MODE_CTX ? "ctx" : "draft-kv",
                          pd_aux_mode_name(ps->aux_mode), pd_aux_mode_name(ps->aux_mode));
    if ((st = check_version(d->aux != NULL ? &d->aux->base : NULL, "dest.aux", err)) != PD_OK)
        return st;
    if (!ctx && al->row_bytes != row)
        return pd_err_set(err, PD_ERR_INVALID, "aux layout mismatch: row bytes %llu, this prefill node has %llu "
                          "(draft taps x hidden)", (unsigned long long)al->row_bytes, (unsigned long long)row);
    if (al->rows < rq->n_token_ids)
        return pd_err_set(err, PD_ERR_INVALID, "dest.aux_layout.rows %u < %zu prompt tokens", al->rows,
                          rq->n_token_ids);
    uint64_t bytes = row * rq->n_token_ids;
    if (ctx && bytes > (uint64_t)al->rows * al->row_bytes)
        return pd_err_set(err, PD_ERR_INVALID, "aux buffer of %u rows x %llu bytes cannot hold %zu ctx rows of %llu bytes",
                          al->rows, (unsigned long long)al->row_bytes, rq->n_token_ids, (unsigned long long)row);
    if (d->aux->rkey.len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "dest.aux.rkey is empty");
    if (d->aux_offset > d->aux->length || bytes > d->aux->length - d->aux_offset)
        return pd_err_set(err, PD_ERR_INVALID, "aux rows [%llu, +%llu) outside the aux region of %llu bytes",
                          (unsigned long long)d->aux_offset, (unsigned long long)bytes,
                          (unsigned long long)d->aux->length);
    return PD_OK;
}

/* Draft K/V pages into the decode node's draft pool: its layout must be our draft pool's. */
static pd_status validate_draft_kv(prefill_server *ps, const Pdspark__PrefillRequest *rq, size_t need,
                                   pd_err *err)
{
    const Pdspark__Destination *d = rq->dest;
    pd_status st;
    if (d->draft_kv_pool == NULL || d->draft_page_layout == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "aux transfer mismatch: this prefill node ships draft-kv "
                          "(--aux-transfer draft-kv) but the destination has no draft KV pool");
    if ((st = check_version(&d->draft_kv_pool->base, "dest.draft_kv_pool", err)) != PD_OK ||
        (st = check_version(&d->draft_page_layout->base, "dest.draft_page_layout", err)) != PD_OK)
        return st;
    const Pdspark__PageLayout *pl = d->draft_page_layout;
    const pd_kv_layout *dl = &ps->dlay;
    if (pl->page_size != (uint32_t)dl->page_size || dtype_from_proto(pl->dtype) != (int)dl->dtype ||
        pl->n_layers != (uint32_t)dl->n_layers || pl->n_kv_heads != (uint32_t)dl->n_kv_heads ||
        pl->head_dim != (uint32_t)dl->head_dim || pl->bytes_per_page != ps->dpage_bytes)
        return pd_err_set(err, PD_ERR_INVALID, "draft kv layout mismatch: decode node has page size %u, %s, "
                          "%u layers, %u kv heads, head dim %u, %llu bytes per page; this prefill node's draft "
                          "has %d, %s, %d, %d, %d, %zu", pl->page_size, dtype_name(dtype_from_proto(pl->dtype)),
                          pl->n_layers, pl->n_kv_heads, pl->head_dim, (unsigned long long)pl->bytes_per_page,
                          dl->page_size, dtype_name((int)dl->dtype), dl->n_layers, dl->n_kv_heads, dl->head_dim,
                          ps->dpage_bytes);
    if (d->draft_kv_pool->rkey.len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "dest.draft_kv_pool.rkey is empty");
    uint64_t per_page_all = 2ull * (uint64_t)dl->n_layers * ps->dpage_bytes;
    uint64_t len = d->draft_kv_pool->length;
    if (len == 0 || len % per_page_all != 0)
        return pd_err_set(err, PD_ERR_INVALID, "dest.draft_kv_pool.length %llu is not a whole number of pages "
                          "(%llu bytes per page over all draft layers)", (unsigned long long)len,
                          (unsigned long long)per_page_all);
    uint64_t rpages = len / per_page_all;
    if (d->n_draft_page_ids != need)
        return pd_err_set(err, PD_ERR_INVALID, "dest.draft_page_ids has %zu pages, a prompt of %zu tokens needs %zu",
                          d->n_draft_page_ids, rq->n_token_ids, need);
    for (size_t i = 0; i < d->n_draft_page_ids; i++)
        if (d->draft_page_ids[i] >= rpages)
            return pd_err_set(err, PD_ERR_INVALID, "dest.draft_page_ids[%zu] = %u outside the draft pool of %llu pages",
                              i, d->draft_page_ids[i], (unsigned long long)rpages);
    return PD_OK;
}

/* Everything a peer could get wrong, checked before the job exists. */
static pd_status validate(prefill_server *ps, const Pdspark__PrefillRequest *rq, pd_err *err)
{
    pd_status st;
    if (rq->request_id == NULL || rq->request_id[0] == '\0' || strlen(rq->request_id) >= 128)
        return pd_err_set(err, PD_ERR_INVALID, "request_id must be 1..127 bytes");
    if (rq->n_token_ids == 0)
        return pd_err_set(err, PD_ERR_INVALID, "empty prompt");
    if (rq->n_token_ids >= (size_t)ps->max_ctx)
        return pd_err_set(err, PD_ERR_INVALID, "prompt of %zu tokens leaves no room in the context of %d tokens",
                          rq->n_token_ids, ps->max_ctx);
    for (size_t i = 0; i < rq->n_token_ids; i++)
        if (rq->token_ids[i] >= (uint32_t)ps->vocab)
            return pd_err_set(err, PD_ERR_INVALID, "prompt token %u (index %zu) is outside the vocabulary (0..%d)",
                              rq->token_ids[i], i, ps->vocab - 1);
    if (rq->sampling != NULL && (st = check_version(&rq->sampling->base, "sampling", err)) != PD_OK)
        return st;
    const Pdspark__Destination *d = rq->dest;
    if ((st = check_version(d != NULL ? &d->base : NULL, "dest", err)) != PD_OK)
        return st;
    if ((st = check_version(d->page_layout != NULL ? &d->page_layout->base : NULL, "dest.page_layout", err)) != PD_OK ||
        (st = check_version(d->kv_pool != NULL ? &d->kv_pool->base : NULL, "dest.kv_pool", err)) != PD_OK ||
        (st = check_version(d->aux_layout != NULL ? &d->aux_layout->base : NULL, "dest.aux_layout", err)) != PD_OK)
        return st;
    const Pdspark__PageLayout *pl = d->page_layout;
    int dt = dtype_from_proto(pl->dtype);
    if (pl->page_size != (uint32_t)ps->lay.page_size)
        return pd_err_set(err, PD_ERR_INVALID, "kv layout mismatch: page size %u, this prefill node uses %d",
                          pl->page_size, ps->lay.page_size);
    if (dt != (int)ps->lay.dtype)
        return pd_err_set(err, PD_ERR_INVALID, "kv layout mismatch: dtype %s, this prefill node uses %s",
                          dtype_name(dt), dtype_name((int)ps->lay.dtype));
    if (pl->n_layers != (uint32_t)ps->lay.n_layers)
        return pd_err_set(err, PD_ERR_INVALID, "kv layout mismatch: layer count %u, this prefill node has %d",
                          pl->n_layers, ps->lay.n_layers);
    if (pl->n_kv_heads != (uint32_t)ps->lay.n_kv_heads)
        return pd_err_set(err, PD_ERR_INVALID, "kv layout mismatch: kv heads %u, this prefill node has %d",
                          pl->n_kv_heads, ps->lay.n_kv_heads);
    if (pl->head_dim != (uint32_t)ps->lay.head_dim)
        return pd_err_set(err, PD_ERR_INVALID, "kv layout mismatch: head dim %u, this prefill node has %d",
                          pl->head_dim, ps->lay.head_dim);
    if (pl->bytes_per_page != ps->page_bytes)
        return pd_err_set(err, PD_ERR_INVALID, "kv layout mismatch: bytes per page %llu, this prefill node has %zu",
                          (unsigned long long)pl->bytes_per_page, ps->page_bytes);
    if (d->worker_address.len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "dest.worker_address is empty");
    if (d->kv_pool->rkey.len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "dest.kv_pool.rkey is empty");
    uint64_t per_page_all = 2ull * (uint64_t)ps->lay.n_layers * ps->page_bytes;
    uint64_t len = d->kv_pool->length;
    if (len == 0 || len % per_page_all != 0)
        return pd_err_set(err, PD_ERR_INVALID, "dest.kv_pool.length %llu is not a whole number of pages "
                          "(%llu bytes per page over all layers)", (unsigned long long)len,
                          (unsigned long long)per_page_all);
    uint64_t rpages = len / per_page_all;
    size_t need = (rq->n_token_ids + (size_t)ps->lay.page_size - 1) / (size_t)ps->lay.page_size;
    if (d->n_page_ids != need)
        return pd_err_set(err, PD_ERR_INVALID, "dest.page_ids has %zu pages, a prompt of %zu tokens needs %zu",
                          d->n_page_ids, rq->n_token_ids, need);
    for (size_t i = 0; i < d->n_page_ids; i++)
        if (d->page_ids[i] >= rpages)
            return pd_err_set(err, PD_ERR_INVALID, "dest.page_ids[%zu] = %u outside the pool of %llu pages",
                              i, d->page_ids[i], (unsigned long long)rpages);
    const Pdspark__AuxLayout *al = d->aux_layout;
    if (al->mode == PDSPARK__AUX_MODE__AUX_MODE_NONE)
        st = PD_OK;   /* the decode node runs no drafter: KV only */
    else if (al->mode != PDSPARK__AUX_MODE__AUX_MODE_RAW && al->mode != PDSPARK__AUX_MODE__AUX_MODE_CTX &&
             al->mode != PDSPARK__AUX_MODE__AUX_MODE_DRAFT_KV)
        st = pd_err_set(err, PD_ERR_INVALID, "aux mode %d unknown", (int)al->mode);
    else if (ps->dm == NULL)
        st = pd_err_set(err, PD_ERR_INVALID, "aux transfer %s needs a draft on the prefill node (--draft)",
                        pd_aux_mode_name(ps->aux_mode));
    else if (ps->aux_mode == PD_AUX_DRAFT_KV)
        st = validate_draft_kv(ps, rq, need, err);
    else
        st = validate_rows(ps, rq, err);
    if (st != PD_OK)
        return st;
    if (rq->top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "top_logprobs %u must be in 0..%d", rq->top_logprobs,
                          PD_MAX_TOP_LOGPROBS);
    if (rq->prompt_top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "prompt_top_logprobs %u must be in 0..%d",
                          rq->prompt_top_logprobs, PD_MAX_TOP_LOGPROBS);
    if (rq->sampling != NULL) {
        pd_sample_params sp = { .temperature = rq->sampling->temperature,
                                .top_k = (int)(rq->sampling->top_k > (uint32_t)ps->vocab ? -1 : (int)rq->sampling->top_k),
                                .top_p = rq->sampling->top_p > 0.0f ? rq->sampling->top_p : 1.0f,
                                .min_p = rq->sampling->min_p, .typical_p = rq->sampling->typical_p };
        if ((st = pd_sample_params_check(&sp, err)) != PD_OK)
            return st;
        if ((st = pd_penalties_check(rq->sampling->presence_penalty, rq->sampling->frequency_penalty,
                                     rq->sampling->repetition_penalty, err)) != PD_OK)
            return st;
        if (rq->sampling->n_stop_token_ids > PD_MAX_STOP_IDS)
            return pd_err_set(err, PD_ERR_INVALID, "stop_token_ids: %zu (at most %d)",
                              rq->sampling->n_stop_token_ids, PD_MAX_STOP_IDS);
        for (size_t i = 0; i < rq->sampling->n_stop_token_ids; i++)
            if (rq->sampling->stop_token_ids[i] >= (uint32_t)ps->vocab)
                return pd_err_set(err, PD_ERR_INVALID, "stop_token_ids: %u is outside the vocabulary",
                                  rq->sampling->stop_token_ids[i]);
        if (rq->sampling->n_logit_bias > PD_MAX_LOGIT_BIAS)
            return pd_err_set(err, PD_ERR_INVALID, "logit_bias: %zu entries (at most %d)",
                              rq->sampling->n_logit_bias, PD_MAX_LOGIT_BIAS);
        for (size_t i = 0; i < rq->sampling->n_logit_bias; i++) {
            const Pdspark__LogitBias *lb = rq->sampling->logit_bias[i];
            pd_logit_bias one = { .tok = lb == NULL || lb->token_id > INT32_MAX ? -1 : (int32_t)lb->token_id,
                                  .bias = lb != NULL ? lb->bias : 0.0f };
            if ((st = pd_logit_bias_check(&one, 1, ps->vocab, err)) != PD_OK)
                return st;
        }
        const ProtobufCBinaryData *fm = &rq->sampling->first_token_mask;
        if (fm->len > 0) {
            if (fm->len != (size_t)(ps->vocab + 7) / 8)
                return pd_err_set(err, PD_ERR_INVALID, "first_token_mask of %zu bytes (the vocabulary of %d "
                                  "tokens needs %d)", fm->len, ps->vocab, (ps->vocab + 7) / 8);
            int any = 0;
            for (size_t i = 0; i < fm->len && !any; i++)
                any = fm->data[i] != 0;
            if (!any)
                return pd_err_set(err, PD_ERR_INVALID, "first_token_mask allows no token");
        }
    }
    return PD_OK;
}

static void prefill_rpc_done(void *arg, pd_rpc_call *call, bool cancelled)
{
    (void)call;
    job *j = arg;
    if (cancelled)
        atomic_store(&j->client_gone, 1);
    job_unref(j);
}

static void *dup_bytes(const ProtobufCBinaryData *b)
{
    void *p = malloc(b->len > 0 ? b->len : 1);
    if (p != NULL && b->len > 0)
        memcpy(p, b->data, b->len);
    return p;
}

void prefill_server_drain(prefill_server *ps)
{
    atomic_store(&ps->draining, 1);
}

int prefill_server_draining(const prefill_server *ps)
{
    return atomic_load(&((prefill_server *)ps)->draining);
}

static pd_status handle_prefill(void *ud, const ProtobufCMessage *msg, pd_rpc_call *call)
{
    prefill_server *ps = ud;
    const Pdspark__PrefillRequest *rq = (const Pdspark__PrefillRequest *)msg;
    pd_err err = {0};
    if (atomic_load(&ps->draining)) {
        /* UNAVAILABLE: the decode node takes the request elsewhere or fails it clearly */
        pd_rpc_finish(call, PD_ERR_PEER, "prefill node is draining: not accepting new requests");
        return PD_OK;
    }
    pd_status st = validate(ps, rq, &err);
    if (st != PD_OK) {
        PD_LOG_DEBUG("prefill", "refused: %s", err.msg);
        pd_rpc_finish(call, st, err.msg);
        return PD_OK;
    }
    job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return PD_ERR_NOMEM;
    atomic_init(&j->refs, 2);
    atomic_init(&j->client_gone, 0);
    j->ps = ps;
    j->call = call;
    snprintf(j->id, sizeof(j->id), "%s", rq->request_id);
    j->n = (int)rq->n_token_ids;
    j->ids = malloc((size_t)j->n * sizeof(int32_t));
    const Pdspark__Destination *d = rq->dest;
    j->waddr = dup_bytes(&d->worker_address);
    j->waddr_len = d->worker_address.len;
    j->n_pages = (int)d->n_page_ids;
    j->pages = malloc((size_t)j->n_pages * sizeof(uint32_t));
    j->kv_rkey = dup_bytes(&d->kv_pool->rkey);
    j->kv_rkey_len = d->kv_pool->rkey.len;
    j->kv_base = d->kv_pool->base_addr;
    j->kv_len = d->kv_pool->length;
    j->remote_pool_pages = d->kv_pool->length / (2ull * (uint64_t)ps->lay.n_layers * ps->page_bytes);
    j->want_aux = d->aux_layout->mode != PDSPARK__AUX_MODE__AUX_MODE_NONE;
    j->aux_mode = ps->aux_mode;
    int dkv = j->want_aux && j->aux_mode == PD_AUX_DRAFT_KV;
    if (j->want_aux && !dkv) {
        j->aux_rkey = dup_bytes(&d->aux->rkey);
        j->aux_rkey_len = d->aux->rkey.len;
        j->aux_base = d->aux->base_addr;
        j->aux_len = d->aux->length;
        j->aux_off = d->aux_offset;
    }
    if (dkv) {
        j->dkv_rkey = dup_bytes(&d->draft_kv_pool->rkey);
        j->dkv_rkey_len = d->draft_kv_pool->rkey.len;
        j->dkv_base = d->draft_kv_pool->base_addr;
        j->dkv_len = d->draft_kv_pool->length;
        j->remote_dpool_pages = d->draft_kv_pool->length / (2ull * (uint64_t)ps->dlay.n_layers * ps->dpage_bytes);
        j->dpages = malloc((size_t)j->n_pages * sizeof(uint32_t));
        if (j->dpages != NULL)
            memcpy(j->dpages, d->draft_page_ids, (size_t)j->n_pages * sizeof(uint32_t));
    }
    if (j->ids == NULL || j->waddr == NULL || j->pages == NULL || j->kv_rkey == NULL ||
        (j->want_aux && !dkv && j->aux_rkey == NULL) || (dkv && (j->dkv_rkey == NULL || j->dpages == NULL))) {
        atomic_store(&j->refs, 1);
        job_unref(j);
        return PD_ERR_NOMEM;
    }
    for (int i = 0; i < j->n; i++)
        j->ids[i] = (int32_t)rq->token_ids[i];
    memcpy(j->pages, d->page_ids, (size_t)j->n_pages * sizeof(uint32_t));
    j->gp.max_new_tokens = 1;
    /* draft-kv needs neither: the prefill's draft pages hold the context K/V */
    j->gp.capture_aux = j->want_aux && j->aux_mode == PD_AUX_RAW;
    j->gp.capture_ctx = j->want_aux && j->aux_mode == PD_AUX_CTX;
    j->gp.hold_kv = 1;
    j->gp.ignore_eos = 1;
    j->gp.logprobs = rq->logprobs;
    j->gp.prompt_logprobs = rq->prompt_logprobs;
    j->gp.top_logprobs = rq->logprobs ? (int)rq->top_logprobs : 0;
    j->gp.prompt_top_logprobs = rq->prompt_logprobs ? (int)rq->prompt_top_logprobs : 0;
    j->gp.sample.top_p = 1.0f;
    if (rq->sampling != NULL) {
        j->gp.sample.temperature = rq->sampling->temperature;
        j->gp.sample.top_p = rq->sampling->top_p > 0.0f ? rq->sampling->top_p : 1.0f;
        j->gp.sample.min_p = rq->sampling->min_p;
        j->gp.sample.typical_p = rq->sampling->typical_p;
        j->gp.sample.top_k = (int)rq->sampling->top_k;
        j->gp.sample.seed = rq->sampling->seed;
        /* the first token: its bias, and no eos when the request wants any minimum */
        j->gp.min_tokens = rq->sampling->min_tokens > 0;
        for (size_t i = 0; i < rq->sampling->n_stop_token_ids && i < PD_MAX_STOP_IDS; i++)
            j->gp.stop_ids[i] = (int32_t)rq->sampling->stop_token_ids[i];
        j->gp.n_stop_ids = rq->sampling->n_stop_token_ids < PD_MAX_STOP_IDS ? (int)rq->sampling->n_stop_token_ids
                                                                              : PD_MAX_STOP_IDS;
        size_t nb = rq->sampling->n_logit_bias;
        if (nb > 0 && (j->bias = malloc(nb * sizeof(*j->bias))) == NULL) {
            atomic_store(&j->refs, 1);
            job_unref(j);
            return PD_ERR_NOMEM;
        }
        if (nb > 0) {
            for (size_t i = 0; i < nb; i++)
                j->bias[i] = (pd_logit_bias){ .tok = (int32_t)rq->sampling->logit_bias[i]->token_id,
                                              .bias = rq->sampling->logit_bias[i]->bias };
            j->gp.logit_bias = j->bias;
            j->gp.n_logit_bias = (int)nb;
        }
        /* only the repetition penalty can touch the first token (the output is still empty) */
        j->gp.presence_penalty = rq->sampling->presence_penalty;
        j->gp.frequency_penalty = rq->sampling->frequency_penalty;
        j->gp.repetition_penalty = rq->sampling->repetition_penalty;
        /* structured output: the decode node sends the tokens its grammar allows first */
        const ProtobufCBinaryData *fm = &rq->sampling->first_token_mask;
        if (fm->len > 0) {
            int words = (ps->vocab + 31) / 32;
            if ((j->first_allow = calloc((size_t)words, sizeof(uint32_t))) == NULL) {
                atomic_store(&j->refs, 1);
                job_unref(j);
                return PD_ERR_NOMEM;
            }
            for (size_t i = 0; i < fm->len; i++)
                j->first_allow[i / 4] |= (uint32_t)fm->data[i] << (8 * (i % 4));
            j->gp.first_allow = j->first_allow;
        }
    }
    j->t_recv = now_ms();
    int64_t tmo = (int64_t)(rq->timeout_ms > (uint64_t)INT32_MAX ? INT32_MAX : rq->timeout_ms);
    int64_t left = pd_rpc_call_deadline_ms(call);
    if (left != INT64_MAX && (tmo == 0 || left < tmo))
        tmo = left > 0 ? left : 1;
    j->deadline = tmo > 0 ? j->t_recv + (double)tmo : 0.0;
    pd_rpc_call_on_done(call, prefill_rpc_done, j);
    if (pd_loop_post(ps->loop, submit_cb, j) != PD_OK) {
        pd_rpc_finish(call, PD_ERR_CANCELLED, "prefill node shutting down");
        job_unref(j);
    }
    return PD_OK;
}

static pd_status handle_cancel(void *ud, const ProtobufCMessage *msg, pd_rpc_call *call)
{
    prefill_server *ps = ud;
    const Pdspark__CancelPrefillRequest *rq = (const Pdspark__CancelPrefillRequest *)msg;
    cancel_msg *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return PD_ERR_NOMEM;
    m->ps = ps;
    m->call = call;
    snprintf(m->id, sizeof(m->id), "%s", rq->request_id != NULL ? rq->request_id : "");
    if (pd_loop_post(ps->loop, cancel_cb, m) != PD_OK) {
        free(m);
        pd_rpc_finish(call, PD_ERR_CANCELLED, "prefill node shutting down");
    }
    return PD_OK;
}

static pd_status handle_health(void *ud, const ProtobufCMessage *msg, pd_rpc_call *call)
{
    (void)msg;
    prefill_server *ps = ud;
    Pdspark__HealthReply r = PDSPARK__HEALTH_REPLY__INIT;
    r.version = PD_PROTO_VERSION;
    r.status = PDSPARK__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING;
    char node[96];
    snprintf(node, sizeof(node), "prefill %s cp %d", ps->device, ps->cp_n);
    r.node = node;
    r.message = "";
    pthread_mutex_lock(&ps->stats_mu);
    r.active_requests = (uint32_t)ps->st_active;
    r.queued_requests = (uint32_t)ps->st_queued;
    r.free_kv_pages = (uint32_t)ps->st_free;
    r.total_kv_pages = (uint32_t)ps->st_total;
    pthread_mutex_unlock(&ps->stats_mu);
    pd_rpc_reply(call, &r.base);
    return PD_OK;
}

static const pd_rpc_method methods[] = {
    { "/pdspark.Prefill/Prefill", PD_RPC_UNARY, &pdspark__prefill_request__descriptor, handle_prefill },
    { "/pdspark.Prefill/CancelPrefill", PD_RPC_UNARY, &pdspark__cancel_prefill_request__descriptor,
      handle_cancel },
    { "/pdspark.Prefill/Health", PD_RPC_UNARY, &pdspark__health_request__descriptor, handle_health },
};

pd_status prefill_server_listen(prefill_server *ps, const char *addr, pd_rpc_server **out, pd_err *err)
{
    return pd_rpc_server_create(addr, methods, sizeof(methods) / sizeof(methods[0]), ps, out, err);
}

/* ---------------------------------------------------------------------------------------------
 * Create / destroy */

pd_status prefill_server_create(const prefill_config *cfg, prefill_server **out, pd_err *err)
{
    if (cfg->model_dir == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "prefill server: --model is required");
    const char *aux = cfg->aux_transfer != NULL ? cfg->aux_transfer : "raw";
    pd_aux_mode am;
    if (pd_aux_mode_parse(aux, &am, NULL) != PD_OK)
        return pd_err_set(err, PD_ERR_INVALID, "--aux-transfer '%s': expected raw, ctx or draft-kv", aux);
    if (cfg->prefix_cache && cfg->draft_dir != NULL && am != PD_AUX_DRAFT_KV)
        return pd_err_set(err, PD_ERR_INVALID, "--prefix-cache needs --aux-transfer draft-kv (%s ships "
                          "per-token rows of every prompt token, which cached pages do not keep)", aux);
    if (cfg->prefix_cache && cfg->cp_size > 1)
        return pd_err_set(err, PD_ERR_INVALID, "--prefix-cache does not combine with --cp-size %d",
                          cfg->cp_size);
    if (am != PD_AUX_RAW && cfg->draft_dir == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "--aux-transfer %s needs --draft DIR (the drafter's %s runs "
                          "on the prefill node)", aux, am == PD_AUX_CTX ? "fc + hidden_norm" : "context K/V");
    prefill_server *ps = calloc(1, sizeof(*ps));
    if (ps == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "prefill server");
    pd_status st;
    ps->cfg = *cfg;
    ps->aux_mode = am;
    pthread_mutex_init(&ps->stats_mu, NULL);
    atomic_init(&ps->next_eid, 1);
    ps->model_dir = strdup(cfg->model_dir);
    ps->draft_dir = cfg->draft_dir != NULL ? strdup(cfg->draft_dir) : NULL;
    ps->device = strdup(cfg->device != NULL ? cfg->device : "cpu");
    ps->cp_strategy = cfg->cp_strategy != NULL ? strdup(cfg->cp_strategy) : NULL;
    if (ps->cfg.max_batch_tokens <= 0)
        ps->cfg.max_batch_tokens = 8192;
    if (ps->cfg.transfer_timeout_ms <= 0)
        ps->cfg.transfer_timeout_ms = 30000;
    if (ps->model_dir == NULL || ps->device == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "prefill config");
        goto err_destroy;
    }
    kern_backend_config bc = { .name = ps->device, .f32 = cfg->f32 };
    if ((st = kern_backend_create(&bc, &ps->be, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_qwen3_load(ps->be, ps->model_dir, &ps->tm, err)) != PD_OK)
        goto err_destroy;
    if (ps->draft_dir != NULL && (st = pd_dspark_load(ps->be, ps->draft_dir, ps->tm, &ps->dm, err)) != PD_OK)
        goto err_destroy;
    pd_engine_config ec = { .target = ps->tm, .draft = ps->dm, .page_size = cfg->page_size,
                            .n_pages = cfg->kv_pages, .kv_mem_fraction = cfg->kv_mem_fraction,
                            .max_prefill_tokens = ps->cfg.max_batch_tokens,
                            .fast_kernels = cfg->fast_kernels, .prefix_cache = cfg->prefix_cache };
    if ((st = pd_cp_targets_load(&ps->cp_targets, ps->be, ps->model_dir, cfg->cp_size, err)) != PD_OK)
        goto err_destroy;
    if (cfg->cp_size > 1) {
        ec.cp_size = cfg->cp_size;
        ec.cp_targets = (const pd_qwen3_model *const *)ps->cp_targets.tm;
        if (ps->cp_strategy != NULL && (st = pd_cp_strategy_parse(ps->cp_strategy, &ec.cp_strategy, err)) != PD_OK)
            goto err_destroy;
    }
    if ((st = pd_engine_create(&ec, &ps->eng, err)) != PD_OK)
        goto err_destroy;
    ps->cp_n = cfg->cp_size > 1 ? cfg->cp_size : 1;
    ps->lay = *pd_kv_pool_layout(pd_engine_target_pool(ps->eng));
    ps->page_bytes = pd_kv_page_bytes(&ps->lay);
    ps->vocab = ps->tm->cfg.vocab_size;
    ps->max_ctx = ps->tm->cfg.max_position_embeddings;
    ps->aux_dim = pd_engine_aux_dim(ps->eng);
    ps->hidden = ps->tm->cfg.hidden_size;
    if (ps->dm != NULL) {
        ps->dlay = *pd_kv_pool_layout(pd_engine_draft_pool(ps->eng));
        ps->dpage_bytes = pd_kv_page_bytes(&ps->dlay);
    }
    if ((st = pd_loop_create(&ps->loop, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_loop_timer_create(ps->loop, step_cb, ps, &ps->step_timer, err)) != PD_OK ||
        (st = pd_loop_timer_create(ps->loop, tick_cb, ps, &ps->tick_timer, err)) != PD_OK)
        goto err_destroy;
    pd_xfer_config xc;
    pd_xfer_config_default(&xc);
    xc.name = "prefill";
    xc.timeout_ms = (uint32_t)ps->cfg.transfer_timeout_ms;
    xc.err_mode_none = cfg->xfer_err_mode_none != 0;
    if ((st = pd_xfer_create(&xc, &ps->x, err)) != PD_OK)
        goto err_destroy;
    /* device KV that UCX cannot read: pages are downloaded to a per-request host buffer first
     * (PD_XFER_FORCE_STAGING=1 takes this path with host memory too, for tests) */
    const char *force = getenv("PD_XFER_FORCE_STAGING");
    ps->stage = (!ps->be->is_host && !pd_xfer_supports_cuda(ps->x)) ||
                (force != NULL && strcmp(force, "1") == 0);
    if (ps->stage && cfg->stage_bytes > 0 &&
        (st = pd_host_arena_create(ps->be, (size_t)cfg->stage_bytes, STAGE_CHUNK_BYTES, &ps->stage_arena,
                                   err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_xfer_thread_start(ps->x, &ps->xt, err)) != PD_OK)
        goto err_destroy;
    pd_loop_timer_start(ps->tick_timer, TICK_MS, true);
    update_stats(ps);
    if (pthread_create(&ps->thread, NULL, engine_thread, ps) != 0) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "engine thread: cannot start");
        goto err_destroy;
    }
    ps->thread_started = 1;
    PD_LOG_INFO("prefill", "engine up: %s, cp %d, %d kv pages of %d tokens, aux transfer %s",
                ps->device, ps->cp_n, ps->lay.n_pages, ps->lay.page_size,
                ps->dm != NULL ? pd_aux_mode_name(ps->aux_mode) : "none");
    *out = ps;
    return PD_OK;
err_destroy:
    prefill_server_destroy(ps);
    return st;
}

void prefill_server_destroy(prefill_server *ps)
{
    if (ps == NULL)
        return;
    if (ps->thread_started) {
        if (pd_loop_post(ps->loop, shutdown_cb, ps) != PD_OK)
            pd_loop_stop(ps->loop);
        pthread_join(ps->thread, NULL);
    }
    /* the transfer thread next (transfers that end meanwhile finish their jobs there: nothing
     * else runs now); then this thread owns the xfer, and jobs whose transfer outlived the bound
     * end as their peers are destroyed (done runs, the peer is already gone) */
    atomic_store(&ps->torn_down, 1);
    pd_xfer_thread_stop(ps->xt);
    for (job *j = ps->head; j != NULL; j = j->next)
        j->pe = NULL;
    while (ps->peers != NULL) {
        peer_ent *pe = ps->peers;
        ps->peers = pe->next;
        pd_xfer_peer_destroy(pe->peer);
        free(pe->addr);
        free(pe);
    }
    while (ps->head != NULL)
        job_finish(ps, ps->head, PD_ERR_CANCELLED, "prefill node shutting down");
    pd_loop_timer_destroy(ps->step_timer);
    pd_loop_timer_destroy(ps->tick_timer);
    pd_loop_destroy(ps->loop);
    pd_xfer_destroy(ps->x);
    pd_host_arena_destroy(ps->stage_arena);   /* every job retired, no put left */
    pd_engine_destroy(ps->eng);
    pd_dspark_free(ps->dm);
    pd_cp_targets_free(&ps->cp_targets);
    pd_qwen3_free(ps->tm);
    kern_backend_destroy(ps->be);
    pthread_mutex_destroy(&ps->stats_mu);
    free(ps->model_dir);
    free(ps->draft_dir);
    free(ps->device);
    free(ps->cp_strategy);
    free(ps);
}
