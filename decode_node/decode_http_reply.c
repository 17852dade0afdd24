/* decode_http_reply.c - the replies of the decode node's OpenAI-compatible HTTP front end
 *   (decode_http_reply.h).
 * Owns: the engine's chunks and results carried to the HTTP thread (copied into a message and
 *   pd_loop_post-ed), stop strings (matched on the detokenized text, a possible partial match
 *   held back while streaming), the response JSON of completions and chat (choices, logprobs,
 *   vLLM's prompt_logprobs, a chat reply split into content, reasoning and tool calls, usage),
 *   SSE events, and the OpenAI error shape with the HTTP status of a pd_status.
 * Not here: the requests' contexts and their lifetime (decode_http.c), reading a request
 *   (decode_http_parse.c).
 * Threading: decode_http_cb_token / _cb_done run on the engine thread and only copy what they
 *   got into a message posted to the HTTP loop; everything else runs on the HTTP thread. */
#include "decode_http_reply.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>

#include "decode_http_internal.h"
#include "decode_http_responses.h"
#include "pd_buf.h"
#include "pd_chat.h"
#include "pd_http.h"
#include "pd_json.h"
#include "pd_log.h"
#include "pd_tokenizer.h"

/* ---------------------------------------------------------------------------------------------
 * Errors */

int decode_http_code_of(pd_status st)
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

void decode_http_send_error(struct evhttp_request *req, int code, const char *param, const char *msg)
{
    pd_http_error(req, code, err_type_of(code), param, NULL, "%s", msg);
}

void decode_http_send_json(struct evhttp_request *req, cJSON *o)
{
    char *s = pd_json_print(o);
    cJSON_Delete(o);
    if (s == NULL) {
        decode_http_send_error(req, 500, NULL, "out of memory encoding the response");
        return;
    }
    pd_http_reply(req, 200, NULL, s, strlen(s));
    free(s);
}

void decode_http_send_failure(http_req *r)
{
    int code = decode_http_code_of(r->err_st);
    if (r->err_st == PD_ERR_CANCELLED)
        code = 503;   /* the server is stopping */
    decode_http_send_error(r->req, code, NULL, r->err_msg[0] != '\0' ? r->err_msg : pd_status_str(r->err_st));
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

/* A JSON string of s[0..n), its NUL bytes as PD_TEXT_NUL (pd_json_print writes \u0000) */
cJSON *decode_http_string_n(const char *s, size_t n)
{
    char *t = pd_text_nul_mark(s, n);   /* an echoed prompt's NUL bytes too */
    if (t == NULL)
        return cJSON_CreateNull();
    cJSON *j = cJSON_CreateString(t);
    free(t);
    return j;
}

/* A token's text for logprobs: its bytes as UTF-8, an incomplete sequence as U+FFFD (as the
 * tokenizer decodes one token); "" for an id the tokenizer does not know; with as_id (vLLM's
 * return_tokens_as_token_ids) "token_id:ID" instead. */
static cJSON *tok_text(const pd_tokenizer *t, int32_t id, int as_id)
{
    char *txt = NULL;
    pd_err err;
    if (as_id) {
        char b[32];
        snprintf(b, sizeof(b), "token_id:%d", (int)id);
        return cJSON_CreateString(b);
    }
    size_t len = 0;
    if (t == NULL || pd_tokenizer_decode(t, &id, 1, 0, &txt, &len, &err) != PD_OK)
        return cJSON_CreateString("");
    cJSON *j = decode_http_string_n(txt, len);   /* the byte-0 token: "\u0000" */
    free(txt);
    return j;
}

/* chat: {"token", "logprob", "bytes"} of one token */
static cJSON *chat_lp_entry(const pd_tokenizer *t, int32_t id, float lp, int as_id)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddItemToObject(e, "token", tok_text(t, id, as_id));
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
    const int as_id = r->r->tok_ids;
    cJSON *o = cJSON_CreateObject();
    if (r->r->chat) {
        cJSON *c = cJSON_AddArrayToObject(o, "content");
        for (int i = from; i < to; i++) {
            const lp_tok *k = &r->lps[i];
            cJSON *e = chat_lp_entry(t, k->id, k->lp.logprob, as_id);
            cJSON *top = cJSON_AddArrayToObject(e, "top_logprobs");
            for (int j = 0; j < k->lp.n_top; j++)
                cJSON_AddItemToArray(top, chat_lp_entry(t, k->lp.top_id[j], k->lp.top_logprob[j], as_id));
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
        cJSON_AddItemToArray(toks, tok_text(t, k->id, as_id));
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
            cJSON *key = tok_text(t, k->lp.top_id[j], as_id);
            cJSON_AddNumberToObject(d, key->valuestring, k->lp.top_logprob[j]);
            cJSON_Delete(key);
            chosen_in |= k->lp.top_id[j] == k->id;
        }
        if (!chosen_in) {
            cJSON *key = tok_text(t, k->id, as_id);
            cJSON_AddNumberToObject(d, key->valuestring, k->lp.logprob);
            cJSON_Delete(key);
        }
        cJSON_AddItemToArray(tops, d);
        size_t off = k->off < r->gen_len ? k->off : r->gen_len;
        cJSON_AddItemToArray(offs, cJSON_CreateNumber((double)utf8_chars(r->gen, off)));
    }
    return o;
}

/* vLLM's prompt_logprobs of a choice: one element per prompt token, null for the first (nothing
 * comes before it), else a dict keyed by token id: the prompt token first, then the likeliest of
 * the position in order, each {"logprob", "rank", "decoded_token"}. As vLLM builds the dict, the
 * prompt token's rank is its place in the list when it is there (with ties the place can be less
 * than kern_logprobs' count), else that count; -inf logprobs become -9999 (vLLM's clamp). */
static cJSON *prompt_lp_entry(const pd_tokenizer *t, int32_t id, float lp, int rank)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddNumberToObject(e, "logprob", lp == -INFINITY ? -9999.0 : (double)lp);
    cJSON_AddNumberToObject(e, "rank", rank);
    cJSON_AddItemToObject(e, "decoded_token", tok_text(t, id, 0));
    return e;
}

static cJSON *prompt_logprobs_json(const http_choice *ch)
{
    const pd_tokenizer *t = decode_server_tokenizer(ch->r->dh->s);
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < ch->n_plps; i++) {
        const lp_tok *k = &ch->plps[i];
        if (k->none) {
            cJSON_AddItemToArray(a, cJSON_CreateNull());
            continue;
        }
        cJSON *d = cJSON_CreateObject();
        char key[16];
        int place = -1;
        for (int j = 0; j < k->lp.n_top; j++)
            if (k->lp.top_id[j] == k->id && place < 0)
                place = j;
        snprintf(key, sizeof(key), "%d", (int)k->id);
        cJSON_AddItemToObject(d, key, prompt_lp_entry(t, k->id, k->lp.logprob, place >= 0 ? place + 1 : k->lp.rank));
        for (int j = 0; j < k->lp.n_top; j++) {
            if (j == place)
                continue;
            snprintf(key, sizeof(key), "%d", (int)k->lp.top_id[j]);
            cJSON_AddItemToObject(d, key, prompt_lp_entry(t, k->lp.top_id[j], k->lp.top_logprob[j], j + 1));
        }
        cJSON_AddItemToArray(a, d);
    }
    return a;
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
    if (ch->r->prompt_lp && !ch->r->chat && !ch->r->stream)   /* chat: the response's (reply_end) */
        cJSON_AddItemToObject(c, "prompt_logprobs", prompt_logprobs_json(ch));
}

/* A tool call's JSON from its first piece: id, type, function name and the arguments so far
 * (streamed: with its index); a later piece streamed: index and the next arguments only. */
static cJSON *tool_call_json(const http_choice *ch, const pd_chat_piece *p, int stream)
{
    cJSON *tc = cJSON_CreateObject();
    if (stream)
        cJSON_AddNumberToObject(tc, "index", p->index);
    if (p->first) {
        char id[PD_CHAT_CALL_ID_SIZE];
        pd_chat_call_id(ch->r->uid, ch->idx, p->index, id);
        cJSON_AddStringToObject(tc, "id", id);
        cJSON_AddStringToObject(tc, "type", "function");
    }
    cJSON *fn = cJSON_AddObjectToObject(tc, "function");
    if (p->first)
        cJSON_AddItemToObject(fn, "name", decode_http_string_n(p->text, p->len));
    cJSON_AddItemToObject(fn, "arguments", decode_http_string_n(p->args, p->args_len));
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
                                               decode_http_string_n(a->args != NULL ? a->args : "", a->al));
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
        cJSON_AddItemToObject(c, "text", decode_http_string_n(text != NULL ? text : "", text != NULL ? len : 0));
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
                cJSON_AddItemToObject(m, "content", decode_http_string_n(a.content != NULL ? a.content : "", a.cl));
            if (r->reasoning) {
                if (a.rl > 0)
                    cJSON_AddItemToObject(m, "reasoning_content", decode_http_string_n(a.reasoning, a.rl));
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
            cJSON_AddItemToObject(m, "content", decode_http_string_n(text, len));
        }
    }
    choice_end(c, ch, finish, lp_from, lp_to);
}

void decode_http_sse_send(http_req *r, const char *event, cJSON *o)
{
    char *s = pd_json_print(o);
    cJSON_Delete(o);
    if (s == NULL || r->req == NULL) {
        free(s);
        return;
    }
    struct evbuffer *b = evbuffer_new();
    if (b != NULL) {
        if (event != NULL)
            evbuffer_add_printf(b, "event: %s\n", event);
        evbuffer_add_printf(b, "data: %s\n\n", s);
        evhttp_send_reply_chunk(r->req, b);
        evbuffer_free(b);
    }
    free(s);
}

static void sse_send(http_req *r, cJSON *o)
{
    decode_http_sse_send(r, NULL, o);
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
    if (r->responses) {
        decode_http_resp_start(r);
    } else if (r->chat) {   /* the role chunk of every choice */
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
                              decode_http_string_n(p->text, p->len));
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
            pd_chat_parser_feed(c->cp, c->gen != NULL ? c->gen : "", safe, final,
                                r->responses ? decode_http_resp_piece : sse_piece, c);
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
    lp_tok *plps;                    /* [n_prompt]: the first chunk of a request with the
                                      * prompt's logprobs (echo with logprobs, prompt_logprobs) */
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

/* an entry's top list cut to at most want (the rest of the list is not read) */
static void lp_cut(pd_token_logprobs *lp, int want)
{
    if (lp->n_top > want)
        lp->n_top = want;
}

static int gen_append(http_choice *r, const char *t, size_t n)
{
    return pd_buf_append(&r->gen, &r->gen_len, &r->gen_cap, t, n);
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
        decode_http_cancel_all(r);
        return;
    }
    /* the prompt's own: with echo and logprobs in front of the output's (offsets within the
     * echoed prompt); with prompt_logprobs for that field; each cut to its own top count (the
     * engine computed the longer) */
    if (m->plps != NULL && r->echo && r->logprobs) {
        if (lps_reserve(c, c->n_lps + m->n_prompt) != 0) {
            decode_cancel(c->h);
            return;
        }
        memcpy(c->lps + c->n_lps, m->plps, (size_t)m->n_prompt * sizeof(*m->plps));
        for (int i = 0; i < m->n_prompt; i++)
            lp_cut(&c->lps[c->n_lps + i].lp, r->top_logprobs);
        c->n_lps += m->n_prompt;
    }
    if (m->plps != NULL && r->prompt_lp && c->plps == NULL) {
        if ((c->plps = malloc((size_t)m->n_prompt * sizeof(*c->plps))) == NULL) {
            decode_cancel(c->h);
            return;
        }
        memcpy(c->plps, m->plps, (size_t)m->n_prompt * sizeof(*m->plps));
        for (int i = 0; i < m->n_prompt; i++)
            lp_cut(&c->plps[i].lp, r->prompt_lp_top);
        c->n_plps = m->n_prompt;
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
    } else if (r->responses) {
        if (r->stream && (r->started || ok))
            sse_start(r);
        else
            r->stream = 0;   /* failed before the stream began: a plain error reply */
        decode_http_resp_end(r);
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
            int code = decode_http_code_of(r->err_st);
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
        /* chat: vLLM answers the prompt's once, beside the choices (they share the prompt) */
        if (r->chat && r->prompt_lp)
            cJSON_AddItemToObject(o, "prompt_logprobs", prompt_logprobs_json(&r->ch[0]));
        decode_http_send_json(r->req, o);
    } else {
        decode_http_send_failure(r);
    }
    decode_http_req_finish(r);
}

static void msg_done(http_msg *m)
{
    http_choice *c = m->c;
    http_req *r = c->r;
    if (r->req == NULL) {   /* unreachable: the reply is only completed here */
        decode_http_req_unref(r);
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
        decode_http_cancel_all(r);
    }
    if (ok && r->err_st == PD_OK) {
        emit_safe(c, stop_scan(c, 1), 1);
        c->finish = !c->stopped && m->finish == PD_FINISH_LENGTH ? "length" : "stop";
        if (c->cp != NULL && pd_chat_parser_calls(c->cp) > 0 && strcmp(c->finish, "stop") == 0)
            c->finish = "tool_calls";
        if (r->stream && !r->gone && !r->responses) {
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
    decode_http_req_unref(r);   /* this choice's engine reference */
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

void decode_http_cb_token(void *ud, const decode_chunk *c)
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

void decode_http_cb_done(void *ud, const decode_result *res)
{
    http_choice *ch = ud;
    http_req *r = ch->r;
    http_msg *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        /* cannot tell the HTTP side; the client gets nothing more (its connection closes at
         * shutdown at the latest) */
        PD_LOG_ERROR("http", "%s: out of memory finishing the request", r->id);
        decode_http_req_unref(r);
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
        decode_http_req_unref(r);
    }
}
