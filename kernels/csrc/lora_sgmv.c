/* Batched LoRA for one projection over the adapter pool (Punica's SGMV idea:
 * the step's tokens grouped by adapter, each group multiplied by its own
 * adapter's weights in one pass).
 *
 * The pool holds rank pages: page p is row p of A [pages, in] (a row of a
 * LoRA A) and row p of B [pages, out] (a column of a LoRA B, its scaling
 * folded in). An adapter of rank r owns r pages, anywhere in the pool.
 * segs [nseg, 4] lists, per segment, where its rows start in `rows`, how many
 * rows it has, where its pages start in `pages`, and its rank. For each:
 *
 *     S = x[rows] @ A[pages]^T          (shrink: rows x rank)
 *     y[rows] += S @ B[pages]            (expand)
 *
 * x rows are `ldx` floats apart, y rows `ldy` (y may be a column slice of a
 * merged projection's output). Both halves are register-blocked: the shrink
 * takes 4 rows x 4 pages at a time (16 vector sums over `in`), the expand
 * 4 rows x 32 columns (each B row chunk loaded once per 4 rows); a block
 * past a segment's last row or page repeats its first one and drops the
 * result. Segments write disjoint rows, so the shrink splits over (segment,
 * 4 pages) and the expand over (segment, 32 columns) between OpenMP threads
 * (torch's libgomp, as for packed_gemm.c). Each adapter's weights stream
 * from memory once a step, however many rows use it.
 */
#include <stdint.h>
#include <stdlib.h>

#define RB 4    /* rows per block */
#define PB 4    /* pages per shrink block */
#define CB 32   /* columns per expand block */

enum { ROW_START = 0, NUM_ROWS = 1, PAGE_START = 2, RANK = 3 };

typedef float v8 __attribute__((vector_size(32)));   /* GCC/Clang vectors: 8 floats, any ISA */

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* s[t * rank + j] for rows t0.. and pages j0.. of one block: 16 vector sums
 * over the first in - in % 8 features, the rest in scalars. */
static void shrink_block(const float *const xr[RB], const float *const ar[PB], long in, float *s, int rank,
                         int t0, int nt, int j0, int nj) {
    v8 acc[RB][PB];
    for (int t = 0; t < RB; t++)
        for (int j = 0; j < PB; j++)
            acc[t][j] = (v8){0};
    long k = 0;
    for (; k + 8 <= in; k += 8) {
        v8 a0 = load8(ar[0] + k), a1 = load8(ar[1] + k), a2 = load8(ar[2] + k), a3 = load8(ar[3] + k);
        for (int t = 0; t < RB; t++) {
            v8 v = load8(xr[t] + k);
            acc[t][0] += v * a0;
            acc[t][1] += v * a1;
            acc[t][2] += v * a2;
            acc[t][3] += v * a3;
        }
    }
    for (int t = 0; t < nt; t++)
        for (int j = 0; j < nj; j++) {
            float sum = hsum(acc[t][j]);
            for (long r = k; r < in; r++)
                sum += xr[t][r] * ar[j][r];
            s[(long)(t0 + t) * rank + j0 + j] = sum;
        }
}

/* y rows += S rows @ B[pages] for 4 rows and CB (32) columns: 16 vector sums. */
static void expand_block(const float *const sr[RB], const int32_t *pg, const float *B, long out, int rank,
                         float *const yr[RB], int nt) {
    v8 acc[RB][CB / 8];
    for (int t = 0; t < RB; t++)
        for (int q = 0; q < CB / 8; q++)
            acc[t][q] = (v8){0};
    for (int j = 0; j < rank; j++) {
        const float *b = B + (long)pg[j] * out;
        v8 b0 = load8(b), b1 = load8(b + 8), b2 = load8(b + 16), b3 = load8(b + 24);
        for (int t = 0; t < RB; t++) {
            float sv = sr[t][j];
            acc[t][0] += b0 * sv;
            acc[t][1] += b1 * sv;
            acc[t][2] += b2 * sv;
            acc[t][3] += b3 * sv;
        }
    }
    for (int t = 0; t < nt; t++)
        for (int q = 0; q < CB / 8; q++) {
            v8 v = load8(yr[t] + 8 * q) + acc[t][q];
            __builtin_memcpy(yr[t] + 8 * q, &v, sizeof v);
        }
}

/* The same for the last, narrower block of columns. */
static void expand_tail(const float *const sr[RB], const int32_t *pg, const float *B, long out, int rank,
                        float *const yr[RB], int nt, long width) {
    for (int t = 0; t < nt; t++) {
        float acc[CB] = {0};
        for (int j = 0; j < rank; j++) {
            const float *b = B + (long)pg[j] * out;
            float sv = sr[t][j];
            for (long c = 0; c < width; c++)
                acc[c] += sv * b[c];
        }
        for (long c = 0; c < width; c++)
            yr[t][c] += acc[c];
    }
}

int lora_sgmv_f32(const float *x, long ldx, long in, float *y, long ldy, long out,
                  const float *A, const float *B, const int32_t *rows, const int32_t *pages,
                  const int32_t *segs, int nseg) {
    if (nseg <= 0)
        return 0;
    /* Per segment: its first shrink work item and where its S starts. */
    long *first = malloc(sizeof(long) * (size_t)(2 * nseg + 2));
    if (!first)
        return -1;
    long *s_start = first + nseg + 1;
    long items = 0, floats = 0;
    for (int i = 0; i < nseg; i++) {
        first[i] = items;
        s_start[i] = floats;
        items += (segs[4 * i + RANK] + PB - 1) / PB;
        floats += (long)segs[4 * i + RANK] * segs[4 * i + NUM_ROWS];
    }
    first[nseg] = items;
    float *scratch = malloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    if (!scratch) {
        free(first);
        return -1;
    }

#pragma omp parallel for schedule(dynamic, 4) if (items > 1)
    for (long w = 0; w < items; w++) {
        int lo = 0, hi = nseg - 1;   /* the segment holding work item w */
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (first[mid] <= w)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int32_t *seg = segs + 4 * lo;
        int rank = seg[RANK], n = seg[NUM_ROWS], j0 = (int)(w - first[lo]) * PB;
        int nj = rank - j0 < PB ? rank - j0 : PB;
        const float *ar[PB];
        for (int j = 0; j < PB; j++)
            ar[j] = A + (long)pages[seg[PAGE_START] + j0 + (j < nj ? j : 0)] * in;
        for (int t0 = 0; t0 < n; t0 += RB) {
            int nt = n - t0 < RB ? n - t0 : RB;
            const float *xr[RB];
            for (int t = 0; t < RB; t++)
                xr[t] = x + (long)rows[seg[ROW_START] + t0 + (t < nt ? t : 0)] * ldx;
            shrink_block(xr, ar, in, scratch + s_start[lo], rank, t0, nt, j0, nj);
        }
    }

    long blocks = (out + CB - 1) / CB;
#pragma omp parallel for schedule(dynamic, 4) if (nseg * blocks > 1)
    for (long w = 0; w < nseg * blocks; w++) {
        int i = (int)(w / blocks);
        long c0 = (w % blocks) * CB, width = out - c0 < CB ? out - c0 : CB;
        const int32_t *seg = segs + 4 * i;
        int rank = seg[RANK], n = seg[NUM_ROWS];
        const int32_t *pg = pages + seg[PAGE_START];
        const float *s = scratch + s_start[i];
        for (int t0 = 0; t0 < n; t0 += RB) {
            int nt = n - t0 < RB ? n - t0 : RB;
            float *yr[RB];
            const float *sr[RB];
            for (int t = 0; t < RB; t++) {
                int row = t0 + (t < nt ? t : 0);
                yr[t] = y + (long)rows[seg[ROW_START] + row] * ldy + c0;
                sr[t] = s + (long)row * rank;
            }
            if (width == CB)
                expand_block(sr, pg, B + c0, out, rank, yr, nt);
            else
                expand_tail(sr, pg, B + c0, out, rank, yr, nt, width);
        }
    }
    free(scratch);
    free(first);
    return 0;
}
