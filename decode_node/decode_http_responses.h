/* decode_http_responses.h - OpenAI's Responses API (POST /v1/responses) on top of the chat path
 *   (decode_http_responses.c).
 * Owns: a Responses request read into the chat request it means (input items as messages,
 *   instructions as the system turn, tools, tool_choice, text.format, max_output_tokens), and the
 *   reply: output items (reasoning, message, function_call) built from the split chat output,
 *   whole or as the API's typed stream events, and the response object with its usage.
 * Not here: the request's context and the engine (decode_http.c), the split of the output into
 *   content, reasoning and calls (pd_chat's parser), SSE plumbing of the other endpoints
 *   (decode_http_reply.c).
 * Stored responses (--responses-store-mb): a node keeps each completed response with its
 *   conversation (as chat messages, the response's output last) in memory, oldest dropped first
 *   past the budget, so previous_response_id continues it and GET / DELETE /v1/responses/{id}
 *   read and drop it; they are lost on restart and not shared between replicas.
 * Threading: the HTTP thread. */
#ifndef DECODE_HTTP_RESPONSES_H
#define DECODE_HTTP_RESPONSES_H

#include <stddef.h>

#include "pd_chat.h"

struct http_req;
struct http_choice;
struct evhttp_request;
typedef struct cJSON cJSON;

/* The stored responses of a node; NULL (cap 0): none are kept. HTTP thread only. */
typedef struct resp_store resp_store;
resp_store *decode_http_resp_store_create(size_t cap_bytes);
void decode_http_resp_store_destroy(resp_store *s);   /* NULL is fine */
/* GET /v1/responses/{id} (the stored response) and, del, DELETE (drops it); 404 when it is not
 * stored. */
void decode_http_responses_stored(struct evhttp_request *req, resp_store *s, int del);

/* The chat request (a new object, the caller's to cJSON_Delete) a Responses request means, in
 * *echo the fields the response repeats (instructions, max_output_tokens, tools, ...), and in
 * *conv the conversation to store with the response (NULL: it is not to be stored: store false,
 * or no store). NULL with *code (400, or 404 for a previous_response_id not stored), *param (the
 * Responses field at fault) and msg when it is malformed or asks for what is not served (other
 * input than text, built-in tools). */
cJSON *decode_http_responses_request(const cJSON *root, resp_store *store, cJSON **echo, cJSON **conv,
                                     int *code, const char **param, char *msg, size_t cap);
/* The Responses field a chat field's error names (for errors found on the chat request). */
const char *decode_http_responses_param(const char *chat_param);

/* The reply's output items of a request (its one choice). */
typedef struct resp_state resp_state;
resp_state *decode_http_resp_create(void);
void decode_http_resp_destroy(resp_state *s);   /* NULL is fine */
/* Streamed: the first events (response.created, response.in_progress), after the SSE headers. */
void decode_http_resp_start(struct http_req *r);
/* pd_chat_parser's emit (ud: the http_choice): a piece of the output into the items (streamed:
 * with its events). */
void decode_http_resp_piece(void *ud, const pd_chat_piece *p);
/* The end of the reply: the open item closed, then the response (streamed: response.completed,
 * .incomplete or .failed; else the JSON body). */
void decode_http_resp_end(struct http_req *r);

#endif
