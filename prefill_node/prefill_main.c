/* prefill_main.c - the prefill_node binary: flags, start the prefill server and its gRPC
 * service, print "listening grpc HOST:PORT", run until SIGINT/SIGTERM, stop in order.
 * Owns: flag parsing and process lifetime. Not here: serving (prefill_server.c).
 * Threading: the main thread waits for a signal. */
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_http.h"
#include "pd_cli.h"
#include "pd_log.h"
#include "pd_rpc.h"
#include "pd_tls.h"
#include "prefill_metrics.h"
#include "prefill_server.h"

#define PROG "prefill_node"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: prefill_node --model DIR [--draft DIR] --listen HOST:PORT\n"
            "                    [--cp-size N --cp-strategy S] [--device cpu|cuda] [--dtype bf16|f32]\n"
            "                    [--max-batch-tokens N] [--kv-pages N | --kv-memory-fraction F] [--page-size N]\n"
            "                    [--transfer-timeout-ms N] [--aux-transfer raw|ctx|draft-kv]\n"
            "                    [--xfer-err-mode peer|none]\n"
            "                    [--log-level error|warn|info|debug|trace] [--log-format text|json]\n"
            "                    [--http HOST:PORT]\n"
            "                    [--drain-timeout-ms N] [--fast-kernels] [--prefix-cache]\n"
            "                    [--stage-memory GIB]\n"
            "                    [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]]\n"
            "                    [--tls-reload-interval SECONDS]\n"
            "\n"
            "Serves pdspark.Prefill: batches queued prompts into engine steps (context-parallel\n"
            "over --cp-size ranks; on cuda rank r on GPU r %% (visible GPUs) with its own copy of\n"
            "the target, NCCL when every rank has a GPU of its own), puts every layer's K/V pages\n"
            "and the packed aux rows into the decode node's memory over UCX, and answers with the\n"
            "first token. --draft loads the drafter, needed for any aux payload: --aux-transfer\n"
            "raw (default) ships the packed aux rows [T, K*hidden], ctx the context rows\n"
            "hidden_norm(fc(aux)) [T, hidden], draft-kv the drafter's context K/V of every draft\n"
            "layer into the decode node's draft pool; all three decode identically.\n"
            "Port 0 picks a free port, printed as\n"
            "'listening grpc HOST:PORT'.\n"
            "--xfer-err-mode none connects to decode nodes without UCX peer-failure mode, so a\n"
            "decode node on the same host is reached over shm/cma instead of tcp; a decode node\n"
            "that dies is then noticed only by --transfer-timeout-ms (default peer: at once).\n"
            "--http serves GET /health, /ready and /metrics (Prometheus text), printed as\n"
            "'listening http HOST:PORT'.\n"
            "--tls-cert FILE --tls-key FILE (PEM: the certificate chain, leaf first, and its\n"
            "unencrypted key) serve gRPC and --http over TLS only (decode nodes then need\n"
            "--tls-ca); --tls-client-ca FILE (PEM roots) requires clients (decode nodes: their\n"
            "--tls-cert) to present a certificate that chains to them (mutual TLS). The KV pages\n"
            "over UCX are not encrypted (keep that network private). The TLS files are read\n"
            "again on SIGHUP and every --tls-reload-interval seconds (default 60, 0: on SIGHUP\n"
            "only); changed files that pass the checks serve the connections made afterwards.\n"
            "--kv-memory-fraction F (0 < F < 1): the KV pools take F of the GPU memory free once\n"
            "the models are loaded (cpu: of the host's available memory), instead of --kv-pages;\n"
            "with --cp-size > 1 every rank's pool on a device together (the fullest decides).\n"
            "--stage-memory GIB (default 2; 0 = none): where UCX cannot read GPU memory the KV\n"
            "pages go to host memory before the puts; up to this much of it is pinned (taken as\n"
            "prompts need it and kept), larger stagings use plain memory.\n"
            "--dtype f32 keeps the weights and KV cache in fp32 on cuda (default bf16); the\n"
            "decode nodes must use the same.\n"
            "--fast-kernels (cuda) batches queued prompts into one forward: faster under load,\n"
            "but a prompt's bf16 KV then depends on the prompts beside it, so the tokens may\n"
            "part from a solo prefill's at near-ties (default: one prompt per forward).\n"
            "--prefix-cache keeps the full KV pages (target and drafter) of prefilled prompts and\n"
            "gives a later prompt with the same beginning those pages instead of prefilling them;\n"
            "with --aux-transfer draft-kv (or no --draft) only, not with --cp-size.\n"
            "SIGTERM drains: new Prefill calls get UNAVAILABLE and /ready 503 while queued and\n"
            "running prefills finish (at most --drain-timeout-ms, default 30000), then it exits 0.\n"
            "SIGINT stops at once.\n");
}

/* A TLS reload (pd_tls_reloader): HTTPS first (the one that can refuse), then gRPC */
typedef struct {
    pd_http *http;
} prefill_tls_target;

static pd_status apply_tls(void *ud, const pd_tls *t, pd_err *err)
{
    prefill_tls_target *tt = ud;
    pd_status st = tt->http != NULL ? pd_http_set_tls(tt->http, t, err) : PD_OK;
    return st == PD_OK ? pd_rpc_set_tls(t, err) : st;
}

/* /ready: 503 while draining */
static int ready_cb(void *ud, char *why, size_t cap)
{
    if (prefill_server_draining(ud)) {
        snprintf(why, cap, "draining: not accepting new requests");
        return 0;
    }
    return 1;
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, PROG))
        return 0;
    prefill_config cfg;
    prefill_config_default(&cfg);
    const char *listen = NULL;
    const char *http_addr = NULL, *tls_cert = NULL, *tls_key = NULL, *tls_client_ca = NULL;
    int drain_ms = 30000;
    int tls_reload_s = 60;
    int tmo = 0;
    enum { O_MODEL = 256, O_DRAFT, O_LISTEN, O_CP, O_CPS, O_DEVICE, O_MBT, O_PAGES, O_PAGE, O_XTMO,
           O_AUX, O_LOG, O_HELP, O_HTTP, O_XERR, O_DRAIN, O_DTYPE, O_FAST, O_LOGFMT,
           O_PREFIX, O_KVFRAC, O_STAGEMEM, O_TLSCERT, O_TLSKEY, O_TLSCCA, O_TLSRELOAD };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"draft", required_argument, 0, O_DRAFT},
        {"listen", required_argument, 0, O_LISTEN}, {"cp-size", required_argument, 0, O_CP},
        {"cp-strategy", required_argument, 0, O_CPS}, {"device", required_argument, 0, O_DEVICE},
        {"max-batch-tokens", required_argument, 0, O_MBT}, {"kv-pages", required_argument, 0, O_PAGES},
        {"kv-memory-fraction", required_argument, 0, O_KVFRAC},
        {"stage-memory", required_argument, 0, O_STAGEMEM},
        {"page-size", required_argument, 0, O_PAGE}, {"transfer-timeout-ms", required_argument, 0, O_XTMO},
        {"aux-transfer", required_argument, 0, O_AUX}, {"log-level", required_argument, 0, O_LOG},
        {"help", no_argument, 0, O_HELP}, {"http", required_argument, 0, O_HTTP},
        {"drain-timeout-ms", required_argument, 0, O_DRAIN}, {"dtype", required_argument, 0, O_DTYPE},
        {"xfer-err-mode", required_argument, 0, O_XERR}, {"fast-kernels", no_argument, 0, O_FAST},
        {"prefix-cache", no_argument, 0, O_PREFIX},
        {"log-format", required_argument, 0, O_LOGFMT},
        {"tls-cert", required_argument, 0, O_TLSCERT}, {"tls-key", required_argument, 0, O_TLSKEY},
        {"tls-client-ca", required_argument, 0, O_TLSCCA},
        {"tls-reload-interval", required_argument, 0, O_TLSRELOAD}, {0, 0, 0, 0},
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case O_MODEL: cfg.model_dir = optarg; break;
        case O_DRAFT: cfg.draft_dir = optarg; break;
        case O_LISTEN: listen = optarg; break;
        case O_CP: bad = pd_cli_parse_int(PROG, "--cp-size", optarg, 1, 64, &cfg.cp_size); break;
        case O_CPS: cfg.cp_strategy = optarg; break;
        case O_DEVICE: cfg.device = optarg; break;
        case O_DTYPE: bad = pd_cli_parse_dtype(PROG, optarg, &cfg.f32); break;
        case O_MBT: bad = pd_cli_parse_int(PROG, "--max-batch-tokens", optarg, 1, INT_MAX / 2, &cfg.max_batch_tokens); break;
        case O_PAGES: bad = pd_cli_parse_int(PROG, "--kv-pages", optarg, 1, INT_MAX / 2, &cfg.kv_pages); break;
        case O_KVFRAC:
            bad = pd_cli_parse_fraction(PROG, "--kv-memory-fraction", optarg, &cfg.kv_mem_fraction);
            break;
        case O_STAGEMEM: bad = pd_cli_parse_gib(PROG, "--stage-memory", optarg, &cfg.stage_bytes); break;
        case O_PAGE: bad = pd_cli_parse_int(PROG, "--page-size", optarg, 1, 4096, &cfg.page_size); break;
        case O_XTMO: bad = pd_cli_parse_int(PROG, "--transfer-timeout-ms", optarg, 1, INT32_MAX, &tmo); cfg.transfer_timeout_ms = tmo; break;
        case O_AUX: cfg.aux_transfer = optarg; break;
        case O_FAST: cfg.fast_kernels = 1; break;
        case O_PREFIX: cfg.prefix_cache = 1; break;
        case O_XERR:
            if (strcmp(optarg, "peer") != 0 && strcmp(optarg, "none") != 0) {
                fprintf(stderr, PROG ": --xfer-err-mode: expected peer or none, got '%s'\n", optarg);
                return 2;
            }
            cfg.xfer_err_mode_none = strcmp(optarg, "none") == 0;
            break;
        case O_LOG: {
            int lvl = pd_log_level_parse(optarg);
            if (lvl < 0) {
                fprintf(stderr, PROG ": --log-level: unknown level '%s'\n", optarg);
                return 2;
            }
            pd_log_set_level((pd_log_level)lvl);
            break;
        }
        case O_HTTP: http_addr = optarg; break;
        case O_TLSCERT: tls_cert = optarg; break;
        case O_TLSKEY: tls_key = optarg; break;
        case O_TLSCCA: tls_client_ca = optarg; break;
        case O_TLSRELOAD:
            bad = pd_cli_parse_int(PROG, "--tls-reload-interval", optarg, 0, 86400 * 365, &tls_reload_s);
            break;
        case O_LOGFMT:
            if (pd_cli_parse_log_format(PROG, optarg) != 0)
                return 2;
            break;
        case O_DRAIN: bad = pd_cli_parse_int(PROG, "--drain-timeout-ms", optarg, 0, INT32_MAX, &drain_ms); break;
        case O_HELP: usage(stdout); return 0;
        default:
            return pd_cli_bad_flag(PROG, argv[optind - 1]);
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, PROG ": unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (cfg.kv_pages > 0 && cfg.kv_mem_fraction > 0.0) {
        fprintf(stderr, PROG ": give --kv-pages N or --kv-memory-fraction F, not both\n");
        return 2;
    }
    if (cfg.model_dir == NULL || listen == NULL) {
        fprintf(stderr, PROG ": --model DIR and --listen HOST:PORT are required\n");
        return 2;
    }
    sigset_t set;
    pd_cli_block_stop_signals(&set);
    long nofile = pd_cli_raise_fd_limit();
    if (nofile >= 0)
        PD_LOG_DEBUG("prefill", "descriptor limit %ld", nofile);

    pd_err err = {0};
    pd_tls tls;
    if (pd_tls_load(tls_cert, tls_key, NULL, tls_client_ca, &tls, &err) != PD_OK || pd_rpc_set_tls(&tls, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        pd_tls_free(&tls);
        return 1;
    }
    prefill_server *ps = NULL;
    pd_rpc_server *rpc = NULL;
    pd_metrics *reg = NULL;
    prefill_metrics *pm = NULL;
    pd_http *http = NULL;
    if (pd_metrics_create(&reg, &err) != PD_OK || prefill_metrics_create(reg, &pm, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 1;
    }
    cfg.observer = prefill_metrics_observer(pm);
    if (prefill_server_create(&cfg, &ps, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 1;
    }
    if (prefill_server_listen(ps, listen, &rpc, &err) != PD_OK) {
        fprintf(stderr, PROG ": --listen %s: %s\n", listen, err.msg);
        prefill_server_destroy(ps);
        return 1;
    }
    char host[128];
    snprintf(host, sizeof(host), "%s", listen);
    char *colon = strrchr(host, ':');
    if (colon != NULL)
        *colon = '\0';
    printf("listening grpc %s:%d\n", host, pd_rpc_server_port(rpc));
    fflush(stdout);
    prefill_metrics_attach(pm, ps);
    if (http_addr != NULL) {
        /* ready = the model is loaded and the service listens, which holds from here on */
        pd_http_config hc = { .addr = http_addr, .node = "prefill", .metrics = reg,
                              .ready = ready_cb, .ready_ud = ps, .tls = &tls };
        if (pd_http_create(&hc, &http, &err) != PD_OK || pd_http_start(http, &err) != PD_OK) {
            fprintf(stderr, PROG ": --http %s: %s\n", http_addr, err.msg);
            pd_http_destroy(http);
            prefill_metrics_attach(pm, NULL);
            pd_rpc_server_destroy(rpc);
            prefill_server_destroy(ps);
            return 1;
        }
        snprintf(host, sizeof(host), "%s", http_addr);
        colon = strrchr(host, ':');
        if (colon != NULL)
            *colon = '\0';
        printf("listening http %s:%d\n", host, pd_http_port(http));
        fflush(stdout);
    }
    prefill_tls_target tt = { http };
    pd_tls_reloader tr;
    pd_tls_reloader_init(&tr, "prefill", &tls, reg, apply_tls, &tt);
    int sig = pd_cli_wait_stop(&set, (int64_t)tls_reload_s * 1000, pd_tls_reloader_tick, &tr);
    if (sig == SIGTERM) {
        /* Kubernetes sends SIGTERM before killing: refuse new work, let the rest finish */
        PD_LOG_INFO("prefill", "SIGTERM: draining (at most %d ms)", drain_ms);
        prefill_server_drain(ps);
        struct timespec t0, now;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (;;) {
            prefill_stats stt;
            prefill_server_stats(ps, &stt);
            if (stt.active_requests == 0 && stt.queued_requests == 0)
                break;
            clock_gettime(CLOCK_MONOTONIC, &now);
            double ms = (now.tv_sec - t0.tv_sec) * 1e3 + (now.tv_nsec - t0.tv_nsec) / 1e6;
            if (ms > drain_ms) {
                PD_LOG_WARN("prefill", "drain timeout: %d running, %d queued are cancelled",
                            stt.active_requests, stt.queued_requests);
                break;
            }
            struct timespec nap = { 0, 20 * 1000 * 1000 };
            nanosleep(&nap, NULL);
        }
    }
    PD_LOG_INFO("prefill", "signal %d: stopping", sig);
    pd_http_stop(http);
    prefill_metrics_attach(pm, NULL);
    pd_rpc_server_destroy(rpc);
    prefill_server_destroy(ps);
    pd_http_destroy(http);
    prefill_metrics_destroy(pm);
    pd_metrics_destroy(reg);
    pd_tls_free(&tls);
    return 0;
}
