/*
 * The persistent thread pool of the native CPU kernels (cpu_experts.c, cpu_quant.c), one copy per
 * library that includes it; cpu_quant.c borrows cpu_experts.c's at run time where that library is
 * loaded (moe_pool_run), so one process has one set of workers and one thread-count setting.
 *
 * A small pool instead of OpenMP: the caller works as thread 0; workers spin briefly after a
 * call (layers follow each other closely in decode) and then sleep. A worker that wakes after
 * the work is done never joins, so a slow wake-up does not delay the call (OpenMP's closing
 * barrier would wait for it). libgomp also keeps one team per calling thread and spins for
 * milliseconds after each region, colliding with torch's team.
 *
 * Needs only SSE2 (_mm_pause), so a library built for AVX2 can include it.
 */
#ifndef MOEDESK_NATIVE_POOL_H
#define MOEDESK_NATIVE_POOL_H

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define POOL_MAX_WORKERS 1023

typedef void (*pool_fn)(void *arg, int tid);

static inline void relax(unsigned *spins) {
    if (++*spins < 4096) _mm_pause();
    else sched_yield(); /* the thread we wait for may have been preempted */
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* state: generation (32 bits) | closed (1) | worker limit (15) | workers joined (16) */
#define ST_GEN(s) ((uint32_t)((s) >> 32))
#define ST_CLOSED (1ull << 31)
#define ST_LIMIT(s) ((uint32_t)(((s) >> 16) & 0x7fff))
#define ST_JOINED(s) ((uint32_t)((s) & 0xffff))

static struct {
    pthread_mutex_t run;     /* one parallel region at a time, whichever thread or kernel starts it */
    pthread_mutex_t sleep;
    pthread_cond_t wake;
    _Atomic uint64_t state;
    _Atomic uint32_t left;   /* joined workers that finished the current job */
    _Atomic int sleepers;
    _Atomic int64_t spin_ns;
    _Atomic int linger;      /* whether workers spin after the current call */
    _Atomic int threads;     /* participants per call, caller included */
    int workers;             /* worker threads started */
    pool_fn fn;              /* the current job, published by the state store that starts it */
    void *arg;
} pool = {
    .run = PTHREAD_MUTEX_INITIALIZER,
    .sleep = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .state = ST_CLOSED,
    .spin_ns = 20000000, /* 20 ms: see set_spin_us in cpu_experts.py */
    .linger = 1,
    .threads = 1,
};

/* Wait for a generation other than `seen`: spin for spin_ns (if asked to), then sleep on the condition. */
static uint64_t wait_new_job(uint32_t seen, int may_spin) {
    uint64_t s = atomic_load(&pool.state);
    if (ST_GEN(s) != seen) return s;
    const int64_t spin = may_spin && atomic_load(&pool.linger) ? atomic_load(&pool.spin_ns) : 0;
    if (spin > 0) {
        const int64_t until = now_ns() + spin;
        for (unsigned i = 1;; i++) {
            _mm_pause();
            s = atomic_load_explicit(&pool.state, memory_order_acquire);
            if (ST_GEN(s) != seen) return s;
            if ((i & 63) == 0 && now_ns() > until) break;
        }
    }
    pthread_mutex_lock(&pool.sleep);
    atomic_fetch_add(&pool.sleepers, 1);
    while (ST_GEN(s = atomic_load(&pool.state)) == seen) pthread_cond_wait(&pool.wake, &pool.sleep);
    atomic_fetch_sub(&pool.sleepers, 1);
    pthread_mutex_unlock(&pool.sleep);
    return s;
}

/* Worker `index` joins calls that use more than `index` workers; the others (after a smaller
 * thread count was set) do not spin, so they leave those cores alone. */
static void *worker_main(void *arg) {
    const uint32_t index = (uint32_t)(uintptr_t)arg;
    uint32_t seen = 0, limit = 0;
    for (;;) {
        uint64_t s = wait_new_job(seen, index < limit);
        limit = ST_LIMIT(s);
        int joined = 0;
        for (;;) {
            if ((s & ST_CLOSED) || index >= ST_LIMIT(s) || ST_JOINED(s) >= ST_LIMIT(s)) break;
            if (atomic_compare_exchange_weak(&pool.state, &s, s + 1)) {
                joined = 1;
                break;
            }
        }
        seen = ST_GEN(s);
        if (!joined) continue;
        pool.fn(pool.arg, (int)index + 1);
        atomic_fetch_add_explicit(&pool.left, 1, memory_order_release);
    }
    return NULL;
}

static int grow_pool(int workers) {
    if (workers > POOL_MAX_WORKERS) workers = POOL_MAX_WORKERS;
    if (pool.workers >= workers) return 0;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the interpreter's threads */
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = 0;
    while (pool.workers < workers) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, (void *)(uintptr_t)pool.workers) != 0) {
            rc = -1;
            break;
        }
        pthread_setname_np(t, "moedesk-experts");
        pool.workers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

/* The child of a fork has none of the workers: start from an empty pool. */
static void pool_after_fork_child(void) {
    pthread_mutex_init(&pool.run, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.state, ST_CLOSED);
    atomic_store(&pool.left, 0);
    atomic_store(&pool.sleepers, 0);
    pool.workers = 0;
}

__attribute__((constructor)) static void pool_install_fork_handler(void) {
    pthread_atfork(NULL, NULL, pool_after_fork_child);
}

/* fn(arg, tid) on `participants` threads, the caller as tid 0 (participants <= 0: the pool's thread
 * setting); returns when all who joined are done. linger: whether workers spin for the next call. */
static void pool_run(pool_fn fn, void *arg, int participants, int linger) {
    if (participants <= 0) participants = atomic_load(&pool.threads);
    pthread_mutex_lock(&pool.run);
    const int limit = participants - 1;
    if (limit > 0 && grow_pool(limit) != 0 && pool.workers == 0) participants = 1;
    const int workers = participants - 1 < pool.workers ? participants - 1 : pool.workers;
    if (workers == 0) {
        fn(arg, 0);
        pthread_mutex_unlock(&pool.run);
        return;
    }
    pool.fn = fn;
    pool.arg = arg;
    atomic_store(&pool.linger, linger);
    atomic_store_explicit(&pool.left, 0, memory_order_relaxed);
    const uint64_t prev = atomic_load(&pool.state);
    atomic_store(&pool.state, ((uint64_t)(ST_GEN(prev) + 1) << 32) | ((uint64_t)workers << 16));
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep);
    }
    fn(arg, 0);
    /* No one joins from now on; wait only for those who did. */
    const uint64_t closed = atomic_fetch_or(&pool.state, ST_CLOSED);
    const uint32_t joined = ST_JOINED(closed);
    unsigned spins = 0;
    while (atomic_load_explicit(&pool.left, memory_order_acquire) < joined) relax(&spins);
    pthread_mutex_unlock(&pool.run);
}

static void pool_set_threads(int n) {
    atomic_store(&pool.threads, n < 1 ? 1 : n > POOL_MAX_WORKERS + 1 ? POOL_MAX_WORKERS + 1 : n);
}
static int pool_get_threads(void) { return atomic_load(&pool.threads); }
static void pool_set_spin_us(int64_t us) { atomic_store(&pool.spin_ns, us < 0 ? 0 : us * 1000); }

#endif
