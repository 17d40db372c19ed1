"""The run directory's name of a command that holds paths (recipes/config/run_dir.py)."""

import shlex
from pathlib import Path

from hydra import compose, initialize_config_dir

from recipes import config as schema
from recipes.config import reuse_export_command, run_dir

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


def _run_leaf(overrides: list[str], dirname: bool = False) -> str:
    """The run directory's leaf of `overrides` (`dirname`: Hydra's override_dirname)."""
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    if dirname:
        return cfg.hydra.job.override_dirname
    leaf = Path(cfg.hydra.run.dir).name
    assert leaf == cfg.hydra.sweep.subdir  # a sweep's job and a single run: one name
    return leaf


def test_run_dir_of_an_export_is_short_and_distinct_per_path():
    """The summary's export command names a run by each path's last two components and a
    hash (the second mention of a path by its hash only): short, one name per command, two
    paths two names; names of runs without a path stay Hydra's override_dirname, made safe."""
    source = "outputs/default/model-mla_tiny+train.steps-20/hf"  # a run of two overrides
    export = shlex.split(reuse_export_command(Path(source)))
    leaf = _run_leaf(export)
    assert len(leaf) < 80 and leaf == _run_leaf(list(reversed(export)))
    digest = run_dir.path_tail(source).split("@")[1]
    assert leaf == f"checkpoint.init_from-train.steps-20_hf@{digest}+model.path-@{digest}+model-hf"
    other = [w.replace("steps-20", "steps-30") for w in export]
    assert _run_leaf(other) != leaf and len(_run_leaf(other)) == len(leaf)
    mixed = [*export[:2], f"checkpoint.init_from={source.replace('20', '30')}"]
    assert len({leaf, _run_leaf(mixed)}) == 2
    assert _run_leaf(["data.path=/x/a/b", "model=mla_tiny"]).startswith("data.path-a_b@")
    assert _run_leaf(["data.path=a/b"]) != _run_leaf(["data.path=a_b"]) == "data.path-a_b"
    # A tail cut to PATH_TAIL_MAX starts at an item; a different head is still another name.
    deep = ["model.path=/r/" + "+".join(f"k{i}-{i}" for i in range(9)) + "/hf"]
    assert _run_leaf(deep).startswith("model.path-k5-5+k6-6+k7-7+k8-8_hf@")  # 22 of 24
    assert _run_leaf(deep) != _run_leaf([deep[0].replace("k0-0", "k0-1")])
    for overrides in ([], ["model=mla_tiny", "mesh.ep=1"], ["optim.betas=[0.9,0.95]"]):
        dirname = _run_leaf(overrides, dirname=True)
        assert _run_leaf(overrides) == schema.run_id(dirname)  # as before paths were shortened
    assert _run_leaf(["model=mla_tiny", "train.steps=20"]) == "model-mla_tiny+train.steps-20"
    # docs/training.md's example and its lengths
    docs = shlex.split(reuse_export_command(Path("outputs/default/base/hf")))
    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    named, written = _run_leaf(docs), schema.run_id(_run_leaf(docs, dirname=True))
    assert f"`outputs/default/{named}` ({len(named)} characters, {len(written)} with" in text
