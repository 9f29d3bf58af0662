// Products with GGUF weights in their own blocks: y[M, N] = x[M, K] W^T, where
// each of W's N rows is a row of GGUF blocks (Q8_0, Q4_0, Q4_1: 32 values per
// block; Q4_K, Q5_K, Q6_K: 256 per super-block), read where the file maps them.
// A block is widened to float32 in registers, 32 values at a time, with the
// same float operations as the reference dequantisation (gguf-py and
// transformers): the values are those, bit for bit, and x is multiplied as
// given (float32; bfloat16 rows widen exactly before the call). Each widened
// group is multiplied into up to ROW_TILE rows of x before the next is read.
// The output rows are split over OpenMP threads (torch's pool).
//
// On x86-64 the hot loop is built three times (AVX-512, AVX2 with FMA, and
// baseline SSE2) and the CPU picks one when the library loads
// (target_clones).
#include <stdint.h>
#include <string.h>
#include <omp.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
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
        case T_Q8_0: return 34;
        case T_Q4_K: return 144;
        case T_Q5_K: return 176;
        case T_Q6_K: return 210;
        default: return 0;
    }
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
    for (int p = 0; p < parts; p++) chunks += (rows[p] + chunk - 1) / chunk;
    const int64_t tiles = (M + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for num_threads(threads) schedule(static) collapse(2)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t c = 0; c < chunks; c++) {
            int p = 0;
            int64_t local = c, y0 = 0;
            while (local >= (rows[p] + chunk - 1) / chunk) {
                local -= (rows[p] + chunk - 1) / chunk;
                y0 += rows[p];
                p++;
            }
            const int64_t m0 = t * ROW_TILE;
            const int tile_rows = (int)(M - m0 < ROW_TILE ? M - m0 : ROW_TILE);
            const int64_t n0 = local * chunk, n1 = n0 + chunk < rows[p] ? n0 + chunk : rows[p];
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
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        for (int64_t blk = 0; blk < K / bv; blk++)
            for (int g = 0; g < groups; g++)
                widen(type, row + blk * bb, g, out + i * K + blk * bv + g * GROUP);
    }
    return 0;
}
