"""Byte counts written as an int or a string with a unit (``"16GiB"``, ``"80GB"``): device memory,
memory budgets."""
from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """A byte count from an int or a string with a unit (KB/MB/GB/TB are powers of 1000, KiB/...
    of 1024; case-insensitive).

    >>> parse_bytes("16GiB"), parse_bytes("80GB"), parse_bytes("1.5 KiB"), parse_bytes(4096)
    (17179869184, 80000000000, 1536, 4096)
    """
    if isinstance(value, bool):
        raise TypeError(f"byte count must be an int or a string like '16GiB', got {value!r}")
    if isinstance(value, (int, np.integer)):
        n = int(value)
    elif isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"byte count {value!r} is not a whole number; pass an int or '16GiB'")
        n = int(value)
    elif isinstance(value, str):
        m = _BYTES_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot parse byte count {value!r}; write a number with an optional "
                             f"unit, one of {sorted(set(_UNITS) - {''})} (e.g. '16GiB', '80GB')")
        n = round(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"byte count must be an int or a string like '16GiB', got {value!r}")
    if n < 0:
        raise ValueError(f"byte count must be >= 0, got {value!r}")
    return n
