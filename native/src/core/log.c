/* log.c - the injector's only output: short lines on stderr, prefixed with who is talking.
 * Quiet with OTEL_GPU_CENSUS_QUIET=1. Never called from a path that runs per record.
 * What a line quotes may come from anyone who can write a file the injector reads (a control file, a
 * folder's name, an environment variable): every byte outside printable ASCII is written as \xNN, so no
 * terminal escape or stray newline reaches the server's stderr. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

void gc_log(const char *fmt, ...)
{
    const char *q = getenv("OTEL_GPU_CENSUS_QUIET");
    if (q && *q == '1') return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (m < 0) return;
    size_t len = (size_t)m < sizeof(msg) ? (size_t)m : sizeof(msg) - 1;
    char line[1024];
    int n = snprintf(line, sizeof(line), "otel-gpu-census[%d]: ", (int)getpid());
    if (n < 0 || (size_t)n >= sizeof(line)) return;
    size_t at = (size_t)n;
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < len && at + 5 < sizeof(line); i++) {
        unsigned char c = (unsigned char)msg[i];
        if (c >= 0x20 && c < 0x7f) {
            line[at++] = (char)c;
        } else {
            line[at++] = '\\';
            line[at++] = 'x';
            line[at++] = hex[c >> 4];
            line[at++] = hex[c & 15];
        }
    }
    line[at++] = '\n';
    /* one write(2): lines from several processes do not interleave mid-line */
    ssize_t w = write(STDERR_FILENO, line, at);
    (void)w;
}
