/* test_proto.c - the wire contract: every message carries `uint32 version = 1`, round trips of
 * the messages with the most structure (PrefillRequest with its destination, the final
 * GenerateChunk), the version check helper, and malformed bytes failing to unpack. */
#include <stdbool.h>
#include <string.h>

#include "pd_proto_version.h"
#include "pdspark.pb-c.h"
#include "test_util.h"

static const ProtobufCMessageDescriptor *const all_messages[] = {
    &pdspark__sampling_params__descriptor,   &pdspark__health_request__descriptor,
    &pdspark__health_reply__descriptor,      &pdspark__generate_request__descriptor,
    &pdspark__usage__descriptor,             &pdspark__dspark_stats__descriptor,
    &pdspark__generate_chunk__descriptor,    &pdspark__page_layout__descriptor,
    &pdspark__aux_layout__descriptor,        &pdspark__remote_region__descriptor,
    &pdspark__destination__descriptor,       &pdspark__prefill_request__descriptor,
    &pdspark__prefill_timings__descriptor,   &pdspark__prefill_reply__descriptor,
    &pdspark__cancel_prefill_request__descriptor, &pdspark__cancel_prefill_reply__descriptor,
};

static void test_version_fields(void)
{
    size_t n = sizeof(all_messages) / sizeof(all_messages[0]);
    for (size_t i = 0; i < n; i++) {
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field(all_messages[i], PD_PROTO_VERSION_FIELD);
        TEST_CHECK_MSG(f != NULL && strcmp(f->name, "version") == 0 &&
                           f->type == PROTOBUF_C_TYPE_UINT32 &&
                           f->label != PROTOBUF_C_LABEL_REPEATED,
                       "%s", all_messages[i]->name);
    }
    /* every message type in the file is in the list above */
    TEST_CHECK(pdspark__generate__descriptor.n_methods == 2);
    TEST_CHECK(pdspark__prefill__descriptor.n_methods == 3);
    TEST_CHECK(strcmp(pdspark__prefill__descriptor.name, "pdspark.Prefill") == 0);
    TEST_CHECK(strcmp(pdspark__generate__descriptor.name, "pdspark.Generate") == 0);
}

static void test_prefill_roundtrip(void)
{
    Pdspark__PrefillRequest req = PDSPARK__PREFILL_REQUEST__INIT;
    Pdspark__SamplingParams sp = PDSPARK__SAMPLING_PARAMS__INIT;
    Pdspark__Destination dst = PDSPARK__DESTINATION__INIT;
    Pdspark__RemoteRegion kv = PDSPARK__REMOTE_REGION__INIT, aux = PDSPARK__REMOTE_REGION__INIT;
    Pdspark__PageLayout pl = PDSPARK__PAGE_LAYOUT__INIT;
    Pdspark__AuxLayout al = PDSPARK__AUX_LAYOUT__INIT;
    req.version = sp.version = dst.version = kv.version = aux.version = pl.version = al.version =
        PD_PROTO_VERSION;
    req.request_id = (char *)"req-42";
    uint32_t toks[5] = {151643, 1, 2, 3, 70000};
    req.n_token_ids = 5;
    req.token_ids = toks;
    sp.temperature = 0.7f;
    sp.top_k = 20;
    sp.seed = 1234567890123ull;
    char *stops[2] = {(char *)"\n\n", (char *)"</s>"};
    sp.n_stop = 2;
    sp.stop = stops;
    req.sampling = &sp;
    uint8_t waddr[7] = {9, 8, 7, 6, 5, 4, 3};
    dst.worker_address.len = sizeof(waddr);
    dst.worker_address.data = waddr;
    uint32_t pages[3] = {17, 4, 99};
    dst.n_page_ids = 3;
    dst.page_ids = pages;
    uint8_t rkey[4] = {0xde, 0xad, 0xbe, 0xef};
    kv.rkey.len = 4;
    kv.rkey.data = rkey;
    kv.base_addr = 0x7f0000001000ull;
    kv.length = 4u << 20;
    aux.rkey = kv.rkey;
    aux.base_addr = 0x7f0000900000ull;
    aux.length = 1u << 20;
    pl.page_size = 16;
    pl.dtype = PDSPARK__KV_DTYPE__KV_DTYPE_BF16;
    pl.n_layers = 28;
    pl.n_kv_heads = 8;
    pl.head_dim = 128;
    pl.bytes_per_page = 16ull * 28 * 8 * 128 * 2 * 2;
    al.mode = PDSPARK__AUX_MODE__AUX_MODE_CTX;
    al.rows = 5;
    al.row_bytes = 2560 * 2;
    dst.kv_pool = &kv;
    dst.aux = &aux;
    dst.page_layout = &pl;
    dst.aux_layout = &al;
    req.dest = &dst;

    size_t n = pdspark__prefill_request__get_packed_size(&req);
    uint8_t *buf = malloc(n);
    TEST_CHECK(pdspark__prefill_request__pack(&req, buf) == n);
    Pdspark__PrefillRequest *r = pdspark__prefill_request__unpack(NULL, n, buf);
    TEST_CHECK(r != NULL);
    if (r != NULL) {
        TEST_CHECK(pd_proto_version_check(&r->base, NULL) == PD_OK);
        TEST_CHECK(strcmp(r->request_id, "req-42") == 0);
        TEST_CHECK(r->n_token_ids == 5 && r->token_ids[4] == 70000);
        TEST_CHECK(r->sampling != NULL && r->sampling->top_k == 20 &&
                   r->sampling->seed == 1234567890123ull && r->sampling->n_stop == 2 &&
                   strcmp(r->sampling->stop[1], "</s>") == 0);
        const Pdspark__Destination *d = r->dest;
        TEST_CHECK(d != NULL && d->worker_address.len == 7 && d->worker_address.data[6] == 3);
        TEST_CHECK(d != NULL && d->n_page_ids == 3 && d->page_ids[2] == 99);
        TEST_CHECK(d != NULL && d->kv_pool != NULL && d->kv_pool->rkey.len == 4 &&
                   d->kv_pool->rkey.data[0] == 0xde && d->kv_pool->base_addr == kv.base_addr);
        TEST_CHECK(d != NULL && d->page_layout != NULL && d->page_layout->n_layers == 28 &&
                   d->page_layout->dtype == PDSPARK__KV_DTYPE__KV_DTYPE_BF16 &&
                   d->page_layout->bytes_per_page == pl.bytes_per_page);
        TEST_CHECK(d != NULL && d->aux_layout != NULL &&
                   d->aux_layout->mode == PDSPARK__AUX_MODE__AUX_MODE_CTX);
        pdspark__prefill_request__free_unpacked(r, NULL);
    }
    /* truncated bytes do not unpack */
    TEST_CHECK(pdspark__prefill_request__unpack(NULL, n - 3, buf) == NULL);
    free(buf);
}

static void test_chunk_roundtrip(void)
{
    Pdspark__GenerateChunk c = PDSPARK__GENERATE_CHUNK__INIT;
    Pdspark__Usage u = PDSPARK__USAGE__INIT;
    Pdspark__DSparkStats st = PDSPARK__DSPARK_STATS__INIT;
    c.version = u.version = st.version = PD_PROTO_VERSION;
    c.final = true;
    c.finish_reason = PDSPARK__FINISH_REASON__FINISH_REASON_STOP;
    u.prompt_tokens = 12;
    u.completion_tokens = 30;
    uint32_t acc[4] = {6, 0, 3, 6};
    st.rounds = 4;
    st.n_accepted_per_round = 4;
    st.accepted_per_round = acc;
    st.tau = 4.75f;
    c.usage = &u;
    c.stats = &st;
    uint8_t buf[256];
    size_t n = pdspark__generate_chunk__pack(&c, buf);
    Pdspark__GenerateChunk *r = pdspark__generate_chunk__unpack(NULL, n, buf);
    TEST_CHECK(r != NULL && r->final && r->usage != NULL && r->usage->completion_tokens == 30 &&
               r->stats != NULL && r->stats->n_accepted_per_round == 4 &&
               r->stats->accepted_per_round[2] == 3 && r->stats->tau == 4.75f &&
               r->finish_reason == PDSPARK__FINISH_REASON__FINISH_REASON_STOP);
    if (r != NULL)
        pdspark__generate_chunk__free_unpacked(r, NULL);
}

static void test_version_check(void)
{
    pd_err err;
    Pdspark__HealthRequest h = PDSPARK__HEALTH_REQUEST__INIT;
    TEST_CHECK(pd_proto_version_check(&h.base, &err) == PD_ERR_INVALID);   /* unset */
    TEST_CHECK(strstr(err.msg, "not set") != NULL);
    h.version = PD_PROTO_VERSION + 1;
    TEST_CHECK(pd_proto_version_check(&h.base, &err) == PD_ERR_INVALID);
    TEST_CHECK_MSG(strstr(err.msg, "pdspark.HealthRequest: protocol version 2, expected 1") != NULL,
                   "%s", err.msg);
    h.version = PD_PROTO_VERSION;
    TEST_CHECK(pd_proto_version_check(&h.base, &err) == PD_OK);
    TEST_CHECK(pd_proto_version_of(&h.base) == PD_PROTO_VERSION);
    TEST_CHECK(pd_proto_version_check(NULL, &err) == PD_ERR_INVALID);
    /* a message decoded from an older peer without the field reads as 0 -> refused */
    uint8_t empty[1];
    Pdspark__HealthRequest *r = pdspark__health_request__unpack(NULL, 0, empty);
    TEST_CHECK(r != NULL && pd_proto_version_check(&r->base, NULL) == PD_ERR_INVALID);
    if (r != NULL)
        pdspark__health_request__free_unpacked(r, NULL);
}

int main(void)
{
    test_version_fields();
    test_prefill_roundtrip();
    test_chunk_roundtrip();
    test_version_check();
    TEST_DONE();
}
