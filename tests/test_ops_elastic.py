"""``ferrosync inspect`` on an elastic job: the whole membership history, whoever wrote
it. In-process, over a directory written through the elastic layer's own ``Rosters``
(the operator tools on fixed-size jobs are tests/test_ops.py's)."""

from __future__ import annotations

import json
import os

import pytest

from ferrosync.__main__ import main


@pytest.mark.unit
def test_inspect_tells_an_elastic_jobs_whole_history_whoever_wrote_it(tmp_path, capsys):
    """Roster writers (a new one every round, as when checkers change; some dying
    between their roster and their history record) run 260 rounds with 82 membership
    changes over a directory, through the elastic layer's own ``Rosters``. ``inspect``
    counts the changes as the rosters do and covers the whole job: the last changes in
    full (two lost records rebuilt from their rosters by the next writer), the older
    ones counted, and the one change whose writer died before a quiet spell pruned its
    rosters said to be unrecorded; two history records on storage."""
    from ferrosync.elastic import history as hist
    from ferrosync.elastic import membership as mb
    from ferrosync.storage import names
    from ferrosync.storage.engines import open_storage
    from ferrosync.storage.objects import Objects
    from ferrosync.storage.wire import job_key, job_tag

    ns = names.elastic_namespace("hist")
    storage = open_storage(str(tmp_path))
    objects = Objects(storage, ns, key=job_key(b"s3cret", ns), tag=job_tag(ns),
                      poll=(0.01, 0.01))
    storage.makedirs(ns)
    ids = (f"{n:016x}" for n in range(1, 1000))

    def how(member):  # what the writer's watch says of a departed member
        return "left" if int(member, 16) % 2 else "silent"

    lost = {101, 103, 159}  # these writers die between their roster and their record
    changed_at = [r for r in range(1, 160, 2)] + [240, 259]
    prev, entries = mb.EMPTY, []  # entries: (round, [(member, event)]) as recorded
    for round_ in range(260):
        members = prev.members or (next(ids), next(ids))
        if round_ == 0:
            entries.append((0, [(m, "joined") for m in members]))
        elif round_ in changed_at:  # one joins, or the longest-standing member goes
            if len(entries) % 2:
                members += (next(ids),)
                entries.append((round_, [(members[-1], "joined")]))
            else:
                members = members[1:]
                event = "left" if how(prev.members[0]) == "left" else "died"
                entries.append((round_, [(prev.members[0], event)]))
        roster = mb.Roster(round_, prev.members, members, 0)
        roster = mb.replace(roster, changes=roster.changes_after(prev)).chained(prev)
        if round_ in lost:
            mb.Rosters(objects).create(roster)  # the roster only: its writer died
        else:
            mb.Rosters(objects).create(roster, prev, how)
        prev = roster
    assert prev.changes == len(changed_at) == 82

    assert main(["inspect", str(tmp_path), "--json", "--watch", "0", "--secret",
                 "s3cret"]) == 0
    (job,) = json.loads(capsys.readouterr().out)["elastic_jobs"]
    assert job["membership_changes"] == 82 and not job["problems"], job
    assert job["unrecorded"] == 1  # round 159: its rosters were pruned before round 240
    recorded = [e for e in entries if e[0] != 159]
    full, older = recorded[-hist.KEEP:], recorded[:-hist.KEEP]
    assert [(e["round"], e["member"], e["event"]) for e in job["events"]] == [
        (r, m, ev) for r, changes in full for m, ev in changes]
    assert job["earlier"] == {
        "entries": len(older), "since": 0, "changes": len(older) - 1,  # the founding: 0
        **{ev: n for ev in ("joined", "left", "died")
           if (n := sum(e == ev for _, c in older for _, e in c))}}
    records = sorted(k for k in os.listdir(tmp_path / ns) if k.startswith("history."))
    assert records == ["history.240", "history.259"]
    assert max(os.path.getsize(tmp_path / ns / k) for k in records) < 16 << 10

    assert main(["inspect", str(tmp_path), "--watch", "0", "--secret", "s3cret"]) == 0
    text = capsys.readouterr().out
    assert (f"elastic job hist  el.hist/  rounds 196-259 on storage  {len(prev.members)} "
            "member(s) now, 82 change(s)") in text, text
    assert f"from round 0: {len(older)} earlier change(s) compacted (" in text, text
    assert f"  round 259    {full[-1][1][0][0]}  {full[-1][1][0][1]}" in text, text
    assert "1 change(s) not recorded" in text, text
