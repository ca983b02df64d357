/*
 * tba._gc: take objects out of CPython's cycle collector.
 *
 * ``untrack(*objects)`` calls ``PyObject_GC_UnTrack`` on each object that the collector tracks
 * now; an object it does not track is left as it is. The collector never looks at an untracked
 * object again: it is freed by its reference count alone, as every object is, and a reference
 * cycle through it would never be collected. So only objects that no reference cycle can pass
 * through may be given here; ``tba/_untrack.py`` says which tba gives, and why (Note [Objects the
 * cycle collector need not see]).
 *
 * Untracking is what ``PyObject_GC_UnTrack`` is for, and every deallocator of CPython and torch
 * calls it in a form that accepts an object already untracked. Nothing tracks these objects
 * again: instances of classes with ``__slots__``, weak references and tensors are tracked once,
 * when they are made.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *untrack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *obj = args[i];
        if (PyObject_IS_GC(obj) && PyObject_GC_IsTracked(obj))
            PyObject_GC_UnTrack(obj);
    }
    Py_RETURN_NONE;
}

static PyMethodDef gc_methods[] = {
    {"untrack", (PyCFunction)(void (*)(void))untrack, METH_FASTCALL,
     "untrack($module, /, *objects)\n--\n\n"
     "Take each object out of the cycle collector (PyObject_GC_UnTrack). See native/tba_gc.c."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef gc_module = {
    PyModuleDef_HEAD_INIT,
    "tba._gc",
    "Objects taken out of CPython's cycle collector (see native/tba_gc.c).",
    -1,
    gc_methods,
};

PyMODINIT_FUNC PyInit__gc(void)
{
    return PyModule_Create(&gc_module);
}
