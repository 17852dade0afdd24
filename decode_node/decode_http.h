/* decode_http.h - the decode node's OpenAI-compatible HTTP front end.
 * Owns: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with stream: true),
 *   GET /v1/models, plus /health, /ready and /metrics through the pd_http server it owns; the
 *   request JSON validation, the chat prompt and the reply's split into content, reasoning and
 *   tool calls (through pd_chat, after checking the checkpoint's chat template),
 *   stop strings, the OpenAI response and error shapes, and draining for the HTTP side
 *   (decode_http.c: the server, routes and request contexts; decode_http_parse.c: the request
 *   bodies; decode_http_reply.c: stop strings, JSON and SSE replies, errors).
 * Not here: scheduling and admission (decode_server.c through decode_api.h), the metric values
 *   (decode_metrics.c), the HTTP plumbing (common/pd_http.c).
 * Threading: the functions below from the control thread (main). Requests are handled on the
 *   pd_http thread (a dedicated libevent loop, not the engine's: an engine step must not delay
 *   SSE writes or /health); the engine-thread callbacks only copy what they got and post it to
 *   that loop. */
#ifndef DECODE_HTTP_H
#define DECODE_HTTP_H

#include <stddef.h>

#include "decode_api.h"
#include "pd_metrics.h"
#include "pd_status.h"
#include "pd_tls.h"

typedef struct decode_http decode_http;
typedef struct decode_metrics decode_metrics;

typedef struct {
    const char *addr;              /* HOST:PORT; port 0 picks one (see decode_http_port) */
    const char *model_dir;         /* the target checkpoint: chat template and the model name */
    const char *model_name;        /* "id" in /v1/models; NULL = the model_dir's last component */
    pd_metrics *metrics;           /* borrowed: served on /metrics */
    decode_metrics *dm;            /* borrowed, may be NULL: refusals at admission are counted */
    size_t max_body;               /* bytes; 0 = 8 MiB */
    const char *api_key;           /* NULL/"": none; else the /v1 routes and /tokenize, /detokenize need
                                    * "Authorization: Bearer <key>" (/health, /ready, /metrics
                                    * stay open) */
    const pd_tls *tls;             /* NULL or no certificate: HTTP; else HTTPS only */
    size_t responses_store_bytes;  /* /v1/responses kept in memory (previous_response_id, GET,
                                    * DELETE); 0: none */
} decode_http_config;

/* Reads the chat template, binds, starts the HTTP thread. s is borrowed and must outlive
 * decode_http_stop. Errors: PD_ERR_INVALID / PD_ERR_IO (address, bind; a --chat-template that
 * cannot be read or does not parse), PD_ERR_NOMEM. */
pd_status decode_http_create(decode_server *s, const decode_http_config *cfg, decode_http **out,
                             pd_err *err);
int decode_http_port(const decode_http *h);
/* The model id the API answers with: served_name, else model_dir's last component. */
void decode_http_model_id(const char *model_dir, const char *served_name, char *out, size_t cap);
/* pd_http_set_tls on its server (a TLS reload; any thread). */
pd_status decode_http_set_tls(decode_http *h, const pd_tls *t, pd_err *err);
/* Stop admitting: /ready answers 503 and new generation requests get 503; requests already
 * running finish normally. Any thread. */
void decode_http_drain(decode_http *h);
/* Generation requests whose reply is not yet complete. Any thread. */
int decode_http_inflight(const decode_http *h);
/* Stop the HTTP thread (no handler runs after this). Call before decode_server_destroy. */
void decode_http_stop(decode_http *h);
/* After decode_server_destroy: frees what is left and closes the connections. NULL is a
 * no-op. */
void decode_http_destroy(decode_http *h);

#endif
