/*
 * tba._record: the store's per-storage record (``tba.runtime._entry.StorageEntry``) as a C type.
 *
 * The Python record is a dataclass: its generated ``__init__`` runs 25 lines per saved storage on the
 * control thread, and the forward waits for that thread's Python (docs/host-cost.md, twenty-fourth and
 * twenty-fifth passes). This type has the same fields, in the same order, with the same defaults; one
 * call builds it in C (vectorcall: keyword arguments matched against interned names, no dict made).
 * Each field is a plain object slot, read and written from Python as fast as a ``__slots__`` attribute;
 * ``cdata`` is read-only. Setting any other name raises AttributeError (the dataclass would take it,
 * and nothing would read it).
 *
 * The field names come from this file; their defaults, the functions that test and free the storage's
 * weak reference and the alignment come from ``tba/runtime/_entry.py`` through :func:`configure`,
 * which also checks that the Python record's fields are these, in this order (Note [One record, two
 * builds] in tba/runtime/_entry.py).
 *
 * The record owns its storage's weak reference (``cdata``): the deallocator frees it, as the Python
 * record's ``__del__`` does, keeping any exception being raised around it. The record can sit in a
 * reference cycle (an ``io_error`` whose traceback holds a frame that holds the record), so it stays
 * with the cycle collector, as the dataclass instance does: ``tp_traverse`` visits every field and
 * ``tp_clear`` drops every field but ``cdata``, which only the deallocator frees.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>

enum {
    F_SEQ, F_LAYER, F_NBYTES, F_PHASE_BYTES, F_VERSION, F_CDATA, F_DATA,
    F_ROOT, F_STATE, F_OFFSET, F_LIVE_VIEWS, F_UNPACKED_VIEWS, F_HOLD_FOR_BACKWARD, F_FULLY_UNPACKED,
    F_TRANSFER_IN_FLIGHT, F_IO_ERROR, F_READ_DONE, F_DEVICE, F_ROUTE, F_READY_EVENT, F_CHECKSUM,
    F_WINDOW_GEN, F_ADDRESS, F_PAGES_DISCARDED, F_OWN_MEMORY,
    N_FIELDS,
};

#define N_REQUIRED (F_DATA + 1)

static const char *const field_names[N_FIELDS] = {
    "seq", "layer", "nbytes", "phase_bytes", "version", "cdata", "data",
    "root", "state", "offset", "live_views", "unpacked_views", "hold_for_backward", "fully_unpacked",
    "transfer_in_flight", "io_error", "read_done", "device", "route", "ready_event", "checksum",
    "window_gen", "address", "pages_discarded", "own_memory",
};

typedef struct {
    PyObject_HEAD
    PyObject *fields[N_FIELDS];
} Entry;

/* Set by configure(): interned field names, the defaults of fields N_REQUIRED.., and the helpers. */
static PyObject *names[N_FIELDS];
static PyObject *defaults[N_FIELDS];
static PyObject *free_weak_ref;
static PyObject *expired_fn;
static long long align_bytes;

static PyTypeObject EntryType;

static Py_ssize_t field_index(PyObject *name)
{
    for (Py_ssize_t i = 0; i < N_FIELDS; i++)
        if (names[i] == name)
            return i;
    for (Py_ssize_t i = 0; i < N_FIELDS; i++)
        if (PyUnicode_Compare(names[i], name) == 0)
            return i;
    if (PyErr_Occurred())
        return -2;
    return -1;
}

static PyObject *entry_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *values[N_FIELDS] = {NULL};

    if (free_weak_ref == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tba._record.StorageEntry is used before configure()");
        return NULL;
    }
    if (nargs > N_FIELDS) {
        PyErr_Format(PyExc_TypeError, "StorageEntry() takes at most %d arguments (%zd given)", N_FIELDS, nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        values[i] = args[i];
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        Py_ssize_t i = field_index(name);
        if (i == -2)
            return NULL;
        if (i < 0) {
            PyErr_Format(PyExc_TypeError, "StorageEntry() got an unexpected keyword argument '%U'", name);
            return NULL;
        }
        if (values[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "StorageEntry() got multiple values for argument '%U'", name);
            return NULL;
        }
        values[i] = args[nargs + k];
    }
    for (Py_ssize_t i = 0; i < N_FIELDS; i++) {
        if (values[i] != NULL)
            continue;
        if (i < N_REQUIRED) {
            PyErr_Format(PyExc_TypeError, "StorageEntry() missing required argument '%s'", field_names[i]);
            return NULL;
        }
        values[i] = defaults[i];
    }
    /* Nothing raises from here on: the record owns cdata as soon as it exists. */
    Entry *self = PyObject_GC_New(Entry, (PyTypeObject *)type);
    if (self == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < N_FIELDS; i++)
        self->fields[i] = Py_NewRef(values[i]);
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static int entry_traverse(Entry *self, visitproc visit, void *arg)
{
    for (Py_ssize_t i = 0; i < N_FIELDS; i++)
        Py_VISIT(self->fields[i]);
    return 0;
}

static int entry_clear(Entry *self)
{
    for (Py_ssize_t i = 0; i < N_FIELDS; i++)
        if (i != F_CDATA)
            Py_CLEAR(self->fields[i]);
    return 0;
}

/* Note: [A chain of records is freed without recursion]
 * A record's field may hold another record (through any object), and freeing the first then frees the next from
 * inside its deallocator: a chain of a few hundred thousand overflowed the C stack (a segmentation fault) where the
 * dataclass, whose instances CPython frees through its trashcan, freed it whole. The deallocator goes through the
 * trashcan too: past a depth, a record is set aside and freed once the stack has unwound. */
static void entry_dealloc(Entry *self)
{
    PyObject_GC_UnTrack(self);
    Py_TRASHCAN_BEGIN(self, entry_dealloc)
    PyObject *cdata = self->fields[F_CDATA];
    if (cdata != NULL) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *result = PyObject_CallOneArg(free_weak_ref, cdata);
        if (result == NULL)
            PyErr_WriteUnraisable(free_weak_ref);
        Py_XDECREF(result);
        PyErr_Restore(type, value, traceback);
    }
    for (Py_ssize_t i = 0; i < N_FIELDS; i++)
        Py_CLEAR(self->fields[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
    Py_TRASHCAN_END
}

static PyObject *entry_expired(Entry *self, PyObject *unused)
{
    return PyObject_CallOneArg(expired_fn, self->fields[F_CDATA]);
}

static PyObject *cannot_copy(PyObject *self, PyObject *unused)
{
    PyErr_SetString(PyExc_TypeError, "a StorageEntry owns its storage's weak reference and cannot be copied");
    return NULL;
}

/* A new reference to field ``i``, or NULL with AttributeError where it was deleted.
 *
 * Note: [A field read holds its value]
 * Converting one field (``__index__``, ``__str__``, ``__repr__``) can run Python that sets another field of the
 * record, whose old value the record alone may hold: read through a borrowed reference, that value was freed and
 * then read (a segmentation fault). So each field a method reads is a new reference, held until it returns. */
static PyObject *field(Entry *self, int i)
{
    PyObject *value = self->fields[i];
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "'StorageEntry' object has no attribute '%s'", field_names[i]);
    return Py_XNewRef(value);
}

static PyObject *entry_describe(Entry *self, PyObject *unused)
{
    PyObject *seq = field(self, F_SEQ), *nbytes = field(self, F_NBYTES), *layer = field(self, F_LAYER), *described = NULL;
    if (seq != NULL && nbytes != NULL && layer != NULL) {
        if (layer == Py_None)
            described = PyUnicode_FromFormat("storage #%S (%S bytes, no layer)", seq, nbytes);
        else
            described = PyUnicode_FromFormat("storage #%S (%S bytes, layer %S)", seq, nbytes, layer);
    }
    Py_XDECREF(seq);
    Py_XDECREF(nbytes);
    Py_XDECREF(layer);
    return described;
}

static PyObject *entry_repr(Entry *self)
{
    PyObject *described = entry_describe(self, NULL);
    if (described == NULL)
        return NULL;
    PyObject *state = Py_NewRef(self->fields[F_STATE] ? self->fields[F_STATE] : Py_None);
    PyObject *repr = PyUnicode_FromFormat("<StorageEntry %U, %R>", described, state);
    Py_DECREF(state);
    Py_DECREF(described);
    return repr;
}

/* ``value`` as a long long, its reference (a field's, Note [A field read holds its value]) given up. */
static long long as_long_long(PyObject *value)
{
    long long result = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return result;
}

static PyObject *entry_extent_bytes(Entry *self, void *closure)
{
    PyObject *phase = field(self, F_PHASE_BYTES), *nbytes = field(self, F_NBYTES);
    if (phase == NULL || nbytes == NULL) {
        Py_XDECREF(phase);
        Py_XDECREF(nbytes);
        return NULL;
    }
    long long phase_value = as_long_long(phase);
    if (phase_value == -1 && PyErr_Occurred()) {
        Py_DECREF(nbytes);
        return NULL;
    }
    long long nbytes_value = as_long_long(nbytes);
    if (nbytes_value == -1 && PyErr_Occurred())
        return NULL;
    long long total = phase_value + nbytes_value;
    if (phase_value < 0 || nbytes_value < 0 || total < 0 || total > LLONG_MAX - align_bytes) {
        PyErr_Format(PyExc_ValueError, "StorageEntry: extent of phase_bytes=%lld, nbytes=%lld", phase_value, nbytes_value);
        return NULL;
    }
    return PyLong_FromLongLong((total + align_bytes - 1) / align_bytes * align_bytes);
}

static PyMethodDef entry_methods[] = {
    {"expired", (PyCFunction)entry_expired, METH_NOARGS, "Whether the storage itself is gone."},
    {"describe", (PyCFunction)entry_describe, METH_NOARGS, "The storage, its size and its layer, in words."},
    {"__copy__", (PyCFunction)cannot_copy, METH_NOARGS, NULL},
    {"__deepcopy__", (PyCFunction)cannot_copy, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef entry_getset[] = {
    {"extent_bytes", (getter)entry_extent_bytes, NULL,
     "Bytes of file space the entry occupies: the storage plus its phase, block aligned.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef entry_members[N_FIELDS + 1];

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tba._record.StorageEntry",
    .tp_doc = "Book-keeping of one offloaded storage (see tba/runtime/_entry.py and native/tba_record.c).",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_repr = (reprfunc)entry_repr,
    .tp_methods = entry_methods,
    .tp_getset = entry_getset,
    .tp_members = entry_members,
    .tp_vectorcall = entry_vectorcall,
};

static PyObject *configure(PyObject *module, PyObject *args)
{
    PyObject *given_names, *given_defaults, *free_fn, *expired;
    long long align;
    if (!PyArg_ParseTuple(args, "O!O!OOL:configure", &PyTuple_Type, &given_names, &PyDict_Type, &given_defaults,
                          &free_fn, &expired, &align))
        return NULL;
    if (PyTuple_GET_SIZE(given_names) != N_FIELDS) {
        PyErr_Format(PyExc_RuntimeError, "tba._record has %d fields, the Python record %zd: rebuild the extension",
                     N_FIELDS, PyTuple_GET_SIZE(given_names));
        return NULL;
    }
    PyObject *values[N_FIELDS];
    for (Py_ssize_t i = 0; i < N_FIELDS; i++) {
        PyObject *name = PyTuple_GET_ITEM(given_names, i);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, field_names[i]) != 0) {
            PyErr_Format(PyExc_RuntimeError, "tba._record's field %zd is %s, the Python record's %R: rebuild the extension",
                         i, field_names[i], name);
            return NULL;
        }
        values[i] = PyDict_GetItemWithError(given_defaults, name);
        if (values[i] == NULL && PyErr_Occurred())
            return NULL;
        if ((values[i] != NULL) != (i >= N_REQUIRED)) {
            PyErr_Format(PyExc_RuntimeError, "tba._record: field %s %s a default in the Python record", field_names[i],
                         values[i] == NULL ? "lacks" : "has");
            return NULL;
        }
    }
    if (align <= 0) {
        PyErr_SetString(PyExc_ValueError, "configure: the alignment must be positive");
        return NULL;
    }
    /* Checked in full before anything changes: a refused configure leaves the last one in force. */
    for (Py_ssize_t i = 0; i < N_FIELDS; i++)
        Py_XSETREF(defaults[i], Py_XNewRef(values[i]));
    align_bytes = align;
    Py_XSETREF(expired_fn, Py_NewRef(expired));
    Py_XSETREF(free_weak_ref, Py_NewRef(free_fn));
    Py_RETURN_NONE;
}

static PyMethodDef record_methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(names, defaults, free_weak_ref, expired, align_bytes)\n--\n\n"
     "Check the Python record's field names, take its defaults and the weak reference's helpers."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef record_module = {
    PyModuleDef_HEAD_INIT,
    "tba._record",
    "The store's per-storage record as a C type (see native/tba_record.c).",
    -1,
    record_methods,
};

PyMODINIT_FUNC PyInit__record(void)
{
    for (Py_ssize_t i = 0; i < N_FIELDS; i++) {
        entry_members[i] = (PyMemberDef){(char *)field_names[i], T_OBJECT_EX, offsetof(Entry, fields) + i * sizeof(PyObject *),
                                         i == F_CDATA ? READONLY : 0, NULL};
        names[i] = PyUnicode_InternFromString(field_names[i]);
        if (names[i] == NULL)
            return NULL;
    }
    if (PyType_Ready(&EntryType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&record_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "StorageEntry", (PyObject *)&EntryType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
