"""Shared pytest setup: markers by folder (`FOLDER_MARKS`), GPU tests skipped where no CUDA
device is present, and one three-strategy `train.py -m` sweep serves every test that reads such
runs."""

from pathlib import Path

import pytest
import torch

from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from tests.train_cli import start_train_py

#: markers implied by a test's folder: the fast lane (`-m "not slow"`) is tests/unit and
#: tests/property; a test that starts a world of ranks or a script lives in a slow folder
FOLDER_MARKS = {
    "distributed": ("slow",),
    "e2e": ("slow",),
    "slurm": ("slow", "slurm"),
    "gpu": ("gpu",),
}
TESTS = Path(__file__).resolve().parent
#: test files that share one worker under pytest-xdist (`-n N --dist loadgroup`): the Slurm
#: clusters start one at a time, and the files reading `strategy_sweep` share its one sweep
XDIST_GROUPS = {
    "slurm": "slurm",  # the folder
    "test_train.py": "strategy_sweep",
    "test_compare_strategies.py": "strategy_sweep",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        for name in FOLDER_MARKS.get(folder, ()):
            item.add_marker(getattr(pytest.mark, name))
        # one worker per file (module fixtures made once), or per group of files
        group = XDIST_GROUPS.get(folder) or XDIST_GROUPS.get(item.path.name, item.path.name)
        item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def strategy_sweep(tmp_path_factory) -> tuple[Path, str]:
    """`python train.py -m optim.remainder_strategy=agrs,pad_all2all,ragged_all_to_all`, run
    once: 4 CPU ranks, ep=2, 3 steps with a NaN gradient injected at step 2, memory measured
    on steps 1 and 3, a checkpoint every step, float32 Newton-Schulz (the strategies' losses
    are compared), W&B offline. Returns (the sweep's directory, the console output)."""
    from recipes.data import build_stdlib_tokens

    root = tmp_path_factory.mktemp("strategy-sweep")
    build_stdlib_tokens(str(root / "cache"))
    args = [
        "-m",
        f"optim.remainder_strategy={','.join(STRATEGIES)}",
        "train.steps=3",
        "train.inject_nan_at_step=2",
        "metrics.memory_every=2",
        "checkpoint.every=1",
        "checkpoint.keep=3",
        "checkpoint.export_hf=false",
        "optim.ns_dtype=float32",
        "data.seq_len=32",
        "data.batch_size=2",
        f"data.cache_dir={root / 'cache'}",
        "train.warmup_steps=1",
    ]
    proc = start_train_py(args, root)  # W&B offline: never the network
    out, _ = proc.communicate(timeout=420)
    assert proc.returncode == 0, out[-4000:]
    return root / "default", out
