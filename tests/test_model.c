/* test_model.c - config parsing and weight loading of the Qwen3 target and the DSpark drafters
 *   on the CPU backend: the bundled tiny models (the drafts borrow the target's embedding), a
 *   draft that carries its own embed/lm_head (written here), and bad configs and checkpoints
 *   that must each fail with a message naming the file, field or tensor.
 * Variants are written into a mkdtemp() directory (config.json edited, weights symlinked). */
#define _GNU_SOURCE
#include <cjson/cJSON.h>
#include <dirent.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kern_backend.h"
#include "pd_model.h"
#include "pd_safetensors.h"
#include "test_util.h"

#define TARGET_DIR PD_MODELS "/tiny-code-qwen3"
#define DRAFT_DIR PD_MODELS "/tiny-code-dspark"
#define GATED_DIR PD_MODELS "/tiny-code-dspark-gated"
#define RNN_DIR PD_MODELS "/tiny-code-dspark-rnn"

static char tmp_root[256];
static kern_backend *be;

/* ---- helpers ----------------------------------------------------------------------------- */

static char *test_path(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof(buf[k]), "%s/%s", tmp_root, name);
    return buf[k];
}

static void test_write_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "wb");
    if (fp != NULL) {
        fputs(text, fp);
        fclose(fp);
    }
}

typedef struct {
    const char *name;
    const char *dtype;
    int n_dims;
    int64_t shape[2];
    const void *data;
    size_t n_bytes;
} test_entry;

/* A safetensors file. odd_header makes the header length odd so every tensor's data is
 * misaligned in the mmap (legal, and the loader must cope). */
static int test_write_st(const char *path, const test_entry *e, size_t n, int odd_header)
{
    cJSON *root = cJSON_CreateObject();
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
    size_t hl = strlen(js);
    size_t padded = odd_header ? (hl | 1) : (hl + 7) & ~(size_t)7;
    FILE *fp = fopen(path, "wb");
    if (fp == NULL) {
        free(js);
        return -1;
    }
    unsigned char le[8];
    for (int i = 0; i < 8; i++)
        le[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    fwrite(le, 1, 8, fp);
    fwrite(js, 1, hl, fp);
    for (size_t i = hl; i < padded; i++)
        fputc(' ', fp);
    for (size_t i = 0; i < n; i++)
        if (e[i].n_bytes)
            fwrite(e[i].data, 1, e[i].n_bytes, fp);
    free(js);
    return fclose(fp) == 0 ? 0 : -1;
}

/* Reads tensor name straight from a safetensors file (fread + cJSON, no pd_st): its raw bytes
 * (caller frees), dtype and element count. */
static unsigned char *test_raw_tensor(const char *path, const char *name, char dtype[8],
                                      size_t *n_elems)
{
    size_t n = 0;
    unsigned char *raw = (unsigned char *)test_read_file(path, &n);
    if (raw == NULL || n < 8)
        return NULL;
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--)
        hl = (hl << 8) | raw[i];
    cJSON *h = cJSON_ParseWithLength((const char *)raw + 8, hl);
    cJSON *e = cJSON_GetObjectItem(h, name);
    unsigned char *out = NULL;
    if (e != NULL) {
        cJSON *of = cJSON_GetObjectItem(e, "data_offsets");
        size_t b = (size_t)cJSON_GetArrayItem(of, 0)->valuedouble;
        size_t en = (size_t)cJSON_GetArrayItem(of, 1)->valuedouble;
        snprintf(dtype, 8, "%s", cJSON_GetObjectItem(e, "dtype")->valuestring);
        size_t cnt = 1;
        cJSON *sh = cJSON_GetObjectItem(e, "shape");
        for (cJSON *d = sh->child; d != NULL; d = d->next)
            cnt *= (size_t)d->valuedouble;
        *n_elems = cnt;
        out = malloc(en - b + 1);
        memcpy(out, raw + 8 + hl + b, en - b);
    }
    cJSON_Delete(h);
    free(raw);
    return out;
}

/* Compares a loaded weight (downloaded from the backend) with a BF16 tensor of a file, each
 * value decoded by hand: bf16 is the top half of an IEEE f32. */
static int test_weight_matches_file(const kern_weight *w, const char *file, const char *name)
{
    char dt[8] = "";
    size_t n = 0;
    unsigned char *raw = test_raw_tensor(file, name, dt, &n);
    if (raw == NULL || strcmp(dt, "BF16") != 0 || (int64_t)n != w->rows * w->cols ||
        w->dtype != KERN_DTYPE_F32) {
        free(raw);
        return 0;
    }
    float *got = malloc(n * sizeof(float));
    pd_err err;
    int ok = kern_download(be, got, w->data, n * sizeof(float), &err) == PD_OK;
    for (size_t i = 0; ok && i < n; i++) {
        uint32_t bits = ((uint32_t)raw[2 * i + 1] << 24) | ((uint32_t)raw[2 * i] << 16);
        float want;
        memcpy(&want, &bits, 4);
        uint16_t h = (uint16_t)(raw[2 * i] | (raw[2 * i + 1] << 8));
        ok = memcmp(&got[i], &want, 4) == 0 && kern_bf16_to_f32(h) == want;
    }
    free(got);
    free(raw);
    return ok;
}

typedef struct {
    const char *key;     /* top-level key of config.json */
    const char *value;   /* JSON text of the new value; NULL deletes the key */
} test_edit;

/* dst (under tmp_root) = src with config.json edited; every other file symlinked. */
static const char *test_variant(const char *dst_name, const char *src, const test_edit *ed,
                                size_t n_ed)
{
    const char *dst = test_path(dst_name);
    static char keep[8][512];
    static int k;
    k = (k + 1) % 8;
    snprintf(keep[k], sizeof(keep[k]), "%s", dst);
    dst = keep[k];
    mkdir(dst, 0700);
    DIR *dir = opendir(src);
    struct dirent *de;
    char a[1024], b[1024];
    while (dir != NULL && (de = readdir(dir)) != NULL) {
        if (de->d_name[0] == '.' || strcmp(de->d_name, "config.json") == 0)
            continue;
        snprintf(a, sizeof(a), "%s/%s", src, de->d_name);
        snprintf(b, sizeof(b), "%s/%s", dst, de->d_name);
        if (symlink(a, b) != 0)
            fprintf(stderr, "symlink %s failed\n", b);
    }
    if (dir != NULL)
        closedir(dir);
    snprintf(a, sizeof(a), "%s/config.json", src);
    size_t n = 0;
    unsigned char *text = (unsigned char *)test_read_file(a, &n);
    cJSON *root = cJSON_Parse((const char *)text);
    free(text);
    for (size_t i = 0; i < n_ed; i++) {
        cJSON_DeleteItemFromObjectCaseSensitive(root, ed[i].key);
        if (ed[i].value != NULL)
            cJSON_AddItemToObject(root, ed[i].key, cJSON_Parse(ed[i].value));
    }
    char *out = cJSON_Print(root);
    snprintf(b, sizeof(b), "%s/config.json", dst);
    test_write_text(b, out);
    free(out);
    cJSON_Delete(root);
    return dst;
}

static void test_check_msg(pd_status st, pd_status want, const pd_err *err, const char *what,
                           const char *n1, const char *n2)
{
    TEST_CHECK_MSG(st == want, "%s: got %s (%s), want %s", what, pd_status_str(st), err->msg,
                   pd_status_str(want));
    if (n1 != NULL)
        TEST_CHECK_MSG(strstr(err->msg, n1) != NULL, "%s: \"%s\" lacks \"%s\"", what, err->msg,
                       n1);
    if (n2 != NULL)
        TEST_CHECK_MSG(strstr(err->msg, n2) != NULL, "%s: \"%s\" lacks \"%s\"", what, err->msg,
                       n2);
    printf("  expected error (%s): %s\n", what, err->msg);
}

static void test_target_fail(const char *dir, pd_status want, const char *n1, const char *n2)
{
    pd_qwen3_model *m = (pd_qwen3_model *)0x1;
    pd_err err;
    pd_err_clear(&err);
    pd_status st = pd_qwen3_load(be, dir, &m, &err);
    test_check_msg(st, want, &err, dir, n1, n2);
    TEST_CHECK(m == (pd_qwen3_model *)0x1);
    if (st == PD_OK && m != (pd_qwen3_model *)0x1)
        pd_qwen3_free(m);
}

static void test_draft_fail(const char *dir, const pd_qwen3_model *t, pd_status want,
                            const char *n1, const char *n2)
{
    pd_dspark_model *m = (pd_dspark_model *)0x1;
    pd_err err;
    pd_err_clear(&err);
    pd_status st = pd_dspark_load(be, dir, t, &m, &err);
    test_check_msg(st, want, &err, dir, n1, n2);
    TEST_CHECK(m == (pd_dspark_model *)0x1);
    if (st == PD_OK && m != (pd_dspark_model *)0x1)
        pd_dspark_free(m);
}

static int test_rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* ---- configs ----------------------------------------------------------------------------- */

static void test_model_configs(void)
{
    pd_qwen3_config c;
    pd_err err;
    pd_status st = pd_qwen3_config_load(TARGET_DIR, &c, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    TEST_CHECK(strcmp(c.arch, "Qwen3ForCausalLM") == 0);
    TEST_CHECK(c.vocab_size == 8192 && c.hidden_size == 256 && c.intermediate_size == 768);
    TEST_CHECK(c.num_hidden_layers == 8 && c.num_attention_heads == 4 &&
               c.num_key_value_heads == 2 && c.head_dim == 64);
    TEST_CHECK(c.rms_norm_eps == 1e-6f && c.rope_theta == 10000.0f);
    TEST_CHECK(c.max_position_embeddings == 4096 && c.tie_word_embeddings == 1 &&
               c.attention_bias == 0);
    TEST_CHECK(c.n_eos == 1 && c.eos_ids[0] == 8188 && c.bos_id == 8188);
    TEST_CHECK(c.pad_id == 8188);   /* null in config.json, 8188 in generation_config.json */

    pd_dspark_config d;
    st = pd_dspark_config_load(DRAFT_DIR, &d, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    TEST_CHECK(strcmp(d.base.arch, "Qwen3DSparkModel") == 0 && d.base.num_hidden_layers == 2);
    TEST_CHECK(d.block_size == 7 && d.mask_token_id == 8191 && d.n_target_layers == 3 &&
               d.target_layer_ids[0] == 1 && d.target_layer_ids[1] == 3 &&
               d.target_layer_ids[2] == 5 && d.num_target_layers == 8);
    TEST_CHECK(d.markov_rank == 64 && d.markov_type == PD_MARKOV_VANILLA &&
               d.enable_confidence_head == 1 && d.confidence_head_with_markov == 1);
    TEST_CHECK(pd_dspark_config_check_target(&d, &c, &err) == PD_OK);
    st = pd_dspark_config_load(GATED_DIR, &d, &err);
    TEST_CHECK(st == PD_OK && d.markov_type == PD_MARKOV_GATED);
    st = pd_dspark_config_load(RNN_DIR, &d, &err);
    TEST_CHECK(st == PD_OK && d.markov_type == PD_MARKOV_RNN);

    /* check_target on its own: the final layer is never a tap, -1 (embeddings) is */
    pd_dspark_config bad = d;
    bad.target_layer_ids[1] = 7;
    st = pd_dspark_config_check_target(&bad, &c, &err);
    test_check_msg(st, PD_ERR_INVALID, &err, "tap 7", "target_layer_ids[1] = 7", NULL);
    bad.target_layer_ids[1] = -1;
    TEST_CHECK(pd_dspark_config_check_target(&bad, &c, &err) == PD_OK);
    bad.target_layer_ids[1] = -2;
    TEST_CHECK(pd_dspark_config_check_target(&bad, &c, &err) == PD_ERR_INVALID);
    bad = d;
    bad.mask_token_id = 9000;
    TEST_CHECK(pd_dspark_config_check_target(&bad, &c, &err) == PD_ERR_INVALID);
    bad = d;
    bad.base.head_dim = 32;
    st = pd_dspark_config_check_target(&bad, &c, &err);
    test_check_msg(st, PD_ERR_INVALID, &err, "head_dim", "head_dim 32", "64");

    /* older transformers keys: rope_theta and torch_dtype at top level; eos as a list;
     * no head_dim (hidden / heads); no generation_config.json */
    const char *dir = test_path("old-keys");
    mkdir(dir, 0700);
    char p[600];
    snprintf(p, sizeof(p), "%s/config.json", dir);
    test_write_text(p, "{\"architectures\": [\"Qwen3ForCausalLM\"], \"vocab_size\": 1000,"
                       " \"hidden_size\": 128, \"intermediate_size\": 256,"
                       " \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                       " \"num_key_value_heads\": 1, \"rope_theta\": 1000000.0,"
                       " \"rope_scaling\": null, \"torch_dtype\": \"bfloat16\","
                       " \"sliding_window\": 4096, \"use_sliding_window\": false,"
                       " \"eos_token_id\": [7, 9], \"tie_word_embeddings\": false}");
    st = pd_qwen3_config_load(dir, &c, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    TEST_CHECK(c.rope_theta == 1000000.0f && c.head_dim == 32 && c.n_eos == 2 &&
               c.eos_ids[0] == 7 && c.eos_ids[1] == 9 && c.bos_id == -1 && c.pad_id == -1 &&
               c.rms_norm_eps == 1e-6f && c.tie_word_embeddings == 0);
    snprintf(p, sizeof(p), "%s/generation_config.json", dir);
    test_write_text(p, "{\"eos_token_id\": [3, 4, 5], \"pad_token_id\": 0}");
    st = pd_qwen3_config_load(dir, &c, &err);
    TEST_CHECK(st == PD_OK && c.n_eos == 3 && c.eos_ids[2] == 5 && c.pad_id == 0);
    test_write_text(p, "{\"eos_token_id\": 5000}");
    st = pd_qwen3_config_load(dir, &c, &err);
    test_check_msg(st, PD_ERR_INVALID, &err, "eos out of vocab", "generation_config.json",
                   "5000");
    test_write_text(p, "{\"eos_token_id\": ");
    st = pd_qwen3_config_load(dir, &c, &err);
    test_check_msg(st, PD_ERR_INVALID, &err, "bad generation_config", "generation_config.json",
                   "JSON");
}

static void test_model_bad_configs(void)
{
    pd_qwen3_config c;
    pd_err err;
    pd_status st = pd_qwen3_config_load(test_path("no-such-dir"), &c, &err);
    test_check_msg(st, PD_ERR_IO, &err, "missing dir", "no-such-dir", NULL);
    mkdir(test_path("empty"), 0700);
    st = pd_qwen3_config_load(test_path("empty"), &c, &err);
    test_check_msg(st, PD_ERR_IO, &err, "no config.json", "config.json", NULL);
    test_target_fail(test_path("empty"), PD_ERR_IO, "config.json", NULL);

    const char *dir = test_variant("badjson", TARGET_DIR, NULL, 0);
    char p[600];
    snprintf(p, sizeof(p), "%s/config.json", dir);
    test_write_text(p, "{\n  \"vocab_size\": 8192,\n  \"hidden_size\": ,\n}\n");
    test_target_fail(dir, PD_ERR_INVALID, "config.json", "line 3");
    test_write_text(p, "[1, 2]");
    test_target_fail(dir, PD_ERR_INVALID, "config.json", "object");

    static const struct {
        const char *name;
        test_edit ed;
        pd_status want;
        const char *n1, *n2;
    } cases[] = {
        {"no-hidden", {"hidden_size", NULL}, PD_ERR_INVALID, "config.json", "hidden_size"},
        {"str-hidden", {"hidden_size", "\"256\""}, PD_ERR_INVALID, "hidden_size", "integer"},
        {"zero-layers", {"num_hidden_layers", "0"}, PD_ERR_INVALID, "num_hidden_layers", NULL},
        {"neg-vocab", {"vocab_size", "-5"}, PD_ERR_INVALID, "vocab_size", NULL},
        {"no-arch", {"architectures", NULL}, PD_ERR_INVALID, "architectures", NULL},
        {"llama", {"architectures", "[\"LlamaForCausalLM\"]"}, PD_ERR_UNSUPPORTED,
         "LlamaForCausalLM", "Qwen3ForCausalLM"},
        {"bias", {"attention_bias", "true"}, PD_ERR_UNSUPPORTED, "attention_bias", NULL},
        {"kvheads", {"num_key_value_heads", "3"}, PD_ERR_INVALID, "num_key_value_heads 3",
         "num_attention_heads 4"},
        {"old-scaling", {"rope_scaling", "{\"type\": \"longrope\", \"factor\": 2}"},
         PD_ERR_UNSUPPORTED, "rope_scaling", "longrope"},
        {"sliding", {"use_sliding_window", "true"}, PD_ERR_UNSUPPORTED, "use_sliding_window",
         NULL},
        {"theta", {"rope_parameters", "{\"rope_theta\": -1}"}, PD_ERR_INVALID, "rope_theta",
         NULL},
        {"eps", {"rms_norm_eps", "0"}, PD_ERR_INVALID, "rms_norm_eps", NULL},
        {"fp8", {"quantization_config", "{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                                        "\"weight_block_size\": [128, 128]}"},
         PD_ERR_UNSUPPORTED, "quantization_config", "fp8"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        dir = test_variant(cases[i].name, TARGET_DIR, &cases[i].ed, 1);
        test_target_fail(dir, cases[i].want, cases[i].n1, cases[i].n2);
    }
    /* a draft is not a target and vice versa */
    test_target_fail(DRAFT_DIR, PD_ERR_UNSUPPORTED, "Qwen3DSparkModel", "Qwen3ForCausalLM");
    test_draft_fail(TARGET_DIR, NULL, PD_ERR_UNSUPPORTED, "Qwen3ForCausalLM", "Qwen3DSparkModel");
}

/* RoPE scaling (yarn, linear) against tests/fixtures/rope/rope_cases.json: what Hugging Face
 * forms of each config (make_rope_cases.py transcribes its float32 steps). The parsed ramp,
 * attention factor and served context, every pair's inverse frequency and the cos/sin at a few
 * positions must be those bits. */
static void test_model_rope_scaling(void)
{
    size_t n = 0;
    char *text = test_read_file(PD_FIXTURES "/rope/rope_cases.json", &n);
    cJSON *root = text != NULL ? cJSON_Parse(text) : NULL;
    free(text);
    TEST_CHECK_MSG(cJSON_GetArraySize(root) >= 5, "rope_cases.json: %d cases", cJSON_GetArraySize(root));
    int n_cases = 0, n_bits = 0;
    for (const cJSON *cs = root != NULL ? root->child : NULL; cs != NULL; cs = cs->next) {
        const char *name = cJSON_GetObjectItem(cs, "name")->valuestring;
        test_edit ed[8];
        int n_ed = 0;
        for (const cJSON *e = cJSON_GetObjectItem(cs, "edits")->child; e != NULL && n_ed < 8; e = e->next, n_ed++) {
            ed[n_ed].key = cJSON_GetArrayItem(e, 0)->valuestring;
            ed[n_ed].value = cJSON_GetArrayItem(e, 1)->valuestring;
        }
        pd_qwen3_config c;
        pd_err err;
        pd_status st = pd_qwen3_config_load(test_variant(name, TARGET_DIR, ed, (size_t)n_ed), &c, &err);
        TEST_CHECK_MSG(st == PD_OK, "%s: %s", name, err.msg);
        if (st != PD_OK)
            continue;
        const kern_rope_scaling *sc = &c.rope_scaling;
        int yarn = strcmp(cJSON_GetObjectItem(cs, "type")->valuestring, "yarn") == 0;
        TEST_CHECK_MSG(sc->type == (yarn ? KERN_ROPE_YARN : KERN_ROPE_LINEAR) &&
                           sc->factor == (float)cJSON_GetObjectItem(cs, "factor")->valuedouble &&
                           c.max_position_embeddings == cJSON_GetObjectItem(cs, "max_position_embeddings")->valueint,
                       "%s: type %d factor %g context %d", name, sc->type, (double)sc->factor,
                       c.max_position_embeddings);
        if (yarn)
            TEST_CHECK_MSG(sc->low == (float)cJSON_GetObjectItem(cs, "low")->valuedouble &&
                               sc->span == (float)cJSON_GetObjectItem(cs, "span")->valuedouble &&
                               sc->attn == (float)cJSON_GetObjectItem(cs, "attn")->valuedouble,
                           "%s: low %g span %g attn %.9g", name, (double)sc->low, (double)sc->span,
                           (double)sc->attn);
        const cJSON *inv = cJSON_GetObjectItem(cs, "inv_freq_bits"), *pos = cJSON_GetObjectItem(cs, "positions");
        TEST_CHECK(cJSON_GetArraySize(inv) == c.head_dim / 2);
        int bad = 0;
        for (int i = 0; i < c.head_dim / 2 && i < cJSON_GetArraySize(inv); i++) {
            float f = kern_rope_inv_freq(c.rope_theta, sc, i, c.head_dim);
            uint32_t u;
            memcpy(&u, &f, 4);
            bad += u != (uint32_t)cJSON_GetArrayItem(inv, i)->valuedouble;
            n_bits++;
            for (int p = 0; p < cJSON_GetArraySize(pos); p++) {
                const cJSON *row = cJSON_GetArrayItem(cJSON_GetObjectItem(cs, "cos_sin_bits"), p);
                float co, si;
                kern_rope_cs(cJSON_GetArrayItem(pos, p)->valueint, c.rope_theta, sc, i, c.head_dim, &co, &si);
                uint32_t uc, us;
                memcpy(&uc, &co, 4);
                memcpy(&us, &si, 4);
                bad += uc != (uint32_t)cJSON_GetArrayItem(row, 2 * i)->valuedouble;
                bad += us != (uint32_t)cJSON_GetArrayItem(row, 2 * i + 1)->valuedouble;
                n_bits += 2;
            }
        }
        TEST_CHECK_MSG(bad == 0, "%s: %d inverse frequencies or cos/sin differ from the reference's bits", name, bad);
        n_cases++;
    }
    cJSON_Delete(root);
    printf("rope scaling: %d configs, %d values equal to the reference bits\n", n_cases, n_bits);

    /* what Hugging Face refuses or would not read is refused by name */
    static const struct {
        const char *name;
        test_edit ed;
        pd_status want;
        const char *n1, *n2;
    } bad[] = {
        {"rope-dynamic", {"rope_parameters", "{\"rope_theta\": 10000, \"rope_type\": \"dynamic\", \"factor\": 2}"},
         PD_ERR_UNSUPPORTED, "dynamic", "not supported"},
        {"rope-llama3", {"rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8}"}, PD_ERR_UNSUPPORTED,
         "llama3", NULL},
        {"rope-factor", {"rope_parameters", "{\"rope_theta\": 10000, \"rope_type\": \"yarn\", \"factor\": 0.5}"},
         PD_ERR_INVALID, "factor 0.5", NULL},
        {"rope-nofactor", {"rope_scaling", "{\"type\": \"linear\"}"}, PD_ERR_INVALID, "factor is missing", "linear"},
        {"rope-strfactor", {"rope_parameters", "{\"rope_theta\": 10000, \"rope_type\": \"yarn\", \"factor\": \"4\"}"},
         PD_ERR_INVALID, "rope_parameters.factor", "number"},
        {"rope-partial", {"rope_parameters", "{\"rope_theta\": 10000, \"rope_type\": \"yarn\", \"factor\": 4, "
                                            "\"partial_rotary_factor\": 0.5}"},
         PD_ERR_UNSUPPORTED, "partial_rotary_factor", NULL},
        {"rope-attn", {"rope_parameters", "{\"rope_theta\": 10000, \"rope_type\": \"yarn\", \"factor\": 4, "
                                         "\"attention_factor\": -1}"}, PD_ERR_INVALID, "attention_factor", NULL},
        {"rope-notobj", {"rope_scaling", "[1]"}, PD_ERR_INVALID, "rope_scaling", "object"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        pd_qwen3_config c;
        pd_err err;
        pd_status st = pd_qwen3_config_load(test_variant(bad[i].name, TARGET_DIR, &bad[i].ed, 1), &c, &err);
        test_check_msg(st, bad[i].want, &err, bad[i].name, bad[i].n1, bad[i].n2);
    }
}

/* ---- weights ----------------------------------------------------------------------------- */

static void test_model_target_and_drafts(pd_qwen3_model **target_out)
{
    pd_qwen3_model *t = NULL;
    pd_err err;
    pd_status st = pd_qwen3_load(be, TARGET_DIR, &t, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        return;
    *target_out = t;
    TEST_CHECK(t->be == be && t->storage != NULL && t->layers != NULL);
    TEST_CHECK(t->embed.rows == 8192 && t->embed.cols == 256 && t->embed.dtype == be->weight_dtype);
    TEST_CHECK(t->lm_head.data == t->embed.data);   /* tied */
    TEST_CHECK(t->final_norm.rows == 1 && t->final_norm.cols == 256);
    const pd_layer_weights *l = &t->layers[7];
    TEST_CHECK(l->q_proj.rows == 256 && l->q_proj.cols == 256);
    TEST_CHECK(l->k_proj.rows == 128 && l->v_proj.rows == 128 && l->o_proj.cols == 256);
    TEST_CHECK(l->q_norm.rows == 1 && l->q_norm.cols == 64 && l->k_norm.cols == 64);
    TEST_CHECK(l->gate_proj.rows == 768 && l->down_proj.cols == 768 && l->down_proj.rows == 256);
    /* every weight starts on a 256-byte boundary of the one buffer */
    const char *base = t->storage->ptr;
    TEST_CHECK(((const char *)l->down_proj.data - base) % 256 == 0);
    TEST_CHECK(((const char *)t->final_norm.data - base) % 256 == 0);
    TEST_CHECK((const char *)t->final_norm.data >= base &&
               (const char *)t->final_norm.data < base + t->storage->bytes);

    TEST_CHECK(test_weight_matches_file(&t->embed, TARGET_DIR "/model-00001-of-00003.safetensors",
                                        "model.embed_tokens.weight"));
    TEST_CHECK(test_weight_matches_file(&l->down_proj,
                                        TARGET_DIR "/model-00003-of-00003.safetensors",
                                        "model.layers.7.mlp.down_proj.weight"));
    TEST_CHECK(test_weight_matches_file(&t->final_norm,
                                        TARGET_DIR "/model-00003-of-00003.safetensors",
                                        "model.norm.weight"));
    TEST_CHECK(test_weight_matches_file(&t->layers[4].k_norm,
                                        TARGET_DIR "/model-00002-of-00003.safetensors",
                                        "model.layers.4.self_attn.k_norm.weight"));

    static const struct {
        const char *dir;
        pd_markov_type type;
    } drafts[] = {{DRAFT_DIR, PD_MARKOV_VANILLA}, {GATED_DIR, PD_MARKOV_GATED},
                  {RNN_DIR, PD_MARKOV_RNN}};
    for (size_t i = 0; i < 3; i++) {
        pd_dspark_model *d = NULL;
        st = pd_dspark_load(be, drafts[i].dir, t, &d, &err);
        TEST_CHECK_MSG(st == PD_OK, "%s: %s", drafts[i].dir, err.msg);
        if (st != PD_OK)
            continue;
        char file[512];
        snprintf(file, sizeof(file), "%s/model.safetensors", drafts[i].dir);
        TEST_CHECK(d->cfg.markov_type == drafts[i].type);
        TEST_CHECK(d->embed.data == t->embed.data && d->lm_head.data == t->lm_head.data);
        TEST_CHECK(d->fc.rows == 256 && d->fc.cols == 768);
        TEST_CHECK(d->markov_w1.rows == 8192 && d->markov_w1.cols == 64 &&
                   d->markov_w2.rows == 8192 && d->markov_w2.cols == 64);
        TEST_CHECK(d->conf_w.rows == 1 && d->conf_w.cols == 320 && d->conf_b.cols == 1 &&
                   d->conf_b.data != NULL);
        TEST_CHECK(d->layers[1].q_proj.rows == 256 && d->hidden_norm.cols == 256);
        TEST_CHECK(test_weight_matches_file(&d->fc, file, "fc.weight"));
        TEST_CHECK(test_weight_matches_file(&d->conf_b, file, "confidence_head.proj.bias"));
        if (drafts[i].type == PD_MARKOV_GATED) {
            TEST_CHECK(d->gate_w.rows == 64 && d->gate_w.cols == 320 && d->gate_b.cols == 64);
            TEST_CHECK(d->joint_w.data == NULL);
            TEST_CHECK(test_weight_matches_file(&d->gate_w, file, "markov_head.gate_proj.weight"));
        } else if (drafts[i].type == PD_MARKOV_RNN) {
            TEST_CHECK(d->joint_w.rows == 192 && d->joint_w.cols == 384 &&
                       d->joint_b.cols == 192);
            TEST_CHECK(d->gate_w.data == NULL);
            TEST_CHECK(test_weight_matches_file(&d->joint_b, file, "markov_head.joint_proj.bias"));
        } else {
            TEST_CHECK(d->gate_w.data == NULL && d->joint_w.data == NULL);
            TEST_CHECK(test_weight_matches_file(&d->markov_w2, file,
                                                "markov_head.markov_w2.weight"));
        }
        pd_dspark_free(d);
    }
    /* no target to borrow the embedding from */
    test_draft_fail(DRAFT_DIR, NULL, PD_ERR_INVALID, "embed_tokens.weight", "target");
    pd_qwen3_free(NULL);
    pd_dspark_free(NULL);
}

/* A draft with its own embed_tokens (F32) and lm_head (F16), plus every tensor of the real
 * draft, written with an odd header length so all data is misaligned in the mmap. */
static void test_model_draft_own_embed(const pd_qwen3_model *t)
{
    const char *dir = test_variant("own-embed", DRAFT_DIR, NULL, 0);
    char path[600];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    unlink(path);   /* the symlink to the real file */

    pd_st_set *src = NULL;
    pd_err err;
    pd_status st = pd_st_open(DRAFT_DIR "/model.safetensors", &src, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st != PD_OK)
        return;
    size_t n_src = pd_st_count(src);
    test_entry *e = calloc(n_src + 2, sizeof(*e));
    const size_t v = 8192, h = 256;
    float *emb = malloc(v * h * sizeof(float));
    uint16_t *head = malloc(v * h * sizeof(uint16_t));
    for (size_t i = 0; i < v * h; i++) {
        emb[i] = (float)((int)(i % 1999) - 999) * 0.001f;
        head[i] = kern_f32_to_f16((float)((int)(i % 61) - 30) * 0.125f);   /* exact in f16 */
    }
    e[0] = (test_entry){"embed_tokens.weight", "F32", 2, {(int64_t)v, (int64_t)h}, emb,
                        v * h * sizeof(float)};
    e[1] = (test_entry){"lm_head.weight", "F16", 2, {(int64_t)v, (int64_t)h}, head,
                        v * h * sizeof(uint16_t)};
    size_t n = 2;
    for (size_t i = 0; i < n_src; i++) {
        const pd_st_tensor *s = pd_st_at(src, i);
        e[n++] = (test_entry){s->name, "BF16", s->n_dims, {s->shape[0], s->shape[1]}, s->data,
                              s->n_bytes};
    }
    TEST_CHECK(test_write_st(path, e, n, 1) == 0);

    for (int with_target = 0; with_target < 2; with_target++) {
        pd_dspark_model *d = NULL;
        st = pd_dspark_load(be, dir, with_target ? t : NULL, &d, &err);
        TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
        if (st != PD_OK)
            continue;
        TEST_CHECK(d->embed.data != NULL && d->lm_head.data != NULL);
        if (t != NULL)
            TEST_CHECK(d->embed.data != t->embed.data && d->lm_head.data != t->lm_head.data);
        TEST_CHECK(d->embed.data != d->lm_head.data);
        float *got = malloc(v * h * sizeof(float));
        TEST_CHECK(kern_download(be, got, d->embed.data, v * h * sizeof(float), &err) == PD_OK);
        int ok = 1;
        for (size_t i = 0; i < v * h && ok; i++)
            ok = got[i] == emb[i];
        TEST_CHECK(ok);
        TEST_CHECK(kern_download(be, got, d->lm_head.data, v * h * sizeof(float), &err) == PD_OK);
        ok = 1;
        for (size_t i = 0; i < v * h && ok; i++)
            ok = got[i] == (float)((int)(i % 61) - 30) * 0.125f;
        TEST_CHECK(ok);
        free(got);
        TEST_CHECK(test_weight_matches_file(&d->markov_w1, DRAFT_DIR "/model.safetensors",
                                            "markov_head.markov_w1.weight"));
        pd_dspark_free(d);
    }

    /* the same file minus a required tensor, plus an unknown one (warned about, not fatal) */
    static const float extra[2] = {1.0f, 2.0f};
    for (size_t i = 0; i < n; i++)
        if (strcmp(e[i].name, "hidden_norm.weight") == 0)
            e[i] = (test_entry){"rotary_emb.inv_freq", "F32", 1, {2, 0}, extra, sizeof(extra)};
    TEST_CHECK(test_write_st(path, e, n, 0) == 0);
    test_draft_fail(dir, NULL, PD_ERR_INVALID, "hidden_norm.weight", "own-embed");

    /* wrong shape and an integer dtype where a float weight belongs */
    for (size_t i = 0; i < n; i++)
        if (strcmp(e[i].name, "rotary_emb.inv_freq") == 0)
            e[i] = (test_entry){"hidden_norm.weight", "F32", 2, {1, 2}, extra, sizeof(extra)};
    TEST_CHECK(test_write_st(path, e, n, 0) == 0);
    test_draft_fail(dir, NULL, PD_ERR_INVALID, "hidden_norm.weight", "[1, 2]");
    float norm[256] = {0};
    for (size_t i = 0; i < n; i++)
        if (strcmp(e[i].name, "hidden_norm.weight") == 0)
            e[i] = (test_entry){"hidden_norm.weight", "I32", 1, {256, 0}, norm, sizeof(norm)};
    TEST_CHECK(test_write_st(path, e, n, 0) == 0);
    test_draft_fail(dir, NULL, PD_ERR_INVALID, "hidden_norm.weight", "I32");

    free(emb);
    free(head);
    free(e);
    pd_st_close(src);
}

static void test_model_bad_weights(const pd_qwen3_model *t)
{
    /* config says 512, the checkpoint holds 768: the first mismatching tensor is named */
    test_edit ed = {"intermediate_size", "512"};
    const char *dir = test_variant("inter512", TARGET_DIR, &ed, 1);
    test_target_fail(dir, PD_ERR_INVALID, "model.layers.0.mlp.gate_proj.weight",
                     "model-00001-of-00003.safetensors");
    test_target_fail(dir, PD_ERR_INVALID, "[768, 256]", "[512, 256]");
    /* untied: lm_head.weight is required and absent */
    ed = (test_edit){"tie_word_embeddings", "false"};
    dir = test_variant("untied", TARGET_DIR, &ed, 1);
    test_target_fail(dir, PD_ERR_INVALID, "lm_head.weight", "untied");
    /* config fine, but a truncated shard */
    dir = test_variant("trunc-shard", TARGET_DIR, NULL, 0);
    char p[600], src[600];
    snprintf(p, sizeof(p), "%s/model-00003-of-00003.safetensors", dir);
    unlink(p);
    snprintf(src, sizeof(src), "%s/model-00003-of-00003.safetensors", TARGET_DIR);
    size_t n = 0;
    unsigned char *raw = (unsigned char *)test_read_file(src, &n);
    FILE *fp = fopen(p, "wb");
    if (fp != NULL && raw != NULL) {
        fwrite(raw, 1, n - 1000, fp);
        fclose(fp);
    }
    free(raw);
    test_target_fail(dir, PD_ERR_INVALID, "model-00003-of-00003.safetensors", "past the end");
    /* no weights at all */
    dir = test_variant("no-weights", DRAFT_DIR, NULL, 0);
    snprintf(p, sizeof(p), "%s/model.safetensors", dir);
    unlink(p);
    test_draft_fail(dir, t, PD_ERR_IO, "no-weights", "model.safetensors");

    if (t == NULL)
        return;
    /* drafts that do not fit the target */
    static const struct {
        const char *name;
        test_edit ed[4];
        size_t n_ed;
        pd_status want;
        const char *n1, *n2;
    } cases[] = {
        {"d-vocab", {{"vocab_size", "4096"}, {"mask_token_id", "4095"}, {"eos_token_id", "1"},
                     {"bos_token_id", "1"}}, 4, PD_ERR_INVALID,
         "vocab_size 4096", "8192"},
        {"d-hidden", {{"hidden_size", "128"}}, 1, PD_ERR_INVALID, "hidden_size 128", "256"},
        {"d-tap-9", {{"target_layer_ids", "[1, 3, 9]"}}, 1, PD_ERR_INVALID, "target_layer_ids",
         "9"},
        {"d-tap-final", {{"target_layer_ids", "[1, 3, 7]"}, {"num_target_layers", NULL}}, 2,
         PD_ERR_INVALID, "target_layer_ids[2] = 7", "final"},
        {"d-tap-beyond", {{"target_layer_ids", "[1, 3, 12]"}, {"num_target_layers", NULL}}, 2,
         PD_ERR_INVALID, "target_layer_ids[2] = 12", NULL},
        {"d-ntl", {{"num_target_layers", "12"}}, 1, PD_ERR_INVALID, "num_target_layers 12", "8"},
        {"d-mask", {{"mask_token_id", "8192"}}, 1, PD_ERR_INVALID, "mask_token_id", NULL},
        {"d-head", {{"markov_head_type", "\"lstm\""}}, 1, PD_ERR_UNSUPPORTED, "lstm", NULL},
        {"d-no-taps", {{"target_layer_ids", NULL}}, 1, PD_ERR_INVALID, "target_layer_ids", NULL},
        {"d-no-block", {{"block_size", NULL}}, 1, PD_ERR_INVALID, "block_size", NULL},
        /* two taps: fc.weight in the file is [256, 768], the config implies [256, 512] */
        {"d-k2", {{"target_layer_ids", "[1, 3]"}}, 1, PD_ERR_INVALID, "fc.weight", "[256, 512]"},
        /* no confidence-head Markov features: its weight should be [1, 256] */
        {"d-conf", {{"confidence_head_with_markov", "false"}}, 1, PD_ERR_INVALID,
         "confidence_head.proj.weight", "[1, 256]"},
        {"d-rank", {{"markov_rank", "32"}}, 1, PD_ERR_INVALID, "markov_head.markov_w1.weight",
         "[8192, 32]"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        dir = test_variant(cases[i].name, DRAFT_DIR, cases[i].ed, cases[i].n_ed);
        test_draft_fail(dir, t, cases[i].want, cases[i].n1, cases[i].n2);
    }
    /* tap -1 (the embedding output) is allowed */
    test_edit tap[1] = {{"target_layer_ids", "[-1, 3, 5]"}};
    dir = test_variant("d-tap-emb", DRAFT_DIR, tap, 1);
    pd_dspark_model *d = NULL;
    pd_err err;
    pd_status st = pd_dspark_load(be, dir, t, &d, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st == PD_OK) {
        TEST_CHECK(d->cfg.target_layer_ids[0] == -1);
        pd_dspark_free(d);
    }
    /* no Markov head: the markov tensors become unexpected extras (warned), conf is [1, 256]
     * in the config but [1, 320] in the file, so drop the confidence head too */
    test_edit nomk[2] = {{"markov_rank", "0"}, {"enable_confidence_head", "false"}};
    dir = test_variant("d-no-markov", DRAFT_DIR, nomk, 2);
    d = NULL;
    st = pd_dspark_load(be, dir, t, &d, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s", err.msg);
    if (st == PD_OK) {
        TEST_CHECK(d->cfg.markov_type == PD_MARKOV_NONE && d->markov_w1.data == NULL &&
                   d->conf_w.data == NULL && d->conf_b.data == NULL);
        pd_dspark_free(d);
    }
}

/* Mutated config.json files (the target's and a draft's; 1-3 bytes changed, digits mostly into
 * other digits, or cut), 800 each: the load fails with PD_ERR_INVALID / PD_ERR_UNSUPPORTED
 * naming config.json, or it
 * gives shapes a model can be built on (every size positive, heads a multiple of the KV heads,
 * the eos ids inside the vocabulary). */
static void test_model_config_fuzz(void)
{
    static const char *srcs[2] = { TARGET_DIR "/config.json", PD_MODELS "/tiny-code-dspark/config.json" };
    uint64_t x = 77;
    for (int which = 0; which < 2; which++) {
        FILE *fp = fopen(srcs[which], "rb");
        char base[16384];
        size_t len = fp != NULL ? fread(base, 1, sizeof(base) - 1, fp) : 0;
        if (fp != NULL)
            fclose(fp);
        TEST_CHECK(len > 100 && len < sizeof(base) - 1);
        const char *dir = test_path(which ? "fuzz-draft" : "fuzz-target");
        char path[600];
        mkdir(dir, 0700);
        snprintf(path, sizeof(path), "%s/config.json", dir);
        int opened = 0, refused = 0, other = 0, insane = 0;
        for (int it = 0; it < 800 && len > 100; it++) {
            char m[16384];
            memcpy(m, base, len);
            size_t n = len;
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            int k = 1 + (int)((x >> 33) % 3);
            for (int j = 0; j < k; j++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                size_t at = (size_t)((x >> 20) % len);
                int digit = m[at] >= '0' && m[at] <= '9';
                m[at] = digit && (x >> 60) < 12 ? (char)('0' + (x >> 40) % 10)
                        : (x >> 60) < 14        ? "-.e9\"{}[],:"[(x >> 44) % 12]
                                                : (char)(x >> 48);
            }
            if ((x >> 8) % 10 == 0)
                n = (size_t)((x >> 12) % len);
            m[n] = '\0';
            test_write_text(path, m);
            pd_err err = {0};
            pd_status st;
            pd_qwen3_config c;
            pd_dspark_config d;
            if (which == 0) {
                st = pd_qwen3_config_load(dir, &c, &err);
            } else {
                st = pd_dspark_config_load(dir, &d, &err);
                c = d.base;
            }
            if (st == PD_OK) {
                opened++;
                int ok = c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 &&
                         c.num_hidden_layers > 0 && c.num_attention_heads > 0 && c.num_key_value_heads > 0 &&
                         c.num_attention_heads % c.num_key_value_heads == 0 && c.head_dim > 0 &&
                         c.max_position_embeddings > 0 && c.rms_norm_eps > 0.0f && c.rope_theta > 0.0f;
                for (int e = 0; e < c.n_eos; e++)
                    ok &= c.eos_ids[e] >= 0 && c.eos_ids[e] < c.vocab_size;
                if (which == 1)
                    ok &= d.block_size > 0 && d.n_target_layers > 0 && d.mask_token_id >= 0 &&
                          d.mask_token_id < c.vocab_size;
                if (!ok && insane++ < 3)
                    printf("  config fuzz %d/%d: accepted but not buildable: vocab %d hidden %d inter %d layers %d "
                           "heads %d/%d head_dim %d eps %g theta %g max_pos %d eos %d (%d)\n", which, it,
                           c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                           c.num_attention_heads, c.num_key_value_heads, c.head_dim, (double)c.rms_norm_eps,
                           (double)c.rope_theta, c.max_position_embeddings, c.n_eos ? c.eos_ids[0] : -1, c.n_eos);
            } else if ((st == PD_ERR_INVALID || st == PD_ERR_UNSUPPORTED) &&
                       strstr(err.msg, "config.json") != NULL) {
                refused++;
            } else if (other++ < 3) {
                printf("  config fuzz %d/%d: %s %s\n", which, it, pd_status_str(st), err.msg);
            }
        }
        printf("config fuzz (%s): 800 mutated files: %d loaded, %d refused, %d otherwise, %d not buildable\n",
               which ? "draft" : "target", opened, refused, other, insane);
        TEST_CHECK_MSG(other == 0 && insane == 0 && opened > 0 && refused > 0,
                       "config fuzz %d: %d loaded, %d refused, %d other, %d not buildable", which, opened, refused,
                       other, insane);
    }
}

int main(void)
{
    snprintf(tmp_root, sizeof(tmp_root), "%s/pd_test_model_XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (mkdtemp(tmp_root) == NULL)
        TEST_SKIP("mkdtemp failed");
    kern_backend_config bc = {.name = "cpu", .device = 0, .threads = 0};
    pd_err err;
    if (kern_backend_create(&bc, &be, &err) != PD_OK) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        return 1;
    }
    pd_qwen3_model *target = NULL;
    test_model_configs();
    test_model_bad_configs();
    test_model_rope_scaling();
    test_model_config_fuzz();
    test_model_target_and_drafts(&target);
    test_model_draft_own_embed(target);
    test_model_bad_weights(target);
    pd_qwen3_free(target);
    kern_backend_destroy(be);
    nftw(tmp_root, test_rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    TEST_DONE();
}
