/* Mixture-of-experts feed-forward for the CPU, float32: route, group the
 * step's tokens by expert, multiply each active expert once.
 *
 * out[t] = sum_j w[t, j] * (down_e(act(gate_up_e(x[t]) + b13_e)) + b2_e),
 * e = ids[t, j], over the top-k slots j of token t. A slot whose id is not in
 * [0, E) is skipped (an expert held by another rank under expert parallelism).
 *
 * Expert weights are packed as packed_gemm.c packs one linear weight, one
 * expert after another: w13p[E][ceil(2I / NB)][H][NB] (the rows of gate_up:
 * the I gate rows, then the I up rows) and w2p[E][ceil(H / NB)][I][NB]. A
 * step reads only the experts its tokens were routed to, each once, however
 * many of its tokens go there: the step's (token, slot) pairs are sorted by
 * expert, each expert's rows are gathered into one block of rows, and that
 * block multiplies the expert's packed weight through packed_gemm.c's
 * run_blocks (rows in register chunks, column blocks kept in cache).
 *
 * One OpenMP region runs four phases with barriers between them: gate_up
 * GEMMs, activation, down GEMMs, then the weighted sum per token. The GEMM
 * phases split (expert, column block) items over the threads by cost (a
 * block's bytes plus its rows' work), so one busy expert does not leave a
 * thread idle. Scratch memory is the calling thread's own (tensor-parallel
 * ranks may be threads of one process) and grows to the largest step seen.
 */
#include "packed_gemm.c"

#include <math.h>

#define ACT_SILU 0         /* silu(gate) * up */
#define ACT_SWIGLU_OAI 1   /* gpt-oss: clamped gate and up, gate * sigmoid(alpha * gate) * (up + 1) */

/* Work of one column block of an expert with n rows, in units of an eighth
 * of a block's read: streaming a block costs about as much as eight rows'
 * multiply-adds on it (both AVX2 and AVX-512 chunks). */
#define BLOCK_COST 8.0

static __thread float *scratch = NULL;   /* [P][H] rows, then [P][2I] and [P][I] */
static __thread size_t scratch_len = 0;
static __thread int *index_buf = NULL;   /* counts, offsets, order, slot rows */
static __thread size_t index_len = 0;

static int grow_float(size_t n) {
    if (scratch_len >= n) return 0;
    free(scratch);
    scratch = aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64);
    scratch_len = scratch ? n : 0;
    return scratch ? 0 : -1;
}

static int grow_int(size_t n) {
    if (index_len >= n) return 0;
    free(index_buf);
    index_buf = malloc(n * sizeof(int));
    index_len = index_buf ? n : 0;
    return index_buf ? 0 : -1;
}

/* The column blocks [*first, *last) of active expert a that thread t of nt
 * multiplies: blocks go to threads by the middle of their cost span. */
static void share(const double *start, const double *cost, int a, int blocks, double total,
                  int t, int nt, int *first, int *last) {
    double lo = total * t / nt, hi = total * (t + 1) / nt, c = cost[a];
    int f = (int)ceil((lo - start[a]) / c - 0.5), l = (int)ceil((hi - start[a]) / c - 0.5);
    if (t == nt - 1) l = blocks;
    *first = f < 0 ? 0 : (f > blocks ? blocks : f);
    *last = l < 0 ? 0 : (l > blocks ? blocks : l);
}

/* The slot of a token's n-th smallest valid expert id (ties in slot
 * order), or -1 when it has fewer than n + 1 valid slots. */
static int slot_by_expert(const int *ids, int k, int n, int E) {
    int prev = -1, prev_slot = -1;
    for (int m = 0; m <= n; m++) {
        int best = -1;
        for (int j = 0; j < k; j++) {
            int e = ids[j];
            if (e < 0 || e >= E) continue;
            int after = e > prev || (e == prev && j > prev_slot);
            if (after && (best < 0 || e < ids[best])) best = j;
        }
        if (best < 0) return -1;
        prev = ids[best];
        prev_slot = best;
    }
    return prev_slot;
}

INLINE float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

INLINE float swiglu_oai(float g, float u, float alpha, float limit) {
    g = g > limit ? limit : g;
    u = u > limit ? limit : (u < -limit ? -limit : u);
    return g / (1.f + expf(-alpha * g)) * (u + 1.f);
}

/* Returns 0, or -1 when scratch memory could not be allocated. *bytes (when
 * not NULL) receives the bytes of expert weights the step read. */
int fused_moe(const float *x, int T, int H, int I, const int *ids, const float *weights, int k, int E,
              const float *w13p, const float *w2p, const float *b13, const float *b2, int act,
              float alpha, float limit, float *out, int threads, long long *bytes) {
    int N1 = 2 * I, B1 = (N1 + NB - 1) / NB, B2 = (H + NB - 1) / NB;
    size_t e13 = (size_t)B1 * H * NB, e2 = (size_t)B2 * I * NB;   /* floats per packed expert */
    if (bytes) *bytes = 0;
    if (T <= 0) return 0;
    if (grow_int((size_t)3 * E + 2 + 2 * (size_t)T * k)) return -1;
    int *count = index_buf, *offset = count + E, *fill = offset + E + 1;
    int *order = fill + E + 1, *row_of = order + (size_t)T * k;
    memset(count, 0, sizeof(int) * E);
    for (size_t p = 0; p < (size_t)T * k; p++)
        if (ids[p] >= 0 && ids[p] < E) count[ids[p]]++;
    offset[0] = 0;
    for (int e = 0; e < E; e++) offset[e + 1] = offset[e] + count[e];
    int P = offset[E];
    memcpy(fill, offset, sizeof(int) * E);
    for (size_t p = 0; p < (size_t)T * k; p++) {   /* pairs by expert, tokens in order */
        int e = ids[p];
        row_of[p] = e >= 0 && e < E ? fill[e]++ : -1;
        if (row_of[p] >= 0) order[row_of[p]] = (int)p;
    }
    if (P == 0) {
        memset(out, 0, sizeof(float) * (size_t)T * H);
        return 0;
    }
    if (grow_float((size_t)P * H + (size_t)P * N1 + (size_t)P * I)) return -1;
    float *rows = scratch, *h1 = rows + (size_t)P * H, *h2 = h1 + (size_t)P * N1;
    /* Active experts and their cost spans, per GEMM phase. */
    int active[E > 0 ? E : 1], nact = 0;
    double start1[E > 0 ? E : 1], cost1[E > 0 ? E : 1], start2[E > 0 ? E : 1], cost2[E > 0 ? E : 1];
    double total1 = 0, total2 = 0;
    for (int e = 0; e < E; e++) {
        if (!count[e]) continue;
        double c = 1.0 + count[e] / BLOCK_COST;
        start1[nact] = total1; cost1[nact] = c; total1 += c * B1;
        start2[nact] = total2; cost2[nact] = c; total2 += c * B2;
        active[nact++] = e;
        if (bytes) *bytes += (long long)((e13 + e2) * sizeof(float));
    }
    if (threads < 1) threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int t = 0, nt = 1;
#endif
        /* Gather each pair's token row, in expert order. */
        for (int r = (int)((long)P * t / nt); r < (int)((long)P * (t + 1) / nt); r++)
            memcpy(rows + (size_t)r * H, x + (size_t)(order[r] / k) * H, sizeof(float) * H);
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int a = 0; a < nact; a++) {   /* h1 = rows . gate_up^T */
            int e = active[a], first, last;
            share(start1, cost1, a, B1, total1, t, nt, &first, &last);
            if (first < last)
                run_blocks(rows + (size_t)offset[e] * H, w13p + (size_t)e * e13, 0, NULL,
                           h1 + (size_t)offset[e] * N1, count[e], H, N1, first, last);
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int r = (int)((long)P * t / nt); r < (int)((long)P * (t + 1) / nt); r++) {
            /* h2 = act(h1 + b13), rows split over threads */
            const float *g = h1 + (size_t)r * N1, *u = g + I;
            const float *bg = b13 ? b13 + (size_t)ids[order[r]] * N1 : NULL, *bu = bg ? bg + I : NULL;
            float *o = h2 + (size_t)r * I;
            if (act == ACT_SWIGLU_OAI) {
                for (int i = 0; i < I; i++)
                    o[i] = swiglu_oai(g[i] + (bg ? bg[i] : 0.f), u[i] + (bu ? bu[i] : 0.f), alpha, limit);
            } else {
                for (int i = 0; i < I; i++)
                    o[i] = silu_mul(g[i] + (bg ? bg[i] : 0.f), u[i] + (bu ? bu[i] : 0.f));
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int a = 0; a < nact; a++) {   /* rows = h2 . down^T (the gathered rows are spent) */
            int e = active[a], first, last;
            share(start2, cost2, a, B2, total2, t, nt, &first, &last);
            if (first < last)
                run_blocks(h2 + (size_t)offset[e] * I, w2p + (size_t)e * e2, 0, NULL,
                           rows + (size_t)offset[e] * H, count[e], I, H, first, last);
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        for (int tok = (int)((long)T * t / nt); tok < (int)((long)T * (t + 1) / nt); tok++) {
            float *o = out + (size_t)tok * H;
            memset(o, 0, sizeof(float) * H);
            for (int n = 0; n < k; n++) {
                /* Slots by ascending expert (rows of one token are in expert
                 * order), as Hugging Face's experts add them up. */
                int j = slot_by_expert(ids + (size_t)tok * k, k, n, E);
                int r = j < 0 ? -1 : row_of[(size_t)tok * k + j];
                if (r < 0) continue;
                float w = weights[(size_t)tok * k + j];
                const float *y = rows + (size_t)r * H;
                const float *bd = b2 ? b2 + (size_t)ids[(size_t)tok * k + j] * H : NULL;
                if (bd) {
                    for (int h = 0; h < H; h++) o[h] += w * (y[h] + bd[h]);
                } else {
                    for (int h = 0; h < H; h++) o[h] += w * y[h];
                }
            }
        }
    }
    return 0;
}

/* Output columns per packed block (the packing's NB). */
int fused_moe_block_cols(void) { return NB; }
