/* pd_cli.c - flag parsing, token-id files, the clock, address splitting (pd_cli.h).
 * Owns: nothing stateful. Not here: engine or network code.
 * Threading: pure functions. */
#include "pd_cli.h"

#include "pd_log.h"
#include "pd_version.h"
#ifdef PD_HAVE_NET
#include "pd_proto_version.h"
#endif

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

const char *pd_cli_version(void)
{
    return PD_VERSION;
}

const char *pd_cli_commit(void)
{
    return PD_GIT_COMMIT;
}

void pd_cli_print_version(FILE *f, const char *prog)
{
#ifdef PD_HAVE_CUDA
    const char *cuda = "on";
#else
    const char *cuda = "off";
#endif
#ifdef PD_HAVE_NET
    fprintf(f, "%s (pdspark %s, commit %s; cuda %s, services on, protocol %u)\n", prog, PD_VERSION, PD_GIT_COMMIT,
            cuda, (unsigned)PD_PROTO_VERSION);
#else
    fprintf(f, "%s (pdspark %s, commit %s; cuda %s, services off)\n", prog, PD_VERSION, PD_GIT_COMMIT, cuda);
#endif
}

int pd_cli_version_flag(int argc, char **argv, const char *prog)
{
    for (int i = 1; i < argc && strcmp(argv[i], "--") != 0; i++)
        if (strcmp(argv[i], "--version") == 0) {
            pd_cli_print_version(stdout, prog);
            return 1;
        }
    return 0;
}

double pd_cli_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

void pd_cli_block_stop_signals(sigset_t *set)
{
    sigemptyset(set);
    sigaddset(set, SIGINT);
    sigaddset(set, SIGTERM);
    sigset_t all = *set;
    sigaddset(&all, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    signal(SIGPIPE, SIG_IGN);
}

int pd_cli_wait_stop(const sigset_t *stop, int64_t every_ms, void (*tick)(void *ud, int hup), void *ud)
{
    sigset_t w = *stop;
    sigaddset(&w, SIGHUP);
    double next = pd_cli_now_ms() + (double)every_ms;
    for (;;) {
        int sig = -1;
        if (every_ms > 0) {
            double left = next - pd_cli_now_ms();
            if (left <= 0) {
                if (tick != NULL)
                    tick(ud, 0);
                next = pd_cli_now_ms() + (double)every_ms;
                continue;
            }
            struct timespec ts = { (time_t)(left / 1000.0), (long)(fmod(left, 1000.0) * 1e6) };
            sig = sigtimedwait(&w, NULL, &ts);
        } else if (sigwait(&w, &sig) != 0) {
            sig = -1;
        }
        if (sig == SIGHUP) {
            if (tick != NULL)
                tick(ud, 1);
        } else if (sig > 0) {
            return sig;
        }
    }
}

long pd_cli_raise_fd_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return -1;
    if (rl.rlim_cur < rl.rlim_max) {
        struct rlimit want = {rl.rlim_max, rl.rlim_max};
        if (setrlimit(RLIMIT_NOFILE, &want) == 0)
            rl.rlim_cur = rl.rlim_max;
    }
    return rl.rlim_cur == RLIM_INFINITY ? -1 : (long)rl.rlim_cur;
}

int pd_cli_parse_i64(const char *prog, const char *flag, const char *s, int64_t lo, int64_t hi,
                     int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0' || end == s || v < lo || v > hi) {
        fprintf(stderr, "%s: %s: '%s' is not an integer in %lld..%lld\n", prog, flag, s,
                (long long)lo, (long long)hi);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

int pd_cli_parse_int(const char *prog, const char *flag, const char *s, int lo, int hi, int *out)
{
    int64_t v;
    if (pd_cli_parse_i64(prog, flag, s, lo, hi, &v) != 0)
        return -1;
    *out = (int)v;
    return 0;
}

int pd_cli_parse_dtype(const char *prog, const char *s, int *f32)
{
    if (strcmp(s, "f32") != 0 && strcmp(s, "bf16") != 0) {
        fprintf(stderr, "%s: --dtype: '%s' is not bf16 or f32\n", prog, s);
        return -1;
    }
    *f32 = strcmp(s, "f32") == 0;
    return 0;
}

pd_status pd_cli_read_text(const char *path, char **out, pd_err *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return pd_err_set(err, PD_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    do {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *nb = realloc(buf, cap);
            if (nb == NULL) {
                free(buf);
                fclose(f);
                return pd_err_set(err, PD_ERR_NOMEM, "%s: read buffer", path);
            }
            buf = nb;
        }
        n = fread(buf + len, 1, 4096, f);
        len += n;
    } while (n == 4096);
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return pd_err_set(err, PD_ERR_IO, "%s: read error", path);
    }
    buf[len] = '\0';
    *out = buf;
    return PD_OK;
}

int pd_cli_parse_log_format(const char *prog, const char *s)
{
    if (strcmp(s, "text") != 0 && strcmp(s, "json") != 0) {
        fprintf(stderr, "%s: --log-format: want text or json, got '%s'\n", prog, s);
        return -1;
    }
    pd_log_set_format(strcmp(s, "json") == 0 ? PD_LOG_FORMAT_JSON : PD_LOG_FORMAT_TEXT);
    return 0;
}

int pd_cli_parse_float(const char *prog, const char *flag, const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno != 0 || *end != '\0' || end == s) {
        fprintf(stderr, "%s: %s: '%s' is not a number\n", prog, flag, s);
        return -1;
    }
    *out = v;
    return 0;
}

int pd_cli_parse_fraction(const char *prog, const char *flag, const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || *end != '\0' || end == s || !(v > 0.0 && v < 1.0)) {
        fprintf(stderr, "%s: %s: '%s' is not a fraction in (0, 1)\n", prog, flag, s);
        return -1;
    }
    *out = v;
    return 0;
}

int pd_cli_parse_gib(const char *prog, const char *flag, const char *s, int64_t *bytes)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || *end != '\0' || end == s || !(v >= 0.0 && v <= 65536.0)) {
        fprintf(stderr, "%s: %s: '%s' is not a size in GiB in [0, 65536]\n", prog, flag, s);
        return -1;
    }
    *bytes = (int64_t)(v * 1073741824.0);
    return 0;
}

int pd_cli_parse_logit_bias(const char *prog, const char *flag, const char *s, pd_logit_bias **b, int *n)
{
    const char *p = s;
    while (*p != '\0') {
        char *end;
        errno = 0;
        long id = strtol(p, &end, 10);
        if (errno != 0 || end == p || *end != ':' || id < 0 || id > INT32_MAX) {
            fprintf(stderr, "%s: %s: '%s' is not ID:BIAS[,ID:BIAS...]\n", prog, flag, s);
            return -1;
        }
        p = end + 1;
        float v = strtof(p, &end);
        if (errno != 0 || end == p || (*end != ',' && *end != '\0')) {
            fprintf(stderr, "%s: %s: '%s' is not ID:BIAS[,ID:BIAS...]\n", prog, flag, s);
            return -1;
        }
        if (*n >= PD_MAX_LOGIT_BIAS) {
            fprintf(stderr, "%s: %s: more than %d entries\n", prog, flag, PD_MAX_LOGIT_BIAS);
            return -1;
        }
        pd_logit_bias *nb = realloc(*b, (size_t)(*n + 1) * sizeof(**b));
        if (nb == NULL) {
            fprintf(stderr, "%s: out of memory\n", prog);
            return -1;
        }
        *b = nb;
        (*b)[(*n)++] = (pd_logit_bias){ .tok = (int32_t)id, .bias = v };
        p = *end == ',' ? end + 1 : end;
    }
    return 0;
}

int pd_cli_parse_ids(const char *prog, const char *flag, const char *s, uint32_t **ids, int *n)
{
    const char *p = s;
    do {
        char *end;
        errno = 0;
        long long id = strtoll(p, &end, 10);
        if (errno != 0 || end == p || (*end != ',' && *end != '\0') || id < 0 || id > UINT32_MAX) {
            fprintf(stderr, "%s: %s: '%s' is not ID[,ID...]\n", prog, flag, s);
            return -1;
        }
        uint32_t *nv = realloc(*ids, (size_t)(*n + 1) * sizeof(**ids));
        if (nv == NULL) {
            fprintf(stderr, "%s: out of memory\n", prog);
            return -1;
        }
        *ids = nv;
        (*ids)[(*n)++] = (uint32_t)id;
        p = *end == ',' ? end + 1 : end;
    } while (*p != '\0');
    return 0;
}

int pd_cli_parse_guide(const char *prog, const char *flag, const char *arg, pd_cli_guide *g)
{
    int kinds = g->json_object + (g->schema != NULL) + (g->n_choices > 0) + (g->regex != NULL) + (g->grammar != NULL);
    int same = (strcmp(flag, "--choice") == 0 && g->n_choices > 0);
    if (kinds > 0 && !same) {
        fprintf(stderr, "%s: %s: give only one of --json-object, --json-schema, --choice, --regex and --grammar\n",
                prog, flag);
        return -1;
    }
    if (strcmp(flag, "--json-object") == 0) {
        g->json_object = 1;
        return 0;
    }
    if (strcmp(flag, "--regex") == 0) {
        g->regex = arg;
        return 0;
    }
    if (strcmp(flag, "--choice") == 0) {
        char **nc = realloc(g->choices, (size_t)(g->n_choices + 1) * sizeof(char *));
        if (nc == NULL || (nc[g->n_choices] = strdup(arg)) == NULL) {
            if (nc != NULL)
                g->choices = nc;
            fprintf(stderr, "%s: out of memory\n", prog);
            return -1;
        }
        g->choices = nc;
        g->n_choices++;
        return 0;
    }
    FILE *f = strcmp(arg, "-") == 0 ? stdin : fopen(arg, "rb");
    if (f == NULL) {
        fprintf(stderr, "%s: %s %s: %s\n", prog, flag, arg, strerror(errno));
        return -1;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    while (buf != NULL) {
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
        if (n + 1 == cap) {
            char *nb = cap < (1u << 20) ? realloc(buf, cap * 2) : NULL;
            if (nb == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    if (f != stdin)
        fclose(f);
    if (buf == NULL) {
        fprintf(stderr, "%s: %s %s: out of memory or larger than 1 MiB\n", prog, flag, arg);
        return -1;
    }
    buf[n] = '\0';
    if (strcmp(flag, "--grammar") == 0)
        g->grammar = buf;
    else
        g->schema = buf;
    return 0;
}

void pd_cli_guide_free(pd_cli_guide *g)
{
    free(g->schema);
    free(g->grammar);
    for (int i = 0; i < g->n_choices; i++)
        free(g->choices[i]);
    free(g->choices);
    memset(g, 0, sizeof(*g));
}

int pd_cli_read_ids(const char *prog, const char *path, int32_t **ids, int *n)
{
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "%s: --prompt-ids %s: %s\n", prog, path, strerror(errno));
        return -1;
    }
    int cap = 256, cnt = 0, rc = 0;
    int32_t *v = malloc((size_t)cap * sizeof(int32_t));
    char word[64];
    while (v != NULL && fscanf(f, "%63s", word) == 1) {
        char *end;
        errno = 0;
        long long x = strtoll(word, &end, 10);
        if (errno != 0 || *end != '\0' || x < INT32_MIN || x > INT32_MAX) {
            fprintf(stderr, "%s: --prompt-ids %s: '%s' is not a token id\n", prog, path, word);
            rc = -1;
            break;
        }
        if (cnt == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, (size_t)cap * sizeof(int32_t));
            if (nv == NULL) {
                free(v);
                v = NULL;
                break;
            }
            v = nv;
        }
        v[cnt++] = (int32_t)x;
    }
    if (f != stdin)
        fclose(f);
    if (v == NULL) {
        fprintf(stderr, "%s: out of memory reading %s\n", prog, path);
        return -1;
    }
    if (rc != 0) {
        free(v);
        return rc;
    }
    *ids = v;
    *n = cnt;
    return 0;
}

int pd_cli_split_hostport(const char *addr, char *host, size_t host_len, char *port,
                          size_t port_len)
{
    const char *colon;
    size_t hl;
    const char *h = addr;
    if (addr[0] == '[') {
        const char *rb = strchr(addr, ']');
        if (rb == NULL || rb[1] != ':')
            return -1;
        h = addr + 1;
        hl = (size_t)(rb - h);
        colon = rb + 1;
    } else {
        colon = strrchr(addr, ':');
        if (colon == NULL)
            return -1;
        hl = (size_t)(colon - addr);
    }
    size_t pl = strlen(colon + 1);
    if (hl == 0 || hl >= host_len || pl == 0 || pl >= port_len)
        return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    memcpy(port, colon + 1, pl + 1);
    return 0;
}

int pd_cli_bad_flag(const char *prog, const char *arg)
{
    fprintf(stderr, "%s: unknown or incomplete flag '%s' (%s --help lists the flags)\n", prog,
            arg != NULL ? arg : "", prog);
    return 2;
}
