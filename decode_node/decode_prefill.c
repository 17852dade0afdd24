/* decode_prefill.c - the decode node's side of disaggregated prefill.
 * Owns: the prefill-node clients (least-loaded choice, reconnect after a failure, --prefill
 *   resolved again on a thread of its own when asked), the Prefill call of a request (pages and
 *   aux rows reserved here, the first-token mask of a grammar, the KV layout and keys), its
 *   reply on the engine thread (staged KV uploaded, prompt logprobs taken, the request handed to
 *   the engine or failed, a retry on another node when the first was never reached), the
 *   staging pool's pages (device KV that UCX cannot reach: bounded host pages the prefill nodes
 *   put into, held per request from its Prefill until no put can land), and the UCX worker
 *   (target KV pool or its staging pool, the same for the draft pool, and the aux arena
 *   registered once; every --aux-transfer mode is offered, the reply says which one the prefill
 *   node used).
 * Not here: the request lifecycle and admission (decode_server.c), CancelPrefill's sending
 *   (decode_server.c, when a request ends), the prefill node itself (prefill_node/).
 * Threading: engine thread; replies arrive on a pd_rpc poller thread and are posted to it; the
 *   resolver thread only resolves and posts. */
#define _GNU_SOURCE   /* pthread_setname_np */
#include "decode_prefill.h"

#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "pd_cli.h"
#include "pd_log.h"
#include "pd_proto_version.h"
#include "pd_wire.h"
#include "pdspark.pb-c.h"

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

void decode_prefill_cancel_reply(void *ud, pd_status st, ProtobufCMessage *resp, const pd_err *err)
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
    if (best != NULL && (best->reset || !pd_rpc_channel_tls_current(best->ch)) && best->calls == 0) {
        /* a fresh channel connects at once instead of waiting out gRPC's reconnect backoff, and
         * presents (and checks against) the TLS files read last */
        pd_rpc_channel *ch = NULL;
        pd_err err;
        if (pd_rpc_channel_create_as(best->addr, best->host, &ch, &err) == PD_OK) {
            if (!best->reset)
                PD_LOG_INFO("decode", "prefill node %s: a new channel with the TLS files read last",
                            best->addr);
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
/* The tokens h's grammar, allowed tokens and bad words (one-token words) allow first, as
 * SamplingParams.first_token_mask's bytes (malloc'd) */
static pd_status first_token_mask(decode_server *s, const decode_handle *h, uint8_t **out, pd_err *err)
{
    pd_grammar *g = h->grammar;
    const uint32_t *allow = h->allow;
    pd_gmatch *m = NULL;
    int words = (s->vocab + 31) / 32;
    uint32_t *bits = malloc((size_t)words * sizeof(uint32_t));
    uint8_t *bytes = malloc((size_t)words * sizeof(uint32_t));
    pd_status st = bits == NULL || bytes == NULL ? pd_err_set(err, PD_ERR_NOMEM, "first-token mask") : PD_OK;
    if (st == PD_OK && g != NULL && (st = pd_gmatch_create(g, &m, err)) == PD_OK)
        st = pd_gmatch_allowed(m, s->gvocab, bits, err);
    else if (st == PD_OK)
        memset(bits, 0xff, (size_t)words * sizeof(uint32_t));
    for (int w = 0; st == PD_OK && allow != NULL && w < words; w++)
        bits[w] &= allow[w];
    for (int i = 0; st == PD_OK && h->bad != NULL && i < h->gp.n_bad; i += 1 + h->bad[i])
        if (h->bad[i] == 1)
            bits[h->bad[i + 1] / 32] &= ~(1u << (h->bad[i + 1] % 32));
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
    /* staging: the prefill node puts into staging pages (the staging pool is the remote pool
     * it sees, same layout, stage_n pages), target and draft under the same ids */
    PD_ASSERT(s->kv_stage == NULL || h->n_stage == np);
    for (int i = 0; i < np; i++)
        pages[i] = (uint32_t)(s->kv_stage != NULL ? h->stage_pages[i] : h->r->tkv.pages[i]);
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
            dpages[i] = (uint32_t)(s->kv_stage != NULL ? h->stage_pages[i] : h->r->dkv.pages[i]);
    }
    for (int i = 0; i < h->n_prompt; i++)
        ids[i] = (uint32_t)h->prompt[i];
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    sp.version = PD_PROTO_VERSION;
    sp.temperature = h->gp.sample.temperature;
    sp.top_p = h->gp.sample.top_p;
    sp.min_p = h->gp.sample.min_p;
    sp.typical_p = h->gp.sample.typical_p;
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
    /* structured output, allowed_token_ids, bad_words: the prefill node samples the first token,
     * from the tokens they allow at its start */
    uint8_t *first_mask = NULL;
    if (h->grammar != NULL || h->allow != NULL || h->bad != NULL) {
        pd_status gst = first_token_mask(s, h, &first_mask, err);
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
    al.mode = PDSPARK__AUX_MODE__AUX_MODE_NONE;   /* no drafter here (--no-draft): the KV pages only */
    if (s->dm != NULL) {
        al.mode = PDSPARK__AUX_MODE__AUX_MODE_RAW;
        al.rows = (uint32_t)h->n_prompt;
        al.row_bytes = (uint64_t)s->aux_dim * sizeof(float);
    }
    Pdspark__Destination d = PDSPARK__DESTINATION__INIT;
    d.version = PD_PROTO_VERSION;
    d.worker_address.data = (uint8_t *)s->waddr;
    d.worker_address.len = s->waddr_len;
    d.n_page_ids = (size_t)np;
    d.page_ids = pages;
    d.kv_pool = &kv;
    d.aux = s->dm != NULL ? &ax : NULL;
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
    pr.prompt_top_logprobs = (uint32_t)h->gp.prompt_top_logprobs;
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
        pd_err_prefix(err, "prefill node %s", nd->addr);   /* (its message is an argument: not pd_err_set) */
        return err->code = PD_ERR_PEER;
    }
    nd->inflight++;
    nd->calls++;
    PD_LOG_DEBUG("decode", "%s: prefill on %s (%d tokens, %d pages)", h->id, nd->addr,
                 h->n_prompt, np);
    return PD_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Staging pool */

/* np staging pages for h, the lowest free ids in order (a mostly free pool gives consecutive
 * ids, which the prefill node's puts and the upload move as runs). PD_ERR_BUSY when fewer are
 * free (they come back within a transfer); nothing held on error. */
static pd_status stage_alloc(decode_server *s, decode_handle *h, int np, pd_err *err)
{
    PD_ASSERT(h->stage_pages == NULL && np > 0);
    if (s->stage_n - s->stage_used < np)
        return pd_err_set(err, PD_ERR_BUSY, "kv staging pool: %d of %d pages free, %d needed",
                          s->stage_n - s->stage_used, s->stage_n, np);
    int32_t *ids = malloc((size_t)np * sizeof(*ids));
    if (ids == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "kv staging pages: %d", np);
    for (int i = 0, k = 0; k < np; i++)
        if (!s->stage_busy[i]) {
            s->stage_busy[i] = 1;
            ids[k++] = i;
        }
    s->stage_used += np;
    h->stage_pages = ids;
    h->n_stage = np;
    return PD_OK;
}

void decode_prefill_stage_release(decode_server *s, decode_handle *h)
{
    if (h->stage_pages == NULL)
        return;
    for (int i = 0; i < h->n_stage; i++) {
        PD_ASSERT(s->stage_busy[h->stage_pages[i]]);
        s->stage_busy[h->stage_pages[i]] = 0;
    }
    s->stage_used -= h->n_stage;
    free(h->stage_pages);
    h->stage_pages = NULL;
    h->n_stage = 0;
}

/* Reserve aux rows, staging pages (when staging) and KV pages, and send Prefill. PD_ERR_BUSY: no
 * room now (nothing held). */
pd_status decode_prefill_start(decode_server *s, decode_handle *h, pd_err *err)
{
    int row = decode_server_aux_alloc(s, h->n_prompt);
    if (row < 0)
        return pd_err_set(err, PD_ERR_BUSY, "aux arena full");
    pd_status st = PD_OK;
    if (s->kv_stage != NULL) {
        st = stage_alloc(s, h, (h->n_prompt + s->page_size - 1) / s->page_size, err);
        if (st == PD_ERR_BUSY && !h->stage_waited) {
            h->stage_waited = 1;
            s->stage_waits++;
            PD_LOG_DEBUG("decode", "%s: waits for staging pages (%s)", h->id, err->msg);
        }
    }
    if (st == PD_OK)
        st = pd_engine_add_external(s->eng, h->eid, h->prompt, h->n_prompt, &h->gp, &h->r, err);
    if (st != PD_OK) {
        decode_prefill_stage_release(s, h);
        decode_server_aux_free(s, row);
        return st;
    }
    h->aux_row = row;
    st = send_prefill(s, h, pick_node(s), err);
    if (st != PD_OK) {
        /* nothing is in flight: no put can land in the staging pages */
        pd_engine_release(s->eng, h->r);
        h->r = NULL;
        decode_prefill_stage_release(s, h);
        decode_server_aux_free(s, h->aux_row);
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

/* Staging: copy the prompt's pages (every layer's K and V) from h's staging pages of stage (the
 * staging pool of pool's layout) into its pool pages seq->pages. */
static pd_status upload_staged(decode_server *s, decode_handle *h, pd_kv_pool *pool, const void *stage,
                               const pd_kv_seq *seq, pd_err *err)
{
    if (stage == NULL)
        return PD_OK;
    const pd_kv_layout *lay = pd_kv_pool_layout(pool);
    const kern_buf *kb = pd_kv_pool_buf(pool);
    size_t pb = pd_kv_page_bytes(lay);
    int np = h->n_stage;
    const int32_t *sp = h->stage_pages;
    PD_ASSERT(np == (h->n_prompt + lay->page_size - 1) / lay->page_size && seq->n_pages >= np);
    if (np == 0)
        return PD_OK;
    /* one batched copy of every run (consecutive ids on both sides) */
    kern_copy_span *cp = malloc((size_t)2 * lay->n_layers * (size_t)np * sizeof(*cp));
    if (cp == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "staged upload: %d copies", 2 * lay->n_layers * np);
    int n = 0;
    for (int l = 0; l < lay->n_layers; l++)
        for (int half = 0; half < 2; half++)
            for (int p = 0, run; p < np; p += run) {
                run = 1;
                while (p + run < np && seq->pages[p + run] == seq->pages[p] + run &&
                       sp[p + run] == sp[p] + run)
                    run++;
                size_t dst = ((size_t)(2 * l + half) * (size_t)lay->n_pages + (size_t)seq->pages[p]) * pb;
                size_t src = ((size_t)(2 * l + half) * (size_t)s->stage_n + (size_t)sp[p]) * pb;
                cp[n++] = (kern_copy_span){ (char *)kb->ptr + dst, (const char *)stage + src, (size_t)run * pb };
            }
    pd_status st = kern_upload_spans(s->be, cp, n, err);
    free(cp);
    return st;
}

/* The prompt's pages and the drafter's payload arrived (the prefill node used mode): move the
 * staged pages in and hand the request to the engine. */
static pd_status complete_external(decode_server *s, decode_handle *h, int32_t first,
                                   Pdspark__AuxMode mode, const pd_token_logprobs *first_lp,
                                   pd_err *err)
{
    pd_aux_mode am = PD_AUX_RAW;   /* without a drafter: no rows to take */
    if (s->dm == NULL) {
        if (mode != PDSPARK__AUX_MODE__AUX_MODE_NONE)
            return pd_err_set(err, PD_ERR_INVALID, "aux transfer mismatch: the prefill node shipped a drafter "
                              "payload (aux mode %d) that this decode node (--no-draft) did not ask for",
                              (int)mode);
    } else switch (mode) {
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
    /* raw rows are [n, K*hidden]; ctx rows are [n, hidden], packed from the same first row; none
     * without a drafter */
    const float *rows = s->dm == NULL || am == PD_AUX_DRAFT_KV ? NULL
                      : s->aux_arena + (size_t)h->aux_row * (size_t)s->aux_dim;
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
            first_lp.rank = rep->first_token_rank > INT32_MAX ? -1 : (int32_t)rep->first_token_rank;
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
            decode_server_handle_retire(s, h);   /* the node answered: no put of ours is running */
        } else {
            /* no word from the node: give a put that might still be running time to end */
            h->state = H_HOLD;
            h->hold_until = pd_cli_now_ms() + (double)s->cfg.transfer_timeout_ms;
        }
        decode_server_update_stats(s);
        decode_server_kick(s);
        return;
    }
    PD_ASSERT(h->state == H_PREFILL);
    if (st == PD_OK) {
        pd_err err = {0};
        if (complete_external(s, h, first, aux_mode, &first_lp, &err) == PD_OK) {
            decode_server_aux_free(s, h->aux_row);
            h->aux_row = -1;
            decode_prefill_stage_release(s, h);   /* uploaded; the node has answered */
            s->n_prefill--;
            s->n_running++;
            h->state = H_RUNNING;
            decode_server_emit_new(s, h);
            decode_server_update_stats(s);
            decode_server_kick(s);
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
                decode_server_update_stats(s);
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
        decode_server_call_done(s, h, PD_ERR_TIMEOUT, full);
    } else {
        snprintf(full, sizeof(full), "prefill node %s failed: %s", nd->addr, msg);
        PD_LOG_WARN("decode", "%s: %s", h->id, full);
        decode_server_call_done(s, h, PD_ERR_PEER, full);
    }
    s->n_prefill--;
    if (st == PD_ERR_PEER || st == PD_ERR_TIMEOUT || st == PD_ERR_INTERNAL) {
        h->state = H_HOLD;
        h->hold_until = pd_cli_now_ms() + (st == PD_ERR_TIMEOUT ? (double)s->cfg.transfer_timeout_ms : 0.0);
    } else {
        decode_server_handle_retire(s, h);
    }
    decode_server_update_stats(s);
    decode_server_kick(s);
}

/* ---------------------------------------------------------------------------------------------
 * Resolving --prefill, and the UCX worker */

/* Every address of spec: "HOST:PORT[,HOST:PORT...]" or "file:PATH" (the same entries, separated
 * by commas or whitespace, '#' to the end of a line a comment; read again at every resolution),
 * each name as every address it resolves to, as "IP:PORT" / "[IP6]:PORT", without duplicates;
 * each string is followed, past its NUL, by the host name it came from (the name a TLS
 * certificate must carry). *out (malloc'd strings) may be empty. Errors: PD_ERR_INVALID (an entry that is not HOST:PORT:
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
            size_t nl = strlen(name) + 1, hl = strlen(host) + 1;
            if (a == NULL || (a[n] = malloc(nl + hl)) == NULL) {
                if (a != NULL)
                    addrs = a;
                st = pd_err_set(err, PD_ERR_NOMEM, "prefill nodes");
                break;
            }
            memcpy(a[n], name, nl);          /* "IP:PORT", then the name it came from */
            memcpy(a[n] + nl, host, hl);
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
        snprintf(nd->host, sizeof(nd->host), "%s", addrs[k] + strlen(addrs[k]) + 1);
        if ((st = pd_rpc_channel_create_as(nd->addr, nd->host, &nd->ch, err)) != PD_OK) {
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
    decode_server_update_stats(m->s);
    decode_server_kick(m->s);
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

pd_status decode_prefill_resolver_start(decode_server *s, pd_err *err)
{
    if (pthread_create(&s->resolver, NULL, resolver_thread, s) != 0)
        return pd_err_set(err, PD_ERR_INTERNAL, "prefill resolver thread: cannot start");
    s->resolver_started = 1;
    return PD_OK;
}

/* The first resolution, before the engine thread starts: a list that is not HOST:PORT fails;
 * names that do not resolve (yet) fail too unless they are resolved again later. */
pd_status decode_prefill_resolve_nodes(decode_server *s, pd_err *err)
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

/* The pages of the longest prompt decode_submit admits (its tokens in *tokens): shorter than the
 * context, within the aux arena, and with a new token and a draft block within the pool. */
static int longest_prompt_pages(const decode_server *s, long *tokens)
{
    long n = (long)s->max_ctx - 1;
    if (n > s->aux_rows)
        n = s->aux_rows;
    if (((long)s->max_ctx + s->page_size - 1) / s->page_size > s->total_pages) {
        long pool = (long)s->total_pages * s->page_size - s->block_size - 2;
        if (n > pool)
            n = pool;
    }
    if (n < 1)
        n = 1;
    *tokens = n;
    return (int)((n + s->page_size - 1) / s->page_size);
}

/* The staging pool's pages: --kv-staging-pages, else as many as the prompts in prefill at once
 * can use: the aux arena's rows in pages (every prompt in prefill holds its rows) plus one page
 * per batch slot (each prompt's last page may be partly used), at most the pool. A value below
 * the longest admissible prompt's pages is refused (that prompt could never be staged); one
 * above the pool is cut to it (a request in prefill holds as many pool pages). */
static pd_status stage_pages_config(const decode_server *s, int *out, pd_err *err)
{
    long longest_tokens = 0;
    int longest = longest_prompt_pages(s, &longest_tokens);
    int want = s->cfg.kv_staging_pages;
    if (want > 0 && want < longest)
        return pd_err_set(err, PD_ERR_INVALID, "--kv-staging-pages %d: the longest prompt this node admits "
                          "(%ld tokens) needs %d pages of %d tokens; give at least %d, or leave the flag out",
                          want, longest_tokens, longest, s->page_size, longest);
    long n = want;
    if (want <= 0) {
        n = ((long)s->aux_rows + s->page_size - 1) / s->page_size + s->cfg.max_batch;
        if (n < longest)
            n = longest;
    }
    if (n > s->total_pages) {
        if (want > 0)
            PD_LOG_INFO("decode", "--kv-staging-pages %d is more than the kv pool's %d pages: using %d",
                        want, s->total_pages, s->total_pages);
        n = s->total_pages;
    }
    *out = (int)n;
    return PD_OK;
}

pd_status decode_prefill_setup_xfer(decode_server *s, pd_err *err)
{
    pd_xfer_config xc;
    pd_xfer_config_default(&xc);
    xc.name = "decode";
    xc.timeout_ms = (uint32_t)s->cfg.transfer_timeout_ms;
    pd_status st = pd_xfer_create(&xc, &s->x, err);
    if (st != PD_OK)
        return st;
    /* aux arena: enough rows for every prompt the pool can hold, capped at 256 MiB; rows are
     * sized for raw (K*hidden floats), the largest payload, since the prefill node picks the
     * mode; ctx rows (hidden floats) are packed into the same reservation */
    size_t row_bytes = (size_t)(s->aux_dim > 0 ? s->aux_dim : 1) * sizeof(float);
    size_t rows = (size_t)s->total_pages * (size_t)s->page_size;
    if (rows * row_bytes > ((size_t)256 << 20))
        rows = ((size_t)256 << 20) / row_bytes;
    s->aux_rows = (int)rows;
    int stage_n = 0;
    if ((st = stage_pages_config(s, &stage_n, err)) != PD_OK)
        return st;
    pd_kv_pool *tpool = pd_engine_target_pool(s->eng), *dpool = pd_engine_draft_pool(s->eng);
    const kern_buf *kb = pd_kv_pool_buf(tpool);
    /* device KV that UCX cannot reach: prefill nodes put into the staging pool and the prompt's
     * pages are uploaded when the Prefill reply arrives (PD_XFER_FORCE_STAGING=1 takes this
     * path with host memory too, for tests) */
    const char *force = getenv("PD_XFER_FORCE_STAGING");
    size_t stage_bytes = 0, dstage_bytes = 0;
    if ((!s->be->is_host && !pd_xfer_supports_cuda(s->x)) || (force != NULL && strcmp(force, "1") == 0)) {
        pd_kv_layout sl = *pd_kv_pool_layout(tpool);
        sl.n_pages = stage_n;
        stage_bytes = pd_kv_pool_bytes(&sl);
        if (dpool != NULL) {
            pd_kv_layout dl = *pd_kv_pool_layout(dpool);
            dl.n_pages = stage_n;
            dstage_bytes = pd_kv_pool_bytes(&dl);
        }
        /* the backend's host memory (pinned on a GPU: the reply's upload reads the pages in
         * place instead of through the backend's ring) */
        if ((s->stage_busy = calloc((size_t)stage_n, 1)) == NULL)
            return pd_err_set(err, PD_ERR_NOMEM, "kv staging pool: %d pages", stage_n);
        if ((st = kern_host_alloc(s->be, stage_bytes, &s->kv_stage, err)) != PD_OK ||
            (dpool != NULL && (st = kern_host_alloc(s->be, dstage_bytes, &s->dkv_stage, err)) != PD_OK))
            return pd_err_prefix(err, "kv staging pool: %d pages, %zu + %zu bytes", stage_n, stage_bytes,
                                 dstage_bytes);
        memset(s->kv_stage, 0, stage_bytes);
        if (s->dkv_stage != NULL)
            memset(s->dkv_stage, 0, dstage_bytes);
        s->stage_n = stage_n;
        PD_LOG_INFO("decode", "kv staging: %d pages (%.1f MiB of host memory%s) receive the prompts' kv, "
                    "uploaded into the pool of %d pages on the reply (--kv-staging-pages)", stage_n,
                    (double)(stage_bytes + dstage_bytes) / (1 << 20), dpool != NULL ? ", target and draft" : "",
                    s->total_pages);
    } else if (s->cfg.kv_staging_pages > 0) {
        PD_LOG_INFO("decode", "--kv-staging-pages %d unused: prefill nodes put into the kv pools directly",
                    s->cfg.kv_staging_pages);
    }
    st = pd_xfer_mem_register(s->x, s->kv_stage != NULL ? s->kv_stage : kb->ptr,
                              s->kv_stage != NULL ? stage_bytes : kb->bytes, &s->kv_mem, err);
    if (st != PD_OK)
        return st;
    st = pd_xfer_mem_pack(s->kv_mem, &s->kv_rkey, &s->kv_rkey_len, err);
    if (st != PD_OK)
        return st;
    /* draft pool: offered to prefill nodes that ship draft-kv (staged like the target pool) */
    if (dpool != NULL) {
        const kern_buf *db = pd_kv_pool_buf(dpool);
        st = pd_xfer_mem_register(s->x, s->dkv_stage != NULL ? s->dkv_stage : db->ptr,
                                  s->dkv_stage != NULL ? dstage_bytes : db->bytes, &s->dkv_mem, err);
        if (st != PD_OK)
            return st;
        st = pd_xfer_mem_pack(s->dkv_mem, &s->dkv_rkey, &s->dkv_rkey_len, err);
        if (st != PD_OK)
            return st;
    }
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
