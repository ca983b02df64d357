"""Offloaded recompute (plan letter ``S``): the layer is recomputed and its inputs go to the spill file.

Each test compares with training without tba bit for bit (``torch.equal``) and checks where the
inputs went: written through tba for ``S``, held in memory for ``R`` (Note [Hook nesting of a
recomputed layer] in ``tba/runtime/_recompute.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import tba
from tba.bench.models import PRESETS, make_batch, make_gpt

CODES = {"S": "offloaded_recompute", "R": "recompute", "O": "offload", "K": "keep"}
TINY4 = dataclasses.replace(PRESETS["tiny"], layers=4)  # dropout 0.1: recomputation must replay the masks


def _step(model: nn.Module, batch: tuple, offloader: tba.Offloader | None = None, *, seed: int = 7,
          flush: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if offloader is None:
        loss = model(*batch)
    else:
        with offloader:
            loss = model(*batch)
            if flush:
                offloader.flush()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_same(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]), f"loss {got[0]} != {want[0]}"
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), f"gradient of {name} differs"


def _offloader(spill_dir: str, model: nn.Module, code: str, **options) -> tba.Offloader:
    plan = tba.Plan(tuple(CODES[c] for c in code), window_bytes=1 << 20)
    return tba.Offloader(spill_dir, layers=model, policy=plan, min_offload_bytes=0, **options)


@pytest.mark.parametrize("code, flush", [("SSSS", True), ("SORK", False), ("KSOS", True)])
def test_gpt_with_dropout_is_exact(spill_dir, code, flush):
    reference, model = make_gpt(TINY4), make_gpt(TINY4)
    batch = make_batch(TINY4)
    offloader = _offloader(spill_dir, model, code)
    for step in range(2):  # the second step reuses the file and the plan
        _assert_same(_step(model, batch, offloader, seed=step, flush=flush), _step(reference, batch, seed=step))
    input_bytes = TINY4.batch_size * TINY4.seq_len * TINY4.width * 4
    for index, letter in enumerate(code):
        saved = offloader.layer_saved_bytes.get(index, 0)
        if letter == "S" and index < len(code) - 1:  # the last layer's count has the head's tensors too
            assert saved == 2 * input_bytes, f"layer {index}: only its input goes through tba, once per step"
        if letter == "R" and index < len(code) - 1:
            assert saved == 0, f"layer {index}: a recompute layer's input stays in memory, out of tba"
    assert offloader.stats.bytes_written > 0
    offloader.close()


def test_bf16_inputs_are_exact(spill_dir):
    reference, model = make_gpt(TINY4).to(torch.bfloat16), make_gpt(TINY4).to(torch.bfloat16)
    batch = make_batch(TINY4)
    offloader = _offloader(spill_dir, model, "SSSS")
    _assert_same(_step(model, batch, offloader), _step(reference, batch))
    assert offloader.layer_saved_bytes[0] == TINY4.batch_size * TINY4.seq_len * TINY4.width * 2
    offloader.close()


def test_recomputation_writes_nothing_and_reads_the_inputs(spill_dir):
    model = make_gpt(TINY4)
    offloader = _offloader(spill_dir, model, "SSSS")
    torch.manual_seed(0)
    with offloader:
        loss = model(*make_batch(TINY4))
        offloader.flush()
    written = offloader.stats.bytes_written
    loss.backward()
    stats = offloader.stats
    assert written > 0 and stats.bytes_written == written, "the rebuilt internals were offloaded again"
    assert stats.bytes_read + stats.unpacks_from_memory > 0
    offloader.close()


class Mixer(nn.Module):
    """A layer with several tensor inputs: a view, a keyword tensor and a tuple of tensors."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor],
                mode: str = "add") -> torch.Tensor:
        assert mode == "add"
        out = self.dropout(torch.tanh(self.linear(x) * scale + pair[0])) * pair[1]
        return torch.cat([out, out.flip(1)], dim=1)


class ViewChain(nn.Module):
    """Each layer gets a slice (a view) of a tensor saved outside the layers (by ``tanh``), plus keyword and
    nested tensors."""

    def __init__(self, width: int = 64, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Mixer(width) for _ in range(layers))
        self.width = width
        self.seen: list[list[StorageWeakRef]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x, x], dim=1)
        scale = torch.sigmoid(x)
        pair = (x.cos(), torch.sin(x))
        for block in self.blocks:
            view = torch.tanh(h)[:, : self.width]  # tanh saves its output: the view's storage is saved twice
            self.seen.append([StorageWeakRef(t.untyped_storage()) for t in (view, scale, *pair)])
            h = block(view, scale=scale, pair=pair, mode="add")
        return h.square().mean()


def test_view_keyword_and_nested_inputs_are_offloaded_and_exact(spill_dir):
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    reference, model = ViewChain(), ViewChain()
    want = _step(reference, (x,))
    want_x = x.grad.clone()
    x.grad = None
    offloader = _offloader(spill_dir, model, "SSS")
    model.seen.clear()
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    with offloader:
        loss = model(x)
        offloader.flush()
    # Written and dropped: neither the view's storage nor the keyword / nested inputs stay alive.
    assert all(ref.expired() for refs in model.seen for ref in refs), "an S layer's input stayed in memory"
    saved = offloader.layer_saved_bytes
    assert saved[0] >= 2 * 256 * 128 * 4  # tanh's outputs, whole storages the views point into, written once
    assert offloader.stats.bytes_deduplicated > 0
    loss.backward()
    got = (loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()})
    _assert_same(got, want)
    assert torch.equal(x.grad, want_x)
    offloader.close()


class AuxBlock(nn.Module):
    """Appends an auxiliary loss to a list it is called with, and reshapes by a ``torch.Size`` argument."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, aux: list, shape: torch.Size, pair: tuple) -> torch.Tensor:
        h = torch.tanh(self.linear(x.flatten(0, 1))).view(shape)  # AttributeError-free only for a torch.Size
        aux.append(h.square().mean() * shape.numel() / 1e3)
        return x + h * pair[0] + pair[1][0]


class AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([AuxBlock() for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux: list[torch.Tensor] = []
        scale = torch.full((32,), 0.5)
        for block in self.blocks:
            x = block(x, aux, x.shape, (scale, (x[0, 0],)))
        assert len(aux) == len(self.blocks)
        return x.square().mean() + sum(aux)


@pytest.mark.parametrize("code", ["SSSS", "OSRK", "RRRR"])
def test_a_list_a_size_and_nested_tuples_reach_the_layer_as_they_were(spill_dir, code):
    """Note [A recomputation gets the call as it was]: the list the layer appends to is the caller's
    own (a rebuilt copy lost the appends and the loss changed), a torch.Size stays one, and the
    tensors inside plain tuples still reach the layer (and are written)."""
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(3))
    reference, model = AuxNet(), AuxNet()
    model.load_state_dict(reference.state_dict())
    want = _step(reference, (x,))
    offloader = _offloader(spill_dir, model, code)
    _assert_same(_step(model, (x,), offloader), want)
    offloader.close()


def test_recompute_inputs_stay_in_memory(spill_dir):
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
    model = ViewChain()
    offloader = _offloader(spill_dir, model, "RRR")
    with offloader:
        loss = model(x)
        offloader.flush()
    # tanh's output is written (tba drops its reference), yet the view of it that layer 1 got stays alive.
    assert not any(ref.expired() for ref in model.seen[1]), "R holds its inputs, as plain checkpoint does"
    loss.backward()
    offloader.close()


@pytest.mark.parametrize("placement", ["OFFLOADED_RECOMPUTE", "RECOMPUTE", "OFFLOAD", "KEEP"])
def test_the_users_own_checkpoint_around_tba_layers_is_exact(spill_dir, placement):
    """HF's gradient checkpointing wraps each block in a non-reentrant checkpoint of its own: an
    offloaded-recompute layer then runs as recompute (Note [Hook nesting of a recomputed layer]);
    its inputs saved into the user's frame gave silently wrong gradients."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(128, 256), nn.Linear(256, 128)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.l2(torch.relu(self.l1(torch.tanh(x))))  # tanh saves an output of x's shape

    def run(use_tba: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = nn.ModuleList([Block() for _ in range(2)])
        x = torch.randn(256, 128, requires_grad=True)

        def forward() -> torch.Tensor:
            h = x
            for block in blocks:
                h = checkpoint(block, h, use_reentrant=False)
            return h.square().mean()

        if use_tba:
            plan = tba.Plan(decisions=(getattr(tba.Placement, placement),) * 2, window_bytes=8 << 20)
            with tba.Offloader(spill_dir, layers=list(blocks), policy=plan) as off:
                loss = forward()
            loss.backward()
            off.close()
        else:
            forward().backward()
        return [p.grad for p in blocks.parameters()] + [x.grad]

    want, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(32, 32), nn.BatchNorm1d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


@pytest.mark.parametrize("code", ["RKKK", "SKKK", "KKRK", "KSKK", "RSRS"])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_tba_layers_inside_a_user_checkpoint_of_two_blocks_are_exact(spill_dir, code, backward_inside):
    """Note [Inside a user's checkpoint a recomputed layer runs as it is]: the user's checkpoint of two blocks
    recomputed its segment after tba's wrapper was gone, matched the saves by order, and a first
    block recomputed by tba gave silently wrong gradients (BatchNorm's statistics too)."""
    from torch.utils.checkpoint import checkpoint

    def run(use_tba: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        blocks = nn.ModuleList([Residual() for _ in range(4)])
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)

        def forward() -> torch.Tensor:
            h = x
            for i in (0, 2):
                h = checkpoint(lambda t, i=i: blocks[i + 1](blocks[i](t)), h, use_reentrant=False)
            return h.pow(2).mean()

        if use_tba:
            offloader = _offloader(spill_dir, blocks, code)
            with offloader:
                loss = forward()
                if backward_inside:
                    loss.backward()
            if not backward_inside:
                loss.backward()
            offloader.close()
        else:
            forward().backward()
        return [p.grad for p in blocks.parameters()] + [x.grad] + [b.clone() for b in blocks.buffers()]

    want, got = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


class StateBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, state: list) -> torch.Tensor:
        state.append(None)  # the recomputation's own append must not reach the caller's list
        return torch.tanh(self.linear(state[0])) * state[1]


class StateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([StateBlock() for _ in range(4)])
        self.lengths: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = [x, torch.full((16,), 0.5)]
        for block in self.blocks:
            state[0] = block(state)  # the caller reuses its argument list after each call
            del state[2:]
        self.state = state
        return state[0].square().sum()


@pytest.mark.parametrize("code", ["SKKK", "RKKK", "SSSS", "RSRS"])
def test_a_list_the_caller_changes_after_the_call_is_recomputed_as_it_was(spill_dir, code):
    """Note [A recomputation gets the call as it was]: the recomputation read the caller's list as it
    was in backward (a review found SKKK and RKKK silently wrong), and appended to it again."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    reference, model = StateNet(), StateNet()
    model.load_state_dict(reference.state_dict())
    want = _step(reference, (x,))
    offloader = _offloader(spill_dir, model, code)
    _assert_same(_step(model, (x,), offloader), want)
    assert len(model.state) == 2, "the recomputation appended to the caller's list"
    offloader.close()


@pytest.mark.parametrize("code", ["RRR", "SSS"])
def test_under_another_pair_within_tbas_a_planned_layer_is_still_recomputed(spill_dir, code):
    """Note [Inside a user's checkpoint a recomputed layer runs as it is]: only a checkpoint's pair makes
    a layer run unwrapped; under a memory meter's pass-through pair its internals are still dropped."""
    held: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor.nbytes)
        return tensor

    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    reference, model = ViewChain(), ViewChain()
    model.load_state_dict(reference.state_dict())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        want = _step(reference, (x,))
    everything, held[:] = sum(held), []
    offloader = _offloader(spill_dir, model, code)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with offloader, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x)
    loss.backward()
    _assert_same((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}), want)
    assert sum(held) < everything / 2, f"{sum(held)} of {everything} bytes held by the pair: the layers ran unwrapped"
    offloader.close()


class Squash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(h))


class MutatingLoop(nn.Module):
    """Changes each block's input in place after the block ran, inside ``allow_mutation_on_saved_tensors()``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Squash() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            h = x * 1
            for block in self.blocks:
                out = block(h)
                h.mul_(2)  # legal here: the context cloned what was saved of h first
                h = out + h
            loss = h.square().sum()
            loss.backward()  # the context must be active for backward too
        return loss


@pytest.mark.parametrize("code", ["RR", "SS"])
def test_a_recomputed_layers_input_changed_inside_allow_mutation_on_saved_tensors(spill_dir, code):
    """Note [Hook nesting of a recomputed layer]: the pair tba pushed for a recomputed layer's inputs went above the
    context's, which never saw them, and the change raised torch's in-place error in backward; the context's pair
    now takes them, as under plain checkpoint, and the gradients are those without tba."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    reference, model = MutatingLoop(), MutatingLoop()
    model.load_state_dict(reference.state_dict())
    reference.zero_grad(set_to_none=True)
    want = reference(x).detach(), {name: p.grad.clone() for name, p in reference.named_parameters()}
    offloader = _offloader(spill_dir, model, code)
    with offloader:
        loss = model(x)
    _assert_same((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}), want)
    offloader.close()


@pytest.mark.parametrize("code", ["R", "S"])
def test_a_tensor_in_a_list_argument_changed_after_forward_raises(spill_dir, code):
    class ListBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, pair: list) -> torch.Tensor:
            return torch.tanh(self.linear(pair[0])) * pair[1]

    block = ListBlock()
    scale = torch.full((16,), 0.5, requires_grad=True)
    offloader = _offloader(spill_dir, nn.ModuleList([block]), code)
    with offloader:
        loss = block([torch.randn(8, 16), scale * 1.0]).sum()
    with torch.no_grad():
        scale.add_(1.0)  # not saved by anything; the list's own tensor below is
    loss.backward()
    pair = [torch.randn(8, 16), scale * 1.0]
    with offloader:
        loss = block(pair).sum()
    pair[1].add_(1.0)
    with pytest.raises(tba.TbaError, match="input of a recomputed layer .* was changed in place after the layer's forward"):
        loss.backward()
    offloader.close()
