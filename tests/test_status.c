/* test_status.c - pd_err formatting, truncation and the status strings; pd_log's lines: what a
 * client may put into a message (newlines, escapes, bytes that are not UTF-8) can neither end a
 * text line nor make a JSON line invalid. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "pd_log.h"
#include "pd_status.h"
#include "test_util.h"

static void test_status_set_and_prefix(void)
{
    pd_err err;
    pd_err_clear(&err);
    TEST_CHECK(err.code == PD_OK && err.msg[0] == '\0');
    TEST_CHECK(pd_err_set(&err, PD_ERR_INVALID, "tensor %s: shape %d", "w", 3) == PD_ERR_INVALID);
    TEST_CHECK(strcmp(err.msg, "tensor w: shape 3") == 0);
    TEST_CHECK(pd_err_prefix(&err, "file %s", "a.safetensors") == PD_ERR_INVALID);
    TEST_CHECK(strcmp(err.msg, "file a.safetensors: tensor w: shape 3") == 0);
    TEST_CHECK(pd_err_set(NULL, PD_ERR_IO, "ignored") == PD_ERR_IO);
    char big[2000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    pd_err_set(&err, PD_ERR_NOMEM, "%s", big);
    TEST_CHECK(strlen(err.msg) == sizeof(err.msg) - 1);
}

static void test_status_strings(void)
{
    for (int s = PD_OK; s <= PD_ERR_INTERNAL; s++)
        TEST_CHECK(strcmp(pd_status_str((pd_status)s), "unknown status") != 0);
    TEST_CHECK(pd_log_level_parse("trace") == PD_LOG_LEVEL_TRACE);
    TEST_CHECK(pd_log_level_parse("nope") == -1);
}

static void test_log_clean(void)
{
    static const struct { const char *in, *out; } cases[] = {
        {"plain text, 42 %", "plain text, 42 %"},
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
        {"a\nb\rc\td", "a\\nb\\rc\\td"},
        {"esc \x1b[31mred\x7f", "esc \\x1b[31mred\\x7f"},
        {"nel \xc2\x85 end", "nel \\u0085 end"},
        {"bad \xff\xfe", "bad \\xff\\xfe"},
        {"cut \xe6uzz", "cut \\xe6uzz"},                       /* a sequence cut short */
        {"overlong \xc0\xaf", "overlong \\xc0\\xaf"},
        {"surrogate \xed\xa0\x80", "surrogate \\xed\\xa0\\x80"},
        {"past U+10FFFF \xf4\x90\x80\x80", "past U+10FFFF \\xf4\\x90\\x80\\x80"},
        {"", ""},
    };
    char out[128];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        pd_log_clean(out, sizeof(out), cases[i].in);
        TEST_CHECK(strcmp(out, cases[i].out) == 0);
        if (strcmp(out, cases[i].out) != 0)
            fprintf(stderr, "  case %zu: got '%s', want '%s'\n", i, out, cases[i].out);
    }
    /* cut at a whole character or escape: never half of either */
    pd_log_clean(out, 6, "ab\xc3\xa9" "cd");
    TEST_CHECK(strcmp(out, "ab\xc3\xa9" "c") == 0);
    pd_log_clean(out, 4, "ab\xc3\xa9" "cd");
    TEST_CHECK(strcmp(out, "ab") == 0);
    pd_log_clean(out, 6, "ab\ncd");
    TEST_CHECK(strcmp(out, "ab\\nc") == 0);
    pd_log_clean(out, 5, "abc\n");
    TEST_CHECK(strcmp(out, "abc") == 0);
    pd_log_clean(out, 1, "abc");
    TEST_CHECK(out[0] == '\0');
}

/* pd_log_write's own lines, stderr caught in a file: a request id with a forged line in it */
static void test_log_lines(void)
{
    const char *id = "evil\n2026-12-07T00:00:00.000Z info  request  forged: ok\xff\x1b[2J";
    char path[] = "/tmp/pd_test_log_XXXXXX";
    int fd = mkstemp(path);
    TEST_CHECK(fd >= 0);
    if (fd < 0)
        return;
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    pd_log_set_format(PD_LOG_FORMAT_TEXT);
    pd_log_write(PD_LOG_LEVEL_WARN, "request", "%s: bad", id);
    pd_log_set_format(PD_LOG_FORMAT_JSON);
    pd_log_write(PD_LOG_LEVEL_WARN, "request", "%s: bad", id);
    pd_log_set_format(PD_LOG_FORMAT_TEXT);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char buf[2048];
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    close(fd);
    unlink(path);
    TEST_CHECK(n > 0);
    if (n <= 0)
        return;
    buf[n] = '\0';
    char *nl = strchr(buf, '\n');
    TEST_CHECK(nl != NULL);
    if (nl == NULL)
        return;
    *nl = '\0';
    const char *want = "evil\\n2026-12-07T00:00:00.000Z info  request  forged: ok\\xff\\x1b[2J: bad";
    TEST_CHECK(strstr(buf, want) != NULL);           /* the text line holds all of it, escaped */
    char *json = nl + 1, *end = strchr(json, '\n');
    TEST_CHECK(end != NULL && end[1] == '\0');       /* two lines in all, nothing forged */
    if (end == NULL)
        return;
    *end = '\0';
    cJSON *o = cJSON_Parse(json);
    TEST_CHECK(o != NULL);
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(o, "msg");
    TEST_CHECK(cJSON_IsString(msg) && strcmp(msg->valuestring, want) == 0);
    cJSON_Delete(o);
    for (const unsigned char *p = (const unsigned char *)buf; *p != '\0'; p++)
        TEST_CHECK(*p >= 0x20 && *p < 0x7f);         /* no control and no stray high byte */
}

int main(void)
{
    test_status_set_and_prefix();
    test_status_strings();
    test_log_clean();
    test_log_lines();
    TEST_DONE();
}
