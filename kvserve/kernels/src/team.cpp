// The thread team of team.h: workers made on first use and kept. A call publishes its body and bumps a
// generation counter; a worker that sees it joins the call (unless the caller has already closed it),
// runs its id's part and leaves. The caller runs its own part, which takes every piece of work no
// thread has taken yet, closes the call and waits only for the workers inside it: a worker the host has
// not scheduled yet (an oversubscribed host, a wake-up on its way) costs the call nothing.
// Whoever waits (an idle worker for the next call, the caller for the workers inside) spins with `pause`
// for a bounded time, then sleeps on a condition variable; it never yields in a loop: on an oversubscribed
// host each sched_yield hands a whole time slice to another process. One caller at a time: a second
// thread's call waits for the first to end.
#include "team.h"

#include <pthread.h>

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

struct Team {
    static constexpr uint64_t CLOSED = 1u << 15, INSIDE = CLOSED - 1;  // `state`'s low bits

    const std::chrono::microseconds spin = spin_from_env();
    std::mutex caller;  // one call at a time
    std::vector<std::thread> workers;
    std::atomic<uint64_t> generation{0};  // the current call's number
    std::atomic<uint64_t> state{0};       // the current call's number << 16 | CLOSED | workers inside it
    std::atomic<int> sleepers{0};         // workers asleep (or about to be) on `wake`
    std::atomic<bool> caller_asleep{false};  // the caller sleeps (or is about to) on `done`
    // the current call; written before `state` and `generation` are, read by a worker once it has joined
    void (*body)(void*, int, int) = nullptr;
    void* ctx = nullptr;
    int n = 0;
    std::mutex sleep_lock;
    std::condition_variable wake, done;

    // joins call `gen` unless it is closed or past: whether this worker is now inside it
    bool join(uint64_t gen) {
        uint64_t s = state.load(std::memory_order_acquire);
        while ((s >> 16) == gen && !(s & CLOSED))
            if (state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return true;
        return false;
    }

    void worker_loop(int id) {
        uint64_t seen = 0;
        for (;;) {
            auto published = [&] { return generation.load(std::memory_order_acquire) != seen; };
            if (!spin_until(spin, published)) {
                std::unique_lock<std::mutex> lock(sleep_lock);
                sleepers.fetch_add(1);  // seq_cst: pairs with the caller's bump of `generation`
                wake.wait(lock, published);
                sleepers.fetch_sub(1);
            }
            seen = generation.load(std::memory_order_acquire);
            if (!join(seen)) continue;
            if (id < n) body(ctx, id, n);
            const uint64_t left = state.fetch_sub(1) - 1;  // seq_cst: pairs with the caller's `caller_asleep`
            if ((left & CLOSED) && (left & INSIDE) == 0 && caller_asleep.load()) {
                std::lock_guard<std::mutex> lock(sleep_lock);
                done.notify_one();
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
        const uint64_t gen = generation.load(std::memory_order_relaxed) + 1;
        state.store(gen << 16, std::memory_order_release);
        generation.store(gen);  // seq_cst: pairs with a sleeper's `sleepers`
        if (sleepers.load() > 0) {
            std::lock_guard<std::mutex> lock(sleep_lock);
            wake.notify_all();
        }
        fn(arg, 0, threads);
        state.fetch_or(CLOSED);  // no worker joins from here on
        auto all_out = [&] { return (state.load() & INSIDE) == 0; };
        if (!spin_until(spin, all_out)) {
            std::unique_lock<std::mutex> lock(sleep_lock);
            caller_asleep.store(true);  // seq_cst, then `state` read under the lock: pairs with the last worker out
            done.wait(lock, all_out);
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
