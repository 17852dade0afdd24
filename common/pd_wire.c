/* pd_wire.c - see pd_wire.h. */
#include "pd_wire.h"

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
