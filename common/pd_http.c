/* pd_http.c - evhttp server on its own thread, ops endpoints, reply helpers (pd_http.h).
 * Owns: the evhttp object and bound socket, the route table, the HTTP thread.
 * Not here: the OpenAI API, metric values.
 * Threading: see pd_http.h; after pd_http_start every evhttp call happens on the HTTP thread
 *   until pd_http_stop has joined it. */
#include "pd_http.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <openssl/ssl.h>

#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/bufferevent_ssl.h>
#include <event2/event.h>
#include <event2/http.h>
#include <event2/keyvalq_struct.h>
#include <event2/listener.h>

#include "pd_cli.h"
#include "pd_log.h"

#define MAX_ROUTES 32
#define DEFAULT_MAX_BODY (8u << 20)
#define ACCEPT_PAUSE_MIN_MS 100              /* first pause after a failed accept() */
#define ACCEPT_PAUSE_MAX_MS 1000             /* doubling up to this while it keeps failing */
#define ACCEPT_LOG_EVERY_MS 10000            /* one warning per this, with the count between */

typedef struct {
    pd_http *h;
    char *path;
    int methods;
    pd_http_handler fn;
    void *ud;
    int open;            /* /health, /ready, /metrics: served without a client certificate */
    size_t prefix;       /* a prefix route ("/x/" then "*"): the length of "/x/" (0: exact) */
} route;

struct pd_http {
    pd_http_config cfg;
    char node[32];
    pd_loop *loop;
    struct evhttp *http;
    int port;
    pthread_t thread;
    int started, stopped;
    route routes[MAX_ROUTES];
    int n_routes;
    /* accept() failures (accept_error_cb): the listener pauses, a timer resumes it */
    struct evconnlistener *lev;
    pd_loop_timer *accept_timer;
    uint64_t accept_pause_ms;
    double accept_last_err_ms, accept_last_log_ms;
    uint64_t accept_errors, accept_errors_logged;
    pd_metric *m_accept_errors;
    pd_http *next_listener;                  /* listener_link's list */
    SSL_CTX *ssl_ctx;                        /* HTTPS: every new connection's TLS session
                                              * (tls_mu: pd_http_set_tls replaces it) */
    pthread_mutex_t tls_mu;
    int need_client_cert;                    /* mutual TLS on the routes that are not open */
};

/* ---------------------------------------------------------------------------------------------
 * Helpers */

void pd_http_reply(struct evhttp_request *req, int code, const char *content_type,
                   const char *body, size_t len)
{
    struct evkeyvalq *oh = evhttp_request_get_output_headers(req);
    evhttp_add_header(oh, "Content-Type", content_type != NULL ? content_type : "application/json");
    struct evbuffer *b = evbuffer_new();
    if (b == NULL) {
        evhttp_send_error(req, 500, "out of memory");
        return;
    }
    if (body != NULL && len > 0)
        evbuffer_add(b, body, len);
    const char *reason = code == 200 ? "OK" : code == 400 ? "Bad Request" : code == 404 ? "Not Found"
                       : code == 405 ? "Method Not Allowed" : code == 413 ? "Payload Too Large"
                       : code == 429 ? "Too Many Requests" : code == 501 ? "Not Implemented"
                       : code == 503 ? "Service Unavailable" : code == 504 ? "Gateway Timeout"
                       : code >= 500 ? "Internal Server Error" : "Error";
    evhttp_send_reply(req, code, reason, b);
    evbuffer_free(b);
}

void pd_http_error(struct evhttp_request *req, int code, const char *type, const char *param,
                   const char *err_code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    cJSON *root = cJSON_CreateObject();
    cJSON *e = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", type);
    if (param != NULL)
        cJSON_AddStringToObject(e, "param", param);
    else
        cJSON_AddNullToObject(e, "param");
    if (err_code != NULL)
        cJSON_AddStringToObject(e, "code", err_code);
    else
        cJSON_AddNullToObject(e, "code");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (s == NULL) {
        evhttp_send_error(req, 500, "out of memory");
        return;
    }
    pd_http_reply(req, code, NULL, s, strlen(s));
    free(s);
}

char *pd_http_body(struct evhttp_request *req, size_t *len)
{
    struct evbuffer *in = evhttp_request_get_input_buffer(req);
    size_t n = evbuffer_get_length(in);
    char *p = malloc(n + 1);
    if (p == NULL)
        return NULL;
    if (n > 0)
        evbuffer_copyout(in, p, n);
    p[n] = '\0';
    if (len != NULL)
        *len = n;
    return p;
}

/* ---------------------------------------------------------------------------------------------
 * Routing */

static void allow_header(struct evhttp_request *req, int methods)
{
    char allow[32] = "";
    if (methods & PD_HTTP_GET)
        strcat(allow, "GET, HEAD");
    if (methods & PD_HTTP_POST)
        strcat(allow, allow[0] != '\0' ? ", POST" : "POST");
    if (methods & PD_HTTP_DELETE)
        strcat(allow, allow[0] != '\0' ? ", DELETE" : "DELETE");
    evhttp_add_header(evhttp_request_get_output_headers(req), "Allow", allow);
}

/* The request came over TLS with a client certificate that verified (a presented one that does
 * not verify fails the handshake: pd_tls_ssl_ctx) */
static int has_client_cert(struct evhttp_request *req)
{
    struct evhttp_connection *c = evhttp_request_get_connection(req);
    struct bufferevent *bev = c != NULL ? evhttp_connection_get_bufferevent(c) : NULL;
    SSL *ssl = bev != NULL ? bufferevent_openssl_get_ssl(bev) : NULL;
    if (ssl == NULL)
        return 0;
    X509 *peer = SSL_get1_peer_certificate(ssl);
    int ok = peer != NULL && SSL_get_verify_result(ssl) == X509_V_OK;
    X509_free(peer);
    return ok;
}

static void route_cb(struct evhttp_request *req, void *arg)
{
    route *r = arg;
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    int ok = ((r->methods & PD_HTTP_GET) && (cmd == EVHTTP_REQ_GET || cmd == EVHTTP_REQ_HEAD)) ||
             ((r->methods & PD_HTTP_POST) && cmd == EVHTTP_REQ_POST) ||
             ((r->methods & PD_HTTP_DELETE) && cmd == EVHTTP_REQ_DELETE);
    if (!ok) {
        allow_header(req, r->methods);
        pd_http_error(req, 405, "invalid_request_error", NULL, "method_not_allowed",
                      "method not allowed on %s", r->path);
        return;
    }
    if (r->h->need_client_cert && !r->open && !has_client_cert(req)) {
        pd_http_error(req, 403, "invalid_request_error", NULL, "client_certificate_required",
                      "a client certificate signed by the node's --tls-client-ca is required on %s",
                      r->path);
        return;
    }
    size_t n = evbuffer_get_length(evhttp_request_get_input_buffer(req));
    if (n > r->h->cfg.max_body) {
        pd_http_error(req, 413, "invalid_request_error", NULL, "request_too_large",
                      "request body of %zu bytes exceeds the limit of %zu bytes", n,
                      r->h->cfg.max_body);
        return;
    }
    r->fn(req, r->ud);
}

static void notfound_cb(struct evhttp_request *req, void *arg)
{
    pd_http *h = arg;
    const char *uri = evhttp_request_get_uri(req);
    char path[256];
    snprintf(path, sizeof(path), "%s", uri != NULL ? uri : "");
    char *q = strchr(path, '?');
    if (q != NULL)
        *q = '\0';
    for (int i = 0; i < h->n_routes; i++) {   /* the prefix routes */
        route *r = &h->routes[i];
        if (r->prefix > 0 && strlen(path) > r->prefix && strncmp(path, r->path, r->prefix) == 0) {
            route_cb(req, r);
            return;
        }
    }
    enum evhttp_cmd_type cmd = evhttp_request_get_command(req);
    const char *m = cmd == EVHTTP_REQ_GET ? "GET" : cmd == EVHTTP_REQ_POST ? "POST"
                  : cmd == EVHTTP_REQ_HEAD ? "HEAD" : cmd == EVHTTP_REQ_PUT ? "PUT"
                  : cmd == EVHTTP_REQ_DELETE ? "DELETE" : cmd == EVHTTP_REQ_OPTIONS ? "OPTIONS"
                  : cmd == EVHTTP_REQ_PATCH ? "PATCH" : "?";
    pd_http_error(req, 404, "invalid_request_error", NULL, "not_found", "no route for %s %s", m,
                  path);
}

static void health_cb(struct evhttp_request *req, void *ud)
{
    pd_http *h = ud;
    char body[96];
    int n = snprintf(body, sizeof(body), "{\"status\":\"ok\",\"node\":\"%s\"}", h->node);
    pd_http_reply(req, 200, NULL, body, (size_t)n);
}

static void ready_cb(struct evhttp_request *req, void *ud)
{
    pd_http *h = ud;
    char why[256] = "";
    int ok = h->cfg.ready == NULL || h->cfg.ready(h->cfg.ready_ud, why, sizeof(why));
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "status", ok ? "ready" : "not ready");
    cJSON_AddStringToObject(o, "node", h->node);
    if (!ok)
        cJSON_AddStringToObject(o, "reason", why);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (s == NULL) {
        evhttp_send_error(req, 500, "out of memory");
        return;
    }
    pd_http_reply(req, ok ? 200 : 503, NULL, s, strlen(s));
    free(s);
}

static void metrics_cb(struct evhttp_request *req, void *ud)
{
    pd_http *h = ud;
    size_t len = 0;
    char *txt = h->cfg.metrics != NULL ? pd_metrics_render(h->cfg.metrics, &len) : strdup("");
    if (txt == NULL) {
        pd_http_error(req, 500, "server_error", NULL, NULL, "out of memory rendering metrics");
        return;
    }
    pd_http_reply(req, 200, "text/plain; version=0.0.4; charset=utf-8", txt, len);
    free(txt);
}

pd_status pd_http_route(pd_http *h, const char *path, int methods, pd_http_handler fn, void *ud,
                        pd_err *err)
{
    if (h->started)
        return pd_err_set(err, PD_ERR_INVALID, "http: route %s added after start", path);
    if (h->n_routes == MAX_ROUTES)
        return pd_err_set(err, PD_ERR_INVALID, "http: more than %d routes", MAX_ROUTES);
    route *r = &h->routes[h->n_routes];
    r->path = strdup(path);
    if (r->path == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "http: route");
    r->h = h;
    r->methods = methods;
    r->fn = fn;
    r->ud = ud;
    size_t pl = strlen(path);
    r->prefix = pl >= 2 && strcmp(path + pl - 2, "/*") == 0 ? pl - 1 : 0;
    if (r->prefix > 0) {   /* a prefix route: served from notfound_cb */
        h->n_routes++;
        return PD_OK;
    }
    if (evhttp_set_cb(h->http, path, route_cb, r) != 0) {
        free(r->path);
        r->path = NULL;
        return pd_err_set(err, PD_ERR_INVALID, "http: route %s already taken", path);
    }
    h->n_routes++;
    return PD_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Lifetime */

static int split_addr(const char *addr, char *host, size_t hcap, int *port)
{
    const char *colon;
    if (addr[0] == '[') {
        const char *rb = strchr(addr, ']');
        if (rb == NULL || rb[1] != ':' || (size_t)(rb - addr - 1) >= hcap)
            return -1;
        memcpy(host, addr + 1, (size_t)(rb - addr - 1));
        host[rb - addr - 1] = '\0';
        colon = rb + 1;
    } else {
        colon = strrchr(addr, ':');
        if (colon == NULL || (size_t)(colon - addr) >= hcap)
            return -1;
        memcpy(host, addr, (size_t)(colon - addr));
        host[colon - addr] = '\0';
    }
    char *end = NULL;
    errno = 0;
    long p = strtol(colon + 1, &end, 10);
    if (colon[1] == '\0' || *end != '\0' || errno != 0 || p < 0 || p > 65535)
        return -1;
    if (host[0] == '\0')
        snprintf(host, hcap, "0.0.0.0");
    *port = (int)p;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Accept failures. accept() failing for want of descriptors (EMFILE, ENFILE) or memory leaves
 * the connection in the listen backlog and the socket readable, and libevent 2.1 retries at
 * once, forever: the HTTP thread spun at 100 % CPU and wrote a warning per try (1.5 M lines in
 * 5 s under a 128-descriptor limit). The listener pauses instead, 100 ms at first, doubling to
 * 1 s while the failures go on; the connections it has keep being served, the waiting ones are
 * accepted once descriptors free up. One warning per 10 s with the count, and a counter. */

static void accept_resume(void *arg)
{
    pd_http *h = arg;
    evconnlistener_enable(h->lev);
}

/* libevent hands the error callback the listener's user data, which is evhttp's, so the
 * servers whose listeners have one are found here by listener */
static pthread_mutex_t listeners_mu = PTHREAD_MUTEX_INITIALIZER;
static pd_http *listeners;                   /* linked through next_listener */

static void listener_link(pd_http *h, int on)
{
    pthread_mutex_lock(&listeners_mu);
    pd_http **pp = &listeners;
    while (*pp != NULL && *pp != h)
        pp = &(*pp)->next_listener;
    if (on && *pp == NULL) {
        h->next_listener = listeners;
        listeners = h;
    } else if (!on && *pp != NULL) {
        *pp = h->next_listener;
    }
    pthread_mutex_unlock(&listeners_mu);
}

static void accept_error_cb(struct evconnlistener *lev, void *arg)
{
    (void)arg;
    pd_http *h;
    pthread_mutex_lock(&listeners_mu);
    for (h = listeners; h != NULL && h->lev != lev; h = h->next_listener)
        ;
    pthread_mutex_unlock(&listeners_mu);
    if (h == NULL)
        return;
    int e = EVUTIL_SOCKET_ERROR();
    double now = pd_cli_now_ms();
    h->accept_pause_ms = now - h->accept_last_err_ms > 5.0 * ACCEPT_PAUSE_MAX_MS ? ACCEPT_PAUSE_MIN_MS
                       : h->accept_pause_ms * 2 > ACCEPT_PAUSE_MAX_MS ? ACCEPT_PAUSE_MAX_MS
                       : h->accept_pause_ms * 2;
    h->accept_last_err_ms = now;
    h->accept_errors++;
    pd_metric_inc(h->m_accept_errors);
    evconnlistener_disable(lev);
    pd_loop_timer_start(h->accept_timer, h->accept_pause_ms, false);
    if (h->accept_last_log_ms == 0 || now - h->accept_last_log_ms >= ACCEPT_LOG_EVERY_MS) {
        PD_LOG_WARN("http", "accept failed: %s (%llu failures since the last report); new "
                    "connections wait in the listen backlog, retried every <= %d ms",
                    evutil_socket_error_to_string(e),
                    (unsigned long long)(h->accept_errors - h->accept_errors_logged),
                    ACCEPT_PAUSE_MAX_MS);
        h->accept_errors_logged = h->accept_errors;
        h->accept_last_log_ms = now;
    }
}

/* HTTPS: each accepted connection's bufferevent does the server side of TLS (evhttp sets the
 * socket afterwards). A client that closes without close_notify is not an error. */
static struct bufferevent *tls_bev(struct event_base *base, void *arg)
{
    pd_http *h = arg;
    pthread_mutex_lock(&h->tls_mu);
    SSL *ssl = SSL_new(h->ssl_ctx);          /* holds its own reference to the context */
    pthread_mutex_unlock(&h->tls_mu);
    if (ssl == NULL)
        return NULL;
    struct bufferevent *bev = bufferevent_openssl_socket_new(base, -1, ssl, BUFFEREVENT_SSL_ACCEPTING,
                                                             BEV_OPT_CLOSE_ON_FREE);
    if (bev == NULL) {
        SSL_free(ssl);
        return NULL;
    }
    bufferevent_openssl_set_allow_dirty_shutdown(bev, 1);
    return bev;
}

pd_status pd_http_create(const pd_http_config *cfg, pd_http **out, pd_err *err)
{
    char host[128];
    int port = 0;
    if (cfg->addr == NULL || split_addr(cfg->addr, host, sizeof(host), &port) != 0)
        return pd_err_set(err, PD_ERR_INVALID, "http: bad address '%s' (want HOST:PORT)",
                          cfg->addr != NULL ? cfg->addr : "");
    pd_http *h = calloc(1, sizeof(*h));
    if (h == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "http server");
    h->cfg = *cfg;
    h->cfg.tls = NULL;                       /* read below into ssl_ctx */
    pthread_mutex_init(&h->tls_mu, NULL);
    if (h->cfg.max_body == 0)
        h->cfg.max_body = DEFAULT_MAX_BODY;
    snprintf(h->node, sizeof(h->node), "%s", cfg->node != NULL ? cfg->node : "node");
    h->cfg.node = h->node;
    h->cfg.addr = NULL;
    pd_status st = pd_loop_create(&h->loop, err);
    if (st != PD_OK)
        goto err_free;
    h->http = evhttp_new(pd_loop_base(h->loop));
    if (h->http == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "http: evhttp_new");
        goto err_loop;
    }
    /* Bodies past max_body (up to 4x) are read and refused by route_cb with an OpenAI-shaped
     * 413; beyond that libevent refuses them itself without reading them. */
    evhttp_set_max_body_size(h->http, (ev_ssize_t)(h->cfg.max_body * 4 + 4096));
    evhttp_set_max_headers_size(h->http, 64 * 1024);
    evhttp_set_timeout(h->http, 600);
    evhttp_set_allowed_methods(h->http, EVHTTP_REQ_GET | EVHTTP_REQ_POST | EVHTTP_REQ_HEAD |
                                        EVHTTP_REQ_PUT | EVHTTP_REQ_DELETE | EVHTTP_REQ_OPTIONS |
                                        EVHTTP_REQ_PATCH);
    evhttp_set_gencb(h->http, notfound_cb, h);
    if (cfg->tls != NULL && cfg->tls->cert_pem != NULL) {
        if ((h->ssl_ctx = pd_tls_ssl_ctx(cfg->tls, err)) == NULL) {
            st = pd_err_prefix(err, "http: TLS");
            goto err_http;
        }
        evhttp_set_bevcb(h->http, tls_bev, h);
        h->need_client_cert = cfg->tls->client_ca_pem != NULL;
    }
    errno = 0;
    struct evhttp_bound_socket *bs = evhttp_bind_socket_with_handle(h->http, host, (ev_uint16_t)port);
    if (bs == NULL) {
        /* errno is 0 when the host did not resolve (getaddrinfo fails without it) */
        st = pd_err_set(err, PD_ERR_IO, "http: cannot listen on %s port %d: %s", host, port,
                        errno != 0 ? strerror(errno) : "no such address here");
        goto err_http;
    }
    h->lev = evhttp_bound_socket_get_listener(bs);
    if ((st = pd_loop_timer_create(h->loop, accept_resume, h, &h->accept_timer, err)) != PD_OK)
        goto err_http;
    listener_link(h, 1);
    evconnlistener_set_error_cb(h->lev, accept_error_cb);
    if (h->cfg.metrics != NULL)
        h->m_accept_errors = pd_metrics_counter(h->cfg.metrics, "pdspark_http_accept_errors_total",
                                                "accept() failures on the HTTP listener (descriptor "
                                                "or memory limits; the listener pauses <= 1 s)", NULL);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    if (getsockname(evhttp_bound_socket_get_fd(bs), (struct sockaddr *)&ss, &sl) == 0)
        h->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                           : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    if ((st = pd_http_route(h, "/health", PD_HTTP_GET, health_cb, h, err)) != PD_OK ||
        (st = pd_http_route(h, "/ready", PD_HTTP_GET, ready_cb, h, err)) != PD_OK ||
        (st = pd_http_route(h, "/metrics", PD_HTTP_GET, metrics_cb, h, err)) != PD_OK)
        goto err_routes;
    for (int i = 0; i < h->n_routes; i++)
        h->routes[i].open = 1;
    *out = h;
    return PD_OK;
err_routes:
    for (int i = 0; i < h->n_routes; i++)
        free(h->routes[i].path);
    listener_link(h, 0);
    pd_loop_timer_destroy(h->accept_timer);
err_http:
    evhttp_free(h->http);
    pd_tls_ssl_ctx_free(h->ssl_ctx);
err_loop:
    pd_loop_destroy(h->loop);
err_free:
    pthread_mutex_destroy(&h->tls_mu);
    free(h);
    return st;
}

pd_status pd_http_set_tls(pd_http *h, const pd_tls *t, pd_err *err)
{
    pthread_mutex_lock(&h->tls_mu);
    int https = h->ssl_ctx != NULL;
    pthread_mutex_unlock(&h->tls_mu);
    if (!https)
        return PD_OK;
    SSL_CTX *ctx = pd_tls_ssl_ctx(t, err);
    if (ctx == NULL)
        return pd_err_prefix(err, "http: TLS");
    pthread_mutex_lock(&h->tls_mu);
    SSL_CTX *old = h->ssl_ctx;
    h->ssl_ctx = ctx;
    pthread_mutex_unlock(&h->tls_mu);
    pd_tls_ssl_ctx_free(old);                /* connections made with it keep their reference */
    return PD_OK;
}

int pd_http_port(const pd_http *h)
{
    return h->port;
}

pd_loop *pd_http_loop(pd_http *h)
{
    return h->loop;
}

static void *http_thread(void *arg)
{
    pd_http *h = arg;
    pd_err err = {0};
    if (pd_loop_run(h->loop, &err) != PD_OK)
        PD_LOG_ERROR("http", "event loop failed: %s", err.msg);
    return NULL;
}

pd_status pd_http_start(pd_http *h, pd_err *err)
{
    if (h->started)
        return PD_OK;
    int rc = pthread_create(&h->thread, NULL, http_thread, h);
    if (rc != 0)
        return pd_err_set(err, PD_ERR_INTERNAL, "http: thread: %s", strerror(rc));
    h->started = 1;
    return PD_OK;
}

void pd_http_stop(pd_http *h)
{
    if (h == NULL || !h->started || h->stopped)
        return;
    pd_loop_stop(h->loop);
    pthread_join(h->thread, NULL);
    h->stopped = 1;
}

void pd_http_destroy(pd_http *h)
{
    if (h == NULL)
        return;
    pd_http_stop(h);
    listener_link(h, 0);
    pd_loop_timer_destroy(h->accept_timer);
    evhttp_free(h->http);
    pd_tls_ssl_ctx_free(h->ssl_ctx);
    pthread_mutex_destroy(&h->tls_mu);
    pd_loop_destroy(h->loop);
    for (int i = 0; i < h->n_routes; i++)
        free(h->routes[i].path);
    free(h);
}
