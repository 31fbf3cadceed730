/*
 * segment.c - the census segment file: create, map, identity, seqlock.
 *
 * The file's blocks are reserved with posix_fallocate before it is mapped: a store into a
 * mapped page of a full tmpfs raises SIGBUS, which would kill the server we watch.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gpu_census.h"
#include "internal.h"

uint64_t gc_wall_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t gc_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Field 22 of /proc/self/stat: start time in clock ticks since boot. With the pid it names a
 * process uniquely, so a reader can tell a reused pid apart. */
static uint64_t proc_start_ticks(void)
{
    char buf[1024];
    int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm may hold spaces and parentheses */
    if (!p) return 0;
    int field = 2;
    for (; *p && field < 22; p++)
        if (*p == ' ') field++;
    return strtoull(p, NULL, 10);
}

static void read_comm(char *out, size_t len)
{
    int fd = open("/proc/self/comm", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, out, len - 1) : -1;
    if (fd >= 0) close(fd);
    if (n <= 0) n = 0;
    out[n] = 0;
    char *nl = strchr(out, '\n');
    if (nl) *nl = 0;
}

void gc_segment_init(gc_segment *seg, const char *comm, uint64_t wall_start_ns, uint64_t clock_ref_gpu_ns)
{
    seg->layout_version = GC_LAYOUT_VERSION;
    seg->segment_size = (uint32_t)sizeof(gc_segment);
    seg->pid = (uint32_t)getpid();
    seg->ppid = (uint32_t)getppid();
    seg->proc_start_ticks = proc_start_ticks();
    seg->wall_start_ns = wall_start_ns ? wall_start_ns : gc_wall_ns();
    /* CUPTI's timestamp and the wall clock read together at census start map GPU time to wall time */
    seg->clock_ref_wall_ns = seg->wall_start_ns;
    seg->clock_ref_gpu_ns = clock_ref_gpu_ns ? clock_ref_gpu_ns : seg->wall_start_ns;
    seg->window_ns_div = (uint32_t)(GC_WINDOW_NS / 1000);
    if (comm)
        snprintf(seg->comm, sizeof(seg->comm), "%s", comm);
    else
        read_comm(seg->comm, sizeof(seg->comm));
    seg->state = GC_STATE_ACTIVE;
    seg->wall_update_ns = gc_wall_ns();
    /* magic last: a reader that sees it sees a fully initialised identity */
    __atomic_store_n(&seg->magic, GC_MAGIC, __ATOMIC_RELEASE);
}

/* Seqlock, writer side (one writer at a time: the caller holds the tally mutex). */
void gc_segment_begin_update(gc_segment *seg)
{
    __atomic_store_n(&seg->seq, seg->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

void gc_segment_end_update(gc_segment *seg)
{
    seg->wall_update_ns = gc_wall_ns();
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&seg->seq, seg->seq + 1, __ATOMIC_RELAXED);
}

/* The census folder: $OTEL_GPU_CENSUS_DIR, else $XDG_RUNTIME_DIR/otel-gpu-census, else
 * /tmp/otel-gpu-census-<uid>. Created 0700. Returns a descriptor of it, or -1 (and a log line).
 *
 * Anyone can plant a symbolic link at /tmp/otel-gpu-census-<uid>, or swap one in between a check
 * and an open by path, to send our segments into a folder they chose. So the folder is opened once,
 * without following a link (O_NOFOLLOW), the checks (a folder, ours, not group/world-writable) are
 * made on that descriptor, and the segment is created relative to it: what is checked is what is
 * written into. A folder named through a link is refused; `otel-gpu-census run` resolves a folder
 * the user names before it hands it on. */
static int census_dir_fd(char *out, size_t len)
{
    const char *env = getenv("OTEL_GPU_CENSUS_DIR");
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n;
    if (env && *env)
        n = snprintf(out, len, "%s", env);
    else if (xdg && *xdg)
        n = snprintf(out, len, "%s/otel-gpu-census", xdg);
    else
        n = snprintf(out, len, "/tmp/otel-gpu-census-%u", (unsigned)getuid());
    if (n < 0 || (size_t)n >= len) {
        gc_log("census off: the census folder's name is longer than %zu bytes", len - 1);
        return -1;
    }
    if (mkdir(out, 0700) != 0 && errno != EEXIST) {
        gc_log("census off: cannot create census folder %s: %s", out, strerror(errno));
        return -1;
    }
    int dfd = open(out, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) {
        int e = errno;
        struct stat lst;
        /* a link gives ELOOP or ENOTDIR (O_DIRECTORY is checked first on some kernels) */
        if ((e == ELOOP || e == ENOTDIR) && lstat(out, &lst) == 0 && S_ISLNK(lst.st_mode))
            gc_log("census off: census folder %s is a symbolic link (refused: name the folder itself)", out);
        else if (e == ENOTDIR)
            gc_log("census off: %s is not a folder", out);
        else
            gc_log("census off: cannot open census folder %s: %s", out, strerror(e));
        return -1;
    }
    struct stat st;
    if (fstat(dfd, &st) != 0 || !S_ISDIR(st.st_mode)) {
        gc_log("census off: %s is not a folder", out);
        close(dfd);
        return -1;
    }
    if (st.st_uid != getuid() || (st.st_mode & 0022)) {
        gc_log("census off: census folder %s must belong to uid %u and not be group/world-writable",
               out, (unsigned)getuid());
        close(dfd);
        return -1;
    }
    return dfd;
}

gc_segment *gc_segment_open(char *path, size_t path_len)
{
    char dir[4096 - 64];
    char name[64];
    int dfd = census_dir_fd(dir, sizeof(dir));
    if (dfd < 0) return NULL;
    snprintf(name, sizeof(name), "gpu-census-%d-%llu.seg", (int)getpid(),
             (unsigned long long)proc_start_ticks());
    snprintf(path, path_len, "%s/%s", dir, name);
    int fd = openat(dfd, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) {
        gc_log("census off: cannot create %s: %s", path, strerror(errno));
        close(dfd);
        path[0] = 0;
        return NULL;
    }
    void *p = MAP_FAILED;
    int err = posix_fallocate(fd, 0, (off_t)sizeof(gc_segment));
    if (err != 0)
        gc_log("census off: cannot reserve %zu bytes for %s: %s", sizeof(gc_segment), path,
               strerror(err));
    else if ((p = mmap(NULL, sizeof(gc_segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        gc_log("census off: cannot map %s: %s", path, strerror(errno));
    close(fd);
    if (p == MAP_FAILED) {
        unlinkat(dfd, name, 0);
        path[0] = 0;
    }
    close(dfd);
    return p == MAP_FAILED ? NULL : p;
}
