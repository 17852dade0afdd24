/* test_grammar: structured output grammars (JSON schema, json_object, choices, regex) and the
 * token matcher, on a small vocabulary (every byte, some multi-byte tokens, an eos) and on the
 * bundled model's tokenizer: whole texts accepted or refused as the grammar says, the allowed
 * mask equal to trying every token, random walks through the mask ending in texts that parse
 * (cJSON) and obey the schema, and bad specs refused with the keyword or offset named. */
#include "pd_grammar.h"
#include "test_util.h"

#define N_SMALL (256 + 12 + 1)
static const char *const multi[12] = { "{\"", "\":", "true", "null", "  ", "\n  ", "abc",
                                       "12", "\"}", "\", \"", "yes", "e\u00e9" };
static void small_tables(const uint8_t **tb, size_t *tl);

static pd_gvocab *small_vocab(void)
{
    const uint8_t *tok[N_SMALL];
    size_t len[N_SMALL];
    small_tables(tok, len);
    int32_t eos = N_SMALL - 1;
    pd_gvocab *v = NULL;
    pd_err err;
    TEST_CHECK(pd_gvocab_create_raw(tok, len, N_SMALL, &eos, 1, &v, &err) == PD_OK);
    return v;
}

/* 1: the whole text is a match, 0: refused on the way or incomplete at the end */
static int accepts(pd_grammar *g, const pd_gvocab *v, const char *text)
{
    pd_gmatch *m = NULL;
    pd_err err;
    if (pd_gmatch_create(g, &m, &err) != PD_OK)
        return -1;
    int ok = 1;
    for (const char *p = text; *p && ok; p++)
        ok = pd_gmatch_advance(m, v, (uint8_t)*p, &err) == 1;
    ok = ok && pd_gmatch_complete(m) && pd_gmatch_advance(m, v, N_SMALL - 1, &err) == 1;
    pd_gmatch_destroy(m);
    return ok;
}

static pd_grammar *json(const char *schema)
{
    pd_grammar *g = NULL;
    pd_err err;
    pd_status st = pd_grammar_json(schema, schema ? strlen(schema) : 0, &g, &err);
    TEST_CHECK_MSG(st == PD_OK, "%s: %s", schema ? schema : "json_object", err.msg);
    return g;
}

static pd_grammar *regex(const char *re)
{
    pd_grammar *g = NULL;
    pd_err err;
    TEST_CHECK_MSG(pd_grammar_regex(re, strlen(re), &g, &err) == PD_OK, "%s: %s", re, err.msg);
    return g;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

/* random walks: at every step the mask equals trying each token on a copy; the walk takes a
 * random allowed token (eos with some weight when allowed) and ends at eos or after max steps.
 * Returns the text of the last walk that ended at eos (malloc'd) or NULL. */
static char *walks(pd_grammar *g, const pd_gvocab *v, int n_vocab, const uint8_t *const *tb,
                   const size_t *tl, int n_walks, int max_steps, int *mask_ok, int *ended)
{
    pd_err err;
    int words = pd_gvocab_words(v);
    uint32_t *bits = malloc((size_t)words * 4);
    int32_t *cand = malloc((size_t)n_vocab * 4);
    char *last = NULL;
    *mask_ok = 1;
    *ended = 0;
    for (int w = 0; w < n_walks; w++) {
        pd_gmatch *m = NULL, *c = NULL;
        if (pd_gmatch_create(g, &m, &err) != PD_OK || pd_gmatch_create(g, &c, &err) != PD_OK) {
            *mask_ok = 0;
            break;
        }
        size_t cap = 4096, n = 0;
        char *text = malloc(cap);
        int done = 0;
        for (int s = 0; s < max_steps && !done; s++) {
            if (pd_gmatch_allowed(m, v, bits, &err) != PD_OK) {
                fprintf(stderr, "allowed: %s\n", err.msg);
                *mask_ok = 0;
                break;
            }
            int nc = 0, has_eos = 0;
            for (int t = 0; t < n_vocab; t++) {
                pd_gmatch_copy(c, m, &err);
                int a = pd_gmatch_advance(c, v, t, &err);
                int bit = (bits[t >> 5] >> (t & 31)) & 1;
                if (a != bit) {
                    if (*mask_ok)
                        fprintf(stderr, "mask %d vs advance %d for token %d at step %d\n", bit, a, t, s);
                    *mask_ok = 0;
                }
                if (bit) {
                    if (tb[t] == NULL)
                        has_eos = 1;
                    else
                        cand[nc++] = t;
                }
            }
            if (nc == 0 && !has_eos) {
                *mask_ok = 0;   /* a dead end: the grammar must always go on or end */
                break;
            }
            if (has_eos && (nc == 0 || rnd() % 4 == 0)) {
                done = 1;
                break;
            }
            int t = cand[rnd() % (uint32_t)nc];
            if (pd_gmatch_advance(m, v, t, &err) != 1)
                *mask_ok = 0;
            if (n + tl[t] + 1 > cap)
                text = realloc(text, cap *= 2);
            memcpy(text + n, tb[t], tl[t]);
            n += tl[t];
        }
        text[n] = '\0';
        if (done) {
            (*ended)++;
            free(last);
            last = text;
        } else
            free(text);
        pd_gmatch_destroy(m);
        pd_gmatch_destroy(c);
    }
    free(bits);
    free(cand);
    return last;
}

static void small_tables(const uint8_t **tb, size_t *tl)
{
    static uint8_t single[256];
    for (int i = 0; i < 256; i++) {
        single[i] = (uint8_t)i;
        tb[i] = &single[i];
        tl[i] = 1;
    }
    for (int i = 0; i < 12; i++) {
        tb[256 + i] = (const uint8_t *)multi[i];
        tl[256 + i] = strlen(multi[i]);
    }
    tb[N_SMALL - 1] = NULL;
    tl[N_SMALL - 1] = 0;
}

static void test_json_object(const pd_gvocab *v, const uint8_t **tb, const size_t *tl)
{
    pd_grammar *g = json(NULL);
    if (g == NULL)
        return;
    const char *good[] = { "{}", "{\"a\":1}", "{ \"a\": [1, 2.5e3, -0, true, null, \"x\\n\\u00e9\"], \"b\": {} }",
                           "{\n  \"k\": \"\xc3\xa9\xe2\x82\xac\"\n}", "{\"a\":{\"b\":{\"c\":[[]]}}}" };
    const char *bad[] = { "", "[]", "{", "{\"a\"}", "{\"a\":01}", "{\"a\":1,}", "{'a':1}", "{\"a\":tru}",
                          "{\"a\":\"\x01\"}", "{\"a\":1} ", "{\"a\":\"\xc3\"}", "{\"a\":1.}" };
    for (size_t i = 0; i < sizeof(good) / sizeof(*good); i++)
        TEST_CHECK_MSG(accepts(g, v, good[i]) == 1, "json_object accepts %s", good[i]);
    for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++)
        TEST_CHECK_MSG(accepts(g, v, bad[i]) == 0, "json_object refuses %s", bad[i]);
    int mask_ok, ended;
    char *t = walks(g, v, N_SMALL, tb, tl, 30, 60, &mask_ok, &ended);
    TEST_CHECK(mask_ok);
    TEST_CHECK_MSG(ended > 0, "%d walks ended", ended);
    cJSON *doc = t != NULL ? cJSON_Parse(t) : NULL;
    TEST_CHECK_MSG(doc != NULL && cJSON_IsObject(doc), "a walk's text parses as an object: %s", t ? t : "(none)");
    cJSON_Delete(doc);
    free(t);
    pd_grammar_unref(g);
}

static const char *person =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"maxLength\":5,\"title\":\"Name\"},"
    "\"age\":{\"type\":\"integer\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\"]},\"maxItems\":2},"
    "\"ok\":{\"type\":[\"boolean\",\"null\"]}},"
    "\"required\":[\"name\",\"ok\"]}";

static void test_schema(const pd_gvocab *v, const uint8_t **tb, const size_t *tl)
{
    pd_grammar *g = json(person);
    if (g == NULL)
        return;
    const char *good[] = { "{\"name\":\"bob\",\"ok\":true}", "{\"name\": \"\", \"age\": -3, \"ok\": null}",
                           "{\"name\":\"x\",\"tags\":[\"a\",\"b\"],\"ok\":false}",
                           "{\"name\":\"x\",\"age\":0,\"tags\":[],\"ok\":true}" };
    const char *bad[] = { "{\"age\":3,\"ok\":true}", "{\"name\":\"toolong\",\"ok\":true}",
                          "{\"name\":\"x\",\"tags\":[\"a\",\"b\",\"a\"],\"ok\":true}",
                          "{\"name\":\"x\",\"extra\":1,\"ok\":true}", "{\"ok\":true,\"name\":\"x\"}",
                          "{\"name\":\"x\",\"age\":1.5,\"ok\":true}", "{\"name\":\"x\",\"tags\":[\"c\"],\"ok\":true}",
                          "{\"name\":\"x\"}" };
    for (size_t i = 0; i < sizeof(good) / sizeof(*good); i++)
        TEST_CHECK_MSG(accepts(g, v, good[i]) == 1, "schema accepts %s", good[i]);
    for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++)
        TEST_CHECK_MSG(accepts(g, v, bad[i]) == 0, "schema refuses %s", bad[i]);
    int mask_ok, ended, parsed = 0, obeys = 0;
    for (int k = 0; k < 5; k++) {
        char *t = walks(g, v, N_SMALL, tb, tl, 4, 80, &mask_ok, &ended);
        TEST_CHECK(mask_ok);
        cJSON *doc = t != NULL ? cJSON_Parse(t) : NULL;
        if (doc != NULL) {
            parsed++;
            cJSON *name = cJSON_GetObjectItemCaseSensitive(doc, "name");
            cJSON *ok = cJSON_GetObjectItemCaseSensitive(doc, "ok");
            cJSON *tags = cJSON_GetObjectItemCaseSensitive(doc, "tags");
            obeys += cJSON_IsString(name) && (cJSON_IsBool(ok) || cJSON_IsNull(ok)) &&
                     (tags == NULL || cJSON_GetArraySize(tags) <= 2);
        }
        cJSON_Delete(doc);
        free(t);
    }
    TEST_CHECK_MSG(parsed > 0 && obeys == parsed, "walks: %d parsed, %d obey the schema", parsed, obeys);
    pd_grammar_unref(g);

    /* $defs, $ref and recursion (pydantic's form), anyOf, const, additionalProperties schema */
    g = json("{\"$defs\":{\"Node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
             "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/Node\"}}},\"required\":[\"v\"]}},"
             "\"anyOf\":[{\"$ref\":\"#/$defs/Node\"},{\"const\":\"leaf\"},"
             "{\"type\":\"object\",\"additionalProperties\":{\"type\":\"number\"}}]}");
    if (g != NULL) {
        TEST_CHECK(accepts(g, v, "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[]}]}") == 1);
        TEST_CHECK(accepts(g, v, "\"leaf\"") == 1);
        TEST_CHECK(accepts(g, v, "{\"x\":1.5,\"y\":2}") == 1);
        TEST_CHECK(accepts(g, v, "{\"x\":\"s\"}") == 0);
        TEST_CHECK(accepts(g, v, "{\"v\":1,\"kids\":[{\"w\":2}]}") == 0);
        pd_grammar_unref(g);
    }

    /* pattern: the string's unescaped text is searched by the regex (anchors as written); a
     * quote or backslash in it is matched as its JSON escape */
    g = json("{\"type\":\"string\",\"pattern\":\"a\\\"b\"}");
    if (g != NULL) {
        TEST_CHECK(accepts(g, v, "\"a\\\"b\"") == 1);
        TEST_CHECK(accepts(g, v, "\"xxa\\\"byy\"") == 1);   /* unanchored: found inside */
        TEST_CHECK(accepts(g, v, "\"ab\"") == 0 && accepts(g, v, "\"a\"b\"") == 0);
        pd_grammar_unref(g);
    }
    g = json("{\"type\":\"object\",\"properties\":{\"d\":{\"type\":\"string\",\"pattern\":\"^[0-9]{4}-[0-9]{2}$\"},"
             "\"q\":{\"type\":\"string\",\"pattern\":\"^a\\\"b+$\"}},\"required\":[\"d\",\"q\"]}");
    if (g != NULL) {
        TEST_CHECK(accepts(g, v, "{\"d\":\"2026-12\",\"q\":\"a\\\"bb\"}") == 1);
        TEST_CHECK(accepts(g, v, "{\"d\":\"2026-1\",\"q\":\"a\\\"b\"}") == 0);
        TEST_CHECK(accepts(g, v, "{\"d\":\"x2026-12\",\"q\":\"a\\\"b\"}") == 0);    /* anchored */
        TEST_CHECK(accepts(g, v, "{\"d\":\"2026-12\",\"q\":\"a\\\"bx\"}") == 0);
        char *t = walks(g, v, N_SMALL, tb, tl, 10, 120, &mask_ok, &ended);
        TEST_CHECK(mask_ok);
        cJSON *doc = t != NULL ? cJSON_Parse(t) : NULL;
        cJSON *d = cJSON_GetObjectItemCaseSensitive(doc, "d"), *q = cJSON_GetObjectItemCaseSensitive(doc, "q");
        TEST_CHECK_MSG(ended > 0 && cJSON_IsString(d) && strlen(d->valuestring) == 7 && d->valuestring[4] == '-' &&
                       cJSON_IsString(q) && strncmp(q->valuestring, "a\"b", 3) == 0,
                       "a pattern walk obeys it (%d ended): %s", ended, t ? t : "");
        cJSON_Delete(doc);
        free(t);
        pd_grammar_unref(g);
    }

    /* integer ranges: every integer in -300..300 (and a few far ones) accepted exactly when in
     * range, for closed, one-sided and exclusive bounds */
    struct { const char *schema; long long lo, hi; } ranges[] = {
        { "{\"type\":\"integer\",\"minimum\":-15,\"maximum\":123}", -15, 123 },
        { "{\"type\":\"integer\",\"minimum\":5}", 5, 9999999999999999LL },
        { "{\"type\":\"integer\",\"exclusiveMinimum\":0,\"exclusiveMaximum\":100}", 1, 99 },
        { "{\"type\":\"integer\",\"maximum\":-20}", -9999999999999999LL, -20 },
        { "{\"type\":\"integer\",\"minimum\":0.5,\"maximum\":10.5}", 1, 10 },
        { "{\"type\":\"integer\",\"minimum\":7,\"maximum\":7}", 7, 7 },
    };
    for (size_t i = 0; i < sizeof(ranges) / sizeof(*ranges); i++) {
        pd_grammar *r = json(ranges[i].schema);
        if (r == NULL)
            continue;
        int wrong = 0;
        long long probe[] = { 1000, 12345, 99999, 1000000000LL, -1000, -123456 };
        for (long long x = -300; x <= 300 + 6; x++) {
            long long y = x <= 300 ? x : probe[x - 301];
            char txt[32];
            snprintf(txt, sizeof(txt), "%lld", y);
            int want = y >= ranges[i].lo && y <= ranges[i].hi;
            if (accepts(r, v, txt) != want) {
                if (!wrong)
                    fprintf(stderr, "%s: %s gives %d\n", ranges[i].schema, txt, !want);
                wrong = 1;
            }
        }
        TEST_CHECK_MSG(!wrong && accepts(r, v, "-0") == 0 && accepts(r, v, "05") == 0, "%s", ranges[i].schema);
        pd_grammar_unref(r);
    }

    /* number ranges (whole-number bounds; fractional ones below): every quarter in -40..40, written as "x", "x.0" and
     * "x.25" / "x.5" / "x.75", accepted exactly when in range */
    struct { const char *schema; int lo4, lo_ex, hi4, hi_ex; } nranges[] = {   /* bounds x4; +-9999: none */
        { "{\"type\":\"number\",\"minimum\":0,\"maximum\":1}", 0, 0, 4, 0 },
        { "{\"type\":\"number\",\"exclusiveMinimum\":0}", 0, 1, 9999, 0 },
        { "{\"type\":\"number\",\"minimum\":-2,\"exclusiveMaximum\":3}", -8, 0, 12, 1 },
        { "{\"type\":\"number\",\"maximum\":-1}", -9999, 0, -4, 0 },
        { "{\"type\":\"number\",\"exclusiveMinimum\":-5,\"exclusiveMaximum\":-1}", -20, 1, -4, 1 },
        { "{\"type\":\"number\",\"minimum\":2,\"maximum\":2}", 8, 0, 8, 0 },
        { "{\"type\":[\"number\",\"null\"],\"minimum\":-1,\"maximum\":12}", -4, 0, 48, 0 },
    };
    for (size_t i = 0; i < sizeof(nranges) / sizeof(*nranges); i++) {
        pd_grammar *r = json(nranges[i].schema);
        if (r == NULL)
            continue;
        int wrong = 0;
        for (int q = -160; q <= 160 && !wrong; q++) {
            int in = (q > nranges[i].lo4 || (q == nranges[i].lo4 && !nranges[i].lo_ex)) &&
                     (q < nranges[i].hi4 || (q == nranges[i].hi4 && !nranges[i].hi_ex));
            int aq = q < 0 ? -q : q;
            static const char *const fr[4] = { "", ".25", ".5", ".75" };
            char t1[32], t2[48];
            snprintf(t1, sizeof(t1), "%s%d%s", q < 0 ? "-" : "", aq / 4, fr[aq % 4]);
            snprintf(t2, sizeof(t2), "%s%s", t1, aq % 4 == 0 ? ".0" : "0");
            if (accepts(r, v, t1) != in || accepts(r, v, t2) != in) {
                fprintf(stderr, "%s: %s / %s gives %d / %d\n", nranges[i].schema, t1, t2, accepts(r, v, t1),
                        accepts(r, v, t2));
                wrong = 1;
            }
        }
        TEST_CHECK_MSG(!wrong && accepts(r, v, "1e2") == 0, "%s", nranges[i].schema);
        int walk_ok, walk_ended;
        char *t = walks(r, v, N_SMALL, tb, tl, 3, 30, &walk_ok, &walk_ended);
        TEST_CHECK_MSG(walk_ok, "%s mask", nranges[i].schema);
        free(t);
        pd_grammar_unref(r);
    }

    /* fractional bounds: random bounds of up to 3 fraction digits (either end open, exclusive or
     * not), random decimals of up to 4; accepted exactly when in range (compared x 10^4) */
    int frac_wrong = 0;
    for (int iter = 0; iter < 60 && !frac_wrong; iter++) {
        long long bnd[2];
        for (int e = 0; e < 2; e++)
            bnd[e] = ((long long)(rnd() % 10001) - 5000) * 10;
        if (bnd[0] > bnd[1]) {
            long long t = bnd[0];
            bnd[0] = bnd[1];
            bnd[1] = t;
        }
        int kind[2] = { (int)(rnd() % 3), (int)(rnd() % 3) };   /* 0 none, 1 inclusive, 2 exclusive */
        if (bnd[0] == bnd[1] && (kind[0] == 2 || kind[1] == 2))
            bnd[1] += 10;
        char schema[160] = "{\"type\":\"number\"";
        static const char *const key[2][3] = { { "", "minimum", "exclusiveMinimum" },
                                               { "", "maximum", "exclusiveMaximum" } };
        for (int e = 0; e < 2; e++)
            if (kind[e] != 0) {
                long long a = bnd[e] < 0 ? -bnd[e] : bnd[e];
                size_t l = strlen(schema);
                snprintf(schema + l, sizeof(schema) - l, ",\"%s\":%s%lld.%03lld", key[e][kind[e]], bnd[e] < 0 ? "-" : "",
                         a / 10000, a % 10000 / 10);
            }
        strcat(schema, "}");
        pd_grammar *r = json(schema);
        if (r == NULL) {
            frac_wrong = 1;
            break;
        }
        for (int t = 0; t < 200 && !frac_wrong; t++) {
            int nd = (int)(rnd() % 5);   /* fraction digits written */
            long long step = 1;
            for (int d = nd; d < 4; d++)
                step *= 10;
            long long x = ((long long)(rnd() % 120001) - 60000) / step * step;
            if (t < 8)   /* the bounds themselves and their neighbours */
                x = bnd[t % 2] + (t / 2 % 2 ? 0 : (t / 4 ? 1 : -1)), nd = 4;
            int in = (kind[0] == 0 || x > bnd[0] || (x == bnd[0] && kind[0] == 1)) &&
                     (kind[1] == 0 || x < bnd[1] || (x == bnd[1] && kind[1] == 1));
            long long ax = x < 0 ? -x : x;
            char txt[40];
            snprintf(txt, sizeof(txt), "%s%lld", x < 0 ? "-" : "", ax / 10000);
            if (nd > 0) {
                char f[8];
                snprintf(f, sizeof(f), "%04lld", ax % 10000);
                f[nd] = '\0';
                strcat(txt, ".");
                strcat(txt, f);
            }
            if (accepts(r, v, txt) != in) {
                fprintf(stderr, "%s: %s gives %d, in range %d\n", schema, txt, accepts(r, v, txt), in);
                frac_wrong = 1;
            }
        }
        pd_grammar_unref(r);
    }
    TEST_CHECK(!frac_wrong);
    /* a bound of 16 fraction digits and one that is not exact in binary */
    g = json("{\"type\":\"number\",\"minimum\":0.1,\"exclusiveMaximum\":0.2000000000000001}");
    TEST_CHECK(g != NULL && accepts(g, v, "0.1") == 1 && accepts(g, v, "0.0999999999999999") == 0 &&
               accepts(g, v, "0.1000000000000001") == 1 && accepts(g, v, "0.2") == 1 &&
               accepts(g, v, "0.2000000000000001") == 0 && accepts(g, v, "0.19999") == 1);
    pd_grammar_unref(g);

    /* multipleOf a power of ten: at most that many decimal places, with bounds or without */
    g = json("{\"type\":\"number\",\"multipleOf\":0.01,\"minimum\":0.005,\"maximum\":100}");
    TEST_CHECK(g != NULL && accepts(g, v, "0.01") == 1 && accepts(g, v, "99.99") == 1 && accepts(g, v, "100") == 1 &&
               accepts(g, v, "100.00") == 1 && accepts(g, v, "0.00") == 0 && accepts(g, v, "1.005") == 0 &&
               accepts(g, v, "100.01") == 0 && accepts(g, v, "-1") == 0 && accepts(g, v, "1e1") == 0);
    pd_grammar_unref(g);
    g = json("{\"type\":\"number\",\"multipleOf\":1}");
    TEST_CHECK(g != NULL && accepts(g, v, "-12") == 1 && accepts(g, v, "0") == 1 && accepts(g, v, "1.5") == 0 &&
               accepts(g, v, "3.") == 0);
    pd_grammar_unref(g);
    g = json("{\"type\":\"number\",\"multipleOf\":0.1}");
    TEST_CHECK(g != NULL && accepts(g, v, "-0.5") == 1 && accepts(g, v, "7") == 1 && accepts(g, v, "0.55") == 0);
    pd_grammar_unref(g);
    g = json("{\"type\":\"integer\",\"multipleOf\":1,\"minimum\":2}");
    TEST_CHECK(g != NULL && accepts(g, v, "2") == 1 && accepts(g, v, "1") == 0);
    pd_grammar_unref(g);

    /* a schema that refers to itself first: its other branch is its language */
    g = json("{\"anyOf\":[{\"$ref\":\"#\"},{\"type\":\"null\"}]}");
    if (g != NULL) {
        TEST_CHECK(accepts(g, v, "null") == 1 && accepts(g, v, "nul") == 0 && accepts(g, v, "1") == 0);
        pd_grammar_unref(g);
    }

    /* string formats: each a regular language of the text; other formats are annotations */
    static const struct { const char *format, *yes[4], *no[4]; } formats[] = {
        { "date", { "2026-12-05", "0001-01-31", "1999-02-29", "2000-10-01" },
          { "2026-13-01", "2026-1-01", "2026-12-32", "26-12-05" } },
        { "time", { "23:59:60Z", "00:00:00.125+05:30", "12:30:00z", "08:00:00-00:00" },
          { "24:00:00Z", "12:30Z", "12:30:00", "12:60:00Z" } },
        { "date-time", { "2026-12-05T08:45:00Z", "2026-12-05t08:45:00.5+01:00", "1970-01-01T00:00:00Z", NULL },
          { "2026-12-05 08:45:00Z", "2026-12-05T08:45Z", "2026-12-05", "T08:45:00Z" } },
        { "uuid", { "123e4567-e89b-12d3-a456-426614174000", "00000000-0000-0000-0000-000000000000",
                    "ABCDEF01-2345-6789-abcd-ef0123456789", NULL },
          { "123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400", "g23e4567-e89b-12d3-a456-426614174000",
            NULL } },
        { "ipv4", { "127.0.0.1", "255.255.255.255", "0.0.0.0", "10.20.30.40" },
          { "256.1.1.1", "1.2.3", "01.2.3.4", "1.2.3.4.5" } },
        { "ipv6", { "::1", "2001:db8::8a2e:370:7334", "fe80:0:0:0:0:0:0:1", "::" },
          { ":::", "1:2:3:4:5:6:7:8:9", "2001:db8::g", "1::2::3" } },
        { "hostname", { "example.com", "a", "my-host.local", "x1.y-2.z3" },
          { "-bad.com", "bad-.com", "a..b", "sp ace" } },
        { "email", { "a@b.co", "first.last+tag@mail.example.org", "x_y@h-1.io", NULL },
          { "a@b", "@b.com", "a..b@c.com", "a b@c.com" } },
        { "uri", { "https://example.com/a?b=c#d", "urn:isbn:0451450523", "mailto:a@b.c", NULL },
          { "example.com", "1http://x", "http://a b", "http:" } },
    };
    for (size_t i = 0; i < sizeof(formats) / sizeof(formats[0]); i++) {
        char schema[128];
        snprintf(schema, sizeof(schema), "{\"type\":\"string\",\"format\":\"%s\"}", formats[i].format);
        pd_grammar *fg = json(schema);
        for (int k = 0; fg != NULL && k < 4; k++) {
            char q[96];
            if (formats[i].yes[k] != NULL) {
                snprintf(q, sizeof(q), "\"%s\"", formats[i].yes[k]);
                TEST_CHECK_MSG(accepts(fg, v, q) == 1, "format %s accepts %s", formats[i].format, q);
            }
            if (formats[i].no[k] != NULL) {
                snprintf(q, sizeof(q), "\"%s\"", formats[i].no[k]);
                TEST_CHECK_MSG(accepts(fg, v, q) == 0, "format %s refuses %s", formats[i].format, q);
            }
        }
        int walk_ok, walk_ended;
        char *t = fg != NULL ? walks(fg, v, N_SMALL, tb, tl, 3, 40, &walk_ok, &walk_ended) : NULL;
        TEST_CHECK_MSG(fg == NULL || walk_ok, "format %s mask", formats[i].format);
        free(t);
        pd_grammar_unref(fg);
    }
    g = json("{\"type\":\"string\",\"format\":\"color\"}");   /* unknown: any string */
    TEST_CHECK(g != NULL && accepts(g, v, "\"red\"") == 1);
    pd_grammar_unref(g);
    g = json("{\"type\":\"string\",\"format\":\"date\",\"pattern\":\"^x$\"}");   /* pattern before format */
    TEST_CHECK(g != NULL && accepts(g, v, "\"x\"") == 1 && accepts(g, v, "\"2026-12-05\"") == 0);
    pd_grammar_unref(g);

    /* refused by name */
    struct { const char *schema, *needle; } refused[] = {
        { "{\"type\":\"string\",\"format\":\"date\",\"maxLength\":3}", "format 'date' with" },
        { "{\"type\":\"string\",\"format\":7}", "'format' must be a string" },
        { "{\"type\":\"number\",\"multipleOf\":2}", "'multipleOf'" },
        { "{\"type\":\"number\",\"multipleOf\":0.25}", "power of ten" },
        { "{\"type\":\"integer\",\"multipleOf\":0.1}", "on an integer must be 1" },
        { "{\"type\":\"number\",\"multipleOf\":\"x\"}", "'multipleOf'" },
        { "{\"type\":\"string\",\"pattern\":\"a\",\"maxLength\":3}", "pattern with" },
        { "{\"type\":\"string\",\"pattern\":\"(a\"}", "unterminated (" },
        { "{\"type\":\"number\",\"minimum\":0.12345678901234567}", "16 fractional digits" },
        { "{\"type\":\"number\",\"minimum\":1,\"exclusiveMaximum\":1}", "empty" },
        { "{\"type\":\"integer\",\"minimum\":3,\"maximum\":2}", "empty" },
        { "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"strin\"}}}", "strin" },
        { "{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "'b'" },
        { "{\"$ref\":\"#/$defs/Missing\"}", "Missing" },
        { "{\"type\":", "not valid JSON" },
        { "{\"type\":\"string\"} x", "not valid JSON (at byte 18)" },
        { "{\"type\":\"array\",\"maxItems\":1,\"minItems\":2}", "maxItems" },
        { "{\"type\":\"string\",\"maxLength\":100000}", "rules" },
        { "{\"allOf\":[{\"$ref\":\"#\"}]}", "matches no text" },
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(*refused); i++) {
        pd_err err = { 0 };
        pd_grammar *x = NULL;
        pd_status st = pd_grammar_json(refused[i].schema, strlen(refused[i].schema), &x, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, refused[i].needle) != NULL && x == NULL,
                       "%s -> %d %s", refused[i].schema, st, err.msg);
        pd_grammar_unref(x);
    }
}

/* g (NULL: nothing to check; released here) accepts yes[0..3) and refuses no[0..3) (NULL
 * entries skipped), and its masks equal trying every token along a few walks */
static void check_cases(pd_grammar *g, const char *spec, const char *const yes[3], const char *const no[3],
                        const pd_gvocab *v, const uint8_t **tb, const size_t *tl)
{
    if (g == NULL)
        return;
    for (int k = 0; k < 3; k++) {
        if (yes[k] != NULL)
            TEST_CHECK_MSG(accepts(g, v, yes[k]) == 1, "[%s] accepts '%s'", spec, yes[k]);
        if (no[k] != NULL)
            TEST_CHECK_MSG(accepts(g, v, no[k]) == 0, "[%s] refuses '%s'", spec, no[k]);
    }
    int mask_ok, ended;
    char *t = walks(g, v, N_SMALL, tb, tl, 3, 30, &mask_ok, &ended);
    TEST_CHECK_MSG(mask_ok, "[%s] mask", spec);
    free(t);
    pd_grammar_unref(g);
}

static void test_choice_regex(const pd_gvocab *v, const uint8_t **tb, const size_t *tl)
{
    const char *ch[] = { "yes", "no", "yes please" };
    pd_grammar *g = NULL;
    pd_err err;
    TEST_CHECK(pd_grammar_choice(ch, 3, &g, &err) == PD_OK);
    if (g != NULL) {
        TEST_CHECK(accepts(g, v, "yes") == 1 && accepts(g, v, "no") == 1 && accepts(g, v, "yes please") == 1);
        TEST_CHECK(accepts(g, v, "ye") == 0 && accepts(g, v, "yess") == 0 && accepts(g, v, "") == 0);
        int mask_ok, ended;
        char *t = walks(g, v, N_SMALL, tb, tl, 20, 20, &mask_ok, &ended);
        TEST_CHECK(mask_ok && ended == 20);
        TEST_CHECK_MSG(t != NULL && (!strcmp(t, "yes") || !strcmp(t, "no") || !strcmp(t, "yes please")),
                       "a walk is a choice: %s", t ? t : "(none)");
        free(t);
        pd_grammar_unref(g);
    }
    const char *empty[] = { "a", "" };
    TEST_CHECK(pd_grammar_choice(empty, 2, &g, &err) == PD_ERR_INVALID && strstr(err.msg, "choice 1") != NULL);
    TEST_CHECK(pd_grammar_choice(empty, 0, &g, &err) == PD_ERR_INVALID);

    struct { const char *re, *yes[3], *no[3]; } cases[] = {
        { "^\\d{3}-\\d{4}$", { "555-1234", "000-0000", NULL }, { "55-1234", "555-12345", "abc-defg" } },
        { "[a-z]+@[a-z]+\\.com", { "a@b.com", "xyz@ab.com", NULL }, { "@b.com", "a@b.co", "A@b.com" } },
        { "(ab|cd)*e?", { "", "abcd", "cdabe" }, { "abc", "ee", "x" } },
        { "(?:x[^0-9]){2,3}", { "xaxb", "xaxbx\xc3\xa9", NULL }, { "xa", "x1xa", "xaxbxcxd" } },
        { "a.c|\\(\\)", { "abc", "a\xe2\x82\xac" "c", "()" }, { "a\nc", "ac", "(" } },
        { "colou?r{1,}", { "color", "colourrr", NULL }, { "colo", "colouur", NULL } },
        { "[\\w.-]+", { "a_b.c-d", NULL, NULL }, { "a b", "", NULL } },
        /* starred parts that can be empty: the loop through them is cut, not refused */
        { "(a|b?)+", { "", "abba", "b" }, { "c", "abc", NULL } },
        { "((a*)*b?)*c", { "c", "aabac", "bbc" }, { "", "ab", "ca" } },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        check_cases(regex(cases[i].re), cases[i].re, cases[i].yes, cases[i].no, v, tb, tl);
    }
    struct { const char *re, *needle; } refused[] = {
        { "(a)\\1", "backreferences" }, { "(?=a)b", "lookaround" }, { "(ab", "unterminated (" },
        { "ab)", "unbalanced )" }, { "*a", "nothing before" }, { "[b-a]", "backwards" }, { "a{3,2}", "below" },
        { "a^b", "^ and $" }, { "[\xc3\xa9]", "non-ASCII" }, { "a++", "possessive" },
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(*refused); i++) {
        pd_grammar *x = NULL;
        memset(&err, 0, sizeof(err));
        pd_status st = pd_grammar_regex(refused[i].re, strlen(refused[i].re), &x, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, refused[i].needle) != NULL,
                       "/%s/ -> %d %s", refused[i].re, st, err.msg);
        pd_grammar_unref(x);
    }
}

/* EBNF (GBNF): whole texts, Unicode classes, multi-line rules, comments, the mask along random
 * walks; undefined rules, left recursion, no root and syntax errors refused by name */
static void test_ebnf(const pd_gvocab *v, const uint8_t **tb, const size_t *tl)
{
    struct { const char *g, *yes[3], *no[3]; } cases[] = {
        { "root ::= \"yes\" | \"no\"", { "yes", "no", NULL }, { "", "yesno", "maybe" } },
        /* a list grammar over several lines, with comments and a rule used before it is defined */
        { "# a call\nroot ::= name \"(\" args? \")\"\nargs ::= arg (\", \" arg)*   # one or more\n"
          "arg ::= [0-9]+ | name\nname ::= [a-z_] [a-z0-9_]*\n",
          { "f()", "f(1, x, 22)", "g_2(a)" }, { "f(", "f(1,2)", "2f()" } },
        { "root ::= [^\"\\\\]{2,3} \"!\"?", { "ab", "x\xc3\xa9z!", "\xe4\xb8\xad\xe6\x96\x87" },
          { "a", "abcd", "a\"b" } },
        { "root ::= [\\u4e00-\\u9fa5]+ [\xc3\xa0-\xc3\xbf]", { "\xe4\xb8\xad\xe6\x96\x87\xc3\xa9", NULL, NULL },
          { "\xe4\xb8\xad", "a\xc3\xa9", "\xc3\xa9" } },
        { "root ::= . \"\\x41\\u00e9\" ( ( \"a\" | \"b\"? ) )*", { "\xf0\x9f\x98\x80" "A\xc3\xa9", "\nA\xc3\xa9" "ab", NULL },
          { "A\xc3\xa9", "xA\xc3\xa9" "c", NULL } },
        { "root ::= ws obj ws\nobj ::= \"{\" ws (pair (\",\" ws pair)*)? \"}\"\npair ::= key \":\" ws value ws\n"
          "key ::= \"\\\"\" [a-z]+ \"\\\"\"\nvalue ::= obj | [0-9]+ | key\nws ::= [ \\t\\n]*",
          { "{}", " {\"a\": 1, \"b\":{\"c\":\"d\"}} ", NULL }, { "{", "{\"a\"}", "{'a': 1}" } },
        /* right recursion is fine */
        { "root ::= \"(\" root \")\" | \"x\"", { "x", "((x))", NULL }, { "(x", "()", NULL } },
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(*cases); i++) {
        pd_grammar *g = NULL;
        pd_err err;
        TEST_CHECK_MSG(pd_grammar_ebnf(cases[i].g, strlen(cases[i].g), &g, &err) == PD_OK, "%s: %s", cases[i].g, err.msg);
        check_cases(g, cases[i].g, cases[i].yes, cases[i].no, v, tb, tl);
    }
    struct { const char *g, *needle; } refused[] = {
        { "root ::= item\n", "'item' is used but not defined" },
        { "root ::= list\nlist ::= list \",\" \"x\" | \"x\"", "'list' is left-recursive" },
        { "root ::= a \"x\"\na ::= b? root\nb ::= \"y\"", "left-recursive" },
        { "start ::= \"x\"", "no rule named 'root'" },
        { "root ::= \"a\"\nroot ::= \"b\"", "defined twice" },
        { "root ::= \"a\"\n  \"b\" )", "line 2 column 7: unbalanced )" },
        { "root ::= \"abc", "unterminated string" },
        { "root ::= [z-a]", "backwards" },
        { "root ::= \"\\q\"", "unknown escape \\q" },
        { "root ::= [^\\x00-\\U0010FFFF]", "matches no character" },
        { "root = \"x\"", "expected a rule definition" },
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(*refused); i++) {
        pd_grammar *x = NULL;
        pd_err err;
        memset(&err, 0, sizeof(err));
        pd_status st = pd_grammar_ebnf(refused[i].g, strlen(refused[i].g), &x, &err);
        TEST_CHECK_MSG(st == PD_ERR_INVALID && strstr(err.msg, refused[i].needle) != NULL,
                       "[%s] -> %d %s", refused[i].g, st, err.msg);
        pd_grammar_unref(x);
    }
}

/* the bundled model's tokenizer: a schema walk through real tokens (multi-byte, byte-level
 * pieces), the mask against trying every token */
static void test_real_vocab(void)
{
    pd_tokenizer *tk = NULL;
    pd_err err;
    if (pd_tokenizer_load(PD_MODELS "/tiny-code-qwen3", &tk, &err) != PD_OK) {
        TEST_CHECK_MSG(0, "tokenizer: %s", err.msg);
        return;
    }
    int n = (int)pd_tokenizer_vocab_size(tk);
    int32_t eos = pd_tokenizer_token_to_id(tk, "<|endoftext|>");
    if (eos < 0)
        eos = n - 1;
    pd_gvocab *v = NULL;
    TEST_CHECK(pd_gvocab_create(tk, n, &eos, 1, &v, &err) == PD_OK);
    const uint8_t **tb = calloc((size_t)n, sizeof(*tb));
    size_t *tl = calloc((size_t)n, sizeof(*tl));
    for (int i = 0; i < n; i++)
        if (!pd_tokenizer_is_special(tk, i) && i != eos)
            tb[i] = pd_tokenizer_token_bytes(tk, i, &tl[i]);
    pd_grammar *g = json(person);
    if (v != NULL && g != NULL) {
        int mask_ok, ended;
        char *t = walks(g, v, n, tb, tl, 2, 40, &mask_ok, &ended);
        TEST_CHECK(mask_ok);
        if (t != NULL) {
            cJSON *doc = cJSON_Parse(t);
            TEST_CHECK_MSG(doc != NULL, "real-vocabulary walk parses: %s", t);
            cJSON_Delete(doc);
        }
        free(t);
    }
    pd_grammar_unref(g);
    free(tb);
    free(tl);
    pd_gvocab_destroy(v);
    pd_tokenizer_free(tk);
}

/* --bench: mask times along a JSON text at a vocabulary of Qwen3's size (the bundled
 * tokenizer's tokens, then pairs of them up to 151936 entries); prints, asserts nothing */
#include <time.h>
static double ms_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Malformed specs: random mutations (bytes replaced, dropped, duplicated; cut) of valid
 * schemas, regexes and grammars compile or are refused with PD_ERR_INVALID and a message, never
 * anything else (run under ASan in CI); what compiles gives a matcher whose masks equal trying
 * every token along a short walk. */
static void test_mutations(const pd_gvocab *v, const uint8_t **tb, const size_t *tl, int iters)
{
    static const char *const seeds[3][4] = {
        { "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":-3,\"maximum\":40},"
          "\"b\":{\"type\":\"array\",\"items\":{\"enum\":[\"x\",1,null]},\"maxItems\":3},\"c\":{\"anyOf\":"
          "[{\"type\":\"string\",\"pattern\":\"^[a-z]+$\"},{\"$ref\":\"#/$defs/n\"}]}},\"required\":[\"a\"],"
          "\"$defs\":{\"n\":{\"type\":\"number\",\"exclusiveMinimum\":0}}}",
          "{\"type\":\"string\",\"minLength\":2,\"maxLength\":5}", "{\"oneOf\":[{\"const\":\"a\"},{\"type\":\"boolean\"}]}",
          "{\"type\":\"object\",\"properties\":{\"p\":{\"type\":\"number\",\"minimum\":-0.25,\"maximum\":12.5,"
          "\"multipleOf\":0.01},\"q\":{\"type\":\"string\",\"format\":\"ipv6\"},\"r\":{\"type\":\"string\","
          "\"format\":\"date-time\"}}}" },
        { "^(ab|c[d-f]+)*\\d{2,3}(?:x|y)?$", "[^a-c]\\w+\\s?.{1,4}", "(a|b?)+c{0,2}", "-?\\d+(\\.\\d{1,2})?" },
        { "root ::= item (\",\" ws item)*\nitem ::= [a-z]+ | \"(\" root \")\" | num\nnum ::= [0-9]{1,3}\nws ::= [ \\t]*\n",
          "root ::= [^\"\\\\\\u0100-\\uFFFF]{1,4} \"\\u00e9\"? # c\n", "root ::= (\"a\" | \"b\")+ . \"x\"*",
          "root ::= num (\",\" num)*\nnum ::= [0-9]+ (\".\" [0-9]+)?\n" },
    };
    static const char junk[] = "{}[]()\":,\\|*+?.^$-#=:09az \n\t\xc3\xa9\xff";
    int compiled = 0, refused = 0, bad = 0;
    for (int iter = 0; iter < iters; iter++) {
        int kind = iter % 3;
        const char *src = seeds[kind][(iter / 3) % 4];
        char buf[1024];
        size_t n = strlen(src);
        memcpy(buf, src, n);
        int edits = 1 + (int)(rnd() % 4);
        for (int e = 0; e < edits && n > 0; e++) {
            size_t at = rnd() % n;
            switch (rnd() % 4) {
            case 0: buf[at] = junk[rnd() % (sizeof(junk) - 1)]; break;
            case 1: memmove(buf + at, buf + at + 1, n - at - 1); n--; break;
            case 2:
                if (n + 1 < sizeof(buf)) {
                    memmove(buf + at + 1, buf + at, n - at);
                    n++;
                }
                break;
            default: n = at; break;
            }
        }
        buf[n] = '\0';
        pd_grammar *g = NULL;
        pd_err err = { 0 };
        pd_status st = kind == 0 ? pd_grammar_json(buf, n, &g, &err)
                     : kind == 1 ? pd_grammar_regex(buf, n, &g, &err) : pd_grammar_ebnf(buf, n, &g, &err);
        if (st == PD_OK && g != NULL) {
            compiled++;
            int ok, ended;
            char *t = walks(g, v, N_SMALL, tb, tl, 1, 8, &ok, &ended);
            free(t);
            if (!ok) {
                fprintf(stderr, "mutation %d (kind %d): mask differs: %s\n", iter, kind, buf);
                bad++;
            }
        } else if (st == PD_ERR_INVALID && g == NULL && err.msg[0] != '\0') {
            refused++;
        } else {
            fprintf(stderr, "mutation %d (kind %d): status %d (%s): %s\n", iter, kind, st, err.msg, buf);
            bad++;
        }
        pd_grammar_unref(g);
    }
    printf("mutations: %d compiled, %d refused\n", compiled, refused);
    TEST_CHECK(bad == 0 && compiled > 50 && refused > 50);
}

/* the compile cache: the same key gives the same grammar, a failed compile is not kept, the
 * least recently used entry goes; two matchers of one grammar (the second served from the
 * masks the first left) give equal masks along the same walk */
static int n_compiles;
static pd_status compile_regex(void *ud, pd_grammar **out, pd_err *err)
{
    n_compiles++;
    const char *re = ud;
    return pd_grammar_regex(re, strlen(re), out, err);
}

static void test_gcache(const pd_gvocab *v)
{
    pd_gcache *c = NULL;
    pd_err err;
    TEST_CHECK(pd_gcache_create(2, &c, &err) == PD_OK);
    pd_grammar *a = NULL, *b = NULL, *x = NULL, *y = NULL;
    n_compiles = 0;
    TEST_CHECK(pd_gcache_get(c, "ra+b", 4, compile_regex, "a+b", &a, &err) == PD_OK);
    TEST_CHECK(pd_gcache_get(c, "ra+b", 4, compile_regex, "a+b", &b, &err) == PD_OK);
    TEST_CHECK(a != NULL && a == b && n_compiles == 1);
    TEST_CHECK(pd_gcache_get(c, "r(a", 3, compile_regex, "(a", &x, &err) == PD_ERR_INVALID && x == NULL);
    TEST_CHECK(pd_gcache_get(c, "r(a", 3, compile_regex, "(a", &x, &err) == PD_ERR_INVALID && n_compiles == 3);
    TEST_CHECK(pd_gcache_get(c, "rc", 2, compile_regex, "c", &x, &err) == PD_OK);
    TEST_CHECK(pd_gcache_get(c, "rd", 2, compile_regex, "d", &y, &err) == PD_OK);   /* a+b goes (max 2) */
    pd_grammar_unref(b);
    TEST_CHECK(pd_gcache_get(c, "ra+b", 4, compile_regex, "a+b", &b, &err) == PD_OK && b != a && n_compiles == 6);
    uint64_t hits, misses;
    pd_gcache_stats(c, &hits, &misses);
    TEST_CHECK(hits == 1 && misses == 6);
    pd_grammar_unref(x);
    pd_grammar_unref(y);
    pd_grammar_unref(b);
    pd_gcache_destroy(c);
    /* a still works after the cache is gone */
    TEST_CHECK(accepts(a, v, "aab") == 1 && accepts(a, v, "b") == 0);
    pd_grammar_unref(a);

    pd_grammar *g = json("{\"type\":\"object\",\"properties\":{\"s\":{\"type\":\"string\"},\"n\":{\"type\":\"integer\"}}}");
    pd_gmatch *m1 = NULL, *m2 = NULL;
    int words = pd_gvocab_words(v), same = 1;
    uint32_t *b1 = malloc((size_t)words * 4), *b2 = malloc((size_t)words * 4);
    const char *text = "{\"s\": \"hello\", \"n\": 12}";
    if (g != NULL && pd_gmatch_create(g, &m1, &err) == PD_OK && pd_gmatch_create(g, &m2, &err) == PD_OK) {
        for (const char *p = text;; p++) {
            same = same && pd_gmatch_allowed(m1, v, b1, &err) == PD_OK && pd_gmatch_allowed(m2, v, b2, &err) == PD_OK &&
                   memcmp(b1, b2, (size_t)words * 4) == 0;
            if (*p == '\0' || pd_gmatch_advance(m1, v, (uint8_t)*p, &err) != 1 ||
                pd_gmatch_advance(m2, v, (uint8_t)*p, &err) != 1)
                break;
        }
    }
    TEST_CHECK(same && pd_gmatch_complete(m2));
    free(b1);
    free(b2);
    pd_gmatch_destroy(m1);
    pd_gmatch_destroy(m2);
    pd_grammar_unref(g);
}

static int bench(void)
{
    pd_tokenizer *tk = NULL;
    pd_err err;
    if (pd_tokenizer_load(PD_MODELS "/tiny-code-qwen3", &tk, &err) != PD_OK)
        return 1;
    int n0 = (int)pd_tokenizer_vocab_size(tk), n = 151936;
    const uint8_t **tb = calloc((size_t)n, sizeof(*tb));
    size_t *tl = calloc((size_t)n, sizeof(*tl));
    uint8_t *pool = malloc((size_t)n * 64);
    srand(1);
    for (int i = 0; i < n; i++) {
        if (i < n0) {
            if (!pd_tokenizer_is_special(tk, i))
                tb[i] = pd_tokenizer_token_bytes(tk, i, &tl[i]);
            continue;
        }
        size_t l1, l2;
        const uint8_t *a = pd_tokenizer_token_bytes(tk, rand() % 8000, &l1);
        const uint8_t *b = pd_tokenizer_token_bytes(tk, rand() % 8000, &l2);
        if (l1 + l2 > 64)
            l2 = 64 - l1;
        memcpy(pool + (size_t)i * 64, a, l1);
        memcpy(pool + (size_t)i * 64 + l1, b, l2);
        tb[i] = pool + (size_t)i * 64;
        tl[i] = l1 + l2;
    }
    int32_t eos = pd_tokenizer_token_to_id(tk, "<|endoftext|>");
    pd_gvocab *v = NULL;
    double t = ms_now();
    if (pd_gvocab_create_raw(tb, tl, n, &eos, 1, &v, &err) != PD_OK)
        return 1;
    printf("vocabulary of %d tokens: trie built in %.1f ms\n", n, ms_now() - t);
    pd_grammar *g = json(person);
    pd_gmatch *m = NULL;
    pd_gmatch_create(g, &m, &err);
    uint32_t *bits = malloc((size_t)pd_gvocab_words(v) * 4);
    const char *text = "{\"name\": \"ab\", \"age\": 12";
    for (const char *p = text;; p++) {
        for (int rep = 0; rep < 2; rep++) {
            t = ms_now();
            pd_gmatch_allowed(m, v, bits, &err);
            double dt = ms_now() - t;
            int cnt = 0;
            for (int w = 0; w < pd_gvocab_words(v); w++)
                cnt += __builtin_popcount(bits[w]);
            printf("after '%.*s': %s mask %.3f ms, %d tokens allowed\n", (int)(p - text), text,
                   rep ? "again:" : "first:", dt, cnt);
        }
        if (*p == '\0')
            break;
        int tok = -1;
        for (int i = 0; i < n0 && tok < 0; i++)
            if (tl[i] == 1 && tb[i][0] == (uint8_t)*p)
                tok = i;
        if (pd_gmatch_advance(m, v, tok, &err) != 1)
            break;
    }
    /* a second request's matcher of the same grammar (pd_gcache gives it): the masks the first
     * met are shared */
    pd_gmatch *m2 = NULL;
    pd_gmatch_create(g, &m2, &err);
    double total = 0;
    int steps = 0;
    for (const char *p = text;; p++, steps++) {
        t = ms_now();
        pd_gmatch_allowed(m2, v, bits, &err);
        total += ms_now() - t;
        if (*p == '\0')
            break;
        int tok = -1;
        for (int i = 0; i < n0 && tok < 0; i++)
            if (tl[i] == 1 && tb[i][0] == (uint8_t)*p)
                tok = i;
        if (pd_gmatch_advance(m2, v, tok, &err) != 1)
            break;
    }
    printf("a second matcher of the grammar: %d masks in %.3f ms (shared)\n", steps + 1, total);
    pd_gmatch_destroy(m2);
    free(bits);
    pd_gmatch_destroy(m);
    pd_grammar_unref(g);
    pd_gvocab_destroy(v);
    free(pool);
    free(tb);
    free(tl);
    pd_tokenizer_free(tk);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "--bench") == 0)
        return bench();
    if (argc == 4 && strcmp(argv[1], "--fuzz") == 0) {   /* --fuzz ITERATIONS SEED: more mutations, by hand */
        const uint8_t *tb[N_SMALL];
        size_t tl[N_SMALL];
        small_tables(tb, tl);
        pd_gvocab *v = small_vocab();
        rng_state = strtoull(argv[3], NULL, 0) | 1;
        if (v != NULL)
            test_mutations(v, tb, tl, atoi(argv[2]));
        pd_gvocab_destroy(v);
        TEST_DONE();
    }
    const uint8_t *tb[N_SMALL];
    size_t tl[N_SMALL];
    small_tables(tb, tl);
    pd_gvocab *v = small_vocab();
    if (v != NULL) {
        test_json_object(v, tb, tl);
        test_schema(v, tb, tl);
        test_choice_regex(v, tb, tl);
        test_ebnf(v, tb, tl);
        test_mutations(v, tb, tl, 4000);
        test_gcache(v);
    }
    pd_gvocab_destroy(v);
    test_real_vocab();
    TEST_DONE();
}
