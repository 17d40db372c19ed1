"""The multi-rank harness itself: passing collectives, forwarded errors, bounded hangs."""

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
    import time

    start = time.monotonic()
    with pytest.raises(WorldError, match=r"rank\(s\) \[0, 1\] did not finish within 15 s"):
        run_world(_rank_one_skips_collective, 2, timeout_s=15)
    assert time.monotonic() - start < 40
