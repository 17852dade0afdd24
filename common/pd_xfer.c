/* pd_xfer.c - UCX UCP behind a small transfer API (see pd_xfer.h for the contract).
 * Owns: ucp context/worker lifetime, endpoints and their error handling, rkeys, the transfer
 *       state machine (issue within the window -> flush -> done), timeouts.
 * Not here: page layout, staging from device memory, the address exchange.
 * Threading: single owner thread (SINGLE worker). UCX callbacks (request completion, endpoint
 *       error) only record results in the transfer/peer; the work (issuing more puts,
 *       closing failed endpoints, running done callbacks) happens in pd_xfer_progress. */
#include "pd_xfer.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <ucp/api/ucp.h>

#include "pd_log.h"

#define XFER_DEFAULT_WINDOW 64u
#define XFER_DEFAULT_TIMEOUT_MS 30000u
#define XFER_POLL_MS 100

struct pd_xfer {
    ucp_context_h ctx;
    ucp_worker_h worker;
    int efd;
    ucp_address_t *addr;
    size_t addr_len;
    uint8_t *sealed_addr;       /* addr in a seal (seal_wrap), what peers are given */
    size_t sealed_len;
    bool cuda;
    uint32_t window;
    uint32_t timeout_ms;
    bool err_mode_none;         /* endpoints without peer-failure mode (config) */
    char name[32];
    pd_xfer_op *ops;            /* active transfers (doubly linked) */
    size_t n_ops;
    pd_xfer_peer *peers;
    pd_xfer_mem *mems;
    pd_xfer_op *orphans;        /* ops whose requests outlived a force close (freed last) */
    bool signalled;             /* a completion is ready without a network event */
};

struct pd_xfer_peer {
    pd_xfer *x;
    ucp_ep_h ep;
    bool failed;                /* set by the error handler or a timeout */
    ucs_status_t fail_status;   /* from the error handler (UCS_OK if none) */
    bool closed;                /* ep closed after a failure */
    pd_xfer_rkey *rkeys;
    pd_xfer_peer *next;
    unsigned id;
};

struct pd_xfer_mem {
    pd_xfer *x;
    ucp_mem_h memh;
    void *base;
    size_t len;
    pd_xfer_mem *next;
};

struct pd_xfer_rkey {
    pd_xfer_peer *p;
    ucp_rkey_h rkey;            /* NULL after the peer's endpoint was closed */
    uint64_t base;
    uint64_t len;
    pd_xfer_rkey *next;
};

struct pd_xfer_op {
    pd_xfer *x;
    pd_xfer_peer *p;
    pd_xfer_rkey *rk;           /* NULL for a flush */
    ucp_mem_h local_memh;       /* may be NULL */
    pd_xfer_span *spans;
    size_t n, next;
    uint32_t inflight;          /* puts and the flush outstanding in UCX */
    bool flush_started, flushed;
    pd_err err;                 /* first error; code PD_OK while healthy */
    uint64_t deadline_ns;
    pd_xfer_done_fn done;
    void *ud;
    pd_xfer_op *prev_op, *next_op;
};

/* UCX trusts the worker address and remote key bytes it is given (malformed ones abort the
 * process inside ucp_ep_create / ucp_ep_rkey_unpack), and they arrive in a Prefill request. So
 * the bytes a node hands out are sealed: a 16-byte header (a 4-byte tag, the payload's length,
 * a 64-bit FNV-1a of the payload) before them, and what comes in is checked against it before
 * UCX sees it. It catches corruption and strangers, not a forger. */
#define SEAL_HEADER 16

static uint64_t seal_hash(const uint8_t *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* malloc'd tag + header + payload; NULL on NOMEM */
static uint8_t *seal_wrap(const char tag[4], const void *payload, size_t n, size_t *out_len)
{
    uint8_t *b = malloc(SEAL_HEADER + n);
    if (b == NULL)
        return NULL;
    uint32_t len = (uint32_t)n;
    uint64_t h = seal_hash(payload, n);
    memcpy(b, tag, 4);
    memcpy(b + 4, &len, 4);
    memcpy(b + 8, &h, 8);
    memcpy(b + SEAL_HEADER, payload, n);
    *out_len = SEAL_HEADER + n;
    return b;
}

/* The payload of sealed bytes, or NULL when they are not a seal of this tag. */
static const void *seal_open(const char tag[4], const void *buf, size_t len, size_t *payload_len)
{
    const uint8_t *b = buf;
    uint32_t n;
    uint64_t h;
    if (buf == NULL || len < SEAL_HEADER || memcmp(b, tag, 4) != 0)
        return NULL;
    memcpy(&n, b + 4, 4);
    memcpy(&h, b + 8, 8);
    if ((size_t)n != len - SEAL_HEADER || seal_hash(b + SEAL_HEADER, n) != h)
        return NULL;
    *payload_len = n;
    return b + SEAL_HEADER;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void pd_xfer_config_default(pd_xfer_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->name = "xfer";
    cfg->max_inflight = XFER_DEFAULT_WINDOW;
    cfg->timeout_ms = XFER_DEFAULT_TIMEOUT_MS;
}

/* ---------------------------------------------------------------------------------------------
 * Context and worker */

pd_status pd_xfer_create(const pd_xfer_config *cfg, pd_xfer **out, pd_err *err)
{
    pd_xfer_config def;
    if (cfg == NULL) {
        pd_xfer_config_default(&def);
        cfg = &def;
    }
    pd_xfer *x = calloc(1, sizeof(*x));
    if (x == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "xfer: %zu bytes", sizeof(*x));
    snprintf(x->name, sizeof(x->name), "%s", cfg->name != NULL ? cfg->name : "xfer");
    x->window = cfg->max_inflight ? cfg->max_inflight : XFER_DEFAULT_WINDOW;
    x->timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : XFER_DEFAULT_TIMEOUT_MS;
    x->err_mode_none = cfg->err_mode_none;
    x->efd = -1;
    pd_status st;

    ucp_config_t *ucfg = NULL;
    ucs_status_t us = ucp_config_read(NULL, NULL, &ucfg);
    if (us != UCS_OK) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "xfer %s: ucp_config_read: %s", x->name,
                        ucs_status_string(us));
        goto err_free;
    }
    if (cfg->transports != NULL && cfg->transports[0] != '\0') {
        us = ucp_config_modify(ucfg, "TLS", cfg->transports);
        if (us != UCS_OK) {
            ucp_config_release(ucfg);
            st = pd_err_set(err, PD_ERR_INVALID, "xfer %s: transports \"%s\": %s", x->name,
                            cfg->transports, ucs_status_string(us));
            goto err_free;
        }
    }
    if (!cfg->ucx_keepalive && getenv("UCX_KEEPALIVE_INTERVAL") == NULL) {
        /* UCX's keepalive wakes an idle worker hundreds of times a second (tcp); a dead peer
         * is still seen through its socket, and a hung one through the transfer timeout. */
        us = ucp_config_modify(ucfg, "KEEPALIVE_INTERVAL", "inf");
        if (us != UCS_OK)
            PD_LOG_DEBUG("xfer", "%s: keepalive off: %s", x->name, ucs_status_string(us));
    }
    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                        UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    params.name = x->name;
    us = ucp_init(&params, ucfg, &x->ctx);
    ucp_config_release(ucfg);
    if (us != UCS_OK) {
        st = pd_err_set(err, us == UCS_ERR_NO_DEVICE || us == UCS_ERR_UNSUPPORTED
                                 ? PD_ERR_UNSUPPORTED : PD_ERR_INTERNAL,
                        "xfer %s: ucp_init: %s", x->name, ucs_status_string(us));
        goto err_free;
    }
    ucp_context_attr_t cattr;
    memset(&cattr, 0, sizeof(cattr));
    cattr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(x->ctx, &cattr) == UCS_OK)
        x->cuda = (cattr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

    ucp_worker_params_t wparams;
    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;   /* one thread at a time, handed over (pd_xfer_thread) */
    us = ucp_worker_create(x->ctx, &wparams, &x->worker);
    if (us != UCS_OK) {
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "xfer %s: ucp_worker_create: %s", x->name,
                        ucs_status_string(us));
        goto err_cleanup;
    }
    us = ucp_worker_get_efd(x->worker, &x->efd);
    if (us != UCS_OK) {
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "xfer %s: ucp_worker_get_efd: %s", x->name,
                        ucs_status_string(us));
        goto err_worker;
    }
    us = ucp_worker_get_address(x->worker, &x->addr, &x->addr_len);
    if (us != UCS_OK) {
        st = pd_err_set(err, PD_ERR_INTERNAL, "xfer %s: ucp_worker_get_address: %s", x->name,
                        ucs_status_string(us));
        goto err_worker;
    }
    x->sealed_addr = seal_wrap("PDXA", x->addr, x->addr_len, &x->sealed_len);
    if (x->sealed_addr == NULL) {
        st = pd_err_set(err, PD_ERR_NOMEM, "xfer %s: worker address", x->name);
        ucp_worker_release_address(x->worker, x->addr);
        goto err_worker;
    }
    PD_LOG_INFO("xfer", "%s: ucp worker up, address %zu bytes, cuda memory %s", x->name,
                x->addr_len, x->cuda ? "yes" : "no (host staging)");
    *out = x;
    return PD_OK;
err_worker:
    ucp_worker_destroy(x->worker);
err_cleanup:
    ucp_cleanup(x->ctx);
err_free:
    free(x);
    return st;
}

bool pd_xfer_supports_cuda(const pd_xfer *x)
{
    return x->cuda;
}

int pd_xfer_fd(const pd_xfer *x)
{
    return x->efd;
}

size_t pd_xfer_active(const pd_xfer *x)
{
    return x->n_ops;
}

void pd_xfer_address(const pd_xfer *x, const void **addr, size_t *len)
{
    *addr = x->sealed_addr;
    *len = x->sealed_len;
}

/* Wait for a UCX request (close, flush) by progressing, at most timeout_ms. Returns its status
 * (UCS_ERR_TIMED_OUT if it did not finish; the request is then released to finish alone). */
static ucs_status_t request_wait(pd_xfer *x, void *req, uint32_t timeout_ms)
{
    if (req == NULL)
        return UCS_OK;
    if (UCS_PTR_IS_ERR(req))
        return UCS_PTR_STATUS(req);
    uint64_t end = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    ucs_status_t us;
    while ((us = ucp_request_check_status(req)) == UCS_INPROGRESS) {
        if (ucp_worker_progress(x->worker) == 0 && now_ns() > end) {
            us = UCS_ERR_TIMED_OUT;
            break;
        }
    }
    ucp_request_free(req);
    return us;
}

/* ---------------------------------------------------------------------------------------------
 * Transfers */

static void op_fail(pd_xfer_op *op, pd_status st, const char *fmt, const char *detail)
{
    if (op->err.code == PD_OK)
        pd_err_set(&op->err, st, fmt, op->x->name, op->p->id, detail);
}

/* Completion of one put or the flush: record only. */
static void op_req_done(void *request, ucs_status_t status, void *user_data)
{
    pd_xfer_op *op = user_data;
    PD_ASSERT(op->inflight > 0);
    op->inflight--;
    if (status != UCS_OK)
        op_fail(op, status == UCS_ERR_CANCELED ? PD_ERR_CANCELLED : PD_ERR_PEER,
                "xfer %s: peer %u: put failed: %s", ucs_status_string(status));
    ucp_request_free(request);
}

/* Route one *_nbx result: NULL = done now, error = record, request = wait for the callback. */
static void op_track(pd_xfer_op *op, ucs_status_ptr_t r)
{
    if (r == NULL)
        return;
    if (UCS_PTR_IS_ERR(r)) {
        ucs_status_t us = UCS_PTR_STATUS(r);
        op_fail(op, PD_ERR_PEER, "xfer %s: peer %u: %s", ucs_status_string(us));
        return;
    }
    op->inflight++;
}

static void op_unlink(pd_xfer_op *op)
{
    pd_xfer *x = op->x;
    if (op->prev_op != NULL)
        op->prev_op->next_op = op->next_op;
    else
        x->ops = op->next_op;
    if (op->next_op != NULL)
        op->next_op->prev_op = op->prev_op;
    x->n_ops--;
}

/* Forcefully close a failed peer's endpoint: UCX completes its outstanding requests (with an
 * error), after which its rkeys can go. */
static void peer_close_failed(pd_xfer_peer *p)
{
    if (p->closed || p->ep == NULL)
        return;
    pd_xfer *x = p->x;
    ucp_request_param_t prm;
    memset(&prm, 0, sizeof(prm));
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_t us = request_wait(x, ucp_ep_close_nbx(p->ep, &prm), x->timeout_ms);
    if (us != UCS_OK && us != UCS_ERR_CANCELED && us != UCS_ERR_ENDPOINT_TIMEOUT &&
        us != UCS_ERR_CONNECTION_RESET)
        PD_LOG_DEBUG("xfer", "%s: peer %u: force close: %s", x->name, p->id,
                     ucs_status_string(us));
    for (pd_xfer_rkey *rk = p->rkeys; rk != NULL; rk = rk->next) {
        if (rk->rkey != NULL) {
            ucp_rkey_destroy(rk->rkey);
            rk->rkey = NULL;
        }
    }
    p->ep = NULL;
    p->closed = true;
}

static void peer_fail(pd_xfer_peer *p, pd_status st, const char *why)
{
    pd_xfer *x = p->x;
    if (!p->failed)
        PD_LOG_WARN("xfer", "%s: peer %u failed: %s", x->name, p->id, why);
    p->failed = true;
    for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op) {
        if (op->p == p)
            op_fail(op, st, "xfer %s: peer %u: %s", why);
    }
    peer_close_failed(p);
}

/* Issue what the window allows; flush when all spans are issued and completed. */
static void op_advance(pd_xfer_op *op)
{
    pd_xfer *x = op->x;
    pd_xfer_peer *p = op->p;
    if (op->err.code != PD_OK || p->failed)
        return;
    while (op->next < op->n && op->inflight < x->window && op->err.code == PD_OK) {
        const pd_xfer_span *s = &op->spans[op->next++];
        ucp_request_param_t prm;
        memset(&prm, 0, sizeof(prm));
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        prm.cb.send = op_req_done;
        prm.user_data = op;
        if (op->local_memh != NULL) {
            prm.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
            prm.memh = op->local_memh;
        }
        op_track(op, ucp_put_nbx(p->ep, s->src, s->len, s->raddr, op->rk->rkey, &prm));
    }
    if (op->next == op->n && op->inflight == 0 && !op->flush_started && op->err.code == PD_OK) {
        /* All puts are locally complete; the flush makes them remotely complete. */
        op->flush_started = true;
        ucp_request_param_t prm;
        memset(&prm, 0, sizeof(prm));
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        prm.cb.send = op_req_done;
        prm.user_data = op;
        ucs_status_ptr_t r = ucp_ep_flush_nbx(p->ep, &prm);
        op_track(op, r);
        if (r == NULL || UCS_PTR_IS_PTR(r))
            op->flushed = true;   /* done once inflight drains to zero */
    }
}

static bool op_finished(const pd_xfer_op *op)
{
    if (op->inflight > 0)
        return false;
    return op->err.code != PD_OK || op->flushed;
}

static void op_complete(pd_xfer_op *op)
{
    op_unlink(op);
    pd_err e = op->err;
    if (e.code == PD_OK)
        pd_err_clear(&e);
    PD_LOG_TRACE("xfer", "%s: peer %u: transfer of %zu spans done: %s", op->x->name, op->p->id,
                 op->n, e.code == PD_OK ? "ok" : e.msg);
    pd_xfer_done_fn done = op->done;
    void *ud = op->ud;
    free(op->spans);
    free(op);
    if (done != NULL)
        done(ud, e.code, &e);
}

/* One pass over peers and transfers; returns the number of done callbacks run. */
static unsigned xfer_advance(pd_xfer *x)
{
    for (pd_xfer_peer *p = x->peers; p != NULL; p = p->next) {
        if (p->fail_status != UCS_OK && !p->closed)
            peer_fail(p, PD_ERR_PEER, ucs_status_string(p->fail_status));
    }
    for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op) {
        /* without peer-failure mode no handler reports a dead peer: a put that failed does */
        if (op->err.code == PD_ERR_PEER && !op->p->failed && !op->p->closed)
            peer_fail(op->p, PD_ERR_PEER, op->err.msg);
    }
    uint64_t now = now_ns();
    for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op) {
        if (op->err.code == PD_OK && now > op->deadline_ns) {
            char why[96];
            snprintf(why, sizeof(why), "transfer timed out after %u ms", x->timeout_ms);
            /* In-flight puts can only be aborted by closing the endpoint. */
            op_fail(op, PD_ERR_TIMEOUT, "xfer %s: peer %u: %s", why);
            peer_fail(op->p, PD_ERR_TIMEOUT, why);
        }
    }
    for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op)
        op_advance(op);
    unsigned n_done = 0;
    for (pd_xfer_op *op = x->ops, *next; op != NULL; op = next) {
        next = op->next_op;
        if (op->err.code == PD_OK || op->inflight == 0 || !op->p->closed)
            continue;
        /* The force close did not complete this failed op's requests (endpoints without
         * peer-failure mode: UCX does not purge them). End it now, as peer_destroy does, and
         * keep it until the worker is gone, since those requests still point at it. */
        PD_LOG_WARN("xfer", "%s: peer %u: %u requests outlived the endpoint close", x->name,
                    op->p->id, op->inflight);
        op_unlink(op);
        pd_err e = op->err;
        op->next_op = x->orphans;
        x->orphans = op;
        if (op->done != NULL)
            op->done(op->ud, e.code, &e);
        op->done = NULL;
        n_done++;
        next = x->ops;   /* done() may have changed the list */
    }
    for (;;) {
        /* done() may start or finish other transfers: rescan after each one. */
        pd_xfer_op *ready = NULL;
        for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op) {
            if (op_finished(op)) {
                ready = op;
                break;
            }
        }
        if (ready == NULL)
            break;
        op_complete(ready);
        n_done++;
    }
    return n_done;
}

unsigned pd_xfer_progress(pd_xfer *x)
{
    unsigned n_done = 0;
    for (int spins = 0;; spins++) {
        while (ucp_worker_progress(x->worker) != 0) {
        }
        x->signalled = false;
        n_done += xfer_advance(x);
        ucs_status_t us = ucp_worker_arm(x->worker);
        if (us == UCS_ERR_BUSY)
            continue;
        if (us != UCS_OK && spins == 0)
            PD_LOG_WARN("xfer", "%s: ucp_worker_arm: %s", x->name, ucs_status_string(us));
        if (x->signalled) {
            /* A transfer finished without a network event: make the fd say so. */
            ucp_worker_signal(x->worker);
        }
        break;
    }
    return n_done;
}

unsigned pd_xfer_wait(pd_xfer *x, int timeout_ms)
{
    if (x->n_ops > 0 && (timeout_ms < 0 || timeout_ms > XFER_POLL_MS))
        timeout_ms = XFER_POLL_MS;   /* wake for transfer timeouts */
    struct pollfd pfd = {.fd = x->efd, .events = POLLIN};
    if (poll(&pfd, 1, timeout_ms) < 0 && errno != EINTR)
        PD_LOG_WARN("xfer", "%s: poll: %s", x->name, strerror(errno));
    return pd_xfer_progress(x);
}

/* ---------------------------------------------------------------------------------------------
 * Peers */

static void peer_on_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    pd_xfer_peer *p = arg;
    p->fail_status = status == UCS_OK ? UCS_ERR_CONNECTION_RESET : status;   /* record only */
}

pd_status pd_xfer_peer_create(pd_xfer *x, const void *addr, size_t len, pd_xfer_peer **out,
                              pd_err *err)
{
    static unsigned next_id = 1;
    if (addr == NULL || len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: empty peer address", x->name);
    size_t ucx_len;
    const void *ucx_addr = seal_open("PDXA", addr, len, &ucx_len);
    if (ucx_addr == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: a %zu-byte worker address that no pdspark node "
                          "sealed (corrupt, or a node of another version)", x->name, len);
    pd_xfer_peer *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "xfer %s: peer", x->name);
    p->x = x;
    p->id = __atomic_fetch_add(&next_id, 1, __ATOMIC_RELAXED);
    ucp_ep_params_t ep;
    memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = ucx_addr;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = peer_on_error;
    ep.err_handler.arg = p;
    if (x->err_mode_none)
        /* same-host peers (config): let UCX pick shm/cma, which have no peer-failure mode */
        ep.field_mask &= ~(uint64_t)(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER);
    ucs_status_t us = ucp_ep_create(x->worker, &ep, &p->ep);
    if (us == UCS_ERR_UNREACHABLE && !x->err_mode_none) {
        /* The transports allowed here (e.g. shared memory only) cannot report peer failure:
         * connect without it; the transfer timeout is then the only bound. */
        ep.field_mask &= ~(uint64_t)(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                     UCP_EP_PARAM_FIELD_ERR_HANDLER);
        us = ucp_ep_create(x->worker, &ep, &p->ep);
        if (us == UCS_OK)
            PD_LOG_WARN("xfer", "%s: peer %u: no transport with peer-failure detection; "
                        "failures are detected by the %u ms transfer timeout only", x->name,
                        p->id, x->timeout_ms);
    }
    if (us != UCS_OK) {
        free(p);
        return pd_err_set(err, us == UCS_ERR_INVALID_PARAM ? PD_ERR_INVALID : PD_ERR_PEER,
                          "xfer %s: connect to a %zu-byte worker address: %s", x->name, ucx_len,
                          ucs_status_string(us));
    }
    p->next = x->peers;
    x->peers = p;
    PD_LOG_DEBUG("xfer", "%s: peer %u connected", x->name, p->id);
    *out = p;
    return PD_OK;
}

bool pd_xfer_peer_failed(const pd_xfer_peer *p)
{
    return p->failed || p->fail_status != UCS_OK;
}

void pd_xfer_peer_destroy(pd_xfer_peer *p)
{
    if (p == NULL)
        return;
    pd_xfer *x = p->x;
    /* Stop its transfers; let the issued puts finish (flush close below waits for them). */
    for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op) {
        if (op->p == p && op->err.code == PD_OK)
            op_fail(op, PD_ERR_CANCELLED, "xfer %s: peer %u: %s", "peer closed");
    }
    if (!p->closed && p->ep != NULL) {
        if (p->failed || p->fail_status != UCS_OK) {
            peer_close_failed(p);
        } else {
            /* Graceful: wait for this peer's issued puts, then close with flush. */
            uint64_t end = now_ns() + (uint64_t)x->timeout_ms * 1000000ull;
            for (;;) {
                bool busy = false;
                for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op)
                    busy = busy || (op->p == p && op->inflight > 0);
                if (!busy || p->fail_status != UCS_OK || now_ns() > end)
                    break;
                ucp_worker_progress(x->worker);
            }
            bool clean = true;
            for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op)
                clean = clean && !(op->p == p && op->inflight > 0);
            if (!clean || p->fail_status != UCS_OK) {
                peer_close_failed(p);
            } else {
                for (pd_xfer_rkey *rk = p->rkeys; rk != NULL; rk = rk->next) {
                    if (rk->rkey != NULL) {
                        ucp_rkey_destroy(rk->rkey);
                        rk->rkey = NULL;
                    }
                }
                ucp_request_param_t prm;
                memset(&prm, 0, sizeof(prm));
                ucs_status_t us = request_wait(x, ucp_ep_close_nbx(p->ep, &prm), x->timeout_ms);
                if (us != UCS_OK)
                    PD_LOG_DEBUG("xfer", "%s: peer %u: close: %s", x->name, p->id,
                                 ucs_status_string(us));
                p->ep = NULL;
                p->closed = true;
            }
        }
    }
    /* Every op of p has drained now: run their done callbacks. */
    for (;;) {
        pd_xfer_op *mine = NULL;
        for (pd_xfer_op *op = x->ops; op != NULL; op = op->next_op) {
            if (op->p == p) {
                mine = op;
                break;
            }
        }
        if (mine == NULL)
            break;
        if (mine->inflight > 0) {
            /* The close did not finish in time: UCX still owns requests that point at this
             * op. Report it, and keep the op until the worker is gone. */
            PD_LOG_ERROR("xfer", "%s: peer %u: %u requests outlived the endpoint close",
                         x->name, p->id, mine->inflight);
            op_unlink(mine);
            pd_err e = mine->err;
            mine->next_op = x->orphans;
            x->orphans = mine;
            if (mine->done != NULL)
                mine->done(mine->ud, e.code, &e);
            continue;
        }
        op_complete(mine);
    }
    while (p->rkeys != NULL) {
        pd_xfer_rkey *rk = p->rkeys;
        p->rkeys = rk->next;
        free(rk);
    }
    for (pd_xfer_peer **pp = &x->peers; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == p) {
            *pp = p->next;
            break;
        }
    }
    PD_LOG_DEBUG("xfer", "%s: peer %u closed", x->name, p->id);
    free(p);
}

/* ---------------------------------------------------------------------------------------------
 * Memory and keys */

pd_status pd_xfer_mem_register(pd_xfer *x, void *base, size_t len, pd_xfer_mem **out,
                               pd_err *err)
{
    if (base == NULL || len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: register an empty region", x->name);
    pd_xfer_mem *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "xfer %s: mem", x->name);
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = base;
    mp.length = len;
    ucs_status_t us = ucp_mem_map(x->ctx, &mp, &m->memh);
    if (us != UCS_OK) {
        free(m);
        return pd_err_set(err, us == UCS_ERR_NO_MEMORY ? PD_ERR_NOMEM : PD_ERR_INTERNAL,
                          "xfer %s: register %zu bytes at %p: %s", x->name, len, base,
                          ucs_status_string(us));
    }
    m->x = x;
    m->base = base;
    m->len = len;
    m->next = x->mems;
    x->mems = m;
    *out = m;
    return PD_OK;
}

pd_status pd_xfer_mem_alloc(pd_xfer *x, size_t len, pd_xfer_mem **out, pd_err *err)
{
    if (len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: allocate an empty region", x->name);
    pd_xfer_mem *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "xfer %s: mem", x->name);
    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = NULL;
    mp.length = len;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucs_status_t us = ucp_mem_map(x->ctx, &mp, &m->memh);
    ucp_mem_attr_t ma;
    memset(&ma, 0, sizeof(ma));
    ma.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    if (us == UCS_OK && (us = ucp_mem_query(m->memh, &ma)) != UCS_OK)
        ucp_mem_unmap(x->ctx, m->memh);
    if (us != UCS_OK) {
        free(m);
        return pd_err_set(err, us == UCS_ERR_NO_MEMORY ? PD_ERR_NOMEM : PD_ERR_INTERNAL,
                          "xfer %s: allocate %zu bytes: %s", x->name, len, ucs_status_string(us));
    }
    m->x = x;
    m->base = ma.address;
    m->len = len;
    m->next = x->mems;
    x->mems = m;
    *out = m;
    return PD_OK;
}

void pd_xfer_mem_deregister(pd_xfer_mem *m)
{
    if (m == NULL)
        return;
    pd_xfer *x = m->x;
    ucs_status_t us = ucp_mem_unmap(x->ctx, m->memh);
    if (us != UCS_OK)
        PD_LOG_WARN("xfer", "%s: unregister %zu bytes: %s", x->name, m->len,
                    ucs_status_string(us));
    for (pd_xfer_mem **pm = &x->mems; *pm != NULL; pm = &(*pm)->next) {
        if (*pm == m) {
            *pm = m->next;
            break;
        }
    }
    free(m);
}

void *pd_xfer_mem_base(const pd_xfer_mem *m)
{
    return m->base;
}

size_t pd_xfer_mem_len(const pd_xfer_mem *m)
{
    return m->len;
}

pd_status pd_xfer_mem_pack(const pd_xfer_mem *m, void **buf, size_t *len, pd_err *err)
{
    void *rb = NULL;
    size_t n = 0;
    ucs_status_t us = ucp_rkey_pack(m->x->ctx, m->memh, &rb, &n);
    if (us != UCS_OK)
        return pd_err_set(err, PD_ERR_INTERNAL, "xfer %s: rkey pack: %s", m->x->name,
                          ucs_status_string(us));
    size_t sealed = 0;
    uint8_t *copy = seal_wrap("PDXK", rb, n, &sealed);
    ucp_rkey_buffer_release(rb);
    if (copy == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "xfer %s: rkey of %zu bytes", m->x->name, n);
    *buf = copy;
    *len = sealed;
    return PD_OK;
}

pd_status pd_xfer_rkey_unpack(pd_xfer_peer *p, const void *buf, size_t len, uint64_t base,
                              uint64_t region_len, pd_xfer_rkey **out, pd_err *err)
{
    pd_xfer *x = p->x;
    if (pd_xfer_peer_failed(p) || p->ep == NULL)
        return pd_err_set(err, PD_ERR_PEER, "xfer %s: peer %u failed", x->name, p->id);
    if (buf == NULL || len == 0)
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: empty remote key", x->name);
    if (base + region_len < base)
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: remote region wraps around", x->name);
    size_t ucx_len;
    const void *ucx_key = seal_open("PDXK", buf, len, &ucx_len);
    if (ucx_key == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: peer %u: a %zu-byte remote key that no pdspark node "
                          "sealed (corrupt, or a node of another version)", x->name, p->id, len);
    pd_xfer_rkey *rk = calloc(1, sizeof(*rk));
    if (rk == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "xfer %s: rkey", x->name);
    ucs_status_t us = ucp_ep_rkey_unpack(p->ep, ucx_key, &rk->rkey);
    if (us != UCS_OK) {
        free(rk);
        return pd_err_set(err, PD_ERR_INVALID, "xfer %s: peer %u: bad remote key (%zu bytes): %s",
                          x->name, p->id, len, ucs_status_string(us));
    }
    rk->p = p;
    rk->base = base;
    rk->len = region_len;
    rk->next = p->rkeys;
    p->rkeys = rk;
    *out = rk;
    return PD_OK;
}

void pd_xfer_rkey_destroy(pd_xfer_rkey *rk)
{
    if (rk == NULL)
        return;
    pd_xfer_peer *p = rk->p;
    for (pd_xfer_op *op = p->x->ops; op != NULL; op = op->next_op)
        PD_ASSERT(op->rk != rk);   /* the caller waits for its transfers' done first */
    if (rk->rkey != NULL)
        ucp_rkey_destroy(rk->rkey);
    for (pd_xfer_rkey **pr = &p->rkeys; *pr != NULL; pr = &(*pr)->next) {
        if (*pr == rk) {
            *pr = rk->next;
            break;
        }
    }
    free(rk);
}

/* ---------------------------------------------------------------------------------------------
 * Put / flush */

static pd_status op_start(pd_xfer_peer *p, pd_xfer_rkey *rk, const pd_xfer_mem *local,
                          const pd_xfer_span *spans, size_t n, pd_xfer_done_fn done, void *ud,
                          pd_xfer_op **out, pd_err *err)
{
    pd_xfer *x = p->x;
    if (pd_xfer_peer_failed(p) || p->ep == NULL)
        return pd_err_set(err, PD_ERR_PEER, "xfer %s: peer %u failed", x->name, p->id);
    if (rk != NULL && rk->rkey == NULL)
        return pd_err_set(err, PD_ERR_PEER, "xfer %s: peer %u: remote key released", x->name,
                          p->id);
    for (size_t i = 0; i < n; i++) {
        const pd_xfer_span *s = &spans[i];
        uint64_t end = s->raddr + s->len;
        if (s->src == NULL || s->len == 0 || end < s->raddr || s->raddr < rk->base ||
            end > rk->base + rk->len)
            return pd_err_set(err, PD_ERR_INVALID,
                              "xfer %s: span %zu (%zu bytes at 0x%llx) outside the remote "
                              "region [0x%llx, +%llu)", x->name, i, s->len,
                              (unsigned long long)s->raddr, (unsigned long long)rk->base,
                              (unsigned long long)rk->len);
    }
    pd_xfer_op *op = calloc(1, sizeof(*op));
    if (op == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "xfer %s: transfer", x->name);
    if (n > 0) {
        op->spans = malloc(n * sizeof(*spans));
        if (op->spans == NULL) {
            free(op);
            return pd_err_set(err, PD_ERR_NOMEM, "xfer %s: %zu spans", x->name, n);
        }
        memcpy(op->spans, spans, n * sizeof(*spans));
    }
    op->x = x;
    op->p = p;
    op->rk = rk;
    op->local_memh = local != NULL ? local->memh : NULL;
    op->n = n;
    op->done = done;
    op->ud = ud;
    op->deadline_ns = now_ns() + (uint64_t)x->timeout_ms * 1000000ull;
    op->next_op = x->ops;
    if (x->ops != NULL)
        x->ops->prev_op = op;
    x->ops = op;
    x->n_ops++;
    if (out != NULL)
        *out = op;
    op_advance(op);
    if (op_finished(op)) {
        /* Already complete: done runs from the next progress; make the fd readable. */
        x->signalled = true;
        ucp_worker_signal(x->worker);
    }
    return PD_OK;
}

pd_status pd_xfer_put(pd_xfer_rkey *rk, const pd_xfer_mem *local, const pd_xfer_span *spans,
                      size_t n, pd_xfer_done_fn done, void *ud, pd_xfer_op **out, pd_err *err)
{
    if (rk == NULL || (spans == NULL && n > 0))
        return pd_err_set(err, PD_ERR_INVALID, "xfer: put without a remote key or spans");
    return op_start(rk->p, rk, local, spans, n, done, ud, out, err);
}

pd_status pd_xfer_flush(pd_xfer_peer *p, pd_xfer_done_fn done, void *ud, pd_xfer_op **out,
                        pd_err *err)
{
    return op_start(p, NULL, NULL, NULL, 0, done, ud, out, err);
}

void pd_xfer_op_cancel(pd_xfer_op *op)
{
    if (op != NULL && op->err.code == PD_OK)
        op_fail(op, PD_ERR_CANCELLED, "xfer %s: peer %u: %s", "transfer cancelled");
}

/* ---------------------------------------------------------------------------------------------
 * Teardown */

void pd_xfer_destroy(pd_xfer *x)
{
    if (x == NULL)
        return;
    while (x->peers != NULL)
        pd_xfer_peer_destroy(x->peers);
    while (x->mems != NULL) {
        PD_LOG_DEBUG("xfer", "%s: registration of %zu bytes still alive at destroy", x->name,
                     x->mems->len);
        pd_xfer_mem_deregister(x->mems);
    }
    ucp_worker_release_address(x->worker, x->addr);
    free(x->sealed_addr);
    ucp_worker_destroy(x->worker);
    ucp_cleanup(x->ctx);
    while (x->orphans != NULL) {
        pd_xfer_op *op = x->orphans;
        x->orphans = op->next_op;
        free(op->spans);
        free(op);
    }
    PD_LOG_INFO("xfer", "%s: ucp worker down", x->name);
    free(x);
}
