"""Shared fixtures, and the skip conditions behind the markers registered in ``pyproject.toml``.

Tests mark what they need (``@pytest.mark.requires_cuda``, ``@pytest.mark.requires_io_uring``);
:func:`pytest_collection_modifyitems` turns each marker into a skip, with the reason, on machines
that lack it.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket

# Deterministic cuBLAS, so that GPU gradients with and without tba can be compared bit for bit.
# It must be set before CUDA is initialised; on CPU it has no effect.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Note: [The suite runs torch on one intra-op thread]
# pytest-xdist runs two workers on CI's two cores, and many tests start Python runs of their own
# beside them. With torch's default, one intra-op thread per core in every one of those processes,
# GNU OpenMP's workers spun at each parallel region's barrier for a partner that another process had
# preempted (docs/host-cost.md found a fifth of a busy core's samples there): CPU that ran no test.
# Set before torch is imported, in the environment, so that every process the suite starts
# inherits it; a run that sets its own (OMP_NUM_THREADS=2) still can. No test here depends on
# torch's default count: those that need a count set it themselves (tests/cli/test_bench_hooks.py,
# the fork tests' torch.set_num_threads(1)).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from tba._control import settle
from tba.io import available_backends

pytest_plugins = ("timeout_report",)  # Note [A test past its timeout in a worker says so] in tests/timeout_report.py


def _missing_requirements() -> dict[str, str | None]:
    """Marker name -> why this machine lacks it (``None`` where it has it)."""
    return {
        "requires_cuda": None if torch.cuda.is_available() else "needs a CUDA device",
        "requires_io_uring": (
            None if available_backends()["io_uring"] is None
            else f"io_uring unavailable: {available_backends()['io_uring']}"
        ),
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _missing_requirements()
    for item in items:
        for name, reason in missing.items():
            if reason is not None and item.get_closest_marker(name) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
    # Note: [Slow tests run first]
    # pytest-xdist hands its two workers the tests in collection order, so a 30 s test collected
    # last (the fuzz run, in tests/test_fuzz.py) ran alone on one core while the other waited:
    # on CI's two cores the suite's length is its CPU time over two plus such a tail. Tests marked
    # ``slow`` (over about 10 s on the 2-core VM) are collected first, in their order, then the rest.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


SILENTLY_FATAL_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGTERM", "SIGALRM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGXFSZ") if hasattr(signal, name))
"""Signals whose default action ends the process without the traceback pytest's faulthandler prints
for a crash (SIGSEGV, SIGABRT, ...)."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Note: [A worker ended by a signal says which]
    A CI run lost a pytest-xdist worker in the middle of a test with nothing printed but "node down:
    Not properly terminated": not a crash (pytest's faulthandler prints those), so a signal whose
    default action ends the process, ``os._exit``, or SIGKILL. It was most likely pytest-timeout's
    ``os._exit`` (Note [A test past its timeout in a worker says so]); a signal must not be as silent
    the next time. Before each test (a test may have replaced a handler), such signals get
    faulthandler's handler, which prints every thread's stack (where the signal found each) to
    stderr, then ends the process as the default action would.
    A handler the program installed itself (``signal.signal``) replaces it until the next test. The
    stack goes to the stderr pytest found (``tests/timeout_report.py``), as a timed-out test's does.
    """
    from timeout_report import stderr_as_found  # imported here: pytest imports it first, as a plugin

    for signum in SILENTLY_FATAL_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            # Registered again only after unregister: a test's signal.signal() replaced the handler while
            # faulthandler still counts it as registered, and would not install it again.
            faulthandler.unregister(signum)
            faulthandler.register(signum, file=stderr_as_found(), all_threads=True, chain=True)


USABLE_BACKENDS = [name for name, reason in available_backends().items() if reason is None]


@pytest.fixture(autouse=True)
def earlier_objects_frozen():
    """Before each test, the garbage collected and every object still alive moved out of the collector's sight.

    Note: [The suite's collections skip what earlier tests left]
    Tests collect garbage often (:func:`open_fds` before each count, tba itself at some closes, the tests'
    own ``gc.collect()``), and each full collection walked every tracked object of the worker: torch's
    and tba's modules, Dynamo's and what earlier tests left, 600,000 to 900,000 objects late in a run,
    0.1-0.5 s a collection. A whole ``make test`` spent about 60 s of CPU there. ``gc.freeze()`` here,
    after a collection of what the last test left (young objects only: the rest is frozen already),
    leaves the survivors to reference counting; what this test creates is collected as before, so a
    test that checks that a collection frees its objects, or counts descriptors before and after, sees
    the same. Two things change for objects made before the test: one that becomes cyclic garbage
    later is never collected, in this test or any later one of the worker (no collection looks at
    frozen objects again; only ``gc.unfreeze()``, as :func:`unfrozen` does, hands them back), so its
    finalizer does not run and what it alone holds stays too, even objects this test made; and
    ``gc.get_objects()`` and ``gc.get_referrers()`` do not see it. A test that drops an object an
    earlier test or a module or session fixture left in a cycle and expects it collected, or that
    searches those, asks for :func:`unfrozen`.
    """
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def unfrozen():
    """Every object visible to ``gc.get_referrers()`` and ``gc.get_objects()`` again for this test (Note [The
    suite's collections skip what earlier tests left]); the next test freezes them again."""
    gc.unfreeze()
    yield


@pytest.fixture(params=USABLE_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each backend this machine supports."""
    return request.param


_LINEAR = torch.nn.functional.linear


@pytest.fixture(autouse=True)
def torchs_own_linear():
    """Every test ends with torch's own ``F.linear``: DeepSpeed's ZeRO-3 replaces it process-wide with an autograd
    Function ("this will persist unless manually reset"), and a later test in the same worker ran through it (a
    nested tensor failed there: 'Expected both to be nested'; a fresh-clone CI run)."""
    yield
    torch.nn.functional.linear = _LINEAR


_GLOBAL_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                        "_global_backward_hooks")


def _global_module_hooks() -> dict[tuple[str, int], object]:
    from torch.nn.modules import module as module_hooks

    return {(name, key): hook for name in _GLOBAL_MODULE_HOOKS for key, hook in getattr(module_hooks, name).items()}


@pytest.fixture(autouse=True)
def no_global_module_hook_left():
    """Every test ends with the global module hooks it began with: one left (tba's profiled-step watch of the modules
    outside a layer, ``tba/runtime/_outside.py``, by a test that started a step and never ended it) ran at every
    module call of every later test, and tests/runtime/test_exception_at_every_call.py, which asserts that none is
    left, failed after it in one process (helper-111). The hooks left are taken off, so only this test fails."""
    from torch.nn.modules import module as module_hooks

    before = set(_global_module_hooks())
    yield
    left = {key: hook for key, hook in _global_module_hooks().items() if key not in before}
    for name, key in left:
        getattr(module_hooks, name).pop(key, None)
    assert not left, f"global module hooks left registered: {list(left.values())}"


@pytest.fixture(autouse=True)
def no_shared_runtimes():
    """Every test starts and ends with no idle shared runtime (``tba.shutdown()``), so descriptor counts are its own."""
    import tba

    tba.shutdown()
    yield
    tba.shutdown()


@pytest.fixture
def read_back_always(monkeypatch):
    """Every unpack of a written host storage reads the file, even while the test still holds the storage.

    Tests of the file's round trip (odd sizes and phases, checksums, read counters) keep their tensors
    alive to compare with; without this, backward would use that memory instead (Note [A storage the
    program still holds is not read back] in ``tba/runtime/_reads.py``) and the file would go unread.
    """
    from tba.runtime._reads import StoreReads

    monkeypatch.setattr(StoreReads, "_live_bytes", lambda self, entry: None)


@pytest.fixture
def no_gc():
    """Automatic cycle collection off, so a reference cycle shows as a leak instead of a timing."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture
def spill_dir(tmp_path) -> str:
    """An empty directory for spill files; the test fails if anything is left in it."""
    path = tmp_path / "spill"
    path.mkdir()
    yield str(path)
    settle()
    assert os.listdir(path) == [], "a spill file was left behind"


@pytest.fixture
def open_fds():
    """The number of open file descriptors, as a function, to compare before and after.

    Collects garbage first, so descriptors of objects left by earlier tests do not move the count, and
    lets tba's control thread finish the releases that dropped views queued (``tba/_control.py``).
    """

    def count() -> int:
        gc.collect()
        settle()
        return len(os.listdir("/proc/self/fd"))

    return count


@pytest.fixture(scope="module")
def single_process_group():
    """One gloo process group for a DeepSpeed test module; DeepSpeed's shared-memory allreduce op is not built.

    DeepSpeed caches its groups; they are released with the process group, so the next module
    starts afresh.

    That op only speeds up allreduce between ranks on one node and JIT-compiles for about a
    minute on first use, which a one-rank test does not need.
    """
    deepspeed = pytest.importorskip("deepspeed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    compatible = deepspeed.ops.__compatible_ops__
    name = deepspeed.accelerator.get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    was_compatible = compatible.get(name)
    compatible[name] = False
    yield
    compatible[name] = was_compatible
    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def sim():
    """A simulated CUDA device (tba/device/sim) for the test; afterwards no race, no use after free, no thread left."""
    import threading

    import tba
    from tba.device.sim import simulate

    before = set(threading.enumerate())
    with simulate(seed=1234) as device:
        yield device
        tba.shutdown()
    assert device.problems() == [], "\n".join(device.problems())
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith(("tba", "fake"))]
    assert not left, f"threads left: {left}"


@pytest.fixture
def search_calls(monkeypatch) -> list[int]:
    """How many values the generator search of recomputed layers (``_collect`` in tba/runtime/_generators.py) has met
    so far: its cost, counted instead of timed."""
    from tba.runtime import _generators

    calls = [0]
    search = _generators._collect

    def counted(*args):
        calls[0] += 1
        return search(*args)

    monkeypatch.setattr(_generators, "_collect", counted)
    return calls


@pytest.fixture(params=["c", "python"])
def exit_kind(request, monkeypatch) -> str:
    """An offloader's exit in C (``tba._shield``) and in Python (Note [An exit that always runs] in tba/_whole_exit.py):
    a test taking it runs under both."""
    from tba import _whole_exit

    if request.param == "c" and _whole_exit.exit_block is None:
        pytest.skip("the native extension tba._shield is not built")
    if request.param == "python":
        monkeypatch.setattr(_whole_exit, "exit_block", None)
    return request.param
