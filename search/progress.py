"""The progress bar of a long search: tqdm over the episodes, then the stages after the tree by name."""
from __future__ import annotations

import sys
import time
from typing import Sequence

from tqdm import tqdm

BAR_DELAY_S = 2.0  # a search that ends sooner shows no progress bar


class Progress:
    """A tqdm bar over the episodes and then the stages after them (:meth:`steps`), named as they
    run; shown on a terminal (or always, with ``enabled=True``) once the search has run
    ``BAR_DELAY_S``.

    >>> bar = Progress(episodes=2, enabled=False)  # off: every call does nothing
    >>> bar.steps(["polish"]); bar.episode(best=1.5); bar.episode(best=1.7); bar.step("polish", episodes_run=2)
    >>> bar.close()
    """

    def __init__(self, episodes: int, enabled: bool | None):
        shown = enabled or (enabled is None and sys.stderr.isatty())
        self._bar = tqdm(total=episodes, desc="automap search", delay=BAR_DELAY_S, leave=False) if shown else None
        self._t0, self._step, self._steps = time.perf_counter(), None, 0

    def steps(self, names: Sequence[str]) -> None:
        """The stages that follow the episodes, each one step of the bar."""
        self._steps = len(names)
        if self._bar is not None:
            self._bar.total += self._steps

    def episode(self, best: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(best=f"{best:.3f}", refresh=False)
            self._bar.update(1)

    def step(self, name: str, episodes_run: int) -> None:
        """The stage ``name`` begins (the one before it, if any, is done)."""
        if self._bar is None:
            return
        if self._step is None:  # a time budget may have ended the episodes early
            self._bar.total = episodes_run + self._steps
            self._bar.n = episodes_run
        else:
            self._bar.update(1)
        self._step = name
        self._bar.set_description(f"automap search: {name}", refresh=False)
        if time.perf_counter() - self._t0 >= BAR_DELAY_S:  # tqdm's refresh() would not wait
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            if self._step is not None:
                self._bar.update(1)
            self._bar.close()
