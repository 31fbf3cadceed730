/* internal.h - what the injector's units share; not part of the reader contract. */
#ifndef GC_INTERNAL_H
#define GC_INTERNAL_H

#include <stdint.h>
#include <cupti.h>

/* The newest record structs of the CUPTI headers we build with. tally.c reads only fields
 * whose offsets every 13.x version shares, and asserts that. */
#if CUPTI_API_VERSION >= 130500
#define GC_KERNEL_T CUpti_ActivityKernel13
#define GC_MEMCPY_T CUpti_ActivityMemcpy7
#define GC_MEMSET_T CUpti_ActivityMemset5
#else
/* Records of CUPTI 13.0-13.4 have the same offsets for what we read (asserted in tally.c),
 * but the multi-subscriber API we use where it exists first appears in these headers. */
#error "otel-gpu-census builds against CUPTI >= 13.5 headers (pip wheel nvidia-cuda-cupti)"
#endif

/* The external-correlation kind our steps use; torch/kineto use CUSTOM0 and CUSTOM1. */
#define GC_EXTERNAL_KIND CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2

/* log.c: one line to stderr, prefixed, never more than once per reason id. */
void gc_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* segment.c */
struct gc_segment;
/* Create and map this process's segment in the census folder; NULL (and a log line) on failure. */
struct gc_segment *gc_segment_open(char *path_out, size_t path_len);
uint64_t gc_wall_ns(void);

#endif
