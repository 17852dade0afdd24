/* pd_wire.h - engine structs as pdspark messages and back, where more than one node needs the
 *   same conversion.
 * Owns: TokenLogprobs <-> pd_token_logprobs (decode node's Generate chunks, prefill node's
 *   Prefill reply, the decode node reading that reply).
 * Not here: the messages (proto/pdspark.proto), the transport (pd_rpc).
 * Threading: pure functions. */
#ifndef PD_WIRE_H
#define PD_WIRE_H

#include <stdint.h>

#include "pd_sample.h"
#include "pd_status.h"
#include "pdspark.pb-c.h"

/* msgs[i] (and ptrs[i] = &msgs[i], for a repeated field) describe token ids[i] with lps[i]; the
 * top arrays are borrowed from lps, which must outlive the messages. */
void pd_wire_logprobs_out(const pd_token_logprobs *lps, const int32_t *ids, int n,
                          Pdspark__TokenLogprobs *msgs, Pdspark__TokenLogprobs **ptrs);
/* One message into *out; PD_ERR_PEER naming `what` when it is missing, its two top arrays differ
 * in length or hold more than PD_MAX_TOP_LOGPROBS (ids and a rank beyond int32 become -1, which
 * the engine refuses as outside the vocabulary). */
pd_status pd_wire_logprobs_in(const Pdspark__TokenLogprobs *m, pd_token_logprobs *out, const char *what,
                              pd_err *err);

#endif
