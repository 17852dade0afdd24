/* pd_xfer_thread.h - a pd_xfer progressed on a thread of its own.
 * Why: a node's engine thread spends most of a busy period inside forwards and decode rounds;
 *   a pd_xfer it progresses between them moves a put only as far as the socket buffers take it
 *   per pass, so a transfer (and, over tcp, the target side that must progress to receive it)
 *   waits a whole forward per pass. On its own thread a transfer runs beside the compute.
 * Owns: the thread and its pd_loop (the xfer's fd watched, a timer for transfer timeouts).
 * Not here: the pd_xfer itself (the caller creates and destroys it), what is put.
 * Threading: between pd_xfer_thread_start and pd_xfer_thread_stop the pd_xfer and everything
 *   made from it belong to the thread: use them only in closures run there through
 *   pd_xfer_thread_post (done callbacks run there too). Before start and after stop they are
 *   the caller's again. */
#ifndef PD_XFER_THREAD_H
#define PD_XFER_THREAD_H

#include "pd_loop.h"
#include "pd_status.h"
#include "pd_xfer.h"

typedef struct pd_xfer_thread pd_xfer_thread;

/* Starts the thread; from now on it owns x. Errors: PD_ERR_NOMEM, PD_ERR_IO (loop setup),
 * PD_ERR_INTERNAL (no thread). */
pd_status pd_xfer_thread_start(pd_xfer *x, pd_xfer_thread **out, pd_err *err);
/* Runs fn(arg) on the thread, in post order (any thread). Errors as pd_loop_post's; after an
 * error fn did not run and arg stays the caller's. */
pd_status pd_xfer_thread_post(pd_xfer_thread *t, pd_loop_fn fn, void *arg);
/* True on the transfer thread. */
bool pd_xfer_thread_here(const pd_xfer_thread *t);
/* Stops and joins the thread; closures still queued run on the calling thread, which owns the
 * pd_xfer again afterwards. NULL is a no-op. */
void pd_xfer_thread_stop(pd_xfer_thread *t);

#endif
