/* The prefix index's store, compiled: prefix_index.PythonPrefixIndex's state and operations, same results.
 *
 * Index() holds, per instance slot, an LRU list of the chained block hashes it is modelled to hold, and for
 * every block the bitmask of the slots holding it. prefix_index.CompiledPrefixIndex keeps the names, slots
 * and capacities (shared with the Python version) and calls:
 *     set_capacity(slot, cap)   create the slot if new; evict its LRU blocks past cap
 *     clear(slot)               forget all its blocks and free its memory
 *     record(slot, blocks)      touch the chain tail first (new blocks added, cached ones made recent), trim
 *     forget(slot, blocks)      -> blocks removed
 *     match(blocks, names)      -> {names[slot]: depth}: the longest cached prefix per slot, by bisection
 *     holds(slot, block), entries(slot=-1), distinct(), nbytes(), lru_order(slot) (tests)
 * The Python version (dicts of Python ints, an OrderedDict per instance) costs several times the memory per
 * entry and is slow to record a long cold prompt at a full index (docs/tuning.md); here an entry is an
 * open-addressing slot and a list node (all allocated through PyMem so tracemalloc sees it) and memory is
 * touched a few cache lines per block. Block hashes are 64-bit ints (as block_hash produces); others raise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define NIL UINT32_MAX

/* -- open-addressing table: uint64 key -> uint32 value (NIL marks an empty slot); linear probing ------------ */
typedef struct {
    uint64_t *keys;
    uint32_t *vals;
    uint32_t cap;   /* a power of two, or 0 */
    uint32_t len;
    int shift;      /* 64 - log2(cap) */
} Table;

static inline uint32_t home(const Table *t, uint64_t k) {
    return (uint32_t)((k * 0x9E3779B97F4A7C15ULL) >> t->shift);  /* Fibonacci hashing: any key spreads */
}

/* The slot holding k, or NIL. */
static inline uint32_t t_find(const Table *t, uint64_t k) {
    if (t->len == 0) return NIL;
    uint32_t mask = t->cap - 1, i = home(t, k);
    while (t->vals[i] != NIL) {
        if (t->keys[i] == k) return i;
        i = (i + 1) & mask;
    }
    return NIL;
}

static int t_resize(Table *t, uint32_t cap) {
    uint64_t *keys = PyMem_Malloc((size_t)cap * sizeof *keys);
    uint32_t *vals = PyMem_Malloc((size_t)cap * sizeof *vals);
    if (keys == NULL || vals == NULL) {
        PyMem_Free(keys);
        PyMem_Free(vals);
        PyErr_NoMemory();
        return -1;
    }
    memset(vals, 0xff, (size_t)cap * sizeof *vals);
    Table n = {keys, vals, cap, 0, 64};
    for (uint32_t c = cap; c > 1; c >>= 1) n.shift--;
    for (uint32_t i = 0; i < t->cap; i++) {
        if (t->vals[i] == NIL) continue;
        uint32_t j = home(&n, t->keys[i]);
        while (n.vals[j] != NIL) j = (j + 1) & (cap - 1);
        n.keys[j] = t->keys[i];
        n.vals[j] = t->vals[i];
        n.len++;
    }
    PyMem_Free(t->keys);
    PyMem_Free(t->vals);
    *t = n;
    return 0;
}

/* Insert k (absent) -> v; the table grows at 3/4 full. */
static int t_insert(Table *t, uint64_t k, uint32_t v) {
    if ((uint64_t)(t->len + 1) * 4 > (uint64_t)t->cap * 3) {
        if (t->cap >= (1u << 31)) {
            PyErr_SetString(PyExc_MemoryError, "prefix index table full");
            return -1;
        }
        if (t_resize(t, t->cap ? t->cap * 2 : 16) < 0) return -1;
    }
    uint32_t mask = t->cap - 1, i = home(t, k);
    while (t->vals[i] != NIL) i = (i + 1) & mask;
    t->keys[i] = k;
    t->vals[i] = v;
    t->len++;
    return 0;
}

/* Empty slot i, shifting later entries of its probe run back (no tombstones). */
static void t_delete_at(Table *t, uint32_t i) {
    uint32_t mask = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (t->vals[j] == NIL) break;
        /* The entry at j may fill the hole at i if i lies on its probe path: home .. j (cyclically). */
        if (((j - home(t, t->keys[j])) & mask) >= ((j - i) & mask)) {
            t->keys[i] = t->keys[j];
            t->vals[i] = t->vals[j];
            i = j;
        }
    }
    t->vals[i] = NIL;
    t->len--;
}

static void t_free(Table *t) {
    PyMem_Free(t->keys);
    PyMem_Free(t->vals);
    memset(t, 0, sizeof *t);
    t->shift = 64;
}

static size_t t_bytes(const Table *t) { return (size_t)t->cap * (sizeof(uint64_t) + sizeof(uint32_t)); }

/* -- one instance's modelled cache: block -> node, nodes in a doubly linked LRU list ------------------------- */
typedef struct {
    Table map;
    uint64_t *hash;
    uint32_t *prev, *next;  /* next also links the free nodes */
    uint32_t nodes;         /* allocated */
    uint32_t lru, mru, free_node;
    Py_ssize_t len, capacity;
    int used;
} Lru;

static int lru_grow(Lru *c) {
    uint32_t n = c->nodes ? c->nodes * 2 : 64;
    if (c->nodes >= (1u << 30)) {
        PyErr_SetString(PyExc_MemoryError, "prefix index instance full");
        return -1;
    }
    uint64_t *hash = PyMem_Realloc(c->hash, (size_t)n * sizeof *hash);
    if (hash == NULL) goto fail;
    c->hash = hash;
    uint32_t *prev = PyMem_Realloc(c->prev, (size_t)n * sizeof *prev);
    if (prev == NULL) goto fail;
    c->prev = prev;
    uint32_t *next = PyMem_Realloc(c->next, (size_t)n * sizeof *next);
    if (next == NULL) goto fail;
    c->next = next;
    for (uint32_t i = c->nodes; i < n; i++) c->next[i] = i + 1 < n ? i + 1 : c->free_node;
    c->free_node = c->nodes;
    c->nodes = n;
    return 0;
fail:
    PyErr_NoMemory();
    return -1;
}

static inline void lru_unlink(Lru *c, uint32_t n) {
    uint32_t p = c->prev[n], q = c->next[n];
    if (p != NIL) c->next[p] = q; else c->lru = q;
    if (q != NIL) c->prev[q] = p; else c->mru = p;
}

static inline void lru_append(Lru *c, uint32_t n) {
    c->prev[n] = c->mru;
    c->next[n] = NIL;
    if (c->mru != NIL) c->next[c->mru] = n; else c->lru = n;
    c->mru = n;
}

static void lru_free(Lru *c) {
    t_free(&c->map);
    PyMem_Free(c->hash);
    PyMem_Free(c->prev);
    PyMem_Free(c->next);
    memset(c, 0, sizeof *c);
    c->map.shift = 64;
    c->lru = c->mru = c->free_node = NIL;
}

static size_t lru_bytes(const Lru *c) {
    return t_bytes(&c->map) + (size_t)c->nodes * (sizeof(uint64_t) + 2 * sizeof(uint32_t));
}

/* -- the index ------------------------------------------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    Table owners;        /* block -> owner record */
    uint64_t *masks;     /* words per record: bit s of a record = slot s holds the block */
    uint32_t words;
    uint32_t records;    /* allocated */
    uint32_t *free_recs; /* a stack of free records */
    uint32_t nfree;
    Lru *slots;
    Py_ssize_t nslots;
} Index;

static int grow_records(Index *ix) {
    uint32_t n = ix->records ? ix->records * 2 : 64;
    uint64_t *masks = PyMem_Realloc(ix->masks, (size_t)n * ix->words * sizeof *masks);
    if (masks == NULL) goto fail;
    ix->masks = masks;
    uint32_t *free_recs = PyMem_Realloc(ix->free_recs, (size_t)n * sizeof *free_recs);
    if (free_recs == NULL) goto fail;
    ix->free_recs = free_recs;
    for (uint32_t r = n; r > ix->records; r--) ix->free_recs[ix->nfree++] = r - 1;
    ix->records = n;
    return 0;
fail:
    PyErr_NoMemory();
    return -1;
}

/* Room in every record for slot s's bit. */
static int widen(Index *ix, Py_ssize_t s) {
    uint32_t words = (uint32_t)(s / 64 + 1);
    if (words <= ix->words) return 0;
    uint64_t *masks = PyMem_Calloc((size_t)(ix->records ? ix->records : 1) * words, sizeof *masks);
    if (masks == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t r = 0; r < ix->records; r++)
        memcpy(masks + (size_t)r * words, ix->masks + (size_t)r * ix->words, ix->words * sizeof *masks);
    PyMem_Free(ix->masks);
    ix->masks = masks;
    ix->words = words;
    return 0;
}

static inline uint64_t *mask_of(Index *ix, uint32_t rec) { return ix->masks + (size_t)rec * ix->words; }

static int owner_add(Index *ix, uint64_t k, Py_ssize_t s) {
    uint32_t i = t_find(&ix->owners, k), rec;
    if (i != NIL) {
        rec = ix->owners.vals[i];
    } else {
        if (ix->nfree == 0 && grow_records(ix) < 0) return -1;
        rec = ix->free_recs[--ix->nfree];
        if (t_insert(&ix->owners, k, rec) < 0) {
            ix->free_recs[ix->nfree++] = rec;
            return -1;
        }
        memset(mask_of(ix, rec), 0, ix->words * sizeof(uint64_t));
    }
    mask_of(ix, rec)[s / 64] |= 1ULL << (s % 64);
    return 0;
}

static void owner_clear(Index *ix, uint64_t k, Py_ssize_t s) {
    uint32_t i = t_find(&ix->owners, k);
    if (i == NIL) return;
    uint32_t rec = ix->owners.vals[i];
    uint64_t *m = mask_of(ix, rec);
    m[s / 64] &= ~(1ULL << (s % 64));
    for (uint32_t w = 0; w < ix->words; w++)
        if (m[w]) return;
    t_delete_at(&ix->owners, i);
    ix->free_recs[ix->nfree++] = rec;
}

/* Drop node n of slot s (its map entry found at mi, or NIL to look it up). */
static void drop_node(Index *ix, Py_ssize_t s, uint32_t n, uint32_t mi) {
    Lru *c = &ix->slots[s];
    uint64_t k = c->hash[n];
    if (mi == NIL) mi = t_find(&c->map, k);
    t_delete_at(&c->map, mi);
    lru_unlink(c, n);
    c->next[n] = c->free_node;
    c->free_node = n;
    c->len--;
    owner_clear(ix, k, s);
}

static void evict_to(Index *ix, Py_ssize_t s, Py_ssize_t cap) {
    Lru *c = &ix->slots[s];
    while (c->len > cap && c->lru != NIL) drop_node(ix, s, c->lru, NIL);
}

static void index_clear_slot(Index *ix, Py_ssize_t s) {
    Lru *c = &ix->slots[s];
    for (uint32_t n = c->lru; n != NIL; n = c->next[n]) owner_clear(ix, c->hash[n], s);
    Py_ssize_t capacity = c->capacity;
    int used = c->used;
    lru_free(c);
    c->capacity = capacity;
    c->used = used;
}

/* -- argument helpers --------------------------------------------------------------------------------------------- */
static int get_slot(Index *ix, PyObject *arg, Py_ssize_t *s) {
    *s = PyLong_AsSsize_t(arg);
    if (*s == -1 && PyErr_Occurred()) return -1;
    if (*s < 0 || *s >= ix->nslots || !ix->slots[*s].used) {
        PyErr_Format(PyExc_KeyError, "no slot %zd", *s);
        return -1;
    }
    return 0;
}

static inline int as_u64(PyObject *o, uint64_t *out) {
    *out = PyLong_AsUnsignedLongLong(o);
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "block hashes must be ints from 0 to 2**64-1");
        }
        return -1;
    }
    return 0;
}

/* A chain of block hashes as uint64s: read in place from a buffer of 'Q' (block_hash's Chain: no Python int at
 * all), else converted from a sequence of ints into memory of our own, all before anything changes. */
typedef struct {
    const uint64_t *h;
    Py_ssize_t n;
    Py_buffer view;    /* held while h points into it */
    int has_view;
    uint64_t *owned;
} ChainView;

static int is_u64_format(const char *f) {
    return f != NULL && (strcmp(f, "Q") == 0 || strcmp(f, "@Q") == 0 || strcmp(f, "=Q") == 0);
}

static int chain_open(PyObject *blocks, ChainView *cv) {
    memset(cv, 0, sizeof *cv);
    if (PyObject_CheckBuffer(blocks) && !PyBytes_Check(blocks) && !PyByteArray_Check(blocks)) {
        if (PyObject_GetBuffer(blocks, &cv->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            if (cv->view.itemsize == 8 && is_u64_format(cv->view.format) && cv->view.ndim <= 1) {
                cv->has_view = 1;
                cv->h = cv->view.buf;
                cv->n = cv->view.len / 8;
                return 0;
            }
            PyBuffer_Release(&cv->view);
        } else {
            PyErr_Clear();
        }
    }
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence of ints");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *out = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *out);
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_u64(items[i], &out[i]) < 0) {
            PyMem_Free(out);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    cv->h = cv->owned = out;
    cv->n = n;
    return 0;
}

static void chain_close(ChainView *cv) {
    if (cv->has_view) PyBuffer_Release(&cv->view);
    PyMem_Free(cv->owned);
    memset(cv, 0, sizeof *cv);
}

/* -- methods ------------------------------------------------------------------------------------------------------- */
static PyObject *Index_set_capacity(Index *ix, PyObject *args) {
    Py_ssize_t s, cap;
    if (!PyArg_ParseTuple(args, "nn", &s, &cap)) return NULL;
    if (s < 0 || s >= (1 << 20) || cap < 0) {
        PyErr_SetString(PyExc_ValueError, "slot must be in 0..2**20 and capacity >= 0");
        return NULL;
    }
    if (s >= ix->nslots) {
        Lru *slots = PyMem_Realloc(ix->slots, (size_t)(s + 1) * sizeof *slots);
        if (slots == NULL) return PyErr_NoMemory();
        for (Py_ssize_t i = ix->nslots; i <= s; i++) {
            memset(&slots[i], 0, sizeof *slots);
            slots[i].map.shift = 64;
            slots[i].lru = slots[i].mru = slots[i].free_node = NIL;
        }
        ix->slots = slots;
        ix->nslots = s + 1;
    }
    if (widen(ix, s) < 0) return NULL;
    ix->slots[s].used = 1;
    ix->slots[s].capacity = cap;
    evict_to(ix, s, cap);
    Py_RETURN_NONE;
}

static PyObject *Index_clear(Index *ix, PyObject *arg) {
    Py_ssize_t s;
    if (get_slot(ix, arg, &s) < 0) return NULL;
    index_clear_slot(ix, s);
    Py_RETURN_NONE;
}

static PyObject *Index_release(Index *ix, PyObject *arg) {
    Py_ssize_t s;
    if (get_slot(ix, arg, &s) < 0) return NULL;
    index_clear_slot(ix, s);
    ix->slots[s].used = 0;
    ix->slots[s].capacity = 0;
    Py_RETURN_NONE;
}

/* (slot, blocks) arguments: the slot checked, the chain opened (close it). */
static int slot_and_chain(Index *ix, PyObject *args, Py_ssize_t *s, ChainView *cv) {
    PyObject *slot_obj, *blocks;
    if (!PyArg_ParseTuple(args, "OO", &slot_obj, &blocks)) return -1;
    if (get_slot(ix, slot_obj, s) < 0) return -1;
    return chain_open(blocks, cv);
}

static PyObject *Index_record(Index *ix, PyObject *args) {
    Py_ssize_t s, n;
    ChainView cv;
    if (slot_and_chain(ix, args, &s, &cv) < 0) return NULL;
    n = cv.n;
    Lru *c = &ix->slots[s];
    for (Py_ssize_t j = n - 1; j >= 0; j--) {  /* tail first: the head ends up most recent */
        uint64_t k = cv.h[j];
        uint32_t mi = t_find(&c->map, k);
        if (mi != NIL) {
            uint32_t node = c->map.vals[mi];
            lru_unlink(c, node);
            lru_append(c, node);
            continue;
        }
        if (c->free_node == NIL && lru_grow(c) < 0) goto fail;
        uint32_t node = c->free_node;
        if (t_insert(&c->map, k, node) < 0) goto fail;
        if (owner_add(ix, k, s) < 0) {
            t_delete_at(&c->map, t_find(&c->map, k));
            goto fail;
        }
        c->free_node = c->next[node];
        c->hash[node] = k;
        lru_append(c, node);
        c->len++;
    }
    chain_close(&cv);
    evict_to(ix, s, c->capacity);
    Py_RETURN_NONE;
fail:  /* out of memory part way: what was added stays consistent; trim it back to capacity */
    chain_close(&cv);
    evict_to(ix, s, c->capacity);
    return NULL;
}

static PyObject *Index_forget(Index *ix, PyObject *args) {
    Py_ssize_t s, n, removed = 0;
    ChainView cv;
    if (slot_and_chain(ix, args, &s, &cv) < 0) return NULL;
    n = cv.n;
    Lru *c = &ix->slots[s];
    for (Py_ssize_t j = 0; j < n; j++) {
        uint32_t mi = t_find(&c->map, cv.h[j]);
        if (mi != NIL) {
            drop_node(ix, s, c->map.vals[mi], mi);
            removed++;
        }
    }
    chain_close(&cv);
    return PyLong_FromSsize_t(removed);
}

/* Block i of a chain being matched: from a buffer of uint64 in place, or converted from a list's int. */
typedef struct {
    const uint64_t *raw;
    PyObject **items;
} Reader;

/* The owner mask of block i (0 if absent), ANDed with `within` if given, into out. Returns -1 on error. */
static int mask_at(Index *ix, const Reader *r, Py_ssize_t i, const uint64_t *within, uint64_t *out) {
    uint64_t k;
    if (r->raw != NULL) k = r->raw[i];
    else if (as_u64(r->items[i], &k) < 0) return -1;
    uint32_t t = t_find(&ix->owners, k);
    if (t == NIL) {
        memset(out, 0, ix->words * sizeof *out);
        return 0;
    }
    const uint64_t *m = mask_of(ix, ix->owners.vals[t]);
    for (uint32_t w = 0; w < ix->words; w++) out[w] = within ? m[w] & within[w] : m[w];
    return 0;
}

static int mask_eq(const uint64_t *a, const uint64_t *b, uint32_t words) {
    return memcmp(a, b, words * sizeof *a) == 0;
}

/* Longest cached prefix per slot: the same bisection as PythonPrefixIndex.match_depths, in the same order. */
static PyObject *Index_match(Index *ix, PyObject *args) {
    PyObject *blocks, *names, *seq = NULL;
    if (!PyArg_ParseTuple(args, "OO", &blocks, &names)) return NULL;
    if (!PyList_Check(names)) {
        PyErr_SetString(PyExc_TypeError, "names must be a list");
        return NULL;
    }
    /* A Chain is read in place; anything else as a sequence of ints, each converted only where bisection
     * looks (a chain is never copied whole). A Chain's first hash is read alone first: when nobody holds it
     * (a cold prompt) nothing deeper can match, and a lazy Chain is then never hashed beyond its first block. */
    ChainView cv = {0};
    Reader reader = {NULL, NULL};
    Py_ssize_t n = -1;
    uint64_t first = 0;
    int buffered = PyObject_CheckBuffer(blocks) && !PyBytes_Check(blocks) && !PyByteArray_Check(blocks);
    if (buffered && (n = PyObject_Length(blocks)) < 0) {  /* no length: open it whole (it says what is wrong) */
        PyErr_Clear();
        buffered = 0;
        if (chain_open(blocks, &cv) < 0) return NULL;
        reader.raw = cv.h;
        n = cv.n;
    } else if (buffered) {  /* its first block only, until that is known to be held */
        if (n > 0) {
            PyObject *b0 = PySequence_GetItem(blocks, 0);
            if (b0 == NULL) return NULL;
            int bad = as_u64(b0, &first);
            Py_DECREF(b0);
            if (bad < 0) return NULL;
        }
        reader.raw = &first;
    } else {
        seq = PySequence_Fast(blocks, "blocks must be a sequence of ints");
        if (seq == NULL) return NULL;
        reader.items = PySequence_Fast_ITEMS(seq);
        n = PySequence_Fast_GET_SIZE(seq);
    }
    uint32_t W = ix->words ? ix->words : 1;
    PyObject *depths = PyDict_New();
    /* A stack of intervals (lo, hi) with their masks; depth <= 2 log2(n) + 2 entries. */
    Py_ssize_t max_stack = 2 * 64 + 4;
    Py_ssize_t *los = PyMem_Malloc(max_stack * 2 * sizeof *los);
    uint64_t *ms = PyMem_Malloc((size_t)max_stack * 2 * W * sizeof *ms);
    uint64_t *mid_mask = PyMem_Malloc((size_t)W * sizeof *mid_mask);
    if (depths == NULL || los == NULL || ms == NULL || mid_mask == NULL) {
        if (depths != NULL) PyErr_NoMemory();
        goto fail;
    }
    if (n == 0 || ix->words == 0) goto done;
    /* entry e: los[2e] = lo, los[2e+1] = hi, ms[2eW..] = mask(lo), ms[(2e+1)W..] = mask(hi) */
    Py_ssize_t top = 0;
    if (mask_at(ix, &reader, 0, NULL, ms) < 0) goto fail;
    int any = 0;
    for (uint32_t w = 0; w < W; w++) any |= ms[w] != 0;
    if (!any) goto done;
    if (buffered) {  /* held: read the whole chain */
        if (chain_open(blocks, &cv) < 0) goto fail;
        if (cv.n != n) {
            PyErr_SetString(PyExc_ValueError, "blocks changed length while being read");
            goto fail;
        }
        reader.raw = cv.h;
    }
    los[0] = 0;
    los[1] = n;
    memset(ms + W, 0, W * sizeof *ms);
    top = 1;
    while (top > 0) {
        top--;
        Py_ssize_t lo = los[2 * top], hi = los[2 * top + 1];
        uint64_t *mlo = ms + (size_t)2 * top * W, *mhi = mlo + W;
        if (mask_eq(mlo, mhi, W)) continue;
        if (hi - lo == 1) {
            for (uint32_t w = 0; w < W; w++) {
                uint64_t dropped = mlo[w] & ~mhi[w];
                while (dropped) {
                    uint64_t bit = dropped & (0 - dropped);
                    Py_ssize_t s = (Py_ssize_t)w * 64 + __builtin_ctzll(dropped);
                    dropped ^= bit;
                    if (s >= PyList_GET_SIZE(names)) continue;
                    PyObject *name = PyList_GET_ITEM(names, s);
                    if (name == Py_None) continue;
                    PyObject *d = PyLong_FromSsize_t(lo + 1);
                    if (d == NULL || PyDict_SetItem(depths, name, d) < 0) {
                        Py_XDECREF(d);
                        goto fail;
                    }
                    Py_DECREF(d);
                }
            }
            continue;
        }
        Py_ssize_t mid = (lo + hi) / 2;
        if (mask_at(ix, &reader, mid, mlo, mid_mask) < 0) goto fail;
        if (top + 2 > max_stack) {  /* cannot happen for a bisection (depth <= 64), kept as a guard */
            PyErr_SetString(PyExc_RuntimeError, "match stack overflow");
            goto fail;
        }
        /* push (lo, mid) then (mid, hi), as the Python version; (mid, hi) is popped first */
        uint64_t *e1 = ms + (size_t)2 * (top + 1) * W;
        memcpy(e1, mid_mask, W * sizeof *ms);           /* mask(mid) of (mid, hi) */
        memcpy(e1 + W, mhi, W * sizeof *ms);             /* mask(hi) */
        memcpy(mhi, mid_mask, W * sizeof *ms);           /* (lo, mid): mask(lo) stays, mask(hi) := mask(mid) */
        los[2 * top + 1] = mid;
        los[2 * (top + 1)] = mid;
        los[2 * (top + 1) + 1] = hi;
        top += 2;
    }
done:
    PyMem_Free(los);
    PyMem_Free(ms);
    PyMem_Free(mid_mask);
    Py_XDECREF(seq);
    chain_close(&cv);
    return depths;
fail:
    PyMem_Free(los);
    PyMem_Free(ms);
    PyMem_Free(mid_mask);
    Py_XDECREF(seq);
    chain_close(&cv);
    Py_XDECREF(depths);
    return NULL;
}

static PyObject *Index_holds(Index *ix, PyObject *args) {
    Py_ssize_t s;
    PyObject *block;
    uint64_t k;
    if (!PyArg_ParseTuple(args, "nO", &s, &block)) return NULL;
    if (as_u64(block, &k) < 0) {
        PyErr_Clear();  /* no such block can be held */
        Py_RETURN_FALSE;
    }
    if (s < 0 || s >= ix->nslots || !ix->slots[s].used) Py_RETURN_FALSE;
    return PyBool_FromLong(t_find(&ix->slots[s].map, k) != NIL);
}

static PyObject *Index_entries(Index *ix, PyObject *args) {
    Py_ssize_t s = -1, total = 0;
    if (!PyArg_ParseTuple(args, "|n", &s)) return NULL;
    if (s >= 0) return PyLong_FromSsize_t(s < ix->nslots ? ix->slots[s].len : 0);
    for (Py_ssize_t i = 0; i < ix->nslots; i++) total += ix->slots[i].len;
    return PyLong_FromSsize_t(total);
}

static PyObject *Index_distinct(Index *ix, PyObject *unused) { return PyLong_FromSize_t(ix->owners.len); }

static PyObject *Index_nbytes(Index *ix, PyObject *unused) {
    size_t b = sizeof *ix + t_bytes(&ix->owners) + (size_t)ix->records * (ix->words * 8 + 4);
    b += (size_t)ix->nslots * sizeof(Lru);
    for (Py_ssize_t i = 0; i < ix->nslots; i++) b += lru_bytes(&ix->slots[i]);
    return PyLong_FromSize_t(b);
}

static PyObject *Index_lru_order(Index *ix, PyObject *arg) {
    Py_ssize_t s;
    if (get_slot(ix, arg, &s) < 0) return NULL;
    Lru *c = &ix->slots[s];
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (uint32_t n = c->lru; n != NIL; n = c->next[n]) {
        PyObject *h = PyLong_FromUnsignedLongLong(c->hash[n]);
        if (h == NULL || PyList_Append(out, h) < 0) {
            Py_XDECREF(h);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(h);
    }
    return out;
}

static PyObject *Index_owners(Index *ix, PyObject *unused) {
    /* {block: owner mask as an int}: every block's owner bits (tests compare them with the caches) */
    PyObject *out = PyDict_New(), *shift = PyLong_FromLong(64);
    if (out == NULL || shift == NULL) goto fail;
    for (uint32_t i = 0; i < ix->owners.cap; i++) {
        if (ix->owners.vals[i] == NIL) continue;
        const uint64_t *m = mask_of(ix, ix->owners.vals[i]);
        PyObject *mask = PyLong_FromLong(0);
        for (uint32_t w = ix->words; w-- > 0 && mask != NULL;) {  /* most significant word first */
            PyObject *shifted = PyNumber_Lshift(mask, shift);
            PyObject *word = PyLong_FromUnsignedLongLong(m[w]);
            Py_DECREF(mask);
            mask = shifted != NULL && word != NULL ? PyNumber_Or(shifted, word) : NULL;
            Py_XDECREF(shifted);
            Py_XDECREF(word);
        }
        PyObject *key = PyLong_FromUnsignedLongLong(ix->owners.keys[i]);
        int bad = mask == NULL || key == NULL || PyDict_SetItem(out, key, mask) < 0;
        Py_XDECREF(mask);
        Py_XDECREF(key);
        if (bad) goto fail;
    }
    Py_DECREF(shift);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(shift);
    return NULL;
}

static void Index_dealloc(Index *ix) {
    for (Py_ssize_t i = 0; i < ix->nslots; i++) lru_free(&ix->slots[i]);
    PyMem_Free(ix->slots);
    t_free(&ix->owners);
    PyMem_Free(ix->masks);
    PyMem_Free(ix->free_recs);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static PyObject *Index_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "Index() takes no arguments");
        return NULL;
    }
    Index *ix = (Index *)type->tp_alloc(type, 0);
    if (ix == NULL) return NULL;
    ix->owners.shift = 64;
    return (PyObject *)ix;
}

static PyMethodDef Index_methods[] = {
    {"set_capacity", (PyCFunction)Index_set_capacity, METH_VARARGS, "set_capacity(slot, cap): create or resize"},
    {"clear", (PyCFunction)Index_clear, METH_O, "clear(slot): forget all its blocks"},
    {"release", (PyCFunction)Index_release, METH_O, "release(slot): clear it and mark it unused"},
    {"record", (PyCFunction)Index_record, METH_VARARGS, "record(slot, blocks): the slot now holds this chain"},
    {"forget", (PyCFunction)Index_forget, METH_VARARGS, "forget(slot, blocks) -> blocks removed"},
    {"match", (PyCFunction)Index_match, METH_VARARGS, "match(blocks, names) -> {names[slot]: depth}"},
    {"holds", (PyCFunction)Index_holds, METH_VARARGS, "holds(slot, block) -> bool"},
    {"entries", (PyCFunction)Index_entries, METH_VARARGS, "entries(slot=-1) -> entries of the slot, or of all"},
    {"distinct", (PyCFunction)Index_distinct, METH_NOARGS, "distinct() -> blocks held by anyone"},
    {"nbytes", (PyCFunction)Index_nbytes, METH_NOARGS, "nbytes() -> bytes allocated"},
    {"lru_order", (PyCFunction)Index_lru_order, METH_O, "lru_order(slot) -> blocks, least recent first"},
    {"owners", (PyCFunction)Index_owners, METH_NOARGS, "owners() -> {block: owner mask}"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "warmroute.core._index.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The prefix index's store (see prefix_index.CompiledPrefixIndex).",
    .tp_new = Index_new,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_index", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__index(void) {
    if (PyType_Ready(&IndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
