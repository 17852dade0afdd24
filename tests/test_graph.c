/* test_graph.c - the graph cache's rules (common/pd_graph.c) on a mock backend whose graph ops
 * only count: first sight of a shape runs eagerly, the second is captured and launched, later
 * ones replay; a stale graph is dropped and the step re-warmed; a capture that fails runs the
 * step eagerly and, after two failures, the shape stays eager; OFF never captures; eviction
 * frees the least recently used graph; the bucket functions. Runs everywhere (no GPU). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_graph.h"
#include "test_util.h"

static struct {
    int begins, ends, launches, frees, body_calls, capturing;
    int fail_body_in_capture;   /* the body fails while capturing */
    int stale_next_launch;      /* the next launch answers BUSY */
} mk;

static pd_status mock_begin(kern_backend *be, pd_err *err)
{
    (void)be;
    (void)err;
    mk.begins++;
    mk.capturing = 1;
    return PD_OK;
}

static pd_status mock_end(kern_backend *be, void **out, pd_err *err)
{
    (void)be;
    mk.ends++;
    mk.capturing = 0;
    if (mk.fail_body_in_capture)
        return pd_err_set(err, PD_ERR_CUDA, "mock capture invalidated");
    *out = malloc(1);
    return PD_OK;
}

static pd_status mock_launch(kern_backend *be, void *g, pd_err *err)
{
    (void)be;
    (void)g;
    if (mk.stale_next_launch) {
        mk.stale_next_launch = 0;
        return pd_err_set(err, PD_ERR_BUSY, "mock stale");
    }
    mk.launches++;
    return PD_OK;
}

static void mock_free(kern_backend *be, void *g)
{
    (void)be;
    mk.frees++;
    free(g);
}

static pd_status body(void *ud, pd_err *err)
{
    (void)ud;
    mk.body_calls++;
    if (mk.capturing && mk.fail_body_in_capture)
        return pd_err_set(err, PD_ERR_CUDA, "mock op refused during capture");
    return PD_OK;
}

static pd_status run(pd_graph_cache *gc, int64_t k, pd_err *err)
{
    int64_t key[2] = { k, 7 };
    return pd_graph_run(gc, key, 2, body, NULL, err);
}

int main(void)
{
    kern_backend_ops ops = { .name = "mock", .graph_begin = mock_begin, .graph_end = mock_end,
                             .graph_launch = mock_launch, .graph_free = mock_free };
    kern_backend be = { .ops = &ops, .is_host = 0 };
    pd_err err;
    pd_graph_cache gc;
    pd_graph_cache_init(&gc, &be, PD_GRAPHS_AUTO);
    TEST_CHECK(pd_graph_pad(&gc));
    /* warm-up, capture + launch, replay */
    TEST_CHECK(run(&gc, 1, &err) == PD_OK && mk.body_calls == 1 && mk.begins == 0);
    TEST_CHECK(run(&gc, 1, &err) == PD_OK && mk.body_calls == 2 && mk.begins == 1 && mk.launches == 1);
    TEST_CHECK(run(&gc, 1, &err) == PD_OK && mk.body_calls == 2 && mk.launches == 2);
    TEST_CHECK(gc.n_eager == 1 && gc.n_captures == 1 && gc.n_replays == 1);
    /* another shape has its own graph */
    TEST_CHECK(run(&gc, 2, &err) == PD_OK && mk.body_calls == 3 && mk.begins == 1);
    /* stale: dropped, the step runs eagerly now, captured again next time */
    mk.stale_next_launch = 1;
    TEST_CHECK(run(&gc, 1, &err) == PD_OK && mk.body_calls == 4 && mk.frees == 1);
    TEST_CHECK(run(&gc, 1, &err) == PD_OK && mk.begins == 2 && mk.launches == 3);
    /* a failing capture runs the step eagerly (it was only recorded); two failures: eager for good */
    mk.fail_body_in_capture = 1;
    int calls = mk.body_calls;
    TEST_CHECK(run(&gc, 3, &err) == PD_OK && mk.body_calls == calls + 1);        /* warm-up */
    TEST_CHECK(run(&gc, 3, &err) == PD_OK && mk.body_calls == calls + 3);        /* capture fails, eager */
    TEST_CHECK(run(&gc, 3, &err) == PD_OK && mk.body_calls == calls + 5);        /* again */
    int begins = mk.begins;
    TEST_CHECK(run(&gc, 3, &err) == PD_OK && mk.begins == begins && mk.body_calls == calls + 6);
    mk.fail_body_in_capture = 0;
    /* eviction: PD_GRAPH_CACHE_SIZE more shapes push out the least recently used graph */
    int frees = mk.frees;
    for (int k = 100; k < 100 + PD_GRAPH_CACHE_SIZE; k++)
        TEST_CHECK(run(&gc, k, &err) == PD_OK);
    TEST_CHECK_MSG(mk.frees > frees, "eviction freed no graph (%d frees)", mk.frees);
    TEST_CHECK(gc.n <= PD_GRAPH_CACHE_SIZE);
    pd_graph_cache_clear(&gc);
    /* OFF and host backends: always eager, no padding */
    pd_graph_cache_init(&gc, &be, PD_GRAPHS_OFF);
    begins = mk.begins;
    for (int i = 0; i < 3; i++)
        TEST_CHECK(run(&gc, 1, &err) == PD_OK);
    TEST_CHECK(mk.begins == begins && gc.n_eager == 3 && !pd_graph_pad(&gc));
    kern_backend host = { .ops = &ops, .is_host = 1 };
    pd_graph_cache_init(&gc, &host, PD_GRAPHS_AUTO);
    TEST_CHECK(!pd_graph_pad(&gc));
    pd_graph_cache_init(&gc, &host, PD_GRAPHS_PAD);
    TEST_CHECK(pd_graph_pad(&gc));
    /* buckets */
    static const int in[] = { 1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65, 250, 257, 520 };
    static const int want[] = { 1, 2, 3, 4, 8, 8, 12, 16, 24, 64, 96, 256, 384, 640 };
    for (size_t i = 0; i < sizeof(in) / sizeof(in[0]); i++)
        TEST_CHECK_MSG(pd_graph_bucket(in[i]) == want[i], "bucket(%d) = %d, want %d", in[i],
                       pd_graph_bucket(in[i]), want[i]);
    int ok = 1;
    for (int n = 1; n <= 4096 && ok; n++) {
        int b = pd_graph_bucket(n);
        ok = b >= n && (n <= 4 ? b == n : b < 2 * n);
        TEST_CHECK_MSG(ok, "bucket(%d) = %d", n, b);
    }
    TEST_CHECK(pd_graph_bucket_pow2(1, 64) == 64 && pd_graph_bucket_pow2(65, 64) == 128 &&
               pd_graph_bucket_pow2(3, 4) == 4 && pd_graph_bucket_pow2(5, 4) == 8);
    pd_graph_mode m;
    TEST_CHECK(pd_graph_mode_parse("pad", &m, &err) == PD_OK && m == PD_GRAPHS_PAD);
    TEST_CHECK(pd_graph_mode_parse("sometimes", &m, &err) == PD_ERR_INVALID &&
               strstr(err.msg, "sometimes") != NULL);
    TEST_DONE();
}
