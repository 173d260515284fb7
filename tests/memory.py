"""Measuring the controller's memory in tests: the peak RSS of this process while a block runs."""

from __future__ import annotations

import threading
from typing import Any

import psutil


class PeakRss:
    """Samples this process's resident memory every millisecond in a thread while the block runs;
    ``growth`` is the peak above the level at the start."""

    def __enter__(self) -> PeakRss:
        self._process = psutil.Process()
        self.start = self.peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._sampler.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start
