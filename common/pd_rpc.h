/* pd_rpc.h - the gRPC control plane as the nodes see it: protobuf-c messages in and out.
 * Owns: the server (one completion queue + its poller thread), per-call contexts, stream write
 *       queues, client channels and calls, and the pd_status <-> gRPC status mapping
 *       (pd_rpc_code_from / pd_rpc_status_from_code).
 * Not here: what the methods do (prefill_node/, decode_node/), the messages (proto/).
 *       Only pd_rpc.c includes <grpc/grpc.h>; nothing here exposes a gRPC type.
 * Threading:
 *   - Server handlers and on-done callbacks run on the server's poller thread and must return
 *     quickly (hand work to a pd_loop / worker). pd_rpc_reply, pd_rpc_stream_write,
 *     pd_rpc_finish and pd_rpc_call_on_done may be called from any thread.
 *   - Blocking client calls may run on any thread; each uses its own completion queue.
 *     pd_rpc_stream_cancel may be called from any thread while another thread reads.
 *     Async unary calls (pd_rpc_unary_async) complete on one poller thread per channel.
 *
 * Server call lifecycle (the contract a node relies on):
 *   1. A request arrives; pd_rpc unpacks it (size limit, protobuf-c, PD_PROTO_VERSION check:
 *      failures answer INVALID_ARGUMENT without reaching the node) and calls the handler.
 *   2. Handler returns PD_OK: the node now holds the call and must end it exactly once with
 *      pd_rpc_reply (unary) or pd_rpc_finish (any), from any thread, even after the client
 *      went away. Handler returns an error status: pd_rpc finishes the call with that status
 *      (the handler must not have finished it).
 *   3. When the call is over on the wire (status sent, client cancel/disconnect, deadline,
 *      server shutdown) the on-done callback (pd_rpc_call_on_done) runs once, with
 *      cancelled = true unless our status reached the client. After a cancel, writes return
 *      PD_ERR_CANCELLED; the node still calls pd_rpc_finish to release its reference.
 *   4. The request message stays valid until the node's pd_rpc_finish/pd_rpc_reply. */
#ifndef PD_RPC_H
#define PD_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "pd_status.h"
#include "pd_tls.h"

/* Requests larger than this are refused with INVALID_ARGUMENT (above twice this, gRPC itself
 * refuses them with RESOURCE_EXHAUSTED before they are read). */
#define PD_RPC_MAX_MESSAGE_BYTES (64u << 20)
/* Messages a stream may queue behind the one being sent before pd_rpc_stream_write says BUSY. */
#define PD_RPC_STREAM_QUEUE_MAX 4096u

/* gRPC status codes (numerically the standard ones; see grpc/status.h). */
typedef enum {
    PD_RPC_OK = 0,
    PD_RPC_CANCELLED = 1,
    PD_RPC_UNKNOWN = 2,
    PD_RPC_INVALID_ARGUMENT = 3,
    PD_RPC_DEADLINE_EXCEEDED = 4,
    PD_RPC_NOT_FOUND = 5,
    PD_RPC_ALREADY_EXISTS = 6,
    PD_RPC_PERMISSION_DENIED = 7,
    PD_RPC_RESOURCE_EXHAUSTED = 8,
    PD_RPC_FAILED_PRECONDITION = 9,
    PD_RPC_ABORTED = 10,
    PD_RPC_OUT_OF_RANGE = 11,
    PD_RPC_UNIMPLEMENTED = 12,
    PD_RPC_INTERNAL = 13,
    PD_RPC_UNAVAILABLE = 14,
    PD_RPC_DATA_LOSS = 15,
    PD_RPC_UNAUTHENTICATED = 16
} pd_rpc_code;

/* The one place pd_status maps to gRPC codes: INVALID->INVALID_ARGUMENT, NOT_FOUND->NOT_FOUND,
 * TIMEOUT->DEADLINE_EXCEEDED, PEER->UNAVAILABLE, BUSY->RESOURCE_EXHAUSTED,
 * CANCELLED->CANCELLED, UNSUPPORTED->UNIMPLEMENTED, OK->OK, anything else->INTERNAL. */
pd_rpc_code pd_rpc_code_from(pd_status st);
/* And back (what a client sees): the inverse of the above; other codes -> PD_ERR_INTERNAL. */
pd_status pd_rpc_status_from_code(pd_rpc_code code);
const char *pd_rpc_code_str(pd_rpc_code code);

/* ---------------------------------------------------------------------------------------------
 * Server */

typedef struct pd_rpc_server pd_rpc_server;
typedef struct pd_rpc_call pd_rpc_call;

typedef enum { PD_RPC_UNARY = 0, PD_RPC_SERVER_STREAM } pd_rpc_kind;

/* req is owned by the call (valid until the node finishes it). See the lifecycle above. */
typedef pd_status (*pd_rpc_handler)(void *ud, const ProtobufCMessage *req, pd_rpc_call *call);

typedef struct {
    const char *method;                       /* full path: "/pdspark.Prefill/Prefill" */
    pd_rpc_kind kind;
    const ProtobufCMessageDescriptor *req;    /* request type */
    pd_rpc_handler fn;
} pd_rpc_method;

/* TLS for the servers and channels made from here on (a node sets it at start, from
 * --tls-cert/--tls-key/--tls-ca/--tls-client-ca, before it makes any): t's certificate and key
 * make servers TLS-only (its client roots make them require client certificates), its roots
 * make channels TLS (presenting the certificate, when there is one, to servers that ask); NULL
 * fields (or t NULL) leave that side plaintext. The strings are copied. Called again (a reload
 * of the same files), servers made before serve the new certificate from their next handshake
 * on (whether they ask for client certificates stays), and channels made before keep theirs:
 * pd_rpc_channel_tls_current tells their owner to make them again. Errors: PD_ERR_NOMEM. */
pd_status pd_rpc_set_tls(const pd_tls *t, pd_err *err);

/* Start a server listening on addr ("HOST:PORT"; port 0 picks a free one, see
 * pd_rpc_server_port). The method table m[0..n) is borrowed and must outlive the server; ud is
 * passed to every handler. Calls to methods not in the table get UNIMPLEMENTED.
 * Errors: PD_ERR_INVALID (bad table), PD_ERR_IO (cannot bind addr), PD_ERR_NOMEM,
 * PD_ERR_INTERNAL. */
pd_status pd_rpc_server_create(const char *addr, const pd_rpc_method *m, size_t n, void *ud,
                               pd_rpc_server **out, pd_err *err);
/* The TCP port actually bound. */
int pd_rpc_server_port(const pd_rpc_server *srv);
/* Orderly stop: no new calls, cancel the ones in flight (their on-done callbacks run with
 * cancelled = true), wait for gRPC to release them, join the poller, free. Calls the node still
 * holds stay valid for pd_rpc_finish (which then only frees). NULL is a no-op. Must not be
 * called from a handler or on-done callback. */
void pd_rpc_server_destroy(pd_rpc_server *srv);

/* The request and the method of a call (valid until the node finishes it). */
const ProtobufCMessage *pd_rpc_call_request(const pd_rpc_call *call);
const char *pd_rpc_call_method(const pd_rpc_call *call);
/* Milliseconds left until the client's deadline; INT64_MAX when it set none, <= 0 if passed. */
int64_t pd_rpc_call_deadline_ms(const pd_rpc_call *call);
/* True once the client cancelled, disconnected or hit its deadline. */
bool pd_rpc_call_is_cancelled(pd_rpc_call *call);

typedef void (*pd_rpc_done_fn)(void *arg, pd_rpc_call *call, bool cancelled);
/* Register the once-only callback for the end of the call on the wire (see lifecycle 3). It
 * runs on the poller thread; if the call has already ended it runs now, on this thread. It may
 * call pd_rpc_finish. One callback per call (a second registration replaces the first if the
 * first has not run yet). */
void pd_rpc_call_on_done(pd_rpc_call *call, pd_rpc_done_fn fn, void *arg);

/* Unary: send resp and status OK, and release the node's reference (no pd_rpc_finish after).
 * resp is borrowed (packed before return). Returns PD_ERR_CANCELLED when the client is gone,
 * PD_ERR_INVALID if the call was already finished (a bug), PD_ERR_NOMEM. The call is released
 * in every case. */
pd_status pd_rpc_reply(pd_rpc_call *call, const ProtobufCMessage *resp);
/* Server stream: queue msg (borrowed, packed before return) behind the writes in flight.
 * Returns PD_ERR_CANCELLED when the client is gone, PD_ERR_BUSY when PD_RPC_STREAM_QUEUE_MAX
 * messages are already queued (slow reader), PD_ERR_INVALID after finish or on a unary call. */
pd_status pd_rpc_stream_write(pd_rpc_call *call, const ProtobufCMessage *msg);
/* Number of stream messages queued or in flight (for backpressure). */
size_t pd_rpc_stream_pending(pd_rpc_call *call);
/* End the call with st (PD_OK or an error; msg may be NULL -> pd_status_str(st)) after the
 * queued writes, and release the node's reference. The call pointer is invalid afterwards. */
void pd_rpc_finish(pd_rpc_call *call, pd_status st, const char *msg);

/* ---------------------------------------------------------------------------------------------
 * Client */

typedef struct pd_rpc_channel pd_rpc_channel;
typedef struct pd_rpc_stream pd_rpc_stream;

/* A channel to target ("HOST:PORT"): TLS when pd_rpc_set_tls gave roots to trust (the server's
 * certificate must chain to them and name HOST), plaintext otherwise. Connects lazily.
 * Errors: PD_ERR_NOMEM, PD_ERR_INTERNAL. */
pd_status pd_rpc_channel_create(const char *target, pd_rpc_channel **out, pd_err *err);
/* The same, with TLS verifying the server's certificate against tls_name instead of target's
 * host (NULL: target's host): a name resolved to addresses keeps the name it was given. */
pd_status pd_rpc_channel_create_as(const char *target, const char *tls_name, pd_rpc_channel **out,
                                   pd_err *err);
/* False once pd_rpc_set_tls was called after ch was made (its credentials are the older ones). */
bool pd_rpc_channel_tls_current(const pd_rpc_channel *ch);
/* Blocking calls and streams on the channel must be over; async calls still in flight are
 * cancelled and their callbacks run before this returns (so it must not be called from one).
 * NULL is a no-op. */
void pd_rpc_channel_destroy(pd_rpc_channel *ch);

/* Blocking unary call. timeout_ms <= 0 means no deadline. On PD_OK *out is a new message of type
 * resp_desc (free with protobuf_c_message_free_unpacked(*out, NULL)). Errors: the server's
 * status mapped by pd_rpc_status_from_code with its message in err (PD_ERR_TIMEOUT for
 * DEADLINE_EXCEEDED, PD_ERR_PEER when unreachable, ...), PD_ERR_INVALID if the reply does not
 * unpack. The reply's version is not checked here (use pd_proto_version_check). */
pd_status pd_rpc_unary(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                       const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                       ProtobufCMessage **out, pd_err *err);
/* Same with raw bytes both ways (tests, proxies). *out_bytes is malloc'd (free()), may be NULL
 * when the reply is empty (then *out_len = 0). */
pd_status pd_rpc_unary_raw(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                           int64_t timeout_ms, void **out_bytes, size_t *out_len, pd_err *err);

/* Asynchronous unary call, for loop threads that must not block (e.g. the decode node sending
 * Prefill). Returns at once; fn(ud, st, resp, err) runs exactly once on the channel's poller
 * thread (keep it short: post to your pd_loop). resp is the callee's on PD_OK (free it with
 * protobuf_c_message_free_unpacked), NULL otherwise; err is valid during the callback only.
 * req is borrowed (packed before return). If out is non-NULL it receives a handle the caller
 * must release with pd_rpc_pending_release (any time, from any thread, also inside fn); with
 * out == NULL the call cannot be cancelled except by pd_rpc_channel_destroy. On a non-OK
 * return fn never runs. */
typedef struct pd_rpc_pending pd_rpc_pending;
typedef void (*pd_rpc_reply_fn)(void *ud, pd_status st, ProtobufCMessage *resp,
                                const pd_err *err);
pd_status pd_rpc_unary_async(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                             pd_rpc_reply_fn fn, void *ud, pd_rpc_pending **out, pd_err *err);
/* Cancel (any thread, until released; a no-op once fn has started): fn then runs with
 * PD_ERR_CANCELLED unless the reply won the race. Cancel and release stay valid after
 * pd_rpc_channel_destroy. */
void pd_rpc_pending_cancel(pd_rpc_pending *p);
void pd_rpc_pending_release(pd_rpc_pending *p);                       /* NULL is a no-op */

/* Open a server-streaming call: sends req (borrowed) and returns immediately. */
pd_status pd_rpc_stream_open(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                             pd_rpc_stream **out, pd_err *err);
/* Block for the next message. PD_OK with *out != NULL: a message (caller frees with
 * protobuf_c_message_free_unpacked). PD_OK with *out == NULL: the stream ended with status OK.
 * Otherwise the call's final status (PD_ERR_CANCELLED after pd_rpc_stream_cancel,
 * PD_ERR_TIMEOUT, ...) with the server's message in err; further reads return the same. */
pd_status pd_rpc_stream_read(pd_rpc_stream *s, ProtobufCMessage **out, pd_err *err);
/* Cancel the call (any thread, any time before pd_rpc_stream_close). */
void pd_rpc_stream_cancel(pd_rpc_stream *s);
/* Cancel if not ended, wait for gRPC to release the call, free. NULL is a no-op. */
void pd_rpc_stream_close(pd_rpc_stream *s);

/* Convenience: open, call on_msg for each message (msg is freed after the callback returns;
 * a non-PD_OK return cancels the call and is returned), close. */
typedef pd_status (*pd_rpc_msg_fn)(void *ud, const ProtobufCMessage *msg);
pd_status pd_rpc_stream_call(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                             const ProtobufCMessageDescriptor *resp_desc, int64_t timeout_ms,
                             pd_rpc_msg_fn on_msg, void *ud, pd_err *err);

#endif
