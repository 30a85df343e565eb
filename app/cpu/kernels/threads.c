/* Each thread of the calling thread's OpenMP team kept on one CPU, exposed as llm_serve::bind_threads (app/cpu/threads.py).
 *
 * Why: a step's kernels split their work across the team and meet at a barrier. Unbound, Linux moves the threads
 * between CPUs as the serving processes beside them (the HTTP server, the client's connections, Ray's daemons) wake up,
 * and a thread moved onto a CPU that is busy waits there while its teammate waits for it at the barrier. vLLM's CPU
 * backend binds its OpenMP threads one per core for the same reason (VLLM_CPU_OMP_THREADS_BIND). The team is the one
 * this thread runs every later parallel region with (libgomp keeps it, thread for thread, while its size stays the same),
 * so the binding holds for the kernels and for torch's own parallel ops.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

/* Thread t of a team of n to cpus[t]; returns how many threads were bound (n when all were). */
int64_t bind_openmp_threads(const int64_t* cpus, int64_t n) {
  int64_t bound = 0;
#pragma omp parallel num_threads((int)n) reduction(+ : bound)
  {
    const int t = omp_get_thread_num();
    if (omp_get_num_threads() == n) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET((int)cpus[t], &set);
      bound += sched_setaffinity(0, sizeof set, &set) == 0;
    }
  }
  return bound;
}
