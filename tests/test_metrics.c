/* test_metrics.c - pd_metrics: registration rules, counter/gauge/histogram arithmetic, the exact
 * Prometheus text, the collect hook, NULL safety, and concurrent updates. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_metrics.h"
#include "test_util.h"

static int collected;

static void on_collect(void *ud)
{
    pd_metric_set(ud, 42);
    collected++;
}

static void test_metrics_render(void)
{
    pd_metrics *m = NULL;
    pd_err err = {0};
    TEST_CHECK(pd_metrics_create(&m, &err) == PD_OK);
    pd_metric *ok = pd_metrics_counter(m, "req_total", "Requests by outcome", "outcome=\"ok\"");
    pd_metric *bad = pd_metrics_counter(m, "req_total", "ignored help", "outcome=\"bad\"");
    TEST_CHECK(ok != NULL && bad != NULL && ok != bad);
    TEST_CHECK(pd_metrics_counter(m, "req_total", NULL, "outcome=\"ok\"") == ok);
    TEST_CHECK(pd_metrics_gauge(m, "req_total", "x", NULL) == NULL);       /* type clash */
    TEST_CHECK(pd_metrics_counter(m, "9bad", "x", NULL) == NULL);          /* bad name */
    TEST_CHECK(pd_metrics_counter(m, "bad-name", "x", NULL) == NULL);
    double nb[] = {1, 1};
    TEST_CHECK(pd_metrics_histogram(m, "h_bad", "x", NULL, nb, 2) == NULL); /* not increasing */
    pd_metric_inc(ok);
    pd_metric_add(ok, 2);
    pd_metric_add(ok, -5);   /* counters never go down */
    pd_metric_inc(bad);
    TEST_CHECK(pd_metric_value(ok) == 3);
    pd_metric *g = pd_metrics_gauge(m, "queue_depth", "Waiting\nrequests \\ now", NULL);
    pd_metric_set(g, 7);
    pd_metric_add(g, -2.5);
    TEST_CHECK(pd_metric_value(g) == 4.5);
    double b[] = {0.5, 1, 2};
    pd_metric *h = pd_metrics_histogram(m, "lat_seconds", "Latency", "path=\"a\"", b, 3);
    TEST_CHECK(h != NULL);
    pd_metric_observe(h, 0.25);
    pd_metric_observe(h, 1);     /* le is inclusive */
    pd_metric_observe_n(h, 3, 2);
    TEST_CHECK(pd_metric_count(h) == 4);
    TEST_CHECK(pd_metric_value(h) == 7.25);
    pd_metric *c2 = pd_metrics_gauge(m, "collected", "Set by the collect hook", NULL);
    pd_metrics_on_collect(m, on_collect, c2);
    size_t len = 0;
    char *txt = pd_metrics_render(m, &len);
    TEST_CHECK(txt != NULL && strlen(txt) == len);
    TEST_CHECK(collected == 1);
    const char *want =
        "# HELP req_total Requests by outcome\n"
        "# TYPE req_total counter\n"
        "req_total{outcome=\"ok\"} 3\n"
        "req_total{outcome=\"bad\"} 1\n"
        "# HELP queue_depth Waiting\\nrequests \\\\ now\n"
        "# TYPE queue_depth gauge\n"
        "queue_depth 4.5\n"
        "# HELP lat_seconds Latency\n"
        "# TYPE lat_seconds histogram\n"
        "lat_seconds_bucket{path=\"a\",le=\"0.5\"} 1\n"
        "lat_seconds_bucket{path=\"a\",le=\"1\"} 2\n"
        "lat_seconds_bucket{path=\"a\",le=\"2\"} 2\n"
        "lat_seconds_bucket{path=\"a\",le=\"+Inf\"} 4\n"
        "lat_seconds_sum{path=\"a\"} 7.25\n"
        "lat_seconds_count{path=\"a\"} 4\n"
        "# HELP collected Set by the collect hook\n"
        "# TYPE collected gauge\n"
        "collected 42\n";
    TEST_CHECK(txt != NULL && strcmp(txt, want) == 0);
    if (txt != NULL && strcmp(txt, want) != 0)
        fprintf(stderr, "got:\n%s", txt);
    free(txt);
    /* NULL handles are no-ops */
    pd_metric_inc(NULL);
    pd_metric_set(NULL, 1);
    pd_metric_observe(NULL, 1);
    TEST_CHECK(pd_metric_value(NULL) == 0);
    char esc[32];
    pd_metrics_label_escape(esc, sizeof(esc), "a\"b\\c\nd");
    TEST_CHECK(strcmp(esc, "a\\\"b\\\\c\\nd") == 0);
    double eb[4];
    pd_metrics_exp_buckets(1, 2, 4, eb);
    TEST_CHECK(eb[0] == 1 && eb[3] == 8);
    pd_metrics_destroy(m);
    pd_metrics_destroy(NULL);
}

typedef struct {
    pd_metric *c, *h;
} thr_arg;

static void *hammer(void *p)
{
    thr_arg *a = p;
    for (int i = 0; i < 10000; i++) {
        pd_metric_inc(a->c);
        pd_metric_observe(a->h, i % 3);
    }
    return NULL;
}

static void test_metrics_threads(void)
{
    pd_metrics *m = NULL;
    TEST_CHECK(pd_metrics_create(&m, NULL) == PD_OK);
    double b[] = {0, 1, 2};
    thr_arg a = { pd_metrics_counter(m, "n_total", "n", NULL),
                  pd_metrics_histogram(m, "v", "v", NULL, b, 3) };
    pthread_t t[4];
    for (int i = 0; i < 4; i++)
        pthread_create(&t[i], NULL, hammer, &a);
    for (int i = 0; i < 4; i++) {
        char *s = pd_metrics_render(m, NULL);   /* renders while others update */
        free(s);
    }
    for (int i = 0; i < 4; i++)
        pthread_join(t[i], NULL);
    TEST_CHECK(pd_metric_value(a.c) == 40000);
    TEST_CHECK(pd_metric_count(a.h) == 40000);
    pd_metrics_destroy(m);
}

int main(void)
{
    test_metrics_render();
    test_metrics_threads();
    TEST_DONE();
}
