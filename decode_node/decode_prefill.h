/* decode_prefill.h - the decode node's side of disaggregated prefill (decode_prefill.c).
 * Owns: the declarations below.
 * Not here: the request lifecycle (decode_server.c), the prefill node (prefill_node/).
 * Threading: engine thread, except decode_prefill_cancel_reply (a pd_rpc poller thread) and
 *   the set-up functions (decode_server_create). */
#ifndef DECODE_PREFILL_H
#define DECODE_PREFILL_H

#include "decode_server_internal.h"

/* Reserve aux rows, staging pages (when staging) and KV pages, and send Prefill. PD_ERR_BUSY:
 * no room now (nothing held). */
pd_status decode_prefill_start(decode_server *s, decode_handle *h, pd_err *err);
/* pd_rpc callback of a CancelPrefill call (ud: its prefill_node): posts the reply to the engine
 * thread. */
void decode_prefill_cancel_reply(void *ud, pd_status st, ProtobufCMessage *resp, const pd_err *err);
/* The first resolution of --prefill, before the engine thread starts: a list that is not
 * HOST:PORT fails; names that do not resolve (yet) fail too unless they are resolved again
 * later (cfg.prefill_refresh_ms), which starts the resolver thread. */
pd_status decode_prefill_resolve_nodes(decode_server *s, pd_err *err);
/* The thread that resolves --prefill again every cfg.prefill_refresh_ms and posts the
 * addresses to the engine thread (stopped and joined by decode_server_destroy). */
pd_status decode_prefill_resolver_start(decode_server *s, pd_err *err);
/* The UCX worker: the target and draft KV pools (or, where prefill nodes cannot put into them,
 * their staging pool of cfg.kv_staging_pages host pages) and the aux arena registered once, their
 * keys packed for the Prefill calls, the worker progressed on its own thread from here on.
 * PD_ERR_INVALID: cfg.kv_staging_pages below the longest admissible prompt's pages. */
pd_status decode_prefill_setup_xfer(decode_server *s, pd_err *err);
/* Give back h's staging pages (none: nothing happens). Only once no put of h's Prefill can land
 * in them: after its reply, or its hold. */
void decode_prefill_stage_release(decode_server *s, decode_handle *h);

#endif
