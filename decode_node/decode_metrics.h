/* decode_metrics.h - what the decode node measures: the request observer (decode_observer in
 * decode_api.h) that feeds the Prometheus registry and writes one log line per finished request
 * (text or JSON, after pd_log's format), and the gauges mirrored from decode_server_stats.
 * Owns: the decode node's series in a pd_metrics registry (names in decode_metrics.c).
 * Not here: the registry and its rendering (common/pd_metrics.c), serving /metrics (pd_http).
 * Threading: the observer runs on the engine thread; decode_metrics_refused and
 *   decode_metrics_set_draining from any thread; create/attach/destroy from main. */
#ifndef DECODE_METRICS_H
#define DECODE_METRICS_H

#include "decode_api.h"
#include "pd_metrics.h"
#include "pd_status.h"

typedef struct decode_metrics decode_metrics;

/* reg is borrowed and must outlive m. Errors: PD_ERR_NOMEM. */
pd_status decode_metrics_create(pd_metrics *reg, decode_metrics **out, pd_err *err);
void decode_metrics_destroy(decode_metrics *m);   /* NULL is a no-op */
/* The observer for decode_config.observer (valid while m lives). */
const decode_observer *decode_metrics_observer(decode_metrics *m);
/* Mirror s's stats into the gauges at every scrape; NULL detaches (do so before
 * decode_server_destroy while /metrics may still be scraped). */
void decode_metrics_attach(decode_metrics *m, decode_server *s);
void decode_metrics_set_draining(decode_metrics *m, int draining);
/* Also export vLLM's names for the series load balancers read (the Kubernetes Gateway API
 * inference extension, KEDA, vLLM dashboards), labelled model_name="model": vllm:num_requests_running,
 * vllm:num_requests_waiting, vllm:kv_cache_usage_perc (and its older name
 * vllm:gpu_cache_usage_perc), vllm:num_preemptions_total, vllm:prompt_tokens_total,
 * vllm:generation_tokens_total, vllm:request_success_total{finished_reason},
 * vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds. Call from main before the
 * server takes requests. */
void decode_metrics_vllm_names(decode_metrics *m, const char *model);
/* A request refused before it reached the engine: outcome "invalid", "draining", "busy", ... */
void decode_metrics_refused(decode_metrics *m, const char *outcome);

#endif
