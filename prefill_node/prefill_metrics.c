/* prefill_metrics.c - the prefill node's metrics (prefill_metrics.h).
 * Owns: series handles into the shared registry and the attached server for the collect hook.
 * Not here: rendering (pd_metrics.c), the job lifecycle (prefill_server.c).
 * Threading: the observer on the engine thread, collect on the HTTP thread; mu guards the
 *   attached server pointer. */
#include "prefill_metrics.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "pd_cli.h"

struct prefill_metrics {
    pd_metrics *reg;
    prefill_observer obs;
    pthread_mutex_t mu;
    prefill_server *ps;              /* under mu */
    pd_metric *req_ok, *req_cancelled, *req_timeout, *req_invalid, *req_peer, *req_busy, *req_error;
    pd_metric *prompt_tokens, *cached_tokens, *bytes, *xfer_seconds, *forward_seconds_total;
    pd_metric *queue_h, *forward_h, *xfer_h, *total_h;
    pd_metric *running, *queued, *kv_used, *kv_free, *kv_total, *cp_size;
};

static void obs_done(void *ud, const prefill_event *ev)
{
    prefill_metrics *m = ud;
    pd_metric *c = ev->status == PD_OK ? m->req_ok : ev->status == PD_ERR_CANCELLED ? m->req_cancelled
                 : ev->status == PD_ERR_TIMEOUT ? m->req_timeout : ev->status == PD_ERR_INVALID ? m->req_invalid
                 : ev->status == PD_ERR_PEER ? m->req_peer : ev->status == PD_ERR_BUSY ? m->req_busy
                 : m->req_error;
    pd_metric_inc(c);
    pd_metric_set(m->cp_size, ev->cp_size);
    if (ev->status != PD_OK)
        return;
    pd_metric_add(m->prompt_tokens, ev->prompt_tokens);
    pd_metric_add(m->cached_tokens, ev->cached_tokens);
    pd_metric_add(m->bytes, (double)ev->bytes);
    pd_metric_add(m->xfer_seconds, ev->transfer_ms / 1000.0);
    pd_metric_add(m->forward_seconds_total, ev->forward_ms / 1000.0);
    pd_metric_observe(m->queue_h, ev->queue_ms / 1000.0);
    pd_metric_observe(m->forward_h, ev->forward_ms / 1000.0);
    pd_metric_observe(m->xfer_h, ev->transfer_ms / 1000.0);
    pd_metric_observe(m->total_h, ev->total_ms / 1000.0);
}

static void collect(void *ud)
{
    prefill_metrics *m = ud;
    pthread_mutex_lock(&m->mu);
    if (m->ps != NULL) {
        prefill_stats st;
        prefill_server_stats(m->ps, &st);
        pd_metric_set(m->running, st.active_requests);
        pd_metric_set(m->queued, st.queued_requests);
        pd_metric_set(m->kv_used, st.total_kv_pages - st.free_kv_pages);
        pd_metric_set(m->kv_free, st.free_kv_pages);
        pd_metric_set(m->kv_total, st.total_kv_pages);
    }
    pthread_mutex_unlock(&m->mu);
}

#define REQ_HELP "Prefill calls by outcome (ok, cancelled, timeout, invalid, peer_error, busy, error)"

pd_status prefill_metrics_create(pd_metrics *reg, prefill_metrics **out, pd_err *err)
{
    prefill_metrics *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "prefill metrics");
    m->reg = reg;
    pthread_mutex_init(&m->mu, NULL);
    m->obs.on_done = obs_done;
    m->obs.ud = m;
    pd_metrics_build_info(reg, pd_cli_version(), pd_cli_commit());
    const char *rq = "pdspark_prefill_requests_total";
    m->req_ok = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"ok\"");
    m->req_cancelled = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"cancelled\"");
    m->req_timeout = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"timeout\"");
    m->req_invalid = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"invalid\"");
    m->req_peer = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"peer_error\"");
    m->req_busy = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"busy\"");
    m->req_error = pd_metrics_counter(reg, rq, REQ_HELP, "outcome=\"error\"");
    m->cached_tokens = pd_metrics_counter(reg, "pdspark_prefill_cached_tokens_total",
                                          "Prompt tokens served from the prefix cache", NULL);
    m->prompt_tokens = pd_metrics_counter(reg, "pdspark_prefill_prompt_tokens_total",
                                          "Prompt tokens prefilled and shipped", NULL);
    m->bytes = pd_metrics_counter(reg, "pdspark_prefill_transfer_bytes_total",
                                  "KV page and aux bytes put into decode nodes", NULL);
    m->xfer_seconds = pd_metrics_counter(reg, "pdspark_prefill_transfer_seconds_total",
                                         "Time from the end of the forward to the flushed puts", NULL);
    m->forward_seconds_total = pd_metrics_counter(reg, "pdspark_prefill_forward_seconds_total",
                                                  "Forward (CP over cp_size ranks) time of the "
                                                  "batches that held each request", NULL);
    double b[16];
    pd_metrics_exp_buckets(0.001, 2.0, 16, b);   /* 1 ms .. 33 s */
    m->queue_h = pd_metrics_histogram(reg, "pdspark_prefill_queue_seconds",
                                      "Prefill call received -> its forward started", NULL, b, 16);
    m->forward_h = pd_metrics_histogram(reg, "pdspark_prefill_forward_seconds",
                                        "Forward time (context-parallel over cp_size ranks) of "
                                        "the batch that held the request", NULL, b, 16);
    m->xfer_h = pd_metrics_histogram(reg, "pdspark_prefill_transfer_seconds",
                                     "KV + aux transfer to the decode node (puts issued -> flushed)",
                                     NULL, b, 16);
    m->total_h = pd_metrics_histogram(reg, "pdspark_prefill_request_seconds",
                                      "Prefill call received -> reply", NULL, b, 16);
    m->running = pd_metrics_gauge(reg, "pdspark_prefill_requests_running",
                                  "Requests in the forward or the transfer", NULL);
    m->queued = pd_metrics_gauge(reg, "pdspark_prefill_requests_queued",
                                 "Requests waiting for a forward (queue depth)", NULL);
    m->kv_used = pd_metrics_gauge(reg, "pdspark_prefill_kv_pages_used", "KV pages in use", NULL);
    m->kv_free = pd_metrics_gauge(reg, "pdspark_prefill_kv_pages_free", "Free KV pages", NULL);
    m->kv_total = pd_metrics_gauge(reg, "pdspark_prefill_kv_pages_total", "KV pages in the pool", NULL);
    m->cp_size = pd_metrics_gauge(reg, "pdspark_prefill_cp_size",
                                  "Context-parallel ranks of the forward (0 before the first request)",
                                  NULL);
    if (m->req_ok == NULL || m->req_error == NULL || m->total_h == NULL || m->cp_size == NULL) {
        prefill_metrics_destroy(m);
        return pd_err_set(err, PD_ERR_NOMEM, "prefill metrics: registering series");
    }
    pd_metrics_on_collect(reg, collect, m);
    *out = m;
    return PD_OK;
}

void prefill_metrics_destroy(prefill_metrics *m)
{
    if (m == NULL)
        return;
    pd_metrics_on_collect(m->reg, NULL, NULL);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

const prefill_observer *prefill_metrics_observer(prefill_metrics *m)
{
    return &m->obs;
}

void prefill_metrics_attach(prefill_metrics *m, prefill_server *ps)
{
    pthread_mutex_lock(&m->mu);
    m->ps = ps;
    pthread_mutex_unlock(&m->mu);
}
