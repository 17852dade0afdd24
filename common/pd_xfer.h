/* pd_xfer.h - one-sided transfers (UCX UCP RMA put) of KV pages and aux rows between nodes.
 * Owns: the UCP context and its one worker, endpoints to peers (with peer-failure handling),
 *       memory registrations, remote keys, and transfers (a list of spans put with a bounded
 *       window, then flushed, with a timeout).
 * Not here: which pages go where (pd_kv.h, the nodes), staging device memory through pinned
 *       host buffers (the caller does it when pd_xfer_supports_cuda() is false), the address
 *       exchange (it rides in the Prefill RPC: pd_xfer_address + pd_xfer_mem_pack).
 * Threading: a pd_xfer and everything made from it (peers, mems, rkeys, transfers) belong to one
 *       thread at a time: the thread that progresses it (a pd_loop watching pd_xfer_fd, or a
 *       worker thread calling pd_xfer_wait). Done callbacks run on that thread, from
 *       pd_xfer_progress / pd_xfer_wait / pd_xfer_peer_destroy, never from inside pd_xfer_put.
 *
 * Typical use (decode node = target, prefill node = initiator):
 *   target:    pd_xfer_create; pd_xfer_mem_register(pool); pd_xfer_mem_pack -> rkey bytes;
 *              pd_xfer_address -> worker bytes; send both in PrefillRequest.dest; keep
 *              progressing (software RMA over tcp needs the target to progress).
 *   initiator: pd_xfer_peer_create(worker bytes); pd_xfer_rkey_unpack(rkey bytes, base, len);
 *              pd_xfer_put(spans) -> done(PD_OK) after the data is remotely complete (flushed).
 * A transfer's source memory must stay valid and unchanged until its done callback: done runs
 * only once UCX no longer touches the buffers (on errors too). */
#ifndef PD_XFER_H
#define PD_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_status.h"

typedef struct pd_xfer pd_xfer;
typedef struct pd_xfer_peer pd_xfer_peer;
typedef struct pd_xfer_mem pd_xfer_mem;
typedef struct pd_xfer_rkey pd_xfer_rkey;
typedef struct pd_xfer_op pd_xfer_op;

typedef struct {
    const char *name;          /* for logs ("prefill", "decode"); NULL -> "xfer" */
    uint32_t max_inflight;     /* puts outstanding per transfer (window); 0 -> 64 */
    uint32_t timeout_ms;       /* bound on one transfer, start to done; 0 -> 30000 */
    const char *transports;    /* UCX_TLS-style list ("tcp,shm,self"); NULL/"" -> UCX default
                                  (which the UCX_TLS environment variable still overrides) */
    bool ucx_keepalive;        /* keep UCX's endpoint keepalive (off by default: it wakes an
                                  idle worker hundreds of times a second over tcp; peers that
                                  die are seen through socket errors and the transfer timeout;
                                  UCX_KEEPALIVE_INTERVAL in the environment wins) */
    bool err_mode_none;        /* endpoints without UCX peer-failure mode (for same-host peers):
                                  UCX's shared-memory transports (shm, cma) cannot report a
                                  peer's failure, so in peer mode (the default, false) puts go
                                  over tcp even between two processes of one host; with this
                                  set they can use shm/cma. A peer that dies is then seen only
                                  through the transfer timeout (timeout_ms: done gets
                                  PD_ERR_TIMEOUT), not through a PD_ERR_PEER right away. */
} pd_xfer_config;

void pd_xfer_config_default(pd_xfer_config *cfg);

/* UCP context (RMA + wakeup) and one SERIALIZED-thread-mode worker (one thread at a time).
 * Errors: PD_ERR_UNSUPPORTED (no transport for RMA here), PD_ERR_NOMEM, PD_ERR_INTERNAL. */
pd_status pd_xfer_create(const pd_xfer_config *cfg, pd_xfer **out, pd_err *err);
/* Destroys the peers still open (their transfers end with PD_ERR_CANCELLED) and the
 * registrations still alive. NULL is a no-op. */
void pd_xfer_destroy(pd_xfer *x);

/* True when the context can register and put CUDA device memory directly. */
bool pd_xfer_supports_cuda(const pd_xfer *x);

/* Event fd to watch for readability (pd_loop_watch_fd); on readable call pd_xfer_progress. */
int pd_xfer_fd(const pd_xfer *x);
/* Progress the worker until idle, advance transfers (issue puts, flush, timeouts, peer
 * failures), run done callbacks, then arm the fd (progressing again while arming says busy).
 * Also call it periodically (every <= 100 ms) so timeouts fire without network events.
 * Returns the number of done callbacks run. */
unsigned pd_xfer_progress(pd_xfer *x);
/* Wait up to timeout_ms for the fd (or until a transfer may have timed out), then progress.
 * For threads that own a pd_xfer without a pd_loop. Returns pd_xfer_progress's count. */
unsigned pd_xfer_wait(pd_xfer *x, int timeout_ms);
/* Transfers not yet done. */
size_t pd_xfer_active(const pd_xfer *x);

/* This worker's address (owned by x) for the peer to connect to: UCX's bytes in a checked seal
 * (pd_xfer.c), as the remote keys of pd_xfer_mem_pack are. */
void pd_xfer_address(const pd_xfer *x, const void **addr, size_t *len);

/* Connect to a remote worker address (borrowed bytes). The endpoint has a peer-failure handler:
 * a peer that dies fails its transfers with PD_ERR_PEER and later puts return PD_ERR_PEER
 * (unless the config's err_mode_none: then the transfer timeout is the only bound).
 * Errors: PD_ERR_INVALID (bad address: bytes that are not a seal of pd_xfer_address never reach
 * UCX, which would abort on malformed ones), PD_ERR_PEER, PD_ERR_NOMEM. */
pd_status pd_xfer_peer_create(pd_xfer *x, const void *addr, size_t len, pd_xfer_peer **out,
                              pd_err *err);
/* True once the peer failed (error, timeout); destroy it and connect again. */
bool pd_xfer_peer_failed(const pd_xfer_peer *p);
/* Close the endpoint (flush if healthy, force if failed; progressed to completion, bounded by
 * the config timeout). Transfers still running end with PD_ERR_CANCELLED (their done runs
 * here). Destroys the peer's rkeys. NULL is a no-op. */
void pd_xfer_peer_destroy(pd_xfer_peer *p);

/* Register [base, base+len) (borrowed: must outlive the registration) for remote access.
 * Errors: PD_ERR_INVALID, PD_ERR_NOMEM, PD_ERR_INTERNAL. */
pd_status pd_xfer_mem_register(pd_xfer *x, void *base, size_t len, pd_xfer_mem **out,
                               pd_err *err);
/* Allocate len bytes through UCX (ucp_mem_map ALLOCATE) and register them; the memory is
 * pd_xfer_mem_base(*out), zero-filled is not promised, and is freed by pd_xfer_mem_deregister.
 * UCX may place it in shared memory, so a same-host peer can map it and its puts become plain
 * copies (what ucx_perftest measures); memory registered with pd_xfer_mem_register is reached
 * over shm/cma by copies through the target worker instead.
 * Errors: PD_ERR_INVALID, PD_ERR_NOMEM, PD_ERR_INTERNAL. */
pd_status pd_xfer_mem_alloc(pd_xfer *x, size_t len, pd_xfer_mem **out, pd_err *err);
void pd_xfer_mem_deregister(pd_xfer_mem *m);                  /* NULL is a no-op */
void *pd_xfer_mem_base(const pd_xfer_mem *m);
size_t pd_xfer_mem_len(const pd_xfer_mem *m);
/* Pack the remote key for a peer; *buf is malloc'd (caller frees). */
pd_status pd_xfer_mem_pack(const pd_xfer_mem *m, void **buf, size_t *len, pd_err *err);

/* Unpack a packed key (borrowed bytes) for the remote region [base, base+len) on peer p. The
 * rkey belongs to p: pd_xfer_peer_destroy destroys it if the caller has not.
 * Errors: PD_ERR_INVALID (bad key, failed peer), PD_ERR_NOMEM. */
pd_status pd_xfer_rkey_unpack(pd_xfer_peer *p, const void *buf, size_t len, uint64_t base,
                              uint64_t region_len, pd_xfer_rkey **out, pd_err *err);
void pd_xfer_rkey_destroy(pd_xfer_rkey *rk);                  /* NULL is a no-op */

/* One contiguous piece: len bytes from local src to remote address raddr. */
typedef struct {
    const void *src;
    uint64_t raddr;
    size_t len;
} pd_xfer_span;

/* err is valid during the call only; err->code == st. */
typedef void (*pd_xfer_done_fn)(void *ud, pd_status st, const pd_err *err);

/* Put spans[0..n) (copied; n may be 0 = flush only) to the region of rk on rk's peer, at most
 * max_inflight outstanding, then flush the endpoint; done(ud, st, err) runs once: PD_OK when
 * every byte is remotely complete, PD_ERR_PEER (peer failed), PD_ERR_TIMEOUT (the transfer
 * ran past timeout_ms: the peer is closed, its other transfers fail too), PD_ERR_CANCELLED
 * (pd_xfer_op_cancel, peer destroyed). local (may be NULL) is the registration holding the
 * sources, passed to UCX as a hint. *out (may be NULL) is a handle valid until done runs.
 * A non-OK return (PD_ERR_INVALID: span outside the region or overflow; PD_ERR_PEER: failed
 * peer; PD_ERR_NOMEM) means nothing was started and done will not run. */
pd_status pd_xfer_put(pd_xfer_rkey *rk, const pd_xfer_mem *local, const pd_xfer_span *spans,
                      size_t n, pd_xfer_done_fn done, void *ud, pd_xfer_op **out, pd_err *err);
/* Flush all puts so far to p: a transfer with no spans. */
pd_status pd_xfer_flush(pd_xfer_peer *p, pd_xfer_done_fn done, void *ud, pd_xfer_op **out,
                        pd_err *err);
/* Stop issuing the rest of op's spans; done(PD_ERR_CANCELLED) runs once the puts already
 * issued have completed. */
void pd_xfer_op_cancel(pd_xfer_op *op);

#endif
