/* decode_main.c - the decode_node binary: flags, start the decode server and its gRPC service,
 * print "listening grpc HOST:PORT", run until SIGINT/SIGTERM, stop in order.
 * Owns: flag parsing and process lifetime.
 * Not here: serving (decode_server.c, decode_grpc.c).
 * Threading: the main thread waits for a signal; everything else runs on the server's threads. */
#include <getopt.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode_api.h"
#include "decode_grpc.h"
#include "decode_util.h"
#include "pd_log.h"

#define PROG "decode_node"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: decode_node --model DIR --draft DIR --listen HOST:PORT\n"
            "                   (--prefill HOST:PORT[,HOST:PORT...] | --colocated)\n"
            "                   [--device cpu|cuda] [--kv-pages N] [--page-size N] [--max-batch N]\n"
            "                   [--max-queue N] [--queue-timeout-ms N] [--request-timeout-ms N]\n"
            "                   [--transfer-timeout-ms N] [--cp-size N --cp-strategy S]\n"
            "                   [--log-level error|warn|info|debug|trace]\n"
            "\n"
            "Serves pdspark.Generate (gRPC, server-streaming) with DSpark speculative decoding.\n"
            "--colocated runs the prefill in this process (--cp-size/--cp-strategy apply there);\n"
            "otherwise prompts are prefilled by the least-loaded --prefill node (a name that\n"
            "resolves to several addresses is several nodes) and their KV pages arrive over UCX.\n"
            "Port 0 picks a free port; the address is printed as 'listening grpc HOST:PORT'.\n");
}

int main(int argc, char **argv)
{
    decode_config cfg;
    decode_config_default(&cfg);
    const char *listen = NULL;
    int colocated = 0;
    enum { O_MODEL = 256, O_DRAFT, O_LISTEN, O_PREFILL, O_COLO, O_DEVICE, O_PAGES, O_PAGE, O_BATCH,
           O_QUEUE, O_QTMO, O_RTMO, O_XTMO, O_CP, O_CPS, O_LOG, O_HELP };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"draft", required_argument, 0, O_DRAFT},
        {"listen", required_argument, 0, O_LISTEN}, {"prefill", required_argument, 0, O_PREFILL},
        {"colocated", no_argument, 0, O_COLO}, {"device", required_argument, 0, O_DEVICE},
        {"kv-pages", required_argument, 0, O_PAGES}, {"page-size", required_argument, 0, O_PAGE},
        {"max-batch", required_argument, 0, O_BATCH}, {"max-queue", required_argument, 0, O_QUEUE},
        {"queue-timeout-ms", required_argument, 0, O_QTMO},
        {"request-timeout-ms", required_argument, 0, O_RTMO},
        {"transfer-timeout-ms", required_argument, 0, O_XTMO},
        {"cp-size", required_argument, 0, O_CP}, {"cp-strategy", required_argument, 0, O_CPS},
        {"log-level", required_argument, 0, O_LOG}, {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0},
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int bad = 0;
        int64_t v = 0;
        switch (c) {
        case O_MODEL: cfg.model_dir = optarg; break;
        case O_DRAFT: cfg.draft_dir = optarg; break;
        case O_LISTEN: listen = optarg; break;
        case O_PREFILL: cfg.prefill = optarg; break;
        case O_COLO: colocated = 1; break;
        case O_DEVICE: cfg.device = optarg; break;
        case O_PAGES: bad = decode_parse_int(PROG, "--kv-pages", optarg, 1, INT_MAX / 2, &cfg.kv_pages); break;
        case O_PAGE: bad = decode_parse_int(PROG, "--page-size", optarg, 1, 4096, &cfg.page_size); break;
        case O_BATCH: bad = decode_parse_int(PROG, "--max-batch", optarg, 1, 65536, &cfg.max_batch); break;
        case O_QUEUE: bad = decode_parse_int(PROG, "--max-queue", optarg, 1, 1 << 20, &cfg.max_queue); break;
        case O_QTMO: bad = decode_parse_i64(PROG, "--queue-timeout-ms", optarg, 1, INT32_MAX, &v); cfg.queue_timeout_ms = v; break;
        case O_RTMO: bad = decode_parse_i64(PROG, "--request-timeout-ms", optarg, 0, INT32_MAX, &v); cfg.request_timeout_ms = v; break;
        case O_XTMO: bad = decode_parse_i64(PROG, "--transfer-timeout-ms", optarg, 1, INT32_MAX, &v); cfg.transfer_timeout_ms = v; break;
        case O_CP: bad = decode_parse_int(PROG, "--cp-size", optarg, 1, 64, &cfg.cp_size); break;
        case O_CPS: cfg.cp_strategy = optarg; break;
        case O_LOG: {
            int lvl = pd_log_level_parse(optarg);
            if (lvl < 0) {
                fprintf(stderr, PROG ": --log-level: unknown level '%s'\n", optarg);
                return 2;
            }
            pd_log_set_level((pd_log_level)lvl);
            break;
        }
        case O_HELP: usage(stdout); return 0;
        default:
            fprintf(stderr, PROG ": unknown or incomplete flag '%s'\n", argv[optind - 1]);
            usage(stderr);
            return 2;
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, PROG ": unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (cfg.model_dir == NULL || cfg.draft_dir == NULL || listen == NULL) {
        fprintf(stderr, PROG ": --model DIR, --draft DIR and --listen HOST:PORT are required\n");
        return 2;
    }
    if (colocated == (cfg.prefill != NULL)) {
        fprintf(stderr, PROG ": give exactly one of --prefill HOST:PORT[,...] or --colocated\n");
        return 2;
    }
    if (!colocated && (cfg.cp_size > 1 || cfg.cp_strategy != NULL)) {
        fprintf(stderr, PROG ": --cp-size/--cp-strategy apply to --colocated only (prefill nodes "
                        "take their own)\n");
        return 2;
    }
    cfg.colocated = colocated;

    /* block the stop signals in every thread; the main thread waits for them */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    pd_err err = {0};
    decode_server *s = NULL;
    pd_rpc_server *rpc = NULL;
    if (decode_server_create(&cfg, &s, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 1;
    }
    if (decode_grpc_start(s, listen, &rpc, &err) != PD_OK) {
        fprintf(stderr, PROG ": --listen %s: %s\n", listen, err.msg);
        decode_server_destroy(s);
        return 1;
    }
    char host[128], port[16];
    if (decode_split_hostport(listen, host, sizeof(host), port, sizeof(port)) != 0)
        snprintf(host, sizeof(host), "%s", "0.0.0.0");
    int is_v6 = strchr(host, ':') != NULL;
    printf("listening grpc %s%s%s:%d\n", is_v6 ? "[" : "", host, is_v6 ? "]" : "",
           pd_rpc_server_port(rpc));
    fflush(stdout);
    PD_LOG_INFO("decode", "listening grpc %s port %d (%s)", host, pd_rpc_server_port(rpc),
                decode_server_mode(s));
    int sig = 0;
    sigwait(&set, &sig);
    PD_LOG_INFO("decode", "signal %d: stopping", sig);
    pd_rpc_server_destroy(rpc);
    decode_server_destroy(s);
    return 0;
}
