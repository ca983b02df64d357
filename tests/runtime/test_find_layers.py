"""``layers=model`` (``tba.find_layers``) on models whose blocks sit in a ``ModuleDict`` or in lists of lists.

torchtitan keeps its blocks in ``nn.ModuleDict`` (``layers["0"]``, ...), and many models keep a
``nn.ModuleList`` of ``nn.ModuleList([attention, feed_forward])`` pairs. Neither container is ever called, so
the blocks are the modules inside them (Note [Containers that are never called] in ``tba/runtime/_layers.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tba

WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class Net(nn.Module):
    """Embedding, ``layers`` called in order (their leaves, whatever containers hold them), head."""

    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.embed, self.layers, self.head = nn.Embedding(50, WIDTH), layers, nn.Linear(WIDTH, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in leaves(self.layers):
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def leaves(module: nn.Module) -> list[nn.Module]:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [leaf for child in module.children() for leaf in leaves(child)]
    return [module]


def titan() -> nn.ModuleDict:
    return nn.ModuleDict({str(i): Block() for i in range(4)})


def pairs() -> nn.ModuleList:
    return nn.ModuleList([nn.ModuleList([Attention(), Block()]) for _ in range(3)])


def stacks() -> nn.ModuleDict:
    return nn.ModuleDict({"encoder": nn.ModuleDict({"blocks": nn.ModuleList([Block() for _ in range(2)])}),
                          "decoder": nn.ModuleDict({"blocks": nn.ModuleList([Block() for _ in range(3)])})})


@pytest.mark.parametrize("build", [titan, pairs, stacks])
def test_find_layers_returns_the_blocks_inside_containers_never_called(build):
    model = Net(build())
    assert tba.find_layers(model) == leaves(model.layers)
    assert tba.find_layers(model.layers) == leaves(model.layers)


def test_a_list_of_lists_given_as_layers_is_its_blocks():
    model = Net(pairs())
    offloader = tba.Offloader(layers=model.layers, policy="offload")
    assert offloader.layers == leaves(model.layers)
    offloader.close()


def test_lists_of_callable_blocks_are_found_as_before():
    sequential = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    assert tba.find_layers(sequential) == []
    listed = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    assert tba.find_layers(nn.Sequential(nn.Linear(4, 4), listed[0])) == []
    assert tba.find_layers(Net(listed)) == list(listed)
    mixed = nn.ModuleDict({"a": nn.ModuleList([Block(), Block()]), "b": Block()})  # a list beside a block: not one kind
    assert tba.find_layers(Net(mixed)) == list(mixed["a"])


@pytest.mark.parametrize("policy", ["recompute", "offload"])
@pytest.mark.parametrize("build", [titan, pairs, stacks])
def test_layers_model_places_blocks_inside_containers_never_called(spill_dir, build, policy):
    """Before: find_layers gave [] for a ModuleDict of blocks (a pinned plan refused: 'policy Plan needs the model's
    layers'; the adaptive default never planned) and the inner ModuleLists of a list of lists, whose hooks never ran
    (a plan per block refused: 'the plan has 6 decisions but layers= has 3 layers'; nothing tagged)."""
    tokens = torch.randint(50, (4, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Net(build())
    model(tokens).backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    blocks = len(leaves(model.layers))
    plan = tba.Plan((policy,) * blocks, window_bytes=1 << 20)
    offloader = tba.Offloader(spill_dir, layers=model, policy=plan, min_offload_bytes=0, backend="threads")
    with offloader:
        loss = model(tokens)
    loss.backward()
    offloader.close()
    assert all(torch.equal(want[name], p.grad) for name, p in model.named_parameters())
    if policy == "offload":  # every block ran as a layer and tagged what it saved
        assert sorted(key for key in offloader.layer_saved_bytes if key is not None) == list(range(blocks))


class Attributes(nn.Module):
    """Repeated blocks held as attributes, called in a loop: no container for find_layers to find."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, WIDTH), nn.Linear(WIDTH, 50)
        self.b0, self.b1, self.b2 = Block(), Block(), Block()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in (self.b0, self.b1, self.b2):
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


def test_a_module_without_repeated_blocks_given_as_layers_finds_them_during_forward(spill_dir):
    """layers=model where find_layers finds nothing gave no layers and no finder: the adaptive default profiled
    nothing and offloaded every step for good, silently (a bare context found the blocks)."""
    model = Attributes()
    assert tba.find_layers(model) == []
    tokens = torch.randint(50, (4, 16), generator=torch.Generator().manual_seed(1))
    offloader = tba.Offloader(spill_dir, layers=model, min_offload_bytes=0, backend="threads")
    for _ in range(5):
        with offloader:
            loss = model(tokens)
        loss.backward()
    offloader.close()
    assert offloader.discovered_layers == [model.b0, model.b1, model.b2]
    assert offloader.plan is not None and len(offloader.plan.decisions) == 3


@pytest.mark.parametrize("policy", ["keep", tba.Plan(("keep",) * 3, window_bytes=0)])
def test_a_plan_for_a_module_without_repeated_blocks_names_the_fix(spill_dir, policy):
    """Refused as "policy Plan needs the model's layers: pass layers=model", which the user had done."""
    with pytest.raises(tba.TbaConfigError, match=r"layers=Attributes holds no repeated blocks tba.find_layers finds "
                                                 r"\(a ModuleList, Sequential or ModuleDict of modules of one class\); "
                                                 r"pass its blocks as a list: layers=\[\.\.\.\]"):
        tba.Offloader(spill_dir, layers=Attributes(), policy=policy)


@pytest.mark.parametrize("layers", [lambda m: list(m.parameters()), lambda m: torch.zeros(100, 100)])
def test_layers_of_tensors_are_refused_in_one_short_line(layers):
    """layers=list(model.parameters()) printed every parameter's values, lines of them, into the message."""
    model = Net(titan())
    with pytest.raises(tba.TbaConfigError) as raised:
        tba.Offloader(layers=layers(model))
    message = str(raised.value)
    assert "\n" not in message and len(message) < 300, message
    assert message.startswith("layers must contain nn.Module objects, got ") and "layers=model" in message


@pytest.mark.parametrize("unordered", ["set", "dict"])
def test_layers_given_in_no_forward_order_are_refused_naming_the_fix(unordered):
    """A set of blocks was taken in its iteration order, by object address: a pinned plan's decisions went to
    other blocks than the user's, differently in every run; a dict gave its keys, refused as 'got str'."""
    blocks = [torch.nn.Linear(4, 4) for _ in range(3)]
    layers = set(blocks) if unordered == "set" else {f"block{i}": block for i, block in enumerate(blocks)}
    with pytest.raises(tba.TbaConfigError, match=rf"layers is a {unordered}, .* pass a list of the blocks in forward "
                                                 r"order"):
        tba.Offloader(layers=layers)


def test_parameters_partitioned_by_zero3_are_counted_at_their_full_size():
    """DeepSpeed ZeRO-3 leaves each parameter an empty tensor between gathers, its size in ``ds_numel``: every container
    held 0 parameters, so find_layers took the first one met, here two embeddings before the blocks, and
    ``TbaDeepSpeed(engine)`` under ZeRO-3 tagged and planned the embeddings (Note [Parameters partitioned away])."""
    model = Net(nn.ModuleList([Block() for _ in range(3)]))
    model.embed = nn.ModuleList([nn.Embedding(50, WIDTH), nn.Embedding(16, WIDTH)])
    for parameter in model.parameters():  # as deepspeed.zero.Init partitions them, world size 1
        parameter.ds_numel = parameter.numel()
        parameter.data = torch.empty(0)
    assert tba.find_layers(model) == list(model.layers)
