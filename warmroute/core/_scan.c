/* cache_aware's filters, scorer and tie-breaking in one pass (see warmroute/core/stages/compiled.py).
 *
 * scan(up, params) -> Instance | list[Instance] | None, params a stages.compiled.ScanParams: the stages
 * load_guard, hot_share, estimated_ttft, tie_slack and least_loaded_ties, computing the same values in the same
 * order of floating-point operations as they do, so both decide alike (tests/core/test_choose_equivalence.py).
 * Attributes are read as Python reads them, except that for an exact Instance (a dataclass with __slots__, see
 * configure) the fields are read at their slot's offset, which is what makes this pass worth compiling. An empty
 * slot, or any other object, goes through getattr and raises as Python would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_inflight, *s_engine, *s_queued, *s_rate, *s_name, *s_recent, *s_capacity, *s_healthy,
    *s_draining;
static PyObject *s_foreign_requests, *s_foreign_waiting, *s_kv_usage;

/* The Instance class and its fields' slot offsets (configure); NULL / -1: read with getattr. */
static PyTypeObject *inst_type = NULL;
enum { F_INFLIGHT, F_ENGINE, F_QUEUED, F_RATE, F_NAME, F_RECENT, F_CAPACITY, F_HEALTHY, F_DRAINING, F_COUNT };
static Py_ssize_t offsets[F_COUNT] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
static PyObject **field_names[F_COUNT] = {&s_inflight, &s_engine, &s_queued, &s_rate, &s_name, &s_recent,
                                          &s_capacity, &s_healthy, &s_draining};

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

static inline double as_double(PyObject *v) {
    return PyFloat_CheckExact(v) ? PyFloat_AS_DOUBLE(v) : PyFloat_AsDouble(v);
}

static inline int field_double(PyObject *obj, int f, double *out) {
    PyObject *v = peek(obj, f);
    if (v != NULL && PyFloat_CheckExact(v)) {  /* the usual case: a float in its slot, read in place */
        *out = PyFloat_AS_DOUBLE(v);
        return 0;
    }
    v = field(obj, f);
    if (v == NULL) return -1;
    *out = as_double(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

typedef struct {
    PyObject *inst;    /* borrowed from the list */
    PyObject *engine;  /* new reference, or NULL for None */
    double load;       /* in flight as the guard counts it */
    long inflight;
    double recent;     /* read only for a hot prefix */
    double cost;
    double rate;
} Row;

/* Rows a and b change places (compacting the kept rows to the front; most rows stay where they are). */
static inline void swap_rows(Row *rows, Py_ssize_t a, Py_ssize_t b) {
    if (a != b) {
        Row tmp = rows[a];
        rows[a] = rows[b];
        rows[b] = tmp;
    }
}

static int get_double(PyObject *obj, PyObject *attr, double *out) {
    PyObject *v = PyObject_GetAttr(obj, attr);
    if (v == NULL) return -1;
    *out = as_double(v);
    Py_DECREF(v);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* The miss weights of a prompt held by a few instances, taken out of the dict once: each instance's name is then
 * compared with these few keys (by identity, then hash and value, as a dict compares str keys), which costs less
 * than a dict lookup per instance. */
#define FEW_MISSES 8
typedef struct {
    PyObject *name;  /* a new reference */
    Py_hash_t hash;
    double weight;
} Miss;

/* miss's entries into few (their count), or -1 where the dict is asked per instance instead: more than
 * FEW_MISSES entries, a key that is not an exact str, or a weight that is not an exact float. */
static Py_ssize_t few_misses(PyObject *miss, Miss *few) {
    if (PyDict_GET_SIZE(miss) > FEW_MISSES) return -1;
    Py_ssize_t pos = 0, k = 0;
    PyObject *key, *value;
    while (PyDict_Next(miss, &pos, &key, &value)) {
        Py_hash_t h = PyUnicode_CheckExact(key) && PyFloat_CheckExact(value) ? PyObject_Hash(key) : -1;
        if (h == -1) {  /* (a str's hash cannot fail) */
            for (Py_ssize_t j = 0; j < k; j++) Py_DECREF(few[j].name);
            return -1;
        }
        few[k++] = (Miss){Py_NewRef(key), h, PyFloat_AS_DOUBLE(value)};
    }
    return k;
}

/* The miss weight of the instance named `name`: its entry in few (k of them), else miss_all; the dict's entry
 * where k is -1 or the name is not an exact str. -1 with an exception set on an error. */
static int miss_weight(PyObject *miss, const Miss *few, Py_ssize_t k, PyObject *name, double miss_all,
                       double *out) {
    *out = miss_all;
    if (k >= 0 && PyUnicode_CheckExact(name)) {
        for (Py_ssize_t j = 0; j < k; j++) {
            if (few[j].name == name) {
                *out = few[j].weight;
                return 0;
            }
        }
        Py_hash_t h = PyObject_Hash(name);
        for (Py_ssize_t j = 0; j < k; j++) {
            if (few[j].hash == h && PyUnicode_Compare(few[j].name, name) == 0) {
                *out = few[j].weight;
                return 0;
            }
        }
        return 0;
    }
    PyObject *got = PyDict_GetItemWithError(miss, name);  /* borrowed */
    if (got == NULL) return PyErr_Occurred() ? -1 : 0;
    *out = as_double(got);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* engine_load.backlog_tokens: foreign waiting x mean, plus the part of the prompt beyond the free KV. */
static int backlog(PyObject *engine, PyObject *inst, double prompt, double mean, double *out) {
    double waiting, capacity, usage;
    if (get_double(engine, s_foreign_waiting, &waiting) < 0) return -1;
    double extra = waiting * mean;
    PyObject *kv = PyObject_GetAttr(engine, s_kv_usage);
    if (kv == NULL) return -1;
    if (kv != Py_None) {
        usage = PyFloat_AsDouble(kv);
        Py_DECREF(kv);
        if (usage == -1.0 && PyErr_Occurred()) return -1;
        if (field_double(inst, F_CAPACITY, &capacity) < 0) return -1;
        double over = prompt - (1.0 - usage) * capacity;
        extra += over > 0.0 ? over : 0.0;  /* max(0.0, over): 0.0 unless over > 0.0 */
    } else {
        Py_DECREF(kv);
    }
    *out = extra;
    return 0;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *up, *params, *miss, *result = NULL;
    double balance_factor, hot_factor, hot_slack, miss_all, prompt, mean, slack_tokens, least_slack;
    long threshold, balance_slack;
    int hot;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &up, &PyTuple_Type, &params)) return NULL;
    /* ScanParams's fields, in its order */
    if (!PyArg_ParseTuple(params, "ldlpddO!ddddd", &threshold, &balance_factor, &balance_slack, &hot, &hot_factor,
                          &hot_slack, &PyDict_Type, &miss, &miss_all, &prompt, &mean, &slack_tokens, &least_slack))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(up);
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no instances");
        return NULL;
    }
    Miss few[FEW_MISSES];
    Py_ssize_t n_few = 0;
    Row stack_rows[128];
    Row *rows = n <= 128 ? stack_rows : PyMem_Malloc(n * sizeof(Row));
    if (rows == NULL) return PyErr_NoMemory();
    Py_ssize_t filled = 0;

    /* The guard: in flight (plus the engine's foreign requests) against min(threshold, ceil((1+e)(sum+1)/n)+k).
     * Sums are taken in the list's order, as Python's sum() does. */
    double total = 0.0, sent = 0.0;
    for (Py_ssize_t i = 0; i < n; i++, filled++) {
        Row *r = &rows[i];
        r->inst = PyList_GET_ITEM(up, i);
        r->engine = NULL;
        PyObject *v = field(r->inst, F_INFLIGHT);
        if (v == NULL) goto done;
        r->inflight = PyLong_AsLong(v);
        Py_DECREF(v);
        if (r->inflight == -1 && PyErr_Occurred()) goto done;
        r->load = (double)r->inflight;
        PyObject *engine = field(r->inst, F_ENGINE);
        if (engine == NULL) goto done;
        if (engine == Py_None) {
            Py_DECREF(engine);
        } else {
            r->engine = engine;
            double foreign;
            if (get_double(engine, s_foreign_requests, &foreign) < 0) { filled++; goto done; }
            r->load += foreign;
        }
        total += r->load;
        if (hot) {
            if (field_double(r->inst, F_RECENT, &r->recent) < 0) { filled++; goto done; }
            sent += r->recent;
        }
    }
    double cap = ceil((1.0 + balance_factor) * (total + 1.0) / (double)n) + (double)balance_slack;
    if ((double)threshold < cap) cap = (double)threshold;
    Py_ssize_t m = 0;  /* candidates are compacted to the front of rows (their order kept) */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!(rows[i].load >= cap)) {
            swap_rows(rows, m, i);
            m++;
        }
    }
    if (m == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }

    /* A hot prefix: not onto an instance sent more than its share of recent requests (unless all were). */
    if (hot) {  /* HotShare.cap: (1+d) x the mean over all routable instances + slack */
        double share_cap = (1.0 + hot_factor) * sent / (double)n + hot_slack;
        Py_ssize_t fair = 0;
        for (Py_ssize_t i = 0; i < m; i++) fair += rows[i].recent <= share_cap;
        if (fair > 0) {
            Py_ssize_t k = 0;
            for (Py_ssize_t i = 0; i < m; i++) {
                if (rows[i].recent <= share_cap) {
                    swap_rows(rows, k, i);
                    k++;
                }
            }
            m = k;
        }
    }

    /* Costs: (queued prefill [+ engine backlog] + miss) / rate; the cheapest, and everything within a block. */
    double best = INFINITY, slowest = INFINITY;
    n_few = PyDict_GET_SIZE(miss) > 0 ? few_misses(miss, few) : 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        Row *r = &rows[i];
        double queued, extra, miss_here = miss_all;
        if (field_double(r->inst, F_QUEUED, &queued) < 0) goto done;
        if (r->engine != NULL) {
            if (backlog(r->engine, r->inst, prompt, mean, &extra) < 0) goto done;
            queued = queued + extra;
        }
        if (n_few != 0) {
            PyObject *name = field(r->inst, F_NAME);
            if (name == NULL) goto done;
            int err = miss_weight(miss, few, n_few, name, miss_all, &miss_here);
            Py_DECREF(name);
            if (err < 0) goto done;
        }
        if (field_double(r->inst, F_RATE, &r->rate) < 0) goto done;
        r->cost = (queued + miss_here) / r->rate;
        if (r->cost < best) best = r->cost;
        if (r->rate < slowest) slowest = r->rate;
    }
    double limit = best + slack_tokens / slowest;
    Py_ssize_t tied = 0;
    long least = LONG_MAX;  /* least_slack may be inf: the step is not in the pipeline, every tie stays */
    for (Py_ssize_t i = 0; i < m; i++) {
        if (rows[i].cost <= limit) {
            swap_rows(rows, tied, i);
            if (rows[tied].inflight < least) least = rows[tied].inflight;
            tied++;
        }
    }
    if (tied > 1 && !isinf(least_slack)) {  /* equal cost: the least loaded of them (and those close to it) */
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < tied; i++) {
            if ((double)rows[i].inflight <= (double)least + least_slack) {
                swap_rows(rows, k, i);
                k++;
            }
        }
        tied = k;
    }
    if (tied == 1) {
        result = Py_NewRef(rows[0].inst);
        goto done;
    }
    result = PyList_New(tied);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < tied; i++) PyList_SET_ITEM(result, i, Py_NewRef(rows[i].inst));

done:
    for (Py_ssize_t j = 0; j < n_few; j++) Py_DECREF(few[j].name);
    for (Py_ssize_t i = 0; i < filled && i < n; i++) Py_XDECREF(rows[i].engine);
    if (rows != stack_rows) PyMem_Free(rows);
    return result;
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
    {"scan", scan, METH_VARARGS, "cache_aware's filters, scorer and tie-breaking (see stages/compiled.py)."},
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
        {&s_inflight, "inflight"}, {&s_engine, "engine"}, {&s_queued, "queued_prefill_tokens"},
        {&s_rate, "prefill_tokens_per_s"}, {&s_name, "name"}, {&s_recent, "recent"},
        {&s_capacity, "kv_capacity_tokens"}, {&s_healthy, "healthy"}, {&s_draining, "draining"},
        {&s_foreign_requests, "foreign_requests"},
        {&s_foreign_waiting, "foreign_waiting"}, {&s_kv_usage, "kv_usage"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (*names[i].slot == NULL) return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "API", 2) < 0) {  /* stages/compiled.py's API */
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
