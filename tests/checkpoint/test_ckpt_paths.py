"""Lazy saves and loads that name one checkpoint by different paths, and saves of two processes racing to publish."""

from __future__ import annotations

import time

import pytest
import torch

import tba.checkpoint as tc
from tba.checkpoint import _layout

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled")


def _slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    write_image = _layout.write_image

    def slow_write_image(*args, **kwargs):
        time.sleep(0.5)
        return write_image(*args, **kwargs)

    monkeypatch.setattr(_layout, "write_image", slow_write_image)


@pytest.mark.parametrize("spelling", ["linked_parent", "link_to_checkpoint"])
def test_a_load_by_another_spelling_of_the_path_waits_for_the_lazy_save(tmp_path, monkeypatch, spelling):
    """Note [One checkpoint, many spellings of its path]: a load through a symbolic link read the checkpoint before
    the save, silently (helper-153)."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    path = str(real / "step")
    load_path = str(tmp_path / "link" / "step") if spelling == "linked_parent" else str(tmp_path / "latest")
    if spelling == "link_to_checkpoint":
        (tmp_path / "latest").symlink_to(real / "step")
    model = torch.nn.Linear(512, 512)
    with tc.LazyCheckpointer() as checkpointer:
        with torch.no_grad():
            model.weight.fill_(1.0)
        checkpointer.save(tc.state_dict(model), path).wait()
        with torch.no_grad():
            model.weight.fill_(2.0)
        _slow_writes(monkeypatch)
        handle = checkpointer.save(tc.state_dict(model), path)
        fresh = torch.nn.Linear(512, 512)
        tc.load(load_path, fresh)
        assert handle.done()
    assert torch.equal(fresh.weight, model.weight)
