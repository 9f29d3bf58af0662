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
 * result. Work items are chunks of a segment (64 rows by 16 pages for the
 * shrink, 64 rows by 128 columns for the expand), shared between OpenMP
 * threads (torch's libgomp, as for packed_gemm.c): a long prefill's rows stay
 * in cache while pages pass over them, and a decode's adapter weights stream
 * from memory once a step, however many rows use them. Segments write
 * disjoint rows, so items never write the same place.
 */
#include <stdint.h>
#include <stdlib.h>

#define RB 4    /* rows per block */
#define PB 4    /* pages per shrink block */
#define CB 32   /* columns per expand block */
#define ROW_CHUNK 64     /* rows per work item */
#define PAGE_CHUNK 16    /* pages per shrink item */
#define COL_CHUNK 128    /* columns per expand item */

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

/* The segment holding work item w, given each segment's first item. */
static int segment_of(const long *first, int nseg, long w) {
    int lo = 0, hi = nseg - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static long cdiv(long a, long b) {
    return (a + b - 1) / b;
}

int lora_sgmv_f32(const float *x, long ldx, long in, float *y, long ldy, long out,
                  const float *A, const float *B, const int32_t *rows, const int32_t *pages,
                  const int32_t *segs, int nseg) {
    if (nseg <= 0)
        return 0;
    /* Per segment: its first shrink item, its first expand item, where its S starts. */
    long *first = malloc(sizeof(long) * (size_t)(3 * nseg + 3));
    if (!first)
        return -1;
    long *first_expand = first + nseg + 1, *s_start = first_expand + nseg + 1;
    long shrink_items = 0, expand_items = 0, floats = 0;
    for (int i = 0; i < nseg; i++) {
        long chunks = cdiv(segs[4 * i + NUM_ROWS], ROW_CHUNK);
        first[i] = shrink_items;
        first_expand[i] = expand_items;
        s_start[i] = floats;
        shrink_items += chunks * cdiv(segs[4 * i + RANK], PAGE_CHUNK);
        expand_items += chunks * cdiv(out, COL_CHUNK);
        floats += (long)segs[4 * i + RANK] * segs[4 * i + NUM_ROWS];
    }
    float *scratch = malloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    if (!scratch) {
        free(first);
        return -1;
    }

    /* Shrink: an item is up to ROW_CHUNK rows x PAGE_CHUNK pages of one
     * segment; its x rows stay in cache while its pages pass over them. */
#pragma omp parallel for schedule(dynamic, 1) if (shrink_items > 1)
    for (long w = 0; w < shrink_items; w++) {
        int i = segment_of(first, nseg, w);
        const int32_t *seg = segs + 4 * i;
        int rank = seg[RANK], n = seg[NUM_ROWS];
        long local = w - first[i], page_chunks = cdiv(rank, PAGE_CHUNK);
        int r0 = (int)(local / page_chunks) * ROW_CHUNK, p0 = (int)(local % page_chunks) * PAGE_CHUNK;
        int r1 = r0 + ROW_CHUNK < n ? r0 + ROW_CHUNK : n, p1 = p0 + PAGE_CHUNK < rank ? p0 + PAGE_CHUNK : rank;
        for (int j0 = p0; j0 < p1; j0 += PB) {
            int nj = p1 - j0 < PB ? p1 - j0 : PB;
            const float *ar[PB];
            for (int j = 0; j < PB; j++)
                ar[j] = A + (long)pages[seg[PAGE_START] + j0 + (j < nj ? j : 0)] * in;
            for (int t0 = r0; t0 < r1; t0 += RB) {
                int nt = r1 - t0 < RB ? r1 - t0 : RB;
                const float *xr[RB];
                for (int t = 0; t < RB; t++)
                    xr[t] = x + (long)rows[seg[ROW_START] + t0 + (t < nt ? t : 0)] * ldx;
                shrink_block(xr, ar, in, scratch + s_start[i], rank, t0, nt, j0, nj);
            }
        }
    }

    /* Expand: an item is up to ROW_CHUNK rows x COL_CHUNK columns of one
     * segment; each B row chunk stays in cache while the rows pass over it. */
#pragma omp parallel for schedule(dynamic, 1) if (expand_items > 1)
    for (long w = 0; w < expand_items; w++) {
        int i = segment_of(first_expand, nseg, w);
        const int32_t *seg = segs + 4 * i;
        int rank = seg[RANK], n = seg[NUM_ROWS];
        long local = w - first_expand[i], col_chunks = cdiv(out, COL_CHUNK);
        int r0 = (int)(local / col_chunks) * ROW_CHUNK, r1 = r0 + ROW_CHUNK < n ? r0 + ROW_CHUNK : n;
        long c_end = (local % col_chunks) * COL_CHUNK + COL_CHUNK < out ? (local % col_chunks) * COL_CHUNK
                                                                            + COL_CHUNK : out;
        const int32_t *pg = pages + seg[PAGE_START];
        const float *s = scratch + s_start[i];
        for (long c0 = (local % col_chunks) * COL_CHUNK; c0 < c_end; c0 += CB) {
            long width = c_end - c0 < CB ? c_end - c0 : CB;
            for (int t0 = r0; t0 < r1; t0 += RB) {
                int nt = r1 - t0 < RB ? r1 - t0 : RB;
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
    }
    free(scratch);
    free(first);
    return 0;
}
