"""``Accepts[Held, Given]``: how a dataclass field that takes more than it holds is annotated for type checkers.

Note [A field that takes more than it holds] in ``tba/config.py`` says why and how.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

_Held = TypeVar("_Held", covariant=True)
_Given = TypeVar("_Given", contravariant=True)


class Accepts(Protocol[_Held, _Given]):
    """A field read as ``_Held`` and given as ``_Given`` (``Accepts[int, int | str]``: ``"2GiB"`` in, bytes out).

    Only annotations name it, and tba's annotations are never evaluated (``from __future__ import annotations``):
    at run time the field is a plain attribute, as before. Type checkers treat a field whose type has ``__set__``
    as a descriptor: the dataclass's ``__init__`` takes what ``__set__`` takes, and reading gives what ``__get__``
    returns.
    """

    def __get__(self, instance: object, owner: type | None = None) -> _Held: ...

    def __set__(self, instance: object, value: _Given) -> None: ...
