"""The world runner itself (recipes.bench.world, through tests.harness): passing collectives,
a world that joins its process group from the environment, forwarded errors, bounded hangs."""

import pytest
import torch
import torch.distributed as dist

from tests.harness import WorldError, init_mesh, run_world


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


@pytest.mark.slow
def test_world_joined_from_the_environment_with_another_checkout(tmp_path):
    (tmp_path / "muon").mkdir()
    (tmp_path / "muon" / "__init__.py").write_text("")
    out = run_world(_join_from_environment, 2, backend=None, pythonpath=str(tmp_path))
    assert out == [(2.0, str(tmp_path / "muon" / "__init__.py"))] * 2


@pytest.mark.slow
def test_passing_collective_and_2d_mesh():
    out = run_world(_all_reduce_and_mesh, 4)
    assert [o[0] for o in out] == [10.0] * 4
    assert all(o[1] == 2 and o[3] == 4 for o in out)
    assert [o[2] for o in out] == [0, 1, 0, 1]


@pytest.mark.slow
def test_rank_exception_is_forwarded_with_traceback():
    with pytest.raises(WorldError, match=r"rank 1 raised:(.|\n)*boom from rank one"):
        run_world(_raise_on_rank_one, 2)


@pytest.mark.slow
def test_hanging_collective_fails_in_bounded_time():
    """Rank 1 sleeps past the world's timeout while rank 0 waits in a collective: the runner
    kills both and names them (the error itself is the bound: no clock is read here)."""
    with pytest.raises(WorldError, match=r"rank\(s\) \[0, 1\] did not finish within 5 s"):
        run_world(_rank_one_skips_collective, 2, timeout_s=5)
