/* decode_server.c - the decode node's engine thread and request lifecycle (decode_api.h).
 * Owns: the pd_engine and its KV pools, the engine thread's pd_loop (steps, a 20 ms tick for
 *   deadlines and UCX progress), the request table (queued -> prefilling -> running -> ended),
 *   admission bounded by free KV pages (FIFO queue, then RESOURCE_EXHAUSTED), streaming
 *   detokenization, the chat template both front ends render by, and in disaggregated mode the
 *   UCX worker (target KV pool, draft KV pool and
 *   aux arena registered once; every --aux-transfer mode is offered, the reply says which one
 *   the prefill node used), the prefill-node clients (least-loaded choice, reconnect after a
 *   failure) and the Prefill / CancelPrefill calls.
 * Not here: the wire format of Generate (decode_grpc.c), the engine math (common/pd_engine.c).
 * Threading: everything below the API functions runs on the engine thread; the API functions
 *   hand work over with pd_loop_post. Prefill replies arrive on a pd_rpc poller thread and are
 *   posted too. The stats snapshot is the one piece shared under a mutex. The pd_xfer (a passive
 *   target of the prefill nodes' puts) is set up here and then progressed on its own thread
 *   (pd_xfer_thread) until destroy. */
#define _GNU_SOURCE   /* pthread_setname_np */
#include "decode_api.h"

#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "pd_cli.h"
#include "pd_log.h"
#include "pd_loop.h"
#include "pd_proto_version.h"
#include "pd_rpc.h"
#include "pd_grammar.h"
#include "pd_tokenizer.h"
#include "pd_wire.h"
#include "pd_xfer.h"
#include "pd_xfer_thread.h"
#include "pdspark.pb-c.h"

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
    pd_rpc_channel *ch;
    int inflight;            /* Prefill calls */
    int calls;               /* every call in flight on ch (Prefill + CancelPrefill) */
    double down_until;
    int reset;               /* recreate the channel once idle (after a failure) */
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
    void *kv_stage;                  /* host mirror of the KV pool when it is device memory */
    /* draft pool (--aux-transfer draft-kv on a prefill node puts the draft context K/V here) */
    pd_xfer_mem *dkv_mem;
    void *dkv_rkey;
    size_t dkv_rkey_len;
    void *dkv_stage;                 /* host mirror of the draft pool when it is device memory */
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

void decode_config_default(decode_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->device = "cpu";
    cfg->page_size = 16;
    cfg->max_batch = 64;
    cfg->prefill_refresh_ms = 10000;
    cfg->max_queue = 256;
    cfg->queue_timeout_ms = 30000;
    cfg->transfer_timeout_ms = 30000;
    cfg->max_local_prefill = -1;
    cfg->swap_bytes = (int64_t)4 << 30;   /* vLLM's --swap-space default */
}

/* max_new_tokens 0: what a prompt of n tokens leaves of the context, as vLLM gives a request
 * without max_tokens, and no more than the KV pool holds beside the prompt and a block (so the
 * request fits the pool alone) */
static int max_new_default(const decode_server *s, int n)
{
    long ctx = (long)s->max_ctx - n;
    long pool = (long)s->total_pages * s->page_size - n - s->block_size - 1;
    long v = ctx < pool ? ctx : pool;
    return v >= 1 ? (int)v : 1;
}

/* ---------------------------------------------------------------------------------------------
 * Handles */

static void handle_unref(decode_handle *h)
{
    if (h == NULL)
        return;
    if (atomic_fetch_sub(&h->refs, 1) == 1) {
        free(h->prompt);
        free(h->bias);
        pd_grammar_unref(h->grammar);
        free(h);
    }
}

void decode_handle_release(decode_handle *h)
{
    handle_unref(h);
}

static void list_remove(decode_server *s, decode_handle *h)
{
    if (h->prev != NULL)
        h->prev->next = h->next;
    else
        s->head = h->next;
    if (h->next != NULL)
        h->next->prev = h->prev;
    else
        s->tail = h->prev;
    h->prev = h->next = NULL;
}

static void update_stats(decode_server *s)
{
    decode_stats st = {0};
    st.serving = atomic_load(&s->accepting);
    st.active_requests = s->n_running + s->n_prefill;
    st.queued_requests = s->n_queued;
    st.total_kv_pages = s->total_pages;
    st.free_kv_pages = pd_engine_kv_free_pages(s->eng);
    st.pages_in_use = st.total_kv_pages - st.free_kv_pages;
    pd_engine_swap_stats(s->eng, &st.preemptions, &st.swapped_requests, &st.swap_bytes);
    double now = pd_cli_now_ms();
    st.disaggregated = !s->cfg.colocated;
    for (int i = 0; i < s->n_nodes; i++) {
        st.prefill_inflight += s->nodes[i]->inflight;
        if (s->nodes[i]->gone)
            continue;
        st.prefill_nodes++;
        if (s->nodes[i]->down_until <= now)
            st.prefill_nodes_up++;
        else if (st.prefill_retry_ms == 0.0 || s->nodes[i]->down_until < st.prefill_retry_ms)
            st.prefill_retry_ms = s->nodes[i]->down_until;
    }
    pthread_mutex_lock(&s->stats_mu);
    s->stats = st;
    pthread_mutex_unlock(&s->stats_mu);
}

void decode_server_drain(decode_server *s)
{
    atomic_store(&s->draining, 1);
    atomic_store(&s->accepting, 0);
    pthread_mutex_lock(&s->stats_mu);
    s->stats.serving = 0;
    pthread_mutex_unlock(&s->stats_mu);
}

void decode_server_stats(decode_server *s, decode_stats *out)
{
    pthread_mutex_lock(&s->stats_mu);
    *out = s->stats;
    pthread_mutex_unlock(&s->stats_mu);
}

const pd_tokenizer *decode_server_tokenizer(const decode_server *s)
{
    return s->tok;
}

int decode_server_vocab(const decode_server *s)
{
    return s->vocab;
}

int decode_server_max_ctx(const decode_server *s)
{
    return s->max_ctx;
}

const char *decode_server_device(const decode_server *s)
{
    return s->device;
}

const char *decode_server_mode(const decode_server *s)
{
    return s->cfg.colocated ? "colocated" : "disaggregated";
}

/* ---------------------------------------------------------------------------------------------
 * Aux arena: contiguous row ranges, first fit */

/* ---- structured output -------------------------------------------------------------------- */

pd_status decode_compile_guide(decode_server *s, const decode_req *req, pd_grammar **out, pd_err *err)
{
    pd_grammar_spec spec = { .json_object = req->json_object, .json_schema = req->json_schema,
                             .json_schema_len = req->json_schema_len, .choices = req->choices,
                             .n_choices = req->n_choices, .regex = req->regex, .regex_len = req->regex_len,
                             .ebnf = req->ebnf, .ebnf_len = req->ebnf_len };
    return pd_grammar_compile(&spec, s->grammars, out, err);
}

pd_gcache *decode_server_grammars(decode_server *s)
{
    return s->grammars;
}

static int aux_alloc(decode_server *s, int n)
{
    int at = 0, i = 0;
    for (; i < s->n_segs; i++) {
        if (s->segs[i].start - at >= n)
            break;
        at = s->segs[i].start + s->segs[i].n;
    }
    if (i == s->n_segs && s->aux_rows - at < n)
        return -1;
    if (s->n_segs == s->cap_segs) {
        int cap = s->cap_segs ? 2 * s->cap_segs : 64;
        aux_seg *ns = realloc(s->segs, (size_t)cap * sizeof(*ns));
        if (ns == NULL)
            return -1;
        s->segs = ns;
        s->cap_segs = cap;
    }
    memmove(&s->segs[i + 1], &s->segs[i], (size_t)(s->n_segs - i) * sizeof(*s->segs));
    s->segs[i] = (aux_seg){ at, n };
    s->n_segs++;
    return at;
}

static void aux_free(decode_server *s, int start)
{
    for (int i = 0; i < s->n_segs; i++)
        if (s->segs[i].start == start) {
            memmove(&s->segs[i], &s->segs[i + 1], (size_t)(s->n_segs - i - 1) * sizeof(*s->segs));
            s->n_segs--;
            return;
        }
}

/* ---------------------------------------------------------------------------------------------
 * Ending requests */

static void kick(decode_server *s);

/* tok is the eos or stop_token_ids token that ended h (its last token): its text is not part
 * of the output (vLLM's default) */
static int ended_by_stop_id(const decode_server *s, const decode_handle *h, int32_t tok)
{
    if (h->r->finish != PD_FINISH_STOP || h->r->n_out == 0 || h->r->out[h->r->n_out - 1] != tok)
        return 0;
    for (int i = 0; i < h->gp.n_stop_ids; i++)
        if (h->gp.stop_ids[i] == tok)
            return 1;
    for (int i = 0; i < s->tm->cfg.n_eos && !h->gp.ignore_eos; i++)
        if (s->tm->cfg.eos_ids[i] == tok)
            return 1;
    return 0;
}

static void emit_new(decode_server *s, decode_handle *h)
{
    if (h->r == NULL || h->done_called)
        return;
    int n = 0;
    const int32_t *nt = pd_engine_take_new(h->r, &n);
    if (n <= 0)
        return;
    double now = pd_cli_now_ms();
    int first = h->t_first == 0.0;
    if (first)
        h->t_first = now;
    double gap = now - (first ? h->t_submit : h->t_last);
    h->t_last = now;
    size_t cap = 256, len = 0;
    char *text = malloc(cap);
    size_t *plen = calloc((size_t)n, sizeof(size_t));
    for (int i = 0; i < n && text != NULL && plen != NULL; i++) {
        char *piece = NULL;
        pd_err err;
        if (i == n - 1 && ended_by_stop_id(s, h, nt[i]))
            continue;   /* an eos or stop_token_ids token ends the text without being part of it */
        if (h->detok == NULL || pd_detok_push(h->detok, nt[i], &piece, &err) != PD_OK)
            continue;
        size_t pl = strlen(piece);
        plen[i] = pl;
        if (len + pl + 1 > cap) {
            while (len + pl + 1 > cap)
                cap *= 2;
            char *nt2 = realloc(text, cap);
            if (nt2 == NULL) {
                free(piece);
                break;
            }
            text = nt2;
        }
        memcpy(text + len, piece, pl);
        len += pl;
        free(piece);
    }
    if (text != NULL)
        text[len] = '\0';
    if (plen == NULL)
        len = 0;
    decode_chunk c = { .request_id = h->id, .ids = nt, .n_ids = n, .text = text ? text : "",
                       .text_len = text ? len : 0, .piece_len = plen,
                       .logprobs = h->r->lps != NULL ? h->r->lps + (nt - h->r->out) : NULL };
    if (first && h->r->prompt_lps != NULL) {
        c.prompt_logprobs = h->r->prompt_lps;
        c.prompt_ids = h->r->prompt;
        c.n_prompt = h->r->n_prompt;
    }
    const decode_observer *ob = s->cfg.observer;
    if (ob != NULL && ob->on_token != NULL)
        ob->on_token(ob->ud, &c, gap, first);
    if (h->on_token != NULL)
        h->on_token(h->ud, &c);
    free(text);
    free(plen);
}

/* Call on_done once. The request's engine state is left to the caller. */
static void call_done(decode_server *s, decode_handle *h, pd_status st, const char *msg)
{
    if (h->done_called)
        return;
    h->done_called = 1;
    char *tail = NULL;
    pd_err err;
    if (h->detok != NULL && pd_detok_flush(h->detok, &tail, &err) != PD_OK)
        tail = NULL;
    pd_request *r = h->r;
    int running = h->state == H_RUNNING && r != NULL;
    decode_result res = {
        .request_id = h->id,
        .status = st,
        .error = msg != NULL ? msg : "",
        .finish = running ? r->finish : PD_FINISH_ERROR,
        .text_tail = tail != NULL ? tail : "",
        .text_tail_len = tail != NULL ? strlen(tail) : 0,
        .tokens = running ? r->out : NULL,
        .n_tokens = running ? r->n_out : 0,
        .prompt_tokens = h->n_prompt,
        .cached_tokens = r != NULL ? (r->external ? h->cached_remote : r->cached) : 0,
        .rounds = running ? r->n_rounds : 0,
        .accepted_per_round = running ? r->accepted : NULL,
        .block_size = s->block_size,
        .accepted_at_pos = running ? r->accepted_at_pos : NULL,
    };
    if (st == PD_ERR_CANCELLED)
        res.finish = PD_FINISH_CANCELLED;
    if (running && r->n_rounds > 0) {
        long sum = 0;
        for (int i = 0; i < r->n_rounds; i++)
            sum += r->accepted[i];
        res.tau = (double)sum / r->n_rounds;
    }
    double now = pd_cli_now_ms();
    res.time_ms = now - h->t_submit;
    res.ttft_ms = h->t_first > 0 ? h->t_first - h->t_submit : res.time_ms;
    res.queue_ms = h->t_admit > 0 ? h->t_admit - h->t_submit : -1.0;
    res.prefill_call_ms = h->t_sent > 0 && h->t_reply >= h->t_sent ? h->t_reply - h->t_sent : -1.0;
    res.prefill_join_ms = h->t_reply > 0 && h->t_first >= h->t_reply ? h->t_first - h->t_reply : -1.0;
    if (st == PD_OK)
        PD_LOG_DEBUG("decode", "%s: done (%s), %d tokens, %d rounds, tau %.3f in %.1f ms", h->id,
                     pd_finish_reason_str(res.finish), res.n_tokens, res.rounds, res.tau, res.time_ms);
    else
        PD_LOG_DEBUG("decode", "%s: ended %s: %s", h->id, pd_status_str(st), res.error);
    if (s->cfg.observer != NULL && s->cfg.observer->on_done != NULL)
        s->cfg.observer->on_done(s->cfg.observer->ud, &res);
    if (h->on_done != NULL)
        h->on_done(h->ud, &res);
    free(tail);
    pd_detok_destroy(h->detok);
    h->detok = NULL;
}

/* Drop the server's hold on h: engine request, aux rows, list entry, reference. */
static void handle_retire(decode_server *s, decode_handle *h)
{
    if (h->r != NULL) {
        pd_engine_release(s->eng, h->r);
        h->r = NULL;
    }
    if (h->aux_row >= 0) {
        aux_free(s, h->aux_row);
        h->aux_row = -1;
    }
    h->state = H_GONE;
    s->admit_blocked = 0;   /* pages or rows came back */
    list_remove(s, h);
    handle_unref(h);
}

static void cancel_prefill_reply(void *ud, pd_status st, ProtobufCMessage *resp, const pd_err *err);

/* End a request for its caller with st. Pages a prefill node may still write stay held. */
static void end_request(decode_server *s, decode_handle *h, pd_status st, const char *msg)
{
    if (h->done_called)
        return;
    switch (h->state) {
    case H_QUEUED:
        s->n_queued--;
        atomic_fetch_sub(&s->n_waiting, 1);
        call_done(s, h, st, msg);
        handle_retire(s, h);
        break;
    case H_RUNNING:
        if (h->r != NULL && h->r->finish == PD_FINISH_NONE)
            pd_engine_cancel(s->eng, h->r);
        if (st != PD_OK && st != PD_ERR_CANCELLED)
            h->state = H_GONE;   /* no tokens/stats in an error result; a cancelled one keeps
                                  * them (HTTP stop strings end generation by cancelling) */
        call_done(s, h, st, msg);
        h->state = H_RUNNING;
        s->n_running--;
        handle_retire(s, h);
        break;
    case H_PREFILL: {
        /* the prefill node may be putting into our pages: tell it to stop, keep the pages
         * until its Prefill reply (bounded by that call's deadline) */
        call_done(s, h, st, msg);
        s->n_prefill--;
        h->state = H_ZOMBIE;
        prefill_node *nd = h->node;
        Pdspark__CancelPrefillRequest cr = PDSPARK__CANCEL_PREFILL_REQUEST__INIT;
        cr.version = PD_PROTO_VERSION;
        cr.request_id = h->id;
        pd_err err;
        if (nd != NULL && pd_rpc_unary_async(nd->ch, "/pdspark.Prefill/CancelPrefill", &cr.base,
                                             &pdspark__cancel_prefill_reply__descriptor,
                                             s->cfg.transfer_timeout_ms, cancel_prefill_reply, nd,
                                             NULL, &err) == PD_OK)
            nd->calls++;
        break;
    }
    default:
        break;
    }
    update_stats(s);
}

/* ---------------------------------------------------------------------------------------------
 * Prefill nodes */

typedef struct {
    decode_server *s;
    decode_handle *h;
    prefill_node *node;
    pd_status st;
    ProtobufCMessage *resp;
    char msg[512];
    int is_cancel;
    double t_recv;               /* when the reply reached the poller thread */
} reply_msg;

static void on_reply_loop(void *arg);

static void post_reply(decode_server *s, decode_handle *h, prefill_node *nd, int is_cancel,
                       pd_status st, ProtobufCMessage *resp, const pd_err *err)
{
    reply_msg *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        /* cannot hand it over: the request stays held until shutdown bounds it */
        PD_LOG_ERROR("decode", "prefill reply: out of memory");
        if (resp != NULL)
            protobuf_c_message_free_unpacked(resp, NULL);
        return;
    }
    m->s = s;
    m->h = h;
    m->node = nd;
    m->st = st;
    m->resp = resp;
    m->is_cancel = is_cancel;
    m->t_recv = pd_cli_now_ms();
    if (st != PD_OK && err != NULL)
        snprintf(m->msg, sizeof(m->msg), "%s", err->msg[0] ? err->msg : pd_status_str(st));
    if (pd_loop_post(s->loop, on_reply_loop, m) != PD_OK) {
        if (resp != NULL)
            protobuf_c_message_free_unpacked(resp, NULL);
        free(m);
    }
}

static void cancel_prefill_reply(void *ud, pd_status st, ProtobufCMessage *resp, const pd_err *err)
{
    prefill_node *nd = ud;
    post_reply(nd->s, NULL, nd, 1, st, resp, err);
}

static void prefill_reply(void *ud, pd_status st, ProtobufCMessage *resp, const pd_err *err)
{
    decode_handle *h = ud;
    post_reply(h->s, h, h->node, 0, st, resp, err);
}

static prefill_node *pick_node(decode_server *s)
{
    double now = pd_cli_now_ms();
    prefill_node *best = NULL;
    int best_up = 0;
    for (int i = 0; i < s->n_nodes; i++) {
        prefill_node *nd = s->nodes[i];
        if (nd->gone)
            continue;
        int up = nd->down_until <= now;
        if (best == NULL || (up && !best_up) ||
            (up == best_up && nd->inflight < best->inflight)) {
            best = nd;
            best_up = up;
        }
    }
    if (best != NULL && best->reset && best->calls == 0) {
        /* a fresh channel connects at once instead of waiting out gRPC's reconnect backoff */
        pd_rpc_channel *ch = NULL;
        pd_err err;
        if (pd_rpc_channel_create(best->addr, &ch, &err) == PD_OK) {
            pd_rpc_channel_destroy(best->ch);
            best->ch = ch;
            best->reset = 0;
        }
    }
    return best;
}

static void node_failed(decode_server *s, prefill_node *nd, const char *why)
{
    (void)s;
    if (nd->down_until <= pd_cli_now_ms())
        PD_LOG_WARN("decode", "prefill node %s failed: %s", nd->addr, why);
    nd->down_until = pd_cli_now_ms() + NODE_DOWN_MS;
    nd->reset = 1;
}

static Pdspark__KvDtype kern_dtype_to_proto(kern_dtype d)
{
    switch (d) {
    case KERN_DTYPE_F32: return PDSPARK__KV_DTYPE__KV_DTYPE_F32;
    case KERN_DTYPE_BF16: return PDSPARK__KV_DTYPE__KV_DTYPE_BF16;
    case KERN_DTYPE_F16: return PDSPARK__KV_DTYPE__KV_DTYPE_F16;
    default: return PDSPARK__KV_DTYPE__KV_DTYPE_UNSPECIFIED;
    }
}

/* Reserve pages + aux rows and send Prefill. PD_ERR_BUSY: no room now (nothing held). */
/* Send h's Prefill (pages and aux rows already reserved) to nd. On error nothing is in flight. */
/* The tokens a grammar allows first, as SamplingParams.first_token_mask's bytes (malloc'd) */
static pd_status first_token_mask(decode_server *s, pd_grammar *g, uint8_t **out, pd_err *err)
{
    pd_gmatch *m = NULL;
    int words = pd_gvocab_words(s->gvocab);
    uint32_t *bits = malloc((size_t)words * sizeof(uint32_t));
    uint8_t *bytes = malloc((size_t)words * sizeof(uint32_t));
    pd_status st = bits == NULL || bytes == NULL ? pd_err_set(err, PD_ERR_NOMEM, "first-token mask")
                                                 : pd_gmatch_create(g, &m, err);
    if (st == PD_OK)
        st = pd_gmatch_allowed(m, s->gvocab, bits, err);
    for (int i = 0; st == PD_OK && i < words * 4; i++)
        bytes[i] = (uint8_t)(bits[i / 4] >> (8 * (i % 4)));
    pd_gmatch_destroy(m);
    free(bits);
    if (st != PD_OK) {
        free(bytes);
        return st;
    }
    *out = bytes;
    return PD_OK;
}

static pd_status send_prefill(decode_server *s, decode_handle *h, prefill_node *nd, pd_err *err)
{
    if (nd == NULL)
        return pd_err_set(err, PD_ERR_PEER, "no prefill node: '%s' resolves to no address now", s->prefill);
    pd_status st;
    int row = h->aux_row;
    const pd_kv_layout *lay = pd_kv_pool_layout(pd_engine_target_pool(s->eng));
    int np = (h->n_prompt + lay->page_size - 1) / lay->page_size;
    uint32_t *pages = malloc((size_t)np * sizeof(uint32_t));
    uint32_t *ids = malloc((size_t)h->n_prompt * sizeof(uint32_t));
    if (pages == NULL || ids == NULL) {
        free(pages);
        free(ids);
        return pd_err_set(err, PD_ERR_NOMEM, "prefill request");
    }
    for (int i = 0; i < np; i++)
        pages[i] = (uint32_t)h->r->tkv.pages[i];
    uint32_t *dpages = NULL;
    if (s->dkv_mem != NULL) {
        PD_ASSERT(h->r->dkv.n_pages >= np);
        dpages = malloc((size_t)np * sizeof(uint32_t));
        if (dpages == NULL) {
            free(pages);
            free(ids);
            return pd_err_set(err, PD_ERR_NOMEM, "prefill request");
        }
        for (int i = 0; i < np; i++)
            dpages[i] = (uint32_t)h->r->dkv.pages[i];
    }
    for (int i = 0; i < h->n_prompt; i++)
        ids[i] = (uint32_t)h->prompt[i];
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    sp.version = PD_PROTO_VERSION;
    sp.temperature = h->gp.sample.temperature;
    sp.top_p = h->gp.sample.top_p;
    sp.min_p = h->gp.sample.min_p;
    sp.top_k = (uint32_t)h->gp.sample.top_k;
    sp.seed = h->gp.sample.seed;
    sp.max_new_tokens = 1;
    sp.presence_penalty = h->gp.presence_penalty;
    sp.frequency_penalty = h->gp.frequency_penalty;
    sp.repetition_penalty = h->gp.repetition_penalty;
    sp.min_tokens = (uint32_t)h->gp.min_tokens;
    uint32_t stop_ids[PD_MAX_STOP_IDS];
    for (int i = 0; i < h->gp.n_stop_ids; i++)
        stop_ids[i] = (uint32_t)h->gp.stop_ids[i];
    sp.n_stop_token_ids = (size_t)h->gp.n_stop_ids;
    sp.stop_token_ids = stop_ids;
    /* structured output: the prefill node samples the first token, from the tokens the grammar
     * allows at its start */
    uint8_t *first_mask = NULL;
    if (h->grammar != NULL) {
        pd_status gst = first_token_mask(s, h->grammar, &first_mask, err);
        if (gst != PD_OK) {
            free(pages);
            free(ids);
            free(dpages);
            return gst;
        }
        sp.first_token_mask.data = first_mask;
        sp.first_token_mask.len = (size_t)(s->vocab + 7) / 8;
    }
    Pdspark__LogitBias *lbm = NULL, **lbp = NULL;
    if (h->gp.n_logit_bias > 0) {
        lbm = calloc((size_t)h->gp.n_logit_bias, sizeof(*lbm));
        lbp = calloc((size_t)h->gp.n_logit_bias, sizeof(*lbp));
        if (lbm == NULL || lbp == NULL) {
            free(lbm);
            free(lbp);
            free(pages);
            free(ids);
            free(dpages);
            free(first_mask);
            return pd_err_set(err, PD_ERR_NOMEM, "prefill request");
        }
        for (int i = 0; i < h->gp.n_logit_bias; i++) {
            pdspark__logit_bias__init(&lbm[i]);
            lbm[i].version = PD_PROTO_VERSION;
            lbm[i].token_id = (uint32_t)h->gp.logit_bias[i].tok;
            lbm[i].bias = h->gp.logit_bias[i].bias;
            lbp[i] = &lbm[i];
        }
        sp.n_logit_bias = (size_t)h->gp.n_logit_bias;
        sp.logit_bias = lbp;
    }
    Pdspark__PageLayout pl = PDSPARK__PAGE_LAYOUT__INIT;
    pl.version = PD_PROTO_VERSION;
    pl.page_size = (uint32_t)lay->page_size;
    pl.dtype = kern_dtype_to_proto(lay->dtype);
    pl.n_layers = (uint32_t)lay->n_layers;
    pl.n_kv_heads = (uint32_t)lay->n_kv_heads;
    pl.head_dim = (uint32_t)lay->head_dim;
    pl.bytes_per_page = pd_kv_page_bytes(lay);
    Pdspark__PageLayout dpl = PDSPARK__PAGE_LAYOUT__INIT;
    Pdspark__RemoteRegion dkv = PDSPARK__REMOTE_REGION__INIT;
    if (s->dkv_mem != NULL) {
        const pd_kv_layout *dl = pd_kv_pool_layout(pd_engine_draft_pool(s->eng));
        dpl.version = PD_PROTO_VERSION;
        dpl.page_size = (uint32_t)dl->page_size;
        dpl.dtype = kern_dtype_to_proto(dl->dtype);
        dpl.n_layers = (uint32_t)dl->n_layers;
        dpl.n_kv_heads = (uint32_t)dl->n_kv_heads;
        dpl.head_dim = (uint32_t)dl->head_dim;
        dpl.bytes_per_page = pd_kv_page_bytes(dl);
        dkv.version = PD_PROTO_VERSION;
        dkv.rkey.data = s->dkv_rkey;
        dkv.rkey.len = s->dkv_rkey_len;
        dkv.base_addr = (uint64_t)(uintptr_t)pd_xfer_mem_base(s->dkv_mem);
        dkv.length = pd_xfer_mem_len(s->dkv_mem);
    }
    Pdspark__RemoteRegion kv = PDSPARK__REMOTE_REGION__INIT;
    kv.version = PD_PROTO_VERSION;
    kv.rkey.data = s->kv_rkey;
    kv.rkey.len = s->kv_rkey_len;
    kv.base_addr = (uint64_t)(uintptr_t)pd_xfer_mem_base(s->kv_mem);
    kv.length = pd_xfer_mem_len(s->kv_mem);
    Pdspark__RemoteRegion ax = PDSPARK__REMOTE_REGION__INIT;
    ax.version = PD_PROTO_VERSION;
    ax.rkey.data = s->aux_rkey;
    ax.rkey.len = s->aux_rkey_len;
    ax.base_addr = (uint64_t)(uintptr_t)pd_xfer_mem_base(s->aux_mem);
    ax.length = pd_xfer_mem_len(s->aux_mem);
    Pdspark__AuxLayout al = PDSPARK__AUX_LAYOUT__INIT;
    al.version = PD_PROTO_VERSION;
    al.mode = PDSPARK__AUX_MODE__AUX_MODE_RAW;
    al.rows = (uint32_t)h->n_prompt;
    al.row_bytes = (uint64_t)s->aux_dim * sizeof(float);
    Pdspark__Destination d = PDSPARK__DESTINATION__INIT;
    d.version = PD_PROTO_VERSION;
    d.worker_address.data = (uint8_t *)s->waddr;
    d.worker_address.len = s->waddr_len;
    d.n_page_ids = (size_t)np;
    d.page_ids = pages;
    d.kv_pool = &kv;
    d.aux = &ax;
    d.page_layout = &pl;
    d.aux_layout = &al;
    d.aux_offset = (uint64_t)row * al.row_bytes;
    /* every mode is offered (the aux rows fit raw or ctx, plus the draft pool): the prefill
     * node ships what its --aux-transfer says and names it in the reply */
    if (s->dkv_mem != NULL) {
        d.draft_kv_pool = &dkv;
        d.n_draft_page_ids = (size_t)np;
        d.draft_page_ids = dpages;
        d.draft_page_layout = &dpl;
    }
    Pdspark__PrefillRequest pr = PDSPARK__PREFILL_REQUEST__INIT;
    pr.version = PD_PROTO_VERSION;
    pr.request_id = h->id;
    pr.n_token_ids = (size_t)h->n_prompt;
    pr.token_ids = ids;
    pr.sampling = &sp;
    pr.dest = &d;
    pr.logprobs = h->gp.logprobs != 0;
    pr.top_logprobs = (uint32_t)h->gp.top_logprobs;
    pr.prompt_logprobs = h->gp.prompt_logprobs != 0;
    int64_t tmo = s->cfg.transfer_timeout_ms;
    h->prefill_by_deadline = 0;
    if (h->deadline > 0) {
        int64_t left = (int64_t)(h->deadline - pd_cli_now_ms());
        if (left < tmo) {
            tmo = left > 1 ? left : 1;
            h->prefill_by_deadline = 1;
        }
    }
    pr.timeout_ms = (uint64_t)tmo;
    /* the call's own deadline is a little longer than the node's bound, so a node that gives
     * up on time still gets its answer (and its word that no put is running) back to us */
    /* the reply callback reads h->node on the poller thread, possibly before this returns */
    h->node = nd;
    h->t_sent = pd_cli_now_ms();
    st = pd_rpc_unary_async(nd->ch, "/pdspark.Prefill/Prefill", &pr.base,
                            &pdspark__prefill_reply__descriptor, tmo + 500, prefill_reply, h,
                            &h->pending, err);
    free(pages);
    free(dpages);
    free(ids);
    free(lbm);
    free(lbp);
    free(first_mask);
    if (st != PD_OK) {
        h->node = NULL;
        node_failed(s, nd, err->msg);
        return pd_err_set(err, PD_ERR_PEER, "prefill node %s: %s", nd->addr, err->msg);
    }
    nd->inflight++;
    nd->calls++;
    PD_LOG_DEBUG("decode", "%s: prefill on %s (%d tokens, %d pages)", h->id, nd->addr,
                 h->n_prompt, np);
    return PD_OK;
}

/* Reserve pages + aux rows and send Prefill. PD_ERR_BUSY: no room now (nothing held). */
static pd_status start_external(decode_server *s, decode_handle *h, pd_err *err)
{
    int row = aux_alloc(s, h->n_prompt);
    if (row < 0)
        return pd_err_set(err, PD_ERR_BUSY, "aux arena full");
    pd_status st = pd_engine_add_external(s->eng, h->eid, h->prompt, h->n_prompt, &h->gp, &h->r, err);
    if (st != PD_OK) {
        aux_free(s, row);
        return st;
    }
    h->aux_row = row;
    st = send_prefill(s, h, pick_node(s), err);
    if (st != PD_OK) {
        pd_engine_release(s->eng, h->r);
        h->r = NULL;
        aux_free(s, h->aux_row);
        h->aux_row = -1;
    }
    return st;
}

/* True when a failed Prefill provably never reached a node (no connection was made), so no put
 * of it can be running and the same pages may be offered to another node. */
static int never_delivered(const char *msg)
{
    return strstr(msg, "failed to connect") != NULL || strstr(msg, "Connection refused") != NULL;
}

/* Staging: copy the prompt's pages (every layer's K and V) of pool from its host mirror. */
static pd_status upload_staged(decode_server *s, decode_handle *h, pd_kv_pool *pool, const void *stage,
                               const pd_kv_seq *seq, pd_err *err)
{
    if (stage == NULL)
        return PD_OK;
    const pd_kv_layout *lay = pd_kv_pool_layout(pool);
    const kern_buf *kb = pd_kv_pool_buf(pool);
    size_t pb = pd_kv_page_bytes(lay);
    int np = (h->n_prompt + lay->page_size - 1) / lay->page_size;
    for (int l = 0; l < lay->n_layers; l++)
        for (int half = 0; half < 2; half++)
            for (int p = 0, run; p < np; p += run) {
                /* a run of consecutive page ids in one copy */
                run = 1;
                while (p + run < np && seq->pages[p + run] == seq->pages[p] + run)
                    run++;
                size_t off = ((size_t)(2 * l + half) * (size_t)lay->n_pages + (size_t)seq->pages[p]) * pb;
                pd_status st = kern_upload(s->be, (char *)kb->ptr + off, (const char *)stage + off,
                                           (size_t)run * pb, err);
                if (st != PD_OK)
                    return st;
            }
    return PD_OK;
}

/* The prompt's pages and the drafter's payload arrived (the prefill node used mode): move the
 * staged pages in and hand the request to the engine. */
static pd_status complete_external(decode_server *s, decode_handle *h, int32_t first,
                                   Pdspark__AuxMode mode, const pd_token_logprobs *first_lp,
                                   pd_err *err)
{
    pd_aux_mode am;
    switch (mode) {
    case PDSPARK__AUX_MODE__AUX_MODE_RAW: am = PD_AUX_RAW; break;
    case PDSPARK__AUX_MODE__AUX_MODE_CTX: am = PD_AUX_CTX; break;
    case PDSPARK__AUX_MODE__AUX_MODE_DRAFT_KV: am = PD_AUX_DRAFT_KV; break;
    default:
        return pd_err_set(err, PD_ERR_INVALID, "aux transfer mismatch: the prefill node shipped no drafter "
                          "payload (aux mode %d); this decode node needs raw, ctx or draft-kv", (int)mode);
    }
    if (am == PD_AUX_DRAFT_KV && s->dkv_mem == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "aux transfer mismatch: the prefill node shipped draft-kv, "
                          "this decode node offered no draft pool");
    pd_status st = upload_staged(s, h, pd_engine_target_pool(s->eng), s->kv_stage, &h->r->tkv, err);
    if (st == PD_OK && am == PD_AUX_DRAFT_KV)
        st = upload_staged(s, h, pd_engine_draft_pool(s->eng), s->dkv_stage, &h->r->dkv, err);
    if (st != PD_OK)
        return st;
    /* raw rows are [n, K*hidden]; ctx rows are [n, hidden], packed from the same first row */
    const float *rows = am == PD_AUX_DRAFT_KV ? NULL : s->aux_arena + (size_t)h->aux_row * (size_t)s->aux_dim;
    return pd_engine_complete_prefill_mode(s->eng, h->r, first, am, rows, first_lp, err);
}

/* A Prefill reply's prompt logprobs into the engine request (PrefillRequest.prompt_logprobs). */
static pd_status take_prompt_logprobs(decode_server *s, decode_handle *h, const Pdspark__PrefillReply *rep,
                                      pd_err *err)
{
    if (rep->n_prompt_logprobs != (size_t)h->n_prompt)
        return pd_err_set(err, PD_ERR_PEER, "prefill reply: %zu prompt logprobs for %d prompt tokens",
                          rep->n_prompt_logprobs, h->n_prompt);
    pd_token_logprobs *lps = calloc((size_t)h->n_prompt, sizeof(*lps));
    if (lps == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "prompt logprobs");
    pd_status st = PD_OK;
    for (int i = 0; i < h->n_prompt && st == PD_OK; i++) {
        const Pdspark__TokenLogprobs *t = rep->prompt_logprobs[i];
        if (t != NULL && t->token_id != (uint32_t)h->prompt[i])
            st = pd_err_set(err, PD_ERR_PEER, "prefill reply: prompt logprobs of token %d name token %u",
                            i, t->token_id);
        else
            st = pd_wire_logprobs_in(t, &lps[i], "prefill reply: prompt token", err);
    }
    if (st == PD_OK && (st = pd_engine_set_prompt_logprobs(s->eng, h->r, lps, h->n_prompt, err)) != PD_OK)
        st = PD_ERR_PEER;
    free(lps);
    return st;
}

static void on_reply_loop(void *arg)
{
    reply_msg *m = arg;
    decode_server *s = m->s;
    prefill_node *nd = m->node;
    if (nd != NULL)
        nd->calls--;
    if (m->is_cancel) {
        if (m->resp != NULL)
            protobuf_c_message_free_unpacked(m->resp, NULL);
        free(m);
        return;
    }
    decode_handle *h = m->h;
    nd->inflight--;
    pd_rpc_pending_release(h->pending);
    h->pending = NULL;
    pd_status st = m->st;
    h->t_reply = m->t_recv;
    char msg[640];
    snprintf(msg, sizeof(msg), "%s", m->msg);
    int32_t first = -1;
    Pdspark__AuxMode aux_mode = PDSPARK__AUX_MODE__AUX_MODE_NONE;
    pd_token_logprobs first_lp = {0};
    if (st == PD_OK) {
        Pdspark__PrefillReply *rep = (Pdspark__PrefillReply *)m->resp;
        pd_err verr;
        if (pd_proto_version_check(m->resp, &verr) != PD_OK) {
            st = PD_ERR_PEER;
            snprintf(msg, sizeof(msg), "%s", verr.msg);
        } else if (rep->n_first_top_ids != rep->n_first_top_logprobs ||
                   rep->n_first_top_ids > PD_MAX_TOP_LOGPROBS) {
            st = PD_ERR_PEER;
            snprintf(msg, sizeof(msg), "prefill reply: %zu top ids with %zu top logprobs (at most %d)",
                     rep->n_first_top_ids, rep->n_first_top_logprobs, PD_MAX_TOP_LOGPROBS);
        } else {
            first = (int32_t)rep->first_token_id;
            aux_mode = rep->aux_mode;
            h->cached_remote = rep->cached_tokens > (uint32_t)h->n_prompt ? h->n_prompt : (int)rep->cached_tokens;
            first_lp.logprob = rep->first_token_logprob;
            first_lp.n_top = (int)rep->n_first_top_ids;
            for (int i = 0; i < first_lp.n_top; i++) {
                first_lp.top_id[i] = rep->first_top_ids[i] > INT32_MAX ? -1 : (int32_t)rep->first_top_ids[i];
                first_lp.top_logprob[i] = rep->first_top_logprobs[i];
            }
            if (h->gp.prompt_logprobs && h->state == H_PREFILL) {
                pd_err perr;
                if (take_prompt_logprobs(s, h, rep, &perr) != PD_OK) {
                    st = PD_ERR_PEER;
                    snprintf(msg, sizeof(msg), "%s", perr.msg);
                }
            }
        }
    }
    if (m->resp != NULL)
        protobuf_c_message_free_unpacked(m->resp, NULL);
    free(m);
    /* a call that ran out of the request's own time says nothing against the node */
    int req_deadline = st == PD_ERR_TIMEOUT && h->prefill_by_deadline;
    if ((st == PD_ERR_PEER || st == PD_ERR_TIMEOUT) && !req_deadline)
        node_failed(s, nd, msg);
    if (h->state == H_ZOMBIE) {
        if (st == PD_OK || st == PD_ERR_INVALID || st == PD_ERR_NOT_FOUND || st == PD_ERR_CANCELLED) {
            handle_retire(s, h);   /* the node answered: no put of ours is running */
        } else {
            /* no word from the node: give a put that might still be running time to end */
            h->state = H_HOLD;
            h->hold_until = pd_cli_now_ms() + (double)s->cfg.transfer_timeout_ms;
        }
        update_stats(s);
        kick(s);
        return;
    }
    PD_ASSERT(h->state == H_PREFILL);
    if (st == PD_OK) {
        pd_err err = {0};
        if (complete_external(s, h, first, aux_mode, &first_lp, &err) == PD_OK) {
            aux_free(s, h->aux_row);
            h->aux_row = -1;
            s->n_prefill--;
            s->n_running++;
            h->state = H_RUNNING;
            emit_new(s, h);
            update_stats(s);
            kick(s);
            return;
        }
        st = PD_ERR_PEER;
        snprintf(msg, sizeof(msg), "%s", err.msg);
    }
    if (st == PD_ERR_PEER && never_delivered(msg) && h->retries < s->n_nodes - 1) {
        prefill_node *alt = pick_node(s);
        pd_err rerr = {0};
        if (alt != NULL && alt != nd && alt->down_until <= pd_cli_now_ms()) {
            h->retries++;
            PD_LOG_INFO("decode", "%s: prefill node %s unreachable, retrying on %s", h->id,
                        nd->addr, alt->addr);
            if (send_prefill(s, h, alt, &rerr) == PD_OK) {
                update_stats(s);
                return;
            }
            snprintf(msg, sizeof(msg), "%s", rerr.msg);
            nd = alt;
        }
    }
    char full[900];
    if (req_deadline) {
        snprintf(full, sizeof(full), "deadline exceeded after %.0f ms (during its prefill on %s)",
                 pd_cli_now_ms() - h->t_submit, nd->addr);
        call_done(s, h, PD_ERR_TIMEOUT, full);
    } else {
        snprintf(full, sizeof(full), "prefill node %s failed: %s", nd->addr, msg);
        PD_LOG_WARN("decode", "%s: %s", h->id, full);
        call_done(s, h, PD_ERR_PEER, full);
    }
    s->n_prefill--;
    if (st == PD_ERR_PEER || st == PD_ERR_TIMEOUT || st == PD_ERR_INTERNAL) {
        h->state = H_HOLD;
        h->hold_until = pd_cli_now_ms() + (st == PD_ERR_TIMEOUT ? (double)s->cfg.transfer_timeout_ms : 0.0);
    } else {
        handle_retire(s, h);
    }
    update_stats(s);
    kick(s);
}

/* ---------------------------------------------------------------------------------------------
 * The engine loop */

/* A request of h's group is being prefilled (admitted, no token yet; here or on a prefill
 * node): h waits, so that its prompt's pages come from the prefix cache once that one's prefill
 * offered them. */
static int sibling_prefilling(const decode_server *s, const decode_handle *h)
{
    if (h->group == 0 || !s->cfg.prefix_cache)
        return 0;
    for (const decode_handle *g = s->head; g != NULL; g = g->next)
        if (g != h && g->group == h->group && g->t_first == 0.0 &&
            (g->state == H_RUNNING || g->state == H_PREFILL))
            return 1;
    return 0;
}

/* Disaggregated: h is prefilled here when what the prefix cache does not hold of its prompt is
 * at most max_local_prefill tokens (with the cache's default, at most a page: an n request's
 * later choices, a prompt repeated), else by a prefill node. */
static int prefill_here(decode_server *s, const decode_handle *h)
{
    if (s->cfg.colocated)
        return 1;
    int max = s->cfg.max_local_prefill >= 0 ? s->cfg.max_local_prefill : s->cfg.prefix_cache ? s->page_size : 0;
    if (max <= 0 || h->gp.prompt_logprobs)
        return 0;
    return h->n_prompt - pd_engine_prefix_cached(s->eng, h->prompt, h->n_prompt) <= max;
}

static void admit(decode_server *s)
{
    double now = pd_cli_now_ms();
    s->admit_blocked = 0;
    for (decode_handle *h = s->head, *next; h != NULL; h = next) {
        next = h->next;
        if (h->state != H_QUEUED)
            continue;
        if (s->stopping) {
            end_request(s, h, PD_ERR_CANCELLED, "server shutting down");
            continue;
        }
        if (s->n_running + s->n_prefill >= s->cfg.max_batch)
            break;
        if (sibling_prefilling(s, h))
            continue;
        pd_err err = {0};
        pd_status st;
        int here = prefill_here(s, h);
        if (here)
            st = pd_engine_add(s->eng, h->eid, h->prompt, h->n_prompt, &h->gp, &h->r, &err);
        else
            st = start_external(s, h, &err);
        if (st == PD_ERR_BUSY) {
            if (s->cfg.queue_timeout_ms > 0 && now - h->t_submit > (double)s->cfg.queue_timeout_ms) {
                char msg[256];
                snprintf(msg, sizeof(msg), "no KV capacity for %lld ms (%d pages free, %d queued)",
                         (long long)s->cfg.queue_timeout_ms, pd_engine_kv_free_pages(s->eng),
                         s->n_queued);
                end_request(s, h, PD_ERR_BUSY, msg);
                continue;
            }
            s->admit_blocked = 1;
            break;   /* FIFO: later requests wait behind this one */
        }
        if (st != PD_OK) {
            end_request(s, h, st, err.msg);
            continue;
        }
        s->n_queued--;
        atomic_fetch_sub(&s->n_waiting, 1);
        h->t_admit = pd_cli_now_ms();
        PD_LOG_DEBUG("decode", "%s: admitted (%d prompt tokens%s)", h->id, h->n_prompt,
                     here && !s->cfg.colocated ? ", its full pages cached: prefilled here" : "");
        if (here) {
            h->state = H_RUNNING;
            s->n_running++;
        } else {
            h->state = H_PREFILL;
            s->n_prefill++;
        }
    }
    update_stats(s);
}

static void collect(decode_server *s)
{
    for (decode_handle *h = s->head, *next; h != NULL; h = next) {
        next = h->next;
        if (h->state != H_RUNNING || h->r == NULL)
            continue;
        emit_new(s, h);
        pd_request *r = h->r;
        if (r->finish == PD_FINISH_NONE)
            continue;
        pd_status st = PD_OK;
        const char *msg = NULL;
        if (r->finish == PD_FINISH_ERROR) {
            st = h->fail_st != PD_OK ? h->fail_st : PD_ERR_INTERNAL;
            msg = r->error;
        } else if (r->finish == PD_FINISH_CANCELLED) {
            st = PD_ERR_CANCELLED;
            msg = "cancelled";
        }
        end_request(s, h, st, msg);
    }
}

static void check_times(decode_server *s)
{
    double now = pd_cli_now_ms();
    for (decode_handle *h = s->head, *next; h != NULL; h = next) {
        next = h->next;
        if (h->state == H_HOLD) {
            if (now >= h->hold_until || s->stopping) {
                handle_retire(s, h);
                update_stats(s);
            }
            continue;
        }
        if (h->done_called)
            continue;
        if (atomic_load(&h->cancel_asked)) {
            end_request(s, h, PD_ERR_CANCELLED, "cancelled by the client");
            continue;
        }
        if (h->deadline > 0 && now >= h->deadline) {
            char msg[128];
            snprintf(msg, sizeof(msg), "deadline exceeded after %.0f ms", now - h->t_submit);
            end_request(s, h, PD_ERR_TIMEOUT, msg);
        }
    }
}

static void step_cb(void *arg)
{
    decode_server *s = arg;
    s->step_armed = 0;
    check_times(s);
    admit(s);
    if (s->n_running > 0) {
        pd_err err = {0};
        PD_LOG_TRACE("decode", "step: %d running", s->n_running);
        if (pd_engine_step(s->eng, &err) != PD_OK) {
            /* an engine-wide failure: every running request ends with it */
            PD_LOG_ERROR("decode", "engine step: %s", err.msg);
            for (decode_handle *h = s->head, *next; h != NULL; h = next) {
                next = h->next;
                if (h->state == H_RUNNING)
                    end_request(s, h, err.code == PD_OK ? PD_ERR_INTERNAL : err.code, err.msg);
            }
        }
        collect(s);
        update_stats(s);
    }
    kick(s);
}

static void kick(decode_server *s)
{
    if (s->step_armed)
        return;
    int queued_ready = s->n_queued > 0 && !s->admit_blocked &&
                       s->n_running + s->n_prefill < s->cfg.max_batch;
    if (s->n_running > 0 || queued_ready) {
        s->step_armed = 1;
        pd_loop_timer_start(s->step_timer, 0, false);
    }
}

static void tick_cb(void *arg)
{
    decode_server *s = arg;
    check_times(s);
    s->admit_blocked = 0;
    if (s->stopping) {
        int busy = 0;
        for (decode_handle *h = s->head; h != NULL; h = h->next)
            busy++;
        for (int i = 0; i < s->n_nodes; i++)
            busy += s->nodes[i]->calls;
        if (busy == 0 || pd_cli_now_ms() > s->stop_deadline)
            pd_loop_stop(s->loop);
    }
    kick(s);
}

static void submit_cb(void *arg)
{
    decode_handle *h = arg;
    decode_server *s = h->s;
    h->prev = s->tail;
    h->next = NULL;
    if (s->tail != NULL)
        s->tail->next = h;
    else
        s->head = h;
    s->tail = h;
    h->state = H_QUEUED;
    s->n_queued++;
    update_stats(s);
    if (s->stopping || atomic_load(&h->cancel_asked)) {
        end_request(s, h, PD_ERR_CANCELLED, s->stopping ? "server shutting down" : "cancelled");
        return;
    }
    admit(s);
    kick(s);
}

static void cancel_cb(void *arg)
{
    decode_handle *h = arg;
    decode_server *s = h->s;
    if (h->state != H_GONE && !h->done_called)
        end_request(s, h, PD_ERR_CANCELLED, "cancelled by the client");
    kick(s);
    handle_unref(h);
}

static void shutdown_cb(void *arg)
{
    decode_server *s = arg;
    s->stopping = 1;
    s->stop_deadline = pd_cli_now_ms() + (double)s->cfg.transfer_timeout_ms + 1000.0;
    for (decode_handle *h = s->head, *next; h != NULL; h = next) {
        next = h->next;
        if (!h->done_called)
            end_request(s, h, PD_ERR_CANCELLED, "server shutting down");
    }
    tick_cb(s);
}

static void *engine_thread(void *arg)
{
    decode_server *s = arg;
    pd_err err;
    pthread_setname_np(pthread_self(), "pd-engine");
    if (pd_loop_run(s->loop, &err) != PD_OK)
        PD_LOG_ERROR("decode", "engine loop: %s", err.msg);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * API */

pd_status decode_submit(decode_server *s, const decode_req *req, decode_token_fn on_token,
                        decode_done_fn on_done, void *ud, decode_handle **out, pd_err *err)
{
    if (!atomic_load(&s->accepting))
        return pd_err_set(err, PD_ERR_CANCELLED, "%s", atomic_load(&s->draining)
                          ? "server is draining: not accepting new requests"
                          : "server is not accepting requests");
    int has_text = req->prompt_text != NULL && req->prompt_text_len > 0;
    int has_ids = req->prompt_ids != NULL && req->n_prompt_ids > 0;
    if (has_text && has_ids)
        return pd_err_set(err, PD_ERR_INVALID, "give either prompt text or prompt token ids, not both");
    if (!has_text && !has_ids)
        return pd_err_set(err, PD_ERR_INVALID, "empty prompt");
    if (!isfinite(req->temperature) || req->temperature < 0.0f)
        return pd_err_set(err, PD_ERR_INVALID, "temperature %g must be finite and >= 0",
                          (double)req->temperature);
    if (!isfinite(req->top_p) || req->top_p < 0.0f || req->top_p > 1.0f)
        return pd_err_set(err, PD_ERR_INVALID, "top_p %g must be in [0, 1] (0 = off)",
                          (double)req->top_p);
    if (!(req->min_p >= 0.0f && req->min_p <= 1.0f))
        return pd_err_set(err, PD_ERR_INVALID, "min_p %g must be in [0, 1] (0 = off)", (double)req->min_p);
    if (req->top_k < 0 || req->top_k > s->vocab)
        return pd_err_set(err, PD_ERR_INVALID, "top_k %d must be in 0..%d", req->top_k, s->vocab);
    pd_status pst = pd_penalties_check(req->presence_penalty, req->frequency_penalty,
                                       req->repetition_penalty, err);
    if (pst != PD_OK)
        return pst;
    if ((pst = pd_logit_bias_check(req->logit_bias, req->n_logit_bias, s->vocab, err)) != PD_OK)
        return pst;
    if ((pst = pd_stop_ids_check(req->stop_token_ids, req->n_stop_token_ids, PD_MAX_STOP_IDS, s->vocab,
                                 err)) != PD_OK)
        return pst;
    if (req->min_tokens < 0 || (req->max_new_tokens > 0 && req->min_tokens > req->max_new_tokens))
        return pd_err_set(err, PD_ERR_INVALID, "min_tokens %d must be in 0..max_new_tokens (%d)",
                          req->min_tokens, req->max_new_tokens);
    if (req->prompt_logprobs && s->cfg.colocated && s->cfg.cp_size > 1)
        return pd_err_set(err, PD_ERR_INVALID, "prompt logprobs (echo with logprobs) are not "
                          "available with context-parallel prefill (--cp-size %d)", s->cfg.cp_size);
    if (req->top_logprobs < 0 || req->top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "top_logprobs %d must be in 0..%d", req->top_logprobs,
                          PD_MAX_TOP_LOGPROBS);
    if (req->max_new_tokens < 0 || req->max_new_tokens > s->max_ctx)
        return pd_err_set(err, PD_ERR_INVALID, "max_new_tokens %d must be in 0..%d (0 = the rest of "
                          "the context)",
                          req->max_new_tokens, s->max_ctx);
    if (req->timeout_ms < 0)
        return pd_err_set(err, PD_ERR_INVALID, "timeout_ms %lld must be >= 0",
                          (long long)req->timeout_ms);
    if (req->request_id != NULL && strlen(req->request_id) > 80)
        return pd_err_set(err, PD_ERR_INVALID, "request_id longer than 80 bytes");
    if (req->verify_policy < PD_VERIFY_DEFAULT || req->verify_policy > PD_VERIFY_SCHEDULED)
        return pd_err_set(err, PD_ERR_INVALID, "verify policy %d unknown", req->verify_policy);
    if (!isfinite(req->verify_threshold) || req->verify_threshold < 0.0f || req->verify_threshold > 1.0f)
        return pd_err_set(err, PD_ERR_INVALID, "verify_threshold %g must be in (0, 1] (0 = the node's)",
                          (double)req->verify_threshold);
    int n_guides = (req->json_object != 0) + (req->json_schema != NULL) + (req->n_choices > 0) +
                   (req->regex != NULL) + (req->ebnf != NULL) + (req->grammar != NULL);
    if (n_guides > 1)
        return pd_err_set(err, PD_ERR_INVALID, "structured output: give at most one of a JSON object, "
                          "a JSON schema, choices, a regex and a grammar");
    if (n_guides > 0 && req->min_tokens > 0)
        return pd_err_set(err, PD_ERR_INVALID, "min_tokens cannot be combined with structured output "
                          "(the grammar decides where the output may end)");
    int32_t *ids = NULL;
    int n = 0;
    if (has_text) {
        size_t nn = 0;
        if (req->prompt_text_len > (size_t)s->max_ctx * 64)
            return pd_err_set(err, PD_ERR_INVALID, "prompt text of %zu bytes is too long for a context of %d tokens",
                              req->prompt_text_len, s->max_ctx);
        pd_status st = pd_tokenizer_encode(s->tok, req->prompt_text, req->prompt_text_len, 1, &ids, &nn, err);
        if (st != PD_OK)
            return st == PD_ERR_NOMEM ? st : pd_err_set(err, PD_ERR_INVALID, "prompt text: %s", err->msg);
        n = (int)nn;
        if (n == 0) {
            free(ids);
            return pd_err_set(err, PD_ERR_INVALID, "prompt text encodes to no tokens");
        }
    } else {
        n = req->n_prompt_ids;
        if (n >= s->max_ctx)
            return pd_err_set(err, PD_ERR_INVALID,
                              "prompt of %d tokens leaves no room in the context of %d tokens", n,
                              s->max_ctx);
        for (int i = 0; i < n; i++)
            if (req->prompt_ids[i] < 0 || req->prompt_ids[i] >= s->vocab)
                return pd_err_set(err, PD_ERR_INVALID,
                                  "prompt token %d (index %d) is outside the vocabulary (0..%d)",
                                  req->prompt_ids[i], i, s->vocab - 1);
        ids = malloc((size_t)n * sizeof(int32_t));
        if (ids == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "prompt copy: %d tokens", n);
        memcpy(ids, req->prompt_ids, (size_t)n * sizeof(int32_t));
    }
    pd_status st;
    if (n >= s->max_ctx) {
        st = pd_err_set(err, PD_ERR_INVALID, "prompt of %d tokens leaves no room in the context of %d tokens",
                        n, s->max_ctx);
        goto err_ids;
    }
    /* the engine admits a request with its worst case reserved (prompt, every new token, one
     * draft block): one that can never fit is refused now instead of waiting in the queue */
    long max_new = req->max_new_tokens > 0 ? req->max_new_tokens : max_new_default(s, n);
    if (req->min_tokens > max_new) {
        st = pd_err_set(err, PD_ERR_INVALID, "min_tokens %d exceeds the %ld tokens the context leaves "
                        "after a prompt of %d tokens", req->min_tokens, max_new, n);
        goto err_ids;
    }
    long worst = (long)n + max_new + s->block_size + 1;
    if (worst > s->max_ctx)
        worst = s->max_ctx;
    long need = (worst + s->page_size - 1) / s->page_size;
    if (need > s->total_pages) {
        st = pd_err_set(err, PD_ERR_INVALID, "prompt of %d tokens with max_new_tokens %ld needs %ld "
                        "KV pages, the pool has %d", n, max_new, need, s->total_pages);
        goto err_ids;
    }
    if (!s->cfg.colocated && n > s->aux_rows) {
        st = pd_err_set(err, PD_ERR_INVALID, "prompt of %d tokens exceeds the aux arena (%d rows)",
                        n, s->aux_rows);
        goto err_ids;
    }
    pd_grammar *grammar = NULL;
    st = PD_OK;
    if (req->grammar != NULL)
        grammar = pd_grammar_ref(req->grammar);
    else if (n_guides > 0 && (st = decode_compile_guide(s, req, &grammar, err)) != PD_OK)
        goto err_ids;
    if (atomic_fetch_add(&s->n_waiting, 1) >= s->cfg.max_queue) {
        atomic_fetch_sub(&s->n_waiting, 1);
        pd_grammar_unref(grammar);
        st = pd_err_set(err, PD_ERR_BUSY, "%d requests already waiting for KV pages", s->cfg.max_queue);
        goto err_ids;
    }
    decode_handle *h = calloc(1, sizeof(*h));
    if (h == NULL) {
        atomic_fetch_sub(&s->n_waiting, 1);
        pd_grammar_unref(grammar);
        st = pd_err_set(err, PD_ERR_NOMEM, "request handle");
        goto err_ids;
    }
    h->grammar = grammar;
    h->gp.grammar = grammar;
    h->gp.gvocab = grammar != NULL ? s->gvocab : NULL;
    atomic_init(&h->refs, 2);
    atomic_init(&h->cancel_asked, 0);
    h->s = s;
    h->eid = atomic_fetch_add(&s->next_id, 1);
    h->group = req->group;
    if (req->request_id != NULL && req->request_id[0] != '\0')
        snprintf(h->id, sizeof(h->id), "%s", req->request_id);
    else
        snprintf(h->id, sizeof(h->id), "req-%llu", (unsigned long long)h->eid);
    h->prompt = ids;
    h->n_prompt = n;
    h->gp.sample.temperature = req->temperature;
    h->gp.sample.top_p = req->top_p > 0.0f ? req->top_p : 1.0f;
    h->gp.sample.min_p = req->min_p;
    h->gp.sample.top_k = req->top_k;
    h->gp.sample.seed = req->seed;
    h->gp.max_new_tokens = (int)max_new;
    h->gp.ignore_eos = req->ignore_eos;
    h->gp.verify_policy = (pd_verify_policy)req->verify_policy;
    h->gp.verify_threshold = req->verify_threshold;
    h->gp.presence_penalty = req->presence_penalty;
    h->gp.frequency_penalty = req->frequency_penalty;
    h->gp.repetition_penalty = req->repetition_penalty;
    h->gp.min_tokens = req->min_tokens;
    for (int i = 0; i < req->n_stop_token_ids; i++)
        h->gp.stop_ids[i] = req->stop_token_ids[i];
    h->gp.n_stop_ids = req->n_stop_token_ids;
    if (req->n_logit_bias > 0) {
        if ((h->bias = malloc((size_t)req->n_logit_bias * sizeof(*h->bias))) == NULL) {
            atomic_fetch_sub(&s->n_waiting, 1);
            pd_grammar_unref(h->grammar);
            free(h);
            st = pd_err_set(err, PD_ERR_NOMEM, "logit_bias");
            goto err_ids;
        }
        memcpy(h->bias, req->logit_bias, (size_t)req->n_logit_bias * sizeof(*h->bias));
        h->gp.logit_bias = h->bias;
        h->gp.n_logit_bias = req->n_logit_bias;
    }
    h->gp.logprobs = req->logprobs != 0;
    h->gp.prompt_logprobs = req->prompt_logprobs != 0;
    h->gp.top_logprobs = req->logprobs ? req->top_logprobs : 0;
    h->on_token = on_token;
    h->on_done = on_done;
    h->ud = ud;
    h->aux_row = -1;
    h->t_submit = pd_cli_now_ms();
    int64_t tmo = req->timeout_ms > 0 ? req->timeout_ms : s->cfg.request_timeout_ms;
    h->deadline = tmo > 0 ? h->t_submit + (double)tmo : 0.0;
    h->fail_st = PD_ERR_INTERNAL;
    if (pd_detok_create(s->tok, &h->detok, err) != PD_OK) {
        atomic_fetch_sub(&s->n_waiting, 1);
        st = err->code;
        free(h->bias);
        pd_grammar_unref(h->grammar);
        free(h);
        goto err_ids;
    }
    pd_detok_set_skip_special(h->detok, req->skip_special);
    h->state = H_QUEUED;
    if (pd_loop_post(s->loop, submit_cb, h) != PD_OK) {
        atomic_fetch_sub(&s->n_waiting, 1);
        pd_detok_destroy(h->detok);
        free(h->bias);
        free(h);
        st = pd_err_set(err, PD_ERR_CANCELLED, "server is shutting down");
        goto err_ids;
    }
    *out = h;
    return PD_OK;
err_ids:
    free(ids);
    return st;
}

void decode_cancel(decode_handle *h)
{
    if (h == NULL)
        return;
    if (atomic_exchange(&h->cancel_asked, 1))
        return;
    atomic_fetch_add(&h->refs, 1);
    if (pd_loop_post(h->s->loop, cancel_cb, h) != PD_OK)
        handle_unref(h);
}

/* ---------------------------------------------------------------------------------------------
 * Create / destroy */

/* Every address of spec: "HOST:PORT[,HOST:PORT...]" or "file:PATH" (the same entries, separated
 * by commas or whitespace, '#' to the end of a line a comment; read again at every resolution),
 * each name as every address it resolves to, as "IP:PORT" / "[IP6]:PORT", without duplicates.
 * *out (malloc'd strings) may be empty. Errors: PD_ERR_INVALID (an entry that is not HOST:PORT:
 * the command line is wrong), PD_ERR_PEER (a name that does not resolve, a file not readable:
 * may change), PD_ERR_NOMEM. */
static pd_status resolve_spec(const char *spec, char ***out, int *n_out, pd_err *err)
{
    char *copy = NULL;
    if (strncmp(spec, "file:", 5) == 0) {
        pd_err rerr;
        pd_status rs = pd_cli_read_text(spec + 5, &copy, &rerr);
        if (rs != PD_OK)   /* a file not there yet may come: like a name that does not resolve */
            return pd_err_set(err, rs == PD_ERR_IO ? PD_ERR_PEER : rs, "--prefill: %s", rerr.msg);
        /* '#' comments to the end of their line */
        for (char *c = strchr(copy, '#'); c != NULL; c = strchr(c, '#'))
            while (*c != '\0' && *c != '\n')
                *c++ = ' ';
    } else if ((copy = strdup(spec)) == NULL) {
        return pd_err_set(err, PD_ERR_NOMEM, "prefill list");
    }
    char **addrs = NULL;
    int n = 0;
    pd_status st = PD_OK;
    char *save = NULL;
    for (char *tok = strtok_r(copy, ", \t\r\n", &save); tok != NULL && st == PD_OK;
         tok = strtok_r(NULL, ", \t\r\n", &save)) {
        char host[128], port[16];
        if (pd_cli_split_hostport(tok, host, sizeof(host), port, sizeof(port)) != 0) {
            st = pd_err_set(err, PD_ERR_INVALID, "--prefill: '%s' is not HOST:PORT", tok);
            break;
        }
        struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM }, *res = NULL;
        int rc = getaddrinfo(host, port, &hints, &res);
        if (rc != 0) {
            st = pd_err_set(err, PD_ERR_PEER, "--prefill: cannot resolve %s: %s", host, gai_strerror(rc));
            break;
        }
        for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
            char ip[INET6_ADDRSTRLEN + 8], name[160];
            if (getnameinfo(ai->ai_addr, ai->ai_addrlen, ip, sizeof(ip), NULL, 0, NI_NUMERICHOST) != 0)
                continue;
            if (ai->ai_family == AF_INET6)
                snprintf(name, sizeof(name), "[%s]:%s", ip, port);
            else
                snprintf(name, sizeof(name), "%s:%s", ip, port);
            int dup = 0;
            for (int i = 0; i < n; i++)
                dup |= strcmp(addrs[i], name) == 0;
            if (dup)
                continue;
            char **a = realloc(addrs, (size_t)(n + 1) * sizeof(*a));
            if (a == NULL || (a[n] = strdup(name)) == NULL) {
                if (a != NULL)
                    addrs = a;
                st = pd_err_set(err, PD_ERR_NOMEM, "prefill nodes");
                break;
            }
            addrs = a;
            n++;
        }
        freeaddrinfo(res);
    }
    free(copy);
    if (st != PD_OK) {
        for (int i = 0; i < n; i++)
            free(addrs[i]);
        free(addrs);
        return st;
    }
    *out = addrs;
    *n_out = n;
    return PD_OK;
}

/* The nodes are now exactly addrs (taken, freed here): new addresses become nodes, nodes whose
 * address is no longer there are marked gone (not picked; their calls in flight finish), a gone
 * address that is back is used again. Engine thread (or before it starts). */
static pd_status apply_addrs(decode_server *s, char **addrs, int n, pd_err *err)
{
    pd_status st = PD_OK;
    for (int i = 0; i < s->n_nodes; i++) {
        prefill_node *nd = s->nodes[i];
        int there = 0;
        for (int k = 0; k < n && !there; k++)
            there = strcmp(addrs[k], nd->addr) == 0;
        if (there == !nd->gone)
            continue;
        nd->gone = !there;
        PD_LOG_INFO("decode", "prefill node %s %s '%s'", nd->addr, there ? "is back in" : "is gone from",
                    s->prefill);
    }
    for (int k = 0; k < n && st == PD_OK; k++) {
        int known = 0;
        for (int i = 0; i < s->n_nodes && !known; i++)
            known = strcmp(s->nodes[i]->addr, addrs[k]) == 0;
        if (known)
            continue;
        prefill_node **nn = realloc(s->nodes, (size_t)(s->n_nodes + 1) * sizeof(*nn));
        prefill_node *nd = calloc(1, sizeof(*nd));
        if (nn != NULL)
            s->nodes = nn;
        if (nn == NULL || nd == NULL) {
            free(nd);
            st = pd_err_set(err, PD_ERR_NOMEM, "prefill nodes");
            break;
        }
        nd->s = s;
        snprintf(nd->addr, sizeof(nd->addr), "%s", addrs[k]);
        if ((st = pd_rpc_channel_create(nd->addr, &nd->ch, err)) != PD_OK) {
            free(nd);
            break;
        }
        s->nodes[s->n_nodes++] = nd;
        PD_LOG_INFO("decode", "prefill node %s (from '%s')", nd->addr, s->prefill);
    }
    for (int k = 0; k < n; k++)
        free(addrs[k]);
    free(addrs);
    return st;
}

typedef struct {
    decode_server *s;
    char **addrs;
    int n;
} addrs_msg;

static void on_addrs(void *arg)
{
    addrs_msg *m = arg;
    pd_err err = {0};
    if (apply_addrs(m->s, m->addrs, m->n, &err) != PD_OK)
        PD_LOG_WARN("decode", "prefill nodes: %s", err.msg);
    update_stats(m->s);
    kick(m->s);
    free(m);
}

/* Resolves --prefill every prefill_refresh_ms and hands the addresses to the engine thread. A
 * failed resolution keeps the nodes as they are (a DNS hiccup is not a scale-down). */
static void *resolver_thread(void *arg)
{
    decode_server *s = arg;
    pthread_setname_np(pthread_self(), "pd-resolve");
    char last_err[sizeof(((pd_err *)0)->msg)] = "";
    pthread_mutex_lock(&s->res_mu);
    while (!s->res_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long long ns = ts.tv_nsec + (long long)s->cfg.prefill_refresh_ms * 1000000LL;
        ts.tv_sec += (time_t)(ns / 1000000000LL);
        ts.tv_nsec = (long)(ns % 1000000000LL);
        pthread_cond_timedwait(&s->res_cv, &s->res_mu, &ts);
        if (s->res_stop)
            break;
        pthread_mutex_unlock(&s->res_mu);
        char **addrs = NULL;
        int n = 0;
        pd_err err = {0};
        if (resolve_spec(s->prefill, &addrs, &n, &err) != PD_OK) {
            if (strcmp(err.msg, last_err) != 0)
                PD_LOG_WARN("decode", "%s (the prefill nodes stay as they are)", err.msg);
            snprintf(last_err, sizeof(last_err), "%s", err.msg);
        } else {
            last_err[0] = '\0';
            addrs_msg *m = malloc(sizeof(*m));
            if (m != NULL) {
                *m = (addrs_msg){ .s = s, .addrs = addrs, .n = n };
                if (pd_loop_post(s->loop, on_addrs, m) == PD_OK)
                    addrs = NULL;
                else
                    free(m);
            }
            for (int i = 0; addrs != NULL && i < n; i++)
                free(addrs[i]);
            free(addrs);
        }
        pthread_mutex_lock(&s->res_mu);
    }
    pthread_mutex_unlock(&s->res_mu);
    return NULL;
}

/* The first resolution, before the engine thread starts: a list that is not HOST:PORT fails;
 * names that do not resolve (yet) fail too unless they are resolved again later. */
static pd_status resolve_nodes(decode_server *s, pd_err *err)
{
    char **addrs = NULL;
    int n = 0;
    pd_status st = resolve_spec(s->prefill, &addrs, &n, err);
    if (st == PD_ERR_PEER && s->cfg.prefill_refresh_ms > 0) {
        PD_LOG_WARN("decode", "%s; resolving again every %lld ms", err->msg,
                    (long long)s->cfg.prefill_refresh_ms);
        return PD_OK;
    }
    if (st != PD_OK)
        return st;
    if (n == 0 && s->cfg.prefill_refresh_ms <= 0) {
        free(addrs);
        return pd_err_set(err, PD_ERR_INVALID, "--prefill: no prefill node addresses in '%s'", s->prefill);
    }
    if (n == 0)
        PD_LOG_WARN("decode", "--prefill: no prefill node in '%s' yet; resolving again every %lld ms",
                    s->prefill, (long long)s->cfg.prefill_refresh_ms);
    return apply_addrs(s, addrs, n, err);
}

static pd_status setup_xfer(decode_server *s, pd_err *err)
{
    pd_xfer_config xc;
    pd_xfer_config_default(&xc);
    xc.name = "decode";
    xc.timeout_ms = (uint32_t)s->cfg.transfer_timeout_ms;
    pd_status st = pd_xfer_create(&xc, &s->x, err);
    if (st != PD_OK)
        return st;
    const kern_buf *kb = pd_kv_pool_buf(pd_engine_target_pool(s->eng));
    /* device KV that UCX cannot reach: prefill nodes put into a host mirror of the pool and the
     * prompt's pages are uploaded when the Prefill reply arrives (PD_XFER_FORCE_STAGING=1 takes
     * this path with host memory too, for tests) */
    const char *force = getenv("PD_XFER_FORCE_STAGING");
    if ((!s->be->is_host && !pd_xfer_supports_cuda(s->x)) || (force != NULL && strcmp(force, "1") == 0)) {
        s->kv_stage = calloc(1, kb->bytes);
        if (s->kv_stage == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "kv staging mirror: %zu bytes", kb->bytes);
        PD_LOG_INFO("decode", "kv pages arrive in a host mirror (%zu bytes) and are uploaded",
                    kb->bytes);
    }
    st = pd_xfer_mem_register(s->x, s->kv_stage != NULL ? s->kv_stage : kb->ptr, kb->bytes,
                              &s->kv_mem, err);
    if (st != PD_OK)
        return st;
    st = pd_xfer_mem_pack(s->kv_mem, &s->kv_rkey, &s->kv_rkey_len, err);
    if (st != PD_OK)
        return st;
    /* draft pool: offered to prefill nodes that ship draft-kv (staged like the target pool) */
    pd_kv_pool *dpool = pd_engine_draft_pool(s->eng);
    if (dpool != NULL) {
        const kern_buf *db = pd_kv_pool_buf(dpool);
        if (s->kv_stage != NULL && (s->dkv_stage = calloc(1, db->bytes)) == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "draft kv staging mirror: %zu bytes", db->bytes);
        st = pd_xfer_mem_register(s->x, s->dkv_stage != NULL ? s->dkv_stage : db->ptr, db->bytes,
                                  &s->dkv_mem, err);
        if (st != PD_OK)
            return st;
        st = pd_xfer_mem_pack(s->dkv_mem, &s->dkv_rkey, &s->dkv_rkey_len, err);
        if (st != PD_OK)
            return st;
    }
    /* aux arena: enough rows for every prompt the pool can hold, capped at 256 MiB; rows are
     * sized for raw (K*hidden floats), the largest payload, since the prefill node picks the
     * mode; ctx rows (hidden floats) are packed into the same reservation */
    size_t row_bytes = (size_t)(s->aux_dim > 0 ? s->aux_dim : 1) * sizeof(float);
    size_t rows = (size_t)s->total_pages * (size_t)s->page_size;
    if (rows * row_bytes > ((size_t)256 << 20))
        rows = ((size_t)256 << 20) / row_bytes;
    s->aux_rows = (int)rows;
    s->aux_arena = calloc(rows, row_bytes);
    if (s->aux_arena == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "aux arena: %zu rows of %zu bytes", rows, row_bytes);
    st = pd_xfer_mem_register(s->x, s->aux_arena, rows * row_bytes, &s->aux_mem, err);
    if (st != PD_OK)
        return st;
    st = pd_xfer_mem_pack(s->aux_mem, &s->aux_rkey, &s->aux_rkey_len, err);
    if (st != PD_OK)
        return st;
    pd_xfer_address(s->x, &s->waddr, &s->waddr_len);
    /* the puts target this node: over tcp they move only while its worker progresses, which
     * the engine thread could do only between decode rounds */
    return pd_xfer_thread_start(s->x, &s->xt, err);
}

static char *dup_or_null(const char *p)
{
    return p != NULL ? strdup(p) : NULL;
}

const pd_chat_template *decode_server_chat_template(const decode_server *s, const char **why)
{
    if (why != NULL)
        *why = s->chat_ok ? NULL : s->chat_why;
    return s->chat_ok ? &s->chat : NULL;
}

int decode_server_reasoning(const decode_server *s)
{
    return s->cfg.reasoning;
}

pd_status decode_server_create(const decode_config *cfg, decode_server **out, pd_err *err)
{
    if (cfg->model_dir == NULL || cfg->draft_dir == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "decode server: --model and --draft are required");
    if (!cfg->colocated && (cfg->prefill == NULL || cfg->prefill[0] == '\0'))
        return pd_err_set(err, PD_ERR_INVALID, "decode server: --prefill HOST:PORT or --colocated is required");
    decode_server *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "decode server");
    pd_status st = PD_OK;
    s->cfg = *cfg;
    s->model_dir = strdup(cfg->model_dir);
    s->draft_dir = strdup(cfg->draft_dir);
    s->device = strdup(cfg->device != NULL ? cfg->device : "cpu");
    s->prefill = dup_or_null(cfg->prefill);
    s->cfg.model_dir = s->model_dir;
    s->cfg.draft_dir = s->draft_dir;
    s->cfg.device = s->device;
    s->cfg.prefill = s->prefill;
    s->cfg.cp_strategy = NULL;
    s->cfg.chat_template = NULL;
    if (s->cfg.max_batch <= 0)
        s->cfg.max_batch = 64;
    if (s->cfg.max_queue <= 0)
        s->cfg.max_queue = 256;
    if (s->cfg.queue_timeout_ms <= 0)
        s->cfg.queue_timeout_ms = 30000;
    if (s->cfg.transfer_timeout_ms <= 0)
        s->cfg.transfer_timeout_ms = 30000;
    pthread_mutex_init(&s->stats_mu, NULL);
    pthread_mutex_init(&s->res_mu, NULL);
    pthread_cond_init(&s->res_cv, NULL);
    atomic_init(&s->accepting, 0);
    atomic_init(&s->n_waiting, 0);
    atomic_init(&s->next_id, 1);
    if (s->model_dir == NULL || s->draft_dir == NULL || s->device == NULL ||
        (cfg->prefill != NULL && s->prefill == NULL)) {
        st = pd_err_set(err, PD_ERR_NOMEM, "decode config");
        goto err_destroy;
    }
    if ((st = pd_chat_template_load(s->model_dir, cfg->chat_template, &s->chat, &s->chat_ok, s->chat_why,
                                    sizeof(s->chat_why), err)) != PD_OK)
        goto err_destroy;
    if (!s->chat_ok)
        PD_LOG_WARN("decode", "%s", s->chat_why);
    kern_backend_config bc = { .name = s->device, .f32 = cfg->f32 };
    if ((st = kern_backend_create(&bc, &s->be, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_qwen3_load(s->be, s->model_dir, &s->tm, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_dspark_load(s->be, s->draft_dir, s->tm, &s->dm, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_tokenizer_load(s->model_dir, &s->tok, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_gcache_create(64, &s->grammars, err)) != PD_OK)
        goto err_destroy;
    pd_engine_config ec = { .target = s->tm, .draft = s->dm, .page_size = cfg->page_size,
                            .n_pages = cfg->kv_pages, .kv_mem_fraction = cfg->kv_mem_fraction,
                            .fast_kernels = cfg->fast_kernels, .graphs = cfg->graphs,
                            .max_prefill_tokens = cfg->max_prefill_tokens,
                            .verify_threshold = cfg->verify_threshold,
                            .prefix_cache = cfg->prefix_cache,
                            .swap_bytes = cfg->swap_bytes > 0 ? (size_t)cfg->swap_bytes : 0 };
    if (cfg->verify != NULL && (st = pd_verify_policy_parse(cfg->verify, &ec.verify_policy, err)) != PD_OK)
        goto err_destroy;
    pd_err cerr;
    pd_status cs = pd_calib_load(s->draft_dir, &s->calib, &cerr);
    if (cs == PD_OK)
        ec.calib = &s->calib;
    else if (cs != PD_ERR_NOT_FOUND)
        PD_LOG_WARN("decode", "ignoring the confidence calibration: %s", cerr.msg);
    if (cfg->colocated && cfg->cp_size > 1) {
        if ((st = pd_cp_targets_load(&s->cp_targets, s->be, s->model_dir, cfg->cp_size, err)) != PD_OK)
            goto err_destroy;
        ec.cp_size = cfg->cp_size;
        ec.cp_targets = (const pd_qwen3_model *const *)s->cp_targets.tm;
        if (cfg->cp_strategy != NULL &&
            (st = pd_cp_strategy_parse(cfg->cp_strategy, &ec.cp_strategy, err)) != PD_OK)
            goto err_destroy;
    }
    if (cfg->colocated)
        ec.tp_size = cfg->tp_size;
    if ((st = pd_engine_create(&ec, &s->eng, err)) != PD_OK)
        goto err_destroy;
    if (ec.verify_policy == PD_VERIFY_SCHEDULED) {
        if ((st = pd_engine_profile_sps_cached(s->eng, s->model_dir, s->device, s->cfg.max_batch, &s->sps, err)) != PD_OK)
            goto err_destroy;
        pd_engine_set_sps(s->eng, &s->sps);
    }
    const pd_kv_layout *lay = pd_kv_pool_layout(pd_engine_target_pool(s->eng));
    s->vocab = s->tm->cfg.vocab_size;
    s->max_ctx = s->tm->cfg.max_position_embeddings;
    if ((st = pd_gvocab_create(s->tok, s->vocab, s->tm->cfg.eos_ids, s->tm->cfg.n_eos, &s->gvocab, err)) != PD_OK)
        goto err_destroy;
    s->page_size = lay->page_size;
    s->total_pages = lay->n_pages;
    s->block_size = pd_engine_block_size(s->eng);
    s->aux_dim = pd_engine_aux_dim(s->eng);
    if ((st = pd_loop_create(&s->loop, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_loop_timer_create(s->loop, step_cb, s, &s->step_timer, err)) != PD_OK ||
        (st = pd_loop_timer_create(s->loop, tick_cb, s, &s->tick_timer, err)) != PD_OK)
        goto err_destroy;
    if (!cfg->colocated) {
        if ((st = setup_xfer(s, err)) != PD_OK)
            goto err_destroy;
        if ((st = resolve_nodes(s, err)) != PD_OK)
            goto err_destroy;
    }
    pd_loop_timer_start(s->tick_timer, TICK_MS, true);
    update_stats(s);
    atomic_store(&s->accepting, 1);
    update_stats(s);
    if (pthread_create(&s->thread, NULL, engine_thread, s) != 0) {
        atomic_store(&s->accepting, 0);
        st = pd_err_set(err, PD_ERR_INTERNAL, "engine thread: cannot start");
        goto err_destroy;
    }
    s->thread_started = 1;
    if (!cfg->colocated && s->cfg.prefill_refresh_ms > 0) {
        if (pthread_create(&s->resolver, NULL, resolver_thread, s) != 0) {
            st = pd_err_set(err, PD_ERR_INTERNAL, "prefill resolver thread: cannot start");
            goto err_destroy;
        }
        s->resolver_started = 1;
    }
    PD_LOG_INFO("decode", "engine up: %s, %s, %d kv pages of %d tokens, block %d", s->device,
                decode_server_mode(s), s->total_pages, s->page_size, s->block_size);
    *out = s;
    return PD_OK;
err_destroy:
    decode_server_destroy(s);
    return st;
}

void decode_server_destroy(decode_server *s)
{
    if (s == NULL)
        return;
    atomic_store(&s->accepting, 0);
    if (s->resolver_started) {
        pthread_mutex_lock(&s->res_mu);
        s->res_stop = 1;
        pthread_cond_signal(&s->res_cv);
        pthread_mutex_unlock(&s->res_mu);
        pthread_join(s->resolver, NULL);
    }
    if (s->thread_started) {
        if (pd_loop_post(s->loop, shutdown_cb, s) != PD_OK)
            pd_loop_stop(s->loop);
        pthread_join(s->thread, NULL);
    }
    /* whatever is left (a Prefill that outlived the bound) is dropped here; channel destroy
     * below cancels those calls, their replies cannot be posted any more */
    for (int i = 0; i < s->n_nodes; i++) {
        pd_rpc_channel_destroy(s->nodes[i]->ch);
        free(s->nodes[i]);
    }
    s->n_nodes = 0;   /* (the resolver has been joined: nothing adds nodes any more) */
    while (s->head != NULL) {
        decode_handle *h = s->head;
        pd_rpc_pending_release(h->pending);
        h->pending = NULL;
        if (!h->done_called)
            call_done(s, h, PD_ERR_CANCELLED, "server shutting down");
        handle_retire(s, h);
    }
    pd_loop_timer_destroy(s->step_timer);
    pd_loop_timer_destroy(s->tick_timer);
    pd_loop_destroy(s->loop);
    pd_xfer_thread_stop(s->xt);
    free(s->kv_rkey);
    free(s->aux_rkey);
    free(s->dkv_rkey);
    pd_xfer_mem_deregister(s->kv_mem);
    pd_xfer_mem_deregister(s->aux_mem);
    pd_xfer_mem_deregister(s->dkv_mem);
    pd_xfer_destroy(s->x);
    free(s->aux_arena);
    free(s->kv_stage);
    free(s->dkv_stage);
    free(s->segs);
    free(s->nodes);
    pd_engine_destroy(s->eng);
    pd_sps_cleanup(&s->sps);
    pd_tokenizer_free(s->tok);
    pd_gvocab_destroy(s->gvocab);
    pd_gcache_destroy(s->grammars);
    pd_dspark_free(s->dm);
    pd_cp_targets_free(&s->cp_targets);
    pd_qwen3_free(s->tm);
    kern_backend_destroy(s->be);
    pthread_mutex_destroy(&s->stats_mu);
    pthread_mutex_destroy(&s->res_mu);
    pthread_cond_destroy(&s->res_cv);
    free(s->model_dir);
    free(s->draft_dir);
    free(s->device);
    free(s->prefill);
    free(s);
}
