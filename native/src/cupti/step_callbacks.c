/*
 * step_callbacks.c - under the precise collector, CUPTI's callback at the entry of every API call that launches work
 * notes the call's correlation id under the thread's open step (steps.c).
 *
 * Why not CUPTI's external correlation (cuptiActivityPushExternalCorrelationId and the
 * EXTERNAL_CORRELATION kind)? CUPTI emits those records together with driver/runtime API records, so
 * without tracing every API call (a record per call) it emits none: measured, 0 of them for 132 kernels
 * and copies. A callback on the few launching calls costs far less and needs no records.
 */
#include <string.h>

#include "cupti_api.h"
#include "internal.h"

/* The API calls that put work on the GPU, by name prefix. Graph-node setters (cudaGraphAddMemcpyNode…)
 * do not match: they launch nothing. */
static int launches_work(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const char *name)
{
    (void)cbid;
    static const char *const runtime[] = {"cudaLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset"};
    static const char *const driver[] = {"cuLaunch", "cuGraphLaunch", "cuMemcpy", "cuMemset"};
    const char *const *p = dom == CUPTI_CB_DOMAIN_RUNTIME_API ? runtime : driver;
    for (int i = 0; i < 4; i++)
        if (strncmp(name, p[i], strlen(p[i])) == 0) return 1;
    return 0;
}

void gc_steps_callback(CUpti_CallbackDomain dom, const void *data)
{
    if (dom == CUPTI_CB_DOMAIN_RESOURCE) return;
    const CUpti_CallbackData *cb = data;
    if (cb->callbackSite == CUPTI_API_ENTER) gc_steps_note(cb->correlationId);   /* outside a step: returns at once */
}

int gc_cupti_steps_follow(void) { return gc_cupti_enable_api("steps off", GC_CB_STEPS, launches_work) > 0 ? 0 : -1; }
