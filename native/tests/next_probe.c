/* next_probe.c - two copies of this library (PROBE=1 and PROBE=2), preloaded after the census library, tell
 * whether dlsym(RTLD_NEXT, ...) still searches after its caller when the census library answers dlsym. */
#define _GNU_SOURCE
#include <dlfcn.h>

int probe(void) { return PROBE; }
int next_probe(void)
{
    int (*f)(void) = (int (*)(void))dlsym(RTLD_NEXT, "probe");
    return f ? f() : 0;
}
