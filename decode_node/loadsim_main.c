/* loadsim_main.c - pdspark-loadsim: the engine under closed-loop load, in-process, per
 *   concurrency level and verification policy (the DSpark scheduler's throughput/latency sweep).
 * Owns: the sweep (for each policy x concurrency: keep C requests in flight through one engine
 *   until R requests have finished), the figures (output tokens/s, mean ITL, TTFT, tau, mean
 *   verified drafts per round) and their CSV.
 * Not here: the network path (scripts/pdspark-loadgen measures a running decode_node over HTTP);
 *   kernels (pdspark-bench). Runs where the services cannot (the GPU machine has no gRPC/UCX).
 * ITL is the per-request mean time between output tokens, (t_last - t_first) / (n - 1), with
 *   token times taken when pd_engine_step returns them (tokens of one round share a time).
 * Threading: one thread. */
#include <cjson/cJSON.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cli.h"
#include "pd_engine.h"
#include "pd_graph.h"
#include "pd_json.h"
#include "pd_log.h"
#include "pd_model.h"
#include "pd_verify_policy.h"

#define PROG "pdspark-loadsim"
#define MAX_LEVELS 16
#define MAX_PROMPTS 1024

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pdspark-loadsim (--model DIR [--draft DIR] | --synthetic qwen3-4b|qwen3-8b)\n"
            "                       [--device cpu|cuda] [--concurrency 1,8,32,128]\n"
            "                       [--policies target,full,threshold,scheduled] [--threshold T]\n"
            "                       [--prompts FILE.jsonl | --prompt-len N] [--max-new-tokens N]\n"
            "                       [--requests N] [--seed S] [--fast-kernels] [--graphs auto|off|pad]\n"
            "                       [--csv FILE] [--label NAME] [--sched-arm auto|plain|algo1|all]\n"
            "                       [--warmup-tokens N] [--sched-trace FILE]\n"
            "\n"
            "Runs one engine under closed-loop load: for every policy and concurrency C it keeps C\n"
            "greedy requests in flight until --requests (default max(2C, 16)) have finished, then\n"
            "prints output tokens/s, mean ITL, mean TTFT, tau and the drafts verified per round.\n"
            "'target' is target-only decoding. --prompts reads input_ids from JSONL lines (the eval\n"
            "prompts); otherwise prompts are --prompt-len random ids (default 256). A calibration\n"
            "next to --draft is used; 'scheduled' profiles this device's SPS curve up to C x\n"
            "(block + 1) verify tokens first. With --synthetic the drafter is random (2 layers,\n"
            "block 7): tau is meaningless there, the cost is real. --sched-arm (diagnostics) pins\n"
            "the scheduled policy to one arm: no drafts, Algorithm 1, or all drafts. Each level\n"
            "starts after an untimed warm-up of C requests of --warmup-tokens (default 32) new\n"
            "tokens on the same engine: graphs are captured and the scheduled policy has tried\n"
            "its arms, as on a server that has been running. --sched-trace writes one line per\n"
            "round of the scheduled policy (arm, estimates, what the round took).\n");
}

typedef struct {
    int32_t *ids;
    int n;
} prompt;

typedef struct {
    double tokens_per_s, itl_ms, ttft_ms, tau, verified, wall_s;
    long out_tokens;
    int requests;
} level_result;

static int parse_list(const char *s, int *out, int max)
{
    int n = 0;
    char *dup = strdup(s), *save = NULL;
    for (char *t = strtok_r(dup, ",", &save); t != NULL && n < max; t = strtok_r(NULL, ",", &save)) {
        char *end = NULL;
        long v = strtol(t, &end, 10);
        if (end == t || *end != '\0' || v < 1 || v > 4096) {
            fprintf(stderr, PROG ": --concurrency: '%s' is not a count in 1..4096\n", t);
            free(dup);
            return -1;
        }
        out[n++] = (int)v;
    }
    free(dup);
    return n;
}

static int load_prompts(const char *path, prompt *p, int max)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, PROG ": --prompts %s: cannot open\n", path);
        return -1;
    }
    char *line = NULL;
    size_t cap = 0;
    int n = 0;
    while (n < max && getline(&line, &cap, f) > 0) {
        cJSON *o = pd_json_parse_str(line, NULL);
        cJSON *ids = cJSON_GetObjectItem(o, "input_ids");
        int k = cJSON_IsArray(ids) ? cJSON_GetArraySize(ids) : 0;
        if (k <= 0) {
            cJSON_Delete(o);
            continue;
        }
        p[n].ids = malloc((size_t)k * sizeof(int32_t));
        for (int j = 0; j < k; j++)
            p[n].ids[j] = cJSON_GetArrayItem(ids, j)->valueint;
        p[n].n = k;
        n++;
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    if (n == 0)
        fprintf(stderr, PROG ": --prompts %s: no lines with input_ids\n", path);
    return n > 0 ? n : -1;
}

typedef struct {
    pd_request *r;
    double t_submit, t_first, t_last;
    int seen;
} slot;

/* One policy at one concurrency: closed loop until n_req requests have finished. */
static pd_status run_level(pd_engine *e, const prompt *pr, int n_pr, int conc, int n_req,
                           pd_verify_policy pol, float thr, int max_new, level_result *res, pd_err *err)
{
    slot *sl = calloc((size_t)conc, sizeof(*sl));
    if (sl == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "load slots");
    pd_gen_params gp = { .sample = { .top_p = 1.0f }, .max_new_tokens = max_new, .ignore_eos = 1,
                         .verify_policy = pol,
                         .verify_threshold = thr };
    int submitted = 0, done = 0;
    double sum_itl = 0.0, sum_ttft = 0.0;
    long tokens = 0, rounds = 0, accepted = 0, verified = 0;
    int n_itl = 0;
    pd_status st = PD_OK;
    double t0 = pd_cli_now_ms();
    while (done < n_req) {
        for (int i = 0; i < conc && submitted < n_req; i++) {
            if (sl[i].r != NULL)
                continue;
            const prompt *p = &pr[submitted % n_pr];
            pd_err aerr;
            st = pd_engine_add(e, (uint64_t)submitted + 1, p->ids, p->n, &gp, &sl[i].r, &aerr);
            if (st == PD_ERR_BUSY) {
                st = PD_OK;   /* no pages now: retry after a step frees some */
                break;
            }
            if (st != PD_OK) {
                *err = aerr;
                goto out;
            }
            sl[i].t_submit = pd_cli_now_ms();
            sl[i].t_first = sl[i].t_last = -1.0;
            sl[i].seen = 0;
            submitted++;
        }
        if ((st = pd_engine_step(e, err)) != PD_OK)
            goto out;
        double now = pd_cli_now_ms();
        for (int i = 0; i < conc; i++) {
            pd_request *r = sl[i].r;
            if (r == NULL)
                continue;
            int n_new = 0;
            (void)pd_engine_take_new(r, &n_new);
            if (n_new > 0) {
                if (sl[i].t_first < 0)
                    sl[i].t_first = now;
                sl[i].t_last = now;
            }
            if (r->finish == PD_FINISH_NONE)
                continue;
            if (r->finish == PD_FINISH_ERROR) {
                st = pd_err_set(err, PD_ERR_INTERNAL, "request %llu failed: %s",
                                (unsigned long long)r->id, r->error);
                goto out;
            }
            tokens += r->n_out;
            sum_ttft += sl[i].t_first - sl[i].t_submit;
            if (r->n_out > 1) {
                sum_itl += (sl[i].t_last - sl[i].t_first) / (r->n_out - 1);
                n_itl++;
            }
            for (int k = 0; k < r->n_rounds; k++) {
                accepted += r->accepted[k];
                verified += r->verified != NULL ? r->verified[k] : 0;
            }
            rounds += r->n_rounds;
            pd_engine_release(e, r);
            sl[i].r = NULL;
            done++;
        }
    }
    double wall = (pd_cli_now_ms() - t0) / 1000.0;
    res->wall_s = wall;
    res->out_tokens = tokens;
    res->requests = done;
    res->tokens_per_s = wall > 0 ? (double)tokens / wall : 0.0;
    res->itl_ms = n_itl > 0 ? sum_itl / n_itl : 0.0;
    res->ttft_ms = done > 0 ? sum_ttft / done : 0.0;
    res->tau = rounds > 0 ? (double)accepted / rounds : 1.0;
    res->verified = rounds > 0 ? (double)verified / rounds : 0.0;
out:
    for (int i = 0; i < conc; i++)
        if (sl[i].r != NULL) {
            pd_engine_cancel(e, sl[i].r);
            pd_engine_release(e, sl[i].r);
        }
    free(sl);
    return st;
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, PROG))
        return 0;
    const char *model_dir = NULL, *draft_dir = NULL, *synthetic = NULL, *device = "cpu";
    const char *prompts_path = NULL, *csv_path = NULL, *label = NULL;
    const char *policies = "target,full,threshold,scheduled";
    int levels[MAX_LEVELS] = { 1, 8, 32, 128 }, n_levels = 4;
    int prompt_len = 256, max_new = 128, n_requests = 0, seed = 1, fast = 0, sched_arm = 0, warmup = 32;
    const char *trace_path = NULL;
    FILE *trace = NULL;
    float threshold = 0.5f;
    pd_graph_mode graphs = PD_GRAPHS_AUTO;
    enum { O_MODEL = 256, O_DRAFT, O_SYN, O_DEVICE, O_CONC, O_POL, O_THR, O_PROMPTS, O_PLEN,
           O_MAXNEW, O_REQ, O_SEED, O_FAST, O_GRAPHS, O_CSV, O_LABEL, O_ARM, O_WARM, O_TRACE, O_HELP };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"draft", required_argument, 0, O_DRAFT},
        {"synthetic", required_argument, 0, O_SYN}, {"device", required_argument, 0, O_DEVICE},
        {"concurrency", required_argument, 0, O_CONC}, {"policies", required_argument, 0, O_POL},
        {"threshold", required_argument, 0, O_THR}, {"prompts", required_argument, 0, O_PROMPTS},
        {"prompt-len", required_argument, 0, O_PLEN}, {"max-new-tokens", required_argument, 0, O_MAXNEW},
        {"requests", required_argument, 0, O_REQ}, {"seed", required_argument, 0, O_SEED},
        {"fast-kernels", no_argument, 0, O_FAST}, {"graphs", required_argument, 0, O_GRAPHS},
        {"csv", required_argument, 0, O_CSV}, {"label", required_argument, 0, O_LABEL},
        {"sched-arm", required_argument, 0, O_ARM}, {"warmup-tokens", required_argument, 0, O_WARM},
        {"sched-trace", required_argument, 0, O_TRACE},
        {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0},
    };
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        int bad = 0;
        pd_err perr;
        switch (c) {
        case O_MODEL: model_dir = optarg; break;
        case O_DRAFT: draft_dir = optarg; break;
        case O_SYN: synthetic = optarg; break;
        case O_DEVICE: device = optarg; break;
        case O_CONC: bad = (n_levels = parse_list(optarg, levels, MAX_LEVELS)) < 1; break;
        case O_POL: policies = optarg; break;
        case O_THR:
            bad = pd_cli_parse_float(PROG, "--threshold", optarg, &threshold);
            if (!bad && !(threshold > 0.0f && threshold <= 1.0f)) {
                fprintf(stderr, PROG ": --threshold %g must be in (0, 1]\n", (double)threshold);
                bad = 1;
            }
            break;
        case O_PROMPTS: prompts_path = optarg; break;
        case O_PLEN: bad = pd_cli_parse_int(PROG, "--prompt-len", optarg, 1, 1 << 20, &prompt_len); break;
        case O_MAXNEW: bad = pd_cli_parse_int(PROG, "--max-new-tokens", optarg, 1, 1 << 20, &max_new); break;
        case O_REQ: bad = pd_cli_parse_int(PROG, "--requests", optarg, 1, 1 << 20, &n_requests); break;
        case O_SEED: bad = pd_cli_parse_int(PROG, "--seed", optarg, 0, INT_MAX, &seed); break;
        case O_FAST: fast = 1; break;
        case O_GRAPHS:
            if (pd_graph_mode_parse(optarg, &graphs, &perr) != PD_OK) {
                fprintf(stderr, PROG ": --graphs: %s\n", perr.msg);
                bad = 1;
            }
            break;
        case O_CSV: csv_path = optarg; break;
        case O_WARM: bad = pd_cli_parse_int(PROG, "--warmup-tokens", optarg, 1, 1 << 20, &warmup); break;
        case O_TRACE: trace_path = optarg; break;
        case O_ARM:
            sched_arm = -1;
            for (int a = 0; a < 4; a++)
                if (strcmp(optarg, (const char *[]){"auto", "plain", "algo1", "all"}[a]) == 0)
                    sched_arm = a;
            if (sched_arm < 0) {
                fprintf(stderr, PROG ": --sched-arm: '%s' is not auto, plain, algo1 or all\n", optarg);
                bad = 1;
            }
            break;
        case O_LABEL:
            label = optarg;
            if (strchr(label, '"') != NULL) {
                fprintf(stderr, PROG ": --label must not contain '\"'\n");
                return 2;
            }
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
    if ((model_dir == NULL) == (synthetic == NULL)) {
        fprintf(stderr, PROG ": give exactly one of --model DIR and --synthetic NAME\n");
        usage(stderr);
        return 2;
    }
    /* policies: "target" = no draft; the rest are pd_verify_policy names */
    int pol_target[8], n_pol = 0;
    pd_verify_policy pol[8];
    {
        char *dup = strdup(policies), *save = NULL;
        for (char *t = strtok_r(dup, ",", &save); t != NULL && n_pol < 8; t = strtok_r(NULL, ",", &save)) {
            pd_err perr;
            pol_target[n_pol] = strcmp(t, "target") == 0;
            if (!pol_target[n_pol] && pd_verify_policy_parse(t, &pol[n_pol], &perr) != PD_OK) {
                fprintf(stderr, PROG ": --policies: %s (or target)\n", perr.msg);
                free(dup);
                return 2;
            }
            n_pol++;
        }
        free(dup);
    }
    pd_err err = {0};
    int rc = 1;
    kern_backend *be = NULL;
    pd_qwen3_model *tm = NULL;
    pd_dspark_model *dm = NULL;
    prompt *pr = calloc(MAX_PROMPTS, sizeof(*pr));
    int n_pr = 0;
    FILE *csv = NULL;
    pd_calib calib;
    int have_calib = 0;
    kern_backend_config bc = { .name = device };
    if (pr == NULL || kern_backend_create(&bc, &be, &err) != PD_OK)
        goto fail;
    if (synthetic != NULL) {
        if (pd_qwen3_synthetic(be, synthetic, (uint64_t)seed, &tm, &err) != PD_OK ||
            pd_dspark_synthetic(be, tm, 2, 7, (uint64_t)seed + 1, &dm, &err) != PD_OK)
            goto fail;
    } else {
        if (pd_qwen3_load(be, model_dir, &tm, &err) != PD_OK)
            goto fail;
        if (draft_dir != NULL && pd_dspark_load(be, draft_dir, tm, &dm, &err) != PD_OK)
            goto fail;
        if (dm != NULL) {
            pd_err cerr;
            pd_status cs = pd_calib_load(draft_dir, &calib, &cerr);
            if (cs == PD_OK)
                have_calib = 1;
            else if (cs != PD_ERR_NOT_FOUND)
                PD_LOG_WARN("loadsim", "ignoring the confidence calibration: %s", cerr.msg);
        }
    }
    if (prompts_path != NULL) {
        if ((n_pr = load_prompts(prompts_path, pr, MAX_PROMPTS)) < 0)
            goto out;
    } else {
        uint64_t s = (uint64_t)seed * 0x9E3779B97F4A7C15ull + 1;
        n_pr = 64;
        for (int i = 0; i < n_pr; i++) {
            pr[i].n = prompt_len;
            pr[i].ids = malloc((size_t)prompt_len * sizeof(int32_t));
            for (int j = 0; j < prompt_len; j++) {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                pr[i].ids[j] = (int32_t)(s % (uint64_t)tm->cfg.vocab_size);
            }
        }
    }
    int max_prompt = 0;
    for (int i = 0; i < n_pr; i++)
        max_prompt = pr[i].n > max_prompt ? pr[i].n : max_prompt;
    if (trace_path != NULL && (trace = fopen(trace_path, "w")) == NULL) {
        fprintf(stderr, PROG ": --sched-trace %s: cannot open\n", trace_path);
        goto out;
    }
    if (csv_path != NULL && (csv = fopen(csv_path, "w")) == NULL) {
        fprintf(stderr, PROG ": --csv %s: cannot open\n", csv_path);
        goto out;
    }
    if (csv != NULL)
        fprintf(csv, "label,policy,concurrency,requests,output_tokens,wall_s,tokens_per_s,mean_itl_ms,"
                     "mean_ttft_ms,tau,verified_per_round\n");
    printf("%-10s %5s %8s %10s %10s %10s %6s %9s\n", "policy", "conc", "requests", "tok/s",
           "ITL ms", "TTFT ms", "tau", "verified");
    for (int li = 0; li < n_levels; li++) {
        int C = levels[li];
        int R = n_requests > 0 ? n_requests : (2 * C > 16 ? 2 * C : 16);
        for (int pi = 0; pi < n_pol; pi++) {
            int with_draft = !pol_target[pi] && dm != NULL;
            int B = with_draft ? dm->cfg.block_size : 0;
            int per_req = (max_prompt + max_new + B + 2 + 15) / 16 + 1;
            /* the scheduler's SPS profile runs C * (B + 1) tokens over 256-token contexts, 8
             * tokens per sequence, next to nothing else */
            int prof = with_draft ? (C * (B + 1) + 7) / 8 * ((256 + 8 + 15) / 16 + 1) : 0;
            int pages = (C * per_req > prof ? C * per_req : prof) + 64;
            pd_engine_config ec = { .target = tm, .draft = with_draft ? dm : NULL, .page_size = 16,
                                    .n_pages = pages, .draft_n_pages = pages,
                                    .verify_policy = pol_target[pi] ? PD_VERIFY_FULL : pol[pi],
                                    .verify_threshold = threshold, .fast_kernels = fast, .sched_debug_arm = sched_arm,
                                    .graphs = graphs, .calib = have_calib ? &calib : NULL,
                                    .sched_trace = with_draft && pol[pi] == PD_VERIFY_SCHEDULED ? trace : NULL };
            if (ec.sched_trace != NULL)
                fprintf(trace, "# C=%d: warm-up level (%d requests of %d tokens), then %d requests\n", C, C,
                        warmup, R);
            pd_engine *e = NULL;
            pd_sps sps = {0};
            if (pd_engine_create(&ec, &e, &err) != PD_OK)
                goto fail;
            if (with_draft && pol[pi] == PD_VERIFY_SCHEDULED) {
                if (pd_engine_profile_sps(e, C * (B + 1), 256, NULL, NULL, &sps, &err) != PD_OK) {
                    pd_engine_destroy(e);
                    goto fail;
                }
                pd_engine_set_sps(e, &sps);
            }
            level_result res = {0};
            const char *pname = pol_target[pi] ? "target" : pd_verify_policy_name(pol[pi]);
            /* a short warm-up level first: graph captures and scratch growth stay out of the timing */
            pd_status st = run_level(e, pr, n_pr, C, C, pol_target[pi] ? PD_VERIFY_DEFAULT : pol[pi],
                                     threshold, warmup, &res, &err);
            if (ec.sched_trace != NULL)
                fprintf(trace, "# C=%d: timed level\n", C);
            pd_engine_times t_warm = *pd_engine_phase_times(e);
            uint64_t g_eager0 = 0, g_cap0 = 0, g_rep0 = 0;
            pd_engine_graph_stats(e, &g_eager0, &g_cap0, &g_rep0);
            long warm_picks[PD_SCHED_ARMS];
            memcpy(warm_picks, pd_engine_sched(e)->n_arm, sizeof(warm_picks));
            if (st == PD_OK)
                st = run_level(e, pr, n_pr, C, R, pol_target[pi] ? PD_VERIFY_DEFAULT : pol[pi], threshold,
                               max_new, &res, &err);
            char arms[1024] = "";
            if (st == PD_OK && with_draft && pol[pi] == PD_VERIFY_SCHEDULED) {
                const pd_sched_ctl *sc = pd_engine_sched(e);
                snprintf(arms, sizeof(arms),
                         "  scheduled arms at C=%d: rounds plain/algo1/all %ld/%ld/%ld (warm-up %ld/%ld/%ld; "
                         "%ld all-drafts probes of new requests), estimated tok/s %.0f/%.0f/%.0f\n", C,
                         sc->n_arm[PD_SCHED_PLAIN] - warm_picks[PD_SCHED_PLAIN],
                         sc->n_arm[PD_SCHED_ALGO1] - warm_picks[PD_SCHED_ALGO1],
                         sc->n_arm[PD_SCHED_ALL] - warm_picks[PD_SCHED_ALL], warm_picks[PD_SCHED_PLAIN],
                         warm_picks[PD_SCHED_ALGO1], warm_picks[PD_SCHED_ALL], sc->n_probes,
                         pd_sched_estimate(sc, PD_SCHED_PLAIN, C), pd_sched_estimate(sc, PD_SCHED_ALGO1, C),
                         pd_sched_estimate(sc, PD_SCHED_ALL, C));
                static const char *arm_name[PD_SCHED_ARMS] = { "plain", "algo1", "all" };
                for (int a = 0; a < PD_SCHED_ARMS; a++) {
                    pd_sched_parts sp;
                    pd_sched_parts_of(sc, (pd_sched_arm)a, C, &sp);
                    size_t used = strlen(arms);
                    snprintf(arms + used, sizeof(arms) - used,
                             "    %-5s: %d rounds recorded; per round %.2f tok/request, %.1f verify tok %.1f us "
                             "(SPS) + rest %.1f us + draft %.1f us = %.1f us\n", arm_name[a], sp.n, sp.tau,
                             sp.verify_tok, sp.verify_s * 1e6, sp.rest_s * 1e6, sp.draft_s * 1e6,
                             sp.round_s * 1e6);
                }
            }
            char phases[768] = "";
            const pd_engine_times *pt = pd_engine_phase_times(e);
            long n_rounds = pt->rounds - t_warm.rounds;
            if (st == PD_OK && n_rounds > 0) {
                double k = 1e6 / (double)n_rounds;
#define PH(f) ((pt->f - t_warm.f) * k)
                uint64_t g_eager = 0, g_cap = 0, g_rep = 0;
                pd_engine_graph_stats(e, &g_eager, &g_cap, &g_rep);
                snprintf(phases, sizeof(phases),
                         "  host us per round (%ld rounds): step %.1f = prefill %.1f (target %.1f, draft %.1f) "
                         "+ round %.1f (reserve/pick %.1f, flush %.1f, draft %.1f, verify %.1f, commit %.1f, "
                         "extend %.1f); graphs: %llu eager, %llu captures, %llu replays; deferred context: %ld flushes, "
                         "%ld compactions\n",
                         n_rounds, PH(step), PH(prefill), PH(prefill_target), PH(prefill_draft), PH(round),
                         PH(reserve), PH(flush), PH(draft), PH(verify), PH(commit), PH(extend),
                         (unsigned long long)(g_eager - g_eager0), (unsigned long long)(g_cap - g_cap0),
                         (unsigned long long)(g_rep - g_rep0), pt->pend_flushes - t_warm.pend_flushes,
                         pt->pend_compactions - t_warm.pend_compactions);
#undef PH
            }
            pd_engine_destroy(e);
            pd_sps_cleanup(&sps);
            if (st != PD_OK)
                goto fail;
            printf("%-10s %5d %8d %10.1f %10.3f %10.1f %6.3f %9.2f\n", pname, C, res.requests,
                   res.tokens_per_s, res.itl_ms, res.ttft_ms, res.tau, res.verified);
            fputs(arms, stdout);
            fputs(phases, stdout);
            fflush(stdout);
            if (csv != NULL) {
                fprintf(csv, "\"%s\",%s,%d,%d,%ld,%.4f,%.2f,%.4f,%.3f,%.4f,%.3f\n",
                        label != NULL ? label : (synthetic != NULL ? synthetic : model_dir), pname, C,
                        res.requests, res.out_tokens, res.wall_s, res.tokens_per_s, res.itl_ms,
                        res.ttft_ms, res.tau, res.verified);
                fflush(csv);
            }
        }
    }
    rc = 0;
    goto out;
fail:
    fprintf(stderr, PROG ": %s\n", err.msg);
out:
    if (csv != NULL)
        fclose(csv);
    if (trace != NULL)
        fclose(trace);
    for (int i = 0; pr != NULL && i < n_pr; i++)
        free(pr[i].ids);
    free(pr);
    pd_dspark_free(dm);
    pd_qwen3_free(tm);
    kern_backend_destroy(be);
    return rc;
}
