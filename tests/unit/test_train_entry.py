"""train.py's entry: the fork server its local world's ranks fork from is started only when a
local world will be started (and, tests/unit/test_config_preflight.py, only once the config
passed its torch-free checks)."""

import pytest

import train


@pytest.mark.parametrize(
    ("argv", "env", "starts"),
    [
        ([], {}, True),
        (["-m", "optim.remainder_strategy=agrs,pad_all2all", "mesh.ep=1"], {}, True),
        (["--help"], {}, False),
        (["optim=adamw", "-h"], {}, False),
        (["--cfg", "job"], {}, False),
        (["-m", "hydra/launcher=slurm", "hydra.launcher.nodes=2"], {}, False),
        ([], {"RANK": "0"}, False),  # torchrun / Slurm: this process is a rank
        ([], {"SUBMITIT_FOLDER": "/x"}, False),  # a submitit job joins its tasks' world
    ],
)
def test_fork_server_starts_only_for_a_local_world(argv, env, starts, monkeypatch):
    for key in ("RANK", "SUBMITIT_FOLDER"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert train.starts_a_local_world(argv) is starts
