// The kernels' thread pool (see pool.h for what and why).
//
// One region at a time: the caller publishes the job (function, range, chunk size), then
// stores a claim word, epoch << 32 | next << 16 | n, and bumps the epoch word workers watch.
// Everyone (the caller included) claims chunks with one fetch_add on the claim word until
// next >= n; a fetch_add that lands on a later region's word is a valid claim in that region,
// and the epoch in the word tells which. The caller then waits only for chunks still running
// (done == n), never for a worker that has not claimed one. A worker reads the job only after
// a successful claim, and the caller cannot publish the next job before that chunk is done, so
// the job it reads is the one its chunk belongs to.
//
// Idle workers poll the epoch for spin_us, then sleep on it (futex); the caller wakes them
// only when one sleeps. The caller polls for running chunks for wait_us, then sleeps until the
// worker that finishes the last one wakes it.
#include "pool.h"

// No torch headers beyond TORCH_CHECK's: parsing torch/extension.h was most of this file's
// compile time (50 -> 15 s of CPU on the 2-core Zen 3).
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace specserve::pool {
namespace {

// next and n share 16 bits each; each thread's last, failing claim of a region adds one past
// n, so n stays well below 2^16 (a longer range gets longer chunks: same bits).
constexpr int64_t kMaxChunks = 60000;
constexpr int64_t kMaxWorkers = 1023;
constexpr uint64_t kNextOne = uint64_t{1} << 16;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

// Polls ready() for up to budget_us (< 0: until it holds); true when it holds.
template <typename Ready>
bool poll(const Ready& ready, int64_t budget_us) {
  if (ready()) return true;
  if (budget_us == 0) return false;
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::microseconds(std::max<int64_t>(0, budget_us));
  for (;;) {
    for (int i = 0; i < 16; ++i) {
      if (ready()) return true;
      _mm_pause();
    }
    if (budget_us > 0 && Clock::now() >= deadline) return ready();
  }
}

thread_local bool t_in_region = false;  // a worker, or a caller inside its region

struct Worker {
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> chunks{0};  // chunks this worker ran (tests read it)
};

class Pool {
 public:
  void run(int64_t begin, int64_t end, int64_t chunk, ChunkFn fn, const void* ctx) {
    int64_t n = (end - begin + chunk - 1) / chunk;
    const int64_t team = std::min<int64_t>(team_size(), kMaxWorkers + 1);
    if (t_in_region || team <= 1 || n <= 1) return fn(ctx, begin, end);
    std::unique_lock<std::mutex> lock(caller_, std::try_to_lock);
    if (!lock.owns_lock()) return fn(ctx, begin, end);  // another thread's region is running
    if (n > kMaxChunks) {
      chunk = (end - begin + kMaxChunks - 1) / kMaxChunks;
      n = (end - begin + chunk - 1) / chunk;
    }
    resize(team - 1);
    fn_ = fn;
    ctx_ = ctx;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    publish(static_cast<uint32_t>(n));
    t_in_region = true;
    const uint32_t mine = work<false>(caller_chunks_);
    t_in_region = false;
    regions_.fetch_add(1, std::memory_order_relaxed);
    // done_ counts the workers' chunks only (the caller's own need no shared increment) until
    // the caller sleeps: then it adds its own, and the worker that brings done_ to n wakes it.
    const uint32_t total = static_cast<uint32_t>(n);
    auto finished = [&] { return done_.load(std::memory_order_acquire) + mine == total; };
    if (!poll(finished, wait_us_.load(std::memory_order_relaxed))) {
      caller_sleeping_.store(1, std::memory_order_seq_cst);
      done_.fetch_add(mine, std::memory_order_seq_cst);
      for (uint32_t d; (d = done_.load(std::memory_order_seq_cst)) != total;)
        futex_wait(&done_, d);
      caller_sleeping_.store(0, std::memory_order_relaxed);
    }
    if (error_) std::rethrow_exception(error_);
  }

  void set_policy(const Policy& p) {
    spin_us_.store(p.spin_us);
    wait_us_.store(p.wait_us);
    openmp_.store(p.openmp);
    threads_.store(p.threads);
    chunks_.store(p.chunks);
  }

  Policy policy() const {
    return Policy{spin_us_.load(), wait_us_.load(), openmp_.load(), threads_.load(),
                  chunks_.load()};
  }
  int64_t chunks_per_thread() const { return chunks_.load(std::memory_order_relaxed); }
  bool dynamic() const { return !openmp_.load(std::memory_order_relaxed); }
  int64_t team_size() const {
    const int64_t t = threads_.load(std::memory_order_relaxed);
    return t > 0 && dynamic() ? t : at::get_num_threads();
  }

  // (workers started, regions run here, chunks the callers ran, chunks the workers ran)
  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(caller_);
    int64_t by_workers = 0;
    for (const auto& w : workers_) by_workers += w->chunks.load();
    return {static_cast<int64_t>(workers_.size()), regions_.load(), caller_chunks_.load(),
            by_workers};
  }

  // Tests: parks every worker before it claims another chunk (as if the OS had descheduled
  // it) and returns once all are parked; false lets them go.
  void hold_workers(bool hold) {
    std::lock_guard<std::mutex> lock(caller_);
    hold_.store(hold);
    if (!hold) return;
    publish(0);  // wakes the sleeping ones
    while (parked_.load() < static_cast<int64_t>(workers_.size())) std::this_thread::yield();
  }

 private:
  void publish(uint32_t n) {
    ++epoch_;
    claim_.store(uint64_t{epoch_} << 32 | n, std::memory_order_release);
    gen_.store(epoch_, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&gen_);
  }

  // Claims and runs chunks until none is left, counting them in `ran` (before each is
  // reported done, so a caller that saw the region done sees the counts); returns how many it
  // ran. Workers (kWorker) report each chunk done; the caller keeps its own count.
  template <bool kWorker>
  uint32_t work(std::atomic<int64_t>& ran) {
    for (uint32_t mine = 0;; ++mine) {
      const uint64_t s = claim_.fetch_add(kNextOne, std::memory_order_acq_rel);
      const uint32_t next = static_cast<uint32_t>(s >> 16) & 0xFFFF;
      const uint32_t n = static_cast<uint32_t>(s) & 0xFFFF;
      if (next >= n) return mine;
      const int64_t b = begin_ + next * chunk_;
      try {
        fn_(ctx_, b, std::min(end_, b + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_lock_);
        if (!error_) error_ = std::current_exception();
      }
      ran.store(ran.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      if (kWorker && done_.fetch_add(1, std::memory_order_seq_cst) + 1 == n &&
          caller_sleeping_.load(std::memory_order_seq_cst))
        futex_wake_all(&done_);
    }
  }

  void worker_loop(Worker* me, uint32_t seen) {
    pthread_setname_np(pthread_self(), "specserve-pool");
    t_in_region = true;  // a kernel called from a chunk runs its regions inline
    for (;;) {
      auto fresh = [&] { return gen_.load(std::memory_order_acquire) != seen; };
      if (!poll(fresh, spin_us_.load(std::memory_order_relaxed))) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        while (gen_.load(std::memory_order_seq_cst) == seen) futex_wait(&gen_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
      seen = gen_.load(std::memory_order_acquire);
      if (me->stop.load(std::memory_order_acquire)) return;
      if (hold_.load()) {
        parked_.fetch_add(1);
        while (hold_.load()) std::this_thread::yield();
        parked_.fetch_sub(1);
      }
      work<true>(me->chunks);
    }
  }

  // Starts or stops workers (the caller's lock held, no region running).
  void resize(int64_t want) {
    while (static_cast<int64_t>(workers_.size()) < want) {
      auto w = std::make_unique<Worker>();
      try {
        w->thread = std::thread(&Pool::worker_loop, this, w.get(), epoch_);
      } catch (const std::system_error&) {
        break;  // no more threads: fewer workers, the same bits
      }
      workers_.push_back(std::move(w));
    }
    if (static_cast<int64_t>(workers_.size()) <= want) return;
    for (size_t i = want; i < workers_.size(); ++i) workers_[i]->stop.store(true);
    publish(0);  // an empty region: the stopping workers see it and leave
    for (size_t i = want; i < workers_.size(); ++i) workers_[i]->thread.join();
    workers_.resize(want);
  }

  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<uint32_t> done_{0};
  std::atomic<uint32_t> caller_sleeping_{0};
  alignas(64) std::atomic<uint32_t> gen_{0};
  std::atomic<uint32_t> sleepers_{0};
  alignas(64) ChunkFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  uint32_t epoch_ = 0;
  std::exception_ptr error_;
  std::mutex error_lock_;
  std::mutex caller_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::atomic<int64_t> spin_us_{200}, wait_us_{50};
  std::atomic<bool> openmp_{false};
  std::atomic<int64_t> threads_{0};
  std::atomic<int64_t> chunks_{4};
  std::atomic<bool> hold_{false};
  std::atomic<int64_t> parked_{0};
  std::atomic<int64_t> regions_{0}, caller_chunks_{0};
};

std::atomic<Pool*> g_pool{nullptr};

// A forked child has none of the parent's workers: it starts a pool of its own (the parent's
// is left behind, its threads gone), with the parent's policy.
void after_fork_in_child() {
  Pool* parent = g_pool.load();
  Pool* fresh = new Pool();
  if (parent != nullptr) fresh->set_policy(parent->policy());
  g_pool.store(fresh);
}

Pool& instance() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_pool.store(new Pool());  // never deleted: workers may outlive static destructors
    pthread_atfork(nullptr, nullptr, after_fork_in_child);
  });
  return *g_pool.load(std::memory_order_acquire);
}

}  // namespace

void set_policy(const Policy& p) { instance().set_policy(p); }
Policy policy() { return instance().policy(); }
bool dynamic() { return instance().dynamic(); }
int64_t team_size() { return instance().team_size(); }
int64_t chunks_per_thread() { return instance().chunks_per_thread(); }

void run(int64_t begin, int64_t end, int64_t chunk, ChunkFn fn, const void* ctx) {
  instance().run(begin, end, chunk, fn, ctx);
}

std::vector<int64_t> stats() { return instance().stats(); }
void hold_workers(bool hold) { instance().hold_workers(hold); }

}  // namespace specserve::pool

void register_pool(pybind11::module& mod) {
  namespace pool = specserve::pool;
  mod.def(
      "set_thread_policy",
      [](int64_t spin_us, int64_t wait_us, bool openmp, int64_t threads, int64_t chunks) {
        TORCH_CHECK(spin_us >= -1 && wait_us >= -1,
                    "spin_us and wait_us must be >= 0 microseconds, or -1 (never sleep); got ",
                    spin_us, ", ", wait_us);
        TORCH_CHECK(threads >= 0 && threads <= 1024, "threads must be in 0..1024 (0: torch's "
                    "number of threads); got ", threads);
        TORCH_CHECK(chunks >= 1 && chunks <= 64, "chunks (per thread) must be in 1..64; got ",
                    chunks);
        pool::set_policy(pool::Policy{spin_us, wait_us, openmp, threads, chunks});
      },
      "How the kernels' parallel regions run: idle workers poll spin_us before sleeping, the "
      "caller polls wait_us for running chunks before sleeping (-1: never sleep); openmp: "
      "at::parallel_for's static split instead of the pool; threads: the pool's team (0: "
      "torch.get_num_threads()); chunks: chunks per thread of a projection",
      pybind11::arg("spin_us"), pybind11::arg("wait_us"), pybind11::arg("openmp") = false,
      pybind11::arg("threads") = 0, pybind11::arg("chunks") = 4);
  mod.def("thread_policy", [] {
    const pool::Policy p = pool::policy();
    return std::make_tuple(p.spin_us, p.wait_us, p.openmp, p.threads, p.chunks);
  }, "(spin_us, wait_us, openmp, threads, chunks) now in force");
  mod.def("pool_stats", [] { return pool::stats(); },
          "(workers started, regions run on the pool, chunks run by callers, by workers)");
  mod.def("pool_hold_workers", [](bool hold) { pool::hold_workers(hold); },
          "Tests: workers wait before claiming chunks while set, as descheduled threads would");
}
