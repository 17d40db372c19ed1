"""Muon rejects what it cannot do: group keys, group edits, state dicts (muon/validate.py,
muon/optimizer.py). Single process, CPU, fast."""

import pytest
import torch
from torch import nn

from muon import Muon
from muon.validate import ADAMW_GROUP_KEYS, MUON_GROUP_KEYS


def _w(*shape, seed=0):
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


# ----------------------------------------------------------------------------- group keys


@pytest.mark.parametrize(
    "group, key, names",
    [
        ({"num_experts": 4}, "num_experts", ["num_blocks"]),
        ({"split_sizes": [16, 16]}, "split_sizes", list(MUON_GROUP_KEYS)),
        ({"algorithm": "adamw", "maximize": True}, "maximize", list(ADAMW_GROUP_KEYS)),
        ({"algorithm": "adamw", "amsgrad": True}, "amsgrad", list(ADAMW_GROUP_KEYS)),
        ({"algorithm": "adamw", "weight_decy": 0.1}, "weight_decy", list(ADAMW_GROUP_KEYS)),
        ({"algorithm": "adamw", "momentum": 0.9}, "momentum", ["betas"]),
        ({"betas": (0.9, 0.99)}, "betas", list(MUON_GROUP_KEYS)),
    ],
    ids=[
        "renamed",
        "muon-unknown",
        "maximize",
        "amsgrad",
        "typo",
        "muon-key-in-adamw",
        "adamw-key",
    ],
)
def test_unknown_group_keys_are_rejected_by_name(group, key, names):
    """Every key of every group is checked, in the constructor and in add_param_group; the
    message names the key and the accepted keys (a renamed key its new name)."""
    for build in (
        lambda: Muon([{"params": [_w(32, 16)], **group}]),
        lambda: Muon([_w(8, 8)]).add_param_group({"params": [_w(32, 16)], **group}),
    ):
        with pytest.raises(ValueError) as info:
            build()
        msg = str(info.value)
        assert repr(key) in msg, msg
        for name in names:
            assert name in msg, msg


def test_accepted_keys_and_scheduler_keys_pass():
    w, b = _w(32, 16), nn.Parameter(torch.zeros(16))
    opt = Muon(
        [
            {"params": [w], "num_blocks": 2, "ns_dtype": "float32"},
            {"params": [b], "algorithm": "adamw", "lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-6},
        ]
    )
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # writes "initial_lr"
    opt.add_param_group({"params": [_w(8, 8)], "initial_lr": 0.1})
    assert set(opt.param_groups[1]) <= set(ADAMW_GROUP_KEYS) | {"initial_lr"}
