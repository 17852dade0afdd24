/* decode_http_responses.c - OpenAI's Responses API on top of the chat path
 *   (decode_http_responses.h). A request is read into the chat request it means and runs as one;
 *   its reply is the chat output split by pd_chat's parser (reasoning, content, tool calls) and
 *   written as output items: "reasoning", "message" (one output_text part), "function_call". A
 *   streamed reply is the API's typed events, each item opened (output_item.added, with its
 *   content part), grown (output_text / reasoning_text / function_call_arguments .delta) and
 *   closed (.done events) in the order the output writes them; the items, whole or streamed,
 *   come from the same pieces through the same state, so both forms carry the same ids and text. */
#include "decode_http_responses.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <event2/http.h>

#include "decode_http_internal.h"
#include "decode_http_reply.h"
#include "pd_buf.h"
#include "pd_http.h"
#include "pd_json.h"

/* ---------------------------------------------------------------------------------------------
 * Stored responses */

typedef struct resp_stored {
    struct resp_stored *prev, *next;   /* oldest first */
    char *id;
    cJSON *conv;                       /* the conversation, this response's output last */
    cJSON *resp;                       /* the response object */
    size_t bytes;                      /* both as JSON text: what the budget counts */
} resp_stored;

struct resp_store {
    resp_stored *head, *tail;
    size_t bytes, cap;
};

resp_store *decode_http_resp_store_create(size_t cap_bytes)
{
    if (cap_bytes == 0)
        return NULL;
    resp_store *s = calloc(1, sizeof(*s));
    if (s != NULL)
        s->cap = cap_bytes;
    return s;
}

static void store_unlink(resp_store *s, resp_stored *e)
{
    if (e->prev != NULL)
        e->prev->next = e->next;
    else
        s->head = e->next;
    if (e->next != NULL)
        e->next->prev = e->prev;
    else
        s->tail = e->prev;
    s->bytes -= e->bytes;
    free(e->id);
    cJSON_Delete(e->conv);
    cJSON_Delete(e->resp);
    free(e);
}

void decode_http_resp_store_destroy(resp_store *s)
{
    while (s != NULL && s->head != NULL)
        store_unlink(s, s->head);
    free(s);
}

static const resp_stored *store_find(const resp_store *s, const char *id)
{
    for (resp_stored *e = s->tail; e != NULL; e = e->prev)   /* the newest first */
        if (strcmp(e->id, id) == 0)
            return e;
    return NULL;
}

static size_t json_bytes(const cJSON *j)
{
    char *t = cJSON_PrintUnformatted(j);
    size_t n = t != NULL ? strlen(t) : 0;
    free(t);
    return n;
}

/* conv and resp (taken) kept under id, the oldest dropped past the budget; one response larger
 * than the whole budget is not kept */
static void store_put(resp_store *s, const char *id, cJSON *conv, cJSON *resp)
{
    resp_stored *old = (resp_stored *)store_find(s, id);
    if (old != NULL)   /* a client's repeated X-Request-Id: the newer wins */
        store_unlink(s, old);
    size_t bytes = json_bytes(conv) + json_bytes(resp) + strlen(id);
    resp_stored *e = bytes <= s->cap ? calloc(1, sizeof(*e)) : NULL;
    if (e == NULL || (e->id = strdup(id)) == NULL) {
        free(e);
        cJSON_Delete(conv);
        cJSON_Delete(resp);
        return;
    }
    e->conv = conv;
    e->resp = resp;
    e->bytes = bytes;
    while (s->head != NULL && s->bytes + bytes > s->cap)
        store_unlink(s, s->head);
    e->prev = s->tail;
    if (s->tail != NULL)
        s->tail->next = e;
    else
        s->head = e;
    s->tail = e;
    s->bytes += bytes;
}

void decode_http_responses_stored(struct evhttp_request *req, resp_store *s, int del)
{
    const char *uri = evhttp_request_get_uri(req);
    const char *id = uri != NULL ? strstr(uri, "/v1/responses/") : NULL;
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", id != NULL ? id + strlen("/v1/responses/") : "");
    buf[strcspn(buf, "?")] = '\0';
    if (strchr(buf, '/') != NULL) {
        pd_http_error(req, 404, "invalid_request_error", NULL, "not_found",
                      "no route for %.120s (a stored response is read whole: GET /v1/responses/{id})", uri);
        return;
    }
    resp_stored *e = s != NULL ? (resp_stored *)store_find(s, buf) : NULL;
    if (e == NULL) {
        pd_http_error(req, 404, "invalid_request_error", NULL, "not_found", "response '%.80s' is not stored here%s",
                      buf, s == NULL ? " (this node stores no responses: --responses-store-mb 0)" : "");
        return;
    }
    if (!del) {
        decode_http_send_json(req, cJSON_Duplicate(e->resp, 1));
        return;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", e->id);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddTrueToObject(o, "deleted");
    store_unlink(s, e);
    decode_http_send_json(req, o);
}

/* the output items as the assistant turn a later request's conversation continues from */
static cJSON *output_turn(const cJSON *items)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "assistant");
    char *text = NULL, *reason = NULL;
    size_t tl = 0, tc = 0, rl = 0, rc = 0;
    cJSON *calls = NULL;
    const cJSON *it;
    cJSON_ArrayForEach(it, items) {
        const char *ty = cJSON_GetObjectItemCaseSensitive(it, "type")->valuestring;
        const cJSON *parts = cJSON_GetObjectItemCaseSensitive(it, "content"), *p;
        if (strcmp(ty, "function_call") == 0) {
            if (calls == NULL)
                calls = cJSON_CreateArray();
            cJSON *tcall = cJSON_CreateObject();
            cJSON_AddItemToObject(tcall, "id", cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(it, "call_id"), 1));
            cJSON_AddStringToObject(tcall, "type", "function");
            cJSON *fn = cJSON_AddObjectToObject(tcall, "function");
            cJSON_AddItemToObject(fn, "name", cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(it, "name"), 1));
            cJSON_AddItemToObject(fn, "arguments", cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(it, "arguments"), 1));
            cJSON_AddItemToArray(calls, tcall);
            continue;
        }
        int reasoning = strcmp(ty, "reasoning") == 0;
        cJSON_ArrayForEach(p, parts) {
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(p, "text");
            if (cJSON_IsString(t))
                pd_buf_append(reasoning ? &reason : &text, reasoning ? &rl : &tl, reasoning ? &rc : &tc,
                              t->valuestring, strlen(t->valuestring));
        }
    }
    if (text != NULL)
        cJSON_AddStringToObject(m, "content", text);
    else
        cJSON_AddNullToObject(m, "content");
    if (reason != NULL)
        cJSON_AddStringToObject(m, "reasoning_content", reason);
    if (calls != NULL)
        cJSON_AddItemToObject(m, "tool_calls", calls);
    free(text);
    free(reason);
    return m;
}

/* ---------------------------------------------------------------------------------------------
 * The request */

/* Set msg and return NULL (the translator's error exit). */
#define FAIL(p, ...) do { *param = (p); snprintf(msg, cap, __VA_ARGS__); goto fail; } while (0)

/* A content part's text: input_text / output_text / text parts (a string content is itself). */
static const char *part_text(const cJSON *part)
{
    const cJSON *ty = cJSON_GetObjectItemCaseSensitive(part, "type");
    const cJSON *tx = cJSON_GetObjectItemCaseSensitive(part, "text");
    if (!cJSON_IsString(ty) || !cJSON_IsString(tx))
        return NULL;
    if (strcmp(ty->valuestring, "input_text") != 0 && strcmp(ty->valuestring, "output_text") != 0 &&
        strcmp(ty->valuestring, "text") != 0)
        return NULL;
    return tx->valuestring;
}

/* An item's content (a string, or text parts) as chat content: a string, or text parts. NULL
 * with msg set otherwise. */
static cJSON *content_of(const cJSON *c, int i, char *msg, size_t cap)
{
    if (cJSON_IsString(c))
        return cJSON_CreateString(c->valuestring);
    if (!cJSON_IsArray(c)) {
        snprintf(msg, cap, "input[%d].content must be a string or an array of text parts", i);
        return NULL;
    }
    cJSON *parts = cJSON_CreateArray();
    int k = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, c) {
        const char *t = part_text(p);
        if (t == NULL) {
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(p, "type");
            snprintf(msg, cap, "input[%d].content[%d]: only input_text and output_text parts are supported "
                     "(this model reads text)%s%.40s", i, k, cJSON_IsString(ty) ? "; got " : "",
                     cJSON_IsString(ty) ? ty->valuestring : "");
            cJSON_Delete(parts);
            return NULL;
        }
        cJSON *q = cJSON_CreateObject();
        cJSON_AddStringToObject(q, "type", "text");
        cJSON_AddStringToObject(q, "text", t);
        cJSON_AddItemToArray(parts, q);
        k++;
    }
    return parts;
}

/* The text of an item's reasoning ("content" reasoning_text parts, else its "summary" texts). */
static char *reasoning_of(const cJSON *it)
{
    char *buf = NULL;
    size_t len = 0, cap = 0;
    const char *keys[2] = {"content", "summary"};
    for (int k = 0; k < 2 && len == 0; k++) {
        const cJSON *arr = cJSON_GetObjectItemCaseSensitive(it, keys[k]), *p;
        if (!cJSON_IsArray(arr))
            continue;
        cJSON_ArrayForEach(p, arr) {
            const cJSON *tx = cJSON_GetObjectItemCaseSensitive(p, "text");
            if (cJSON_IsString(tx))
                pd_buf_append(&buf, &len, &cap, tx->valuestring, strlen(tx->valuestring));
        }
    }
    return buf;
}

/* The last message if it is the assistant's (function calls join it), else a new one. */
static cJSON *assistant_turn(cJSON *msgs, char **reasoning)
{
    cJSON *last = cJSON_GetArrayItem(msgs, cJSON_GetArraySize(msgs) - 1);
    const cJSON *role = last != NULL ? cJSON_GetObjectItemCaseSensitive(last, "role") : NULL;
    if (!(cJSON_IsString(role) && strcmp(role->valuestring, "assistant") == 0)) {
        last = cJSON_CreateObject();
        cJSON_AddStringToObject(last, "role", "assistant");
        cJSON_AddNullToObject(last, "content");
        cJSON_AddItemToArray(msgs, last);
    }
    if (*reasoning != NULL) {
        cJSON_DeleteItemFromObjectCaseSensitive(last, "reasoning_content");
        cJSON_AddStringToObject(last, "reasoning_content", *reasoning);
        free(*reasoning);
        *reasoning = NULL;
    }
    return last;
}

/* The "input" items as chat messages appended to msgs. 0, or -1 with msg. */
static int input_messages(const cJSON *input, cJSON *msgs, char *msg, size_t cap)
{
    if (cJSON_IsString(input)) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", input->valuestring);
        cJSON_AddItemToArray(msgs, m);
        return 0;
    }
    if (!cJSON_IsArray(input) || cJSON_GetArraySize(input) == 0) {
        snprintf(msg, cap, "'input' must be a string or a non-empty array of items");
        return -1;
    }
    char *reasoning = NULL;   /* a reasoning item waits for the assistant turn it belongs to */
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, input) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(it, "type");
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        const char *type = cJSON_IsString(ty) ? ty->valuestring : "message";
        if (!cJSON_IsObject(it) || (ty != NULL && !cJSON_IsString(ty))) {
            snprintf(msg, cap, "input[%d] must be an object with a string 'type'", i);
            goto fail;
        }
        if (strcmp(type, "message") == 0) {
            static const char *const roles[] = {"user", "system", "developer", "assistant"};
            int known = 0;
            for (int k = 0; k < 4 && cJSON_IsString(role); k++)
                known |= strcmp(role->valuestring, roles[k]) == 0;
            if (!known) {
                snprintf(msg, cap, "input[%d].role must be user, system, developer or assistant", i);
                goto fail;
            }
            cJSON *content = content_of(cJSON_GetObjectItemCaseSensitive(it, "content"), i, msg, cap);
            if (content == NULL)
                goto fail;
            if (strcmp(role->valuestring, "assistant") == 0) {
                cJSON *m = assistant_turn(msgs, &reasoning);
                cJSON_ReplaceItemInObjectCaseSensitive(m, "content", content);
            } else {
                cJSON *m = cJSON_CreateObject();
                cJSON_AddStringToObject(m, "role", role->valuestring);
                cJSON_AddItemToObject(m, "content", content);
                cJSON_AddItemToArray(msgs, m);
            }
        } else if (strcmp(type, "function_call") == 0) {
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "call_id");
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
            const cJSON *args = cJSON_GetObjectItemCaseSensitive(it, "arguments");
            if (!cJSON_IsString(id) || !cJSON_IsString(name) || !cJSON_IsString(args)) {
                snprintf(msg, cap, "input[%d]: a function_call needs string call_id, name and arguments", i);
                goto fail;
            }
            cJSON *m = assistant_turn(msgs, &reasoning);
            cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
            if (calls == NULL)
                calls = cJSON_AddArrayToObject(m, "tool_calls");
            cJSON *tc = cJSON_CreateObject();
            cJSON_AddStringToObject(tc, "id", id->valuestring);
            cJSON_AddStringToObject(tc, "type", "function");
            cJSON *fn = cJSON_AddObjectToObject(tc, "function");
            cJSON_AddStringToObject(fn, "name", name->valuestring);
            cJSON_AddStringToObject(fn, "arguments", args->valuestring);
            cJSON_AddItemToArray(calls, tc);
        } else if (strcmp(type, "function_call_output") == 0) {
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "call_id");
            cJSON *content = content_of(cJSON_GetObjectItemCaseSensitive(it, "output"), i, msg, cap);
            if (!cJSON_IsString(id) || content == NULL) {
                if (content == NULL && msg[0] != '\0')
                    goto fail;
                cJSON_Delete(content);
                snprintf(msg, cap, "input[%d]: a function_call_output needs a string call_id and output", i);
                goto fail;
            }
            cJSON *m = cJSON_CreateObject();
            cJSON_AddStringToObject(m, "role", "tool");
            cJSON_AddStringToObject(m, "tool_call_id", id->valuestring);
            cJSON_AddItemToObject(m, "content", content);
            cJSON_AddItemToArray(msgs, m);
        } else if (strcmp(type, "reasoning") == 0) {
            free(reasoning);
            reasoning = reasoning_of(it);
        } else {
            snprintf(msg, cap, "input[%d].type '%.40s' is not supported (message, function_call, "
                     "function_call_output, reasoning; nothing is stored, so item references are not)", i, type);
            goto fail;
        }
        i++;
    }
    free(reasoning);   /* reasoning after the last assistant turn belongs to none */
    return 0;
fail:
    free(reasoning);
    return -1;
}

/* "tools": Responses' flat function tools as chat's; other kinds are refused */
static cJSON *tools_of(const cJSON *tools, char *msg, size_t cap)
{
    if (!cJSON_IsArray(tools)) {
        snprintf(msg, cap, "'tools' must be an array");
        return NULL;
    }
    cJSON *out = cJSON_CreateArray();
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(t, "type");
        if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "function") != 0) {
            snprintf(msg, cap, "tools[%d]: only function tools are supported (no built-in tools here)%s%.40s",
                     i, cJSON_IsString(ty) ? "; got " : "", cJSON_IsString(ty) ? ty->valuestring : "");
            cJSON_Delete(out);
            return NULL;
        }
        cJSON *ct = cJSON_CreateObject();
        cJSON_AddStringToObject(ct, "type", "function");
        cJSON *fn = cJSON_AddObjectToObject(ct, "function");
        static const char *const keys[] = {"name", "description", "parameters", "strict"};
        for (int k = 0; k < 4; k++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(t, keys[k]);
            if (v != NULL && !cJSON_IsNull(v))
                cJSON_AddItemToObject(fn, keys[k], cJSON_Duplicate(v, 1));
        }
        cJSON_AddItemToArray(out, ct);
        i++;
    }
    return out;
}

cJSON *decode_http_responses_request(const cJSON *root, resp_store *store, cJSON **echo, cJSON **conv,
                                     int *code, const char **param, char *msg, size_t cap)
{
    cJSON *c = cJSON_CreateObject(), *msgs = NULL;
    *echo = cJSON_CreateObject();
    *conv = NULL;
    *code = 400;
    msg[0] = '\0';
    static const struct { const char *key, *why; } refused[] = {
        { "conversation", "'conversation' is not supported: this server stores no conversations; send the "
                          "whole conversation in 'input'" },
        { "background", "'background' responses are not supported (nothing is stored to poll)" },
        { "prompt", "'prompt' (stored prompt templates) is not supported" },
    };
    for (size_t k = 0; k < sizeof(refused) / sizeof(refused[0]); k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, refused[k].key);
        if (v != NULL && !cJSON_IsNull(v) && !cJSON_IsFalse(v))
            FAIL(refused[k].key, "%s", refused[k].why);
    }
    const cJSON *tlp = cJSON_GetObjectItemCaseSensitive(root, "top_logprobs");
    if (tlp != NULL && !cJSON_IsNull(tlp) && !(cJSON_IsNumber(tlp) && tlp->valuedouble == 0))
        FAIL("top_logprobs", "'top_logprobs' is not offered on /v1/responses (chat completions' 'logprobs' is)");
    const cJSON *inc = cJSON_GetObjectItemCaseSensitive(root, "include"), *e;
    if (inc != NULL && !cJSON_IsNull(inc) && !cJSON_IsArray(inc))
        FAIL("include", "'include' must be an array");
    const cJSON *inc_list = cJSON_IsArray(inc) ? inc : NULL;
    cJSON_ArrayForEach(e, inc_list) {
        if (cJSON_IsString(e) && strcmp(e->valuestring, "message.output_text.logprobs") == 0)
            FAIL("include", "'message.output_text.logprobs' is not offered on /v1/responses (chat completions' "
                 "'logprobs' is)");
    }
    const cJSON *ins = cJSON_GetObjectItemCaseSensitive(root, "instructions");
    if (ins != NULL && !cJSON_IsNull(ins) && !cJSON_IsString(ins))
        FAIL("instructions", "'instructions' must be a string");
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(root, "store");
    if (st != NULL && !cJSON_IsNull(st) && !cJSON_IsBool(st))
        FAIL("store", "'store' must be a boolean");
    /* the conversation: a stored response's (previous_response_id), then the input's messages;
     * the instructions go in front of it for this response only, as OpenAI's do */
    cJSON *cv = cJSON_AddArrayToObject(*echo, "");   /* held by echo until handed out */
    const cJSON *prev = cJSON_GetObjectItemCaseSensitive(root, "previous_response_id");
    if (prev != NULL && !cJSON_IsNull(prev)) {
        if (!cJSON_IsString(prev))
            FAIL("previous_response_id", "'previous_response_id' must be a string");
        const resp_stored *ps = store != NULL ? store_find(store, prev->valuestring) : NULL;
        if (ps == NULL) {
            *code = 404;
            FAIL("previous_response_id", store != NULL
                 ? "previous response '%.80s' is not stored here (stored responses live in this node's memory: "
                   "lost on restart, dropped oldest first past --responses-store-mb, not shared between replicas)"
                 : "previous response '%.80s': this node stores no responses (--responses-store-mb 0); send the "
                   "whole conversation in 'input'", prev->valuestring);
        }
        const cJSON *m;
        cJSON_ArrayForEach(m, ps->conv)
            cJSON_AddItemToArray(cv, cJSON_Duplicate(m, 1));
    }
    const cJSON *input = cJSON_GetObjectItemCaseSensitive(root, "input");
    if (input == NULL)
        FAIL("input", "'input' is required");
    if (input_messages(input, cv, msg, cap) != 0) {
        *param = "input";
        goto fail;
    }
    msgs = cJSON_AddArrayToObject(c, "messages");
    if (cJSON_IsString(ins)) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "system");
        cJSON_AddStringToObject(m, "content", ins->valuestring);
        cJSON_AddItemToArray(msgs, m);
    }
    const cJSON *m;
    cJSON_ArrayForEach(m, cv)
        cJSON_AddItemToArray(msgs, cJSON_Duplicate(m, 1));
    cJSON_DetachItemViaPointer(*echo, cv);
    if (store != NULL && !cJSON_IsFalse(st))
        *conv = cv;
    else
        cJSON_Delete(cv);
    /* the sampling fields and the rest, as chat names them (vLLM's extensions too) */
    static const char *const same[] = {"model", "temperature", "top_p", "stream", "user", "seed",
                                       "parallel_tool_calls", "top_k", "min_p", "repetition_penalty",
                                       "presence_penalty", "frequency_penalty", "stop", "min_tokens",
                                       "logit_bias", "ignore_eos", "verify", "guided_json", "guided_regex",
                                       "guided_choice", "guided_grammar", "structured_outputs"};
    for (size_t k = 0; k < sizeof(same) / sizeof(same[0]); k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, same[k]);
        if (v != NULL)
            cJSON_AddItemToObject(c, same[k], cJSON_Duplicate(v, 1));
    }
    const cJSON *mot = cJSON_GetObjectItemCaseSensitive(root, "max_output_tokens");
    if (mot != NULL && !cJSON_IsNull(mot)) {
        if (!cJSON_IsNumber(mot) || mot->valuedouble < 1 || mot->valuedouble != (double)(long long)mot->valuedouble)
            FAIL("max_output_tokens", "'max_output_tokens' must be a positive integer");
        cJSON_AddNumberToObject(c, "max_completion_tokens", mot->valuedouble);
    }
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (tools != NULL && !cJSON_IsNull(tools)) {
        cJSON *ct = tools_of(tools, msg, cap);
        if (ct == NULL) {
            *param = "tools";
            goto fail;
        }
        cJSON_AddItemToObject(c, "tools", ct);
    }
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "tool_choice");
    if (tc != NULL && !cJSON_IsNull(tc)) {
        if (cJSON_IsString(tc)) {
            cJSON_AddStringToObject(c, "tool_choice", tc->valuestring);
        } else {
            const cJSON *ty = cJSON_GetObjectItemCaseSensitive(tc, "type");
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(tc, "name");
            if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "function") != 0 || !cJSON_IsString(name))
                FAIL("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                     "{\"type\": \"function\", \"name\": ...}");
            cJSON *o = cJSON_AddObjectToObject(c, "tool_choice");
            cJSON_AddStringToObject(o, "type", "function");
            cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "function"), "name", name->valuestring);
        }
    }
    /* text.format: text, json_object, json_schema {name, schema, strict} */
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text");
    const cJSON *fmt = cJSON_IsObject(text) ? cJSON_GetObjectItemCaseSensitive(text, "format") : NULL;
    if (text != NULL && !cJSON_IsNull(text) && !cJSON_IsObject(text))
        FAIL("text", "'text' must be an object");
    if (fmt != NULL && !cJSON_IsNull(fmt)) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(fmt, "type");
        if (!cJSON_IsString(ty))
            FAIL("text.format", "'text.format.type' must be text, json_object or json_schema");
        if (strcmp(ty->valuestring, "json_object") == 0) {
            cJSON_AddStringToObject(cJSON_AddObjectToObject(c, "response_format"), "type", "json_object");
        } else if (strcmp(ty->valuestring, "json_schema") == 0) {
            cJSON *rf = cJSON_AddObjectToObject(c, "response_format");
            cJSON_AddStringToObject(rf, "type", "json_schema");
            cJSON *js = cJSON_AddObjectToObject(rf, "json_schema");
            static const char *const keys[] = {"name", "schema", "strict", "description"};
            for (int k = 0; k < 4; k++) {
                const cJSON *v = cJSON_GetObjectItemCaseSensitive(fmt, keys[k]);
                if (v != NULL)
                    cJSON_AddItemToObject(js, keys[k], cJSON_Duplicate(v, 1));
            }
        } else if (strcmp(ty->valuestring, "text") != 0) {
            FAIL("text.format", "'text.format.type' must be text, json_object or json_schema, not '%.40s'",
                 ty->valuestring);
        }
    }
    /* reasoning.effort "none" turns Qwen3's thinking off; the other efforts leave it as the
     * template has it */
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(root, "reasoning");
    const cJSON *eff = cJSON_IsObject(rs) ? cJSON_GetObjectItemCaseSensitive(rs, "effort") : NULL;
    if (rs != NULL && !cJSON_IsNull(rs) && !cJSON_IsObject(rs))
        FAIL("reasoning", "'reasoning' must be an object");
    if (eff != NULL && !cJSON_IsNull(eff) && !cJSON_IsString(eff))
        FAIL("reasoning.effort", "'reasoning.effort' must be a string");
    if (cJSON_IsString(eff) && strcmp(eff->valuestring, "none") == 0)
        cJSON_AddFalseToObject(cJSON_AddObjectToObject(c, "chat_template_kwargs"), "enable_thinking");
    /* what the response repeats */
    static const char *const echoed[] = {"instructions", "max_output_tokens", "temperature", "top_p",
                                         "tools", "tool_choice", "parallel_tool_calls", "text",
                                         "reasoning", "metadata", "user", "previous_response_id"};
    for (size_t k = 0; k < sizeof(echoed) / sizeof(echoed[0]); k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, echoed[k]);
        if (v != NULL)
            cJSON_AddItemToObject(*echo, echoed[k], cJSON_Duplicate(v, 1));
    }
    return c;
fail:
    cJSON_Delete(c);
    cJSON_Delete(*echo);
    cJSON_Delete(*conv);
    *echo = NULL;
    *conv = NULL;
    return NULL;
}

const char *decode_http_responses_param(const char *chat_param)
{
    static const char *const map[][2] = {
        {"messages", "input"}, {"max_completion_tokens", "max_output_tokens"},
        {"max_tokens", "max_output_tokens"}, {"response_format", "text.format"},
        {"chat_template_kwargs", "reasoning"},
    };
    for (size_t k = 0; chat_param != NULL && k < sizeof(map) / sizeof(map[0]); k++)
        if (strcmp(chat_param, map[k][0]) == 0)
            return map[k][1];
    return chat_param;
}

/* ---------------------------------------------------------------------------------------------
 * The reply */

enum { ITEM_NONE, ITEM_REASONING, ITEM_MESSAGE, ITEM_CALL };

struct resp_state {
    cJSON *items;                /* the output items, the open one (if any) last */
    int open;                    /* ITEM_* of the open item */
    char *text;                  /* its text (call: arguments) so far */
    size_t tl, tc;
    char *ws;                    /* whitespace content while no message is open: it opens none,
                                  * and goes in front of the text of the message it precedes */
    size_t wl, wc;
    char *name;                  /* the open call's function */
    int call;                    /* its index among the calls */
    int seq;                     /* the next event's sequence_number */
};

resp_state *decode_http_resp_create(void)
{
    resp_state *s = calloc(1, sizeof(*s));
    if (s != NULL && (s->items = cJSON_CreateArray()) == NULL) {
        free(s);
        s = NULL;
    }
    return s;
}

void decode_http_resp_destroy(resp_state *s)
{
    if (s == NULL)
        return;
    cJSON_Delete(s->items);
    free(s->text);
    free(s->ws);
    free(s->name);
    free(s);
}

/* One typed event of a streamed reply: "event: TYPE" and its JSON (type and sequence_number
 * first, then o's members) */
static void event(http_req *r, const char *type, cJSON *o)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "type", type);
    cJSON_AddNumberToObject(e, "sequence_number", r->rs->seq++);
    cJSON *m = o != NULL ? o->child : NULL;
    while (m != NULL) {
        cJSON *next = m->next;
        cJSON_AddItemToObject(e, m->string, cJSON_DetachItemViaPointer(o, m));
        m = next;
    }
    cJSON_Delete(o);
    decode_http_sse_send(r, type, e);
}

static int streaming(const http_req *r)
{
    return r->stream && !r->gone && r->req != NULL;
}

/* item k's id: its kind's prefix and the response's hex id with k */
static void item_id(const http_req *r, const char *prefix, int k, char *out, size_t cap)
{
    const char *hex = strchr(r->uid, '_');
    snprintf(out, cap, "%s_%s%02x", prefix, hex != NULL ? hex + 1 : r->uid, k & 0xff);
}

/* the text part of a reasoning or message item */
static cJSON *part_json(int kind, const char *text, size_t len)
{
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "type", kind == ITEM_REASONING ? "reasoning_text" : "output_text");
    cJSON_AddItemToObject(p, "text", decode_http_string_n(text, len));
    if (kind == ITEM_MESSAGE) {
        cJSON_AddArrayToObject(p, "annotations");
        cJSON_AddArrayToObject(p, "logprobs");
    }
    return p;
}

/* the open item's whole form (done: 1 completed, 2 incomplete: the output ended in it at
 * max_output_tokens), or in progress with empty text (done 0: as added) */
static cJSON *item_json(const http_req *r, int kind, int k, const char *text, size_t len, int done,
                        const char *name, int call)
{
    char id[96];
    cJSON *it = cJSON_CreateObject();
    if (kind == ITEM_REASONING) {
        item_id(r, "rs", k, id, sizeof(id));
        cJSON_AddStringToObject(it, "id", id);
        cJSON_AddStringToObject(it, "type", "reasoning");
        cJSON_AddArrayToObject(it, "summary");
        cJSON *parts = cJSON_AddArrayToObject(it, "content");
        if (done)
            cJSON_AddItemToArray(parts, part_json(kind, text, len));
    } else if (kind == ITEM_MESSAGE) {
        item_id(r, "msg", k, id, sizeof(id));
        cJSON_AddStringToObject(it, "id", id);
        cJSON_AddStringToObject(it, "type", "message");
        cJSON_AddStringToObject(it, "role", "assistant");
        cJSON *parts = cJSON_AddArrayToObject(it, "content");
        if (done)
            cJSON_AddItemToArray(parts, part_json(kind, text, len));
    } else {
        item_id(r, "fc", k, id, sizeof(id));
        char cid[PD_CHAT_CALL_ID_SIZE];
        pd_chat_call_id(r->uid, 0, call, cid);
        cJSON_AddStringToObject(it, "id", id);
        cJSON_AddStringToObject(it, "type", "function_call");
        cJSON_AddStringToObject(it, "call_id", cid);
        cJSON_AddStringToObject(it, "name", name);
        cJSON_AddItemToObject(it, "arguments", decode_http_string_n(done ? text : "", done ? len : 0));
    }
    if (kind != ITEM_REASONING)
        cJSON_AddStringToObject(it, "status", done == 2 ? "incomplete" : done ? "completed" : "in_progress");
    return it;
}

/* an event's place: the item's id and output_index (and content_index for text parts) */
static cJSON *at(const cJSON *item, int k, int part)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "item_id", cJSON_GetObjectItemCaseSensitive(item, "id")->valuestring);
    cJSON_AddNumberToObject(o, "output_index", k);
    if (part)
        cJSON_AddNumberToObject(o, "content_index", 0);
    return o;
}

/* The open item closed: its whole form replaces the in-progress one (streamed: the .done
 * events); last: the output ended in it */
static void close_item(http_req *r, int last)
{
    resp_state *s = r->rs;
    if (s->open == ITEM_NONE)
        return;
    int k = cJSON_GetArraySize(s->items) - 1;
    const char *fin = r->ch[0].finish;
    int cut = last && fin != NULL && strcmp(fin, "length") == 0;
    cJSON *whole = item_json(r, s->open, k, s->text != NULL ? s->text : "", s->tl, cut ? 2 : 1,
                             s->name != NULL ? s->name : "", s->call);
    cJSON_ReplaceItemInArray(s->items, k, whole);
    if (streaming(r)) {
        const char *t = s->text != NULL ? s->text : "";
        if (s->open == ITEM_CALL) {
            cJSON *o = at(whole, k, 0);
            cJSON_AddStringToObject(o, "name", s->name != NULL ? s->name : "");
            cJSON_AddItemToObject(o, "arguments", decode_http_string_n(t, s->tl));
            event(r, "response.function_call_arguments.done", o);
        } else {
            cJSON *o = at(whole, k, 1);
            cJSON_AddItemToObject(o, "text", decode_http_string_n(t, s->tl));
            if (s->open == ITEM_MESSAGE)
                cJSON_AddArrayToObject(o, "logprobs");   /* not offered here: always empty */
            event(r, s->open == ITEM_REASONING ? "response.reasoning_text.done" : "response.output_text.done", o);
            o = at(whole, k, 1);
            cJSON_AddItemToObject(o, "part", part_json(s->open, t, s->tl));
            event(r, "response.content_part.done", o);
        }
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "output_index", k);
        cJSON_AddItemToObject(o, "item", cJSON_Duplicate(whole, 1));
        event(r, "response.output_item.done", o);
    }
    s->open = ITEM_NONE;
    s->tl = 0;
}

/* A new item of kind opened (streamed: output_item.added and its content part's .added) */
static void open_item(http_req *r, int kind, const char *name, size_t name_len, int call)
{
    resp_state *s = r->rs;
    close_item(r, 0);
    int k = cJSON_GetArraySize(s->items);
    free(s->name);
    s->name = strndup(name != NULL ? name : "", name_len);   /* NOMEM: the name is "" */
    s->call = call;
    cJSON *it = item_json(r, kind, k, "", 0, 0, s->name != NULL ? s->name : "", call);
    cJSON_AddItemToArray(s->items, it);
    s->open = kind;
    s->tl = 0;
    if (streaming(r)) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "output_index", k);
        cJSON_AddItemToObject(o, "item", cJSON_Duplicate(it, 1));
        event(r, "response.output_item.added", o);
        if (kind != ITEM_CALL) {
            o = at(it, k, 1);
            cJSON_AddItemToObject(o, "part", part_json(kind, "", 0));
            event(r, "response.content_part.added", o);
        }
    }
}

/* text[0..len) onto the open item (streamed: its .delta event) */
static void grow_item(http_req *r, const char *text, size_t len)
{
    resp_state *s = r->rs;
    if (len == 0)
        return;
    pd_buf_append(&s->text, &s->tl, &s->tc, text, len);   /* NOMEM: the text is cut */
    if (!streaming(r))
        return;
    int k = cJSON_GetArraySize(s->items) - 1;
    cJSON *it = cJSON_GetArrayItem(s->items, k);
    cJSON *o = at(it, k, s->open != ITEM_CALL);
    cJSON_AddItemToObject(o, "delta", decode_http_string_n(text, len));
    if (s->open == ITEM_MESSAGE)
        cJSON_AddArrayToObject(o, "logprobs");
    event(r, s->open == ITEM_CALL ? "response.function_call_arguments.delta"
             : s->open == ITEM_REASONING ? "response.reasoning_text.delta" : "response.output_text.delta", o);
}

static int blank(const char *t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (t[i] != ' ' && t[i] != '\n' && t[i] != '\t' && t[i] != '\r')
            return 0;
    return 1;
}

void decode_http_resp_piece(void *ud, const pd_chat_piece *p)
{
    http_choice *ch = ud;
    http_req *r = ch->r;
    resp_state *s = r->rs;
    if (p->kind == PD_CHAT_TOOL_CALL) {
        if (p->first)
            open_item(r, ITEM_CALL, p->text, p->len, p->index);
        grow_item(r, p->args, p->args_len);
    } else if (p->kind == PD_CHAT_REASONING) {
        if (s->open != ITEM_REASONING)
            open_item(r, ITEM_REASONING, NULL, 0, 0);
        grow_item(r, p->text, p->len);
    } else if (s->open == ITEM_MESSAGE) {
        grow_item(r, p->text, p->len);
    } else if (blank(p->text, p->len)) {
        pd_buf_append(&s->ws, &s->wl, &s->wc, p->text, p->len);
    } else {
        open_item(r, ITEM_MESSAGE, NULL, 0, 0);
        grow_item(r, s->ws, s->wl);
        s->wl = 0;
        grow_item(r, p->text, p->len);
    }
}

/* the response object: status, the items, usage, and what the request set */
static cJSON *response_json(const http_req *r, const char *status, int with_output)
{
    const http_choice *c = &r->ch[0];
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", r->id);
    cJSON_AddStringToObject(o, "object", "response");
    cJSON_AddNumberToObject(o, "created_at", (double)r->created);
    cJSON_AddStringToObject(o, "status", status);
    if (strcmp(status, "failed") == 0) {
        cJSON *e = cJSON_AddObjectToObject(o, "error");
        cJSON_AddStringToObject(e, "code", decode_http_code_of(r->err_st) >= 500 ? "server_error" : "invalid_request");
        cJSON_AddStringToObject(e, "message", r->err_msg[0] != '\0' ? r->err_msg : pd_status_str(r->err_st));
    } else {
        cJSON_AddNullToObject(o, "error");
    }
    if (strcmp(status, "incomplete") == 0)
        cJSON_AddStringToObject(cJSON_AddObjectToObject(o, "incomplete_details"), "reason", "max_output_tokens");
    else
        cJSON_AddNullToObject(o, "incomplete_details");
    cJSON_AddStringToObject(o, "model", r->dh->model);
    cJSON_AddItemToObject(o, "output", with_output ? cJSON_Duplicate(r->rs->items, 1) : cJSON_CreateArray());
    static const struct { const char *key; int kind; double num; const char *str; } dflt[] = {
        {"instructions", 0, 0, NULL}, {"max_output_tokens", 0, 0, NULL}, {"temperature", 1, 1.0, NULL},
        {"top_p", 1, 1.0, NULL}, {"tools", 2, 0, NULL}, {"tool_choice", 3, 0, "auto"},
        {"parallel_tool_calls", 4, 0, NULL}, {"text", 5, 0, NULL}, {"reasoning", 0, 0, NULL},
        {"metadata", 6, 0, NULL}, {"user", 0, 0, NULL},
    };
    for (size_t k = 0; k < sizeof(dflt) / sizeof(dflt[0]); k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->resp_echo, dflt[k].key);
        if (v != NULL && !cJSON_IsNull(v)) {
            cJSON_AddItemToObject(o, dflt[k].key, cJSON_Duplicate(v, 1));
            continue;
        }
        switch (dflt[k].kind) {
        case 1: cJSON_AddNumberToObject(o, dflt[k].key, dflt[k].num); break;
        case 2: cJSON_AddArrayToObject(o, dflt[k].key); break;
        case 3: cJSON_AddStringToObject(o, dflt[k].key, dflt[k].str); break;
        case 4: cJSON_AddTrueToObject(o, dflt[k].key); break;
        case 5: cJSON_AddStringToObject(cJSON_AddObjectToObject(cJSON_AddObjectToObject(o, "text"), "format"),
                                        "type", "text"); break;
        case 6: cJSON_AddObjectToObject(o, dflt[k].key); break;
        default: cJSON_AddNullToObject(o, dflt[k].key);
        }
    }
    const cJSON *prev = cJSON_GetObjectItemCaseSensitive(r->resp_echo, "previous_response_id");
    if (cJSON_IsString(prev))
        cJSON_AddStringToObject(o, "previous_response_id", prev->valuestring);
    else
        cJSON_AddNullToObject(o, "previous_response_id");
    cJSON_AddBoolToObject(o, "store", r->resp_conv != NULL || r->resp_stored);   /* kept once it completes */
    cJSON_AddStringToObject(o, "truncation", "disabled");
    if (!with_output) {
        cJSON_AddNullToObject(o, "usage");
        return o;
    }
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    cJSON_AddNumberToObject(u, "input_tokens", c->prompt_tokens);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "input_tokens_details"), "cached_tokens", c->cached_tokens);
    cJSON_AddNumberToObject(u, "output_tokens", c->n_tokens);
    /* not counted apart: the reasoning's tokens are part of output_tokens */
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "output_tokens_details"), "reasoning_tokens", 0);
    cJSON_AddNumberToObject(u, "total_tokens", c->prompt_tokens + c->n_tokens);
    cJSON *d = cJSON_AddObjectToObject(u, "dspark");   /* extension, as the other endpoints' */
    cJSON_AddNumberToObject(d, "rounds", c->rounds);
    cJSON_AddNumberToObject(d, "tau", c->rounds > 0 ? (double)c->accepted / c->rounds : 0.0);
    cJSON_AddNumberToObject(d, "block_size", c->block_size);
    cJSON_AddNumberToObject(d, "accepted_tokens", (double)c->accepted);
    return o;
}

void decode_http_resp_start(http_req *r)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "response", response_json(r, "in_progress", 0));
    event(r, "response.created", o);
    o = cJSON_CreateObject();
    cJSON_AddItemToObject(o, "response", response_json(r, "in_progress", 0));
    event(r, "response.in_progress", o);
}

void decode_http_resp_end(http_req *r)
{
    http_choice *c = &r->ch[0];
    int ok = r->err_st == PD_OK;
    if (ok && !r->stream) {
        /* the whole output split as a stream would have been */
        pd_chat_parser *p = pd_chat_parser_create(r->tools, r->reasoning);
        if (p != NULL)
            pd_chat_parser_feed(p, c->gen != NULL ? c->gen : "", c->gen_len, 1, decode_http_resp_piece, c);
        pd_chat_parser_destroy(p);
    }
    close_item(r, 1);
    const char *status = !ok ? "failed" : c->finish != NULL && strcmp(c->finish, "length") == 0
                                          ? "incomplete" : "completed";
    if (!ok) {   /* a failed response is not kept */
        cJSON_Delete(r->resp_conv);
        r->resp_conv = NULL;
    }
    if (r->resp_conv != NULL && r->dh->store != NULL) {
        cJSON_AddItemToArray(r->resp_conv, output_turn(r->rs->items));
        store_put(r->dh->store, r->id, r->resp_conv, response_json(r, status, 1));
        r->resp_conv = NULL;   /* the store's now; the response still says store: true */
        r->resp_stored = 1;
    }
    if (r->stream) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "response", response_json(r, status, 1));
        event(r, !ok ? "response.failed" : strcmp(status, "incomplete") == 0 ? "response.incomplete"
                                                                            : "response.completed", o);
        evhttp_send_reply_end(r->req);
        return;
    }
    if (!ok)
        decode_http_send_failure(r);
    else
        decode_http_send_json(r->req, response_json(r, status, 1));
}
