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
 *
 * `layer` runs a whole middle slice of a decode step in one call (one layer's output
 * projection, norm and MLP, then the next layer's norm, QKV projection and RoPE): the
 * operators above and lamina.model._qmatmul's products (handed over once by
 * `use_products`), in the order and on the rows the slice's traced code uses, so the
 * same bits. Its intermediates live in a per-thread scratch, grown when a longer step comes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* ---------------------------------------------------------------- the fused slice */

/* lamina.model._qmatmul's products (use_products), or NULL: `layer` refuses until set. */
typedef int (*products_fn)(int fmt, const float *x, float *y, int64_t m, int64_t k, int64_t n, const void *w,
                           const uint16_t *d, const uint16_t *mn, const float *bias, int threads);
#define PRODUCTS_CAPSULE "lamina.model._qmatmul.products"
static products_fn products;

/* One packed weight as the products read it: format, inputs k, outputs n, addresses. */
typedef struct {
    int fmt;
    int64_t k, n;
    const void *w;
    const uint16_t *d, *mn;
    const float *bias;
} weight_t;

/* A middle slice's weights and shapes, checked once when the plan is made. */
typedef struct {
    weight_t o, gate_up, down, qkv;
    const float *post_norm, *next_norm; /* [d] each */
    float eps;
    int64_t d, f, heads, kv_heads, head_dim;
} plan_t;

#define PLAN_CAPSULE "lamina.model._slice_ops.plan"

static __thread float *scratch;
static __thread size_t scratch_floats;

static float *scratch_for(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = malloc(floats * sizeof(float));
        scratch_floats = scratch ? floats : 0;
    }
    return scratch;
}

static inline int product(const weight_t *w, const float *x, float *y, int64_t rows, int threads) {
    return products(w->fmt, x, y, rows, w->k, w->n, w->w, w->d, w->mn, w->bias, threads);
}

/* attn [t, heads * head_dim], residual [t, d] -> qkv [t, (heads + 2 kv_heads) * head_dim]
 * (Q and K rotated at pos) and the residual stream after the layer, res_out [t, d].
 * Returns -2 when out of memory, the first row whose position is outside the rope table
 * (nothing computed), or -1. */
static int64_t layer_rows(const plan_t *p, const float *attn, const float *residual, const int64_t *pos,
                          const float *cos, const float *sin, int64_t table_rows, float *qkv, float *res_out,
                          int64_t t, int threads) {
    for (int64_t r = 0; r < t; r++)
        if (pos[r] < 0 || pos[r] >= table_rows) return r;
    float *mid = scratch_for((size_t)t * (size_t)(2 * p->d + 3 * p->f));
    if (!mid) return -2;
    float *xn = mid + t * p->d;      /* [t, d]: a norm's output, the input of the next product */
    float *gate_up = xn + t * p->d;  /* [t, 2f] */
    float *act = gate_up + t * 2 * p->f; /* [t, f] */
    /* the output projection, then the residual add (over it) and the MLP's norm */
    if (product(&p->o, attn, mid, t, threads)) return -2;
    add_rms_norm_rows(residual, p->d, mid, p->post_norm, xn, t, p->d, p->eps);
    if (product(&p->gate_up, xn, gate_up, t, threads)) return -2;
    silu_mul_rows(gate_up, 2 * p->f, act, t, p->f);
    /* the MLP's output lands in res_out, the add goes over it, the next layer's norm follows */
    if (product(&p->down, act, res_out, t, threads)) return -2;
    add_rms_norm_rows(mid, p->d, res_out, p->next_norm, xn, t, p->d, p->eps);
    if (product(&p->qkv, xn, qkv, t, threads)) return -2;
    const int64_t row = (p->heads + 2 * p->kv_heads) * p->head_dim;
    rope_rows(qkv, row, pos, cos, sin, table_rows, t, p->heads + p->kv_heads, p->head_dim);
    return -1;
}

static void plan_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, PLAN_CAPSULE)); }

static int parse_weight(PyObject *args, weight_t *w) {
    long long k, n, v, d, mn, bias;
    if (!PyArg_ParseTuple(args, "iLLLLLL", &w->fmt, &k, &n, &v, &d, &mn, &bias)) return 0;
    w->k = k;
    w->n = n;
    w->w = (const void *)(intptr_t)v;
    w->d = (const uint16_t *)(intptr_t)d;
    w->mn = (const uint16_t *)(intptr_t)mn;
    w->bias = (const float *)(intptr_t)bias;
    if (w->fmt < 0 || w->fmt > 3 || k <= 0 || n <= 0 || !v || (w->fmt && (k % 32 || !d)) || (w->fmt == 3 && !mn)) {
        PyErr_SetString(PyExc_ValueError, "bad packed weight");
        return 0;
    }
    return 1;
}

static PyObject *plan(PyObject *self, PyObject *args) {
    PyObject *o, *gu, *down, *qkv;
    long long post, next, d, f, heads, kv_heads, head_dim;
    float eps;
    if (!PyArg_ParseTuple(args, "O!O!O!O!LLfLLLLL", &PyTuple_Type, &o, &PyTuple_Type, &gu, &PyTuple_Type, &down,
                          &PyTuple_Type, &qkv, &post, &next, &eps, &d, &f, &heads, &kv_heads, &head_dim))
        return NULL;
    plan_t *p = calloc(1, sizeof *p);
    if (!p) return PyErr_NoMemory();
    if (!parse_weight(o, &p->o) || !parse_weight(gu, &p->gate_up) || !parse_weight(down, &p->down) ||
        !parse_weight(qkv, &p->qkv)) {
        free(p);
        return NULL;
    }
    p->post_norm = (const float *)(intptr_t)post;
    p->next_norm = (const float *)(intptr_t)next;
    p->eps = eps;
    p->d = d;
    p->f = f;
    p->heads = heads;
    p->kv_heads = kv_heads;
    p->head_dim = head_dim;
    const int64_t q = heads * head_dim;
    if (d <= 0 || f <= 0 || heads <= 0 || kv_heads <= 0 || head_dim <= 0 || head_dim % 2 || !post || !next ||
        p->o.k != q || p->o.n != d || p->gate_up.k != d || p->gate_up.n != 2 * f || p->down.k != f ||
        p->down.n != d || p->qkv.k != d || p->qkv.n != q + 2 * kv_heads * head_dim) {
        free(p);
        PyErr_SetString(PyExc_ValueError, "the weights do not make a layer of these shapes");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(p, PLAN_CAPSULE, plan_free);
    if (!capsule) free(p);
    return capsule;
}

static PyObject *layer(PyObject *self, PyObject *args) {
    PyObject *capsule;
    long long attn, residual, pos, cos, sin, table_rows, qkv, res_out, t;
    int threads;
    if (!PyArg_ParseTuple(args, "OLLLLLLLLLi", &capsule, &attn, &residual, &pos, &cos, &sin, &table_rows, &qkv,
                          &res_out, &t, &threads))
        return NULL;
    const plan_t *p = PyCapsule_GetPointer(capsule, PLAN_CAPSULE);
    if (!p) return NULL;
    if (!products) {
        PyErr_SetString(PyExc_RuntimeError, "layer needs use_products(lamina.model._qmatmul.products()) first");
        return NULL;
    }
    if (t < 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "bad layer arguments");
        return NULL;
    }
    int64_t rc;
    Py_BEGIN_ALLOW_THREADS
    rc = layer_rows(p, (const float *)(intptr_t)attn, (const float *)(intptr_t)residual, (const int64_t *)(intptr_t)pos,
                    (const float *)(intptr_t)cos, (const float *)(intptr_t)sin, table_rows, (float *)(intptr_t)qkv,
                    (float *)(intptr_t)res_out, t, threads);
    Py_END_ALLOW_THREADS
    if (rc == -2) return PyErr_NoMemory();
    return PyLong_FromLongLong(rc);
}

static PyObject *use_products(PyObject *self, PyObject *capsule) {
    const products_fn *fn = PyCapsule_GetPointer(capsule, PRODUCTS_CAPSULE);
    if (!fn) return NULL;
    products = *fn;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- entry points */

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
    {"plan", plan, METH_VARARGS,
     "plan(o, gate_up, down, qkv, post_norm, next_norm, eps, d, f, heads, kv_heads, head_dim) -> a layer plan; "
     "each weight (fmt, k, n, values, scale, minimum, bias) addresses; see model/fused_slice.py"},
    {"layer", layer, METH_VARARGS,
     "layer(plan, attn, residual, pos, cos, sin, table_rows, qkv, res_out, t, threads) -> first row outside the "
     "rope table or -1; addresses; see model/fused_slice.py"},
    {"use_products", use_products, METH_O, "use_products(capsule): lamina.model._qmatmul.products(), for layer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slice_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slice_ops(void) { return PyModule_Create(&module); }
