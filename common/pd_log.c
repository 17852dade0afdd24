/* pd_log.c - the one place that decides the log line format, and what of a message reaches it
 *   (pd_log_clean: one line of valid UTF-8 whatever a client put into it).
 * Threading: any thread; the level is read racily on purpose (a stale level
 * only changes whether one message is printed). */
#include "pd_log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <utf8proc.h>

pd_log_level pd_log_cur_level = PD_LOG_LEVEL_INFO;
static pd_log_format cur_format = PD_LOG_FORMAT_TEXT;

static const char *level_names[] = {"error", "warn", "info", "debug", "trace"};

void pd_log_set_level(pd_log_level lvl) { pd_log_cur_level = lvl; }
void pd_log_set_format(pd_log_format fmt) { cur_format = fmt; }
pd_log_format pd_log_get_format(void) { return cur_format; }

int pd_log_level_parse(const char *s)
{
    for (int i = 0; i < 5; i++)
        if (strcmp(s, level_names[i]) == 0)
            return i;
    return -1;
}

char *pd_log_clean(char *dst, size_t cap, const char *src)
{
    size_t o = 0, len = strlen(src);
    const unsigned char *s = (const unsigned char *)src;
    for (size_t i = 0; i < len;) {
        utf8proc_int32_t cp = -1;
        utf8proc_ssize_t n = utf8proc_iterate(s + i, (utf8proc_ssize_t)(len - i), &cp);
        char esc[8];
        const char *put = NULL;
        size_t k;
        if (n < 1) {                                   /* not UTF-8: this byte as \xNN */
            snprintf(esc, sizeof(esc), "\\x%02x", s[i]);
            put = esc;
            n = 1;
        } else if (cp == '\n' || cp == '\r' || cp == '\t') {
            esc[0] = '\\';
            esc[1] = cp == '\n' ? 'n' : cp == '\r' ? 'r' : 't';
            esc[2] = '\0';
            put = esc;
        } else if (cp < 0x20 || cp == 0x7f) {
            snprintf(esc, sizeof(esc), "\\x%02x", (unsigned)cp);
            put = esc;
        } else if (cp >= 0x80 && cp < 0xa0) {
            snprintf(esc, sizeof(esc), "\\u%04x", (unsigned)cp);
            put = esc;
        }
        k = put != NULL ? strlen(put) : (size_t)n;
        if (o + k >= cap)
            break;
        memcpy(dst + o, put != NULL ? put : (const char *)s + i, k);
        o += k;
        i += (size_t)n;
    }
    if (cap > 0)
        dst[o] = '\0';
    return dst;
}

static void json_escape(char *dst, size_t cap, const char *src)
{
    size_t o = 0;
    for (; *src != '\0' && o + 7 < cap; src++) {
        unsigned char c = (unsigned char)*src;
        if (c == '"' || c == '\\') {
            dst[o++] = '\\';
            dst[o++] = (char)c;
        } else if (c < 0x20) {
            o += (size_t)snprintf(dst + o, cap - o, "\\u%04x", c);
        } else {
            dst[o++] = (char)c;
        }
    }
    dst[o] = '\0';
}

void pd_log_write(pd_log_level lvl, const char *module, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    char clean[4096];
    pd_log_clean(clean, sizeof(clean), msg);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char when[32];
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
    if (cur_format == PD_LOG_FORMAT_JSON) {
        char esc[8192];
        json_escape(esc, sizeof(esc), clean);
        fprintf(stderr, "{\"ts\":\"%s.%03ldZ\",\"level\":\"%s\",\"module\":\"%s\",\"msg\":\"%s\"}\n",
                when, ts.tv_nsec / 1000000, level_names[lvl], module, esc);
    } else {
        fprintf(stderr, "%s.%03ldZ %-5s %-8s %s\n", when, ts.tv_nsec / 1000000,
                level_names[lvl], module, clean);
    }
}
