"""An offloader's block exited on another thread than the one that entered it leaves that thread's saved-tensor
hooks alone (Note [A block's hooks come off only on its thread] in tba/_whole_exit.py): another context there
keeps its pair, the offloader still closes, and training stays exact."""

from __future__ import annotations

import _thread
import contextlib
import threading

import pytest
import torch

import tba
from tba.runtime import _keep
from tba.runtime._unpack_hooks import Phase

_top = torch._C._autograd._top_saved_tensors_default_hooks


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(3)])


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _on_thread(fn) -> list:
    """Run ``fn`` on a new thread; what it returned or raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            out.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def test_an_exit_on_another_thread_leaves_that_threads_context_alone(spill_dir, exit_kind):
    """The worker's own save_on_cpu pair stays on top of its stack: it was popped before."""
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    off.__enter__()

    def worker() -> tuple:
        with torch.autograd.graph.save_on_cpu():
            before = _top(True)
            off.__exit__(None, None, None)
            return before, _top(True)

    [result] = _on_thread(worker)
    assert not isinstance(result, BaseException), result
    before, after = result
    assert before is not None and after == before
    assert _top(True) == (off.pack, off.unpack)  # still on the entering thread, where the worker could not pop it
    torch._C._autograd._pop_saved_tensors_default_hooks()
    off.close()


def test_a_block_exited_on_another_thread_closes_and_training_stays_exact(spill_dir, exit_kind, caplog, monkeypatch):
    monkeypatch.setattr(_keep, "_warned_orphaned", False)  # one warning per process
    x = torch.randn(16, 32)
    reference = _model()
    reference(x).sum().backward()
    model = _model()
    off = tba.offload_activations(directory=spill_dir, backend="threads")
    off.__enter__()
    loss = model(x).sum()
    assert _on_thread(lambda: off.__exit__(None, None, None)) == [None]
    loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(reference), strict=True))
    with caplog.at_level("WARNING", logger="tba"):
        model(x).sum().backward()  # saved on the entering thread, whose pair is left: kept in memory, one warning
    assert "exited on another thread" in caplog.text
    torch._C._autograd._pop_saved_tensors_default_hooks()
    assert off._phase is Phase.CLOSED


def test_a_second_exit_pops_nothing(spill_dir, exit_kind):
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    with torch.autograd.graph.save_on_cpu():
        outer = _top(True)
        with off:
            pass
        off.__exit__(None, None, None)
        assert _top(True) == outer
    off.close()


def test_an_exit_stack_closed_on_another_thread(spill_dir, exit_kind):
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    stack = contextlib.ExitStack()
    stack.enter_context(off)

    def worker() -> bool:
        with torch.autograd.graph.save_on_cpu():
            before = _top(True)
            stack.close()
            return _top(True) == before

    assert _on_thread(worker) == [True]
    torch._C._autograd._pop_saved_tensors_default_hooks()
    off.close()


def test_a_generator_resumed_on_another_thread_leaves_its_pair(spill_dir, exit_kind):
    """A generator suspended in a block and finished on a worker: the worker's pair is not the block's."""
    off = tba.Offloader(spill_dir, backend="threads", layers=[])

    def steps():
        with off:
            yield

    suspended = steps()
    next(suspended)

    def worker() -> bool:
        with torch.autograd.graph.save_on_cpu():
            before = _top(True)
            next(suspended, None)
            return _top(True) == before

    assert _on_thread(worker) == [True]
    assert _top(True) == (off.pack, off.unpack)
    torch._C._autograd._pop_saved_tensors_default_hooks()
    off.close()


def test_a_late_exit_of_a_block_ended_elsewhere_leaves_the_next_block_alone(spill_dir, exit_kind):
    """Thread A enters a reusable offloader, a worker exits it, thread C enters it again: A's own exit, when it comes,
    pops A's pair and must not end C's block (helper-132: it closed C's block)."""
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    off.__enter__()  # thread A: this one
    assert _on_thread(lambda: off.__exit__(None, None, None)) == [None]
    entered, leave, left = threading.Event(), threading.Event(), []

    def thread_c() -> None:
        with off:
            entered.set()
            leave.wait(30)
        left.append(_top(True))

    c = threading.Thread(target=thread_c)
    c.start()
    assert entered.wait(30)
    off.__exit__(None, None, None)  # A's late exit
    assert _top(True) is None  # A's own pair came off
    assert off._phase is Phase.ACTIVE, "A's late exit ended the block thread C had entered"
    leave.set()
    c.join()
    assert left == [None]
    off.close()


def test_an_exit_on_another_thread_ends_the_block_after_the_entering_threads_own_exit(spill_dir, exit_kind):
    """A enters, a worker ends A's block, A's own exit comes (its pair off), C enters: A ending C's block by hand
    ends it, under either exit. The C exit of A's own left A noted as a thread whose block was ended elsewhere, and
    A's later exit of C's block was taken for A's late exit and ended nothing."""
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    off.__enter__()  # thread A: this one
    assert _on_thread(lambda: off.__exit__(None, None, None)) == [None]
    off.__exit__(None, None, None)  # A's own exit, after the worker's
    assert _top(True) is None
    entered, leave, left = threading.Event(), threading.Event(), []

    def thread_c() -> None:
        off.__enter__()
        entered.set()
        leave.wait(30)
        left.append(_top(True) is not None)

    c = threading.Thread(target=thread_c)
    c.start()
    assert entered.wait(30)
    try:
        off.__exit__(None, None, None)  # A ends C's block, as the worker ended A's
        assert off._phase is Phase.IDLE, "A's exit of C's block ended nothing"
    finally:
        leave.set()
        c.join()
        off.close()
    assert left == [True]  # C's pair stays on C's stack (Note [A block's hooks come off only on its thread])


def test_a_new_thread_given_a_dead_entering_threads_id_ends_a_block_by_hand(spill_dir, exit_kind):
    """T enters, this thread ends T's block, T ends without its own exit; this thread enters again, and a new thread
    the system gave T's id ends that block by hand: the block ends, as for any other thread (helper-137: it was taken
    for T's late exit and ended nothing, the block left active)."""
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    entering = threading.Thread(target=off.__enter__)
    entering.start()
    entering.join()
    _end_by_hand_on_a_thread_given(entering.ident, off, _on_thread)


def _on_bare_thread(fn) -> list:
    """Run ``fn`` on a thread ``threading`` did not make (``_thread.start_new_thread``: its current_thread() is a
    ``_DummyThread``, which Python 3.11 keeps for its identity after the thread ends, alive by ``is_alive``)."""
    out: list = []
    done = _thread.allocate_lock()
    done.acquire()

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            out.append(err)
        finally:
            done.release()

    _thread.start_new_thread(run, ())
    done.acquire()
    return out


def test_a_new_bare_thread_given_a_dead_bare_entering_threads_id_ends_a_block_by_hand(spill_dir, exit_kind):
    """As above, with threads ``threading`` did not make (a C library's, ``_thread.start_new_thread``'s): the new
    thread given T's id is handed T's ``_DummyThread``, so it was taken for T's late exit and ended nothing."""
    off = tba.Offloader(spill_dir, backend="threads", layers=[])
    [entering] = _on_bare_thread(lambda: off.__enter__() and threading.get_ident())
    _end_by_hand_on_a_thread_given(entering, off, _on_bare_thread)


def _end_by_hand_on_a_thread_given(ident: int, off: tba.Offloader, on_thread) -> None:
    """T (``ident``) entered ``off``, this thread ended T's block, T ended: this thread enters again, and a new thread
    (run by ``on_thread``) that the system gave T's id ends that block by hand. It must end, as for any other thread."""
    off.__exit__(None, None, None)  # T's block, ended here
    off.__enter__()
    try:
        for _ in range(50):  # the system hands a finished thread's id to a new one, most often at once
            tried = on_thread(lambda: threading.get_ident() == ident and off.__exit__(None, None, None) is None)
            if tried == [True]:
                break
        else:
            pytest.skip("no new thread was given the finished thread's id")
        assert off._phase is Phase.IDLE, "the exit was taken for the dead thread's late exit and ended nothing"
    finally:
        if _top(True) == (off.pack, off.unpack):  # this thread's pair: hooks come off only on the entering thread
            torch._C._autograd._pop_saved_tensors_default_hooks()
        off.close()
