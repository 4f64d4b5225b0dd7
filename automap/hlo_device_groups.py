"""The device groups of a parsed HLO collective (:mod:`automap.hlo`): ``replica_groups`` in every
syntax XLA prints, and a collective-permute's ``source_target_pairs``."""
from __future__ import annotations

import math
import re

import numpy as np

from automap.hlo import Instruction, int_list

__all__ = ["replica_groups", "source_target_pairs"]

_IOTA = re.compile(r"^\[([\d,\s]*)\]<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?$")


def replica_groups(inst: Instruction, num_devices: int | None = None) -> list[list[int]] | None:
    """The device groups of a collective, in any syntax XLA prints; None if it has none.

    Explicit ``{{0,1},{2,3}}``; empty ``{}`` (all devices: one group of ``num_devices``, or
    ``[]`` when that is unknown); iota ``[2,4]<=[8]`` and ``[4,2]<=[2,4]T(1,0)``; and mesh
    axes ``mesh['a'=2,'b'=4] {'b'}``, optionally with ``device_ids=(...)`` and sub-axes
    ``'b':(1)2``.
    """
    text = inst.attrs.get("replica_groups")
    if text is None:
        return None
    try:
        return _parse_groups(text.strip(), inst.attrs.get("device_ids"), num_devices)
    except (AttributeError, IndexError, ValueError) as e:  # a regex did not match, bad sizes
        raise ValueError(f"cannot parse replica_groups={text} ({e}) in: {inst.line}") from e


def _parse_groups(text: str, device_ids: str | None,
                  num_devices: int | None) -> list[list[int]]:
    if text.startswith("mesh"):
        return _mesh_groups(text, device_ids)
    if m := _IOTA.match(text.replace(" ", "")):
        shape, reshape = int_list(m.group(1)), int_list(m.group(2))
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if m.group(3) is not None:
            ids = ids.transpose(int_list(m.group(3)))
        return ids.reshape(shape).tolist()
    if text.startswith("{"):
        groups = [int_list(g) for g in re.findall(r"\{([^{}]*)\}", text[1:-1])]
        if groups:
            return groups
        return [list(range(num_devices))] if num_devices else []
    raise ValueError("unknown syntax")


def _mesh_groups(text: str, device_ids: str | None) -> list[list[int]]:
    # mesh['a'=2,'b'=4] {'b'}   |   mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}
    axes_text = re.match(r"mesh\[([^\]]*)\]", text).group(1)
    axes = [(n.strip().strip("'\""), int(s)) for n, s in
            (a.rsplit("=", 1) for a in axes_text.split(",") if a.strip())]
    tail = device_ids if device_ids is not None else text
    group_text = re.search(r"\{([^{}]*)\}\s*$", tail).group(1)
    n = math.prod(s for _, s in axes)
    devices = np.arange(n)
    if device_ids is not None:
        ids_text = tail[:tail.rindex("{")].strip().removeprefix("(").removesuffix(")")
        devices = _device_array(ids_text, n)
    refs = []  # (mesh axis index, pre_size or None, size)
    for ref in re.findall(r"'[^']*'(?::\(\d+\)\d+)?|[\w.\-]+(?::\(\d+\)\d+)?", group_text):
        m = re.match(r"'?([^':]*)'?(?::\((\d+)\)(\d+))?$", ref)
        idx = [a for a, _ in axes].index(m.group(1))
        refs.append((idx, int(m.group(2)) if m.group(2) else None,
                     int(m.group(3)) if m.group(3) else axes[idx][1]))
    # split each mesh axis at its sub-axis boundaries (major to minor), then group the refs
    dims, ref_dim = [], {}
    for idx, (_, size) in enumerate(axes):
        subs = [(pre, sz) for i, pre, sz in refs if i == idx and pre is not None]
        bounds = sorted({1, size, *(p for p, _ in subs), *(p * s for p, s in subs)})
        base = len(dims)
        dims += [b // a for a, b in zip(bounds, bounds[1:], strict=False)] or [1]
        for i, pre, _ in refs:
            if i == idx:
                ref_dim[(i, pre)] = base + (bounds.index(pre) if pre is not None else 0)
    grouped = [ref_dim[(i, pre)] for i, pre, _ in refs]
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    size = math.prod(dims[d] for d in grouped)
    return devices.reshape(dims).transpose(order).reshape(-1, size).tolist()


def _device_array(text: str, n: int) -> np.ndarray:
    m = re.match(r"^\[([\d,\s]*)\](?:<=\[([\d,\s]*)\])?(?:T\(([\d,\s]*)\))?$", text.strip())
    if m is None:  # an explicit list of ids
        return np.array(int_list(text))
    reshape = int_list(m.group(2) if m.group(2) is not None else m.group(1))
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if m.group(3) is not None:
        ids = ids.transpose(int_list(m.group(3)))
    return ids.reshape(n)


def source_target_pairs(inst: Instruction) -> list[list[int]] | None:
    text = inst.attrs.get("source_target_pairs")
    return None if text is None else [int_list(p) for p in re.findall(r"\{([^{}]*)\}", text)]
