"""Rules shared by the configs users write: the bounds of a model spec, and pydantic's
refusals as imgret errors (one line naming each bad field, no traceback).

Configs that users write (training options, checkpoint specs) are pydantic dataclasses; what
they refuse must reach the user as an :class:`~imgret.errors.ImgretError`, which the CLI
prints as one line and the service maps to a 4xx.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from imgret.errors import ImgretError

# Bounds of a model spec, shared by checkpoints (imgret.checkpoint.ModelSpec) and the training
# config, kept here because this module does not import torch (a training option is checked
# before torch loads). They admit every size the project trains and serves (8..224 px, dim
# 8..512) with room above (ViT fine-tuning at 384/448 px; 4096-d embeddings).
MAX_DIM = 4096
MIN_IMAGE_SIZE = 8
MAX_IMAGE_SIZE = 512


def describe(exc: ValidationError) -> str:
    """``field: problem (got value)`` per error, ``; ``-joined; a check over several fields
    gives its own message."""
    problems = []
    for error in exc.errors():
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            field = ".".join(map(str, error["loc"]))
            message = f"{field}: {message} (got {error['input']!r})"
        problems.append(message)
    return "; ".join(problems)


def raising(error: type[ImgretError]) -> Callable[[type], type]:
    """Class decorator for a pydantic dataclass: a bad value raises ``error`` (with
    :func:`describe`'s message) instead of pydantic's ``ValidationError``.

    Apply it above ``@pydantic.dataclasses.dataclass``; ``dataclasses.replace`` goes through the
    same check.
    """

    def decorate(cls: type) -> type:
        validate = cls.__init__

        @functools.wraps(validate)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                validate(self, *args, **kwargs)
            except ValidationError as exc:
                raise error(f"bad {cls.__name__}: {describe(exc)}") from None

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate
