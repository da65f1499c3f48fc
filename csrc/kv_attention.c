/*
 * Attention of a batch of sequences over KV read in place: one call for every
 * sequence of a step, no copy of any sequence's history.
 *
 * Built at install into model/_kv_attention (setup.py); model/kv_attention.py checks
 * every argument (dtypes, shapes, contiguity, slot ranges) and is the only caller.
 * `append_rows` (at the end) writes a step's new K or V rows into sequences' own
 * buffers, one call for the batch.
 *
 * KV rows are float32, or 4-bit packed (model/kv_quant.py): per KV head, D/2 bytes of
 * codes (group by group; byte j of a group holds its value j in the low nibble and
 * value j + group/2 in the high one) and then a float16 (min, scale) pair per group.
 * Packed rows are decoded block by block inside the loop below, for one KV head at a
 * time, into a scratch of BLOCK rows: no sequence's history is ever decoded whole.
 * `quantize` (at the end) packs float rows, the same bytes as model/kv_quant.py's torch
 * path.
 *
 * Layout (float32, contiguous):
 *   q    [T, Hq, D]     the new tokens' queries, sequences concatenated
 *   out  [T, Hq, D]
 *   lse  [T, Hq]        optional: log-sum-exp of the scaled scores (-inf: no key)
 *   keys of sequence b, row j: k_base[b] + row(j) * Hkv * D floats (Hkv packed rows
 *   when group > 0), where
 *   row(j) = slots[kv_start[b] + j] when slots are given (a slab pool), else j
 *   (a sequence's own buffer); values alike from v_base[b]. Sequence b has
 *   L_b = kv_len[b] keys, or kv_start[b + 1] - kv_start[b] without kv_len (a
 *   shorter kv_len attends over a prefix of the sequence's slots).
 * Query i of sequence b (of n_b) sees keys 0 .. L_b - n_b + i when causal, every
 * key otherwise.
 *
 * One pass over the keys with an online softmax, in blocks of BLOCK keys. Within a
 * block, for each KV head, every query row that reads that head (n_b * G of them)
 * takes the block's scores, softmax update and weighted sum of V in turn: the block's
 * K and V rows come from memory once and are then read from cache by the other rows.
 * A causal row's visible keys are a prefix of the block, so nothing is masked.
 *
 * Threads: `attend(..., threads)` with threads > 1 shares the call out over
 * lamina.model._qmatmul's worker pool (handed over once by `use_pool`): units of one
 * sequence, or of a run of one sequence's KV heads when there are few sequences, each
 * claimed by one thread. Every output row is computed by one thread in the same order as
 * with one, so the results do not depend on the thread count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64
/* Built with -ffast-math (vectorized expf): nothing here may rely on infinities, so the
 * running maximum starts at a large finite negative and -inf is written only into lse,
 * by its bits. */
#define NONE (-1e30f)

static inline float minus_infinity(void) {
    union { uint32_t u; float f; } bits = {0xff800000u};
    return bits.f;
}

/* Each loop is compiled twice on x86: for AVX2 + FMA and for the baseline; `run` picks
 * by what the CPU reports, so one built .so is fast where AVX2 is and runs everywhere.
 * (target_clones("arch=haswell") would pick by CPU model, never on AMD.) */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define X86 1
#define AVX2 __attribute__((target("avx2,fma")))
#else
#define X86 0
#define AVX2
#endif
#define INLINE static inline __attribute__((always_inline))

/* Eight floats; the unaligned, aliasing form is for loads and stores of tensor rows. */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

INLINE v8 load8(const float *p) { return *(const v8u *)p; }
INLINE void store8(float *p, v8 x) { *(v8u *)p = x; }
INLINE float hsum8(v8 x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

typedef struct {
    const float *q;
    float *out;
    float *lse; /* may be NULL */
    const int64_t *k_base, *v_base; /* addresses */
    const int64_t *slots;           /* may be NULL */
    const int64_t *q_start, *kv_start;
    const int64_t *kv_len; /* may be NULL: kv_start[b + 1] - kv_start[b] */
    int64_t batch, hq, hkv, d;
    int causal;
    float scale;
    int64_t group; /* 0: float32 rows; > 0: 4-bit packed rows, groups of this many values */
} job_t;

/* Bytes of one KV head's row in the pools. */
static inline int64_t head_bytes(const job_t *job) {
    return job->group ? job->d / 2 + 4 * (job->d / job->group) : job->d * (int64_t)sizeof(float);
}

/* A float16 (IEEE binary16) as a float: exact for every value. */
INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } r;
    if (exp == 0) {
        r.f = (float)mant * 0x1p-24f; /* zero and subnormals */
    } else if (exp == 31) {
        r.u = 0x7f800000u | (mant << 13);
    } else {
        r.u = ((exp + 112) << 23) | (mant << 13);
    }
    r.u |= sign;
    return r.f;
}

typedef int32_t i8x32 __attribute__((vector_size(32)));

/* Eight code bytes at c -> their low nibbles' m + q * s at out, their high ones' at
 * out_high. Each byte is shifted into a 32-bit lane of its own first: x86 has no byte
 * shifts, and GCC scalarizes byte-to-float conversions. */
INLINE void decode8(const uint8_t *c, float m, float s, float *out, float *out_high) {
    uint32_t a, b;
    memcpy(&a, c, 4);
    memcpy(&b, c + 4, 4);
    const i8x32 shifts = {0, 8, 16, 24, 0, 8, 16, 24};
    const i8x32 w = ((i8x32){a, a, a, a, b, b, b, b} >> shifts) & 0xff;
    store8(out, __builtin_convertvector(w & 15, v8) * s + m);
    store8(out_high, __builtin_convertvector(w >> 4, v8) * s + m);
}

/* One packed row of d values -> out[d]. (float)q * s is exact (4-bit times an 11-bit
 * significand), so the sum rounds once, fused or not: the same floats as the torch
 * decoding (model/kv_quant.py) under any contraction -ffast-math allows. */
INLINE void decode_groups(const uint8_t *restrict row, int64_t d, int64_t group, float *restrict out) {
    const uint8_t *params = row + d / 2;
    const int64_t half = group / 2;
    for (int64_t gi = 0; gi < d / group; gi++) {
        uint16_t mh, sh;
        memcpy(&mh, params + 4 * gi, 2);
        memcpy(&sh, params + 4 * gi + 2, 2);
        const float m = half_to_float(mh), s = half_to_float(sh);
        const uint8_t *c = row + gi * half;
        float *o = out + gi * group;
        int64_t j = 0;
        for (; j + 8 <= half; j += 8) decode8(c + j, m, s, o + j, o + half + j);
        for (; j < half; j++) {
            o[j] = (float)(c[j] & 15) * s + m;
            o[half + j] = (float)(c[j] >> 4) * s + m;
        }
    }
}

/* Groups of 32 (the attention workers' choice) get a copy with the size fixed, so the
 * loops unroll into straight vector code. */
INLINE void decode_q4(const uint8_t *restrict row, int64_t d, int64_t group, float *restrict out) {
    if (group == 32)
        decode_groups(row, d, 32, out);
    else
        decode_groups(row, d, group, out);
}

/* s[j] = scale * <q, k_j> for the block's first jn keys (k_j = krow[j] + off).
 * Four keys at a time: four independent accumulators hide the FMA latency. */
INLINE void scores(const float *restrict q, const float *const *krow, int64_t off, int64_t jn, int64_t d,
                   float scale, float *restrict s) {
    int64_t j = 0;
    for (; j + 4 <= jn; j += 4) {
        const float *k0 = krow[j] + off, *k1 = krow[j + 1] + off, *k2 = krow[j + 2] + off, *k3 = krow[j + 3] + off;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        int64_t x = 0;
        for (; x + 8 <= d; x += 8) {
            const v8 qq = load8(q + x);
            a0 += qq * load8(k0 + x);
            a1 += qq * load8(k1 + x);
            a2 += qq * load8(k2 + x);
            a3 += qq * load8(k3 + x);
        }
        float t0 = hsum8(a0), t1 = hsum8(a1), t2 = hsum8(a2), t3 = hsum8(a3);
        for (; x < d; x++) {
            t0 += q[x] * k0[x];
            t1 += q[x] * k1[x];
            t2 += q[x] * k2[x];
            t3 += q[x] * k3[x];
        }
        s[j] = t0 * scale;
        s[j + 1] = t1 * scale;
        s[j + 2] = t2 * scale;
        s[j + 3] = t3 * scale;
    }
    for (; j < jn; j++) {
        const float *k0 = krow[j] + off;
        v8 a0 = {0};
        int64_t x = 0;
        for (; x + 8 <= d; x += 8) a0 += load8(q + x) * load8(k0 + x);
        float t0 = hsum8(a0);
        for (; x < d; x++) t0 += q[x] * k0[x];
        s[j] = t0 * scale;
    }
}

/* acc = acc * corr + sum_j p[j] v_j (v_j = vrow[j] + off), 64 columns at a time so the
 * accumulator stays in eight registers across the block's keys. */
INLINE void weighted_values(const float *restrict p, const float *const *vrow, int64_t off, int64_t jn, int64_t d,
                            float corr, float *restrict acc) {
    int64_t x = 0;
    for (; x + 64 <= d; x += 64) {
        v8 c[8];
        for (int u = 0; u < 8; u++) c[u] = load8(acc + x + 8 * u) * corr;
        for (int64_t j = 0; j < jn; j++) {
            const float *vv = vrow[j] + off + x;
            const float pj = p[j];
            for (int u = 0; u < 8; u++) c[u] += pj * load8(vv + 8 * u);
        }
        for (int u = 0; u < 8; u++) store8(acc + x + 8 * u, c[u]);
    }
    for (; x + 8 <= d; x += 8) {
        v8 c = load8(acc + x) * corr;
        for (int64_t j = 0; j < jn; j++) c += p[j] * load8(vrow[j] + off + x);
        store8(acc + x, c);
    }
    for (; x < d; x++) {
        float c = acc[x] * corr;
        for (int64_t j = 0; j < jn; j++) c += p[j] * vrow[j][off + x];
        acc[x] = c;
    }
}

/* Asks for KV head kh of the keys j0 .. j0 + BLOCK of sequence b (or, past its end, of
 * the next sequence's first block) while the current block is computed: slots can be
 * anywhere in the pool, where the hardware's stream prefetch would not look. One head
 * at a time keeps what is fetched ahead small beside the block in use. */
INLINE void prefetch_block(const job_t *job, int64_t b, int64_t j0, int64_t kh) {
    for (; b < job->batch; b++, j0 = 0) {
        const int64_t len = job->kv_len ? job->kv_len[b] : job->kv_start[b + 1] - job->kv_start[b];
        if (j0 >= len) continue;
        const int64_t jn = len - j0 < BLOCK ? len - j0 : BLOCK;
        const int64_t hb = head_bytes(job), row_bytes = job->hkv * hb;
        const char *kb = (const char *)(intptr_t)job->k_base[b] + kh * hb;
        const char *vb = (const char *)(intptr_t)job->v_base[b] + kh * hb;
        const int64_t *slots = job->slots ? job->slots + job->kv_start[b] : NULL;
        for (int64_t j = j0; j < j0 + jn; j++) {
            const int64_t at = (slots ? slots[j] : j) * row_bytes;
            for (int64_t x = 0; x < hb; x += 64) {
                __builtin_prefetch(kb + at + x);
                __builtin_prefetch(vb + at + x);
            }
        }
        return;
    }
}

/* Query heads h0 .. h1 of one sequence (every head of it, or a piece when the sequence is
 * split over threads). Local row r is query i = r / nh, head h = h0 + r % nh (nh = h1 - h0),
 * which reads KV head h / g. m, l: [n * nh] running maximum and sum; acc: [n * nh, d];
 * s: [BLOCK]; dq: [2, BLOCK, d], a block of one head's K and V decoded (packed rows
 * only). d is a constant in the specialized copies below, so loops unroll. A row's
 * output depends on nothing but its own query and keys, so any split gives the same
 * bits. */
INLINE void one_piece(const job_t *job, int64_t b, int64_t h0, int64_t h1, int64_t d, float *acc, float *m,
                      float *l, float *s, float *dq) {
    const int64_t hq = job->hq, hkv = job->hkv, g = hq / hkv, nh = h1 - h0;
    const int64_t n = job->q_start[b + 1] - job->q_start[b];
    const int64_t len = job->kv_len ? job->kv_len[b] : job->kv_start[b + 1] - job->kv_start[b];
    const int64_t rows = n * nh;
    const char *kb = (const char *)(intptr_t)job->k_base[b];
    const char *vb = (const char *)(intptr_t)job->v_base[b];
    const int64_t *slots = job->slots ? job->slots + job->kv_start[b] : NULL;
    const int64_t group = job->group, hb = group ? d / 2 + 4 * (d / group) : d * (int64_t)sizeof(float);
    const int64_t row_stride = hkv * hb; /* bytes */
    const float *q = job->q + job->q_start[b] * hq * d; /* [n, hq, d] */

    for (int64_t r = 0; r < rows; r++) {
        m[r] = NONE;
        l[r] = 0.0f;
    }
    memset(acc, 0, (size_t)(rows * d) * sizeof(float));

    for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {
        const int64_t jn = len - j0 < BLOCK ? len - j0 : BLOCK;
        const char *kat[BLOCK], *vat[BLOCK]; /* each key's row in the pools */
        const float *krow[BLOCK], *vrow[BLOCK];
        for (int64_t j = 0; j < jn; j++) {
            const int64_t row = slots ? slots[j0 + j] : j0 + j;
            kat[j] = kb + row * row_stride;
            vat[j] = vb + row * row_stride;
            krow[j] = group ? dq + j * d : (const float *)kat[j];
            vrow[j] = group ? dq + (BLOCK + j) * d : (const float *)vat[j];
        }
        for (int64_t kh = h0 / g; kh * g < h1; kh++) {
            prefetch_block(job, b, j0 + BLOCK, kh);
            /* float rows are read at head kh's offset; packed ones are decoded to offset 0 */
            const int64_t off = group ? 0 : kh * d;
            if (group) {
                for (int64_t j = 0; j < jn; j++) {
                    decode_q4((const uint8_t *)kat[j] + kh * hb, d, group, dq + j * d);
                    decode_q4((const uint8_t *)vat[j] + kh * hb, d, group, dq + (BLOCK + j) * d);
                }
            }
            const int64_t first = kh * g > h0 ? kh * g : h0, last = kh * g + g < h1 ? kh * g + g : h1;
            for (int64_t i = 0; i < n; i++) {
                /* keys this query sees in the block: all, or up to its own position */
                int64_t seen = job->causal ? len - n + i + 1 - j0 : jn;
                if (seen > jn) seen = jn;
                if (seen <= 0) continue;
                for (int64_t h = first; h < last; h++) {
                    const int64_t r = i * nh + h - h0;
                    scores(q + (i * hq + h) * d, krow, off, seen, d, job->scale, s);
                    float bmax = s[0];
                    for (int64_t j = 1; j < seen; j++) bmax = s[j] > bmax ? s[j] : bmax;
                    const float mnew = bmax > m[r] ? bmax : m[r];
                    const float corr = expf(m[r] - mnew); /* 0 on the row's first block */
                    float sum = 0.0f;
                    for (int64_t j = 0; j < seen; j++) {
                        s[j] = expf(s[j] - mnew); /* now the weights */
                        sum += s[j];
                    }
                    m[r] = mnew;
                    l[r] = l[r] * corr + sum;
                    weighted_values(s, vrow, off, seen, d, corr, acc + r * d);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r / nh, h = h0 + r % nh, at = (job->q_start[b] + i) * hq + h; /* [T, Hq] row */
        const float *a = acc + r * d;
        float *o = job->out + at * d;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t x = 0; x < d; x++) o[x] = a[x] * inv;
        if (job->lse) job->lse[at] = l[r] > 0.0f ? m[r] + logf(l[r]) : minus_infinity();
    }
}

/* The work of one call, split into units: sequence u / pieces, KV heads piece u % pieces
 * of it (pieces equal runs of the hkv heads) with the query heads that read them. Never
 * finer than a KV head: each K and V row then still comes from memory once, for every
 * query head that reads it (split by query heads, a batch-1 step read each row G times
 * and ran no faster on two threads than on one). */
typedef struct {
    const job_t *job;
    int64_t pieces;
} split_t;

typedef void (*pieces_fn)(const split_t *, int64_t, int64_t, float *, float *, float *, float *, float *);

/* Piece p's query heads [*h0, *h1): KV heads hkv * p / pieces .. hkv * (p + 1) / pieces and
 * the G query heads of each. */
INLINE void piece_heads(const split_t *sp, int64_t p, int64_t *h0, int64_t *h1) {
    const int64_t hkv = sp->job->hkv, g = sp->job->hq / hkv;
    *h0 = g * (hkv * p / sp->pieces);
    *h1 = g * (hkv * (p + 1) / sp->pieces);
}

/* Head sizes 64 and 128 get copies with d constant (unrolled, accumulators in registers). */
#define PIECES(name, attr, dim)                                                                                \
    attr static void name(const split_t *sp, int64_t u0, int64_t u1, float *acc, float *m, float *l, float *s,   \
                          float *dq) {                                                                          \
        const job_t *job = sp->job;                                                                             \
        for (int64_t u = u0; u < u1; u++) {                                                                     \
            int64_t h0, h1;                                                                                     \
            piece_heads(sp, u % sp->pieces, &h0, &h1);                                                          \
            one_piece(job, u / sp->pieces, h0, h1, dim, acc, m, l, s, dq);                                      \
        }                                                                                                       \
    }
PIECES(pieces_d64, , 64)
PIECES(pieces_d128, , 128)
PIECES(pieces_any, , job->d)
#if X86
PIECES(pieces_d64_avx2, AVX2, 64)
PIECES(pieces_d128_avx2, AVX2, 128)
PIECES(pieces_any_avx2, AVX2, job->d)
#endif

static pieces_fn pick(int64_t d) {
#if X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return d == 64 ? pieces_d64_avx2 : d == 128 ? pieces_d128_avx2 : pieces_any_avx2;
#endif
    return d == 64 ? pieces_d64 : d == 128 ? pieces_d128 : pieces_any;
}

/* Scratch of the calling thread (the caller's, or a pool worker's), kept between calls:
 * a decode step makes one call a layer. Above SCRATCH_KEPT floats (a long prompt's
 * rows) it is given back after the call. */
#define SCRATCH_KEPT (256 * 1024)
static __thread float *scratch;
static __thread size_t scratch_floats;

/* Units [u0, u1) on this thread. */
static int run_units(const void *ctx, int64_t u0, int64_t u1) {
    const split_t *sp = ctx;
    const job_t *job = sp->job;
    int64_t max_rows = 0;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / sp->pieces;
        int64_t h0, h1;
        piece_heads(sp, u % sp->pieces, &h0, &h1);
        const int64_t rows = (job->q_start[b + 1] - job->q_start[b]) * (h1 - h0);
        if (rows > max_rows) max_rows = rows;
    }
    if (max_rows == 0) return 0;
    const size_t decoded = job->group ? (size_t)2 * BLOCK * job->d : 0;
    const size_t need = (size_t)max_rows * (job->d + 2) + BLOCK + decoded;
    if (need > scratch_floats) {
        float *mem = malloc(need * sizeof(float));
        if (!mem) return -1;
        free(scratch);
        scratch = mem;
        scratch_floats = need;
    }
    float *acc = scratch, *m = acc + max_rows * job->d, *l = m + max_rows, *s = l + max_rows, *dq = s + BLOCK;
    pick(job->d)(sp, u0, u1, acc, m, l, s, dq);
    if (scratch_floats > SCRATCH_KEPT) {
        free(scratch);
        scratch = NULL;
        scratch_floats = 0;
    }
    return 0;
}

/* lamina.model._qmatmul's worker pool (use_pool), or NULL: every call on its caller. */
typedef int (*range_fn)(const void *ctx, int64_t u0, int64_t u1);
typedef int (*parallel_fn)(range_fn, const void *ctx, int64_t units, int64_t ranges, int parts);
#define PARALLEL_CAPSULE "lamina.model._qmatmul.parallel_for"
static parallel_fn parallel;

/* Multiply-adds of Q.K (n * L * Hq * D) a thread must get for a split to pay for handing
 * work to the pool: a batch-1 step over about 30 keys and up. */
#define MIN_MACS_PER_PART 16384
/* Units per taking part: the sequences (and, when there are few, pieces of their heads)
 * are claimed one by one, so uneven lengths even out over several per thread. */
#define UNITS_PER_PART 4

static int run(const job_t *job, int threads) {
    if (job->batch == 0) return 0;
    int64_t macs = 0;
    for (int64_t b = 0; b < job->batch; b++) {
        const int64_t len = job->kv_len ? job->kv_len[b] : job->kv_start[b + 1] - job->kv_start[b];
        macs += (job->q_start[b + 1] - job->q_start[b]) * len * job->hq * job->d;
    }
    int64_t parts = parallel ? threads : 1;
    if (parts > macs / MIN_MACS_PER_PART) parts = macs / MIN_MACS_PER_PART;
    if (parts <= 1) {
        const split_t whole = {job, 1};
        return run_units(&whole, 0, job->batch);
    }
    /* Few sequences: each split into up to hkv pieces of its heads, so every part has work. */
    int64_t pieces = (UNITS_PER_PART * parts + job->batch - 1) / job->batch;
    if (pieces > job->hkv) pieces = job->hkv;
    const split_t sp = {job, pieces};
    const int64_t units = job->batch * pieces;
    return parallel(run_units, &sp, units, units, (int)parts);
}

static PyObject *attend(PyObject *self, PyObject *args) {
    long long q, out, lse, k_base, v_base, slots, q_start, kv_start, kv_len, batch, hq, hkv, d, group;
    int causal, threads = 1;
    float scale;
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLLpfL|i", &q, &out, &lse, &k_base, &v_base, &slots, &q_start, &kv_start,
                          &kv_len, &batch, &hq, &hkv, &d, &causal, &scale, &group, &threads))
        return NULL;
    if (batch < 0 || hq <= 0 || hkv <= 0 || d <= 0 || hq % hkv || group < 0 || threads < 1 ||
        (group && (group % 2 || d % group))) {
        PyErr_SetString(PyExc_ValueError, "bad attention dimensions");
        return NULL;
    }
    job_t job = {(const float *)(intptr_t)q, (float *)(intptr_t)out, (float *)(intptr_t)lse,
                 (const int64_t *)(intptr_t)k_base, (const int64_t *)(intptr_t)v_base,
                 (const int64_t *)(intptr_t)slots, (const int64_t *)(intptr_t)q_start,
                 (const int64_t *)(intptr_t)kv_start, (const int64_t *)(intptr_t)kv_len, batch, hq, hkv, d, causal,
                 scale, group};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run(&job, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Appends new rows to sequences' own buffers: sequence b's rows src_start[b] ..
 * src_start[b + 1] of src (each `row` floats) go to base[b] from row at[b] on. Rows are
 * consecutive on both sides, so each sequence is one copy. */
static PyObject *append_rows(PyObject *self, PyObject *args) {
    long long src, base, at, src_start, batch, row;
    if (!PyArg_ParseTuple(args, "LLLLLL", &src, &base, &at, &src_start, &batch, &row)) return NULL;
    if (batch < 0 || row <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad row dimensions");
        return NULL;
    }
    const float *from = (const float *)(intptr_t)src;
    const int64_t *bases = (const int64_t *)(intptr_t)base, *ats = (const int64_t *)(intptr_t)at;
    const int64_t *starts = (const int64_t *)(intptr_t)src_start;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t b = 0; b < batch; b++)
        memcpy((float *)(intptr_t)bases[b] + ats[b] * row, from + starts[b] * row,
               (size_t)((starts[b + 1] - starts[b]) * row) * sizeof(float));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* A float as float16 (IEEE binary16, round to nearest even), in integer operations only
 * so that -ffast-math cannot change it: torch's conversion, bit for bit, for values of
 * magnitude up to 65504 (the caller clamps). */
static uint16_t float_to_half(float f) {
    union { float f; uint32_t u; } in = {f};
    const uint16_t sign = (uint16_t)((in.u >> 16) & 0x8000u);
    const uint32_t u = in.u & 0x7fffffffu;
    if (u >= 0x38800000u) /* normal: drop 13 bits, rounding to nearest even */
        return sign | (uint16_t)((u + 0x0fffu + ((u >> 13) & 1u) - 0x38000000u) >> 13);
    if (u < 0x33000000u) return sign; /* below half the smallest subnormal: zero */
    const uint32_t e = u >> 23, mant = (u & 0x7fffffu) | 0x800000u, shift = 126 - e; /* 14..24 */
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

static inline float clamp_f16(float x) { return x < -65504.0f ? -65504.0f : x > 65504.0f ? 65504.0f : x; }

/* round((x - m) * inv) to nearest even, clamped to 0..15 (clamping first gives the same:
 * the bounds are integers). Adding 2^23 rounds y to an integer in the sum's low bits;
 * they are read as bits, so -ffast-math has no subtraction to cancel, and no libm call. */
static inline uint8_t code_q4(float x, float m, float inv) {
    float y = (clamp_f16(x) - m) * inv;
    y = y < 0.0f ? 0.0f : y > 15.0f ? 15.0f : y;
    union { float f; uint32_t u; } r = {y + 0x1p23f};
    return (uint8_t)(r.u & 15u);
}

/* One row of d floats -> its packed bytes (model/kv_quant.py gives the definition, in
 * the same operations: a multiply by the reciprocal, never a division that -ffast-math
 * could turn into one). */
static void quantize_row(const float *restrict x, int64_t d, int64_t group, uint8_t *restrict out) {
    const int64_t half = group / 2;
    for (int64_t gi = 0; gi < d / group; gi++) {
        const float *g = x + gi * group;
        float lo = clamp_f16(g[0]), hi = lo;
        for (int64_t j = 1; j < group; j++) {
            const float v = clamp_f16(g[j]);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        const uint16_t mh = float_to_half(lo), sh = float_to_half((hi - lo) * (1.0f / 15.0f));
        const float m = half_to_float(mh), s = half_to_float(sh), inv = s > 0.0f ? 1.0f / s : 1.0f;
        uint8_t *c = out + gi * half;
        for (int64_t j = 0; j < half; j++) c[j] = (uint8_t)(code_q4(g[j], m, inv) | code_q4(g[half + j], m, inv) << 4);
        memcpy(out + d / 2 + 4 * gi, &mh, 2);
        memcpy(out + d / 2 + 4 * gi + 2, &sh, 2);
    }
}

/* rows float rows of d values (contiguous) -> rows packed rows (contiguous). */
static PyObject *quantize(PyObject *self, PyObject *args) {
    long long src, dst, rows, d, group;
    if (!PyArg_ParseTuple(args, "LLLLL", &src, &dst, &rows, &d, &group)) return NULL;
    if (rows < 0 || d <= 0 || group <= 0 || group % 2 || d % group) {
        PyErr_SetString(PyExc_ValueError, "bad quantization dimensions");
        return NULL;
    }
    const float *x = (const float *)(intptr_t)src;
    uint8_t *out = (uint8_t *)(intptr_t)dst;
    const int64_t row_bytes = d / 2 + 4 * (d / group);
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < rows; r++) quantize_row(x + r * d, d, group, out + r * row_bytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Takes lamina.model._qmatmul's pool (its parallel_pool() capsule) for calls with threads > 1. */
static PyObject *use_pool(PyObject *self, PyObject *capsule) {
    const parallel_fn *fn = PyCapsule_GetPointer(capsule, PARALLEL_CAPSULE);
    if (!fn) return NULL;
    parallel = *fn;
    Py_RETURN_NONE;
}

static PyObject *pooled(PyObject *self, PyObject *unused) { return PyBool_FromLong(parallel != NULL); }

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS,
     "attend(q, out, lse, k_base, v_base, slots, q_start, kv_start, kv_len, batch, hq, hkv, d, causal, scale, group"
     "[, threads]): addresses of checked buffers; see model/kv_attention.py"},
    {"use_pool", use_pool, METH_O, "use_pool(capsule): lamina.model._qmatmul.parallel_pool(), for threads > 1"},
    {"pooled", pooled, METH_NOARGS, "whether calls with threads > 1 have a pool to run on"},
    {"append_rows", append_rows, METH_VARARGS,
     "append_rows(src, base, at, src_start, batch, row): addresses of checked buffers; see model/kv_attention.py"},
    {"quantize", quantize, METH_VARARGS,
     "quantize(src, dst, rows, d, group): addresses of checked buffers; see model/kv_quant.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kv_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kv_attention(void) { return PyModule_Create(&module); }
