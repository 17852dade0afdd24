/* pd_loop.c - libevent event loop with a mutex-protected post queue woken by an eventfd.
 * Owns: event_base lifetime, the post queue, the wake fd, timer/watcher wrappers.
 * Not here: what runs on the loop.
 * Threading: see pd_loop.h; the queue mutex is the only state shared across threads. */
#include "pd_loop.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <event2/event.h>

#include "pd_log.h"

typedef struct post_item {
    pd_loop_fn fn;
    void *arg;
    struct post_item *next;
} post_item;

struct pd_loop {
    struct event_base *base;
    struct event *wake_ev;
    int wake_fd;
    pthread_mutex_t mu;
    post_item *head, *tail;     /* guarded by mu */
    bool stopping;              /* a stop was asked and not yet acted on (guarded by mu) */
    bool stopped;               /* run returned because of a stop (guarded by mu) */
    bool running;
    pthread_t owner;
};

struct pd_loop_timer {
    pd_loop *loop;
    struct event *ev;
    pd_loop_fn fn;
    void *arg;
    uint64_t ms;
    bool repeat;
};

struct pd_loop_watch {
    struct event *ev;
    pd_loop_fd_fn fn;
    void *arg;
};

/* Run everything queued now (not what the closures post meanwhile: that waits for the next
 * wake, so one busy producer cannot starve the loop). */
static void loop_drain(pd_loop *l)
{
    pthread_mutex_lock(&l->mu);
    post_item *it = l->head;
    l->head = l->tail = NULL;
    bool stop = l->stopping;
    l->stopping = false;
    pthread_mutex_unlock(&l->mu);
    while (it != NULL) {
        post_item *next = it->next;
        it->fn(it->arg);
        free(it);
        it = next;
    }
    if (stop)
        event_base_loopbreak(l->base);
}

static void loop_on_wake(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    uint64_t v;
    if (read(fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        PD_LOG_WARN("loop", "wake read: %s", strerror(errno));
    loop_drain(arg);
}

static void loop_wake(pd_loop *l)
{
    uint64_t one = 1;
    if (write(l->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
        PD_LOG_WARN("loop", "wake write: %s", strerror(errno));
}

/* libevent's own messages (a failed accept(), a bad event) go through the node's log, in its
 * format (text or JSON), instead of libevent's "[warn] ..." lines on stderr */
static void libevent_log(int severity, const char *msg)
{
    pd_log_level lvl = severity == EVENT_LOG_ERR ? PD_LOG_LEVEL_ERROR
                     : severity == EVENT_LOG_WARN ? PD_LOG_LEVEL_WARN
                     : severity == EVENT_LOG_MSG ? PD_LOG_LEVEL_INFO : PD_LOG_LEVEL_DEBUG;
    PD_LOG_AT(lvl, "libevent", "%s", msg);
}

static void libevent_log_once(void)
{
    event_set_log_callback(libevent_log);
}

pd_status pd_loop_create(pd_loop **out, pd_err *err)
{
    static pthread_once_t log_once = PTHREAD_ONCE_INIT;
    pthread_once(&log_once, libevent_log_once);
    pd_loop *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "loop: %zu bytes", sizeof(*l));
    pd_status st;
    pthread_mutex_init(&l->mu, NULL);
    l->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (l->wake_fd < 0) {
        st = pd_err_set(err, PD_ERR_IO, "loop: eventfd: %s", strerror(errno));
        goto err_free;
    }
    l->base = event_base_new();
    if (l->base == NULL) {
        st = pd_err_set(err, PD_ERR_IO, "loop: event_base_new failed");
        goto err_close;
    }
    l->wake_ev = event_new(l->base, l->wake_fd, EV_READ | EV_PERSIST, loop_on_wake, l);
    if (l->wake_ev == NULL || event_add(l->wake_ev, NULL) != 0) {
        st = pd_err_set(err, PD_ERR_IO, "loop: cannot watch the wake fd");
        goto err_base;
    }
    *out = l;
    return PD_OK;
err_base:
    if (l->wake_ev != NULL)
        event_free(l->wake_ev);
    event_base_free(l->base);
err_close:
    close(l->wake_fd);
err_free:
    pthread_mutex_destroy(&l->mu);
    free(l);
    return st;
}

void pd_loop_destroy(pd_loop *l)
{
    if (l == NULL)
        return;
    PD_ASSERT(!l->running);
    /* Hand-offs still queued own resources: run them (bounded: each round runs what exists). */
    pthread_mutex_lock(&l->mu);
    l->stopped = true;   /* posts from now on are refused */
    pthread_mutex_unlock(&l->mu);
    for (int round = 0; round < 64; round++) {
        pthread_mutex_lock(&l->mu);
        bool empty = l->head == NULL;
        pthread_mutex_unlock(&l->mu);
        if (empty)
            break;
        loop_drain(l);
    }
    event_free(l->wake_ev);
    event_base_free(l->base);
    close(l->wake_fd);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

pd_status pd_loop_run(pd_loop *l, pd_err *err)
{
    /* A stop asked before this point (even before run) is kept: the wake fd is already
     * readable, so the loop drains and returns at once. */
    pthread_mutex_lock(&l->mu);
    l->owner = pthread_self();
    l->running = true;
    l->stopped = false;
    pthread_mutex_unlock(&l->mu);
    int rc = event_base_loop(l->base, 0);
    pthread_mutex_lock(&l->mu);
    l->running = false;
    l->stopped = true;
    pthread_mutex_unlock(&l->mu);
    if (rc < 0)
        return pd_err_set(err, PD_ERR_INTERNAL, "loop: event_base_loop failed");
    return PD_OK;
}

void pd_loop_stop(pd_loop *l)
{
    pthread_mutex_lock(&l->mu);
    l->stopping = true;
    pthread_mutex_unlock(&l->mu);
    loop_wake(l);
}

pd_status pd_loop_post(pd_loop *l, pd_loop_fn fn, void *arg)
{
    post_item *it = malloc(sizeof(*it));
    if (it == NULL)
        return PD_ERR_NOMEM;
    it->fn = fn;
    it->arg = arg;
    it->next = NULL;
    pthread_mutex_lock(&l->mu);
    if (l->stopped) {
        pthread_mutex_unlock(&l->mu);
        free(it);
        return PD_ERR_CANCELLED;
    }
    bool was_empty = l->head == NULL;
    if (l->tail != NULL)
        l->tail->next = it;
    else
        l->head = it;
    l->tail = it;
    pthread_mutex_unlock(&l->mu);
    if (was_empty)
        loop_wake(l);
    return PD_OK;
}

bool pd_loop_in_loop_thread(const pd_loop *l)
{
    /* any thread may ask (running and owner change under mu) */
    pd_loop *m = (pd_loop *)l;
    pthread_mutex_lock(&m->mu);
    bool here = l->running && pthread_equal(l->owner, pthread_self());
    pthread_mutex_unlock(&m->mu);
    return here;
}

struct event_base *pd_loop_base(pd_loop *l)
{
    return l->base;
}

static void timer_on_fire(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    pd_loop_timer *t = arg;
    t->fn(t->arg);
}

pd_status pd_loop_timer_create(pd_loop *l, pd_loop_fn fn, void *arg, pd_loop_timer **out,
                               pd_err *err)
{
    pd_loop_timer *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "loop timer");
    t->loop = l;
    t->fn = fn;
    t->arg = arg;
    *out = t;
    return PD_OK;
}

void pd_loop_timer_start(pd_loop_timer *t, uint64_t ms, bool repeat)
{
    if (t->ev != NULL && t->repeat != repeat) {
        event_free(t->ev);
        t->ev = NULL;
    }
    if (t->ev == NULL) {
        t->ev = event_new(t->loop->base, -1, repeat ? EV_PERSIST : 0, timer_on_fire, t);
        if (t->ev == NULL) {
            PD_LOG_ERROR("loop", "timer: event_new failed");
            return;
        }
    }
    t->ms = ms;
    t->repeat = repeat;
    struct timeval tv = {.tv_sec = (time_t)(ms / 1000), .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    event_add(t->ev, &tv);
}

void pd_loop_timer_stop(pd_loop_timer *t)
{
    if (t != NULL && t->ev != NULL)
        event_del(t->ev);
}

void pd_loop_timer_destroy(pd_loop_timer *t)
{
    if (t == NULL)
        return;
    if (t->ev != NULL)
        event_free(t->ev);
    free(t);
}

static void watch_on_ready(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    pd_loop_watch *w = arg;
    w->fn((int)fd, w->arg);
}

pd_status pd_loop_watch_fd(pd_loop *l, int fd, pd_loop_fd_fn fn, void *arg, pd_loop_watch **out,
                           pd_err *err)
{
    pd_loop_watch *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "loop watch");
    w->fn = fn;
    w->arg = arg;
    w->ev = event_new(l->base, fd, EV_READ | EV_PERSIST, watch_on_ready, w);
    if (w->ev == NULL || event_add(w->ev, NULL) != 0) {
        if (w->ev != NULL)
            event_free(w->ev);
        free(w);
        return pd_err_set(err, PD_ERR_IO, "loop: cannot watch fd %d", fd);
    }
    *out = w;
    return PD_OK;
}

void pd_loop_watch_destroy(pd_loop_watch *w)
{
    if (w == NULL)
        return;
    event_free(w->ev);
    free(w);
}
