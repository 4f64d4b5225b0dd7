"""The progress bar of a long search: tqdm over the episodes, then the final steps by name."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

BAR_DELAY_S = 2.0  # a search that ends sooner shows no progress bar
FINAL_STEPS = ("polish", "sweep", "refine")  # after the episodes, each one step of the bar


class Progress:
    """A tqdm bar over the episodes and then the final steps, named as they run; shown on a
    terminal (or always, with ``enabled=True``) once the search has run ``BAR_DELAY_S``.

    >>> bar = Progress(episodes=2, enabled=False)  # off: every call does nothing
    >>> bar.episode(best=1.5); bar.episode(best=1.7); bar.step("polish", episodes_run=2); bar.close()
    """

    def __init__(self, episodes: int, enabled: bool | None):
        shown = enabled or (enabled is None and sys.stderr.isatty())
        self._bar = tqdm(total=episodes + len(FINAL_STEPS), desc="automap search", delay=BAR_DELAY_S,
                         leave=False) if shown else None
        self._t0, self._step = time.perf_counter(), None

    def episode(self, best: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix(best=f"{best:.3f}", refresh=False)
            self._bar.update(1)

    def step(self, name: str, episodes_run: int) -> None:
        """The final step ``name`` begins (the one before it, if any, is done)."""
        if self._bar is None:
            return
        if self._step is None:  # a time budget may have ended the episodes early
            self._bar.total = episodes_run + len(FINAL_STEPS)
        else:
            self._bar.update(1)
        self._step = name
        self._bar.set_description(f"automap search: {name}", refresh=False)
        if time.perf_counter() - self._t0 >= BAR_DELAY_S:  # tqdm's refresh() would not wait
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.close()
