/* decode_metrics.c - the decode node's metrics and per-request log lines (decode_metrics.h).
 * Owns: series handles into the shared registry, the cumulative DSpark sums behind tau and the
 *   per-position acceptance rates (under mu), the attached server for the collect callback.
 * Not here: rendering (pd_metrics.c), the request lifecycle (decode_server.c).
 * Threading: observer callbacks on the engine thread; the collect callback on the HTTP thread;
 *   mu guards the DSpark sums and the attached server pointer. */
#include "decode_metrics.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd_cli.h"
#include "pd_grammar.h"
#include "pd_log.h"

#define MAX_POS 64

struct decode_metrics {
    pd_metrics *reg;
    decode_observer obs;
    pthread_mutex_t mu;
    decode_server *s;                /* under mu */
    atomic_int draining;
    /* DSpark sums (under mu) */
    double rounds, accepted;
    double at_pos[MAX_POS];
    int block_size;
    pd_metric *pos_acc[MAX_POS], *pos_rate[MAX_POS];
    /* series */
    pd_metric *req_ok, *req_cancelled, *req_timeout, *req_busy, *req_peer, *req_invalid, *req_error;
    pd_metric *fin_stop, *fin_length;
    pd_metric *prompt_tokens, *gen_tokens, *cached_tokens;
    pd_metric *gcache_hits, *gcache_misses;  /* structured-output grammars reused / compiled */
    pd_metric *preempt, *swapped, *swap_bytes, *swap_held;   /* --swap-space */
    uint64_t preempt_seen;
    pd_metric *stage_used, *stage_total, *stage_waits;   /* the KV staging pool */
    uint64_t stage_waits_seen;
    uint64_t gc_hits_seen, gc_misses_seen;
    pd_metric *running, *queued, *kv_used, *kv_free, *kv_total, *prefill_inflight, *serving,
              *draining_g;
    pd_metric *ttft, *itl, *e2e, *apr, *rounds_c, *accepted_c, *tau;
    pd_metric *queue, *pf_call, *pf_join;   /* the first token's parts */
    /* vLLM's names (decode_metrics_vllm_names; NULL: not exported) */
    pd_metric *v_running, *v_waiting, *v_kv, *v_kv_old, *v_preempt, *v_prompt, *v_gen, *v_stop, *v_length,
              *v_ttft, *v_e2e;
};

/* ---------------------------------------------------------------------------------------------
 * Observer (engine thread) */

static void obs_token(void *ud, const decode_chunk *c, double gap_ms, int first)
{
    decode_metrics *m = ud;
    if (first || c->n_ids <= 0)
        return;
    /* a DSpark round commits several tokens at once: spread the gap over them */
    pd_metric_observe_n(m->itl, gap_ms / 1000.0 / c->n_ids, (uint64_t)c->n_ids);
}

static const char *outcome_of(const decode_result *r)
{
    switch (r->status) {
    case PD_OK: return "ok";
    case PD_ERR_CANCELLED: return "cancelled";
    case PD_ERR_TIMEOUT: return "timeout";
    case PD_ERR_BUSY: return "busy";
    case PD_ERR_PEER: return "peer_error";
    case PD_ERR_INVALID: return "invalid";
    default: return "error";
    }
}

static void log_request(const decode_result *r, const char *outcome)
{
    if (PD_LOG_LEVEL_INFO > pd_log_cur_level)
        return;
    if (pd_log_get_format() != PD_LOG_FORMAT_JSON) {
        pd_log_write(PD_LOG_LEVEL_INFO, "request",
                     "%s: %s, finish %s, prompt %d tokens, generated %d tokens, rounds %d, "
                     "tau %.3f, ttft %.1f ms, total %.1f ms%s%s",
                     r->request_id, outcome, pd_finish_reason_str(r->finish), r->prompt_tokens,
                     r->n_tokens, r->rounds, r->tau, r->ttft_ms, r->time_ms,
                     r->status != PD_OK ? ": " : "", r->status != PD_OK ? r->error : "");
        return;
    }
    /* JSON: the fields as keys (not inside "msg"), one object per line like pd_log's */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char when[48], stamp[64];
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(stamp, sizeof(stamp), "%s.%03ldZ", when, ts.tv_nsec / 1000000);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "ts", stamp);
    cJSON_AddStringToObject(o, "level", "info");
    cJSON_AddStringToObject(o, "module", "request");
    cJSON_AddStringToObject(o, "msg", "request done");
    char id[256], error[1024];   /* what a client sent, as pd_log would print it */
    cJSON_AddStringToObject(o, "id", pd_log_clean(id, sizeof(id), r->request_id));
    cJSON_AddStringToObject(o, "outcome", outcome);
    cJSON_AddStringToObject(o, "finish", pd_finish_reason_str(r->finish));
    cJSON_AddNumberToObject(o, "prompt_tokens", r->prompt_tokens);
    cJSON_AddNumberToObject(o, "cached_tokens", r->cached_tokens);
    cJSON_AddNumberToObject(o, "generated_tokens", r->n_tokens);
    cJSON_AddNumberToObject(o, "rounds", r->rounds);
    cJSON_AddNumberToObject(o, "tau", (double)(long)(r->tau * 1000.0 + 0.5) / 1000.0);
    cJSON_AddNumberToObject(o, "ttft_ms", (double)(long)(r->ttft_ms * 10.0 + 0.5) / 10.0);
    cJSON_AddNumberToObject(o, "total_ms", (double)(long)(r->time_ms * 10.0 + 0.5) / 10.0);
    /* the first token's parts, where the request got that far */
    const char *part[3] = {"queue_ms", "prefill_call_ms", "prefill_join_ms"};
    const double ms[3] = {r->queue_ms, r->prefill_call_ms, r->prefill_join_ms};
    for (int i = 0; i < 3; i++)
        if (ms[i] >= 0)
            cJSON_AddNumberToObject(o, part[i], (double)(long)(ms[i] * 10.0 + 0.5) / 10.0);
    if (r->status != PD_OK)
        cJSON_AddStringToObject(o, "error", pd_log_clean(error, sizeof(error), r->error != NULL ? r->error : ""));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (s != NULL) {
        fprintf(stderr, "%s\n", s);
        free(s);
    }
}

static void ensure_positions(decode_metrics *m, int block_size)
{
    /* under mu; the block size is fixed per server, so this registers once */
    int n = block_size < MAX_POS ? block_size : MAX_POS;
    for (int k = 0; k < n; k++) {
        if (m->pos_acc[k] != NULL)
            continue;
        char lab[32];
        snprintf(lab, sizeof(lab), "position=\"%d\"", k + 1);
        m->pos_acc[k] = pd_metrics_counter(m->reg, "pdspark_dspark_accepted_at_position_total",
                                           "DSpark rounds whose draft token at this block "
                                           "position (1-based) was accepted", lab);
        m->pos_rate[k] = pd_metrics_gauge(m->reg, "pdspark_dspark_acceptance_rate",
                                          "Fraction of DSpark rounds whose draft token at this "
                                          "position was accepted (cumulative)", lab);
    }
    if (n > m->block_size)
        m->block_size = n;
}

static void obs_done(void *ud, const decode_result *r)
{
    decode_metrics *m = ud;
    const char *outcome = outcome_of(r);
    pd_metric *c = r->status == PD_OK ? m->req_ok : r->status == PD_ERR_CANCELLED ? m->req_cancelled
                 : r->status == PD_ERR_TIMEOUT ? m->req_timeout : r->status == PD_ERR_BUSY ? m->req_busy
                 : r->status == PD_ERR_PEER ? m->req_peer : r->status == PD_ERR_INVALID ? m->req_invalid
                 : m->req_error;
    pd_metric_inc(c);
    if (r->status == PD_OK) {
        pd_metric_inc(r->finish == PD_FINISH_LENGTH ? m->fin_length : m->fin_stop);
        pd_metric_inc(r->finish == PD_FINISH_LENGTH ? m->v_length : m->v_stop);
        pd_metric_observe(m->v_e2e, r->time_ms / 1000.0);
    }
    pd_metric_add(m->prompt_tokens, r->prompt_tokens);
    pd_metric_add(m->v_prompt, r->prompt_tokens);
    pd_metric_add(m->cached_tokens, r->cached_tokens);
    pd_metric_add(m->gen_tokens, r->n_tokens);
    pd_metric_add(m->v_gen, r->n_tokens);
    if (r->n_tokens > 0) {
        pd_metric_observe(m->ttft, r->ttft_ms / 1000.0);
        pd_metric_observe(m->v_ttft, r->ttft_ms / 1000.0);
    }
    if (r->queue_ms >= 0)
        pd_metric_observe(m->queue, r->queue_ms / 1000.0);
    if (r->prefill_call_ms >= 0 && r->n_tokens > 0)
        pd_metric_observe(m->pf_call, r->prefill_call_ms / 1000.0);
    if (r->prefill_join_ms >= 0 && r->n_tokens > 0)
        pd_metric_observe(m->pf_join, r->prefill_join_ms / 1000.0);
    if (r->status == PD_OK)
        pd_metric_observe(m->e2e, r->time_ms / 1000.0);
    pd_metric_add(m->rounds_c, r->rounds);
    long acc = 0;
    for (int i = 0; i < r->rounds && r->accepted_per_round != NULL; i++) {
        pd_metric_observe(m->apr, r->accepted_per_round[i]);
        acc += r->accepted_per_round[i];
    }
    pd_metric_add(m->accepted_c, (double)acc);
    pthread_mutex_lock(&m->mu);
    m->rounds += r->rounds;
    m->accepted += (double)acc;
    if (r->block_size > 0 && r->accepted_at_pos != NULL && r->rounds > 0) {
        ensure_positions(m, r->block_size);
        for (int k = 0; k < r->block_size && k < MAX_POS; k++) {
            m->at_pos[k] += r->accepted_at_pos[k];
            pd_metric_add(m->pos_acc[k], r->accepted_at_pos[k]);
        }
    }
    pthread_mutex_unlock(&m->mu);
    log_request(r, outcome);
}

/* ---------------------------------------------------------------------------------------------
 * Scrape (HTTP thread) */

static void collect(void *ud)
{
    decode_metrics *m = ud;
    pthread_mutex_lock(&m->mu);
    if (m->s != NULL) {
        decode_stats st;
        decode_server_stats(m->s, &st);
        pd_metric_set(m->running, st.active_requests);
        pd_metric_set(m->queued, st.queued_requests);
        pd_metric_set(m->kv_used, st.pages_in_use);
        pd_metric_set(m->kv_free, st.free_kv_pages);
        pd_metric_set(m->kv_total, st.total_kv_pages);
        pd_metric_set(m->prefill_inflight, st.prefill_inflight);
        pd_metric_set(m->serving, st.serving && !atomic_load(&m->draining));
        uint64_t hits = 0, misses = 0;
        pd_gcache_stats(decode_server_grammars(m->s), &hits, &misses);
        pd_metric_add(m->gcache_hits, (double)(hits - m->gc_hits_seen));
        pd_metric_add(m->gcache_misses, (double)(misses - m->gc_misses_seen));
        pd_metric_add(m->preempt, (double)(st.preemptions - m->preempt_seen));
        pd_metric_add(m->v_preempt, (double)(st.preemptions - m->preempt_seen));
        pd_metric_set(m->v_running, st.active_requests);
        pd_metric_set(m->v_waiting, st.queued_requests);
        double usage = st.total_kv_pages > 0 ? (double)st.pages_in_use / st.total_kv_pages : 0.0;
        pd_metric_set(m->v_kv, usage);
        pd_metric_set(m->v_kv_old, usage);
        m->preempt_seen = st.preemptions;
        pd_metric_set(m->swapped, st.swapped_requests);
        pd_metric_set(m->stage_used, st.staging_pages_used);
        pd_metric_set(m->stage_total, st.staging_pages);
        pd_metric_add(m->stage_waits, (double)(st.staging_waits - m->stage_waits_seen));
        m->stage_waits_seen = st.staging_waits;
        pd_metric_set(m->swap_bytes, (double)st.swap_bytes);
        pd_metric_set(m->swap_held, (double)st.swap_held);
        m->gc_hits_seen = hits;
        m->gc_misses_seen = misses;
    }
    pd_metric_set(m->draining_g, atomic_load(&m->draining));
    pd_metric_set(m->tau, m->rounds > 0 ? m->accepted / m->rounds : 0.0);
    for (int k = 0; k < m->block_size; k++)
        pd_metric_set(m->pos_rate[k], m->rounds > 0 ? m->at_pos[k] / m->rounds : 0.0);
    pthread_mutex_unlock(&m->mu);
}

/* ---------------------------------------------------------------------------------------------
 * Lifetime */

void decode_metrics_vllm_names(decode_metrics *m, const char *model)
{
    char esc[512], lab[600], fin[700];
    pd_metrics_label_escape(esc, sizeof(esc), model);
    snprintf(lab, sizeof(lab), "model_name=\"%s\"", esc);
    pd_metrics *reg = m->reg;
    m->v_running = pd_metrics_gauge(reg, "vllm:num_requests_running", "Requests running (pdspark_requests_running)",
                                    lab);
    m->v_waiting = pd_metrics_gauge(reg, "vllm:num_requests_waiting", "Requests waiting (pdspark_requests_queued)",
                                    lab);
    m->v_kv = pd_metrics_gauge(reg, "vllm:kv_cache_usage_perc", "KV pool usage, 0..1 (pdspark_kv_pages_used / "
                               "pdspark_kv_pages_total)", lab);
    m->v_kv_old = pd_metrics_gauge(reg, "vllm:gpu_cache_usage_perc", "KV pool usage, 0..1 (vLLM's older name)",
                                   lab);
    m->v_preempt = pd_metrics_counter(reg, "vllm:num_preemptions_total", "Preemptions (pdspark_preemptions_total)",
                                      lab);
    m->v_prompt = pd_metrics_counter(reg, "vllm:prompt_tokens_total", "Prompt tokens (pdspark_prompt_tokens_total)",
                                     lab);
    m->v_gen = pd_metrics_counter(reg, "vllm:generation_tokens_total",
                                  "Generated tokens (pdspark_generation_tokens_total)", lab);
    snprintf(fin, sizeof(fin), "%s,finished_reason=\"stop\"", lab);
    m->v_stop = pd_metrics_counter(reg, "vllm:request_success_total", "Successful requests by finish reason", fin);
    snprintf(fin, sizeof(fin), "%s,finished_reason=\"length\"", lab);
    m->v_length = pd_metrics_counter(reg, "vllm:request_success_total", "Successful requests by finish reason", fin);
    double b[16];
    pd_metrics_exp_buckets(0.005, 2.0, 14, b);
    m->v_ttft = pd_metrics_histogram(reg, "vllm:time_to_first_token_seconds",
                                     "Time to first token (pdspark_time_to_first_token_seconds)", lab, b, 14);
    m->v_e2e = pd_metrics_histogram(reg, "vllm:e2e_request_latency_seconds",
                                    "End-to-end latency of successful requests (pdspark_request_duration_seconds)",
                                    lab, b, 14);
}

#define REQ_HELP "Requests by outcome (ok, cancelled, timeout, busy, peer_error, invalid, " \
                 "draining, error)"

pd_status decode_metrics_create(pd_metrics *reg, decode_metrics **out, pd_err *err)
{
    decode_metrics *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "decode metrics");
    m->reg = reg;
    pthread_mutex_init(&m->mu, NULL);
    atomic_init(&m->draining, 0);
    m->obs.on_token = obs_token;
    m->obs.on_done = obs_done;
    m->obs.ud = m;
    pd_metrics_build_info(reg, pd_cli_version(), pd_cli_commit());
    const char *rq = "pdspark_requests_total";
    m->req_ok = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"ok\"");
    m->req_cancelled = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"cancelled\"");
    m->req_timeout = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"timeout\"");
    m->req_busy = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"busy\"");
    m->req_peer = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"peer_error\"");
    m->req_invalid = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"invalid\"");
    pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"draining\"");
    m->req_error = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"error\"");
    const char *fh = "Successful requests by finish reason (stop = eos or a stop string "
                     "through the engine, length = max tokens)";
    m->fin_stop = pd_metrics_counter(reg, "pdspark_request_finish_total", fh, "reason=\"stop\"");
    m->fin_length = pd_metrics_counter(reg, "pdspark_request_finish_total", fh, "reason=\"length\"");
    m->prompt_tokens = pd_metrics_counter(reg, "pdspark_prompt_tokens_total",
                                          "Prompt tokens of finished requests", NULL);
    m->cached_tokens = pd_metrics_counter(reg, "pdspark_prompt_cached_tokens_total",
                                          "Prompt tokens of finished requests served from the prefix cache",
                                          NULL);
    m->gcache_hits = pd_metrics_counter(reg, "pdspark_grammar_cache_hits_total",
                                        "Structured-output grammars served from the compile cache", NULL);
    m->gcache_misses = pd_metrics_counter(reg, "pdspark_grammar_cache_misses_total",
                                          "Structured-output grammars compiled (cache misses, failures included)",
                                          NULL);
    m->preempt = pd_metrics_counter(reg, "pdspark_preemptions_total",
                                    "Requests preempted when the KV pool ran out (their KV swapped to host "
                                    "memory, resumed later)", NULL);
    m->swapped = pd_metrics_gauge(reg, "pdspark_requests_swapped",
                                  "Requests preempted now (their KV in host memory)", NULL);
    m->swap_bytes = pd_metrics_gauge(reg, "pdspark_swap_bytes", "Host bytes holding preempted requests' KV",
                                     NULL);
    m->swap_held = pd_metrics_gauge(reg, "pdspark_swap_space_held_bytes",
                                    "Host memory the swap space's pinned arena holds (GPU backends; kept "
                                    "once taken, 0 without one)", NULL);
    m->stage_used = pd_metrics_gauge(reg, "pdspark_kv_staging_pages_used",
                                     "KV staging pages held by requests (from their Prefill call until "
                                     "no put of it can land)", NULL);
    m->stage_total = pd_metrics_gauge(reg, "pdspark_kv_staging_pages_total",
                                      "Host pages prefill nodes put KV into where they cannot reach the "
                                      "pool (0 = no staging)", NULL);
    m->stage_waits = pd_metrics_counter(reg, "pdspark_kv_staging_waits_total",
                                        "Requests that waited at the head of the queue for KV staging "
                                        "pages (the ones behind it wait with it)", NULL);
    m->gen_tokens = pd_metrics_counter(reg, "pdspark_generation_tokens_total",
                                       "Generated tokens of finished requests", NULL);
    m->running = pd_metrics_gauge(reg, "pdspark_requests_running",
                                  "Requests admitted and not ended (prefilling or decoding)", NULL);
    m->queued = pd_metrics_gauge(reg, "pdspark_requests_queued",
                                 "Requests waiting for KV pages (queue depth)", NULL);
    m->kv_used = pd_metrics_gauge(reg, "pdspark_kv_pages_used",
                                  "KV pages in use (incl. pages held for in-flight puts)", NULL);
    m->kv_free = pd_metrics_gauge(reg, "pdspark_kv_pages_free", "Free KV pages", NULL);
    m->kv_total = pd_metrics_gauge(reg, "pdspark_kv_pages_total", "KV pages in the pool", NULL);
    m->prefill_inflight = pd_metrics_gauge(reg, "pdspark_prefill_inflight",
                                           "Prefill calls in flight to prefill nodes", NULL);
    m->serving = pd_metrics_gauge(reg, "pdspark_serving",
                                  "1 while the node admits requests, 0 when starting, "
                                  "draining or stopping", NULL);
    m->draining_g = pd_metrics_gauge(reg, "pdspark_draining", "1 after SIGTERM (draining)", NULL);
    double b[32];
    pd_metrics_exp_buckets(0.005, 2.0, 14, b);   /* 5 ms .. 41 s */
    m->ttft = pd_metrics_histogram(reg, "pdspark_time_to_first_token_seconds",
                                   "Submission to first generated token", NULL, b, 14);
    m->e2e = pd_metrics_histogram(reg, "pdspark_request_duration_seconds",
                                  "Submission to end of successful requests", NULL, b, 14);
    m->queue = pd_metrics_histogram(reg, "pdspark_request_queue_seconds",
                                    "Submission to admission (KV pages reserved, prefill started)",
                                    NULL, b, 14);
    m->pf_call = pd_metrics_histogram(reg, "pdspark_request_prefill_call_seconds",
                                      "Disaggregated: Prefill call sent to its reply (the prefill "
                                      "node's queue, forward and transfer, and the network)",
                                      NULL, b, 14);
    m->pf_join = pd_metrics_histogram(reg, "pdspark_request_prefill_join_seconds",
                                      "Disaggregated: Prefill reply to the first token (the "
                                      "engine thread's wait and the staged upload)", NULL, b, 14);
    pd_metrics_exp_buckets(0.0005, 2.0, 14, b);  /* 0.5 ms .. 4 s */
    m->itl = pd_metrics_histogram(reg, "pdspark_inter_token_latency_seconds",
                                  "Time between generated tokens after the first (a round's gap "
                                  "spread over the tokens it committed)", NULL, b, 14);
    pd_metrics_lin_buckets(1, 1, 16, b);
    m->apr = pd_metrics_histogram(reg, "pdspark_dspark_accepted_tokens_per_round",
                                  "Tokens committed per DSpark verify round (accepted drafts "
                                  "+ the bonus token)", NULL, b, 16);
    m->rounds_c = pd_metrics_counter(reg, "pdspark_dspark_rounds_total",
                                     "DSpark verify rounds of finished requests", NULL);
    m->accepted_c = pd_metrics_counter(reg, "pdspark_dspark_accepted_tokens_total",
                                       "Tokens committed by DSpark rounds (accepted + bonus)", NULL);
    m->tau = pd_metrics_gauge(reg, "pdspark_dspark_tau",
                              "Mean tokens committed per round (tau) over finished requests", NULL);
    if (m->req_ok == NULL || m->req_error == NULL || m->ttft == NULL || m->itl == NULL ||
        m->queue == NULL || m->pf_call == NULL || m->pf_join == NULL ||
        m->apr == NULL || m->tau == NULL || m->draining_g == NULL || m->stage_waits == NULL) {
        decode_metrics_destroy(m);
        return pd_err_set(err, PD_ERR_NOMEM, "decode metrics: registering series");
    }
    pd_metrics_on_collect(reg, collect, m);
    *out = m;
    return PD_OK;
}

void decode_metrics_destroy(decode_metrics *m)
{
    if (m == NULL)
        return;
    pd_metrics_on_collect(m->reg, NULL, NULL);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

const decode_observer *decode_metrics_observer(decode_metrics *m)
{
    return &m->obs;
}

void decode_metrics_attach(decode_metrics *m, decode_server *s)
{
    pthread_mutex_lock(&m->mu);
    m->s = s;
    pthread_mutex_unlock(&m->mu);
}

void decode_metrics_set_draining(decode_metrics *m, int draining)
{
    if (m != NULL)
        atomic_store(&m->draining, draining);
}

void decode_metrics_refused(decode_metrics *m, const char *outcome)
{
    if (m == NULL)
        return;
    char lab[64];
    snprintf(lab, sizeof(lab), "outcome=\"%s\"", outcome);
    pd_metric_inc(pd_metrics_counter(m->reg, "pdspark_requests_total", REQ_HELP, lab));
}
