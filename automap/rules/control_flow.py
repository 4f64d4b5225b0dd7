"""Control flow. ``scan``, ``cond`` and ``while`` keep their bodies as regions whose inputs and
outputs are tied to the op's operands and results by :mod:`automap.ir.lower` (the stacked dim
of scanned inputs and outputs is blocked). Calls (jit, custom_jvp/vjp, remat) are inlined.
Names listed here are handled structurally and count as covered."""
from __future__ import annotations

from automap import _compat

STRUCTURAL = frozenset({"scan", "cond", "while"}) | frozenset(_compat.INLINE_CALLS)
