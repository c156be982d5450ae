/* The primitives of a routing decision that run compiled (see warmroute/core/stages/compiled.py): the
 * rendezvous top of a tie, the rendezvous seed of an ASCII prompt, and the routable filter. Each has one meaning
 * and a Python twin; no routing policy lives here.
 * Attributes are read as Python reads them, except that for an exact Instance (a dataclass with __slots__, see
 * configure) the fields are read at their slot's offset. An empty slot, or any other object, goes through getattr
 * and raises as Python would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_name, *s_healthy, *s_draining;

/* The Instance class and its fields' slot offsets (configure); NULL / -1: read with getattr. */
static PyTypeObject *inst_type = NULL;
enum { F_NAME, F_HEALTHY, F_DRAINING, F_COUNT };
static Py_ssize_t offsets[F_COUNT] = {-1, -1, -1};
static PyObject **field_names[F_COUNT] = {&s_name, &s_healthy, &s_draining};

/* A new reference to obj's field (or NULL with an exception set, as getattr). */
static inline PyObject *field(PyObject *obj, int f) {
    if (offsets[f] >= 0 && Py_IS_TYPE(obj, inst_type)) {
        PyObject *v = *(PyObject **)((char *)obj + offsets[f]);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(obj, *field_names[f]);
}

/* obj's field f where it is a slot of an exact Instance that is set, borrowed (no Python code runs while it is
 * read); else NULL, and the caller goes through field(). */
static inline PyObject *peek(PyObject *obj, int f) {
    return offsets[f] >= 0 && Py_IS_TYPE(obj, inst_type) ? *(PyObject **)((char *)obj + offsets[f]) : NULL;
}

/* rendezvous.py's weight function (xxh3 of the name's bytes, seeded by the key), its cache of names' bytes and
 * the function that fills it (configure). */
static PyObject *hash_fn = NULL, *name_bytes = NULL, *encode = NULL;
/* The same xxh3 function of the xxhash library, called directly where rendezvous.py found its address (the
 * library's XXH3_64bits_withSeed, exported by the xxhash package's extension), which skips the Python
 * wrapper's call overhead. NULL: call hash_fn. configure checks the two agree before using it. */
typedef uint64_t (*xxh3_seeded)(const void *data, size_t len, uint64_t seed);
static xxh3_seeded native_xxh3 = NULL;

/* rendezvous.weight(seed, inst.name): xxh3 of the name's UTF-8 bytes seeded by the seed, into *out. Called
 * directly where `direct` (with the seed as 64 bits): an ASCII name's characters are its UTF-8 bytes, hashed in
 * place; any other name's bytes come from rendezvous's cache (filled on a miss). Else through hash_fn. */
static int weight_of(PyObject *inst, PyObject *seed, int direct, unsigned long long s64,
                     unsigned long long *out) {
    PyObject *name = field(inst, F_NAME);
    if (name == NULL) return -1;
    if (direct && PyUnicode_CheckExact(name) && PyUnicode_IS_COMPACT_ASCII(name)) {
        *out = native_xxh3(PyUnicode_DATA(name), (size_t)PyUnicode_GET_LENGTH(name), s64);
        Py_DECREF(name);
        return 0;
    }
    PyObject *raw = PyDict_GetItemWithError(name_bytes, name);  /* borrowed */
    if (raw != NULL) {
        Py_INCREF(raw);
    } else if (!PyErr_Occurred()) {
        raw = PyObject_CallOneArg(encode, name);  /* a name not seen before: encoded and cached */
    }
    Py_DECREF(name);
    if (raw == NULL) return -1;
    if (direct && PyBytes_CheckExact(raw)) {
        *out = native_xxh3(PyBytes_AS_STRING(raw), (size_t)PyBytes_GET_SIZE(raw), s64);
        Py_DECREF(raw);
        return 0;
    }
    PyObject *argv[2] = {raw, seed};
    PyObject *w = PyObject_Vectorcall(hash_fn, argv, 2, NULL);
    Py_DECREF(raw);
    if (w == NULL) return -1;
    *out = PyLong_AsUnsignedLongLong(w);
    Py_DECREF(w);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* top(seed, instances): the instance whose name rendezvous.top(seed, names) picks: the highest weight, the first
 * of equal ones. The same weights, computed by the same xxh3 function, without building the list of names. */
static PyObject *top(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *seed, *list, *best = NULL;
    unsigned long long best_weight = 0;
    if (!PyArg_ParseTuple(args, "O!O!", &PyLong_Type, &seed, &PyList_Type, &list)) return NULL;
    if (hash_fn == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_scan.configure() was not called");
        return NULL;
    }
    /* The seed as 64 bits, for the direct call; one outside 64 bits goes through hash_fn (as Python takes it). */
    int direct = native_xxh3 != NULL;
    unsigned long long s64 = 0;
    if (direct) {
        s64 = PyLong_AsUnsignedLongLong(seed);
        if (s64 == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            direct = 0;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *inst = PyList_GET_ITEM(list, i);
        unsigned long long weight;
        if (weight_of(inst, seed, direct, s64, &weight) < 0) return NULL;
        if (best == NULL || weight > best_weight) {
            best = inst;
            best_weight = weight;
        }
    }
    return Py_NewRef(best != NULL ? best : Py_None);
}

/* text_hash(text, n, seed) -> int | None: what xxhash.xxh3_64_intdigest(text[:n].encode(), seed) gives, for an
 * ASCII str (its characters are its UTF-8 bytes: hashed where they are, without the slice and its encoding);
 * None where xxh3 is not called directly, the text is not an exact ASCII str, n is negative or the seed is not
 * 64 bits: the caller computes it then. */
static PyObject *text_hash(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *text, *seed;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnO!", &text, &n, &PyLong_Type, &seed)) return NULL;
    if (native_xxh3 == NULL || n < 0 || !PyUnicode_CheckExact(text) || !PyUnicode_IS_COMPACT_ASCII(text))
        Py_RETURN_NONE;
    unsigned long long s64 = PyLong_AsUnsignedLongLong(seed);
    if (s64 == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t len = PyUnicode_GET_LENGTH(text);
    return PyLong_FromUnsignedLongLong(native_xxh3(PyUnicode_DATA(text), (size_t)(n < len ? n : len), s64));
}

/* Truth of obj's field f: 1, 0, or -1 with an exception set. */
static inline int field_true(PyObject *obj, int f) {
    PyObject *v = peek(obj, f);
    if (v == Py_True || v == Py_False) return v == Py_True;  /* the usual case: a bool in its slot */
    v = field(obj, f);
    if (v == NULL) return -1;
    int t = v == Py_True ? 1 : v == Py_False ? 0 : PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* routable(instances, serving) -> list: Fleet.routable's filter, the instances (a dict's values, in order) that
 * are healthy and not draining and, unless `serving` is None, whose name is in it (a frozenset). */
static PyObject *routable(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *instances, *serving;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &instances, &serving)) return NULL;
    if (serving != Py_None && !PyAnySet_Check(serving)) {
        PyErr_SetString(PyExc_TypeError, "serving must be a set or None");
        return NULL;
    }
    /* The kept instances are gathered first (each with a reference held) and the list made at its final size:
     * growing it one append at a time reallocated it several times per call. */
    PyObject *stack_kept[128];
    PyObject **keep = stack_kept;
    Py_ssize_t room = 128, kept = 0;
    PyObject *out = NULL;
    Py_ssize_t pos = 0;
    PyObject *key, *inst;
    while (PyDict_Next(instances, &pos, &key, &inst)) {  /* borrowed references */
        Py_INCREF(inst);  /* a getattr below may run Python code that changes the dict */
        int ok = field_true(inst, F_HEALTHY);
        if (ok == 1) {
            int draining = field_true(inst, F_DRAINING);
            ok = draining < 0 ? -1 : !draining;
        }
        if (ok == 1 && serving != Py_None) {
            PyObject *name = field(inst, F_NAME);
            ok = name == NULL ? -1 : PySet_Contains(serving, name);
            Py_XDECREF(name);
        }
        if (ok == 1 && kept == room) {  /* more than 128 instances: move to the heap, doubling */
            PyObject **grown = PyMem_Malloc(2 * room * sizeof(PyObject *));
            if (grown == NULL) {
                PyErr_NoMemory();
                ok = -1;
            } else {
                memcpy(grown, keep, kept * sizeof(PyObject *));
                if (keep != stack_kept) PyMem_Free(keep);
                keep = grown;
                room *= 2;
            }
        }
        if (ok == 1) {
            keep[kept++] = inst;  /* its reference moves to the list */
            continue;
        }
        Py_DECREF(inst);
        if (ok < 0) goto done;
    }
    out = PyList_New(kept);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < kept; i++) PyList_SET_ITEM(out, i, keep[i]);
    kept = 0;
done:
    for (Py_ssize_t i = 0; i < kept; i++) Py_DECREF(keep[i]);
    if (keep != stack_kept) PyMem_Free(keep);
    return out;
}

/* configure(Instance, hash_fn, name_bytes, encode, xxh3_address=0): remember where Instance's fields live, if
 * they are slots holding objects, and rendezvous's weight function (and the address of the library function
 * behind it, used only if it gives hash_fn's values on a few probes); returns how many fields are read at
 * their offsets. */
static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *type, *fn, *cache, *enc;
    unsigned long long address = 0;
    if (!PyArg_ParseTuple(args, "O!OO!O|K", &PyType_Type, &type, &fn, &PyDict_Type, &cache, &enc, &address))
        return NULL;
    Py_XSETREF(hash_fn, Py_NewRef(fn));
    Py_XSETREF(name_bytes, Py_NewRef(cache));
    Py_XSETREF(encode, Py_NewRef(enc));
    native_xxh3 = NULL;
    if (address != 0) {
        xxh3_seeded candidate = (xxh3_seeded)(uintptr_t)address;
        static const char *probes[] = {"", "a", "instance-7", "engine-12=http://10.0.0.1:8000",
                                       "a name longer than sixteen bytes, and longer than 128 bytes too, so that "
                                       "every one of xxh3's length classes is probed before it is trusted: ok"};
        static const unsigned long long seeds[] = {0ULL, 1ULL, 0x9E3779B97F4A7C15ULL, 0xFFFFFFFFFFFFFFFFULL};
        int agree = 1;
        for (size_t i = 0; agree && i < sizeof probes / sizeof *probes; i++) {
            for (size_t j = 0; agree && j < sizeof seeds / sizeof *seeds; j++) {
                PyObject *raw = PyBytes_FromString(probes[i]);
                PyObject *sd = PyLong_FromUnsignedLongLong(seeds[j]);
                PyObject *w = raw && sd ? PyObject_CallFunctionObjArgs(fn, raw, sd, NULL) : NULL;
                unsigned long long want = w ? PyLong_AsUnsignedLongLong(w) : 0;
                Py_XDECREF(raw);
                Py_XDECREF(sd);
                Py_XDECREF(w);
                if (PyErr_Occurred()) return NULL;
                agree = candidate(probes[i], strlen(probes[i]), seeds[j]) == want;
            }
        }
        if (agree) native_xxh3 = candidate;
    }
    long found = 0;
    for (int f = 0; f < F_COUNT; f++) {
        offsets[f] = -1;
        PyObject *d = PyDict_GetItemWithError(((PyTypeObject *)type)->tp_dict, *field_names[f]);  /* borrowed */
        if (d == NULL && PyErr_Occurred()) return NULL;
        if (d != NULL && Py_IS_TYPE(d, &PyMemberDescr_Type)) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
            if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) {
                offsets[f] = m->offset;
                found++;
            }
        }
    }
    Py_XSETREF(inst_type, (PyTypeObject *)Py_NewRef(type));
    return PyLong_FromLong(found);
}

/* Whether top() calls the xxhash library directly (configure found and checked its address). */
static PyObject *native_weights(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(native_xxh3 != NULL);
}

static PyMethodDef methods[] = {
    {"top", top, METH_VARARGS, "The instance rendezvous.top(seed, their names) picks (see rendezvous.py)."},
    {"routable", routable, METH_VARARGS, "Fleet.routable's filter over a dict of instances."},
    {"text_hash", text_hash, METH_VARARGS, "xxh3 of an ASCII str's first n characters (None: not done here)."},
    {"configure", configure, METH_VARARGS, "Instance's slot offsets and rendezvous's weight function."},
    {"native_weights", native_weights, METH_NOARGS, "Whether top() calls xxh3 directly."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scan(void) {
    struct { PyObject **slot; const char *name; } names[] = {
        {&s_name, "name"}, {&s_healthy, "healthy"}, {&s_draining, "draining"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (*names[i].slot == NULL) return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "API", 3) < 0) {  /* stages/compiled.py's API */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
