/*
 * Preloaded into vLLM 0.32 CPU processes by tests/e2e/test_scratchpad_ownership.py.
 *
 * vLLM's CPU extension keeps one process-global cpu_utils::ScratchPadManager
 * ({size_t size_; void *ptr_;}). Its realloc(n) swaps in a new buffer and frees
 * the old one, unlocked, whenever n outgrows it; kernels read ptr_ while they
 * run. If two threads use it, one can free the buffer the other is reading.
 * vLLM grows it rarely, so that race shows about one start in eight.
 *
 * This replacement makes it deterministic: every call moves the buffer to a
 * fresh mapping and makes the old one inaccessible (PROT_NONE) for the next
 * QUARANTINE moves, so any access through a stale pointer faults at once
 * instead of corrupting the heap silently. Sizes only grow, as in vLLM.
 *
 * With SCRATCHPAD_LOG set to a path, each thread's first call appends
 * "pid tid" there, so a test can tell the library was really interposed.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

struct scratchpad_manager {
    size_t size;
    void *ptr;
};

#define QUARANTINE 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct { void *base; size_t len; } retired[QUARANTINE];
static size_t num_retired;
static __thread int thread_logged;

static void log_thread(void) {
    const char *path = getenv("SCRATCHPAD_LOG");
    if (thread_logged || path == NULL) return;
    thread_logged = 1;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0) return;
    char line[64];
    int len = snprintf(line, sizeof line, "%d %ld\n", getpid(), (long)syscall(SYS_gettid));
    if (write(fd, line, len) < 0) { /* best effort */ }
    close(fd);
}

void _ZN9cpu_utils17ScratchPadManager7reallocEm(struct scratchpad_manager *self, size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = (n + page - 1) & ~(page - 1);
    log_thread();
    pthread_mutex_lock(&lock);
    if (len < self->size) len = self->size;
    void *fresh = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (fresh == MAP_FAILED) abort();
    if (self->ptr != NULL) {
        size_t slot = num_retired++ % QUARANTINE;
        if (retired[slot].base != NULL) munmap(retired[slot].base, retired[slot].len);
        mprotect(self->ptr, self->size, PROT_NONE);
        retired[slot].base = self->ptr;
        retired[slot].len = self->size;
    }
    self->ptr = fresh;
    self->size = len;
    pthread_mutex_unlock(&lock);
}
