/* y[M, N] = ((float)(a[M, K] . q[N, K]^T) * t[M]) * s[N]: int8 activations a
 * (one scale t per row) times int8 weights q (one scale s per output), the
 * products summed exactly in int32, for the few rows of a decode step.
 *
 * The weight stays in its plain [N, K] layout, the one torch._int_mm reads
 * for larger steps, so one copy serves both and a row's result is the same
 * bits whichever computes it (the int32 sums are exact; the two float
 * multiplications come in torch's order).
 *
 * AVX-512 VNNI's vpdpbusd multiplies unsigned by signed bytes, four at a time
 * into int32 lanes. The activations are made unsigned once per call
 * (a + 128, in a per-thread copy), and each output subtracts 128 * sum_k q[n, k]
 * (`colsum`, computed at load). Each output is one vector of 16 partial sums
 * along k, added across its lanes at the end. Up to four weight rows stream
 * side by side (four for 1-4 rows of a, two for 5-8, one for 9-16, so the
 * accumulators stay in registers: BENCHMARKS.md, "quant_kernels"); each of their
 * 64-byte lines is used by every row of a before the next is read. Rows of
 * the weight are split evenly over OpenMP threads (torch's libgomp, so both
 * share one thread team).
 *
 * Without AVX-512 VNNI and BW (w8a8_gemm_available() returns 0) the entry
 * point does nothing: the caller uses torch._int_mm for every step, and
 * w8a8_rescale below for its scaling.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_ROWS 16  /* rows of a per call; more go to torch._int_mm */
#define COLS 4       /* weight rows streamed side by side, up to 4 rows of a */
/* Weight rows streamed side by side for m rows of a: m * cols accumulators
 * must fit in 32 registers with room for the loads. */
#define COLS_FOR(m) ((m) <= 4 ? 4 : (m) <= 8 ? 2 : 1)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

int w8a8_gemm_available(void) { return HAVE_VNNI; }
int w8a8_gemm_max_rows(void) { return MAX_ROWS; }

#if HAVE_VNNI
#define INLINE static inline __attribute__((always_inline))

/* Rows n0..n0+cols-1 of q (cols <= C) times the m rows of au (unsigned
 * copies of a). */
INLINE void cols_times_rows(const uint8_t *au, const int8_t *q, const int32_t *colsum,
                            const float *t, const float *s, float *y, int m, int K, int N,
                            int n0, int cols, const int C) {
    __m512i acc[MAX_ROWS][COLS];
    for (int r = 0; r < m; r++)
        for (int j = 0; j < C; j++) acc[r][j] = _mm512_setzero_si512();
    const int8_t *w[COLS];
    for (int j = 0; j < C; j++) w[j] = q + (size_t)(n0 + (j < cols ? j : 0)) * K;
    int k = 0;
    for (; k + 64 <= K; k += 64) {
#pragma GCC unroll 4
        for (int j = 0; j < C; j++) {
            if (j < cols) {
                __builtin_prefetch(w[j] + k + 512, 0, 3);
                __m512i wv = _mm512_loadu_si512((const void *)(w[j] + k));
#pragma GCC unroll 16
                for (int r = 0; r < MAX_ROWS; r++)
                    if (r < m)
                        acc[r][j] = _mm512_dpbusd_epi32(
                            acc[r][j], _mm512_loadu_si512((const void *)(au + (size_t)r * K + k)), wv);
            }
        }
    }
    if (k < K) {   /* the last K % 64 bytes; masked-off lanes load zeros */
        __mmask64 mask = (K - k) >= 64 ? ~0ULL : ((1ULL << (K - k)) - 1);
        for (int j = 0; j < C; j++) {
            if (j < cols) {
                __m512i wv = _mm512_maskz_loadu_epi8(mask, w[j] + k);
                for (int r = 0; r < m; r++)
                    acc[r][j] = _mm512_dpbusd_epi32(
                        acc[r][j], _mm512_maskz_loadu_epi8(mask, au + (size_t)r * K + k), wv);
            }
        }
    }
    for (int j = 0; j < cols; j++) {
        int n = n0 + j;
        for (int r = 0; r < m; r++) {
            int32_t sum = _mm512_reduce_add_epi32(acc[r][j]) - colsum[n];
            y[(size_t)r * N + n] = ((float)sum * t[r]) * s[n];
        }
    }
}

static __thread uint8_t *unsigned_a = NULL;   /* a + 128, per thread */
static __thread size_t unsigned_len = 0;

INLINE int run_cols(const int8_t *a, const float *t, const int8_t *q, const int32_t *colsum,
                    const float *s, float *y, int M, int K, int N, int first, int last) {
    size_t len = (size_t)M * K;
    if (unsigned_len < len) {
        free(unsigned_a);
        unsigned_a = aligned_alloc(64, (len + 63) / 64 * 64);
        unsigned_len = unsigned_a ? len : 0;
        if (!unsigned_a) return -1;
    }
    for (size_t i = 0; i < len; i++) unsigned_a[i] = (uint8_t)(a[i] ^ (int8_t)0x80);
    int C = COLS_FOR(M);
    for (int n = first; n < last; n += C) {
        int cols = last - n < C ? last - n : C;
        /* constant row and column counts keep the accumulators in registers */
        switch (M) {
#define ROWS(r) case r: cols_times_rows(unsigned_a, q, colsum, t, s, y, r, K, N, n, cols, COLS_FOR(r)); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
        }
    }
    return 0;
}
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

/* y[m, n] = ((float)acc[m, n] * t[m]) * s[n]: the scaling of torch._int_mm's
 * int32 product for larger steps, vectorised by the compiler (two rounded
 * multiplications, as in the kernel above) and split over OpenMP threads. */
void w8a8_rescale(const int32_t *acc, const float *t, const float *s, float *y, int M, int N,
                  int threads) {
    long total = (long)M * N;
    if (total <= 0) return;
    if (threads < 1) threads = 1;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#endif
    for (int m = 0; m < M; m++) {
        const int32_t *a = acc + (size_t)m * N;
        float *out = y + (size_t)m * N;
        float tm = t[m];
        for (int n = 0; n < N; n++) out[n] = ((float)a[n] * tm) * s[n];
    }
}

/* Returns 0; -1 when a thread could not allocate its copy of a, -2 when this
 * build has no AVX-512 VNNI or M is out of 1..MAX_ROWS (nothing written). */
int w8a8_gemm(const int8_t *a, const float *t, const int8_t *q, const int32_t *colsum,
              const float *s, float *y, int M, int K, int N, int threads) {
#if HAVE_VNNI
    if (M < 1 || M > MAX_ROWS) return -2;
    if (N <= 0) return 0;
    int groups = (N + COLS - 1) / COLS, failed = 0;
    if (threads < 1) threads = 1;
    if (threads > groups) threads = groups;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(|: failed)
    {
        int th = omp_get_thread_num(), nt = omp_get_num_threads();
        int first = (int)((long)groups * th / nt) * COLS, last = (int)((long)groups * (th + 1) / nt) * COLS;
        if (last > N) last = N;
        failed |= run_cols(a, t, q, colsum, s, y, M, K, N, first, last);
    }
#else
    (void)threads;
    failed = run_cols(a, t, q, colsum, s, y, M, K, N, 0, N);
#endif
    return failed ? -1 : 0;
#else
    (void)a; (void)t; (void)q; (void)colsum; (void)s; (void)y; (void)M; (void)K; (void)N; (void)threads;
    return -2;
#endif
}
