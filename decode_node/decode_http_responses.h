/* decode_http_responses.h - OpenAI's Responses API (POST /v1/responses) on top of the chat path
 *   (decode_http_responses.c).
 * Owns: a Responses request read into the chat request it means (input items as messages,
 *   instructions as the system turn, tools, tool_choice, text.format, max_output_tokens), and the
 *   reply: output items (reasoning, message, function_call) built from the split chat output,
 *   whole or as the API's typed stream events, and the response object with its usage.
 * Not here: the request's context and the engine (decode_http.c), the split of the output into
 *   content, reasoning and calls (pd_chat's parser), SSE plumbing of the other endpoints
 *   (decode_http_reply.c). Nothing is stored: previous_response_id is refused by name.
 * Threading: the HTTP thread. */
#ifndef DECODE_HTTP_RESPONSES_H
#define DECODE_HTTP_RESPONSES_H

#include <stddef.h>

#include "pd_chat.h"

struct http_req;
struct http_choice;
typedef struct cJSON cJSON;

/* The chat request (a new object, the caller's to cJSON_Delete) a Responses request means, and in
 * *echo the fields the response repeats (instructions, max_output_tokens, tools, ...). NULL with
 * *param (the Responses field at fault) and msg when it is malformed or asks for what is not
 * served (stored responses, other input than text, built-in tools). */
cJSON *decode_http_responses_request(const cJSON *root, cJSON **echo, const char **param, char *msg,
                                     size_t cap);
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
