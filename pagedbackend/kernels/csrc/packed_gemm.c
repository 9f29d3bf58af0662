/* y[M, N] = x[M, K] . W[N, K]^T in float32, for the few rows of a decode step.
 *
 * W is packed once, at load, into column blocks of NB outputs: wp[N / NB][K][NB]
 * (the last block zero-padded). One block is read from memory once per call
 * and kept in cache while every MR-row chunk of x multiplies it, with MR x 2
 * vector accumulators held in registers; with several chunks, a block goes
 * panel by panel and the next panel is prefetched while one is in use (see
 * chunk_times_panel). Blocks are split
 * evenly over OpenMP threads (the same libgomp as torch's, so both share one
 * thread team).
 *
 * int8 weights (packed_gemm_i8) use the same layout, qp[N / NB][K][NB] int8,
 * with one float scale per output column (w = q * scale, symmetric per row
 * of W): scales[N / NB * NB] (zero-padded). A quarter of the bytes to stream,
 * so decode steps of a few rows, bound by memory bandwidth, take about a
 * quarter of the time. The weights are widened to float in registers and
 * each output is sum_k(x * q) * scale; steps of more than one row chunk widen
 * each block once into a per-thread float copy, scale applied, and multiply
 * every chunk by it as for float32 weights. Where the CPU has AVX512_BF16,
 * those steps can turn each block into bfloat16 pairs instead and round x to
 * bfloat16, for vdpbf16ps (see HAVE_BF16 below).
 *
 * Built at run time with -march=native: NB is 32 and MR 12 with AVX-512 (24 of
 * its 32 registers accumulate), NB 16 and MR 6 with AVX2 (12 of 16), and the
 * same code falls back to whatever vectors the target has. Each output is one
 * fp32 sum over k in order, so results differ from a BLAS sgemm only by
 * rounding.
 *
 * bfloat16 weights (packed_gemm_bf16, and fused_moe.c's experts) use the float
 * layout with two bytes a weight: each is widened to float in registers (a shift: exact), so the sums
 * are those of the float32 kernel on the same values, bit for bit, for half
 * the bytes. A weight published in bfloat16 loses nothing kept this way.
 *
 * Every function below takes the weight as `const void *` with `q` saying
 * its type (W_F32, W_I8, W_BF16); they are inlined into the entry points,
 * where `q` is a constant, so each gets code of its own.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
/* Each chunk reads the whole block again from L2: 12-row chunks rather than 8
 * take 0.88-0.95x the time at 10-28 rows, and int8 steps of 9-12 rows read
 * their blocks in one chunk instead of through a float copy, 0.63-0.69x
 * (BENCHMARKS.md, "cpu_kernels"). */
#define MR 12
#else
#define VW 8
#define MR 6
#endif
#define NB (2 * VW)
#define PREFETCH_K 32    /* float rows of a block prefetched ahead */
/* Float rows prefetched into L2 only (prefetcht1: no L1 fill buffer held),
 * 32 KB ahead, by the passes of 3 to 24 rows, whose FMAs used to hold the
 * weights' stream up: SmolLM2's decode-step walk at 4-16 rows in 0.86-0.95x
 * the time on AVX-512 (0.83x at 4 rows on AVX2), 1-2 rows unchanged (already
 * at the bandwidth bound), 32 and more compute-bound and left alone
 * (BENCHMARKS.md, "cpu_kernels"). */
#define PREFETCH_L2 256
/* bfloat16 rows prefetched into L2, 8 KB ahead, at every row count: the
 * fused MoE kernel's expert slices (24-64 KB blocks, a new expert every few
 * hundred KB) in 0.89-0.92x the time at 1-64 tokens; 16 KB ahead was
 * 1.02x that, 32 KB 1.05x, 4 KB the same (BENCHMARKS.md, "moe"). */
#define PREFETCH_L2_BF16 128
/* Prefetch row k of float block w (two 64-byte lines when NB is 32) into L1
 * (locality 3) or L2 (2). */
#define PREFETCH_ROW(w, k, locality) do { \
        const float *row_ = (const float *)(w) + (size_t)(k) * NB; \
        __builtin_prefetch(row_, 0, locality); \
        if (NB > 16) __builtin_prefetch(row_ + 16, 0, locality); \
    } while (0)
#define PREFETCH_QK 64   /* int8 rows */
#define INLINE static inline __attribute__((always_inline))
#define W_F32 0
#define W_I8 1
#define W_BF16 2

typedef float vf __attribute__((vector_size(VW * 4), aligned(4)));

/* VW int8 weights widened to a float vector (vpmovsxbd + vcvtdq2ps; gcc's
 * generic vector conversion widens them one by one). */
INLINE vf widen(const signed char *p) {
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

/* VW bfloat16 weights as a float vector: each one's 16 bits become the high
 * half of a float (exact). */
INLINE vf widen_bf16(const unsigned short *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(__AVX2__)
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    vf w;
    for (int i = 0; i < VW; i++) {
        unsigned u = (unsigned)p[i] << 16;
        memcpy(&w[i], &u, sizeof u);
    }
    return w;
#endif
}

/* Bytes of one packed weight of type q. */
#define W_BYTES(q) ((q) == W_I8 ? 1 : (q) == W_BF16 ? 2 : (int)sizeof(float))

/* Row k of a packed block: its two vectors of weights, as floats. */
INLINE void load_row(const void *w, int q, int k, vf *w0, vf *w1) {
    if (q == W_BF16) {
        const unsigned short *p = (const unsigned short *)w + (size_t)k * NB;
        *w0 = widen_bf16(p);
        *w1 = widen_bf16(p + VW);
    } else if (q == W_I8) {
        const signed char *p = (const signed char *)w + (size_t)k * NB;
        *w0 = widen(p);
        *w1 = widen(p + VW);
    } else {
        const float *p = (const float *)w + (size_t)k * NB;
        *w0 = *(const vf *)p;
        *w1 = *(const vf *)(p + VW);
    }
}

/* Block b of the packed weight. */
INLINE const void *block(const void *wp, int q, int b, int K) {
    return (const char *)wp + (size_t)b * K * NB * W_BYTES(q);
}

/* One output row of a block: ncols values, times the column scales when
 * sc is not NULL. */
INLINE void store_row(vf a0, vf a1, const float *sc, float *y, int ncols) {
    if (sc) {
        a0 *= *(const vf *)sc;
        a1 *= *(const vf *)(sc + VW);
    }
    if (ncols == NB) {
        *(vf *)y = a0;
        *(vf *)(y + VW) = a1;
    } else {
        float tmp[NB];
        *(vf *)tmp = a0;
        *(vf *)(tmp + VW) = a1;
        memcpy(y, tmp, (size_t)ncols * sizeof(float));
    }
}

/* acc[r] += x[r, k] * (w0, w1) for the chunk's m rows: row k of a block. */
INLINE void rows_times_row(vf acc[MR][2], const float *x, int m, int K, int k, vf w0, vf w1) {
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
        if (r < m) {
            float xs = x[(size_t)r * K + k];
            acc[r][0] += xs * w0;
            acc[r][1] += xs * w1;
        }
    }
}

/* One MR-row chunk (m rows) of x times one packed block, as a step of one
 * chunk (or of bfloat16 weights) multiplies it: the chunk prefetches ahead in
 * its own block, a line at a time (reads past the end of the weight are
 * prefetches only, which never fault). Float blocks of several chunks go
 * panel by panel instead (chunk_times_panel). */
INLINE void chunk_times_block(const float *x, const void *w, int q, const float *sc,
                              float *y, int m, int K, int ldy, int ncols) {
    vf acc[MR][2];
    for (int r = 0; r < MR; r++) {
        acc[r][0] = (vf){0};
        acc[r][1] = (vf){0};
    }
    for (int k = 0; k < K; k++) {
        if (q == W_I8) {
            __builtin_prefetch((const signed char *)w + (size_t)(k + PREFETCH_QK) * NB, 0, 3);
        } else if (q == W_BF16) {   /* a row of NB bf16: at most one 64-byte line */
            __builtin_prefetch((const unsigned short *)w + (size_t)(k + PREFETCH_K) * NB, 0, 3);
            __builtin_prefetch((const unsigned short *)w + (size_t)(k + PREFETCH_L2_BF16) * NB, 0, 2);
        } else {
            PREFETCH_ROW(w, k + PREFETCH_K, 3);
            PREFETCH_ROW(w, k + PREFETCH_L2, 2);
        }
        vf w0, w1;
        load_row(w, q, k, &w0, &w1);
        rows_times_row(acc, x, m, K, k, w0, w1);
    }
    for (int r = 0; r < m; r++)
        store_row(acc[r][0], acc[r][1], sc, y + (size_t)r * ldy, ncols);
}

/* Rows k0..k1-1 of one float block (a panel) times one MR-row chunk, added
 * to the partial sums the earlier panels left in y (k0 > 0). Steps of several
 * chunks walk a block panel by panel, every chunk over one panel before the
 * next: a panel (KP rows: 24 KB with AVX-512, 12 KB with AVX2) and the chunks' slices of x stay
 * in L1 for all chunks, where a whole block (K x NB floats, 72-192 KB for
 * SmolLM2's layers) went through L1 once per chunk from L2. Meanwhile chunk c
 * of C prefetches its share of the next KP rows of the weight, which follow
 * in memory (the rest of this block, then the next block). Each output is
 * still one float sum over k in order, so results are unchanged bit for bit. */
#define KP 192
INLINE void chunk_times_panel(const float *x, const float *w, float *y, int m, int K, int ldy,
                              int ncols, int k0, int k1, int c, int C) {
    vf acc[MR][2];
    for (int r = 0; r < MR; r++) {
        if (r < m && k0 > 0) {
            const float *yr = y + (size_t)r * ldy;
            if (ncols == NB) {
                acc[r][0] = *(const vf *)yr;
                acc[r][1] = *(const vf *)(yr + VW);
            } else {
                float tmp[NB] = {0};
                memcpy(tmp, yr, (size_t)ncols * sizeof(float));
                acc[r][0] = *(const vf *)tmp;
                acc[r][1] = *(const vf *)(tmp + VW);
            }
        } else {
            acc[r][0] = (vf){0};
            acc[r][1] = (vf){0};
        }
    }
    /* chunk c's share of the next panel, KP x NB / C floats, one step of
     * NB / C floats (in 1/256ths) per k: spread over the pass, no division */
    const float *next = w + (size_t)k1 * NB + (size_t)c * KP * NB / C;
    unsigned step = (NB << 8) / C, at = 0;
    for (int k = k0; k < k1; k++, at += step) {
        __builtin_prefetch(next + (at >> 8), 0, 3);
        if (C <= 2)   /* below 25 rows (AVX-512), where the weights' bandwidth still bounds */
            __builtin_prefetch(next + (size_t)PREFETCH_L2 * NB + (at >> 8), 0, 2);
        const float *p = w + (size_t)k * NB;
        vf w0 = *(const vf *)p, w1 = *(const vf *)(p + VW);
        rows_times_row(acc, x, m, K, k, w0, w1);
    }
    for (int r = 0; r < m; r++)
        store_row(acc[r][0], acc[r][1], NULL, y + (size_t)r * ldy, ncols);
}

/* Decode steps of a few rows are bound by memory bandwidth, and one
 * sequential stream per thread does not reach it: these rows multiply GB
 * consecutive blocks at once, GB streams side by side (4 streams: 1.12x at
 * one row on SmolLM2's layers, BENCHMARKS.md, "cpu_kernels"). With AVX-512's 32
 * registers, three or four rows take three streams (24 accumulators): 0.85x
 * and 0.92x the time of one chunk at a time (BENCHMARKS.md, "cpu_kernels"). With
 * AVX2's 16 registers that spills, so only one or two rows stream this way. */
#define GB 4
#if VW == 16
#define STREAM_ROWS 4
#define GB_WIDE 3    /* streams of three or four rows */
#else
#define STREAM_ROWS 2
#define GB_WIDE GB
#endif
INLINE void rows_times_blocks(const float *x, const void *wp, int q, const float *scales, float *y,
                              int rows, int K, int N, int b, int count) {
    vf acc[STREAM_ROWS][GB][2];
    const void *w[GB];
    for (int j = 0; j < GB; j++) {
        w[j] = block(wp, q, b + (j < count ? j : 0), K);
        for (int r = 0; r < rows; r++) acc[r][j][0] = acc[r][j][1] = (vf){0};
    }
    for (int k = 0; k < K; k++) {
#pragma GCC unroll 4
        for (int j = 0; j < GB; j++) {
            if (j < count) {
                if (q == W_F32 && rows > 2)
                    PREFETCH_ROW(w[j], k + PREFETCH_L2, 2);
                if (q == W_BF16)
                    __builtin_prefetch((const unsigned short *)w[j] + (size_t)(k + PREFETCH_L2_BF16) * NB, 0, 2);
                vf w0, w1;
                load_row(w[j], q, k, &w0, &w1);
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
            store_row(acc[r][j][0], acc[r][j][1], scales ? scales + (size_t)(b + j) * NB : NULL,
                      y + (size_t)r * N + (size_t)(b + j) * NB, ncols);
    }
}

static __thread float *widened = NULL;   /* one int8 block in float, per thread */
static __thread size_t widened_len = 0;

#if defined(__AVX512BF16__) && VW == 16
/* int8 steps of bf16_rows rows or more (set by packed_linear.py at load),
 * with AVX512_BF16: the block is turned
 * into bfloat16 pairs instead of floats (int8 values are exact in bfloat16),
 * the rows of x are rounded to bfloat16 (to nearest even), and vdpbf16ps
 * multiplies them, two k at a time, summing in float32; the column scales
 * come last, as in the single-chunk int8 path. Twice the multiply-adds of
 * an FMA per instruction: over SmolLM2's int8 weights on an AMD Zen 4, 0.58x
 * the float rows' time at 24-32 rows, 0.84x at 12; below about 9 rows
 * converting each block costs more than it saves. On an Intel Emerald Rapids
 * it took 1.2-1.9x the float rows' time at every row count (vdpbf16ps issues
 * at about 2/3 of the FMA rate there), so packed_linear.py turns it on by
 * default on AMD CPUs only. packed_gemm_set_bf16_rows sets from how many rows, the same
 * for every call of the process. */
#define HAVE_BF16 1
static int bf16_rows = 0;   /* int8 steps of at least this many rows; 0: none (set at load) */
static __thread unsigned short *paired = NULL;   /* one block as [K/2][NB][2] bf16 */
static __thread size_t paired_len = 0;
static __thread unsigned short *x_bf16 = NULL;   /* the rows of x, [M][Kp] bf16 */
static __thread size_t x_bf16_len = 0;

/* Two rows k, k + 1 of an int8 block as NB (row k, row k + 1) bfloat16 pairs. */
INLINE void pair_rows(const signed char *p, const signed char *p1, unsigned short *out) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int h = 0; h < 2; h++) {
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + h * VW))));
        __m512 b = p1 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p1 + h * VW))))
                      : _mm512_setzero_ps();
        __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);   /* a in the low half, b in the high */
        _mm512_storeu_si512(out + (size_t)h * 2 * VW, _mm512_permutexvar_epi16(order, ab));
    }
}

/* m rows of bfloat16 x (Kp columns, Kp even) times one paired block. */
INLINE void chunk_times_pairs(const unsigned short *xb, const unsigned short *w, const float *sc, float *y,
                              int m, int Kp, int ldy, int ncols) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int k = 0; k < Kp; k += 2) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + (size_t)k * NB);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (size_t)k * NB + 2 * VW);
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            if (r < m) {
                int pair;
                memcpy(&pair, xb + (size_t)r * Kp + k, sizeof pair);
                __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            }
        }
    }
    for (int r = 0; r < m; r++)
        store_row((vf)acc[r][0], (vf)acc[r][1], sc, y + (size_t)r * ldy, ncols);
}

/* One float as bfloat16: to nearest even, subnormals to (signed) zero; x is
 * never NaN here (a NaN row gives NaN either way). */
INLINE unsigned short bf16_of(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0) return (unsigned short)((u >> 16) & 0x8000u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

/* x [M, K] float to this thread's [M, Kp] bfloat16 copy (an odd K gets a zero
 * column). Returns the copy, or NULL when it could not be allocated. */
static unsigned short *rows_to_bf16(const float *x, int M, int K, int Kp) {
    size_t need = (size_t)M * Kp;
    if (x_bf16_len < need) {
        free(x_bf16);
        x_bf16 = aligned_alloc(64, (need * sizeof(unsigned short) + 63) / 64 * 64);
        x_bf16_len = x_bf16 ? need : 0;
        if (!x_bf16) return NULL;
    }
    for (int r = 0; r < M; r++) {
        const float *xr = x + (size_t)r * K;
        unsigned short *o = x_bf16 + (size_t)r * Kp;
        int k = 0;
        for (; k + 32 <= K; k += 32) {
            __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k));
            _mm512_storeu_si512(o + k, v);
        }
        for (; k < Kp; k++)   /* the rest, as vcvtne2ps2bf16 rounds (subnormals to zero) */
            o[k] = k < K ? bf16_of(xr[k]) : 0;
    }
    return x_bf16;
}
#else
#define HAVE_BF16 0
#endif

/* Blocks first..last-1 of y. Returns 0, or -1 when the float copy of an int8
 * block could not be allocated. */
INLINE int run_blocks(const float *x, const void *wp, int q, const float *scales, float *y,
                      int M, int K, int N, int first, int last) {
    int C = (M + MR - 1) / MR;
#if HAVE_BF16
    if (q == W_I8 && bf16_rows > 0 && M >= bf16_rows) {
        int Kp = (K + 1) / 2 * 2;
        if (paired_len < (size_t)Kp * NB) {
            free(paired);
            paired = aligned_alloc(64, ((size_t)Kp * NB * sizeof(unsigned short) + 63) / 64 * 64);
            paired_len = paired ? (size_t)Kp * NB : 0;
            if (!paired) return -1;
        }
        const unsigned short *xb = rows_to_bf16(x, M, K, Kp);
        if (!xb) return -1;
        for (int b = first; b < last; b++) {
            const signed char *wb = (const signed char *)block(wp, 1, b, K);
            int ncols = N - b * NB;
            if (ncols > NB) ncols = NB;
            for (int k = 0; k < K; k += 2) {
                __builtin_prefetch(wb + (size_t)(k + PREFETCH_QK) * NB, 0, 3);
                pair_rows(wb + (size_t)k * NB, k + 1 < K ? wb + (size_t)(k + 1) * NB : NULL,
                          paired + (size_t)k * NB);
            }
            for (int c = 0; c < C; c++) {
                int m = M / C + (c < M % C), r0 = c * (M / C) + (c < M % C ? c : M % C);
                const unsigned short *xc = xb + (size_t)r0 * Kp;
                float *yc = y + (size_t)r0 * N + (size_t)b * NB;
                const float *sc = scales + (size_t)b * NB;
                switch (m) {
#define ROWS(n) case n: chunk_times_pairs(xc, paired, sc, yc, n, Kp, N, ncols); break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
                ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#undef ROWS
                }
            }
        }
        return 0;
    }
#endif
    if (M <= STREAM_ROWS) {
        int streams = M <= 2 ? GB : GB_WIDE;
        for (int b = first; b < last; b += streams) {
            int count = last - b < streams ? last - b : streams;
            /* constant row and block counts keep the accumulators in registers */
#define BLOCKS(rows, n) case n: rows_times_blocks(x, wp, q, scales, y, rows, K, N, b, n); break;
            switch (M) {
            case 1: switch (count) { BLOCKS(1, 1) BLOCKS(1, 2) BLOCKS(1, 3) BLOCKS(1, 4) } break;
            case 2: switch (count) { BLOCKS(2, 1) BLOCKS(2, 2) BLOCKS(2, 3) BLOCKS(2, 4) } break;
#if STREAM_ROWS > 2
            case 3: switch (count) { BLOCKS(3, 1) BLOCKS(3, 2) BLOCKS(3, 3) } break;
            case 4: switch (count) { BLOCKS(4, 1) BLOCKS(4, 2) BLOCKS(4, 3) } break;
#endif
            }
#undef BLOCKS
        }
        return 0;
    }
    int copy = q == W_I8 && C > 1;   /* int8 blocks widened once for all chunks */
    if (copy && widened_len < (size_t)K * NB) {
        free(widened);
        widened = aligned_alloc(64, ((size_t)K * NB * sizeof(float) + 63) / 64 * 64);
        widened_len = widened ? (size_t)K * NB : 0;
        if (!widened) return -1;
    }
    for (int b = first; b < last; b++) {
        const void *wb = block(wp, q, b, K);
        const float *sc = q == W_I8 ? scales + (size_t)b * NB : NULL;
        int ncols = N - b * NB;
        if (ncols > NB) ncols = NB;
        if (copy) {
            vf s0 = *(const vf *)sc, s1 = *(const vf *)(sc + VW);
            for (int k = 0; k < K; k++) {
                __builtin_prefetch((const signed char *)wb + (size_t)(k + PREFETCH_QK) * NB, 0, 3);
                vf w0, w1;
                load_row(wb, 1, k, &w0, &w1);
                *(vf *)(widened + (size_t)k * NB) = w0 * s0;
                *(vf *)(widened + (size_t)k * NB + VW) = w1 * s1;
            }
        }
        /* float blocks of several chunks: panel by panel (chunk_times_panel;
         * the widened int8 copy, already in L2, gains nothing from it: 1.04-1.14x
         * the time at 16-64 rows) */
        int panels = q == W_F32 && C > 1;
        for (int k0 = 0; k0 < K; k0 += panels ? KP : K) {
            int k1 = panels && k0 + KP < K ? k0 + KP : K;
            for (int c = 0; c < C; c++) {
                /* C chunks of as even sizes as can be (16 rows: 8 + 8, not 12 + 4) */
                int m = M / C + (c < M % C), r0 = c * (M / C) + (c < M % C ? c : M % C);
                const float *xc = x + (size_t)r0 * K;
                float *yc = y + (size_t)r0 * N + (size_t)b * NB;
                /* A constant row count per case lets the compiler keep the
                 * accumulators in registers. */
                switch (m) {
#define ROWS(n) case n: { if (panels) chunk_times_panel(xc, (const float *)wb, yc, n, K, N, ncols, k0, k1, c, C); \
                          else if (copy) chunk_times_block(xc, widened, 0, NULL, yc, n, K, N, ncols); \
                          else chunk_times_block(xc, wb, q, sc, yc, n, K, N, ncols); } break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if MR > 6
                ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
#undef ROWS
                }
            }
        }
    }
    return 0;
}

#ifdef _OPENMP
#include <omp.h>
#endif

INLINE int run(const float *x, const void *wp, int q, const float *scales, float *y,
               int M, int K, int N, int threads) {
    int blocks = (N + NB - 1) / NB, failed = 0;
    if (M <= 0 || blocks <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = blocks;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(|: failed)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        failed |= run_blocks(x, wp, q, scales, y, M, K, N, (int)((long)blocks * t / nt),
                             (int)((long)blocks * (t + 1) / nt));
    }
#else
    (void)threads;
    failed = run_blocks(x, wp, q, scales, y, M, K, N, 0, blocks);
#endif
    return failed ? -1 : 0;
}

void packed_gemm(const float *x, const float *wp, float *y, int M, int K, int N, int threads) {
    run(x, wp, W_F32, NULL, y, M, K, N, threads);   /* float weights allocate nothing */
}

/* y = x . W^T for W held in bfloat16 (see the top): float32 sums, bit for bit
 * those of packed_gemm on the same values. */
void packed_gemm_bf16(const float *x, const unsigned short *wp, float *y, int M, int K, int N, int threads) {
    run(x, wp, W_BF16, NULL, y, M, K, N, threads);
}

/* y = x . (q * scales)^T for int8 packed q (see the top). Returns 0, or -1
 * when a thread could not allocate its float copy of a block. */
int packed_gemm_i8(const float *x, const signed char *qp, const float *scales, float *y,
                   int M, int K, int N, int threads) {
    return run(x, qp, W_I8, scales, y, M, K, N, threads);
}

/* int8 steps of at least `rows` rows take the bfloat16 path from now on (0:
 * none), where the build has it (AVX512_BF16; elsewhere nothing changes); a
 * negative value only asks. Returns the setting now (0 without the path). */
int packed_gemm_set_bf16_rows(int rows) {
#if HAVE_BF16
    if (rows >= 0) bf16_rows = rows;
    return bf16_rows;
#else
    (void)rows;
    return 0;
#endif
}

int packed_gemm_has_bf16(void) { return HAVE_BF16; }

/* Output columns per packed block (the packing's NB). */
int packed_gemm_block_cols(void) { return NB; }
