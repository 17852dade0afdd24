/* decode_http.c - OpenAI-compatible HTTP on the decode node (decode_http.h): the server, its
 *   routes and the requests' contexts.
 * Owns: the pd_http server (its own libevent thread: see decode_http.h for why not the engine
 *   loop), the routes and their handlers (completions and chat submitted to the engine, models,
 *   tokenize / detokenize, readiness), the API key check, per-request contexts (http_req)
 *   tying an evhttp_request to its decode_handles, the --generation-config request defaults,
 *   HTTP-side draining.
 * Not here: request JSON validation (decode_http_parse.c); stop strings, response/SSE/error
 *   encoding and the engine's chunks brought to the HTTP thread (decode_http_reply.c);
 *   admission and generation (decode_server.c), metrics values (decode_metrics.c).
 * Threading: handlers and every http_req field except refs run on the HTTP thread. Engine
 *   callbacks copy a chunk / result into a message and pd_loop_post it there. An http_req holds
 *   1 + n references: the HTTP side (until its reply is complete) and each choice's engine
 *   request (until its on_done message ran, or dropped at once when the post is refused because
 *   the HTTP loop has stopped). "n" > 1 runs n engine requests of the prompt (choice i samples
 *   with seed + i), a batch of prompts n of each; the reply completes when the last ended. evhttp requests whose client went away stay ours (libevent detaches them) and are
 *   freed by the final send. */
#include "decode_http.h"

#include <ctype.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <event2/http.h>

#include "decode_http_internal.h"
#include "decode_http_parse.h"
#include "decode_http_reply.h"
#include "decode_http_responses.h"
#include "decode_metrics.h"
#include "pd_chat.h"
#include "pd_cli.h"
#include "pd_http.h"
#include "pd_json.h"
#include "pd_log.h"
#include "pd_tokenizer.h"

/* ---------------------------------------------------------------------------------------------
 * Request contexts */

/* The request field a decode_submit message names first (its messages open with the field:
 * "bad_words[0] must ...", "min_tokens 5 exceeds ..."), or NULL */
static const char *submit_param(const char *msg)
{
    static const char *const fields[] = { "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
                                          "min_tokens", "max_new_tokens", "top_logprobs", "logit_bias",
                                          "stop_token_ids" };
    for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); i++) {
        size_t n = strlen(fields[i]);
        if (strncmp(msg, fields[i], n) == 0 && (msg[n] == ' ' || msg[n] == '[' || msg[n] == ':'))
            return strcmp(fields[i], "max_new_tokens") == 0 ? "max_tokens" : fields[i];
    }
    return NULL;
}

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
        free(r->ch[i].plps);
        pd_chat_parser_destroy(r->ch[i].cp);
    }
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    cJSON_Delete(r->resp_echo);
    cJSON_Delete(r->resp_conv);
    decode_http_resp_destroy(r->rs);
    free(r);
}

/* Asks every choice still running to end (the client left, or one choice failed). */
void decode_http_cancel_all(http_req *r)
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

void decode_http_req_unref(http_req *r)
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
    decode_http_cancel_all(r);
}

/* The reply is complete (handed to evhttp): detach from the connection, drop the HTTP ref. */
void decode_http_req_finish(http_req *r)
{
    if (r->evcon != NULL)
        evhttp_connection_set_closecb(r->evcon, NULL, NULL);
    r->evcon = NULL;
    r->req = NULL;
    atomic_fetch_sub(&r->dh->inflight, 1);
    decode_http_req_unref(r);
}

/* ---------------------------------------------------------------------------------------------
 * Handlers */

/* X-Request-Id (the tracing header of proxies and vLLM): 1..DECODE_HTTP_XRID_MAX bytes of
 * A-Z a-z 0-9 . _ : - copied to xrid ("" without the header); -1 with a 400 sent when it is
 * anything else (it becomes part of the reply's id and of the node's log lines). */
static int request_id_header(struct evhttp_request *req, char *xrid)
{
    xrid[0] = '\0';
    const char *h = evhttp_find_header(evhttp_request_get_input_headers(req), "X-Request-Id");
    if (h == NULL)
        return 0;
    size_t n = strlen(h), i = 0;
    while (i < n && (isalnum((unsigned char)h[i]) || strchr("._:-", h[i]) != NULL))
        i++;
    if (n == 0 || n > DECODE_HTTP_XRID_MAX || i < n) {
        pd_http_error(req, 400, "invalid_request_error", NULL, "invalid_request_id",
                      "the X-Request-Id header must be 1 to %d characters of A-Z a-z 0-9 . _ : - "
                      "(this one is %zu bytes%s)", DECODE_HTTP_XRID_MAX, n,
                      n > 0 && i < n ? ", with other characters" : "");
        return -1;
    }
    memcpy(xrid, h, n + 1);
    return 0;
}

/* chat: 0 /v1/completions, 1 /v1/chat/completions, 2 /v1/responses (read into the chat
 * request it means) */
static void handle_generate(struct evhttp_request *req, decode_http *dh, int chat)
{
    const int responses = chat == 2;
    chat = chat != 0;
    if (atomic_load(&dh->draining)) {
        decode_metrics_refused(dh->dm, "draining");
        pd_http_error(req, 503, "service_unavailable", NULL, "draining",
                      "the server is draining and accepts no new requests");
        return;
    }
    char xrid[DECODE_HTTP_XRID_MAX + 1];
    if (request_id_header(req, xrid) != 0)
        return;
    if (xrid[0] != '\0')   /* every reply from here carries it, errors too */
        evhttp_add_header(evhttp_request_get_output_headers(req), "X-Request-Id", xrid);
    const char *chat_why = NULL;
    const pd_chat_template *tmpl = decode_server_chat_template(dh->s, &chat_why);
    if (chat && tmpl == NULL) {
        pd_http_error(req, 400, "invalid_request_error", responses ? "input" : "messages",
                      "chat_template_unsupported", "%s", chat_why);
        return;
    }
    cJSON *root = decode_http_json_body(req);
    cJSON *echo = NULL, *conv = NULL;
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
    if (responses) {
        int code = 400;
        cJSON *c = decode_http_responses_request(root, dh->store, &echo, &conv, &code, &param, msg, sizeof(msg));
        if (c == NULL) {
            decode_metrics_refused(dh->dm, "invalid");
            if (code == 404)
                pd_http_error(req, 404, "invalid_request_error", param, "not_found", "%s", msg);
            else
                decode_http_send_error(req, code, param, msg);
            goto out;
        }
        cJSON_Delete(root);
        root = c;
    }
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (model != NULL && !cJSON_IsNull(model) && !cJSON_IsString(model)) {
        decode_metrics_refused(dh->dm, "invalid");
        decode_http_send_error(req, 400, "model", "'model' must be a string");
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
    o.gd = decode_server_gen_defaults(dh->s);
    if (decode_http_parse_common(root, chat, &dr, &o, &param, msg, sizeof(msg)) != 0) {
        decode_metrics_refused(dh->dm, "invalid");
        decode_http_send_error(req, 400, responses ? decode_http_responses_param(param) : param, msg);
        goto out;
    }
    if (chat) {
        if (decode_http_chat_setup(root, &dr, &o, &tools, &copts, &param, msg, sizeof(msg)) != 0 ||
            pd_chat_render(tmpl, cJSON_GetObjectItemCaseSensitive(root, "messages"), &tools, &copts,
                           &chat_text, &chat_len, msg, sizeof(msg)) != 0) {
            decode_metrics_refused(dh->dm, "invalid");
            param = param != NULL ? param : "messages";
            decode_http_send_error(req, 400, responses ? decode_http_responses_param(param) : param, msg);
            goto out;
        }
        dr.prompt_text = chat_text;
        dr.prompt_text_len = chat_len;
    } else if (decode_http_parse_prompts(root, MAX_CHOICES / (o.n > 0 ? o.n : 1), &prompts, &n_prompts, msg,
                                         sizeof(msg)) != 0) {
        decode_metrics_refused(dh->dm, "invalid");
        decode_http_send_error(req, 400, "prompt", msg);
        goto out;
    }
    r = calloc(1, sizeof(*r));
    if (r == NULL) {
        decode_http_send_error(req, 500, NULL, "out of memory");
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
    r->responses = responses;
    if (responses) {
        r->resp_echo = echo;
        r->resp_conv = conv;
        echo = conv = NULL;
        if ((r->rs = decode_http_resp_create()) == NULL) {
            decode_http_send_error(req, 500, NULL, "out of memory");
            req_contents_free(r);
            goto out;
        }
    }
    /* parallel_tool_calls false: one call at most (the splitter drops what follows it) */
    r->tools = chat ? pd_chat_tools_mode(&tools) : 0;
    /* 1: the reply may open <think>; 2: the generation prompt opened it (the reply starts inside) */
    r->reasoning = chat && dh->reasoning ? pd_chat_reasoning_mode(tmpl, &copts) : 0;
    r->stream = o.stream;
    for (int i = 0; r->stream && (r->tools || r->reasoning || responses) && i < r->n_choice; i++)
        if ((r->ch[i].cp = pd_chat_parser_create(r->tools, r->reasoning)) == NULL) {
            decode_http_send_error(req, 500, NULL, "out of memory");
            req_contents_free(r);
            goto out;
        }
    r->include_usage = o.include_usage;
    r->logprobs = dr.logprobs;
    r->top_logprobs = dr.top_logprobs;
    r->prompt_lp = o.prompt_lp;
    r->prompt_lp_top = o.prompt_lp_top;
    r->echo = o.echo;
    r->tok_ids = o.tok_ids;
    r->no_gen = o.max0;
    for (int p = 0; r->echo && p < n_prompts; p++) {
        if (prompts != NULL)
            decode_http_prompt_use(&dr, &prompts[p]);
        if (echo_one(r, &dr, p * r->n_per_prompt, (p + 1) * r->n_per_prompt, msg, sizeof(msg)) != 0) {
            decode_http_send_error(req, 500, NULL, msg);
            req_contents_free(r);
            goto out;
        }
    }
    r->created = (long)time(NULL);
    unsigned long long seq = atomic_fetch_add(&dh->next_id, 1);
    const char *kind = responses ? "resp_" : chat ? "chatcmpl-" : "cmpl-";
    snprintf(r->uid, sizeof(r->uid), "%s%llx%04llx", kind, (unsigned long long)r->created, seq & 0xffffull);
    if (xrid[0] != '\0') {   /* clients may repeat theirs: tool call ids come from uid */
        snprintf(r->id, sizeof(r->id), "%s%s", kind, xrid);
    } else {
        memcpy(r->id, r->uid, sizeof(r->id));
        evhttp_add_header(evhttp_request_get_output_headers(req), "X-Request-Id", r->id);
    }
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
            decode_http_prompt_use(&dr, &prompts[p]);
        /* the choices of one prompt: with the prefix cache it is prefilled once */
        dr.group = r->n_per_prompt > 1 ? group0 + (uint64_t)p + 1 : 0;
        if (r->n_choice > 1) {
            snprintf(cid, sizeof(cid), "%s-%d", r->id, sub);
            dr.request_id = cid;
        }
        dr.seed = seed0 + (uint64_t)(sub % r->n_per_prompt);   /* a batched prompt samples as alone */
        st = decode_submit(dh->s, &dr, decode_http_cb_token, decode_http_cb_done, &r->ch[sub], &r->ch[sub].h, &err);
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
            decode_http_send_error(req, decode_http_code_of(st), submit_param(err.msg), err.msg);
            decode_http_req_finish(r);
            goto out;
        }
        decode_http_cancel_all(r);   /* the answer is the error once the submitted ones end */
    }
    r->evcon = evhttp_request_get_connection(req);
    if (r->evcon != NULL)
        evhttp_connection_set_closecb(r->evcon, on_close, r);
out:
    decode_http_opts_free(&o);
    decode_http_prompts_free(prompts, n_prompts);
    free(chat_text);
    pd_chat_tools_free(&tools);
    cJSON_Delete(root);
    cJSON_Delete(echo);
    cJSON_Delete(conv);
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

static void h_responses(struct evhttp_request *req, void *ud)
{
    if (authorized(req, ud))
        handle_generate(req, ud, 2);
}

/* GET / DELETE /v1/responses/{id}: a stored response */
static void h_response_id(struct evhttp_request *req, void *ud)
{
    decode_http *dh = ud;
    if (authorized(req, ud))
        decode_http_responses_stored(req, dh->store, evhttp_request_get_command(req) == EVHTTP_REQ_DELETE);
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
    decode_http_send_json(req, o);
}

/* GET /v1/models/{id} (OpenAI's retrieve): this node's model; any other id is the 404 of an
 * unknown path */
static void h_model(struct evhttp_request *req, void *ud)
{
    decode_http *dh = ud;
    if (authorized(req, dh))
        decode_http_send_json(req, model_json(dh));
}

/* The JSON object of a POST body, or NULL after answering 400 / 401 / 404 (the key and the
 * model checked). */
static cJSON *body_object(struct evhttp_request *req, decode_http *dh)
{
    if (!authorized(req, dh))
        return NULL;
    cJSON *root = decode_http_json_body(req);
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
        if (decode_http_chat_setup(root, NULL, NULL, &tools, &copts, &param, msg, sizeof(msg)) != 0 ||
            pd_chat_render(tmpl, cJSON_GetObjectItemCaseSensitive(root, "messages"), &tools, &copts,
                           &chat_text, &len, msg, sizeof(msg)) != 0) {
            decode_http_send_error(req, 400, param != NULL ? param : "messages", msg);
            goto out;
        }
        text = chat_text;
    } else if (cJSON_IsString(p)) {
        text = p->valuestring;
        len = strlen(text);
    } else {
        decode_http_send_error(req, 400, "prompt", "'prompt' (a string) or 'messages' is required");
        goto out;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    pd_err err;
    if (pd_tokenizer_encode(decode_server_tokenizer(dh->s), text, len, 1, &ids, &n, &err) != PD_OK) {
        decode_http_send_error(req, 500, NULL, err.msg);
        goto out;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", (double)n);
    cJSON_AddNumberToObject(o, "max_model_len", decode_server_max_ctx(dh->s));
    cJSON *arr = cJSON_AddArrayToObject(o, "tokens");
    for (size_t i = 0; i < n; i++)
        cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    free(ids);
    decode_http_send_json(req, o);
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
        decode_http_send_error(req, n < 0 ? 400 : 500, "tokens",
                               n < 0 ? "'tokens' (an array of token ids) is required" : "out of memory");
        goto out;
    }
    int i = 0;
    for (const cJSON *it = t->child; it != NULL; it = it->next, i++) {
        if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
            it->valuedouble >= decode_server_vocab(dh->s)) {
            char msg[160];
            snprintf(msg, sizeof(msg), "'tokens'[%d] is not a token id in 0..%d", i,
                     decode_server_vocab(dh->s) - 1);
            decode_http_send_error(req, 400, "tokens", msg);
            goto out;
        }
        ids[i] = (int32_t)it->valuedouble;
    }
    char *txt = NULL;
    size_t txt_len = 0;
    pd_err err;
    if (pd_tokenizer_decode(decode_server_tokenizer(dh->s), ids, (size_t)n, 0, &txt, &txt_len, &err) != PD_OK) {
        decode_http_send_error(req, 400, "tokens", err.msg);
        goto out;
    }
    char *marked = pd_text_nul_mark(txt, txt_len);   /* a NUL byte: "\u0000" */
    free(txt);
    if (marked == NULL) {
        decode_http_send_error(req, 500, NULL, "out of memory");
        goto out;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "prompt", marked);
    free(marked);
    decode_http_send_json(req, o);
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

/* ---------------------------------------------------------------------------------------------
 * Lifetime */

void decode_http_model_id(const char *model_dir, const char *served_name, char *out, size_t cap)
{
    if (served_name != NULL) {
        snprintf(out, cap, "%s", served_name);
        return;
    }
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s", model_dir != NULL ? model_dir : "model");
    size_t l = strlen(tmp);
    while (l > 1 && tmp[l - 1] == '/')
        tmp[--l] = '\0';
    const char *base = strrchr(tmp, '/');
    snprintf(out, cap, "%.255s", base != NULL ? base + 1 : tmp);
}

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
    dh->store = decode_http_resp_store_create(cfg->responses_store_bytes);   /* NULL: none (or NOMEM) */
    atomic_init(&dh->draining, 0);
    atomic_init(&dh->inflight, 0);
    atomic_init(&dh->next_id, 1);
    decode_http_model_id(cfg->model_dir, cfg->model_name, dh->model, sizeof(dh->model));
    pd_status st;
    char model_path[300];
    snprintf(model_path, sizeof(model_path), "/v1/models/%s", dh->model);
    pd_http_config hc = {
        .addr = cfg->addr, .node = "decode", .metrics = cfg->metrics,
        .ready = ready_fn, .ready_ud = dh, .max_body = cfg->max_body, .tls = cfg->tls,
    };
    if ((st = pd_http_create(&hc, &dh->http, err)) != PD_OK)
        goto err_free;
    if ((st = pd_http_route(dh->http, "/v1/completions", PD_HTTP_POST, h_completions, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, "/v1/chat/completions", PD_HTTP_POST, h_chat, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, "/v1/responses", PD_HTTP_POST, h_responses, dh, err)) != PD_OK ||
        (st = pd_http_route(dh->http, "/v1/responses/*", PD_HTTP_GET | PD_HTTP_DELETE, h_response_id, dh,
                            err)) != PD_OK ||
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
    decode_http_resp_store_destroy(dh->store);
    pthread_mutex_destroy(&dh->mu);
    free(dh->api_key);
    free(dh);
    return st;
}

int decode_http_port(const decode_http *h)
{
    return pd_http_port(h->http);
}

pd_status decode_http_set_tls(decode_http *h, const pd_tls *t, pd_err *err)
{
    return pd_http_set_tls(h->http, t, err);
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
    decode_http_resp_store_destroy(h->store);
    pthread_mutex_destroy(&h->mu);
    free(h->api_key);
    free(h);
}
