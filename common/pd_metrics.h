/* pd_metrics.h - a small metric registry (counters, gauges, histograms with fixed buckets) and
 * its Prometheus text exposition (format 0.0.4), shared by both nodes' /metrics.
 * Owns: the series (a family name, its help and type, one label set each) and their values.
 * Not here: serving /metrics (pd_http.c), what is measured (the nodes).
 * Threading: every function may be called from any thread; one mutex per registry orders
 *   updates and rendering. Series handles stay valid until pd_metrics_destroy. */
#ifndef PD_METRICS_H
#define PD_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "pd_status.h"

typedef struct pd_metrics pd_metrics;
typedef struct pd_metric pd_metric;   /* one series: a family name plus one label set */

typedef enum { PD_METRIC_COUNTER = 0, PD_METRIC_GAUGE, PD_METRIC_HISTOGRAM } pd_metric_type;

/* Errors: PD_ERR_NOMEM. */
pd_status pd_metrics_create(pd_metrics **out, pd_err *err);
void pd_metrics_destroy(pd_metrics *m);   /* NULL is a no-op */

/* Register (or find, when name and labels were registered before) one series.
 * name: [a-zA-Z_:][a-zA-Z0-9_:]*; help: free text (escaped when rendered); labels: NULL or ""
 * for none, else the inside of the braces, e.g. `outcome="ok"` (label values are the caller's
 * to escape; pd_metrics_label_escape helps). All strings are copied. A family keeps the type
 * and help of its first series; a second registration with another type, a bad name, or
 * histogram bounds that are not strictly increasing returns NULL (a programming error: the
 * updates below accept NULL and do nothing, so a bad registration never takes a node down). */
pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *help,
                              const char *labels);
pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *help,
                            const char *labels);
/* bounds: the upper bounds of the finite buckets (copied), strictly increasing; +Inf is
 * implied. n_bounds 1..64. */
pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *help,
                                const char *labels, const double *bounds, int n_bounds);

/* Counter: add v >= 0 (a negative v is ignored). Gauge: add any v. */
void pd_metric_add(pd_metric *s, double v);
void pd_metric_inc(pd_metric *s);
/* Gauge only. */
void pd_metric_set(pd_metric *s, double v);
/* Histogram only: one observation of v, or n of them. */
void pd_metric_observe(pd_metric *s, double v);
void pd_metric_observe_n(pd_metric *s, double v, uint64_t n);
/* The current value (counter/gauge) or sum (histogram), and for histograms the count (tests). */
double pd_metric_value(pd_metric *s);
uint64_t pd_metric_count(pd_metric *s);

/* fn(ud) runs at the start of every render, outside the registry lock, so gauges that mirror
 * a snapshot (queue depth, KV pages) are fresh when scraped. One callback per registry; the
 * latest wins; NULL removes it. */
void pd_metrics_on_collect(pd_metrics *m, void (*fn)(void *ud), void *ud);

/* The whole registry as Prometheus text: "# HELP" and "# TYPE" once per family, families in
 * registration order, histograms as cumulative _bucket{le=...}, _sum, _count. Returns a
 * malloc'd NUL-terminated string (the caller frees) and its length in *len (may be NULL);
 * NULL when out of memory. */
char *pd_metrics_render(pd_metrics *m, size_t *len);

/* The gauge pdspark_build_info{version="V",commit="C"} 1 (Prometheus' build-info convention). */
void pd_metrics_build_info(pd_metrics *m, const char *version, const char *commit);

/* Escape a label value (backslash, double quote, newline) into dst[cap]; truncates. */
void pd_metrics_label_escape(char *dst, size_t cap, const char *src);

/* Bucket helpers: n bounds start, start*factor, ... into out[n]. */
void pd_metrics_exp_buckets(double start, double factor, int n, double *out);
/* n bounds start, start+width, ... into out[n]. */
void pd_metrics_lin_buckets(double start, double width, int n, double *out);

#endif
