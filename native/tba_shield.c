/*
 * tba._shield: a context manager's exit that an asynchronous exception cannot skip.
 *
 * ``exit_block(pop, control, reply, job, exc_type, exc, tb)`` is what ``with`` calls when it leaves
 * a block of ``tba.Offloader`` (``tba/_whole_exit.py`` binds the first four arguments). In this
 * order, and without running any Python frame of its own:
 *
 *   1. ``pop()``: takes the offloader's saved-tensor hooks off the calling thread;
 *   2. ``control._control.jobs.put((reply, job, (failed,)))``: queues ``job(failed)`` for tba's
 *      control thread, where ``failed`` says whether the block raised. ``control`` is the module
 *      ``tba._control``; its attributes are read now, not when the block was entered, since a
 *      forked child has a control thread (and a queue) of its own;
 *   3. ``reply.get()`` until it returns ``(error, result)``, the job's outcome.
 *
 * A Python ``__exit__`` cannot promise this: CPython runs pending signal handlers when a Python
 * frame starts, so a handler's exception (Ctrl-C, a timer) could strike before its first line, and
 * the hooks stayed pushed and the offloader open for good. Here ``pop``, the attribute reads and
 * ``put`` are C calls (no handler runs inside them), and a handler's exception raised while
 * ``get`` waits is kept and raised once the job has run. The first such exception wins over the
 * job's own error, which is raised otherwise; an error of ``pop`` is raised last.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *put_name, *get_name; /* interned "put" and "get" */

struct kept_error {
    PyObject *type, *value, *traceback;
};

/* Keep the pending exception if none is kept yet, else drop it. */
static void keep_first(struct kept_error *kept)
{
    if (kept->type == NULL)
        PyErr_Fetch(&kept->type, &kept->value, &kept->traceback);
    else
        PyErr_Clear();
}

static PyObject *raise_kept(struct kept_error *kept)
{
    PyErr_Restore(kept->type, kept->value, kept->traceback);
    return NULL;
}

static void drop_kept(struct kept_error *kept)
{
    Py_XDECREF(kept->type);
    Py_XDECREF(kept->value);
    Py_XDECREF(kept->traceback);
}

static PyObject *exit_block(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "exit_block() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *pop = args[0], *control = args[1], *reply = args[2], *job = args[3], *exc_type = args[4];
    struct kept_error asynchronous = {NULL, NULL, NULL}, popping = {NULL, NULL, NULL};

    PyObject *done = PyObject_CallNoArgs(pop);
    if (done == NULL)
        keep_first(&popping);
    Py_XDECREF(done);

    PyObject *state = PyObject_GetAttrString(control, "_control");
    PyObject *jobs = state == NULL ? NULL : PyObject_GetAttrString(state, "jobs");
    PyObject *item = jobs == NULL ? NULL : Py_BuildValue("(OO(O))", reply, job, exc_type == Py_None ? Py_False : Py_True);
    done = item == NULL ? NULL : PyObject_CallMethodObjArgs(jobs, put_name, item, NULL);
    Py_XDECREF(item);
    Py_XDECREF(jobs);
    Py_XDECREF(state);
    if (done == NULL) {
        /* Nothing was queued (out of memory, or no control state): there is nothing to wait for. */
        drop_kept(&popping);
        return NULL;
    }
    Py_DECREF(done);

    PyObject *outcome;
    while ((outcome = PyObject_CallMethodNoArgs(reply, get_name)) == NULL)
        keep_first(&asynchronous);
    PyObject *error = NULL;
    if (!PyTuple_Check(outcome) || PyTuple_GET_SIZE(outcome) != 2)
        error = PyObject_CallFunction(PyExc_RuntimeError, "s", "tba: the control thread's reply is not (error, result)");
    else if (PyTuple_GET_ITEM(outcome, 0) != Py_None)
        error = Py_NewRef(PyTuple_GET_ITEM(outcome, 0));
    Py_DECREF(outcome);

    if (asynchronous.type != NULL) {
        drop_kept(&popping);
        Py_XDECREF(error);
        return raise_kept(&asynchronous);
    }
    if (error != NULL) {
        drop_kept(&popping);
        PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(error)), error, PyException_GetTraceback(error));
        return NULL;
    }
    if (popping.type != NULL)
        return raise_kept(&popping);
    Py_RETURN_NONE;
}

static PyMethodDef shield_methods[] = {
    {"exit_block", (PyCFunction)(void (*)(void))exit_block, METH_FASTCALL,
     "exit_block(pop, control, reply, job, exc_type, exc, tb): pop(), then control._control.jobs.put(\n"
     "(reply, job, (failed,))), then reply.get() until it returns; see native/tba_shield.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef shield_module = {
    PyModuleDef_HEAD_INIT,
    "tba._shield",
    "A context manager's exit that an asynchronous exception cannot skip (see native/tba_shield.c).",
    -1,
    shield_methods,
};

PyMODINIT_FUNC PyInit__shield(void)
{
    put_name = PyUnicode_InternFromString("put");
    get_name = PyUnicode_InternFromString("get");
    if (put_name == NULL || get_name == NULL)
        return NULL;
    return PyModule_Create(&shield_module);
}
