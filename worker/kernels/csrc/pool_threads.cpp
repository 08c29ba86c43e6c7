// stepserve_cpu::intra_op_thread_ids() -> int[]: the kernel thread ids (gettid) of ATen's
// intra-op pool, the calling thread first, one per thread a parallel region runs on (the
// same OpenMP pool the kernels and the compiled forward use). worker.thread_policy sets the
// helpers' scheduling policy by these ids; /proc alone cannot tell them from other threads.
// stepserve_cpu::helper_watchdog_start / _stats: the watchdog of `--worker-helper-policy
// auto`, below.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

std::vector<int64_t> intra_op_thread_ids() {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> ids(n, 0);
  // grain 1 over n items: thread t of the region runs item t; thread 0 is the caller
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ids[at::get_thread_num()] = static_cast<int64_t>(syscall(SYS_gettid));
  });
  std::vector<int64_t> out;
  for (int64_t id : ids)
    if (id != 0) out.push_back(id);
  return out;
}


// ---- the helper watchdog (--worker-helper-policy auto) -----------------------------------
// A SCHED_IDLE helper beside a CPU-bound neighbour gets almost no time, and every parallel
// region waits for it. A thread of its own (not the GIL's: a stalled step holds the GIL
// in the model's Python) samples each helper every period: its state (/proc/self/task/<tid>/
// stat) and, from .../schedstat, its time on a CPU and its time runnable but waiting. The
// kernel adds a wait to the second only when the wait ends (the thread gets a CPU), so a
// helper that gets none shows nothing there; it shows as runnable ('R') at both ends of a
// period with almost no CPU time in between (a running thread's time is brought up to date
// at every tick, so it shows >= period - one tick). A period is starved when a helper did
// that, or registered a wait of more than `starved` of the period; two in a row, or one
// registered wait of more than two periods, put every helper back under SCHED_OTHER for
// `hold` ms. A starvation within 8 holds of the return to SCHED_IDLE doubles the hold, up
// to 64 s. (An engine that preempts an idle helper takes well under a millisecond a step.)

namespace {

struct Watchdog {
  std::vector<int64_t> tids;
  int64_t period_us = 5000;
  double starved = 0.5;
  int64_t hold_ms = 1000;
  std::atomic<bool> stop{false};
  std::atomic<int64_t> demotions{0}, restores{0}, normal{0};
  std::thread thread;
};

std::mutex g_mutex;
Watchdog* g_dog = nullptr;

struct Sample {
  int64_t run_ns = -1, wait_ns = -1;
  bool runnable = false;
};

Sample sample(int64_t tid) {
  Sample out;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/task/%lld/schedstat", static_cast<long long>(tid));
  if (FILE* f = std::fopen(path, "r")) {
    unsigned long long run = 0, wait = 0;
    if (std::fscanf(f, "%llu %llu", &run, &wait) == 2) {
      out.run_ns = static_cast<int64_t>(run);
      out.wait_ns = static_cast<int64_t>(wait);
    }
    std::fclose(f);
  }
  std::snprintf(path, sizeof(path), "/proc/self/task/%lld/stat", static_cast<long long>(tid));
  if (FILE* f = std::fopen(path, "r")) {
    char buf[512];
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold anything
    out.runnable = close != nullptr && close[1] == ' ' && close[2] == 'R';
  }
  return out;
}

void set_policy(const std::vector<int64_t>& tids, int policy) {
  sched_param param{};
  param.sched_priority = 0;
  for (int64_t tid : tids) sched_setscheduler(static_cast<pid_t>(tid), policy, &param);
}

void watch(Watchdog* dog) {
  using clock = std::chrono::steady_clock;
  std::vector<Sample> last(dog->tids.size());
  for (size_t i = 0; i < dog->tids.size(); ++i) last[i] = sample(dog->tids[i]);
  int strikes = 0;
  int64_t hold_ms = dog->hold_ms;
  clock::time_point until{}, restored{};
  const auto period = std::chrono::microseconds(dog->period_us);
  const int64_t period_ns = dog->period_us * 1000;
  while (!dog->stop.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(period);
    bool starved = false, surely = false;
    for (size_t i = 0; i < dog->tids.size(); ++i) {
      const Sample now = sample(dog->tids[i]);
      const Sample& was = last[i];
      if (now.run_ns >= 0 && was.run_ns >= 0) {
        const int64_t waited = now.wait_ns - was.wait_ns, ran = now.run_ns - was.run_ns;
        starved |= waited > static_cast<int64_t>(dog->starved * period_ns);
        starved |= was.runnable && now.runnable && ran < period_ns / 10;
        surely |= waited > 2 * period_ns;
      }
      last[i] = now;
    }
    const auto now = clock::now();
    if (dog->normal.load()) {
      if (now >= until) {
        set_policy(dog->tids, SCHED_IDLE);
        dog->normal.store(0);
        dog->restores.fetch_add(1);
        restored = now;
        strikes = 0;
      }
      continue;
    }
    strikes = starved ? strikes + 1 : 0;
    if (strikes >= 2 || surely) {
      const bool again = dog->restores.load() > 0 && now - restored < std::chrono::milliseconds(8 * hold_ms);
      hold_ms = again ? std::min<int64_t>(2 * hold_ms, 64000) : dog->hold_ms;
      set_policy(dog->tids, SCHED_OTHER);
      dog->normal.store(1);
      dog->demotions.fetch_add(1);
      until = now + std::chrono::milliseconds(hold_ms);
      strikes = 0;
    }
  }
}

}  // namespace

// Start watching `tids` (already SCHED_IDLE); a second call replaces the first watchdog.
void helper_watchdog_start(std::vector<int64_t> tids, int64_t period_us, double starved, int64_t hold_ms) {
  TORCH_CHECK(period_us >= 100 && starved > 0 && starved <= 1 && hold_ms >= 1, "bad helper watchdog settings");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_dog != nullptr) {
    g_dog->stop.store(true);
    g_dog->thread.join();
    delete g_dog;
  }
  g_dog = new Watchdog();
  g_dog->tids = std::move(tids);
  g_dog->period_us = period_us;
  g_dog->starved = starved;
  g_dog->hold_ms = hold_ms;
  g_dog->thread = std::thread(watch, g_dog);
}

// [times the helpers went back to SCHED_OTHER, times they went back to SCHED_IDLE, 1 while
// they are SCHED_OTHER]; zeros when no watchdog runs.
std::vector<int64_t> helper_watchdog_stats() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_dog == nullptr) return {0, 0, 0};
  return {g_dog->demotions.load(), g_dog->restores.load(), g_dog->normal.load()};
}

TORCH_LIBRARY_FRAGMENT(stepserve_cpu, m) {
  m.def("intra_op_thread_ids() -> int[]", &intra_op_thread_ids);
  m.def("helper_watchdog_start(int[] tids, int period_us, float starved, int hold_ms) -> ()", &helper_watchdog_start);
  m.def("helper_watchdog_stats() -> int[]", &helper_watchdog_stats);
}
