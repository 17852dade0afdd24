/* decode_server.c - the decode node's engine thread and request lifecycle (decode_api.h).
 * Owns: the pd_engine and its KV pools, the engine thread's pd_loop (steps, a 20 ms tick for
 *   deadlines and UCX progress), the request table (queued -> prefilling -> running -> ended),
 *   admission bounded by free KV pages (FIFO queue, then RESOURCE_EXHAUSTED), streaming
 *   detokenization, the chat template both front ends render by, the structured-output grammar
 *   cache (with the forced tool calls of both front ends' chat requests), the aux arena's rows,
 *   and the CancelPrefill of a request that ends while its Prefill is in flight.
 * Not here: the prefill-node side of disaggregated mode (decode_prefill.c: the UCX worker, the
 *   Prefill calls and their replies, --prefill resolution), the wire format of Generate
 *   (decode_grpc.c), the engine math (common/pd_engine.c).
 * Threading: everything below the API functions runs on the engine thread; the API functions
 *   hand work over with pd_loop_post. Prefill replies arrive on a pd_rpc poller thread and are
 *   posted too. The stats snapshot is the one piece shared under a mutex. The pd_xfer (a passive
 *   target of the prefill nodes' puts) is set up here and then progressed on its own thread
 *   (pd_xfer_thread) until destroy. */
#define _GNU_SOURCE   /* pthread_setname_np */
#include "decode_api.h"
#include "decode_prefill.h"
#include "decode_server_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "pd_cli.h"
#include "pd_json.h"
#include "pd_log.h"
#include "pd_loop.h"
#include "pd_proto_version.h"
#include "pd_rpc.h"
#include "pd_grammar.h"
#include "pd_tokenizer.h"
#include "pd_xfer.h"
#include "pd_xfer_thread.h"
#include "pdspark.pb-c.h"


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

/* h and the request options it owns (bias, allowed tokens, bad words, grammar reference) */
static void handle_free(decode_handle *h)
{
    free(h->bias);
    free(h->allow);
    free(h->bad);
    pd_grammar_unref(h->grammar);
    free(h);
}

static void handle_unref(decode_handle *h)
{
    if (h == NULL)
        return;
    if (atomic_fetch_sub(&h->refs, 1) == 1) {
        free(h->prompt);
        handle_free(h);
    }
}

/* decode_submit's way out for a handle that never reached the engine: what it holds (not its
 * prompt, which the caller frees), and its place among the waiting requests */
static void handle_discard(decode_server *s, decode_handle *h)
{
    atomic_fetch_sub(&s->n_waiting, 1);
    pd_detok_destroy(h->detok);
    handle_free(h);
}

/* req's bad words as pd_gen_params.bad's sequences, as vLLM's NoBadWordsLogitsProcessor makes
 * them: each word without its leading spaces, and with one space before it when that gives as
 * many tokens with another first token (the word inside a text); a special token's text (e.g.
 * "<|im_end|>") is that token */
static pd_status bad_words_ids(decode_server *s, const decode_req *req, int32_t **out, int *n_out, pd_err *err)
{
    *out = NULL;
    *n_out = 0;
    if (req->n_bad_words < 0 || req->n_bad_words > DECODE_MAX_BAD_WORDS)
        return pd_err_set(err, PD_ERR_INVALID, "bad_words: %d words (at most %d)", req->n_bad_words,
                          DECODE_MAX_BAD_WORDS);
    int32_t *v = NULL;
    int n = 0;
    pd_status st = PD_OK;
    for (int w = 0; w < req->n_bad_words && st == PD_OK; w++) {
        const char *word = req->bad_words[w];
        size_t len = word != NULL ? strlen(word) : 0;
        while (len > 0 && (*word == ' ' || *word == '\t' || *word == '\n')) {
            word++;
            len--;
        }
        if (len == 0 || len > 256) {
            st = pd_err_set(err, PD_ERR_INVALID, "bad_words[%d] must be 1..256 bytes besides leading spaces", w);
            break;
        }
        char *spaced = malloc(len + 2);
        int32_t *ids[2] = { NULL, NULL };
        size_t nid[2] = { 0, 0 };
        if (spaced == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "bad words");
            break;
        }
        spaced[0] = ' ';
        memcpy(spaced + 1, word, len + 1);
        /* special tokens' text is the special token, as a Hugging Face tokenizer's encode reads it */
        st = pd_tokenizer_encode(s->tok, word, len, 1, &ids[0], &nid[0], err);
        if (st == PD_OK)
            st = pd_tokenizer_encode(s->tok, spaced, len + 1, 1, &ids[1], &nid[1], err);
        for (int k = 0; k < 2 && st == PD_OK; k++) {
            if (nid[k] == 0 || (k == 1 && (nid[1] != nid[0] || ids[1][0] == ids[0][0])))
                continue;
            int32_t *nv = realloc(v, (size_t)(n + 1 + (int)nid[k]) * sizeof(int32_t));
            if (nv == NULL) {
                st = pd_err_set(err, PD_ERR_NOMEM, "bad words");
                break;
            }
            v = nv;
            v[n++] = (int32_t)nid[k];
            memcpy(v + n, ids[k], nid[k] * sizeof(int32_t));
            n += (int)nid[k];
        }
        free(ids[0]);
        free(ids[1]);
        free(spaced);
    }
    if (st != PD_OK) {
        free(v);
        return st;
    }
    *out = v;
    *n_out = n;
    return PD_OK;
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

void decode_server_update_stats(decode_server *s)
{
    decode_stats st = {0};
    st.serving = atomic_load(&s->accepting);
    st.active_requests = s->n_running + s->n_prefill;
    st.queued_requests = s->n_queued;
    st.total_kv_pages = s->total_pages;
    st.free_kv_pages = pd_engine_kv_free_pages(s->eng);
    st.pages_in_use = st.total_kv_pages - st.free_kv_pages;
    st.staging_pages = s->stage_n;
    st.staging_pages_used = s->stage_used;
    st.staging_waits = s->stage_waits;
    pd_engine_swap_stats(s->eng, &st.preemptions, &st.swapped_requests, &st.swap_bytes);
    size_t arena_used = 0;
    pd_engine_swap_arena_stats(s->eng, &st.swap_held, &arena_used);
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

pd_status decode_tools_grammar(decode_server *s, const pd_chat_tools *t, const char *guide, int min_tokens,
                               pd_grammar **out, const char **param, pd_err *err)
{
    *out = NULL;
    if (t->choice != PD_TOOLS_REQUIRED && t->choice != PD_TOOLS_NAMED)
        return PD_OK;
    *param = "tool_choice";
    if (guide != NULL)
        return pd_err_set(err, PD_ERR_INVALID, "'tool_choice' %s cannot be combined with %s (both constrain the "
                          "output)", t->choice == PD_TOOLS_REQUIRED ? "\"required\"" : "naming a function", guide);
    if (min_tokens > 0) {
        *param = "min_tokens";
        return pd_err_set(err, PD_ERR_INVALID, "'min_tokens' cannot be combined with a forced tool call (the "
                          "grammar decides where the output may end)");
    }
    pd_status st = pd_chat_tools_grammar(t, s->grammars, out, err);
    if (st != PD_OK)
        *param = "tools";
    return st;
}

int decode_server_aux_alloc(decode_server *s, int n)
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

void decode_server_aux_free(decode_server *s, int start)
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

void decode_server_emit_new(decode_server *s, decode_handle *h)
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
void decode_server_call_done(decode_server *s, decode_handle *h, pd_status st, const char *msg)
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

/* Drop the server's hold on h: engine request, aux rows, staging pages, list entry, reference. */
void decode_server_handle_retire(decode_server *s, decode_handle *h)
{
    if (h->r != NULL) {
        pd_engine_release(s->eng, h->r);
        h->r = NULL;
    }
    if (h->aux_row >= 0) {
        decode_server_aux_free(s, h->aux_row);
        h->aux_row = -1;
    }
    decode_prefill_stage_release(s, h);
    h->state = H_GONE;
    s->admit_blocked = 0;   /* pages or rows came back */
    list_remove(s, h);
    handle_unref(h);
}

/* End a request for its caller with st. Pages a prefill node may still write stay held. */
static void end_request(decode_server *s, decode_handle *h, pd_status st, const char *msg)
{
    if (h->done_called)
        return;
    switch (h->state) {
    case H_QUEUED:
        s->n_queued--;
        atomic_fetch_sub(&s->n_waiting, 1);
        decode_server_call_done(s, h, st, msg);
        decode_server_handle_retire(s, h);
        break;
    case H_RUNNING:
        if (h->r != NULL && h->r->finish == PD_FINISH_NONE)
            pd_engine_cancel(s->eng, h->r);
        if (st != PD_OK && st != PD_ERR_CANCELLED)
            h->state = H_GONE;   /* no tokens/stats in an error result; a cancelled one keeps
                                  * them (HTTP stop strings end generation by cancelling) */
        decode_server_call_done(s, h, st, msg);
        h->state = H_RUNNING;
        s->n_running--;
        decode_server_handle_retire(s, h);
        break;
    case H_PREFILL: {
        /* the prefill node may be putting into our pages: tell it to stop, keep the pages
         * until its Prefill reply (bounded by that call's deadline) */
        decode_server_call_done(s, h, st, msg);
        s->n_prefill--;
        h->state = H_ZOMBIE;
        prefill_node *nd = h->node;
        Pdspark__CancelPrefillRequest cr = PDSPARK__CANCEL_PREFILL_REQUEST__INIT;
        cr.version = PD_PROTO_VERSION;
        cr.request_id = h->id;
        pd_err err;
        if (nd != NULL && pd_rpc_unary_async(nd->ch, "/pdspark.Prefill/CancelPrefill", &cr.base,
                                             &pdspark__cancel_prefill_reply__descriptor,
                                             s->cfg.transfer_timeout_ms, decode_prefill_cancel_reply, nd,
                                             NULL, &err) == PD_OK)
            nd->calls++;
        break;
    }
    default:
        break;
    }
    decode_server_update_stats(s);
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
            st = decode_prefill_start(s, h, &err);
        if (st == PD_ERR_BUSY) {
            if (s->cfg.queue_timeout_ms > 0 && now - h->t_submit > (double)s->cfg.queue_timeout_ms) {
                char msg[256];
                snprintf(msg, sizeof(msg), "no KV capacity for %lld ms (%d pages free, %d queued; %.120s)",
                         (long long)s->cfg.queue_timeout_ms, pd_engine_kv_free_pages(s->eng),
                         s->n_queued, err.msg);
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
    decode_server_update_stats(s);
}

static void collect(decode_server *s)
{
    for (decode_handle *h = s->head, *next; h != NULL; h = next) {
        next = h->next;
        if (h->state != H_RUNNING || h->r == NULL)
            continue;
        decode_server_emit_new(s, h);
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
                decode_server_handle_retire(s, h);
                decode_server_update_stats(s);
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
        decode_server_update_stats(s);
    }
    decode_server_kick(s);
}

void decode_server_kick(decode_server *s)
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
    decode_server_kick(s);
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
    decode_server_update_stats(s);
    if (s->stopping || atomic_load(&h->cancel_asked)) {
        end_request(s, h, PD_ERR_CANCELLED, s->stopping ? "server shutting down" : "cancelled");
        return;
    }
    admit(s);
    decode_server_kick(s);
}

static void cancel_cb(void *arg)
{
    decode_handle *h = arg;
    decode_server *s = h->s;
    if (h->state != H_GONE && !h->done_called)
        end_request(s, h, PD_ERR_CANCELLED, "cancelled by the client");
    decode_server_kick(s);
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

/* The seed of a request that gave none: the kernel's random bytes, else the clock and a counter. */
static uint64_t draw_seed(void)
{
    uint64_t v;
    if (getrandom(&v, sizeof(v), GRND_NONBLOCK) == (ssize_t)sizeof(v))
        return v;
    static atomic_uint_fast64_t n;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
           (((uint64_t)atomic_fetch_add(&n, 1) + 1) * 0x9e3779b97f4a7c15ull);
}

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
    /* a request's top_p 0 means off (proto3's unset); the rest as the engine checks them */
    if (!isfinite(req->top_p) || req->top_p < 0.0f || req->top_p > 1.0f)
        return pd_err_set(err, PD_ERR_INVALID, "top_p %g must be in [0, 1] (0 = off)",
                          (double)req->top_p);
    if (req->top_k > s->vocab)
        return pd_err_set(err, PD_ERR_INVALID, "top_k %d must be in 0..%d", req->top_k, s->vocab);
    pd_sample_params sp = { .temperature = req->temperature, .top_k = req->top_k,
                            .top_p = req->top_p > 0.0f ? req->top_p : 1.0f, .min_p = req->min_p,
                            .typical_p = req->typical_p, .seed = req->seed_random ? draw_seed() : req->seed };
    pd_status pst = pd_sample_params_check(&sp, err);
    if (pst != PD_OK)
        return pst;
    pst = pd_penalties_check(req->presence_penalty, req->frequency_penalty,
                             req->repetition_penalty, err);
    if (pst != PD_OK)
        return pst;
    if ((pst = pd_logit_bias_check(req->logit_bias, req->n_logit_bias, s->vocab, err)) != PD_OK)
        return pst;
    if ((pst = pd_stop_ids_check(req->stop_token_ids, req->n_stop_token_ids, PD_MAX_STOP_IDS, s->vocab,
                                 err)) != PD_OK)
        return pst;
    if (req->n_allowed_token_ids < 0 || req->n_allowed_token_ids > s->vocab)
        return pd_err_set(err, PD_ERR_INVALID, "allowed_token_ids: %d ids (at most the vocabulary's %d)",
                          req->n_allowed_token_ids, s->vocab);
    for (int i = 0; i < req->n_allowed_token_ids; i++)
        if (req->allowed_token_ids[i] < 0 || req->allowed_token_ids[i] >= s->vocab)
            return pd_err_set(err, PD_ERR_INVALID, "allowed_token_ids[%d] = %d is outside the vocabulary "
                              "(0..%d)", i, req->allowed_token_ids[i], s->vocab - 1);
    if (req->min_tokens < 0 || (req->max_new_tokens > 0 && req->min_tokens > req->max_new_tokens))
        return pd_err_set(err, PD_ERR_INVALID, "min_tokens %d must be in 0..max_new_tokens (%d)",
                          req->min_tokens, req->max_new_tokens);
    if (req->prompt_logprobs && s->cfg.colocated && s->cfg.cp_size > 1)
        return pd_err_set(err, PD_ERR_INVALID, "prompt logprobs (prompt_logprobs, or echo with logprobs) "
                          "are not available with context-parallel prefill (--cp-size %d)", s->cfg.cp_size);
    if (req->top_logprobs < 0 || req->top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "top_logprobs %d must be in 0..%d", req->top_logprobs,
                          PD_MAX_TOP_LOGPROBS);
    if (req->prompt_top_logprobs < 0 || req->prompt_top_logprobs > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_INVALID, "prompt_top_logprobs %d must be in 0..%d",
                          req->prompt_top_logprobs, PD_MAX_TOP_LOGPROBS);
    if (req->max_new_tokens < 0 || req->max_new_tokens > s->max_ctx)
        return pd_err_set(err, PD_ERR_INVALID, "max_new_tokens %d must be in 0..%d (0 = the rest of "
                          "the context)",
                          req->max_new_tokens, s->max_ctx);
    if (req->truncate_prompt_tokens < -1)
        return pd_err_set(err, PD_ERR_INVALID, "truncate_prompt_tokens %d must be >= -1 (-1 = what the "
                          "context leaves, 0 = off)", req->truncate_prompt_tokens);
    /* the prompt's tokens kept from its end (left truncation); 0: all */
    const int keep = req->truncate_prompt_tokens > 0 ? req->truncate_prompt_tokens
                     : req->truncate_prompt_tokens < 0
                         ? s->max_ctx - (req->max_new_tokens > 0 ? req->max_new_tokens : 1)
                         : 0;
    if (req->truncate_prompt_tokens != 0 && keep < 1)
        return pd_err_set(err, PD_ERR_INVALID, "truncate_prompt_tokens -1 with max_new_tokens %d leaves no "
                          "prompt in the context of %d tokens", req->max_new_tokens, s->max_ctx);
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
        /* tokenizing is bounded by what can fit: ~64 bytes a context token, or with left
         * truncation (whose point is a text longer than the context) DECODE_TRUNC_TEXT_MAX */
        if (keep == 0 && req->prompt_text_len > (size_t)s->max_ctx * 64)
            return pd_err_set(err, PD_ERR_INVALID, "prompt text of %zu bytes is too long for a context of %d "
                              "tokens (truncate_prompt_tokens accepts up to %d MiB)", req->prompt_text_len,
                              s->max_ctx, DECODE_TRUNC_TEXT_MAX >> 20);
        if (req->prompt_text_len > DECODE_TRUNC_TEXT_MAX)
            return pd_err_set(err, PD_ERR_INVALID, "prompt text of %zu bytes is over the %d MiB that "
                              "truncate_prompt_tokens accepts", req->prompt_text_len, DECODE_TRUNC_TEXT_MAX >> 20);
        pd_status st = pd_tokenizer_encode(s->tok, req->prompt_text, req->prompt_text_len, 1, &ids, &nn, err);
        if (st != PD_OK) {
            if (st == PD_ERR_NOMEM)
                return st;
            pd_err_prefix(err, "prompt text");   /* (its message is an argument: not pd_err_set) */
            return err->code = PD_ERR_INVALID;
        }
        n = (int)nn;
        if (n == 0) {
            free(ids);
            return pd_err_set(err, PD_ERR_INVALID, "prompt text encodes to no tokens");
        }
    } else {
        n = req->n_prompt_ids;
        if (n >= s->max_ctx && (keep == 0 || keep >= s->max_ctx))
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
    if (keep > 0 && n > keep) {
        memmove(ids, ids + (n - keep), (size_t)keep * sizeof(int32_t));
        n = keep;
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
    /* (the staging pool holds the longest prompt admitted here: decode_prefill_setup_xfer) */
    if (s->stage_n > 0 && (n + s->page_size - 1) / s->page_size > s->stage_n) {
        st = pd_err_set(err, PD_ERR_INVALID, "prompt of %d tokens exceeds the kv staging pool (%d pages "
                        "of %d tokens)", n, s->stage_n, s->page_size);
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
    h->gp.sample = sp;
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
    const size_t allow_words = (size_t)(s->vocab + 31) / 32;
    if ((req->n_logit_bias > 0 && (h->bias = malloc((size_t)req->n_logit_bias * sizeof(*h->bias))) == NULL) ||
        (req->n_allowed_token_ids > 0 && (h->allow = calloc(allow_words, sizeof(uint32_t))) == NULL)) {
        handle_discard(s, h);
        st = pd_err_set(err, PD_ERR_NOMEM, "logit_bias / allowed_token_ids");
        goto err_ids;
    }
    if ((st = bad_words_ids(s, req, &h->bad, &h->gp.n_bad, err)) != PD_OK) {
        handle_discard(s, h);
        goto err_ids;
    }
    h->gp.bad = h->bad;
    if (req->n_logit_bias > 0) {
        memcpy(h->bias, req->logit_bias, (size_t)req->n_logit_bias * sizeof(*h->bias));
        h->gp.logit_bias = h->bias;
        h->gp.n_logit_bias = req->n_logit_bias;
    }
    for (int i = 0; i < req->n_allowed_token_ids; i++)
        h->allow[req->allowed_token_ids[i] / 32] |= 1u << (req->allowed_token_ids[i] % 32);
    h->gp.allow = h->allow;
    h->gp.logprobs = req->logprobs != 0;
    h->gp.prompt_logprobs = req->prompt_logprobs != 0;
    h->gp.top_logprobs = req->logprobs ? req->top_logprobs : 0;
    h->gp.prompt_top_logprobs = req->prompt_logprobs ? req->prompt_top_logprobs : 0;
    h->on_token = on_token;
    h->on_done = on_done;
    h->ud = ud;
    h->aux_row = -1;
    h->t_submit = pd_cli_now_ms();
    int64_t tmo = req->timeout_ms > 0 ? req->timeout_ms : s->cfg.request_timeout_ms;
    h->deadline = tmo > 0 ? h->t_submit + (double)tmo : 0.0;
    h->fail_st = PD_ERR_INTERNAL;
    if (pd_detok_create(s->tok, &h->detok, err) != PD_OK) {
        st = err->code;
        handle_discard(s, h);
        goto err_ids;
    }
    pd_detok_set_skip_special(h->detok, req->skip_special);
    h->state = H_QUEUED;
    if (pd_loop_post(s->loop, submit_cb, h) != PD_OK) {
        handle_discard(s, h);
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

/* --generation-config: "auto" (NULL) reads model_dir/generation_config.json, "none" nothing,
 * else DIR/generation_config.json; its temperature, top_p, top_k, min_p, typical_p,
 * repetition_penalty and max_new_tokens become the defaults of requests that leave them out
 * (vLLM's defaults; gRPC requests with SamplingParams.model_defaults). A file
 * that is absent is no error with "auto"; a value out of range is. */
static pd_status load_gen_defaults(decode_gen_defaults *g, const char *model_dir, const char *which, pd_err *err)
{
    if (which != NULL && strcmp(which, "none") == 0)
        return PD_OK;
    char path[4096];
    snprintf(path, sizeof(path), "%s/generation_config.json", which == NULL || strcmp(which, "auto") == 0
                                                                  ? model_dir : which);
    char *txt = NULL;
    pd_err rerr;
    if (pd_cli_read_text(path, &txt, &rerr) != PD_OK) {
        if (which == NULL || strcmp(which, "auto") == 0)
            return PD_OK;
        return pd_err_set(err, PD_ERR_IO, "--generation-config: cannot read %.300s", path);
    }
    cJSON *j = pd_json_parse_str(txt, NULL);
    free(txt);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return pd_err_set(err, PD_ERR_INVALID, "%.300s: not a JSON object", path);
    }
    static const struct { const char *key; double lo, hi; } f[7] = {
        { "temperature", 0, 2 }, { "top_p", 1e-9, 1 }, { "top_k", -1, 1e9 }, { "repetition_penalty", 1e-9, 10 },
        { "max_new_tokens", 1, 1e9 }, { "min_p", 0, 1 }, { "typical_p", 1e-9, 1 },
    };
    int *has[7] = { &g->has_temp, &g->has_top_p, &g->has_top_k, &g->has_rep, &g->has_max, &g->has_min_p,
                    &g->has_typical_p };
    pd_status st = PD_OK;
    char used[256] = "";
    for (int k = 0; k < 7 && st == PD_OK; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, f[k].key);
        if (v == NULL || cJSON_IsNull(v))
            continue;
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= f[k].lo && v->valuedouble <= f[k].hi)) {
            st = pd_err_set(err, PD_ERR_INVALID, "%.300s: '%s' must be a number in [%g, %g]", path, f[k].key,
                            f[k].lo, f[k].hi);
            break;
        }
        double x = v->valuedouble;
        *has[k] = 1;
        switch (k) {
        case 0: g->temperature = (float)x; break;
        case 1: g->top_p = (float)x; break;
        case 2: g->top_k = x < 0 ? 0 : (int)x; break;
        case 3: g->repetition_penalty = (float)x; break;
        case 5: g->min_p = (float)x; break;
        case 6: g->typical_p = (float)x; break;
        default: g->max_new_tokens = (int)x; break;
        }
        size_t l = strlen(used);
        snprintf(used + l, sizeof(used) - l, "%s%s %g", l > 0 ? ", " : "", f[k].key, x);
    }
    if (st == PD_OK && used[0] != '\0')
        PD_LOG_INFO("decode", "request defaults from %s: %s (a request's own values win; --generation-config "
                    "none for OpenAI's)", path, used);
    cJSON_Delete(j);
    return st;
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

const decode_gen_defaults *decode_server_gen_defaults(const decode_server *s)
{
    return &s->gen;
}

int decode_server_reasoning(const decode_server *s)
{
    return s->cfg.reasoning;
}

pd_status decode_server_create(const decode_config *cfg, decode_server **out, pd_err *err)
{
    if (cfg->model_dir == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "decode server: --model is required");
    if (!cfg->colocated && (cfg->prefill == NULL || cfg->prefill[0] == '\0'))
        return pd_err_set(err, PD_ERR_INVALID, "decode server: --prefill HOST:PORT or --colocated is required");
    decode_server *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "decode server");
    pd_status st = PD_OK;
    s->cfg = *cfg;
    s->model_dir = strdup(cfg->model_dir);
    s->draft_dir = dup_or_null(cfg->draft_dir);
    s->device = strdup(cfg->device != NULL ? cfg->device : "cpu");
    s->prefill = dup_or_null(cfg->prefill);
    s->cfg.model_dir = s->model_dir;
    s->cfg.draft_dir = s->draft_dir;
    s->cfg.device = s->device;
    s->cfg.prefill = s->prefill;
    s->cfg.cp_strategy = NULL;
    s->cfg.chat_template = NULL;
    s->cfg.generation_config = NULL;
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
    if (s->model_dir == NULL || (cfg->draft_dir != NULL && s->draft_dir == NULL) || s->device == NULL ||
        (cfg->prefill != NULL && s->prefill == NULL)) {
        st = pd_err_set(err, PD_ERR_NOMEM, "decode config");
        goto err_destroy;
    }
    if ((st = pd_chat_template_open(s->model_dir, cfg->chat_template, cfg->jinja, &s->chat, &s->chat_ok,
                                    s->chat_why, sizeof(s->chat_why), err)) != PD_OK)
        goto err_destroy;
    if ((st = load_gen_defaults(&s->gen, s->model_dir, cfg->generation_config, err)) != PD_OK)
        goto err_destroy;
    kern_backend_config bc = { .name = s->device, .f32 = cfg->f32 };
    if ((st = kern_backend_create(&bc, &s->be, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_qwen3_load(s->be, s->model_dir, &s->tm, err)) != PD_OK)
        goto err_destroy;
    if (s->draft_dir != NULL && (st = pd_dspark_load(s->be, s->draft_dir, s->tm, &s->dm, err)) != PD_OK)
        goto err_destroy;
    if ((st = pd_tokenizer_load(s->model_dir, &s->tok, err)) != PD_OK)
        goto err_destroy;
    if (!s->chat_ok)   /* after the checkpoint loaded: a missing model dir is the error, not this */
        PD_LOG_WARN("decode", "%s", s->chat_why);
    if ((st = pd_gcache_create(64, &s->grammars, err)) != PD_OK)
        goto err_destroy;
    pd_engine_config ec = { .target = s->tm, .draft = s->dm, .page_size = cfg->page_size,
                            .n_pages = cfg->kv_pages, .kv_mem_fraction = cfg->kv_mem_fraction,
                            .fast_kernels = cfg->fast_kernels, .graphs = cfg->graphs,
                            .spec_disable_batch = cfg->spec_disable_batch,
                            .max_prefill_tokens = cfg->max_prefill_tokens,
                            .verify_threshold = cfg->verify_threshold,
                            .prefix_cache = cfg->prefix_cache,
                            .swap_bytes = cfg->swap_bytes > 0 ? (size_t)cfg->swap_bytes : 0 };
    if (cfg->verify != NULL && (st = pd_verify_policy_parse(cfg->verify, &ec.verify_policy, err)) != PD_OK)
        goto err_destroy;
    pd_err cerr;
    pd_status cs = s->draft_dir != NULL ? pd_calib_load(s->draft_dir, &s->calib, &cerr) : PD_ERR_NOT_FOUND;
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
        if ((st = decode_prefill_setup_xfer(s, err)) != PD_OK)
            goto err_destroy;
        if ((st = decode_prefill_resolve_nodes(s, err)) != PD_OK)
            goto err_destroy;
    }
    pd_loop_timer_start(s->tick_timer, TICK_MS, true);
    decode_server_update_stats(s);
    atomic_store(&s->accepting, 1);
    decode_server_update_stats(s);
    if (pthread_create(&s->thread, NULL, engine_thread, s) != 0) {
        atomic_store(&s->accepting, 0);
        st = pd_err_set(err, PD_ERR_INTERNAL, "engine thread: cannot start");
        goto err_destroy;
    }
    s->thread_started = 1;
    if (!cfg->colocated && s->cfg.prefill_refresh_ms > 0) {
        if ((st = decode_prefill_resolver_start(s, err)) != PD_OK)
            goto err_destroy;
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
            decode_server_call_done(s, h, PD_ERR_CANCELLED, "server shutting down");
        decode_server_handle_retire(s, h);
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
    kern_host_free(s->be, s->kv_stage);
    kern_host_free(s->be, s->dkv_stage);
    free(s->stage_busy);
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
    pd_chat_template_free(&s->chat);
    free(s->model_dir);
    free(s->draft_dir);
    free(s->device);
    free(s->prefill);
    free(s);
}
