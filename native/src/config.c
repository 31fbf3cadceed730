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

/* The injector's names, and those only the Python side reads (so they are not typos). */
static const char *const KNOWN[] = {
    "DISABLED", "DIR", "CUPTI", "FLUSH_MS", "BUFFER_KB", "MAX_BUFFERS", "KERNELS", "GRAPHS", "CUPTI_API",
    "QUIET", "LIB", "TEST_BUILD", "START", "ATTACH", "ACTIVITY", "WINDOWS_PROBE", "EVENT_EVERY", "EVENT_GATE",
    "SETTLE",                   /* the Python engine integrations' (integrations/settle_process.py) */
};
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

/* The default: every kernel counted, kernel records for 100 ms of every second. */
#define COUNTED_ON_MS 100u
#define COUNTED_PERIOD_MS 1000u

/* ACTIVITY=windows: CUPTI attached 200 ms of every 5 s */
#define WINDOWS_ON_MS 200u
#define WINDOWS_PERIOD_MS 5000u

/* ACTIVITY=events: every graph launch of a thread timed by an event pair, and about 1 in 128 eager launches. Gated
 * (events.c), an eager pair is the kernel and its dispatch (ungated, several times CUPTI's durations on vLLM:
 * docs/measurements.md); EAGER 0 leaves eager kernel time unknown */
#define EVENTS_EVERY_EAGER 128u
#define EVENTS_EVERY_GRAPH 1u

/* ON_MS/PERIOD_MS, both multiples of the 20 ms window, 0 < ON_MS < PERIOD_MS <= 1 h: 0, or -1. */
static int parse_schedule(const char *v, uint32_t *on_ms, uint32_t *period_ms)
{
    const uint32_t w = (uint32_t)(GC_WINDOW_NS / 1000000ull);
    char *end;
    unsigned long on = strtoul(v, &end, 10), period = 0;
    if (end == v) return -1;
    if (*end == '/') {
        char *p = end + 1;
        period = strtoul(p, &end, 10);
        if (end == p) period = 0;
    }
    if (*end || on == 0 || period <= on || period > 3600000ul || on % w || period % w) return -1;
    *on_ms = (uint32_t)on;
    *period_ms = (uint32_t)period;
    return 0;
}

/* A kernel tracing setting: counted (the default, also for an empty value), counted:ON_MS/PERIOD_MS,
 * all, off, or ON_MS/PERIOD_MS (sampled). 0 and the mode (and schedule) set, or -1. Used for
 * OTEL_GPU_CENSUS_KERNELS and for the control file's kernels= word. */
int gc_parse_kernels(const char *v, uint32_t *mode, uint32_t *on_ms, uint32_t *period_ms)
{
    if (!v || !*v || strcmp(v, "counted") == 0) {
        *mode = GC_KERNELS_COUNTED;
        *on_ms = COUNTED_ON_MS;
        *period_ms = COUNTED_PERIOD_MS;
        return 0;
    }
    if (strcmp(v, "all") == 0) {
        *mode = GC_KERNELS_ALL;
        return 0;
    }
    if (strcmp(v, "off") == 0) {
        *mode = GC_KERNELS_OFF;
        return 0;
    }
    if (strncmp(v, "counted:", 8) == 0) {
        if (parse_schedule(v + 8, on_ms, period_ms) != 0) return -1;
        *mode = GC_KERNELS_COUNTED;
        return 0;
    }
    if (parse_schedule(v, on_ms, period_ms) != 0) return -1;
    *mode = GC_KERNELS_SAMPLED;
    return 0;
}

/* OTEL_GPU_CENSUS_KERNELS. Anything unknown: one line, and the default. */
static void parse_kernels(struct gc_config *c)
{
    const char *v = getenv("OTEL_GPU_CENSUS_KERNELS");
    c->kernels_named = v && *v;
    if (gc_parse_kernels(v, &c->kernel_mode, &c->kernel_on_ms, &c->kernel_period_ms) != 0) {
        gc_parse_kernels(NULL, &c->kernel_mode, &c->kernel_on_ms, &c->kernel_period_ms);
        c->kernels_named = 0;
        gc_log("ignoring OTEL_GPU_CENSUS_KERNELS=%s (expected counted, counted:ON_MS/PERIOD_MS, all, off or "
               "ON_MS/PERIOD_MS, multiples of %u ms, ON_MS < PERIOD_MS); counting every kernel, records %u ms of "
               "every %u ms", v, (unsigned)(GC_WINDOW_NS / 1000000ull), COUNTED_ON_MS, COUNTED_PERIOD_MS);
    }
}

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
 * (1 unless given) of a thread timed, EAGER in [0, 1000000], GRAPH in [1, 1000000]; anything else: one line and the
 * defaults. */
static void parse_event_every(struct gc_config *c)
{
    c->events_every_eager = EVENTS_EVERY_EAGER;
    c->events_every_graph = EVENTS_EVERY_GRAPH;
    const char *v = getenv("OTEL_GPU_CENSUS_EVENT_EVERY");
    if (!v || !*v) return;
    char *end;
    long e = strtol(v, &end, 10), g = 1;
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
    static const char *const graphs[] = {"launch", "node"}, *const api[] = {"v2", "v1"},
                             *const start[] = {"on", "paused"}, *const attach[] = {"context", "cuinit"},
                             *const activity[] = {"on", "off", "windows", "events"},
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
    c->start_paused = env_choice("OTEL_GPU_CENSUS_START", start, 2) == 1;
    c->attach_cuinit = env_choice("OTEL_GPU_CENSUS_ATTACH", attach, 2) == 1;
    int act = env_choice("OTEL_GPU_CENSUS_ACTIVITY", activity, 4);
    c->activity_off = act != 0;
    c->activity_windows = act == 2;
    c->activity_events = act == 3;
    parse_event_every(c);
    c->events_gate = env_choice("OTEL_GPU_CENSUS_EVENT_GATE", gate, 2) == 0;
    parse_kernels(c);
    /* Windows of CUPTI: longer and rarer than the activity census's duty cycle (designed to pay a set-up and a
     * detach each) unless OTEL_GPU_CENSUS_KERNELS=counted:ON_MS/PERIOD_MS says otherwise. */
    if (c->activity_windows && !c->kernels_named) {
        c->kernel_on_ms = WINDOWS_ON_MS;
        c->kernel_period_ms = WINDOWS_PERIOD_MS;
    }
}
