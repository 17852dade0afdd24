/* pd_xfer_thread.c - a pd_xfer progressed on its own thread (pd_xfer_thread.h).
 * Owns: the thread, its pd_loop, the fd watch and the timeout tick.
 * Threading: see pd_xfer_thread.h. */
#define _GNU_SOURCE   /* pthread_setname_np */
#include "pd_xfer_thread.h"

#include <pthread.h>
#include <stdlib.h>

#include "pd_log.h"

/* pd_xfer wants a progress at least every 100 ms for its transfer timeouts */
#define TICK_MS 50

struct pd_xfer_thread {
    pd_xfer *x;
    pd_loop *loop;
    pd_loop_watch *watch;
    pd_loop_timer *tick;
    pthread_t thread;
};

static void on_fd(int fd, void *arg)
{
    (void)fd;
    pd_xfer_thread *t = arg;
    pd_xfer_progress(t->x);
}

static void on_tick(void *arg)
{
    pd_xfer_thread *t = arg;
    pd_xfer_progress(t->x);
}

static void *thread_main(void *arg)
{
    pd_xfer_thread *t = arg;
    pd_err err = {0};
    pthread_setname_np(pthread_self(), "pd-xfer");   /* as top -H and gdb show it */
    if (pd_loop_run(t->loop, &err) != PD_OK)
        PD_LOG_ERROR("xfer", "transfer thread: %s", err.msg);
    return NULL;
}

static void release(pd_xfer_thread *t)
{
    pd_loop_watch_destroy(t->watch);
    pd_loop_timer_destroy(t->tick);
    pd_loop_destroy(t->loop);
    free(t);
}

pd_status pd_xfer_thread_start(pd_xfer *x, pd_xfer_thread **out, pd_err *err)
{
    pd_xfer_thread *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "transfer thread");
    t->x = x;
    pd_status st;
    if ((st = pd_loop_create(&t->loop, err)) != PD_OK ||
        (st = pd_loop_watch_fd(t->loop, pd_xfer_fd(x), on_fd, t, &t->watch, err)) != PD_OK ||
        (st = pd_loop_timer_create(t->loop, on_tick, t, &t->tick, err)) != PD_OK) {
        release(t);
        return st;
    }
    pd_loop_timer_start(t->tick, TICK_MS, true);
    if (pthread_create(&t->thread, NULL, thread_main, t) != 0) {
        release(t);
        return pd_err_set(err, PD_ERR_INTERNAL, "transfer thread: cannot start");
    }
    *out = t;
    return PD_OK;
}

pd_status pd_xfer_thread_post(pd_xfer_thread *t, pd_loop_fn fn, void *arg)
{
    return pd_loop_post(t->loop, fn, arg);
}

bool pd_xfer_thread_here(const pd_xfer_thread *t)
{
    return pd_loop_in_loop_thread(t->loop);
}

void pd_xfer_thread_stop(pd_xfer_thread *t)
{
    if (t == NULL)
        return;
    pd_loop_stop(t->loop);
    pthread_join(t->thread, NULL);
    /* the loop's queued closures run in release, here */
    release(t);
}
