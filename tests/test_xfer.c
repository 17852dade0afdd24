/* test_xfer.c - pd_xfer on loopback.
 * 1. Peer death: a forked child registers a pool over tcp and is killed mid-transfer; the
 *    transfer must end with PD_ERR_PEER or PD_ERR_TIMEOUT, never hang or report success.
 * 2. Two pd_xfer instances in one process (receiver progressed by its own thread): register a
 *    4 MiB "KV pool", pack/unpack the rkey, put scattered pages with a small window, flush,
 *    compare bytes; bad spans are refused; flush-only transfers; cancel.
 * 3. The same transfer driven by a pd_loop (fd watcher + periodic timer), with closures posted
 *    from another thread and a one-shot timer.
 * 4. Both sides on pd_xfer_threads, the way the nodes run them: the main thread only posts
 *    the put and then sleeps (an engine thread inside a forward); the transfer still completes,
 *    its done runs on the sender's transfer thread, and a cancel posted to an ended transfer
 *    touches nothing.
 * Transports: part 2 uses the UCX default (or UCX_TLS from the environment); part 1 forces tcp
 * because only a socket notices a dead process without waiting for keepalive.
 * Nothing is timed; waits are bounded only to turn a hang into a failure. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pd_loop.h"
#include "pd_xfer.h"
#include "pd_xfer_thread.h"
#include "test_util.h"

#define POOL_BYTES (4u << 20)
#define PAGE_BYTES (16u << 10)
#define N_PAGES (POOL_BYTES / PAGE_BYTES)
#define WAIT_LIMIT_S 120

typedef struct {
    bool done;
    pd_status st;
    char msg[512];
} done_box;

static void on_done(void *ud, pd_status st, const pd_err *err)
{
    done_box *b = ud;
    b->done = true;
    b->st = st;
    snprintf(b->msg, sizeof(b->msg), "%s", err != NULL ? err->msg : "");
}

static double wall_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Progress until *flag; false after WAIT_LIMIT_S (a hang, reported as a failure). */
static bool wait_done(pd_xfer *x, const bool *flag)
{
    double end = wall_s() + WAIT_LIMIT_S;
    while (!*flag) {
        if (wall_s() > end)
            return false;
        pd_xfer_wait(x, 50);
    }
    return true;
}

static bool write_full(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w <= 0)
            return false;
        c += w;
        n -= (size_t)w;
    }
    return true;
}

static bool read_full(int fd, void *p, size_t n)
{
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r <= 0)
            return false;
        c += r;
        n -= (size_t)r;
    }
    return true;
}

/* ---------------------------------------------------------------------------------------------
 * 1. Peer death (forked receiver) */

#define DEATH_POOL_BYTES (64u << 20)

/* Endpoints without peer-failure mode (pd_xfer_config.err_mode_none) for the next test run. */
static bool g_err_none;

static void death_child(int wfd)
{
    pd_xfer_config cfg;
    pd_xfer_config_default(&cfg);
    cfg.name = "child";
    cfg.transports = "tcp";
    pd_xfer *x = NULL;
    pd_err err;
    uint32_t ok = 0;
    char *pool = calloc(1, DEATH_POOL_BYTES);
    pd_xfer_mem *m = NULL;
    void *rkey = NULL;
    size_t rkey_len = 0;
    if (pool != NULL && pd_xfer_create(&cfg, &x, &err) == PD_OK &&
        pd_xfer_mem_register(x, pool, DEATH_POOL_BYTES, &m, &err) == PD_OK &&
        pd_xfer_mem_pack(m, &rkey, &rkey_len, &err) == PD_OK)
        ok = 1;
    else
        fprintf(stderr, "child: %s\n", err.msg);
    write_full(wfd, &ok, sizeof(ok));
    if (!ok)
        _exit(1);
    const void *addr;
    size_t addr_len;
    pd_xfer_address(x, &addr, &addr_len);
    uint64_t base = (uint64_t)(uintptr_t)pool, len = DEATH_POOL_BYTES;
    uint32_t al = (uint32_t)addr_len, rl = (uint32_t)rkey_len;
    write_full(wfd, &base, sizeof(base));
    write_full(wfd, &len, sizeof(len));
    write_full(wfd, &al, sizeof(al));
    write_full(wfd, addr, addr_len);
    write_full(wfd, &rl, sizeof(rl));
    write_full(wfd, rkey, rkey_len);
    close(wfd);
    for (;;)   /* serve (software RMA over tcp needs the target to progress) until killed */
        pd_xfer_wait(x, 100);
}

/* stop = false: the peer process is killed (socket reset -> PD_ERR_PEER, or the timeout).
 * stop = true: the peer hangs (SIGSTOP, connection stays up) -> the transfer timeout fires. */
static void test_peer_death(bool stop)
{
    int fds[2];
    if (pipe(fds) != 0)
        TEST_SKIP("pipe failed");
    pid_t pid = fork();
    if (pid < 0)
        TEST_SKIP("fork failed");
    if (pid == 0) {
        close(fds[0]);
        death_child(fds[1]);
        _exit(0);
    }
    close(fds[1]);
    uint32_t ok = 0;
    if (!read_full(fds[0], &ok, sizeof(ok)) || !ok) {
        waitpid(pid, NULL, 0);
        TEST_SKIP("UCX tcp transport unavailable for the peer-death test");
    }
    uint64_t base, len;
    uint32_t al, rl;
    TEST_CHECK(read_full(fds[0], &base, sizeof(base)) && read_full(fds[0], &len, sizeof(len)));
    TEST_CHECK(read_full(fds[0], &al, sizeof(al)));
    void *addr = malloc(al);
    TEST_CHECK(read_full(fds[0], addr, al));
    TEST_CHECK(read_full(fds[0], &rl, sizeof(rl)));
    void *rkb = malloc(rl);
    TEST_CHECK(read_full(fds[0], rkb, rl));
    close(fds[0]);

    pd_xfer_config cfg;
    pd_xfer_config_default(&cfg);
    cfg.name = "parent";
    cfg.transports = "tcp";
    cfg.max_inflight = 16;
    cfg.timeout_ms = stop || g_err_none ? 1500 : 20000;   /* the bound if the failure is not seen */
    cfg.err_mode_none = g_err_none;
    pd_xfer *x = NULL;
    pd_xfer_peer *p = NULL;
    pd_xfer_rkey *rk = NULL;
    pd_err err;
    pd_status st = pd_xfer_create(&cfg, &x, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st == PD_OK)
        st = pd_xfer_peer_create(x, addr, al, &p, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st == PD_OK)
        st = pd_xfer_rkey_unpack(p, rkb, rl, base, len, &rk, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);

    /* Far more bytes than can move before the kill lands. */
    const size_t span = 64u << 10, n = 200000;
    char *src = malloc(span);
    pd_xfer_span *spans = malloc(n * sizeof(*spans));
    memset(src, 0x5a, span);
    for (size_t i = 0; i < n; i++)
        spans[i] = (pd_xfer_span){src, base + (i % (len / span)) * span, span};
    done_box box = {0};
    if (st == PD_OK) {
        st = pd_xfer_put(rk, NULL, spans, n, on_done, &box, NULL, &err);
        TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    }
    free(spans);
    if (st == PD_OK) {
        for (int i = 0; i < 5 && !box.done; i++)
            pd_xfer_wait(x, 10);
        TEST_CHECK(!box.done);
        kill(pid, stop ? SIGSTOP : SIGKILL);
        if (!stop)
            waitpid(pid, NULL, 0);
        TEST_CHECK_MSG(wait_done(x, &box.done), "transfer still pending after the peer died");
        TEST_CHECK_MSG(box.st == PD_ERR_PEER || box.st == PD_ERR_TIMEOUT, "%s: %s",
                       pd_status_str(box.st), box.msg);
        printf("peer %s%s -> %s (%s)\n", stop ? "hang" : "death", g_err_none ? " (err mode none)" : "",
               pd_status_str(box.st), box.msg);
        if (stop) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        TEST_CHECK(pd_xfer_peer_failed(p));
        /* a put on the failed peer is refused at once */
        pd_xfer_span one = {src, base, 64};
        done_box b2 = {0};
        TEST_CHECK(pd_xfer_put(rk, NULL, &one, 1, on_done, &b2, NULL, &err) == PD_ERR_PEER);
        TEST_CHECK(!b2.done);
    } else {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    pd_xfer_peer_destroy(p);   /* also frees rk */
    pd_xfer_destroy(x);
    free(src);
    free(addr);
    free(rkb);
}

/* ---------------------------------------------------------------------------------------------
 * 2. In-process pair */

typedef struct {
    pd_xfer *x;
    atomic_bool stop;
} rx_thread_arg;

static void *rx_thread(void *arg)
{
    rx_thread_arg *a = arg;
    while (!atomic_load(&a->stop))
        pd_xfer_wait(a->x, 10);
    return NULL;
}

/* A receiver "rx" and a sender "tx" (window 8, g_err_none's endpoint mode); false (reported)
 * when either cannot be made; skips the test where UCX has no transport. */
static bool pair_create(pd_xfer **rx, pd_xfer **tx, uint32_t timeout_ms)
{
    pd_err err;
    pd_xfer_config cfg;
    pd_xfer_config_default(&cfg);
    cfg.name = "rx";
    *rx = *tx = NULL;
    pd_status st = pd_xfer_create(&cfg, rx, &err);
    if (st == PD_ERR_UNSUPPORTED)
        TEST_SKIP("UCX has no usable transport here");
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        return false;
    cfg.name = "tx";
    cfg.max_inflight = 8;
    cfg.timeout_ms = timeout_ms;
    cfg.err_mode_none = g_err_none;
    st = pd_xfer_create(&cfg, tx, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK) {
        pd_xfer_destroy(*rx);
        *rx = NULL;
        return false;
    }
    return true;
}

static void test_pair(void)
{
    pd_err err;
    pd_xfer *rx = NULL, *tx = NULL;
    if (!pair_create(&rx, &tx, 30000))
        return;
    printf("cuda memory support: %s\n", pd_xfer_supports_cuda(tx) ? "yes" : "no");
    TEST_CHECK(pd_xfer_fd(tx) >= 0 && pd_xfer_fd(rx) >= 0);

    /* receiver: the KV pool and its key */
    unsigned char *pool = calloc(1, POOL_BYTES);
    pd_xfer_mem *pool_mem = NULL;
    TEST_CHECK(pd_xfer_mem_register(rx, pool, POOL_BYTES, &pool_mem, &err) == PD_OK);
    TEST_CHECK(pd_xfer_mem_base(pool_mem) == pool && pd_xfer_mem_len(pool_mem) == POOL_BYTES);
    void *rkb = NULL;
    size_t rkl = 0;
    TEST_CHECK(pd_xfer_mem_pack(pool_mem, &rkb, &rkl, &err) == PD_OK && rkl > 0);
    const void *rx_addr;
    size_t rx_addr_len;
    pd_xfer_address(rx, &rx_addr, &rx_addr_len);
    TEST_CHECK(rx_addr_len > 0);

    /* sender: pages with a per-page pattern, registered as the source */
    unsigned char *src = malloc(POOL_BYTES);
    for (size_t i = 0; i < POOL_BYTES; i++)
        src[i] = (unsigned char)((i / PAGE_BYTES) * 7 + i * 13 + 1);
    pd_xfer_mem *src_mem = NULL;
    TEST_CHECK(pd_xfer_mem_register(tx, src, POOL_BYTES, &src_mem, &err) == PD_OK);

    rx_thread_arg ta = {.x = rx};
    atomic_init(&ta.stop, false);
    pthread_t th;
    pthread_create(&th, NULL, rx_thread, &ta);

    pd_xfer_peer *p = NULL;
    pd_xfer_rkey *rk = NULL;
    done_box b7 = {0};
    pd_status st = pd_xfer_peer_create(tx, rx_addr, rx_addr_len, &p, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    uint64_t rbase = (uint64_t)(uintptr_t)pool;
    if (st == PD_OK)
        st = pd_xfer_rkey_unpack(p, rkb, rkl, rbase, POOL_BYTES, &rk, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    unsigned char junk[8] = {1, 2, 3};
    pd_xfer_rkey *bad = NULL;
    if (p != NULL)
        TEST_CHECK(pd_xfer_rkey_unpack(p, junk, 0, rbase, 64, &bad, &err) == PD_ERR_INVALID);
    /* bytes that are not what a node sealed never reach UCX (it aborts on malformed ones): a
     * changed byte, a cut, the other kind of blob, garbage */
    unsigned char *alt = malloc(rkl > rx_addr_len ? rkl : rx_addr_len);
    for (int k = 0; k < 4 && p != NULL && alt != NULL; k++) {
        memcpy(alt, rkb, rkl);
        size_t n = rkl;
        if (k == 0)
            alt[rkl - 1] ^= 0x40;
        else if (k == 1)
            n = rkl - 3;
        else if (k == 2)
            alt[3] = 'A';   /* an address's tag */
        else
            memset(alt, 0x5a, rkl);
        TEST_CHECK_MSG(pd_xfer_rkey_unpack(p, alt, n, rbase, 64, &bad, &err) == PD_ERR_INVALID &&
                           strstr(err.msg, "sealed") != NULL, "altered rkey %d: %s", k, err.msg);
        memcpy(alt, rx_addr, rx_addr_len);
        n = rx_addr_len;
        if (k == 0)
            alt[rx_addr_len / 2] ^= 1;
        else if (k == 1)
            n = rx_addr_len - 1;
        else if (k == 2)
            alt[3] = 'K';   /* a key's tag */
        else
            memset(alt, 0xa5, rx_addr_len);
        pd_xfer_peer *bp = NULL;
        TEST_CHECK_MSG(pd_xfer_peer_create(tx, alt, n, &bp, &err) == PD_ERR_INVALID &&
                           strstr(err.msg, "sealed") != NULL, "altered address %d: %s", k, err.msg);
    }
    free(alt);

    if (st == PD_OK) {
        /* scattered: source page i -> destination page (i * 37 + 5) mod N, 100 pages */
        enum { N_PUT = 100 };
        pd_xfer_span spans[N_PUT];
        for (unsigned i = 0; i < N_PUT; i++) {
            unsigned dst = (i * 37u + 5u) % N_PAGES;
            spans[i] = (pd_xfer_span){src + (size_t)i * PAGE_BYTES,
                                      rbase + (uint64_t)dst * PAGE_BYTES, PAGE_BYTES};
        }
        done_box box = {0};
        st = pd_xfer_put(rk, src_mem, spans, N_PUT, on_done, &box, NULL, &err);
        TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
        TEST_CHECK(!box.done);   /* never from inside pd_xfer_put */
        TEST_CHECK(wait_done(tx, &box.done));
        TEST_CHECK_MSG(box.st == PD_OK, "%s", box.msg);
        TEST_CHECK(pd_xfer_active(tx) == 0);
        /* done means remotely complete: the bytes are there now */
        unsigned bad_pages = 0, untouched_ok = 1;
        static unsigned char written[N_PAGES];
        for (unsigned i = 0; i < N_PUT; i++) {
            unsigned dst = (i * 37u + 5u) % N_PAGES;
            written[dst] = 1;
            if (memcmp(pool + (size_t)dst * PAGE_BYTES, src + (size_t)i * PAGE_BYTES,
                       PAGE_BYTES) != 0)
                bad_pages++;
        }
        for (unsigned d = 0; d < N_PAGES; d++) {
            if (written[d])
                continue;
            for (size_t b = 0; b < PAGE_BYTES; b++)
                untouched_ok &= pool[(size_t)d * PAGE_BYTES + b] == 0;
        }
        TEST_CHECK_MSG(bad_pages == 0, "%u pages differ", bad_pages);
        TEST_CHECK(untouched_ok);

        /* sub-page spans, unaligned, without a local registration */
        pd_xfer_span small[3] = {{src + 3, rbase + 1, 1},
                                 {src + 100, rbase + POOL_BYTES - 77, 77},
                                 {src + 5000, rbase + 12345, 4321}};
        done_box b2 = {0};
        TEST_CHECK(pd_xfer_put(rk, NULL, small, 3, on_done, &b2, NULL, &err) == PD_OK);
        TEST_CHECK(wait_done(tx, &b2.done) && b2.st == PD_OK);
        TEST_CHECK(pool[1] == src[3]);
        TEST_CHECK(memcmp(pool + POOL_BYTES - 77, src + 100, 77) == 0);
        TEST_CHECK(memcmp(pool + 12345, src + 5000, 4321) == 0);

        /* out of the region: refused, nothing started, done never runs */
        pd_xfer_span oob[2] = {{src, rbase, 64}, {src, rbase + POOL_BYTES - 8, 16}};
        done_box b3 = {0};
        TEST_CHECK(pd_xfer_put(rk, NULL, oob, 2, on_done, &b3, NULL, &err) == PD_ERR_INVALID);
        TEST_CHECK(strstr(err.msg, "outside the remote region") != NULL);
        pd_xfer_span below = {src, rbase - 64, 64};
        TEST_CHECK(pd_xfer_put(rk, NULL, &below, 1, on_done, &b3, NULL, &err) == PD_ERR_INVALID);
        TEST_CHECK(pd_xfer_active(tx) == 0 && !b3.done);

        /* flush only */
        done_box b4 = {0};
        TEST_CHECK(pd_xfer_flush(p, on_done, &b4, NULL, &err) == PD_OK);
        TEST_CHECK(wait_done(tx, &b4.done) && b4.st == PD_OK);

        /* cancel before progress: issued puts finish, the rest are never issued */
        enum { N_BIG = N_PAGES * 8 };
        pd_xfer_span *many = malloc(N_BIG * sizeof(*many));
        for (unsigned i = 0; i < N_BIG; i++)
            many[i] = (pd_xfer_span){src + (size_t)(i % N_PAGES) * PAGE_BYTES,
                                     rbase + (uint64_t)(i % N_PAGES) * PAGE_BYTES, PAGE_BYTES};
        done_box b5 = {0};
        pd_xfer_op *op = NULL;
        TEST_CHECK(pd_xfer_put(rk, NULL, many, N_BIG, on_done, &b5, &op, &err) == PD_OK);
        free(many);
        if (!b5.done)
            pd_xfer_op_cancel(op);
        TEST_CHECK(wait_done(tx, &b5.done));
        TEST_CHECK_MSG(b5.st == PD_ERR_CANCELLED || b5.st == PD_OK, "%s", b5.msg);

        /* the peer is still healthy after all that */
        done_box b6 = {0};
        TEST_CHECK(pd_xfer_put(rk, src_mem, spans, 10, on_done, &b6, NULL, &err) == PD_OK);
        TEST_CHECK(wait_done(tx, &b6.done) && b6.st == PD_OK);
        TEST_CHECK(!pd_xfer_peer_failed(p));

        /* peer destroyed with a transfer in flight: done runs with CANCELLED (or OK if it won) */
        TEST_CHECK(pd_xfer_put(rk, src_mem, spans, N_PUT, on_done, &b7, NULL, &err) == PD_OK);
    }
    pd_xfer_peer_destroy(p);   /* flush-closes; needs the rx thread still progressing */
    if (st == PD_OK)
        TEST_CHECK_MSG(b7.done && (b7.st == PD_ERR_CANCELLED || b7.st == PD_OK), "%s", b7.msg);

    atomic_store(&ta.stop, true);
    pthread_join(th, NULL);
    pd_xfer_mem_deregister(src_mem);
    pd_xfer_mem_deregister(pool_mem);
    pd_xfer_destroy(tx);
    pd_xfer_destroy(rx);
    free(rkb);
    free(src);
    free(pool);
}

/* ---------------------------------------------------------------------------------------------
 * 3. Loop-driven */

typedef struct {
    pd_loop *loop;
    pd_xfer *tx;
    done_box box;
    int posted_seen;          /* loop thread only */
    int posted_order_ok;
    int oneshot_fired;
    int ticks;
    int fd_wakeups;
} loop_ctx;

static void on_xfer_fd(int fd, void *arg)
{
    (void)fd;
    loop_ctx *c = arg;
    c->fd_wakeups++;
    pd_xfer_progress(c->tx);
}

static void on_tick(void *arg)
{
    loop_ctx *c = arg;
    c->ticks++;
    pd_xfer_progress(c->tx);   /* transfer timeouts fire without network events */
}

static void on_oneshot(void *arg)
{
    ((loop_ctx *)arg)->oneshot_fired++;
}

typedef struct {
    loop_ctx *c;
    int seq;
} post_arg;

static void on_posted(void *arg)
{
    post_arg *a = arg;
    loop_ctx *c = a->c;
    if (!pd_loop_in_loop_thread(c->loop) || a->seq != c->posted_seen)
        c->posted_order_ok = 0;
    c->posted_seen++;
    free(a);
    if (c->posted_seen == 1000 && c->box.done)
        pd_loop_stop(c->loop);
}

static void *poster(void *arg)
{
    loop_ctx *c = arg;
    for (int i = 0; i < 1000; i++) {
        post_arg *a = malloc(sizeof(*a));
        a->c = c;
        a->seq = i;
        if (pd_loop_post(c->loop, on_posted, a) != PD_OK)
            free(a);
    }
    return NULL;
}

static void on_loop_done(void *ud, pd_status st, const pd_err *err)
{
    loop_ctx *c = ud;
    on_done(&c->box, st, err);
    if (c->posted_seen == 1000)
        pd_loop_stop(c->loop);
}

static void on_give_up(void *arg)
{
    pd_loop_stop(((loop_ctx *)arg)->loop);
}

static void test_loop_driven(void)
{
    pd_err err;
    pd_xfer *rx = NULL, *tx = NULL;
    pd_xfer_config cfg;
    pd_xfer_config_default(&cfg);
    cfg.name = "loop-rx";
    if (pd_xfer_create(&cfg, &rx, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "%s", err.msg);
        return;
    }
    cfg.name = "loop-tx";
    cfg.max_inflight = 4;
    TEST_CHECK(pd_xfer_create(&cfg, &tx, &err) == PD_OK);
    unsigned char *pool = calloc(1, POOL_BYTES), *src = malloc(POOL_BYTES);
    for (size_t i = 0; i < POOL_BYTES; i++)
        src[i] = (unsigned char)(i * 31 + 7);
    pd_xfer_mem *pm = NULL;
    void *rkb = NULL;
    size_t rkl = 0;
    const void *addr;
    size_t addr_len;
    TEST_CHECK(pd_xfer_mem_register(rx, pool, POOL_BYTES, &pm, &err) == PD_OK);
    TEST_CHECK(pd_xfer_mem_pack(pm, &rkb, &rkl, &err) == PD_OK);
    pd_xfer_address(rx, &addr, &addr_len);
    rx_thread_arg ta = {.x = rx};
    atomic_init(&ta.stop, false);
    pthread_t th;
    pthread_create(&th, NULL, rx_thread, &ta);

    loop_ctx c;
    memset(&c, 0, sizeof(c));
    c.tx = tx;
    c.posted_order_ok = 1;
    TEST_CHECK(pd_loop_create(&c.loop, &err) == PD_OK);
    pd_loop_watch *w = NULL;
    pd_loop_timer *tick = NULL, *oneshot = NULL, *give_up = NULL;
    TEST_CHECK(pd_loop_watch_fd(c.loop, pd_xfer_fd(tx), on_xfer_fd, &c, &w, &err) == PD_OK);
    TEST_CHECK(pd_loop_timer_create(c.loop, on_tick, &c, &tick, &err) == PD_OK);
    TEST_CHECK(pd_loop_timer_create(c.loop, on_oneshot, &c, &oneshot, &err) == PD_OK);
    TEST_CHECK(pd_loop_timer_create(c.loop, on_give_up, &c, &give_up, &err) == PD_OK);
    pd_loop_timer_start(tick, 50, true);
    pd_loop_timer_start(oneshot, 1, false);
    pd_loop_timer_start(give_up, WAIT_LIMIT_S * 1000, false);

    pd_xfer_peer *p = NULL;
    pd_xfer_rkey *rk = NULL;
    uint64_t rbase = (uint64_t)(uintptr_t)pool;
    TEST_CHECK(pd_xfer_peer_create(tx, addr, addr_len, &p, &err) == PD_OK);
    TEST_CHECK(p != NULL &&
               pd_xfer_rkey_unpack(p, rkb, rkl, rbase, POOL_BYTES, &rk, &err) == PD_OK);
    enum { N = 64 };
    pd_xfer_span spans[N];
    for (unsigned i = 0; i < N; i++)
        spans[i] = (pd_xfer_span){src + (size_t)i * PAGE_BYTES,
                                  rbase + (uint64_t)(N_PAGES - 1 - i) * PAGE_BYTES, PAGE_BYTES};
    pthread_t pt;
    pthread_create(&pt, NULL, poster, &c);
    if (rk != NULL)
        TEST_CHECK(pd_xfer_put(rk, NULL, spans, N, on_loop_done, &c, NULL, &err) == PD_OK);
    pd_xfer_progress(tx);   /* arm before the loop sleeps on the fd */
    TEST_CHECK(pd_loop_run(c.loop, &err) == PD_OK);
    pthread_join(pt, NULL);
    TEST_CHECK_MSG(c.box.done && c.box.st == PD_OK, "%s", c.box.msg);
    printf("loop-driven transfer: %d fd wakeups, %d ticks\n", c.fd_wakeups, c.ticks);
    unsigned bad = 0;
    for (unsigned i = 0; i < N; i++)
        bad += memcmp(pool + (size_t)(N_PAGES - 1 - i) * PAGE_BYTES, src + (size_t)i * PAGE_BYTES,
                      PAGE_BYTES) != 0;
    TEST_CHECK_MSG(bad == 0, "%u pages differ", bad);

    /* a stop asked before run makes run return at once; posts after run are refused */
    pd_loop_stop(c.loop);
    TEST_CHECK(pd_loop_run(c.loop, &err) == PD_OK);
    int dummy = 0;
    TEST_CHECK(pd_loop_post(c.loop, on_oneshot, &dummy) == PD_ERR_CANCELLED);

    pd_loop_timer_destroy(tick);
    pd_loop_timer_destroy(oneshot);
    pd_loop_timer_destroy(give_up);
    pd_loop_watch_destroy(w);
    pd_loop_destroy(c.loop);
    TEST_CHECK_MSG(c.posted_seen == 1000, "%d posts ran", c.posted_seen);
    TEST_CHECK(c.posted_order_ok);
    TEST_CHECK(c.oneshot_fired == 1);

    pd_xfer_peer_destroy(p);
    atomic_store(&ta.stop, true);
    pthread_join(th, NULL);
    pd_xfer_mem_deregister(pm);
    pd_xfer_destroy(tx);
    pd_xfer_destroy(rx);
    free(rkb);
    free(pool);
    free(src);
}

typedef struct {
    pd_xfer *tx;
    pd_xfer_thread *txt;
    const void *addr;
    size_t addr_len;
    const void *rkb;
    size_t rkl;
    uint64_t rbase;
    pd_xfer_span *spans;
    size_t n;
    pd_xfer_peer *p;
    pd_xfer_rkey *rk;
    pd_xfer_op *op;
    pd_status put_st;
    char put_msg[512];
    atomic_int done;           /* 0 running, 1 done */
    pd_status st;
    bool done_on_thread;
    atomic_int closed;
} thr_job;

static void thr_on_done(void *ud, pd_status st, const pd_err *err)
{
    (void)err;
    thr_job *j = ud;
    j->st = st;
    j->op = NULL;
    j->done_on_thread = pd_xfer_thread_here(j->txt);
    atomic_store(&j->done, 1);
}

/* on the sender's transfer thread: connect, unpack, put everything */
static void thr_start(void *arg)
{
    thr_job *j = arg;
    pd_err err = {0};
    pd_status st = pd_xfer_peer_create(j->tx, j->addr, j->addr_len, &j->p, &err);
    if (st == PD_OK)
        st = pd_xfer_rkey_unpack(j->p, j->rkb, j->rkl, j->rbase, POOL_BYTES, &j->rk, &err);
    if (st == PD_OK)
        st = pd_xfer_put(j->rk, NULL, j->spans, j->n, thr_on_done, j, &j->op, &err);
    j->put_st = st;
    snprintf(j->put_msg, sizeof(j->put_msg), "%s", err.msg);
    if (st != PD_OK)
        atomic_store(&j->done, 1);
}

/* a cancel after the end: the op handle is gone and nothing is touched */
static void thr_cancel(void *arg)
{
    thr_job *j = arg;
    if (j->op != NULL)
        pd_xfer_op_cancel(j->op);
}

static void thr_close(void *arg)
{
    thr_job *j = arg;
    pd_xfer_rkey_destroy(j->rk);
    pd_xfer_peer_destroy(j->p);
    j->rk = NULL;
    j->p = NULL;
    atomic_store(&j->closed, 1);
}

static void test_threads(void)
{
    pd_err err;
    pd_xfer *rx = NULL, *tx = NULL;
    if (!pair_create(&rx, &tx, 60000))
        return;
    unsigned char *pool = calloc(1, POOL_BYTES), *src = malloc(POOL_BYTES);
    for (size_t i = 0; i < POOL_BYTES; i++)
        src[i] = (unsigned char)(i * 31 + (i >> 12) + 5);
    pd_xfer_mem *pm = NULL;
    void *rkb = NULL;
    size_t rkl = 0;
    TEST_CHECK(pd_xfer_mem_register(rx, pool, POOL_BYTES, &pm, &err) == PD_OK);
    TEST_CHECK(pd_xfer_mem_pack(pm, &rkb, &rkl, &err) == PD_OK);
    thr_job j = {.tx = tx, .rkb = rkb, .rkl = rkl, .rbase = (uint64_t)(uintptr_t)pool, .n = N_PAGES};
    atomic_init(&j.done, 0);
    atomic_init(&j.closed, 0);
    pd_xfer_address(rx, &j.addr, &j.addr_len);
    /* every page to a scattered destination page */
    j.spans = malloc(N_PAGES * sizeof(*j.spans));
    for (size_t i = 0; i < N_PAGES; i++)
        j.spans[i] = (pd_xfer_span){ .src = src + i * PAGE_BYTES,
                                     .raddr = j.rbase + ((i * 7) % N_PAGES) * PAGE_BYTES,
                                     .len = PAGE_BYTES };
    pd_xfer_thread *rxt = NULL;
    TEST_CHECK(pd_xfer_thread_start(rx, &rxt, &err) == PD_OK);
    TEST_CHECK(pd_xfer_thread_start(tx, &j.txt, &err) == PD_OK);
    TEST_CHECK(!pd_xfer_thread_here(j.txt));
    TEST_CHECK(pd_xfer_thread_post(j.txt, thr_start, &j) == PD_OK);
    /* this thread progresses nothing from here on: it only looks */
    double end = wall_s() + WAIT_LIMIT_S;
    while (atomic_load(&j.done) == 0 && wall_s() < end)
        usleep(20000);
    TEST_CHECK_MSG(atomic_load(&j.done) == 1, "the transfer did not end within %d s", WAIT_LIMIT_S);
    TEST_CHECK_MSG(j.put_st == PD_OK, "put: %s", j.put_msg);
    TEST_CHECK_MSG(j.st == PD_OK, "done: %s", pd_status_str(j.st));
    TEST_CHECK(j.done_on_thread);
    int same = 1;
    for (size_t i = 0; i < N_PAGES; i++)
        same &= memcmp(pool + ((i * 7) % N_PAGES) * PAGE_BYTES, src + i * PAGE_BYTES, PAGE_BYTES) == 0;
    TEST_CHECK_MSG(same, "pages differ after the threaded transfer");
    TEST_CHECK(pd_xfer_thread_post(j.txt, thr_cancel, &j) == PD_OK);
    TEST_CHECK(pd_xfer_thread_post(j.txt, thr_close, &j) == PD_OK);
    /* queued closures run by stop at the latest */
    pd_xfer_thread_stop(j.txt);
    TEST_CHECK(atomic_load(&j.closed) == 1);
    pd_xfer_thread_stop(rxt);
    pd_xfer_thread_stop(NULL);
    /* this thread owns both again */
    TEST_CHECK(pd_xfer_active(tx) == 0);
    pd_xfer_mem_deregister(pm);
    pd_xfer_destroy(tx);
    pd_xfer_destroy(rx);
    free(rkb);
    free(j.spans);
    free(pool);
    free(src);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    /* first: they fork before this process initialises UCX */
    test_peer_death(false);
    test_peer_death(true);
    g_err_none = true;
    test_peer_death(true);
    test_peer_death(false);
    g_err_none = false;
    test_pair();
    /* endpoints without peer-failure mode (same-host peers: shm/cma usable): the same puts
     * arrive intact, and a hung or dead peer ends in the transfer timeout at the latest */
    g_err_none = true;
    test_pair();
    test_loop_driven();
    g_err_none = false;   /* the nodes' endpoint mode */
    test_threads();
    TEST_DONE();
}
