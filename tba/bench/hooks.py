"""Host cost of tba's saved-tensor hooks per storage, against the same loop without tba.

The loop is the one a user would time: ``n`` leaf tensors (``requires_grad=True``) each go
through ``torch.tanh`` (which saves its output, one storage per leaf), then one
``torch.autograd.backward`` runs over all ``n`` results. By default each output is reduced by
``sum()`` at once, so that only autograd (and so tba) holds the saved outputs, as it holds a
model's activations: tba writes each and reads each back. With ``hold_outputs`` the loop keeps
the ``n`` outputs themselves until backward, and tba serves them from the program's memory
instead of reading them back (Note [A storage the program still holds is not read back] in
``tba/runtime/_reads.py``): what is left is the write and the bookkeeping. With tba the forward runs inside a bare
``with tba.offload_activations(directory=d):``. Forward time covers the ``with`` block (entry,
the loop, exit); backward time covers ``backward`` and dropping the outputs, until tba's
bookkeeping of the freed views has run (so that one repetition's work never lands in the next
one's clock). Each figure is the best of ``repeats`` after ``warmups``, and the baseline runs
interleaved with tba in the same process, so both see the same machine. On a GPU (``device``) the
forward clock stops without a synchronisation, as a training loop's host would go on, and each
step ends with one, so that no step's kernels run into the next one's clock.

The *keep* path runs the same loop inside ``tba.keep_in_memory()`` under the offload context:
every tensor goes through the pack hook and stays in memory.

The *many* case, the large-count check, is ``tba/bench/hooks_many.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator

import torch

import tba
from tba import _control
from tba.bench.gc_clock import CollectorClock
from tba.bench.python_work import KINDS, PythonWork, count_step
from tba.bench.sampler import StackSampler
from tba.bench.thread_cpu import by_name as cpu_by_name
from tba.bench.thread_cpu import snapshot as thread_cpu_snapshot


@dataclasses.dataclass(frozen=True)
class HookCase:
    """One row of the table: ``count`` storages of ``size_bytes`` through ``path`` in ``directory``."""

    size_bytes: int
    count: int
    directory: str
    label: str
    """What the directory is (``"disk"``, ``"ram"``)."""
    path: str = "offload"
    """``"offload"`` (the storages go to the file) or ``"keep"`` (inside ``tba.keep_in_memory()``)."""
    hold_outputs: bool = False
    """The loop keeps its outputs until backward (else it keeps only their sums)."""
    device: str = "cpu"
    """Where the leaves live (``"cuda"``: each step ends with a device synchronisation, in both loops)."""


@dataclasses.dataclass
class HookResult:
    """Best-of times of one case, with and without tba, and the extra microseconds per storage."""

    case: HookCase
    base_forward_s: float
    base_backward_s: float
    tba_forward_s: float
    tba_backward_s: float
    thread_cpu_us: dict[str, float] = dataclasses.field(default_factory=dict)
    """CPU microseconds per storage of each thread in the measured step with tba whose forward and backward
    took least, as the times are best-of (``thread_cpu=True``)."""
    base_thread_cpu_us: dict[str, float] = dataclasses.field(default_factory=dict)
    """The same for the best measured step without tba."""
    sample_profile: str = ""
    """Where each thread stood during one more step with tba (``sample=True``; :class:`~tba.bench.sampler.StackSampler`)."""
    mean_s: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """``"base"`` and ``"tba"``: mean forward and backward seconds over the measured steps, every step counted (full
    collections included), as a user's average step is."""
    collector_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """``"base"`` and ``"tba"``: mean seconds per measured step that the cycle collector ran (:class:`CollectorClock`)."""
    full_collections: dict[str, int] = dataclasses.field(default_factory=dict)
    """``"base"`` and ``"tba"``: full collections over the measured steps."""
    python_work: dict[str, dict[str, dict[str, float]]] = dataclasses.field(default_factory=dict)
    """Phase (``"forward"``, ``"backward"``) -> thread -> kind (``tba/bench/python_work.py``'s ``KINDS``) -> count per
    storage in one more step with tba, less the same without (``python_work=True``)."""
    python_work_top: dict[str, dict[str, list[tuple[str, float]]]] = dataclasses.field(default_factory=dict)
    """Phase -> thread -> the functions it called most in that step with tba, calls per storage."""

    @property
    def extra_forward_us(self) -> float:
        return (self.tba_forward_s - self.base_forward_s) / self.case.count * 1e6

    @property
    def extra_backward_us(self) -> float:
        return (self.tba_backward_s - self.base_backward_s) / self.case.count * 1e6

    @property
    def mean_extra_us(self) -> tuple[float, float]:
        """Extra microseconds per storage, forward and backward, between the mean steps (:attr:`mean_s`)."""
        (base_f, base_b), (tba_f, tba_b) = self.mean_s["base"], self.mean_s["tba"]
        return (tba_f - base_f) / self.case.count * 1e6, (tba_b - base_b) / self.case.count * 1e6

    def collector_us(self, name: str) -> float:
        """The cycle collector's microseconds per storage and step, ``"base"`` or ``"tba"``."""
        return self.collector_s.get(name, 0.0) / self.case.count * 1e6

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self.case), "base_forward_s": self.base_forward_s,
                "base_backward_s": self.base_backward_s, "tba_forward_s": self.tba_forward_s,
                "tba_backward_s": self.tba_backward_s, "extra_forward_us": self.extra_forward_us,
                "extra_backward_us": self.extra_backward_us, "thread_cpu_us": self.thread_cpu_us,
                "base_thread_cpu_us": self.base_thread_cpu_us, "sample_profile": self.sample_profile,
                "mean_s": self.mean_s, "collector_s": self.collector_s, "full_collections": self.full_collections,
                "python_work": self.python_work, "python_work_top": self.python_work_top}


SETUP_NOTICES = frozenset({"memory-backed", "no repeated blocks"})
"""tba's warnings (their records' ``tba_notice``) about what the benchmark chose on purpose: a directory in RAM for
the rows without disk cost, and a loop of leaf tensors in no module, which no block holds."""


def _drop_setup_notice(record: logging.LogRecord) -> bool:
    return getattr(record, "tba_notice", None) not in SETUP_NOTICES


@contextlib.contextmanager
def setup_notices_dropped() -> Iterator[None]:
    """Note: [A benchmark is not warned about its own set-up]
    ``bench-hooks`` printed tba's warnings meant for a user's training among its progress lines: that its RAM rows'
    directory is on tmpfs, which keeps files in RAM (the point of those rows), and that the adaptive policy found no
    repeated blocks (its loop has none). While this context is open the ``tba`` logger drops those records
    (:data:`SETUP_NOTICES`); the command says itself when a directory it was given for the disk rows is in RAM.
    """
    logger = logging.getLogger("tba")
    logger.addFilter(_drop_setup_notice)
    try:
        yield
    finally:
        logger.removeFilter(_drop_setup_notice)


def _context(case: HookCase | None) -> contextlib.AbstractContextManager:
    """The ``with`` block around forward: none (baseline), the bare offload context, or it plus keep."""
    if case is None:
        return contextlib.nullcontext()
    if case.path == "keep":
        stack = contextlib.ExitStack()
        stack.enter_context(tba.offload_activations(directory=case.directory))
        stack.enter_context(tba.keep_in_memory())
        return stack
    return tba.offload_activations(directory=case.directory)


def one_step(leaves: list[torch.Tensor], grad: torch.Tensor, case: HookCase | None,
             hold_outputs: bool = False, device: str = "cpu",
             mark: Callable[[str], None] | None = None) -> tuple[float, float]:
    """One forward and backward of the loop, with ``case``'s context (None: without tba); returns their seconds.
    ``mark`` hears ``"forward"`` and ``"backward"`` as each begins."""
    for leaf in leaves:
        leaf.grad = None
    if mark is not None:
        mark("forward")
    start = time.perf_counter()
    with _context(case):
        if hold_outputs:
            outputs = [torch.tanh(leaf) for leaf in leaves]
        else:
            outputs = [torch.tanh(leaf).sum() for leaf in leaves]
    middle = time.perf_counter()
    if mark is not None:
        mark("backward")
    torch.autograd.backward(outputs, [grad] * len(outputs) if hold_outputs else None)
    del outputs
    _control.settle()
    if device != "cpu":
        torch.cuda.synchronize(device)
    return middle - start, time.perf_counter() - middle


def measure(case: HookCase, warmups: int = 2, repeats: int = 3, thread_cpu: bool = False,
            sample: bool = False, python_work: bool = False) -> HookResult:
    """Time ``case`` with and without tba, interleaved, best of ``repeats`` after ``warmups``; with
    ``thread_cpu``, also each thread's CPU time per storage in the best measured step (``thread_cpu.py``);
    with ``sample``, one more step with tba, unmeasured, under a :class:`~tba.bench.sampler.StackSampler`. The mean
    of every measured step and the cycle collector's time in them (:class:`~tba.bench.gc_clock.CollectorClock`) come
    with the best-of figures; with ``python_work``, the Python each thread ran per storage in one more step with and one
    without tba (:func:`~tba.bench.python_work.count_step`)."""
    numel = case.size_bytes // 4
    leaves = [torch.randn(numel, device=case.device, requires_grad=True) for _ in range(case.count)]
    grad = torch.ones(numel, device=case.device)
    best = {"base": [float("inf"), float("inf")], "tba": [float("inf"), float("inf")]}
    spent: dict[str, tuple[float, dict[str, int]]] = {"base": (float("inf"), {}), "tba": (float("inf"), {})}
    # Sums over the measured steps: forward s, backward s, collector s, full collections.
    total = {"base": [0.0, 0.0, 0.0, 0], "tba": [0.0, 0.0, 0.0, 0]}
    clock = CollectorClock()
    gc.collect()
    for rep in range(warmups + repeats):
        for name, which in (("base", None), ("tba", case)):
            before = thread_cpu_snapshot() if thread_cpu and rep >= warmups else None
            with clock:
                forward_s, backward_s = one_step(leaves, grad, which, case.hold_outputs, case.device)
            if before is not None and forward_s + backward_s < spent[name][0]:
                spent[name] = (forward_s + backward_s, cpu_by_name(before, thread_cpu_snapshot()))
            if rep >= warmups:
                best[name][0] = min(best[name][0], forward_s)
                best[name][1] = min(best[name][1], backward_s)
                sums = total[name]
                sums[0] += forward_s
                sums[1] += backward_s
                sums[2] += clock.seconds
                sums[3] += clock.full
    profile = ""
    if sample:
        with StackSampler() as sampler:
            one_step(leaves, grad, case, case.hold_outputs, case.device)
        profile = sampler.report()
    work = top = {}
    if python_work:
        work, top = _python_work(leaves, grad, case)
    return HookResult(case, best["base"][0], best["base"][1], best["tba"][0], best["tba"][1],
                      per_storage_us(spent["tba"][1], case.count), per_storage_us(spent["base"][1], case.count),
                      profile, {name: (sums[0] / repeats, sums[1] / repeats) for name, sums in total.items()},
                      {name: sums[2] / repeats for name, sums in total.items()},
                      {name: sums[3] for name, sums in total.items()}, work, top)


def _python_work(leaves: list[torch.Tensor], grad: torch.Tensor, case: HookCase) -> tuple[dict, dict]:
    """Per phase and thread, each kind of Python work per storage with tba less without; and tba's top functions."""
    counted: dict[str, PythonWork] = {}
    for name, which in (("base", None), ("tba", case)):
        counted[name] = count_step(lambda mark, which=which: one_step(leaves, grad, which, case.hold_outputs,
                                                                      case.device, mark))
    work: dict[str, dict[str, dict[str, float]]] = {}
    top: dict[str, dict[str, list[tuple[str, float]]]] = {}
    for phase in ("forward", "backward"):
        kinds = {kind: (counted["tba"].per_storage(phase, case.count, kind), counted["base"].per_storage(
            phase, case.count, kind)) for kind in KINDS}
        threads = sorted({thread for with_tba, without in kinds.values() for thread in (*with_tba, *without)},
                         key=lambda thread: -kinds["lines"][0].get(thread, 0.0))
        work[phase] = {thread: {kind: with_tba.get(thread, 0.0) - without.get(thread, 0.0)
                                for kind, (with_tba, without) in kinds.items()} for thread in threads}
        top[phase] = {thread: counted["tba"].top_functions(phase, thread, case.count) for thread in threads}
    return work, top


def per_storage_us(ns_by_thread: dict[str, int], count: int) -> dict[str, float]:
    """Nanoseconds by thread as microseconds per storage, the busiest thread first."""
    return {thread: ns / 1e3 / count for thread, ns in sorted(ns_by_thread.items(), key=lambda item: -item[1])}
