/*
 * tba._requests: host transfers into engine requests, in C (``add_requests`` of tba/runtime/_host_requests.py).
 *
 * Each batch of host writes a deferred save queues becomes engine requests on the control thread, whose
 * Python the forward waits for (docs/host-cost.md, twenty-fifth pass): the Python loop that joins
 * adjacent extents ran about 20 lines per storage. This is the same loop, decision for decision (Note
 * [Adjacent storages, one request] in tba/runtime/_host_requests.py): consecutive transfers of one file
 * whose extents touch, in either order, go as one request of at most ``max_pieces`` pieces and
 * ``join_bytes`` bytes, sorted into file order, its callback ``functools.partial(_group_done, group,
 * retry)``; without ``retry`` every transfer goes alone; one larger than ``block_size_bytes`` goes to the
 * Python ``_add_large``. The requests are the same ``Request`` tuples, built as ``tuple.__new__`` builds a
 * named tuple (the type's ``tp_alloc``, then the items).
 *
 * Note: [File offsets, not wrapped sums]
 * The Python loop adds offsets and extents as Python integers, exactly; here they are ``long long``, where a
 * sum past ``LLONG_MAX`` is undefined and, as built, wraps: two transfers at the top of the range and at
 * ``-2**63`` then touched, and were joined into one request of a negative size, where the Python loop sent
 * each alone. So a transfer with a negative offset or extent, or one that ends past ``LLONG_MAX`` (no file
 * offset, ``off_t``, reaches it), is refused with a ``ValueError``; within that range every sum below fits
 * but the group's bytes plus the next extent (each up to ``block_size_bytes``), which is checked for overflow.
 *
 * ``configure`` takes the Python types and functions it builds with, and checks the fields of ``Request``
 * and ``Transfer`` against the indices used here, so that a change to either is refused, not misread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

enum { T_OP, T_FD, T_ADDRESS, T_EXTENT_BYTES, T_OFFSET, T_ON_DONE, T_OWNER, TRANSFER_FIELDS };
enum { R_OP, R_FD, R_ADDRESS, R_NBYTES, R_OFFSET, R_OWNER, R_PIECES, REQUEST_FIELDS };

static const char *const transfer_fields[TRANSFER_FIELDS] = {
    "op", "fd", "address", "extent_bytes", "offset", "on_done", "owner"};
static const char *const request_fields[REQUEST_FIELDS] = {
    "op", "fd", "address", "nbytes", "offset", "owner", "pieces"};

static PyTypeObject *request_type;
static PyObject *partial;
static PyObject *group_done;
static PyObject *add_large;

/* A new Request holding new references to ``items`` (all made beforehand: nothing allocates while it is half filled). */
static int append_request(PyObject *requests, PyObject *const items[REQUEST_FIELDS])
{
    PyObject *request = request_type->tp_alloc(request_type, REQUEST_FIELDS);
    if (request == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < REQUEST_FIELDS; i++)
        PyTuple_SET_ITEM(request, i, Py_NewRef(items[i]));
    int failed = PyList_Append(requests, request);
    Py_DECREF(request);
    return failed;
}

static int append_alone(PyObject *requests, PyObject *callbacks, PyObject *transfer)
{
    PyObject *const *t = &PyTuple_GET_ITEM(transfer, 0);
    PyObject *items[REQUEST_FIELDS] = {t[T_OP], t[T_FD], t[T_ADDRESS], t[T_EXTENT_BYTES], t[T_OFFSET], t[T_OWNER], Py_None};
    if (append_request(requests, items) < 0)
        return -1;
    return PyList_Append(callbacks, t[T_ON_DONE]);
}

typedef struct {
    long long offset;
    Py_ssize_t index;
} Key;

static int by_offset(const void *a, const void *b)
{
    const Key *x = a, *y = b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    return x->index < y->index ? -1 : (x->index > y->index);  /* stable, as list.sort */
}

/* Note: [One conversion at a time]
 * ``PyLong_AsLongLong`` calls a non-int's ``__index__``, which may be Python: called while the last conversion's
 * error is still set, that Python ran with an exception pending, and CPython turned its result into a SystemError
 * ("returned a result with an exception set") in place of the TypeError the Python loop raises (an assertion in a
 * debug build). So each conversion is checked before the next is made. */
static long long as_bytes(PyObject *transfer, int field)
{
    return PyLong_AsLongLong(PyTuple_GET_ITEM(transfer, field));
}

/* ``group`` (a list of transfers, already checked) as one request, or one per transfer. */
static int add_group(PyObject *requests, PyObject *callbacks, PyObject *group, PyObject *retry)
{
    Py_ssize_t n = PyList_GET_SIZE(group);
    if (n == 1 || retry == Py_None) {
        for (Py_ssize_t i = 0; i < n; i++)
            if (append_alone(requests, callbacks, PyList_GET_ITEM(group, i)) < 0)
                return -1;
        return 0;
    }
    int failed = -1;
    PyObject *sorted = NULL, *owners = NULL, *pieces = NULL, *total = NULL, *callback = NULL;
    Key *keys = PyMem_Malloc(n * sizeof(Key));
    if (keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    long long total_bytes = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long extent;
        keys[i].index = i;
        if (((keys[i].offset = as_bytes(PyList_GET_ITEM(group, i), T_OFFSET)) == -1 && PyErr_Occurred())
            || ((extent = as_bytes(PyList_GET_ITEM(group, i), T_EXTENT_BYTES)) == -1 && PyErr_Occurred()))
            goto done;
        total_bytes += extent;
    }
    qsort(keys, n, sizeof(Key), by_offset);
    if ((sorted = PyList_New(n)) == NULL || (owners = PyTuple_New(n)) == NULL || (pieces = PyTuple_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *transfer = PyList_GET_ITEM(group, keys[i].index);
        PyList_SET_ITEM(sorted, i, Py_NewRef(transfer));
        PyTuple_SET_ITEM(owners, i, Py_NewRef(PyTuple_GET_ITEM(transfer, T_OWNER)));
        PyObject *piece = PyTuple_Pack(2, PyTuple_GET_ITEM(transfer, T_ADDRESS), PyTuple_GET_ITEM(transfer, T_EXTENT_BYTES));
        if (piece == NULL)
            goto done;
        PyTuple_SET_ITEM(pieces, i, piece);
    }
    if (PyList_SetSlice(group, 0, n, sorted) < 0)  /* in place, as group.sort(): the callback holds this list */
        goto done;
    if ((total = PyLong_FromLongLong(total_bytes)) == NULL)
        goto done;
    if ((callback = PyObject_CallFunctionObjArgs(partial, group_done, group, retry, NULL)) == NULL)
        goto done;
    PyObject *const *first = &PyTuple_GET_ITEM(PyList_GET_ITEM(group, 0), 0);
    PyObject *items[REQUEST_FIELDS] = {first[T_OP], first[T_FD], first[T_ADDRESS], total, first[T_OFFSET], owners, pieces};
    if (append_request(requests, items) < 0 || PyList_Append(callbacks, callback) < 0)
        goto done;
    failed = 0;
done:
    PyMem_Free(keys);
    Py_XDECREF(sorted);
    Py_XDECREF(owners);
    Py_XDECREF(pieces);
    Py_XDECREF(total);
    Py_XDECREF(callback);
    return failed;
}

static PyObject *add_requests(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (request_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "tba._requests.add_requests is used before configure()");
        return NULL;
    }
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "add_requests(requests, callbacks, transfers, block_size_bytes, retry, "
                                         "max_pieces, join_bytes) takes 7 arguments");
        return NULL;
    }
    PyObject *requests = args[0], *callbacks = args[1], *retry = args[4], *block_object = args[3];
    if (!PyList_Check(requests) || !PyList_Check(callbacks)) {
        PyErr_SetString(PyExc_TypeError, "add_requests: requests and callbacks must be lists");
        return NULL;
    }
    /* Each conversion checked before the next (Note [One conversion at a time]). */
    long long block_bytes, max_pieces, join_bytes;
    if (((block_bytes = PyLong_AsLongLong(block_object)) == -1 && PyErr_Occurred())
        || ((max_pieces = PyLong_AsLongLong(args[5])) == -1 && PyErr_Occurred())
        || ((join_bytes = PyLong_AsLongLong(args[6])) == -1 && PyErr_Occurred()))
        return NULL;
    /* A tuple of its own: Python called from here (_add_large, a finalizer at an allocation) cannot change it. */
    PyObject *transfers = PySequence_Tuple(args[2]);
    if (transfers == NULL)
        return NULL;
    PyObject *group = PyList_New(0);
    if (group == NULL) {
        Py_DECREF(transfers);
        return NULL;
    }
    long long low = 0, high = 0, group_bytes = 0, group_fd = 0;
    Py_ssize_t count = PyTuple_GET_SIZE(transfers);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *transfer = PyTuple_GET_ITEM(transfers, i);
        if (!PyTuple_Check(transfer) || PyTuple_GET_SIZE(transfer) != TRANSFER_FIELDS) {
            PyErr_Format(PyExc_TypeError, "add_requests: a transfer must be a Transfer, not %R", transfer);
            goto failed;
        }
        long long extent, offset, fd;
        if (((extent = as_bytes(transfer, T_EXTENT_BYTES)) == -1 && PyErr_Occurred())
            || ((offset = as_bytes(transfer, T_OFFSET)) == -1 && PyErr_Occurred())
            || ((fd = as_bytes(transfer, T_FD)) == -1 && PyErr_Occurred()))
            goto failed;
        if (extent < 0 || offset < 0 || offset > LLONG_MAX - extent) {
            /* The Python loop's sums are exact; past a file offset's range they would wrap here (Note [File
             * offsets, not wrapped sums]). */
            PyErr_Format(PyExc_ValueError, "add_requests: a transfer of %lld bytes at offset %lld is outside a file",
                         extent, offset);
            goto failed;
        }
        if (extent > block_bytes) {
            PyObject *result = PyObject_CallFunctionObjArgs(add_large, requests, callbacks, transfer, block_object, NULL);
            if (result == NULL)
                goto failed;
            Py_DECREF(result);
            continue;
        }
        Py_ssize_t length = PyList_GET_SIZE(group);
        long long joined_bytes;
        int too_many_bytes = __builtin_add_overflow(group_bytes, extent, &joined_bytes) || joined_bytes > join_bytes;
        if (length > 0 && (retry == Py_None || fd != group_fd || length >= max_pieces || too_many_bytes
                           || (offset != high && offset + extent != low))) {
            if (add_group(requests, callbacks, group, retry) < 0)
                goto failed;
            Py_SETREF(group, PyList_New(0));
            if (group == NULL)
                goto failed;
            length = 0;
        }
        if (length == 0) {
            low = high = offset;
            group_bytes = 0;
            group_fd = fd;
        }
        if (PyList_Append(group, transfer) < 0)
            goto failed;
        group_bytes += extent;
        if (offset == high)
            high += extent;
        else
            low = offset;
    }
    if (PyList_GET_SIZE(group) > 0 && add_group(requests, callbacks, group, retry) < 0)
        goto failed;
    Py_DECREF(group);
    Py_DECREF(transfers);
    Py_RETURN_NONE;
failed:
    Py_XDECREF(group);
    Py_DECREF(transfers);
    return NULL;
}

static int check_fields(PyObject *type, const char *const *fields, Py_ssize_t count)
{
    PyObject *names = PyObject_GetAttrString(type, "_fields");
    if (names == NULL)
        return -1;
    int same = PyTuple_Check(names) && PyTuple_GET_SIZE(names) == count;
    for (Py_ssize_t i = 0; same && i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        same = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, fields[i]) == 0;
    }
    if (!same)
        PyErr_Format(PyExc_RuntimeError, "tba._requests does not know %R's fields %R: rebuild the extension", type, names);
    Py_DECREF(names);
    return same ? 0 : -1;
}

static PyObject *configure(PyObject *module, PyObject *args)
{
    PyObject *request, *transfer, *partial_type, *done, *large;
    if (!PyArg_ParseTuple(args, "O!O!OOO:configure", &PyType_Type, &request, &PyType_Type, &transfer, &partial_type,
                          &done, &large))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)request, &PyTuple_Type) || !PyType_IsSubtype((PyTypeObject *)transfer, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "configure: Request and Transfer must be named tuples");
        return NULL;
    }
    if (check_fields(request, request_fields, REQUEST_FIELDS) < 0 || check_fields(transfer, transfer_fields, TRANSFER_FIELDS) < 0)
        return NULL;
    Py_XSETREF(request_type, (PyTypeObject *)Py_NewRef(request));
    Py_XSETREF(partial, Py_NewRef(partial_type));
    Py_XSETREF(group_done, Py_NewRef(done));
    Py_XSETREF(add_large, Py_NewRef(large));
    Py_RETURN_NONE;
}

static PyMethodDef requests_methods[] = {
    {"add_requests", (PyCFunction)(void (*)(void))add_requests, METH_FASTCALL,
     "add_requests(requests, callbacks, transfers, block_size_bytes, retry, max_pieces, join_bytes)\n--\n\n"
     "tba/runtime/_host_requests.py's add_requests, in C (see native/tba_requests.c)."},
    {"configure", configure, METH_VARARGS,
     "configure(Request, Transfer, partial, group_done, add_large)\n--\n\n"
     "The types and functions add_requests builds with; their fields are checked."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef requests_module = {
    PyModuleDef_HEAD_INIT,
    "tba._requests",
    "Host transfers into engine requests, in C (see native/tba_requests.c).",
    -1,
    requests_methods,
};

PyMODINIT_FUNC PyInit__requests(void)
{
    return PyModule_Create(&requests_module);
}
