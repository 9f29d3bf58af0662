/* y[M, N] = x[M, K] . W[N, K]^T in float32, for the few rows of a decode step.
 *
 * W is packed once, at load, into column blocks of NB outputs: wp[N / NB][K][NB]
 * (the last block zero-padded). One block is read from memory once per call
 * and kept in L2 while every MR-row chunk of x multiplies it, with MR x 2
 * vector accumulators held in registers; while a block is in use the next one
 * is prefetched. Blocks are split evenly over OpenMP threads (the same libgomp
 * as torch's, so both share one thread team).
 *
 * Built at run time with -march=native: NB is 32 and MR 8 with AVX-512, NB 16
 * and MR 6 with AVX2 (16 registers), and the same code falls back to whatever
 * vectors the target has. Each output is one fp32 sum over k in order, so
 * results differ from a BLAS sgemm only by rounding.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define MR 8
#else
#define VW 8
#define MR 6
#endif
#define NB (2 * VW)
#define PREFETCH_K 32

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));

/* One MR-row chunk (m rows) of x times one packed block. Chunk c of C also
 * prefetches its share of the next block, so all C chunks together fetch it
 * while this one is in use; a single chunk prefetches ahead in its own block
 * (a whole block ahead would leave L1 before it is read). Reads past the end
 * of the weight are prefetches only, which never fault. */
static inline __attribute__((always_inline)) void chunk_times_block(
        const float *x, const float *wp, const float *next, float *y,
        int m, int K, int ldy, int ncols, int c, int C) {
    vf acc[MR][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = (vf){0};
        acc[r][1] = (vf){0};
    }
    for (int k = 0; k < K; k++) {
        if (C == 1) {   /* one pass: fetch this block's stream PREFETCH_K rows ahead */
            __builtin_prefetch(wp + (size_t)(k + PREFETCH_K) * NB, 0, 3);
            __builtin_prefetch(wp + (size_t)(k + PREFETCH_K) * NB + 16, 0, 3);
        } else if (next) {
            __builtin_prefetch(next + ((size_t)c * K + k) * NB / C, 0, 3);
        }
        vf w0 = *(const vf *)(wp + (size_t)k * NB);
        vf w1 = *(const vf *)(wp + (size_t)k * NB + VW);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < m) {
                float xs = x[(size_t)r * K + k];
                acc[r][0] += xs * w0;
                acc[r][1] += xs * w1;
            }
        }
    }
    for (int r = 0; r < m; r++) {
        if (ncols == NB) {
            *(vf *)(y + (size_t)r * ldy) = acc[r][0];
            *(vf *)(y + (size_t)r * ldy + VW) = acc[r][1];
        } else {
            float tmp[NB];
            *(vf *)tmp = acc[r][0];
            *(vf *)(tmp + VW) = acc[r][1];
            memcpy(y + (size_t)r * ldy, tmp, (size_t)ncols * sizeof(float));
        }
    }
}

/* Decode steps of one or two rows are bound by memory bandwidth, and one
 * sequential stream per thread does not reach it: these rows multiply GB
 * consecutive blocks at once, GB streams side by side (4 streams: 1.12x at
 * one row on SmolLM2's layers, BENCHMARKS.md section 13). */
#define GB 4
static inline __attribute__((always_inline)) void rows_times_blocks(
        const float *x, const float *wp, float *y, int rows, int K, int N, int b, int count) {
    vf acc[2][GB][2];
    const float *w[GB];
    for (int j = 0; j < GB; j++) {
        w[j] = wp + (size_t)(b + (j < count ? j : 0)) * K * NB;
        for (int r = 0; r < 2; r++) acc[r][j][0] = acc[r][j][1] = (vf){0};
    }
    for (int k = 0; k < K; k++) {
#pragma GCC unroll 4
        for (int j = 0; j < GB; j++) {
            if (j < count) {
                vf w0 = *(const vf *)(w[j] + (size_t)k * NB);
                vf w1 = *(const vf *)(w[j] + (size_t)k * NB + VW);
                for (int r = 0; r < rows; r++) {
                    float xs = x[(size_t)r * K + k];
                    acc[r][j][0] += xs * w0;
                    acc[r][j][1] += xs * w1;
                }
            }
        }
    }
    for (int j = 0; j < count; j++) {
        int ncols = N - (b + j) * NB;
        if (ncols > NB) ncols = NB;
        for (int r = 0; r < rows; r++) {
            float tmp[NB];
            *(vf *)tmp = acc[r][j][0];
            *(vf *)(tmp + VW) = acc[r][j][1];
            memcpy(y + (size_t)r * N + (size_t)(b + j) * NB, tmp, (size_t)ncols * sizeof(float));
        }
    }
}

static void run_blocks(const float *x, const float *wp, float *y, int M, int K, int N,
                       int first, int last) {
    int C = (M + MR - 1) / MR;
    if (M <= 2) {
        for (int b = first; b < last; b += GB) {
            int count = last - b < GB ? last - b : GB;
            /* constant row and block counts keep the accumulators in registers */
#define BLOCKS(rows, n) case n: rows_times_blocks(x, wp, y, rows, K, N, b, n); break;
            if (M == 1) {
                switch (count) { BLOCKS(1, 1) BLOCKS(1, 2) BLOCKS(1, 3) BLOCKS(1, 4) }
            } else {
                switch (count) { BLOCKS(2, 1) BLOCKS(2, 2) BLOCKS(2, 3) BLOCKS(2, 4) }
            }
#undef BLOCKS
        }
        return;
    }
    for (int b = first; b < last; b++) {
        const float *wb = wp + (size_t)b * K * NB;
        const float *next = b + 1 < last ? wb + (size_t)K * NB : NULL;
        int ncols = N - b * NB;
        if (ncols > NB) ncols = NB;
        for (int c = 0; c < C; c++) {
            int m = M - c * MR;
            if (m > MR) m = MR;
            const float *xc = x + (size_t)c * MR * K;
            float *yc = y + (size_t)c * MR * N + (size_t)b * NB;
            /* A constant row count per case lets the compiler keep the
             * accumulators in registers. */
            switch (m) {
#define ROWS(n) case n: chunk_times_block(xc, wb, next, yc, n, K, N, ncols, c, C); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if MR > 6
            ROWS(7) ROWS(8)
#endif
#undef ROWS
            }
        }
    }
}

/* ---------------------------------------------------------------- int8
 * The same layout with int8 weights, one float scale per output column
 * (w = q * scale, symmetric per row of W): qp[N / NB][K][NB] int8 and
 * scales[N / NB * NB] (zero-padded). A quarter of the bytes to stream, so
 * decode steps of a few rows, bound by memory bandwidth, take about a
 * quarter of the time; the weights are widened to float in registers and
 * each output is sum_k(x * q) * scale. Steps of more than one row chunk
 * widen each block once into a per-thread float copy, scale applied, and
 * multiply every chunk by it as above. */
#include <immintrin.h>
/* VW int8 weights widened to a float vector (vpmovsxbd + vcvtdq2ps; gcc's
 * generic vector conversion widens them one by one). */
static inline __attribute__((always_inline)) vf widen(const signed char *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf w;
    for (int i = 0; i < VW; i++) w[i] = (float)p[i];
    return w;
#endif
}
#define WIDEN(p) widen(p)
#define PREFETCH_QK 64

static inline __attribute__((always_inline)) void store_scaled(
        vf a0, vf a1, const float *sc, float *y, int ncols) {
    vf s0 = *(const vf *)sc, s1 = *(const vf *)(sc + VW);
    if (ncols == NB) {
        *(vf *)y = a0 * s0;
        *(vf *)(y + VW) = a1 * s1;
    } else {
        float tmp[NB];
        *(vf *)tmp = a0 * s0;
        *(vf *)(tmp + VW) = a1 * s1;
        memcpy(y, tmp, (size_t)ncols * sizeof(float));
    }
}

static inline __attribute__((always_inline)) void chunk_times_qblock(
        const float *x, const signed char *qp, const float *sc, float *y,
        int m, int K, int ldy, int ncols) {
    vf acc[MR][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = (vf){0};
        acc[r][1] = (vf){0};
    }
    for (int k = 0; k < K; k++) {
        __builtin_prefetch(qp + (size_t)(k + PREFETCH_QK) * NB, 0, 3);
        vf w0 = WIDEN(qp + (size_t)k * NB);
        vf w1 = WIDEN(qp + (size_t)k * NB + VW);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < m) {
                float xs = x[(size_t)r * K + k];
                acc[r][0] += xs * w0;
                acc[r][1] += xs * w1;
            }
        }
    }
    for (int r = 0; r < m; r++)
        store_scaled(acc[r][0], acc[r][1], sc, y + (size_t)r * ldy, ncols);
}

static inline __attribute__((always_inline)) void rows_times_qblocks(
        const float *x, const signed char *qp, const float *scales, float *y,
        int rows, int K, int N, int b, int count) {
    vf acc[2][GB][2];
    const signed char *w[GB];
    for (int j = 0; j < GB; j++) {
        w[j] = qp + (size_t)(b + (j < count ? j : 0)) * K * NB;
        for (int r = 0; r < 2; r++) acc[r][j][0] = acc[r][j][1] = (vf){0};
    }
    for (int k = 0; k < K; k++) {
#pragma GCC unroll 4
        for (int j = 0; j < GB; j++) {
            if (j < count) {
                vf w0 = WIDEN(w[j] + (size_t)k * NB);
                vf w1 = WIDEN(w[j] + (size_t)k * NB + VW);
                for (int r = 0; r < rows; r++) {
                    float xs = x[(size_t)r * K + k];
                    acc[r][j][0] += xs * w0;
                    acc[r][j][1] += xs * w1;
                }
            }
        }
    }
    for (int j = 0; j < count; j++) {
        int ncols = N - (b + j) * NB;
        if (ncols > NB) ncols = NB;
        for (int r = 0; r < rows; r++)
            store_scaled(acc[r][j][0], acc[r][j][1], scales + (size_t)(b + j) * NB,
                         y + (size_t)r * N + (size_t)(b + j) * NB, ncols);
    }
}

static __thread float *widened = NULL;   /* one block in float, per thread */
static __thread size_t widened_len = 0;

static int run_qblocks(const float *x, const signed char *qp, const float *scales, float *y,
                       int M, int K, int N, int first, int last) {
    int C = (M + MR - 1) / MR;
    if (M <= 2) {
        for (int b = first; b < last; b += GB) {
            int count = last - b < GB ? last - b : GB;
#define BLOCKS(rows, n) case n: rows_times_qblocks(x, qp, scales, y, rows, K, N, b, n); break;
            if (M == 1) {
                switch (count) { BLOCKS(1, 1) BLOCKS(1, 2) BLOCKS(1, 3) BLOCKS(1, 4) }
            } else {
                switch (count) { BLOCKS(2, 1) BLOCKS(2, 2) BLOCKS(2, 3) BLOCKS(2, 4) }
            }
#undef BLOCKS
        }
        return 0;
    }
    if (C > 1 && widened_len < (size_t)K * NB) {
        free(widened);
        widened = aligned_alloc(64, ((size_t)K * NB * sizeof(float) + 63) / 64 * 64);
        widened_len = widened ? (size_t)K * NB : 0;
        if (!widened) return -1;
    }
    for (int b = first; b < last; b++) {
        const signed char *qb = qp + (size_t)b * K * NB;
        const float *sc = scales + (size_t)b * NB;
        int ncols = N - b * NB;
        if (ncols > NB) ncols = NB;
        if (C > 1) {
            vf s0 = *(const vf *)sc, s1 = *(const vf *)(sc + VW);
            for (int k = 0; k < K; k++) {
                __builtin_prefetch(qb + (size_t)(k + PREFETCH_QK) * NB, 0, 3);
                *(vf *)(widened + (size_t)k * NB) = WIDEN(qb + (size_t)k * NB) * s0;
                *(vf *)(widened + (size_t)k * NB + VW) = WIDEN(qb + (size_t)k * NB + VW) * s1;
            }
        }
        for (int c = 0; c < C; c++) {
            int m = M - c * MR;
            if (m > MR) m = MR;
            const float *xc = x + (size_t)c * MR * K;
            float *yc = y + (size_t)c * MR * N + (size_t)b * NB;
            switch (m) {
#define ROWS(n) case n: { if (C > 1) chunk_times_block(xc, widened, NULL, yc, n, K, N, ncols, c, C); \
                              else chunk_times_qblock(xc, qb, sc, yc, n, K, N, ncols); } break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if MR > 6
            ROWS(7) ROWS(8)
#endif
#undef ROWS
            }
        }
    }
    return 0;
}

#ifdef _OPENMP
#include <omp.h>
#endif

void packed_gemm(const float *x, const float *wp, float *y, int M, int K, int N, int threads) {
    int blocks = (N + NB - 1) / NB;
    if (M <= 0 || blocks <= 0) return;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = blocks;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        run_blocks(x, wp, y, M, K, N, (int)((long)blocks * t / nt), (int)((long)blocks * (t + 1) / nt));
    }
#else
    (void)threads;
    run_blocks(x, wp, y, M, K, N, 0, blocks);
#endif
}

/* Output columns per packed block (the packing's NB). */
int packed_gemm_block_cols(void) { return NB; }

/* y = x . (q * scales)^T for int8 packed q (see above). Returns 0, or -1
 * when a thread could not allocate its float copy of a block. */
int packed_gemm_i8(const float *x, const signed char *qp, const float *scales, float *y,
                   int M, int K, int N, int threads) {
    int blocks = (N + NB - 1) / NB, failed = 0;
    if (M <= 0 || blocks <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = blocks;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(|: failed)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        failed |= run_qblocks(x, qp, scales, y, M, K, N, (int)((long)blocks * t / nt),
                              (int)((long)blocks * (t + 1) / nt));
    }
#else
    (void)threads;
    failed = run_qblocks(x, qp, scales, y, M, K, N, 0, blocks);
#endif
    return failed ? -1 : 0;
}
