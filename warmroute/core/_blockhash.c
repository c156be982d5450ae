/* Chained block hashes in C: the same values as block_hash.py's numpy construction, in one pass.
 *
 * The construction is documented in block_hash.py (which is also the reference implementation, used where
 * this extension was not built, and the oracle of tests/test_block_hash.py). Per block j of `width`
 * 8-byte words:
 *     c_j = sum_l (w ^ (w >> 29)) * lane_key[l mod 8]      (mod 2^64)
 *     c_j = fmix64(c_j);  c_0 ^= seed
 *     h_k = sum_{j<=k} c_j * P^-j                            (mod 2^64)
 * numpy needs about ten array passes and a tolist() for this (≈ 20 µs for a 32,000-byte key); here it is one
 * loop over the words, and most of what is left is allocating the 500 Python ints.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyObject *block_hashes(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *seed_obj = NULL;
    Py_ssize_t block_bytes = default_block_bytes;
    if (!PyArg_ParseTuple(args, "y*|On", &buf, &seed_obj, &block_bytes))
        return NULL;
    /* seed & (2^64 - 1), as in Python */
    uint64_t seed = seed_obj == NULL ? 0 : (uint64_t)PyLong_AsUnsignedLongLongMask(seed_obj);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    if (!configured) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_RuntimeError, "_blockhash.configure() was not called");
        return NULL;
    }
    if (block_bytes <= 0 || block_bytes % 8) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "block_bytes must be a positive multiple of 8");
        return NULL;
    }
    Py_ssize_t n = buf.len / block_bytes, width = block_bytes / 8;
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)buf.buf;
    uint64_t chain = 0, weight = 1;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t c = 0;
        for (Py_ssize_t l = 0; l < width; l++) {
            uint64_t w;
            memcpy(&w, p + (j * width + l) * 8, 8);  /* native byte order, as numpy's frombuffer */
            c += (w ^ (w >> 29)) * lane_keys[l & 7];
        }
        c = fmix64(c);
        if (j == 0)
            c ^= seed;
        chain += c * weight;
        weight *= p_inv;
        PyObject *h = PyLong_FromUnsignedLongLong(chain);
        if (h == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&buf);
            return NULL;
        }
        PyList_SET_ITEM(out, j, h);
    }
    PyBuffer_Release(&buf);
    return out;
}

static PyMethodDef methods[] = {
    {"block_hashes", block_hashes, METH_VARARGS,
     "block_hashes(data, seed=0, block_bytes=default) -> list[int]: block_hash.block_hashes, in C."},
    {"configure", configure, METH_VARARGS, "configure(lane_keys, p_inv, default_block_bytes): block_hash.py's constants."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockhash(void) { return PyModule_Create(&module); }
