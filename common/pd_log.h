/* pd_log.h - leveled logging to stderr, one line per message.
 * Owns: the global level and format (text|json).
 * Threading: any thread; each message is written with one fprintf. */
#ifndef PD_LOG_H
#define PD_LOG_H

#include <stddef.h>

typedef enum { PD_LOG_LEVEL_ERROR = 0, PD_LOG_LEVEL_WARN, PD_LOG_LEVEL_INFO,
               PD_LOG_LEVEL_DEBUG, PD_LOG_LEVEL_TRACE } pd_log_level;
typedef enum { PD_LOG_FORMAT_TEXT = 0, PD_LOG_FORMAT_JSON } pd_log_format;

extern pd_log_level pd_log_cur_level;

void pd_log_set_level(pd_log_level lvl);
/* Parses "error|warn|info|debug|trace"; returns -1 when unknown. */
int pd_log_level_parse(const char *s);
void pd_log_set_format(pd_log_format fmt);
pd_log_format pd_log_get_format(void);
/* Writes one line: the message is passed through pd_log_clean first (text a client sent, such
 * as a gRPC request_id or a field name in an error, can neither break the line nor the JSON). */
void pd_log_write(pd_log_level lvl, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Copies src into dst (cap >= 1 bytes, NUL-terminated) as one line of valid UTF-8: a byte that
 * does not begin a valid UTF-8 sequence becomes the four characters \xNN, a control character
 * (C0, DEL, C1) \n, \r, \t, \xNN or \u0085-style; the rest is copied. Cut at a whole
 * character or escape when dst is full. Returns dst. */
char *pd_log_clean(char *dst, size_t cap, const char *src);

/* The level is checked before the arguments are evaluated. */
#define PD_LOG_AT(lvl, mod, ...) \
    do { if ((lvl) <= pd_log_cur_level) pd_log_write((lvl), (mod), __VA_ARGS__); } while (0)
#define PD_LOG_ERROR(mod, ...) PD_LOG_AT(PD_LOG_LEVEL_ERROR, mod, __VA_ARGS__)
#define PD_LOG_WARN(mod, ...)  PD_LOG_AT(PD_LOG_LEVEL_WARN, mod, __VA_ARGS__)
#define PD_LOG_INFO(mod, ...)  PD_LOG_AT(PD_LOG_LEVEL_INFO, mod, __VA_ARGS__)
#define PD_LOG_DEBUG(mod, ...) PD_LOG_AT(PD_LOG_LEVEL_DEBUG, mod, __VA_ARGS__)
#define PD_LOG_TRACE(mod, ...) PD_LOG_AT(PD_LOG_LEVEL_TRACE, mod, __VA_ARGS__)

#endif
