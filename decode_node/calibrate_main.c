/* calibrate_main.c - pdspark-calibrate: Sequential Temperature Scaling of the DSpark confidence
 *   head. Runs greedy speculative decoding with full verification over a prompt set, records each
 *   round's confidence logits and how many drafts survived, fits one temperature per position on
 *   the first part of the prompts (position k is fitted on the rounds that reached it: c_k is the
 *   survival probability of draft k given drafts < k survived), and reports the expected
 *   calibration error of prefix survival per position on the held-out rest, before and after.
 *   Writes <draft>/dspark_calibration.json (or --out), which decode_node and pdspark-generate
 *   load when present.
 * Threading: single-threaded. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cli.h"
#include "pd_engine.h"
#include "pd_json.h"
#include "pd_log.h"
#include "pd_verify_policy.h"

typedef struct {
    int32_t *ids;
    int n;
} prompt;

static int load_prompts(const char *path, prompt **out, int *n_out)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "pdspark-calibrate: %s: %s\n", path, strerror(errno));
        return -1;
    }
    prompt *ps = NULL;
    int n = 0, lineno = 0;
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, f) > 0) {
        lineno++;
        cJSON *o = pd_json_parse_str(line, NULL);
        cJSON *ids = cJSON_GetObjectItem(o, "input_ids");
        if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) < 1) {
            cJSON_Delete(o);
            if (line[0] == '\n')
                continue;
            fprintf(stderr, "pdspark-calibrate: %s:%d: expected a JSON object with input_ids\n", path, lineno);
            free(line);
            fclose(f);
            return -1;
        }
        ps = realloc(ps, (size_t)(n + 1) * sizeof(*ps));
        ps[n].n = cJSON_GetArraySize(ids);
        ps[n].ids = malloc((size_t)ps[n].n * sizeof(int32_t));
        for (int i = 0; i < ps[n].n; i++)
            ps[n].ids[i] = cJSON_GetArrayItem(ids, i)->valueint;
        n++;
        cJSON_Delete(o);
    }
    free(line);
    fclose(f);
    *out = ps;
    *n_out = n;
    return 0;
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, "pdspark-calibrate"))
        return 0;
    const char *model = NULL, *draft = NULL, *prompts_path = NULL, *out_path = NULL, *device = "cpu";
    int max_new = 128, concurrency = 8;
    double fit_fraction = 0.5;
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"draft", required_argument, 0, 'd'},
        {"prompts", required_argument, 0, 'p'}, {"out", required_argument, 0, 'o'},
        {"device", required_argument, 0, 'D'}, {"max-new-tokens", required_argument, 0, 'n'},
        {"fit-fraction", required_argument, 0, 'f'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0},
    };
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'd': draft = optarg; break;
        case 'p': prompts_path = optarg; break;
        case 'o': out_path = optarg; break;
        case 'D': device = optarg; break;
        case 'n': max_new = atoi(optarg); break;
        case 'f': fit_fraction = atof(optarg); break;
        case 'h':
            printf("usage: pdspark-calibrate --model DIR --draft DIR --prompts FILE.jsonl [--out PATH]\n"
                   "                         [--fit-fraction F] [--max-new-tokens N] [--device cpu|cuda]\n"
                   "FILE.jsonl: one {\"input_ids\": [...]} per line; the first F of the prompts fit the\n"
                   "temperatures, the rest measure the calibration error.\n");
            return 0;
        default:
            return pd_cli_bad_flag("pdspark-calibrate", argv[optind - 1]);
        }
    }
    if (model == NULL || draft == NULL || prompts_path == NULL) {
        fprintf(stderr, "pdspark-calibrate: --model, --draft and --prompts are required\n");
        return 2;
    }
    if (max_new < 1 || !(fit_fraction > 0.0 && fit_fraction < 1.0)) {
        fprintf(stderr, "pdspark-calibrate: --max-new-tokens must be >= 1 and --fit-fraction in (0, 1)\n");
        return 2;
    }
    prompt *ps = NULL;
    int n_p = 0;
    if (load_prompts(prompts_path, &ps, &n_p) != 0)
        return 1;
    if (n_p < 2) {
        fprintf(stderr, "pdspark-calibrate: need at least 2 prompts, %s has %d\n", prompts_path, n_p);
        return 1;
    }
    pd_err err = {0};
    kern_backend *be = NULL;
    pd_qwen3_model *tm = NULL;
    pd_dspark_model *dm = NULL;
    pd_engine *e = NULL;
    kern_backend_config bc = { .name = device };
    if (kern_backend_create(&bc, &be, &err) != PD_OK || pd_qwen3_load(be, model, &tm, &err) != PD_OK ||
        pd_dspark_load(be, draft, tm, &dm, &err) != PD_OK) {
        fprintf(stderr, "pdspark-calibrate: %s\n", err.msg);
        return 1;
    }
    if (!dm->cfg.enable_confidence_head) {
        fprintf(stderr, "pdspark-calibrate: %s has no confidence head\n", draft);
        return 1;
    }
    pd_engine_config ec = { .target = tm, .draft = dm };
    if (pd_engine_create(&ec, &e, &err) != PD_OK) {
        fprintf(stderr, "pdspark-calibrate: %s\n", err.msg);
        return 1;
    }
    int B = pd_engine_block_size(e);
    int n_fit = (int)(n_p * fit_fraction);
    if (n_fit < 1)
        n_fit = 1;
    if (n_fit >= n_p)
        n_fit = n_p - 1;
    /* per round: B logits + accepted drafts; split into fit and held-out by prompt */
    float *logits[2] = {NULL, NULL};
    int *acc[2] = {NULL, NULL}, n_r[2] = {0, 0};
    pd_gen_params gp = { .sample = { .temperature = 0.0f, .top_p = 1.0f }, .max_new_tokens = max_new,
                         .verify_policy = PD_VERIFY_FULL, .record_confidence = 1 };
    pd_request **live = calloc((size_t)concurrency, sizeof(*live));
    int *owner = calloc((size_t)concurrency, sizeof(int));
    int next = 0, done = 0;
    while (done < n_p) {
        for (int s = 0; s < concurrency && next < n_p; s++)
            if (live[s] == NULL) {
                if (pd_engine_add(e, (uint64_t)next, ps[next].ids, ps[next].n, &gp, &live[s], &err) != PD_OK) {
                    fprintf(stderr, "pdspark-calibrate: prompt %d: %s\n", next, err.msg);
                    return 1;
                }
                owner[s] = next++;
            }
        if (pd_engine_step(e, &err) != PD_OK) {
            fprintf(stderr, "pdspark-calibrate: %s\n", err.msg);
            return 1;
        }
        for (int s = 0; s < concurrency; s++) {
            pd_request *r = live[s];
            if (r == NULL || r->finish == PD_FINISH_NONE)
                continue;
            int set = owner[s] < n_fit ? 0 : 1;
            for (int k = 0; k < r->n_conf_rounds && k < r->n_rounds; k++) {
                if (r->verified[k] < B)
                    continue;   /* cut short by the context end: not a full observation */
                if (k == r->n_rounds - 1 && r->finish == PD_FINISH_STOP)
                    continue;   /* a stop token may have ended it without a bonus token */
                logits[set] = realloc(logits[set], (size_t)(n_r[set] + 1) * B * sizeof(float));
                acc[set] = realloc(acc[set], (size_t)(n_r[set] + 1) * sizeof(int));
                memcpy(logits[set] + (size_t)n_r[set] * B, r->conf_log + (size_t)k * B, (size_t)B * sizeof(float));
                int a = r->accepted[k] - 1;   /* accepted[] counts the bonus token */
                acc[set][n_r[set]] = a < 0 ? 0 : a;
                n_r[set]++;
            }
            fprintf(stderr, "\rpdspark-calibrate: %d/%d prompts", ++done, n_p);
            pd_engine_release(e, r);
            live[s] = NULL;
        }
    }
    fputc('\n', stderr);
    /* observations: position k is seen in rounds that accepted at least k drafts */
    pd_calib_obs *obs = malloc((size_t)(n_r[0] * B + 1) * sizeof(*obs));
    int n_obs = 0;
    for (int r = 0; r < n_r[0]; r++)
        for (int k = 0; k < B && k <= acc[0][r]; k++)
            obs[n_obs++] = (pd_calib_obs){ .k = k, .logit = logits[0][(size_t)r * B + k], .survived = acc[0][r] > k };
    pd_calib fit, id;
    pd_calib_fit(obs, n_obs, B, &fit);
    pd_calib_identity(&id, B);
    double before[PD_CALIB_MAX], after[PD_CALIB_MAX], fit_before[PD_CALIB_MAX], fit_after[PD_CALIB_MAX];
    pd_calib_ece(logits[1], acc[1], n_r[1], B, &id, before);
    pd_calib_ece(logits[1], acc[1], n_r[1], B, &fit, after);
    pd_calib_ece(logits[0], acc[0], n_r[0], B, &id, fit_before);
    pd_calib_ece(logits[0], acc[0], n_r[0], B, &fit, fit_after);
    printf("pdspark-calibrate: %d prompts (%d fit, %d held out), %d + %d rounds, block %d\n", n_p, n_fit, n_p - n_fit,
           n_r[0], n_r[1], B);
    printf("position  temperature  ECE(held-out) before  after   ECE(fit set) before  after\n");
    for (int k = 0; k < B; k++)
        printf("%8d  %11.3f  %20.4f  %6.4f  %19.4f  %6.4f\n", k, fit.temp[k], before[k], after[k], fit_before[k],
               fit_after[k]);
    char path[4096];
    if (out_path == NULL) {
        snprintf(path, sizeof(path), "%s/dspark_calibration.json", draft);
        out_path = path;
    }
    int rc = 0;
    if (pd_calib_save(out_path, &fit, before, after, n_r[0], &err) != PD_OK) {
        fprintf(stderr, "pdspark-calibrate: %s\n", err.msg);
        rc = 1;
    } else {
        printf("wrote %s\n", out_path);
    }
    free(obs);
    for (int i = 0; i < 2; i++) {
        free(logits[i]);
        free(acc[i]);
    }
    for (int i = 0; i < n_p; i++)
        free(ps[i].ids);
    free(ps);
    free(live);
    free(owner);
    pd_engine_destroy(e);
    pd_dspark_free(dm);
    pd_qwen3_free(tm);
    kern_backend_destroy(be);
    return rc;
}
