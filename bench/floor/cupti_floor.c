/*
 * cupti_floor.c - the CUPTI floor: the cheapest consumer of the activity kinds the census uses.
 *
 * Loaded like the census (CUDA_INJECTION64_PATH=libcupti_floor.so), it registers buffer callbacks,
 * enables the same activity kinds, sets the same 1 s flush period and hands every completed buffer
 * straight back without looking at a record. What a workload loses under this library is what CUPTI
 * itself costs; whatever the census costs on top of it is the census's own processing.
 *
 * Environment:
 *   CUPTI_FLOOR_KINDS   comma list of kernel,memcpy,memcpy2,memset,extcorr,graph
 *                       (default kernel,memcpy,memcpy2,memset,extcorr, the census default)
 *   CUPTI_FLOOR_BUF_KB  activity buffer size in KiB (default 2048, as the census)
 *   CUPTI_FLOOR_ITERATE =1 walks the records (counting them) instead of discarding buffers unread
 *   CUPTI_FLOOR_QUIET   =1 silences the two stderr lines (start, exit summary)
 *   CUPTI_FLOOR_CALLBACKS  graph: subscribe (callback API) and enable the graph-exec resource
 *                       callbacks; launch: those and the driver's launch/copy/memset API callbacks
 *                       (what the census enables for graphs per launch and for engine steps); the
 *                       callback does nothing. With CUPTI_FLOOR_KINDS=none the activity API is never
 *                       touched: what the callback API alone costs (a census counting through callbacks)
 *   CUPTI_FLOOR_ATTACH  when CUPTI is set up: cuinit (default: in InitializeInjection, inside cuInit,
 *                       before any context exists); context: subscribe there with only the context-
 *                       created callback, the rest inside that callback; thread: nothing in cuInit, a
 *                       thread polls the primary context of device 0 (every 100 us) and sets CUPTI up
 *                       once it is active. Does CUPTI set up before a context exists make that context's
 *                       graph replays slower than one set up after?
 */
#define _GNU_SOURCE
#include <cupti.h>
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static size_t buf_bytes = 2048u * 1024u; /* the census default (OTEL_GPU_CENSUS_BUFFER_KB) */
static int iterate_records;
static int quiet;
static atomic_ullong n_buffers, n_bytes, n_records;
static atomic_int flushed_at_exit;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    /* CUPTI wants 8-byte alignment; malloc gives 16. A NULL buffer makes CUPTI drop records. */
    *buffer = malloc(buf_bytes);
    *size = *buffer ? buf_bytes : 0;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid)
{
    (void)ctx; (void)stream; (void)size;
    if (iterate_records && valid) {
        CUpti_Activity *rec = NULL;
        unsigned long long n = 0;
        while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) n++;
        atomic_fetch_add(&n_records, n);
    }
    atomic_fetch_add(&n_buffers, 1);
    atomic_fetch_add(&n_bytes, valid);
    free(buffer);
}

static void at_exit(void)
{
    if (atomic_exchange(&flushed_at_exit, 1)) return;
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    if (!quiet)
        fprintf(stderr, "cupti_floor: exit pid=%d buffers=%llu record_bytes=%llu records=%llu%s\n",
                (int)getpid(), (unsigned long long)n_buffers, (unsigned long long)n_bytes,
                (unsigned long long)n_records, iterate_records ? "" : " (not walked)");
}

static int enable_kinds(const char *spec, char *enabled, size_t enabled_len)
{
    static const struct { const char *name; CUpti_ActivityKind kind; } table[] = {
        {"kernel", CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL},
        {"memcpy", CUPTI_ACTIVITY_KIND_MEMCPY},
        {"memcpy2", CUPTI_ACTIVITY_KIND_MEMCPY2},   /* peer-to-peer copies */
        {"memset", CUPTI_ACTIVITY_KIND_MEMSET},
        {"extcorr", CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION},
        {"graph", CUPTI_ACTIVITY_KIND_GRAPH_TRACE},
    };
    char buf[256];
    snprintf(buf, sizeof buf, "%s", spec);
    enabled[0] = '\0';
    int failures = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        size_t i;
        for (i = 0; i < sizeof table / sizeof table[0]; i++)
            if (strcmp(tok, table[i].name) == 0) break;
        if (i == sizeof table / sizeof table[0]) {
            fprintf(stderr, "cupti_floor: unknown kind '%s' ignored\n", tok);
            continue;
        }
        CUptiResult r = cuptiActivityEnable(table[i].kind);
        if (r != CUPTI_SUCCESS) {
            const char *msg = "?";
            cuptiGetResultString(r, &msg);
            fprintf(stderr, "cupti_floor: enabling %s failed: %s\n", tok, msg);
            failures++;
            continue;
        }
        size_t used = strlen(enabled);
        snprintf(enabled + used, enabled_len - used, "%s%s", used ? "," : "", tok);
    }
    return failures;
}

static void CUPTIAPI on_context(void *ud, CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data);

static void CUPTIAPI on_callback(void *ud, CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    (void)ud; (void)dom; (void)cbid; (void)data;
}

/* The census's callback set: graph-exec creation and destruction, and (launch) every driver call that
 * puts work on the GPU, matched by name as native/src/steps.c does. */
static CUpti_SubscriberHandle g_sub;
static int g_subscribed;

static int enable_callbacks(const char *spec)
{
    if (!g_subscribed && cuptiSubscribe(&g_sub, on_callback, NULL) != CUPTI_SUCCESS) return -1;
    g_subscribed = 1;
    CUpti_SubscriberHandle sub = g_sub;
    int n = 0;
    n += cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_GRAPHEXEC_CREATED) == CUPTI_SUCCESS;
    n += cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_GRAPHEXEC_DESTROY_STARTING)
         == CUPTI_SUCCESS;
    if (strcmp(spec, "launch") == 0) {
        static const char *const prefix[] = {"cuLaunch", "cuGraphLaunch", "cuMemcpy", "cuMemset"};
        for (uint32_t id = 1; id < CUPTI_DRIVER_TRACE_CBID_SIZE; id++) {
            const char *name = NULL;
            if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, id, &name) != CUPTI_SUCCESS || !name) continue;
            for (size_t i = 0; i < sizeof prefix / sizeof prefix[0]; i++)
                if (strncmp(name, prefix[i], strlen(prefix[i])) == 0) {
                    n += cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_DRIVER_API, id) == CUPTI_SUCCESS;
                    break;
                }
        }
    }
    return n;
}

static const char *g_attach = "cuinit";

static void setup(void)
{
    const char *kinds = getenv("CUPTI_FLOOR_KINDS");
    const char *kb = getenv("CUPTI_FLOOR_BUF_KB");
    iterate_records = getenv("CUPTI_FLOOR_ITERATE") && atoi(getenv("CUPTI_FLOOR_ITERATE")) == 1;
    quiet = getenv("CUPTI_FLOOR_QUIET") && atoi(getenv("CUPTI_FLOOR_QUIET")) == 1;
    if (kb && atol(kb) > 0) buf_bytes = (size_t)atol(kb) * 1024u;
    if (!kinds || !*kinds) kinds = "kernel,memcpy,memcpy2,memset,extcorr";
    const char *cbs = getenv("CUPTI_FLOOR_CALLBACKS");
    int ncb = cbs && *cbs ? enable_callbacks(cbs) : 0;
    if (strcmp(kinds, "none") == 0) { /* the callback API only: no activity buffer, no kind */
        if (!quiet)
            fprintf(stderr, "cupti_floor: pid=%d attach=%s callbacks=%s (%d enabled), no activity API\n",
                    (int)getpid(), g_attach, cbs ? cbs : "none", ncb);
        return;
    }

    CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
        const char *msg = "?";
        cuptiGetResultString(r, &msg);
        fprintf(stderr, "cupti_floor: cuptiActivityRegisterCallbacks failed: %s\n", msg);
        return; /* CUDA goes on without us */
    }
    char enabled[256];
    enable_kinds(kinds, enabled, sizeof enabled);
    cuptiActivityFlushPeriod(1000); /* same staleness bound as the census */
    atexit(at_exit);

    uint32_t version = 0;
    cuptiGetVersion(&version);
    Dl_info info = {0};
    dladdr((void *)cuptiActivityEnable, &info);
    if (!quiet)
        fprintf(stderr, "cupti_floor: pid=%d attach=%s cupti_api=%u lib=%s kinds=%s buf_kb=%zu walk=%d callbacks=%d\n",
                (int)getpid(), g_attach, version, info.dli_fname ? info.dli_fname : "?", enabled,
                buf_bytes / 1024, iterate_records, ncb);
}

static atomic_int g_set_up;

static void CUPTIAPI on_context(void *ud, CUpti_CallbackDomain dom, CUpti_CallbackId cbid, const void *data)
{
    (void)ud; (void)data;
    if (dom == CUPTI_CB_DOMAIN_RESOURCE && cbid == CUPTI_CBID_RESOURCE_CONTEXT_CREATED &&
        !atomic_exchange(&g_set_up, 1)) {
        cuptiEnableCallback(0, g_sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_CREATED);
        setup();
    }
}

typedef int (*primary_state_fn)(int dev, unsigned int *flags, int *active);

static void *watch_primary(void *arg)
{
    primary_state_fn state = (primary_state_fn)arg;
    struct timespec tick = {0, 100000};
    for (long i = 0; i < 600L * 10000; i++) { /* gives up after 10 min */
        unsigned int flags = 0;
        int active = 0;
        if (state(0, &flags, &active) == 0 && active) {
            setup();
            return NULL;
        }
        nanosleep(&tick, NULL);
    }
    return NULL;
}

int InitializeInjection(void)
{
    const char *attach = getenv("CUPTI_FLOOR_ATTACH");
    if (attach && *attach) g_attach = attach;
    if (strcmp(g_attach, "context") == 0) {
        /* on_context replaces on_callback as the one subscriber's callback: it ignores the rest */
        if (cuptiSubscribe(&g_sub, on_context, NULL) != CUPTI_SUCCESS) return 1;
        g_subscribed = 1;
        cuptiEnableCallback(1, g_sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_CREATED);
        return 1;
    }
    if (strcmp(g_attach, "thread") == 0) {
        void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        primary_state_fn state = cuda ? (primary_state_fn)dlsym(cuda, "cuDevicePrimaryCtxGetState") : NULL;
        pthread_t t;
        if (!state || pthread_create(&t, NULL, watch_primary, (void *)state) != 0) {
            fprintf(stderr, "cupti_floor: attach=thread impossible, set up now\n");
            setup();
        } else {
            pthread_detach(t);
        }
        return 1;
    }
    setup();
    return 1;
}
