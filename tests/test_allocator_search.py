"""tba._allocator_search: where a caching allocator's library is, as a path LD_PRELOAD can carry."""

from __future__ import annotations

import pytest

from tba import _allocator_search, allocator
from tba.errors import TbaConfigError

LIBRARY = "libtcmalloc_minimal.so.4"


@pytest.fixture
def places(tmp_path, monkeypatch):
    """An environment folder whose path holds a space (a venv in "My Projects"), and a plain system folder."""
    spaced, plain = tmp_path / "my env" / "lib", tmp_path / "lib"
    for folder in (spaced, plain):
        folder.mkdir(parents=True)
    (spaced / LIBRARY).touch()
    monkeypatch.setattr(_allocator_search, "_environment_dirs", lambda: [str(spaced)])
    monkeypatch.setattr(_allocator_search, "_ldconfig_paths", lambda: {})
    monkeypatch.setattr(_allocator_search, "system_dirs", lambda: [str(plain)])
    return spaced, plain


def test_a_library_whose_path_ld_preload_would_split_is_passed_over(places):
    """The loader splits LD_PRELOAD at spaces and colons, with no escape: such a path preloaded nothing."""
    spaced, plain = places
    (plain / LIBRARY).touch()
    assert _allocator_search.find_library("tcmalloc") == str(plain / LIBRARY)
    env, _ = allocator.launch_env("tcmalloc", {})
    assert env["LD_PRELOAD"] == str(plain / LIBRARY)


def test_an_allocator_found_only_at_such_a_path_is_an_error_saying_why(places):
    assert _allocator_search.find_library("tcmalloc") is None
    with pytest.raises(TbaConfigError, match="space or colon"):
        allocator.resolve("tcmalloc")
