/* Chained block hashes in C: the same values as block_hash.py's numpy construction, in one pass.
 *
 * The construction is documented in block_hash.py (which is also the reference implementation, used where
 * this extension was not built, and the oracle of tests/core/test_block_hash.py). Per block j of `width`
 * 8-byte words:
 *     c_j = sum_l (w ^ (w >> 29)) * lane_key[l mod 8]      (mod 2^64)
 *     c_j = fmix64(c_j);  c_0 ^= seed
 *     h_k = sum_{j<=k} c_j * P^-j                            (mod 2^64)
 * numpy needs about ten array passes and a tolist() for this; here it is one loop over the words (timings:
 * docs/tuning.md). The result is a Chain: the hashes as 64-bit words in one object, a read-only sequence
 * of ints to Python (indexing, slicing, iteration, == with lists) and a buffer of uint64 to C (the compiled
 * prefix index reads it without any int). Making the Python ints cost more than the hashing itself, so an
 * int is made only where Python code reads one.
 *
 * A str is hashed as its UTF-8 bytes; an ASCII str's characters are those bytes, read in place (a 32 KB prompt
 * is not copied to be hashed). A Chain of a bytes object or a str is lazy: it keeps them and computes its
 * hashes when they are first read, and only as far as they are read (the hashes are chained, so h_k needs
 * blocks 0..k and nothing after). Its length
 * is known at once. The router reads a cold prompt's first hash only (nobody holds its first block, so nothing
 * deeper can match) and records the whole chain after the request has left; the hashing is then off the
 * request's path. Every read (item, slice, ==, buffer, list, pickle) sees the same values as an eager chain.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* block_hash.py owns the constants and passes them in once (configure): its 8 lane keys and P^-1 mod 2^64. */
static uint64_t lane_keys[8];
static uint64_t p_inv;
static Py_ssize_t default_block_bytes;
static int configured = 0;

static inline uint64_t fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    PyObject *keys, *inv;
    Py_ssize_t block_bytes;
    if (!PyArg_ParseTuple(args, "OOn", &keys, &inv, &block_bytes))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "lane keys must be a sequence");
    if (seq == NULL)
        return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != 8) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "expected 8 lane keys");
        return NULL;
    }
    uint64_t k[8];
    for (int l = 0; l < 8; l++) {
        k[l] = (uint64_t)PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seq, l));
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    uint64_t v = (uint64_t)PyLong_AsUnsignedLongLongMask(inv);
    if (PyErr_Occurred())
        return NULL;
    memcpy(lane_keys, k, sizeof k);
    p_inv = v;
    default_block_bytes = block_bytes;
    configured = 1;
    Py_RETURN_NONE;
}


/* -- Chain: a read-only sequence of uint64 hashes ----------------------------------------------------------- */
typedef struct {
    PyObject_VAR_HEAD
    PyObject *src;          /* what owns the bytes still to hash (NULL once all are: h[0..size) valid) */
    const unsigned char *bytes;  /* those bytes: a bytes object's, or an ASCII str's characters */
    Py_ssize_t done;        /* h[0..done) are computed */
    Py_ssize_t block_bytes;
    uint64_t seed, sum, weight;  /* the running chain: sum = h[done-1], weight = P^-done */
    uint64_t h[1];
} Chain;

static PyTypeObject ChainType;

static Chain *chain_new(Py_ssize_t n) {
    Chain *c = PyObject_NewVar(Chain, &ChainType, n);
    if (c == NULL) return NULL;
    c->src = NULL;
    c->bytes = NULL;
    c->done = n;
    c->block_bytes = 0;
    c->seed = c->sum = 0;
    c->weight = 1;
    return c;
}

static void chain_dealloc(Chain *c) {
    Py_XDECREF(c->src);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

/* One block's value c_j (before chaining), `width` 8-byte words at b. */
static inline uint64_t block_value(const unsigned char *b, Py_ssize_t width) {
    uint64_t c = 0;
    if (width == 8) {  /* the default 64-byte block, unrolled: eight independent products */
        uint64_t w[8];
        memcpy(w, b, sizeof w);  /* native byte order, as numpy's frombuffer */
        for (int l = 0; l < 8; l++) c += (w[l] ^ (w[l] >> 29)) * lane_keys[l];
    } else {
        for (Py_ssize_t l = 0; l < width; l++) {
            uint64_t w;
            memcpy(&w, b + l * 8, 8);
            c += (w ^ (w >> 29)) * lane_keys[l & 7];
        }
    }
    return fmix64(c);
}

/* The hashing loop is compiled twice where GCC can (x86-64, GCC 11+): for CPUs with AVX-512 (x86-64-v4),
 * whose 64-bit vector multiply computes a block's eight lane products at once, and for any x86-64; the loader
 * picks one when the module is imported. Same values either way (integer arithmetic mod 2^64); the gain is
 * in docs/tuning.md. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__linux__)
#define WR_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define WR_MULTIVERSION
#endif

/* Hashes h[done..upto) of the key at p. */
WR_MULTIVERSION static void chain_fill_from(Chain *c, const unsigned char *p, Py_ssize_t upto) {
    Py_ssize_t bb = c->block_bytes, width = bb / 8;
    uint64_t sum = c->sum, weight = c->weight;
    for (Py_ssize_t j = c->done; j < upto; j++) {
        uint64_t v = block_value(p + j * bb, width);
        if (j == 0) v ^= c->seed;
        sum += v * weight;
        weight *= p_inv;
        c->h[j] = sum;
    }
    c->sum = sum;
    c->weight = weight;
    c->done = upto;
}

/* Hashes h[done..upto) from the kept bytes; the bytes are let go once the last hash is computed. */
static void chain_fill(Chain *c, Py_ssize_t upto) {
    if (upto > Py_SIZE(c)) upto = Py_SIZE(c);
    if (upto <= c->done) return;
    chain_fill_from(c, c->bytes, upto);
    if (upto == Py_SIZE(c)) {
        Py_CLEAR(c->src);
        c->bytes = NULL;
    }
}

static Py_ssize_t chain_length(Chain *c) { return Py_SIZE(c); }

static PyObject *chain_item(Chain *c, Py_ssize_t i) {
    if (i < 0 || i >= Py_SIZE(c)) {
        PyErr_SetString(PyExc_IndexError, "chain index out of range");
        return NULL;
    }
    chain_fill(c, i + 1);
    return PyLong_FromUnsignedLongLong(c->h[i]);
}

static PyObject *chain_tolist(Chain *c, PyObject *unused) {
    chain_fill(c, Py_SIZE(c));
    PyObject *out = PyList_New(Py_SIZE(c));
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < Py_SIZE(c); i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c->h[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *chain_subscript(Chain *c, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        return chain_item(c, i < 0 ? i + Py_SIZE(c) : i);
    }
    if (!PySlice_Check(key)) {
        PyErr_Format(PyExc_TypeError, "chain indices must be integers or slices, not %.200s", Py_TYPE(key)->tp_name);
        return NULL;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(key, &start, &stop, &step) < 0) return NULL;
    Py_ssize_t n = PySlice_AdjustIndices(Py_SIZE(c), &start, &stop, step);
    if (n > 0) chain_fill(c, (step > 0 ? start + (n - 1) * step : start) + 1);  /* the furthest item read */
    Chain *out = chain_new(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) out->h[i] = c->h[start + i * step];
    return (PyObject *)out;
}

static PyObject *chain_richcompare(PyObject *a, PyObject *b, int op) {
    if (op != Py_EQ && op != Py_NE) Py_RETURN_NOTIMPLEMENTED;
    if (Py_IS_TYPE(a, &ChainType) && Py_IS_TYPE(b, &ChainType)) {
        chain_fill((Chain *)a, Py_SIZE(a));
        chain_fill((Chain *)b, Py_SIZE(b));
        int eq = Py_SIZE(a) == Py_SIZE(b) &&
                 memcmp(((Chain *)a)->h, ((Chain *)b)->h, Py_SIZE(a) * sizeof(uint64_t)) == 0;
        return PyBool_FromLong(op == Py_EQ ? eq : !eq);
    }
    PyObject *other = Py_IS_TYPE(a, &ChainType) ? b : a;
    PyObject *self = Py_IS_TYPE(a, &ChainType) ? a : b;
    if (!PyList_Check(other) && !PyTuple_Check(other)) Py_RETURN_NOTIMPLEMENTED;
    /* As a list of the same ints would compare (a tuple is never equal to a list: compare as a tuple). */
    PyObject *mine = chain_tolist((Chain *)self, NULL);
    if (mine == NULL) return NULL;
    if (PyTuple_Check(other)) {
        PyObject *t = PyList_AsTuple(mine);
        Py_DECREF(mine);
        if (t == NULL) return NULL;
        mine = t;
    }
    PyObject *r = PyObject_RichCompare(mine, other, op);
    Py_DECREF(mine);
    return r;
}

static PyObject *chain_repr(Chain *c) {
    PyObject *list = chain_tolist(c, NULL);
    if (list == NULL) return NULL;
    PyObject *r = PyUnicode_FromFormat("Chain(%R)", list);
    Py_DECREF(list);
    return r;
}

static PyObject *chain_reduce(Chain *c, PyObject *unused) {
    /* pickles as the list of its ints */
    PyObject *list = chain_tolist(c, NULL);
    if (list == NULL) return NULL;
    return Py_BuildValue("(O(N))", (PyObject *)&PyList_Type, list);
}

static int chain_getbuffer(Chain *c, Py_buffer *view, int flags) {
    if (flags & PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "a chain is read-only");
        return -1;
    }
    static Py_ssize_t itemsize = sizeof(uint64_t);
    chain_fill(c, Py_SIZE(c));
    view->obj = Py_NewRef(c);
    view->buf = c->h;
    view->len = Py_SIZE(c) * (Py_ssize_t)sizeof(uint64_t);
    view->readonly = 1;
    view->itemsize = sizeof(uint64_t);
    view->format = (flags & PyBUF_FORMAT) ? "Q" : NULL;
    view->ndim = 1;
    view->shape = (flags & PyBUF_ND) ? &((PyVarObject *)c)->ob_size : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &itemsize : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    return 0;
}

static PySequenceMethods chain_as_sequence = {
    .sq_length = (lenfunc)chain_length,
    .sq_item = (ssizeargfunc)chain_item,
};
static PyMappingMethods chain_as_mapping = {
    .mp_length = (lenfunc)chain_length,
    .mp_subscript = (binaryfunc)chain_subscript,
};
static PyBufferProcs chain_as_buffer = {.bf_getbuffer = (getbufferproc)chain_getbuffer};
static PyMethodDef chain_methods[] = {
    {"tolist", (PyCFunction)chain_tolist, METH_NOARGS, "the hashes as a list of ints"},
    {"__reduce__", (PyCFunction)chain_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *chain_computed(Chain *c, void *unused) {
    return PyLong_FromSsize_t(c->done);
}

static PyGetSetDef chain_getset[] = {
    {"computed", (getter)chain_computed, NULL, "how many of the hashes have been computed so far (lazy chains)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ChainType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "warmroute.core._blockhash.Chain",
    .tp_basicsize = offsetof(Chain, h),
    .tp_itemsize = sizeof(uint64_t),
    .tp_dealloc = (destructor)chain_dealloc,
    .tp_getset = chain_getset,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_SEQUENCE,
    .tp_doc = "Chained block hashes: a read-only sequence of 64-bit ints, and a buffer of uint64 ('Q').",
    .tp_repr = (reprfunc)chain_repr,
    .tp_as_sequence = &chain_as_sequence,
    .tp_as_mapping = &chain_as_mapping,
    .tp_as_buffer = &chain_as_buffer,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_richcompare = chain_richcompare,
    .tp_methods = chain_methods,
};

static PyObject *block_hashes(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *data, *seed_obj = NULL, *encoded = NULL;
    Chain *out = NULL;
    Py_ssize_t block_bytes = default_block_bytes;
    if (!PyArg_ParseTuple(args, "O|On", &data, &seed_obj, &block_bytes))
        return NULL;
    /* A str is hashed as its UTF-8 bytes (lone surrogates passed, as str.encode("utf-8", "surrogatepass")). An
     * ASCII str's characters are those bytes: read in place, not copied. Any other str is encoded here. */
    if (PyUnicode_Check(data) && !PyUnicode_IS_ASCII(data)) {
        encoded = data = PyUnicode_AsEncodedString(data, "utf-8", "surrogatepass");
        if (encoded == NULL) return NULL;
    }
    int ascii = PyUnicode_Check(data);
    if ((ascii ? PyBuffer_FillInfo(&buf, data, PyUnicode_DATA(data), PyUnicode_GET_LENGTH(data), 1, PyBUF_SIMPLE)
               : PyObject_GetBuffer(data, &buf, PyBUF_SIMPLE)) < 0) {
        Py_XDECREF(encoded);
        return NULL;
    }
    /* seed & (2^64 - 1), as in Python */
    uint64_t seed = seed_obj == NULL ? 0 : (uint64_t)PyLong_AsUnsignedLongLongMask(seed_obj);
    if (seed == (uint64_t)-1 && PyErr_Occurred())
        goto done;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_blockhash.configure() was not called");
        goto done;
    }
    if (block_bytes <= 0 || block_bytes % 8) {
        PyErr_SetString(PyExc_ValueError, "block_bytes must be a positive multiple of 8");
        goto done;
    }
    Py_ssize_t n = buf.len / block_bytes;
    out = chain_new(n);
    if (out == NULL)
        goto done;
    out->block_bytes = block_bytes;
    out->seed = seed;
    if (n > 0) {
        out->done = 0;
        if (PyBytes_CheckExact(data) || ascii) {  /* immutable: keep it and hash on demand */
            out->src = Py_NewRef(data);
            out->bytes = (const unsigned char *)buf.buf;
        } else  /* a bytearray or memoryview may change after we return: hash it all now */
            chain_fill_from(out, (const unsigned char *)buf.buf, n);
    }
done:
    PyBuffer_Release(&buf);
    Py_XDECREF(encoded);
    return (PyObject *)out;
}

static PyMethodDef methods[] = {
    {"block_hashes", block_hashes, METH_VARARGS,
     "block_hashes(data, seed=0, block_bytes=default) -> Chain: block_hash.block_hashes, in C (lazy for bytes and "
     "str)."},
    {"configure", configure, METH_VARARGS, "configure(lane_keys, p_inv, default_block_bytes): block_hash.py's constants."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockhash(void) {
    if (PyType_Ready(&ChainType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* block_hash.py's API: 2 hashes a str (a build without it is not used) */
    if (PyModule_AddObjectRef(m, "Chain", (PyObject *)&ChainType) < 0
            || PyModule_AddIntConstant(m, "API", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
