/*
 * The decoder's small operators, each over a batch of rows in one call: RMSNorm (alone
 * and after the residual add), the rotary embedding of Q and K, and the gated MLP's
 * SiLU(gate) * up. At decode batch sizes torch's versions cost far more in dispatch and
 * temporaries than in arithmetic (RMSNorm 20-40 us for ten rows of 576 values, RoPE's
 * dozen operators about 25 us for one token), and a decode step of SmolLM2 makes 30 of
 * each per layer kind.
 *
 * Built at install into model/_slice_ops (setup.py); model/llama.py checks the
 * arguments and falls back to torch where this was not built.
 *
 * Rounding follows the reference's operations (Hugging Face's modeling_llama), built
 * with -ffp-contract=off so that no multiply-add is fused:
 * - RMSNorm: x * (1 / sqrt(mean(x^2) + eps)) rounded, then times the weight. Only the
 *   order in which the squares are summed differs (eight partial sums, so that the loop
 *   vectorizes without -ffast-math reassociating anything). The residual add before it
 *   is one rounded add, as torch's, written over the sublayer's output.
 * - RoPE: x * cos + rotate_half(x) * sin, each product rounded, then the add, in place;
 *   cos and sin are read from tables torch computed (model/rope.py), so the result is
 *   the reference's bit for bit.
 * - SiLU: g / (1 + exp(-g)) with libm's expf, then times up; torch's vectorized exp may
 *   differ in the last bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

/* AVX2 where the CPU has it, chosen at load time */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define CLONES __attribute__((target_clones("arch=haswell", "default")))
#else
#define CLONES
#endif

/* out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps)); x, out: [rows, d] (x rows ldx apart). */
CLONES
static void rms_norm_rows(const float *x, int64_t ldx, const float *w, float *out, int64_t rows, int64_t d,
                          float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * d;
        float part[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= d; i += 8)
            for (int u = 0; u < 8; u++) part[u] += xr[i + u] * xr[i + u];
        float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        for (; i < d; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)d + eps);
        for (int64_t j = 0; j < d; j++) o[j] = w[j] * (xr[j] * inv);
    }
}

/* h[r] += x[r] (as x[r] + h[r], the same sum); out[r] = rms_norm(h[r]). x rows ldx apart;
 * h, out: [rows, d]. */
CLONES
static void add_rms_norm_rows(const float *x, int64_t ldx, float *h, const float *w, float *out, int64_t rows,
                              int64_t d, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *hr = h + r * d;
        for (int64_t j = 0; j < d; j++) hr[j] = xr[j] + hr[j];
    }
    rms_norm_rows(h, d, w, out, rows, d, eps);
}

/* Rotates heads [0, heads) of every row of x ([rows, row_stride] floats, heads of d
 * values adjacent) in place, at the row's position: cos, sin are [table_rows, d] (sin
 * signed as rotate-half needs: [-sin f, sin f]). Returns the first row whose position
 * is outside the table, or -1; nothing is rotated unless every position is inside. */
CLONES
static int64_t rope_rows(float *x, int64_t row_stride, const int64_t *pos, const float *cos, const float *sin,
                         int64_t table_rows, int64_t rows, int64_t heads, int64_t d) {
    for (int64_t r = 0; r < rows; r++)
        if (pos[r] < 0 || pos[r] >= table_rows) return r;
    const int64_t half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + pos[r] * d, *sn = sin + pos[r] * d;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *xh = x + r * row_stride + hd * d;
            for (int64_t i = 0; i < half; i++) {
                const float lo = xh[i], hi = xh[i + half];
                const float a = lo * c[i], b = hi * sn[i];
                const float e = hi * c[i + half], f = lo * sn[i + half];
                xh[i] = a + b;
                xh[i + half] = e + f;
            }
        }
    }
    return -1;
}

/* out[r, j] = silu(gu[r, j]) * gu[r, f + j]; gu rows ld apart, out: [rows, f]. */
CLONES
static void silu_mul_rows(const float *gu, int64_t ld, float *out, int64_t rows, int64_t f) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * ld, *u = g + f;
        float *o = out + r * f;
        for (int64_t j = 0; j < f; j++) {
            const float s = g[j] / (1.0f + expf(-g[j]));
            o[j] = s * u[j];
        }
    }
}

static PyObject *add_rms_norm(PyObject *self, PyObject *args) {
    long long x, ldx, h, w, out, rows, d;
    float eps;
    if (!PyArg_ParseTuple(args, "LLLLLLLf", &x, &ldx, &h, &w, &out, &rows, &d, &eps)) return NULL;
    if (rows < 0 || d <= 0 || ldx < d) {
        PyErr_SetString(PyExc_ValueError, "bad add_rms_norm dimensions");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    add_rms_norm_rows((const float *)(intptr_t)x, ldx, (float *)(intptr_t)h, (const float *)(intptr_t)w,
                      (float *)(intptr_t)out, rows, d, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rope(PyObject *self, PyObject *args) {
    long long x, row_stride, pos, cos, sin, table_rows, rows, heads, d;
    if (!PyArg_ParseTuple(args, "LLLLLLLLL", &x, &row_stride, &pos, &cos, &sin, &table_rows, &rows, &heads, &d))
        return NULL;
    if (rows < 0 || heads <= 0 || d <= 0 || d % 2 || row_stride < heads * d) {
        PyErr_SetString(PyExc_ValueError, "bad rope dimensions");
        return NULL;
    }
    int64_t outside;
    Py_BEGIN_ALLOW_THREADS
    outside = rope_rows((float *)(intptr_t)x, row_stride, (const int64_t *)(intptr_t)pos, (const float *)(intptr_t)cos,
                        (const float *)(intptr_t)sin, table_rows, rows, heads, d);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(outside);
}

static PyObject *silu_mul(PyObject *self, PyObject *args) {
    long long gu, ld, out, rows, f;
    if (!PyArg_ParseTuple(args, "LLLLL", &gu, &ld, &out, &rows, &f)) return NULL;
    if (rows < 0 || f <= 0 || ld < 2 * f) {
        PyErr_SetString(PyExc_ValueError, "bad silu_mul dimensions");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_rows((const float *)(intptr_t)gu, ld, (float *)(intptr_t)out, rows, f);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    long long x, ldx, w, out, rows, d;
    float eps;
    if (!PyArg_ParseTuple(args, "LLLLLLf", &x, &ldx, &w, &out, &rows, &d, &eps)) return NULL;
    if (rows < 0 || d <= 0 || ldx < d) {
        PyErr_SetString(PyExc_ValueError, "bad rms_norm dimensions");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rms_norm_rows((const float *)(intptr_t)x, ldx, (const float *)(intptr_t)w, (float *)(intptr_t)out, rows, d, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, "rms_norm(x, ldx, w, out, rows, d, eps): addresses; see model/llama.py"},
    {"add_rms_norm", add_rms_norm, METH_VARARGS,
     "add_rms_norm(x, ldx, h, w, out, rows, d, eps): h += x, out = rms_norm(h); addresses; see model/llama.py"},
    {"rope", rope, METH_VARARGS,
     "rope(x, row_stride, pos, cos, sin, table_rows, rows, heads, d) -> first row outside the table or -1; in place"},
    {"silu_mul", silu_mul, METH_VARARGS, "silu_mul(gu, ld, out, rows, f): addresses; see model/llama.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slice_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slice_ops(void) { return PyModule_Create(&module); }
