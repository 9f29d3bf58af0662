/* A parallel region that does nothing, run from a thread of its own: its
 * threads stay in libgomp's pool for as long as that thread lives, so libgomp
 * counts them among the threads it manages (pagedbackend/worker/cpu_wait.py).
 * Returns how many threads the region had. */
#include <omp.h>

int omp_park_team(int threads) {
    int count = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp atomic
        count++;
    }
    return count;
}
