/* pd_wire.h - engine structs as pdspark messages and back, where more than one node needs the
 *   same conversion or a test checks it against another front end's.
 * Owns: TokenLogprobs <-> pd_token_logprobs (decode node's Generate chunks, prefill node's
 *   Prefill reply, the decode node reading that reply); GenerateRequest's chat as the OpenAI
 *   chat body that pd_chat reads (the decode node's gRPC front end, so that its chats render as
 *   the HTTP API's do).
 * Not here: the messages (proto/pdspark.proto), the transport (pd_rpc), what a chat's fields
 *   must say (pd_chat.c checks them as it reads them).
 * Threading: pure functions. */
#ifndef PD_WIRE_H
#define PD_WIRE_H

#include <stdint.h>

#include <cjson/cJSON.h>

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

/* GenerateRequest's chat as the body of an OpenAI chat request: {"messages": [{"role",
 * "content", "tool_calls", "tool_call_id", "name"}, ...], "tools", "tool_choice",
 * "parallel_tool_calls"}, the fields left empty absent; what pd_chat_tools_parse and
 * pd_chat_render read. *out is the caller's to cJSON_Delete. PD_ERR_INVALID naming the field: a
 * message of another version, a tool_calls_json that is not a JSON array, a tools_json that is not
 * JSON, a tool_choice that begins like JSON and is not (other text goes as a string, which
 * pd_chat_tools_parse judges), parallel_tool_calls above 2; PD_ERR_NOMEM. */
pd_status pd_wire_chat_in(const Pdspark__GenerateRequest *rq, cJSON **out, pd_err *err);

#endif
