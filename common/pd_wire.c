/* pd_wire.c - see pd_wire.h. */
#include "pd_wire.h"

#include <stdio.h>

#include "pd_json.h"
#include "pd_proto_version.h"

void pd_wire_logprobs_out(const pd_token_logprobs *lps, const int32_t *ids, int n,
                          Pdspark__TokenLogprobs *msgs, Pdspark__TokenLogprobs **ptrs)
{
    for (int i = 0; i < n; i++) {
        Pdspark__TokenLogprobs *m = &msgs[i];
        pdspark__token_logprobs__init(m);
        m->version = PD_PROTO_VERSION;
        m->token_id = (uint32_t)ids[i];
        m->logprob = lps[i].logprob;
        m->rank = lps[i].rank > 0 ? (uint32_t)lps[i].rank : 0;
        m->n_top_ids = m->n_top_logprobs = (size_t)lps[i].n_top;
        m->top_ids = (uint32_t *)(uintptr_t)lps[i].top_id;   /* ids >= 0: the same bits */
        m->top_logprobs = (float *)(uintptr_t)lps[i].top_logprob;
        ptrs[i] = m;
    }
}

pd_status pd_wire_logprobs_in(const Pdspark__TokenLogprobs *m, pd_token_logprobs *out, const char *what,
                              pd_err *err)
{
    if (m == NULL || m->n_top_ids != m->n_top_logprobs || m->n_top_ids > PD_MAX_TOP_LOGPROBS)
        return pd_err_set(err, PD_ERR_PEER, "%s: malformed logprobs (%zu top ids, %zu top logprobs, at "
                          "most %d)", what, m != NULL ? m->n_top_ids : 0, m != NULL ? m->n_top_logprobs : 0,
                          PD_MAX_TOP_LOGPROBS);
    out->logprob = m->logprob;
    out->rank = m->rank > INT32_MAX ? -1 : (int32_t)m->rank;
    out->n_top = (int)m->n_top_ids;
    for (size_t k = 0; k < m->n_top_ids; k++) {
        out->top_id[k] = m->top_ids[k] > INT32_MAX ? -1 : (int32_t)m->top_ids[k];
        out->top_logprob[k] = m->top_logprobs[k];
    }
    return PD_OK;
}

/* text of a string field ("" for NULL: messages built in a process, not unpacked, may leave them) */
static const char *str_of(const char *s) { return s != NULL ? s : ""; }

/* JSON text of field `what` parsed into `key` of o; PD_ERR_INVALID naming `what` when it is not
 * JSON or, with array, not an array */
static pd_status json_field(cJSON *o, const char *key, const char *text, int array, const char *what, pd_err *err)
{
    size_t bad = 0;
    cJSON *v = pd_json_parse_str(text, &bad);
    if (v == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "%s is not valid JSON (at byte %zu)", what, bad);
    if (array && !cJSON_IsArray(v)) {
        cJSON_Delete(v);
        return pd_err_set(err, PD_ERR_INVALID, "%s is not a JSON array", what);
    }
    if (!cJSON_AddItemToObject(o, key, v)) {
        cJSON_Delete(v);
        return pd_err_set(err, PD_ERR_NOMEM, "%s", what);
    }
    return PD_OK;
}

pd_status pd_wire_chat_in(const Pdspark__GenerateRequest *rq, cJSON **out, pd_err *err)
{
    pd_status st = PD_ERR_NOMEM;
    char what[64];
    cJSON *root = cJSON_CreateObject();
    cJSON *ms = cJSON_AddArrayToObject(root, "messages");
    if (ms == NULL)
        goto err_nomem;
    for (size_t i = 0; i < rq->n_messages; i++) {
        const Pdspark__ChatMessage *m = rq->messages[i];
        if (m->version != PD_PROTO_VERSION) {
            st = pd_err_set(err, PD_ERR_INVALID, "messages[%zu]: protocol version mismatch", i);
            goto err_free;
        }
        cJSON *o = cJSON_CreateObject();
        if (o == NULL || !cJSON_AddItemToArray(ms, o)) {
            cJSON_Delete(o);
            goto err_nomem;
        }
        if (cJSON_AddStringToObject(o, "role", str_of(m->role)) == NULL ||
            cJSON_AddStringToObject(o, "content", str_of(m->content)) == NULL)
            goto err_nomem;
        if (str_of(m->tool_calls_json)[0] != '\0') {
            snprintf(what, sizeof(what), "messages[%zu].tool_calls_json", i);
            if ((st = json_field(o, "tool_calls", m->tool_calls_json, 1, what, err)) != PD_OK)
                goto err_free;
        }
        if ((str_of(m->tool_call_id)[0] != '\0' &&
             cJSON_AddStringToObject(o, "tool_call_id", m->tool_call_id) == NULL) ||
            (str_of(m->name)[0] != '\0' && cJSON_AddStringToObject(o, "name", m->name) == NULL) ||
            (str_of(m->reasoning_content)[0] != '\0' &&
             cJSON_AddStringToObject(o, "reasoning_content", m->reasoning_content) == NULL))
            goto err_nomem;
    }
    if (str_of(rq->tools_json)[0] != '\0' &&
        (st = json_field(root, "tools", rq->tools_json, 0, "tools_json", err)) != PD_OK)
        goto err_free;
    /* "auto", "none", "required" (or any other word, for pd_chat_tools_parse to refuse as the
     * HTTP API does), or a named function's JSON object */
    const char *tc = str_of(rq->tool_choice), *t0 = tc;
    while (*t0 == ' ' || *t0 == '\n' || *t0 == '\t' || *t0 == '\r')
        t0++;
    if (*t0 == '{' || *t0 == '"') {
        if ((st = json_field(root, "tool_choice", tc, 0, "tool_choice", err)) != PD_OK)
            goto err_free;
    } else if (tc[0] != '\0' && cJSON_AddStringToObject(root, "tool_choice", tc) == NULL) {
        goto err_nomem;
    }
    if (rq->parallel_tool_calls > 2) {
        st = pd_err_set(err, PD_ERR_INVALID, "parallel_tool_calls must be 0 (on), 1 (off) or 2 (on), got %u",
                        rq->parallel_tool_calls);
        goto err_free;
    }
    if (cJSON_AddBoolToObject(root, "parallel_tool_calls", rq->parallel_tool_calls != 1) == NULL)
        goto err_nomem;
    *out = root;
    return PD_OK;
err_nomem:
    st = pd_err_set(err, PD_ERR_NOMEM, "out of memory reading the chat");
err_free:
    cJSON_Delete(root);
    return st;
}
