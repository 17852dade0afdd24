/* prefill_metrics.h - what the prefill node measures: the job observer (prefill_observer in
 * prefill_server.h) feeding the Prometheus registry served on --http /metrics, and the gauges
 * mirrored from prefill_server_stats.
 * Owns: the prefill node's series in a pd_metrics registry (names in prefill_metrics.c).
 * Not here: the registry and its rendering (common/pd_metrics.c), serving (common/pd_http.c).
 * Threading: the observer runs on the prefill engine thread, the collect callback on the HTTP
 *   thread; create/attach/destroy from main. */
#ifndef PREFILL_METRICS_H
#define PREFILL_METRICS_H

#include "pd_metrics.h"
#include "pd_status.h"
#include "prefill_server.h"

typedef struct prefill_metrics prefill_metrics;

/* reg is borrowed and must outlive m. Errors: PD_ERR_NOMEM. */
pd_status prefill_metrics_create(pd_metrics *reg, prefill_metrics **out, pd_err *err);
void prefill_metrics_destroy(prefill_metrics *m);   /* NULL is a no-op */
/* The observer for prefill_config.observer (valid while m lives). */
const prefill_observer *prefill_metrics_observer(prefill_metrics *m);
/* Mirror ps's stats into the gauges at every scrape; NULL detaches (before destroying ps). */
void prefill_metrics_attach(prefill_metrics *m, prefill_server *ps);

#endif
