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

// body(ctx, id, n) on n threads, the caller being id 0; returns when every id has returned. Runs inline
// (id 0 of 1) when n <= 1, or when called from inside a team call.
void team_run_raw(int n, void (*body)(void*, int, int), void* ctx);

template <class F>
void team_run(int n, F&& body) {
    team_run_raw(n, [](void* ctx, int id, int nt) { (*static_cast<F*>(ctx))(id, nt); }, &body);
}

// f(i) for i in [0, count), contiguous ranges split evenly over the n threads
template <class F>
void parallel_for_static(int n, int64_t count, F&& f) {
    team_run(n, [&](int id, int nt) {
        const int64_t per = (count + nt - 1) / nt, lo = id * per, hi = lo + per < count ? lo + per : count;
        for (int64_t i = lo; i < hi; ++i) f(i);
    });
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
    std::unique_ptr<Share[]> shares(new Share[n]);
    const int64_t units = (count + align - 1) / align;
    for (int t = 0; t < n; ++t) {
        shares[t].next.store(std::min(count, units * t / n * align), std::memory_order_relaxed);
        shares[t].end = std::min(count, units * (t + 1) / n * align);
    }
    team_run(n, [&](int id, int nt) {
        for (int k = 0; k < n; ++k) {  // (run inline, nt is 1: id 0 takes every share in turn)
            Share& s = shares[(id + k) % n];
            for (int64_t lo = s.next.fetch_add(chunk, std::memory_order_relaxed); lo < s.end;
                 lo = s.next.fetch_add(chunk, std::memory_order_relaxed))
                f(lo, std::min(lo + chunk, s.end), s.end);
        }
        (void)nt;
    });
}

}  // namespace kvs
