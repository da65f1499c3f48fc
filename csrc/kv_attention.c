/*
 * Attention of a batch of sequences over KV read in place: one call for every
 * sequence of a step, no copy of any sequence's history.
 *
 * Built at install into model/_kv_attention (setup.py); model/kv_attention.py checks
 * every argument (dtypes, shapes, contiguity, slot ranges) and is the only caller.
 *
 * Layout (float32, contiguous):
 *   q    [T, Hq, D]     the new tokens' queries, sequences concatenated
 *   out  [T, Hq, D]
 *   lse  [T, Hq]        optional: log-sum-exp of the scaled scores (-inf: no key)
 *   keys of sequence b, row j: k_base[b] + row(j) * Hkv * D floats, where
 *   row(j) = slots[kv_start[b] + j] when slots are given (a slab pool), else j
 *   (a sequence's own buffer); values alike from v_base[b]. Sequence b has
 *   L_b = kv_len[b] keys, or kv_start[b + 1] - kv_start[b] without kv_len (a
 *   shorter kv_len attends over a prefix of the sequence's slots).
 * Query i of sequence b (of n_b) sees keys 0 .. L_b - n_b + i when causal, every
 * key otherwise.
 *
 * One pass over the keys with an online softmax, in blocks of keys: for each
 * sequence all Hq * n_b query rows are processed together, so each K and V row
 * ([Hkv, D], contiguous) is read from memory once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
/* Built with -ffast-math (vectorized expf): nothing here may rely on infinities, so
 * "no score" is a large finite negative, and -inf is written only into lse, by bits. */
#define NONE (-1e30f)
#define NONE_HALF (-5e29f)

static inline float minus_infinity(void) {
    union { uint32_t u; float f; } bits = {0xff800000u};
    return bits.f;
}

#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define CLONES
#endif

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
} job_t;

/* Eight independent partial sums: vectorizes without reassociating float adds. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float part[8] = {0};
    int64_t x = 0;
    for (; x + 8 <= d; x += 8)
        for (int u = 0; u < 8; u++) part[u] += a[x + u] * b[x + u];
    float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; x < d; x++) sum += a[x] * b[x];
    return sum;
}

/* One sequence, every head: each K and V row ([Hkv, D], contiguous) is read once per
 * block for all Hq * n query rows. Row r of the sequence is query i = r / hq, head
 * r % hq = kh * g + gg, which reads KV head kh. */
CLONES
static void one_sequence(const job_t *job, int64_t b, float *scores, float *acc, float *m, float *l) {
    const int64_t d = job->d, hq = job->hq, hkv = job->hkv, g = hq / hkv;
    const int64_t n = job->q_start[b + 1] - job->q_start[b];
    const int64_t len = job->kv_len ? job->kv_len[b] : job->kv_start[b + 1] - job->kv_start[b];
    const int64_t rows = n * hq;
    const float *kb = (const float *)(intptr_t)job->k_base[b];
    const float *vb = (const float *)(intptr_t)job->v_base[b];
    const int64_t *slots = job->slots ? job->slots + job->kv_start[b] : NULL;
    const int64_t row_stride = hkv * d;
    const float *q = job->q + job->q_start[b] * hq * d; /* [n * hq, d]: row r is query r / hq, head r % hq */

    for (int64_t r = 0; r < rows; r++) {
        m[r] = NONE;
        l[r] = 0.0f;
    }
    memset(acc, 0, (size_t)(rows * d) * sizeof(float));

    for (int64_t j0 = 0; j0 < len; j0 += BLOCK) {
        const int64_t jn = len - j0 < BLOCK ? len - j0 : BLOCK;
        const float *krow[BLOCK], *vrow[BLOCK];
        for (int64_t jj = 0; jj < jn; jj++) {
            const int64_t row = slots ? slots[j0 + jj] : j0 + jj;
            krow[jj] = kb + row * row_stride;
            vrow[jj] = vb + row * row_stride;
        }
        /* scores: [rows, BLOCK]; rows in (query i, KV head, group member) order, no divisions */
        for (int64_t jj = 0; jj < jn; jj++) {
            for (int64_t i = 0; i < n; i++) {
                /* keys past this query's own position are masked when causal */
                const int masked = job->causal && j0 + jj > len - n + i;
                for (int64_t kh = 0; kh < hkv; kh++) {
                    const float *k = krow[jj] + kh * d;
                    for (int64_t gg = 0; gg < g; gg++) {
                        const int64_t r = (i * hkv + kh) * g + gg;
                        scores[r * BLOCK + jj] = masked ? NONE : dot(q + r * d, k, d) * job->scale;
                    }
                }
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            float *s = scores + r * BLOCK;
            float bmax = NONE;
            for (int64_t jj = 0; jj < jn; jj++) bmax = s[jj] > bmax ? s[jj] : bmax;
            if (bmax <= NONE_HALF) { /* every key of the block is masked for this row */
                for (int64_t jj = 0; jj < jn; jj++) s[jj] = 0.0f;
                continue;
            }
            const float mnew = bmax > m[r] ? bmax : m[r];
            const float corr = expf(m[r] - mnew); /* 0 when m was NONE */
            l[r] *= corr;
            float *a = acc + r * d;
            for (int64_t x = 0; x < d; x++) a[x] *= corr;
            m[r] = mnew;
            float sum = 0.0f;
            for (int64_t jj = 0; jj < jn; jj++) {
                s[jj] = s[jj] <= NONE_HALF ? 0.0f : expf(s[jj] - mnew); /* now the weights */
                sum += s[jj];
            }
            l[r] += sum;
        }
        for (int64_t jj = 0; jj < jn; jj++) {
            for (int64_t rk = 0; rk < rows / g; rk++) { /* rk = i * hkv + KV head */
                const float *restrict vv = vrow[jj] + (rk % hkv) * d;
                for (int64_t gg = 0; gg < g; gg++) {
                    const int64_t r = rk * g + gg;
                    const float pj = scores[r * BLOCK + jj];
                    float *restrict a = acc + r * d;
                    for (int64_t x = 0; x < d; x++) a[x] += pj * vv[x];
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *o = job->out + (job->q_start[b] * hq + r) * d;
        const float *a = acc + r * d;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t x = 0; x < d; x++) o[x] = a[x] * inv;
        if (job->lse) job->lse[job->q_start[b] * hq + r] = l[r] > 0.0f ? m[r] + logf(l[r]) : minus_infinity();
    }
}

static int run(const job_t *job) {
    int64_t max_rows = 0;
    for (int64_t b = 0; b < job->batch; b++) {
        const int64_t rows = (job->q_start[b + 1] - job->q_start[b]) * job->hq;
        if (rows > max_rows) max_rows = rows;
    }
    if (max_rows == 0) return 0;
    float *scratch = malloc((size_t)max_rows * (BLOCK + job->d + 2) * sizeof(float));
    if (!scratch) return -1;
    float *scores = scratch, *acc = scores + max_rows * BLOCK, *m = acc + max_rows * job->d, *l = m + max_rows;
    for (int64_t b = 0; b < job->batch; b++) one_sequence(job, b, scores, acc, m, l);
    free(scratch);
    return 0;
}

static PyObject *attend(PyObject *self, PyObject *args) {
    long long q, out, lse, k_base, v_base, slots, q_start, kv_start, kv_len, batch, hq, hkv, d;
    int causal;
    float scale;
    if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLLpf", &q, &out, &lse, &k_base, &v_base, &slots, &q_start, &kv_start,
                          &kv_len, &batch, &hq, &hkv, &d, &causal, &scale))
        return NULL;
    if (batch < 0 || hq <= 0 || hkv <= 0 || d <= 0 || hq % hkv) {
        PyErr_SetString(PyExc_ValueError, "bad attention dimensions");
        return NULL;
    }
    job_t job = {(const float *)(intptr_t)q, (float *)(intptr_t)out, (float *)(intptr_t)lse,
                 (const int64_t *)(intptr_t)k_base, (const int64_t *)(intptr_t)v_base,
                 (const int64_t *)(intptr_t)slots, (const int64_t *)(intptr_t)q_start,
                 (const int64_t *)(intptr_t)kv_start, (const int64_t *)(intptr_t)kv_len, batch, hq, hkv, d, causal,
                 scale};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = run(&job);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS,
     "attend(q, out, lse, k_base, v_base, slots, q_start, kv_start, kv_len, batch, hq, hkv, d, causal, scale): "
     "addresses of checked buffers; see model/kv_attention.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kv_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kv_attention(void) { return PyModule_Create(&module); }
