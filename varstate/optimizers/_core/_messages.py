"""Messages for misspelled optimizer arguments: the closest valid names, and Keras's spellings mapped to ours.

An optimizer is a dataclass; its generated ``__init__`` raises a bare
``TypeError: __init__() got an unexpected keyword argument 'beta_1'``.
`checked_new`, called by ``Optimizer.__new__``, runs first with the same
arguments and raises instead a TypeError naming the class, the closest
fields (`difflib`) and all of them.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

# Keras (and tf.keras) keywords whose TF v1 counterpart is spelled too differently for difflib to find.
_ALIASES = {
    "lr": "learning_rate",
    "nesterov": "use_nesterov",
    "rho": "decay",
    "initial_accumulator": "initial_accumulator_value",
}

def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init) if dataclasses.is_dataclass(cls) else ()


def unexpected_keyword(cls: type, keyword: str) -> TypeError:
    """The TypeError for ``cls(keyword=...)`` when `cls` has no such field: the closest field names, then all.

    >>> from varstate.optimizers import Adam
    >>> print(unexpected_keyword(Adam, "beta_1"))  # doctest: +ELLIPSIS
    Adam() got an unexpected keyword argument 'beta_1': did you mean beta1? Adam's arguments are learning_rate, ...
    """
    fields = _init_fields(cls)
    close = [_ALIASES[keyword]] if _ALIASES.get(keyword) in fields else []
    if not close:  # the best-scoring names (ties kept): beta_1 is beta1, not beta2
        scores = {n: difflib.SequenceMatcher(None, keyword, n).ratio() for n in fields}
        best = max(scores.values(), default=0.0)
        close = [n for n, score in scores.items() if score == best and score >= 0.6]
    hint = f": did you mean {' or '.join(close)}?" if close else "."
    known = f" {cls.__name__}'s arguments are {', '.join(fields)}." if fields else ""
    return TypeError(f"{cls.__name__}() got an unexpected keyword argument {keyword!r}{hint}{known}")


def checked_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``__new__`` for optimizer dataclasses: a keyword that is no field raises `unexpected_keyword`'s TypeError.

    >>> import dataclasses
    >>> from varstate.optimizers import GradientDescent
    >>> @dataclasses.dataclass(frozen=True)
    ... class Hooked(GradientDescent):
    ...     __new__ = checked_new
    >>> Hooked(lr=0.1)
    Traceback (most recent call last):
    TypeError: Hooked() got an unexpected keyword argument 'lr': did you mean learning_rate? ...
    """
    fields = _init_fields(cls) if kwargs else ()
    for keyword in kwargs:
        if fields and keyword not in fields:
            raise unexpected_keyword(cls, keyword)
    return object.__new__(cls)
