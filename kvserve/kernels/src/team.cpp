// The thread team of team.h: workers made on first use and kept; a call publishes its body and bumps a
// generation counter; every worker runs its id's share (or nothing, past the call's n) and checks in.
// Between calls a worker spins with `pause`, then yields its core, then sleeps on a condition variable;
// the bounds are below. One caller at a time: a second thread's call waits for the first to end.
#include "team.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
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

// How long an idle worker stays awake after a call before it sleeps: long enough to span the gaps
// between the calls of one step (a few to ~100 us), short enough that a worker waiting for the next
// step gives its core back to the server's other threads. The first part spins, the rest yields.
// KVSERVE_TEAM_SPIN_US changes the total (0: sleep at once, as OpenMP's passive policy).
struct SpinPolicy {
    std::chrono::microseconds spin{50}, awake{300};
    static SpinPolicy from_env() {
        SpinPolicy p;
        if (const char* s = std::getenv("KVSERVE_TEAM_SPIN_US")) {
            const long us = std::strtol(s, nullptr, 10);
            if (us >= 0) {
                p.awake = std::chrono::microseconds(us);
                p.spin = std::min(p.spin, p.awake);
            }
        }
        return p;
    }
};

// waits until done() holds: spins, then yields, up to the policy's bounds; false if it still does not
template <class Done>
bool wait_awake(const SpinPolicy& policy, Done&& done) {
    const Clock::time_point start = Clock::now();
    for (int i = 0;; ++i) {
        if (done()) return true;
        if ((i & 63) != 63) {
            cpu_relax();
            continue;
        }
        const auto waited = Clock::now() - start;
        if (waited >= policy.awake) return done();
        if (waited >= policy.spin) sched_yield();
    }
}

struct Team {
    SpinPolicy policy = SpinPolicy::from_env();
    std::mutex caller;  // one call at a time
    std::vector<std::thread> workers;
    std::atomic<uint64_t> generation{0};
    std::atomic<int> pending{0};   // workers yet to check in for the current call
    std::atomic<int> sleepers{0};  // workers asleep (or about to be) on `wake`
    // the current call; written before `generation` is bumped, read after it is seen
    void (*body)(void*, int, int) = nullptr;
    void* ctx = nullptr;
    int n = 0;
    std::mutex sleep_lock;
    std::condition_variable wake;

    void worker_loop(int id) {
        uint64_t seen = 0;
        for (;;) {
            auto published = [&] { return generation.load(std::memory_order_acquire) != seen; };
            if (!wait_awake(policy, published)) {
                std::unique_lock<std::mutex> lock(sleep_lock);
                sleepers.fetch_add(1);
                wake.wait(lock, published);
                sleepers.fetch_sub(1);
            }
            seen = generation.load(std::memory_order_acquire);
            if (id < n) body(ctx, id, n);
            pending.fetch_sub(1, std::memory_order_acq_rel);
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
        generation.fetch_add(1);  // seq_cst: pairs with a sleeper's increment of `sleepers`
        if (sleepers.load() > 0) {
            std::lock_guard<std::mutex> lock(sleep_lock);
            wake.notify_all();
        }
        fn(arg, 0, threads);
        auto all_in = [&] { return pending.load(std::memory_order_acquire) == 0; };
        while (!wait_awake(policy, all_in)) sched_yield();
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
