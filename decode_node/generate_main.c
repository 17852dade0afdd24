/* generate_main.c - pdspark-generate: offline generation with the full DSpark loop in-process.
 * Owns: flag parsing, loading the target/draft/tokenizer, driving one pd_engine request to the
 *   end, and printing the result (text, or one JSON object with --json).
 * Not here: the engine (common/pd_engine.c).
 * Threading: single-threaded. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "pd_chat.h"
#include "pd_cp.h"
#include "pd_cli.h"
#include "pd_engine.h"
#include "pd_grammar.h"
#include "pd_graph.h"
#include "pd_json.h"
#include "pd_log.h"
#include "pd_model.h"
#include "pd_tokenizer.h"
#include "pd_tp.h"

#define PROG "pdspark-generate"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pdspark-generate --model DIR [--draft DIR | --no-draft]\n"
            "                        (--prompt TEXT | --prompt-ids FILE)\n"
            "                        [--chat [--system TEXT] [--chat-template FILE|TEXT] [--jinja]]\n"
            "                        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]\n"
            "                        [--min-p P] [--typical-p P] [--seed S] [--block-size B]\n"
            "                        [--ignore-eos] [--json]\n"
            "                        [--device cpu|cuda] [--dtype bf16|f32] [--page-size N]\n"
            "                        [--kv-pages N] [--stream]\n"
            "                        [--verify full|threshold|scheduled] [--threshold T] [--fast-kernels]\n"
            "                        [--graphs auto|off|pad]\n"
            "                        [--presence-penalty P] [--frequency-penalty F] [--repetition-penalty R]\n"
            "                        [--logit-bias ID:BIAS[,ID:BIAS...]] [--min-tokens N]\n"
            "                        [--json-object | --json-schema FILE | --choice TEXT... | --regex RE\n"
            "                         | --grammar FILE]\n"
            "                        [--cp-size N] [--cp-strategy round-robin-split|interleave|zigzag]\n"
            "                        [--tp N]\n"
            "\n"
            "Runs DSpark speculative decoding (or plain target decoding with --no-draft) on one\n"
            "prompt. --prompt-ids reads whitespace-separated token ids. --json prints one object:\n"
            "tokens, text, rounds, accepted_per_round, tau, prompt_tokens, time_ms and more.\n"
            "--chat makes --prompt a user message (after a --system one) rendered by the\n"
            "checkpoint's chat template (or --chat-template), as decode_node renders chat requests;\n"
            "--jinja renders it with the Jinja subset even when it is ChatML-shaped.\n"
            "--cp-size N > 1 runs the prefill context-parallel over N ranks (threads of this process;\n"
            "on cuda rank r runs on GPU r %% (visible GPUs) with its own copy of the target, NCCL\n"
            "when every rank has a GPU of its own), split by --cp-strategy (default\n"
            "round-robin-split); the result is the same as with N = 1 on the cpu, and up to bf16\n"
            "rounding on a GPU (the ranks' row counts take other kernels).\n"
            "--tp N > 1 decodes tensor-parallel over N ranks (threads of this process; on the cpu\n"
            "device with the local communicator, on cuda one GPU per rank with NCCL): attention\n"
            "heads, MLP and lm_head split N ways; N must divide the attention heads; on the cpu the\n"
            "tokens are the same as with N = 1.\n"
            "--dtype f32 keeps the weights and KV cache in fp32 on cuda (default bf16: half the\n"
            "bytes); the cpu device always computes in fp32.\n"
            "Penalties (vLLM's meaning, on the target's logits, drafts verified against the\n"
            "penalised ones): --presence-penalty and --frequency-penalty in [-2, 2] on the output's\n"
            "tokens, --repetition-penalty in (0, 10] on the prompt's and the output's; --logit-bias\n"
            "adds BIAS in [-100, 100] to token ID's logit first; --min-tokens N masks the eos tokens\n"
            "until N tokens were generated.\n"
            "Structured output: the output is any JSON object (--json-object), follows the JSON\n"
            "schema in FILE (--json-schema, - = stdin), is one of the --choice strings (repeat the\n"
            "flag), a whole match of --regex or of the GBNF grammar in FILE (--grammar, rule root);\n"
            "every pick is masked to what the grammar allows.\n");
}

/* --chat: [system,] user rendered by the checkpoint's chat template (or --chat-template) */
static pd_status chat_prompt(const char *model_dir, const char *given, int jinja, const char *system_text,
                             const char *prompt, char **out, pd_err *err)
{
    pd_chat_template t;
    int usable = 0;
    char why[256];
    pd_status st = pd_chat_template_open(model_dir, given, jinja, &t, &usable, why, sizeof(why), err);
    if (st != PD_OK)
        return st;
    if (!usable)
        return pd_err_set(err, PD_ERR_INVALID, "--chat: %s", why);
    const char *roles[2] = { "system", "user" }, *contents[2] = { system_text, prompt };
    const int first = system_text != NULL ? 0 : 1;
    pd_chat_opts o = PD_CHAT_OPTS_DEFAULT;
    size_t len = 0;
    int rc = pd_chat_render_text(&t, roles + first, contents + first, 2 - first, &o, out, &len, why, sizeof(why));
    pd_chat_template_free(&t);
    return rc == 0 ? PD_OK : pd_err_set(err, PD_ERR_INVALID, "--chat: %s", why);
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, PROG))
        return 0;
    const char *model_dir = NULL, *draft_dir = NULL, *prompt = NULL, *ids_path = NULL;
    const char *system_text = NULL, *chat_template = NULL;
    int chat = 0, jinja = 0;
    const char *device = "cpu";
    int no_draft = 0, json = 0, ignore_eos = 0, stream = 0, fast_kernels = 0;
    int max_new = 128, block = 0, page_size = 16, kv_pages = 0, seed = 0, top_k = 0, cp_size = 1;
    int tp = 1, f32 = 0;
    pd_cp_strategy cp_strategy = PD_CP_STRATEGY_ROUND_ROBIN;
    float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f, typical_p = 0.0f, threshold = 0.0f;
    float presence = 0.0f, frequency = 0.0f, repetition = 0.0f;
    pd_logit_bias *bias = NULL;
    int n_bias = 0, min_tokens = 0;
    pd_cli_guide guide = { 0 };
    pd_grammar *grammar = NULL;
    pd_gvocab *gvocab = NULL;
    pd_verify_policy verify = PD_VERIFY_FULL;
    pd_graph_mode graphs = PD_GRAPHS_AUTO;
    enum { O_MODEL = 256, O_DRAFT, O_NO_DRAFT, O_PROMPT, O_IDS, O_MAXNEW, O_TEMP, O_TOPK, O_TOPP,
           O_SEED, O_BLOCK, O_JSON, O_IGNORE, O_DEVICE, O_PAGE, O_PAGES, O_STREAM, O_CP_SIZE,
           O_CP_STRATEGY, O_VERIFY, O_THRESHOLD, O_FAST, O_GRAPHS, O_TP, O_DTYPE, O_PRES, O_FREQ,
           O_REP, O_BIAS, O_MINTOK, O_JOBJ, O_JSCHEMA, O_CHOICE, O_REGEX, O_GRAMMAR, O_MINP, O_TYPP,
           O_CHAT, O_SYSTEM, O_CHATTMPL, O_HELP, O_JINJA };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"draft", required_argument, 0, O_DRAFT},
        {"no-draft", no_argument, 0, O_NO_DRAFT}, {"prompt", required_argument, 0, O_PROMPT},
        {"prompt-ids", required_argument, 0, O_IDS}, {"max-new-tokens", required_argument, 0, O_MAXNEW},
        {"temperature", required_argument, 0, O_TEMP}, {"top-k", required_argument, 0, O_TOPK},
        {"top-p", required_argument, 0, O_TOPP}, {"seed", required_argument, 0, O_SEED},
        {"min-p", required_argument, 0, O_MINP}, {"typical-p", required_argument, 0, O_TYPP},
        {"chat", no_argument, 0, O_CHAT}, {"system", required_argument, 0, O_SYSTEM},
        {"chat-template", required_argument, 0, O_CHATTMPL}, {"jinja", no_argument, 0, O_JINJA},
        {"block-size", required_argument, 0, O_BLOCK}, {"json", no_argument, 0, O_JSON},
        {"ignore-eos", no_argument, 0, O_IGNORE}, {"device", required_argument, 0, O_DEVICE},
        {"dtype", required_argument, 0, O_DTYPE},
        {"page-size", required_argument, 0, O_PAGE}, {"kv-pages", required_argument, 0, O_PAGES},
        {"stream", no_argument, 0, O_STREAM}, {"cp-size", required_argument, 0, O_CP_SIZE},
        {"verify", required_argument, 0, O_VERIFY}, {"threshold", required_argument, 0, O_THRESHOLD},
        {"fast-kernels", no_argument, 0, O_FAST}, {"graphs", required_argument, 0, O_GRAPHS},
        {"tp", required_argument, 0, O_TP},
        {"presence-penalty", required_argument, 0, O_PRES},
        {"frequency-penalty", required_argument, 0, O_FREQ},
        {"repetition-penalty", required_argument, 0, O_REP},
        {"logit-bias", required_argument, 0, O_BIAS}, {"min-tokens", required_argument, 0, O_MINTOK},
        {"json-object", no_argument, 0, O_JOBJ}, {"json-schema", required_argument, 0, O_JSCHEMA},
        {"choice", required_argument, 0, O_CHOICE}, {"regex", required_argument, 0, O_REGEX},
        {"grammar", required_argument, 0, O_GRAMMAR},
        {"cp-strategy", required_argument, 0, O_CP_STRATEGY}, {"help", no_argument, 0, O_HELP},
        {0, 0, 0, 0},
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int bad = 0;
        switch (c) {
        case O_MODEL: model_dir = optarg; break;
        case O_DRAFT: draft_dir = optarg; break;
        case O_NO_DRAFT: no_draft = 1; break;
        case O_PROMPT: prompt = optarg; break;
        case O_CHAT: chat = 1; break;
        case O_SYSTEM: system_text = optarg; break;
        case O_CHATTMPL: chat_template = optarg; break;
        case O_JINJA: jinja = 1; break;
        case O_IDS: ids_path = optarg; break;
        case O_MAXNEW: bad = pd_cli_parse_int(PROG, "--max-new-tokens", optarg, 1, 1 << 20, &max_new); break;
        case O_TEMP: bad = pd_cli_parse_float(PROG, "--temperature", optarg, &temperature); break;
        case O_TOPK: bad = pd_cli_parse_int(PROG, "--top-k", optarg, 0, INT_MAX, &top_k); break;
        case O_TOPP: bad = pd_cli_parse_float(PROG, "--top-p", optarg, &top_p); break;
        case O_MINP: bad = pd_cli_parse_float(PROG, "--min-p", optarg, &min_p); break;
        case O_TYPP: bad = pd_cli_parse_float(PROG, "--typical-p", optarg, &typical_p); break;
        case O_PRES: bad = pd_cli_parse_float(PROG, "--presence-penalty", optarg, &presence); break;
        case O_FREQ: bad = pd_cli_parse_float(PROG, "--frequency-penalty", optarg, &frequency); break;
        case O_REP: bad = pd_cli_parse_float(PROG, "--repetition-penalty", optarg, &repetition); break;
        case O_BIAS: bad = pd_cli_parse_logit_bias(PROG, "--logit-bias", optarg, &bias, &n_bias); break;
        case O_MINTOK: bad = pd_cli_parse_int(PROG, "--min-tokens", optarg, 0, INT_MAX, &min_tokens); break;
        case O_JOBJ: bad = pd_cli_parse_guide(PROG, "--json-object", NULL, &guide); break;
        case O_JSCHEMA: bad = pd_cli_parse_guide(PROG, "--json-schema", optarg, &guide); break;
        case O_CHOICE: bad = pd_cli_parse_guide(PROG, "--choice", optarg, &guide); break;
        case O_REGEX: bad = pd_cli_parse_guide(PROG, "--regex", optarg, &guide); break;
        case O_GRAMMAR: bad = pd_cli_parse_guide(PROG, "--grammar", optarg, &guide); break;
        case O_SEED: bad = pd_cli_parse_int(PROG, "--seed", optarg, 0, INT_MAX, &seed); break;
        case O_BLOCK: bad = pd_cli_parse_int(PROG, "--block-size", optarg, 1, 31, &block); break;
        case O_JSON: json = 1; break;
        case O_IGNORE: ignore_eos = 1; break;
        case O_DEVICE: device = optarg; break;
        case O_DTYPE: bad = pd_cli_parse_dtype(PROG, optarg, &f32); break;
        case O_PAGE: bad = pd_cli_parse_int(PROG, "--page-size", optarg, 1, 4096, &page_size); break;
        case O_PAGES: bad = pd_cli_parse_int(PROG, "--kv-pages", optarg, 1, INT_MAX, &kv_pages); break;
        case O_STREAM: stream = 1; break;
        case O_FAST: fast_kernels = 1; break;
        case O_GRAPHS: {
            pd_err gerr;
            if (pd_graph_mode_parse(optarg, &graphs, &gerr) != PD_OK) {
                fprintf(stderr, "pdspark-generate: --graphs: %s\n", gerr.msg);
                bad = 1;
            }
            break;
        }
        case O_VERIFY: {
            pd_err perr;
            if (pd_verify_policy_parse(optarg, &verify, &perr) != PD_OK) {
                fprintf(stderr, "pdspark-generate: --verify: %s\n", perr.msg);
                bad = 1;
            }
            break;
        }
        case O_THRESHOLD:
            bad = pd_cli_parse_float(PROG, "--threshold", optarg, &threshold);
            if (!bad && !(threshold > 0.0f && threshold <= 1.0f)) {
                fprintf(stderr, "pdspark-generate: --threshold %g must be in (0, 1]\n", (double)threshold);
                bad = 1;
            }
            break;
        case O_TP: bad = pd_cli_parse_int(PROG, "--tp", optarg, 1, PD_TP_MAX_SIZE, &tp); break;
        case O_CP_SIZE: bad = pd_cli_parse_int(PROG, "--cp-size", optarg, 1, PD_CP_MAX_SIZE, &cp_size); break;
        case O_CP_STRATEGY: {
            pd_err perr = {0};
            if (pd_cp_strategy_parse(optarg, &cp_strategy, &perr) != PD_OK) {
                fprintf(stderr, "pdspark-generate: --cp-strategy: %s\n", perr.msg);
                bad = 1;
            }
            break;
        }
        case O_HELP: usage(stdout); return 0;
        default:
            return pd_cli_bad_flag(PROG, argv[optind - 1]);
        }
        if (bad)
            return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "pdspark-generate: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (model_dir == NULL) {
        fprintf(stderr, "pdspark-generate: --model DIR is required\n");
        return 2;
    }
    if (no_draft && draft_dir != NULL) {
        fprintf(stderr, "pdspark-generate: --draft and --no-draft exclude each other\n");
        return 2;
    }
    if ((prompt == NULL) == (ids_path == NULL)) {
        fprintf(stderr, "pdspark-generate: give exactly one of --prompt TEXT or --prompt-ids FILE\n");
        return 2;
    }
    if ((system_text != NULL || chat_template != NULL || jinja) && !chat) {
        fprintf(stderr, "pdspark-generate: --system, --chat-template and --jinja need --chat\n");
        return 2;
    }
    if (chat && prompt == NULL) {
        fprintf(stderr, "pdspark-generate: --chat makes --prompt TEXT the user's message\n");
        return 2;
    }

    pd_err err = {0};
    int rc = 1;
    kern_backend *be = NULL;
    pd_qwen3_model *tm = NULL;
    pd_dspark_model *dm = NULL;
    pd_tokenizer *tok = NULL;
    pd_engine *eng = NULL;
    pd_cp_targets cpt = {0};   /* CP on a device backend: the targets of ranks 1.. */
    int32_t *ids = NULL;
    int n_ids = 0;
    char *text = NULL, *chat_text = NULL;
    size_t text_len = 0;
    pd_detok *detok = NULL;
    pd_sps sps = {0};

    if (chat && chat_prompt(model_dir, chat_template, jinja, system_text, prompt, &chat_text, &err) != PD_OK)
        goto fail;
    kern_backend_config bc = { .name = device, .f32 = f32 };
    if (kern_backend_create(&bc, &be, &err) != PD_OK)
        goto fail;
    if (pd_qwen3_load(be, model_dir, &tm, &err) != PD_OK)
        goto fail;
    if (draft_dir != NULL && pd_dspark_load(be, draft_dir, tm, &dm, &err) != PD_OK)
        goto fail;
    if (pd_tokenizer_load(model_dir, &tok, &err) != PD_OK) {
        if (prompt != NULL)
            goto fail;
        PD_LOG_WARN("generate", "no tokenizer (%s); printing ids only", err.msg);
        tok = NULL;
    }
    if (prompt != NULL) {
        const char *pt = chat_text != NULL ? chat_text : prompt;
        size_t n = 0;
        if (pd_tokenizer_encode(tok, pt, strlen(pt), 1, &ids, &n, &err) != PD_OK)
            goto fail;
        n_ids = (int)n;
    } else if (pd_cli_read_ids(PROG, ids_path, &ids, &n_ids) != 0) {
        goto out;
    }
    if (pd_cp_targets_load(&cpt, be, model_dir, cp_size, &err) != PD_OK)
        goto fail;
    pd_engine_config ec = { .target = tm, .draft = dm, .page_size = page_size, .n_pages = kv_pages,
                            .block_size = block, .cp_size = cp_size, .cp_strategy = cp_strategy,
                            .cp_targets = (const pd_qwen3_model *const *)cpt.tm,
                            .tp_size = tp,
                            .verify_policy = verify, .verify_threshold = threshold,
                            .fast_kernels = fast_kernels, .graphs = graphs };
    /* a calibration fitted by pdspark-calibrate sits next to the draft checkpoint */
    pd_calib calib;
    if (dm != NULL) {
        pd_err cerr;
        pd_status cs = pd_calib_load(draft_dir, &calib, &cerr);
        if (cs == PD_OK)
            ec.calib = &calib;
        else if (cs != PD_ERR_NOT_FOUND)
            PD_LOG_WARN("generate", "ignoring the confidence calibration: %s", cerr.msg);
    }
    if (pd_engine_create(&ec, &eng, &err) != PD_OK)
        goto fail;
    if (verify == PD_VERIFY_SCHEDULED && dm != NULL) {
        /* the scheduler needs this device's step-time curve: profiled once, cached */
        if (pd_engine_profile_sps_cached(eng, model_dir, device, 8, &sps, &err) != PD_OK)
            goto fail;
        pd_engine_set_sps(eng, &sps);
    }
    pd_gen_params gp = { .sample = { .temperature = temperature, .top_k = top_k, .top_p = top_p,
                                     .min_p = min_p, .typical_p = typical_p, .seed = (uint64_t)seed },
                         .max_new_tokens = max_new, .ignore_eos = ignore_eos,
                         .presence_penalty = presence, .frequency_penalty = frequency,
                         .repetition_penalty = repetition, .logit_bias = bias,
                         .n_logit_bias = n_bias, .min_tokens = min_tokens };
    pd_grammar_spec spec = { .json_object = guide.json_object, .json_schema = guide.schema,
                             .json_schema_len = guide.schema != NULL ? strlen(guide.schema) : 0,
                             .choices = (const char *const *)guide.choices, .n_choices = guide.n_choices,
                             .regex = guide.regex, .regex_len = guide.regex != NULL ? strlen(guide.regex) : 0,
                             .ebnf = guide.grammar, .ebnf_len = guide.grammar != NULL ? strlen(guide.grammar) : 0 };
    if (pd_grammar_spec_kinds(&spec) > 0) {
        if (pd_grammar_compile(&spec, NULL, &grammar, &err) != PD_OK)
            goto fail;
        if (tok == NULL) {
            pd_err_set(&err, PD_ERR_INVALID, "structured output needs the model's tokenizer.json");
            goto fail;
        }
        if (pd_gvocab_create(tok, tm->cfg.vocab_size, tm->cfg.eos_ids, tm->cfg.n_eos, &gvocab, &err) != PD_OK)
            goto fail;
        gp.grammar = grammar;
        gp.gvocab = gvocab;
    }
    pd_request *req = NULL;
    double t0 = pd_cli_now_ms();
    if (pd_engine_add(eng, 1, ids, n_ids, &gp, &req, &err) != PD_OK)
        goto fail;
    if (stream && tok != NULL && pd_detok_create(tok, &detok, &err) != PD_OK)
        goto fail;
    double t_first = -1.0;
    while (req->finish == PD_FINISH_NONE) {
        if (pd_engine_step(eng, &err) != PD_OK)
            goto fail;
        int n_new = 0;
        const int32_t *nt = pd_engine_take_new(req, &n_new);
        if (n_new > 0 && t_first < 0)
            t_first = pd_cli_now_ms();
        for (int i = 0; detok != NULL && i < n_new; i++) {
            char *piece = NULL;
            int is_end = 0;
            for (int q = 0; q < tm->cfg.n_eos && !ignore_eos; q++)
                is_end |= nt[i] == tm->cfg.eos_ids[q];
            if (is_end)
                continue;   /* the ending eos is not printed */
            if (pd_detok_push(detok, nt[i], &piece, &err) != PD_OK)
                goto fail;
            fwrite(piece, 1, pd_text_nul_unmark(piece, strlen(piece), 0), stdout);   /* NUL: the byte */
            fflush(stdout);
            free(piece);
        }
    }
    double t1 = pd_cli_now_ms();
    if (req->finish == PD_FINISH_ERROR) {
        fprintf(stderr, "pdspark-generate: %s\n", req->error);
        goto out;
    }
    if (detok != NULL) {
        char *piece = NULL;
        if (pd_detok_flush(detok, &piece, &err) != PD_OK)
            goto fail;
        fwrite(piece, 1, pd_text_nul_unmark(piece, strlen(piece), 0), stdout);
        fputc('\n', stdout);
        free(piece);
    }
    /* the eos that ended the request is not part of the text (as the servers answer) */
    size_t n_text = (size_t)req->n_out;
    for (int q = 0; q < tm->cfg.n_eos && req->finish == PD_FINISH_STOP && !ignore_eos && n_text > 0; q++)
        if (req->out[n_text - 1] == tm->cfg.eos_ids[q]) {
            n_text--;
            break;
        }
    if (tok != NULL && pd_tokenizer_decode(tok, req->out, n_text, 0, &text, &text_len, &err) != PD_OK)
        goto fail;
    long acc_sum = 0;
    for (int i = 0; i < req->n_rounds; i++)
        acc_sum += req->accepted[i];
    double tau = req->n_rounds > 0 ? (double)acc_sum / req->n_rounds : 0.0;
    double ms = t1 - t0;
    double tps = ms > 0 ? req->n_out / (ms / 1e3) : 0.0;
    if (json) {
        cJSON *o = cJSON_CreateObject();
        cJSON *toks = cJSON_AddArrayToObject(o, "tokens");
        for (int i = 0; i < req->n_out; i++)
            cJSON_AddItemToArray(toks, cJSON_CreateNumber(req->out[i]));
        char *marked = text != NULL ? pd_text_nul_mark(text, text_len) : NULL;   /* NUL: \u0000 */
        cJSON_AddStringToObject(o, "text", marked != NULL ? marked : "");
        free(marked);
        cJSON_AddNumberToObject(o, "rounds", req->n_rounds);
        cJSON *apr = cJSON_AddArrayToObject(o, "accepted_per_round");
        for (int i = 0; i < req->n_rounds; i++)
            cJSON_AddItemToArray(apr, cJSON_CreateNumber(req->accepted[i]));
        cJSON_AddNumberToObject(o, "tau", tau);
        cJSON *pos = cJSON_AddArrayToObject(o, "acceptance_by_position");
        for (int k = 0; k < pd_engine_block_size(eng); k++)
            cJSON_AddItemToArray(pos, cJSON_CreateNumber(
                req->n_rounds > 0 ? (double)req->accepted_at_pos[k] / req->n_rounds : 0.0));
        cJSON_AddNumberToObject(o, "prompt_tokens", n_ids);
        cJSON_AddNumberToObject(o, "completion_tokens", req->n_out);
        cJSON_AddStringToObject(o, "finish_reason", pd_finish_reason_str(req->finish));
        cJSON_AddNumberToObject(o, "time_ms", ms);
        cJSON_AddNumberToObject(o, "ttft_ms", t_first >= 0 ? t_first - t0 : ms);
        cJSON_AddNumberToObject(o, "tokens_per_s", tps);
        uint64_t g_eager = 0, g_cap = 0, g_rep = 0;
        pd_engine_graph_stats(eng, &g_eager, &g_cap, &g_rep);
        cJSON *g = cJSON_AddObjectToObject(o, "graphs");
        cJSON_AddNumberToObject(g, "eager", (double)g_eager);
        cJSON_AddNumberToObject(g, "captures", (double)g_cap);
        cJSON_AddNumberToObject(g, "replays", (double)g_rep);
        cJSON_AddStringToObject(o, "device", device);
        cJSON_AddStringToObject(o, "dtype", kern_dtype_name(be->weight_dtype));
        cJSON_AddStringToObject(o, "mode", dm != NULL ? "dspark" : "target-only");
        char *s = pd_json_print(o);
        if (s != NULL)
            puts(s);
        free(s);
        cJSON_Delete(o);
    } else {
        if (detok == NULL) {
            if (text != NULL) {
                fwrite(text, 1, text_len, stdout);   /* a NUL byte of the text included */
                fputc('\n', stdout);
            } else {
                for (int i = 0; i < req->n_out; i++)
                    printf("%d%c", req->out[i], i + 1 == req->n_out ? '\n' : ' ');
            }
        }
        fprintf(stderr, "pdspark-generate: %d prompt tokens, %d generated (%s) in %.1f ms, %.1f tokens/s",
                n_ids, req->n_out, pd_finish_reason_str(req->finish), ms, tps);
        if (dm != NULL)
            fprintf(stderr, ", %d rounds, tau %.3f", req->n_rounds, tau);
        fputc('\n', stderr);
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "pdspark-generate: %s\n", err.msg[0] ? err.msg : pd_status_str(err.code));
    rc = 1;
out:
    pd_detok_destroy(detok);
    free(text);
    free(chat_text);
    free(ids);
    free(bias);
    pd_engine_destroy(eng);
    pd_grammar_unref(grammar);
    pd_gvocab_destroy(gvocab);
    pd_cli_guide_free(&guide);
    pd_sps_cleanup(&sps);
    pd_tokenizer_free(tok);
    pd_dspark_free(dm);
    pd_cp_targets_free(&cpt);
    pd_qwen3_free(tm);
    kern_backend_destroy(be);
    return rc;
}
