/* test_util.h - the whole test harness: checks that count failures and keep going, skips.
 * TEST_CHECK(cond) records a failure with its location and continues; TEST_SKIP(why) exits 77
 * (ctest's SKIP_RETURN_CODE); TEST_DONE() prints "N passed, N failed" and returns the code. */
#ifndef TEST_UTIL_H
#define TEST_UTIL_H

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int test_n_pass;
static int test_n_fail;

#define TEST_CHECK(cond) \
    do { \
        if (cond) { \
            test_n_pass++; \
        } else { \
            test_n_fail++; \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); \
        } \
    } while (0)

#define TEST_CHECK_MSG(cond, ...) \
    do { \
        if (cond) { \
            test_n_pass++; \
        } else { \
            test_n_fail++; \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__); \
            fputc('\n', stderr); \
        } \
    } while (0)

#define TEST_SKIP(why) \
    do { \
        printf("SKIPPED: %s\n", why); \
        exit(77); \
    } while (0)

#define TEST_DONE() \
    do { \
        printf("%d passed, %d failed\n", test_n_pass, test_n_fail); \
        return (test_n_fail == 0 && test_n_pass > 0) ? 0 : 1; \
    } while (0)

/* Reads a whole file into a NUL-terminated malloc'd buffer (NULL on failure); *len may be NULL. */
static inline char *test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (p != NULL && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p != NULL) {
        p[n] = '\0';
        if (len != NULL)
            *len = (size_t)n;
    }
    return p;
}

/* The monotonic clock in seconds, and in milliseconds. */
static inline double test_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static inline double test_now_ms(void)
{
    return test_now_s() * 1e3;
}

/* Relative L2 error ||a - b|| / max(||b||, tiny). */
static inline double test_rel_l2(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
    }
    return sqrt(num) / (den > 1e-30 ? sqrt(den) : 1e-15);
}

/* One line of tests/fixtures/eval/public_prompts.jsonl: its input_ids (at most 512). */
typedef struct {
    int32_t ids[512];
    int n;
} test_prompt;

/* The first n_want public eval prompts into out[0..n_want-1]; 0 when all were read. */
static inline int test_load_eval_prompts(const char *path, test_prompt *out, int n_want)
{
    char *s = test_read_file(path, NULL);
    if (s == NULL)
        return -1;
    int i = 0;
    for (char *line = strtok(s, "\n"); line != NULL && i < n_want; line = strtok(NULL, "\n")) {
        cJSON *o = cJSON_Parse(line);
        cJSON *ids = cJSON_GetObjectItem(o, "input_ids");
        int n = cJSON_GetArraySize(ids);
        out[i].n = n < 512 ? n : 512;
        for (int j = 0; j < out[i].n; j++)
            out[i].ids[j] = cJSON_GetArrayItem(ids, j)->valueint;
        cJSON_Delete(o);
        i++;
    }
    free(s);
    return i == n_want ? 0 : -1;
}

#endif
