"""``fxpipe.cli.ranks``: the torchrun command, progress lines, and the rank a failed run names (no process started)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fxpipe.cli.ranks import (
    LAUNCH_MODULE,
    RANK_MODULE,
    RESULTS,
    DiedRank,
    RankFailure,
    Rendezvous,
    StepDone,
    diagnose,
    died_ranks,
    finished_ranks,
    parse_step,
    rank_errors,
    rank_results,
    rendezvous_failure,
    torchrun_command,
)


def _summary(*failures: tuple[int, int]) -> str:
    """torchrun's failure summary (ChildFailedError) for (rank, exit code) pairs, root cause first."""
    blocks = [f"[{i}]:\n  time      : 2026-01-01_00:00:00\n  host      : box\n"
              f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {100 + rank})\n"
              "  error_file: <N/A>\n  traceback : Signal received\n"
              for i, (rank, code) in enumerate(failures)]
    return ("Traceback (most recent call last):\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
            "============================================================\nfxpipe.cli.rank FAILED\n"
            "------------------------------------------------------------\nFailures:\n" + "".join(blocks[1:])
            + "------------------------------------------------------------\nRoot Cause (first observed failure):\n"
            + blocks[0] + "============================================================\n")


def test_the_command_runs_the_rank_program_under_torchrun(tmp_path: Path) -> None:
    cmd = torchrun_command([tmp_path / "run.json", "--out", tmp_path / "out"], 2)
    assert cmd[:6] == [sys.executable, "-m", LAUNCH_MODULE, "--standalone", "--nproc-per-node=2", "-m"]
    from torch.distributed.run import parse_args

    args = parse_args(cmd[3:])  # torchrun's own options, read by torchrun's own parser
    assert (args.standalone, args.nproc_per_node, args.module, args.training_script) == (True, "2", True, RANK_MODULE)
    assert cmd[6] == RANK_MODULE == "fxpipe.cli.rank" and cmd[7:] == [str(tmp_path / "run.json"), "--out",
                                                                      str(tmp_path / "out")]


def test_the_command_passes_restarts_and_a_multi_node_rendezvous_to_torchrun(tmp_path: Path) -> None:
    cmd = torchrun_command(["run.json"], 2, rendezvous=Rendezvous(2, 1, "10.0.0.1", 29611, timeout=30),
                           max_restarts=3)
    assert cmd[3:cmd.index("-m", 3)] == ["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
                                         "--master-port=29611", "--rdzv-conf=timeout=30", "--max-restarts=3",
                                         "--nproc-per-node=2"]


def test_progress_lines_parse_and_anything_else_is_skipped() -> None:
    assert parse_step("step 2 loss 4.158883 ms 12.5") == StepDone(2, 4.158883, 12.5)
    assert parse_step("step 2 loss") is None and parse_step("") is None and parse_step("warming up") is None


def test_died_ranks_reads_torchrun_exit_codes_and_puts_sigterm_last() -> None:
    stderr = _summary((0, -15), (1, -9), (2, 1), (3, 0))
    assert died_ranks(stderr, reported=()) == [
        DiedRank(1, "killed by signal 9, SIGKILL: often the out-of-memory killer", False),
        DiedRank(2, "exit code 1", False),
        DiedRank(0, "killed by signal 15, SIGTERM", True),
    ]
    assert [d.rank for d in died_ranks(stderr, reported={1, 2})] == [0]  # a rank that reported did not just die


def test_a_clean_run_has_no_failure() -> None:
    assert diagnose(0, "", {}, {0, 1}) is None


def test_a_killed_rank_is_blamed_over_the_ones_waiting_for_it() -> None:
    errors = {0: "RankFailedError: rank 1 stopped responding while rank 0 waited for x"}
    failure = diagnose(1, _summary((1, -9), (0, 1)), errors, set())
    assert failure == RankFailure(1, "rank 1 died (killed by signal 9, SIGKILL: often the out-of-memory killer) "
                                     "without an error report; the other ranks stopped (1 reported waiting for it)")


def test_a_rank_that_failed_by_itself_is_blamed_over_one_torchrun_stopped() -> None:
    errors = {1: "RuntimeError: injected failure on rank 1 at step 1"}
    failure = diagnose(1, _summary((1, 1), (0, -15)), errors, set())
    assert failure == RankFailure(1, "rank 1 failed: RuntimeError: injected failure on rank 1 at step 1; the other "
                                     "ranks stopped")


def test_when_every_report_is_a_wait_the_rank_it_names_is_blamed() -> None:
    errors = {2: "RankFailedError: rank 1 stopped responding while rank 2 waited for y",
              0: "RankFailedError: rank 1 stopped responding while rank 0 waited for x"}
    failure = diagnose(1, "", errors, set())
    assert failure is not None and failure.rank == 1
    assert failure.message.startswith("rank 1 failed without an error report; rank 0 reported: RankFailedError")


def test_no_report_at_all_quotes_torchrun() -> None:
    failure = diagnose(3, "some noise\nModuleNotFoundError: No module named 'x'\n", {}, set())
    assert failure == RankFailure(None, "the ranks exited with code 3 without a report (ModuleNotFoundError: No "
                                        "module named 'x'); re-run to see the ranks' output")
    # torchrun's failure summary ends in a frame of ===; its error line is what is quoted, not the frame.
    framed = ("torch.distributed.DistNetworkError: The server socket has failed to listen (port 29400)\n"
              "=====\nroot cause (first observed failure):\n  exitcode: 1\n=====\n")
    failure = diagnose(1, framed, {}, set())
    assert failure is not None
    assert "(torch.distributed.DistNetworkError: The server socket has failed" in failure.message


def test_reports_are_read_from_the_out_dir(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text("{}")
    (tmp_path / "rank1.error").write_text("ValueError: boom\n")
    (tmp_path / "rank2.error").write_text("")  # stopped while writing it
    assert rank_errors(tmp_path) == {1: "ValueError: boom"}
    assert finished_ranks(tmp_path) == {0}


def test_a_stopped_rank_is_blamed_as_unresponsive_not_as_killed_for_memory() -> None:
    failure = diagnose(1, "", {0: "RankFailedError: rank 1 did not answer within 2 s while rank 0 waited for "
                                        "F1 of microbatch 0"}, set(), stopped={1})
    assert failure is not None and failure.rank == 1
    assert failure.message.startswith("rank 1 was unresponsive: its process was stopped (SIGSTOP")
    assert "out-of-memory" not in failure.message


def test_a_rank_torchrun_had_to_sigkill_is_unresponsive_not_out_of_memory() -> None:
    stderr = ("WARNING Sending process 8 closing signal SIGTERM\n"
              "WARNING Unable to shutdown process 8 via Signals.SIGTERM, forcefully exiting via Signals.SIGKILL\n"
              "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 8)\n")
    (died,) = died_ranks(stderr, reported={0})
    assert died.rank == 1 and "unresponsive" in died.how and "out-of-memory" not in died.how


def test_the_nodes_meet_where_the_options_say() -> None:
    assert Rendezvous().torchrun_args() == ["--standalone"]
    static = Rendezvous(2, 1, "10.0.0.1", None, timeout=30)
    assert static.torchrun_args() == ["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29500",
                                      "--rdzv-conf=timeout=30"]
    assert static.where() == "--master-addr 10.0.0.1 --master-port 29500"
    c10d = Rendezvous(2, endpoint="node0:29400", run_id="job7", timeout=2.5)
    assert c10d.torchrun_args() == ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400",
                                    "--rdzv-id=job7", "--rdzv-conf=join_timeout=3,read_timeout=3"]
    cmd = torchrun_command(["run.json"], 2, rendezvous=static)
    assert cmd[3:9] == [*static.torchrun_args(), "--nproc-per-node=2"]


def test_a_node_that_never_met_the_others_says_where_it_waited() -> None:
    static = Rendezvous(2, 0, "127.0.0.1", 29611, timeout=5)
    stderr = ("Traceback (most recent call last):\n  File \"static_tcp_rendezvous.py\", line 67\n"
              "torch.distributed.DistStoreError: Timed out after 6 seconds waiting for clients. 1/2 clients joined.\n")
    failure = diagnose(1, stderr, {}, set(), rendezvous=static)
    assert failure == RankFailure(None, "this node waited up to 5 s at --master-addr 127.0.0.1 --master-port 29611 and "
                                        "the 2 nodes never all met (DistStoreError: Timed out after 6 seconds waiting "
                                        "for clients. 1/2 clients joined.); start fxpipe run on all 2 nodes with the "
                                        "same --nnodes, --master-addr and --master-port (--node-rank 0 on the machine "
                                        "at --master-addr), check that 127.0.0.1:29611 is reachable from every node, "
                                        "or raise --rdzv-timeout")
    c10d = Rendezvous(3, endpoint="h:1", timeout=9)
    line = rendezvous_failure("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n", c10d)
    assert line is not None and line.message.startswith("this node waited up to 9 s at --rdzv-endpoint h:1 and the 3 "
                                                        "nodes never all met (RendezvousTimeoutError); ")
    assert rendezvous_failure(stderr, Rendezvous()) is None  # one machine: nothing to meet
    # Ranks ran here: it is a rank's failure, not the rendezvous's.
    assert diagnose(1, stderr, {0: "ValueError: boom"}, set(), rendezvous=static) == RankFailure(
        0, "rank 0 failed: ValueError: boom; the other ranks stopped")


def test_a_rank_on_another_node_is_said_to_be_there() -> None:
    errors = {0: "RankFailedError: rank 3 stopped responding while rank 0 waited for x",
              1: "RankFailedError: rank 3 stopped responding while rank 1 waited for y"}
    node = Rendezvous(2, 0, "h", None)
    failure = diagnose(1, "", errors, set(), rendezvous=node, local={0, 1})
    assert failure is not None and failure.rank == 3
    assert failure.message.endswith("(rank 3 ran on another node: its fxpipe run says more)")
    # Without a multi-node rendezvous the message is the one-node one.
    assert diagnose(1, "", errors, set(), local={0, 1}) == diagnose(1, "", errors, set())


def test_only_the_node_holding_rank_0_has_the_results(tmp_path: Path) -> None:
    assert rank_results(tmp_path) is None
    (tmp_path / RESULTS).write_text('[{"rank": 0}, {"rank": 1}]')
    assert rank_results(tmp_path) == [{"rank": 0}, {"rank": 1}]


def test_a_rank_that_fails_while_closing_after_its_result_keeps_the_results() -> None:
    # Every rank wrote its result; rank 1 then exited 1 in gloo's teardown: the run's results stand, with a warning.
    failure = diagnose(1, _summary((1, 1)), {}, {0, 1})
    assert failure == RankFailure(1, "rank 1 exited (exit code 1) after writing its result, while closing the "
                                     "process group; the results are complete", after_results=True)
    # A rank that wrote no result is still a failure, whatever the others did.
    failure = diagnose(1, _summary((1, 1)), {}, {0})
    assert failure is not None and not failure.after_results and failure.rank == 1


def test_a_rank_torchrun_stopped_is_not_blamed_over_the_rank_a_wait_names() -> None:
    """Node 0 of two, rank 3 killed on node 1: rank 1 timed out waiting for it and exited, so torchrun SIGTERMed
    rank 0 before rank 0 wrote its own wait. The cause is rank 3, on the other node, not the rank torchrun stopped."""
    errors = {1: "RankFailedError: rank 3 stopped responding while rank 1 waited for B1 of microbatch 2"}
    failure = diagnose(1, _summary((1, 1), (0, -15)), errors, set(), rendezvous=Rendezvous(2, 0, "127.0.0.1", 29611),
                       local={0, 1})
    assert failure is not None and failure.rank == 3
    assert failure.message.startswith("rank 3 failed without an error report; rank 1 reported: RankFailedError")
    assert failure.message.endswith("(rank 3 ran on another node: its fxpipe run says more)")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process groups from /proc")
def test_stopping_the_launch_leaves_nothing_of_its_group(tmp_path: Path) -> None:
    """torchrun gone, a process it started that ignores SIGTERM (as multiprocessing's resource tracker does) stays
    in its group, orphaned, nobody's descendant: stop_tree still ends it."""
    from fxpipe.cli.ranks import group_members, stop_tree

    ready = tmp_path / "ready"
    child = (f"import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"pathlib.Path({str(ready)!r}).touch(); time.sleep(300)")
    leader = subprocess.Popen([sys.executable, "-c", f"import pathlib, subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}]); "
                               f"[time.sleep(0.05) for _ in range(1200) if not pathlib.Path({str(ready)!r}).exists()]"],
                              start_new_session=True, text=True)
    try:
        assert leader.wait(timeout=60) == 0 and ready.exists()
        assert len(group_members(leader.pid)) == 1
        stop_tree(leader, {}, grace=0.5)
        deadline = time.monotonic() + 10
        while group_members(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_members(leader.pid) == set()
    finally:
        for pid in group_members(leader.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_rank_names_the_first_rank_and_entry_that_differ_from_its_own() -> None:
    """``runtime.same``'s comparison (its all-gather runs in test_multinode.py's launch and the runtimes' tests)."""
    from fxpipe.runtime.same import first_difference

    assert first_difference([1, 2, 3], [[1, 2, 3], [1, 2, 3]]) is None
    assert first_difference([1, 2, 3], [[1, 2, 3], [1, 5, 3], [0, 2, 3]]) == (1, 1)


def test_what_every_rank_must_share_is_the_plan_s_bytes_and_the_program_s_options(tmp_path: Path) -> None:
    import argparse

    from fxpipe.cli.rank import SHARED_OPTIONS, run_identity

    (tmp_path / "plan.json").write_text("{}")
    args = argparse.Namespace(plan=str(tmp_path), out="anywhere", data="/node/local", **dict.fromkeys(SHARED_OPTIONS))
    items = dict(run_identity(args))
    assert items["plan"] == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # sha256 of b"{}"
    assert "--microbatches" in items and "--steps" in items and "--resume" in items
    assert not {"--out", "--data", "--timeout", "--checkpoint-dir"} & set(items)  # a node's own paths may differ


def test_an_asynchronous_chunk_is_timed_step_by_step_on_the_rank() -> None:
    """Each step of a streamed chunk runs from the previous step's last action end (the chunk's start for the first,
    which so carries the set-up) to its own; the last runs to the chunk's end. Steps that finish out of order on a
    rank never give a negative time."""
    from types import SimpleNamespace as A

    from fxpipe.cli.rank import stream_step_ms

    events = [(A(mb=0), 0.0, 0.1), (A(mb=1), 0.1, 0.2), (A(mb=2), 0.2, 0.25), (A(mb=3), 0.25, 0.3)]
    assert [round(ms, 6) for ms in stream_step_ms(events, 0.5, 0.9, 2, 2)] == [700.0, 200.0]
    late = [(A(mb=0), 0.0, 0.4), (A(mb=2), 0.1, 0.2), (A(mb=4), 0.2, 0.5)]  # step 1 ends before step 0
    assert [round(ms, 6) for ms in stream_step_ms(late, 0.0, 0.6, 3, 2)] == [400.0, 0.0, 200.0]


def test_an_asynchronous_chunks_actions_are_timed_per_step_after_the_first() -> None:
    from types import SimpleNamespace as A

    from fxpipe.cli.rank import stream_action_seconds
    from fxpipe.schedules.ir import Kind

    def act(mb: int, kind: Kind) -> A:
        return A(stage=0, mb=mb, kind=kind)

    events = [(act(0, Kind.F), 0.0, 0.5), (act(1, Kind.F), 0.5, 0.6), (act(2, Kind.F), 0.6, 0.8),
              (act(2, Kind.BW), 0.8, 1.1), (act(3, Kind.F), 1.1, 1.2)]
    # step 0 (microbatches 0, 1) carries the set-up and is left out; step 1 (microbatches 2, 3): F 0.2 and 0.1 s
    got = stream_action_seconds(events, 2)
    assert [{k: round(v, 6) for k, v in step.items()} for step in got] == [{(0, "F"): 0.15, (0, "BW"): 0.3}]


def test_the_run_is_stalled_when_no_rank_moves_on_for_the_timeout(tmp_path: Path) -> None:
    """:func:`stalled` reads the ranks' heartbeat files (text: what each does; mtime: when it last moved on) against
    an injected clock: any rank moving on keeps the run going; before the first beat, ``first`` applies."""
    from fxpipe.cli.ranks import stall_failure, stalled

    assert stalled(tmp_path, started=1000.0, timeout=10, now=1009.0) is None
    assert stalled(tmp_path, started=1000.0, timeout=10, now=1011.0, first=30) is None  # nodes still meeting
    (tmp_path / "rank9.beatx").write_text("not a heartbeat")
    assert stalled(tmp_path, started=1000.0, timeout=10, now=1011.0) == ()  # stalled before any rank started
    assert stall_failure((), 10, 5).rank is None
    for rank, doing, at in ((0, "step 3", 1050.0), (1, "loading the plan", 1020.0)):
        (tmp_path / f"rank{rank}.beat").write_text(doing)
        os.utime(tmp_path / f"rank{rank}.beat", (at, at))
    assert stalled(tmp_path, started=1000.0, timeout=10, now=1059.0, first=1000) is None  # rank 0 moved on at 1050
    assert stalled(tmp_path, started=1000.0, timeout=10, now=1061.0, first=1000) is None  # rank 1 is setting up
    hung = stalled(tmp_path, started=1000.0, timeout=10, now=1061.0, first=11)
    assert hung == ((0, "step 3"), (1, "loading the plan"))
    (tmp_path / "rank1.beat").write_text("step 3")
    os.utime(tmp_path / "rank1.beat", (1020.0, 1020.0))
    assert stalled(tmp_path, started=1000.0, timeout=10, now=1061.0, first=1000) == ((0, "step 3"), (1, "step 3"))
    line = stall_failure(hung, 10, 5).message
    assert line.startswith("no rank made progress for 15 s (--timeout 10 s, and 5 more) (rank 0: step 3, rank 1: "
                           "loading the plan)") and "raise --timeout" in line


def test_a_rank_s_warnings_and_fxpipe_s_logged_notes_reach_the_launcher(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In a rank, a warning of fxpipe's or the user's code and a note at WARNING on fxpipe's module loggers become
    lines of its warnings file; the launcher shows each once, with the ranks that raised it."""
    import logging
    import warnings

    from fxpipe.cli.ranks import rank_warnings, record_warnings

    logger = logging.getLogger("fxpipe")
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", logger.propagate)
    for rank in (0, 1):
        record_warnings(tmp_path, rank)
        warnings.warn_explicit("the user's data is short", UserWarning, __file__, 1)
        logging.getLogger("fxpipe.runtime.executor").warning("W runs per microbatch\nsecond line")
        logging.getLogger("fxpipe.runtime.executor").info("not relayed")
        logger.handlers = []
    assert rank_warnings(tmp_path) == ["UserWarning: the user's data is short (ranks 0, 1)",
                                       "Warning: W runs per microbatch (ranks 0, 1)"]


def test_the_launcher_reads_a_killed_ranks_exit_and_leaves_it_to_be_reaped(tmp_path: Path) -> None:
    """torch's failure summary names only the first failed rank: ``fxpipe.cli.launch`` reads each child's exit itself
    (``waitid`` with ``WNOWAIT``) and prints it in that summary's format, so a SIGKILLed rank is still named as
    killed; the child stays for its real parent's ``wait`` (torch's agent)."""
    from fxpipe.cli.launch import Exits

    exits = Exits(tmp_path, every=0.01)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        (tmp_path / "rank1.pid").write_text(str(child.pid))
        deadline = time.monotonic() + 60
        while child.pid not in exits._seen and time.monotonic() < deadline:
            time.sleep(0.01)
        child.kill()
        while child.pid not in exits.codes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exits.codes.get(child.pid) == -signal.SIGKILL
    finally:
        exits.close()
        child.kill()
        assert child.wait(timeout=60) == -signal.SIGKILL  # not reaped by the watcher
    assert died_ranks(exits.summary(), reported=()) == [
        DiedRank(1, "killed by signal 9, SIGKILL: often the out-of-memory killer", False)]
    assert died_ranks(exits.summary(), reported={1}) == []
