/* pd_loop.h - a thin libevent event loop owned by one thread, with cross-thread hand-off.
 * Owns: the event_base, the post queue (mutex + eventfd that wakes the loop), timers and fd
 *       watchers created through it.
 * Not here: HTTP (the node builds evhttp on pd_loop_base), UCX (pd_xfer gives an fd to watch).
 * Threading: exactly one thread runs the loop (pd_loop_run) and owns everything created on it.
 *       Only pd_loop_post and pd_loop_stop may be called from other threads. Timers and
 *       watchers are created/started/stopped/destroyed on the loop thread (or before run). */
#ifndef PD_LOOP_H
#define PD_LOOP_H

#include <stdbool.h>
#include <stdint.h>

#include "pd_status.h"

struct event_base;

typedef struct pd_loop pd_loop;
typedef struct pd_loop_timer pd_loop_timer;
typedef struct pd_loop_watch pd_loop_watch;

typedef void (*pd_loop_fn)(void *arg);
typedef void (*pd_loop_fd_fn)(int fd, void *arg);

/* Errors: PD_ERR_NOMEM, PD_ERR_IO (eventfd/libevent setup). */
pd_status pd_loop_create(pd_loop **out, pd_err *err);
/* After pd_loop_run returned (or before it ever ran). Closures still queued are run here, on
 * the destroying thread, so ownership handed over through a post is never lost. Timers and
 * watchers must have been destroyed. NULL is a no-op. */
void pd_loop_destroy(pd_loop *l);

/* Run on the calling thread (which becomes the owner) until pd_loop_stop.
 * Errors: PD_ERR_INTERNAL when libevent fails. */
pd_status pd_loop_run(pd_loop *l, pd_err *err);
/* Ask the loop to return from pd_loop_run after the current callback (any thread; a stop asked
 * before pd_loop_run makes it return at once). Posts queued before the stop still run first. */
void pd_loop_stop(pd_loop *l);
/* Run fn(arg) on the loop thread, in post order (any thread). Errors: PD_ERR_NOMEM,
 * PD_ERR_CANCELLED once pd_loop_run has returned (until it runs again) or destroy began (fn is
 * not run; arg stays the caller's). */
pd_status pd_loop_post(pd_loop *l, pd_loop_fn fn, void *arg);
/* True on the thread currently inside pd_loop_run. */
bool pd_loop_in_loop_thread(const pd_loop *l);
/* The libevent base, for evhttp and friends (loop thread only). */
struct event_base *pd_loop_base(pd_loop *l);

/* Timer: fn(arg) runs on the loop thread after ms, once or every ms (repeat). */
pd_status pd_loop_timer_create(pd_loop *l, pd_loop_fn fn, void *arg, pd_loop_timer **out,
                               pd_err *err);
void pd_loop_timer_start(pd_loop_timer *t, uint64_t ms, bool repeat);  /* restarts if pending */
void pd_loop_timer_stop(pd_loop_timer *t);
void pd_loop_timer_destroy(pd_loop_timer *t);                          /* NULL is a no-op */

/* Watch fd (borrowed; the caller closes it after pd_loop_watch_destroy) for readability;
 * fn(fd, arg) runs on the loop thread each time it is readable (level-triggered). */
pd_status pd_loop_watch_fd(pd_loop *l, int fd, pd_loop_fd_fn fn, void *arg, pd_loop_watch **out,
                           pd_err *err);
void pd_loop_watch_destroy(pd_loop_watch *w);                          /* NULL is a no-op */

#endif
