/* tokenize_main.c - pdspark-tokenize: the tokenizer as a command-line filter.
 * Owns: flag parsing, stdin/stdout formats (space-separated ids or {"ids": [...]}, text or
 *       {"text": "..."}, and --batch: a JSON array of strings in, a JSON array of id arrays out,
 *       so scripts and tests pay the tokenizer load once for many texts).
 * Not here: the tokenizer itself (common/pd_tokenizer.c).
 * Threading: single-threaded process. Exit codes: 0 ok, 1 bad input or load failure,
 *       2 bad command line. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_cli.h"
#include "pd_json.h"
#include "pd_status.h"
#include "pd_tokenizer.h"

static const char USAGE[] =
    "usage: pdspark-tokenize --tokenizer PATH [--decode | --batch] [--json] [--no-special]\n"
    "  --tokenizer PATH  tokenizer.json, or a checkpoint directory that contains it\n"
    "  (default)         read all of stdin as one text, print its token ids\n"
    "  --decode          read token ids (separated by whitespace, commas or [ ]) from stdin,\n"
    "                    print the text\n"
    "  --json            print {\"ids\": [...]} or {\"text\": \"...\"} instead of plain output\n"
    "  --no-special      encode: treat special tokens such as <|im_start|> as plain text;\n"
    "                    decode: leave special tokens out\n"
    "  --batch           encode a JSON array of strings from stdin; print a JSON array with\n"
    "                    the ids of each (strings must not contain \\u0000)\n"
    "  --help            this message\n";

static int read_stdin(char **data, size_t *len)
{
    size_t cap = 1 << 16, n = 0;
    char *p = malloc(cap + 1);
    if (p == NULL)
        return -1;
    for (;;) {
        if (n == cap) {
            char *q = realloc(p, cap * 2 + 1);
            if (q == NULL) {
                free(p);
                return -1;
            }
            p = q;
            cap *= 2;
        }
        size_t got = fread(p + n, 1, cap - n, stdin);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(stdin)) {
        free(p);
        return -1;
    }
    p[n] = '\0';
    *data = p;
    *len = n;
    return 0;
}

static void print_json_string(const char *s, size_t n)
{
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': fputs("\\\"", stdout); break;
        case '\\': fputs("\\\\", stdout); break;
        case '\n': fputs("\\n", stdout); break;
        case '\r': fputs("\\r", stdout); break;
        case '\t': fputs("\\t", stdout); break;
        default:
            if (c < 0x20 || c == 0x7F)
                printf("\\u%04x", c);
            else
                putchar(c);
        }
    }
    putchar('"');
}

/* --batch: returns 0, or 1 after printing one line on stderr. */
static int encode_batch(const pd_tokenizer *tok, const char *in, size_t in_len, int parse_special)
{
    cJSON *arr = pd_json_parse(in, in_len, NULL);
    if (!cJSON_IsArray(arr)) {
        fprintf(stderr, "pdspark-tokenize: --batch: stdin is not a JSON array of strings\n");
        cJSON_Delete(arr);
        return 1;
    }
    const cJSON *e;
    cJSON_ArrayForEach(e, arr) {
        if (!cJSON_IsString(e)) {
            fprintf(stderr, "pdspark-tokenize: --batch: stdin is not a JSON array of strings\n");
            cJSON_Delete(arr);
            return 1;
        }
    }
    int first = 1;
    putchar('[');
    cJSON_ArrayForEach(e, arr) {
        pd_err err;
        int32_t *ids;
        size_t n;
        if (pd_tokenizer_encode(tok, e->valuestring, strlen(e->valuestring), parse_special, &ids,
                                &n, &err) != PD_OK) {
            fprintf(stderr, "pdspark-tokenize: %s\n", err.msg);
            cJSON_Delete(arr);
            return 1;
        }
        fputs(first ? "[" : ", [", stdout);
        first = 0;
        for (size_t i = 0; i < n; i++)
            printf(i == 0 ? "%d" : ", %d", ids[i]);
        putchar(']');
        free(ids);
    }
    fputs("]\n", stdout);
    cJSON_Delete(arr);
    return 0;
}

static int is_sep(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v' || c == ',' ||
           c == '[' || c == ']';
}

/* Parses the ids in s; returns 0, or 1 after printing one line about the bad item. */
static int parse_ids(const char *s, int32_t **ids_out, size_t *n_out)
{
    size_t n = 0, cap = 64;
    int32_t *ids = malloc(cap * sizeof(*ids));
    if (ids == NULL) {
        fprintf(stderr, "pdspark-tokenize: out of memory\n");
        return 1;
    }
    const char *p = s;
    for (;;) {
        while (*p != '\0' && is_sep(*p))
            p++;
        if (*p == '\0')
            break;
        const char *start = p;
        while (*p != '\0' && !is_sep(*p))
            p++;
        char *end;
        errno = 0;
        long v = strtol(start, &end, 10);
        if (end != p || errno != 0 || v < 0 || v > INT32_MAX) {
            fprintf(stderr, "pdspark-tokenize: bad token id '%.*s' (expected a non-negative integer)\n",
                    (int)(p - start > 40 ? 40 : p - start), start);
            free(ids);
            return 1;
        }
        if (n == cap) {
            int32_t *q = realloc(ids, cap * 2 * sizeof(*ids));
            if (q == NULL) {
                free(ids);
                fprintf(stderr, "pdspark-tokenize: out of memory\n");
                return 1;
            }
            ids = q;
            cap *= 2;
        }
        ids[n++] = (int32_t)v;
    }
    *ids_out = ids;
    *n_out = n;
    return 0;
}

int main(int argc, char **argv)
{
    if (pd_cli_version_flag(argc, argv, "pdspark-tokenize"))
        return 0;
    const char *path = NULL;
    int decode = 0, json = 0, no_special = 0, batch = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc) {
            path = argv[++i];
        } else if (strncmp(argv[i], "--tokenizer=", 12) == 0) {
            path = argv[i] + 12;
        } else if (strcmp(argv[i], "--decode") == 0) {
            decode = 1;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--batch") == 0) {
            batch = 1;
        } else if (strcmp(argv[i], "--no-special") == 0) {
            no_special = 1;
        } else if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(USAGE, stdout);
            return 0;
        } else {
            fprintf(stderr, "pdspark-tokenize: %s '%s' (try --help)\n",
                    strcmp(argv[i], "--tokenizer") == 0 ? "missing value for" : "unknown argument",
                    argv[i]);
            return 2;
        }
    }
    if (path == NULL) {
        fprintf(stderr, "pdspark-tokenize: --tokenizer PATH is required (try --help)\n");
        return 2;
    }
    if (batch && decode) {
        fprintf(stderr, "pdspark-tokenize: --batch only encodes; it cannot go with --decode\n");
        return 2;
    }

    pd_err err;
    pd_err_clear(&err);
    pd_tokenizer *tok;
    if (pd_tokenizer_load(path, &tok, &err) != PD_OK) {
        fprintf(stderr, "pdspark-tokenize: %s\n", err.msg);
        return 1;
    }
    char *in;
    size_t in_len;
    if (read_stdin(&in, &in_len) != 0) {
        fprintf(stderr, "pdspark-tokenize: reading stdin: %s\n", strerror(errno));
        pd_tokenizer_free(tok);
        return 1;
    }
    int rc = 0;
    if (batch) {
        rc = encode_batch(tok, in, in_len, !no_special);
    } else if (!decode) {
        int32_t *ids;
        size_t n;
        if (pd_tokenizer_encode(tok, in, in_len, !no_special, &ids, &n, &err) != PD_OK) {
            fprintf(stderr, "pdspark-tokenize: %s\n", err.msg);
            rc = 1;
        } else {
            fputs(json ? "{\"ids\": [" : "", stdout);
            for (size_t i = 0; i < n; i++)
                printf(i == 0 ? "%d" : (json ? ", %d" : " %d"), ids[i]);
            fputs(json ? "]}\n" : "\n", stdout);
            free(ids);
        }
    } else {
        int32_t *ids;
        size_t n;
        char *text;
        size_t len;
        rc = parse_ids(in, &ids, &n);
        if (rc == 0) {
            if (pd_tokenizer_decode(tok, ids, n, no_special, &text, &len, &err) != PD_OK) {
                fprintf(stderr, "pdspark-tokenize: %s\n", err.msg);
                rc = 1;
            } else {
                if (json) {
                    fputs("{\"text\": ", stdout);
                    print_json_string(text, len);
                    fputs("}\n", stdout);
                } else {
                    fwrite(text, 1, len, stdout);
                }
                free(text);
            }
            free(ids);
        }
    }
    free(in);
    pd_tokenizer_free(tok);
    if (fflush(stdout) != 0 && rc == 0) {
        fprintf(stderr, "pdspark-tokenize: writing stdout: %s\n", strerror(errno));
        rc = 1;
    }
    return rc;
}
