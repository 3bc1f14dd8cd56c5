// Work shared between the compute threads of one at::parallel_for region: each thread takes its own contiguous
// share of the items from the front, in order (for the products, one stream of weights), then helps the
// others from the back of theirs, so a thread the host slowed, or one whose items cost more, no longer holds
// the rest at the region's end. Which thread handles an item never changes what it computes.
//
//   ChunkShares shares(count, teams);                       // teams = min(at::get_num_threads(), count)
//   at::parallel_for(0, teams, 1, [&](int64_t t0, int64_t t1) {
//     for (int64_t t = t0; t < t1; ++t)                     // one index a thread, or all on one thread
//       for (int64_t i = shares.next(t); i >= 0; i = shares.next(t)) work(i);
//   });
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace radixserve_cpu_shares {

class ChunkShares {
 public:
  ChunkShares(int64_t count, int64_t threads) : shares_(threads) {
    for (int64_t t = 0; t < threads; ++t) shares_[t].range.store(pack(count * t / threads, count * (t + 1) / threads));
  }

  // The next item for thread t, or -1 when none is left anywhere.
  int64_t next(int64_t t) {
    const int64_t threads = static_cast<int64_t>(shares_.size());
    for (int64_t i = 0; i < threads; ++i) {
      std::atomic<uint64_t>& range = shares_[(t + i) % threads].range;
      uint64_t v = range.load(std::memory_order_relaxed);
      for (;;) {
        const int64_t lo = static_cast<int64_t>(v >> 32), hi = static_cast<int64_t>(v & 0xffffffffu);
        if (lo >= hi) break;
        const bool own = i == 0;
        if (range.compare_exchange_weak(v, own ? pack(lo + 1, hi) : pack(lo, hi - 1), std::memory_order_relaxed)) {
          return own ? lo : hi - 1;
        }
      }
    }
    return -1;
  }

 private:
  static uint64_t pack(int64_t lo, int64_t hi) { return (static_cast<uint64_t>(lo) << 32) | static_cast<uint64_t>(hi); }
  struct alignas(64) Share {  // a line each: the owners' claims do not bounce one line between the cores
    std::atomic<uint64_t> range{0};
  };
  std::vector<Share> shares_;
};

}  // namespace radixserve_cpu_shares
