/* A persistent worker pool whose caller never waits for a worker that has not started.
 *
 * The caller publishes a job (fn, ctx, nchunks) and claims chunks itself, as do the workers, from one
 * atomic counter; it then waits only for chunks a worker has claimed and is still running. On a loaded
 * machine (more runnable threads than cores) a descheduled worker therefore costs nothing, where an
 * OpenMP fork-join region waits for every thread of its team at the barrier: measured on the 2-core
 * development machine, that wait made a 2-thread decode step 5-40x slower than a 1-thread one under load.
 * Idle workers spin briefly (the gaps between a decode step's kernels are microseconds), then sleep on a
 * futex until the next job.
 */
#define _GNU_SOURCE
#include "cpu_pool.h"

#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_WORKERS 63
#define SPIN_ROUNDS 20000  /* pause instructions before a worker sleeps: some tens of microseconds */

static struct {
    pthread_mutex_t grow, busy;
    int nworkers;
    _Atomic uint32_t gen;       /* the job generation; the futex word workers sleep on */
    _Atomic uint64_t claim;     /* gen << 32 | nchunks << 16 | next chunk */
    _Atomic int done;           /* chunks of the current job that finished */
    _Atomic int sleepers;
    pool_chunk_fn fn;
    void *ctx;
} pool = {.grow = PTHREAD_MUTEX_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER};

static void futex(_Atomic uint32_t *addr, int op, uint32_t val) {
    syscall(SYS_futex, (uint32_t *)addr, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

/* Claims and runs chunks of job `gen` until none is left (or a newer job replaced it). */
static void work(uint32_t gen) {
    for (;;) {
        uint64_t c = atomic_load(&pool.claim);
        if ((uint32_t)(c >> 32) != gen || (c & 0xffff) >= ((c >> 16) & 0xffff)) return;
        if (!atomic_compare_exchange_weak(&pool.claim, &c, c + 1)) continue;
        pool.fn(pool.ctx, (int)(c & 0xffff));  /* job `gen` stays published until this chunk counts as done */
        atomic_fetch_add(&pool.done, 1);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = atomic_load(&pool.gen);
    for (;;) {
        uint32_t g;
        for (int i = 0; (g = atomic_load(&pool.gen)) == seen; i++) {
            if (i < SPIN_ROUNDS) {
                _mm_pause();
                continue;
            }
            atomic_fetch_add(&pool.sleepers, 1);
            futex(&pool.gen, FUTEX_WAIT, seen);  /* returns at once if gen moved on meanwhile */
            atomic_fetch_sub(&pool.sleepers, 1);
            i = 0;
        }
        seen = g;
        work(g);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    pool.nworkers = 0;  /* the workers did not come along; the next job starts new ones */
    pthread_mutex_init(&pool.grow, NULL);
    pthread_mutex_init(&pool.busy, NULL);
}

static void ensure_workers(int n) {
    if (n > MAX_WORKERS) n = MAX_WORKERS;
    if (pool.nworkers >= n) return;
    pthread_mutex_lock(&pool.grow);
    static int registered;
    if (!registered) registered = !pthread_atfork(NULL, NULL, after_fork_in_child);
    while (pool.nworkers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (rc) break;  /* fewer workers: the caller does the rest */
        pool.nworkers++;
    }
    pthread_mutex_unlock(&pool.grow);
}

void pool_run(pool_chunk_fn fn, void *ctx, int nchunks, int nthreads) {
    /* one job at a time: a second calling thread runs its job alone */
    if (nthreads <= 1 || nchunks <= 1 || nchunks > 0xffff || pthread_mutex_trylock(&pool.busy)) {
        for (int i = 0; i < nchunks; i++) fn(ctx, i);
        return;
    }
    ensure_workers(nthreads - 1);
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.done, 0);
    const uint32_t gen = atomic_load(&pool.gen) + 1;
    atomic_store(&pool.claim, (uint64_t)gen << 32 | (uint64_t)nchunks << 16);
    atomic_store(&pool.gen, gen);
    if (atomic_load(&pool.sleepers)) futex(&pool.gen, FUTEX_WAKE, INT_MAX);
    work(gen);
    for (int i = 0; atomic_load(&pool.done) < nchunks; i++) {
        if (i < 1000) _mm_pause();
        else sched_yield();  /* a worker holding a chunk was descheduled: let it run */
    }
    pthread_mutex_unlock(&pool.busy);
}
