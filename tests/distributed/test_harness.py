"""The world runner itself (recipes.world, through tests.harness): passing collectives,
a world that joins its process group from the environment, forwarded errors, bounded hangs,
stop signals forwarded to non-daemonic ranks, ranks that die with the calling process."""

import multiprocessing as mp
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recipes.world import WorldStopped
from tests.harness import WorldError, init_mesh, run_world

ROOT = Path(__file__).resolve().parents[2]


def _all_reduce_and_mesh():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    mesh = init_mesh((2, 2), ("ep", "efsdp"))
    return t.item(), mesh["ep"].size(), mesh["efsdp"].get_local_rank(), dist.get_world_size()


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return dist.get_rank()


def _rank_one_skips_collective():
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: the others block here
    else:
        import time

        time.sleep(60)


def _join_from_environment():
    """`backend=None`: the rank joins from RANK/WORLD_SIZE/MASTER_* (the caller's store); and
    `muon` is whatever `pythonpath` holds (another checkout's packages, for a baseline)."""
    import muon

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item(), muon.__file__


def _report_what_the_rank_sees(tag: str):
    print(f"stdout of rank {dist.get_rank()} {tag}", flush=True)
    print(f"stderr of rank {dist.get_rank()} {tag}", file=sys.stderr, flush=True)
    env = {k: os.environ.get(k) for k in ("HARNESS_PROBE", "OMP_NUM_THREADS")}
    server = Path(f"/proc/{os.getppid()}/environ").read_text().split("\0")  # the fork server's
    server_omp = [v for v in server if v.startswith("OMP_NUM_THREADS=")]
    return env, torch.get_num_threads(), os.getcwd(), sys.path[:3], server_omp


def _child_then_stop(out_dir: str):
    """Each rank starts a process of its own (multiprocessing refuses that to daemonic ones),
    then rank 0 sends the caller SIGINT. Rank 0 records the SIGTERM the runner answers with;
    rank 1 ignores it and sleeps on, to be killed after the grace period."""
    rank = dist.get_rank()
    child = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    got = []
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda signum, _: got.append(signum))
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.barrier()
    if rank == 0:
        os.kill(mp.parent_process().pid, signal.SIGINT)  # the caller (a fork server's child)
    for _ in range(1200):  # bounded: without the SIGTERM, rank 0 returns and the test fails
        if got:
            break
        time.sleep(0.1)
    if rank == 0:
        names = [signal.Signals(s).name for s in got]
        Path(out_dir, "rank0").write_text(f"{names} child exit code {child.exitcode}")
        return names
    time.sleep(120)  # past the grace: killed


def test_stop_signal_reaches_non_daemonic_ranks_then_kills_after_the_grace(tmp_path):
    """`stop_signals`: SIGINT to the caller becomes SIGTERM to every rank; rank 0 exits, rank 1
    (ignoring SIGTERM) is killed after `grace_s`; WorldStopped says so and pickles; the caller's
    own handler comes back. The ranks started children (daemon=False) and had no deadline
    (timeout_s=None: a zero deadline would have failed the world before the signal)."""
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, _: caught.append(signum))
    try:
        with pytest.raises(WorldStopped) as info:
            run_world(
                _child_then_stop,
                2,
                str(tmp_path),
                timeout_s=None,
                daemon=False,
                stop_signals=(signal.SIGINT, signal.SIGTERM),
                grace_s=8,  # rank 0 exits within it; rank 1 is killed at its end
            )
        restored = signal.getsignal(signal.SIGINT)
    finally:
        ours = signal.signal(signal.SIGINT, previous)
    assert ours is restored and not caught  # the runner's handler took it, then gave it back
    err = info.value
    assert str(err) == "_child_then_stop: stopped by SIGINT; rank(s) [1] killed after 8 s"
    assert (err.signum, err.signal_name, err.killed) == (signal.SIGINT, "SIGINT", [1])
    again = pickle.loads(pickle.dumps(err))  # Hydra's submitit launcher pickles job results
    assert (str(again), again.signum, again.killed) == (str(err), err.signum, err.killed)
    assert (tmp_path / "rank0").read_text() == "['SIGTERM'] child exit code 0"


def _record_pid_and_sleep(out_dir: str):
    Path(out_dir, "rank.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaps (its parent was killed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_ranks_die_with_a_killed_caller(tmp_path):
    """SIGKILL to the calling process (no finally runs there): its rank, a non-daemonic one
    with no deadline, is killed by the kernel rather than left running."""
    code = (
        "import sys; from tests.distributed.test_harness import _record_pid_and_sleep as f; "
        "from tests.harness import run_world; "
        "run_world(f, 1, sys.argv[1], daemon=False, timeout_s=None)"
    )
    caller = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT)
    pid_file = tmp_path / "rank.pid"
    pid = None
    try:
        for _ in range(1200):  # bounded wait for the rank to start
            if pid_file.exists() and pid_file.read_text():
                pid = int(pid_file.read_text())
                break
            assert caller.poll() is None, "the caller exited before its rank started"
            time.sleep(0.1)
        assert pid is not None, "the rank never started"
        caller.kill()
        caller.wait(timeout=60)
        for _ in range(600):
            if _dead(pid):
                break
            time.sleep(0.1)
        assert _dead(pid), f"rank {pid} outlived its killed caller"
    finally:
        caller.kill()
        if pid is not None and not _dead(pid):
            os.kill(pid, signal.SIGKILL)


def test_world_joined_from_the_environment_with_another_checkout(tmp_path, capfd):
    (tmp_path / "muon").mkdir()
    (tmp_path / "muon" / "__init__.py").write_text("")
    out = run_world(_join_from_environment, 2, backend=None, pythonpath=str(tmp_path))
    assert out == [(2.0, str(tmp_path / "muon" / "__init__.py"))] * 2
    # Rank 0 joined the caller's store instead of trying to host one on its port.
    assert "failed to bind" not in capfd.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a fork server: Linux")
def test_ranks_get_the_callers_environment_streams_directory_and_path(tmp_path, monkeypatch, capfd):
    """Each world's ranks see the caller as it is when that world starts (a fork server is
    started at the first world and serves the later ones): its environment (and one intra-op
    thread, or the caller's torch default for threads=None), its stdout and stderr (captured
    here), its working directory and sys.path; the server imported torch with one thread."""
    run_world(_report_what_the_rank_sees, 1, "before")  # the server exists from here on, at least
    capfd.readouterr()
    monkeypatch.setenv("HARNESS_PROBE", "set after the first world")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = run_world(_report_what_the_rank_sees, 2, "after")
    env = {"HARNESS_PROBE": "set after the first world", "OMP_NUM_THREADS": "1"}
    # the server imported torch with one OpenMP thread: a fork of a process whose OpenMP pool
    # was started inherits the pool's state but not its threads, and may crash in it
    assert out == [(env, 1, str(tmp_path), sys.path[:3], ["OMP_NUM_THREADS=1"])] * 2
    captured = capfd.readouterr()
    assert [f"stdout of rank {r} after" in captured.out for r in (0, 1)] == [True, True]
    assert [f"stderr of rank {r} after" in captured.err for r in (0, 1)] == [True, True]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (default,) = run_world(_report_what_the_rank_sees, 1, "default", threads=None)
    assert (default[0]["OMP_NUM_THREADS"], default[1]) == (None, torch.get_num_threads())


def test_passing_collective_and_2d_mesh():
    out = run_world(_all_reduce_and_mesh, 4)
    assert [o[0] for o in out] == [10.0] * 4
    assert all(o[1] == 2 and o[3] == 4 for o in out)
    assert [o[2] for o in out] == [0, 1, 0, 1]


def test_rank_exception_is_forwarded_with_traceback():
    with pytest.raises(WorldError, match=r"rank 1 raised:(.|\n)*boom from rank one") as info:
        run_world(_raise_on_rank_one, 2)
    err = pickle.loads(pickle.dumps(info.value))  # what train.py reports, across a pickle too
    assert (err.rank, err.exitcode) == (1, 1) and "ValueError: boom from rank one" in err.detail


def test_hanging_collective_fails_in_bounded_time():
    """Rank 1 sleeps past the world's timeout while rank 0 waits in a collective: the runner
    kills both and names them (the error itself is the bound: no clock is read here)."""
    with pytest.raises(WorldError, match=r"rank\(s\) \[0, 1\] did not finish within 5 s"):
        run_world(_rank_one_skips_collective, 2, timeout_s=5)


def _rank_one_dies_or_freezes(out_dir: str, how: str):
    """Rank 1 writes its log, then kills or stops itself; its peers fail in the next collective
    (a reset connection, or their 5 s collective timeout). A subgroup joins the world's
    collective so that the timeout set for every group is what ends it."""
    from recipes.world_faults import set_collective_timeout

    dist.init_process_group("gloo", timeout=set_collective_timeout(5))
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # made later: torch's own default timeout unless replaced
    Path(out_dir, f"rank_{rank}.log").write_text(f"rank {rank} started\nrank {rank} at step 3\n")
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), getattr(signal, how))
    if rank < 2:
        dist.all_reduce(torch.ones(1), group=group)
    dist.all_reduce(torch.ones(1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process states: Linux")
def test_the_rank_that_died_or_froze_is_named_not_the_peer_that_noticed(tmp_path):
    """SIGKILL, then SIGSTOP, of rank 1 of 3: the error names rank 1 (its signal, or its
    stopped state once its peers' collective timeout has passed, in a subgroup too), with the
    last lines of its log, and lists the peers' errors as following from it."""
    log = str(tmp_path / "rank_{rank}.log")
    for how, reason in [
        ("SIGKILL", r"died first \(killed by SIGKILL, pid \d+\)"),
        ("SIGSTOP", r"stopped responding \(pid \d+, process state: stopped\)"),
    ]:
        with pytest.raises(WorldError) as info:
            run_world(_rank_one_dies_or_freezes, 3, str(tmp_path), how, backend=None, rank_log=log)
        err = pickle.loads(pickle.dumps(info.value))
        assert (err.rank, err.exitcode) == (1, -9 if how == "SIGKILL" else None), str(err)
        assert re.fullmatch(reason + ".*", err.reason), err.reason
        assert str(err).startswith(f"_rank_one_dies_or_freezes: rank 1 {err.reason}:\n")
        assert f"last lines of {tmp_path}/rank_1.log:\n  rank 1 started\n  rank 1 at step 3" in (
            err.detail
        )
        assert "the other ranks' failures, which follow from rank 1's:\n  rank " in err.detail


def _fail_on_sigterm_then_stop(out_dir: str):
    """Rank 0 answers SIGTERM by exiting with status 3 (no checkpoint possible); rank 1 ignores
    it. Rank 0 sends the caller SIGINT."""
    rank = dist.get_rank()
    handler = (lambda *_: os._exit(3)) if rank == 0 else signal.SIG_IGN
    signal.signal(signal.SIGTERM, handler)
    dist.barrier()
    if rank == 0:
        os.kill(mp.parent_process().pid, signal.SIGINT)
    time.sleep(600)


def test_the_stop_grace_ends_once_a_rank_has_failed():
    """A stop signal, then rank 0 fails during the grace: rank 1 is killed at once, not after
    the 600 s grace (WorldStopped says which)."""
    with pytest.raises(WorldStopped) as info:
        run_world(
            _fail_on_sigterm_then_stop,
            2,
            "",
            timeout_s=None,
            stop_signals=(signal.SIGINT,),
            grace_s=600,
        )
    assert str(info.value) == (
        "_fail_on_sigterm_then_stop: stopped by SIGINT; rank(s) [1] killed at once: "
        "rank 0 exit status 3"
    )
    assert info.value.when == "at once: rank 0 exit status 3"
