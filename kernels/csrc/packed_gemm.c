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
