/* pd_log.c - the one place that decides the log line format.
 * Threading: any thread; the level is read racily on purpose (a stale level
 * only changes whether one message is printed). */
#include "pd_log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

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
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char when[32];
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm);
    if (cur_format == PD_LOG_FORMAT_JSON) {
        char esc[4096];
        json_escape(esc, sizeof(esc), msg);
        fprintf(stderr, "{\"ts\":\"%s.%03ldZ\",\"level\":\"%s\",\"module\":\"%s\",\"msg\":\"%s\"}\n",
                when, ts.tv_nsec / 1000000, level_names[lvl], module, esc);
    } else {
        fprintf(stderr, "%s.%03ldZ %-5s %-8s %s\n", when, ts.tv_nsec / 1000000,
                level_names[lvl], module, msg);
    }
}
