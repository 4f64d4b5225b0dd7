"""Keyword arguments and ``static_argnames`` for automap'd functions, as ``jax.jit`` takes them.

An automap'd function plans for its arguments by position, so a call's keyword arguments are bound
to the positions of the function's parameters (``inspect.signature``); a parameter left out before
one given by keyword, or before a static one, takes its default value there (as an argument:
traced, unless it is static). ``static_argnames`` are turned into positions the same way and join
``static_argnums``; a static parameter left out takes its default.

>>> def step(params, batch, scale=2.0, train=True):
...     return params
>>> binder = ArgumentBinder(step, static_argnums=(), static_argnames=("train",))
>>> binder.static_argnums
(3,)
>>> binder.bind((1,), {"batch": 2, "train": False})
(1, 2, 2.0, False)
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

__all__ = ["ArgumentBinder"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and the like
        return None


class ArgumentBinder:
    """Binds a call's ``(args, kwargs)`` to positional arguments of ``fn``."""

    def __init__(self, fn: Callable, static_argnums: Sequence[int], static_argnames: str | Sequence[str] | None):
        self.name = getattr(fn, "__name__", "the function")
        self.signature = _signature(fn)
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames or ())
        positions = list(static_argnums)
        for name in names:
            positions.append(self._position(name, "static_argnames"))
        self.static_argnums = tuple(sorted(set(positions)))

    def _positional(self) -> list[inspect.Parameter]:
        assert self.signature is not None
        return [p for p in self.signature.parameters.values() if p.kind in _POSITIONAL]

    def _position(self, name: str, option: str) -> int:
        if not isinstance(name, str):
            raise TypeError(f"{option} must be parameter names (strings), got {name!r}")
        if self.signature is None:
            raise TypeError(f"{option}={name!r}: {self.name} has no signature to look names up in; use static_argnums")
        params = self.signature.parameters
        if name not in params:
            raise ValueError(f"{option} names {name!r}, but {self.name} has no such parameter; its parameters are "
                             f"{list(params)}")
        if params[name].kind not in _POSITIONAL:
            raise ValueError(
                f"{option} names {name!r}, a {params[name].kind.description} parameter of {self.name}; an automap'd "
                "function takes its arguments by position: make it an ordinary parameter, or bind it beforehand "
                "with functools.partial"
            )
        return [p.name for p in self._positional()].index(name)

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """The positional arguments equivalent to ``fn(*args, **kwargs)``."""
        if self.signature is None:
            if kwargs:
                raise TypeError(f"{self.name} got keyword arguments {sorted(kwargs)} but has no signature to bind "
                                "them with; pass them by position")
            return tuple(args)
        positions = [self._position(name, "keyword argument") for name in kwargs]
        positional = self._positional()
        # through the last keyword, and the last static parameter (a static one left out takes its default)
        last = max(positions + [i for i in self.static_argnums if i < len(positional)], default=-1)
        if not kwargs and last < len(args):
            return tuple(args)
        bound = self.signature.bind(*args, **kwargs)  # Python's own TypeError for a missing or doubled argument
        out = list(args)
        for p in positional[len(args): last + 1]:
            out.append(bound.arguments[p.name] if p.name in bound.arguments else p.default)
        return tuple(out)
