"""A plan that recomputes a layer whose forward calls a module outside it puts that module's state back too, so
training is bit for bit that without tba (Note [A recomputation puts back the modules outside its layer that it calls]
in tba/runtime/_outside_state.py). Before, a BatchNorm three recomputed blocks share through a list counted 18 batches
where training without tba counted 9."""

from __future__ import annotations

import sys
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

import tba

WIDTH = 16


class Block(nn.Module):
    def __init__(self, shared: list[nn.Module], through: str) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        if through == "list":
            self.refs = shared  # a list hides the module from modules()
        else:
            object.__setattr__(self, "norm", shared[0])  # so does an attribute nn.Module never saw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.refs[0] if hasattr(self, "refs") else self.norm
        return x + torch.sin(norm(self.linear(x)))


def _model(shared: nn.Module, through: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block([shared], through) for _ in range(3)])


def _train(placement: tuple[str, ...] | None, shared: nn.Module, through: str, directory: str, eval_at: int = -1) -> dict:
    model = _model(shared, through)
    optimizer = torch.optim.SGD([*model.parameters(), *shared.parameters()], lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        model.train(step != eval_at)
        shared.train(step != eval_at)
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
        if placement is None:
            loss = model(x).pow(2).mean()
        else:
            with tba.Offloader(directory, layers=list(model), policy=tba.Plan(placement, window_bytes=1 << 20)) as off:
                loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if placement is not None:
            off.close()
    return {"losses": losses, "state": {k: v.clone() for k, v in shared.state_dict().items()},
            "params": [p.detach().clone() for p in model.parameters()]}


def _equal(a: dict, b: dict) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"]))
            and a["state"].keys() == b["state"].keys() and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
            and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])))


@pytest.mark.parametrize("placement", ["recompute", "offloaded_recompute"])
@pytest.mark.parametrize("through", ["list", "setattr"])
@pytest.mark.parametrize("eval_at", [-1, 1])
def test_a_shared_batchnorm_is_updated_once_per_forward(tmp_path, placement, through, eval_at):
    reference = _train(None, nn.BatchNorm1d(WIDTH), through, str(tmp_path), eval_at)
    shared = nn.BatchNorm1d(WIDTH)
    got = _train((placement, "offload", placement), shared, through, str(tmp_path), eval_at)
    assert int(shared.num_batches_tracked) == int(reference["state"]["num_batches_tracked"])
    assert _equal(reference, got)


def test_a_shared_module_with_parameters_is_exact(tmp_path):
    """A LayerNorm with weights shared through a list: its parameters get their gradients once, from the recomputation."""
    reference = _train(None, nn.LayerNorm(WIDTH), "list", str(tmp_path))
    assert _equal(reference, _train(("recompute",) * 3, nn.LayerNorm(WIDTH), "list", str(tmp_path)))


def test_a_shared_parameter_changed_before_backward_is_loud(tmp_path):
    shared = nn.LayerNorm(WIDTH)
    model = _model(shared, "list")
    with tba.Offloader(str(tmp_path), layers=list(model), policy=tba.Plan(("recompute",) * 3, window_bytes=1 << 20)) as off:
        loss = model(torch.randn(8, WIDTH)).pow(2).mean()
    with torch.no_grad():
        shared.weight.mul_(2)
    with pytest.raises(tba.TbaError, match="parameter 'weight' of LayerNorm .outside the layer"):
        loss.backward()
    off.close()


def test_the_hook_is_there_only_while_a_first_call_runs(tmp_path):
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(len(module_hooks._global_forward_pre_hooks))
            return x

    shared = Probe()
    model = _model(shared, "list")
    before = len(module_hooks._global_forward_pre_hooks)
    with tba.Offloader(str(tmp_path), layers=list(model), policy=tba.Plan(("recompute",) * 3, window_bytes=1 << 20)) as off:
        loss = model(torch.randn(8, WIDTH)).pow(2).mean()
    assert seen == [before + 1] * 3
    assert len(module_hooks._global_forward_pre_hooks) == before
    loss.backward()
    assert len(module_hooks._global_forward_pre_hooks) == before
    off.close()


def test_another_threads_modules_are_not_the_layers(tmp_path):
    """A module another thread runs while a recomputed layer's first call runs is not the layer's: its parameters may
    change before backward."""
    other = nn.BatchNorm1d(WIDTH)
    started, release = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def forward(self, x):
            started.set()
            release.wait(10)
            return x

    def run_other():
        started.wait(10)
        other(torch.randn(4, WIDTH))
        release.set()

    model = _model(Waits(), "list")
    thread = threading.Thread(target=run_other)
    thread.start()
    with tba.Offloader(str(tmp_path), layers=list(model)[:1], policy=tba.Plan(("recompute",), window_bytes=1 << 20)) as off:
        loss = model[0](torch.randn(8, WIDTH)).pow(2).mean()
    thread.join()
    with torch.no_grad():
        other.weight.add_(1)  # that thread's optimizer step: no concern of the layer's recomputation
    loss.backward()
    assert int(other.num_batches_tracked) == 1
    off.close()


def test_a_layer_holding_a_compiled_module_is_not_watched(tmp_path):
    """torch.compile's wrapper warns when it is called while a global module hook is registered: a layer that holds one
    registers none."""
    torch._dynamo.reset()

    class Compiled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.compile(nn.Linear(WIDTH, WIDTH), backend="eager")

        def forward(self, x):
            return torch.sin(self.inner(x)) + x

    torch.manual_seed(0)
    model = nn.Sequential(Compiled(), Compiled())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tba.Offloader(str(tmp_path), layers=list(model), policy=tba.Plan(("recompute",) * 2, window_bytes=1 << 20)) as off:
            loss = model(torch.randn(8, WIDTH)).pow(2).mean()
        loss.backward()
        off.close()
    assert not [w for w in caught if "global hooks" in str(w.message)]
    torch._dynamo.reset()


class _Injected(BaseException):
    """Raised by a trace function, as a signal handler's exception would be (a ``BaseException`` like Ctrl-C's)."""


def test_an_exception_as_the_watch_is_made_leaves_no_hook(tmp_path):
    """CPython runs pending signal handlers when a call of a class returns: an exception raised as ``OutsideModules``
    is made (here by a trace function at its ``__init__``'s return) reaches the first call before its ``try``. A hook
    registered in ``__init__`` stayed registered, snapshotting and holding every module the thread ran from then on."""
    from tba.runtime import _outside_state

    def trace(frame, event, arg):
        if frame.f_code is not _outside_state.OutsideModules.__init__.__code__:
            return None

        def at_return(frame, event, arg):
            if event == "return":
                raise _Injected
            return at_return

        return at_return

    shared = nn.BatchNorm1d(WIDTH)
    model = _model(shared, "list")
    before = dict(module_hooks._global_forward_pre_hooks)
    off = tba.Offloader(str(tmp_path), layers=list(model), policy=tba.Plan(("recompute",) * 3, window_bytes=1 << 20))
    with pytest.raises(_Injected), off:
        sys.settrace(trace)
        try:
            model(torch.randn(8, WIDTH))
        finally:
            sys.settrace(None)
    off.close()
    assert dict(module_hooks._global_forward_pre_hooks) == before


class _Decays(nn.Linear):
    """Changes its bias in place after using it: a recomputation from the changed bias computes another forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        with torch.no_grad():
            self.bias.add_(0.01)
        return out


def test_an_outside_module_changing_its_parameter_as_it_runs_is_loud(tmp_path):
    """As the layer's own parameter (Note [A recomputed layer that changes its own parameters]): before, the recomputation
    ran from the changed bias and changed it again, silently."""
    shared = _Decays(WIDTH, WIDTH)
    torch.manual_seed(0)
    model = nn.Sequential(Block([], "list"), Block([shared], "list"), Block([], "list"))
    model[0].refs = model[2].refs = [nn.Identity()]
    off = tba.Offloader(str(tmp_path), layers=list(model), policy=tba.Plan(("keep", "recompute", "keep"), window_bytes=1 << 20))
    with pytest.raises(tba.TbaError, match="changed parameter 'bias' of _Decays .outside the layer"), off:
        model(torch.randn(8, WIDTH))
    off.close()


class _Owner(nn.Module):
    """Its blocks call its own norm, which they reach through a list."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList([Block([self.norm], "list") for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("placement", [("recompute",) * 3, ("recompute", "keep", "keep")])
def test_functional_call_reaches_an_outside_modules_recomputation(tmp_path, placement):
    """Fast weights given to the whole model through ``torch.func.functional_call`` (Note [A recomputation runs with the
    parameters its first call ran with]): the recomputation read the norm's own weights, not the ones given."""
    grads = []
    for offloaded in (False, True):
        torch.manual_seed(0)
        model = _Owner()
        with torch.no_grad():
            model.norm.weight.uniform_()
        weights = {name: p * 1.5 for name, p in model.named_parameters()}
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
        if offloaded:
            with tba.Offloader(str(tmp_path), layers=list(model.blocks), policy=tba.Plan(placement, window_bytes=1 << 20)) as off:
                loss = torch.func.functional_call(model, weights, (x,)).pow(2).mean()
            loss.backward()
            off.close()
        else:
            torch.func.functional_call(model, weights, (x,)).pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


class _CountsPrivately(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._n += 1
        return x * self._n


class _CountsNested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.history = {"calls": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.history["calls"].append(1)
        return x * len(self.history["calls"])


def test_an_outside_modules_private_state_is_the_layers(tmp_path):
    """Note [Private state of a recomputed layer]: the recomputation counted again from what the first call left (18 calls
    where training without tba counted 9, and other gradients), silently."""
    model = _model(_CountsPrivately(), "list")
    off = tba.Offloader(str(tmp_path), layers=list(model), policy=tba.Plan(("recompute",) * 3, window_bytes=1 << 20))
    with pytest.raises(tba.TbaError, match=r"changed private state of its modules \(_CountsPrivately._n\)"), off:
        model(torch.randn(8, WIDTH))
    off.close()


@pytest.mark.parametrize("placement", [("recompute", "offload", "recompute"), ("keep", "recompute", "keep")])
def test_an_outside_modules_nested_state_is_put_back(tmp_path, placement):
    """Note [Nested state a recomputation is given back]: a list in the module's public dict counted 15 calls where
    training without tba counted 9."""
    reference = _train(None, _CountsNested(), "list", str(tmp_path))
    shared = _CountsNested()
    assert _equal(reference, _train(placement, shared, "list", str(tmp_path)))
    assert len(shared.history["calls"]) == 9


class _Rotary(nn.Module):
    """Made anew by each forward; a buffer over ``RECOMPUTE_STATE_ALWAYS_COPIED_BYTES`` that it leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.ones(64, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table[0, :WIDTH]


class _MakesItsModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(_Rotary()(self.linear(x)))


def test_what_is_learned_of_modules_made_by_each_forward_is_bounded(tmp_path):
    """Note [What a layer learned of a module outside it goes with that module]: a key per step, for as long as the layer
    lived."""
    from tba.runtime._learned import learned_for

    layer = _MakesItsModule()
    off = tba.Offloader(str(tmp_path), layers=[layer], policy=tba.Plan(("recompute",), window_bytes=1 << 20))
    for _ in range(100):
        with off:
            loss = layer(torch.randn(8, WIDTH)).sum()
        loss.backward()
    off.close()
    learned = learned_for(layer)
    assert len(learned.unchanged) <= 65 and len(learned.outside) <= 65
