// transports._wire: the frame codec's per-frame fast path in native code.
//
// transports/frame.py defines the wire format (version 2) and is its reference
// implementation; this module produces and accepts exactly the same bytes (tests compare
// the two). It exists because the Python codec costs about ten times the system calls on
// a small frame: here a frame is described, checksummed, written and parsed without
// creating Python objects for its descriptors, and tensor memory is reached through
// data_ptr() rather than a numpy view.
//
// Everything that is not the common case returns None (send side) and the caller takes
// the Python path: tensors that are not contiguous CPU tensors of a wire dtype, buffers
// without a contiguous buffer interface, more than MAX_BUFS buffers.
//
//   setup(tensor_type, dtypes, itemsizes, frame_type, unpack, alloc, frame_error)
//   send(fd, kind, user, bufs, checksum, max_frame_bytes) -> bytes not sent | None
//   write_ring(data, start, limit, kind, user, bufs, checksum, max_frame_bytes)
//       -> bytes written (0: it does not fit in `limit`) | None
//   parse(data, start, avail, max_frame_bytes, out) -> needed bytes | (Frame, size)
//
// `user` is the msgpack of the frame's user header (packed by the caller's Packer).
// write_ring and parse address `data` as a ring: byte i of the frame is at
// (start + i) % len(data).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <zlib.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format is little-endian; big-endian hosts use the Python codec"
#endif

#define WIRE_VERSION 2
#define FLAG_PAYLOAD_CRC 1
#define PREAMBLE_SIZE 32
#define DESC_SIZE 16
#define MAX_NDIM 32
#define MAX_HEADER_BYTES (1u << 20)  // transports/frame.py MAX_HEADER_BYTES
#define MAX_BUFS 32
#define MAX_DTYPES 32
#define HEAD_STACK 2048  // preamble + header bytes built on the stack up to this size

static PyObject *tensor_type, *frame_type, *unpack_fn, *alloc_fn, *frame_error;
// By wire code ([0], raw bytes, unused). The send path matches a tensor's dtype against
// these; an entry of None (complex dtypes, whose conjugate views need resolving) is never
// matched, so those tensors take the Python path.
static PyObject *dtypes[MAX_DTYPES + 1];
static uint64_t itemsizes[MAX_DTYPES + 1];
static int num_dtypes;
static PyObject *s_dtype, *s_shape, *s_is_cpu, *s_is_contiguous, *s_data_ptr, *s_nbytes;

static void put_u16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static void put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static uint16_t get_u16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static uint32_t get_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static uint32_t crc32_of(const void *p, uint64_t n) {
    uLong c = crc32(0L, Z_NULL, 0);
    const unsigned char *b = (const unsigned char *)p;
    while (n) {  // zlib's length is a uInt
        uInt k = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, b, k);
        b += k;
        n -= k;
    }
    return (uint32_t)c;
}

static PyObject *frame_err(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    if (msg) {
        PyErr_SetObject(frame_error, msg);
        Py_DECREF(msg);
    }
    return NULL;
}

// ------------------------------------------------------------------ outgoing buffers
typedef struct {
    const char *ptr;
    uint64_t nbytes;
    int code;
    int ndim;
    uint64_t dims[MAX_NDIM];
    Py_buffer view;
    int has_view;
} OutBuf;

static int is_true_attr(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int r = (v == Py_True);
    Py_DECREF(v);
    return r;
}

static int is_true_call(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_CallMethodNoArgs(obj, name);
    if (!v) return -1;
    int r = (v == Py_True);
    Py_DECREF(v);
    return r;
}

static void *tensor_ptr(PyObject *t) {
    PyObject *p = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!p) return NULL;
    void *ptr = PyLong_AsVoidPtr(p);
    Py_DECREF(p);
    return ptr;
}

// 1: described; 0: not for the fast path (no error set); -1: error.
static int describe(PyObject *obj, OutBuf *b) {
    b->has_view = 0;
    if (Py_TYPE(obj) == (PyTypeObject *)tensor_type) {
        PyObject *dt = PyObject_GetAttr(obj, s_dtype);
        if (!dt) return -1;
        int code = 0;
        for (int i = 1; i <= num_dtypes; i++) {
            if (dtypes[i] == dt) { code = i; break; }
        }
        Py_DECREF(dt);
        if (!code) return 0;
        int r = is_true_attr(obj, s_is_cpu);
        if (r <= 0) return r;
        r = is_true_call(obj, s_is_contiguous);
        if (r <= 0) return r;
        PyObject *shape = PyObject_GetAttr(obj, s_shape);  // torch.Size: a tuple
        if (!shape) return -1;
        if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > MAX_NDIM) {
            Py_DECREF(shape);
            return 0;
        }
        b->ndim = (int)PyTuple_GET_SIZE(shape);
        uint64_t n = itemsizes[code];
        for (int i = 0; i < b->ndim; i++) {
            b->dims[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(shape, i));
            n *= b->dims[i];
        }
        Py_DECREF(shape);
        if (PyErr_Occurred()) return -1;
        b->code = code;
        b->nbytes = n;
        b->ptr = NULL;
        if (n) {
            b->ptr = (const char *)tensor_ptr(obj);
            if (!b->ptr && PyErr_Occurred()) return -1;
        }
        return 1;
    }
    if (!PyObject_CheckBuffer(obj)) return 0;
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();  // e.g. not contiguous: the Python path says what is wrong
        return 0;
    }
    b->has_view = 1;
    b->ptr = (const char *)b->view.buf;
    b->nbytes = (uint64_t)b->view.len;
    b->code = 0;
    b->ndim = 1;
    b->dims[0] = b->nbytes;
    return 1;
}

static void release(OutBuf *bufs, int n) {
    for (int i = 0; i < n; i++) {
        if (bufs[i].has_view) PyBuffer_Release(&bufs[i].view);
    }
}

typedef struct {
    OutBuf bufs[MAX_BUFS];
    int nbufs;
    Py_buffer user;
    int has_user;
    unsigned char stack[HEAD_STACK];
    unsigned char *head;  // preamble + header: `stack` or heap
    uint64_t head_len;
    uint64_t payload_len;
} Encoded;

static void encoded_free(Encoded *e) {
    release(e->bufs, e->nbufs);
    if (e->has_user) PyBuffer_Release(&e->user);
    if (e->head && e->head != e->stack) PyMem_Free(e->head);
}

// 1: encoded; 0: not for the fast path; -1: error. encoded_free(e) in every case.
static int encode_frame(Encoded *e, long kind, PyObject *user, PyObject *bufs, int checksum,
                        unsigned long long max_frame_bytes) {
    e->nbufs = 0;
    e->has_user = 0;
    e->head = NULL;
    if (kind < 0 || kind > 0xFFFF) {
        frame_err("frame kind must be in 0..65535, got %ld", kind);
        return -1;
    }
    if (!PyList_Check(bufs) && !PyTuple_Check(bufs)) return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(bufs);
    if (n > MAX_BUFS) return 0;
    PyObject **items = PySequence_Fast_ITEMS(bufs);
    uint64_t header_len = 0, payload_len = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = describe(items[i], &e->bufs[i]);
        if (r <= 0) return r;
        e->nbufs++;
        header_len += DESC_SIZE + 8 * (uint64_t)e->bufs[i].ndim;
        payload_len += e->bufs[i].nbytes;
    }
    if (PyObject_GetBuffer(user, &e->user, PyBUF_SIMPLE) < 0) return -1;
    e->has_user = 1;
    header_len += (uint64_t)e->user.len;
    if (header_len + payload_len > max_frame_bytes) {
        frame_err("frame of %llu bytes exceeds max_frame_bytes=%llu",
                  (unsigned long long)(header_len + payload_len), max_frame_bytes);
        return -1;
    }
    if (header_len > MAX_HEADER_BYTES) {
        frame_err("frame header of %llu bytes exceeds %u", (unsigned long long)header_len, MAX_HEADER_BYTES);
        return -1;
    }
    e->head_len = PREAMBLE_SIZE + header_len;
    e->payload_len = payload_len;
    e->head = e->head_len <= HEAD_STACK ? e->stack : PyMem_Malloc(e->head_len);
    if (!e->head) {
        PyErr_NoMemory();
        return -1;
    }
    unsigned char *p = e->head + PREAMBLE_SIZE;
    for (int i = 0; i < e->nbufs; i++) {
        OutBuf *b = &e->bufs[i];
        p[0] = (unsigned char)b->code;
        p[1] = (unsigned char)b->ndim;
        put_u16(p + 2, 0);
        put_u32(p + 4, checksum && b->nbytes ? crc32_of(b->ptr, b->nbytes) : 0);
        put_u64(p + 8, b->nbytes);
        p += DESC_SIZE;
        for (int d = 0; d < b->ndim; d++, p += 8) put_u64(p, b->dims[d]);
    }
    memcpy(p, e->user.buf, (size_t)e->user.len);
    unsigned char *h = e->head;
    memcpy(h, "LMNF", 4);
    h[4] = WIRE_VERSION;
    h[5] = checksum ? FLAG_PAYLOAD_CRC : 0;
    put_u16(h + 6, (uint16_t)kind);
    put_u32(h + 8, (uint32_t)header_len);
    put_u32(h + 12, (uint32_t)e->nbufs);
    put_u64(h + 16, payload_len);
    put_u32(h + 24, crc32_of(h + PREAMBLE_SIZE, header_len));
    put_u32(h + 28, crc32_of(h, 28));
    return 1;
}

static int nargs_ok(Py_ssize_t nargs, Py_ssize_t n, const char *name) {
    if (nargs == n) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, n, nargs);
    return 0;
}

static int parse_send_args(PyObject *const *args, Py_ssize_t first, long *kind, int *checksum,
                           unsigned long long *max_bytes) {
    *kind = PyLong_AsLong(args[first]);
    if (*kind == -1 && PyErr_Occurred()) return -1;
    *checksum = PyObject_IsTrue(args[first + 3]);
    if (*checksum < 0) return -1;
    *max_bytes = PyLong_AsUnsignedLongLong(args[first + 4]);
    if (*max_bytes == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    return 0;
}

// send(fd, kind, user, bufs, checksum, max_frame_bytes) -> bytes not sent | None
static PyObject *wire_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 6, "send")) return NULL;
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) return NULL;
    long kind;
    int checksum;
    unsigned long long max_bytes;
    if (parse_send_args(args, 1, &kind, &checksum, &max_bytes) < 0) return NULL;
    Encoded e;
    int r = encode_frame(&e, kind, args[2], args[3], checksum, max_bytes);
    if (r <= 0) {
        encoded_free(&e);
        if (r < 0) return NULL;
        Py_RETURN_NONE;
    }
    struct iovec iov[MAX_BUFS + 1];
    int niov = 0;
    iov[niov].iov_base = e.head;
    iov[niov++].iov_len = e.head_len;
    for (int i = 0; i < e.nbufs; i++) {
        if (e.bufs[i].nbytes) {
            iov[niov].iov_base = (void *)e.bufs[i].ptr;
            iov[niov++].iov_len = e.bufs[i].nbytes;
        }
    }
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = niov;
    uint64_t total = e.head_len + e.payload_len;
    ssize_t sent = sendmsg((int)fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    encoded_free(&e);
    // Any error (would block, or one the caller's waiting path reports) is "nothing sent".
    if (sent < 0) sent = 0;
    return PyLong_FromUnsignedLongLong(total - (uint64_t)sent);
}

static void ring_put(unsigned char *ring, uint64_t size, uint64_t pos, const void *src, uint64_t n) {
    uint64_t first = size - pos < n ? size - pos : n;
    memcpy(ring + pos, src, first);
    if (n > first) memcpy(ring, (const unsigned char *)src + first, n - first);
}

static void ring_get(void *dst, const unsigned char *ring, uint64_t size, uint64_t pos, uint64_t n) {
    uint64_t first = size - pos < n ? size - pos : n;
    memcpy(dst, ring + pos, first);
    if (n > first) memcpy((unsigned char *)dst + first, ring, n - first);
}

// write_ring(data, start, limit, kind, user, bufs, checksum, max_frame_bytes)
static PyObject *wire_write_ring(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 8, "write_ring")) return NULL;
    unsigned long long start = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long limit = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    long kind;
    int checksum;
    unsigned long long max_bytes;
    if (parse_send_args(args, 3, &kind, &checksum, &max_bytes) < 0) return NULL;
    Py_buffer ring;
    if (PyObject_GetBuffer(args[0], &ring, PyBUF_WRITABLE) < 0) return NULL;
    if ((uint64_t)ring.len == 0 || start >= (uint64_t)ring.len) {
        PyBuffer_Release(&ring);
        PyErr_SetString(PyExc_ValueError, "write_ring: start is outside the ring");
        return NULL;
    }
    Encoded e;
    int r = encode_frame(&e, kind, args[4], args[5], checksum, max_bytes);
    if (r <= 0) {
        encoded_free(&e);
        PyBuffer_Release(&ring);
        if (r < 0) return NULL;
        Py_RETURN_NONE;
    }
    uint64_t size = (uint64_t)ring.len, total = e.head_len + e.payload_len;
    if (total > limit || total > size) {
        total = 0;
    } else {
        unsigned char *data = ring.buf;
        uint64_t pos = start;
        ring_put(data, size, pos, e.head, e.head_len);
        pos = (pos + e.head_len) % size;
        for (int i = 0; i < e.nbufs; i++) {
            ring_put(data, size, pos, e.bufs[i].ptr, e.bufs[i].nbytes);
            pos = (pos + e.bufs[i].nbytes) % size;
        }
    }
    encoded_free(&e);
    PyBuffer_Release(&ring);
    return PyLong_FromUnsignedLongLong(total);
}

// ------------------------------------------------------------------ parsing
typedef struct {
    int code;
    int ndim;
    uint32_t crc;
    uint64_t nbytes;
    const unsigned char *dims;  // ndim little-endian u64s inside the header
} Desc;

// The destination of buffer i: fills *dst (new reference) and *ptr.
static int destination(PyObject *out, Py_ssize_t i, const Desc *d, PyObject **dst, char **ptr) {
    PyObject *given = NULL;
    if (out != Py_None && i < PySequence_Fast_GET_SIZE(out)) {
        given = PySequence_Fast_GET_ITEM(out, i);
        if (given == Py_None) given = NULL;
    }
    if (given) {
        if (PyObject_TypeCheck(given, (PyTypeObject *)tensor_type)) {
            int c = is_true_call(given, s_is_contiguous);
            int cpu = c > 0 ? is_true_attr(given, s_is_cpu) : c;
            if (c < 0 || cpu < 0) return -1;
            if (!c || !cpu) {
                frame_err("out tensors must be contiguous CPU tensors");
                return -1;
            }
            PyObject *nb = PyObject_GetAttr(given, s_nbytes);
            if (!nb) return -1;
            unsigned long long n = PyLong_AsUnsignedLongLong(nb);
            Py_DECREF(nb);
            if (PyErr_Occurred()) return -1;
            if (n != d->nbytes) {
                frame_err("out buffer has %llu bytes, frame carries %llu", n,
                          (unsigned long long)d->nbytes);
                return -1;
            }
            *ptr = n ? tensor_ptr(given) : NULL;
            if (!*ptr && PyErr_Occurred()) return -1;
        } else {
            Py_buffer v;
            if (PyObject_GetBuffer(given, &v, PyBUF_WRITABLE) < 0) {
                PyErr_Clear();
                frame_err("out entries must be contiguous CPU tensors or writable buffers");
                return -1;
            }
            uint64_t n = (uint64_t)v.len;
            *ptr = v.buf;
            PyBuffer_Release(&v);  // the caller keeps `out` (and so the memory) alive
            if (n != d->nbytes) {
                frame_err("out buffer has %llu bytes, frame carries %llu", (unsigned long long)n,
                          (unsigned long long)d->nbytes);
                return -1;
            }
        }
        Py_INCREF(given);
        *dst = given;
        return 0;
    }
    if (d->code == 0) {
        *dst = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)d->nbytes);
        if (!*dst) return -1;
        *ptr = PyByteArray_AS_STRING(*dst);
        return 0;
    }
    PyObject *shape = PyTuple_New(d->ndim);
    if (!shape) return -1;
    for (int k = 0; k < d->ndim; k++) {
        PyObject *v = PyLong_FromUnsignedLongLong(get_u64(d->dims + 8 * k));
        if (!v) {
            Py_DECREF(shape);
            return -1;
        }
        PyTuple_SET_ITEM(shape, k, v);
    }
    PyObject *code = PyLong_FromLong(d->code);
    if (!code) {
        Py_DECREF(shape);
        return -1;
    }
    *dst = PyObject_CallFunctionObjArgs(alloc_fn, code, shape, NULL);
    Py_DECREF(code);
    Py_DECREF(shape);
    if (!*dst) return -1;
    *ptr = d->nbytes ? tensor_ptr(*dst) : NULL;
    if (!*ptr && PyErr_Occurred()) {
        Py_CLEAR(*dst);
        return -1;
    }
    return 0;
}

// Checks one descriptor's dtype and size (the same checks as frame._check_meta).
static int check_desc(const Desc *d) {
    if (d->code > num_dtypes) {
        frame_err("unknown dtype code %d in frame header", d->code);
        return -1;
    }
    uint64_t expected;
    if (d->code == 0) {
        if (d->ndim != 1) goto bad;
        expected = get_u64(d->dims);
    } else {
        expected = itemsizes[d->code];
        for (int k = 0; k < d->ndim; k++) {
            if (__builtin_mul_overflow(expected, get_u64(d->dims + 8 * k), &expected)) goto bad;
        }
    }
    if (expected == d->nbytes) return 0;
bad:
    frame_err("buffer descriptor of %d dimensions (dtype code %d) cannot hold %llu bytes",
              d->ndim, d->code, (unsigned long long)d->nbytes);
    return -1;
}

static PyObject *unpack_user(const unsigned char *p, uint64_t n) {
    if (n == 1 && p[0] == 0x80) return PyDict_New();  // {}: the most common header
    PyObject *mv = PyMemoryView_FromMemory((char *)p, (Py_ssize_t)n, PyBUF_READ);
    if (!mv) return NULL;
    PyObject *user = PyObject_CallOneArg(unpack_fn, mv);
    Py_DECREF(mv);
    if (!user) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        frame_err("malformed frame header: %S", value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    }
    return user;
}

// parse(data, start, avail, max_frame_bytes, out) -> needed bytes | (Frame, size)
static PyObject *wire_parse(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nargs_ok(nargs, 5, "parse")) return NULL;
    unsigned long long start = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long avail = PyLong_AsUnsignedLongLong(args[2]);
    unsigned long long max_bytes = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    PyObject *out = args[4];
    if (out != Py_None && !PyList_Check(out) && !PyTuple_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "out must be a list, a tuple or None");
        return NULL;
    }
    Py_buffer ring;
    if (PyObject_GetBuffer(args[0], &ring, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *data = ring.buf;
    uint64_t size = (uint64_t)ring.len;
    PyObject *result = NULL, *header = NULL, *list = NULL, *frame = NULL;
    unsigned char *hcopy = NULL;
    Desc descs[MAX_BUFS];
    Desc *ds = descs, *heap_descs = NULL;
    if (start >= size || avail > size) {
        PyErr_SetString(PyExc_ValueError, "parse: start or avail is outside the buffer");
        goto done;
    }
    if (avail < PREAMBLE_SIZE) {
        result = PyLong_FromLong(PREAMBLE_SIZE);
        goto done;
    }
    unsigned char pre[PREAMBLE_SIZE];
    ring_get(pre, data, size, start, PREAMBLE_SIZE);
    if (memcmp(pre, "LMNF", 4) != 0) {
        PyObject *magic = PyBytes_FromStringAndSize((const char *)pre, 4);
        if (magic) {
            frame_err("bad frame magic %R (expected b'LMNF'): corrupted stream", magic);
            Py_DECREF(magic);
        }
        goto done;
    }
    if (crc32_of(pre, 28) != get_u32(pre + 28)) {
        frame_err("frame preamble checksum mismatch: corrupted frame");
        goto done;
    }
    if (pre[4] != WIRE_VERSION) {
        frame_err("unsupported wire version %d (this side speaks %d)", (int)pre[4], WIRE_VERSION);
        goto done;
    }
    int flags = pre[5];
    long kind = get_u16(pre + 6);
    uint64_t hlen = get_u32(pre + 8);
    uint64_t nbufs = get_u32(pre + 12);
    uint64_t payload_len = get_u64(pre + 16);
    if (payload_len > max_bytes || hlen + payload_len > max_bytes) {
        frame_err("frame of %llu bytes exceeds max_frame_bytes=%llu",
                  (unsigned long long)(hlen + payload_len), max_bytes);
        goto done;
    }
    if (hlen > MAX_HEADER_BYTES) {
        frame_err("frame header of %llu bytes exceeds %u", (unsigned long long)hlen, MAX_HEADER_BYTES);
        goto done;
    }
    uint64_t total = PREAMBLE_SIZE + hlen + payload_len;
    if (avail < total) {
        result = PyLong_FromUnsignedLongLong(total);
        goto done;
    }
    // The header, contiguous (copied when it wraps around the ring's end).
    uint64_t hpos = (start + PREAMBLE_SIZE) % size;
    const unsigned char *h = data + hpos;
    if (hpos + hlen > size) {
        hcopy = PyMem_Malloc(hlen ? hlen : 1);
        if (!hcopy) {
            PyErr_NoMemory();
            goto done;
        }
        ring_get(hcopy, data, size, hpos, hlen);
        h = hcopy;
    }
    if (crc32_of(h, hlen) != get_u32(pre + 24)) {
        frame_err("frame header checksum mismatch: corrupted frame");
        goto done;
    }
    if (nbufs > MAX_BUFS) {
        if (nbufs * DESC_SIZE > hlen) {
            frame_err("frame header is shorter than its buffer descriptors");
            goto done;
        }
        heap_descs = PyMem_Malloc(nbufs * sizeof(Desc));
        if (!heap_descs) {
            PyErr_NoMemory();
            goto done;
        }
        ds = heap_descs;
    }
    uint64_t pos = 0, sum = 0;
    for (uint64_t i = 0; i < nbufs; i++) {
        Desc *d = &ds[i];
        if (pos + DESC_SIZE > hlen) {
            frame_err("frame header is shorter than its buffer descriptors");
            goto done;
        }
        d->code = h[pos];
        d->ndim = h[pos + 1];
        if (d->ndim > MAX_NDIM || get_u16(h + pos + 2) != 0) {
            frame_err("malformed buffer descriptor (ndim %d, reserved %d)", d->ndim,
                      (int)get_u16(h + pos + 2));
            goto done;
        }
        d->crc = get_u32(h + pos + 4);
        d->nbytes = get_u64(h + pos + 8);
        pos += DESC_SIZE;
        if (pos + 8 * (uint64_t)d->ndim > hlen) {
            frame_err("frame header is shorter than its buffer descriptors");
            goto done;
        }
        d->dims = h + pos;
        pos += 8 * (uint64_t)d->ndim;
        if (check_desc(d) < 0) goto done;
        if (__builtin_add_overflow(sum, d->nbytes, &sum) || sum > payload_len) {
            sum = payload_len + 1;  // reported as a disagreement below
            break;
        }
    }
    if (pos >= hlen && sum <= payload_len) {
        frame_err("frame header lacks its user header");
        goto done;
    }
    if (sum != payload_len) {
        frame_err("frame header disagrees with the preamble's payload length");
        goto done;
    }
    header = unpack_user(h + pos, hlen - pos);
    if (!header) goto done;
    list = PyList_New((Py_ssize_t)nbufs);
    if (!list) goto done;
    uint64_t ppos = (hpos + hlen) % size;
    for (uint64_t i = 0; i < nbufs; i++) {
        const Desc *d = &ds[i];
        PyObject *dst;
        char *ptr;
        if (destination(out, (Py_ssize_t)i, d, &dst, &ptr) < 0) goto done;
        PyList_SET_ITEM(list, (Py_ssize_t)i, dst);
        if (d->nbytes) {
            ring_get(ptr, data, size, ppos, d->nbytes);
            ppos = (ppos + d->nbytes) % size;
            if ((flags & FLAG_PAYLOAD_CRC) && crc32_of(ptr, d->nbytes) != d->crc) {
                frame_err("payload %d checksum mismatch: corrupted frame", (int)i);
                goto done;
            }
        }
    }
    PyObject *kind_obj = PyLong_FromLong(kind);
    if (!kind_obj) goto done;
    frame = PyObject_CallFunctionObjArgs(frame_type, kind_obj, header, list, NULL);
    Py_DECREF(kind_obj);
    if (frame) result = Py_BuildValue("(OK)", frame, (unsigned long long)total);
done:
    if (heap_descs) PyMem_Free(heap_descs);
    Py_XDECREF(frame);
    Py_XDECREF(list);
    Py_XDECREF(header);
    if (hcopy) PyMem_Free(hcopy);
    PyBuffer_Release(&ring);
    return result;
}

// ------------------------------------------------------------------ setup
static PyObject *wire_setup(PyObject *self, PyObject *args) {
    PyObject *ttype, *dts, *sizes, *ftype, *unpack, *alloc, *ferr;
    if (!PyArg_ParseTuple(args, "OO!O!OOOO", &ttype, &PyTuple_Type, &dts, &PyTuple_Type, &sizes,
                          &ftype, &unpack, &alloc, &ferr))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(dts);
    if (n > MAX_DTYPES || PyTuple_GET_SIZE(sizes) != n || !PyType_Check(ttype)) {
        PyErr_SetString(PyExc_ValueError, "setup: bad dtype table or tensor type");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XSETREF(dtypes[i + 1], Py_NewRef(PyTuple_GET_ITEM(dts, i)));
        itemsizes[i + 1] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(sizes, i));
    }
    if (PyErr_Occurred()) return NULL;
    num_dtypes = (int)n;
    Py_XSETREF(tensor_type, Py_NewRef(ttype));
    Py_XSETREF(frame_type, Py_NewRef(ftype));
    Py_XSETREF(unpack_fn, Py_NewRef(unpack));
    Py_XSETREF(alloc_fn, Py_NewRef(alloc));
    Py_XSETREF(frame_error, Py_NewRef(ferr));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"setup", wire_setup, METH_VARARGS, "Install the types and callables the codec uses."},
    {"send", (PyCFunction)(void (*)(void))wire_send, METH_FASTCALL,
     "send(fd, kind, user, bufs, checksum, max_frame_bytes) -> bytes not sent, or None"},
    {"write_ring", (PyCFunction)(void (*)(void))wire_write_ring, METH_FASTCALL,
     "write_ring(data, start, limit, kind, user, bufs, checksum, max_frame_bytes) -> bytes written"},
    {"parse", (PyCFunction)(void (*)(void))wire_parse, METH_FASTCALL,
     "parse(data, start, avail, max_frame_bytes, out) -> needed bytes, or (Frame, size)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_wire", "Native fast path of the frame codec (see csrc/wire.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__wire(void) {
    s_dtype = PyUnicode_InternFromString("dtype");
    s_shape = PyUnicode_InternFromString("shape");
    s_is_cpu = PyUnicode_InternFromString("is_cpu");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_nbytes = PyUnicode_InternFromString("nbytes");
    if (!s_dtype || !s_shape || !s_is_cpu || !s_is_contiguous || !s_data_ptr || !s_nbytes) return NULL;
    return PyModule_Create(&module);
}
