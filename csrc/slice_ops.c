/*
 * RMSNorm over a batch of rows in one call. At decode batch sizes torch's version
 * costs far more in dispatch and temporaries than in arithmetic (20-40 us for ten
 * rows of 576 values), and a decode step of SmolLM2 calls it 61 times.
 *
 * Built at install into model/_slice_ops (setup.py); model/llama.py checks the
 * arguments and falls back to torch where this was not built.
 *
 * Rounding follows the reference's operations (Hugging Face's LlamaRMSNorm):
 * x * (1 / sqrt(mean(x^2) + eps)) rounded, then times the weight. Only the order in
 * which the squares are summed differs (eight partial sums, so that the loop
 * vectorizes without -ffast-math reassociating anything).
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_slice_ops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__slice_ops(void) { return PyModule_Create(&module); }
