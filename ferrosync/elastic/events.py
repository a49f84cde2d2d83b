"""The membership event: how a change of an elastic job's members reaches whoever holds
its ``ElasticSync`` (strategies, the trainer), instead of each testing what kind of sync
it holds. ``GradSync.on_membership`` is the subscription; a fixed-size sync never emits.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["MembershipChange", "Subscribers"]


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """The members as of round ``round``: this member's ``rank`` and the ``world_size``
    from the next collective on, the member ids in rank order, and who ``joined`` and
    who ``left`` since the subscriber's previous event (its first event: every member
    joined, none left)."""

    round: int
    rank: int
    world_size: int
    members: tuple[str, ...]
    joined: tuple[str, ...]
    left: tuple[str, ...]


class Subscribers:
    """The callbacks subscribed to one sync's membership, each told every change once,
    in subscription order, on the thread that ran the collective that made it."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[MembershipChange], None]] = []
        self._members: tuple[str, ...] = ()

    def subscribe(self, callback: Callable[[MembershipChange], None], round: int,
                  rank: int, members: tuple[str, ...]) -> None:
        """Add ``callback`` and tell it the current members at once (all joined)."""
        self._callbacks.append(callback)
        callback(MembershipChange(round, rank, len(members), members, members, ()))

    def adopt(self, round: int, rank: int, members: tuple[str, ...]) -> None:
        """The members after a collective: an event to every subscriber if they changed."""
        before, self._members = self._members, members
        if members == before or not self._callbacks:
            return
        change = MembershipChange(round, rank, len(members), members,
                                  tuple(m for m in members if m not in before),
                                  tuple(m for m in before if m not in members))
        for callback in list(self._callbacks):
            callback(change)
