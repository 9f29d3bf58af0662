/* The CPU's float32 FMA throughput and latency, for the GEMM benchmark's
 * peak (loadtest/bench/gemm_shapes.py). Built like the kernels (-O3
 * -march=native -fopenmp). */
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define FIRST(v) _mm512_cvtss_f32(v)
#else
typedef __m256 vec;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
#define FIRST(v) _mm256_cvtss_f32(v)
#endif
#define CHAINS 24   /* independent accumulators: enough to cover latency x units */

int fma_probe_lanes(void) { return LANES; }

/* Floating-point operations of `iters` rounds of CHAINS independent FMAs
 * on each of `threads` threads (time it from outside). */
double fma_probe_throughput(long iters, int threads) {
    double flops = 0;
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    {
        vec acc[CHAINS], x = SET1(1.0000001f), y = SET1(1e-7f);
        for (int i = 0; i < CHAINS; i++) acc[i] = SET1((float)i);
        for (long it = 0; it < iters; it++) {
#pragma GCC unroll 24
            for (int i = 0; i < CHAINS; i++) acc[i] = FMA(acc[i], x, y);
        }
        float sink = 0;
        for (int i = 0; i < CHAINS; i++) sink += FIRST(acc[i]);
        flops += sink == -1.0f ? 0 : (double)iters * CHAINS * LANES * 2;
    }
    return flops;
}

/* `iters` FMAs each waiting for the one before (their latency, 4 cycles on
 * every Intel and AMD core with AVX-512 FMA: the FMA clock from the time). */
float fma_probe_chain(long iters) {
    vec acc = SET1(1.0f), x = SET1(1.0000001f), y = SET1(1e-7f);
    for (long it = 0; it < iters; it++) acc = FMA(acc, x, y);
    return FIRST(acc);
}
