/* decode_http.c - OpenAI-compatible HTTP on the decode node (decode_http.h).
 * Owns: the pd_http server (its own libevent thread: see decode_http.h for why not the engine
 *   loop), per-request contexts (http_req) tying an evhttp_request to a decode_handle, request
 *   JSON validation, chat requests rendered by the server's template
 *   (decode_server_chat_template), stop strings (matched on the detokenized text, a possible
 *   partial match held back while streaming), response/SSE/error encoding, HTTP-side draining.
 * Not here: admission and generation (decode_server.c), metrics values (decode_metrics.c).
 * Threading: handlers and every http_req field except refs run on the HTTP thread. Engine
 *   callbacks copy a chunk / result into a message and pd_loop_post it there. An http_req holds
 *   1 + n references: the HTTP side (until its reply is complete) and each choice's engine
 *   request (until its on_done message ran, or dropped at once when the post is refused because
 *   the HTTP loop has stopped). "n" > 1 runs n engine requests of the prompt (choice i samples
 *   with seed + i), a batch of prompts n of each; the reply completes when the last ended. evhttp requests whose client went away stay ours (libevent detaches them) and are
 *   freed by the final send. */
#include "decode_http.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include "decode_metrics.h"
#include "pd_buf.h"
#include "pd_chat.h"
#include "pd_cli.h"
#include "pd_grammar.h"
#include "pd_http.h"
#include "pd_log.h"
#include "pd_tokenizer.h"
#include "pd_verify_policy.h"

#define MAX_STOP 4
#define MAX_STOP_LEN 256
#define COMPLETIONS_DEFAULT_MAX_TOKENS 16   /* OpenAI's default for /v1/completions */

/* The model's recommended sampling (its generation_config.json): what a request that leaves a
 * field out gets, as vLLM's --generation-config auto gives it. */
typedef struct {
    int has_temp, has_top_p, has_top_k, has_rep, has_max, has_min_p;
    float temperature, top_p, repetition_penalty, min_p;
    int top_k, max_new_tokens;
} gen_defaults;

struct decode_http {
    decode_server *s;
    pd_http *http;
    decode_metrics *dm;
    char model[256];
    int reasoning;                   /* --reasoning-parser qwen3: <think> text becomes
                                      * reasoning_content */
    char *api_key;                   /* NULL: requests need no key */
    gen_defaults gd;                 /* --generation-config */
    atomic_int draining;
    atomic_int inflight;
    atomic_ullong next_id;
    int closing;                     /* destroy began: messages must not touch evhttp */
    pthread_mutex_t mu;              /* guards the live list */
    struct http_req *live;
};

#define MAX_N 16                     /* choices per prompt ("n") */
#define MAX_CHOICES 128              /* choices per request: prompts x n */

/* One choice of a request: an engine request of its own ("n" > 1 runs n of them). */
typedef struct http_choice {
    struct http_req *r;
    int idx;                         /* its "index" in the response */
    decode_handle *h;
    char *gen;                       /* generated text so far (cut at a stop string) */
    size_t gen_len, gen_cap, sent, scan;
    int stopped;                     /* a stop string matched; cancel asked */
    int n_gen;                       /* tokens received (usage when a stop string ended it) */
    struct lp_tok *lps;              /* [n_lps] logprobs of the tokens kept so far ... */
    int n_lps, cap_lps, lp_sent;     /* ... of which the first lp_sent went out in stream events */
    int done;                        /* its result arrived (below) */
    pd_chat_parser *cp;              /* a streamed chat with tools or reasoning: the text split
                                      * into content, reasoning and tool calls as it comes */
    size_t lp_end;                   /* with cp: the logprobs of tokens before here went out */
    const char *finish;              /* "stop" / "length" / "tool_calls" when it ended well */
    int n_tokens, prompt_tokens, cached_tokens, rounds, block_size;
    long accepted;
} http_choice;

typedef struct http_req {
    atomic_int refs;                 /* the HTTP side, and one per engine request */
    decode_http *dh;
    struct evhttp_request *req;      /* NULL once the final reply was handed to evhttp */
    struct evhttp_connection *evcon; /* NULL once the client went away */
    int chat, stream, include_usage;
    char id[64];
    long created;
    char *stop[MAX_STOP];
    int n_stop;
    size_t max_stop;
    int keep_stop;                   /* include_stop_str_in_output (vLLM) */
    int started;                     /* SSE headers sent */
    int gone;
    int logprobs, top_logprobs;      /* the request asked for logprobs (and this many likeliest) */
    int echo, no_gen;                /* echo: every choice's text starts with the prompt (and its
                                      * logprobs with the prompt's); no_gen: max_tokens 0 */
    int tools, reasoning;            /* chat: parse <tool_call> blocks; <think>: pd_chat_parser_create's */
    int n_choice, n_done;            /* choices, and those whose result arrived */
    int n_per_prompt;                /* "n": choices i*n .. i*n+n-1 are those of prompt i */
    http_choice ch[MAX_CHOICES];
    pd_status err_st;                /* the first choice that failed: the request's answer */
    char err_msg[512];
    struct http_req *prev, *next;
} http_req;

/* One generated token's logprobs and where its text starts in http_req.gen. */
typedef struct lp_tok {
    int32_t id;
    size_t off;
    int none;                        /* the prompt's first token: no logprob (null) */
    pd_token_logprobs lp;
} lp_tok;

typedef struct {
    int n_stop;
    char *stop[MAX_STOP];
    int keep_stop;                   /* include_stop_str_in_output */
    int stream, include_usage;
    int n;                           /* choices */
    int echo, max0;                  /* "echo"; "max_tokens": 0 (with echo only) */
    pd_logit_bias *bias;             /* "logit_bias" (decode_req.logit_bias points here) */
    int vocab;                       /* the model's, to check token ids */
    decode_server *srv;              /* its grammar cache */
    const gen_defaults *gd;          /* the fields' defaults (the model's generation config) */
    int32_t stop_ids[PD_MAX_STOP_IDS];   /* "stop_token_ids" */
    char *schema;                    /* structured output: a JSON schema's text, or ... */
    char *regex;                     /* ... a regex, or ... */
    char *ebnf;                      /* ... a GBNF grammar, or ... */
    char **choices;                  /* ... the choices (decode_req points at these) */
    int n_choices;
    int n_guides;                    /* fields that asked for structured output */
    pd_grammar *grammar;             /* theirs, compiled once (decode_req.grammar) */
    const char *guide_param;         /* the (last) one of them */
} req_opts;

/* ---------------------------------------------------------------------------------------------
 * Request contexts */

/* echo: every choice's text starts as the prompt (its string, or its ids decoded); stop strings
 * are looked for after it only */
static int echo_one(http_req *r, const decode_req *dr, int from, int to, char *msg, size_t cap)
{
    char *txt = NULL;
    size_t len = 0;
    pd_err err;
    if (dr->prompt_text != NULL) {
        txt = malloc(dr->prompt_text_len + 1);
        if (txt != NULL) {
            memcpy(txt, dr->prompt_text, dr->prompt_text_len);
            txt[dr->prompt_text_len] = '\0';
            len = dr->prompt_text_len;
        }
    } else if (pd_tokenizer_decode(decode_server_tokenizer(r->dh->s), dr->prompt_ids,
                                   (size_t)dr->n_prompt_ids, 0, &txt, &len, &err) != PD_OK) {
        snprintf(msg, cap, "echo: %.400s", err.msg);
        return -1;
    }
    for (int i = from; i < to && txt != NULL; i++) {
        http_choice *c = &r->ch[i];
        c->gen = malloc(len + 1);
        if (c->gen == NULL)
            break;
        memcpy(c->gen, txt, len + 1);
        c->gen_len = len;
        c->gen_cap = len + 1;
        c->scan = len;
    }
    free(txt);
    if (txt == NULL || r->ch[to - 1].gen == NULL) {
        snprintf(msg, cap, "out of memory echoing the prompt");
        return -1;
    }
    return 0;
}

static void req_contents_free(http_req *r)
{
    for (int i = 0; i < r->n_choice; i++) {
        decode_handle_release(r->ch[i].h);
        r->ch[i].h = NULL;
        free(r->ch[i].gen);
        free(r->ch[i].lps);
        pd_chat_parser_destroy(r->ch[i].cp);
    }
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r);
}

/* Asks every choice still running to end (the client left, or one choice failed). */
static void cancel_all(http_req *r)
{
    for (int i = 0; i < r->n_choice; i++)
        if (r->ch[i].h != NULL && !r->ch[i].done)
            decode_cancel(r->ch[i].h);
}

static void req_free(http_req *r)
{
    decode_http *dh = r->dh;
    pthread_mutex_lock(&dh->mu);
    if (r->prev != NULL)
        r->prev->next = r->next;
    else if (dh->live == r)
        dh->live = r->next;
    if (r->next != NULL)
        r->next->prev = r->prev;
    pthread_mutex_unlock(&dh->mu);
    req_contents_free(r);
}

static void req_unref(http_req *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1)
        req_free(r);
}

static void on_close(struct evhttp_connection *evcon, void *arg)
{
    (void)evcon;
    http_req *r = arg;
    r->gone = 1;
    r->evcon = NULL;
    cancel_all(r);
}

/* The reply is complete (handed to evhttp): detach from the connection, drop the HTTP ref. */
static void req_finish(http_req *r)
{
    if (r->evcon != NULL)
        evhttp_connection_set_closecb(r->evcon, NULL, NULL);
    r->evcon = NULL;
    r->req = NULL;
    atomic_fetch_sub(&r->dh->inflight, 1);
    req_unref(r);
}

static int gen_append(http_choice *r, const char *t, size_t n)
{
    return pd_buf_append(&r->gen, &r->gen_len, &r->gen_cap, t, n);
}

/* ---------------------------------------------------------------------------------------------
 * Errors */

static int http_code_of(pd_status st)
{
    switch (st) {
    case PD_ERR_INVALID: return 400;
    case PD_ERR_NOT_FOUND: return 404;
    case PD_ERR_BUSY: return 429;
    case PD_ERR_CANCELLED: return 503;   /* at submission: the server is not accepting */
    case PD_ERR_PEER: return 503;
    case PD_ERR_TIMEOUT: return 504;
    case PD_ERR_UNSUPPORTED: return 501;
    default: return 500;
    }
}

static const char *err_type_of(int code)
{
    return code == 400 ? "invalid_request_error" : code == 404 ? "not_found_error"
         : code == 429 ? "rate_limit_error" : code == 503 ? "service_unavailable"
         : code == 504 ? "timeout_error" : code == 501 ? "not_implemented" : "server_error";
}

static void send_error(struct evhttp_request *req, int code, const char *param, const char *msg)
{
    pd_http_error(req, code, err_type_of(code), param, NULL, "%s", msg);
}

/* ---------------------------------------------------------------------------------------------
 * Responses */

static cJSON *resp_base(const http_req *r, int chunk)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", r->id);
    cJSON_AddStringToObject(o, "object", r->chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                                 : "text_completion");
    cJSON_AddNumberToObject(o, "created", (double)r->created);
    cJSON_AddStringToObject(o, "model", r->dh->model);
    return o;
}

/* A token's text for logprobs: its bytes as UTF-8, an incomplete sequence as U+FFFD (as the
 * tokenizer decodes one token); "" for an id the tokenizer does not know. */
static cJSON *tok_text(const pd_tokenizer *t, int32_t id)
{
    char *txt = NULL;
    pd_err err;
    if (t == NULL || pd_tokenizer_decode(t, &id, 1, 0, &txt, NULL, &err) != PD_OK)
        return cJSON_CreateString("");
    cJSON *j = cJSON_CreateString(txt);
    free(txt);
    return j;
}

/* chat: {"token", "logprob", "bytes"} of one token */
static cJSON *chat_lp_entry(const pd_tokenizer *t, int32_t id, float lp)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddItemToObject(e, "token", tok_text(t, id));
    cJSON_AddNumberToObject(e, "logprob", lp);
    cJSON *b = cJSON_AddArrayToObject(e, "bytes");
    size_t n = 0;
    const uint8_t *p = t != NULL ? pd_tokenizer_token_bytes(t, id, &n) : NULL;
    for (size_t i = 0; p != NULL && i < n; i++)
        cJSON_AddItemToArray(b, cJSON_CreateNumber(p[i]));
    return e;
}

/* Characters (UTF-8 lead bytes) in s[0..n): OpenAI's text_offset counts characters. */
static size_t utf8_chars(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

/* The "logprobs" object of a choice for tokens r->lps[from..to): chat's {"content": [...]} or
 * the completions' parallel arrays (tokens, token_logprobs, top_logprobs with the chosen token
 * added when it is not among the likeliest, text_offset). */
static cJSON *logprobs_json(const http_choice *r, int from, int to)
{
    const pd_tokenizer *t = decode_server_tokenizer(r->r->dh->s);
    cJSON *o = cJSON_CreateObject();
    if (r->r->chat) {
        cJSON *c = cJSON_AddArrayToObject(o, "content");
        for (int i = from; i < to; i++) {
            const lp_tok *k = &r->lps[i];
            cJSON *e = chat_lp_entry(t, k->id, k->lp.logprob);
            cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
            for (int j = 0; j < k->lp.n_top; j++)
                cJSON_AddItemToArray(top, chat_lp_entry(t, k->lp.top_id[j], k->lp.top_logprob[j]));
            cJSON_AddItemToArray(c, e);
        }
        cJSON_AddNullToObject(o, "refusal");
        return o;
    }
    cJSON *toks = cJSON_AddArrayToObject(o, "tokens");
    cJSON *lps = cJSON_AddArrayToObject(o, "token_logprobs");
    cJSON *tops = cJSON_AddArrayToObject(o, "top_logprobs");
    cJSON *offs = cJSON_AddArrayToObject(o, "text_offset");
    for (int i = from; i < to; i++) {
        const lp_tok *k = &r->lps[i];
        cJSON_AddItemToArray(toks, tok_text(t, k->id));
        if (k->none) {   /* the prompt's first token has nothing before it */
            cJSON_AddItemToArray(lps, cJSON_CreateNull());
            cJSON_AddItemToArray(tops, cJSON_CreateNull());
            cJSON_AddItemToArray(offs, cJSON_CreateNumber(0));
            continue;
        }
        cJSON_AddItemToArray(lps, cJSON_CreateNumber(k->lp.logprob));
        cJSON *d = cJSON_CreateObject();
        int chosen_in = 0;
        for (int j = 0; j < k->lp.n_top; j++) {
            cJSON *key = tok_text(t, k->lp.top_id[j]);
            cJSON_AddNumberToObject(d, key->valuestring, k->lp.top_logprob[j]);
            cJSON_Delete(key);
            chosen_in |= k->lp.top_id[j] == k->id;
        }
        if (!chosen_in) {
            cJSON *key = tok_text(t, k->id);
            cJSON_AddNumberToObject(d, key->valuestring, k->lp.logprob);
            cJSON_Delete(key);
        }
        cJSON_AddItemToArray(tops, d);
        size_t off = k->off < r->gen_len ? k->off : r->gen_len;
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)utf8_chars(r->gen, off)));
    }
    return o;
}

static cJSON *string_n(const char *s, size_t n)
{
    char *t = malloc(n + 1);
    if (t == NULL)
        return cJSON_CreateNull();
    memcpy(t, s, n);
    t[n] = '\0';
    cJSON *j = cJSON_CreateString(t);
    free(t);
    return j;
}

/* A new element of o's "choices" for choice ch, with its index. */
static cJSON *choice_begin(cJSON *o, const http_choice *ch)
{
    cJSON *arr = cJSON_GetObjectItemCaseSensitive(o, "choices");
    if (arr == NULL)
        arr = cJSON_AddArrayToObject(o, "choices");
    cJSON *c = cJSON_CreateObject();
    cJSON_AddItemToArray(arr, c);
    cJSON_AddNumberToObject(c, "index", ch->idx);
    return c;
}

/* The end of a choice element: the logprobs of tokens ch->lps[lp_from..lp_to) when the
 * request asked for them (else null), and the finish reason (NULL: null). */
static void choice_end(cJSON *c, const http_choice *ch, const char *finish, int lp_from, int lp_to)
{
    if (ch->r->logprobs && lp_from >= 0)
        cJSON_AddItemToObject(c, "logprobs", logprobs_json(ch, lp_from, lp_to));
    else
        cJSON_AddNullToObject(c, "logprobs");
    if (finish != NULL)
        cJSON_AddStringToObject(c, "finish_reason", finish);
    else
        cJSON_AddNullToObject(c, "finish_reason");
}

/* a tool call's id: call_ and 24 hex digits from the request id, the choice and the call */
static void call_id(const http_choice *ch, int k, char out[40])
{
    uint64_t h[2] = { 1469598103934665603ull, 1099511628211ull * 7 };
    for (int w = 0; w < 2; w++) {
        for (const char *p = ch->r->id; *p; p++)
            h[w] = (h[w] ^ (uint8_t)*p) * 1099511628211ull;
        h[w] = (h[w] ^ (uint64_t)(ch->idx * 1000 + k + w * 77)) * 1099511628211ull;
        h[w] ^= h[w] >> 29;
    }
    snprintf(out, 40, "call_%016llx%08llx", (unsigned long long)h[0], (unsigned long long)(h[1] & 0xffffffffull));
}

/* A tool call's JSON from its first piece: id, type, function name and the arguments so far
 * (streamed: with its index); a later piece streamed: index and the next arguments only. */
static cJSON *tool_call_json(const http_choice *ch, const pd_chat_piece *p, int stream)
{
    cJSON *tc = cJSON_CreateObject();
    if (stream)
        cJSON_AddNumberToObject(tc, "index", p->index);
    if (p->first) {
        char id[40];
        call_id(ch, p->index, id);
        cJSON_AddStringToObject(tc, "id", id);
        cJSON_AddStringToObject(tc, "type", "function");
    }
    cJSON *fn = cJSON_AddObjectToObject(tc, "function");
    if (p->first)
        cJSON_AddItemToObject(fn, "name", string_n(p->text, p->len));
    cJSON_AddItemToObject(fn, "arguments", string_n(p->args, p->args_len));
    return tc;
}

/* a whole reply split (non-streamed): content, reasoning and tool calls gathered */
typedef struct {
    const http_choice *ch;
    char *content, *reasoning, *args;
    size_t cl, cc, rl, rc, al, ac;
    cJSON *calls;
} split_acc;

/* the last call's arguments: what came of them */
static void split_args_done(split_acc *a)
{
    cJSON *tc = cJSON_GetArrayItem(a->calls, cJSON_GetArraySize(a->calls) - 1);
    if (tc != NULL)
        cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetObjectItemCaseSensitive(tc, "function"), "arguments",
                                               string_n(a->args != NULL ? a->args : "", a->al));
    a->al = 0;
}

static void split_piece(void *ud, const pd_chat_piece *p)
{
    split_acc *a = ud;
    if (p->kind == PD_CHAT_CONTENT) {
        pd_buf_append(&a->content, &a->cl, &a->cc, p->text, p->len);   /* NOMEM: the text is cut */
    } else if (p->kind == PD_CHAT_REASONING) {
        pd_buf_append(&a->reasoning, &a->rl, &a->rc, p->text, p->len);
    } else {
        if (p->first) {
            split_args_done(a);
            cJSON_AddItemToArray(a->calls, tool_call_json(a->ch, p, 0));
        }
        pd_buf_append(&a->args, &a->al, &a->ac, p->args, p->args_len);
    }
}

/* Appends choice ch to o's "choices"; text NULL = no text field (chat role-only / final
 * chunk). Logprobs of tokens ch->lps[lp_from..lp_to) when the request asked for them (else
 * null). A whole chat reply of a request with tools or reasoning is split: content (null when
 * there are tool calls and no text), reasoning_content, tool_calls (finish "tool_calls"). */
static void add_choice(cJSON *o, const http_choice *ch, const char *text, size_t len, int chunk,
                       const char *finish, int role, int lp_from, int lp_to)
{
    const http_req *r = ch->r;
    cJSON *c = choice_begin(o, ch);
    if (!r->chat) {
        cJSON_AddItemToObject(c, "text", string_n(text != NULL ? text : "", text != NULL ? len : 0));
    } else {
        cJSON *m = cJSON_AddObjectToObject(c, chunk ? "delta" : "message");
        if (role)
            cJSON_AddStringToObject(m, "role", "assistant");
        if (text != NULL && !chunk && (r->tools || r->reasoning)) {
            split_acc a = { .ch = ch, .calls = cJSON_CreateArray() };
            pd_chat_parser *p = pd_chat_parser_create(r->tools, r->reasoning);
            if (p != NULL)
                pd_chat_parser_feed(p, text, len, 1, split_piece, &a);
            split_args_done(&a);
            pd_chat_parser_destroy(p);
            int calls = cJSON_GetArraySize(a.calls);
            if (a.cl == 0 && calls > 0)
                cJSON_AddNullToObject(m, "content");
            else
                cJSON_AddItemToObject(m, "content", string_n(a.content != NULL ? a.content : "", a.cl));
            if (r->reasoning) {
                if (a.rl > 0)
                    cJSON_AddItemToObject(m, "reasoning_content", string_n(a.reasoning, a.rl));
                else
                    cJSON_AddNullToObject(m, "reasoning_content");
            }
            if (calls > 0) {
                cJSON_AddItemToObject(m, "tool_calls", a.calls);
                if (finish != NULL && strcmp(finish, "stop") == 0)
                    finish = "tool_calls";
            } else {
                cJSON_Delete(a.calls);
            }
            free(a.content);
            free(a.reasoning);
            free(a.args);
        } else if (text != NULL) {
            cJSON_AddItemToObject(m, "content", string_n(text, len));
        }
    }
    choice_end(c, ch, finish, lp_from, lp_to);
}

static void sse_send(http_req *r, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (s == NULL || r->req == NULL) {
        free(s);
        return;
    }
    struct evbuffer *b = evbuffer_new();
    if (b != NULL) {
        evbuffer_add_printf(b, "data: %s\n\n", s);
        evhttp_send_reply_chunk(r->req, b);
        evbuffer_free(b);
    }
    free(s);
}

static void sse_start(http_req *r)
{
    if (r->started || r->req == NULL)
        return;
    r->started = 1;
    struct evkeyvalq *oh = evhttp_request_get_output_headers(r->req);
    evhttp_add_header(oh, "Content-Type", "text/event-stream");
    evhttp_add_header(oh, "Cache-Control", "no-cache");
    evhttp_send_reply_start(r->req, 200, "OK");
    if (r->chat) {   /* the role chunk of every choice */
        cJSON *o = resp_base(r, 1);
        for (int i = 0; i < r->n_choice; i++)
            add_choice(o, &r->ch[i], "", 0, 1, NULL, 1, -1, -1);
        sse_send(r, o);
    }
}

/* A text event for gen[r->sent..safe), with the logprobs of the tokens whose text starts there */
static void sse_delta(http_choice *c, size_t safe)
{
    if (safe <= c->sent)
        return;
    int to = c->lp_sent;
    while (to < c->n_lps && c->lps[to].off < safe)
        to++;
    cJSON *o = resp_base(c->r, 1);
    add_choice(o, c, c->gen + c->sent, safe - c->sent, 1, NULL, 0, c->lp_sent, to);
    c->lp_sent = to;
    sse_send(c->r, o);
}

/* A streamed piece of a split chat reply: a delta of content, reasoning_content or a tool call
 * (its first: id, type, name and the arguments so far; then the arguments as they come), with
 * the logprobs of the tokens whose text starts before the piece's end. */
static void sse_piece(void *ud, const pd_chat_piece *p)
{
    http_choice *ch = ud;
    int to = ch->lp_sent;
    while (to < ch->n_lps && ch->lps[to].off < p->end)
        to++;
    cJSON *o = resp_base(ch->r, 1);
    cJSON *c = choice_begin(o, ch);
    cJSON *d = cJSON_AddObjectToObject(c, "delta");
    if (p->kind == PD_CHAT_TOOL_CALL)
        cJSON_AddItemToArray(cJSON_AddArrayToObject(d, "tool_calls"), tool_call_json(ch, p, 1));
    else
        cJSON_AddItemToObject(d, p->kind == PD_CHAT_CONTENT ? "content" : "reasoning_content",
                              string_n(p->text, p->len));
    choice_end(c, ch, NULL, ch->lp_sent, to);
    ch->lp_sent = to;
    sse_send(ch->r, o);
}

/* ---------------------------------------------------------------------------------------------
 * Stop strings */

static const char *find_bytes(const char *hay, size_t hn, const char *needle, size_t nn)
{
    if (nn == 0 || hn < nn)
        return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (hay[i] == needle[0] && memcmp(hay + i, needle, nn) == 0)
            return hay + i;
    return NULL;
}

/* Look for a stop string in the new text; returns how many bytes of gen may be sent. */
static size_t stop_scan(http_choice *c, int final)
{
    http_req *r = c->r;
    if (r->n_stop == 0 || c->stopped)
        return c->gen_len;
    size_t best = (size_t)-1, best_len = 0;
    for (int i = 0; i < r->n_stop; i++) {
        const char *p = find_bytes(c->gen + c->scan, c->gen_len - c->scan, r->stop[i], strlen(r->stop[i]));
        if (p != NULL && (size_t)(p - c->gen) < best) {
            best = (size_t)(p - c->gen);
            best_len = strlen(r->stop[i]);
        }
    }
    if (best != (size_t)-1) {
        if (r->keep_stop)   /* include_stop_str_in_output: the text ends with the stop string */
            best += best_len;
        c->gen_len = best;
        c->gen[best] = '\0';
        c->stopped = 1;
        /* the tokens whose text starts in the stop string are not part of the output */
        while (c->n_lps > 0 && c->lps[c->n_lps - 1].off >= best)
            c->n_lps--;
        if (c->h != NULL)
            decode_cancel(c->h);
        return c->gen_len;
    }
    /* a match may still start in the last max_stop - 1 bytes */
    c->scan = c->gen_len > r->max_stop - 1 ? c->gen_len - (r->max_stop - 1) : 0;
    if (final)
        return c->gen_len;
    size_t hold = 0;
    for (int i = 0; i < r->n_stop; i++) {
        size_t sl = strlen(r->stop[i]);
        for (size_t k = sl - 1; k > hold; k--)
            if (k <= c->gen_len && memcmp(c->gen + c->gen_len - k, r->stop[i], k) == 0) {
                hold = k;
                break;
            }
    }
    return c->gen_len - hold;
}

/* gen[0..safe) may go out (final: all of it has come) */
static void emit_safe(http_choice *c, size_t safe, int final)
{
    http_req *r = c->r;
    if (safe <= c->sent && !(final && c->cp != NULL))
        return;
    if (r->stream && !r->gone) {
        sse_start(r);
        if (c->cp != NULL)
            pd_chat_parser_feed(c->cp, c->gen != NULL ? c->gen : "", safe, final, sse_piece, c);
        else
            sse_delta(c, safe);
    }
    c->sent = safe;
}

/* ---------------------------------------------------------------------------------------------
 * Engine -> HTTP thread messages */

typedef struct {
    decode_http *dh;
    http_choice *c;
    int done;
    /* chunk */
    char *text;
    size_t len;
    int n_ids;
    lp_tok *lps;                     /* [n_ids] when the request asked for logprobs; off = the
                                      * token's start within text */
    lp_tok *plps;                    /* [n_prompt]: the first chunk of an echo with logprobs */
    int n_prompt;
    /* done */
    pd_status st;
    char error[512];
    pd_finish_reason finish;
    int n_tokens, prompt_tokens, cached_tokens, rounds, block_size;
    long accepted;
} http_msg;

/* libevent does not read from a connection while its request is being answered, so a client
 * that leaves during a non-streamed generation is noticed here, at the next chunk. */
static int peer_closed(struct evhttp_connection *evcon)
{
    struct bufferevent *bev = evcon != NULL ? evhttp_connection_get_bufferevent(evcon) : NULL;
    int fd = bev != NULL ? (int)bufferevent_getfd(bev) : -1;
    if (fd < 0)
        return 0;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static int lps_reserve(http_choice *c, int need)
{
    if (need <= c->cap_lps)
        return 0;
    int cap = c->cap_lps ? c->cap_lps : 64;
    while (cap < need)
        cap *= 2;
    lp_tok *p = realloc(c->lps, (size_t)cap * sizeof(*p));
    if (p == NULL)
        return -1;
    c->lps = p;
    c->cap_lps = cap;
    return 0;
}

static void msg_chunk(http_msg *m)
{
    http_choice *c = m->c;
    http_req *r = c->r;
    if (!r->no_gen)
        c->n_gen += m->n_ids;
    if (c->stopped || r->gone || r->req == NULL || r->err_st != PD_OK)
        return;
    if (!r->stream && peer_closed(r->evcon)) {
        PD_LOG_DEBUG("http", "%s: client went away, cancelling", r->id);
        r->gone = 1;   /* still attached: the final send below fails quietly */
        cancel_all(r);
        return;
    }
    if (m->plps != NULL) {   /* the prompt's own, in front (offsets within the echoed prompt) */
        if (lps_reserve(c, c->n_lps + m->n_prompt) != 0) {
            decode_cancel(c->h);
            return;
        }
        memcpy(c->lps + c->n_lps, m->plps, (size_t)m->n_prompt * sizeof(*m->plps));
        c->n_lps += m->n_prompt;
    }
    if (r->no_gen) {   /* max_tokens 0: the prompt only */
        emit_safe(c, stop_scan(c, 0), 0);
        return;
    }
    size_t base = c->gen_len;
    if (gen_append(c, m->text, m->len) != 0 ||
        (m->lps != NULL && lps_reserve(c, c->n_lps + m->n_ids) != 0)) {
        decode_cancel(c->h);
        return;
    }
    for (int i = 0; m->lps != NULL && i < m->n_ids; i++) {
        c->lps[c->n_lps] = m->lps[i];
        c->lps[c->n_lps++].off += base;
    }
    if (r->stream)
        sse_start(r);   /* the first chunk commits the stream to 200 */
    emit_safe(c, stop_scan(c, 0), 0);
}

/* usage over every choice: each prompt once, the completions and DSpark rounds summed (tau is
 * then accepted tokens over rounds of all of them) */
static void add_usage_all(cJSON *o, const http_req *r)
{
    int completion = 0, rounds = 0, block = 0, prompt = 0, cached = 0;
    long accepted = 0;
    for (int i = 0; i < r->n_choice; i++) {
        if (i % r->n_per_prompt == 0) {   /* the prompt's first choice */
            prompt += r->ch[i].prompt_tokens;
            cached += r->ch[i].cached_tokens;
        }
        completion += r->ch[i].n_tokens;
        rounds += r->ch[i].rounds;
        accepted += r->ch[i].accepted;
        block = r->ch[i].block_size;
    }
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", completion);
    cJSON_AddNumberToObject(u, "total_tokens", prompt + completion);
    /* the prompt tokens the prefix cache served (each prompt's first choice's) */
    cJSON *pd = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(pd, "cached_tokens", cached);
    /* extension: the DSpark loop's statistics of the request (all choices) */
    cJSON *d = cJSON_AddObjectToObject(u, "dspark");
    cJSON_AddNumberToObject(d, "rounds", rounds);
    cJSON_AddNumberToObject(d, "tau", rounds > 0 ? (double)accepted / rounds : 0.0);
    cJSON_AddNumberToObject(d, "block_size", block);
    cJSON_AddNumberToObject(d, "accepted_tokens", (double)accepted);
}

/* Every choice has its result: the rest of the answer (stream: the usage event and [DONE];
 * else the whole response or the error) and the end of the reply. */
static void reply_end(http_req *r)
{
    int ok = r->err_st == PD_OK;
    if (r->gone) {
        /* libevent detached the request when the client left (or will fail the write); the
         * send frees it either way */
        if (r->started)
            evhttp_send_reply_end(r->req);
        else
            evhttp_send_error(r->req, 499, "client closed request");
    } else if (r->stream && (r->started || ok)) {
        sse_start(r);
        if (ok && r->include_usage) {
            cJSON *o = resp_base(r, 1);
            cJSON_AddArrayToObject(o, "choices");
            add_usage_all(o, r);
            sse_send(r, o);
        } else if (!ok) {
            /* the status line is gone: the error travels as an event (as vLLM does) */
            cJSON *o = cJSON_CreateObject();
            cJSON *e = cJSON_AddObjectToObject(o, "error");
            int code = http_code_of(r->err_st);
            cJSON_AddStringToObject(e, "message", r->err_msg);
            cJSON_AddStringToObject(e, "type", err_type_of(code));
            cJSON_AddNullToObject(e, "param");
            cJSON_AddNumberToObject(e, "code", code);
            sse_send(r, o);
        }
        struct evbuffer *b = evbuffer_new();
        if (b != NULL) {
            evbuffer_add_printf(b, "data: [DONE]\n\n");
            evhttp_send_reply_chunk(r->req, b);
            evbuffer_free(b);
        }
        evhttp_send_reply_end(r->req);
    } else if (ok) {
        cJSON *o = resp_base(r, 0);
        for (int i = 0; i < r->n_choice; i++) {
            http_choice *c = &r->ch[i];
            add_choice(o, c, c->gen != NULL ? c->gen : "", c->gen_len, 0, c->finish, 1, 0, c->n_lps);
        }
        add_usage_all(o, r);
        char *s = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (s != NULL) {
            pd_http_reply(r->req, 200, NULL, s, strlen(s));
            free(s);
        } else {
            send_error(r->req, 500, NULL, "out of memory encoding the response");
        }
    } else {
        int code = http_code_of(r->err_st);
        if (r->err_st == PD_ERR_CANCELLED)
            code = 503;   /* the server is stopping */
        send_error(r->req, code, NULL, r->err_msg[0] != '\0' ? r->err_msg : pd_status_str(r->err_st));
    }
    req_finish(r);
}

static void msg_done(http_msg *m)
{
    http_choice *c = m->c;
    http_req *r = c->r;
    if (r->req == NULL) {   /* unreachable: the reply is only completed here */
        req_unref(r);
        return;
    }
    c->done = 1;
    r->n_done++;
    int ok = m->st == PD_OK || (m->st == PD_ERR_CANCELLED && c->stopped);
    if (r->no_gen) {
        m->len = 0;
        m->n_tokens = 0;
        m->finish = PD_FINISH_LENGTH;
    }
    if (ok && !c->stopped && m->len > 0 && gen_append(c, m->text, m->len) != 0) {
        ok = 0;
        m->st = PD_ERR_NOMEM;
        snprintf(m->error, sizeof(m->error), "out of memory");
    }
    c->n_tokens = m->n_tokens > c->n_gen ? m->n_tokens : c->n_gen;
    c->prompt_tokens = m->prompt_tokens;
    c->cached_tokens = m->cached_tokens;
    c->rounds = m->rounds;
    c->block_size = m->block_size;
    c->accepted = m->accepted;
    if (!ok && r->err_st == PD_OK) {
        /* the first failure is the request's answer; the other choices are not needed */
        r->err_st = m->st;
        snprintf(r->err_msg, sizeof(r->err_msg), "%s", m->error);
        cancel_all(r);
    }
    if (ok && r->err_st == PD_OK) {
        emit_safe(c, stop_scan(c, 1), 1);
        c->finish = !c->stopped && m->finish == PD_FINISH_LENGTH ? "length" : "stop";
        if (c->cp != NULL && pd_chat_parser_calls(c->cp) > 0 && strcmp(c->finish, "stop") == 0)
            c->finish = "tool_calls";
        if (r->stream && !r->gone) {
            /* this choice's last event: its finish reason and the logprobs not sent yet (the
             * last choice's carries the usage of all, as with one choice) */
            sse_start(r);
            cJSON *o = resp_base(r, 1);
            add_choice(o, c, r->chat ? NULL : "", 0, 1, c->finish, 0,
                       c->lp_sent < c->n_lps ? c->lp_sent : -1, c->n_lps);
            if (r->n_done == r->n_choice)
                add_usage_all(o, r);
            sse_send(r, o);
        }
    }
    if (r->n_done == r->n_choice)
        reply_end(r);
    req_unref(r);   /* this choice's engine reference */
}

static void msg_run(void *arg)
{
    http_msg *m = arg;
    if (m->dh->closing) {
        /* destroy freed every context already; only the message is left */
    } else if (m->done) {
        msg_done(m);
    } else {
        msg_chunk(m);
    }
    free(m->text);
    free(m->lps);
    free(m->plps);
    free(m);
}

static void cb_token(void *ud, const decode_chunk *c)
{
    http_choice *ch = ud;
    http_msg *m = calloc(1, sizeof(*m));
    char *t = malloc(c->text_len + 1);
    if (m == NULL || t == NULL) {
        free(m);
        free(t);
        return;
    }
    memcpy(t, c->text, c->text_len);
    t[c->text_len] = '\0';
    if (c->logprobs != NULL && c->n_ids > 0) {
        if ((m->lps = malloc((size_t)c->n_ids * sizeof(*m->lps))) == NULL) {
            free(m);
            free(t);
            return;
        }
        size_t off = 0;
        for (int i = 0; i < c->n_ids; i++) {
            m->lps[i] = (lp_tok){ .id = c->ids[i], .off = off, .lp = c->logprobs[i] };
            off += c->piece_len != NULL ? c->piece_len[i] : 0;
        }
    }
    if (c->prompt_logprobs != NULL && c->n_prompt > 0) {
        const pd_tokenizer *tk = decode_server_tokenizer(ch->r->dh->s);
        if ((m->plps = malloc((size_t)c->n_prompt * sizeof(*m->plps))) == NULL) {
            free(m->lps);
            free(m);
            free(t);
            return;
        }
        size_t off = 0, bl = 0;
        for (int i = 0; i < c->n_prompt; i++) {
            m->plps[i] = (lp_tok){ .id = c->prompt_ids[i], .off = off, .none = i == 0,
                                   .lp = c->prompt_logprobs[i] };
            if (pd_tokenizer_token_bytes(tk, c->prompt_ids[i], &bl) != NULL)
                off += bl;
        }
        m->n_prompt = c->n_prompt;
    }
    m->n_ids = c->n_ids;
    m->dh = ch->r->dh;
    m->c = ch;
    m->text = t;
    m->len = c->text_len;
    if (pd_loop_post(pd_http_loop(ch->r->dh->http), msg_run, m) != PD_OK) {
        free(t);
        free(m->lps);
        free(m->plps);
        free(m);
    }
}

static void cb_done(void *ud, const decode_result *res)
{
    http_choice *ch = ud;
    http_req *r = ch->r;
    http_msg *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        /* cannot tell the HTTP side; the client gets nothing more (its connection closes at
         * shutdown at the latest) */
        PD_LOG_ERROR("http", "%s: out of memory finishing the request", r->id);
        req_unref(r);
        return;
    }
    m->dh = r->dh;
    m->c = ch;
    m->done = 1;
    if (res->text_tail_len > 0) {
        m->text = malloc(res->text_tail_len + 1);
        if (m->text != NULL) {
            memcpy(m->text, res->text_tail, res->text_tail_len);
            m->text[res->text_tail_len] = '\0';
            m->len = res->text_tail_len;
        }
    }
    m->st = res->status;
    snprintf(m->error, sizeof(m->error), "%s", res->error != NULL ? res->error : "");
    m->finish = res->finish;
    m->n_tokens = res->n_tokens;
    m->prompt_tokens = res->prompt_tokens;
    m->cached_tokens = res->cached_tokens;
    m->rounds = res->rounds;
    m->block_size = res->block_size;
    for (int i = 0; i < res->rounds && res->accepted_per_round != NULL; i++)
        m->accepted += res->accepted_per_round[i];
    if (pd_loop_post(pd_http_loop(r->dh->http), msg_run, m) != PD_OK) {
        free(m->text);
        free(m);
        req_unref(r);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Request parsing */

/* Optional field: absent or null -> 0 (untouched); wrong type -> -1 with a message. */
static int get_number(const cJSON *o, const char *k, double *v, char *msg, size_t cap)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    if (it == NULL || cJSON_IsNull(it))
        return 0;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble)) {
        snprintf(msg, cap, "'%s' must be a number", k);
        return -1;
    }
    *v = it->valuedouble;
    return 1;
}

static int get_int(const cJSON *o, const char *k, double lo, double hi, long long *v, char *msg,
                   size_t cap)
{
    double d = 0;
    int rc = get_number(o, k, &d, msg, cap);
    if (rc <= 0) {
        if (rc < 0)
            snprintf(msg, cap, "'%s' must be an integer", k);
        return rc;
    }
    if (d != floor(d)) {
        snprintf(msg, cap, "'%s' must be an integer", k);
        return -1;
    }
    if (d < lo || d > hi) {
        snprintf(msg, cap, "'%s' must be in [%.0f, %.0f], got %.0f", k, lo, hi, d);
        return -1;
    }
    *v = (long long)d;
    return 1;
}

static int get_bool(const cJSON *o, const char *k, int *v, char *msg, size_t cap)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    if (it == NULL || cJSON_IsNull(it))
        return 0;
    if (!cJSON_IsBool(it)) {
        snprintf(msg, cap, "'%s' must be a boolean", k);
        return -1;
    }
    *v = cJSON_IsTrue(it);
    return 1;
}

static void opts_free(req_opts *o)
{
    free(o->bias);
    o->bias = NULL;
    free(o->schema);
    free(o->regex);
    free(o->ebnf);
    pd_grammar_unref(o->grammar);
    o->grammar = NULL;
    for (int i = 0; i < o->n_choices; i++)
        free(o->choices[i]);
    free(o->choices);
    o->schema = o->regex = o->ebnf = NULL;
    o->choices = NULL;
    o->n_choices = 0;
    for (int i = 0; i < o->n_stop; i++)
        free(o->stop[i]);
    o->n_stop = 0;
}

/* structured output, one field's worth: a JSON schema (an object, or its text), choices (an array
 * of strings) or a regex (a string); the text compiles in decode_submit */
enum { GUIDE_SCHEMA, GUIDE_CHOICE, GUIDE_REGEX, GUIDE_GRAMMAR };

static int guide_set(const cJSON *v, int kind, const char *name, decode_req *dr, req_opts *o, char *msg,
                     size_t cap)
{
    o->guide_param = strchr(name, '.') != NULL && strncmp(name, "response_format", 15) == 0 ? "response_format"
                   : strncmp(name, "structured_outputs", 18) == 0 ? "structured_outputs" : name;
    if (++o->n_guides > 1) {
        snprintf(msg, cap, "'%s': give only one of response_format, guided_json, guided_choice, "
                 "guided_regex, guided_grammar and structured_outputs", name);
        return -1;
    }
    if (kind == GUIDE_SCHEMA) {
        if (cJSON_IsString(v))
            o->schema = strdup(v->valuestring);
        else if (cJSON_IsObject(v))
            o->schema = cJSON_PrintUnformatted(v);
        else {
            snprintf(msg, cap, "'%s' must be a JSON schema (an object, or its text)", name);
            return -1;
        }
        if (o->schema == NULL)
            goto nomem;
        dr->json_schema = o->schema;
        dr->json_schema_len = strlen(o->schema);
        return 0;
    }
    if (kind == GUIDE_GRAMMAR) {
        if (!cJSON_IsString(v)) {
            snprintf(msg, cap, "'%s' must be a string (a GBNF grammar)", name);
            return -1;
        }
        if ((o->ebnf = strdup(v->valuestring)) == NULL)
            goto nomem;
        dr->ebnf = o->ebnf;
        dr->ebnf_len = strlen(o->ebnf);
        return 0;
    }
    if (kind == GUIDE_REGEX) {
        if (!cJSON_IsString(v)) {
            snprintf(msg, cap, "'%s' must be a string (a regular expression)", name);
            return -1;
        }
        if ((o->regex = strdup(v->valuestring)) == NULL)
            goto nomem;
        dr->regex = o->regex;
        dr->regex_len = strlen(o->regex);
        return 0;
    }
    int n = cJSON_IsArray(v) ? cJSON_GetArraySize(v) : 0;
    if (n < 1 || n > PD_GRAMMAR_MAX_CHOICES) {
        snprintf(msg, cap, "'%s' must be an array of 1..%d strings", name, PD_GRAMMAR_MAX_CHOICES);
        return -1;
    }
    if ((o->choices = calloc((size_t)n, sizeof(char *))) == NULL)
        goto nomem;
    for (const cJSON *it = v->child; it != NULL; it = it->next) {
        if (!cJSON_IsString(it)) {
            snprintf(msg, cap, "'%s' must be an array of strings", name);
            return -1;
        }
        if ((o->choices[o->n_choices++] = strdup(it->valuestring)) == NULL)
            goto nomem;
    }
    dr->choices = (const char *const *)o->choices;
    dr->n_choices = n;
    return 0;
nomem:
    snprintf(msg, cap, "out of memory");
    return -1;
}

/* OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
 * {"name", "schema", "strict"}}), vLLM's guided_json / guided_choice / guided_regex /
 * guided_grammar (GBNF) and its structured_outputs {"json" | "choice" | "regex" | "grammar" |
 * "json_object"} */
static int parse_guides(const cJSON *root, decode_req *dr, req_opts *o, const char **param, char *msg,
                        size_t cap)
{
    *param = "response_format";
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(root, "response_format");
    if (rf != NULL && !cJSON_IsNull(rf)) {
        const cJSON *ty = cJSON_IsObject(rf) ? cJSON_GetObjectItemCaseSensitive(rf, "type") : NULL;
        const char *t = cJSON_IsString(ty) ? ty->valuestring : "";
        if (strcmp(t, "json_object") == 0) {
            o->n_guides++;
            o->guide_param = "response_format";
            dr->json_object = 1;
        } else if (strcmp(t, "json_schema") == 0) {
            const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
            const cJSON *sc = cJSON_IsObject(js) ? cJSON_GetObjectItemCaseSensitive(js, "schema") : NULL;
            if (sc == NULL) {
                snprintf(msg, cap, "'response_format': type json_schema needs json_schema.schema");
                return -1;
            }
            if (guide_set(sc, GUIDE_SCHEMA, "response_format.json_schema.schema", dr, o, msg, cap) < 0)
                return -1;
        } else if (strcmp(t, "text") != 0) {
            snprintf(msg, cap, "'response_format' must be an object whose type is text, json_object or json_schema");
            return -1;
        }
    }
    static const struct { const char *key; int kind; } vllm[] = {
        { "guided_json", GUIDE_SCHEMA }, { "guided_choice", GUIDE_CHOICE }, { "guided_regex", GUIDE_REGEX },
        { "guided_grammar", GUIDE_GRAMMAR },
    };
    for (size_t i = 0; i < sizeof(vllm) / sizeof(vllm[0]); i++) {
        *param = vllm[i].key;
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, vllm[i].key);
        if (v != NULL && !cJSON_IsNull(v) && guide_set(v, vllm[i].kind, vllm[i].key, dr, o, msg, cap) < 0)
            return -1;
    }
    *param = "structured_outputs";
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "structured_outputs");
    if (so != NULL && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) {
            snprintf(msg, cap, "'structured_outputs' must be an object");
            return -1;
        }
        static const struct { const char *key, *name; int kind; } keys[] = {
            { "json", "structured_outputs.json", GUIDE_SCHEMA },
            { "choice", "structured_outputs.choice", GUIDE_CHOICE },
            { "regex", "structured_outputs.regex", GUIDE_REGEX },
            { "grammar", "structured_outputs.grammar", GUIDE_GRAMMAR },
        };
        for (const cJSON *it = so->child; it != NULL; it = it->next) {
            if (cJSON_IsNull(it))
                continue;
            int k = -1;
            for (int q = 0; q < 4 && k < 0; q++)
                k = strcmp(it->string, keys[q].key) == 0 ? q : -1;
            if (k >= 0) {
                if (guide_set(it, keys[k].kind, keys[k].name, dr, o, msg, cap) < 0)
                    return -1;
            } else if (strcmp(it->string, "json_object") == 0) {
                if (cJSON_IsTrue(it)) {
                    if (++o->n_guides > 1) {
                        snprintf(msg, cap, "'structured_outputs': give only one kind of structured output");
                        return -1;
                    }
                    o->guide_param = "structured_outputs";
                    dr->json_object = 1;
                }
            } else {
                snprintf(msg, cap, "'structured_outputs.%.40s' is not supported (json, choice, regex, grammar, "
                         "json_object)",
                         it->string);
                return -1;
            }
        }
    }
    if (o->n_guides > 1) {
        snprintf(msg, cap, "give only one of response_format, guided_json, guided_choice, guided_regex, "
                 "guided_grammar and structured_outputs");
        return -1;
    }
    if (o->n_guides == 0)
        return 0;
    if (dr->min_tokens > 0) {
        *param = "min_tokens";
        snprintf(msg, cap, "'min_tokens' cannot be combined with structured output (the grammar decides where "
                 "the output may end)");
        return -1;
    }
    /* compiled here, so that a bad schema or regex is answered with its parameter's name, and
     * once for every choice of the request */
    pd_grammar *g = NULL;
    pd_err gerr;
    pd_status gst = decode_compile_guide(o->srv, dr, &g, &gerr);
    if (gst == PD_OK) {
        o->grammar = dr->grammar = g;
        dr->json_object = 0;
        dr->json_schema = dr->regex = dr->ebnf = NULL;
        dr->choices = NULL;
        dr->n_choices = 0;
    } else {
        *param = o->guide_param;
        snprintf(msg, cap, "%s", gerr.msg);
        return -1;
    }
    return 0;
}

/* The sampling fields shared by both endpoints. Returns 0 or -1 with msg and *param set. */
static int parse_common(const cJSON *root, int chat, decode_req *dr, req_opts *o,
                        const char **param, char *msg, size_t cap)
{
    double d;
    long long ll;
    int rc, b = 0;
    dr->top_p = 1.0f;
    dr->max_new_tokens = chat ? 0 : COMPLETIONS_DEFAULT_MAX_TOKENS;
    const char *mt = "max_tokens";
    if (chat && cJSON_GetObjectItemCaseSensitive(root, "max_completion_tokens") != NULL &&
        !cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(root, "max_completion_tokens")))
        mt = "max_completion_tokens";
    *param = mt;
    if ((rc = get_int(root, mt, -1e18, 1e18, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (ll < 0 || (ll == 0 && chat)) {
            snprintf(msg, cap, "'%s' must be at least 1, got %lld", mt, ll);
            return -1;
        }
        o->max0 = ll == 0;   /* allowed with echo (scoring a prompt), checked below */
        dr->max_new_tokens = ll == 0 ? 1 : ll > 1000000000 ? 1000000000 : (int)ll;
    } else if (o->gd->has_max) {
        dr->max_new_tokens = o->gd->max_new_tokens;
    }
    *param = "temperature";
    if ((rc = get_number(root, "temperature", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (d < 0 || d > 2) {
            snprintf(msg, cap, "'temperature' must be in [0, 2], got %g", d);
            return -1;
        }
        dr->temperature = (float)d;
    } else {
        dr->temperature = o->gd->has_temp ? o->gd->temperature : 1.0f;   /* the model's, else OpenAI's */
    }
    *param = "top_p";
    if ((rc = get_number(root, "top_p", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (!(d > 0 && d <= 1)) {
            snprintf(msg, cap, "'top_p' must be in (0, 1], got %g", d);
            return -1;
        }
        dr->top_p = (float)d;
    } else if (o->gd->has_top_p) {
        dr->top_p = o->gd->top_p;
    }
    *param = "min_p";   /* extension (vLLM, SGLang, llama.cpp) */
    if ((rc = get_number(root, "min_p", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (!(d >= 0 && d <= 1)) {
            snprintf(msg, cap, "'min_p' must be in [0, 1], got %g", d);
            return -1;
        }
        dr->min_p = (float)d;
    } else if (o->gd->has_min_p) {
        dr->min_p = o->gd->min_p;
    }
    *param = "top_k";   /* extension (vLLM, llama.cpp) */
    if ((rc = get_int(root, "top_k", -1, 1e9, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0)
        dr->top_k = ll < 0 ? 0 : (int)ll;
    else if (o->gd->has_top_k)
        dr->top_k = o->gd->top_k;
    *param = "seed";
    if ((rc = get_int(root, "seed", -9.2e18, 9.2e18, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0)
        dr->seed = (uint64_t)ll;
    *param = "verify";   /* extension: DSpark verification length policy of this request */
    const cJSON *vp = cJSON_GetObjectItemCaseSensitive(root, "verify");
    if (vp != NULL && !cJSON_IsNull(vp)) {
        pd_verify_policy pol;
        pd_err perr;
        if (!cJSON_IsString(vp)) {
            snprintf(msg, cap, "'verify' must be a string: full, threshold or scheduled");
            return -1;
        }
        if (pd_verify_policy_parse(vp->valuestring, &pol, &perr) != PD_OK) {
            snprintf(msg, cap, "'verify': %.400s", perr.msg);
            return -1;
        }
        dr->verify_policy = (int)pol;
    }
    *param = "verify_threshold";
    if ((rc = get_number(root, "verify_threshold", &d, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (!(d > 0 && d <= 1)) {
            snprintf(msg, cap, "'verify_threshold' must be in (0, 1], got %g", d);
            return -1;
        }
        dr->verify_threshold = (float)d;
    }
    /* n choices: n engine requests of the same prompt, choice i sampling with seed + i */
    *param = "n";
    o->n = 1;
    if ((rc = get_int(root, "n", 1, MAX_N, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0)
        o->n = (int)ll;
    *param = "best_of";
    if ((rc = get_int(root, "best_of", -1e18, 1e18, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0 && ll < o->n) {
        snprintf(msg, cap, "'best_of' (%lld) must be >= 'n' (%d)", ll, o->n);
        return -1;
    }
    if (rc > 0 && ll > o->n) {
        snprintf(msg, cap, "'best_of' > 'n' is not supported (it ranks extra completions by "
                 "likelihood and returns n of them)");
        return -1;
    }
    /* fields that would change the answer if they were honoured: refused, not ignored (a number
     * equal to its no-op value, false and [] pass) */
    enum { ONLY_COMPLETIONS, ONLY_CHAT, BOTH };
    static const struct { const char *key, *why; int scope; double noop; } unsupported[] = {
        { "suffix", "'suffix' (text after the insertion) is not supported", ONLY_COMPLETIONS, 0 },
        { "functions", "'functions' (the legacy function calling) is not supported; send 'tools'", ONLY_CHAT, 0 },
        { "function_call", "'function_call' (the legacy function calling) is not supported; send 'tool_choice'",
          ONLY_CHAT, 0 },
        { "typical_p", "'typical_p' is not supported (1 is accepted: off)", BOTH, 1 },
        { "use_beam_search", "beam search is not supported", BOTH, 0 },
        { "bad_words", "'bad_words' is not supported", BOTH, 0 },
        { "allowed_token_ids", "'allowed_token_ids' is not supported (logit_bias can favour tokens)", BOTH, 0 },
        { "logits_processors", "'logits_processors' are not supported", BOTH, 0 },
        { "truncate_prompt_tokens", "'truncate_prompt_tokens' is not supported (a prompt over the context is a "
          "400)", BOTH, 0 },
        { "prompt_logprobs", "'prompt_logprobs' (vLLM's per-token dicts) is not supported; /v1/completions with "
          "'echo': true and 'logprobs' gives the prompt's logprobs", BOTH, -1 },
        { "return_tokens_as_token_ids", "'return_tokens_as_token_ids' is not supported (the gRPC API returns ids)",
          BOTH, 0 },
        { "chat_template", "'chat_template' per request is not supported (the node's template is used; "
          "decode_node --chat-template sets it)", ONLY_CHAT, 0 },
    };
    for (size_t k = 0; k < sizeof(unsupported) / sizeof(unsupported[0]); k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, unsupported[k].key);
        if (v == NULL || cJSON_IsNull(v) || cJSON_IsFalse(v) || (cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0) ||
            (cJSON_IsNumber(v) && v->valuedouble == unsupported[k].noop) ||
            (unsupported[k].scope != BOTH && unsupported[k].scope != (chat ? ONLY_CHAT : ONLY_COMPLETIONS)))
            continue;
        *param = unsupported[k].key;
        snprintf(msg, cap, "%s", unsupported[k].why);
        return -1;
    }
    *param = "stream";
    if (get_bool(root, "stream", &o->stream, msg, cap) < 0)
        return -1;
    *param = "ignore_eos";   /* extension (vLLM) */
    if (get_bool(root, "ignore_eos", &b, msg, cap) < 0)
        return -1;
    dr->ignore_eos = b;
    *param = "skip_special_tokens";   /* extension (vLLM): special tokens add no text unless false */
    b = 1;
    if (get_bool(root, "skip_special_tokens", &b, msg, cap) < 0)
        return -1;
    dr->skip_special = b;
    /* completions: the prompt comes back in front of the text (and, with logprobs, its own
     * logprobs in front of the completion's: scoring a text, as evaluation harnesses do) */
    *param = "echo";
    b = 0;
    if (get_bool(root, "echo", &b, msg, cap) < 0)
        return -1;
    if (b && chat) {
        snprintf(msg, cap, "'echo' applies to /v1/completions only");
        return -1;
    }
    o->echo = b;
    if (o->max0 && !b) {
        *param = mt;
        snprintf(msg, cap, "'%s' must be at least 1 (0 only with 'echo': true), got 0", mt);
        return -1;
    }
    /* completions: "logprobs": N (0..20) asks for them and the N likeliest; chat: "logprobs":
     * true, and "top_logprobs": N */
    *param = "logprobs";
    if (chat) {
        b = 0;
        if (get_bool(root, "logprobs", &b, msg, cap) < 0)
            return -1;
        dr->logprobs = b;
        *param = "top_logprobs";
        if ((rc = get_int(root, "top_logprobs", 0, PD_MAX_TOP_LOGPROBS, &ll, msg, cap)) < 0)
            return -1;
        if (rc > 0 && !b) {
            snprintf(msg, cap, "'top_logprobs' needs 'logprobs': true");
            return -1;
        }
        dr->top_logprobs = rc > 0 ? (int)ll : 0;
    } else {
        if ((rc = get_int(root, "logprobs", 0, PD_MAX_TOP_LOGPROBS, &ll, msg, cap)) < 0)
            return -1;
        dr->logprobs = rc > 0;
        dr->top_logprobs = rc > 0 ? (int)ll : 0;
        dr->prompt_logprobs = dr->logprobs && o->echo;
    }
    /* OpenAI's presence/frequency penalties and the repetition penalty (extension, vLLM) */
    const char *pens[] = {"presence_penalty", "frequency_penalty", "repetition_penalty"};
    float *pv[] = {&dr->presence_penalty, &dr->frequency_penalty, &dr->repetition_penalty};
    for (int i = 0; i < 3; i++) {
        *param = pens[i];
        d = i == 2 && o->gd->has_rep ? o->gd->repetition_penalty : 0;
        if (get_number(root, pens[i], &d, msg, cap) < 0)
            return -1;
        float one[3] = {0.0f, 0.0f, 0.0f};
        one[i] = *pv[i] = (float)d;
        pd_err perr;
        if (pd_penalties_check(one[0], one[1], one[2], &perr) != PD_OK) {
            snprintf(msg, cap, "%s", perr.msg);
            return -1;
        }
    }
    /* OpenAI's logit_bias: {"token id": bias in [-100, 100]}; min_tokens (vLLM): no eos before */
    *param = "logit_bias";
    const cJSON *lb = cJSON_GetObjectItemCaseSensitive(root, "logit_bias");
    if (lb != NULL && !cJSON_IsNull(lb)) {
        int n = cJSON_GetArraySize(lb);
        if (!cJSON_IsObject(lb) || n > PD_MAX_LOGIT_BIAS) {
            snprintf(msg, cap, "'logit_bias' must be an object of at most %d \"token id\": bias pairs",
                     PD_MAX_LOGIT_BIAS);
            return -1;
        }
        if (n > 0 && (o->bias = calloc((size_t)n, sizeof(*o->bias))) == NULL) {
            snprintf(msg, cap, "out of memory");
            return -1;
        }
        int i = 0;
        for (const cJSON *it = lb->child; it != NULL; it = it->next, i++) {
            char *end = NULL;
            long id = strtol(it->string, &end, 10);
            if (it->string[0] == '\0' || *end != '\0' || id < 0 || id > INT32_MAX || !cJSON_IsNumber(it)) {
                snprintf(msg, cap, "'logit_bias': \"%.40s\" must be a token id with a number", it->string);
                return -1;
            }
            o->bias[i] = (pd_logit_bias){ .tok = (int32_t)id, .bias = (float)it->valuedouble };
        }
        pd_err berr;
        if (pd_logit_bias_check(o->bias, n, o->vocab, &berr) != PD_OK) {
            snprintf(msg, cap, "%s", berr.msg);
            return -1;
        }
        dr->logit_bias = o->bias;
        dr->n_logit_bias = n;
    }
    *param = "stop_token_ids";   /* extension (vLLM) */
    const cJSON *sti = cJSON_GetObjectItemCaseSensitive(root, "stop_token_ids");
    if (sti != NULL && !cJSON_IsNull(sti)) {
        int n = cJSON_IsArray(sti) ? cJSON_GetArraySize(sti) : -1;
        if (n < 0 || n > PD_MAX_STOP_IDS) {
            snprintf(msg, cap, "'stop_token_ids' must be an array of at most %d token ids", PD_MAX_STOP_IDS);
            return -1;
        }
        int i = 0;
        for (const cJSON *it = sti->child; it != NULL; it = it->next, i++) {
            if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
                it->valuedouble >= o->vocab) {
                snprintf(msg, cap, "'stop_token_ids'[%d] is not a token id in 0..%d", i, o->vocab - 1);
                return -1;
            }
            o->stop_ids[i] = (int32_t)it->valuedouble;
        }
        dr->stop_token_ids = o->stop_ids;
        dr->n_stop_token_ids = n;
    }
    *param = "min_tokens";
    if ((rc = get_int(root, "min_tokens", 0, 1e9, &ll, msg, cap)) < 0)
        return -1;
    if (rc > 0) {
        if (dr->max_new_tokens > 0 && ll > dr->max_new_tokens) {
            snprintf(msg, cap, "'min_tokens' (%lld) must not exceed the maximum (%d)", ll, dr->max_new_tokens);
            return -1;
        }
        dr->min_tokens = (int)ll;
    }
    if (parse_guides(root, dr, o, param, msg, cap) < 0)
        return -1;
    *param = "stream_options";
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(root, "stream_options");
    if (so != NULL && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) {
            snprintf(msg, cap, "'stream_options' must be an object");
            return -1;
        }
        if (get_bool(so, "include_usage", &o->include_usage, msg, cap) < 0)
            return -1;
    }
    *param = "stop";
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(root, "stop");
    if (st != NULL && !cJSON_IsNull(st)) {
        const cJSON *one = cJSON_IsString(st) ? st : NULL;
        if (one == NULL && !cJSON_IsArray(st)) {
            snprintf(msg, cap, "'stop' must be a string or an array of strings");
            return -1;
        }
        int n = one != NULL ? 1 : cJSON_GetArraySize(st);
        if (n > MAX_STOP) {
            snprintf(msg, cap, "'stop' takes at most %d strings", MAX_STOP);
            return -1;
        }
        for (int i = 0; i < n; i++) {
            const cJSON *it = one != NULL ? one : cJSON_GetArrayItem(st, i);
            if (!cJSON_IsString(it)) {
                snprintf(msg, cap, "'stop' must be a string or an array of strings");
                return -1;
            }
            size_t l = strlen(it->valuestring);
            if (l == 0 || l > MAX_STOP_LEN) {
                snprintf(msg, cap, "stop strings must have 1 to %d bytes", MAX_STOP_LEN);
                return -1;
            }
            if ((o->stop[o->n_stop] = strdup(it->valuestring)) == NULL) {
                snprintf(msg, cap, "out of memory");
                return -1;
            }
            o->n_stop++;
        }
    }
    *param = "include_stop_str_in_output";
    if (get_bool(root, "include_stop_str_in_output", &o->keep_stop, msg, cap) < 0)
        return -1;
    *param = NULL;
    return 0;
}

/* One prompt of a completions request: its text (borrowed from the request JSON) or its ids. */
typedef struct {
    const char *text;
    size_t len;
    int32_t *ids;                    /* malloc'd */
    int n_ids;
} prompt_in;

static int parse_one_prompt(const cJSON *p, prompt_in *out, char *msg, size_t cap)
{
    if (cJSON_IsString(p)) {
        if (p->valuestring[0] == '\0') {
            snprintf(msg, cap, "'prompt' must not be empty");
            return -1;
        }
        out->text = p->valuestring;
        out->len = strlen(p->valuestring);
        return 0;
    }
    int n = cJSON_IsArray(p) ? cJSON_GetArraySize(p) : -1;
    if (n < 0) {
        snprintf(msg, cap, "'prompt' must be a string, an array of token ids, or an array of either");
        return -1;
    }
    if (n == 0) {
        snprintf(msg, cap, "'prompt' must not be empty");
        return -1;
    }
    if ((out->ids = malloc((size_t)n * sizeof(int32_t))) == NULL) {
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    int i = 0;
    for (const cJSON *it = p->child; it != NULL; it = it->next, i++) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) ||
            it->valuedouble < 0 || it->valuedouble > 2147483647.0) {
            snprintf(msg, cap, "'prompt' token ids must be non-negative integers");
            return -1;
        }
        out->ids[i] = (int32_t)it->valuedouble;
    }
    out->n_ids = n;
    return 0;
}

/* /v1/completions "prompt": a string, an array of token ids, or an array of either (a batch: the
 * choices of prompt i come after those of prompt i - 1); at most max of them. *out is
 * calloc'd, *n_out set. */
static int parse_prompts(const cJSON *root, int max, prompt_in **out, int *n_out, char *msg, size_t cap)
{
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    *out = NULL;
    *n_out = 0;
    if (p == NULL || cJSON_IsNull(p)) {
        snprintf(msg, cap, "'prompt' is required");
        return -1;
    }
    int batch = cJSON_IsArray(p) && p->child != NULL && (cJSON_IsString(p->child) || cJSON_IsArray(p->child));
    int n = batch ? cJSON_GetArraySize(p) : 1;
    if (n > max) {
        snprintf(msg, cap, "%d prompts with n=%d make more than %d choices", n, MAX_CHOICES / max, MAX_CHOICES);
        return -1;
    }
    if ((*out = calloc((size_t)n, sizeof(prompt_in))) == NULL) {
        snprintf(msg, cap, "out of memory");
        return -1;
    }
    *n_out = n;
    if (!batch)
        return parse_one_prompt(p, &(*out)[0], msg, cap);
    int i = 0;
    for (const cJSON *it = p->child; it != NULL; it = it->next, i++) {
        if (cJSON_IsString(it) != cJSON_IsString(p->child) || (!cJSON_IsString(it) && !cJSON_IsArray(it))) {
            snprintf(msg, cap, "'prompt' batch entries must all be strings or all be arrays of token ids");
            return -1;
        }
        if (parse_one_prompt(it, &(*out)[i], msg, cap) != 0) {
            char m2[300];
            snprintf(m2, sizeof(m2), "prompt[%d]: %s", i, msg);
            snprintf(msg, cap, "%s", m2);
            return -1;
        }
    }
    return 0;
}

static void prompts_free(prompt_in *p, int n)
{
    for (int i = 0; p != NULL && i < n; i++)
        free(p[i].ids);
    free(p);
}

static void prompt_use(decode_req *dr, const prompt_in *p)
{
    dr->prompt_text = p->text;
    dr->prompt_text_len = p->text != NULL ? p->len : 0;
    dr->prompt_ids = p->ids;
    dr->n_prompt_ids = p->ids != NULL ? p->n_ids : 0;
}

/* A chat request's tools, chat_template_kwargs, add_generation_prompt and
 * continue_final_message. tool_choice "required" or a named function forces the call through a
 * grammar (as structured output, so not with it or min_tokens; not made when dr is NULL:
 * /tokenize). -1 with *param and msg set. */
static int chat_setup(const cJSON *root, decode_req *dr, req_opts *o, pd_chat_tools *t,
                      pd_chat_opts *co, const char **param, char *msg, size_t cap)
{
    static const char *const flags[2] = { "add_generation_prompt", "continue_final_message" };
    for (int k = 0; k < 2; k++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, flags[k]);
        if (f == NULL || cJSON_IsNull(f))
            continue;
        *param = flags[k];
        if (!cJSON_IsBool(f)) {
            snprintf(msg, cap, "'%s' must be a boolean", flags[k]);
            return -1;
        }
        *(k == 0 ? &co->add_generation_prompt : &co->continue_final) = cJSON_IsTrue(f);
    }
    if (co->add_generation_prompt && co->continue_final) {
        snprintf(msg, cap, "'continue_final_message' needs 'add_generation_prompt': false (the prompt ends in the "
                 "last message, not in a new one)");
        return -1;
    }
    *param = "messages";
    if (pd_chat_tools_parse(root, t, param, msg, cap) != 0)
        return -1;
    *param = "chat_template_kwargs";
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(root, "chat_template_kwargs");
    if (kw != NULL && !cJSON_IsNull(kw)) {
        const cJSON *et = cJSON_GetObjectItemCaseSensitive(kw, "enable_thinking");
        if (!cJSON_IsObject(kw) || (et != NULL && !cJSON_IsNull(et) && !cJSON_IsBool(et))) {
            snprintf(msg, cap, "'chat_template_kwargs' must be an object; its enable_thinking a boolean");
            return -1;
        }
        if (cJSON_IsBool(et))
            co->enable_thinking = cJSON_IsTrue(et);
    }
    *param = "tool_choice";
    if (dr != NULL && (t->choice == PD_TOOLS_REQUIRED || t->choice == PD_TOOLS_NAMED)) {
        if (o->n_guides > 0) {
            snprintf(msg, cap, "'tool_choice' %s cannot be combined with %s (both constrain the output)",
                     t->choice == PD_TOOLS_REQUIRED ? "\"required\"" : "naming a function", o->guide_param);
            return -1;
        }
        if (dr->min_tokens > 0) {
            *param = "min_tokens";
            snprintf(msg, cap, "'min_tokens' cannot be combined with a forced tool call (the grammar decides "
                     "where the output may end)");
            return -1;
        }
        pd_err gerr;
        if (pd_chat_tools_grammar(t, decode_server_grammars(o->srv), &o->grammar, &gerr) != PD_OK) {
            *param = "tools";
            snprintf(msg, cap, "%s", gerr.msg);
            return -1;
        }
        dr->grammar = o->grammar;
    }
    *param = "messages";
    return 0;
}

/* The request's body as a JSON object, or NULL after answering 400 (why: not UTF-8, not JSON,
 * not an object) or 500. JSON text must be UTF-8 (RFC 8259) and cJSON does not check it, so
 * the bytes are checked first: an error message that quotes a field stays valid JSON. */
static cJSON *json_body(struct evhttp_request *req)
{
    size_t blen = 0;
    char *body = pd_http_body(req, &blen);
    if (body == NULL) {
        send_error(req, 500, NULL, "out of memory reading the body");
        return NULL;
    }
    size_t valid = pd_utf8_valid_prefix(body, blen);
    if (valid != blen) {
        free(body);
        pd_http_error(req, 400, "invalid_request_error", NULL, NULL,
                      "the request body is not valid UTF-8 (byte %zu)", valid);
        return NULL;
    }
    cJSON *root = cJSON_ParseWithLength(body, blen);
    free(body);
    if (root == NULL || !cJSON_IsObject(root)) {
        send_error(req, 400, NULL, root == NULL ? "the request body is not valid JSON"
                                                : "the request body must be a JSON object");
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

/* ---------------------------------------------------------------------------------------------
 * Handlers */

static void handle_generate(struct evhttp_request *req, decode_http *dh, int chat)
{
    if (atomic_load(&dh->draining)) {
        decode_metrics_refused(dh->dm, "draining");
        pd_http_error(req, 503, "service_unavailable", NULL, "draining",
                      "the server is draining and accepts no new requests");
        return;
    }
    const char *chat_why = NULL;
    const pd_chat_template *tmpl = decode_server_chat_template(dh->s, &chat_why);
    if (chat && tmpl == NULL) {
        pd_http_error(req, 400, "invalid_request_error", "messages", "chat_template_unsupported",
                      "%s", chat_why);
        return;
    }
    cJSON *root = json_body(req);
    char msg[512] = "";
    const char *param = NULL;
    decode_req dr = {0};
    req_opts o = {0};
    prompt_in *prompts = NULL;
    int n_prompts = 1;
    char *chat_text = NULL;
    size_t chat_len = 0;
    pd_chat_tools tools = {0};
    pd_chat_opts copts = PD_CHAT_OPTS_DEFAULT;
    http_req *r = NULL;
    if (root == NULL) {
        decode_metrics_refused(dh->dm, "invalid");
        goto out;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (model != NULL && !cJSON_IsNull(model) && !cJSON_IsString(model)) {
        decode_metrics_refused(dh->dm, "invalid");
        send_error(req, 400, "model", "'model' must be a string");
        goto out;
    }
    if (cJSON_IsString(model) && strcmp(model->valuestring, dh->model) != 0) {
        decode_metrics_refused(dh->dm, "invalid");
        pd_http_error(req, 404, "invalid_request_error", "model", "model_not_found",
                      "the model '%.200s' does not exist; this server serves '%s' (GET /v1/models)",
                      model->valuestring, dh->model);
        goto out;
    }
    o.vocab = decode_server_vocab(dh->s);
    o.srv = dh->s;
    o.gd = &dh->gd;
    if (parse_common(root, chat, &dr, &o, &param, msg, sizeof(msg)) != 0) {
        decode_metrics_refused(dh->dm, "invalid");
        send_error(req, 400, param, msg);
        goto out;
    }
    if (chat) {
        if (chat_setup(root, &dr, &o, &tools, &copts, &param, msg, sizeof(msg)) != 0 ||
            pd_chat_render(tmpl, cJSON_GetObjectItemCaseSensitive(root, "messages"), &tools, &copts,
                           &chat_text, &chat_len, msg, sizeof(msg)) != 0) {
            decode_metrics_refused(dh->dm, "invalid");
            send_error(req, 400, param != NULL ? param : "messages", msg);
            goto out;
        }
        dr.prompt_text = chat_text;
        dr.prompt_text_len = chat_len;
    } else if (parse_prompts(root, MAX_CHOICES / (o.n > 0 ? o.n : 1), &prompts, &n_prompts, msg, sizeof(msg)) != 0) {
        decode_metrics_refused(dh->dm, "invalid");
        send_error(req, 400, "prompt", msg);
        goto out;
    }
    r = calloc(1, sizeof(*r));
    if (r == NULL) {
        send_error(req, 500, NULL, "out of memory");
        goto out;
    }
    r->n_per_prompt = o.n > 0 ? o.n : 1;
    r->n_choice = r->n_per_prompt * n_prompts;
    atomic_init(&r->refs, 1 + r->n_choice);   /* HTTP side, each choice's engine side */
    r->dh = dh;
    for (int i = 0; i < r->n_choice; i++) {
        r->ch[i].r = r;
        r->ch[i].idx = i;
    }
    r->req = req;
    r->chat = chat;
    /* parallel_tool_calls false: one call at most (the splitter drops what follows it) */
    r->tools = !chat || tools.choice == PD_TOOLS_NONE ? 0 : tools.parallel ? 1 : 2;
    /* 1: the reply may open <think>; 2: the generation prompt opened it (the reply starts inside) */
    r->reasoning = chat && dh->reasoning ? pd_chat_reasoning_mode(tmpl, &copts) : 0;
    r->stream = o.stream;
    for (int i = 0; r->stream && (r->tools || r->reasoning) && i < r->n_choice; i++)
        if ((r->ch[i].cp = pd_chat_parser_create(r->tools, r->reasoning)) == NULL) {
            send_error(req, 500, NULL, "out of memory");
            req_contents_free(r);
            goto out;
        }
    r->include_usage = o.include_usage;
    r->logprobs = dr.logprobs;
    r->top_logprobs = dr.top_logprobs;
    r->echo = o.echo;
    r->no_gen = o.max0;
    for (int p = 0; r->echo && p < n_prompts; p++) {
        if (prompts != NULL)
            prompt_use(&dr, &prompts[p]);
        if (echo_one(r, &dr, p * r->n_per_prompt, (p + 1) * r->n_per_prompt, msg, sizeof(msg)) != 0) {
            send_error(req, 500, NULL, msg);
            req_contents_free(r);
            goto out;
        }
    }
    r->created = (long)time(NULL);
    unsigned long long seq = atomic_fetch_add(&dh->next_id, 1);
    snprintf(r->id, sizeof(r->id), "%s-%llx%04llx", chat ? "chatcmpl" : "cmpl",
             (unsigned long long)r->created, seq & 0xffffull);
    for (int i = 0; i < o.n_stop; i++) {
        r->stop[i] = o.stop[i];
        size_t l = strlen(o.stop[i]);
        if (l > r->max_stop)
            r->max_stop = l;
    }
    r->n_stop = o.n_stop;
    r->keep_stop = o.keep_stop;
    o.n_stop = 0;
    dr.request_id = r->id;
    pthread_mutex_lock(&dh->mu);
    r->next = dh->live;
    if (dh->live != NULL)
        dh->live->prev = r;
    dh->live = r;
    pthread_mutex_unlock(&dh->mu);
    atomic_fetch_add(&dh->inflight, 1);
    pd_err err = {0};
    pd_status st = PD_OK;
    char cid[80];
    uint64_t seed0 = dr.seed;
    uint64_t group0 = (((uint64_t)r->created << 16) ^ seq) << 8 | 0x8000000000000000ull;
    int sub = 0;
    for (; sub < r->n_choice && st == PD_OK; sub++) {
        int p = sub / r->n_per_prompt;
        if (prompts != NULL)
            prompt_use(&dr, &prompts[p]);
        /* the choices of one prompt: with the prefix cache it is prefilled once */
        dr.group = r->n_per_prompt > 1 ? group0 + (uint64_t)p + 1 : 0;
        if (r->n_choice > 1) {
            snprintf(cid, sizeof(cid), "%s-%d", r->id, sub);
            dr.request_id = cid;
        }
        dr.seed = seed0 + (uint64_t)(sub % r->n_per_prompt);   /* a batched prompt samples as alone */
        st = decode_submit(dh->s, &dr, cb_token, cb_done, &r->ch[sub], &r->ch[sub].h, &err);
    }
    if (st != PD_OK) {
        decode_metrics_refused(dh->dm, st == PD_ERR_INVALID ? "invalid" : st == PD_ERR_CANCELLED
                                       ? "draining" : "error");
        /* choices from sub - 1 on never reach the engine: they are done, with no reference */
        int failed = sub - 1;
        r->err_st = st;
        snprintf(r->err_msg, sizeof(r->err_msg), "%s", err.msg);
        r->n_done += r->n_choice - failed;
        for (int i = failed; i < r->n_choice; i++) {
            r->ch[i].done = 1;
            atomic_fetch_sub(&r->refs, 1);
        }
        if (failed == 0) {
            send_error(req, http_code_of(st), NULL, err.msg);
            req_finish(r);
            goto out;
        }
        cancel_all(r);   /* the answer is the error once the submitted ones end */
    }
    r->evcon = evhttp_request_get_connection(req);
    if (r->evcon != NULL)
        evhttp_connection_set_closecb(r->evcon, on_close, r);
out:
    opts_free(&o);
    prompts_free(prompts, n_prompts);
    free(chat_text);
    pd_chat_tools_free(&tools);
    cJSON_Delete(root);
}

/* --api-key: "Authorization: Bearer <key>" (the comparison takes the same time wherever the
 * key differs); else a 401 in OpenAI's shape. */
static int authorized(struct evhttp_request *req, const decode_http *dh)
{
    if (dh->api_key == NULL)
        return 1;
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "Authorization");
    int ok = 0;
    if (h != NULL && strncasecmp(h, "Bearer ", 7) == 0) {
        const char *k = h + 7;
        size_t kl = strlen(k), want = strlen(dh->api_key);
        unsigned diff = kl != want;
        for (size_t i = 0; i < want; i++)
            diff |= (unsigned)(uint8_t)dh->api_key[i] ^ (unsigned)(uint8_t)(i < kl ? k[i] : 0);
        ok = diff == 0;
    }
    if (!ok) {
        evhttp_add_header(evhttp_request_get_output_headers(req), "WWW-Authenticate", "Bearer");
        pd_http_error(req, 401, "invalid_request_error", NULL, "invalid_api_key", "%s",
                      h == NULL ? "no API key: send 'Authorization: Bearer <key>'" : "incorrect API key");
    }
    return ok;
}

static void h_completions(struct evhttp_request *req, void *ud)
{
    if (authorized(req, ud))
        handle_generate(req, ud, 0);
}

static void h_chat(struct evhttp_request *req, void *ud)
{
    if (authorized(req, ud))
        handle_generate(req, ud, 1);
}

/* Sends o as a 200 JSON reply (frees it). */
static void reply_json(struct evhttp_request *req, cJSON *o)
{
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (s == NULL) {
        send_error(req, 500, NULL, "out of memory");
        return;
    }
    pd_http_reply(req, 200, NULL, s, strlen(s));
    free(s);
}

static cJSON *model_json(const decode_http *dh)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", dh->model);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "pdspark");
    cJSON_AddNumberToObject(m, "max_model_len", decode_server_max_ctx(dh->s));
    return m;
}

static void h_models(struct evhttp_request *req, void *ud)
{
    decode_http *dh = ud;
    if (!authorized(req, dh))
        return;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(o, "data"), model_json(dh));
    reply_json(req, o);
}

/* GET /v1/models/{id} (OpenAI's retrieve): this node's model; any other id is the 404 of an
 * unknown path */
static void h_model(struct evhttp_request *req, void *ud)
{
    decode_http *dh = ud;
    if (authorized(req, dh))
        reply_json(req, model_json(dh));
}

/* The JSON object of a POST body, or NULL after answering 400 / 401 / 404 (the key and the
 * model checked). */
static cJSON *body_object(struct evhttp_request *req, decode_http *dh)
{
    if (!authorized(req, dh))
        return NULL;
    cJSON *root = json_body(req);
    if (root == NULL)
        return NULL;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (cJSON_IsString(model) && strcmp(model->valuestring, dh->model) != 0) {
        pd_http_error(req, 404, "invalid_request_error", "model", "model_not_found",
                      "the model '%.200s' does not exist; this server serves '%s' (GET /v1/models)",
                      model->valuestring, dh->model);
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

/* POST /tokenize (vLLM's): {"prompt": text} or {"messages": [...]} (rendered as chat requests
 * are) -> {"count", "max_model_len", "tokens"}. */
static void h_tokenize(struct evhttp_request *req, void *ud)
{
    decode_http *dh = ud;
    cJSON *root = body_object(req, dh);
    if (root == NULL)
        return;
    char msg[512];
    char *chat_text = NULL;
    pd_chat_tools tools = {0};
    pd_chat_opts copts = PD_CHAT_OPTS_DEFAULT;
    const char *param = NULL;
    const char *text = NULL;
    size_t len = 0;
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (cJSON_GetObjectItemCaseSensitive(root, "messages") != NULL) {
        const char *chat_why = NULL;
        const pd_chat_template *tmpl = decode_server_chat_template(dh->s, &chat_why);
        if (tmpl == NULL) {
            pd_http_error(req, 400, "invalid_request_error", "messages", "chat_template_unsupported",
                          "%s", chat_why);
            goto out;
        }
        if (chat_setup(root, NULL, NULL, &tools, &copts, &param, msg, sizeof(msg)) != 0 ||
            pd_chat_render(tmpl, cJSON_GetObjectItemCaseSensitive(root, "messages"), &tools, &copts,
                           &chat_text, &len, msg, sizeof(msg)) != 0) {
            send_error(req, 400, param != NULL ? param : "messages", msg);
            goto out;
        }
        text = chat_text;
    } else if (cJSON_IsString(p)) {
        text = p->valuestring;
        len = strlen(text);
    } else {
        send_error(req, 400, "prompt", "'prompt' (a string) or 'messages' is required");
        goto out;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    pd_err err;
    if (pd_tokenizer_encode(decode_server_tokenizer(dh->s), text, len, 1, &ids, &n, &err) != PD_OK) {
        send_error(req, 500, NULL, err.msg);
        goto out;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", (double)n);
    cJSON_AddNumberToObject(o, "max_model_len", decode_server_max_ctx(dh->s));
    cJSON *arr = cJSON_AddArrayToObject(o, "tokens");
    for (size_t i = 0; i < n; i++)
        cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    free(ids);
    reply_json(req, o);
out:
    free(chat_text);
    pd_chat_tools_free(&tools);
    cJSON_Delete(root);
}

/* POST /detokenize (vLLM's): {"tokens": [ids]} -> {"prompt": text}. */
static void h_detokenize(struct evhttp_request *req, void *ud)
{
    decode_http *dh = ud;
    cJSON *root = body_object(req, dh);
    if (root == NULL)
        return;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "tokens");
    int n = cJSON_IsArray(t) ? cJSON_GetArraySize(t) : -1;
    int32_t *ids = n > 0 ? malloc((size_t)n * sizeof(int32_t)) : NULL;
    if (n < 0 || (n > 0 && ids == NULL)) {
        send_error(req, n < 0 ? 400 : 500, "tokens", n < 0 ? "'tokens' (an array of token ids) is required"
                                                           : "out of memory");
        goto out;
    }
    int i = 0;
    for (const cJSON *it = t->child; it != NULL; it = it->next, i++) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
            it->valuedouble >= decode_server_vocab(dh->s)) {
            char msg[160];
            snprintf(msg, sizeof(msg), "'tokens'[%d] is not a token id in 0..%d", i,
                     decode_server_vocab(dh->s) - 1);
            send_error(req, 400, "tokens", msg);
            goto out;
        }
        ids[i] = (int32_t)it->valuedouble;
    }
    char *txt = NULL;
    pd_err err;
    if (pd_tokenizer_decode(decode_server_tokenizer(dh->s), ids, (size_t)n, 0, &txt, NULL, &err) != PD_OK) {
        send_error(req, 400, "tokens", err.msg);
        goto out;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "prompt", txt);
    free(txt);
    reply_json(req, o);
out:
    free(ids);
    cJSON_Delete(root);
}

static int ready_fn(void *ud, char *why, size_t cap)
{
    decode_http *dh = ud;
    if (atomic_load(&dh->draining)) {
        snprintf(why, cap, "draining");
        return 0;
    }
    decode_stats st;
    decode_server_stats(dh->s, &st);
    if (!st.serving) {
        snprintf(why, cap, "the decode server is not serving");
        return 0;
    }
    if (st.disaggregated && st.prefill_nodes == 0) {
        snprintf(why, cap, "no prefill node (--prefill resolves to no address now)");
        return 0;
    }
    if (st.prefill_nodes > 0 && st.prefill_nodes_up == 0 && pd_cli_now_ms() < st.prefill_retry_ms) {
        snprintf(why, cap, "no prefill node is usable (all %d failed recently)", st.prefill_nodes);
        return 0;
    }
    return 1;
}

/* --generation-config: "auto" (NULL) reads model_dir/generation_config.json, "none" nothing,
 * else DIR/generation_config.json; its temperature, top_p, top_k, min_p, repetition_penalty
 * and max_new_tokens become the defaults of requests that leave them out (vLLM's defaults). A file
 * that is absent is no error with "auto"; a value out of range is. */
static pd_status load_gen_defaults(decode_http *dh, const char *model_dir, const char *which, pd_err *err)
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
    cJSON *j = cJSON_Parse(txt);
    free(txt);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return pd_err_set(err, PD_ERR_INVALID, "%.300s: not a JSON object", path);
    }
    static const struct { const char *key; double lo, hi; } f[6] = {
        { "temperature", 0, 2 }, { "top_p", 1e-9, 1 }, { "top_k", -1, 1e9 }, { "repetition_penalty", 1e-9, 10 },
        { "max_new_tokens", 1, 1e9 }, { "min_p", 0, 1 },
    };
    gen_defaults *g = &dh->gd;
    int *has[6] = { &g->has_temp, &g->has_top_p, &g->has_top_k, &g->has_rep, &g->has_max, &g->has_min_p };
    pd_status st = PD_OK;
    char used[256] = "";
    for (int k = 0; k < 6 && st == PD_OK; k++) {
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
        default: g->max_new_tokens = (int)x; break;
        }
        size_t l = strlen(used);
        snprintf(used + l, sizeof(used) - l, "%s%s %g", l > 0 ? ", " : "", f[k].key, x);
    }
    if (st == PD_OK && used[0] != '\0')
        PD_LOG_INFO("http", "request defaults from %s: %s (a request's own values win; --generation-config "
                    "none for OpenAI's)", path, used);
    cJSON_Delete(j);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * Lifetime */

pd_status decode_http_create(decode_server *s, const decode_http_config *cfg, decode_http **out,
                             pd_err *err)
{
    decode_http *dh = calloc(1, sizeof(*dh));
    if (dh == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "http front end");
    dh->s = s;
    dh->dm = cfg->dm;
    dh->reasoning = decode_server_reasoning(s);
    if (cfg->api_key != NULL && cfg->api_key[0] != '\0' && (dh->api_key = strdup(cfg->api_key)) == NULL) {
        pthread_mutex_destroy(&dh->mu);
        free(dh);
        return pd_err_set(err, PD_ERR_NOMEM, "http front end");
    }
    pthread_mutex_init(&dh->mu, NULL);
    atomic_init(&dh->draining, 0);
    atomic_init(&dh->inflight, 0);
    atomic_init(&dh->next_id, 1);
    if (cfg->model_name != NULL) {
        snprintf(dh->model, sizeof(dh->model), "%s", cfg->model_name);
    } else {
        char tmp[4096];
        snprintf(tmp, sizeof(tmp), "%s", cfg->model_dir != NULL ? cfg->model_dir : "model");
        size_t l = strlen(tmp);
        while (l > 1 && tmp[l - 1] == '/')
            tmp[--l] = '\0';
        const char *base = strrchr(tmp, '/');
        snprintf(dh->model, sizeof(dh->model), "%.255s", base != NULL ? base + 1 : tmp);
    }
    pd_status st = load_gen_defaults(dh, cfg->model_dir != NULL ? cfg->model_dir : ".", cfg->generation_config, err);
    if (st != PD_OK)
        goto err_free;
    char model_path[300];
    snprintf(model_path, sizeof(model_path), "/v1/models/%s", dh->model);
    pd_http_config hc = {
        .addr = cfg->addr, .node = "decode", .metrics = cfg->metrics,
        .ready = ready_fn, .ready_ud = dh, .max_body = cfg->max_body,
    };
    if ((st = pd_http_create(&hc, &dh->http, err)) != PD_OK)
        goto err_free;
    if ((st = pd_http_route(dh->http, "/v1/completions", PD_HTTP_POST, h_completions, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, "/v1/chat/completions", PD_HTTP_POST, h_chat, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, "/v1/models", PD_HTTP_GET, h_models, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, model_path, PD_HTTP_GET, h_model, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, "/tokenize", PD_HTTP_POST, h_tokenize, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, "/detokenize", PD_HTTP_POST, h_detokenize, dh, err)) != PD_OK ||
        (st = pd_http_start(dh->http, err)) != PD_OK)
        goto err_http;
    *out = dh;
    return PD_OK;
err_http:
    pd_http_destroy(dh->http);
err_free:
    pthread_mutex_destroy(&dh->mu);
    free(dh->api_key);
    free(dh);
    return st;
}

int decode_http_port(const decode_http *h)
{
    return pd_http_port(h->http);
}

void decode_http_drain(decode_http *h)
{
    if (h != NULL)
        atomic_store(&h->draining, 1);
}

int decode_http_inflight(const decode_http *h)
{
    return h != NULL ? atomic_load(&((decode_http *)h)->inflight) : 0;
}

void decode_http_stop(decode_http *h)
{
    if (h != NULL)
        pd_http_stop(h->http);
}

void decode_http_destroy(decode_http *h)
{
    if (h == NULL)
        return;
    pd_http_stop(h->http);
    h->closing = 1;
    /* the engine is gone: what is left holds only its HTTP reference; evhttp_free below frees
     * the evhttp requests, so detach them from the connections first */
    while (h->live != NULL) {
        http_req *r = h->live;
        if (r->evcon != NULL)
            evhttp_connection_set_closecb(r->evcon, NULL, NULL);
        r->evcon = NULL;
        r->req = NULL;
        h->live = r->next;
        if (h->live != NULL)
            h->live->prev = NULL;
        r->next = r->prev = NULL;
        req_contents_free(r);
    }
    pd_http_destroy(h->http);
    pthread_mutex_destroy(&h->mu);
    free(h->api_key);
    free(h);
}
