/* pd_rpc.c - gRPC C core behind a small protobuf-c API (see pd_rpc.h for the contract).
 * Owns: grpc_init/shutdown pairing, the server completion queue and its poller thread, per-call
 *       contexts (batches in flight, write queue, status), client calls, status mapping.
 * Not here: method semantics, message definitions, version policy (pd_proto_version.h).
 * Threading: the server CQ belongs to its poller thread; a call's mutable state is guarded by
 *       its mutex, which also serialises grpc_call_start_batch on that call (gRPC allows one
 *       op of each type in flight; a stream keeps one SEND_MESSAGE outstanding and queues the
 *       rest). Client calls own a private CQ on the calling thread. */
#include "pd_rpc.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "pd_cli.h"

#include "pd_log.h"
#include "pd_proto_version.h"
#include "pd_tls.h"

/* ---------------------------------------------------------------------------------------------
 * Status mapping: the only place */

pd_rpc_code pd_rpc_code_from(pd_status st)
{
    switch (st) {
    case PD_OK: return PD_RPC_OK;
    case PD_ERR_INVALID: return PD_RPC_INVALID_ARGUMENT;
    case PD_ERR_NOT_FOUND: return PD_RPC_NOT_FOUND;
    case PD_ERR_TIMEOUT: return PD_RPC_DEADLINE_EXCEEDED;
    case PD_ERR_PEER: return PD_RPC_UNAVAILABLE;
    case PD_ERR_BUSY: return PD_RPC_RESOURCE_EXHAUSTED;
    case PD_ERR_CANCELLED: return PD_RPC_CANCELLED;
    case PD_ERR_UNSUPPORTED: return PD_RPC_UNIMPLEMENTED;
    default: return PD_RPC_INTERNAL;
    }
}

pd_status pd_rpc_status_from_code(pd_rpc_code code)
{
    switch (code) {
    case PD_RPC_OK: return PD_OK;
    case PD_RPC_INVALID_ARGUMENT: return PD_ERR_INVALID;
    case PD_RPC_NOT_FOUND: return PD_ERR_NOT_FOUND;
    case PD_RPC_DEADLINE_EXCEEDED: return PD_ERR_TIMEOUT;
    case PD_RPC_UNAVAILABLE: return PD_ERR_PEER;
    case PD_RPC_RESOURCE_EXHAUSTED: return PD_ERR_BUSY;
    case PD_RPC_CANCELLED: return PD_ERR_CANCELLED;
    case PD_RPC_UNIMPLEMENTED: return PD_ERR_UNSUPPORTED;
    default: return PD_ERR_INTERNAL;
    }
}

const char *pd_rpc_code_str(pd_rpc_code code)
{
    static const char *const names[] = {
        "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
        "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
        "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
        "UNAUTHENTICATED"};
    if ((unsigned)code < sizeof(names) / sizeof(names[0]))
        return names[code];
    return "UNKNOWN_CODE";
}

/* ---------------------------------------------------------------------------------------------
 * Shared helpers */

/* Keepalive: a peer host that vanishes without a TCP reset (crash, partition) is noticed in
 * about PD_RPC_KEEPALIVE_MS + PD_RPC_KEEPALIVE_TIMEOUT_MS even on a call without a deadline. */
#define PD_RPC_KEEPALIVE_MS 20000
#define PD_RPC_KEEPALIVE_TIMEOUT_MS 10000

typedef struct {
    grpc_arg a[7];
    grpc_channel_args args;
} rpc_args;

/* Channel args: the transport limit is twice PD_RPC_MAX_MESSAGE_BYTES, so that a request
 * between the two reaches our own check and gets INVALID_ARGUMENT with a message (gRPC would
 * say RESOURCE_EXHAUSTED, which reads as "retry later"); beyond that gRPC refuses it.
 * Keepalive pings from clients, which servers must accept at that rate (the default would
 * answer them with GOAWAY). Servers bind without SO_REUSEPORT (gRPC's default on Linux): a
 * second node started on a port already served must fail, not share its connections with the
 * first one. A client's tls_name (not NULL or "") is the name TLS checks the server's certificate
 * against instead of the target's host. */
static const grpc_channel_args *channel_args_make(rpc_args *r, bool server, const char *tls_name)
{
    size_t n = 0;
    r->a[n].type = GRPC_ARG_INTEGER;
    r->a[n].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    r->a[n++].value.integer = (int)(2 * PD_RPC_MAX_MESSAGE_BYTES);
    r->a[n].type = GRPC_ARG_INTEGER;
    r->a[n].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    r->a[n++].value.integer = (int)(2 * PD_RPC_MAX_MESSAGE_BYTES);
    if (server) {
        r->a[n].type = GRPC_ARG_INTEGER;
        r->a[n].key = (char *)GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS;
        r->a[n++].value.integer = PD_RPC_KEEPALIVE_MS / 2;
        r->a[n].type = GRPC_ARG_INTEGER;
        r->a[n].key = (char *)GRPC_ARG_HTTP2_MAX_PING_STRIKES;
        r->a[n++].value.integer = 0;
        r->a[n].type = GRPC_ARG_INTEGER;
        r->a[n].key = (char *)GRPC_ARG_ALLOW_REUSEPORT;
        r->a[n++].value.integer = 0;
    } else {
        r->a[n].type = GRPC_ARG_INTEGER;
        r->a[n].key = (char *)GRPC_ARG_KEEPALIVE_TIME_MS;
        r->a[n++].value.integer = PD_RPC_KEEPALIVE_MS;
        r->a[n].type = GRPC_ARG_INTEGER;
        r->a[n].key = (char *)GRPC_ARG_KEEPALIVE_TIMEOUT_MS;
        r->a[n++].value.integer = PD_RPC_KEEPALIVE_TIMEOUT_MS;
        if (tls_name != NULL && tls_name[0] != '\0') {
            r->a[n].type = GRPC_ARG_STRING;
            r->a[n].key = (char *)GRPC_SSL_TARGET_NAME_OVERRIDE_ARG;
            r->a[n++].value.string = (char *)tls_name;
        }
    }
    r->args.num_args = n;
    r->args.args = r->a;
    return &r->args;
}

/* TLS (pd_rpc_set_tls): the PEM of every server and channel made afterwards */
static pthread_mutex_t tls_mu = PTHREAD_MUTEX_INITIALIZER;
static pd_tls tls_cfg;
static unsigned tls_gen;          /* bumped by every pd_rpc_set_tls (under tls_mu) */

pd_status pd_rpc_set_tls(const pd_tls *t, pd_err *err)
{
    pd_tls c = {0};
    if (t != NULL &&
        ((t->cert_pem != NULL && (c.cert_pem = strdup(t->cert_pem)) == NULL) ||
         (t->key_pem != NULL && (c.key_pem = strdup(t->key_pem)) == NULL) ||
         (t->ca_pem != NULL && (c.ca_pem = strdup(t->ca_pem)) == NULL) ||
         (t->client_ca_pem != NULL && (c.client_ca_pem = strdup(t->client_ca_pem)) == NULL))) {
        pd_tls_free(&c);
        return pd_err_set(err, PD_ERR_NOMEM, "rpc: TLS settings");
    }
    pthread_mutex_lock(&tls_mu);
    pd_tls old = tls_cfg;
    tls_cfg = c;
    tls_gen++;
    pthread_mutex_unlock(&tls_mu);
    pd_tls_free(&old);
    return PD_OK;
}

static grpc_ssl_certificate_config_reload_status server_cert_fetch(void *ud,
                                                                   grpc_ssl_server_certificate_config **config);

/* A served certificate makes the server TLS-only; client roots make it require and verify
 * client certificates (mutual TLS), else clients are not asked for one. gRPC asks
 * server_cert_fetch for the material at every handshake, so a later pd_rpc_set_tls is in force
 * for the connections that come after it (whether client certificates are asked for stays as
 * it was at creation). */
static grpc_server_credentials *server_creds(pd_rpc_server *srv)
{
    pthread_mutex_lock(&tls_mu);
    int tls = tls_cfg.cert_pem != NULL;
    grpc_ssl_client_certificate_request_type req =
        tls_cfg.client_ca_pem != NULL ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                      : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
    pthread_mutex_unlock(&tls_mu);
    if (!tls)
        return grpc_insecure_server_credentials_create();
    grpc_ssl_server_credentials_options *o =
        grpc_ssl_server_credentials_create_options_using_config_fetcher(req, server_cert_fetch, srv);
    return o != NULL ? grpc_ssl_server_credentials_create_with_options(o) : NULL;
}

/* Roots to trust make channels TLS: the server's certificate must chain to them and name the
 * target's host; a certificate of this process's own is presented to servers that ask. *gen:
 * the pd_rpc_set_tls they come from. */
static grpc_channel_credentials *channel_creds(unsigned *gen)
{
    pthread_mutex_lock(&tls_mu);
    *gen = tls_gen;
    grpc_ssl_pem_key_cert_pair pair = {tls_cfg.key_pem, tls_cfg.cert_pem};
    grpc_channel_credentials *c = tls_cfg.ca_pem != NULL
                                ? grpc_ssl_credentials_create_ex(tls_cfg.ca_pem,
                                                                 tls_cfg.cert_pem != NULL ? &pair : NULL,
                                                                 NULL, NULL)
                                : grpc_insecure_credentials_create();
    pthread_mutex_unlock(&tls_mu);
    return c;
}

/* Pack msg into a new byte buffer (NULL on allocation failure). */
static grpc_byte_buffer *buf_from_msg(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

static grpc_byte_buffer *buf_from_bytes(const void *p, size_t n)
{
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)p, n);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Flatten a received buffer; the slice is the caller's (grpc_slice_unref). */
static grpc_slice buf_flatten(grpc_byte_buffer *bb)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return grpc_empty_slice();
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    return s;
}

static gpr_timespec deadline_from_ms(int64_t timeout_ms)
{
    if (timeout_ms <= 0)
        return gpr_inf_future(GPR_CLOCK_REALTIME);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

/* ---------------------------------------------------------------------------------------------
 * Server */

typedef enum { TAG_NEW_CALL, TAG_RECV, TAG_CLOSE, TAG_SEND, TAG_STATUS, TAG_SHUTDOWN } tag_kind;

/* Every tag handed to gRPC: the poller switches on kind. */
typedef struct {
    tag_kind kind;
    void *owner;
} rpc_tag;

struct pd_rpc_server {
    grpc_server *server;
    grpc_completion_queue *cq;
    pthread_t poller;
    bool poller_started;
    int port;
    const pd_rpc_method *methods;
    size_t n_methods;
    void *ud;
    rpc_tag shutdown_tag;
    bool shutting_down;        /* set before shutdown_and_notify; read on the poller */
    pthread_mutex_t mu;        /* guards shutting_down vs. re-posting request_call */
    unsigned tls_gen;          /* the pd_rpc_set_tls gRPC has from server_cert_fetch (tls_mu) */
    bool tls_fetched;
};

/* gRPC's question at each handshake (on its threads): the material of the newest
 * pd_rpc_set_tls when this server has not had it yet */
static grpc_ssl_certificate_config_reload_status server_cert_fetch(void *ud,
                                                                   grpc_ssl_server_certificate_config **config)
{
    pd_rpc_server *srv = ud;
    grpc_ssl_certificate_config_reload_status rs = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_UNCHANGED;
    pthread_mutex_lock(&tls_mu);
    if (!srv->tls_fetched || srv->tls_gen != tls_gen) {
        rs = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_FAIL;   /* TLS taken away: the old stays */
        if (tls_cfg.cert_pem != NULL) {
            /* gRPC (1.51) asserts that a fetched config has client roots even where clients
             * are not asked for certificates; there the served chain stands in, never used */
            grpc_ssl_pem_key_cert_pair pair = {tls_cfg.key_pem, tls_cfg.cert_pem};
            *config = grpc_ssl_server_certificate_config_create(
                tls_cfg.client_ca_pem != NULL ? tls_cfg.client_ca_pem : tls_cfg.cert_pem, &pair, 1);
            if (*config != NULL) {
                rs = GRPC_SSL_CERTIFICATE_CONFIG_RELOAD_NEW;
                srv->tls_gen = tls_gen;
                srv->tls_fetched = true;
            }
        }
    }
    pthread_mutex_unlock(&tls_mu);
    return rs;
}

struct pd_rpc_call {
    pd_rpc_server *srv;        /* used on the poller thread only, before the handler returns */
    grpc_call *call;           /* NULL once released (no batch in flight and closed) */
    grpc_call_details details;
    grpc_metadata_array req_md;
    rpc_tag tag_new, tag_recv, tag_close, tag_send, tag_status;
    const pd_rpc_method *method;
    char *method_name;
    ProtobufCMessage *req;
    grpc_byte_buffer *recv_buf;
    int close_cancelled;       /* written by gRPC when RECV_CLOSE_ON_SERVER completes */

    pthread_mutex_t mu;
    int inflight;              /* batches started and not yet completed */
    bool node_ref;             /* the node holds the call (handler returned PD_OK) */
    bool closed;               /* RECV_CLOSE_ON_SERVER completed */
    bool cancelled;
    bool initial_md_sent;
    bool status_started;       /* finish/reply called (or an internal error status) */
    bool finish_pending;       /* status waits for the SEND_MESSAGE in flight */
    pd_rpc_code finish_code;
    char *finish_msg;
    grpc_byte_buffer *sending; /* the one SEND_MESSAGE in flight */
    grpc_byte_buffer *status_buf;
    grpc_byte_buffer **queue;  /* ring of writes waiting behind `sending` */
    size_t q_head, q_len, q_cap;
    pd_rpc_done_fn done_fn;
    void *done_arg;
};

static void call_free(pd_rpc_call *c)
{
    if (c->req != NULL)
        protobuf_c_message_free_unpacked(c->req, NULL);
    if (c->recv_buf != NULL)
        grpc_byte_buffer_destroy(c->recv_buf);
    for (size_t i = 0; i < c->q_len; i++)
        grpc_byte_buffer_destroy(c->queue[(c->q_head + i) % c->q_cap]);
    free(c->queue);
    if (c->sending != NULL)
        grpc_byte_buffer_destroy(c->sending);
    if (c->status_buf != NULL)
        grpc_byte_buffer_destroy(c->status_buf);
    grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->req_md);
    free(c->finish_msg);
    free(c->method_name);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static pd_rpc_call *call_alloc(pd_rpc_server *srv)
{
    pd_rpc_call *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->srv = srv;
    grpc_call_details_init(&c->details);
    grpc_metadata_array_init(&c->req_md);
    pthread_mutex_init(&c->mu, NULL);
    c->tag_new = (rpc_tag){TAG_NEW_CALL, c};
    c->tag_recv = (rpc_tag){TAG_RECV, c};
    c->tag_close = (rpc_tag){TAG_CLOSE, c};
    c->tag_send = (rpc_tag){TAG_SEND, c};
    c->tag_status = (rpc_tag){TAG_STATUS, c};
    return c;
}

/* One batch of c finished: release the grpc_call when none is left in flight (it is closed by
 * then, since RECV_CLOSE_ON_SERVER is the last to complete), and the context when the node
 * does not hold it either. */
static void call_batch_done(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    PD_ASSERT(c->inflight > 0);
    c->inflight--;
    grpc_call *gc = NULL;
    if (c->inflight == 0 && c->call != NULL) {
        gc = c->call;
        c->call = NULL;
    }
    bool free_it = c->inflight == 0 && !c->node_ref;
    pthread_mutex_unlock(&c->mu);
    if (gc != NULL)
        grpc_call_unref(gc);
    if (free_it)
        call_free(c);
}

/* Start a batch under c->mu. On failure nothing was started. */
static bool call_start_locked(pd_rpc_call *c, const grpc_op *ops, size_t n, rpc_tag *tag)
{
    if (c->call == NULL)
        return false;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, tag, NULL);
    if (e != GRPC_CALL_OK) {
        PD_LOG_ERROR("rpc", "%s: start batch: %s", c->method_name ? c->method_name : "?",
                     grpc_call_error_to_string(e));
        return false;
    }
    c->inflight++;
    return true;
}

static void op_initial_md(grpc_op *op)
{
    memset(op, 0, sizeof(*op));
    op->op = GRPC_OP_SEND_INITIAL_METADATA;
}

/* Send the status now (nothing in flight on the send side). Under c->mu. */
static void call_send_status_locked(pd_rpc_call *c, pd_rpc_code code, const char *msg)
{
    grpc_op ops[2];
    size_t n = 0;
    if (!c->initial_md_sent)
        op_initial_md(&ops[n++]);
    grpc_slice details = grpc_slice_from_copied_string(msg != NULL ? msg : "");
    memset(&ops[n], 0, sizeof(ops[n]));
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n].data.send_status_from_server.status_details = &details;
    n++;
    if (call_start_locked(c, ops, n, &c->tag_status))
        c->initial_md_sent = true;
    grpc_slice_unref(details);   /* not retained past start_batch */
}

/* End the call with a status after the queued writes (or drop it if the client is gone). */
static pd_status call_finish_internal(pd_rpc_call *c, pd_rpc_code code, const char *msg)
{
    pthread_mutex_lock(&c->mu);
    if (c->status_started) {
        pthread_mutex_unlock(&c->mu);
        return PD_ERR_INVALID;
    }
    c->status_started = true;
    if (!c->closed) {
        if (c->sending != NULL) {
            c->finish_pending = true;
            c->finish_code = code;
            c->finish_msg = strdup(msg != NULL ? msg : "");
        } else {
            call_send_status_locked(c, code, msg);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return PD_OK;
}

static void call_release_node_ref(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    c->node_ref = false;
    bool free_it = c->inflight == 0;
    pthread_mutex_unlock(&c->mu);
    if (free_it)
        call_free(c);
}

/* Start the next queued write, or the pending status. Under c->mu, nothing being sent. */
static void call_pump_locked(pd_rpc_call *c)
{
    if (c->closed)
        return;
    if (c->q_len > 0) {
        grpc_byte_buffer *bb = c->queue[c->q_head];
        c->q_head = (c->q_head + 1) % c->q_cap;
        c->q_len--;
        grpc_op ops[2];
        size_t n = 0;
        if (!c->initial_md_sent)
            op_initial_md(&ops[n++]);
        memset(&ops[n], 0, sizeof(ops[n]));
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = bb;
        n++;
        if (call_start_locked(c, ops, n, &c->tag_send)) {
            c->initial_md_sent = true;
            c->sending = bb;
            return;
        }
        /* Cannot send (logged): drop the stream's queue and still try to end the call. */
        grpc_byte_buffer_destroy(bb);
        for (size_t i = 0; i < c->q_len; i++)
            grpc_byte_buffer_destroy(c->queue[(c->q_head + i) % c->q_cap]);
        c->q_len = 0;
        if (!c->finish_pending)
            return;
    }
    if (c->finish_pending) {
        c->finish_pending = false;
        call_send_status_locked(c, c->finish_code, c->finish_msg);
    }
}

static void server_request_next(pd_rpc_server *srv);

static void server_on_new_call(pd_rpc_server *srv, pd_rpc_call *c, bool ok)
{
    if (!ok) {                        /* server shutting down: the pending request is void */
        call_free(c);
        return;
    }
    server_request_next(srv);         /* re-post first so new calls keep flowing */

    c->method_name = grpc_slice_to_c_string(c->details.method);
    char *tmp = c->method_name;       /* gpr-allocated: move to malloc for call_free */
    c->method_name = strdup(tmp != NULL ? tmp : "");
    gpr_free(tmp);

    pthread_mutex_lock(&c->mu);
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    if (!call_start_locked(c, &op, 1, &c->tag_close)) {
        /* Nothing in flight: release here. */
        grpc_call *gc = c->call;
        c->call = NULL;
        pthread_mutex_unlock(&c->mu);
        if (gc != NULL)
            grpc_call_unref(gc);
        call_free(c);
        return;
    }
    for (size_t i = 0; i < srv->n_methods; i++) {
        if (c->method_name != NULL && strcmp(srv->methods[i].method, c->method_name) == 0) {
            c->method = &srv->methods[i];
            break;
        }
    }
    if (c->method != NULL) {
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &c->recv_buf;
        if (call_start_locked(c, &op, 1, &c->tag_recv)) {
            pthread_mutex_unlock(&c->mu);
            return;
        }
    }
    pthread_mutex_unlock(&c->mu);
    if (c->method == NULL) {
        PD_LOG_DEBUG("rpc", "unknown method %s", c->method_name);
        char msg[256];
        snprintf(msg, sizeof(msg), "unknown method %s", c->method_name);
        call_finish_internal(c, PD_RPC_UNIMPLEMENTED, msg);
    } else {
        call_finish_internal(c, PD_RPC_INTERNAL, "cannot receive request");
    }
}

static void server_on_recv(pd_rpc_server *srv, pd_rpc_call *c, bool ok)
{
    pthread_mutex_lock(&c->mu);
    grpc_byte_buffer *bb = c->recv_buf;
    c->recv_buf = NULL;
    pthread_mutex_unlock(&c->mu);

    pd_err err;
    pd_err_clear(&err);
    ProtobufCMessage *req = NULL;
    if (!ok || bb == NULL) {
        pd_err_set(&err, PD_ERR_INVALID, "%s: no request message", c->method_name);
    } else {
        size_t len = grpc_byte_buffer_length(bb);
        if (len > PD_RPC_MAX_MESSAGE_BYTES) {
            pd_err_set(&err, PD_ERR_INVALID, "%s: request of %zu bytes exceeds the limit %u",
                       c->method_name, len, PD_RPC_MAX_MESSAGE_BYTES);
        } else {
            grpc_slice s = buf_flatten(bb);
            req = protobuf_c_message_unpack(c->method->req, NULL, GRPC_SLICE_LENGTH(s),
                                            GRPC_SLICE_START_PTR(s));
            grpc_slice_unref(s);
            if (req == NULL)
                pd_err_set(&err, PD_ERR_INVALID, "%s: malformed %s (%zu bytes)", c->method_name,
                           c->method->req->name, len);
            else if (pd_proto_version_check(req, &err) != PD_OK)
                pd_err_prefix(&err, "%s", c->method_name);
        }
    }
    if (bb != NULL)
        grpc_byte_buffer_destroy(bb);

    if (err.code != PD_OK) {
        PD_LOG_DEBUG("rpc", "%s", err.msg);
        if (req != NULL)
            protobuf_c_message_free_unpacked(req, NULL);
        call_finish_internal(c, pd_rpc_code_from(err.code), err.msg);
        return;
    }
    pthread_mutex_lock(&c->mu);
    c->req = req;
    c->node_ref = true;
    pthread_mutex_unlock(&c->mu);
    /* The close batch is still in flight (we are on the poller), so c outlives the handler
     * even if it finishes the call at once. */
    pd_status st = c->method->fn(srv->ud, req, c);
    if (st != PD_OK)
        pd_rpc_finish(c, st, NULL);
}

static void server_on_close(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    c->closed = true;
    c->cancelled = c->close_cancelled != 0;
    for (size_t i = 0; i < c->q_len; i++)
        grpc_byte_buffer_destroy(c->queue[(c->q_head + i) % c->q_cap]);
    c->q_len = 0;
    c->finish_pending = false;
    pd_rpc_done_fn fn = c->done_fn;
    void *arg = c->done_arg;
    c->done_fn = NULL;
    bool cancelled = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    if (cancelled)
        PD_LOG_DEBUG("rpc", "%s: cancelled by the client, deadline or shutdown", c->method_name);
    if (fn != NULL)
        fn(arg, c, cancelled);
}

static void server_on_send(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    if (c->sending != NULL) {
        grpc_byte_buffer_destroy(c->sending);
        c->sending = NULL;
    }
    call_pump_locked(c);
    pthread_mutex_unlock(&c->mu);
}

static void server_on_status(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    if (c->status_buf != NULL) {
        grpc_byte_buffer_destroy(c->status_buf);
        c->status_buf = NULL;
    }
    pthread_mutex_unlock(&c->mu);
}

static void server_request_next(pd_rpc_server *srv)
{
    pthread_mutex_lock(&srv->mu);
    if (srv->shutting_down) {
        pthread_mutex_unlock(&srv->mu);
        return;
    }
    pd_rpc_call *c = call_alloc(srv);
    if (c == NULL) {
        pthread_mutex_unlock(&srv->mu);
        PD_LOG_ERROR("rpc", "out of memory: server stops accepting calls");
        return;
    }
    grpc_call_error e = grpc_server_request_call(srv->server, &c->call, &c->details, &c->req_md,
                                                 srv->cq, srv->cq, &c->tag_new);
    pthread_mutex_unlock(&srv->mu);
    if (e != GRPC_CALL_OK) {
        PD_LOG_ERROR("rpc", "request call: %s", grpc_call_error_to_string(e));
        call_free(c);
    }
}

static void *server_poller(void *arg)
{
    pd_rpc_server *srv = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                   NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        rpc_tag *t = ev.tag;
        pd_rpc_call *c = t->owner;
        switch (t->kind) {
        case TAG_NEW_CALL:
            server_on_new_call(srv, c, ev.success != 0);
            break;
        case TAG_RECV:
            server_on_recv(srv, c, ev.success != 0);
            call_batch_done(c);
            break;
        case TAG_CLOSE:
            server_on_close(c);
            call_batch_done(c);
            break;
        case TAG_SEND:
            server_on_send(c);
            call_batch_done(c);
            break;
        case TAG_STATUS:
            server_on_status(c);
            call_batch_done(c);
            break;
        case TAG_SHUTDOWN:
            /* Every call is released: nothing more will be queued on the CQ. */
            grpc_completion_queue_shutdown(srv->cq);
            break;
        }
    }
    return NULL;
}

/* The decimal port of HOST:PORT (any size: gRPC would take it modulo 65536), -1 when addr has
 * no such port (not HOST:PORT, or a target form such as unix:PATH) */
static long addr_port(const char *addr)
{
    char host[256], port[32], *end = NULL;
    if (pd_cli_split_hostport(addr, host, sizeof(host), port, sizeof(port)) != 0 || port[0] < '0' ||
        port[0] > '9')
        return -1;
    errno = 0;
    long pn = strtol(port, &end, 10);
    if (*end != '\0')
        return -1;
    return errno == ERANGE ? LONG_MAX : pn;
}

pd_status pd_rpc_server_create(const char *addr, const pd_rpc_method *m, size_t n, void *ud,
                               pd_rpc_server **out, pd_err *err)
{
    if (addr == NULL || (m == NULL && n > 0))
        return pd_err_set(err, PD_ERR_INVALID, "rpc server: no address or method table");
    /* HOST:PORT with a decimal port in 0..65535 (gRPC takes a larger one modulo 65536) */
    long pn = addr_port(addr);
    if (pn < 0 || pn > 65535)
        return pd_err_set(err, PD_ERR_INVALID, "rpc server: bad address '%s' (want HOST:PORT, port 0..65535)", addr);
    for (size_t i = 0; i < n; i++) {
        if (m[i].method == NULL || m[i].method[0] != '/' || m[i].req == NULL || m[i].fn == NULL)
            return pd_err_set(err, PD_ERR_INVALID, "rpc server: bad method entry %zu (%s)", i,
                              m[i].method != NULL ? m[i].method : "null");
    }
    pd_rpc_server *srv = calloc(1, sizeof(*srv));
    if (srv == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "rpc server: %zu bytes", sizeof(*srv));
    pd_status st;
    grpc_init();
    pthread_mutex_init(&srv->mu, NULL);
    srv->methods = m;
    srv->n_methods = n;
    srv->ud = ud;
    srv->shutdown_tag = (rpc_tag){TAG_SHUTDOWN, NULL};

    rpc_args args;
    srv->server = grpc_server_create(channel_args_make(&args, true, NULL), NULL);
    srv->cq = grpc_completion_queue_create_for_next(NULL);
    if (srv->server == NULL || srv->cq == NULL) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "rpc server: grpc_server_create failed");
        goto err_free;
    }
    grpc_server_register_completion_queue(srv->server, srv->cq, NULL);
    grpc_server_credentials *creds = server_creds(srv);
    srv->port = creds != NULL ? grpc_server_add_http2_port(srv->server, addr, creds) : 0;
    if (creds != NULL)
        grpc_server_credentials_release(creds);
    if (srv->port <= 0) {
        st = pd_err_set(err, PD_ERR_IO, "rpc server: cannot listen on %s (port in use, or no such address here)", addr);
        goto err_free;
    }
    grpc_server_start(srv->server);
    server_request_next(srv);
    if (pthread_create(&srv->poller, NULL, server_poller, srv) != 0) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "rpc server: cannot start the poller thread");
        srv->poller_started = false;
        pd_rpc_server_destroy(srv);   /* the server is started: stop it the orderly way */
        return st;
    }
    srv->poller_started = true;
    PD_LOG_INFO("rpc", "listening on %s port %d", addr, srv->port);
    *out = srv;
    return PD_OK;
err_free:
    if (srv->server != NULL)
        grpc_server_destroy(srv->server);
    if (srv->cq != NULL) {
        grpc_completion_queue_shutdown(srv->cq);
        while (grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
                   .type != GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(srv->cq);
    }
    pthread_mutex_destroy(&srv->mu);
    free(srv);
    grpc_shutdown();
    return st;
}

int pd_rpc_server_port(const pd_rpc_server *srv)
{
    return srv != NULL ? srv->port : 0;
}

void pd_rpc_server_destroy(pd_rpc_server *srv)
{
    if (srv == NULL)
        return;
    pthread_mutex_lock(&srv->mu);
    srv->shutting_down = true;
    pthread_mutex_unlock(&srv->mu);
    grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
    grpc_server_cancel_all_calls(srv->server);
    if (srv->poller_started) {
        pthread_join(srv->poller, NULL);
    } else {
        server_poller(srv);   /* drain on this thread */
    }
    grpc_server_destroy(srv->server);
    grpc_completion_queue_destroy(srv->cq);
    pthread_mutex_destroy(&srv->mu);
    PD_LOG_INFO("rpc", "server on port %d stopped", srv->port);
    free(srv);
    grpc_shutdown();
}

const ProtobufCMessage *pd_rpc_call_request(const pd_rpc_call *call)
{
    return call->req;
}

const char *pd_rpc_call_method(const pd_rpc_call *call)
{
    return call->method_name;
}

int64_t pd_rpc_call_deadline_ms(const pd_rpc_call *call)
{
    gpr_timespec d = call->details.deadline;
    if (gpr_time_cmp(d, gpr_inf_future(d.clock_type)) == 0)
        return INT64_MAX;
    gpr_timespec left = gpr_time_sub(d, gpr_now(d.clock_type));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

bool pd_rpc_call_is_cancelled(pd_rpc_call *call)
{
    pthread_mutex_lock(&call->mu);
    bool c = call->closed && call->cancelled;
    pthread_mutex_unlock(&call->mu);
    return c;
}

void pd_rpc_call_on_done(pd_rpc_call *call, pd_rpc_done_fn fn, void *arg)
{
    pthread_mutex_lock(&call->mu);
    if (!call->closed) {
        call->done_fn = fn;
        call->done_arg = arg;
        pthread_mutex_unlock(&call->mu);
        return;
    }
    bool cancelled = call->cancelled;
    pthread_mutex_unlock(&call->mu);
    if (fn != NULL)
        fn(arg, call, cancelled);
}

pd_status pd_rpc_reply(pd_rpc_call *call, const ProtobufCMessage *resp)
{
    pd_status st = PD_OK;
    grpc_byte_buffer *bb = buf_from_msg(resp);
    pthread_mutex_lock(&call->mu);
    if (call->status_started) {
        st = PD_ERR_INVALID;
    } else if (call->closed) {
        call->status_started = true;
        st = PD_ERR_CANCELLED;
    } else if (bb == NULL) {
        pthread_mutex_unlock(&call->mu);
        call_finish_internal(call, PD_RPC_INTERNAL, "reply: out of memory");
        call_release_node_ref(call);
        return PD_ERR_NOMEM;
    } else if (call->sending != NULL || call->q_len > 0) {
        /* A stream with writes in flight: queue the reply as the last message. */
        pthread_mutex_unlock(&call->mu);
        st = pd_rpc_stream_write(call, resp);
        grpc_byte_buffer_destroy(bb);
        pd_rpc_finish(call, PD_OK, NULL);
        return st;
    } else {
        call->status_started = true;
        grpc_op ops[3];
        size_t n = 0;
        if (!call->initial_md_sent)
            op_initial_md(&ops[n++]);
        memset(&ops[n], 0, sizeof(ops[n]));
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = bb;
        n++;
        memset(&ops[n], 0, sizeof(ops[n]));
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = GRPC_STATUS_OK;
        n++;
        if (call_start_locked(call, ops, n, &call->tag_status)) {
            call->initial_md_sent = true;
            call->status_buf = bb;
            bb = NULL;
        } else {
            st = PD_ERR_CANCELLED;
        }
    }
    pthread_mutex_unlock(&call->mu);
    if (bb != NULL)
        grpc_byte_buffer_destroy(bb);
    if (st == PD_ERR_INVALID) {
        PD_LOG_ERROR("rpc", "%s: reply after finish", call->method_name);
        return st;   /* the node's reference was already released by that finish */
    }
    call_release_node_ref(call);
    return st;
}

pd_status pd_rpc_stream_write(pd_rpc_call *call, const ProtobufCMessage *msg)
{
    if (call->method == NULL || call->method->kind != PD_RPC_SERVER_STREAM)
        return PD_ERR_INVALID;
    grpc_byte_buffer *bb = buf_from_msg(msg);
    if (bb == NULL)
        return PD_ERR_NOMEM;
    pd_status st = PD_OK;
    pthread_mutex_lock(&call->mu);
    if (call->status_started) {
        st = PD_ERR_INVALID;
    } else if (call->closed) {
        st = PD_ERR_CANCELLED;
    } else if (call->q_len >= PD_RPC_STREAM_QUEUE_MAX) {
        st = PD_ERR_BUSY;
    } else {
        if (call->q_len == call->q_cap) {
            size_t cap = call->q_cap ? call->q_cap * 2 : 16;
            grpc_byte_buffer **q = malloc(cap * sizeof(*q));
            if (q == NULL) {
                st = PD_ERR_NOMEM;
                goto out;
            }
            for (size_t i = 0; i < call->q_len; i++)
                q[i] = call->queue[(call->q_head + i) % call->q_cap];
            free(call->queue);
            call->queue = q;
            call->q_cap = cap;
            call->q_head = 0;
        }
        call->queue[(call->q_head + call->q_len) % call->q_cap] = bb;
        call->q_len++;
        bb = NULL;
        if (call->sending == NULL)
            call_pump_locked(call);
    }
out:
    pthread_mutex_unlock(&call->mu);
    if (bb != NULL)
        grpc_byte_buffer_destroy(bb);
    return st;
}

size_t pd_rpc_stream_pending(pd_rpc_call *call)
{
    pthread_mutex_lock(&call->mu);
    size_t n = call->q_len + (call->sending != NULL ? 1 : 0);
    pthread_mutex_unlock(&call->mu);
    return n;
}

void pd_rpc_finish(pd_rpc_call *call, pd_status st, const char *msg)
{
    if (call == NULL)
        return;
    if (call_finish_internal(call, pd_rpc_code_from(st), msg != NULL ? msg : pd_status_str(st))
        != PD_OK) {
        PD_LOG_ERROR("rpc", "%s: finished twice", call->method_name);
        return;
    }
    call_release_node_ref(call);
}

/* ---------------------------------------------------------------------------------------------
 * Client */

struct pd_rpc_channel {
    grpc_channel *ch;
    char *target;
    unsigned tls_gen;              /* the pd_rpc_set_tls its credentials come from */
    /* Asynchronous calls: one CQ and its poller thread, started by the first async call. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    grpc_completion_queue *cq;
    pthread_t poller;
    bool poller_started;
    pd_rpc_pending *async_calls;   /* in flight (callback not yet run) */
    size_t n_async;
};

struct pd_rpc_pending {
    pd_rpc_channel *ch;
    grpc_call *call;
    char *method;
    const ProtobufCMessageDescriptor *desc;
    grpc_byte_buffer *req_buf;
    grpc_byte_buffer *resp_buf;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code code;
    grpc_slice details;
    pd_rpc_reply_fn fn;
    void *ud;
    int refs;                      /* atomic: the poller until the callback ran, the handle */
    bool finished;                 /* written under ch->mu; read atomically without it */
    pd_rpc_pending *prev, *next;
};

pd_status pd_rpc_channel_create(const char *target, pd_rpc_channel **out, pd_err *err)
{
    return pd_rpc_channel_create_as(target, NULL, out, err);
}

pd_status pd_rpc_channel_create_as(const char *target, const char *tls_name, pd_rpc_channel **out,
                                   pd_err *err)
{
    if (target == NULL || target[0] == '\0')
        return pd_err_set(err, PD_ERR_INVALID, "rpc channel: no target");
    long pn = addr_port(target);
    if (pn == 0 || pn > 65535)
        return pd_err_set(err, PD_ERR_INVALID, "rpc channel: bad target '%s' (port 1..65535)", target);
    pd_rpc_channel *ch = calloc(1, sizeof(*ch));
    if (ch == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "rpc channel: %zu bytes", sizeof(*ch));
    ch->target = strdup(target);
    if (ch->target == NULL) {
        free(ch);
        return pd_err_set(err, PD_ERR_NOMEM, "rpc channel: target");
    }
    pthread_mutex_init(&ch->mu, NULL);
    pthread_cond_init(&ch->cv, NULL);
    grpc_init();
    rpc_args args;
    grpc_channel_credentials *creds = channel_creds(&ch->tls_gen);
    const grpc_channel_args *cargs = channel_args_make(&args, false, tls_name);
    ch->ch = creds != NULL ? grpc_channel_create(target, creds, cargs) : NULL;
    if (creds != NULL)
        grpc_channel_credentials_release(creds);
    if (ch->ch == NULL) {
        pthread_mutex_destroy(&ch->mu);
        pthread_cond_destroy(&ch->cv);
        free(ch->target);
        free(ch);
        grpc_shutdown();
        return pd_err_set(err, PD_ERR_INTERNAL, "rpc channel: cannot create channel to %s",
                          target);
    }
    *out = ch;
    return PD_OK;
}

static void cq_destroy_drained(grpc_completion_queue *cq);

bool pd_rpc_channel_tls_current(const pd_rpc_channel *ch)
{
    pthread_mutex_lock(&tls_mu);
    bool cur = ch->tls_gen == tls_gen;
    pthread_mutex_unlock(&tls_mu);
    return cur;
}

void pd_rpc_channel_destroy(pd_rpc_channel *ch)
{
    if (ch == NULL)
        return;
    /* Cancel the async calls still in flight and wait for their callbacks. */
    pthread_mutex_lock(&ch->mu);
    for (pd_rpc_pending *p = ch->async_calls; p != NULL; p = p->next) {
        if (p->call != NULL)   /* NULL: completing, its callback is running */
            grpc_call_cancel(p->call, NULL);
    }
    while (ch->n_async > 0)
        pthread_cond_wait(&ch->cv, &ch->mu);
    pthread_mutex_unlock(&ch->mu);
    if (ch->poller_started) {
        grpc_completion_queue_shutdown(ch->cq);
        pthread_join(ch->poller, NULL);
        grpc_completion_queue_destroy(ch->cq);
    }
    pthread_mutex_destroy(&ch->mu);
    pthread_cond_destroy(&ch->cv);
    grpc_channel_destroy(ch->ch);
    free(ch->target);
    free(ch);
    grpc_shutdown();
}

/* Shut a private CQ down and drain it. */
static void cq_destroy_drained(grpc_completion_queue *cq)
{
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type
           != GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

static pd_status client_status(const char *method, grpc_status_code code, grpc_slice details,
                               pd_err *err)
{
    if (code == GRPC_STATUS_OK)
        return PD_OK;
    pd_rpc_code rc = (pd_rpc_code)code;
    return pd_err_set(err, pd_rpc_status_from_code(rc), "%s: %s: %.*s", method,
                      pd_rpc_code_str(rc), (int)GRPC_SLICE_LENGTH(details),
                      (const char *)GRPC_SLICE_START_PTR(details));
}

static grpc_call *client_call_create(pd_rpc_channel *ch, const char *method,
                                     grpc_completion_queue *cq, int64_t timeout_ms)
{
    grpc_slice m = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                               deadline_from_ms(timeout_ms), NULL);
    grpc_slice_unref(m);
    return call;
}

/* One blocking unary exchange of a packed request; *resp (may be NULL) is the caller's. */
static pd_status client_unary_bb(pd_rpc_channel *ch, const char *method, grpc_byte_buffer *req,
                                 int64_t timeout_ms, grpc_byte_buffer **resp, pd_err *err)
{
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    if (cq == NULL)
        return pd_err_set(err, PD_ERR_INTERNAL, "%s: cannot create a completion queue", method);
    grpc_call *call = client_call_create(ch, method, cq, timeout_ms);
    if (call == NULL) {
        cq_destroy_drained(cq);
        return pd_err_set(err, PD_ERR_INTERNAL, "%s: cannot create the call", method);
    }
    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = req;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = resp;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    pd_status st;
    int tag = 0;
    grpc_call_error e = grpc_call_start_batch(call, ops, 6, &tag, NULL);
    if (e != GRPC_CALL_OK) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "%s: start batch: %s", method,
                        grpc_call_error_to_string(e));
    } else {
        /* Bounded by the call's deadline; RECV_STATUS always completes. */
        grpc_event ev;
        do {
            ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        } while (ev.type != GRPC_OP_COMPLETE || ev.tag != &tag);
        st = client_status(method, code, details, err);
    }
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_call_unref(call);
    cq_destroy_drained(cq);
    return st;
}

pd_status pd_rpc_unary_raw(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                           int64_t timeout_ms, void **out_bytes, size_t *out_len, pd_err *err)
{
    grpc_byte_buffer *bb = buf_from_bytes(req, len);
    if (bb == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "%s: request buffer", method);
    grpc_byte_buffer *resp = NULL;
    pd_status st = client_unary_bb(ch, method, bb, timeout_ms, &resp, err);
    grpc_byte_buffer_destroy(bb);
    if (st == PD_OK) {
        *out_bytes = NULL;
        *out_len = 0;
        if (resp != NULL) {
            grpc_slice s = buf_flatten(resp);
            size_t n = GRPC_SLICE_LENGTH(s);
            if (n > 0) {
                *out_bytes = malloc(n);
                if (*out_bytes == NULL)
                    st = pd_err_set(err, PD_ERR_NOMEM, "%s: reply of %zu bytes", method, n);
                else
                    memcpy(*out_bytes, GRPC_SLICE_START_PTR(s), n);
            }
            *out_len = st == PD_OK ? n : 0;
            grpc_slice_unref(s);
        }
    }
    if (resp != NULL)
        grpc_byte_buffer_destroy(resp);
    return st;
}

pd_status pd_rpc_unary(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                       const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                       ProtobufCMessage **out, pd_err *err)
{
    grpc_byte_buffer *bb = buf_from_msg(req);
    if (bb == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "%s: request buffer", method);
    grpc_byte_buffer *resp = NULL;
    pd_status st = client_unary_bb(ch, method, bb, timeout_ms, &resp, err);
    grpc_byte_buffer_destroy(bb);
    if (st == PD_OK) {
        ProtobufCMessage *m = NULL;
        if (resp != NULL) {
            grpc_slice s = buf_flatten(resp);
            m = protobuf_c_message_unpack(resp_desc, NULL, GRPC_SLICE_LENGTH(s),
                                          GRPC_SLICE_START_PTR(s));
            grpc_slice_unref(s);
        }
        if (m == NULL)
            st = pd_err_set(err, PD_ERR_INVALID, "%s: %s reply that does not unpack as %s",
                            method, resp == NULL ? "missing" : "malformed", resp_desc->name);
        else
            *out = m;
    }
    if (resp != NULL)
        grpc_byte_buffer_destroy(resp);
    return st;
}

/* Atomic, without the channel: a handle may be released after the channel is gone. */
static void pending_unref(pd_rpc_pending *p)
{
    if (__atomic_sub_fetch(&p->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    if (p->req_buf != NULL)
        grpc_byte_buffer_destroy(p->req_buf);
    if (p->resp_buf != NULL)
        grpc_byte_buffer_destroy(p->resp_buf);
    grpc_metadata_array_destroy(&p->init_md);
    grpc_metadata_array_destroy(&p->trail_md);
    grpc_slice_unref(p->details);
    free(p->method);
    free(p);
}

/* The call is over (RECV_STATUS_ON_CLIENT completed): status, reply, callback, release. */
static void pending_complete(pd_rpc_channel *ch, pd_rpc_pending *p)
{
    /* p was published under ch->mu (start_batch); take it once so the fields written before
     * are visibly ordered before these reads, whatever gRPC's queue does internally. */
    pthread_mutex_lock(&ch->mu);
    pthread_mutex_unlock(&ch->mu);
    pd_err err;
    pd_err_clear(&err);
    ProtobufCMessage *m = NULL;
    pd_status st = client_status(p->method, p->code, p->details, &err);
    if (st == PD_OK) {
        if (p->resp_buf != NULL) {
            grpc_slice sl = buf_flatten(p->resp_buf);
            m = protobuf_c_message_unpack(p->desc, NULL, GRPC_SLICE_LENGTH(sl),
                                          GRPC_SLICE_START_PTR(sl));
            grpc_slice_unref(sl);
        }
        if (m == NULL)
            st = pd_err_set(&err, PD_ERR_INVALID, "%s: %s reply that does not unpack as %s",
                            p->method, p->resp_buf == NULL ? "missing" : "malformed",
                            p->desc->name);
    }
    pthread_mutex_lock(&ch->mu);
    __atomic_store_n(&p->finished, true, __ATOMIC_RELEASE);
    grpc_call *gc = p->call;
    p->call = NULL;
    pthread_mutex_unlock(&ch->mu);
    grpc_call_unref(gc);
    p->fn(p->ud, st, m, &err);
    pthread_mutex_lock(&ch->mu);
    if (p->prev != NULL)
        p->prev->next = p->next;
    else
        ch->async_calls = p->next;
    if (p->next != NULL)
        p->next->prev = p->prev;
    ch->n_async--;
    pthread_cond_broadcast(&ch->cv);
    pthread_mutex_unlock(&ch->mu);
    pending_unref(p);
}

static void *channel_poller(void *arg)
{
    pd_rpc_channel *ch = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(ch->cq, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                   NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type == GRPC_OP_COMPLETE)
            pending_complete(ch, ev.tag);
    }
    return NULL;
}

pd_status pd_rpc_unary_async(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                             pd_rpc_reply_fn fn, void *ud, pd_rpc_pending **out, pd_err *err)
{
    if (fn == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "%s: async call without a callback", method);
    pthread_mutex_lock(&ch->mu);
    if (!ch->poller_started) {
        ch->cq = grpc_completion_queue_create_for_next(NULL);
        if (ch->cq == NULL || pthread_create(&ch->poller, NULL, channel_poller, ch) != 0) {
            if (ch->cq != NULL)
                cq_destroy_drained(ch->cq);
            ch->cq = NULL;
            pthread_mutex_unlock(&ch->mu);
            return pd_err_set(err, PD_ERR_INTERNAL, "%s: cannot start the channel poller",
                              method);
        }
        ch->poller_started = true;
    }
    pthread_mutex_unlock(&ch->mu);

    pd_rpc_pending *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "%s: async call", method);
    p->ch = ch;
    p->desc = resp_desc;
    p->fn = fn;
    p->ud = ud;
    p->details = grpc_empty_slice();
    grpc_metadata_array_init(&p->init_md);
    grpc_metadata_array_init(&p->trail_md);
    p->method = strdup(method);
    p->req_buf = buf_from_msg(req);
    if (p->method == NULL || p->req_buf == NULL) {
        p->refs = 1;
        pending_unref(p);
        return pd_err_set(err, PD_ERR_NOMEM, "%s: async call", method);
    }
    p->call = client_call_create(ch, method, ch->cq, timeout_ms);
    if (p->call == NULL) {
        p->refs = 1;
        pending_unref(p);
        return pd_err_set(err, PD_ERR_INTERNAL, "%s: cannot create the call", method);
    }
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = p->req_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &p->init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &p->resp_buf;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &p->trail_md;
    ops[5].data.recv_status_on_client.status = &p->code;
    ops[5].data.recv_status_on_client.status_details = &p->details;
    p->refs = out != NULL ? 2 : 1;
    pthread_mutex_lock(&ch->mu);
    /* Under the lock so that a concurrent channel destroy either sees the call or none of it. */
    grpc_call_error e = grpc_call_start_batch(p->call, ops, 6, p, NULL);
    if (e == GRPC_CALL_OK) {
        p->next = ch->async_calls;
        if (ch->async_calls != NULL)
            ch->async_calls->prev = p;
        ch->async_calls = p;
        ch->n_async++;
    }
    pthread_mutex_unlock(&ch->mu);
    if (e != GRPC_CALL_OK) {
        grpc_call_unref(p->call);
        p->refs = 1;
        pending_unref(p);
        return pd_err_set(err, PD_ERR_INTERNAL, "%s: start batch: %s", method,
                          grpc_call_error_to_string(e));
    }
    if (out != NULL)
        *out = p;
    return PD_OK;
}

void pd_rpc_pending_cancel(pd_rpc_pending *p)
{
    /* Finished calls (all of them once the channel is destroyed) never touch the channel. */
    if (p == NULL || __atomic_load_n(&p->finished, __ATOMIC_ACQUIRE))
        return;
    pthread_mutex_lock(&p->ch->mu);
    if (!p->finished && p->call != NULL)
        grpc_call_cancel(p->call, NULL);
    pthread_mutex_unlock(&p->ch->mu);
}

void pd_rpc_pending_release(pd_rpc_pending *p)
{
    if (p != NULL)
        pending_unref(p);
}

typedef enum { CTAG_START, CTAG_RECV, CTAG_STATUS } ctag_kind;

struct pd_rpc_stream {
    grpc_completion_queue *cq;
    grpc_call *call;
    char *method;
    const ProtobufCMessageDescriptor *desc;
    grpc_byte_buffer *req_buf;
    grpc_byte_buffer *recv_buf;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code code;
    grpc_slice details;
    int tags[3];               /* addresses are the tags: &tags[CTAG_*] */
    int inflight;
    bool got_initial_md;
    bool status_done;
    bool ended;
    pd_err final;
};

/* Wait for one completion on the stream's CQ; returns its kind. */
static ctag_kind stream_next(pd_rpc_stream *s)
{
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME),
                                                   NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        s->inflight--;
        ctag_kind k = (ctag_kind)((int *)ev.tag - s->tags);
        if (k == CTAG_STATUS)
            s->status_done = true;
        return k;
    }
}

pd_status pd_rpc_stream_open(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                             pd_rpc_stream **out, pd_err *err)
{
    pd_rpc_stream *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "%s: stream", method);
    pd_status st;
    s->desc = resp_desc;
    s->details = grpc_empty_slice();
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trail_md);
    s->method = strdup(method);
    s->req_buf = buf_from_msg(req);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    if (s->method == NULL || s->req_buf == NULL || s->cq == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "%s: stream setup", method);
        goto err_free;
    }
    s->call = client_call_create(ch, method, s->cq, timeout_ms);
    if (s->call == NULL) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "%s: cannot create the call", method);
        goto err_free;
    }
    grpc_op ops[3];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = s->req_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    grpc_call_error e = grpc_call_start_batch(s->call, ops, 3, &s->tags[CTAG_START], NULL);
    if (e == GRPC_CALL_OK) {
        s->inflight++;
        grpc_op sop;
        memset(&sop, 0, sizeof(sop));
        sop.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
        sop.data.recv_status_on_client.trailing_metadata = &s->trail_md;
        sop.data.recv_status_on_client.status = &s->code;
        sop.data.recv_status_on_client.status_details = &s->details;
        e = grpc_call_start_batch(s->call, &sop, 1, &s->tags[CTAG_STATUS], NULL);
        if (e == GRPC_CALL_OK)
            s->inflight++;
    }
    if (e != GRPC_CALL_OK) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "%s: start batch: %s", method,
                        grpc_call_error_to_string(e));
        pd_rpc_stream_close(s);
        return st;
    }
    *out = s;
    return PD_OK;
err_free:
    if (s->cq != NULL)
        cq_destroy_drained(s->cq);
    if (s->req_buf != NULL)
        grpc_byte_buffer_destroy(s->req_buf);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    free(s->method);
    free(s);
    return st;
}

static pd_status stream_end(pd_rpc_stream *s, pd_err *err)
{
    while (!s->status_done)
        stream_next(s);
    if (!s->ended) {
        s->ended = true;
        pd_err_clear(&s->final);
        client_status(s->method, s->code, s->details, &s->final);
    }
    if (s->final.code != PD_OK && err != NULL)
        *err = s->final;
    return s->final.code;
}

pd_status pd_rpc_stream_read(pd_rpc_stream *s, ProtobufCMessage **out, pd_err *err)
{
    *out = NULL;
    if (s->ended)
        return stream_end(s, err);
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!s->got_initial_md) {
        ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[n].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
        n++;
    }
    ops[n].op = GRPC_OP_RECV_MESSAGE;
    ops[n].data.recv_message.recv_message = &s->recv_buf;
    n++;
    grpc_call_error e = grpc_call_start_batch(s->call, ops, n, &s->tags[CTAG_RECV], NULL);
    if (e != GRPC_CALL_OK)
        return pd_err_set(err, PD_ERR_INTERNAL, "%s: read: %s", s->method,
                          grpc_call_error_to_string(e));
    s->inflight++;
    s->got_initial_md = true;
    while (stream_next(s) != CTAG_RECV) {
    }
    if (s->recv_buf == NULL)
        return stream_end(s, err);
    grpc_slice sl = buf_flatten(s->recv_buf);
    grpc_byte_buffer_destroy(s->recv_buf);
    s->recv_buf = NULL;
    ProtobufCMessage *m = protobuf_c_message_unpack(s->desc, NULL, GRPC_SLICE_LENGTH(sl),
                                                    GRPC_SLICE_START_PTR(sl));
    size_t len = GRPC_SLICE_LENGTH(sl);
    grpc_slice_unref(sl);
    if (m == NULL) {
        grpc_call_cancel(s->call, NULL);
        pd_status st = pd_err_set(err, PD_ERR_INVALID, "%s: malformed %s in stream (%zu bytes)",
                                  s->method, s->desc->name, len);
        while (!s->status_done)
            stream_next(s);
        s->ended = true;
        if (err != NULL)
            s->final = *err;
        else
            pd_err_set(&s->final, st, "%s: malformed message in stream", s->method);
        return st;
    }
    *out = m;
    return PD_OK;
}

void pd_rpc_stream_cancel(pd_rpc_stream *s)
{
    if (s != NULL && s->call != NULL)
        grpc_call_cancel(s->call, NULL);
}

void pd_rpc_stream_close(pd_rpc_stream *s)
{
    if (s == NULL)
        return;
    if (s->call != NULL) {
        if (!s->status_done)
            grpc_call_cancel(s->call, NULL);
        while (s->inflight > 0)
            stream_next(s);
        grpc_call_unref(s->call);
    }
    cq_destroy_drained(s->cq);
    if (s->recv_buf != NULL)
        grpc_byte_buffer_destroy(s->recv_buf);
    grpc_byte_buffer_destroy(s->req_buf);
    grpc_slice_unref(s->details);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trail_md);
    free(s->method);
    free(s);
}

pd_status pd_rpc_stream_call(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                             pd_rpc_msg_fn on_msg, void *ud, pd_err *err)
{
    pd_rpc_stream *s;
    pd_status st = pd_rpc_stream_open(ch, method, req, resp_desc, timeout_ms, &s, err);
    if (st != PD_OK)
        return st;
    for (;;) {
        ProtobufCMessage *m;
        st = pd_rpc_stream_read(s, &m, err);
        if (st != PD_OK || m == NULL)
            break;
        st = on_msg(ud, m);
        protobuf_c_message_free_unpacked(m, NULL);
        if (st != PD_OK)
            break;   /* close cancels; the callback set its own message */
    }
    pd_rpc_stream_close(s);
    return st;
}
