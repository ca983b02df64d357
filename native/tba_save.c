/*
 * tba._save: the host storage's fresh save, in C (``StoreWrites._start_write`` of tba/runtime/_writes.py).
 *
 * A storage seen for the first time gets its record, its place in the store's books, its extent in the spill
 * file and its write queued, once per saved storage on the control thread, whose Python the forward waits for
 * (docs/host-cost.md, thirty-second pass). ``start_host_write`` does what the Python path does for a CPU
 * storage of less than DISCARD_MIN_BYTES on the host route with no NVTX range to mark, in the same order (Note [A host
 * save in C] in tba/runtime/_writes.py): the same calls on the same objects (the record's type, the window's
 * ``add``, the store's ``_resident``, the spill file's ``allocate``, the write clock's ``start``, the host
 * batch's ``write``), so that what any of them does, raises or is replaced by in a test stays what the store
 * sees; the record's type comes with each call (a test may replace it). It counts the steps that took effect as
 * the Python does, and an error after the first goes to the store's ``_write_not_queued`` with that count, which
 * keeps the record in memory (returned, as a saved one) or undoes every step (the error goes up): Note [A save
 * that fails after its entry is registered] in tba/runtime/_store_lifetime.py. An error before it goes up.
 *
 * ``configure`` takes the Python objects it calls and the record's keyword names, and refuses an ``abi``
 * other than this file's (a build older than the Python that calls it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define TBA_SAVE_ABI 2

/* The steps counted as they take effect, as tba/runtime/_store_lifetime.py numbers them (COUNTED, ...). */
enum { NONE_DONE, COUNTED, MAPPED, IN_WINDOW, REGISTERED, WRITING, CLOCKED };

enum { K_SEQ, K_LAYER, K_NBYTES, K_PHASE_BYTES, K_ADDRESS, K_VERSION, K_DATA, K_ROOT, K_DEVICE, K_ROUTE,
       K_OWN_MEMORY, K_CDATA, RECORD_KEYWORDS };

static const char *const record_keywords[RECORD_KEYWORDS] = {
    "seq", "layer", "nbytes", "phase_bytes", "address", "version", "data", "root", "device", "route",
    "own_memory", "cdata"};

static PyObject *keywords;        /* record_keywords, as the tuple of names a vectorcall takes */
static PyObject *byte_tensor;     /* torch.ByteTensor: storage_bytes' CPU branch */
static PyObject *untrack;
static PyObject *partial;
static PyObject *one;

static PyObject *s_routes, *s_host, *s_data_ptr, *s_phase_bytes, *s_next_seq, *s_live_entries,
    *s_by_storage, *s_cdata, *s_window, *s_add, *s_resident, *s_spill, *s_allocate, *s_extent_bytes, *s_offset,
    *s_writing, *s_unwritten_bytes, *s_transfer_in_flight, *s_write_clock, *s_start, *s_host_batch, *s_write,
    *s_fd, *s_on_write_done, *s_write_wanted, *s_weak_ref, *s_write_not_queued;

static PyObject *configure(PyObject *module, PyObject *args)
{
    int abi;
    PyObject *names, *new_byte_tensor, *new_untrack, *new_partial;
    if (!PyArg_ParseTuple(args, "iO!OOO", &abi, &PyTuple_Type, &names, &new_byte_tensor, &new_untrack, &new_partial))
        return NULL;
    if (abi != TBA_SAVE_ABI) {
        PyErr_Format(PyExc_RuntimeError, "tba._save was built for abi %d, the Python asks for %d (a stale build)",
                     TBA_SAVE_ABI, abi);
        return NULL;
    }
    if (PyTuple_GET_SIZE(names) != RECORD_KEYWORDS) {
        PyErr_SetString(PyExc_RuntimeError, "tba._save: the record's keywords differ from this build's (a stale build)");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < RECORD_KEYWORDS; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, record_keywords[i]) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "tba._save: the record's keywords differ from this build's (a stale build)");
            return NULL;
        }
    }
    Py_XSETREF(keywords, Py_NewRef(names));
    Py_XSETREF(byte_tensor, Py_NewRef(new_byte_tensor));
    Py_XSETREF(untrack, Py_NewRef(new_untrack));
    Py_XSETREF(partial, Py_NewRef(new_partial));
    Py_RETURN_NONE;
}

/* ``obj.name += delta``, as Python's augmented assignment does it. */
static int add_to(PyObject *obj, PyObject *name, PyObject *delta)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    PyObject *sum = PyNumber_InPlaceAdd(value, delta);
    Py_DECREF(value);
    if (sum == NULL)
        return -1;
    int failed = PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return failed;
}

/* The error set now goes up, the save's (``type``, ``value``, ``traceback``: references given up) as its context,
 * as ``raise`` inside the Python path's ``except`` block chains it. */
static void raise_over(PyObject *type, PyObject *value, PyObject *traceback)
{
    PyObject *type2, *value2, *traceback2;
    PyErr_Fetch(&type2, &value2, &traceback2);
    PyErr_NormalizeException(&type2, &value2, &traceback2);
    if (value2 != NULL && value2 != value)
        PyException_SetContext(value2, value);  /* steals value */
    else
        Py_XDECREF(value);
    Py_XDECREF(type); Py_XDECREF(traceback);
    PyErr_Restore(type2, value2, traceback2);
}

/* The store's ``_write_not_queued(entry, error, steps)`` for the error set now: the entry (a new reference) when it
 * is kept, else NULL with the error set again (or the undo's own, the first as its context). */
static PyObject *not_queued(PyObject *store, PyObject *entry, int steps)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL)
        PyException_SetTraceback(value, traceback);
    PyObject *count = PyLong_FromLong(steps);
    PyObject *kept = NULL;
    if (count != NULL) {
        PyObject *call_args[4] = {store, entry, value, count};
        kept = PyObject_VectorcallMethod(s_write_not_queued, call_args, 4, NULL);
        Py_DECREF(count);
    }
    if (kept == NULL) {  /* the undo failed: its error goes up, the save's as its context */
        raise_over(type, value, traceback);
        return NULL;
    }
    /* Its truth, as the Python path's ``not`` takes it: an error of its ``__bool__`` goes up as the undo's would. */
    int is_kept = PyObject_IsTrue(kept);
    Py_DECREF(kept);
    if (is_kept < 0) {
        raise_over(type, value, traceback);
        return NULL;
    }
    if (is_kept) {
        Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(traceback);
        return Py_NewRef(entry);
    }
    PyErr_Restore(type, value, traceback);
    return NULL;
}

/* ``method(arg)`` on ``getattr(obj, holder)``, its result dropped. */
static int call_on(PyObject *obj, PyObject *holder, PyObject *method, PyObject *arg)
{
    PyObject *target = PyObject_GetAttr(obj, holder);
    if (target == NULL)
        return -1;
    PyObject *result = arg == NULL ? PyObject_CallMethodNoArgs(target, method) : PyObject_CallMethodOneArg(target, method, arg);
    Py_DECREF(target);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

static PyObject *start_host_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "start_host_write(store, storage, device, layer, version, root, nbytes, record)");
        return NULL;
    }
    if (keywords == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tba._save is not configured");
        return NULL;
    }
    PyObject *store = args[0], *storage = args[1], *device = args[2], *layer = args[3], *version = args[4];
    PyObject *nbytes = args[6], *record = args[7];
    PyObject *routes = NULL, *route = NULL, *data = NULL, *root = NULL, *done = NULL, *address = NULL;
    PyObject *phase = NULL, *seq = NULL, *cdata = NULL, *entry = NULL, *by_storage = NULL, *key = NULL;
    PyObject *spill = NULL, *extent = NULL, *offset = NULL, *host = NULL, *fd = NULL, *on_done = NULL, *wanted = NULL;
    PyObject *bound = NULL, *result = NULL;
    int steps = NONE_DONE;  /* the steps that took effect: Note [A save that fails after its entry is registered] */

    if ((routes = PyObject_GetAttr(store, s_routes)) == NULL || (route = PyObject_GetAttr(routes, s_host)) == NULL)
        goto error;
    if ((data = PyObject_CallOneArg(byte_tensor, storage)) == NULL || (root = PyWeakref_NewRef(args[5], NULL)) == NULL)
        goto error;
    PyObject *untracked[2] = {data, root};
    if ((done = PyObject_Vectorcall(untrack, untracked, 2, NULL)) == NULL)
        goto error;
    if ((address = PyObject_CallMethodNoArgs(storage, s_data_ptr)) == NULL
        || (phase = PyObject_CallMethodOneArg(route, s_phase_bytes, address)) == NULL
        || (seq = PyObject_GetAttr(store, s_next_seq)) == NULL
        || (cdata = PyObject_CallMethodNoArgs(storage, s_weak_ref)) == NULL)
        goto error;
    /* own_memory: False, as the Python path's expression gives it for a storage below DISCARD_MIN_BYTES */
    PyObject *fields[RECORD_KEYWORDS] = {seq, layer, nbytes, phase, address, version, data, root, device, route,
                                         Py_False, cdata};
    if ((entry = PyObject_Vectorcall(record, fields, 0, keywords)) == NULL)
        goto error;
    if (add_to(store, s_next_seq, one) < 0 || add_to(store, s_live_entries, one) < 0)
        goto error;
    steps = COUNTED;
    if ((by_storage = PyObject_GetAttr(store, s_by_storage)) == NULL || (key = PyObject_GetAttr(storage, s_cdata)) == NULL
        || PyObject_SetItem(by_storage, key, entry) < 0)
        goto error;
    steps = MAPPED;
    if (call_on(store, s_window, s_add, entry) < 0)
        goto error;
    steps = IN_WINDOW;
    if ((result = PyObject_CallMethodOneArg(store, s_resident, nbytes)) == NULL)
        goto error;
    Py_CLEAR(result);
    steps = REGISTERED;
    if ((spill = PyObject_GetAttr(store, s_spill)) == NULL || (extent = PyObject_GetAttr(entry, s_extent_bytes)) == NULL
        || (offset = PyObject_CallMethodOneArg(spill, s_allocate, extent)) == NULL
        || PyObject_SetAttr(entry, s_offset, offset) < 0)
        goto error;
    if (add_to(store, s_writing, one) < 0 || add_to(store, s_unwritten_bytes, nbytes) < 0)
        goto error;
    steps = WRITING;
    if (PyObject_SetAttr(entry, s_transfer_in_flight, Py_True) < 0 || call_on(store, s_write_clock, s_start, NULL) < 0)
        goto error;
    steps = CLOCKED;
    if ((host = PyObject_GetAttr(store, s_host_batch)) == NULL || (fd = PyObject_GetAttr(spill, s_fd)) == NULL)
        goto error;
    if ((bound = PyObject_GetAttr(store, s_on_write_done)) == NULL)
        goto error;
    PyObject *done_args[2] = {bound, entry};
    if ((on_done = PyObject_Vectorcall(partial, done_args, 2, NULL)) == NULL)
        goto error;
    Py_CLEAR(bound);
    if ((bound = PyObject_GetAttr(store, s_write_wanted)) == NULL)
        goto error;
    PyObject *wanted_args[2] = {bound, entry};
    if ((wanted = PyObject_Vectorcall(partial, wanted_args, 2, NULL)) == NULL)
        goto error;
    PyObject *write_args[7] = {host, data, phase, fd, offset, on_done, wanted};
    if ((result = PyObject_VectorcallMethod(s_write, write_args, 7, NULL)) == NULL)
        goto error;
    Py_CLEAR(result);
    goto done;
error:
    if (steps == NONE_DONE)
        Py_CLEAR(entry);
    else
        Py_SETREF(entry, not_queued(store, entry, steps));
done:
    Py_XDECREF(routes); Py_XDECREF(route); Py_XDECREF(data); Py_XDECREF(root); Py_XDECREF(done);
    Py_XDECREF(address); Py_XDECREF(phase); Py_XDECREF(seq);
    Py_XDECREF(cdata); Py_XDECREF(by_storage); Py_XDECREF(key); Py_XDECREF(spill); Py_XDECREF(extent);
    Py_XDECREF(offset); Py_XDECREF(host); Py_XDECREF(fd); Py_XDECREF(on_done); Py_XDECREF(wanted); Py_XDECREF(bound);
    return entry;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(abi, keywords, byte_tensor, untrack, partial)"},
    {"start_host_write", (PyCFunction)(void (*)(void))start_host_write, METH_FASTCALL,
     "start_host_write(store, storage, device, layer, version, root, nbytes, record) -> the new record, its write queued"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "tba._save", NULL, -1, methods};

PyMODINIT_FUNC PyInit__save(void)
{
    struct { PyObject **slot; const char *name; } names[] = {
        {&s_routes, "routes"}, {&s_host, "host"}, {&s_data_ptr, "data_ptr"},
        {&s_phase_bytes, "phase_bytes"}, {&s_next_seq, "_next_seq"}, {&s_live_entries, "live_entries"},
        {&s_by_storage, "_by_storage"}, {&s_cdata, "_cdata"}, {&s_window, "window"}, {&s_add, "add"},
        {&s_resident, "_resident"}, {&s_spill, "spill"}, {&s_allocate, "allocate"}, {&s_extent_bytes, "extent_bytes"},
        {&s_offset, "offset"}, {&s_writing, "_writing"}, {&s_unwritten_bytes, "unwritten_bytes"},
        {&s_transfer_in_flight, "transfer_in_flight"}, {&s_write_clock, "write_clock"}, {&s_start, "start"},
        {&s_host_batch, "_host"}, {&s_write, "write"}, {&s_fd, "fd"}, {&s_on_write_done, "_on_write_done"},
        {&s_write_wanted, "_write_wanted"}, {&s_weak_ref, "_weak_ref"},
        {&s_write_not_queued, "_write_not_queued"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].name)) == NULL)
            return NULL;
    if ((one = PyLong_FromLong(1)) == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module != NULL && PyModule_AddIntConstant(module, "ABI", TBA_SAVE_ABI) < 0)
        Py_CLEAR(module);
    return module;
}
