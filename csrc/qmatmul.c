/*
 * Products against weights kept packed: y[M, N] = x[M, K] @ W^T (+ bias), W [N, K],
 * read in the packed form, never expanded to float32 in memory as a whole.
 *
 * Built at install into model/_qmatmul (setup.py); model/quant.py packs the weights,
 * checks every argument and is the only caller.
 *
 * Layout: W's rows (the outputs) are grouped in panels of NR = 16; panel p holds rows
 * 16p .. 16p + 15 (the last one zero-padded), so for every k the panel's 16 values
 * are adjacent and one pass over a panel produces 16 outputs of every row of x.
 *   f32:  w  float  [P, K, 16]
 *   q8_0: q  int8   [P, K/32, 32, 16]        w = d * q
 *         d  f16    [P, K/32, 16]            (one scale per output and group of 32 k)
 *   q4_0: q  uint8  [P, K/32, 32, 8]         byte j of a k holds output j (low nibble)
 *         d  f16    [P, K/32, 16]            and output j + 8 (high nibble); w = d * (q - 8)
 *   q4_1: as q4_0, and m f16 [P, K/32, 16]   w = d * q + m
 * These are GGUF's Q8_0, Q4_0 and Q4_1 blocks (32 values along K with an f16 scale,
 * and a min for Q4_1) with the same bits, reordered so a panel is contiguous.
 *
 * Exactness: a group's weights are decoded with the reference's operations (gguf's
 * dequantize: d * q, d * (q - 8), d * q + m, each product rounded to float32 before
 * the add; this file is built with -ffp-contract=off so no FMA merges them), so the
 * product differs from dequantize-then-matmul only in the order of accumulation.
 *
 * Blocking: rows of x in chunks of about 192 KiB (a chunk stays in L2 while every panel passes);
 * within a chunk, register blocks of MR = 6 rows x 16 outputs (12 accumulators). With
 * more than MR rows a quantized panel is decoded once per chunk into a float buffer
 * (L2) that every register block reads; with MR rows or fewer each group of 32 k is
 * decoded into a tile in L1 just before its products.
 *
 * Threads: a call with threads > 1 splits the panels (the outputs) into contiguous
 * ranges, CHUNKS_PER_PART per taking part for a call of few rows (a decode step), one
 * otherwise; the caller and workers of a pool kept by this module each claim the next
 * range left until none is, and the caller returns once every range is done. On a host
 * where another process holds a core, a worker that is not running claims nothing and
 * is not waited for: the others compute what it would have, and only a range it was in
 * the middle of, not a fixed share, is waited for (a worker that wakes after its job
 * finds no range left; one that wakes into the next job takes its ranges). Every
 * output is computed by one thread in the same order as without threads, so the result
 * does not depend on the thread count or on who claimed what. Workers spin for
 * SPIN_NS after a range (a decode step calls this hundreds of times, microseconds
 * apart) and then sleep on a condition variable; a call too small to pay for the
 * hand-off (under MIN_MACS_PER_THREAD multiply-adds a thread), or made while another
 * thread's call holds the pool, runs on the caller alone. The pool runs any job of
 * ranges (`parallel_for`); lamina.model._kv_attention takes it through the capsule that
 * `parallel_pool()` returns, so the products and attention share one set of workers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_X86 1
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define HAVE_X86 0
#endif

enum { FMT_F32 = 0, FMT_Q8_0 = 1, FMT_Q4_0 = 2, FMT_Q4_1 = 3 };
#define NR 16
#define GS 32
#define MR 6
#define CHUNK_FLOATS (48 * 1024) /* rows of x per chunk: about 192 KiB of them, whatever K */

typedef struct {
    int fmt;
    const float *x; /* [m, k] row-major */
    float *y;       /* [m, n] row-major */
    int64_t m, k, n;
    const void *w;       /* f32 panels, or the quantized values */
    const uint16_t *d;   /* f16 scales (quantized formats) */
    const uint16_t *mn;  /* f16 mins (q4_1) */
    const float *bias;   /* [n] or NULL */
} job_t;

static inline int64_t groups(const job_t *j) { return j->k / GS; }

/* Bytes of quantized values per group of one panel. */
static inline int64_t group_bytes(int fmt) { return fmt == FMT_Q8_0 ? GS * NR : GS * NR / 2; }

static inline const uint8_t *panel_q(const job_t *j, int64_t p) {
    return (const uint8_t *)j->w + p * groups(j) * group_bytes(j->fmt);
}

/* ---------------------------------------------------------------- portable path */

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

/* Group g of panel p as floats, out[kk * 16 + c]. */
static void decode_group_scalar(const job_t *j, int64_t p, int64_t g, float *out) {
    const int64_t G = groups(j);
    const uint8_t *q = panel_q(j, p) + g * group_bytes(j->fmt);
    const uint16_t *d = j->d + (p * G + g) * NR;
    const uint16_t *mn = j->mn ? j->mn + (p * G + g) * NR : NULL;
    for (int kk = 0; kk < GS; kk++) {
        for (int c = 0; c < NR; c++) {
            const float dc = half_to_float(d[c]);
            float w;
            if (j->fmt == FMT_Q8_0) {
                w = dc * (float)(int8_t)q[kk * NR + c];
            } else {
                const uint8_t b = q[kk * (NR / 2) + (c & 7)];
                const int v = c < 8 ? (b & 0x0f) : (b >> 4);
                if (j->fmt == FMT_Q4_0) {
                    w = dc * (float)(v - 8);
                } else {
                    const float prod = dc * (float)v;
                    w = prod + half_to_float(mn[c]);
                }
            }
            out[kk * NR + c] = w;
        }
    }
}

static void run_scalar(const job_t *j, float *buf, int64_t p0, int64_t p1) {
    const int64_t K = j->k;
    for (int64_t p = p0; p < p1; p++) {
        const float *w;
        if (j->fmt == FMT_F32) {
            w = (const float *)j->w + p * K * NR;
        } else {
            for (int64_t g = 0; g < groups(j); g++) decode_group_scalar(j, p, g, buf + g * GS * NR);
            w = buf;
        }
        const int ncols = j->n - p * NR < NR ? (int)(j->n - p * NR) : NR;
        for (int64_t r = 0; r < j->m; r++) {
            float acc[NR];
            for (int c = 0; c < NR; c++) acc[c] = j->bias && c < ncols ? j->bias[p * NR + c] : 0.0f;
            const float *x = j->x + r * K;
            for (int64_t k = 0; k < K; k++)
                for (int c = 0; c < NR; c++) acc[c] += x[k] * w[k * NR + c];
            memcpy(j->y + r * j->n + p * NR, acc, (size_t)ncols * sizeof(float));
        }
    }
}

/* ---------------------------------------------------------------- AVX2 path */

#if HAVE_X86

/* Weights k = kk of a group, its 16 outputs decoded with the reference's operations:
 * lo = outputs 0-7, hi = 8-15. d0/d1: the group's scales; m0/m1: its mins (q4_1).
 * Inlined where the format is fixed for a whole loop, so the branches go. */
TARGET_AVX2 static inline __attribute__((always_inline)) void decode_k_avx2(int fmt, const uint8_t *q, int kk,
                                                                             __m256 d0, __m256 d1, __m256 m0,
                                                                             __m256 m1, __m256 *lo, __m256 *hi) {
    if (fmt == FMT_Q8_0) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + kk * NR));
        *lo = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
        *hi = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
        return;
    }
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i b = _mm_loadl_epi64((const __m128i *)(q + kk * (NR / 2)));
    const __m256i vlo = _mm256_cvtepu8_epi32(_mm_and_si128(b, mask));
    const __m256i vhi = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
    if (fmt == FMT_Q4_0) {
        const __m256i eight = _mm256_set1_epi32(8);
        *lo = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_sub_epi32(vlo, eight)));
        *hi = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_sub_epi32(vhi, eight)));
        return;
    }
    /* d * q rounded, then + m: the reference's two roundings */
    *lo = _mm256_add_ps(_mm256_mul_ps(d0, _mm256_cvtepi32_ps(vlo)), m0);
    *hi = _mm256_add_ps(_mm256_mul_ps(d1, _mm256_cvtepi32_ps(vhi)), m1);
}

/* A group's scales (and mins, q4_1; zeros otherwise) as 8-float halves. */
TARGET_AVX2 static inline __attribute__((always_inline)) void group_scales_avx2(const uint16_t *d, const uint16_t *mn,
                                                                                 __m256 *d0, __m256 *d1, __m256 *m0,
                                                                                 __m256 *m1) {
    *d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d));
    *d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + 8)));
    *m0 = mn ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mn)) : _mm256_setzero_ps();
    *m1 = mn ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + 8))) : _mm256_setzero_ps();
}

TARGET_AVX2 static inline __attribute__((always_inline)) void decode_group_as(const int fmt, const uint8_t *q,
                                                                               const uint16_t *d, const uint16_t *mn,
                                                                               float *out) {
    __m256 d0, d1, m0, m1, lo, hi;
    group_scales_avx2(d, mn, &d0, &d1, &m0, &m1);
    for (int kk = 0; kk < GS; kk++) {
        decode_k_avx2(fmt, q, kk, d0, d1, m0, m1, &lo, &hi);
        _mm256_store_ps(out + kk * NR, lo);
        _mm256_store_ps(out + kk * NR + 8, hi);
    }
}

/* Group g of panel p as floats into out[kk * 16 + c] (64-byte aligned). */
TARGET_AVX2 static inline void decode_group_avx2(const job_t *j, const uint8_t *q, const uint16_t *d,
                                                 const uint16_t *mn, float *out) {
    switch (j->fmt) { /* one loop per format, its decode inlined */
    case FMT_Q8_0: decode_group_as(FMT_Q8_0, q, d, mn, out); break;
    case FMT_Q4_0: decode_group_as(FMT_Q4_0, q, d, mn, out); break;
    default: decode_group_as(FMT_Q4_1, q, d, mn, out); break;
    }
}

/* Accumulators of register block row r: a<r>0 (outputs 0-7), a<r>1 (outputs 8-15).
 * Named variables, not an array, so that they stay in registers. */
#define ROW_FMA(r)                                                   \
    if (R > r) {                                                     \
        const __m256 xb = _mm256_broadcast_ss(xr + r * ldx + kk);     \
        a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);                  \
        a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);                  \
    }

#define ROW_FMA_ODD(r, s)                                            \
    if (R > r) {                                                     \
        const __m256 xb = _mm256_broadcast_ss(xr + r * ldx + kk + 1); \
        a##s##0 = _mm256_fmadd_ps(xb, v0, a##s##0);                  \
        a##s##1 = _mm256_fmadd_ps(xb, v1, a##s##1);                  \
    }

/* a += x[0 .. R, 0 .. kn) @ w[kn, 16] (R a constant after inlining). With three rows
 * or fewer, odd k go to the spare accumulators of rows r + 3 (added in at the end),
 * so that more independent sums hide the latency of the multiply-adds. */
#define FMA_ROWS(xbase, wbase, kn)                                   \
    do {                                                             \
        const float *xr = (xbase);                                   \
        const float *wr = (wbase);                                   \
        int64_t kk = 0;                                              \
        if (R <= 3) {                                                \
            for (; kk + 2 <= (kn); kk += 2) {                        \
                const __m256 w0 = _mm256_loadu_ps(wr + kk * NR);     \
                const __m256 w1 = _mm256_loadu_ps(wr + kk * NR + 8); \
                const __m256 v0 = _mm256_loadu_ps(wr + kk * NR + 16); \
                const __m256 v1 = _mm256_loadu_ps(wr + kk * NR + 24); \
                ROW_FMA(0) ROW_FMA(1) ROW_FMA(2)                     \
                ROW_FMA_ODD(0, 3) ROW_FMA_ODD(1, 4) ROW_FMA_ODD(2, 5) \
            }                                                        \
        }                                                            \
        for (; kk < (kn); kk++) {                                    \
            const __m256 w0 = _mm256_loadu_ps(wr + kk * NR);         \
            const __m256 w1 = _mm256_loadu_ps(wr + kk * NR + 8);     \
            ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5) \
        }                                                            \
    } while (0)

/* Panel p's 16 biases (zeros past ncols, or all zeros without a bias). */
TARGET_AVX2 static inline void load_bias(const job_t *j, int64_t p, int ncols, __m256 *lo, __m256 *hi) {
    float bb[NR] = {0};
    if (j->bias) memcpy(bb, j->bias + p * NR, (size_t)ncols * sizeof(float));
    *lo = _mm256_loadu_ps(bb);
    *hi = _mm256_loadu_ps(bb + 8);
}

/* A panel's 16 outputs of one row (ncols of them real: the last panel is padded). */
TARGET_AVX2 static inline void store_outputs(float *y, __m256 lo, __m256 hi, int ncols) {
    if (ncols == NR) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
    } else {
        float out[NR];
        _mm256_storeu_ps(out, lo);
        _mm256_storeu_ps(out + 8, hi);
        memcpy(y, out, (size_t)ncols * sizeof(float));
    }
}

#define ROW_STORE(r) \
    if (R > r) store_outputs(j->y + (r0 + r) * j->n + p * NR, a##r##0, a##r##1, ncols);

/* R rows starting at r0 against panel p: from the float panel wf when given (f32, or
 * a quantized panel decoded in advance), else decoding group by group into tile. */
TARGET_AVX2 static inline __attribute__((always_inline)) void rows_avx2(const int R, const job_t *j, int64_t r0,
                                                                        int64_t p, const float *wf, float *tile) {
    const int64_t K = j->k, ldx = K;
    const int ncols = j->n - p * NR < NR ? (int)(j->n - p * NR) : NR;
    __m256 b0, b1;
    load_bias(j, p, ncols, &b0, &b1);
    __m256 a00 = b0, a01 = b1, a10 = b0, a11 = b1, a20 = b0, a21 = b1;
    /* rows 3-5 start at zero when they are row 0-2's spares (the bias is counted once) */
    const __m256 z = _mm256_setzero_ps();
    __m256 a30 = R <= 3 ? z : b0, a31 = R <= 3 ? z : b1, a40 = R <= 3 ? z : b0, a41 = R <= 3 ? z : b1;
    __m256 a50 = R <= 3 ? z : b0, a51 = R <= 3 ? z : b1;
    const float *x = j->x + r0 * K;
    if (wf) {
        FMA_ROWS(x, wf, K);
    } else {
        const int64_t G = groups(j);
        const uint8_t *q = panel_q(j, p);
        const uint16_t *d = j->d + p * G * NR;
        const uint16_t *mn = j->mn ? j->mn + p * G * NR : NULL;
        for (int64_t g = 0; g < G; g++) {
            decode_group_avx2(j, q + g * group_bytes(j->fmt), d + g * NR, mn ? mn + g * NR : NULL, tile);
            FMA_ROWS(x + g * GS, tile, GS);
        }
    }
    if (R <= 3) {
        a00 = _mm256_add_ps(a00, a30);
        a01 = _mm256_add_ps(a01, a31);
        a10 = _mm256_add_ps(a10, a40);
        a11 = _mm256_add_ps(a11, a41);
        a20 = _mm256_add_ps(a20, a50);
        a21 = _mm256_add_ps(a21, a51);
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* One row of x against quantized panel p, each group's weights decoded in registers
 * and multiplied at once (the matrix-vector product of a decode step at batch 1: no
 * tile stored and read back). The sums are those of rows_avx2 with R = 1 in the same
 * order (even k into a00/a01, odd k into the spares a30/a31, added at the end), so the
 * result is bit for bit the same. */
TARGET_AVX2 static inline __attribute__((always_inline)) void row1_avx2(const int fmt, const job_t *j, int64_t r0,
                                                                         int64_t p) {
    const int64_t G = groups(j);
    const int ncols = j->n - p * NR < NR ? (int)(j->n - p * NR) : NR;
    __m256 a00, a01;
    load_bias(j, p, ncols, &a00, &a01);
    __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    const float *x = j->x + r0 * j->k;
    const uint8_t *q = panel_q(j, p);
    const uint16_t *d = j->d + p * G * NR;
    const uint16_t *mn = j->mn ? j->mn + p * G * NR : NULL;
    const int64_t gb = group_bytes(fmt);
    for (int64_t g = 0; g < G; g++, q += gb, d += NR, mn = mn ? mn + NR : NULL, x += GS) {
        __m256 d0, d1, m0, m1, w0, w1, v0, v1;
        group_scales_avx2(d, mn, &d0, &d1, &m0, &m1);
        for (int kk = 0; kk < GS; kk += 2) {
            decode_k_avx2(fmt, q, kk, d0, d1, m0, m1, &w0, &w1);
            decode_k_avx2(fmt, q, kk + 1, d0, d1, m0, m1, &v0, &v1);
            const __m256 xb = _mm256_broadcast_ss(x + kk), xc = _mm256_broadcast_ss(x + kk + 1);
            a00 = _mm256_fmadd_ps(xb, w0, a00);
            a01 = _mm256_fmadd_ps(xb, w1, a01);
            a30 = _mm256_fmadd_ps(xc, v0, a30);
            a31 = _mm256_fmadd_ps(xc, v1, a31);
        }
    }
    store_outputs(j->y + r0 * j->n + p * NR, _mm256_add_ps(a00, a30), _mm256_add_ps(a01, a31), ncols);
}

TARGET_AVX2 static void row1_quant_avx2(const job_t *j, int64_t r0, int64_t p) {
    switch (j->fmt) { /* one copy per format, its decode inlined */
    case FMT_Q8_0: row1_avx2(FMT_Q8_0, j, r0, p); break;
    case FMT_Q4_0: row1_avx2(FMT_Q4_0, j, r0, p); break;
    default: row1_avx2(FMT_Q4_1, j, r0, p); break;
    }
}

TARGET_AVX2 static void rows_dispatch(int R, const job_t *j, int64_t r0, int64_t p, const float *wf, float *tile) {
    switch (R) {
    case 1: rows_avx2(1, j, r0, p, wf, tile); break;
    case 2: rows_avx2(2, j, r0, p, wf, tile); break;
    case 3: rows_avx2(3, j, r0, p, wf, tile); break;
    case 4: rows_avx2(4, j, r0, p, wf, tile); break;
    case 5: rows_avx2(5, j, r0, p, wf, tile); break;
    default: rows_avx2(6, j, r0, p, wf, tile); break;
    }
}

TARGET_AVX2 static void run_avx2(const job_t *j, float *buf, float *tile, int64_t p0, int64_t p1) {
    const int64_t K = j->k, G = groups(j);
    int64_t chunk = CHUNK_FLOATS / K / MR * MR;
    if (chunk < MR) chunk = MR;
    for (int64_t c0 = 0; c0 < j->m; c0 += chunk) {
        const int64_t rows = j->m - c0 < chunk ? j->m - c0 : chunk;
        for (int64_t p = p0; p < p1; p++) {
            const float *wf = NULL;
            if (j->fmt == FMT_F32) {
                wf = (const float *)j->w + p * K * NR;
            } else if (rows > MR) { /* decoded once, read by every register block of the chunk */
                const uint8_t *q = panel_q(j, p);
                for (int64_t g = 0; g < G; g++)
                    decode_group_avx2(j, q + g * group_bytes(j->fmt), j->d + (p * G + g) * NR,
                                      j->mn ? j->mn + (p * G + g) * NR : NULL, buf + g * GS * NR);
                wf = buf;
            }
            if (rows == 1 && !wf) {
                row1_quant_avx2(j, c0, p);
                continue;
            }
            for (int64_t r0 = c0; r0 < c0 + rows; r0 += MR) {
                const int64_t left = c0 + rows - r0;
                rows_dispatch(left < MR ? (int)left : MR, j, r0, p, wf, tile);
            }
        }
    }
}

static int use_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
}
#endif

/* ---------------------------------------------------------------- one thread's share */

/* Scratch of the calling thread, kept between calls (a decode step makes hundreds). */
static __thread float *scratch;
static __thread size_t scratch_floats;

/* Panels [p0, p1) of the job on this thread. */
static int run_range(const job_t *j, int force_scalar, int64_t p0, int64_t p1) {
    /* tile: one decoded group; buf: a decoded panel (quantized formats). 64-byte aligned. */
    const size_t need = GS * NR + (j->fmt == FMT_F32 ? 0 : (size_t)(j->k * NR));
    if (need > scratch_floats) {
        float *mem = aligned_alloc(64, need * sizeof(float));
        if (!mem) return -1;
        free(scratch);
        scratch = mem;
        scratch_floats = need;
    }
    float *tile = scratch, *buf = scratch + GS * NR;
#if HAVE_X86
    if (!force_scalar && use_avx2())
        run_avx2(j, buf, tile, p0, p1);
    else
        run_scalar(j, buf, p0, p1);
#else
    (void)force_scalar;
    run_scalar(j, buf, p0, p1);
#endif
    return 0;
}

/* ---------------------------------------------------------------- the worker pool */

#define MAX_THREADS 64
#define SPIN_NS 100000LL            /* how long an idle worker spins before it sleeps */
#define MIN_MACS_PER_THREAD 131072  /* below this a thread's share is not worth handing off */
#define CHUNKS_PER_PART 4           /* ranges per taking part of a call of at most FEW_ROWS rows */
#define FEW_ROWS 16                 /* more rows: one range a part (each range re-reads x's chunks) */

/* A job for the pool: units [0, units) in `ranges` contiguous ranges, each run by one
 * thread as fn(ctx, u0, u1) (non-zero: failed). The products' job is the panels of one
 * matmul; lamina.model._kv_attention hands its sequences and heads to the same pool
 * (through the capsule `parallel_pool`), so one set of workers serves every kernel and
 * none of them spins while another pool's threads need the core. */
typedef int (*range_fn)(const void *ctx, int64_t u0, int64_t u1);

static struct {
    pthread_mutex_t dispatch; /* held by the one caller using the workers */
    pthread_mutex_t mu;       /* with cv: sleeping workers */
    pthread_cond_t cv;
    int started;              /* workers running: indices 1 .. started */
    /* (generation << 8) | parts: one word, so that a worker learns whether it takes part
     * in a job together with the job's generation (a worker that sat one job out must not
     * read the next job's part count as the old one's: it would run its range twice) */
    atomic_ulong ticket;
    atomic_int sleepers;
    atomic_int failed;
    /* (ranges << 32) | the next range nobody has claimed, of the current job: one word, so
     * that a claim sees its job's range count and never another job's */
    atomic_ullong claims;
    atomic_long done_ranges;  /* ranges of the current job computed */
    /* the current job, written before the ticket is published, read only by its parts */
    range_fn fn;
    const void *ctx;
    int64_t units;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline int64_t range_start(int64_t units, int64_t ranges, int64_t i) { return units * i / ranges; }

/* Claim and run ranges of the current job until none is left. The job's fields are read
 * only after a claim succeeds: they were written before its claims were opened. */
static void run_claimed(void) {
    for (;;) {
        const unsigned long long claim = atomic_fetch_add(&pool.claims, 1);
        const int64_t ranges = (int64_t)(claim >> 32), r = (int64_t)(claim & 0xffffffffULL);
        if (r >= ranges) return;
        if (pool.fn(pool.ctx, range_start(pool.units, ranges, r), range_start(pool.units, ranges, r + 1)))
            atomic_store(&pool.failed, 1);
        atomic_fetch_add(&pool.done_ranges, 1);
    }
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if HAVE_X86
    __builtin_ia32_pause();
#endif
}

typedef struct {
    int index;
    unsigned long seen; /* the ticket when it was started: the next one is its first job */
} worker_arg_t;

static void *worker_main(void *arg) {
    const worker_arg_t start = *(const worker_arg_t *)arg;
    free(arg);
    const int index = start.index;
    unsigned long seen = start.seen;
    for (;;) {
        /* wait for a new job: spin a while, then sleep */
        unsigned long ticket = atomic_load(&pool.ticket);
        if (ticket == seen) {
            const long long until = now_ns() + SPIN_NS;
            int spins = 0;
            while ((ticket = atomic_load(&pool.ticket)) == seen) {
                cpu_relax();
                if (++spins % 64 == 0 && now_ns() > until) break;
            }
            if (ticket == seen) {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleepers, 1);
                while ((ticket = atomic_load(&pool.ticket)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.mu);
            }
        }
        seen = ticket;
        const int parts = (int)(ticket & 0xff);
        if (index < parts) run_claimed();
    }
    return NULL;
}

/* A forked child has none of its parent's workers: start afresh. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.dispatch, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pool.started = 0;
    atomic_store(&pool.sleepers, 0);
}

/* Workers 1 .. want - 1 running (the caller is part 0); returns how many parts can run. */
static int pool_grow(int want) {
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        atfork_done = 1;
    }
    while (pool.started < want - 1) {
        worker_arg_t *arg = malloc(sizeof *arg);
        if (!arg) break;
        arg->index = pool.started + 1;
        arg->seen = atomic_load(&pool.ticket); /* stable: only this dispatcher publishes */
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&tid, &attr, worker_main, arg);
        pthread_attr_destroy(&attr);
        if (rc) {
            free(arg);
            break;
        }
        pool.started++;
    }
    return pool.started + 1;
}

/* fn over units [0, units) in `ranges` ranges (at most units) on up to `parts` threads, the
 * caller one of them; returns once every range is done (-1 if one failed). With one
 * part, or while another thread's job holds the pool, the caller runs them all alone. */
static int parallel_for(range_fn fn, const void *ctx, int64_t units, int64_t ranges, int parts) {
    if (units <= 0) return 0;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    if (ranges > units) ranges = units;
    if (parts > ranges) parts = (int)ranges;
    if (parts <= 1 || pthread_mutex_trylock(&pool.dispatch) != 0) return fn(ctx, 0, units);
    parts = pool_grow(parts);
    int rc = 0;
    if (parts <= 1) {
        rc = fn(ctx, 0, units);
    } else {
        pool.fn = fn;
        pool.ctx = ctx;
        pool.units = units;
        atomic_store(&pool.failed, 0);
        atomic_store(&pool.done_ranges, 0);
        /* opens the claims: after every field above (a late worker's claim on the last job's
         * word is overwritten here, and it found no range left in it) */
        atomic_store(&pool.claims, (unsigned long long)ranges << 32);
        /* publishes the job (sequentially consistent: its fields are visible to the parts) */
        const unsigned long generation = (atomic_load(&pool.ticket) >> 8) + 1;
        atomic_store(&pool.ticket, (generation << 8) | (unsigned long)parts);
        if (atomic_load(&pool.sleepers) > 0) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_broadcast(&pool.cv);
            pthread_mutex_unlock(&pool.mu);
        }
        run_claimed();
        int spins = 0;
        while (atomic_load(&pool.done_ranges) < ranges)
            if (++spins % 1024 == 0) sched_yield(); else cpu_relax();
        if (atomic_load(&pool.failed)) rc = -1;
    }
    pthread_mutex_unlock(&pool.dispatch);
    return rc;
}

typedef struct {
    const job_t *job;
    int force_scalar;
} matmul_ctx_t;

static int matmul_range(const void *ctx, int64_t p0, int64_t p1) {
    const matmul_ctx_t *c = ctx;
    return run_range(c->job, c->force_scalar, p0, p1);
}

static int run(const job_t *j, int force_scalar, int threads) {
    const int64_t panels = (j->n + NR - 1) / NR;
    int64_t parts = threads < MAX_THREADS ? threads : MAX_THREADS;
    const int64_t by_work = j->m * j->k * j->n / MIN_MACS_PER_THREAD;
    if (parts > by_work) parts = by_work;
    if (parts < 1) parts = 1;
    const matmul_ctx_t ctx = {j, force_scalar};
    return parallel_for(matmul_range, &ctx, panels, parts * (j->m <= FEW_ROWS ? CHUNKS_PER_PART : 1), (int)parts);
}

/* ---------------------------------------------------------------- entry points */

static PyObject *matmul(PyObject *self, PyObject *args) {
    int fmt, force_scalar = 0, threads = 1;
    long long x, y, m, k, n, w, d, mn, bias;
    if (!PyArg_ParseTuple(args, "LLLiLLLLLL|pi", &x, &y, &m, &fmt, &k, &n, &w, &d, &mn, &bias, &force_scalar,
                          &threads))
        return NULL;
    if (fmt < FMT_F32 || fmt > FMT_Q4_1 || m < 0 || k <= 0 || n <= 0 || (fmt != FMT_F32 && k % GS) ||
        (fmt != FMT_F32 && !d) || (fmt == FMT_Q4_1 && !mn) || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "bad packed matmul arguments");
        return NULL;
    }
    job_t job = {fmt, (const float *)(intptr_t)x, (float *)(intptr_t)y, m, k, n, (const void *)(intptr_t)w,
                 (const uint16_t *)(intptr_t)d, (const uint16_t *)(intptr_t)mn, (const float *)(intptr_t)bias};
    int rc = 0;
    if (m > 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = run(&job, force_scalar, threads);
        Py_END_ALLOW_THREADS
    }
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *has_avx2(PyObject *self, PyObject *unused) {
#if HAVE_X86
    return PyBool_FromLong(use_avx2());
#else
    Py_RETURN_FALSE;
#endif
}

/* The pool for other native modules: a capsule holding a pointer to a
 * `int (*)(range_fn, const void *ctx, int64_t units, int64_t ranges, int parts)`, named
 * PARALLEL_CAPSULE (lamina.model._kv_attention checks the name before using it). */
#define PARALLEL_CAPSULE "lamina.model._qmatmul.parallel_for"
static int (*const parallel_for_ptr)(range_fn, const void *, int64_t, int64_t, int) = parallel_for;

static PyObject *parallel_pool(PyObject *self, PyObject *unused) {
    return PyCapsule_New((void *)&parallel_for_ptr, PARALLEL_CAPSULE, NULL);
}

/* The products for other native modules (csrc/slice_ops.c's fused slice): a capsule
 * holding a pointer to a `products_fn`, named PRODUCTS_CAPSULE. Arguments as `matmul`'s,
 * already checked by the caller; returns -1 when out of memory. */
typedef int (*products_fn)(int fmt, const float *x, float *y, int64_t m, int64_t k, int64_t n, const void *w,
                           const uint16_t *d, const uint16_t *mn, const float *bias, int threads);
#define PRODUCTS_CAPSULE "lamina.model._qmatmul.products"

static int products(int fmt, const float *x, float *y, int64_t m, int64_t k, int64_t n, const void *w,
                    const uint16_t *d, const uint16_t *mn, const float *bias, int threads) {
    const job_t job = {fmt, x, y, m, k, n, w, d, mn, bias};
    return m > 0 ? run(&job, 0, threads) : 0;
}
static const products_fn products_ptr = products;

static PyObject *products_capsule(PyObject *self, PyObject *unused) {
    return PyCapsule_New((void *)&products_ptr, PRODUCTS_CAPSULE, NULL);
}

static PyMethodDef methods[] = {
    {"parallel_pool", parallel_pool, METH_NOARGS,
     "a capsule of this module's worker pool, for the other native kernels (see csrc/qmatmul.c)"},
    {"products", products_capsule, METH_NOARGS,
     "a capsule of this module's packed products, for the other native kernels (see csrc/qmatmul.c)"},
    {"matmul", matmul, METH_VARARGS,
     "matmul(x, y, m, fmt, k, n, w, d, mn, bias[, force_scalar[, threads]]): addresses of checked buffers; "
     "see model/quant.py"},
    {"has_avx2", has_avx2, METH_NOARGS, "whether the AVX2/FMA/F16C kernels run on this CPU"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qmatmul", NULL, -1, methods};

PyMODINIT_FUNC PyInit__qmatmul(void) { return PyModule_Create(&module); }
