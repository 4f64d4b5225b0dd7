"""Control flow. ``scan``, ``cond`` and ``while`` keep their bodies as regions whose inputs and
outputs are tied to the op's operands and results by :mod:`automap.ir.lower` (the stacked dim
of scanned inputs and outputs is blocked). Calls (jit, custom_jvp/vjp, remat) are inlined.
Names listed here are handled structurally and count as covered."""
from __future__ import annotations

from automap import _compat
from automap.rules.traits import CONTROL_FLOW, declare

STRUCTURAL = frozenset({"scan", "cond", "while"}) | frozenset(_compat.INLINE_CALLS)
declare("scan", "cond", "while", traits=CONTROL_FLOW)  # their regions count their own ops
