"""Cleanup of consumed objects, and reuse of their files (``Recycler``).

An object is deleted by its writer (results by their reducer) once provably consumed,
deferred to the next wait (docs/design.md#cleanup); on a local file system a large
consumed file is parked as a spare and rewritten by a later put, reusing its pages. Used
by one ``StorageSync`` from the thread inside its collective; not thread-safe.
"""

from __future__ import annotations

#: smaller objects are not worth parking (and would truncate a large spare's pages away)
RECYCLE_MIN_BYTES = 256 << 10


class Recycler:
    """Consumed keys waiting for deletion, results held until every rank moved on, and
    parked spare files."""

    def __init__(self, storage, world_size: int) -> None:
        self._storage = storage
        self._world_size = world_size
        self._garbage: list[str] = []  # provably consumed, delete at the next wait
        self._after_gather: list[str] = []  # delete once every rank has moved on
        # consumed objects this rank wrote, kept to be rewritten by later puts instead
        # of being deleted (local file systems only)
        self._written: dict[str, int] = {}
        self._spares: list[tuple[int, str]] = []

    # -- what is consumed when ------------------------------------------------------------
    def consumed(self, *keys: str) -> None:
        """``keys`` are provably consumed: delete (or park) them at the next flush."""
        self._garbage.extend(keys)

    def hold_until_gathered(self, key: str) -> None:
        """``key`` (a result) may go once a later collective has gathered every rank."""
        self._after_gather.append(key)

    def gathered(self, new_results: list[str]) -> None:
        """Called by every rank once a collective is known to have gathered all ranks:
        every rank has then finished the collectives before it, so the results this
        rank was holding can go. ``new_results`` are held until next time."""
        self._garbage.extend(self._after_gather)
        self._after_gather = list(new_results)
        if self._storage.cheap_deletes:
            self.flush()  # else deleted at the next wait, off the critical path

    def before_collective(self) -> None:
        """Recycling: consumed files become spares before the collective's puts;
        otherwise flush only when waits were all too short to delete them for free."""
        if self._storage.can_recycle or len(self._garbage) > 2 * self._world_size + 8:
            self.flush()

    # -- writes ------------------------------------------------------------------------------
    def written(self, key: str, nbytes: int) -> None:
        if self._storage.can_recycle:
            self._written[key] = nbytes

    def take_spare(self, nbytes: int) -> str | None:
        """The smallest spare that fits: its pages get rewritten instead of allocated."""
        if nbytes < RECYCLE_MIN_BYTES or not self._spares:
            return None
        self._spares.sort()
        for i, (size, _key) in enumerate(self._spares):
            if size >= nbytes:
                return self._spares.pop(i)[1]
        return None

    # -- deleting ----------------------------------------------------------------------------
    def flush(self) -> None:
        if not self._garbage:
            return
        keys, self._garbage = self._garbage, []
        doomed = []
        for key in keys:
            size = self._written.pop(key, None)
            if (size is not None and size >= RECYCLE_MIN_BYTES
                    and len(self._spares) < 2 * self._world_size + 4):
                # hidden name: a parked file must not look like a live collective object
                spare = self._storage.park(key)
                if spare is not None:
                    self._spares.append((size, spare))
                    continue
            doomed.append(key)
        if doomed:
            self._storage.delete(doomed)

    def release(self) -> None:
        """On a clean close: delete what is consumed and every spare."""
        self.flush()
        self._storage.delete([key for _, key in self._spares])
        self._spares.clear()
