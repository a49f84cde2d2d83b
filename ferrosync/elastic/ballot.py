"""``LeaveBallot``: an elastic member's vote to leave, riding in its strategy's one
collective per sync (``Strategy.carry``), so after that round every member knows how
many of the round's members voted to leave, at no extra round (docs/elastic.md#the-trainer).
"""

from __future__ import annotations

import torch

__all__ = ["LeaveBallot"]


class LeaveBallot:
    """One float64 element carried beside a strategy's tensors: 1 from a member that
    votes to leave, 0 from one that stays; the round averages it with the tensors.

    ``vote``: set it (any thread, a signal handler included) to leave at the next
    sync. After each sync that carried the ballot: ``voted``, whether this member's
    vote was in it, and ``voters``, how many of the round's contributors voted to
    leave (the same on every member)."""

    def __init__(self) -> None:
        self.vote, self.voted, self.voters = False, False, 0
        self._box: torch.Tensor | None = None

    def tensors(self, beside: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[vote]``, on the device of ``beside`` and in a dtype bucket of its own (so a
        lossy wire codes it apart from them); the same tensor every sync on a device."""
        device = beside[0].device if beside else torch.device("cpu")
        if self._box is None or self._box.device != device:
            self._box = torch.zeros(1, dtype=torch.float64, device=device)
        self.voted = bool(self.vote)
        self._box.fill_(1.0 if self.voted else 0.0)
        return [self._box]

    def arrived(self, sync) -> None:
        """After the sync that carried the ballot: ``voters``, the average of the votes
        times the round's contributors, rounded (a lossy wire's error is far below a
        half vote)."""
        if self._box is not None:
            self.voters = round(float(self._box[0]) * len(sync.contributors))
