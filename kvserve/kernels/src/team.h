// kvserve's own thread team: every parallel loop of the kernels runs on it (not on OpenMP's). A decode
// step makes ~150 parallel calls of a few tens of microseconds each; OpenMP's workers fall asleep
// between them (GOMP_SPINCOUNT) and a wake costs 15-40 us, with ms tails on a shared host. The team's
// workers spin for a bounded time after each call before they sleep (team.cpp), so the calls of one
// step find them awake and a step pays at most one wake. Which thread computes an output never
// changes its bits: each output keeps its one reduction order whoever computes it.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace kvs {

// body(ctx, id, n) on the caller (id 0) and on those of workers 1 .. n - 1 that join before the caller's
// own body(ctx, 0, n) returns; returns when every one that joined has. So a body must hand out all of
// its work through shared counters (below): what the caller's body finds left, it does. Runs inline (id 0
// of 1) when n <= 1, or when called from inside a team call.
void team_run_raw(int n, void (*body)(void*, int, int), void* ctx);

template <class F>
void team_run(int n, F&& body) {
    team_run_raw(n, [](void* ctx, int id, int nt) { (*static_cast<F*>(ctx))(id, nt); }, &body);
}

// A shared counter handing out indices [0, count) one at a time: a thread the host descheduled leaves
// its share to the others.
struct DynamicCounter {
    std::atomic<int64_t> next{0};
    int64_t count;
    explicit DynamicCounter(int64_t n) : count(n) {}
    template <class F>
    void each(F&& f) {
        for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
             i = next.fetch_add(1, std::memory_order_relaxed))
            f(i);
    }
};

// [0, count) cut in n contiguous shares (edges multiples of `align`), each handed out `chunk` at a time:
// thread t takes its own share's chunks front to back, then helps the others from their fronts, so a
// thread the host descheduled leaves the rest of its share to the others. f(lo, hi, share_end): the
// indices [lo, hi) and the end of the share they came from (a bound for prefetching ahead).
template <class F>
void parallel_for_shares(int n, int64_t count, int64_t align, int64_t chunk, F&& f) {
    struct alignas(64) Share {
        std::atomic<int64_t> next;
        int64_t end;
    };
    n = std::max(1, n);
    std::unique_ptr<Share[]> shares(new Share[n]);  // (one allocation a call: ~50 ns of ~10 us at least)
    const int64_t units = (count + align - 1) / align;
    for (int t = 0; t < n; ++t) {
        shares[t].next.store(std::min(count, units * t / n * align), std::memory_order_relaxed);
        shares[t].end = std::min(count, units * (t + 1) / n * align);
    }
    team_run(n, [&](int id, int) {
        for (int k = 0; k < n; ++k) {  // (alone, inline or not, id 0 takes every share in turn)
            Share& s = shares[(id + k) % n];
            for (int64_t lo = s.next.fetch_add(chunk, std::memory_order_relaxed); lo < s.end;
                 lo = s.next.fetch_add(chunk, std::memory_order_relaxed))
                f(lo, std::min(lo + chunk, s.end), s.end);
        }
    });
}

// f(i) for i in [0, count): each thread its own contiguous share first (a quarter at a time), then what
// is left of the others'
template <class F>
void parallel_for(int n, int64_t count, F&& f) {
    const int64_t chunk = std::max<int64_t>(1, (count + 4 * n - 1) / (4 * std::max(1, n)));
    parallel_for_shares(n, count, 1, chunk, [&](int64_t lo, int64_t hi, int64_t) {
        for (int64_t i = lo; i < hi; ++i) f(i);
    });
}

}  // namespace kvs
