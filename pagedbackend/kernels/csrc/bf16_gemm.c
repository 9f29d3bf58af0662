/* y[M, N] = x[M, K] . W[N, K]^T with x and W in bfloat16, products summed in
 * float32, y written in float32 or bfloat16 (rounded to nearest even).
 *
 * W stays in its checkpoint's layout (row-major [N, K], as torch.mm reads it),
 * so a layer holds one copy of its weight and can hand a step to torch's GEMM
 * (oneDNN) where that is faster. Three paths, by what the build's target has
 * (compiled with -march=native, see kernels/native.py) and the step's rows:
 *
 * - AMX tiles (AMX-BF16: Sapphire and Emerald Rapids), steps of at least
 *   amx_rows rows and K a multiple of 32: computes y^T = W . x^T, so that W's
 *   rows are the A tiles as they lie in memory (16 rows of 32 k, 64 bytes
 *   each) and x^T is the B tile, its k pairs interleaved once per call into
 *   [K / 2][32 rows][2] (a few hundred KB at most). A strip of 32 outputs and
 *   32 rows is 4 accumulator tiles; each 32-k step loads two A and two B
 *   tiles and issues four TDPBF16PS. Linux hands out tile state only to a
 *   process that asks (arch_prctl ARCH_REQ_XCOMP_PERM): bf16_gemm_init asks.
 * - AVX512-BF16 dot products (VDPBF16PS), otherwise: NR rows of W by MR rows
 *   of x, 32 k at a time, each output a horizontal sum at the end.
 * - Elsewhere (AVX2, or AVX-512 without BF16, or scalar), the same loop with
 *   both operands widened to float in registers (a shift, exact) and FMAs.
 *
 * Every product of two bfloat16 values is exact in float32, so the paths
 * differ from one another and from torch only in the order of the float32
 * sums (and VDPBF16PS / TDPBF16PS treat subnormal inputs as zero).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* float32 to bfloat16, to nearest even (as torch rounds; NaN stays NaN). */
INLINE uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float bf16_widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE void store_out(void *y, int out_bf16, size_t at, float v) {
    if (out_bf16) ((uint16_t *)y)[at] = bf16_round(v);
    else ((float *)y)[at] = v;
}

/* This thread's even share [*lo, *hi) of count items (inside a parallel region). */
INLINE void thread_share(int count, int *lo, int *hi) {
    int t = 0, nt = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    nt = omp_get_num_threads();
#endif
    *lo = (int)((long)count * t / nt);
    *hi = (int)((long)count * (t + 1) / nt);
}

/* ---------------------------------------------------------------- dot products */

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#define MR 6
#define NR 4
/* rows n0..n0+nr-1 of W by rows m0..m0+m-1 of x: MR x NR accumulators */
INLINE void dot_tile(const uint16_t *x, const uint16_t *w, void *y, int out_bf16, int K, int N,
                     int m0, int m, int n0, int nr) {
    __m512 acc[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 32) {
        __mmask32 mask = K - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        __m512bh wv[NR];
#pragma GCC unroll 4
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                const uint16_t *p = w + (size_t)(n0 + j) * K + k;
                __builtin_prefetch(p + 512, 0, 3);
                wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            if (r < m) {
                __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (size_t)(m0 + r) * K + k);
#pragma GCC unroll 4
                for (int j = 0; j < NR; j++)
                    if (j < nr) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
            }
        }
    }
    for (int r = 0; r < m; r++)
        for (int j = 0; j < nr; j++)
            store_out(y, out_bf16, (size_t)(m0 + r) * N + n0 + j, _mm512_reduce_add_ps(acc[r][j]));
}
#else
#define HAVE_DPBF16 0
#if defined(__AVX512F__)
#define VW 16
#define MR 4
#define NR 4
#else
#define VW 8
#define MR 3
#define NR 3
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));

/* VW bfloat16 values (those of p below `left`, zeros after) as floats */
INLINE vf load_widened(const uint16_t *p, int left) {
    vu u;
    if (left >= VW) {
        for (int i = 0; i < VW; i++) u[i] = p[i];
    } else {
        for (int i = 0; i < VW; i++) u[i] = i < left ? p[i] : 0;
    }
    return (vf)(u << 16);
}

INLINE void dot_tile(const uint16_t *x, const uint16_t *w, void *y, int out_bf16, int K, int N,
                     int m0, int m, int n0, int nr) {
    vf acc[MR][NR];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NR; j++) acc[r][j] = (vf){0};
    for (int k = 0; k < K; k += VW) {
        vf wv[NR];
        for (int j = 0; j < NR; j++) {
            if (j < nr) {
                const uint16_t *p = w + (size_t)(n0 + j) * K + k;
                __builtin_prefetch(p + 512, 0, 3);
                wv[j] = load_widened(p, K - k);
            }
        }
        for (int r = 0; r < MR; r++) {
            if (r < m) {
                vf xv = load_widened(x + (size_t)(m0 + r) * K + k, K - k);
                for (int j = 0; j < NR; j++)
                    if (j < nr) acc[r][j] += xv * wv[j];
            }
        }
    }
    for (int r = 0; r < m; r++)
        for (int j = 0; j < nr; j++) {
            float s = 0;
            for (int i = 0; i < VW; i++) s += acc[r][j][i];
            store_out(y, out_bf16, (size_t)(m0 + r) * N + n0 + j, s);
        }
}
#endif

/* Outputs n0..n1-1 of every row, by dot products. */
static void dot_columns(const uint16_t *x, const uint16_t *w, void *y, int out_bf16, int M, int K, int N,
                        int n0, int n1) {
    for (int n = n0; n < n1; n += NR) {
        int nr = n1 - n < NR ? n1 - n : NR;
        for (int m0 = 0; m0 < M; m0 += MR) {
            int m = M - m0 < MR ? M - m0 : MR;
            /* constant counts keep the accumulators in registers */
            if (nr == NR) {
                switch (m) {
#define ROWS(c) case c: dot_tile(x, w, y, out_bf16, K, N, m0, c, n, NR); break;
                ROWS(1) ROWS(2) ROWS(3)
#if MR > 3
                ROWS(4)
#endif
#if MR > 4
                ROWS(5) ROWS(6)
#endif
#undef ROWS
                }
            } else {
                dot_tile(x, w, y, out_bf16, K, N, m0, m, n, nr);
            }
        }
    }
}

/* ------------------------------------------------------- the paired layout */

/* With AVX512-BF16 and no tiles, a layer can hold its weight paired instead:
 * wp[ceil(N / 16)][K / 2][16][2] (K even; the last block's missing rows zero),
 * the two k of each output side by side, as VDPBF16PS takes them. One load
 * is then 16 outputs' next two k, and a pair of x broadcast to all lanes
 * multiplies it: every lane is one output's own sum, so no horizontal sums,
 * and a tile of PMR rows by PNB blocks keeps PMR x PNB accumulators (24 of
 * the 32 registers) in use. K goes in slices of KC (a slice of a panel is
 * PNB x KC x 32 bytes, L1-resident while each PMR-row chunk of x multiplies
 * it); the sums between slices wait in a per-thread float scratch. Panels of
 * PNB blocks are split evenly over the threads. */
#if HAVE_DPBF16
#define PAIRED 1
#define PMR 8
#define PNB 3
#define KC 256        /* k per slice (even) */
#define MC 64         /* rows of x per pass over a slice */
#define PF_PAIRS 16   /* k pairs (64-byte lines of a block) prefetched ahead */

/* s[r][j * 16 ..] += rows r of x times blocks j of w over kc k (kc even) */
INLINE void paired_tile(const uint16_t *x, int K, const uint16_t *w, size_t wstride, int kc, float *s,
                        int m, int nb, int first) {
    __m512 acc[PMR][PNB];
    for (int r = 0; r < PMR; r++)
        for (int j = 0; j < PNB; j++)
            if (r < m && j < nb)
                acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(s + (size_t)r * PNB * 16 + j * 16);
    for (int k = 0; k < kc; k += 2) {
        __m512bh wv[PNB];
#pragma GCC unroll 3
        for (int j = 0; j < PNB; j++)
            if (j < nb) {
                const uint16_t *p = w + j * wstride + (size_t)k * 16;
                __builtin_prefetch(p + PF_PAIRS * 32, 0, 3);
                wv[j] = (__m512bh)_mm512_loadu_si512(p);
            }
#pragma GCC unroll 8
        for (int r = 0; r < PMR; r++)
            if (r < m) {
                int32_t pair;
                memcpy(&pair, x + (size_t)r * K + k, sizeof pair);
                __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 3
                for (int j = 0; j < PNB; j++)
                    if (j < nb) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
            }
    }
    for (int r = 0; r < PMR; r++)
        for (int j = 0; j < PNB; j++)
            if (r < m && j < nb) _mm512_storeu_ps(s + (size_t)r * PNB * 16 + j * 16, acc[r][j]);
}

/* One tile with constant counts, so that its accumulators stay in registers. */
static void paired_tile_any(const uint16_t *x, int K, const uint16_t *w, size_t wstride, int kc, float *s,
                            int m, int nb, int first) {
    switch (nb * 16 + m) {
#define TILE(b, r) case b * 16 + r: paired_tile(x, K, w, wstride, kc, s, r, b, first); break;
#define TILES(b) TILE(b, 1) TILE(b, 2) TILE(b, 3) TILE(b, 4) TILE(b, 5) TILE(b, 6) TILE(b, 7) TILE(b, 8)
    TILES(1) TILES(2) TILES(3)
#undef TILES
#undef TILE
    }
}

/* Panels p0..p1-1 (PNB blocks of 16 outputs each) of every row. */
static void paired_panels(const uint16_t *x, const uint16_t *wp, void *y, int out_bf16, int M, int K, int N,
                          int p0, int p1) {
    float s[MC * PNB * 16] __attribute__((aligned(64)));
    int blocks = (N + 15) / 16;
    size_t wstride = (size_t)K * 16;
    for (int p = p0; p < p1; p++) {
        int b0 = p * PNB, nb = blocks - b0 < PNB ? blocks - b0 : PNB;
        const uint16_t *w = wp + (size_t)b0 * wstride;
        for (int m0 = 0; m0 < M; m0 += MC) {
            int mc = M - m0 < MC ? M - m0 : MC;
            for (int k0 = 0; k0 < K; k0 += KC) {
                int kc = K - k0 < KC ? K - k0 : KC;
                for (int r = 0; r < mc; r += PMR)
                    paired_tile_any(x + (size_t)(m0 + r) * K + k0, K, w + (size_t)k0 * 16, wstride, kc,
                                    s + (size_t)r * PNB * 16, mc - r < PMR ? mc - r : PMR, nb, k0 == 0);
            }
            int n0 = b0 * 16, cols = N - n0 < nb * 16 ? N - n0 : nb * 16;
            for (int r = 0; r < mc; r++)
                for (int c = 0; c < cols; c++)
                    store_out(y, out_bf16, (size_t)(m0 + r) * N + n0 + c, s[(size_t)r * PNB * 16 + c]);
        }
    }
}
#else
#define PAIRED 0
#endif

/* 1 where bf16_gemm_paired runs (AVX512-BF16), else 0. */
int bf16_gemm_paired_available(void) { return PAIRED; }

/* y = x . W^T with W in the paired layout above (K even); out_bf16 as
 * bf16_gemm's. Returns 0, or -1 where there is no paired path or K is odd. */
int bf16_gemm_paired(const uint16_t *x, const uint16_t *wp, void *y, int out_bf16, int M, int K, int N,
                     int threads) {
#if PAIRED
    if (K % 2) return -1;
    if (M <= 0 || N <= 0) return 0;
    if (threads < 1) threads = 1;
    int panels = ((N + 15) / 16 + PNB - 1) / PNB;
    if (threads > panels) threads = panels;
#pragma omp parallel num_threads(threads)
    {
        int p0, p1;
        thread_share(panels, &p0, &p1);
        paired_panels(x, wp, y, out_bf16, M, K, N, p0, p1);
    }
    return 0;
#else
    (void)x; (void)wp; (void)y; (void)out_bf16; (void)M; (void)K; (void)N; (void)threads;
    return -1;
#endif
}

/* ---------------------------------------------------------------- AMX tiles */

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#define HAVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_ready = 0;
/* elements (1 KB) ahead in each of a strip's 32 rows: 256-2048 elements measured within noise */
#define PREFETCH_AMX 512   /* the kernel granted tile state to this process */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

INLINE void load_tile_config(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* x [M, K] as [ceil(M / 32)][K / 2][32][2]: the B tiles' layout (rows past M zero). */
static uint16_t *pair_rows(const uint16_t *x, int M, int K) {
    int chunks = (M + 31) / 32;
    size_t words = (size_t)chunks * (K / 2) * 32;
    uint32_t *xt = aligned_alloc(64, words * 4);
    if (!xt) return NULL;
    memset(xt, 0, words * 4);
    for (int m = 0; m < M; m++) {
        const uint16_t *row = x + (size_t)m * K;
        uint32_t *out = xt + (size_t)(m / 32) * (K / 2) * 32 + (m % 32);
        for (int k2 = 0; k2 < K / 2; k2++) memcpy(out + (size_t)k2 * 32, row + 2 * k2, 4);
    }
    return (uint16_t *)xt;
}

/* Strips s0..s1-1 (32 outputs each) of every row, in tiles; this thread's
 * tile configuration is loaded. */
static void amx_strips(const uint16_t *xt, const uint16_t *w, void *y, int out_bf16, int M, int K, int N,
                       int s0, int s1) {
    float out[16][16] __attribute__((aligned(64)));
    int chunks = (M + 31) / 32;
    size_t stride_w = (size_t)K * 2;
    for (int s = s0; s < s1; s++) {
        const uint16_t *w0 = w + (size_t)s * 32 * K, *w1 = w0 + (size_t)16 * K;
        for (int c = 0; c < chunks; c++) {
            const uint16_t *xc = xt + (size_t)c * (K / 2) * 64;
            int half = M - c * 32 <= 16;   /* one B tile: rows 16..31 of the chunk are past M */
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int k = 0; k < K; k += 32) {
                if (c == 0)   /* the strip's next lines, in each row */
                    for (int i = 0; i < 32; i++)
                        __builtin_prefetch(w0 + (size_t)i * K + k + PREFETCH_AMX, 0, 3);
                _tile_loadd(4, w0 + k, stride_w);
                _tile_loadd(6, xc + (size_t)k * 32, 128);
                _tile_loadd(5, w1 + k, stride_w);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                if (!half) {
                    _tile_loadd(7, xc + (size_t)k * 32 + 32, 128);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            /* tile t holds y^T for outputs (t / 2) * 16.. and rows (t % 2) * 16.. of the chunk */
            for (int t = 0; t < 4; t++) {
                int n_base = s * 32 + (t / 2) * 16, m_base = c * 32 + (t % 2) * 16;
                if (m_base >= M) continue;
                switch (t) {
                case 0: _tile_stored(0, out, 64); break;
                case 1: _tile_stored(1, out, 64); break;
                case 2: _tile_stored(2, out, 64); break;
                default: _tile_stored(3, out, 64); break;
                }
                int mm = M - m_base < 16 ? M - m_base : 16;
                for (int r = 0; r < mm; r++) {
                    size_t at = (size_t)(m_base + r) * N + n_base;
                    if (out_bf16) {
                        uint16_t *yo = (uint16_t *)y + at;
                        for (int i = 0; i < 16; i++) yo[i] = bf16_round(out[i][r]);
                    } else {
                        float *yo = (float *)y + at;
                        for (int i = 0; i < 16; i++) yo[i] = out[i][r];
                    }
                }
            }
        }
    }
}
#else
#define HAVE_AMX 0
#endif

static int amx_rows = 4;   /* steps of at least this many rows take the tiles (0: never) */

/* Ask for the tile state (once per process). Returns 1 when the AMX path is
 * usable, 0 when the build or the kernel lacks it. */
int bf16_gemm_init(void) {
#if HAVE_AMX
    if (!amx_ready) {
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        int cpu = (d >> 22 & 1) && (d >> 24 & 1);   /* AMX-BF16, AMX-TILE */
        amx_ready = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_ready;
#else
    return 0;
#endif
}

/* 2: AMX tiles, 1: AVX512-BF16 dot products, 0: widened FMAs. */
int bf16_gemm_isa(void) {
    return bf16_gemm_init() ? 2 : HAVE_DPBF16;
}

/* Steps of at least `rows` rows take the tiles from now on (0: never); a
 * negative value only asks. Returns the setting (0 where there are no tiles). */
int bf16_gemm_set_amx_rows(int rows) {
    if (rows >= 0) amx_rows = rows;
    return bf16_gemm_init() ? amx_rows : 0;
}

/* y = x . W^T (see the top); out_bf16: y is bfloat16, else float32. Returns
 * 0, or -1 when the tiles' copy of x could not be allocated. */
int bf16_gemm(const uint16_t *x, const uint16_t *w, void *y, int out_bf16, int M, int K, int N,
              int threads) {
    if (M <= 0 || N <= 0) return 0;
    if (threads < 1) threads = 1;
#if HAVE_AMX
    if (amx_ready && amx_rows > 0 && M >= amx_rows && K % 32 == 0 && N >= 32) {
        uint16_t *xt = pair_rows(x, M, K);
        if (!xt) return -1;
        int strips = N / 32;
        if (threads > strips) threads = strips;
#pragma omp parallel num_threads(threads)
        {
            int s0, s1;
            thread_share(strips, &s0, &s1);
            load_tile_config();
            amx_strips(xt, w, y, out_bf16, M, K, N, s0, s1);
            _tile_release();
        }
        free(xt);
        if (strips * 32 < N) dot_columns(x, w, y, out_bf16, M, K, N, strips * 32, N);
        return 0;
    }
#endif
    int groups = (N + NR - 1) / NR;
    if (threads > groups) threads = groups;
#pragma omp parallel num_threads(threads)
    {
        int g0, g1;
        thread_share(groups, &g0, &g1);
        int n1 = g1 * NR < N ? g1 * NR : N;
        dot_columns(x, w, y, out_bf16, M, K, N, g0 * NR, n1);
    }
    return 0;
}
