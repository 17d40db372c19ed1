"""Checkpoint RNG states are plain tensors: nothing in `rng/` can run code when resumed."""

import pytest
import torch

from recipes import checkpoint
from tests.faults import Payload


def test_rng_states_round_trip_as_safetensors(tmp_path):
    (tmp_path / "rng").mkdir()
    checkpoint.write_rng(tmp_path, 3)
    expected = torch.get_rng_state()
    torch.rand(5)  # moves the generator on
    assert [p.name for p in (tmp_path / "rng").iterdir()] == ["rank_3.safetensors"]
    state = checkpoint.read_rng(tmp_path, 3)
    assert torch.equal(state["cpu"], expected)
    assert checkpoint.read_rng(tmp_path, 0) is None  # another world's rank: not restored


def test_rng_file_of_an_older_checkpoint_still_loads(tmp_path):
    """Checkpoints written before the safetensors format hold `rank_<k>.pt` (torch.save of the
    same byte tensors): they load with weights_only=True."""
    (tmp_path / "rng").mkdir()
    torch.save(checkpoint.rng_state(), tmp_path / "rng" / "rank_0.pt")
    assert torch.equal(checkpoint.read_rng(tmp_path, 0)["cpu"], torch.get_rng_state())


def test_a_crafted_pickle_in_rng_is_refused_not_run(tmp_path):
    (tmp_path / "rng").mkdir()
    ran = tmp_path / "code-ran"
    torch.save({"cpu": Payload(str(ran))}, tmp_path / "rng" / "rank_0.pt")
    with pytest.raises(ValueError, match=r"rank_0.pt: not plain RNG tensors, refused") as err:
        checkpoint.read_rng(tmp_path, 0)
    assert "Delete" in str(err.value) and not ran.exists()
    # the same pickle read the trusting way does run code: the test's payload is real
    torch.load(tmp_path / "rng" / "rank_0.pt", weights_only=False)
    assert ran.exists()
