/*
 * tba._shield: a context manager's exit that an asynchronous exception cannot skip.
 *
 * ``exit_block(pop, top, control, reply, job, fallback, entered, exc_type, exc, tb)`` is what ``with``
 * calls when it leaves a block of ``tba.Offloader`` (``tba/_whole_exit.py`` binds the first seven).
 * Without running any Python frame of its own, in this order:
 *
 *   1. ``pop()``: takes the offloader's saved-tensor hooks off the calling thread, unless
 *      ``top(True)`` shows the stack empty (``pop_top`` below), or the calling thread is not the one
 *      that entered the block: ``entered``, a one-item list, holds that thread's identity from the
 *      entry until the first exit, which sets it to 0. An exit on any other thread is the Python
 *      one's (``fallback``), which tells a thread whose block another thread ended from one that
 *      never entered (Note [A block's hooks come off only on its thread] in tba/_whole_exit.py);
 *   2. ``control._control.jobs.put((reply, job, (failed,)))``: queues ``job(failed)`` for tba's
 *      control thread, where ``failed`` says whether the block raised. ``control`` is the module
 *      ``tba._control``; its attributes are read now, not when the block was entered, since a
 *      forked child has a control thread (and a queue) of its own;
 *   3. ``reply.get()`` until it returns ``(error, result)``, the job's outcome.
 *
 * Where no control thread would run the job (the caller is the control thread itself, or it has
 * stopped at interpreter exit) or the call has keyword arguments, it calls ``fallback(exc_type,
 * exc, tb)``, the same exit in Python, which runs the job inline.
 *
 * A Python ``__exit__`` cannot promise this: CPython runs pending signal handlers when a Python
 * frame starts, so a handler's exception (Ctrl-C, a timer) could strike before its first line, and
 * the hooks stayed pushed and the offloader open for good. Here ``pop``, the attribute reads and
 * ``put`` are C calls (no handler runs inside them), and a handler's exception raised while
 * ``get`` waits is kept and raised once the job has run. The first such exception wins over the
 * job's own error (chained to the block's exception, as ``raise`` in an ``__exit__`` would be),
 * which is raised otherwise; an error of ``pop`` is raised last.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#define BOUND_ARGS 7 /* pop, top, control, reply, job, fallback, entered */

static PyObject *put_name, *get_name, *control_name, *jobs_name, *stopped_name, *ident_name;

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

/* The control thread's state (``control._control``) when it takes jobs from this thread now, else
 * NULL (no error set) or NULL with an error set. */
static PyObject *taking_state(PyObject *control)
{
    PyObject *state = PyObject_GetAttr(control, control_name);
    if (state == NULL)
        return NULL;
    PyObject *stopped = PyObject_GetAttr(state, stopped_name);
    PyObject *ident = stopped == NULL ? NULL : PyObject_GetAttr(state, ident_name);
    int takes = ident != NULL && stopped == Py_False && PyLong_Check(ident)
                && PyLong_AsUnsignedLong(ident) != PyThread_get_thread_ident();
    Py_XDECREF(stopped);
    Py_XDECREF(ident);
    if (PyErr_Occurred() || !takes) {
        Py_DECREF(state);
        return NULL;
    }
    return state;
}

/* Pop the pair on top of the thread's saved-tensor hooks, if any (torch asserts on an empty stack:
 * a block finalized on a thread that has none, the control thread collecting a generator). Only
 * the top one, whoever pushed it: a pair that an inner context left above the offloader's (its
 * exit skipped) cannot be told from one whose owner pops it later (a generator suspended across
 * the block's end), and popping both unbalanced the latter. */
static int pop_top(PyObject *pop, PyObject *top)
{
    PyObject *pair = PyObject_CallOneArg(top, Py_True);
    if (pair == NULL)
        return -1;
    int empty = pair == Py_None;
    Py_DECREF(pair);
    if (empty)
        return 0;
    PyObject *popped = PyObject_CallNoArgs(pop);
    if (popped == NULL)
        return -1;
    Py_DECREF(popped);
    return 0;
}

/* Whether the calling thread entered the block (``entered[0]``): 1, 0, or -1 with an error set. */
static int entered_here(PyObject *entered)
{
    if (!PyList_Check(entered) || PyList_GET_SIZE(entered) != 1) {
        PyErr_SetString(PyExc_TypeError, "exit_block: entered must be a list of one thread identity");
        return -1;
    }
    PyObject *ident = PyList_GET_ITEM(entered, 0);
    unsigned long thread = PyLong_Check(ident) ? PyLong_AsUnsignedLong(ident) : 0;
    if (thread == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    return thread != 0 && thread == PyThread_get_thread_ident();
}

/* ``pop_top`` where the calling thread entered the block (``entered[0]``), which then reads 0: the
 * hooks of another thread, or those of a block exited a second time, are left alone. */
static int pop_own(PyObject *pop, PyObject *top, PyObject *entered)
{
    int own = entered_here(entered);
    if (own <= 0)
        return own;
    PyObject *ident = PyList_GET_ITEM(entered, 0);
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL)
        return -1;
    PyList_SET_ITEM(entered, 0, zero);
    Py_DECREF(ident);
    return pop_top(pop, top);
}

static PyObject *exit_block(PyObject *module, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    (void)module;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < BOUND_ARGS) {
        PyErr_Format(PyExc_TypeError, "exit_block() takes at least %d arguments (%zd given)", BOUND_ARGS, nargs);
        return NULL;
    }
    PyObject *pop = args[0], *top = args[1], *control = args[2], *reply = args[3], *job = args[4];
    PyObject *fallback = args[5], *entered = args[6];
    Py_ssize_t given = nargs - BOUND_ARGS;
    if ((kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) || given != 3)
        return PyObject_Vectorcall(fallback, args + BOUND_ARGS, given, kwnames);
    PyObject *exc_type = args[BOUND_ARGS], *exc = args[BOUND_ARGS + 1];
    int own = entered_here(entered);
    if (own < 0)
        return NULL;
    PyObject *state = own ? taking_state(control) : NULL;
    if (state == NULL) {  /* the control thread, or an exit on another thread than the block's: Python decides */
        if (PyErr_Occurred())
            return NULL;
        return PyObject_Vectorcall(fallback, args + BOUND_ARGS, given, NULL);
    }
    struct kept_error asynchronous = {NULL, NULL, NULL}, popping = {NULL, NULL, NULL};

    if (pop_own(pop, top, entered) < 0)
        keep_first(&popping);

    PyObject *jobs = PyObject_GetAttr(state, jobs_name);
    Py_DECREF(state);
    PyObject *item = jobs == NULL ? NULL : Py_BuildValue("(OO(O))", reply, job, exc_type == Py_None ? Py_False : Py_True);
    PyObject *done = item == NULL ? NULL : PyObject_CallMethodObjArgs(jobs, put_name, item, NULL);
    Py_XDECREF(item);
    Py_XDECREF(jobs);
    if (done == NULL) {
        /* Nothing was queued (out of memory): there is nothing to wait for. */
        drop_kept(&popping);
        return NULL;
    }
    Py_DECREF(done);

    PyObject *outcome;
    while ((outcome = PyObject_CallMethodNoArgs(reply, get_name)) == NULL)
        keep_first(&asynchronous);
    int well_formed = PyTuple_Check(outcome) && PyTuple_GET_SIZE(outcome) == 2;
    PyObject *error = NULL;
    if (well_formed && PyTuple_GET_ITEM(outcome, 0) != Py_None)
        error = Py_NewRef(PyTuple_GET_ITEM(outcome, 0));
    Py_DECREF(outcome);

    if (asynchronous.type != NULL) {
        drop_kept(&popping);
        Py_XDECREF(error);
        return raise_kept(&asynchronous);
    }
    if (!well_formed) {
        drop_kept(&popping);
        PyErr_SetString(PyExc_RuntimeError, "tba: the control thread's reply is not (error, result)");
        return NULL;
    }
    if (error != NULL && !PyExceptionInstance_Check(error)) {
        /* What ``raise error`` says of it: taken as an exception, its type and traceback were read out of an object
         * that has neither (a segmentation fault). */
        drop_kept(&popping);
        Py_DECREF(error);
        PyErr_SetString(PyExc_TypeError, "tba: the control thread's reply holds an error that is no exception "
                                         "(exceptions must derive from BaseException)");
        return NULL;
    }
    if (error != NULL) {
        drop_kept(&popping);
        PyObject *context = PyException_GetContext(error);
        if (context == NULL && exc != error && PyExceptionInstance_Check(exc))
            PyException_SetContext(error, Py_NewRef(exc));
        Py_XDECREF(context);
        PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(error)), error, PyException_GetTraceback(error));
        return NULL;
    }
    if (popping.type != NULL)
        return raise_kept(&popping);
    Py_RETURN_NONE;
}

static PyMethodDef shield_methods[] = {
    {"exit_block", (PyCFunction)(void (*)(void))exit_block, METH_FASTCALL | METH_KEYWORDS,
     "exit_block($module, pop, top, control, reply, job, fallback, /, *args, **kwargs)\n--\n\n"
     "pop(), then control._control.jobs.put((reply, job, (failed,))), then reply.get() until it\n"
     "returns; fallback(*args, **kwargs) where the control thread cannot take the job. See\n"
     "native/tba_shield.c."},
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
    if ((put_name = PyUnicode_InternFromString("put")) == NULL || (get_name = PyUnicode_InternFromString("get")) == NULL
        || (control_name = PyUnicode_InternFromString("_control")) == NULL
        || (jobs_name = PyUnicode_InternFromString("jobs")) == NULL
        || (stopped_name = PyUnicode_InternFromString("stopped")) == NULL
        || (ident_name = PyUnicode_InternFromString("thread_ident")) == NULL)
        return NULL;
    return PyModule_Create(&shield_module);
}
