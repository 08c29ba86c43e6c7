// stepserve_cpu::intra_op_thread_ids() -> int[]: the kernel thread ids (gettid) of ATen's
// intra-op pool, the calling thread first, one per thread a parallel region runs on (the
// same OpenMP pool the kernels and the compiled forward use). worker.thread_policy sets the
// helpers' scheduling policy by these ids; /proc alone cannot tell them from other threads.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
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

TORCH_LIBRARY_FRAGMENT(stepserve_cpu, m) { m.def("intra_op_thread_ids() -> int[]", &intra_op_thread_ids); }
