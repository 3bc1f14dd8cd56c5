// Helper threads for the CPU's products that never make the caller wait for them.
//
// When other processes want a rank's cores, its OpenMP team shrinks to one thread (services/worker/
// cpu_threads.py): a team's every region ends at a barrier that waits for each of its threads, and a thread
// the kernel has preempted holds the whole step for its time slice. The products, most of such a step, still
// use the rank's other cores through these helpers: a product is cut into chunks (rows of a single-row
// product, matvec.cpp; panels of a few rows' product, panels.cpp), the caller and each helper claim chunks in
// turn, and when none is left to claim the caller (or a helper) takes over any chunk another thread claimed
// and has not finished, so a helper that was preempted mid-chunk delays nobody; the caller returns once
// every chunk is in the output, whether or not its helpers ever ran. Beside two busy loops on 2 vCPUs a pass
// over SmolLM2's weights took 56-60 ms this way against 52-92 (one thread) and 60-71 with a p90 of 175-480
// (two threads, a barrier each product) (bench/HISTORY.md, thirty-eighth session).
//
// A chunk is computed into the claimer's own buffer and committed (copied into the output) only by the
// thread that wins the chunk's state from "claimed by me" to "committing"; taking a chunk over is claiming it
// again ("claimed by another" or "free" -> "claimed by me"), so a helper preempted after it took over one of
// the caller's chunks is itself taken over, and the caller waits for no helper, only for a commit's copy in
// flight. Each job has a generation, part of every chunk state and of the claim counter, so a helper that
// wakes after its job has ended (and another has begun) claims and writes nothing. A chunk's values come from
// the same arithmetic whichever thread computes it, so the output's bits are the one thread's.
//
// What a job reads (its weight, its input rows) must outlive any helper still computing one of its chunks,
// which may be long after the caller has returned. So the caller keeps each job's inputs in one of kSlots
// slots of its own, the slot gen % kSlots, and a job runs only while no helper is still inside the job that
// used its slot before (each helper says which job it is in); else the caller computes it alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

namespace radixserve_cpu_helpers {

// A job's chunks: `compute` writes chunk c into a thread's buffer of `buffer_floats` floats, `commit` copies
// that buffer into the job's output. Both read the job only through the pointer the caller's slot holds.
struct Work {
  int64_t chunks = 0;
  int64_t buffer_floats = 0;
  void (*compute)(const void* job, int64_t c, float* buf) = nullptr;
  void (*commit)(const void* job, int64_t c, const float* buf) = nullptr;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

class RowHelpers {
 public:
  static constexpr int64_t kMaxChunks = 1 << 16;  // chunk states kept; a job of more chunks runs alone
  static constexpr int kSpins = 4000;             // pauses before a waiting helper sleeps (~0.1-0.3 ms)
  static constexpr uint64_t kSlots = 4;          // jobs whose inputs the caller keeps

  static RowHelpers& get() {
    static RowHelpers* helpers = new RowHelpers();  // never destroyed: its threads may outlive static teardown
    return *helpers;
  }

  int count() const { return count_.load(std::memory_order_relaxed); }

  // Starts `count` helpers (ending the ones before, then calling `idle()`: no helper reads any job's inputs
  // then); returns their kernel thread ids. `delay_us` makes each helper sleep that long after claiming
  // every chunk, as a preempted one would (tests).
  template <typename Idle>
  std::vector<int64_t> resize(int count, int64_t delay_us, Idle idle) {
    std::lock_guard<std::mutex> runs(run_mutex_);
    stop();
    idle();
    delay_us_.store(delay_us);
    quit_.store(false);
    std::vector<int64_t> tids(count, 0);
    std::atomic<int> started{0};
    inside_.reset(new std::atomic<uint64_t>[std::max(count, 1)]);
    for (int i = 0; i < count; ++i) inside_[i].store(0);
    for (int i = 0; i < count; ++i) {
      threads_.emplace_back([this, i, &tids, &started] {
        tids[i] = static_cast<int64_t>(syscall(SYS_gettid));
        started.fetch_add(1);
        loop(i + 1);
      });
    }
    while (started.load() < count) std::this_thread::yield();
    count_.store(count);
    return tids;
  }

  // Runs `work` on the caller and the helpers. `fill(slot)` stores the job's inputs in the caller's slot
  // `slot` and returns the job that work's functions read. False, with nothing done, while another thread's
  // product has the helpers, a helper is still inside that slot's last job, or the job has too many chunks.
  template <typename Fill>
  bool run(Fill fill, const Work& work) {
    if (work.chunks > kMaxChunks) return false;
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (!busy.owns_lock() || count() == 0) return false;
    const uint64_t gen = gen_.load() + 1;
    for (int i = 0; i < count(); ++i) {
      const uint64_t in = inside_[i].load();
      if (in != 0 && in % kSlots == gen % kSlots) return false;
    }
    const void* job = fill(static_cast<int>(gen % kSlots));
    for (int64_t c = 0; c < work.chunks; ++c) states_[c].store(tag(gen, kFree), std::memory_order_relaxed);
    job_.store(job, std::memory_order_relaxed);
    chunks_.store(work.chunks, std::memory_order_relaxed);
    buffer_floats_.store(work.buffer_floats, std::memory_order_relaxed);
    compute_.store(work.compute, std::memory_order_relaxed);
    commit_.store(work.commit, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    next_.store(claim_base(gen), std::memory_order_relaxed);
    gen_.store(gen);  // sequentially consistent, as a sleeper's count and check: one of the two sees the other
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    run_chunks(0, gen, job, work);
    return true;
  }

  // Chunks committed by helpers, and chunks taken over from a thread that had claimed them, since the start.
  std::pair<int64_t, int64_t> stats() const { return {helped_.load(), taken_.load()}; }

  // CPU nanoseconds the helpers have spent inside jobs (claiming, computing and committing chunks) since the
  // start: their work, without the spinning between jobs that their CPU time also holds (services/worker/
  // cpu_threads.py's probe).
  int64_t busy_ns() const { return busy_ns_.load(std::memory_order_relaxed); }

 private:
  enum State : uint64_t { kFree = 0, kDone = 1, kCommitting = 2, kClaimed = 4 };  // kClaimed + thread (0: caller)

  RowHelpers() : states_(new std::atomic<uint64_t>[kMaxChunks]) {}

  static uint64_t tag(uint64_t gen, uint64_t state) { return gen << 8 | state; }
  static uint64_t claim_base(uint64_t gen) { return (gen & 0xffffffffu) << 32; }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_.store(true);
      gen_.fetch_add(1);
      wake_.notify_all();
    }
    for (std::thread& t : threads_) t.join();
    threads_.clear();
    count_.store(0);
  }

  // Computes chunk c (claimed as `mine`) into buf and, unless another thread took it over meanwhile, commits it.
  void compute_and_commit(int me, uint64_t gen, const void* job, const Work& w, int64_t c, uint64_t mine,
                          float* buf) {
    w.compute(job, c, buf);
    uint64_t expect = mine;
    if (!states_[c].compare_exchange_strong(expect, tag(gen, kCommitting))) return;
    w.commit(job, c, buf);
    states_[c].store(tag(gen, kDone), std::memory_order_release);
    done_.fetch_add(1, std::memory_order_acq_rel);
    if (me > 0) helped_.fetch_add(1, std::memory_order_relaxed);
  }

  // This thread's CPU time in nanoseconds (not wall time: a helper preempted inside a job is not working).
  static int64_t thread_cpu_ns() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
  }

  // Claims chunks of job `gen` until none is left, then takes over those another thread claimed and has not
  // finished: a helper once, the caller until every chunk is committed.
  void run_chunks(int me, uint64_t gen, const void* job, const Work& w) {
    std::vector<float> buf(static_cast<size_t>(w.buffer_floats));
    const uint64_t mine = tag(gen, kClaimed + me);
    const int64_t delay = me > 0 ? delay_us_.load(std::memory_order_relaxed) : 0;
    for (;;) {
      const uint64_t v = next_.fetch_add(1, std::memory_order_acq_rel);
      if ((v >> 32) != (gen & 0xffffffffu)) return;  // a later job's counter: this one has ended
      const int64_t c = static_cast<int64_t>(v & 0xffffffffu);
      if (c >= w.chunks) break;
      uint64_t expect = tag(gen, kFree);
      if (!states_[c].compare_exchange_strong(expect, mine)) continue;  // taken over before it was marked
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      compute_and_commit(me, gen, job, w, c, mine, buf.data());
    }
    do {
      for (int64_t c = 0; c < w.chunks; ++c) {
        uint64_t s = states_[c].load(std::memory_order_acquire);
        if ((s >> 8) != gen) return;
        const uint64_t state = s & 0xff;
        if (state != kFree && (state < kClaimed || s == mine)) continue;  // committed, committing, or this thread's
        if (!states_[c].compare_exchange_strong(s, mine)) continue;
        taken_.fetch_add(1, std::memory_order_relaxed);
        compute_and_commit(me, gen, job, w, c, mine, buf.data());
      }
    } while (me == 0 && done_.load(std::memory_order_acquire) < w.chunks);
  }

  // Helper `me` (1-based) in job `gen` while the job is current, with `inside_` saying so for as long as it
  // may read the job's inputs.
  void enter(int me, uint64_t gen) {
    std::atomic<uint64_t>& inside = inside_[me - 1];
    inside.store(gen);
    if (gen_.load() == gen) {  // still current: the caller sees `inside` before it refills this job's slot
      Work w;
      w.chunks = chunks_.load(std::memory_order_relaxed);
      w.buffer_floats = buffer_floats_.load(std::memory_order_relaxed);
      w.compute = compute_.load(std::memory_order_relaxed);
      w.commit = commit_.load(std::memory_order_relaxed);
      const int64_t start = thread_cpu_ns();  // two clock reads a job, not a chunk
      run_chunks(me, gen, job_.load(std::memory_order_relaxed), w);
      busy_ns_.fetch_add(thread_cpu_ns() - start, std::memory_order_relaxed);
    }
    inside.store(0);
  }

  void loop(int me) {
    uint64_t seen = gen_.load();
    for (;;) {
      uint64_t gen = gen_.load(std::memory_order_acquire);
      for (int spins = 0; gen == seen && spins < kSpins; ++spins) {
        cpu_relax();
        gen = gen_.load(std::memory_order_acquire);
      }
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1);
        wake_.wait(lock, [&] { return quit_.load() || gen_.load() != seen; });
        sleepers_.fetch_sub(1);
        gen = gen_.load();
      }
      if (quit_.load()) return;
      seen = gen;
      enter(me, gen);
    }
  }

  std::unique_ptr<std::atomic<uint64_t>[]> states_, inside_;
  std::atomic<uint64_t> gen_{0}, next_{0};
  std::atomic<int64_t> done_{0}, chunks_{0}, buffer_floats_{0}, delay_us_{0}, helped_{0}, taken_{0}, busy_ns_{0};
  std::atomic<const void*> job_{nullptr};
  std::atomic<void (*)(const void*, int64_t, float*)> compute_{nullptr};
  std::atomic<void (*)(const void*, int64_t, const float*)> commit_{nullptr};
  std::atomic<bool> quit_{false};
  std::atomic<int> sleepers_{0}, count_{0};
  std::mutex mutex_, run_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
};

}  // namespace radixserve_cpu_helpers
