"""Checks of :func:`automap.automap`'s options, each failing with an error that names the option,
what was wrong and how to fix it (the searchers check their own fields, ``search/base.py``).

>>> import automap, tactics
>>> mesh = automap.make_mesh({"data": 2})
>>> automap.partition(lambda x: x, mesh=mesh, tactics=[tactics.data_parallel("dta")])
Traceback (most recent call last):
...
ValueError: tactics: data_parallel('dta') names mesh axis 'dta', but the mesh has axes ('data',); ...
"""
from __future__ import annotations

import numbers
from typing import Any, Sequence, get_args

from jax.sharding import Mesh

from automap.emit import PinPolicy

__all__ = ["check_argnums", "check_flag", "check_memory_budget", "check_pins", "tactic_list"]


def _leaves(tactic: Any) -> list[Any]:
    inner = getattr(tactic, "tactics", None)  # a schedule
    if isinstance(inner, (tuple, list)):
        return [leaf for t in inner for leaf in _leaves(t)]
    return [tactic]


def tactic_list(tactics: Any, mesh: Mesh) -> tuple[Any, ...] | None:
    """``tactics`` as a tuple (one tactic alone is accepted), each checked: callable, and every
    mesh axis it names (``axis``) is one of the mesh's."""
    if tactics is None:
        return None
    if callable(tactics):  # one tactic (or schedule) instead of a list
        tactics = (tactics,)
    elif isinstance(tactics, (str, bytes)) or not isinstance(tactics, Sequence):
        raise TypeError(f"tactics must be a list of tactics (e.g. [tactics.data_parallel('data')]), got {tactics!r}")
    tactics = tuple(tactics)
    names = tuple(str(a) for a in mesh.axis_names)
    for t in tactics:
        if not callable(t):
            raise TypeError(
                f"tactics must be tactic objects, got {t!r}: use e.g. tactics.data_parallel({t!r}) or "
                "tactics.manual({regex: PartitionSpec})"
            )
        for leaf in _leaves(t):
            axis = getattr(leaf, "axis", None)
            if isinstance(axis, str) and axis not in names:
                raise ValueError(
                    f"tactics: {getattr(leaf, 'name', type(leaf).__name__)}({axis!r}) names mesh axis {axis!r}, but "
                    f"the mesh has axes {names}; use one of those (automap.make_mesh({{{axis!r}: n, ...}}) adds one)"
                )
    return tactics


def check_memory_budget(memory_budget: Any) -> None:
    """``memory_budget``: None, a byte count, or a string with a unit ('16GiB')."""
    if memory_budget is None:
        return
    from automap.cost import parse_bytes

    try:
        parse_bytes(memory_budget)
    except (TypeError, ValueError) as e:
        raise type(e)(f"memory_budget={memory_budget!r}: {e}") from None


def check_pins(pins: Any) -> None:
    """``pins``: one of the pin policies of :func:`automap.emit.pinned_values`."""
    allowed = get_args(PinPolicy)
    if not isinstance(pins, str) or pins not in allowed:
        raise ValueError(f"pins={pins!r}: pins must be one of {list(allowed)} (which intermediates get sharding "
                         "constraints; the default is 'plan')")


def check_flag(name: str, value: Any) -> bool:
    """A yes/no option (``keep_user_remat``): True or False.

    >>> check_flag("keep_user_remat", "yes")
    Traceback (most recent call last):
    ...
    TypeError: keep_user_remat='yes': keep_user_remat must be True or False
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: {name} must be True or False")
    return value


def check_argnums(name: str, argnums: Any) -> tuple[int, ...]:
    """``static_argnums`` / ``donate_argnums``: an int or a sequence of ints >= 0, as a tuple."""
    if isinstance(argnums, numbers.Integral) and not isinstance(argnums, bool):
        argnums = (argnums,)
    if not isinstance(argnums, Sequence) or isinstance(argnums, str) or not all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in argnums):
        raise TypeError(f"{name}={argnums!r}: {name} must be argument positions, ints >= 0 (e.g. {name}=(0,))")
    return tuple(int(i) for i in argnums)


def check_argnums_in_range(name: str, argnums: Sequence[int], n_args: int) -> None:
    """Every position in ``argnums`` names one of the ``n_args`` arguments given."""
    for i in argnums:
        if not i < n_args:
            raise ValueError(
                f"{name}={tuple(argnums)} names argument {i}, but {n_args} arguments were given; {name} count "
                "positional arguments from 0"
            )
