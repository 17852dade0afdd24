/* pd_metrics.c - metric registry and Prometheus text rendering (pd_metrics.h).
 * Owns: families (name, help, type) and series (labels, value or buckets), kept in
 *   registration order in two growing arrays of pointers (handles never move).
 * Not here: HTTP, what the numbers mean.
 * Threading: one mutex guards everything; the collect callback runs outside it. */
#include "pd_metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_buf.h"

#define MAX_BOUNDS 64

typedef struct family {
    char *name, *help;
    pd_metric_type type;
} family;

struct pd_metric {
    pd_metrics *reg;
    family *fam;
    char *labels;            /* "" when none */
    double value;            /* counter/gauge value, histogram sum */
    int n_bounds;
    double *bounds;          /* histogram: [n_bounds] */
    uint64_t *buckets;       /* histogram: [n_bounds + 1], not cumulative; last = +Inf */
    uint64_t count;
};

struct pd_metrics {
    pthread_mutex_t mu;
    family **fams;
    int n_fams, cap_fams;
    pd_metric **series;
    int n_series, cap_series;
    void (*collect)(void *ud);
    void *collect_ud;
};

pd_status pd_metrics_create(pd_metrics **out, pd_err *err)
{
    pd_metrics *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "metrics registry");
    pthread_mutex_init(&m->mu, NULL);
    *out = m;
    return PD_OK;
}

void pd_metrics_destroy(pd_metrics *m)
{
    if (m == NULL)
        return;
    for (int i = 0; i < m->n_series; i++) {
        free(m->series[i]->labels);
        free(m->series[i]->bounds);
        free(m->series[i]->buckets);
        free(m->series[i]);
    }
    for (int i = 0; i < m->n_fams; i++) {
        free(m->fams[i]->name);
        free(m->fams[i]->help);
        free(m->fams[i]);
    }
    free(m->series);
    free(m->fams);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static int name_ok(const char *n)
{
    if (n == NULL || n[0] == '\0' || (n[0] >= '0' && n[0] <= '9'))
        return 0;
    for (const char *p = n; *p != '\0'; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == ':'))
            return 0;
    }
    return 1;
}


/* Called with mu held. */
static pd_metric *reg_series(pd_metrics *m, const char *name, const char *help, const char *labels,
                             pd_metric_type type, const double *bounds, int n_bounds)
{
    if (labels == NULL)
        labels = "";
    family *f = NULL;
    for (int i = 0; i < m->n_fams; i++)
        if (strcmp(m->fams[i]->name, name) == 0) {
            f = m->fams[i];
            break;
        }
    if (f != NULL && f->type != type)
        return NULL;
    if (f != NULL)
        for (int i = 0; i < m->n_series; i++)
            if (m->series[i]->fam == f && strcmp(m->series[i]->labels, labels) == 0)
                return m->series[i];
    if (pd_buf_grow((void **)&m->series, &m->cap_series, m->n_series + 1, sizeof(*m->series)) != 0)
        return NULL;
    if (f == NULL) {
        if (pd_buf_grow((void **)&m->fams, &m->cap_fams, m->n_fams + 1, sizeof(*m->fams)) != 0)
            return NULL;
        f = calloc(1, sizeof(*f));
        if (f == NULL)
            return NULL;
        f->name = strdup(name);
        f->help = strdup(help != NULL ? help : "");
        f->type = type;
        if (f->name == NULL || f->help == NULL) {
            free(f->name);
            free(f->help);
            free(f);
            return NULL;
        }
        m->fams[m->n_fams++] = f;
    }
    pd_metric *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->reg = m;
    s->fam = f;
    s->labels = strdup(labels);
    if (type == PD_METRIC_HISTOGRAM) {
        s->n_bounds = n_bounds;
        s->bounds = malloc((size_t)n_bounds * sizeof(double));
        s->buckets = calloc((size_t)n_bounds + 1, sizeof(uint64_t));
        if (s->bounds != NULL)
            memcpy(s->bounds, bounds, (size_t)n_bounds * sizeof(double));
    }
    if (s->labels == NULL || (type == PD_METRIC_HISTOGRAM && (s->bounds == NULL || s->buckets == NULL))) {
        free(s->labels);
        free(s->bounds);
        free(s->buckets);
        free(s);
        return NULL;
    }
    m->series[m->n_series++] = s;
    return s;
}

static pd_metric *reg_locked(pd_metrics *m, const char *name, const char *help, const char *labels,
                             pd_metric_type type, const double *bounds, int n_bounds)
{
    if (m == NULL || !name_ok(name))
        return NULL;
    if (type == PD_METRIC_HISTOGRAM) {
        if (bounds == NULL || n_bounds < 1 || n_bounds > MAX_BOUNDS)
            return NULL;
        for (int i = 0; i < n_bounds; i++)
            if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
                return NULL;
    }
    pthread_mutex_lock(&m->mu);
    pd_metric *s = reg_series(m, name, help, labels, type, bounds, n_bounds);
    pthread_mutex_unlock(&m->mu);
    return s;
}

pd_metric *pd_metrics_counter(pd_metrics *m, const char *name, const char *help, const char *labels)
{
    return reg_locked(m, name, help, labels, PD_METRIC_COUNTER, NULL, 0);
}

pd_metric *pd_metrics_gauge(pd_metrics *m, const char *name, const char *help, const char *labels)
{
    return reg_locked(m, name, help, labels, PD_METRIC_GAUGE, NULL, 0);
}

void pd_metrics_build_info(pd_metrics *m, const char *version, const char *commit)
{
    char v[64], c[64], labels[200];
    pd_metrics_label_escape(v, sizeof(v), version);
    pd_metrics_label_escape(c, sizeof(c), commit);
    snprintf(labels, sizeof(labels), "version=\"%s\",commit=\"%s\"", v, c);
    pd_metric_set(pd_metrics_gauge(m, "pdspark_build_info", "The build serving: pdspark's version and the source commit "
                                   "(always 1)", labels), 1.0);
}

pd_metric *pd_metrics_histogram(pd_metrics *m, const char *name, const char *help,
                                const char *labels, const double *bounds, int n_bounds)
{
    return reg_locked(m, name, help, labels, PD_METRIC_HISTOGRAM, bounds, n_bounds);
}

void pd_metric_add(pd_metric *s, double v)
{
    if (s == NULL || s->fam->type == PD_METRIC_HISTOGRAM || !isfinite(v))
        return;
    if (s->fam->type == PD_METRIC_COUNTER && v < 0)
        return;
    pthread_mutex_lock(&s->reg->mu);
    s->value += v;
    pthread_mutex_unlock(&s->reg->mu);
}

void pd_metric_inc(pd_metric *s)
{
    pd_metric_add(s, 1.0);
}

void pd_metric_set(pd_metric *s, double v)
{
    if (s == NULL || s->fam->type != PD_METRIC_GAUGE)
        return;
    pthread_mutex_lock(&s->reg->mu);
    s->value = v;
    pthread_mutex_unlock(&s->reg->mu);
}

void pd_metric_observe_n(pd_metric *s, double v, uint64_t n)
{
    if (s == NULL || s->fam->type != PD_METRIC_HISTOGRAM || isnan(v) || n == 0)
        return;
    int b = 0;
    while (b < s->n_bounds && v > s->bounds[b])
        b++;
    pthread_mutex_lock(&s->reg->mu);
    s->buckets[b] += n;
    s->count += n;
    s->value += v * (double)n;
    pthread_mutex_unlock(&s->reg->mu);
}

void pd_metric_observe(pd_metric *s, double v)
{
    pd_metric_observe_n(s, v, 1);
}

double pd_metric_value(pd_metric *s)
{
    if (s == NULL)
        return 0.0;
    pthread_mutex_lock(&s->reg->mu);
    double v = s->value;
    pthread_mutex_unlock(&s->reg->mu);
    return v;
}

uint64_t pd_metric_count(pd_metric *s)
{
    if (s == NULL)
        return 0;
    pthread_mutex_lock(&s->reg->mu);
    uint64_t c = s->count;
    pthread_mutex_unlock(&s->reg->mu);
    return c;
}

void pd_metrics_on_collect(pd_metrics *m, void (*fn)(void *ud), void *ud)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->mu);
    m->collect = fn;
    m->collect_ud = ud;
    pthread_mutex_unlock(&m->mu);
}

/* ---------------------------------------------------------------------------------------------
 * Rendering */

typedef struct {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void sb_printf(sbuf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t nc = b->cap * 2;
        while (nc - b->len <= (size_t)n)
            nc *= 2;
        char *np = realloc(b->p, nc);
        if (np == NULL) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = nc;
    }
}

/* Prometheus float: integers without a fraction, +Inf/-Inf/NaN spelled as the format wants. */
static void fmt_num(char *dst, size_t cap, double v)
{
    if (isnan(v))
        snprintf(dst, cap, "NaN");
    else if (isinf(v))
        snprintf(dst, cap, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15)
        snprintf(dst, cap, "%.0f", v);
    else
        snprintf(dst, cap, "%.15g", v);
}

static void help_escape(sbuf *b, const char *h)
{
    for (const char *p = h; *p != '\0'; p++) {
        if (*p == '\\')
            sb_printf(b, "\\\\");
        else if (*p == '\n')
            sb_printf(b, "\\n");
        else
            sb_printf(b, "%c", *p);
    }
}

static const char *type_name(pd_metric_type t)
{
    return t == PD_METRIC_COUNTER ? "counter" : t == PD_METRIC_GAUGE ? "gauge" : "histogram";
}

static void render_series(sbuf *b, const pd_metric *s)
{
    const char *n = s->fam->name;
    const char *l = s->labels;
    char num[64];
    if (s->fam->type != PD_METRIC_HISTOGRAM) {
        fmt_num(num, sizeof(num), s->value);
        if (l[0] != '\0')
            sb_printf(b, "%s{%s} %s\n", n, l, num);
        else
            sb_printf(b, "%s %s\n", n, num);
        return;
    }
    uint64_t cum = 0;
    const char *sep = l[0] != '\0' ? "," : "";
    for (int i = 0; i <= s->n_bounds; i++) {
        cum += s->buckets[i];
        if (i < s->n_bounds)
            fmt_num(num, sizeof(num), s->bounds[i]);
        else
            snprintf(num, sizeof(num), "+Inf");
        sb_printf(b, "%s_bucket{%s%sle=\"%s\"} %llu\n", n, l, sep, num, (unsigned long long)cum);
    }
    fmt_num(num, sizeof(num), s->value);
    if (l[0] != '\0') {
        sb_printf(b, "%s_sum{%s} %s\n", n, l, num);
        sb_printf(b, "%s_count{%s} %llu\n", n, l, (unsigned long long)s->count);
    } else {
        sb_printf(b, "%s_sum %s\n", n, num);
        sb_printf(b, "%s_count %llu\n", n, (unsigned long long)s->count);
    }
}

char *pd_metrics_render(pd_metrics *m, size_t *len)
{
    if (m == NULL)
        return NULL;
    pthread_mutex_lock(&m->mu);
    void (*fn)(void *) = m->collect;
    void *ud = m->collect_ud;
    pthread_mutex_unlock(&m->mu);
    if (fn != NULL)
        fn(ud);
    sbuf b = {.cap = 4096};
    b.p = malloc(b.cap);
    if (b.p == NULL)
        return NULL;
    b.p[0] = '\0';
    pthread_mutex_lock(&m->mu);
    for (int f = 0; f < m->n_fams; f++) {
        const family *fam = m->fams[f];
        sb_printf(&b, "# HELP %s ", fam->name);
        help_escape(&b, fam->help);
        sb_printf(&b, "\n# TYPE %s %s\n", fam->name, type_name(fam->type));
        for (int i = 0; i < m->n_series; i++)
            if (m->series[i]->fam == fam)
                render_series(&b, m->series[i]);
    }
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    if (len != NULL)
        *len = b.len;
    return b.p;
}

void pd_metrics_label_escape(char *dst, size_t cap, const char *src)
{
    if (cap == 0)
        return;
    size_t o = 0;
    for (; src != NULL && *src != '\0'; src++) {
        const char *rep = *src == '\\' ? "\\\\" : *src == '"' ? "\\\"" : *src == '\n' ? "\\n" : NULL;
        size_t need = rep != NULL ? 2 : 1;
        if (o + need >= cap)
            break;
        if (rep != NULL) {
            dst[o++] = rep[0];
            dst[o++] = rep[1];
        } else {
            dst[o++] = *src;
        }
    }
    dst[o] = '\0';
}

void pd_metrics_exp_buckets(double start, double factor, int n, double *out)
{
    double v = start;
    for (int i = 0; i < n; i++, v *= factor)
        out[i] = v;
}

void pd_metrics_lin_buckets(double start, double width, int n, double *out)
{
    for (int i = 0; i < n; i++)
        out[i] = start + width * i;
}
