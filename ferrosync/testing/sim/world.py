"""One simulation: members of an elastic job running the production code (``ElasticSync``)
on a simulated store, churn, and the invariants checked every round.

Each member (``Member.main``) connects with its own ``SimStorage`` and ``SimRuntime``,
fetches the job's state when new, and averages contributions drawn from the seed (small
integers: every sum exact). ``violations`` names the broken invariants and
``wrong_rounds`` counts wrong averages; the invariants: docs/elastic.md#simulation.
"""

from __future__ import annotations

import hashlib
import random
import statistics

import torch

from ferrosync.elastic import ElasticSync
from ferrosync.elastic.options import ElasticOptions
from ferrosync.errors import JobEnded, MemberDropped, PeerFailed, SyncTimeout
from ferrosync.storage import names
from ferrosync.testing.sim.scheduler import Process, Scheduler, wall
from ferrosync.testing.sim.store import PROFILES, SimServer, SimStorage

URL = "s3://sim/job"
JOB = "sim"
CHURN_KINDS = ("joins", "leaves", "kills", "pauses", "total_loss", "stragglers")
#: floats a simulated member really moves; the store counts them as ``payload`` bytes
REAL_FLOATS = 256
#: connects a member process makes at most (a newcomer whose state's publisher died
#: connects again)
RECONNECTS = 3


def parse_churn(spec: str | None) -> dict[str, float]:
    """``joins=600,kills=300`` -> {kind: events per virtual hour}; ValueError if bad."""
    out: dict[str, float] = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        kind, _, value = part.partition("=")
        kind = kind.strip()
        if kind not in CHURN_KINDS:
            raise ValueError(f"unknown churn kind {kind!r} (use {', '.join(CHURN_KINDS)})")
        rate = float(value)
        if not rate >= 0:
            raise ValueError(f"churn rate of {kind} must be >= 0, not {value!r}")
        out[kind] = rate
    return out


def _seed_of(*fields) -> int:
    return int.from_bytes(hashlib.blake2b(repr(fields).encode(), digest_size=8).digest(),
                          "little")


class Member:
    """One simulated member process and what the simulator knows of it."""

    def __init__(self, world: World, number: int) -> None:
        self.world = world
        self.number = number
        self.proc = Process(world.sched, f"m{number}", _seed_of(world.seed, "member", number))
        self.member_id: str | None = None
        self.arrived = world.sched.now
        self.admitted: int | None = None
        self.leave = False  # asked to leave (SIGTERM-style) at its next round boundary
        self.fate: str | None = None  # killed / paused / left: why it may stop
        self.died_at: float | None = None
        self.back_at = float("inf")  # when a paused member runs again
        self.slow = 1.0  # a straggler's compute factor for its next round
        self.done = False
        self.heard: list = []  # the membership events of its sync (on_membership)

    def main(self) -> None:
        """Connect; a newcomer whose state's publisher died connects again, as
        ``read_state`` tells it to (at most ``RECONNECTS`` times)."""
        for _ in range(RECONNECTS):
            if not self._connect_and_train():
                return

    def _connect_and_train(self) -> bool:
        """One membership; True when this process should connect again."""
        world = self.world
        sched = world.sched
        options = ElasticOptions.parse({"job": JOB, "min_ranks": world.min_ranks,
                                        **world.member_options})
        storage = SimStorage(world.server, self.proc, URL)
        self.arrived = sched.now
        try:
            sync = ElasticSync(URL, ElasticSync.identity(None, None), world.timeout,
                               options, storage=storage, runtime=self.proc.runtime)
        except (JobEnded, SyncTimeout) as exc:
            world.refused(self, exc)
            return False
        self.member_id = sync.member_id
        world.timing = (sync.heartbeat_interval, sync.heartbeat_timeout)
        self.admitted = sync.round
        world.admitted(self, sync)
        model = torch.zeros(REAL_FLOATS)
        try:
            if sync.founding:
                got = sync.fetch_state([model])
                world.restarted(self, sync, got)
            else:
                try:
                    state = sync.read_state(min_round=sync.round,
                                            publisher=sync.membership[0])
                except PeerFailed as exc:
                    sched.note("reconnect", self.proc.name, str(exc)[:80])
                    return True
                model.copy_(next(iter(state.tensors.values())))
            while sync.round < world.rounds and not self.leave:
                sched.note("compute", self.proc.name)
                self.proc.runtime.sleep(world.compute_s * self.slow)
                self.slow = 1.0
                round_ = sync.round + 1
                grad = world.contribution(self.member_id, round_)
                world.began(round_)
                sync.average_([grad])
                model.add_(grad)
                world.finished(self, sync, round_, grad, model)
                if sync.rank == 0 and (sync.newcomers or round_ % world.publish_every == 0):
                    sync.publish_state([model], {"round": sync.round})
                    world.published[sync.round] = sched.now
            if sync.round >= world.rounds:
                sync.end_job()
        except (MemberDropped, PeerFailed, SyncTimeout) as exc:
            world.dropped(self, exc)
        finally:
            sync.close()
        return False


class World:
    """A seeded simulation of ``members`` members for ``rounds`` rounds."""

    def __init__(self, members: int, rounds: int, seed: int, *, profile: str = "s3",
                 churn: dict[str, float] | None = None, payload: int = 1 << 20,
                 compute_s: float = 1.0, publish_every: int = 5,
                 timeout: float = 600.0, member_options: dict | None = None,
                 min_ranks: int = 1, spread_s: float = 0.0, progress=None) -> None:
        self.members_n, self.rounds, self.seed = members, rounds, seed
        self.profile = PROFILES[profile]
        self.churn = churn or {}
        self.payload = payload
        self.compute_s = compute_s
        self.publish_every = publish_every
        self.timeout = timeout
        self.member_options = member_options or {}
        self.min_ranks = min_ranks
        self.spread_s = spread_s  # the first members arrive over this many seconds
        self.progress = progress  # progress(line): a line per round (None: silent)
        self.sched = Scheduler()
        self.start = self.sched.now
        scale = payload / (REAL_FLOATS * 4)
        self.server = SimServer(self.sched, self.profile, _seed_of(seed, "store"),
                                scale=scale)
        self._rng = random.Random(_seed_of(seed, "churn"))
        self.everyone: list[Member] = []
        self.timing = (10.0, 30.0)
        self.violations: dict[str, int] = {}
        self.wrong: set[int] = set()
        self.rosters: dict[int, tuple] = {}
        self.models: dict[int, bytes] = {}
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.member_rounds = 0
        self.published: dict[int, float] = {}
        self.losses: list[tuple[float, int]] = []  # (time, the newest finished round)
        self.contributions: dict[tuple[str, int], torch.Tensor] = {}
        self._references: dict[tuple[int, tuple], torch.Tensor] = {}  # see _reference
        self.deaths: list[Member] = []
        self.details: list[str] = []  # what each violation saw, in order
        #: the slowest detection: seconds from the bound's start to the roster that
        #: dropped the member, over ``heartbeat_timeout`` (the bound is 1.5)
        self.detection_max = 0.0
        self.running = 0  # member processes whose main thread has not ended
        self.wall_began = wall()
        self.events: dict[str, int] = {}  # churn events that happened, by kind

    # -- what members report -----------------------------------------------------------
    def violate(self, name: str, detail: str = "") -> None:
        self.violations[name] = self.violations.get(name, 0) + 1
        self.details.append(f"{name} at {self.sched.now - self.start:.3f} s: {detail}")
        self.sched.note("violation", name, detail)

    def contribution(self, member_id: str, round_: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(_seed_of(self.seed, member_id, round_) >> 1)
        grad = torch.randint(-4, 5, (REAL_FLOATS,), generator=gen).float()
        self.contributions[(member_id, round_)] = grad.clone()
        return grad

    def began(self, round_: int) -> None:
        self.starts.setdefault(round_, self.sched.now)

    def finished(self, member: Member, sync, round_: int, avg, model) -> None:
        if sync.round != round_:
            self.violate("round_skipped", f"{member.member_id} {round_}->{sync.round}")
            return
        if round_ not in self.ends and self.progress is not None:
            self.progress(f"round {round_} done at {self.sched.now - self.start:.1f} virtual "
                          f"s, {wall() - self.wall_began:.1f} s wall, {sync.world_size} members")
        self.ends[round_] = self.sched.now
        contributors = self._saw(round_, sync)
        self._check_events(member, sync)
        held = model.numpy().tobytes()
        if self.models.setdefault(round_, held) != held:
            self.violate("divergent_model", str(round_))
        if not torch.equal(self._reference(round_, contributors), avg):
            self.wrong.add(round_)
            self.violate("wrong_average", str(round_))
        self.member_rounds += 1
        self.sched.note("round", member.proc.name, round_, len(contributors))

    def _reference(self, round_: int, contributors: tuple) -> torch.Tensor:
        """The average members of ``round_`` that saw these ``contributors`` must hold:
        the mean of their draws, summed in float64 (every sum of these small integers is
        exact) and rounded once. Computed once per round and view (each member's
        average is still compared with it): summing it again for every member cost
        O(W^2) per round."""
        key = (round_, contributors)
        ref = self._references.get(key)
        if ref is None:
            ref = torch.zeros(REAL_FLOATS, dtype=torch.float64)
            for m in contributors:
                ref += self.contributions[(m, round_)]
            ref = self._references[key] = (ref / max(len(contributors), 1)).float()
        return ref

    def _saw(self, round_: int, sync) -> tuple:
        """Record a member's view of the roster of ``round_``; its contributors."""
        view = (tuple(sync.contributors), tuple(sync.membership))
        if self.rosters.setdefault(round_, view) != view:
            self.violate("split_roster", str(round_))
        return view[0]

    def _check_events(self, member: Member, sync) -> None:
        """The membership events a member heard tell its sync's members after every
        round, one event per change, each naming who joined and who left."""
        heard = member.heard
        last = heard[-1] if heard else None
        if last is None or (last.rank, last.world_size, last.members) != (
                sync.rank, sync.world_size, tuple(sync.membership)):
            self.violate("stale_membership_event", f"{sync.member_id} round {sync.round}")
        if len(heard) >= 2:
            before, after = set(heard[-2].members), set(last.members)
            if (before == after or set(last.joined) != after - before
                    or set(last.left) != before - after):
                self.violate("wrong_membership_event", f"{sync.member_id} round {last.round}")

    def admitted(self, member: Member, sync) -> None:
        self.sched.note("admitted", member.proc.name, sync.member_id, sync.round)
        member.heard = []
        sync.on_membership(member.heard.append)
        self._saw(sync.round, sync)
        if sync.founding:
            return  # founding or refounding: no roster to be admitted by
        late = [r for r in range(0, sync.round + 1)
                if self.server.created.get(self._roster_key(r), -1.0) > member.arrived]
        if len(late) > 2:
            self.violate("slow_admission", f"{sync.member_id}: {len(late)} rosters")

    def restarted(self, member: Member, sync, state_round) -> None:
        for at, newest in self.losses:
            if at <= self.sched.now and newest >= 0:
                lost = newest - (state_round if state_round is not None else 0)
                if lost > self.publish_every:
                    self.violate("lost_work", f"{lost} rounds")
        self.losses = [x for x in self.losses if x[0] > self.sched.now]

    def refused(self, member: Member, exc: BaseException) -> None:
        member.done = True
        self.sched.note("refused", member.proc.name, type(exc).__name__)

    def dropped(self, member: Member, exc: BaseException) -> None:
        self.sched.note("dropped", member.proc.name, type(exc).__name__)
        if member.fate is None:
            self.violate(f"member_error:{type(exc).__name__}", str(exc)[:200])

    @staticmethod
    def _roster_key(round_: int) -> str:
        return names.within(names.elastic_namespace(JOB), names.elastic_roster(round_))

    # -- churn -------------------------------------------------------------------------
    def spawn(self) -> Member:
        member = Member(self, len(self.everyone))
        self.everyone.append(member)

        self.running += 1

        def main() -> None:
            try:
                member.main()
            finally:
                member.done = True
                self.running -= 1

        self.sched.spawn(member.proc, f"{member.proc.name}/main", main)
        return member

    def alive(self) -> list[Member]:
        return [m for m in self.everyone if not m.done and m.fate is None
                and m.member_id is not None]

    def _schedule(self, kind: str) -> None:
        rate = self.churn.get(kind, 0.0)
        if rate > 0:
            at = self.sched.now + self._rng.expovariate(rate / 3600.0)
            self.sched.call_at(at, lambda: self._event(kind))

    def _event(self, kind: str) -> None:
        if self.over():
            return
        self._schedule(kind)
        alive = self.alive()
        sched = self.sched
        sched.note("churn", kind)
        self.events[kind] = self.events.get(kind, 0) + 1
        if kind == "joins":
            self.spawn()
            return
        if kind == "total_loss":
            newest = max(self.ends, default=-1)
            self.losses.append((sched.now, newest))
            for m in alive:
                self._kill(m)
            for _ in range(max(len(alive), 1)):
                self.spawn()
            return
        if len(alive) <= 1:
            return  # keep the job going: churn never takes its last member
        victim = alive[self._rng.randrange(len(alive))]
        if kind == "leaves":
            victim.leave = True
            victim.fate = "left"
        elif kind == "kills":
            self._kill(victim)
        elif kind == "pauses":
            victim.fate = "paused"
            victim.died_at = sched.now
            self.deaths.append(victim)
            seconds = self.timing[1] * (1.2 + self._rng.random())
            victim.back_at = sched.now + seconds
            sched.pause(victim.proc, seconds)
        elif kind == "stragglers":
            victim.slow = 5.0

    def _kill(self, member: Member) -> None:
        member.fate = "killed"
        member.died_at = self.sched.now
        self.deaths.append(member)
        self.sched.kill(member.proc)

    def _tick(self) -> None:
        """A progress line every 10 virtual seconds (with ``progress``)."""
        admitted = sum(1 for m in self.everyone if m.admitted is not None)
        self.progress(f"at {self.sched.now - self.start:.0f} virtual s, "
                      f"{wall() - self.wall_began:.0f} s wall: {admitted} admitted, "
                      f"{sum(self.server.requests.values())} requests, "
                      f"{self.server.slowdowns} SlowDowns, {self.sched.switches} switches")
        if not self.over():
            self.sched.call_at(self.sched.now + 10.0, self._tick)

    def over(self) -> bool:
        """Every member process finished (a killed one once its threads unwound)."""
        return self.running == 0

    # -- the run -----------------------------------------------------------------------
    def run(self, max_virtual_s: float | None = None) -> dict:
        began = self.wall_began = wall()
        for i in range(self.members_n):
            if self.spread_s > 0 and i:
                self.sched.call_at(self.start + self.spread_s * i / self.members_n,
                                   self.spawn)
            else:
                self.spawn()
        for kind in self.churn:
            self._schedule(kind)
        if self.progress is not None:
            self._tick()
        limit = self.start + (max_virtual_s or 10 * 86400.0)
        self.sched.run(limit, stop=self.over)
        if not self.over():
            self.violate("stalled", f"{len(self.sched.pending())} threads waiting")
        for task, exc in self.sched.failures:
            self.violate(f"member_error:{type(exc).__name__}", f"{task.name}: {exc}"[:300])
        self._check_detection()
        return self.result(wall() - began)

    def _check_detection(self) -> None:
        """The roster that drops a dead member is written within the bound of its
        death, or of the start of that round, or of the latest death of another member
        or queued joiner before it was written, whichever is latest (members that die
        together leave together: a round waits for every one of them). Rosters before
        it may list it rightly: a member that contributed and then died counts in that
        round."""
        bound = 1.5 * self.timing[1]
        created = self.server.created
        events = [m.died_at for m in self.deaths] + [
            m.back_at for m in self.deaths if m.back_at != float("inf")]
        for member in self.deaths:
            mid, died = member.member_id, member.died_at
            if mid is None:
                continue
            for r in sorted(self.rosters):
                at = created.get(self._roster_key(r))
                if at is None or at <= died:
                    continue
                if at > member.back_at:
                    break  # a paused member runs again: it may be a member again
                if mid in self.rosters[r][1]:
                    continue
                start = self.starts.get(r, died)
                # the round waits on every member and queued joiner that died (or
                # resumed from a pause: then it is waited for alive) before it was
                # written: the dead leave together, after the last of these events
                start = max([start] + [t for t in events if t < at])
                self.detection_max = max(self.detection_max,
                                         (at - max(died, start)) / self.timing[1])
                if at > max(died, start) + bound:
                    self.violate("slow_detection", f"{mid} ({member.fate} at "
                                 f"{died - self.start:.3f} s) dropped by roster {r} written "
                                 f"at {at - self.start:.3f} s (round began "
                                 f"{start - self.start:.3f} s)")
                break

    def result(self, wall_s: float) -> dict:
        durations = sorted(self.ends[r] - self.starts[r] for r in self.ends if r in self.starts)
        virtual_s = self.sched.now - self.start
        counts = {"puts": self.server.requests["put"], "gets": self.server.requests["get"],
                  "deletes": self.server.requests["delete"],
                  "lists": self.server.requests["list"]}
        prices = dict(self.profile.prices)
        cost = sum(counts[k + "s"] * prices.get(k, 0.0) / 1000 for k in
                   ("put", "get", "delete", "list"))
        total = sum(counts.values())
        return {
            "members": self.members_n, "rounds": len(self.ends), "seed": self.seed,
            "profile": self.profile.name, "virtual_s": round(virtual_s, 3),
            "wall_s": round(wall_s, 3),
            "round_s_p50": round(statistics.median(durations), 4) if durations else None,
            "round_s_p99": round(_quantile(durations, 0.99), 4) if durations else None,
            "wrong_rounds": len(self.wrong),
            "violations": sorted(self.violations),
            "requests_per_member_round": round(total / self.member_rounds, 2)
            if self.member_rounds else None,
            "peak_prefix_put_rate": self.server.peak_prefix_put_rate,
            "slowdowns": self.server.slowdowns,
            "cost_per_hour": round(cost * 3600 / virtual_s, 4) if virtual_s else None,
            "trace_digest": self.sched.digest,
            "joined": len(self.everyone), "switches": self.sched.switches,
            "churn": dict(sorted(self.events.items())),
            "detection_max": round(self.detection_max, 3),
            "faults": {"lost_replies": self.server.lost_replies,
                       "cut_bodies": self.server.cut_bodies},
            "details": self.details[:20],
        }


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank)."""
    k = min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))
    return values[k]
