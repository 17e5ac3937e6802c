/* The lookup plane's hot loops in C (see kvtier/key_index.py, whose layout they share).
 *
 * longest_prefix: `IndexReader.longest_prefix` without numpy's per-call overhead (a dozen numpy
 * calls made a 16-key lookup 8 us; this is under 1). It answers what the numpy fast path
 * answers: each key's two home groups read in one pass, under the segment's write_seq read
 * before and after. Anything else (a write under way or in between, a first missing key whose
 * home groups are both full and so may have spilled) it leaves to numpy, which answers those.
 *
 * insert: `IndexWriter.insert_many`'s placement and writes, key by key as `insert` does, in one
 * write_seq window (the daemon publishes every page it stores: 1.8-2 us a page in numpy). A
 * batch of `GIL_FREE_KEYS` keys or more (a rebuild's load) runs without the GIL, so a rebuild
 * on a thread of its own leaves the daemon's other threads running.
 *
 * remove: `IndexWriter.remove_many`'s tombstones, key by key as `remove` does, in one window
 * (without the GIL from `GIL_FREE_KEYS` keys, as insert).
 *
 * find: the slot of each key, for the writer (its removes, and its filter of keys published
 * already). The table is the writer's only record of where keys are: a dict of key -> slot cost
 * more than the placement (0.3-0.45 us a key at a million keys) and 100 bytes of heap a key.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 16
#define GROUP_SLOTS 8
#define GROUP_BYTES (KEY_BYTES * GROUP_SLOTS)
#define WRITE_SEQ_WORD 3 /* header word: odd while a write is under way */
#define SPILL_GROUPS 4   /* key_index.SPILL_GROUPS */
/* Batches this large (inserts, removes) give up the GIL: about 1 ms of work here, against a
 * hand-back that may wait a switch interval for the GIL when other threads want it (the store
 * path's batches are far smaller and keep it). */
#define GIL_FREE_KEYS 16384

/* The reserved slot patterns (key_index.EMPTY_KEY, DELETED_KEY): never published. */
static const unsigned char EMPTY_KEY[KEY_BYTES];
static const unsigned char DELETED_KEY[KEY_BYTES] = {
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

/* The home mix of key_index.HOME_MIX: (w0, w1) -> (w0*A + w1*B, w0*C + w1*D) mod 2^64. */
static const uint64_t MIX_A = 0x9E3779B97F4A7C15ULL, MIX_B = 0x85EBCA77C2B2AE62ULL,
                      MIX_C = 0x165667B19E3779F9ULL, MIX_D = 0xC2B2AE3D27D4EB4FULL;

/* A key's two home groups (key_index.home_groups): its words mixed, each one's high bits picking
 * a group in its half of `num_groups`, by a divisor of ceil(2^64 / half) (so always in range). */
static void home_groups(const unsigned char *key, uint64_t num_groups, uint64_t *first,
                        uint64_t *second) {
    const uint64_t half = num_groups / 2, divisor = UINT64_MAX / half + 1;
    uint64_t w0, w1;
    memcpy(&w0, key, 8);
    memcpy(&w1, key + 8, 8);
    *first = (w0 * MIX_A + w1 * MIX_B) / divisor;
    *second = half + (w0 * MIX_C + w1 * MIX_D) / divisor;
}

/* The slot of `key` in `group`, or -1; *has_empty set when the group has an empty slot. */
static long long slot_in_group(const unsigned char *slots, uint64_t group,
                               const unsigned char *key, int *has_empty) {
    const unsigned char *at = slots + group * GROUP_BYTES;
    for (int slot = 0; slot < GROUP_SLOTS; slot++) {
        if (memcmp(at + slot * KEY_BYTES, key, KEY_BYTES) == 0)
            return (long long)(group * GROUP_SLOTS + slot);
        if (memcmp(at + slot * KEY_BYTES, EMPTY_KEY, KEY_BYTES) == 0)
            *has_empty = 1;
    }
    return -1;
}

/* The prefix the fast path knows, or -1: a write tore the read, or the first missing key may
 * have spilled past its full home groups (ask the numpy path). */
static Py_ssize_t fast_prefix(const unsigned char *segment, Py_ssize_t slots_offset,
                              uint64_t num_groups, const unsigned char *keys,
                              Py_ssize_t num_keys) {
    const uint64_t *write_seq = (const uint64_t *)segment + WRITE_SEQ_WORD;
    const uint64_t seq = __atomic_load_n(write_seq, __ATOMIC_ACQUIRE);
    if (seq & 1)
        return -1;
    const unsigned char *slots = segment + slots_offset;
    Py_ssize_t answer = num_keys;
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        const unsigned char *key = keys + i * KEY_BYTES;
        uint64_t first, second;
        home_groups(key, num_groups, &first, &second);
        int has_empty = 0;
        if (slot_in_group(slots, first, key, &has_empty) >= 0
            || slot_in_group(slots, second, key, &has_empty) >= 0)
            continue;
        answer = has_empty ? i : -1; /* no empty slot in either: it may have spilled */
        break;
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the slot reads above come before the re-read */
    if (__atomic_load_n(write_seq, __ATOMIC_RELAXED) != seq)
        return -1;
    return answer;
}

static PyObject *longest_prefix(PyObject *module, PyObject *args) {
    Py_buffer segment, keys;
    Py_ssize_t slots_offset;
    unsigned long long num_groups;
    if (!PyArg_ParseTuple(args, "y*y*nK", &segment, &keys, &slots_offset, &num_groups))
        return NULL;
    Py_ssize_t answer = -1;
    const char *problem = NULL;
    if (keys.len % KEY_BYTES)
        problem = "keys must be 16 bytes each";
    else if (num_groups < 4 || num_groups % 2 || slots_offset < 64 || slots_offset > segment.len
             || (uint64_t)(segment.len - slots_offset) / GROUP_BYTES < num_groups)
        problem = "the segment is smaller than its layout";
    else if ((uintptr_t)segment.buf % 8 == 0) /* else its header words are not atomic: numpy */
        answer = fast_prefix(segment.buf, slots_offset, num_groups, keys.buf,
                             keys.len / KEY_BYTES); /* with the GIL: a lookup is a microsecond */
    PyBuffer_Release(&segment);
    PyBuffer_Release(&keys);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    return PyLong_FromSsize_t(answer);
}

/* One slot write inside the batch's write_seq window: the group's version odd around it. */
static void write_slot(unsigned char *segment, Py_ssize_t versions_offset, Py_ssize_t slots_offset,
                       uint64_t group, uint64_t slot, const unsigned char *key) {
    uint64_t *version = (uint64_t *)(segment + versions_offset) + group;
    __atomic_store_n(version, *version + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* odd before the key's bytes */
    memcpy(segment + slots_offset + slot * KEY_BYTES, key, KEY_BYTES);
    __atomic_store_n(version, *version + 1, __ATOMIC_RELEASE); /* even after them */
}

/* The slot holding `key` (not a reserved pattern), or -1: its home groups, then, when neither
 * has an empty slot (a key spills only past two full homes, and a used slot is never empty
 * again), the SPILL_GROUPS after the second. Only the writer calls it: it reads its own
 * writes, no seqlock. */
static long long find_slot(const unsigned char *slots, uint64_t num_groups,
                           const unsigned char *key) {
    uint64_t first, second;
    home_groups(key, num_groups, &first, &second);
    int has_empty = 0;
    long long slot = slot_in_group(slots, first, key, &has_empty);
    if (slot < 0)
        slot = slot_in_group(slots, second, key, &has_empty);
    for (int step = 1; slot < 0 && !has_empty && step <= SPILL_GROUPS; step++)
        slot = slot_in_group(slots, (second + step) % num_groups, key, &has_empty);
    return slot;
}

static int is_reserved(const unsigned char *key) {
    return memcmp(key, EMPTY_KEY, KEY_BYTES) == 0 || memcmp(key, DELETED_KEY, KEY_BYTES) == 0;
}

/* d-left insertion of `num_keys` keys, as IndexWriter.insert places one: the home group with
 * more free slots (the first on a tie), else the first of SPILL_GROUPS after the second with
 * one, else refused; within a group, its lowest free slot. A reserved pattern, and with
 * `skip_published` a key published already (before or earlier in the batch), is passed over.
 * Counts the keys placed, refused and the tombstones reused. */
static void insert_keys(unsigned char *segment, unsigned char *free_bits,
                        unsigned char *deleted_bits, Py_ssize_t versions_offset,
                        Py_ssize_t slots_offset, uint64_t num_groups,
                        const unsigned char *keys, Py_ssize_t num_keys, int skip_published,
                        Py_ssize_t *num_placed, Py_ssize_t *num_refused,
                        Py_ssize_t *num_undeleted) {
    uint64_t *write_seq = (uint64_t *)segment + WRITE_SEQ_WORD;
    const unsigned char *table = segment + slots_offset;
    __atomic_store_n(write_seq, *write_seq + 1, __ATOMIC_RELAXED); /* odd: writes under way */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        const unsigned char *key = keys + i * KEY_BYTES;
        if (is_reserved(key) || (skip_published && find_slot(table, num_groups, key) >= 0))
            continue;
        uint64_t first, second, group;
        home_groups(key, num_groups, &first, &second);
        if (free_bits[first] || free_bits[second]) {
            group = __builtin_popcount(free_bits[first]) >= __builtin_popcount(free_bits[second])
                        ? first : second;
        } else {
            group = num_groups; /* none yet */
            for (int step = 1; step <= SPILL_GROUPS; step++) {
                const uint64_t next = (second + step) % num_groups;
                if (free_bits[next]) {
                    group = next;
                    break;
                }
            }
            if (group == num_groups) {
                ++*num_refused;
                continue;
            }
        }
        const unsigned char bits = free_bits[group];
        const unsigned char lowest = bits & (unsigned char)-bits;
        free_bits[group] = bits ^ lowest;
        if (deleted_bits[group] & lowest) {
            deleted_bits[group] ^= lowest;
            ++*num_undeleted;
        }
        const uint64_t slot = group * GROUP_SLOTS + __builtin_ctz(lowest);
        write_slot(segment, versions_offset, slots_offset, group, slot, key);
        ++*num_placed;
    }
    __atomic_store_n(write_seq, *write_seq + 1, __ATOMIC_RELEASE); /* even: done */
}

/* Unpublish `num_keys` keys as IndexWriter.remove does one by one (a tombstone in each one's
 * slot, its group's bits free and deleted), in one write_seq window; a key not published (or
 * named twice) is passed over. Counts the keys unpublished. */
static void remove_keys(unsigned char *segment, unsigned char *free_bits,
                        unsigned char *deleted_bits, Py_ssize_t versions_offset,
                        Py_ssize_t slots_offset, uint64_t num_groups,
                        const unsigned char *keys, Py_ssize_t num_keys, Py_ssize_t *num_removed) {
    uint64_t *write_seq = (uint64_t *)segment + WRITE_SEQ_WORD;
    const unsigned char *table = segment + slots_offset;
    __atomic_store_n(write_seq, *write_seq + 1, __ATOMIC_RELAXED); /* odd: writes under way */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        const unsigned char *key = keys + i * KEY_BYTES;
        const long long slot = is_reserved(key) ? -1 : find_slot(table, num_groups, key);
        if (slot < 0)
            continue;
        const uint64_t group = (uint64_t)slot / GROUP_SLOTS;
        const unsigned char bit = (unsigned char)(1u << (slot % GROUP_SLOTS));
        write_slot(segment, versions_offset, slots_offset, group, (uint64_t)slot, DELETED_KEY);
        free_bits[group] |= bit;
        deleted_bits[group] |= bit;
        ++*num_removed;
    }
    __atomic_store_n(write_seq, *write_seq + 1, __ATOMIC_RELEASE); /* even: done */
}

/* The segment's layout arguments, checked against its buffers; 0 with ValueError set if not. */
static int layout_ok(const Py_buffer *segment, Py_ssize_t versions_offset,
                     Py_ssize_t slots_offset, uint64_t num_groups) {
    if (num_groups < 4 || num_groups % 2 || versions_offset < 64
        || slots_offset < versions_offset + (Py_ssize_t)(num_groups * 8)
        || slots_offset > segment->len
        || (uint64_t)(segment->len - slots_offset) / GROUP_BYTES < num_groups
        || (uintptr_t)segment->buf % 8 || versions_offset % 8) {
        PyErr_SetString(PyExc_ValueError, "the segment does not match its layout");
        return 0;
    }
    return 1;
}

static int keys_ok(const Py_buffer *keys) {
    if (keys->len % KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "keys must be 16 bytes each");
        return 0;
    }
    return 1;
}

/* A writer's call: the layout, the per-group bitmasks and the keys checked (ValueError). */
static int writer_args_ok(const Py_buffer *segment, const Py_buffer *free_bits,
                          const Py_buffer *deleted_bits, const Py_buffer *keys,
                          Py_ssize_t versions_offset, Py_ssize_t slots_offset,
                          uint64_t num_groups) {
    if (!layout_ok(segment, versions_offset, slots_offset, num_groups))
        return 0;
    if ((uint64_t)free_bits->len != num_groups || (uint64_t)deleted_bits->len != num_groups) {
        PyErr_SetString(PyExc_ValueError, "the segment does not match its layout");
        return 0;
    }
    return keys_ok(keys);
}

static void release_writer_args(Py_buffer *segment, Py_buffer *free_bits,
                                Py_buffer *deleted_bits, Py_buffer *keys) {
    PyBuffer_Release(segment);
    PyBuffer_Release(free_bits);
    PyBuffer_Release(deleted_bits);
    PyBuffer_Release(keys);
}

static PyObject *insert(PyObject *module, PyObject *args) {
    Py_buffer segment, free_bits, deleted_bits, keys;
    Py_ssize_t versions_offset, slots_offset;
    unsigned long long num_groups;
    int skip_published;
    if (!PyArg_ParseTuple(args, "w*w*w*y*nnKp", &segment, &free_bits, &deleted_bits, &keys,
                          &versions_offset, &slots_offset, &num_groups, &skip_published))
        return NULL;
    PyObject *result = NULL;
    if (writer_args_ok(&segment, &free_bits, &deleted_bits, &keys, versions_offset, slots_offset,
                       num_groups)) {
        Py_ssize_t num_placed = 0, num_refused = 0, num_undeleted = 0;
        const Py_ssize_t num_keys = keys.len / KEY_BYTES;
        /* The buffers stay exported until released below: nothing can resize them meanwhile. */
        PyThreadState *saved = num_keys >= GIL_FREE_KEYS ? PyEval_SaveThread() : NULL;
        insert_keys(segment.buf, free_bits.buf, deleted_bits.buf, versions_offset, slots_offset,
                    num_groups, keys.buf, num_keys, skip_published, &num_placed, &num_refused,
                    &num_undeleted);
        if (saved != NULL)
            PyEval_RestoreThread(saved);
        result = Py_BuildValue("nnn", num_placed, num_refused, num_undeleted);
    }
    release_writer_args(&segment, &free_bits, &deleted_bits, &keys);
    return result;
}

static PyObject *remove_(PyObject *module, PyObject *args) {
    Py_buffer segment, free_bits, deleted_bits, keys;
    Py_ssize_t versions_offset, slots_offset;
    unsigned long long num_groups;
    if (!PyArg_ParseTuple(args, "w*w*w*y*nnK", &segment, &free_bits, &deleted_bits, &keys,
                          &versions_offset, &slots_offset, &num_groups))
        return NULL;
    PyObject *result = NULL;
    if (writer_args_ok(&segment, &free_bits, &deleted_bits, &keys, versions_offset, slots_offset,
                       num_groups)) {
        Py_ssize_t num_removed = 0;
        const Py_ssize_t num_keys = keys.len / KEY_BYTES;
        PyThreadState *saved = num_keys >= GIL_FREE_KEYS ? PyEval_SaveThread() : NULL;
        remove_keys(segment.buf, free_bits.buf, deleted_bits.buf, versions_offset, slots_offset,
                    num_groups, keys.buf, num_keys, &num_removed);
        if (saved != NULL)
            PyEval_RestoreThread(saved);
        result = PyLong_FromSsize_t(num_removed);
    }
    release_writer_args(&segment, &free_bits, &deleted_bits, &keys);
    return result;
}

static PyObject *find(PyObject *module, PyObject *args) {
    Py_buffer segment, keys;
    Py_ssize_t versions_offset, slots_offset;
    unsigned long long num_groups;
    if (!PyArg_ParseTuple(args, "y*y*nnK", &segment, &keys, &versions_offset, &slots_offset,
                          &num_groups))
        return NULL;
    PyObject *result = NULL;
    if (layout_ok(&segment, versions_offset, slots_offset, num_groups) && keys_ok(&keys)) {
        const Py_ssize_t num_keys = keys.len / KEY_BYTES;
        const unsigned char *table = (const unsigned char *)segment.buf + slots_offset;
        result = PyList_New(num_keys);
        for (Py_ssize_t i = 0; result && i < num_keys; i++) {
            const unsigned char *key = (const unsigned char *)keys.buf + i * KEY_BYTES;
            const long long slot = is_reserved(key) ? -1 : find_slot(table, num_groups, key);
            PyObject *item = PyLong_FromLongLong(slot);
            if (!item)
                Py_CLEAR(result);
            else
                PyList_SET_ITEM(result, i, item);
        }
    }
    PyBuffer_Release(&segment);
    PyBuffer_Release(&keys);
    return result;
}

static PyMethodDef methods[] = {
    {"insert", insert, METH_VARARGS,
     "insert(segment, free, deleted, keys, versions_offset, slots_offset, num_groups,\n"
     "       skip_published) -> (num_placed, num_refused, num_undeleted)\n\n"
     "Publish keys (16 bytes each, joined) as IndexWriter.insert does one by one, in one\n"
     "write_seq window; reserved patterns, and with skip_published the keys published already,\n"
     "are passed over: how many were placed and refused, and how many tombstones were reused.\n"
     "`free` and `deleted` are the writer's per-group bitmasks, updated."},
    {"remove", remove_, METH_VARARGS,
     "remove(segment, free, deleted, keys, versions_offset, slots_offset, num_groups) -> int\n\n"
     "Unpublish keys (16 bytes each, joined) as IndexWriter.remove does one by one, in one\n"
     "write_seq window: how many were published. `free` and `deleted` are updated."},
    {"find", find, METH_VARARGS,
     "find(segment, keys, versions_offset, slots_offset, num_groups) -> list[int]\n\n"
     "The slot of each key (16 bytes each, joined) in the writer's segment, -1 where absent."},
    {"longest_prefix", longest_prefix, METH_VARARGS,
     "longest_prefix(segment, keys, slots_offset, num_groups) -> int\n\n"
     "How many leading keys (16 bytes each, joined) of an index segment's layout are published,\n"
     "as of one untorn read; -1 when a write tore it or the first missing key may have spilled\n"
     "past its full home groups (kvtier.key_index answers those)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier._index_native",
    "The lookup plane's index reads and inserts (see kvtier.key_index).", -1, methods,
};

PyMODINIT_FUNC PyInit__index_native(void) { return PyModule_Create(&module); }
