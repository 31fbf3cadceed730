/* cupti_api.h - the CUPTI layer: the one unit that knows CUPTI's two APIs (v1 single-subscriber, v2
 * multi-subscriber from CUPTI 13.2) and resolves them at run time, so that a missing or old libcupti
 * means "census off", never a server that cannot start. The rest of the injector calls these. */
#ifndef GC_CUPTI_API_H
#define GC_CUPTI_API_H

#include <stdint.h>
#include <cupti.h>

/* Load libcupti: one already in the process (torch's) wins, else `path` (an error when it does not
 * load), else the soname. 0 on success; a log line and -1 otherwise. */
int gc_cupti_load(const char *path);
/* Become a subscriber: v2 (shared with profilers) unless want_v1 or the library lacks it, else a v1
 * probe that is given back (so a later torch.profiler can still subscribe). -1 with a log line when
 * another tool holds CUPTI exclusively. */
int gc_cupti_subscribe(int want_v1);
int gc_cupti_is_v2(void);
/* Give the v2 subscription back and take the v1 path (a probe, as gc_cupti_subscribe(1)): for a driver
 * whose v2 API refuses what we need. Activity buffers must be registered again. 0 on success. */
int gc_cupti_downgrade_v1(void);
const char *gc_cupti_error(CUptiResult r);
uint32_t gc_cupti_version(void);

CUptiResult gc_cupti_register(CUpti_BuffersCallbackRequestFunc req, CUpti_BuffersCallbackCompleteFunc done);
CUptiResult gc_cupti_enable(CUpti_ActivityKind kind);
CUptiResult gc_cupti_disable(CUpti_ActivityKind kind);
/* CONCURRENT_KERNEL on or off for one context (cuptiActivityEnableContext/DisableContext; they
 * supersede the global setting). CUPTI_ERROR_NOT_SUPPORTED when the library lacks them. */
CUptiResult gc_cupti_kernels_context(CUcontext ctx, int on);
CUptiResult gc_cupti_next_record(uint8_t *buffer, size_t valid, CUpti_Activity **record);
CUptiResult gc_cupti_dropped(CUcontext ctx, uint32_t stream, size_t *dropped);
CUptiResult gc_cupti_flush_all(uint32_t flag);
CUptiResult gc_cupti_flush_period(uint32_t ms);
/* A CUPTI timestamp (0 when none can be had); *why gets the error. */
uint64_t gc_cupti_timestamp(CUptiResult *why);

/* The one function that CUPTI's API and resource callbacks reach (the injector's dispatcher). */
void gc_cupti_set_api_callback(CUpti_CallbackFunc cb);
/* Enable, for `owner`, the callbacks of every runtime and driver API call whose name `want` accepts (found
 * by name, so every CUPTI 13.x works). Under v1 the first enabling takes CUPTI's one subscriber slot for good.
 * Returns how many were enabled, or -1 when no callback can be had (a log line begins with `who`). */
enum { GC_CB_GRAPHS = 1, GC_CB_STEPS = 2, GC_CB_MANAGED = 4 }; /* who wants a callback */
/* Runtime and driver callback ids are below this (tables indexed [driver?][cbid]). */
#define GC_API_CBIDS ((int)CUPTI_DRIVER_TRACE_CBID_SIZE > (int)CUPTI_RUNTIME_TRACE_CBID_SIZE \
                      ? (int)CUPTI_DRIVER_TRACE_CBID_SIZE : (int)CUPTI_RUNTIME_TRACE_CBID_SIZE)
int gc_cupti_enable_api(const char *who, int owner,
                        int (*want)(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const char *name));
/* CUPTI's unified-memory counters configured on (bytes each way, page faults, thrashing and the like where the
 * driver offers them; else the bytes alone): CUPTI_SUCCESS, else why not (CUPTI_ERROR_NOT_SUPPORTED: the library
 * lacks the call). Then enable CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER. */
CUptiResult gc_cupti_um_configure(void);
/* The device of a context (cuptiGetDeviceId). */
CUptiResult gc_cupti_device_of(CUcontext ctx, uint32_t *dev);
/* Enable one resource callback (CUPTI_CBID_RESOURCE_*); 0 on success. */
int gc_cupti_enable_resource(const char *who, CUpti_CallbackId cbid);

/* graph_callbacks.c: the precise collector's way of telling graphs.c of graphs */
int gc_cupti_graphs_follow(void);   /* after gc_graphs_start(): 0, or -1 (learning stopped) */
void gc_graphs_callback(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data);

/* step_callbacks.c: the precise collector's way of noting launches under steps (steps.c) */
int gc_cupti_steps_follow(void);    /* the launch callbacks on: 0, or -1 (steps off) */
void gc_steps_callback(CUpti_CallbackDomain dom, const void *data);

#endif
