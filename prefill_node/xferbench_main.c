/* xferbench_main.c - pdspark-xferbench: KV page transfer bandwidth through pd_xfer (the path
 *   prefill_node uses to put pages into a decode node) against ucx_perftest ucp_put_bw on the
 *   same transports, in the same run.
 * Owns: a forked target process (registers a pool, publishes worker address + rkey over a pipe,
 *   progresses until told to stop), the initiator loop (one span per page, scattered page ids as
 *   a real request has, windowed puts + flush per transfer), and running ucx_perftest.
 * Not here: pd_xfer itself (common/pd_xfer.c).
 * Threading: single-threaded per process. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pd_cli.h"
#include "pd_xfer.h"

#define PROG "pdspark-xferbench"

static int g_busy;   /* progress by polling instead of sleeping on the worker fd */
static int g_ucx_alloc;   /* the target's region comes from pd_xfer_mem_alloc */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    char *c = p;
    while (n > 0) {
        ssize_t r = read(fd, c, n);
        if (r <= 0)
            return -1;
        c += r;
        n -= (size_t)r;
    }
    return 0;
}

static int send_blob(int fd, const void *p, size_t n)
{
    uint64_t len = n;
    return write_all(fd, &len, sizeof(len)) || write_all(fd, p, n) ? -1 : 0;
}

static void *recv_blob(int fd, size_t *n)
{
    uint64_t len;
    if (read_all(fd, &len, sizeof(len)) != 0 || len > (1u << 20))
        return NULL;
    void *p = malloc(len ? len : 1);
    if (p != NULL && read_all(fd, p, len) != 0) {
        free(p);
        return NULL;
    }
    *n = len;
    return p;
}

/* Target: register the pool, publish, progress until the parent closes its pipe. */
static int run_target(const pd_xfer_config *xc, size_t bytes, int wfd, int rfd)
{
    pd_err err = {0};
    pd_xfer *x = NULL;
    pd_xfer_mem *m = NULL;
    void *pool = g_ucx_alloc ? NULL : calloc(1, bytes), *rkey = NULL;
    size_t rkey_len = 0;
    if ((!g_ucx_alloc && pool == NULL) || pd_xfer_create(xc, &x, &err) != PD_OK ||
        (g_ucx_alloc ? pd_xfer_mem_alloc(x, bytes, &m, &err)
                     : pd_xfer_mem_register(x, pool, bytes, &m, &err)) != PD_OK ||
        pd_xfer_mem_pack(m, &rkey, &rkey_len, &err) != PD_OK) {
        fprintf(stderr, PROG " target: %s\n", err.msg);
        return 1;
    }
    const void *addr;
    size_t addr_len;
    pd_xfer_address(x, &addr, &addr_len);
    uint64_t base = (uint64_t)(uintptr_t)pd_xfer_mem_base(m);
    if (send_blob(wfd, addr, addr_len) != 0 || send_blob(wfd, rkey, rkey_len) != 0 ||
        write_all(wfd, &base, sizeof(base)) != 0)
        return 1;
    for (;;) {
        if (g_busy)
            pd_xfer_progress(x);
        else
            pd_xfer_wait(x, 20);
        struct pollfd p = { .fd = rfd, .events = POLLIN };
        if (poll(&p, 1, 0) > 0)
            break;   /* EOF or a byte: done */
    }
    free(rkey);
    pd_xfer_mem_deregister(m);
    pd_xfer_destroy(x);
    free(pool);
    return 0;
}

typedef struct {
    int done;
    pd_status st;
} done_flag;

static void on_done(void *ud, pd_status st, const pd_err *err)
{
    (void)err;
    done_flag *d = ud;
    d->done = 1;
    d->st = st;
}

/* ucx_perftest ucp_put_bw with the same message size; returns MB/s (10^6... as it prints:
 * MiB-based "MB/s") or -1. */
static double run_perftest(const char *tls, size_t msg, long iters, int port)
{
    char sn[32], it[32], pt[32];
    snprintf(sn, sizeof(sn), "%zu", msg);
    snprintf(it, sizeof(it), "%ld", iters);
    snprintf(pt, sizeof(pt), "%d", port);
    setenv("UCX_TLS", tls, 1);
    pid_t srv = fork();
    if (srv == 0) {
        int devnull = open("/dev/null", 1);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execlp("ucx_perftest", "ucx_perftest", "-t", "ucp_put_bw", "-s", sn, "-n", it, "-p", pt,
               (char *)NULL);
        _exit(127);
    }
    usleep(500000);
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "ucx_perftest 127.0.0.1 -t ucp_put_bw -s %s -n %s -p %s 2>/dev/null",
             sn, it, pt);
    FILE *f = popen(cmd, "r");
    double mbs = -1;
    char line[512];
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        double a, b, c, d, bw_avg, bw_all;
        long n;
        if (sscanf(line, "Final: %ld %lf %lf %lf %lf %lf", &n, &a, &b, &c, &bw_avg, &bw_all) == 6)
            mbs = bw_all;
        (void)d;
    }
    if (f != NULL)
        pclose(f);
    int status;
    for (int i = 0; i < 100 && waitpid(srv, &status, WNOHANG) == 0; i++)
        usleep(50000);
    if (waitpid(srv, &status, WNOHANG) == 0) {
        kill(srv, SIGKILL);
        waitpid(srv, &status, 0);
    }
    return mbs;
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, PROG))
        return 0;
    size_t page_bytes = 8192;
    long n_pages = 4096, iters = 20;
    unsigned window = 64;
    const char *tls = getenv("UCX_TLS") != NULL ? getenv("UCX_TLS") : "tcp,shm,self";
    int json = 0, perftest = 1, err_none = 0, same_page = 0;
    static const struct option opts[] = {
        {"page-bytes", required_argument, 0, 'b'}, {"pages", required_argument, 0, 'p'},
        {"iters", required_argument, 0, 'i'}, {"window", required_argument, 0, 'w'},
        {"tls", required_argument, 0, 't'}, {"json", no_argument, 0, 'j'},
        {"no-perftest", no_argument, 0, 'n'}, {"busy", no_argument, 0, 'B'},
        {"err-mode", required_argument, 0, 'e'}, {"same-page", no_argument, 0, 'S'},
        {"ucx-alloc", no_argument, 0, 'U'},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'b': page_bytes = (size_t)strtoul(optarg, NULL, 10); break;
        case 'p': n_pages = strtol(optarg, NULL, 10); break;
        case 'i': iters = strtol(optarg, NULL, 10); break;
        case 'w': window = (unsigned)strtoul(optarg, NULL, 10); break;
        case 't': tls = optarg; break;
        case 'j': json = 1; break;
        case 'n': perftest = 0; break;
        case 'B': g_busy = 1; break;
        case 'S': same_page = 1; break;
        case 'U': g_ucx_alloc = 1; break;
        case 'e':
            if (strcmp(optarg, "peer") != 0 && strcmp(optarg, "none") != 0) {
                fprintf(stderr, PROG ": --err-mode: expected peer or none, got '%s'\n", optarg);
                return 2;
            }
            err_none = strcmp(optarg, "none") == 0;
            break;
        case 'h':
            printf("usage: " PROG " [--page-bytes N] [--pages N] [--iters N] [--window N]\n"
                   "                         [--tls LIST] [--busy] [--err-mode peer|none]\n"
                   "                         [--same-page] [--ucx-alloc] [--no-perftest] [--json]\n"
                   "Puts --pages scattered pages of --page-bytes (one span each, as prefill_node\n"
                   "does) through pd_xfer into a forked target, --iters times (flush per\n"
                   "transfer), and runs ucx_perftest ucp_put_bw with the same message size.\n"
                   "--busy progresses both sides by polling, as ucx_perftest does (the nodes\n"
                   "sleep on the worker fd in their event loops). --err-mode none connects\n"
                   "without UCX peer-failure mode (pd_xfer_config.err_mode_none), so shm/cma\n"
                   "can carry the puts (as in ucx_perftest); peer (default) is the nodes' mode.\n"
                   "--same-page puts every span from one source page to one destination page,\n"
                   "as ucx_perftest reuses one message buffer (cache-resident), instead of\n"
                   "--pages distinct pages (the real footprint). --ucx-alloc: the target's region\n"
                   "is allocated by UCX (pd_xfer_mem_alloc, as ucx_perftest allocates), not\n"
                   "malloc'd and registered (as the nodes' pools are).\n");
            return 0;
        default:
            return pd_cli_bad_flag(PROG, argv[optind - 1]);
        }
    }
    if (page_bytes == 0 || n_pages <= 0 || iters <= 0 || window == 0) {
        fprintf(stderr, PROG ": sizes must be positive\n");
        return 2;
    }
    setenv("UCX_TLS", tls, 1);
    pd_xfer_config xc;
    pd_xfer_config_default(&xc);
    xc.name = "bench";
    xc.max_inflight = window;
    xc.timeout_ms = 120000;
    xc.err_mode_none = err_none != 0;
    size_t bytes = page_bytes * (size_t)n_pages;
    int c2p[2], p2c[2];
    if (pipe(c2p) != 0 || pipe(p2c) != 0)
        return 1;
    pid_t pid = fork();
    if (pid == 0) {
        close(c2p[0]);
        close(p2c[1]);
        _exit(run_target(&xc, bytes, c2p[1], p2c[0]));
    }
    close(c2p[1]);
    close(p2c[0]);
    size_t addr_len = 0, rkey_len = 0;
    void *addr = recv_blob(c2p[0], &addr_len);
    void *rkey = recv_blob(c2p[0], &rkey_len);
    uint64_t base = 0;
    if (addr == NULL || rkey == NULL || read_all(c2p[0], &base, sizeof(base)) != 0) {
        fprintf(stderr, PROG ": target did not start\n");
        return 1;
    }
    pd_err err = {0};
    pd_xfer *x = NULL;
    pd_xfer_peer *peer = NULL;
    pd_xfer_rkey *rk = NULL;
    pd_xfer_mem *lm = NULL;
    char *src = malloc(bytes);
    pd_xfer_span *sp = malloc((size_t)n_pages * sizeof(*sp));
    if (src == NULL || sp == NULL || pd_xfer_create(&xc, &x, &err) != PD_OK ||
        pd_xfer_peer_create(x, addr, addr_len, &peer, &err) != PD_OK ||
        pd_xfer_rkey_unpack(peer, rkey, rkey_len, base, bytes, &rk, &err) != PD_OK ||
        pd_xfer_mem_register(x, src, bytes, &lm, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 1;
    }
    memset(src, 0x5a, bytes);
    /* scattered destination pages (a stride coprime with the count), as pool pages are */
    long stride = 7;
    while (n_pages % stride == 0)
        stride += 2;
    for (long i = 0; i < n_pages; i++)
        sp[i] = same_page ? (pd_xfer_span){ .src = src, .raddr = base, .len = page_bytes }
                          : (pd_xfer_span){ .src = src + (size_t)i * page_bytes,
                                            .raddr = base + (uint64_t)((i * stride) % n_pages) * page_bytes,
                                            .len = page_bytes };
    double best = 0, total_t = 0;
    for (long it = -1; it < iters; it++) {   /* it = -1: warm-up */
        done_flag d = {0};
        double t0 = now_s();
        if (pd_xfer_put(rk, lm, sp, (size_t)n_pages, on_done, &d, NULL, &err) != PD_OK) {
            fprintf(stderr, PROG ": put: %s\n", err.msg);
            return 1;
        }
        while (!d.done) {
            if (g_busy)
                pd_xfer_progress(x);
            else
                pd_xfer_wait(x, 10);
        }
        double dt = now_s() - t0;
        if (d.st != PD_OK) {
            fprintf(stderr, PROG ": transfer failed: %s\n", pd_status_str(d.st));
            return 1;
        }
        if (it >= 0) {
            total_t += dt;
            if (best == 0 || dt < best)
                best = dt;
        }
    }
    double mbs = (double)bytes * (double)iters / total_t / (1024.0 * 1024.0);
    pd_xfer_mem_deregister(lm);
    pd_xfer_peer_destroy(peer);
    pd_xfer_destroy(x);
    close(p2c[1]);
    int status;
    waitpid(pid, &status, 0);
    double ref = perftest ? run_perftest(tls, page_bytes, (long)n_pages * iters, 13000 + (int)(getpid() % 2000)) : -1;
    if (json) {
        printf("{\"busy\":%s,\"ucx_alloc\":%s,\"same_page\":%s,\"err_mode\":\"%s\",\"tls\":\"%s\",\"page_bytes\":%zu,\"pages\":%ld,\"iters\":%ld,\"window\":%u,"
               "\"pd_xfer_MBps\":%.1f,\"ucx_perftest_MBps\":%.1f,\"ratio\":%.3f}\n",
               g_busy ? "true" : "false", g_ucx_alloc ? "true" : "false", same_page ? "true" : "false", err_none ? "none" : "peer", tls, page_bytes, n_pages, iters, window, mbs, ref,
               ref > 0 ? mbs / ref : 0.0);
    } else {
        printf("transports %s, %ld pages of %zu bytes per transfer, %ld transfers, window %u%s, "
               "endpoint error mode %s\n", tls, n_pages, page_bytes, iters, window,
               g_busy ? ", busy progress" : "", err_none ? "none" : "peer");
        printf("pd_xfer put (scattered pages, flush per transfer): %.1f MB/s (best transfer %.2f ms)\n",
               mbs, best * 1e3);
        if (ref > 0)
            printf("ucx_perftest ucp_put_bw (%zu-byte messages):      %.1f MB/s -> ratio %.3f\n",
                   page_bytes, ref, mbs / ref);
        else if (perftest)
            printf("ucx_perftest: not run or no result\n");
    }
    free(src);
    free(sp);
    free(addr);
    free(rkey);
    return 0;
}
