// The kernels' own thread pool: parallel regions whose chunks are claimed from one atomic
// counter, so a region ends when its last chunk is done, not when every thread has checked in.
//
// Why not at::parallel_for: torch's OpenMP pool splits a range statically (one piece per
// thread) and ends every region at a team barrier. A decode step runs ~200 regions of a few
// microseconds each; when the OS deschedules one team thread (a server's event loop waking,
// another process, a 2-core machine), every other thread waits at the next barrier until it
// runs again, about a scheduler time slice. Here a thread that wakes late finds the chunks
// claimed and is not waited for; the caller works too, so a region never waits for a thread
// that has not started.
//
// Bits: a chunk's result never depends on which thread computes it or in what order chunks
// run; every kernel's per-row arithmetic is fixed (see qgemm.cpp), so batch invariance holds
// under any schedule.
//
// Policy (set_policy, measured per machine by kernels/thread_policy.py):
//   spin_us  how long an idle worker polls for the next region before it sleeps on a futex
//            (-1: never sleeps). Regions of one step come microseconds apart; steps, ~1 ms.
//   wait_us  how long the caller polls for chunks still running on other threads before it
//            sleeps until the last one is done (-1: never sleeps).
//   openmp   run every region through at::parallel_for instead (the old static split, kept
//            for same-run comparisons: benchmarks/thread_policy.py).
//   threads  the team: the caller and threads - 1 workers, started on first use and resized
//            when the number changes; 0 (the default): torch.get_num_threads() (the engine's
//            --num-threads). A number of its own lets torch's ops run on one thread while the
//            kernels run on several: torch's OpenMP workers, woken by an elementwise op on a
//            vocabulary of logits, spin for milliseconds after it beside the pool's.
//   chunks   chunks per thread a projection is cut into (more: finer balance, more claims).
// The kernels size their chunks by team_size() and chunks_per_thread().
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

namespace specserve::pool {

using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);

struct Policy {
  int64_t spin_us;
  int64_t wait_us;
  bool openmp;
  int64_t threads;
  int64_t chunks;
};

void set_policy(const Policy& p);
Policy policy();
bool dynamic();               // regions run on this pool (not OpenMP)
int64_t team_size();          // threads a region runs on (the caller included)
int64_t chunks_per_thread();  // how finely a projection is cut

// fn(ctx, b, e) over [begin, end) in chunks of `chunk` (the last one shorter), claimed
// dynamically by the caller and the workers.
void run(int64_t begin, int64_t end, int64_t chunk, ChunkFn fn, const void* ctx);

// f(b, e) for consecutive chunks of [begin, end) of `chunk` items (>= 1). A range of at most
// one chunk, a team of one, a call from inside a region, or a second thread calling while
// another's region runs: f(begin, end) on the calling thread. Under the openmp policy:
// at::parallel_for(begin, end, chunk, f), the static split the kernels ran before.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  if (end <= begin) return;
  if (!dynamic()) {
    at::parallel_for(begin, end, chunk, f);
    return;
  }
  run(begin, end, chunk < 1 ? 1 : chunk,
      [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

}  // namespace specserve::pool
