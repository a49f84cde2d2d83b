"""The plan of a tree reduce: which member sums which range over which group, the same on
every member (docs/elastic.md#the-tree-reduce).

Everything follows from the previous roster's size and ``fan_in`` alone, so every
member computes the plan without asking (``plan``, cached per size); ``Units`` cuts a
call's flats into codec frames. ``tree.py`` runs a plan for one round.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

import torch

from ferrosync.compression.codecs import Codec, accumulator_dtype

#: the smallest membership (of the previous roster) whose averages go through the tree
TREE_FROM = 5


def _groups(count: int, fan_in: int) -> tuple[tuple[int, int], ...]:
    """``count`` children in contiguous groups of about ``fan_in`` (sizes differing by
    at most one, none of one child unless ``count`` is 1): (start, size) each."""
    n = max(1, min(-(-count // fan_in), count // 2))
    base, extra = divmod(count, n)
    out, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        out.append((start, size))
        start += size
    return tuple(out)


@lru_cache(maxsize=64)
def plan(members: int, fan_in: int) -> TreePlan:
    return TreePlan(members, fan_in)


class TreePlan:
    """The tree over ``members`` roster positions: the same on every member.

    ``levels[l-1]`` holds level l's groups (each a contiguous (start, size) run of
    level l-1's nodes; level 0's nodes are the positions) and its ``k``: the smallest
    group's size, the number of slots per node (a larger group's last child only
    passes its output up)."""

    def __init__(self, members: int, fan_in: int) -> None:
        self.members = members
        self.levels: list[tuple[tuple[tuple[int, int], ...], int]] = []
        count = members
        while count > 1:
            groups = _groups(count, fan_in)
            self.levels.append((groups, min(size for _, size in groups)))
            count = len(groups)
        self.depth = len(self.levels)

    def k(self, level: int) -> int:
        return self.levels[level - 1][1]

    def children(self, level: int, node: int) -> range:
        start, size = self.levels[level - 1][0][node]
        return range(start, start + size)

    def nodes(self, level: int) -> int:
        return self.members if level == 0 else len(self.levels[level - 1][0])

    def paths(self, length: int):
        """Every range path of ``length`` slots (mixed radix, in order)."""
        paths = [()]
        for level in range(1, length + 1):
            paths = [p + (j,) for p in paths for j in range(self.k(level))]
        return paths

    def index(self, path) -> tuple[int, int]:
        """(the path's index, the number of paths of its length)."""
        i, of = 0, 1
        for level, j in enumerate(path, 1):
            i, of = i * self.k(level) + j, of * self.k(level)
        return i, of

    def span(self, path, units: int) -> tuple[int, int]:
        """The units [lo, hi) of ``units`` that ``path`` covers."""
        lo, hi = 0, units
        for level, j in enumerate(path, 1):
            k = self.k(level)
            lo, hi = lo + (hi - lo) * j // k, lo + (hi - lo) * (j + 1) // k
        return lo, hi

    def holder(self, level: int, node: int, path) -> int:
        """The position that sums range ``path`` (of ``level`` slots) over ``node``."""
        while level > 0:
            node = self.children(level, node)[path[-1]]
            level, path = level - 1, path[:-1]
        return node

    def roles(self) -> list[tuple]:
        """Every computation of a round, in an order that only ever waits on earlier
        ones: ("sum", level, node, path) bottom up, then ("merge", path) top down."""
        out = []
        for level in range(1, self.depth + 1):
            for path in self.paths(level):
                for node in range(self.nodes(level)):
                    out.append(("sum", level, node, path))
        for length in range(self.depth - 1, 0, -1):
            out.extend(("merge", path) for path in self.paths(length))
        return out

    @cached_property
    def assignments(self) -> list[tuple[tuple, int]]:
        """(role, the position it falls to) for every role, in ``roles`` order."""
        return [(role, self.designee(role)) for role in self.roles()]

    @cached_property
    def by_designee(self) -> dict[int, tuple[int, ...]]:
        """position -> the indices in ``assignments`` of the roles that fall to it."""
        out: dict[int, list[int]] = {}
        for i, (_, position) in enumerate(self.assignments):
            out.setdefault(position, []).append(i)
        return {p: tuple(ii) for p, ii in out.items()}

    def traffic(self, units: int = 1 << 20) -> list[dict]:
        """What each position does in a healthy round (everyone contributes and takes
        part), as the code does it: PUTs (its slices, its marker and every object it
        computes; each deleted again two rounds later), GETs of tree objects, and the
        bytes of both as fractions of the payload (float32: contributions, sums and
        averages are the same size per element). The roster poll, the heartbeats and the
        checker's marker reads are not tree traffic (``tools/bench/elastic_costs.py`` adds
        them)."""
        out = [{"puts": self.k(1) + 1, "gets": 0, "read": 0.0, "written": 1.0}
               for _ in range(self.members)]

        def size(path) -> float:
            lo, hi = self.span(path, units)
            return (hi - lo) / units

        results: dict[int, set] = {p: set() for p in range(self.members)}
        for role, p in self.assignments:
            mine = out[p]
            if role[0] == "merge":
                path = role[1]
                subs = self.k(len(path) + 1)
                mine["gets"] += subs - 1
                mine["read"] += size(path) - size(path + (0,))
                mine["puts"] += 1
                mine["written"] += size(path)
                if len(path) == 1:
                    results[p].add(path)
                continue
            _, level, node, path = role
            children = len(self.children(level, node))
            mine["gets"] += children - 1
            mine["read"] += (children - 1) * size(path)
            if level == self.depth:
                mine["puts"] += 1
                if level == 1:
                    results[p].add(path)
            else:
                mine["puts"] += self.k(level + 1)
            mine["written"] += size(path)
        for p, mine in enumerate(out):
            missing = [(j,) for j in range(self.k(1)) if (j,) not in results[p]]
            mine["gets"] += len(missing)
            mine["read"] += sum(size(path) for path in missing)
        return out

    def designee(self, role) -> int:
        if role[0] == "sum":
            return self.holder(*role[1:])
        path = role[1]
        return self.holder(self.depth, 0, path + (0,) * (self.depth - len(path)))


class Units:
    """The call's flats as one sequence of codec frames ("units"), so a range of units
    is a contiguous run of every kind of bytes: the contribution's wire bytes, the
    accumulators' and the average's."""

    def __init__(self, flats: list[torch.Tensor], codecs: list[Codec]) -> None:
        self.flats, self.codecs = list(flats), list(codecs)
        self.starts, n = [0], 0
        for f, c in zip(flats, codecs):
            n += -(-f.numel() // c.frame_elems)
            self.starts.append(n)
        self.total = n

    def pieces(self, lo: int, hi: int):
        """(flat index, first element, end element, first frame, end frame) of every
        flat that units [lo, hi) touch."""
        starts = self.starts
        for i, (f, c) in enumerate(zip(self.flats, self.codecs)):
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if a >= b:
                continue
            fa, fb = a - starts[i], b - starts[i]
            fe = c.frame_elems
            yield i, fa * fe, min(fb * fe, f.numel()), fa, fb

    def nbytes(self, kind: str, lo: int, hi: int) -> int:
        total = 0
        for i, e0, e1, fa, fb in self.pieces(lo, hi):
            total += (fb - fa) * self.codecs[i].frame_bytes if kind == "wire" else \
                (e1 - e0) * itemsize(self.dtype(kind, i))
        return total

    def dtype(self, kind: str, i: int) -> torch.dtype:
        dtype = self.flats[i].dtype
        return accumulator_dtype(dtype) if kind == "sum" else dtype


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
