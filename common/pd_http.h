/* pd_http.h - the nodes' HTTP server: libevent evhttp on a dedicated thread with its own pd_loop,
 * the operational endpoints both nodes serve (GET /health, GET /ready, GET /metrics), and the
 * reply helpers (JSON bodies, OpenAI-shaped errors).
 * Owns: the listening socket, the evhttp object, the HTTP thread and its pd_loop, method and
 *   body-size checks per route, 404 for unknown paths.
 * Not here: the OpenAI API (decode_node/decode_http*.c), what /ready means (the node's ready
 *   callback), the metric values (pd_metrics).
 * Threading: create, route, start, stop and destroy from one control thread (main). Route
 *   handlers, the ready callback and the helpers below run on the HTTP thread; other threads
 *   reach it with pd_loop_post(pd_http_loop(h), ...). A dedicated thread (rather than the
 *   decode engine's loop) keeps /health, /metrics and SSE writes answering while an engine step
 *   computes for tens of milliseconds. */
#ifndef PD_HTTP_H
#define PD_HTTP_H

#include <stddef.h>

#include "pd_loop.h"
#include "pd_metrics.h"
#include "pd_status.h"
#include "pd_tls.h"

struct evhttp_request;

typedef struct pd_http pd_http;

/* 1 = ready; 0 = not ready with a reason written to why[cap]. Runs on the HTTP thread. */
typedef int (*pd_http_ready_fn)(void *ud, char *why, size_t cap);
typedef void (*pd_http_handler)(struct evhttp_request *req, void *ud);

typedef struct {
    const char *addr;            /* "HOST:PORT" or "[V6]:PORT"; port 0 picks a free one */
    const char *node;            /* "decode" / "prefill": named in /health */
    pd_metrics *metrics;         /* borrowed (outlives the server); NULL: /metrics is empty */
    pd_http_ready_fn ready;      /* NULL: ready whenever the process is up */
    void *ready_ud;
    size_t max_body;             /* request bodies above this get 413 (0 = 8 MiB) */
    const pd_tls *tls;           /* NULL or no certificate: plain HTTP; else HTTPS only (TLS 1.2+)
                                  * with its certificate and key (read at create); with client
                                  * roots, routes other than /health, /ready and /metrics answer
                                  * 403 to a client without a certificate that chains to them */
} pd_http_config;

enum { PD_HTTP_GET = 1, PD_HTTP_POST = 2, PD_HTTP_DELETE = 4 };   /* route method masks (HEAD
                                                                   * follows GET) */

/* Binds the socket (the port is known from here on) and prepares the ops routes; nothing is
 * served before pd_http_start. Errors: PD_ERR_INVALID (bad address, a certificate OpenSSL
 * refuses), PD_ERR_IO (bind), PD_ERR_NOMEM. */
pd_status pd_http_create(const pd_http_config *cfg, pd_http **out, pd_err *err);
/* Add a route before pd_http_start: an exact path (the query string is ignored), or a path
 * ending in "/" + "*" for every path under it with at least one more character (the handler reads
 * the rest from the URI), the methods it takes (others get 405 with an Allow header). fn runs on the HTTP thread with the body already
 * read and within max_body. ud is borrowed. Errors: PD_ERR_INVALID (path taken / started). */
pd_status pd_http_route(pd_http *h, const char *path, int methods, pd_http_handler fn, void *ud,
                        pd_err *err);
int pd_http_port(const pd_http *h);
pd_loop *pd_http_loop(pd_http *h);
/* HTTPS: t's certificate and key (and client roots) for the connections accepted from here on
 * (a reload of the files named at start; any thread); open connections keep theirs. A server
 * that was made plain stays plain (PD_OK, nothing done). Errors: PD_ERR_INVALID (OpenSSL
 * refuses them; the material in force stays), PD_ERR_NOMEM. */
pd_status pd_http_set_tls(pd_http *h, const pd_tls *t, pd_err *err);
/* Start the HTTP thread. Errors: PD_ERR_INTERNAL (thread). */
pd_status pd_http_start(pd_http *h, pd_err *err);
/* Stop the loop and join the thread: no handler or post runs after this returns; posts are
 * refused (PD_ERR_CANCELLED). Connections stay open until destroy. Idempotent. */
void pd_http_stop(pd_http *h);
/* Stop, close every connection, free. NULL is a no-op. */
void pd_http_destroy(pd_http *h);

/* Helpers, HTTP thread only. */
/* Send a complete reply: code, content type (NULL = application/json), body[len]. */
void pd_http_reply(struct evhttp_request *req, int code, const char *content_type,
                   const char *body, size_t len);
/* OpenAI's error shape: {"error":{"message","type","param","code"}}; param and code may be NULL
 * (JSON null). type: "invalid_request_error", "not_found_error", "server_error", ... */
void pd_http_error(struct evhttp_request *req, int code, const char *type, const char *param,
                   const char *err_code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* The request body as a malloc'd NUL-terminated copy (len in *len), NULL when out of memory. */
char *pd_http_body(struct evhttp_request *req, size_t *len);

#endif
