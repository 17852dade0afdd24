/* test_safetensors.c - pd_safetensors: the bundled sharded and single-file checkpoints, a
 *   round trip through a small writer, and malformed files (by hand, and 1500 mutated ones) that
 *   must each give a clear error naming the file (and the tensor where there is one) without
 *   crashing.
 * Corrupt files are written into a mkdtemp() directory that is removed at the end. */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pd_safetensors.h"
#include "test_util.h"

#define TARGET_DIR PD_MODELS "/tiny-code-qwen3"
#define DRAFT_FILE PD_MODELS "/tiny-code-dspark/model.safetensors"

static char tmp_root[256];

/* ---- helpers ----------------------------------------------------------------------------- */

typedef struct {
    const char *name;
    const char *dtype;
    int n_dims;
    int64_t shape[4];
    const void *data;
    size_t n_bytes;
} test_entry;

static char *test_path(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof(buf[k]), "%s/%s", tmp_root, name);
    return buf[k];
}

/* Writes a file: 8-byte LE length (hlen_field, or the real one when 0), header, data. */
static int test_write_raw(const char *path, uint64_t hlen_field, const char *header,
                          const void *data, size_t n)
{
    FILE *fp = fopen(path, "wb");
    if (fp == NULL)
        return -1;
    uint64_t hl = hlen_field ? hlen_field : strlen(header);
    unsigned char le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (unsigned char)(hl >> (8 * i));
    int ok = fwrite(le, 1, 8, fp) == 8 && fwrite(header, 1, strlen(header), fp) == strlen(header) &&
             (n == 0 || fwrite(data, 1, n, fp) == n);
    return (fclose(fp) == 0 && ok) ? 0 : -1;
}

/* A well-formed safetensors file; the header is padded with spaces to a multiple of 8. */
static int test_write_st(const char *path, const test_entry *e, size_t n)
{
    cJSON *root = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
    cJSON_AddStringToObject(meta, "format", "pt");
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        cJSON *t = cJSON_AddObjectToObject(root, e[i].name);
        cJSON_AddStringToObject(t, "dtype", e[i].dtype);
        cJSON *sh = cJSON_AddArrayToObject(t, "shape");
        for (int d = 0; d < e[i].n_dims; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)e[i].shape[d]));
        cJSON *of = cJSON_AddArrayToObject(t, "data_offsets");
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(of, cJSON_CreateNumber((double)(off + e[i].n_bytes)));
        off += e[i].n_bytes;
    }
    char *js = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    size_t hl = strlen(js), padded = (hl + 7) & ~(size_t)7;
    char *hdr = malloc(padded + 1);
    memcpy(hdr, js, hl);
    memset(hdr + hl, ' ', padded - hl);
    hdr[padded] = '\0';
    free(js);
    unsigned char *data = malloc(off ? off : 1);
    off = 0;
    for (size_t i = 0; i < n; i++) {
        if (e[i].n_bytes)
            memcpy(data + off, e[i].data, e[i].n_bytes);
        off += e[i].n_bytes;
    }
    int rc = test_write_raw(path, 0, hdr, data, off);
    free(hdr);
    free(data);
    return rc;
}

/* Opening path must fail with want; the message must contain every non-NULL needle. */
static void test_expect_fail(const char *path, pd_status want, const char *n1, const char *n2)
{
    pd_st_set *set = (pd_st_set *)0x1;
    pd_err err;
    pd_err_clear(&err);
    pd_status st = pd_st_open(path, &set, &err);
    TEST_CHECK_MSG(st == want, "%s: got %s (%s), want %s", path, pd_status_str(st), err.msg,
                   pd_status_str(want));
    TEST_CHECK_MSG(set == (pd_st_set *)0x1, "%s: out written on failure", path);
    printf("  expected error: %s\n", err.msg);
    if (n1 != NULL)
        TEST_CHECK_MSG(strstr(err.msg, n1) != NULL, "message \"%s\" lacks \"%s\"", err.msg, n1);
    if (n2 != NULL)
        TEST_CHECK_MSG(strstr(err.msg, n2) != NULL, "message \"%s\" lacks \"%s\"", err.msg, n2);
    if (st == PD_OK && set != (pd_st_set *)0x1)
        pd_st_close(set);
}

static int test_rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* ---- cases ------------------------------------------------------------------------------- */

static void test_st_sharded_target(void)
{
    pd_st_set *set = NULL;
    pd_err err;
    pd_err_clear(&err);
    pd_status st = pd_st_open(TARGET_DIR, &set, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        return;
    TEST_CHECK(pd_st_count(set) == 8 * 11 + 2);
    for (size_t i = 1; i < pd_st_count(set); i++)
        TEST_CHECK(strcmp(pd_st_at(set, i - 1)->name, pd_st_at(set, i)->name) < 0);
    TEST_CHECK(pd_st_at(set, pd_st_count(set)) == NULL);

    const pd_st_tensor *t = pd_st_find(set, "model.embed_tokens.weight");
    TEST_CHECK(t != NULL);
    if (t != NULL) {
        TEST_CHECK(t->dtype == KERN_DTYPE_BF16 && t->n_dims == 2 && t->shape[0] == 8192 &&
                   t->shape[1] == 256 && t->n_elems == 8192 * 256 && t->n_bytes == 8192 * 512);
        TEST_CHECK(strstr(t->file, "model-00001-of-00003.safetensors") != NULL);
    }
    t = pd_st_find(set, "model.norm.weight");
    TEST_CHECK(t != NULL && strstr(t->file, "model-00003-of-00003.safetensors") != NULL);
    TEST_CHECK(pd_st_find(set, "lm_head.weight") == NULL);
    TEST_CHECK(pd_st_find(set, "__metadata__") == NULL);

    /* the bytes pd_st hands out are the file's bytes at 8 + header + data_offsets[0] */
    if (t != NULL) {
        size_t n = 0;
        unsigned char *raw = (unsigned char *)test_read_file(t->file, &n);
        uint64_t hl = 0;
        for (int i = 7; i >= 0; i--)
            hl = (hl << 8) | raw[i];
        char *hj = malloc(hl + 1);
        memcpy(hj, raw + 8, hl);
        hj[hl] = '\0';
        cJSON *h = cJSON_Parse(hj);
        cJSON *e = cJSON_GetObjectItem(h, "model.norm.weight");
        cJSON *of = cJSON_GetObjectItem(e, "data_offsets");
        size_t begin = (size_t)cJSON_GetArrayItem(of, 0)->valuedouble;
        TEST_CHECK(memcmp(raw + 8 + hl + begin, t->data, t->n_bytes) == 0);
        const unsigned char *b = raw + 8 + hl + begin;
        uint32_t bits = ((uint32_t)b[1] << 24) | ((uint32_t)b[0] << 16);
        float manual;
        memcpy(&manual, &bits, 4);
        uint16_t h0;
        memcpy(&h0, t->data, 2);
        TEST_CHECK(kern_bf16_to_f32(h0) == manual);
        cJSON_Delete(h);
        free(hj);
        free(raw);
    }

    const pd_st_tensor *g = NULL;
    int64_t good[2] = {768, 256}, bad[2] = {768, 255};
    TEST_CHECK(pd_st_get(set, "model.layers.0.mlp.gate_proj.weight", 2, good, &g, &err) == PD_OK &&
               g != NULL);
    g = NULL;
    st = pd_st_get(set, "model.layers.0.mlp.gate_proj.weight", 2, bad, &g, &err);
    TEST_CHECK(st == PD_ERR_INVALID && g == NULL);
    TEST_CHECK_MSG(strstr(err.msg, "model.layers.0.mlp.gate_proj.weight") &&
                   strstr(err.msg, "model-0000") && strstr(err.msg, "[768, 256]") &&
                   strstr(err.msg, "[768, 255]"), "%s", err.msg);
    st = pd_st_get(set, "model.layers.0.mlp.gate_proj.weight", 1, good, &g, &err);
    TEST_CHECK(st == PD_ERR_INVALID);
    st = pd_st_get(set, "no.such.tensor", 1, good, &g, &err);
    TEST_CHECK(st == PD_ERR_NOT_FOUND && strstr(err.msg, "no.such.tensor") != NULL);
    pd_st_close(set);
    pd_st_close(NULL);
}

static void test_st_single_file(void)
{
    pd_st_set *set = NULL;
    pd_err err;
    pd_status st = pd_st_open(DRAFT_FILE, &set, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        return;
    TEST_CHECK(pd_st_count(set) == 29);
    const pd_st_tensor *t = pd_st_find(set, "confidence_head.proj.weight");
    TEST_CHECK(t != NULL && t->n_dims == 2 && t->shape[0] == 1 && t->shape[1] == 320);
    TEST_CHECK(pd_st_find(set, "embed_tokens.weight") == NULL);
    pd_st_close(set);
    /* the directory form finds model.safetensors */
    st = pd_st_open(PD_MODELS "/tiny-code-dspark-rnn", &set, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st == PD_OK) {
        TEST_CHECK(pd_st_find(set, "markov_head.joint_proj.weight") != NULL);
        pd_st_close(set);
    }
}

static void test_st_roundtrip(void)
{
    float f32[6] = {1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, -7.0f};
    uint16_t bf16[4], f16[3];
    for (int i = 0; i < 4; i++)
        bf16[i] = kern_f32_to_bf16((float)i - 1.5f);
    for (int i = 0; i < 3; i++)
        f16[i] = kern_f32_to_f16((float)i * 0.5f);
    int32_t i32[2] = {-5, 123456};
    test_entry e[] = {
        {"a.f32", "F32", 2, {2, 3}, f32, sizeof(f32)},
        {"b.bf16", "BF16", 1, {4}, bf16, sizeof(bf16)},
        {"c.f16", "F16", 3, {1, 3, 1}, f16, sizeof(f16)},
        {"d.i32", "I32", 1, {2}, i32, sizeof(i32)},
        {"e.empty", "F32", 2, {0, 4}, NULL, 0},
        {"f.scalar", "F32", 0, {0}, f32, 4},
    };
    const char *path = test_path("rt.safetensors");
    TEST_CHECK(test_write_st(path, e, sizeof(e) / sizeof(e[0])) == 0);
    pd_st_set *set = NULL;
    pd_err err;
    pd_status st = pd_st_open(path, &set, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        return;
    TEST_CHECK(pd_st_count(set) == 6);
    const pd_st_tensor *t = pd_st_find(set, "a.f32");
    TEST_CHECK(t && t->dtype == KERN_DTYPE_F32 && t->n_elems == 6 &&
               memcmp(t->data, f32, sizeof(f32)) == 0);
    t = pd_st_find(set, "b.bf16");
    TEST_CHECK(t && t->dtype == KERN_DTYPE_BF16);
    if (t != NULL) {
        float out[4];
        TEST_CHECK(kern_convert_host(out, KERN_DTYPE_F32, t->data, KERN_DTYPE_BF16, 4, &err) ==
                   PD_OK);
        TEST_CHECK(out[0] == -1.5f && out[3] == 1.5f);
    }
    t = pd_st_find(set, "c.f16");
    TEST_CHECK(t && t->dtype == KERN_DTYPE_F16 && t->n_dims == 3 && t->n_elems == 3);
    t = pd_st_find(set, "d.i32");
    TEST_CHECK(t && t->dtype == KERN_DTYPE_I32);
    if (t != NULL) {
        int32_t v;   /* safetensors does not align data; read through memcpy */
        memcpy(&v, (const char *)t->data + 4, 4);
        TEST_CHECK(v == 123456);
    }
    t = pd_st_find(set, "e.empty");
    TEST_CHECK(t && t->n_elems == 0 && t->n_bytes == 0);
    t = pd_st_find(set, "f.scalar");
    TEST_CHECK(t && t->n_dims == 0 && t->n_elems == 1 && t->n_bytes == 4);
    pd_st_close(set);
}

static void test_st_bad_files(void)
{
    const char *p;
    static const uint8_t zeros[64];

    test_expect_fail(test_path("does-not-exist"), PD_ERR_IO, "does-not-exist", NULL);
    mkdir(test_path("empty-dir"), 0700);
    test_expect_fail(test_path("empty-dir"), PD_ERR_IO, "empty-dir", "model.safetensors");

    p = test_path("short.safetensors");
    FILE *fp = fopen(p, "wb");
    fwrite("\x10\0\0", 1, 3, fp);
    fclose(fp);
    test_expect_fail(p, PD_ERR_INVALID, "short.safetensors", "truncated");

    p = test_path("hlen.safetensors");
    test_write_raw(p, 1000, "{}", NULL, 0);
    test_expect_fail(p, PD_ERR_INVALID, "hlen.safetensors", "header length 1000");
    p = test_path("hlen-huge.safetensors");
    test_write_raw(p, UINT64_MAX, "{}", NULL, 0);
    test_expect_fail(p, PD_ERR_INVALID, "hlen-huge.safetensors", "header length");

    p = test_path("json.safetensors");
    test_write_raw(p, 0, "{\"a\": {\"dtype\": \"F32\",", NULL, 0);
    test_expect_fail(p, PD_ERR_INVALID, "json.safetensors", "JSON");
    p = test_path("array.safetensors");
    test_write_raw(p, 0, "[1, 2]  ", NULL, 0);
    test_expect_fail(p, PD_ERR_INVALID, "array.safetensors", "object");

    p = test_path("past.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
                   zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "past.safetensors", "tensor w");
    p = test_path("order.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}",
                   zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "order.safetensors", "tensor w");
    p = test_path("bytes.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"BF16\",\"shape\":[3,2],\"data_offsets\":[0,8]}}",
                   zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "bytes.safetensors", "tensor w");
    p = test_path("dtype.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}",
                   zeros, 8);
    test_expect_fail(p, PD_ERR_UNSUPPORTED, "dtype.safetensors", "tensor w: unsupported dtype F64");
    p = test_path("negdim.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1,2],\"data_offsets\":[0,8]}}",
                   zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "negdim.safetensors", "tensor w");
    p = test_path("fracdim.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,8]}}",
                   zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "fracdim.safetensors", "tensor w");
    p = test_path("nooff.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "nooff.safetensors", "tensor w");
    p = test_path("bigshape.safetensors");
    test_write_raw(p, 0, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],"
                   "\"data_offsets\":[0,8]}}", zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "bigshape.safetensors", "tensor w");
    p = test_path("overlap.safetensors");
    test_write_raw(p, 0, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                   "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", zeros, 12);
    test_expect_fail(p, PD_ERR_INVALID, "overlap.safetensors", "overlap");
    p = test_path("dup.safetensors");
    test_write_raw(p, 0, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                   "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", zeros, 8);
    test_expect_fail(p, PD_ERR_INVALID, "dup.safetensors", "tensor a");

    /* the real draft checkpoint cut in half: some tensor's data_offsets run past the end */
    size_t n = 0;
    unsigned char *raw = (unsigned char *)test_read_file(DRAFT_FILE, &n);
    TEST_CHECK(raw != NULL && n > 4096);
    if (raw != NULL) {
        p = test_path("half.safetensors");
        fp = fopen(p, "wb");
        fwrite(raw, 1, n / 2, fp);
        fclose(fp);
        test_expect_fail(p, PD_ERR_INVALID, "half.safetensors", "past the end");
        /* and cut inside the header */
        p = test_path("hdrcut.safetensors");
        fp = fopen(p, "wb");
        fwrite(raw, 1, 100, fp);
        fclose(fp);
        test_expect_fail(p, PD_ERR_INVALID, "hdrcut.safetensors", "header length");
        free(raw);
    }
}

static void test_st_bad_index(void)
{
    /* a copy of the sharded target whose index names a shard that is not there */
    const char *dir = test_path("idx-missing");
    mkdir(dir, 0700);
    char buf[1024];
    for (int i = 1; i <= 3; i++) {
        char name[64];
        snprintf(name, sizeof(name), "model-0000%d-of-00003.safetensors", i);
        snprintf(buf, sizeof(buf), "%s/%s", dir, name);
        char src[512];
        snprintf(src, sizeof(src), "%s/%s", TARGET_DIR, name);
        if (i != 2)
            TEST_CHECK(symlink(src, buf) == 0);
    }
    snprintf(buf, sizeof(buf), "%s/model.safetensors.index.json", dir);
    size_t n = 0;
    unsigned char *idx = (unsigned char *)test_read_file(TARGET_DIR "/model.safetensors.index.json", &n);
    TEST_CHECK(idx != NULL);
    if (idx == NULL)
        return;
    FILE *fp = fopen(buf, "wb");
    fwrite(idx, 1, n, fp);
    fclose(fp);
    test_expect_fail(dir, PD_ERR_INVALID, "model-00002-of-00003.safetensors", "index.json");

    /* all shards present, but the index claims a tensor the shard does not hold */
    dir = test_path("idx-wrong");
    mkdir(dir, 0700);
    for (int i = 1; i <= 3; i++) {
        char name[64], src[512];
        snprintf(name, sizeof(name), "model-0000%d-of-00003.safetensors", i);
        snprintf(buf, sizeof(buf), "%s/%s", dir, name);
        snprintf(src, sizeof(src), "%s/%s", TARGET_DIR, name);
        TEST_CHECK(symlink(src, buf) == 0);
    }
    char *text = malloc(n + 1);
    memcpy(text, idx, n);
    text[n] = '\0';
    cJSON *root = cJSON_Parse(text);
    cJSON *wm = cJSON_GetObjectItem(root, "weight_map");
    cJSON_AddStringToObject(wm, "model.extra.weight", "model-00003-of-00003.safetensors");
    char *out = cJSON_Print(root);
    snprintf(buf, sizeof(buf), "%s/model.safetensors.index.json", dir);
    fp = fopen(buf, "wb");
    fputs(out, fp);
    fclose(fp);
    test_expect_fail(dir, PD_ERR_INVALID, "model.extra.weight", "model-00003-of-00003.safetensors");

    /* a shard name escaping the directory */
    cJSON_DeleteItemFromObject(wm, "model.extra.weight");
    cJSON_ReplaceItemInObject(wm, "model.norm.weight",
                              cJSON_CreateString("../model-00003-of-00003.safetensors"));
    free(out);
    out = cJSON_Print(root);
    fp = fopen(buf, "wb");
    fputs(out, fp);
    fclose(fp);
    test_expect_fail(dir, PD_ERR_INVALID, "model.norm.weight", NULL);

    /* not JSON at all */
    fp = fopen(buf, "wb");
    fputs("{\"weight_map\": {", fp);
    fclose(fp);
    test_expect_fail(dir, PD_ERR_INVALID, "index.json", "JSON");
    fp = fopen(buf, "wb");
    fputs("{\"metadata\": {}}", fp);
    fclose(fp);
    test_expect_fail(dir, PD_ERR_INVALID, "index.json", "weight_map");

    free(out);
    cJSON_Delete(root);
    free(text);
    free(idx);
}

/* Mutated files: a small valid file with 1-3 header bytes changed, or cut, 1500 times. Each
 * open either fails with PD_ERR_INVALID / PD_ERR_UNSUPPORTED naming the file, or gives tensors
 * whose every byte lies in the file (read here: a bound the parser missed faults or trips ASan)
 * and whose size is its shape's. */
static void test_st_fuzz(void)
{
    float f[12];
    uint16_t b[6];
    int32_t ids[5] = { 1, 2, 3, 4, 5 };
    for (int i = 0; i < 12; i++)
        f[i] = (float)i;
    for (int i = 0; i < 6; i++)
        b[i] = (uint16_t)(0x3f80 + i);
    test_entry e[3] = {
        { "model.a.weight", "F32", 2, { 3, 4 }, f, sizeof(f) },
        { "model.b", "BF16", 1, { 6 }, b, sizeof(b) },
        { "ids", "I32", 1, { 5 }, ids, sizeof(ids) },
    };
    const char *src = test_path("fuzz-src.safetensors"), *p = test_path("fuzz.safetensors");
    TEST_CHECK(test_write_st(src, e, 3) == 0);
    FILE *fp = fopen(src, "rb");
    unsigned char buf[4096];
    size_t len = fp != NULL ? fread(buf, 1, sizeof(buf), fp) : 0;
    if (fp != NULL)
        fclose(fp);
    TEST_CHECK(len > 16 && len < sizeof(buf));
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)buf[i] << (8 * i);
    uint64_t x = 12345;
    int opened = 0, refused = 0, other = 0, bad_tensor = 0;
    for (int it = 0; it < 1500 && len > 16; it++) {
        unsigned char m[4096];
        memcpy(m, buf, len);
        size_t n = len;
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int k = 1 + (int)((x >> 33) % 3);
        for (int j = 0; j < k; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            size_t at = (size_t)((x >> 20) % (8 + hl));   /* the length field and the header */
            m[at] = (unsigned char)(x >> 52);
        }
        if ((x >> 8) % 8 == 0)
            n = (size_t)((x >> 12) % len);
        FILE *w = fopen(p, "wb");
        fwrite(m, 1, n, w);
        fclose(w);
        pd_st_set *set = NULL;
        pd_err err = {0};
        pd_status st = pd_st_open(p, &set, &err);
        if (st == PD_OK) {
            opened++;
            unsigned sum = 0;
            for (size_t t = 0; t < pd_st_count(set); t++) {
                const pd_st_tensor *ts = pd_st_at(set, t);
                const unsigned char *d = ts->data;
                for (size_t i = 0; i < ts->n_bytes; i++)
                    sum += d[i];
                bad_tensor += ts->n_bytes != (size_t)ts->n_elems * kern_dtype_size(ts->dtype);
            }
            (void)sum;
            pd_st_close(set);
        } else if ((st == PD_ERR_INVALID || st == PD_ERR_UNSUPPORTED) && strstr(err.msg, "fuzz.safetensors")) {
            refused++;
        } else {
            other++;
            if (other <= 3)
                printf("  fuzz %d: %s %s\n", it, pd_status_str(st), err.msg);
        }
    }
    printf("safetensors fuzz: 1500 mutated files: %d opened, %d refused, %d otherwise\n", opened, refused, other);
    TEST_CHECK_MSG(other == 0 && bad_tensor == 0 && opened > 0 && refused > 0,
                   "fuzz: %d opened, %d refused, %d other errors, %d tensors with a wrong size", opened, refused,
                   other, bad_tensor);
}

int main(void)
{
    snprintf(tmp_root, sizeof(tmp_root), "%s/pd_test_st_XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (mkdtemp(tmp_root) == NULL)
        TEST_SKIP("mkdtemp failed");
    test_st_sharded_target();
    test_st_single_file();
    test_st_roundtrip();
    test_st_bad_files();
    test_st_bad_index();
    test_st_fuzz();
    nftw(tmp_root, test_rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    TEST_DONE();
}
