"""ferrosync/testing/members.py: the command that starts a tool's member parses back,
with the tool's own flags, into what the member connects with; the flags stay out of
the tool's help."""

import argparse
import json
import sys

from ferrosync.testing.members import add_member_flags, member_command, member_env


def tool_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_member_flags(p)
    p.add_argument("--url")
    p.add_argument("--rounds", type=int, default=10)
    return p


def test_a_member_command_parses_back():
    options = {"heartbeat_timeout": 6.0, "storage_options": {"key": "k"}}
    cmd = member_command("tools/bench/bench.py", url="s3://b/p", job="j1", options=options,
                         min_ranks=3, log="/tmp/j1.0.log", extra=("--rounds", "4"))
    assert cmd[0] == sys.executable and cmd[1].endswith("/tools/bench/bench.py")
    args = tool_parser().parse_args(cmd[2:])
    assert (args.member, args.url, args.job, args.min_ranks, args.log, args.rounds) == (
        True, "s3://b/p", "j1", 3, "/tmp/j1.0.log", 4)
    assert json.loads(args.options) == options


def test_the_member_flags_are_hidden_and_off_by_default():
    p = tool_parser()
    assert "--member" not in p.format_help() and "--min-ranks" not in p.format_help()
    args = p.parse_args([])
    assert (args.member, args.options, args.min_ranks) == (False, "{}", 1)


def test_a_member_runs_on_one_thread_with_the_clone_first():
    env = member_env("/clone")
    assert env["PYTHONPATH"] == "/clone" and env["OMP_NUM_THREADS"] == "1"
