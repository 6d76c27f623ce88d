/* How fast this machine's cores read memory with plain AVX2 loads: the ceiling a memory-bound
 * decode step is held against (docs/RESULTS.md, the AVX2 section).
 *
 *     cc -O2 -mavx2 -fopenmp scripts/read_bandwidth.c -o /tmp/read_bandwidth
 *     OMP_NUM_THREADS=2 /tmp/read_bandwidth [MiB]      (default 1024)
 *
 * Each thread sums its contiguous share of a buffer (huge pages asked for, as the weights' arena
 * asks) with 256-bit loads; five passes, GB/s each. The sum is printed so the loads are kept. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

int main(int argc, char **argv) {
    const long mib = argc > 1 ? atol(argv[1]) : 1024;
    if (mib < 1) {
        fprintf(stderr, "read_bandwidth: the size must be a positive number of MiB\n");
        return 2;
    }
    const size_t huge = (size_t)1 << 21; /* aligned_alloc wants a multiple of the alignment */
    const size_t n = (((size_t)mib << 20) + huge - 1) / huge * huge;
    char *b = aligned_alloc(huge, n);
    if (!b) return 1;
    madvise(b, n, MADV_HUGEPAGE);
    memset(b, 1, n);
    for (int pass = 0; pass < 5; pass++) {
        double t = omp_get_wtime();
        long total = 0;
#pragma omp parallel reduction(+ : total)
        {
            const int nt = omp_get_num_threads(), id = omp_get_thread_num();
            const size_t share = n / nt / 128 * 128;
            const char *p = b + id * share;
            __m256i s = _mm256_setzero_si256();
            for (size_t i = 0; i < share; i += 128) {
                s = _mm256_add_epi8(s, _mm256_load_si256((const __m256i *)(p + i)));
                s = _mm256_add_epi8(s, _mm256_load_si256((const __m256i *)(p + i + 32)));
                s = _mm256_add_epi8(s, _mm256_load_si256((const __m256i *)(p + i + 64)));
                s = _mm256_add_epi8(s, _mm256_load_si256((const __m256i *)(p + i + 96)));
            }
            total += _mm256_extract_epi8(s, 0);
        }
        t = omp_get_wtime() - t;
        printf("pass %d: %.1f GB/s (%d threads, sum %ld)\n", pass + 1, n / t / 1e9, omp_get_max_threads(), total);
    }
    free(b);
    return 0;
}
