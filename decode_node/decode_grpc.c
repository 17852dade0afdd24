/* decode_grpc.c - pdspark.Generate over gRPC (decode_grpc.h).
 * Owns: per-call contexts tying a pd_rpc_call to its choices' decode_handles (GenerateRequest.n:
 *   n engine requests of the prompt on one stream; the group is reference counted: the handler,
 *   the call's on-done and each submitted choice's on_done hold one), chunk encoding, a
 *   request's chat (messages and tools) made into its prompt and a forced call's grammar the way
 *   the HTTP API makes a chat request's (read as that body by pd_wire_chat_in, then pd_chat and
 *   decode_tools_grammar), and the reply split by pd_chat's parser into text, reasoning and
 *   tool calls: whole ones, or (GenerateRequest.stream_tool_arguments) the parser's pieces as
 *   ToolCall deltas, as the HTTP API streams them.
 * Not here: scheduling, validation rules (decode_server.c), what a chat's fields must say
 *   (pd_chat.c).
 * Threading: handlers and on-done on the pd_rpc poller thread, on_token/on_done on the engine
 *   thread; the group's mutex orders "handle known" against "client gone" and collects the
 *   choices' ends. */
#include "decode_grpc.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_buf.h"
#include "pd_chat.h"
#include "pd_grammar.h"
#include "pd_log.h"
#include "pd_proto_version.h"
#include "pd_tokenizer.h"
#include "pd_verify_policy.h"
#include "pd_wire.h"
#include "pdspark.pb-c.h"

#define MAX_STOP 16
#define MAX_STOP_LEN 256
#define MAX_N 16               /* GenerateRequest.n */

typedef struct gen_group gen_group;

/* A tool call of a choice's reply: its arguments gathered until they are whole (or, streamed,
 * the bytes the deltas point into) */
typedef struct {
    char *name, *args;
    size_t name_len, name_cap, args_len, args_cap;
} gen_call;

/* One choice of a call */
typedef struct {
    gen_group *g;
    uint32_t index;
    decode_handle *h;      /* under g->mu */
    int stopped;           /* under g->mu: a stop string matched (the request is being cancelled) */
    /* stop strings (engine thread): text is held back while it may still start a match */
    char *pend;            /* received, not yet sent */
    size_t pend_len, pend_cap;
    uint32_t n_sent_ids;
    char id[96];           /* the choice's request id when n > 1 */
    /* a chat reply split into content, reasoning and tool calls (engine thread; NULL: no split) */
    pd_chat_parser *cp;
    char *sent;            /* the reply's text sent so far (before the split) */
    size_t sent_len, sent_cap;
    gen_call *calls;       /* [n_calls] the reply's tool calls; the first calls_sent went out */
    int n_calls, cap_calls, calls_sent;
} gen_ctx;

struct gen_group {
    atomic_int refs;
    pthread_mutex_t mu;
    pd_rpc_call *call;
    decode_server *s;
    int gone;              /* under mu: the client went away */
    int n;                 /* choices submitted or being submitted */
    int n_open;            /* under mu: choices whose on_done has not run */
    pd_status err_st;      /* under mu: the first choice that failed (PD_OK: none) */
    char err_msg[sizeof(((pd_err *)0)->msg)];
    int want_ids;
    int want_stats;
    int stream_args;       /* GenerateRequest.stream_tool_arguments: calls go as deltas */
    char **stop;
    int n_stop;
    gen_ctx ch[];          /* [n] */
};

static void group_unref(gen_group *g, int k)
{
    if (atomic_fetch_sub(&g->refs, k) != k)
        return;
    for (int i = 0; i < g->n; i++) {
        decode_handle_release(g->ch[i].h);
        free(g->ch[i].pend);
        free(g->ch[i].sent);
        pd_chat_parser_destroy(g->ch[i].cp);
        for (int j = 0; j < g->ch[i].n_calls; j++) {
            free(g->ch[i].calls[j].name);
            free(g->ch[i].calls[j].args);
        }
        free(g->ch[i].calls);
    }
    pthread_mutex_destroy(&g->mu);
    for (int i = 0; i < g->n_stop; i++)
        free(g->stop[i]);
    free(g->stop);
    free(g);
}

/* Cancels every choice whose handle is known (NULL-safe: one not yet known is cancelled by the
 * handler once it is, as it sees g->gone or g->err_st) */
static void group_cancel(gen_group *g)
{
    decode_handle *hs[MAX_N];
    pthread_mutex_lock(&g->mu);
    for (int i = 0; i < g->n; i++)
        hs[i] = g->ch[i].h;
    pthread_mutex_unlock(&g->mu);
    for (int i = 0; i < g->n; i++)
        decode_cancel(hs[i]);
}

/* Records st (and msg) as the call's answer unless a choice failed before; 1 when it is the first */
static int group_fail(gen_group *g, pd_status st, const char *msg)
{
    pthread_mutex_lock(&g->mu);
    int first = g->err_st == PD_OK;
    if (first) {
        g->err_st = st;
        snprintf(g->err_msg, sizeof(g->err_msg), "%s", msg != NULL ? msg : "");
    }
    pthread_mutex_unlock(&g->mu);
    return first;
}

/* A choice has ended (its on_done ran, or it was never submitted): the call ends with the last */
static void group_choice_end(gen_group *g, int k)
{
    pthread_mutex_lock(&g->mu);
    g->n_open -= k;
    int last = g->n_open == 0;
    pd_status st = g->err_st;
    pthread_mutex_unlock(&g->mu);
    if (last)
        pd_rpc_finish(g->call, st, st != PD_OK ? g->err_msg : NULL);
}

static Pdspark__FinishReason finish_to_proto(pd_finish_reason f)
{
    switch (f) {
    case PD_FINISH_STOP: return PDSPARK__FINISH_REASON__FINISH_REASON_EOS;
    case PD_FINISH_LENGTH: return PDSPARK__FINISH_REASON__FINISH_REASON_LENGTH;
    case PD_FINISH_CANCELLED: return PDSPARK__FINISH_REASON__FINISH_REASON_CANCELLED;
    case PD_FINISH_ERROR: return PDSPARK__FINISH_REASON__FINISH_REASON_ERROR;
    default: return PDSPARK__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    }
}

static int pend_add(gen_ctx *c, const char *t, size_t n)
{
    return pd_buf_append(&c->pend, &c->pend_len, &c->pend_cap, t, n);
}

/* Streamed: one call's arguments that came with a feed, c->calls[call].args[from..to) */
typedef struct {
    int call;
    int first;             /* the call's first piece is among them: the delta names it */
    size_t from, to;
} split_delta;

/* A run of a chunk's reply pieces, sent as one GenerateChunk: its content and reasoning, then the
 * calls that became whole (streamed: the calls' deltas) after them. Text that comes after a call
 * starts the next run, so a client that takes a message's text before its calls keeps the
 * reply's order (the HTTP route sends an event per piece). */
typedef struct {
    char *text[2];         /* [0] content, [1] reasoning (NULL: none) */
    size_t len[2], cap[2];
    int d0;                /* streamed: its deltas are split_out.d[d0 .. the next run's d0) */
    int k0;                /* whole calls: its calls are c->calls[k0 .. the next run's k0) */
} split_run;

/* A chat reply split as it is sent: the runs of the chunk's text, and the tool calls that became
 * whole (or, streamed, the calls' deltas) */
typedef struct {
    gen_ctx *c;
    int stream_args;       /* gen_group.stream_args */
    split_run *run;        /* [n_run]: one, or more where text followed a call */
    int n_run, cap_run;
    Pdspark__ToolCall *tc, **tcp;   /* [n] the calls of every run (strings borrowed from c->calls) */
    char (*ids)[PD_CHAT_CALL_ID_SIZE];
    split_delta *d;        /* streamed: [n_d] the deltas of this feed, in call order */
    int n_d, cap_d;
    char *pieces;          /* streamed: the deltas' arguments, each NUL-ended */
    Pdspark__GenerateChunk *more;   /* [n_run - 1] the messages of the runs after the first */
    int oom;
} split_out;

static void split_out_free(split_out *o)
{
    for (int r = 0; r < o->n_run; r++) {
        free(o->run[r].text[0]);
        free(o->run[r].text[1]);
    }
    free(o->run);
    free(o->tc);
    free(o->tcp);
    free(o->ids);
    free(o->d);
    free(o->pieces);
    free(o->more);
}

/* A new run whose calls start at c->calls[k0] and deltas at o->d[o->n_d]. -1 on NOMEM. */
static int split_run_add(split_out *o, int k0)
{
    if (pd_buf_grow((void **)&o->run, &o->cap_run, o->n_run + 1, sizeof(*o->run)) != 0)
        return -1;
    o->run[o->n_run++] = (split_run){ .d0 = o->n_d, .k0 = k0 };
    return 0;
}

/* Streamed: a piece of call k, args[from..to) of it, joins that call's delta of this feed (the
 * parser ends a call before the next one begins, so a call's pieces are adjacent) */
static void split_delta_add(split_out *o, int k, int first, size_t from, size_t to)
{
    if (o->n_d > 0 && o->d[o->n_d - 1].call == k) {
        o->d[o->n_d - 1].to = to;
        return;
    }
    if (pd_buf_grow((void **)&o->d, &o->cap_d, o->n_d + 1, sizeof(*o->d)) != 0) {
        o->oom = 1;
        return;
    }
    o->d[o->n_d++] = (split_delta){ .call = k, .first = first, .from = from, .to = to };
}

static void split_emit(void *ud, const pd_chat_piece *p)
{
    split_out *o = ud;
    if (p->kind != PD_CHAT_TOOL_CALL) {
        int k = p->kind == PD_CHAT_REASONING, done = pd_chat_parser_calls_done(o->c->cp);
        split_run *r = &o->run[o->n_run - 1];
        if ((o->stream_args ? o->n_d > r->d0 : done > r->k0) && split_run_add(o, done) != 0) {
            o->oom = 1;
            return;
        }
        r = &o->run[o->n_run - 1];
        if (pd_buf_append(&r->text[k], &r->len[k], &r->cap[k], p->text, p->len) != 0)
            o->oom = 1;
        return;
    }
    gen_ctx *c = o->c;
    if (p->first) {
        if (pd_buf_grow((void **)&c->calls, &c->cap_calls, c->n_calls + 1, sizeof(*c->calls)) != 0) {
            o->oom = 1;
            return;
        }
        gen_call *nk = &c->calls[c->n_calls++];
        memset(nk, 0, sizeof(*nk));
        if (pd_buf_append(&nk->name, &nk->name_len, &nk->name_cap, p->text, p->len) != 0)
            o->oom = 1;
    }
    if (c->n_calls == 0) {   /* its first piece found no room */
        o->oom = 1;
        return;
    }
    gen_call *k = &c->calls[c->n_calls - 1];
    size_t from = k->args_len;
    if (pd_buf_append(&k->args, &k->args_len, &k->args_cap, p->args, p->args_len) != 0) {
        o->oom = 1;
        return;
    }
    if (o->stream_args)
        split_delta_add(o, c->n_calls - 1, p->first, from, k->args_len);
}

/* Room in o for n ToolCall messages (o->tc, o->tcp, o->ids). -1 on NOMEM. */
static int split_calls_alloc(split_out *o, size_t n)
{
    o->tc = calloc(n, sizeof(*o->tc));
    o->tcp = calloc(n, sizeof(*o->tcp));
    o->ids = calloc(n, sizeof(*o->ids));
    if (o->tc == NULL || o->tcp == NULL || o->ids == NULL)
        return -1;
    for (size_t i = 0; i < n; i++)
        o->tcp[i] = &o->tc[i];
    return 0;
}

/* o's message i: call k of the choice, named (its id and name) when named */
static Pdspark__ToolCall *split_call(gen_ctx *c, const Pdspark__GenerateChunk *m, split_out *o, size_t i,
                                     int k, int named)
{
    Pdspark__ToolCall *t = &o->tc[i];
    pdspark__tool_call__init(t);
    t->version = PD_PROTO_VERSION;
    t->index = (uint32_t)k;
    if (named) {
        pd_chat_call_id(m->request_id, (int)c->index, k, o->ids[i]);
        t->id = o->ids[i];
        t->name = c->calls[k].name != NULL ? c->calls[k].name : "";
    }
    return t;
}

/* Streamed: o's deltas as ToolCall messages (their strings in o). -1 on NOMEM. */
static int split_deltas_out(gen_ctx *c, const Pdspark__GenerateChunk *m, split_out *o)
{
    if (o->n_d == 0)
        return 0;
    size_t n = (size_t)o->n_d, bytes = 0;
    for (size_t i = 0; i < n; i++)
        bytes += o->d[i].to - o->d[i].from + 1;
    o->pieces = malloc(bytes);
    if (o->pieces == NULL || split_calls_alloc(o, n) != 0)
        return -1;
    char *at = o->pieces;
    for (size_t i = 0; i < n; i++) {
        const split_delta *d = &o->d[i];
        const gen_call *k = &c->calls[d->call];
        /* later deltas carry the index only, as OpenAI's streamed calls */
        Pdspark__ToolCall *t = split_call(c, m, o, i, d->call, d->first);
        if (d->to > d->from)   /* an empty first piece may find args still NULL */
            memcpy(at, k->args + d->from, d->to - d->from);
        at[d->to - d->from] = '\0';
        t->arguments_delta = at;
        at += d->to - d->from + 1;
    }
    return 0;
}

/* m's text_delta is the reply's next text: m then carries the first run of it (content certain
 * so far as its text_delta, reasoning as its reasoning_delta, then the calls whose arguments
 * became whole, or streamed their deltas, as its tool_calls), and o->more the runs after it (text
 * that followed a call), all in o (split_write sends them; split_out_free after). -1 on NOMEM
 * (m unchanged). */
static int split_chunk(gen_ctx *c, Pdspark__GenerateChunk *m, int final, split_out *o)
{
    o->c = c;
    o->stream_args = c->g->stream_args;
    if (split_run_add(o, c->calls_sent) != 0 ||
        pd_buf_append(&c->sent, &c->sent_len, &c->sent_cap, m->text_delta, strlen(m->text_delta)) != 0 ||
        pd_chat_parser_feed(c->cp, c->sent, c->sent_len, final, split_emit, o) != 0 || o->oom)
        return -1;
    int from = c->calls_sent, to = pd_chat_parser_calls_done(c->cp);
    if (o->stream_args) {
        if (split_deltas_out(c, m, o) != 0)
            return -1;
    } else if (to > from) {
        if (split_calls_alloc(o, (size_t)(to - from)) != 0)
            return -1;
        for (int k = from; k < to; k++) {
            Pdspark__ToolCall *t = split_call(c, m, o, (size_t)(k - from), k, 1);
            t->arguments_json = c->calls[k].args != NULL ? c->calls[k].args : "";
        }
    }
    if (o->n_run > 1 && (o->more = calloc((size_t)o->n_run - 1, sizeof(*o->more))) == NULL)
        return -1;
    if (!o->stream_args)
        c->calls_sent = to;
    for (int r = 0; r < o->n_run; r++) {
        const split_run *u = &o->run[r];
        Pdspark__GenerateChunk *ms = m;
        if (r > 0) {
            ms = &o->more[r - 1];
            pdspark__generate_chunk__init(ms);
            ms->version = m->version;
            ms->request_id = m->request_id;
            ms->index = m->index;
        }
        /* its ToolCall messages: tcp[a .. b) */
        int a = o->stream_args ? u->d0 : u->k0 - from;
        int b = o->stream_args ? (r + 1 < o->n_run ? u[1].d0 : o->n_d) : (r + 1 < o->n_run ? u[1].k0 : to) - from;
        ms->n_tool_calls = b > a ? (size_t)(b - a) : 0;
        ms->tool_calls = b > a ? o->tcp + a : NULL;
        ms->text_delta = u->text[0] != NULL ? u->text[0] : "";
        ms->reasoning_delta = u->text[1] != NULL ? u->text[1] : "";
    }
    return 0;
}

/* m and the runs split_chunk put after it, in order: the first carries the chunk's ids and
 * logprobs, the last its end (final, finish reason, usage, stats, device) */
static pd_status split_write(pd_rpc_call *call, Pdspark__GenerateChunk *m, split_out *o)
{
    if (o->n_run <= 1 || o->more == NULL)   /* one run, or split_chunk failed: m as it is */
        return pd_rpc_stream_write(call, &m->base);
    Pdspark__GenerateChunk *last = &o->more[o->n_run - 2];
    last->final = m->final;
    last->finish_reason = m->finish_reason;
    last->usage = m->usage;
    last->stats = m->stats;
    last->device = m->device;
    m->final = 0;
    m->finish_reason = PDSPARK__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    m->usage = NULL;
    m->stats = NULL;
    m->device = (char *)"";
    pd_status st = pd_rpc_stream_write(call, &m->base);
    for (int r = 0; r + 1 < o->n_run && st == PD_OK; r++)
        st = pd_rpc_stream_write(call, &o->more[r].base);
    return st;
}

/* With stop strings: how many bytes of pend may be sent now. *hit is set when a stop string
 * starts at the returned offset (the text from there on is dropped). At the end (final) nothing
 * is held back. */
static size_t stop_safe(gen_ctx *c, int final, int *hit)
{
    *hit = 0;
    const gen_group *g = c->g;
    size_t best = c->pend_len;
    for (int i = 0; i < g->n_stop; i++) {
        size_t sl = strlen(g->stop[i]);
        for (size_t at = 0; at + sl <= c->pend_len && at < best; at++)
            if (memcmp(c->pend + at, g->stop[i], sl) == 0) {
                best = at;
                *hit = 1;
                break;
            }
    }
    if (*hit || final)
        return best;
    /* hold back the longest tail that is a proper prefix of a stop string */
    size_t keep = 0;
    for (int i = 0; i < g->n_stop; i++) {
        size_t sl = strlen(g->stop[i]);
        for (size_t k = sl - 1; k > keep; k--)
            if (k <= c->pend_len && memcmp(c->pend + c->pend_len - k, g->stop[i], k) == 0) {
                keep = k;
                break;
            }
    }
    return c->pend_len - keep;
}

/* gRPC's strings are C strings: a NUL byte of the text (PD_TEXT_NUL) is left out. The text of
 * t[0..*len) as it goes out; *own is a copy to free when one was made. */
static const char *grpc_text(const char *t, size_t *len, char **own)
{
    *own = NULL;
    if (t == NULL || strstr(t, PD_TEXT_NUL) == NULL || (*own = malloc(*len + 1)) == NULL)
        return t;
    memcpy(*own, t, *len);
    *len = pd_text_nul_unmark(*own, *len, 1);
    return *own;
}

static void gen_on_token_text(gen_ctx *c, const decode_chunk *ch)
{
    gen_group *g = c->g;
    Pdspark__GenerateChunk m = PDSPARK__GENERATE_CHUNK__INIT;
    m.version = PD_PROTO_VERSION;
    m.request_id = (char *)ch->request_id;
    m.text_delta = (char *)ch->text;
    m.index = c->index;
    char *sendbuf = NULL;
    if (g->n_stop > 0) {
        pthread_mutex_lock(&g->mu);
        int stopped = c->stopped;
        pthread_mutex_unlock(&g->mu);
        if (stopped)
            return;
        int hit = 0;
        if (pend_add(c, ch->text, ch->text_len) != 0)
            return;
        size_t safe = stop_safe(c, 0, &hit);
        sendbuf = strndup(c->pend, safe);
        if (sendbuf == NULL)
            return;
        if (hit) {
            c->pend_len = 0;
            pthread_mutex_lock(&g->mu);
            c->stopped = 1;
            decode_handle *h = c->h;
            pthread_mutex_unlock(&g->mu);
            decode_cancel(h);   /* NULL before the handler knows h: it cancels then */
        } else {
            memmove(c->pend, c->pend + safe, c->pend_len - safe + 1);
            c->pend_len -= safe;
        }
        m.text_delta = sendbuf;
        c->n_sent_ids += (uint32_t)ch->n_ids;
    }
    if (g->want_ids) {
        m.n_token_ids = (size_t)ch->n_ids;
        m.token_ids = (uint32_t *)(uintptr_t)ch->ids;   /* int32 ids >= 0: same bits */
    }
    Pdspark__TokenLogprobs *lpm = NULL, **lpp = NULL;
    if (ch->logprobs != NULL && ch->n_ids > 0) {
        lpm = calloc((size_t)ch->n_ids, sizeof(*lpm));
        lpp = calloc((size_t)ch->n_ids, sizeof(*lpp));
        if (lpm == NULL || lpp == NULL) {
            free(lpm);
            free(lpp);
            free(sendbuf);
            return;
        }
        pd_wire_logprobs_out(ch->logprobs, ch->ids, ch->n_ids, lpm, lpp);
        m.n_logprobs = (size_t)ch->n_ids;
        m.logprobs = lpp;
    }
    /* the prompt's first token has no logprobs (nothing comes before it): entries 1.. only */
    Pdspark__TokenLogprobs *plm = NULL, **plp = NULL;
    if (ch->prompt_logprobs != NULL && ch->n_prompt > 1) {
        size_t np = (size_t)ch->n_prompt - 1;
        plm = calloc(np, sizeof(*plm));
        plp = calloc(np, sizeof(*plp));
        if (plm == NULL || plp == NULL) {
            free(plm);
            free(plp);
            free(lpm);
            free(lpp);
            free(sendbuf);
            return;
        }
        pd_wire_logprobs_out(ch->prompt_logprobs + 1, ch->prompt_ids + 1, ch->n_prompt - 1, plm, plp);
        m.n_prompt_logprobs = np;
        m.prompt_logprobs = plp;
    }
    split_out so = {0};
    pd_status st = c->cp != NULL && split_chunk(c, &m, 0, &so) != 0 ? PD_ERR_NOMEM : split_write(g->call, &m, &so);
    split_out_free(&so);
    free(sendbuf);
    free(lpm);
    free(lpp);
    free(plm);
    free(plp);
    if (st == PD_ERR_BUSY) {
        PD_LOG_WARN("grpc", "%s: client reads too slowly, cancelling", ch->request_id);
        group_cancel(g);
    } else if (st == PD_ERR_CANCELLED) {
        group_cancel(g);
    }
}

static void gen_on_token(void *ud, const decode_chunk *ch)
{
    decode_chunk cc = *ch;
    char *own = NULL;
    cc.text = grpc_text(ch->text, &cc.text_len, &own);
    gen_on_token_text(ud, &cc);
    free(own);
}

static void gen_on_done_text(gen_ctx *c, const decode_result *res)
{
    gen_group *g = c->g;
    pthread_mutex_lock(&g->mu);
    int stopped = c->stopped;
    pthread_mutex_unlock(&g->mu);
    if (res->status != PD_OK && !(stopped && res->status == PD_ERR_CANCELLED)) {
        if (group_fail(g, res->status, res->error) && g->n > 1)
            group_cancel(g);   /* the call's answer is this error once the others end */
        group_choice_end(g, 1);
        group_unref(g, 1);
        return;
    }
    char *tail = NULL;
    if (g->n_stop > 0 && !stopped) {
        int hit = 0;
        if (pend_add(c, res->text_tail, res->text_tail_len) == 0) {
            tail = strndup(c->pend, stop_safe(c, 1, &hit));
            stopped = hit;
        }
    }
    Pdspark__GenerateChunk m = PDSPARK__GENERATE_CHUNK__INIT;
    Pdspark__Usage u = PDSPARK__USAGE__INIT;
    Pdspark__DSparkStats ds = PDSPARK__DSPARK_STATS__INIT;
    m.version = PD_PROTO_VERSION;
    m.request_id = (char *)res->request_id;
    m.text_delta = (char *)res->text_tail;
    m.final = 1;
    m.index = c->index;
    m.finish_reason = finish_to_proto(res->finish);
    if (g->n_stop > 0) {
        m.text_delta = tail != NULL ? tail : "";
        if (stopped)
            m.finish_reason = PDSPARK__FINISH_REASON__FINISH_REASON_STOP;
    }
    m.device = (char *)decode_server_device(g->s);
    u.version = PD_PROTO_VERSION;
    u.prompt_tokens = (uint32_t)res->prompt_tokens;
    u.completion_tokens = stopped ? c->n_sent_ids : (uint32_t)res->n_tokens;
    m.usage = &u;
    uint32_t *apr = NULL, *pos = NULL;
    if (g->want_stats) {
        ds.version = PD_PROTO_VERSION;
        ds.rounds = (uint32_t)res->rounds;
        ds.tau = (float)res->tau;
        ds.block_size = (uint32_t)res->block_size;
        apr = malloc((size_t)(res->rounds > 0 ? res->rounds : 1) * sizeof(uint32_t));
        pos = malloc((size_t)(res->block_size > 0 ? res->block_size : 1) * sizeof(uint32_t));
        if (apr != NULL && pos != NULL) {
            uint32_t acc = 0;
            for (int i = 0; i < res->rounds; i++) {
                apr[i] = (uint32_t)res->accepted_per_round[i];
                acc += apr[i];
            }
            ds.n_accepted_per_round = (size_t)res->rounds;
            ds.accepted_per_round = apr;
            for (int k = 0; k < res->block_size && res->accepted_at_pos != NULL; k++)
                pos[k] = (uint32_t)res->accepted_at_pos[k];
            ds.n_accepted_at_position = res->accepted_at_pos != NULL ? (size_t)res->block_size : 0;
            ds.accepted_at_position = pos;
            ds.drafted_tokens = (uint32_t)(res->rounds * res->block_size);
            ds.accepted_tokens = acc;
        }
        m.stats = &ds;
    }
    split_out so = {0};
    if (m.text_delta == NULL)
        m.text_delta = "";
    if (c->cp != NULL)
        (void)split_chunk(c, &m, 1, &so);   /* NOMEM: the unsplit text goes */
    /* a reply that made calls and ended where it chose to (eos, a stop string) ends for them, as
     * the HTTP API's finish_reason "tool_calls" */
    if (c->cp != NULL && pd_chat_parser_calls(c->cp) > 0 &&
        (m.finish_reason == PDSPARK__FINISH_REASON__FINISH_REASON_EOS ||
         m.finish_reason == PDSPARK__FINISH_REASON__FINISH_REASON_STOP))
        m.finish_reason = PDSPARK__FINISH_REASON__FINISH_REASON_TOOL_CALLS;
    (void)split_write(g->call, &m, &so);
    split_out_free(&so);
    free(apr);
    free(pos);
    free(tail);
    group_choice_end(g, 1);
    group_unref(g, 1);
}

static void gen_on_done(void *ud, const decode_result *res)
{
    decode_result rr = *res;
    char *own = NULL;
    rr.text_tail = grpc_text(res->text_tail, &rr.text_tail_len, &own);
    gen_on_done_text(ud, &rr);
    free(own);
}

static void gen_rpc_done(void *arg, pd_rpc_call *call, bool cancelled)
{
    (void)call;
    gen_group *g = arg;
    if (cancelled) {
        pthread_mutex_lock(&g->mu);
        g->gone = 1;
        pthread_mutex_unlock(&g->mu);
        group_cancel(g);   /* a no-op for requests that ended */
    }
    group_unref(g, 1);
}

/* the SamplingParams field by which dr asks for structured output, NULL when none does */
static const char *guide_field(const decode_req *dr)
{
    return dr->json_object ? "json_object" : dr->json_schema != NULL ? "json_schema"
         : dr->n_choices > 0 ? "choice" : dr->regex != NULL ? "regex" : dr->ebnf != NULL ? "grammar" : NULL;
}

/* A chat (GenerateRequest.messages and its tools) read as the HTTP API reads a chat request's
 * body, so that both render it and force its calls alike: the prompt the node's chat template
 * writes (*out, malloc'd, and *len), the grammar that forces a call (*grammar, NULL when none: the
 * caller unrefs it), and the reply parser's tools and reasoning modes (pd_chat_parser_create).
 * PD_ERR_INVALID with the field at fault (chat unavailable, another prompt field also set, a bad
 * message, bad tools), PD_ERR_NOMEM. */
static pd_status chat_setup(decode_server *s, const Pdspark__GenerateRequest *rq, const decode_req *dr, char **out,
                            size_t *len, pd_grammar **grammar, int *tools, int *reasoning, pd_err *err)
{
    const char *unavailable = NULL;
    const pd_chat_template *tp = decode_server_chat_template(s, &unavailable);
    if (tp == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "%s", unavailable);
    if ((rq->prompt_text != NULL && rq->prompt_text[0] != '\0') || rq->n_prompt_token_ids > 0)
        return pd_err_set(err, PD_ERR_INVALID, "set one of prompt_text, prompt_token_ids and messages");
    if (rq->enable_thinking > 2)
        return pd_err_set(err, PD_ERR_INVALID, "enable_thinking must be 0 (the template's default), 1 (off) or "
                          "2 (on)");
    cJSON *body = NULL;
    pd_status st = pd_wire_chat_in(rq, &body, err);
    if (st != PD_OK)
        return st;
    pd_chat_tools t;
    const char *param = NULL;
    char msg[sizeof(err->msg)];
    pd_chat_opts o = PD_CHAT_OPTS_DEFAULT;
    o.enable_thinking = rq->enable_thinking == 0 ? -1 : (int)rq->enable_thinking - 1;
    /* the HTTP API's 'tools' is this API's tools_json (tool_choice is named alike) */
    if (pd_chat_tools_parse(body, &t, &param, msg, sizeof(msg)) != 0) {
        st = pd_err_set(err, PD_ERR_INVALID, "%s%s", strcmp(param, "tools") == 0 ? "tools_json: " : "", msg);
        goto out;
    }
    if (pd_chat_render(tp, cJSON_GetObjectItemCaseSensitive(body, "messages"), &t, &o, out, len, msg,
                       sizeof(msg)) != 0) {
        st = pd_err_set(err, PD_ERR_INVALID, "%s", msg);
        goto out;
    }
    pd_err gerr;
    st = decode_tools_grammar(s, &t, guide_field(dr), dr->min_tokens, grammar, &param, &gerr);
    if (st != PD_OK) {
        pd_err_set(err, st, "%s%s", strcmp(param, "tools") == 0 ? "tools_json: " : "", gerr.msg);
        free(*out);
        *out = NULL;
        goto out;
    }
    *tools = pd_chat_tools_mode(&t);
    *reasoning = decode_server_reasoning(s) ? pd_chat_reasoning_mode(tp, &o) : 0;
out:
    pd_chat_tools_free(&t);
    cJSON_Delete(body);
    return st;
}

/* SamplingParams.model_defaults: the fields left 0 take the model's values where it has them */
static void apply_model_defaults(const decode_gen_defaults *gd, decode_req *dr)
{
    if (dr->temperature == 0.0f && gd->has_temp)
        dr->temperature = gd->temperature;
    if (dr->top_p == 0.0f && gd->has_top_p)
        dr->top_p = gd->top_p;
    if (dr->top_k == 0 && gd->has_top_k)
        dr->top_k = gd->top_k;
    if (dr->min_p == 0.0f && gd->has_min_p)
        dr->min_p = gd->min_p;
    if (dr->typical_p == 0.0f && gd->has_typical_p)
        dr->typical_p = gd->typical_p;
    if (dr->repetition_penalty == 0.0f && gd->has_rep)
        dr->repetition_penalty = gd->repetition_penalty;
    if (dr->max_new_tokens == 0 && gd->has_max)
        dr->max_new_tokens = gd->max_new_tokens;
}

static pd_status handle_generate(void *ud, const ProtobufCMessage *msg, pd_rpc_call *call)
{
    decode_server *s = ud;
    const Pdspark__GenerateRequest *rq = (const Pdspark__GenerateRequest *)msg;
    pd_err err = {0};
    decode_req dr = {0};
    pd_logit_bias bias[PD_MAX_LOGIT_BIAS];   /* SamplingParams.logit_bias, for the call */
    int32_t stop_ids[PD_MAX_STOP_IDS];       /* SamplingParams.stop_token_ids (more: refused) */
    dr.request_id = rq->request_id;
    if (rq->prompt_text != NULL && rq->prompt_text[0] != '\0') {
        dr.prompt_text = rq->prompt_text;
        dr.prompt_text_len = strlen(rq->prompt_text);
    }
    int32_t *ids = NULL;
    if (rq->n_prompt_token_ids > 0) {
        ids = malloc(rq->n_prompt_token_ids * sizeof(int32_t));
        if (ids == NULL)
            return pd_err_set(&err, PD_ERR_NOMEM, "prompt ids");
        for (size_t i = 0; i < rq->n_prompt_token_ids; i++)
            ids[i] = rq->prompt_token_ids[i] > (uint32_t)INT32_MAX ? -1 : (int32_t)rq->prompt_token_ids[i];
        dr.prompt_ids = ids;
        dr.n_prompt_ids = (int)(rq->n_prompt_token_ids > (size_t)INT32_MAX ? INT32_MAX : rq->n_prompt_token_ids);
    }
    dr.top_p = 1.0f;
    if (rq->sampling != NULL) {
        const Pdspark__SamplingParams *sp = rq->sampling;
        if (sp->version != PD_PROTO_VERSION) {
            free(ids);
            pd_rpc_finish(call, PD_ERR_INVALID, "SamplingParams: protocol version mismatch");
            return PD_OK;
        }
        if (sp->n_stop > MAX_STOP) {
            free(ids);
            pd_rpc_finish(call, PD_ERR_INVALID, "more than 16 stop strings");
            return PD_OK;
        }
        for (size_t i = 0; i < sp->n_stop; i++)
            if (sp->stop[i] == NULL || sp->stop[i][0] == '\0' || strlen(sp->stop[i]) > MAX_STOP_LEN) {
                free(ids);
                pd_rpc_finish(call, PD_ERR_INVALID, "stop strings must be 1..256 bytes");
                return PD_OK;
            }
        dr.temperature = sp->temperature;
        dr.top_p = sp->top_p;
        dr.min_p = sp->min_p;
        dr.typical_p = sp->typical_p;
        dr.top_k = sp->top_k > (uint32_t)INT32_MAX ? -1 : (int)sp->top_k;
        dr.seed = sp->seed;
        dr.seed_random = sp->seed == 0;   /* the proto's "0 = server picks" */
        dr.max_new_tokens = sp->max_new_tokens > (uint32_t)INT32_MAX ? -1 : (int)sp->max_new_tokens;
        dr.ignore_eos = sp->ignore_eos;
        dr.presence_penalty = sp->presence_penalty;
        dr.frequency_penalty = sp->frequency_penalty;
        dr.repetition_penalty = sp->repetition_penalty;
        dr.min_tokens = sp->min_tokens > (uint32_t)INT32_MAX ? -1 : (int)sp->min_tokens;
        if (sp->model_defaults)
            apply_model_defaults(decode_server_gen_defaults(s), &dr);
        for (size_t i = 0; i < sp->n_stop_token_ids && i < PD_MAX_STOP_IDS; i++)
            stop_ids[i] = sp->stop_token_ids[i] > (uint32_t)INT32_MAX ? -1 : (int32_t)sp->stop_token_ids[i];
        dr.stop_token_ids = stop_ids;
        dr.n_stop_token_ids = sp->n_stop_token_ids > INT32_MAX ? INT32_MAX : (int)sp->n_stop_token_ids;
        /* decode_submit checks the ids as int32: one past INT32_MAX is refused here, by its value */
        for (size_t i = 0; i < sp->n_allowed_token_ids; i++)
            if (sp->allowed_token_ids[i] > (uint32_t)INT32_MAX) {
                char m[96];
                snprintf(m, sizeof(m), "allowed_token_ids[%zu] = %u is outside the vocabulary", i,
                         (unsigned)sp->allowed_token_ids[i]);
                free(ids);
                pd_rpc_finish(call, PD_ERR_INVALID, m);
                return PD_OK;
            }
        dr.allowed_token_ids = (const int32_t *)sp->allowed_token_ids;
        dr.n_allowed_token_ids = sp->n_allowed_token_ids > INT32_MAX ? INT32_MAX : (int)sp->n_allowed_token_ids;
        dr.bad_words = (const char *const *)sp->bad_words;   /* decode_submit checks count, sizes */
        dr.n_bad_words = sp->n_bad_words > INT32_MAX ? INT32_MAX : (int)sp->n_bad_words;
        /* more than PD_MAX_LOGIT_BIAS entries: decode_submit refuses the count */
        for (size_t i = 0; i < sp->n_logit_bias && i < PD_MAX_LOGIT_BIAS; i++) {
            const Pdspark__LogitBias *lb = sp->logit_bias[i];
            bias[i] = (pd_logit_bias){ .tok = lb == NULL || lb->token_id > INT32_MAX ? -1 : (int32_t)lb->token_id,
                                       .bias = lb != NULL ? lb->bias : 0.0f };
        }
        dr.logit_bias = bias;
        dr.n_logit_bias = sp->n_logit_bias > INT32_MAX ? INT32_MAX : (int)sp->n_logit_bias;
        /* structured output: decode_submit compiles it and refuses more than one */
        dr.json_object = sp->json_object;
        if (sp->json_schema != NULL && sp->json_schema[0] != '\0') {
            dr.json_schema = sp->json_schema;
            dr.json_schema_len = strlen(sp->json_schema);
        }
        if (sp->n_choice > 0) {
            dr.choices = (const char *const *)sp->choice;
            dr.n_choices = sp->n_choice > INT32_MAX ? INT32_MAX : (int)sp->n_choice;
        }
        if (sp->regex != NULL && sp->regex[0] != '\0') {
            dr.regex = sp->regex;
            dr.regex_len = strlen(sp->regex);
        }
        if (sp->grammar != NULL && sp->grammar[0] != '\0') {
            dr.ebnf = sp->grammar;
            dr.ebnf_len = strlen(sp->grammar);
        }
    }
    if (rq->verify_policy != NULL && rq->verify_policy[0] != '\0') {
        pd_verify_policy vp;
        pd_err perr;
        if (pd_verify_policy_parse(rq->verify_policy, &vp, &perr) != PD_OK) {
            free(ids);
            pd_rpc_finish(call, PD_ERR_INVALID, perr.msg);
            return PD_OK;
        }
        dr.verify_policy = (int)vp;
    }
    dr.verify_threshold = rq->verify_threshold;
    dr.logprobs = rq->logprobs;
    dr.skip_special = rq->skip_special_tokens;
    dr.top_logprobs = rq->top_logprobs > (uint32_t)INT32_MAX ? INT32_MAX : (int)rq->top_logprobs;
    dr.prompt_logprobs = rq->prompt_logprobs;
    dr.truncate_prompt_tokens = rq->truncate_prompt_tokens;   /* decode_submit checks it */
    /* decode_submit checks its range, and drops it without prompt_logprobs */
    dr.prompt_top_logprobs = rq->prompt_top_logprobs > (uint32_t)INT32_MAX ? INT32_MAX : (int)rq->prompt_top_logprobs;
    int64_t tmo = rq->timeout_ms > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)rq->timeout_ms;
    int64_t left = pd_rpc_call_deadline_ms(call);
    if (left != INT64_MAX && (tmo == 0 || left < tmo))
        tmo = left > 0 ? left : 1;
    dr.timeout_ms = tmo;
    if (rq->n_messages == 0 && ((rq->tools_json != NULL && rq->tools_json[0] != '\0') ||
                                (rq->tool_choice != NULL && rq->tool_choice[0] != '\0') ||
                                rq->parallel_tool_calls != 0)) {
        free(ids);
        pd_rpc_finish(call, PD_ERR_INVALID, "tools_json, tool_choice and parallel_tool_calls need messages (a chat)");
        return PD_OK;
    }
    if (rq->n > MAX_N) {
        free(ids);
        pd_rpc_finish(call, PD_ERR_INVALID, "n must be 1..16 choices");
        return PD_OK;
    }
    char *chat_text = NULL;
    pd_grammar *tools_grammar = NULL;   /* a forced tool call's (decode_submit takes its own ref) */
    int tools = 0, reasoning = 0;
    if (rq->n_messages > 0) {
        pd_err cerr;
        pd_status cst = chat_setup(s, rq, &dr, &chat_text, &dr.prompt_text_len, &tools_grammar, &tools, &reasoning,
                                   &cerr);
        if (cst != PD_OK) {
            free(ids);
            pd_rpc_finish(call, cst, cerr.msg);
            return PD_OK;
        }
        dr.prompt_text = chat_text;
        if (tools_grammar != NULL)
            dr.grammar = tools_grammar;
    }
    const int n = rq->n > 1 ? (int)rq->n : 1;
    gen_group *g = calloc(1, sizeof(*g) + (size_t)n * sizeof(gen_ctx));
    if (g == NULL) {
        free(ids);
        free(chat_text);
        pd_grammar_unref(tools_grammar);
        return pd_err_set(&err, PD_ERR_NOMEM, "call context");
    }
    atomic_init(&g->refs, 2 + n);   /* handler, call on-done, each choice's on_done */
    pthread_mutex_init(&g->mu, NULL);
    g->call = call;
    g->s = s;
    g->n = n;
    g->n_open = n;
    g->want_ids = rq->return_token_ids;
    g->want_stats = rq->return_stats;
    g->stream_args = rq->stream_tool_arguments;
    int oom = 0;
    for (int i = 0; i < n; i++) {
        g->ch[i].g = g;
        g->ch[i].index = (uint32_t)i;
        if ((tools || reasoning) && (g->ch[i].cp = pd_chat_parser_create(tools, reasoning)) == NULL)
            oom = 1;
    }
    if (oom) {
        free(ids);
        free(chat_text);
        pd_grammar_unref(tools_grammar);
        group_unref(g, 2 + n);
        return pd_err_set(&err, PD_ERR_NOMEM, "reply parser");
    }
    size_t n_stop = rq->sampling != NULL ? rq->sampling->n_stop : 0;
    if (n_stop > 0) {
        g->stop = calloc(n_stop, sizeof(char *));
        for (size_t i = 0; g->stop != NULL && i < n_stop; i++) {
            g->stop[i] = strdup(rq->sampling->stop[i]);
            if (g->stop[i] == NULL)
                break;
            g->n_stop++;
        }
        if (g->n_stop != (int)n_stop) {
            free(ids);
            free(chat_text);
            pd_grammar_unref(tools_grammar);
            group_unref(g, 2 + n);
            return pd_err_set(&err, PD_ERR_NOMEM, "stop strings");
        }
    }
    pd_rpc_call_on_done(call, gen_rpc_done, g);
    /* the choices of one prompt share a group id (with the prefix cache it is prefilled once);
     * bit 62 set and bit 63 clear keeps these apart from the HTTP front end's */
    static atomic_uint_fast64_t next_group;
    const uint64_t group = n > 1 ? 0x4000000000000000ull | (atomic_fetch_add(&next_group, 1) + 1) : 0;
    const uint64_t seed0 = dr.seed;
    const char *id0 = dr.request_id;
    pd_status st = PD_OK;
    int sub = 0;
    for (; sub < n; sub++) {
        gen_ctx *c = &g->ch[sub];
        if (n > 1) {
            dr.group = group;
            dr.seed = seed0 + (uint64_t)sub;
            if (id0 != NULL && id0[0] != '\0') {
                snprintf(c->id, sizeof(c->id), "%.80s-%d", id0, sub);
                dr.request_id = c->id;
            }
        }
        decode_handle *h = NULL;
        if ((st = decode_submit(s, &dr, gen_on_token, gen_on_done, c, &h, &err)) != PD_OK)
            break;
        pthread_mutex_lock(&g->mu);
        c->h = h;
        int gone = g->gone || c->stopped || g->err_st != PD_OK;
        pthread_mutex_unlock(&g->mu);
        if (gone)
            decode_cancel(h);
    }
    free(ids);
    free(chat_text);
    pd_grammar_unref(tools_grammar);
    if (st != PD_OK) {
        /* choices from sub on never reach the engine: they end here, with no on_done */
        PD_LOG_DEBUG("grpc", "generate refused: %s", err.msg);
        (void)group_fail(g, st, err.msg);
        if (sub > 0)
            group_cancel(g);
        group_choice_end(g, n - sub);
        group_unref(g, n - sub);
    }
    group_unref(g, 1);
    return PD_OK;
}

static pd_status handle_health(void *ud, const ProtobufCMessage *msg, pd_rpc_call *call)
{
    (void)msg;
    decode_server *s = ud;
    decode_stats st;
    decode_server_stats(s, &st);
    Pdspark__HealthReply r = PDSPARK__HEALTH_REPLY__INIT;
    r.version = PD_PROTO_VERSION;
    r.status = st.serving ? PDSPARK__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING
                          : PDSPARK__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_NOT_SERVING;
    char node[96];
    snprintf(node, sizeof(node), "decode %s %s", decode_server_mode(s), decode_server_device(s));
    r.node = node;
    r.message = st.serving ? "" : "stopping";
    r.active_requests = (uint32_t)st.active_requests;
    r.queued_requests = (uint32_t)st.queued_requests;
    r.free_kv_pages = (uint32_t)st.free_kv_pages;
    r.total_kv_pages = (uint32_t)st.total_kv_pages;
    r.staging_pages_used = (uint32_t)st.staging_pages_used;
    r.staging_pages_total = (uint32_t)st.staging_pages;
    r.staging_waits = st.staging_waits;
    r.preemptions = st.preemptions;
    r.swapped_requests = (uint32_t)st.swapped_requests;
    r.swap_bytes = st.swap_bytes;
    r.swap_space_held_bytes = st.swap_held;
    pd_rpc_reply(call, &r.base);
    return PD_OK;
}

static const pd_rpc_method methods[] = {
    { "/pdspark.Generate/Generate", PD_RPC_SERVER_STREAM, &pdspark__generate_request__descriptor,
      handle_generate },
    { "/pdspark.Generate/Health", PD_RPC_UNARY, &pdspark__health_request__descriptor, handle_health },
};

pd_status decode_grpc_start(decode_server *s, const char *addr, pd_rpc_server **out, pd_err *err)
{
    return pd_rpc_server_create(addr, methods, sizeof(methods) / sizeof(methods[0]), s, out, err);
}
