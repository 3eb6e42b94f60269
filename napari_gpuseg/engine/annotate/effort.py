"""How hard the last objects of an image were to get with the annotator's model: per commit,
whether its first mask was rated unsure and how many corrective prompts followed. The
annotator suggests adapting the model when the recent ones were hard."""
from __future__ import annotations

from collections import deque


class CommitEffort:
    """The last :attr:`RECENT` commits of an image: ``(unsure, corrections)`` each.

    A commit is *hard* when its first mask was rated unsure (a first click under the unsure
    threshold) or it took at least :attr:`CORRECTIONS` corrective prompts; :meth:`struggling`
    speaks once :attr:`HARD` of the last :attr:`RECENT` commits were hard."""

    RECENT = 3
    HARD = 2
    CORRECTIONS = 2

    def __init__(self) -> None:
        self._recent: deque = deque(maxlen=self.RECENT)

    def record(self, unsure: bool, corrections: int) -> None:
        self._recent.append((bool(unsure), max(0, int(corrections))))

    def clear(self) -> None:
        self._recent.clear()

    def __len__(self) -> int:
        return len(self._recent)

    def struggling(self) -> str | None:
        """Why the recent commits look hard (a few words), or None."""
        if len(self._recent) < self.RECENT:
            return None
        unsure = any(u for u, _c in self._recent)
        corrected = any(c >= self.CORRECTIONS for _u, c in self._recent)
        hard = sum(u or c >= self.CORRECTIONS for u, c in self._recent)
        if hard < self.HARD:
            return None
        what = " or ".join(w for w, on in (("began unsure", unsure),
                                            (f"needed {self.CORRECTIONS}+ corrections", corrected)) if on)
        return f"{hard} of the last {self.RECENT} {what}"
