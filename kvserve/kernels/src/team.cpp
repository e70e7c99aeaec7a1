// The thread team of team.h: workers made on first use and kept; a call publishes its body and bumps a
// generation counter; every worker runs its id's share (or nothing, past the call's n) and checks in.
// Whoever waits (an idle worker for the next call, the caller for the workers to check in) spins with
// `pause` for a bounded time, then sleeps on a condition variable; it never yields in a loop: on a host
// with more runnable threads than cores, each sched_yield hands a whole time slice to another process,
// while a sleeper that is woken runs at once. A worker that the kernel preempts often (the host is
// oversubscribed) stops spinning for a while: its spinning would take the core from the thread it waits
// for. One caller at a time: a second thread's call waits for the first to end.
#include "team.h"

#include <pthread.h>
#include <sys/resource.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace kvs {
namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

// How long a waiter spins before it sleeps: long enough to span the gaps between the calls of one
// decode step (a few to ~100 us: ~150 calls of tens of microseconds; a futex wake costs 15-40 us on
// these VMs), short enough that a worker waiting for the next step gives its core back to the
// server's other threads. KVSERVE_TEAM_SPIN_US changes it (0: sleep at once, as OpenMP's passive policy).
std::chrono::microseconds spin_from_env() {
    const char* s = std::getenv("KVSERVE_TEAM_SPIN_US");
    const long us = s ? std::strtol(s, nullptr, 10) : -1;
    return std::chrono::microseconds(us >= 0 ? us : 300);
}

// spins until done() holds or `spin` has passed; whether it holds
template <class Done>
bool spin_until(std::chrono::microseconds spin, Done&& done) {
    if (done()) return true;
    if (spin.count() == 0) return false;
    const Clock::time_point end = Clock::now() + spin;
    for (int i = 1;; ++i) {
        if (done()) return true;
        cpu_relax();
        if ((i & 63) == 0 && Clock::now() >= end) return done();
    }
}

// Involuntary context switches of the calling thread: the kernel took its core for another thread
long preemptions() {
    rusage usage{};
    return getrusage(RUSAGE_THREAD, &usage) == 0 ? usage.ru_nivcsw : 0;
}

// A worker counts its preemptions every PROBE_CALLS calls; more than PREEMPTED_PER_PROBE there (the host
// has more runnable threads than cores: other processes, the server's own threads) and every waiter
// sleeps at once, as OpenMP's passive threads do, for the next PASSIVE_CALLS calls (a second or more of
// decode steps), then spins again. Speed only: which thread computes an output never changes it.
constexpr uint64_t PROBE_CALLS = 64, PASSIVE_CALLS = 16384;
constexpr long PREEMPTED_PER_PROBE = 2;

struct Team {
    const std::chrono::microseconds spin = spin_from_env();
    std::mutex caller;  // one call at a time
    std::vector<std::thread> workers;
    std::atomic<uint64_t> generation{0};
    std::atomic<int> pending{0};         // workers yet to check in for the current call
    std::atomic<int> sleepers{0};        // workers asleep (or about to be) on `wake`
    std::atomic<bool> caller_asleep{false};  // the caller sleeps (or is about to) on `done`
    std::atomic<uint64_t> passive_until{0};  // generation before which waiters do not spin
    // the current call; written before `generation` is bumped, read after it is seen
    void (*body)(void*, int, int) = nullptr;
    void* ctx = nullptr;
    int n = 0;
    std::mutex sleep_lock;
    std::condition_variable wake, done;

    std::chrono::microseconds spin_now(uint64_t gen) const {
        return gen < passive_until.load(std::memory_order_relaxed) ? std::chrono::microseconds(0) : spin;
    }

    void worker_loop(int id) {
        uint64_t seen = 0, calls = 0;
        long preempted = preemptions();
        for (;;) {
            auto published = [&] { return generation.load(std::memory_order_acquire) != seen; };
            if (!spin_until(spin_now(seen), published)) {
                std::unique_lock<std::mutex> lock(sleep_lock);
                sleepers.fetch_add(1);
                wake.wait(lock, published);
                sleepers.fetch_sub(1);
            }
            seen = generation.load(std::memory_order_acquire);
            if (id < n) body(ctx, id, n);
            if (pending.fetch_sub(1) == 1 && caller_asleep.load()) {
                std::lock_guard<std::mutex> lock(sleep_lock);
                done.notify_one();
            }
            if (++calls % PROBE_CALLS == 0) {
                const long now = preemptions();
                if (now - preempted > PREEMPTED_PER_PROBE) passive_until.store(seen + PASSIVE_CALLS, std::memory_order_relaxed);
                preempted = now;
            }
        }
    }

    void run(int threads, void (*fn)(void*, int, int), void* arg) {
        std::lock_guard<std::mutex> one_call(caller);
        while (static_cast<int>(workers.size()) < threads - 1) {
            const int id = static_cast<int>(workers.size()) + 1;
            workers.emplace_back([this, id] { worker_loop(id); });
            workers.back().detach();  // kept for the process's life (the team is never destroyed)
        }
        body = fn;
        ctx = arg;
        n = threads;
        // every worker checks in, also those past n: none may still be reading this call's fields
        // when the next call writes them
        pending.store(static_cast<int>(workers.size()), std::memory_order_relaxed);
        const uint64_t gen = generation.fetch_add(1) + 1;  // seq_cst: pairs with a sleeper's `sleepers`
        if (sleepers.load() > 0) {
            std::lock_guard<std::mutex> lock(sleep_lock);
            wake.notify_all();
        }
        fn(arg, 0, threads);
        auto all_in = [&] { return pending.load() == 0; };
        if (!spin_until(spin_now(gen), all_in)) {
            std::unique_lock<std::mutex> lock(sleep_lock);
            caller_asleep.store(true);  // seq_cst, then `pending` read under the lock: pairs with the last worker
            done.wait(lock, all_in);
            caller_asleep.store(false);
        }
    }
};

Team* g_team = nullptr;
std::once_flag g_fork_handler;
thread_local bool t_in_call = false;  // this thread is running a team call's body

Team& team() {
    std::call_once(g_fork_handler, [] {
        // a forked child has none of the parent's workers: it makes its own team on first use
        pthread_atfork(nullptr, nullptr, [] { g_team = nullptr; });
    });
    static std::mutex make;
    std::lock_guard<std::mutex> lock(make);
    if (g_team == nullptr) g_team = new Team();  // never deleted: detached workers wait on it until exit
    return *g_team;
}

struct Body {
    void (*fn)(void*, int, int);
    void* ctx;
};

void run_marked(void* arg, int id, int n) {
    const Body& b = *static_cast<const Body*>(arg);
    const bool outer = t_in_call;
    t_in_call = true;
    b.fn(b.ctx, id, n);
    t_in_call = outer;
}

}  // namespace

void team_run_raw(int n, void (*body)(void*, int, int), void* ctx) {
    if (n <= 1 || t_in_call) {
        body(ctx, 0, 1);
        return;
    }
    Body b{body, ctx};
    team().run(n, run_marked, &b);
}

}  // namespace kvs
