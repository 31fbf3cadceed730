/*
 * graph_callbacks.c - under the precise collector, CUPTI's callbacks tell graphs.c of the graphs a process makes:
 * an exec instantiated (learn its contents), updated or changed, destroyed, and each launch's correlation id (the
 * tally finds the launch's contents by it in the GRAPH_TRACE record).
 */
#include <string.h>

#include <cuda.h>

#include "cupti_api.h"
#include "internal.h"

enum role { R_NONE = 0, R_LAUNCH, R_UPDATE, R_CHANGE };
static uint8_t g_role[2][GC_API_CBIDS];  /* [driver?][cbid]: what a callback of ours is for */

static int wanted(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const char *name)
{
    static const struct { const char *prefix; uint8_t role; int driver_only; } table[] = {
        {"cuGraphLaunch", R_LAUNCH, 0}, {"cudaGraphLaunch", R_LAUNCH, 0},
        /* The runtime's calls reach the driver's, whose callbacks fire too: walk once, there. */
        {"cuGraphExecUpdate", R_UPDATE, 1},
        {"cuGraphExecMemcpyNodeSetParams", R_CHANGE, 1}, {"cuGraphExecMemsetNodeSetParams", R_CHANGE, 1},
        {"cuGraphExecNodeSetParams", R_CHANGE, 1}, {"cuGraphExecChildGraphNodeSetParams", R_CHANGE, 1},
        {"cuGraphNodeSetEnabled", R_CHANGE, 1},
    };
    int d = dom == CUPTI_CB_DOMAIN_DRIVER_API;
    if (cbid >= sizeof(g_role[0])) return 0;
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        if (table[i].driver_only && !d) continue;
        if (strncmp(name, table[i].prefix, strlen(table[i].prefix)) == 0) {
            g_role[d][cbid] = table[i].role;
            return 1;
        }
    }
    return 0;
}

void gc_graphs_callback(CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    if (dom == CUPTI_CB_DOMAIN_RESOURCE) {
        const CUpti_ResourceData *r = data;
        const CUpti_GraphData *gd = r ? r->resourceDescriptor : NULL;
        if (!gd || !gd->graphExec) return;
        if (cbid == CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED) gc_graphs_learn(gd->graphExec, gd->graph);
        else if (cbid == CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING) gc_graphs_forget(gd->graphExec);
        return;
    }
    if (dom != CUPTI_CB_DOMAIN_DRIVER_API && dom != CUPTI_CB_DOMAIN_RUNTIME_API) return;
    if (cbid >= sizeof(g_role[0])) return;
    uint8_t role = g_role[dom == CUPTI_CB_DOMAIN_DRIVER_API][cbid];
    if (role == R_NONE) return;
    const CUpti_CallbackData *cb = data;
    /* every call these roles name takes the exec first (and the update its new graph second) */
    void *const *p = cb->functionParams;
    if (!p) return;
    CUgraphExec exec = (CUgraphExec)p[0];
    if (role == R_LAUNCH) {
        if (cb->callbackSite == CUPTI_API_ENTER) gc_graphs_launch(exec, cb->correlationId);
        return;
    }
    if (cb->callbackSite != CUPTI_API_EXIT || !cb->functionReturnValue ||
        *(const CUresult *)cb->functionReturnValue != CUDA_SUCCESS)
        return;
    if (role == R_UPDATE) gc_graphs_learn(exec, (CUgraph)p[1]);
    else gc_graphs_changed(exec);
}

/* After gc_graphs_start(): the callbacks on, 0; -1 (graphs then traced node by node) with learning stopped. */
int gc_cupti_graphs_follow(void)
{
    if (gc_cupti_enable_resource("graphs traced node by node", CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED) != 0 ||
        gc_cupti_enable_resource("graphs traced node by node", CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING) != 0 ||
        gc_cupti_enable_api("graphs traced node by node", GC_CB_GRAPHS, wanted) <= 0) {
        gc_graphs_stop();
        return -1;
    }
    return 0;
}
