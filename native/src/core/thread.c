/* thread.c - the census's own threads (the flusher, events.c's watchdog), started the one way they must be inside
 * someone else's server: detached, with every signal blocked (the server's signals are its threads' to take, never
 * ours), on a stack of the size asked for, or the default one where that size is refused. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>

#include "internal.h"

int gc_thread_start(void *(*fn)(void *), size_t stack, const char *what)
{
    pthread_attr_t attr;
    pthread_t th;
    sigset_t all, old;
    if (pthread_attr_init(&attr) != 0) return -1;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the new thread inherits "all blocked" */
    int rc = pthread_attr_setstacksize(&attr, stack) == 0 ? pthread_create(&th, &attr, fn, NULL) : EINVAL;
    if (rc == EINVAL) {
        pthread_attr_destroy(&attr);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&th, &attr, fn, NULL);
    }
    if (rc != 0) gc_log("cannot start the %s: %s", what, strerror(rc));
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return rc == 0 ? 0 : -1;
}
