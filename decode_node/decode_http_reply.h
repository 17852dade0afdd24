/* decode_http_reply.h - the replies of the OpenAI-compatible HTTP front end
 *   (decode_http_reply.c): the engine's callbacks of a choice, and errors.
 * Owns: decode_http_cb_token / _cb_done (what an engine request of a choice reports, carried to
 *   the HTTP thread and written out as JSON or SSE), the HTTP status of a pd_status, the
 *   OpenAI error reply.
 * Not here: the request's context and its lifetime (decode_http.c).
 * Threading: the callbacks on the engine thread; the rest on the HTTP thread. */
#ifndef DECODE_HTTP_REPLY_H
#define DECODE_HTTP_REPLY_H

#include "decode_api.h"
#include "pd_status.h"

struct evhttp_request;
typedef struct cJSON cJSON;

/* The HTTP status of an error status (400 invalid, 429 busy, 503, 504, ...). */
int decode_http_code_of(pd_status st);
/* Answers req with an OpenAI error object: its message, the type of code and the field
 * (param, NULL: null). */
void decode_http_send_error(struct evhttp_request *req, int code, const char *param, const char *msg);
/* One SSE event of r's stream: "event: NAME" when event is not NULL, then "data: " o's JSON
 * (o freed; nothing is sent once the reply is gone). */
struct http_req;
void decode_http_sse_send(struct http_req *r, const char *event, cJSON *o);
/* A 200 reply with o's JSON (o freed; 500 when it cannot be printed). */
void decode_http_send_json(struct evhttp_request *req, cJSON *o);
/* r's failure (its first failed choice's status and message) as the error reply. */
struct http_req;
void decode_http_send_failure(struct http_req *r);
/* A JSON string of s[0..n), its NUL bytes kept (pd_json_print writes them as \u0000). */
cJSON *decode_http_string_n(const char *s, size_t n);
/* decode_submit's callbacks of one choice (ud: its http_choice): a chunk of tokens, and the
 * result (after which the choice's reference to its http_req is dropped). */
void decode_http_cb_token(void *ud, const decode_chunk *c);
void decode_http_cb_done(void *ud, const decode_result *res);

#endif
