// The native kernels' one way of spreading a call's independent work units over XLA's intra-op
// thread pool.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jserve {

// Calls unit(i) once for every i in [0, n) and returns when all n are done. Units are taken from
// an atomic counter by the calling thread and by up to pool.num_threads() - 1 pool tasks. The
// caller takes units too, so the call finishes even if no pool thread is free; a task that only
// starts after the last unit was taken finds nothing left (the counter lives in shared state,
// not on the caller's stack) and never calls `unit`.
inline void run_units(xla::ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> unit) {
  struct State {
    std::function<void(int64_t)> unit;
    int64_t n = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  state->unit = std::move(unit);
  state->n = n;
  auto drain = [](State& s) {
    for (int64_t i = s.next.fetch_add(1); i < s.n; i = s.next.fetch_add(1)) {
      s.unit(i);
      s.done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([state, drain] { drain(*state); });
  }
  drain(*state);
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jserve
