/* test_status.c - pd_err formatting, truncation and the status strings. */
#include <string.h>

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

int main(void)
{
    test_status_set_and_prefix();
    test_status_strings();
    TEST_DONE();
}
