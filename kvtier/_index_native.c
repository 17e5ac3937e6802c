/* The lookup plane's read fast path in C: `kvtier.key_index.IndexReader.longest_prefix` without
 * numpy's per-call overhead (a dozen numpy calls made a 16-key lookup 8-9 us; this is under 1).
 *
 * It answers what the numpy fast path answers, from the same segment layout (see key_index.py):
 * each key's two home groups read in one pass, under the segment's write_seq read before and
 * after. Anything else (a write under way or in between, a first missing key whose home groups
 * are both full and so may have spilled) it leaves to the numpy path, which answers those.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 16
#define GROUP_SLOTS 8
#define GROUP_BYTES (KEY_BYTES * GROUP_SLOTS)
#define WRITE_SEQ_WORD 3 /* header word: odd while a write is under way */

/* The home mix of key_index.HOME_MIX: (w0, w1) -> (w0*A + w1*B, w0*C + w1*D) mod 2^64. */
static const uint64_t MIX_A = 0x9E3779B97F4A7C15ULL, MIX_B = 0x85EBCA77C2B2AE62ULL,
                      MIX_C = 0x165667B19E3779F9ULL, MIX_D = 0xC2B2AE3D27D4EB4FULL;

/* Whether `group` (GROUP_SLOTS keys) holds `key`; *has_empty: whether a slot is all zero. */
static int group_holds(const unsigned char *group, const unsigned char *key, int *has_empty) {
    static const unsigned char empty[KEY_BYTES];
    int found = 0;
    for (int slot = 0; slot < GROUP_SLOTS; slot++) {
        const unsigned char *at = group + slot * KEY_BYTES;
        if (memcmp(at, key, KEY_BYTES) == 0)
            found = 1;
        else if (memcmp(at, empty, KEY_BYTES) == 0)
            *has_empty = 1;
    }
    return found;
}

/* The prefix the fast path knows, or -1: a write tore the read, or the first missing key may
 * have spilled past its full home groups (ask the numpy path). */
static Py_ssize_t fast_prefix(const unsigned char *segment, Py_ssize_t slots_offset,
                              uint64_t num_groups, uint64_t divisor, const unsigned char *keys,
                              Py_ssize_t num_keys) {
    const uint64_t *write_seq = (const uint64_t *)segment + WRITE_SEQ_WORD;
    const uint64_t seq = __atomic_load_n(write_seq, __ATOMIC_ACQUIRE);
    if (seq & 1)
        return -1;
    const unsigned char *slots = segment + slots_offset;
    const uint64_t half = num_groups / 2;
    Py_ssize_t answer = num_keys;
    for (Py_ssize_t i = 0; i < num_keys; i++) {
        const unsigned char *key = keys + i * KEY_BYTES;
        uint64_t w0, w1;
        memcpy(&w0, key, 8);
        memcpy(&w1, key + 8, 8);
        const uint64_t first = (w0 * MIX_A + w1 * MIX_B) / divisor;
        const uint64_t second = half + (w0 * MIX_C + w1 * MIX_D) / divisor;
        if (first >= num_groups || second >= num_groups)
            return -1; /* not this layout's divisor: the numpy path says what is wrong */
        int has_empty = 0;
        if (group_holds(slots + first * GROUP_BYTES, key, &has_empty)
            || group_holds(slots + second * GROUP_BYTES, key, &has_empty))
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
    unsigned long long num_groups, divisor;
    if (!PyArg_ParseTuple(args, "y*y*nKK", &segment, &keys, &slots_offset, &num_groups,
                          &divisor))
        return NULL;
    Py_ssize_t answer = -1;
    const char *problem = NULL;
    if (keys.len % KEY_BYTES)
        problem = "keys must be 16 bytes each";
    else if (num_groups < 4 || num_groups % 2 || divisor == 0 || slots_offset < 64
             || slots_offset > segment.len
             || (uint64_t)(segment.len - slots_offset) / GROUP_BYTES < num_groups)
        problem = "the segment is smaller than its layout";
    else if ((uintptr_t)segment.buf % 8 == 0) /* else its header words are not atomic: numpy */
        answer = fast_prefix(segment.buf, slots_offset, num_groups, divisor, keys.buf,
                             keys.len / KEY_BYTES); /* with the GIL: a lookup is a microsecond */
    PyBuffer_Release(&segment);
    PyBuffer_Release(&keys);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    return PyLong_FromSsize_t(answer);
}

static PyMethodDef methods[] = {
    {"longest_prefix", longest_prefix, METH_VARARGS,
     "longest_prefix(segment, keys, slots_offset, num_groups, divisor) -> int\n\n"
     "How many leading keys (16 bytes each, joined) of an index segment's layout are published,\n"
     "as of one untorn read; -1 when a write tore it or the first missing key may have spilled\n"
     "past its full home groups (kvtier.key_index answers those)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier._index_native",
    "The lookup plane's read fast path (see kvtier.key_index).", -1, methods,
};

PyMODINIT_FUNC PyInit__index_native(void) { return PyModule_Create(&module); }
