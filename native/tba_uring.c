/*
 * tba._uring: the Python face of uring_ring.c and uring_io.c.
 *
 * ``Ring(depth)`` owns one io_uring instance with ``depth`` request slots. ``submit`` takes a list
 * of ``(is_write, fd, address, nbytes, offset, tag)`` tuples (``address`` an int, or a sequence of
 * ``(address, nbytes)`` pieces that fill the file range one after another) and queues all of them (the reaping
 * thread issues them as slots free up); ``reap`` blocks until at least one request finished (or
 * ``wake`` was called) and returns ``(finished, woke)`` where ``finished`` is a list of
 * ``(tag, result, done_bytes)``: ``result`` is the byte count, an ``OSError`` instance carrying
 * the errno, or ``None`` for a read that met end of file early. Both release the GIL around every
 * syscall. ``reap`` refuses while another thread reaps (the ring has one reaper). ``close`` frees the
 * ring; it refuses while another thread is inside the ring.
 * ``forget_after_fork`` frees it in a forked child, where the threads that were inside it are gone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "uring_ring.h"

typedef struct {
    PyObject_HEAD
    struct tba_ring ring;
    struct tba_done *done_buf; /* reaper's scratch space, one entry per slot */
    int open;
    int users; /* calls currently running with the GIL released (changed only under the GIL) */
    int reaping; /* a thread is inside reap (changed only under the GIL): the ring has one reaper */
} RingObject;

static PyObject *make_oserror(int err)
{
    return PyObject_CallFunction(PyExc_OSError, "is", err, strerror(err));
}

static PyObject *raise_errno(int err)
{
    PyObject *exc = make_oserror(err);
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static int check_open(RingObject *self)
{
    if (self->open)
        return 0;
    PyErr_SetString(PyExc_ValueError, "ring is closed");
    return -1;
}

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"depth", NULL};
    int depth; /* "i" refuses what an int does not hold; "I" took the depth modulo 2**32 */
    int err;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i", kwlist, &depth))
        return -1;
    if (depth < 1) {
        PyErr_Format(PyExc_ValueError, "depth must be at least 1, got %d", depth);
        return -1;
    }
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "ring already initialised");
        return -1;
    }
    err = tba_ring_open(&self->ring, (unsigned)depth);
    if (err) {
        raise_errno(-err);
        return -1;
    }
    self->done_buf = PyMem_RawCalloc((size_t)depth, sizeof(*self->done_buf));
    if (!self->done_buf) {
        tba_ring_close(&self->ring);
        PyErr_NoMemory();
        return -1;
    }
    self->open = 1;
    return 0;
}

static void free_ring(RingObject *self)
{
    if (!self->open)
        return;
    tba_ring_close(&self->ring);
    PyMem_RawFree(self->done_buf);
    self->done_buf = NULL;
    self->open = 0;
}

static void Ring_dealloc(RingObject *self)
{
    free_ring(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ``obj`` (an int, or an object with __index__) as an integer in 0..``max``, into ``*out``; else
 * OverflowError naming ``what``. Format ``K`` took any int modulo 2**64, without a word: a tag of
 * 2**64 + 5 came back as 5 (another request's), nbytes -1 asked the kernel for 2**64 - 1 bytes at
 * the address, and offset -1 is io_uring's "at the file's current position". */
static int as_u64(PyObject *obj, unsigned long long max, const char *what, unsigned long long *out)
{
    PyObject *index = PyNumber_Index(obj);
    if (!index)
        return -1;
    unsigned long long value = PyLong_AsUnsignedLongLong(index); /* OverflowError when negative or too big */
    int fits = !(value == (unsigned long long)-1 && PyErr_Occurred()) && value <= max;
    if (!fits) {
        PyErr_Clear();
        PyErr_Format(PyExc_OverflowError, "%s must be in 0..%llu, got %S", what, max, index);
    }
    Py_DECREF(index);
    if (!fits)
        return -1;
    *out = value;
    return 0;
}

/* Note: [Entries read from a snapshot]
 * Reading an entry can run Python (an ``__index__``), which may change the list it came from: ``submit`` read the
 * list's items by an index counted before, and its entries' fields through borrowed references, so a list cleared
 * under it was read past its end and its freed items read (a segmentation fault). The requests and each request's
 * pieces and each piece's two fields are read from a tuple of their own (the caller's tuple itself, else a copy; not
 * ``PyArg_Parse``'s "(OO)", whose items of a sequence that is no tuple are borrowed from nothing once it returns):
 * ``submit`` takes the entries as they were when it was called. */
static PyObject *snapshot(PyObject *obj, const char *message)
{
    PyObject *fast = PySequence_Fast(obj, message);
    if (fast == NULL || PyTuple_Check(fast))
        return fast;
    PyObject *copy = PyList_AsTuple(fast);
    Py_DECREF(fast);
    return copy;
}

/* A vectored request's pieces: a sequence of (address, nbytes) pairs whose sizes add up to ``len``. */
static int parse_pieces(PyObject *pieces, unsigned long long len, struct tba_req *req)
{
    PyObject *seq = snapshot(pieces, "address must be an int or a sequence of (address, nbytes) pairs");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > IOV_MAX) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "a vectored request takes 1 to %d pieces, got %zd", IOV_MAX, n);
        return -1;
    }
    req->iov = malloc((size_t)n * sizeof(*req->iov));
    if (!req->iov) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    req->iovcnt = (unsigned)n;
    unsigned long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long addr, size;
        PyObject *piece = snapshot(PySequence_Fast_GET_ITEM(seq, i), "a piece must be (address, nbytes)");
        if (piece != NULL && PyTuple_GET_SIZE(piece) != 2) {
            PyErr_SetString(PyExc_TypeError, "a piece must be (address, nbytes)");
            Py_CLEAR(piece);
        }
        int converted = piece != NULL && !as_u64(PyTuple_GET_ITEM(piece, 0), UINT64_MAX, "a piece's address", &addr)
                        && !as_u64(PyTuple_GET_ITEM(piece, 1), UINT64_MAX, "a piece's nbytes", &size);
        Py_XDECREF(piece);
        if (!converted)
            goto fail;
        if (size == 0) {
            PyErr_SetString(PyExc_ValueError, "piece of 0 bytes");
            goto fail;
        }
        if (size > len - total) { /* also keeps the sum from wrapping round to len */
            PyErr_Format(PyExc_ValueError, "pieces add up to more than the request's %llu bytes", len);
            goto fail;
        }
        req->iov[i].iov_base = (void *)(uintptr_t)addr;
        req->iov[i].iov_len = (size_t)size;
        total += size;
    }
    Py_DECREF(seq);
    if (total != len) {
        PyErr_Format(PyExc_ValueError, "pieces add up to %llu bytes, the request says %llu", total, len);
        tba_req_free(req);
        return -1;
    }
    return 0;
fail:
    Py_DECREF(seq);
    tba_req_free(req);
    return -1;
}

static int parse_request(PyObject *item, struct tba_req *req)
{
    int is_write;
    unsigned long long len, offset, tag;
    PyObject *address, *len_obj, *offset_obj, *tag_obj;

    memset(req, 0, sizeof(*req));
    if (!PyArg_ParseTuple(item, "iiOOOO;request must be (is_write, fd, address, nbytes, offset, tag)",
                          &is_write, &req->fd, &address, &len_obj, &offset_obj, &tag_obj))
        return -1;
    /* An offset is a loff_t: the kernel refuses one past INT64_MAX, save -1 (the current position). */
    if (as_u64(len_obj, UINT64_MAX, "nbytes", &len) || as_u64(offset_obj, INT64_MAX, "offset", &offset)
        || as_u64(tag_obj, UINT64_MAX, "tag", &tag))
        return -1;
    if (len == 0) {
        PyErr_SetString(PyExc_ValueError, "request of 0 bytes");
        return -1;
    }
    if (PyLong_Check(address)) {
        req->addr = PyLong_AsUnsignedLongLong(address);
        if (PyErr_Occurred())
            return -1;
    } else if (parse_pieces(address, len, req)) {
        return -1;
    }
    req->is_write = is_write != 0;
    req->len = len;
    req->offset = offset;
    req->tag = tag;
    return 0;
}

/* Free the pieces of ``n`` parsed requests that the ring did not take. */
static void free_requests(struct tba_req *reqs, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        tba_req_free(&reqs[i]);
    PyMem_RawFree(reqs);
}

static PyObject *Ring_submit(RingObject *self, PyObject *arg)
{
    PyObject *seq;
    struct tba_req *reqs;
    int err;

    if (check_open(self))
        return NULL;
    seq = snapshot(arg, "submit() takes a list of request tuples");  /* Note [Entries read from a snapshot] */
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    reqs = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(*reqs));
    if (!reqs) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_request(PySequence_Fast_GET_ITEM(seq, i), &reqs[i])) {
            free_requests(reqs, i);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    /* Reading the entries may have run Python (an __index__, a pieces sequence's __iter__), which
     * may have closed the ring: it takes none of them then. From here to users++ nothing can. */
    if (check_open(self)) {
        free_requests(reqs, n);
        return NULL;
    }
    self->users++;
    Py_BEGIN_ALLOW_THREADS
    err = tba_ring_submit(&self->ring, reqs, (unsigned)n);
    Py_END_ALLOW_THREADS
    self->users--;
    if (err) {
        free_requests(reqs, n); /* all or nothing: the ring took none of them */
        return raise_errno(-err);
    }
    PyMem_RawFree(reqs); /* the ring owns the pieces now */
    Py_RETURN_NONE;
}

static PyObject *finished_tuple(const struct tba_done *d)
{
    PyObject *result;
    if (d->res == TBA_RES_SHORT)
        result = Py_NewRef(Py_None);
    else if (d->res < 0)
        result = make_oserror((int)-d->res);
    else
        result = PyLong_FromLongLong(d->res);
    if (!result)
        return NULL;
    return Py_BuildValue("KNK", (unsigned long long)d->tag, result, (unsigned long long)d->done);
}

static PyObject *Ring_reap(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    unsigned n = 0;
    int woke = 0, err;
    PyObject *list;

    if (check_open(self))
        return NULL;
    /* tba_ring_reap touches the completion queue, the slots it finishes and done_buf without the
     * lock, as the only reaper: a second thread in it at once took the same completions, pushed
     * slots twice onto the free stack (past its end) and lost others. */
    if (self->reaping) {
        PyErr_SetString(PyExc_RuntimeError, "another thread is reaping this ring");
        return NULL;
    }
    self->reaping = 1;
    self->users++;
    Py_BEGIN_ALLOW_THREADS
    err = tba_ring_reap(&self->ring, self->done_buf, self->ring.nslots, &n, &woke);
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (err && n == 0 && !woke) {
        raise_errno(-err);
        goto done;
    }
    /* Note: [A reaper reads its results in use]
     * Each object made below may start a collection, whose finalizers are Python, and a thread they let run: the
     * ring stays in use (``close`` refuses) and reaped (a second reaper is refused) until the results are read,
     * for a finalizer that closed it freed done_buf under this loop (a segmentation fault). */
    list = PyList_New(n);
    if (!list)
        goto done;
    for (unsigned i = 0; i < n; i++) {
        PyObject *item = finished_tuple(&self->done_buf[i]);
        if (!item) {
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, i, item);
    }
    result = Py_BuildValue("NO", list, woke ? Py_True : Py_False);
done:
    self->users--;
    self->reaping = 0;
    return result;
}

static PyObject *Ring_wake(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    int err;
    if (check_open(self))
        return NULL;
    self->users++;
    Py_BEGIN_ALLOW_THREADS
    err = tba_ring_wake(&self->ring);
    Py_END_ALLOW_THREADS
    self->users--;
    if (err)
        return raise_errno(-err);
    Py_RETURN_NONE;
}

static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->users > 0) {
        PyErr_SetString(PyExc_RuntimeError, "ring is in use by another thread");
        return NULL;
    }
    free_ring(self);
    Py_RETURN_NONE;
}

/* In a child of fork(): the parent's threads that were inside the ring do not exist here, and the
 * ring's lock may have been held by one of them. Forget their marks, leave the lock as it is
 * (destroying a mutex another thread held is undefined), and unmap and close the inherited ring. */
static PyObject *Ring_forget_after_fork(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    self->users = 0;
    self->reaping = 0;
    self->ring.lock_ready = 0;
    if (self->open)
        tba_ring_mark_inherited(&self->ring);
    free_ring(self);
    Py_RETURN_NONE;
}

static PyObject *Ring_get_in_flight(RingObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(self->open ? tba_ring_in_flight(&self->ring) : 0);
}

static PyObject *Ring_get_depth(RingObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(self->open ? self->ring.nslots : 0);
}

static PyObject *Ring_get_closed(RingObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(!self->open);
}

static PyMethodDef Ring_methods[] = {
    {"submit", (PyCFunction)Ring_submit, METH_O,
     "submit(requests): queue (is_write, fd, address, nbytes, offset, tag) tuples."},
    {"reap", (PyCFunction)Ring_reap, METH_NOARGS,
     "reap() -> (list of (tag, result, done_bytes), woke): wait for finished requests."},
    {"wake", (PyCFunction)Ring_wake, METH_NOARGS, "wake(): make a blocked reap() return."},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "close(): free the ring (idempotent)."},
    {"forget_after_fork", (PyCFunction)Ring_forget_after_fork, METH_NOARGS,
     "forget_after_fork(): in a forked child, close the inherited ring without the parent's threads."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"in_flight", (getter)Ring_get_in_flight, NULL, "requests queued or in the kernel, not yet reaped", NULL},
    {"depth", (getter)Ring_get_depth, NULL, "number of request slots", NULL},
    {"closed", (getter)Ring_get_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tba._uring.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(depth): an io_uring instance with depth request slots.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
};

static struct PyModuleDef uring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tba._uring",
    .m_doc = "Raw-syscall io_uring ring for tba's block I/O engine.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__uring(void)
{
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&uring_module);
    if (!module)
        return NULL;
    if (PyModule_AddObjectRef(module, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
