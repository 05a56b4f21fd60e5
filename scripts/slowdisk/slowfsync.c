/* LD_PRELOAD shim for benchmarks: every fsync/fdatasync sleeps IDEM_FSYNC_DELAY_US microseconds (default
 * 2000) before the real call, emulating a disk whose flush takes milliseconds (a cloud network volume).
 * Used by scripts/slowdisk/start.sh for a private PostgreSQL cluster; never in production. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <unistd.h>

static useconds_t delay_us(void) {
    const char *v = getenv("IDEM_FSYNC_DELAY_US");
    return v ? (useconds_t)atoi(v) : 2000;
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    usleep(delay_us());
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    usleep(delay_us());
    return real(fd);
}
