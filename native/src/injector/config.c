/*
 * config.c - every OTEL_GPU_CENSUS_* setting the injector reads, read once at start and checked here.
 * A bad value gets one line and its default; a name nobody knows (a typo) gets one line too.
 * (OTEL_GPU_CENSUS_DIR is read where the folder is made, segment.c; QUIET by log.c.)
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu_census.h"
#include "internal.h"

extern char **environ;

/* Every OTEL_GPU_CENSUS_* name, the injector's and the Python side's: the one table (gpu_census_settings.def). */
#define S(name, audience, dflt, values, help) #name,
static const char *const KNOWN[] = {
#include "gpu_census_settings.def"
};
#undef S
#define PREFIX "OTEL_GPU_CENSUS_"

static long env_long(const char *name, long dflt, long lo, long hi)
{
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    long x = strtol(v, &end, 10);
    if (*end || x < lo || x > hi) {
        gc_log("ignoring %s=%s (expected an integer in [%ld, %ld]); using %ld", name, v, lo, hi, dflt);
        return dflt;
    }
    return x;
}

/* One of `choices` (the first is the default); anything else: one line and the default. */
static int env_choice(const char *name, const char *const *choices, int n)
{
    const char *v = getenv(name);
    if (!v || !*v) return 0;
    for (int i = 0; i < n; i++)
        if (strcmp(v, choices[i]) == 0) return i;
    char list[128] = "";
    size_t used = 0;
    for (int i = 0; i < n && used < sizeof(list); i++)
        used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%s", i == 0 ? "" : i == n - 1 ? " or " : ", ",
                                 choices[i]);
    gc_log("ignoring %s=%s (expected %s); using %s", name, v, list, choices[0]);
    return 0;
}

/* The default collector times about 1 in 128 eager launches and 1 in 16 graph launches of a thread with a gated event
 * pair (and each graph exec version's first launches, events.c); EAGER 0 leaves eager kernel time unknown. */
#define EVENTS_EVERY_EAGER 128u
#define EVENTS_EVERY_GRAPH 16u

static void warn_unknown(void)
{
    const size_t plen = strlen(PREFIX);
    for (char **e = environ; e && *e; e++) {
        if (strncmp(*e, PREFIX, plen) != 0) continue;
        const char *name = *e + plen, *eq = strchr(name, '=');
        size_t n = eq ? (size_t)(eq - name) : strlen(name);
        int known = 0;
        for (size_t i = 0; i < sizeof(KNOWN) / sizeof(KNOWN[0]) && !known; i++)
            known = strlen(KNOWN[i]) == n && strncmp(KNOWN[i], name, n) == 0;
        if (!known) gc_log("ignoring unknown setting %.*s%.*s", (int)plen, *e, (int)n, name);
    }
}

/* OTEL_GPU_CENSUS_EVENT_EVERY=EAGER[/GRAPH]: about 1 of every EAGER eager launches (0: none) and GRAPH graph launches
 * (EVENTS_EVERY_GRAPH unless given) of a thread timed, EAGER in [0, 1000000], GRAPH in [1, 1000000]; anything else:
 * one line and the defaults. */
static void parse_event_every(struct gc_config *c)
{
    c->events_every_eager = EVENTS_EVERY_EAGER;
    c->events_every_graph = EVENTS_EVERY_GRAPH;
    const char *v = getenv("OTEL_GPU_CENSUS_EVENT_EVERY");
    if (!v || !*v) return;
    char *end;
    long e = strtol(v, &end, 10), g = EVENTS_EVERY_GRAPH;
    if (*end == '/') g = strtol(end + 1, &end, 10);
    if (*end || e < 0 || e > 1000000 || g < 1 || g > 1000000 || v[0] == '-' || v[0] == '+' || v[0] == ' ' ||
        end == v) {
        gc_log("ignoring OTEL_GPU_CENSUS_EVENT_EVERY=%s (expected EAGER or EAGER/GRAPH, EAGER in [0, 1000000], GRAPH "
               "in [1, 1000000]); "
               "using %u/%u", v, EVENTS_EVERY_EAGER, EVENTS_EVERY_GRAPH);
        return;
    }
    c->events_every_eager = (uint32_t)e;
    c->events_every_graph = (uint32_t)g;
}

int gc_config_disabled(void)
{
    const char *off = getenv("OTEL_GPU_CENSUS_DISABLED");
    return off && *off && strcmp(off, "0") != 0;
}

void gc_config_load(struct gc_config *c)
{
    /* the first of each list is its default: counted at the calls with event-timed kernels (events) wherever the
     * library is preloaded, whether `run` started the process or the environment alone did */
    static const char *const graphs[] = {"launch", "node"}, *const api[] = {"v2", "v1"},
                             *const activity[] = {"events", "on", "off"},
                             *const gate[] = {"on", "off"};
    memset(c, 0, sizeof(*c));
    warn_unknown();
    c->cupti_path = getenv("OTEL_GPU_CENSUS_CUPTI");
    c->buffer_size = (size_t)env_long("OTEL_GPU_CENSUS_BUFFER_KB", 2048, 64, 65536) * 1024;
    c->max_buffers = (int)env_long("OTEL_GPU_CENSUS_MAX_BUFFERS", 32, 2, 4096);
    c->flush_ms = (uint32_t)env_long("OTEL_GPU_CENSUS_FLUSH_MS", 1000, 10, 60000);
    c->graph_mode = env_choice("OTEL_GPU_CENSUS_GRAPHS", graphs, 2) == 1 ? GC_GRAPHS_NODE : GC_GRAPHS_LAUNCH;
    const char *gv = getenv("OTEL_GPU_CENSUS_GRAPHS");
    c->graph_named = gv && strcmp(gv, "launch") == 0;
    c->api_v1 = env_choice("OTEL_GPU_CENSUS_CUPTI_API", api, 2) == 1;
    const char *named = getenv("OTEL_GPU_CENSUS_CUPTI_API");
    c->api_named = named && (strcmp(named, "v1") == 0 || strcmp(named, "v2") == 0);
    int act = env_choice("OTEL_GPU_CENSUS_ACTIVITY", activity, 3);
    c->calls = act != 1;
    c->timing = act == 0;
    parse_event_every(c);
    c->events_gate = env_choice("OTEL_GPU_CENSUS_EVENT_GATE", gate, 2) == 0;
    /* The collector a user names: default (counted at the calls, event-timed kernels) or precise (CUPTI's records of
     * every kernel and copy, measured; busy). It decides over the finer settings above. */
    static const char *const collector[] = {"default", "precise"};
    const char *cv = getenv("OTEL_GPU_CENSUS_COLLECTOR");
    if (cv && *cv) {
        int precise = env_choice("OTEL_GPU_CENSUS_COLLECTOR", collector, 2) == 1;
        c->timing = !precise;
        c->calls = !precise;
    }

}
