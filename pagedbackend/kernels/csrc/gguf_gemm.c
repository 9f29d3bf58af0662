// Products with GGUF weights in their own blocks: y[M, N] = x[M, K] W^T, where
// each of W's N rows is a row of GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: 32 values per
// block; Q4_K, Q5_K, Q6_K: 256 per super-block), read where the file maps them.
// A block is widened to float32 in registers, 32 values at a time, with the
// same float operations as the reference dequantisation (gguf-py and
// transformers): the values are those, bit for bit, and x is multiplied as
// given (float32; bfloat16 rows widen exactly before the call). Each widened
// group is multiplied into up to ROW_TILE rows of x before the next is read.
// The output rows are split over OpenMP threads (torch's pool).
//
// Where the CPU has AVX-512 (see the AVX-512 section) blocks decode straight
// into registers and several weight rows run at once; elsewhere (and when
// gguf_gemm_avx512(0) asks for it) the portable loop rows_tile runs, built
// three times on x86-64 (AVX-512, AVX2 with FMA, and baseline SSE2) for the
// CPU to pick one when the library loads (target_clones). Built with
// -ffp-contract=off (native.EXTRA_FLAGS): no product of the dequantisation
// fuses with its add or subtract.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define ROW_TILE 8
#define GROUP 32

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(NO_RUNTIME_DISPATCH)
#define DISPATCH __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DISPATCH
#endif

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {   // subnormal: normalise
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Block sizes: (values, bytes).
static int block_values(int type) { return type >= T_Q4_K ? 256 : 32; }
static int block_bytes(int type) {
    switch (type) {
        case T_Q4_0: return 18;
        case T_Q4_1: return 20;
        case T_Q5_0: return 22;
        case T_Q5_1: return 24;
        case T_Q8_0: return 34;
        case T_Q4_K: return 144;
        case T_Q5_K: return 176;
        case T_Q6_K: return 210;
        default: return 0;
    }
}

// Panels (see "int8 activations on panels"): weight rows per panel, and x
// rows run over a panel at once.
#define PANEL 16
#define PANEL_X 8
// A Q4_K panel super-block: 8 groups of values (256 bytes each, as Q4_0's), d
// and dmin (float16) at PANEL_K_D, then the 8 groups' 6-bit scales and minimums
// (a byte a row each: [group][row]) at PANEL_K_SC and PANEL_K_SC + 128.
#define PANEL_K_D (8 * 256)
#define PANEL_K_SC (PANEL_K_D + 4 * PANEL)
// A Q6_K panel super-block: 8 groups of 384 bytes (the low 4 bits of each value
// as Q4_0 pairs them, then 128 bytes of their top 2 bits: lane j of the first
// 64 holds, in byte t, bits 4-5 of values t, 4 + t, 8 + t, 12 + t of row j at
// bits 0-1, 2-3, 4-5, 6-7; the next 64 those of values 16 + t ..), the 16
// scales of each row (int8: [half of 16][row]) at PANEL_6_SC, d (float16) at
// PANEL_6_D: 3,360 bytes, as many as the 16 rows' blocks.
#define PANEL_6_SC (8 * 384)
#define PANEL_6_D (PANEL_6_SC + 16 * PANEL)
// A Q5_K panel super-block: as Q4_K's, each group's 256 bytes of low 4 bits
// followed by 64 of their fifth bits (lane j holds, in byte t, those of values
// t, 4 + t, 8 + t, 12 + t of row j at bits 0-3 and of 16 + t .. 28 + t at bits
// 4-7); d and dmin at PANEL_5_D, the scales and minimums at PANEL_5_SC: 2,880
// bytes for the 16 rows' 2,816.
#define PANEL_5_GROUP 320
#define PANEL_5_D (8 * PANEL_5_GROUP)
#define PANEL_5_SC (PANEL_5_D + 4 * PANEL)

static int panel_type(int type) {
    return type == T_Q8_0 || type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}
// Q5_0 and Q5_1 panels: Q4_0's and Q4_1's 256 bytes, then 64 of fifth bits as Q5_K's (PANEL_5_GROUP).
static int64_t panel_values_bytes(int type) {
    return type == T_Q8_0 ? 512 : type == T_Q5_0 || type == T_Q5_1 ? 320 : 256;
}
int64_t gguf_panel_bytes(int type, int64_t rows, int64_t K);
// Bytes of a panel's group of 32 columns (32-value types) or super-block of 256 (K-quants).
static int64_t panel_group_bytes(int type) {
    if (type == T_Q4_K) return PANEL_K_SC + 2 * 8 * PANEL;
    if (type == T_Q5_K) return PANEL_5_SC + 2 * 8 * PANEL;
    if (type == T_Q6_K) return PANEL_6_D + 2 * PANEL;
    return panel_values_bytes(type) + 2 * PANEL + (type == T_Q4_1 || type == T_Q5_1 ? 2 * PANEL : 0);
}


static inline void scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// scale_min_k4 for all 8 groups at once, from the 12 bytes at s: out holds
// the 8 scales in bytes 0..7 and the 8 minimums in bytes 8..15.
static inline void scales_mins_k4(const uint8_t *s, uint32_t out[4]) {
    memcpy(out, s, 12);
    out[3] = ((out[2] >> 4) & 0x0f0f0f0fu) | (((out[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_lo = out[1] & 0x3f3f3f3fu;
    out[1] = (out[2] & 0x0f0f0f0fu) | (((out[0] >> 6) & 0x03030303u) << 4);
    out[2] = mins_lo;
    out[0] &= 0x3f3f3f3fu;
}

// The 32 values of group g (0..7 in a super-block; 0 for 32-value blocks) of block b.
static inline void widen(int type, const uint8_t *b, int g, float *restrict w) {
    switch (type) {
        case T_Q8_0: {
            const float d = half_to_float(b);
            const int8_t *q = (const int8_t *)(b + 2);
            for (int i = 0; i < 32; i++) w[i] = (float)q[i] * d;
            break;
        }
        case T_Q4_0: {
            const float d = half_to_float(b);
            const uint8_t *q = b + 2;
            for (int i = 0; i < 16; i++) {
                w[i] = d * (float)((int)(q[i] & 0xF) - 8);
                w[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
            }
            break;
        }
        case T_Q4_1: {
            const float d = half_to_float(b), m = half_to_float(b + 2);
            const uint8_t *q = b + 4;
            for (int i = 0; i < 16; i++) {
                w[i] = d * (float)(q[i] & 0xF) + m;
                w[i + 16] = d * (float)(q[i] >> 4) + m;
            }
            break;
        }
        case T_Q5_0:
        case T_Q5_1: {   // d * (q - 16); d * q + m: q's fifth bit for value i is bit i of qh
            const float d = half_to_float(b), m = type == T_Q5_1 ? half_to_float(b + 2) : 0.0f;
            const uint8_t *qh = b + (type == T_Q5_0 ? 2 : 4), *q = qh + 4;
            const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
            for (int i = 0; i < 32; i++) {
                const int v = ((i < 16 ? q[i] : q[i - 16] >> 4) & 0xF) | (int)((h >> i) & 1) << 4;
                w[i] = type == T_Q5_0 ? d * (float)(v - 16) : d * (float)v + m;
            }
            break;
        }
        case T_Q4_K:
        case T_Q5_K: {
            uint8_t sc, mn;
            scale_min_k4(b + 4, g, &sc, &mn);
            const float ds = half_to_float(b) * (float)sc, dm = half_to_float(b + 2) * (float)mn;
            const int shift = 4 * (g & 1);
            if (type == T_Q4_K) {
                const uint8_t *q = b + 16 + 32 * (g >> 1);
                for (int i = 0; i < 32; i++) w[i] = ds * (float)((q[i] >> shift) & 0xF) - dm;
            } else {
                const uint8_t *qh = b + 16, *q = b + 48 + 32 * (g >> 1);
                for (int i = 0; i < 32; i++)
                    w[i] = ds * (float)(((q[i] >> shift) & 0xF) | (((qh[i] >> g) & 1) << 4)) - dm;
            }
            break;
        }
        case T_Q6_K: {
            const float d = half_to_float(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            const int h = g >> 2, k = g & 3;   // half of 128 values, quarter of it
            const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
            const int lshift = 4 * (k >> 1), hshift = 2 * k;
            const float s0 = d * (float)sc[2 * g], s1 = d * (float)sc[2 * g + 1];
            for (int i = 0; i < 32; i++) {
                int q = (((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32;
                w[i] = (i < 16 ? s0 : s1) * (float)q;
            }
            break;
        }
    }
}

// y[m0 .. m0 + rows, n0 .. n1) for output rows n0..n1 of one part (rows <= ROW_TILE):
// W row n is part row map[n] (map NULL: n), and lands in y's column y0 + n.
DISPATCH
static void rows_tile(int type, const float *x, int64_t K, const uint8_t *w, const int64_t *map,
                      float *y, int64_t ldy, int64_t y0, int64_t m0, int rows, int64_t n0, int64_t n1) {
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    const int64_t blocks = K / bv, row_bytes = blocks * bb;
    float wv[GROUP] __attribute__((aligned(64)));
    float acc[ROW_TILE][GROUP] __attribute__((aligned(64)));
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + (map ? map[n] : n) * row_bytes;
        memset(acc, 0, sizeof(acc));
        for (int64_t blk = 0; blk < blocks; blk++) {
            const uint8_t *b = row + blk * bb;
            for (int g = 0; g < groups; g++) {
                widen(type, b, g, wv);
                const int64_t col = blk * bv + g * GROUP;
                for (int r = 0; r < rows; r++) {
                    const float *xr = x + (m0 + r) * K + col;
                    for (int i = 0; i < GROUP; i++) acc[r][i] += wv[i] * xr[i];
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            float s = 0.0f;
            for (int i = 0; i < GROUP; i++) s += acc[r][i];
            y[(m0 + r) * ldy + y0 + n] = s;
        }
    }
}

// ---------------------------------------------------------------- AVX-512
// Where the CPU has AVX-512 (BW, VL) with F16C and FMA, each block is decoded
// straight into registers, 16 values to a register: Q8_0's and Q6_K's quants
// widened to int32 (vpmovsxbd) and converted, then multiplied by the block's
// scale; a 4-bit type's 16 (Q5_K: 32) possible weights of a group computed
// from the scales, then looked up by each quant (vpermps). Every weight is the
// reference's own operations (multiply, then add or subtract), each rounded
// alone (the file is built with -ffp-contract=off: none fuses into an FMA). fp16
// scales convert with F16C, which is exact (subnormals included). WR weight
// rows are decoded together and each decoded register is multiplied into up
// to R rows of x with FMAs into R x WR accumulators, summed across lanes once
// at the end. A task's weight rows are read from memory once: every tile of x
// rows runs over a group of WR rows while they are still in cache.
#if defined(__x86_64__) && defined(__GNUC__) && (!defined(NO_RUNTIME_DISPATCH) || defined(__AVX512BW__))
#define HAVE_AVX512 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define INLINE512 static inline __attribute__((always_inline)) AVX512
#define WR_MAX 4                // weight rows decoded together


INLINE512 float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// float(q) for 16 signed bytes.
INLINE512 __m512 i8_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }

// The 32 five-bit values of a Q5_0 / Q5_1 block from its qh (4 bytes) and
// the 16 bytes of nibbles after it: value i in byte i.
INLINE512 __m256i q5_values(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m128i q = _mm_loadu_si128((const __m128i *)(qh + 4));
    const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    return _mm256_or_si256(v, _mm256_and_si256(_mm256_movm_epi8((__mmask32)h), _mm256_set1_epi8(16)));
}

// A block's (super-block's) scales that its groups share: for Q4_K/Q5_K the 8
// d * sc and dmin * m of scale_min_k4; for Q6_K the 16 d * sc.
typedef struct { float s[16], m[8]; } scales_t;

INLINE512 void block_scales(const int type, const uint8_t *b, scales_t *out) {
    if (type == T_Q4_K || type == T_Q5_K) {
        uint32_t u[4];
        scales_mins_k4(b + 4, u);
        const __m128i v = _mm_loadu_si128((const __m128i *)u);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
        _mm256_storeu_ps(out->s, _mm256_mul_ps(_mm256_set1_ps(h2f(b)), sc));
        _mm256_storeu_ps(out->m, _mm256_mul_ps(_mm256_set1_ps(h2f(b + 2)), mn));
    } else if (type == T_Q6_K) {
        const __m512 sc = i8_ps(_mm_loadu_si128((const __m128i *)(b + 192)));
        _mm512_storeu_ps(out->s, _mm512_mul_ps(_mm512_set1_ps(h2f(b + 208)), sc));
    }
}

// Values 0..15 (lo) and 16..31 (hi) of group g of block b, as widen() gives them.
INLINE512 void decode(const int type, const uint8_t *b, const int g, const scales_t *sc, __m512 *lo, __m512 *hi) {
    // 0..15: a 4-bit type's 16 possible weights are computed once per group,
    // with the reference's operations, and each value looked up (vpermps reads
    // the low 4 bits of each index, so no mask is needed).
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    switch (type) {
        case T_Q8_0: {
            const __m512 d = _mm512_set1_ps(h2f(b));
            *lo = _mm512_mul_ps(i8_ps(_mm_loadu_si128((const __m128i *)(b + 2))), d);
            *hi = _mm512_mul_ps(i8_ps(_mm_loadu_si128((const __m128i *)(b + 18))), d);
            break;
        }
        case T_Q4_0: {   // d * (q - 8)
            const __m512 t = _mm512_mul_ps(_mm512_set1_ps(h2f(b)), _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
            *lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), t);
            *hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(q, 4)), t);
            break;
        }
        case T_Q4_1: {   // d * q + m
            const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(h2f(b)), iota), _mm512_set1_ps(h2f(b + 2)));
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
            *lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), t);
            *hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(q, 4)), t);
            break;
        }
        case T_Q5_0:
        case T_Q5_1: {   // d * (q - 16); d * q + m: two tables of 16, bit i of qh the fifth bit of value i
            const __m512 d = _mm512_set1_ps(h2f(b));
            __m512 t0, t1;
            if (type == T_Q5_0) {
                t0 = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f)));
                t1 = _mm512_mul_ps(d, iota);
            } else {
                const __m512 m = _mm512_set1_ps(h2f(b + 2));
                t0 = _mm512_add_ps(_mm512_mul_ps(d, iota), m);
                t1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.0f))), m);
            }
            const __m256i v = q5_values(b + (type == T_Q5_0 ? 2 : 4));
            *lo = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)), t1);
            *hi = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)), t1);
            break;
        }
        case T_Q4_K: {   // d * sc * q - dmin * m
            const __m512 t = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(sc->s[g]), iota), _mm512_set1_ps(sc->m[g]));
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (g >> 1)));
            if (g & 1) v = _mm256_srli_epi16(v, 4);
            *lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)), t);
            *hi = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)), t);
            break;
        }
        case T_Q5_K: {   // as Q4_K, bit g of qh is bit 4 of q: 32 values, two tables
            const __m512 ds = _mm512_set1_ps(sc->s[g]), dm = _mm512_set1_ps(sc->m[g]);
            const __m512 t0 = _mm512_sub_ps(_mm512_mul_ps(ds, iota), dm);
            const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(ds, _mm512_add_ps(iota, _mm512_set1_ps(16.0f))), dm);
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (g >> 1)));
            v = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), bit = _mm256_set1_epi8(1 << g);
            v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                    _mm256_set1_epi8(16)));
            *lo = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)), t1);
            *hi = _mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)), t1);
            break;
        }
        case T_Q6_K: {
            const int h = g >> 2, k = g & 3;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (k & 1)));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i l = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0f));
            // bits 2k, 2k+1 of qh as bits 4, 5
            const __m256i hb = 2 * k <= 4 ? _mm256_slli_epi16(qh, 4 - 2 * k) : _mm256_srli_epi16(qh, 2 * k - 4);
            const __m256i v = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_and_si256(hb, _mm256_set1_epi8(0x30))),
                                              _mm256_set1_epi8(32));
            *lo = _mm512_mul_ps(_mm512_set1_ps(sc->s[2 * g]), i8_ps(_mm256_castsi256_si128(v)));
            *hi = _mm512_mul_ps(_mm512_set1_ps(sc->s[2 * g + 1]), i8_ps(_mm256_extracti128_si256(v, 1)));
            break;
        }
    }
}

// out[r * WR + i] = x row r . weight row i over K, for R rows of x (stride K)
// and the WR rows wr[i] of type; next[i]: the rows the following call reads
// (prefetched one group ahead: 1.2-2x the GB/s of no prefetch at one row of x
// over weights larger than the cache, AMD Zen 4).
INLINE512 void tile512(const int type, const int WR, const int R, const uint8_t *const *wr,
                       const uint8_t *const *next, const float *x, int64_t K, float *out) {
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    __m512 acc[WR_MAX * ROW_TILE];
    for (int i = 0; i < WR * R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < K / bv; blk++) {
        const int64_t off = blk * bb;
        scales_t sc[WR_MAX];
        for (int i = 0; i < WR; i++) {
            // the next group's block at this offset: one group ahead of its decode
            for (int p = 0; p < bb; p += 64) _mm_prefetch((const char *)next[i] + off + p, _MM_HINT_T0);
            block_scales(type, wr[i] + off, &sc[i]);
        }
#pragma GCC unroll 8
        for (int g = 0; g < groups; g++) {
            __m512 lo[WR_MAX], hi[WR_MAX];
#pragma GCC unroll 4
            for (int i = 0; i < WR; i++) decode(type, wr[i] + off, g, &sc[i], &lo[i], &hi[i]);
            const float *xc = x + blk * bv + g * GROUP;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m512 x0 = _mm512_loadu_ps(xc + r * K), x1 = _mm512_loadu_ps(xc + r * K + 16);
#pragma GCC unroll 4
                for (int i = 0; i < WR; i++) {
                    acc[r * WR + i] = _mm512_fmadd_ps(lo[i], x0, acc[r * WR + i]);
                    acc[r * WR + i] = _mm512_fmadd_ps(hi[i], x1, acc[r * WR + i]);
                }
            }
        }
    }
    for (int i = 0; i < WR * R; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

// The K values of a weight row, widened (gguf_get_rows).
INLINE512 void widen512(const int type, const uint8_t *row, int64_t K, float *out) {
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    for (int64_t blk = 0; blk < K / bv; blk++) {
        scales_t sc;
        block_scales(type, row + blk * bb, &sc);
        for (int g = 0; g < groups; g++) {
            __m512 lo, hi;
            decode(type, row + blk * bb, g, &sc, &lo, &hi);
            _mm512_storeu_ps(out + blk * bv + g * GROUP, lo);
            _mm512_storeu_ps(out + blk * bv + g * GROUP + 16, hi);
        }
    }
}

// One instance per type, weight rows together and x rows (all constants, so
// the accumulators stay in registers): 4 weight rows by 1..4 x rows, 2 by 5..8.
#define TILE_R(type, WR, R) case R: tile512(type, WR, R, wr, next, x, K, out); break;
#define TILE_TYPE(type)                                                                     \
    static AVX512 void tile_##type(int rows, const uint8_t *const *wr, const uint8_t *const *next, const float *x, \
                                   int64_t K, float *out) {                                 \
        switch (rows) {                                                                     \
            TILE_R(type, 4, 1) TILE_R(type, 4, 2) TILE_R(type, 4, 3) TILE_R(type, 4, 4)     \
            TILE_R(type, 2, 5) TILE_R(type, 2, 6) TILE_R(type, 2, 7) TILE_R(type, 2, 8)     \
        }                                                                                   \
    }                                                                                       \
    static AVX512 void widen_##type(const uint8_t *row, int64_t K, float *out) { widen512(type, row, K, out); }
TILE_TYPE(T_Q8_0)
TILE_TYPE(T_Q4_0)
TILE_TYPE(T_Q4_1)
TILE_TYPE(T_Q5_0)
TILE_TYPE(T_Q5_1)
TILE_TYPE(T_Q4_K)
TILE_TYPE(T_Q5_K)
TILE_TYPE(T_Q6_K)
#define BY_TYPE(type, CALL)                                                                  \
    switch (type) {                                                                          \
        case T_Q8_0: CALL(T_Q8_0); break;                                                    \
        case T_Q4_0: CALL(T_Q4_0); break;                                                    \
        case T_Q4_1: CALL(T_Q4_1); break;                                                    \
        case T_Q5_0: CALL(T_Q5_0); break;                                                    \
        case T_Q5_1: CALL(T_Q5_1); break;                                                    \
        case T_Q4_K: CALL(T_Q4_K); break;                                                    \
        case T_Q5_K: CALL(T_Q5_K); break;                                                    \
        case T_Q6_K: CALL(T_Q6_K); break;                                                    \
    }

static void widen_row512(int type, const uint8_t *row, int64_t K, float *out) {
#define WIDEN_CALL(t) widen_##t(row, K, out)
    BY_TYPE(type, WIDEN_CALL)
}

// y[0 .. M, y0 + n0 .. y0 + n1) of one part (as rows_tile, all rows of x): 4
// weight rows at a time (the last group repeats its last row, not stored twice),
// each run over every tile of x rows.
static AVX512 void rows_avx512(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, const int64_t *map,
                               float *y, int64_t ldy, int64_t y0, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / block_values(type) * block_bytes(type);
    for (int64_t n = n0; n < n1; n += WR_MAX) {
        const uint8_t *wr[2 * WR_MAX];   // this group's rows, then the next group's (prefetched)
        for (int i = 0; i < 2 * WR_MAX; i++) {
            const int64_t row = n + i < n1 ? n + i : n1 - 1;
            wr[i] = w + (map ? map[row] : row) * row_bytes;
        }
        for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
            const int rows = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            const int per = rows <= 4 ? 4 : 2;   // weight rows per call: 4 for 1..4 x rows, 2 for 5..8
            for (int h = 0; h < WR_MAX; h += per) {
                float out[WR_MAX * ROW_TILE];
                const uint8_t *const *part = wr + h;
                const float *xt = x + m0 * K;
#define TILE_CALL(t) tile_##t(rows, part, part + WR_MAX, xt, K, out)
                BY_TYPE(type, TILE_CALL)
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < per && n + h + i < n1; i++)
                        y[(m0 + r) * ldy + y0 + n + h + i] = out[r * per + i];
            }
        }
    }
}

// ---------------------------------------------------------------- int8 activations
// As llama.cpp multiplies quantised weights: each x row is rounded to int8 in
// groups of 32 (symmetric, x ~= dx * v, dx = max|x| / 127, v = rint(x / dx)
// computed as x * (1 / dx)), and each group's product with a weight group is
// an integer dot product (VNNI vpdpbusd: unsigned weight values u times signed
// v, exact in int32), scaled in float32. A weight group is w = a * u + c: Q8_0
// u = q + 128 (its sign bit flipped), c = -128 a; Q4_0 c = -8 a; Q5_0 u its five
// bits, c = -16 a; Q6_K u its six bits, c = -32 a per half of 16; those
// constant offsets enter the integer sum as -c/a * sum(v) (in lane 0, or lanes
// 0 and 4 for Q6_K's halves). Q4_1, Q5_1, Q4_K and Q5_K's minimums add
// c * dx * sum(v) in float32.
#define AVX512Q __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define INLINEQ static inline __attribute__((always_inline)) AVX512Q

// One x row rounded: v[K], per group of 32 dx and dx * sum(v), per half of 16 sum(v).
typedef struct { const int8_t *v; const float *dx, *dxs; const int32_t *s16; } xq_t;

static AVX512Q void quantize_row_q8(const float *x, int64_t K, int8_t *v, float *dx, float *dxs, int32_t *s16) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(v + g * GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(v + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        const int32_t sa = _mm512_reduce_add_epi32(qa), sb = _mm512_reduce_add_epi32(qb);
        s16[2 * g] = sa;
        s16[2 * g + 1] = sb;
        dx[g] = d;
        dxs[g] = d * (float)(sa + sb);
    }
}

// The sum of a register's 8 floats.
INLINEQ float sum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// The unsigned values u of group g of block b (32 bytes, value i in byte i).
INLINEQ __m256i unsigned_values(const int type, const uint8_t *b, const int g) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    switch (type) {
        case T_Q8_0:
            return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
        case T_Q4_0:
        case T_Q4_1: {
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + (type == T_Q4_0 ? 2 : 4)));
            const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
            return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        }
        case T_Q5_0:
        case T_Q5_1:
            return q5_values(b + (type == T_Q5_0 ? 2 : 4));
        case T_Q4_K: {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (g >> 1)));
            return _mm256_and_si256(g & 1 ? _mm256_srli_epi16(v, 4) : v, low4);
        }
        case T_Q5_K: {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (g >> 1)));
            v = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(v, 4) : v, low4);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)), bit = _mm256_set1_epi8((char)(1 << g));
            return _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                       _mm256_set1_epi8(16)));
        }
        default: {   // T_Q6_K
            const int h = g >> 2, k = g & 3;
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (k & 1)));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i l = _mm256_and_si256(k >> 1 ? _mm256_srli_epi16(ql, 4) : ql, low4);
            const __m256i hb = 2 * k <= 4 ? _mm256_slli_epi16(qh, 4 - 2 * k) : _mm256_srli_epi16(qh, 2 * k - 4);
            return _mm256_or_si256(l, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
        }
    }
}

// out[r * WR + i] = x row r . weight row i over K (R rows of x, WR of W), int8 x.
INLINEQ void tile_q8(const int type, const int WR, const int R, const uint8_t *const *wr,
                     const uint8_t *const *next, const xq_t *xs, int64_t K, float *out) {
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    const int offset = type == T_Q8_0 ? 128 : type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q6_K ? 32 : 0;
    const int has_min = type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
    __m256 acc[WR_MAX * 4];
    float corr[WR_MAX * 4];
    for (int i = 0; i < WR * R; i++) {
        acc[i] = _mm256_setzero_ps();
        corr[i] = 0.0f;
    }
    for (int64_t blk = 0; blk < K / bv; blk++) {
        const int64_t off = blk * bb;
        scales_t sc[WR_MAX];
        for (int i = 0; i < WR; i++) {
            for (int p = 0; p < bb; p += 64) _mm_prefetch((const char *)next[i] + off + p, _MM_HINT_T0);
            if (type >= T_Q4_K) block_scales(type, wr[i] + off, &sc[i]);
        }
#pragma GCC unroll 8
        for (int g = 0; g < groups; g++) {
            const int64_t gi = blk * groups + g;
            __m256i u[WR_MAX];
            __m256 a[WR_MAX];
            float c[WR_MAX];
#pragma GCC unroll 4
            for (int i = 0; i < WR; i++) {
                const uint8_t *b = wr[i] + off;
                u[i] = unsigned_values(type, b, g);
                if (type == T_Q6_K) {
                    a[i] = _mm256_insertf128_ps(_mm256_set1_ps(sc[i].s[2 * g]), _mm_set1_ps(sc[i].s[2 * g + 1]), 1);
                } else if (type >= T_Q4_K) {
                    a[i] = _mm256_set1_ps(sc[i].s[g]);
                    c[i] = -sc[i].m[g];
                } else {
                    a[i] = _mm256_set1_ps(h2f(b));
                    if (type == T_Q4_1 || type == T_Q5_1) c[i] = h2f(b + 2);
                }
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(xs[r].v + gi * GROUP));
                __m256i init = _mm256_setzero_si256();
                if (type == T_Q6_K)
                    init = _mm256_setr_epi32(-32 * xs[r].s16[2 * gi], 0, 0, 0, -32 * xs[r].s16[2 * gi + 1], 0, 0, 0);
                else if (offset)
                    init = _mm256_setr_epi32(-offset * (xs[r].s16[2 * gi] + xs[r].s16[2 * gi + 1]), 0, 0, 0, 0, 0, 0, 0);
                const __m256 dx = _mm256_set1_ps(xs[r].dx[gi]);
#pragma GCC unroll 4
                for (int i = 0; i < WR; i++) {
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(init, u[i], v));
                    acc[r * WR + i] = _mm256_fmadd_ps(dot, _mm256_mul_ps(a[i], dx), acc[r * WR + i]);
                    if (has_min) corr[r * WR + i] += c[i] * xs[r].dxs[gi];
                }
            }
        }
    }
    for (int i = 0; i < WR * R; i++) out[i] = sum8(acc[i]) + corr[i];
}

#define TILEQ_R(type, R) case R: tile_q8(type, WR_MAX, R, wr, next, xs, K, out); break;
#define TILEQ_TYPE(type)                                                                    \
    static AVX512Q void tileq_##type(int rows, const uint8_t *const *wr, const uint8_t *const *next, \
                                     const xq_t *xs, int64_t K, float *out) {                \
        switch (rows) { TILEQ_R(type, 1) TILEQ_R(type, 2) TILEQ_R(type, 3) TILEQ_R(type, 4) } \
    }
TILEQ_TYPE(T_Q8_0)
TILEQ_TYPE(T_Q4_0)
TILEQ_TYPE(T_Q4_1)
TILEQ_TYPE(T_Q5_0)
TILEQ_TYPE(T_Q5_1)
TILEQ_TYPE(T_Q4_K)
TILEQ_TYPE(T_Q5_K)
TILEQ_TYPE(T_Q6_K)

// As rows_avx512, with x rounded to int8 (xs: its M rows): 4 weight rows by up to 4 x rows.
static AVX512Q void rows_q8(int type, const xq_t *xs, int64_t M, int64_t K, const uint8_t *w, const int64_t *map,
                            float *y, int64_t ldy, int64_t y0, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / block_values(type) * block_bytes(type);
    for (int64_t n = n0; n < n1; n += WR_MAX) {
        const uint8_t *wr[2 * WR_MAX];
        for (int i = 0; i < 2 * WR_MAX; i++) {
            const int64_t row = n + i < n1 ? n + i : n1 - 1;
            wr[i] = w + (map ? map[row] : row) * row_bytes;
        }
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int rows = (int)(M - m0 < 4 ? M - m0 : 4);
            float out[WR_MAX * 4];
#define TILEQ_CALL(t) tileq_##t(rows, wr, wr + WR_MAX, xs + m0, K, out)
            BY_TYPE(type, TILEQ_CALL)
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < WR_MAX && n + i < n1; i++) y[(m0 + r) * ldy + y0 + n + i] = out[r * WR_MAX + i];
        }
    }
}

// K-quants against x rounded per super-block of 256 (one scale a row per
// super-block, as llama.cpp's Q8_K): a group's integer dot products are
// weighted by its integer scale in int32 (vpmaddubsw, then vpdpwssd with the
// scale), so a super-block needs one float multiply-add per x row. A weight
// super-block is decoded once for every x row of the call (up to XK_ROWS at a
// time). The minimums (Q4_K, Q5_K: - dmin m_g per group of 32) and Q6_K's
// offset (- 32 d sc_h per half of 16) are summed once per weight row and x row
// as a float dot product over K / 32 (K / 16) values: the weight row's
// offsets times the x row's dx * sum(v) of each group (half).
typedef struct { const int8_t *v; const float *d, *e32, *e16; const int32_t *s16; } xk_t;
#define XK_ROWS 64

static AVX512Q void quantize_row_q8k(const float *x, int64_t K, int8_t *v, float *d, float *e32, float *e16,
                                     int32_t *s16) {
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const float *xs = x + sb * 256;
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < 256; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xs + i)));
        const float dd = _mm512_reduce_max_ps(amax) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        for (int i = 0; i < 256; i += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xs + i), _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(v + sb * 256 + i), _mm512_cvtsepi32_epi8(q));
            const int32_t sum = _mm512_reduce_add_epi32(q);
            e16[sb * 16 + i / 16] = dd * (float)sum;
            s16[sb * 16 + i / 16] = sum;
            if (i % 32 == 0) e32[sb * 8 + i / 32] = (float)sum;
            else e32[sb * 8 + i / 32] = dd * (e32[sb * 8 + i / 32] + (float)sum);
        }
        d[sb] = dd;
    }
}

// y[m0 + r, col] = x row m0 + r . weight row b over K, for rows x rows; offs:
// scratch for the row's K / 16 offsets.
INLINEQ void rowk(const int type, const int64_t rows, const uint8_t *b, const uint8_t *next, const xk_t *xs,
                  int64_t K, float *y, int64_t ldy, float *offs) {
    const int bb = block_bytes(type);
    __m256 acc[XK_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < K / 256; sb++, b += bb) {
        for (int p = 0; p < bb; p += 64) _mm_prefetch((const char *)next + sb * bb + p, _MM_HINT_T0);
        __m256i sc[8], u[8];
        float d;
        if (type == T_Q6_K) {
            d = h2f(b + 208);
            const int8_t *s8 = (const int8_t *)(b + 192);
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++)   // int16 lanes 0..7 (values 0..15) scale 2g, lanes 8..15 scale 2g + 1
                sc[g] = _mm256_inserti128_si256(_mm256_set1_epi16(s8[2 * g]), _mm_set1_epi16(s8[2 * g + 1]), 1);
            _mm512_storeu_ps(offs + sb * 16, _mm512_mul_ps(_mm512_set1_ps(-32.0f * d),
                                                         i8_ps(_mm_loadu_si128((const __m128i *)s8))));
        } else {
            d = h2f(b);
            uint32_t w4[4];
            scales_mins_k4(b + 4, w4);
            const uint8_t *s8 = (const uint8_t *)w4;   // 8 scales, then 8 minimums
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) sc[g] = _mm256_set1_epi16((short)s8[g]);
            const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s8 + 8))));
            _mm256_storeu_ps(offs + sb * 8, _mm256_mul_ps(_mm256_set1_ps(-h2f(b + 2)), mins));
        }
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) u[g] = unsigned_values(type, b, g);
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *v = xs[r].v + sb * 256;
            __m256i part[4];   // four sums, so that no chain of dependent products is longer than two
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m256i p = _mm256_maddubs_epi16(u[g], _mm256_loadu_si256((const __m256i *)(v + 32 * g)));
                part[g & 3] = g < 4 ? _mm256_madd_epi16(p, sc[g]) : _mm256_dpwssd_epi32(part[g & 3], p, sc[g]);
            }
            const __m256i isum = _mm256_add_epi32(_mm256_add_epi32(part[0], part[1]), _mm256_add_epi32(part[2], part[3]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * xs[r].d[sb]), acc[r]);
        }
    }
    const int64_t n_offs = type == T_Q6_K ? K / 16 : K / 32;
    for (int64_t r = 0; r < rows; r++) {
        const float *e = type == T_Q6_K ? xs[r].e16 : xs[r].e32;
        __m512 o = _mm512_setzero_ps();
        for (int64_t i = 0; i < n_offs; i += 16) {
            const __mmask16 k = n_offs - i >= 16 ? 0xffff : (__mmask16)((1u << (n_offs - i)) - 1);
            o = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, offs + i), _mm512_maskz_loadu_ps(k, e + i), o);
        }
        y[r * ldy] = sum8(acc[r]) + _mm512_reduce_add_ps(o);
    }
}

static AVX512Q void rowk_q4k(int64_t rows, const uint8_t *b, const uint8_t *next, const xk_t *xs, int64_t K,
                             float *y, int64_t ldy, float *offs) { rowk(T_Q4_K, rows, b, next, xs, K, y, ldy, offs); }
static AVX512Q void rowk_q5k(int64_t rows, const uint8_t *b, const uint8_t *next, const xk_t *xs, int64_t K,
                             float *y, int64_t ldy, float *offs) { rowk(T_Q5_K, rows, b, next, xs, K, y, ldy, offs); }
static AVX512Q void rowk_q6k(int64_t rows, const uint8_t *b, const uint8_t *next, const xk_t *xs, int64_t K,
                             float *y, int64_t ldy, float *offs) { rowk(T_Q6_K, rows, b, next, xs, K, y, ldy, offs); }

static AVX512Q void rows_k(int type, const xk_t *xs, int64_t M, int64_t K, const uint8_t *w, const int64_t *map,
                           float *y, int64_t ldy, int64_t y0, int64_t n0, int64_t n1) {
    const int64_t row_bytes = K / 256 * block_bytes(type);
    float *offs = malloc((size_t)(K / 16) * sizeof(float));
    if (!offs) return;   // (the caller's buffers are far larger: not reached in practice)
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *b = w + (map ? map[n] : n) * row_bytes;
        const int64_t after = n + 1 < n1 ? n + 1 : n;
        const uint8_t *next = w + (map ? map[after] : after) * row_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += XK_ROWS) {
            const int64_t rows = M - m0 < XK_ROWS ? M - m0 : XK_ROWS;
            float *out = y + m0 * ldy + y0 + n;
            if (type == T_Q4_K) rowk_q4k(rows, b, next, xs + m0, K, out, ldy, offs);
            else if (type == T_Q5_K) rowk_q5k(rows, b, next, xs + m0, K, out, ldy, offs);
            else rowk_q6k(rows, b, next, xs + m0, K, out, ldy, offs);
        }
    }
    free(offs);
}

// ---------------------------------------------------------------- int8 activations on panels
// A part's weight rows (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; Q4_K, Q5_K and Q6_K
// below, with their layouts beside PANEL_K_D, PANEL_5_GROUP and PANEL_6_SC) copied at load into panels of PANEL
// rows, so that one 512-bit register holds 4 consecutive values of each of 16
// rows: vpdpbusd with 4 bytes of an x row broadcast adds that x group's
// products into 16 outputs at once, with no sums across lanes, and a group's
// scaling is one multiply-add per 16 outputs (the layout of llama.cpp's
// repacked Q4_0 GEMMs). For each group of 32 input columns a panel holds the
// values, then the 16 rows' d (float16), then (Q4_1, Q5_1) their m:
// - Q8_0, 8 registers: lane j of register c holds u = q + 128 of row j's
//   values 4c .. 4c + 3;
// - Q4_0, Q4_1, 4 registers: lane j of register k holds bytes 4k .. 4k + 3 of
//   row j's 16 bytes of nibbles, as the block stores them: the low nibbles are
//   values 4k .. 4k + 3, the high ones 16 + 4k .. 19 + 4k;
// - Q5_0, Q5_1: as Q4_0, Q4_1, then a register of the fifth bits laid out as
//   a Q5_K panel group's (PANEL_5_GROUP).
// Rows past the last (a part's rows need not be a multiple of 16) are zeros.
// x is rounded per group of 32 as for rows_q8, and each product is the same
// integer dot product scaled the same way; only the order of the float sums
// differs.
//
// The panels read x by tiles of R <= PANEL_X rows interleaved word by word
// (word j, values 4j .. 4j + 3, of the tile's row r at w[j * R + r]), and
// each group's scalars likewise ([g * R + r]): one pointer serves the tile,
// every vpdpbusd takes its broadcast word at a fixed offset from it, and a
// tile of fewer rows (one row, in a one-stream decode) is as compact as they.
typedef struct { const int32_t *w; const float *dx, *dxs; const int32_t *neg8, *neg128; } xt_t;
typedef struct { const int32_t *w; const float *d, *e32; const int32_t *neg32; } xkt_t;

static void xtile_words(const int8_t *const *v, int R, int64_t K, int32_t *w) {
    for (int64_t j = 0; j < K / 4; j++)
        for (int r = 0; r < R; r++) memcpy(w + j * R + r, v[r] + 4 * j, 4);
}

// A tile of x as the 32-value types' panels read it (rows xs[0 .. R)); buffers
// of K * R bytes (w) and K / 32 * R values (the rest).
static void xtile_q8(const xq_t *xs, int R, int64_t K, int32_t *w, float *dx, float *dxs, int32_t *neg8,
                    int32_t *neg128) {
    const int8_t *v[PANEL_X];
    for (int r = 0; r < R; r++) v[r] = xs[r].v;
    xtile_words(v, R, K, w);
    for (int64_t g = 0; g < K / GROUP; g++)
        for (int r = 0; r < R; r++) {
            const int64_t i = g * R + r;
            const int32_t sum = xs[r].s16[2 * g] + xs[r].s16[2 * g + 1];
            dx[i] = xs[r].dx[g];
            dxs[i] = xs[r].dxs[g];
            neg8[i] = -8 * sum;
            neg128[i] = -128 * sum;
        }
}

// The same for the K-quants' panels: d per super-block, e32 (the minimums'
// weights) per group of 32, and -32 sum(v) per half group (Q6_K's offset,
// which starts each half group's integer sum); K / 256 * R values of d, 8
// times as many of e32 and 16 times of neg32.
static void xtile_q8k(const xk_t *xs, int R, int64_t K, int32_t *w, float *d, float *e32, int32_t *neg32) {
    const int8_t *v[PANEL_X];
    for (int r = 0; r < R; r++) v[r] = xs[r].v;
    xtile_words(v, R, K, w);
    for (int r = 0; r < R; r++) {
        for (int64_t sb = 0; sb < K / 256; sb++) d[sb * R + r] = xs[r].d[sb];
        for (int64_t g = 0; g < K / 32; g++) e32[g * R + r] = xs[r].e32[g];
        for (int64_t h = 0; h < K / 16; h++) neg32[h * R + r] = -32 * xs[r].s16[h];
    }
}

// s += u's bytes times the 4 bytes of word i at base broadcast to every lane,
// in a tile of R rows: for 2 rows or more, vpdpbusd with its memory operand
// broadcast (a load, no broadcast instruction of its own, which gcc 12 emits
// for _mm512_set1_epi32 of memory). The word is given as an address and a
// constant offset, not as a memory operand, so that the compiler still keeps
// the accumulators of a loop in registers; the x tiles are not written while
// the panels run, so the asm reads no memory that changes under it. One row's
// single chain of sums keeps the separate broadcast, which measured as fast or
// faster there (Q4_1, Q8_0). (The offset is a constant once the loops are
// unrolled, which an unoptimised build does not do: there, the intrinsic.)
#ifdef __OPTIMIZE__
#define DPBUSD_X(s, u, base, i)                                                               \
    do {                                                                                      \
        if (R == 1)                                                                           \
            s = _mm512_dpbusd_epi32(s, u, _mm512_set1_epi32((base)[i]));                      \
        else                                                                                  \
            __asm__("vpdpbusd %c3(%2)%{1to16%}, %1, %0" : "+v"(s) : "v"(u), "r"(base), "i"(4 * (i))); \
    } while (0)
#else
#define DPBUSD_X(s, u, base, i) (s = _mm512_dpbusd_epi32(s, u, _mm512_set1_epi32((base)[i])))
#endif
// A panel kernel's prefetch, for tiles of 2 rows or more, as it reads n bytes
// at o: those PF_L2 bytes ahead to L2, and those PF_L1 ahead (fetched to L2
// already) to L1. Over weights larger than the cache one tile of 8 rows runs
// 1.2-1.5x as fast as with the hardware's prefetcher alone (AMD Zen 4), which
// leaves the loop waiting for memory. One row of x: Q4_K and Q6_K panels read
// 1.23x and 1.39x the GB/s from memory with it (2 threads, 600 MB of panels,
// 11 paired rounds); Q4_0's loop keeps up without (0.90x with it).
#ifndef PF_L2
#define PF_L2 12288
#endif
#ifndef PF_L1
#define PF_L1 2048
#endif
#define PANEL_PREFETCH(o, n)                                                  \
    _Pragma("GCC unroll 16") for (int p_ = 0; p_ < (n); p_ += 64) {           \
        _mm_prefetch((const char *)(o) + PF_L2 + p_, _MM_HINT_T1);            \
        _mm_prefetch((const char *)(o) + PF_L1 + p_, _MM_HINT_T0);            \
    }

INLINEQ void panel32(const int type, const int R, const uint8_t *pw, const xt_t *xt, int64_t K, float *y,
                     int64_t ldy, __mmask16 lanes) {
    const int64_t groups = K / GROUP, vb = panel_values_bytes(type), gb = panel_group_bytes(type);
    const int offset = type == T_Q8_0 ? 128 : type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0;
    const int five = type == T_Q5_0 || type == T_Q5_1, has_min = type == T_Q4_1 || type == T_Q5_1;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[PANEL_X];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *o = pw + g * gb;
        if (R > 1) PANEL_PREFETCH(o, gb);
        const int32_t *xw = xt->w + g * 8 * R, *neg = (offset == 128 ? xt->neg128 : xt->neg8) + g * R;
        // the scales first: their loads start the group's last cache line early (a one-row loop waits on memory)
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + vb)));
        const __m512 m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + vb + 32)))
                                 : _mm512_setzero_ps();
        const __m512i top = five ? _mm512_loadu_si512((const void *)(o + 256)) : _mm512_setzero_si512();
        __m512i s[PANEL_X];
#pragma GCC unroll 8   // Q5_0's offset of 16: twice Q4_0's -8 sum(v)
        for (int r = 0; r < R; r++) s[r] = offset ? _mm512_set1_epi32(offset == 16 ? 2 * neg[r] : neg[r])
                                                  : _mm512_setzero_si512();
        // each weight register into every row's sum before the next: R chains side by side
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m512i lo, hi;
            if (type == T_Q8_0) {
                lo = _mm512_loadu_si512((const void *)(o + 64 * k));
                hi = _mm512_loadu_si512((const void *)(o + 64 * (k + 4)));
            } else {
                const __m512i t = _mm512_loadu_si512((const void *)(o + 64 * k));
                lo = _mm512_and_si512(t, low4);
                hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low4);
                if (five) {   // as panel_kq: bit k of each top byte to bit 4 of lo, bit 4 + k to bit 4 of hi
                    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(top, 4 - k), bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(top, k), bit4));
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) DPBUSD_X(s[r], lo, xw, k * R + r);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) DPBUSD_X(s[r], hi, xw, (k + 4) * R + r);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xt->dx[g * R + r])),
                                     acc[r]);
            if (has_min) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xt->dxs[g * R + r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, lanes, acc[r]);
}

// One instance of a panel kernel per type and x tile height (constants, so the
// sums stay in registers): panel_<type>(rows, ...) for kernel panel32 (x tiles
// xt_t) or panel_kq (xkt_t).
#define PANEL_R(kernel, type, R) case R: kernel(type, R, pw, xt, K, y, ldy, lanes); break;
#define PANEL_OF(type, kernel, xtile)                                                                   \
    static AVX512Q void panel_##type(int rows, const uint8_t *pw, const xtile *xt, int64_t K, float *y, \
                                     int64_t ldy, __mmask16 lanes) {                                    \
        switch (rows) {                                                                                 \
            PANEL_R(kernel, type, 1) PANEL_R(kernel, type, 2) PANEL_R(kernel, type, 3)                  \
            PANEL_R(kernel, type, 4) PANEL_R(kernel, type, 5) PANEL_R(kernel, type, 6)                  \
            PANEL_R(kernel, type, 7) PANEL_R(kernel, type, 8)                                           \
        }                                                                                               \
    }
#define PANEL_TYPE(type) PANEL_OF(type, panel32, xt_t)
PANEL_TYPE(T_Q8_0)
PANEL_TYPE(T_Q4_0)
PANEL_TYPE(T_Q4_1)
PANEL_TYPE(T_Q5_0)
PANEL_TYPE(T_Q5_1)

// Q4_K and Q5_K panels against x rounded per super-block (xk_t, as rowk): a
// group's integer dot product is weighted by its integer scale in int32
// (vpmulld), so a super-block needs one float multiply-add per 16 outputs, and
// its minimums one more per group (dmin m_g times the x group's dx * sum(v)).
// Q5_K's fifth bits join the low four as bit 4 of each byte before vpdpbusd.
INLINEQ void panel_kq(const int type, const int R, const uint8_t *pw, const xkt_t *xt, int64_t K, float *y,
                      int64_t ldy, __mmask16 lanes) {
    const int five = type == T_Q5_K, gs = five ? PANEL_5_GROUP : 256;
    const int at_d = five ? PANEL_5_D : PANEL_K_D, at_sc = five ? PANEL_5_SC : PANEL_K_SC;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[PANEL_X];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *o = pw + sb * panel_group_bytes(type);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + at_d)));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + at_d + 2 * PANEL)));
        __m512i isb[PANEL_X];
        for (int r = 0; r < R; r++) isb[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int g = 0; g < 8; g++) {
            const uint8_t *og = o + gs * g;
            PANEL_PREFETCH(og, gs);
            const int32_t *xw = xt->w + (sb * 64 + g * 8) * R;
            const __m512i top = five ? _mm512_loadu_si512((const void *)(og + 256)) : _mm512_setzero_si512();
            __m512i s[PANEL_X];
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m512i t = _mm512_loadu_si512((const void *)(og + 64 * k));
                __m512i lo = _mm512_and_si512(t, low4), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low4);
                if (five) {   // bit k of each top byte to bit 4 of lo, bit 4 + k to bit 4 of hi
                    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(top, 4 - k), bit4));
                    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(top, k), bit4));
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) DPBUSD_X(s[r], lo, xw, k * R + r);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) DPBUSD_X(s[r], hi, xw, (k + 4) * R + r);
            }
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(o + at_sc + PANEL * g)));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) isb[r] = _mm512_add_epi32(isb[r], _mm512_mullo_epi32(s[r], sc));
        }
        __m512 mins[8];
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++)
            mins[g] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(o + at_sc + 8 * PANEL + PANEL * g)))));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb[r]), _mm512_mul_ps(d, _mm512_set1_ps(xt->d[sb * R + r])),
                                       acc[r]);
#pragma GCC unroll 8
            for (int g = 0; g < 8; g++)
                a = _mm512_fnmadd_ps(mins[g], _mm512_set1_ps(xt->e32[(sb * 8 + g) * R + r]), a);
            acc[r] = a;
        }
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, lanes, acc[r]);
}

// Q6_K panels against x rounded per super-block: each half group's integer dot
// product (Q6_K's offset of 32 taken off in int32) weighted by its int8 scale.
INLINEQ void panel_q6k(const int R, const uint8_t *pw, const xkt_t *xt, int64_t K, float *y, int64_t ldy,
                       __mmask16 lanes) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
    __m512 acc[PANEL_X];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const uint8_t *o = pw + sb * panel_group_bytes(T_Q6_K);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + PANEL_6_D)));
        __m512i isb[PANEL_X];
        for (int r = 0; r < R; r++) isb[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int g = 0; g < 8; g++) {
            const uint8_t *og = o + 384 * g;
            PANEL_PREFETCH(og, 384);
            const int32_t *xw = xt->w + (sb * 64 + g * 8) * R, *neg = xt->neg32 + (sb * 16 + 2 * g) * R;
            // the two halves one after the other (values 0..15: registers 0..3; 16..31: 4..7)
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m512i top = _mm512_loadu_si512((const void *)(og + 256 + 64 * half));
                __m512i s[PANEL_X];
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) s[r] = _mm512_set1_epi32(neg[half * R + r]);
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    const __m512i t = _mm512_loadu_si512((const void *)(og + 64 * q));
                    const __m512i l = half ? _mm512_srli_epi16(t, 4) : t;
                    // bits 2q, 2q + 1 of each byte, to bits 4, 5
                    const __m512i hb = q <= 2 ? _mm512_slli_epi16(top, 4 - 2 * q) : _mm512_srli_epi16(top, 2 * q - 4);
                    const __m512i u = _mm512_or_si512(_mm512_and_si512(l, low4), _mm512_and_si512(hb, bits45));
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++) DPBUSD_X(s[r], u, xw, (4 * half + q) * R + r);
                }
                const __m512i sc = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(o + PANEL_6_SC + PANEL * (2 * g + half))));
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) isb[r] = _mm512_add_epi32(isb[r], _mm512_mullo_epi32(s[r], sc));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb[r]), _mm512_mul_ps(d, _mm512_set1_ps(xt->d[sb * R + r])),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * ldy, lanes, acc[r]);
}

#define PANEL6_R(R) case R: panel_q6k(R, pw, xt, K, y, ldy, lanes); break;
static AVX512Q void panel_T_Q6_K(int rows, const uint8_t *pw, const xkt_t *xt, int64_t K, float *y, int64_t ldy,
                                 __mmask16 lanes) {
    switch (rows) { PANEL6_R(1) PANEL6_R(2) PANEL6_R(3) PANEL6_R(4) PANEL6_R(5) PANEL6_R(6) PANEL6_R(7) PANEL6_R(8) }
}

PANEL_OF(T_Q4_K, panel_kq, xkt_t)
PANEL_OF(T_Q5_K, panel_kq, xkt_t)

// y[0 .. M, y0 + n0 .. y0 + n1) from the panels of a part (n0 a multiple of
// PANEL); x in tiles as xts (32-value types) or xkts (K-quants) round it.
static AVX512Q void rows_panel(int type, const xt_t *xts, const xkt_t *xkts, int64_t M, int64_t K,
                               const uint8_t *panels, float *y, int64_t ldy, int64_t y0, int64_t n0, int64_t n1) {
    const int64_t panel_bytes = gguf_panel_bytes(type, PANEL, K);
    for (int64_t n = n0; n < n1; n += PANEL) {
        const uint8_t *pw = panels + n / PANEL * panel_bytes;
        const __mmask16 lanes = n1 - n >= PANEL ? 0xffff : (__mmask16)((1u << (n1 - n)) - 1);
        for (int64_t m0 = 0; m0 < M; m0 += PANEL_X) {
            const int rows = (int)(M - m0 < PANEL_X ? M - m0 : PANEL_X);
            float *out = y + m0 * ldy + y0 + n;
            const int64_t t = m0 / PANEL_X;
            if (type == T_Q4_K) panel_T_Q4_K(rows, pw, xkts + t, K, out, ldy, lanes);
            else if (type == T_Q5_K) panel_T_Q5_K(rows, pw, xkts + t, K, out, ldy, lanes);
            else if (type == T_Q6_K) panel_T_Q6_K(rows, pw, xkts + t, K, out, ldy, lanes);
            else if (type == T_Q8_0) panel_T_Q8_0(rows, pw, xts + t, K, out, ldy, lanes);
            else if (type == T_Q4_0) panel_T_Q4_0(rows, pw, xts + t, K, out, ldy, lanes);
            else if (type == T_Q5_0) panel_T_Q5_0(rows, pw, xts + t, K, out, ldy, lanes);
            else if (type == T_Q5_1) panel_T_Q5_1(rows, pw, xts + t, K, out, ldy, lanes);
            else panel_T_Q4_1(rows, pw, xts + t, K, out, ldy, lanes);
        }
    }
}

static int vnni_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
           __builtin_cpu_supports("fma");
}

static int avx512_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
}
#else
#define HAVE_AVX512 0
static int avx512_usable(void) { return 0; }
static int vnni_usable(void) { return 0; }
#endif

// -1: not yet decided; then 1 where the AVX-512 path runs, 0 where rows_tile does.
static int use_avx512 = -1;

// Which path gguf_gemm_parts takes: on = 1 asks for the AVX-512 one (taken
// only where the CPU has it), 0 for the portable one, -1 leaves it; returns
// the path now taken (1: AVX-512).
int gguf_gemm_avx512(int on) {
    if (on >= 0) use_avx512 = on && avx512_usable();
    else if (use_avx512 < 0) use_avx512 = avx512_usable();
    return use_avx512;
}

// Task c of the output rows cut in chunks of ``chunk`` per part: its part
// (returned), the part's first column in y (y0) and its rows n0..n1 of the part.
static int chunk_span(int64_t c, int64_t chunk, const int64_t *rows, int64_t *y0, int64_t *n0, int64_t *n1) {
    int p = 0;
    *y0 = 0;
    while (c >= (rows[p] + chunk - 1) / chunk) {
        c -= (rows[p] + chunk - 1) / chunk;
        *y0 += rows[p];
        p++;
    }
    *n0 = c * chunk;
    *n1 = *n0 + chunk < rows[p] ? *n0 + chunk : rows[p];
    return p;
}

// y[M, sum(rows)] = x[M, K] W^T with W the rows of parts 0..parts-1 one after
// another (part p: rows[p] rows of GGUF blocks of types[p] at w[p], read
// through maps[p] when not NULL). 0, or -1 for a type or K a part does not take.
int gguf_gemm_parts(const float *x, int64_t M, int64_t K, int parts, const uint8_t *const *w,
                    const int64_t *const *maps, const int *types, const int64_t *rows, float *y, int threads) {
    int64_t N = 0, chunks = 0;
    for (int p = 0; p < parts; p++) {
        if (!block_bytes(types[p]) || K % block_values(types[p])) return -1;
        N += rows[p];
    }
    // Output rows per task: a few tasks per thread, at least 4 rows each.
    int64_t chunk = N / ((int64_t)threads * 4);
    if (chunk < 4) chunk = 4;
    const int wide = gguf_gemm_avx512(-1);
    if (wide) chunk = (chunk + 3) / 4 * 4;   // whole groups of 4 weight rows
    for (int p = 0; p < parts; p++) chunks += (rows[p] + chunk - 1) / chunk;
    // The AVX-512 path runs every x row in one task; rows_tile ROW_TILE of them.
    const int64_t tiles = wide ? 1 : (M + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            int64_t y0, n0, n1;
            const int p = chunk_span(c, chunk, rows, &y0, &n0, &n1);
#if HAVE_AVX512
            if (wide) {
                rows_avx512(types[p], x, M, K, w[p], maps[p], y, N, y0, n0, n1);
                continue;
            }
#endif
            const int64_t m0 = t * ROW_TILE;
            const int tile_rows = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            rows_tile(types[p], x, K, w[p], maps[p], y, N, y0, m0, tile_rows, n0, n1);
        }
    }
    return 0;
}

// out[i, K] = the widened row ids[i] of W (an embedding lookup); 0, or -1 as above
// or for an id outside 0..N-1.
int gguf_get_rows(const uint8_t *w, const int64_t *ids, float *out, int64_t count, int64_t K, int64_t N,
                  int64_t row_bytes, int type) {
    if (!block_bytes(type) || K % block_values(type) || row_bytes != K / block_values(type) * block_bytes(type))
        return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) return -1;
    const int bv = block_values(type), bb = block_bytes(type), groups = bv / GROUP;
    const int wide = gguf_gemm_avx512(-1);
    (void)wide;
    // Threads for a whole weight (a long prefill widens every row), not for a few tokens.
#pragma omp parallel for schedule(static) if (count * K >= (1 << 20))
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
#if HAVE_AVX512
        if (wide) {
            widen_row512(type, row, K, out + i * K);
            continue;
        }
#endif
        for (int64_t blk = 0; blk < K / bv; blk++)
            for (int g = 0; g < groups; g++)
                widen(type, row + blk * bb, g, out + i * K + blk * bv + g * GROUP);
    }
    return 0;
}

// Whether gguf_gemm_q8_parts runs on this CPU (AVX-512 with VNNI): 1 or 0.
int gguf_gemm_q8_usable(void) { return vnni_usable(); }

// Bytes of the panel copy of a part of ``rows`` rows of ``type`` over K
// columns (see "int8 activations on panels"); 0 where the type has none.
int64_t gguf_panel_bytes(int type, int64_t rows, int64_t K) {
    if (!panel_type(type) || K <= 0 || K % block_values(type) || rows <= 0) return 0;
    return (rows + PANEL - 1) / PANEL * (K / block_values(type)) * panel_group_bytes(type);
}

// Row j of a Q4_K panel super-block o from the super-block b: each group's 32
// values re-paired as Q4_0 pairs them (value i low, i + 16 high), its scales.
static void pack_q4k(const uint8_t *b, int j, uint8_t *o) {
    for (int g = 0; g < 8; g++) {
        const uint8_t *q = b + 16 + 32 * (g / 2);
        uint8_t v[32], pairs[16];
        for (int l = 0; l < 32; l++) v[l] = g & 1 ? q[l] >> 4 : q[l] & 0x0f;
        for (int i = 0; i < 16; i++) pairs[i] = (uint8_t)(v[i] | (v[i + 16] << 4));
        for (int k = 0; k < 4; k++) memcpy(o + 256 * g + 64 * k + 4 * j, pairs + 4 * k, 4);
        scale_min_k4(b + 4, g, o + PANEL_K_SC + PANEL * g + j, o + PANEL_K_SC + 8 * PANEL + PANEL * g + j);
    }
    memcpy(o + PANEL_K_D + 2 * j, b, 2);
    memcpy(o + PANEL_K_D + 2 * PANEL + 2 * j, b + 2, 2);
}

// A group's 32 fifth bits (bit i of h, value i's) as a panel row holds them
// beside PANEL_5_GROUP: value i in byte i % 4, at bit i / 4 (values 0-15 in
// bits 0-3, 16-31 in bits 4-7). Q5_K, Q5_0 and Q5_1 panels share the layout.
static void pack_fifth_bits(uint32_t h, uint8_t *top) {
    memset(top, 0, 4);
    for (int i = 0; i < 32; i++) top[i % 4] |= (uint8_t)(((h >> i) & 1) << (i / 4));
}

// Row j of a Q5_K panel super-block o from the super-block b: the low 4 bits
// as pack_q4k pairs them, the fifth bits in the layout beside PANEL_5_GROUP.
static void pack_q5k(const uint8_t *b, int j, uint8_t *o) {
    for (int g = 0; g < 8; g++) {
        const uint8_t *q = b + 48 + 32 * (g / 2), *qh = b + 16;
        uint8_t v[32], pairs[16];
        uint32_t h = 0;
        for (int l = 0; l < 32; l++) {
            v[l] = (uint8_t)(g & 1 ? q[l] >> 4 : q[l] & 0x0f);
            h |= (uint32_t)((qh[l] >> g) & 1) << l;
        }
        for (int i = 0; i < 16; i++) pairs[i] = (uint8_t)(v[i] | (v[i + 16] << 4));
        for (int k = 0; k < 4; k++) memcpy(o + PANEL_5_GROUP * g + 64 * k + 4 * j, pairs + 4 * k, 4);
        pack_fifth_bits(h, o + PANEL_5_GROUP * g + 256 + 4 * j);
        scale_min_k4(b + 4, g, o + PANEL_5_SC + PANEL * g + j, o + PANEL_5_SC + 8 * PANEL + PANEL * g + j);
    }
    memcpy(o + PANEL_5_D + 2 * j, b, 2);
    memcpy(o + PANEL_5_D + 2 * PANEL + 2 * j, b + 2, 2);
}

// Row j of a Q6_K panel super-block o from the super-block b.
static void pack_q6k(const uint8_t *b, int j, uint8_t *o) {
    for (int g = 0; g < 8; g++) {
        const int h = g >> 2, k = g & 3;   // as widen() reads group g
        const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
        uint8_t v[32], pairs[16], top[8] = {0};
        for (int i = 0; i < 32; i++) v[i] = (uint8_t)(((ql[i] >> (4 * (k >> 1))) & 0xF) | (((qh[i] >> (2 * k)) & 3) << 4));
        for (int i = 0; i < 16; i++) pairs[i] = (uint8_t)((v[i] & 0xF) | ((v[i + 16] & 0xF) << 4));
        for (int i = 0; i < 32; i++)   // value i: chunk c = i / 4 (0..7), byte t = i % 4
            top[(i / 16) * 4 + i % 4] |= (uint8_t)((v[i] >> 4) << (2 * ((i / 4) % 4)));
        for (int q = 0; q < 4; q++) memcpy(o + 384 * g + 64 * q + 4 * j, pairs + 4 * q, 4);
        for (int q = 0; q < 2; q++) memcpy(o + 384 * g + 256 + 64 * q + 4 * j, top + 4 * q, 4);
    }
    for (int half = 0; half < 16; half++) o[PANEL_6_SC + PANEL * half + j] = b[192 + half];
    memcpy(o + PANEL_6_D + 2 * j, b + 208, 2);
}

// Copy a part's rows (read through map when not NULL) into panels at out
// (gguf_panel_bytes of them); 0, or -1 for a type without panels.
int gguf_panel_pack(int type, const uint8_t *w, const int64_t *map, int64_t rows, int64_t K, uint8_t *out,
                    int threads) {
    if (!gguf_panel_bytes(type, rows, K)) return -1;
    const int64_t groups = K / block_values(type), gb = panel_group_bytes(type), vb = panel_values_bytes(type);
    const int64_t bb = block_bytes(type), row_bytes = groups * bb, panels = (rows + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *o = out + (p * groups + g) * gb;
            memset(o, 0, (size_t)gb);
            for (int j = 0; j < PANEL && p * PANEL + j < rows; j++) {
                const int64_t row = p * PANEL + j;
                const uint8_t *b = w + (map ? map[row] : row) * row_bytes + g * bb;
                if (type >= T_Q4_K) {
                    (type == T_Q4_K ? pack_q4k : type == T_Q5_K ? pack_q5k : pack_q6k)(b, j, o);
                    continue;
                }
                if (type == T_Q8_0) {
                    for (int c = 0; c < 8; c++)
                        for (int t = 0; t < 4; t++) o[64 * c + 4 * j + t] = (uint8_t)(b[2 + 4 * c + t] ^ 0x80);
                } else {
                    const int at = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
                    const uint8_t *qs = b + at;
                    for (int k = 0; k < 4; k++) memcpy(o + 64 * k + 4 * j, qs + 4 * k, 4);
                    if (type == T_Q5_0 || type == T_Q5_1) {   // the fifth bits: qh, before qs
                        uint32_t h;
                        memcpy(&h, qs - 4, 4);
                        pack_fifth_bits(h, o + 256 + 4 * j);
                    }
                }
                memcpy(o + vb + 2 * j, b, 2);
                if (type == T_Q4_1 || type == T_Q5_1) memcpy(o + vb + 2 * PANEL + 2 * j, b + 2, 2);
            }
        }
    }
    return 0;
}

int gguf_gemm_q8_panels(const float *x, int64_t M, int64_t K, int parts, const uint8_t *const *w,
                        const int64_t *const *maps, const uint8_t *const *panels, const int *types,
                        const int64_t *rows, float *y, int threads);

// gguf_gemm_parts with x rounded to int8 per group of 32 (see "int8
// activations"); 0, -1 as gguf_gemm_parts, -2 where the CPU lacks AVX-512 VNNI,
// -3 where scratch memory could not be had.
int gguf_gemm_q8_parts(const float *x, int64_t M, int64_t K, int parts, const uint8_t *const *w,
                       const int64_t *const *maps, const int *types, const int64_t *rows, float *y, int threads) {
    return gguf_gemm_q8_panels(x, M, K, parts, w, maps, NULL, types, rows, y, threads);
}

// As gguf_gemm_q8_parts, with panels[p] (when panels and it are not NULL) the
// panel copy of part p (gguf_panel_pack), which is then read instead of w[p].
int gguf_gemm_q8_panels(const float *x, int64_t M, int64_t K, int parts, const uint8_t *const *w,
                        const int64_t *const *maps, const uint8_t *const *panels, const int *types,
                        const int64_t *rows, float *y, int threads) {
    int64_t N = 0, chunks = 0;
    for (int p = 0; p < parts; p++) {
        if (!block_bytes(types[p]) || K % block_values(types[p])) return -1;
        if (panels && panels[p] && !panel_type(types[p])) return -1;
        N += rows[p];
    }
    if (!vnni_usable()) return -2;
#if HAVE_AVX512
    const int64_t groups = K / GROUP;
    int8_t *v = malloc((size_t)(M * K));
    float *dx = malloc((size_t)(M * groups) * sizeof(float)), *dxs = malloc((size_t)(M * groups) * sizeof(float));
    int32_t *s16 = malloc((size_t)(M * groups * 2) * sizeof(int32_t));
    xq_t *xs = malloc((size_t)M * sizeof(xq_t));
    int kquant = 0;
    for (int p = 0; p < parts; p++) kquant |= types[p] >= T_Q4_K;
    int8_t *vk = kquant ? malloc((size_t)(M * K)) : NULL;
    float *dk = kquant ? malloc((size_t)(M * (K / 256)) * sizeof(float)) : NULL;
    float *sk = kquant ? malloc((size_t)(M * (K / 16 + K / 32)) * sizeof(float)) : NULL;
    int32_t *ik = kquant ? malloc((size_t)(M * (K / 16)) * sizeof(int32_t)) : NULL;
    xk_t *xks = kquant ? malloc((size_t)M * sizeof(xk_t)) : NULL;
    if (!v || !dx || !dxs || !s16 || !xs || (kquant && (!vk || !dk || !sk || !ik || !xks))) {
        free(v); free(dx); free(dxs); free(s16); free(xs); free(vk); free(dk); free(sk); free(ik); free(xks);
        return -3;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        if (kquant) {
            float *e = sk + m * (K / 16 + K / 32);
            quantize_row_q8k(x + m * K, K, vk + m * K, dk + m * (K / 256), e, e + K / 32, ik + m * (K / 16));
            xks[m] = (xk_t){vk + m * K, dk + m * (K / 256), e, e + K / 32, ik + m * (K / 16)};
        }
        quantize_row_q8(x + m * K, K, v + m * K, dx + m * groups, dxs + m * groups, s16 + m * groups * 2);
        xs[m] = (xq_t){v + m * K, dx + m * groups, dxs + m * groups, s16 + m * groups * 2};
    }
    // The tiles the panels read (see "int8 activations on panels"): of x as the
    // 32-value types round it where one of their parts has panels (t32), as the
    // K-quants round it where one of theirs has (tk).
    int panels32 = 0, panelsk = 0;
    for (int p = 0; p < parts; p++)
        if (panels && panels[p]) *(types[p] >= T_Q4_K ? &panelsk : &panels32) = 1;
    // Per row of x: K / 4 words, and 4 (32-value types) or 1 + 8 + 16 (K-quants)
    // values per 256 columns; a tile holds its rows' share (R rows, not PANEL_X).
    const int64_t tiles = panels32 || panelsk ? (M + PANEL_X - 1) / PANEL_X : 0;
    const int64_t row32 = K / 4 + 4 * (K / GROUP), rowk = K / 4 + K / 256 + K / 32 + K / 16;
    int32_t *t32 = panels32 ? malloc((size_t)(M * row32) * sizeof(int32_t)) : NULL;
    int32_t *tk = panelsk ? malloc((size_t)(M * rowk) * sizeof(int32_t)) : NULL;
    xt_t *xts = panels32 ? malloc((size_t)tiles * sizeof(xt_t)) : NULL;
    xkt_t *xkts = panelsk ? malloc((size_t)tiles * sizeof(xkt_t)) : NULL;
    if ((panels32 && (!t32 || !xts)) || (panelsk && (!tk || !xkts))) {
        free(v); free(dx); free(dxs); free(s16); free(xs); free(vk); free(dk); free(sk); free(ik); free(xks);
        free(t32); free(tk); free(xts); free(xkts);
        return -3;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (tiles >= 2)
    for (int64_t t = 0; t < tiles; t++) {
        const int R = (int)(M - t * PANEL_X < PANEL_X ? M - t * PANEL_X : PANEL_X);
        const int64_t tw = K / 4 * R, tg = K / GROUP * R;   // the tile's words, and values per group
        if (panels32) {
            int32_t *b = t32 + t * PANEL_X * row32;
            float *dxt = (float *)(b + tw), *dxst = dxt + tg;
            int32_t *neg8 = b + tw + 2 * tg, *neg128 = neg8 + tg;
            xtile_q8(xs + t * PANEL_X, R, K, b, dxt, dxst, neg8, neg128);
            xts[t] = (xt_t){b, dxt, dxst, neg8, neg128};
        }
        if (panelsk) {
            int32_t *c = tk + t * PANEL_X * rowk;
            float *d = (float *)(c + tw), *e = d + tg / 8;
            int32_t *h = (int32_t *)(e + tg);
            xtile_q8k(xks + t * PANEL_X, R, K, c, d, e, h);
            xkts[t] = (xkt_t){c, d, e, h};
        }
    }
    int64_t chunk = N / ((int64_t)threads * 4);
    if (chunk < 4) chunk = 4;
    chunk = (chunk + PANEL - 1) / PANEL * PANEL;   // whole panels (and whole groups of 4 weight rows)
    for (int p = 0; p < parts; p++) chunks += (rows[p] + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t y0, n0, n1;
        const int p = chunk_span(c, chunk, rows, &y0, &n0, &n1);
        if (panels && panels[p]) rows_panel(types[p], xts, xkts, M, K, panels[p], y, N, y0, n0, n1);
        else if (types[p] >= T_Q4_K) rows_k(types[p], xks, M, K, w[p], maps[p], y, N, y0, n0, n1);
        else rows_q8(types[p], xs, M, K, w[p], maps[p], y, N, y0, n0, n1);
    }
    free(v); free(dx); free(dxs); free(s16); free(xs); free(vk); free(dk); free(sk); free(ik); free(xks);
    free(t32); free(tk); free(xts); free(xkts);
    return 0;
#else
    (void)x; (void)M; (void)w; (void)maps; (void)panels; (void)y; (void)threads; (void)chunks;
    return -2;
#endif
}
