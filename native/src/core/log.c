/* log.c - the injector's only output: short lines on stderr, prefixed with who is talking.
 * Quiet with OTEL_GPU_CENSUS_QUIET=1. Never called from a path that runs per record. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

void gc_log(const char *fmt, ...)
{
    const char *q = getenv("OTEL_GPU_CENSUS_QUIET");
    if (q && *q == '1') return;
    char line[512];
    int n = snprintf(line, sizeof(line), "otel-gpu-census[%d]: ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof(line)) n += vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof(line) - 1) n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    /* one write(2): lines from several processes do not interleave mid-line */
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}
