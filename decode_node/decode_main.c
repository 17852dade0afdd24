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
#include <time.h>

#include "decode_api.h"
#include "decode_grpc.h"
#include "decode_http.h"
#include "decode_metrics.h"
#include "pd_cli.h"
#include "pd_graph.h"
#include "pd_log.h"
#include "pd_rpc.h"
#include "pd_tls.h"
#include "pd_tp.h"

#define PROG "decode_node"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: decode_node --model DIR (--draft DIR | --no-draft) --listen HOST:PORT\n"
            "                   (--prefill HOST:PORT[,HOST:PORT...]|file:PATH [--prefill-refresh-ms N]\n"
            "                    | --colocated)\n"
            "                   [--device cpu|cuda] [--dtype bf16|f32] [--kv-pages N | --kv-memory-fraction F]\n"
            "                   [--page-size N] [--max-batch N] [--swap-space GIB] [--kv-staging-pages N]\n"
            "                   [--max-queue N] [--queue-timeout-ms N] [--request-timeout-ms N]\n"
            "                   [--transfer-timeout-ms N] [--cp-size N --cp-strategy S] [--tp N]\n"
            "                   [--log-level error|warn|info|debug|trace]\n"
            "                   [--http HOST:PORT] [--log-format text|json] [--drain-timeout-ms N]\n"
            "                   [--verify full|threshold|scheduled] [--threshold T] [--fast-kernels]\n"
            "                   [--speculative-disable-by-batch-size N]\n"
            "                   [--graphs auto|off|pad] [--chunked-prefill-size N]\n"
            "                   [--reasoning-parser qwen3] [--served-model-name NAME] [--api-key KEY]\n"
            "                   [--chat-template FILE|TEXT] [--jinja] [--max-local-prefill N] [--responses-store-mb N]\n"
            "                   [--vllm-metrics]\n"
            "                   [--generation-config auto|none|DIR]\n"
            "                   [--tls-cert FILE --tls-key FILE [--tls-client-ca FILE]] [--tls-ca FILE]\n"
            "                   [--tls-reload-interval SECONDS]\n"
            "\n"
            "Serves pdspark.Generate (gRPC, server-streaming) with DSpark speculative decoding.\n"
            "--no-draft loads no drafter and decodes the target alone, one token a step (what a\n"
            "server without speculative decoding does; every reply's tau is 1); behind prefill\n"
            "nodes it asks them for the KV pages only (no drafter payload: they need no --draft).\n"
            "--colocated runs the prefill in this process (--cp-size/--cp-strategy apply there; on\n"
            "cuda CP rank r runs on GPU r %% (visible GPUs) with its own copy of the target);\n"
            "--tp N (with --colocated) decodes tensor-parallel over N ranks (cpu: threads, cuda:\n"
            "one GPU per rank with NCCL);\n"
            "otherwise prompts are prefilled by the least-loaded --prefill node (a name that\n"
            "resolves to several addresses is several nodes) and their KV pages arrive over UCX.\n"
            "--prefill file:PATH reads the HOST:PORT entries from a file (one or more per line,\n"
            "# comments). Names and the file are resolved again every --prefill-refresh-ms\n"
            "(default 10000; 0 = at start only): new addresses become nodes, vanished ones are no\n"
            "longer picked, and until some address exists /ready says 503 and requests fail\n"
            "UNAVAILABLE.\n"
            "Port 0 picks a free port; the address is printed as 'listening grpc HOST:PORT'.\n"
            "--http serves the OpenAI-compatible API (/v1/completions, /v1/chat/completions,\n"
            "/v1/models) and /health, /ready, /metrics; printed as 'listening http HOST:PORT'.\n"
            "Chat requests with 'tools' get the tools in the prompt as Qwen's templates write them\n"
            "and <tool_call> blocks back as tool_calls; --reasoning-parser qwen3 returns the\n"
            "<think> text of a chat reply as reasoning_content instead of content (gRPC: as\n"
            "GenerateChunk.reasoning_delta instead of text_delta).\n"
            "--generation-config auto (default) takes the temperature, top_p, top_k, min_p,\n"
            "typical_p, repetition_penalty and max_new_tokens of the model's\n"
            "generation_config.json as the defaults of HTTP requests that leave them out, as vLLM\n"
            "does, and of gRPC requests with SamplingParams.model_defaults that leave them 0; none\n"
            "keeps OpenAI's (temperature 1); DIR reads DIR/generation_config.json.\n"
            "--chat-template FILE (or the template text itself) replaces the checkpoint's chat\n"
            "template. ChatML-shaped templates are rendered as Qwen's are; any other is rendered\n"
            "by the server's Jinja2 subset (one that does not parse stops the node at start);\n"
            "--jinja renders ChatML-shaped templates with it too (the template followed exactly\n"
            "instead of the built-in rules of Qwen's ChatML).\n"
            "--responses-store-mb N (default 64; 0: none) keeps completed /v1/responses replies and\n"
            "their conversations in this node's memory (oldest dropped first past N MiB) for\n"
            "previous_response_id and GET/DELETE /v1/responses/{id}; lost on restart, not shared\n"
            "between replicas (route a conversation to one node).\n"
            "--vllm-metrics also exports vLLM's names of the series load balancers and dashboards\n"
            "read (vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,\n"
            "token counters, TTFT and latency histograms; label model_name), as the Kubernetes\n"
            "Gateway API inference extension scrapes them.\n"
            "--served-model-name sets the model id of /v1/models and the replies (default: the\n"
            "--model directory's name); a request naming another model gets 404.\n"
            "--api-key KEY (or the PDSPARK_API_KEY environment variable, which keeps it out of\n"
            "the process list) makes /v1/* and /tokenize, /detokenize require 'Authorization:\n"
            "Bearer KEY' (401 otherwise); /health, /ready and /metrics stay open.\n"
            "SIGTERM drains: new requests are refused (HTTP 503, /ready 503), running ones\n"
            "finish for up to --drain-timeout-ms (default 30000), then the node exits 0.\n"
            "--log-format json writes every log line (and the per-request line) as JSON.\n"
            "--tls-cert FILE --tls-key FILE (PEM: the certificate chain, leaf first, and its\n"
            "unencrypted key) serve gRPC (--listen) and HTTP (--http) over TLS only; --tls-ca FILE\n"
            "(PEM roots) makes this node's gRPC calls to --prefill nodes TLS, their certificates\n"
            "verified against it and the host named in --prefill (presenting --tls-cert to prefill\n"
            "nodes that ask for client certificates). --tls-client-ca FILE (PEM roots) requires\n"
            "gRPC and HTTP clients to present a certificate that chains to them (mutual TLS).\n"
            "The KV pages over UCX are not encrypted (keep that network private). The TLS files\n"
            "are read again on SIGHUP and every --tls-reload-interval seconds (default 60, 0: on\n"
            "SIGHUP only); changed files that pass the checks serve the connections made\n"
            "afterwards, and calls to prefill nodes present them from their next idle moment.\n"
            "--speculative-disable-by-batch-size N (default 0 = never): decode rounds of more than N\n"
            "running requests draft nothing (plain decode steps; vLLM's disable_by_batch_size),\n"
            "where drafting costs more than it gains (docs/BENCHMARKS.md: from ~32 requests on an\n"
            "H100 with the default kernels); --verify scheduled decides this per round instead.\n"
            "--kv-memory-fraction F (0 < F < 1): the KV pools (target and draft) take F of the\n"
            "GPU memory free once the models are loaded (cpu: of the host's available memory),\n"
            "instead of --kv-pages (default: two contexts + 64 pages); with --cp-size or --tp > 1\n"
            "every rank's pools on a device together (the fullest device decides).\n"
            "--kv-staging-pages N (disaggregated, cuda without UCX CUDA support): prefill nodes put\n"
            "a prompt's KV into N pages of host memory (the pool's page layout, target and draft),\n"
            "held from the Prefill call until its reply and then uploaded into the pool; requests\n"
            "wait for free staging pages. At least the longest admissible prompt's pages (the\n"
            "node refuses less at start); default: the aux arena's rows in pages plus --max-batch,\n"
            "at most the pool (as many as the prompts in prefill at once can use); pinned host\n"
            "memory on cuda. Logged at start.\n"
            "--swap-space GIB (default 4; 0 = off): host memory for preempted requests' KV. A\n"
            "request gets KV pages for its prompt at admission and more as it generates; when the\n"
            "pool runs out, the request admitted last is preempted (its KV copied to host memory\n"
            "bit for bit, as vLLM's swap) and resumes before new requests are admitted, with the\n"
            "output it would have had; when the swap space is full its KV is recomputed instead.\n"
            "With 0 every request reserves its prompt + max_tokens at admission. A request\n"
            "without max_tokens may generate to the end of the context. On cuda the swap space\n"
            "is pinned host memory: 256 MiB taken at start, more in chunks of up to 256 MiB as\n"
            "preemptions need it, kept (the page copies then read and write it in place).\n"
            "--dtype f32 keeps the weights and KV cache in fp32 on cuda (default bf16); prefill\n"
            "nodes must use the same (a KV layout that differs is refused by name).\n"
            "--chunked-prefill-size N (prompts prefilled here): prompt tokens per engine step (default\n"
            "2048); a longer prompt is prefilled in chunks with a decode round after each, so the\n"
            "running requests keep streaming (prefill nodes: --max-batch-tokens).\n"
            "--prefix-cache: keep the full KV pages of finished prompts and let a later\n"
            "prompt that starts with the same tokens skip prefilling them (usage reports\n"
            "prompt_tokens_details.cached_tokens); pages only the cache holds count as free and go\n"
            "back when a request needs them. Not with --cp-size / --tp > 1. Disaggregated, the\n"
            "pages prefill nodes send are kept, and a prompt whose every full page is cached (the\n"
            "later choices of an n request, which wait for the first one's pages; a repeated\n"
            "prompt) is prefilled here (at most a page) instead of on a prefill node.\n"
            "--max-local-prefill N (disaggregated): a prompt whose part the prefix cache does not\n"
            "hold (all of it without --prefix-cache) is at most N tokens is prefilled here instead\n"
            "of on a prefill node (a conversation's next turn, short prompts); default: the page\n"
            "size with --prefix-cache, else 0 (never).\n");
}

/* A TLS reload (pd_tls_reloader): HTTPS first (the one that can refuse), then gRPC, whose
 * prefill channels are made again once idle */
typedef struct {
    decode_http *http;
} decode_tls_target;

static pd_status apply_tls(void *ud, const pd_tls *t, pd_err *err)
{
    decode_tls_target *tt = ud;
    pd_status st = tt->http != NULL ? decode_http_set_tls(tt->http, t, err) : PD_OK;
    return st == PD_OK ? pd_rpc_set_tls(t, err) : st;
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, PROG))
        return 0;
    decode_config cfg;
    decode_config_default(&cfg);
    const char *listen = NULL;
    int colocated = 0, refresh_given = 0, no_draft = 0;
    const char *http_addr = NULL, *tls_cert = NULL, *tls_key = NULL, *tls_ca = NULL, *tls_client_ca = NULL;
    int reasoning = 0;
    const char *served_name = NULL, *chat_template = NULL, *generation_config = NULL;
    const char *api_key = getenv("PDSPARK_API_KEY");
    int64_t drain_ms = 30000;
    int tls_reload_s = 60;
    int store_mb = 64, vllm_metrics = 0, jinja = 0;
    enum { O_MODEL = 256, O_DRAFT, O_LISTEN, O_PREFILL, O_COLO, O_DEVICE, O_PAGES, O_PAGE, O_BATCH,
           O_QUEUE, O_QTMO, O_RTMO, O_XTMO, O_CP, O_CPS, O_LOG, O_HELP, O_HTTP, O_LOGFMT, O_DRAIN,
           O_VERIFY, O_THRESH, O_FAST, O_GRAPHS, O_TP, O_DTYPE, O_CHUNK, O_REFRESH, O_PREFIX,
           O_REASON, O_SERVED, O_APIKEY, O_CHATTMPL, O_LOCALPF, O_GENCFG, O_KVFRAC, O_SWAP,
           O_STAGE, O_SPECOFF, O_NODRAFT, O_TLSCERT, O_TLSKEY, O_TLSCA, O_TLSCCA, O_TLSRELOAD, O_RSTORE, O_VLLMMET, O_JINJA };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"draft", required_argument, 0, O_DRAFT},
        {"no-draft", no_argument, 0, O_NODRAFT},
        {"listen", required_argument, 0, O_LISTEN}, {"prefill", required_argument, 0, O_PREFILL},
        {"colocated", no_argument, 0, O_COLO}, {"device", required_argument, 0, O_DEVICE},
        {"kv-pages", required_argument, 0, O_PAGES}, {"page-size", required_argument, 0, O_PAGE},
        {"kv-memory-fraction", required_argument, 0, O_KVFRAC},
        {"swap-space", required_argument, 0, O_SWAP},
        {"kv-staging-pages", required_argument, 0, O_STAGE},
        {"max-batch", required_argument, 0, O_BATCH}, {"max-queue", required_argument, 0, O_QUEUE},
        {"queue-timeout-ms", required_argument, 0, O_QTMO},
        {"request-timeout-ms", required_argument, 0, O_RTMO},
        {"transfer-timeout-ms", required_argument, 0, O_XTMO},
        {"cp-size", required_argument, 0, O_CP}, {"cp-strategy", required_argument, 0, O_CPS},
        {"verify", required_argument, 0, O_VERIFY}, {"threshold", required_argument, 0, O_THRESH},
        {"fast-kernels", no_argument, 0, O_FAST}, {"graphs", required_argument, 0, O_GRAPHS},
        {"speculative-disable-by-batch-size", required_argument, 0, O_SPECOFF},
        {"chunked-prefill-size", required_argument, 0, O_CHUNK},
        {"prefix-cache", no_argument, 0, O_PREFIX},
        {"reasoning-parser", required_argument, 0, O_REASON},
        {"chat-template", required_argument, 0, O_CHATTMPL},
        {"max-local-prefill", required_argument, 0, O_LOCALPF},
        {"generation-config", required_argument, 0, O_GENCFG},
        {"served-model-name", required_argument, 0, O_SERVED},
        {"api-key", required_argument, 0, O_APIKEY},
        {"prefill-refresh-ms", required_argument, 0, O_REFRESH},
        {"tp", required_argument, 0, O_TP}, {"dtype", required_argument, 0, O_DTYPE},
        {"log-level", required_argument, 0, O_LOG}, {"help", no_argument, 0, O_HELP},
        {"http", required_argument, 0, O_HTTP}, {"log-format", required_argument, 0, O_LOGFMT},
        {"drain-timeout-ms", required_argument, 0, O_DRAIN},
        {"tls-cert", required_argument, 0, O_TLSCERT}, {"tls-key", required_argument, 0, O_TLSKEY},
        {"tls-ca", required_argument, 0, O_TLSCA}, {"tls-client-ca", required_argument, 0, O_TLSCCA},
        {"tls-reload-interval", required_argument, 0, O_TLSRELOAD},
        {"responses-store-mb", required_argument, 0, O_RSTORE},
        {"vllm-metrics", no_argument, 0, O_VLLMMET}, {"jinja", no_argument, 0, O_JINJA},
        {0, 0, 0, 0},
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int bad = 0;
        int64_t v = 0;
        switch (c) {
        case O_MODEL: cfg.model_dir = optarg; break;
        case O_DRAFT: cfg.draft_dir = optarg; break;
        case O_NODRAFT: no_draft = 1; break;
        case O_LISTEN: listen = optarg; break;
        case O_PREFILL: cfg.prefill = optarg; break;
        case O_COLO: colocated = 1; break;
        case O_DEVICE: cfg.device = optarg; break;
        case O_DTYPE: bad = pd_cli_parse_dtype(PROG, optarg, &cfg.f32); break;
        case O_PAGES: bad = pd_cli_parse_int(PROG, "--kv-pages", optarg, 1, INT_MAX / 2, &cfg.kv_pages); break;
        case O_KVFRAC:
            bad = pd_cli_parse_fraction(PROG, "--kv-memory-fraction", optarg, &cfg.kv_mem_fraction);
            break;
        case O_SWAP: bad = pd_cli_parse_gib(PROG, "--swap-space", optarg, &cfg.swap_bytes); break;
        case O_STAGE:
            bad = pd_cli_parse_int(PROG, "--kv-staging-pages", optarg, 1, INT_MAX / 2, &cfg.kv_staging_pages);
            break;
        case O_PAGE: bad = pd_cli_parse_int(PROG, "--page-size", optarg, 1, 4096, &cfg.page_size); break;
        case O_BATCH: bad = pd_cli_parse_int(PROG, "--max-batch", optarg, 1, 65536, &cfg.max_batch); break;
        case O_REFRESH:
            refresh_given = 1;
            bad = pd_cli_parse_i64(PROG, "--prefill-refresh-ms", optarg, 0, INT32_MAX, &cfg.prefill_refresh_ms);
            break;
        case O_PREFIX: cfg.prefix_cache = 1; break;
        case O_CHUNK:
            bad = pd_cli_parse_int(PROG, "--chunked-prefill-size", optarg, 1, 1 << 20, &cfg.max_prefill_tokens);
            break;
        case O_QUEUE: bad = pd_cli_parse_int(PROG, "--max-queue", optarg, 1, 1 << 20, &cfg.max_queue); break;
        case O_QTMO: bad = pd_cli_parse_i64(PROG, "--queue-timeout-ms", optarg, 1, INT32_MAX, &v); cfg.queue_timeout_ms = v; break;
        case O_RTMO: bad = pd_cli_parse_i64(PROG, "--request-timeout-ms", optarg, 0, INT32_MAX, &v); cfg.request_timeout_ms = v; break;
        case O_XTMO: bad = pd_cli_parse_i64(PROG, "--transfer-timeout-ms", optarg, 1, INT32_MAX, &v); cfg.transfer_timeout_ms = v; break;
        case O_CP: bad = pd_cli_parse_int(PROG, "--cp-size", optarg, 1, 64, &cfg.cp_size); break;
        case O_CPS: cfg.cp_strategy = optarg; break;
        case O_TP: bad = pd_cli_parse_int(PROG, "--tp", optarg, 1, PD_TP_MAX_SIZE, &cfg.tp_size); break;
        case O_VERIFY: cfg.verify = optarg; break;
        case O_THRESH:
            bad = pd_cli_parse_float(PROG, "--threshold", optarg, &cfg.verify_threshold);
            if (!bad && !(cfg.verify_threshold > 0.0f && cfg.verify_threshold <= 1.0f)) {
                fprintf(stderr, PROG ": --threshold %g must be in (0, 1]\n", (double)cfg.verify_threshold);
                bad = 1;
            }
            break;
        case O_FAST: cfg.fast_kernels = 1; break;
        case O_SPECOFF:
            bad = pd_cli_parse_int(PROG, "--speculative-disable-by-batch-size", optarg, 0, 1 << 20,
                                   &cfg.spec_disable_batch);
            break;
        case O_GRAPHS: {
            pd_err gerr;
            pd_graph_mode gm = PD_GRAPHS_AUTO;
            if (pd_graph_mode_parse(optarg, &gm, &gerr) != PD_OK) {
                fprintf(stderr, PROG ": --graphs: %s\n", gerr.msg);
                bad = 1;
            }
            cfg.graphs = (int)gm;
            break;
        }
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
        case O_TLSCA: tls_ca = optarg; break;
        case O_TLSCCA: tls_client_ca = optarg; break;
        case O_VLLMMET: vllm_metrics = 1; break;
        case O_JINJA: jinja = 1; break;
        case O_RSTORE: bad = pd_cli_parse_int(PROG, "--responses-store-mb", optarg, 0, 1 << 20, &store_mb); break;
        case O_TLSRELOAD:
            bad = pd_cli_parse_int(PROG, "--tls-reload-interval", optarg, 0, 86400 * 365, &tls_reload_s);
            break;
        case O_APIKEY: api_key = optarg; break;
        case O_SERVED:
            if (optarg[0] == '\0' || strlen(optarg) > 255) {
                fprintf(stderr, PROG ": --served-model-name must have 1 to 255 bytes\n");
                return 2;
            }
            served_name = optarg;
            break;
        case O_CHATTMPL: chat_template = optarg; break;
        case O_GENCFG: generation_config = optarg; break;
        case O_LOCALPF:
            bad = pd_cli_parse_int(PROG, "--max-local-prefill", optarg, 0, 1 << 20, &cfg.max_local_prefill);
            break;
        case O_REASON:
            if (strcmp(optarg, "qwen3") != 0 && strcmp(optarg, "none") != 0) {
                fprintf(stderr, PROG ": --reasoning-parser '%s': known parsers are qwen3 and none\n", optarg);
                return 2;
            }
            reasoning = strcmp(optarg, "qwen3") == 0;
            break;
        case O_DRAIN: bad = pd_cli_parse_i64(PROG, "--drain-timeout-ms", optarg, 0, INT32_MAX, &drain_ms); break;
        case O_LOGFMT:
            if (pd_cli_parse_log_format(PROG, optarg) != 0)
                return 2;
            break;
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
    if (cfg.model_dir == NULL || (cfg.draft_dir == NULL && !no_draft) || listen == NULL) {
        fprintf(stderr, PROG ": --model DIR, --draft DIR (or --no-draft) and --listen HOST:PORT are required\n");
        return 2;
    }
    if (cfg.draft_dir != NULL && no_draft) {
        fprintf(stderr, PROG ": --draft and --no-draft exclude each other\n");
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
    if (!colocated && cfg.tp_size > 1) {
        fprintf(stderr, PROG ": --tp applies to --colocated only (a prefill node's KV would reach "
                        "rank 0's shard only)\n");
        return 2;
    }
    if (colocated && cfg.max_local_prefill >= 0) {
        fprintf(stderr, PROG ": --max-local-prefill applies to --prefill only (a --colocated node "
                        "prefills every prompt itself)\n");
        return 2;
    }
    if (colocated && cfg.kv_staging_pages > 0) {
        fprintf(stderr, PROG ": --kv-staging-pages applies to --prefill only (a --colocated node "
                        "writes its pages in place)\n");
        return 2;
    }
    if (colocated && refresh_given) {
        fprintf(stderr, PROG ": --prefill-refresh-ms applies to --prefill only (a --colocated node "
                        "has no prefill nodes to resolve)\n");
        return 2;
    }
    if (!colocated && cfg.max_prefill_tokens > 0 && !cfg.prefix_cache && cfg.max_local_prefill <= 0) {
        fprintf(stderr, PROG ": --chunked-prefill-size applies to prompts prefilled here: --colocated, or "
                        "disaggregated with --prefix-cache or --max-local-prefill (prefill nodes take "
                        "--max-batch-tokens)\n");
        return 2;
    }
    cfg.colocated = colocated;

    /* block the stop signals in every thread; the main thread waits for them */
    sigset_t set;
    pd_cli_block_stop_signals(&set);
    long nofile = pd_cli_raise_fd_limit();
    if (nofile >= 0)
        PD_LOG_DEBUG("decode", "descriptor limit %ld", nofile);

    pd_err err = {0};
    pd_tls tls;
    if (pd_tls_load(tls_cert, tls_key, tls_ca, tls_client_ca, &tls, &err) != PD_OK || pd_rpc_set_tls(&tls, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        pd_tls_free(&tls);
        return 1;
    }
    decode_server *s = NULL;
    pd_rpc_server *rpc = NULL;
    pd_metrics *reg = NULL;
    decode_metrics *dm = NULL;
    decode_http *http = NULL;
    if (pd_metrics_create(&reg, &err) != PD_OK || decode_metrics_create(reg, &dm, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 1;
    }
    cfg.observer = decode_metrics_observer(dm);
    if (vllm_metrics) {
        char model_id[256];
        decode_http_model_id(cfg.model_dir, served_name, model_id, sizeof(model_id));
        decode_metrics_vllm_names(dm, model_id);
    }
    cfg.chat_template = chat_template;
    cfg.jinja = jinja;
    cfg.reasoning = reasoning;
    cfg.generation_config = generation_config;
    if (decode_server_create(&cfg, &s, &err) != PD_OK) {
        fprintf(stderr, PROG ": %s\n", err.msg);
        return 1;
    }
    decode_metrics_attach(dm, s);
    if (decode_grpc_start(s, listen, &rpc, &err) != PD_OK) {
        fprintf(stderr, PROG ": --listen %s: %s\n", listen, err.msg);
        decode_server_destroy(s);
        return 1;
    }
    char host[128], port[16];
    if (pd_cli_split_hostport(listen, host, sizeof(host), port, sizeof(port)) != 0)
        snprintf(host, sizeof(host), "%s", "0.0.0.0");
    int is_v6 = strchr(host, ':') != NULL;
    printf("listening grpc %s%s%s:%d\n", is_v6 ? "[" : "", host, is_v6 ? "]" : "",
           pd_rpc_server_port(rpc));
    fflush(stdout);
    PD_LOG_INFO("decode", "listening grpc %s port %d (%s%s)", host, pd_rpc_server_port(rpc),
                decode_server_mode(s), tls.cert_pem != NULL ? ", TLS" : "");
    if (http_addr != NULL) {
        decode_http_config hc = { .addr = http_addr, .model_dir = cfg.model_dir, .metrics = reg,
                                  .dm = dm, .model_name = served_name,
                                  .api_key = api_key, .tls = &tls,
                                  .responses_store_bytes = (size_t)store_mb << 20 };
        if (decode_http_create(s, &hc, &http, &err) != PD_OK) {
            fprintf(stderr, PROG ": --http %s: %s\n", http_addr, err.msg);
            pd_rpc_server_destroy(rpc);
            decode_metrics_attach(dm, NULL);
            decode_server_destroy(s);
            return 1;
        }
        char hh[128], hp[16];
        if (pd_cli_split_hostport(http_addr, hh, sizeof(hh), hp, sizeof(hp)) != 0 || hh[0] == '\0')
            snprintf(hh, sizeof(hh), "%s", "0.0.0.0");
        int v6 = strchr(hh, ':') != NULL;
        printf("listening http %s%s%s:%d\n", v6 ? "[" : "", hh, v6 ? "]" : "",
               decode_http_port(http));
        fflush(stdout);
        PD_LOG_INFO("decode", "listening http %s port %d%s", hh, decode_http_port(http),
                    tls.cert_pem != NULL ? " (TLS)" : "");
    }
    decode_tls_target tt = { http };
    pd_tls_reloader tr;
    pd_tls_reloader_init(&tr, "decode", &tls, reg, apply_tls, &tt);
    int sig = pd_cli_wait_stop(&set, (int64_t)tls_reload_s * 1000, pd_tls_reloader_tick, &tr);
    if (sig == SIGTERM) {
        /* graceful drain (Kubernetes sends SIGTERM first): refuse new work, let running
         * requests finish up to the timeout; a second signal stops at once */
        PD_LOG_INFO("decode", "SIGTERM: draining for up to %lld ms", (long long)drain_ms);
        decode_server_drain(s);
        decode_http_drain(http);
        decode_metrics_set_draining(dm, 1);
        double end = pd_cli_now_ms() + (double)drain_ms;
        for (;;) {
            decode_stats st;
            decode_server_stats(s, &st);
            int engine = st.active_requests + st.queued_requests;
            int replies = decode_http_inflight(http);
            if (engine == 0 && replies == 0) {
                PD_LOG_INFO("decode", "drained");
                break;
            }
            if (pd_cli_now_ms() >= end) {
                PD_LOG_WARN("decode", "drain timeout: %d requests still in the engine, %d HTTP "
                            "replies unfinished; cancelling", engine, replies);
                break;
            }
            struct timespec ts = { 0, 20 * 1000000 };
            if (sigtimedwait(&set, NULL, &ts) > 0) {
                PD_LOG_WARN("decode", "second signal: stopping now");
                break;
            }
        }
        /* the last replies were handed to the sockets; give them a moment to leave */
        struct timespec ts = { 0, 200 * 1000000 };
        sigtimedwait(&set, NULL, &ts);
    } else {
        PD_LOG_INFO("decode", "signal %d: stopping", sig);
    }
    decode_http_stop(http);
    decode_metrics_attach(dm, NULL);
    pd_rpc_server_destroy(rpc);
    decode_server_destroy(s);
    decode_http_destroy(http);
    decode_metrics_destroy(dm);
    pd_metrics_destroy(reg);
    pd_tls_free(&tls);
    return 0;
}
