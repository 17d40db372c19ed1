"""`scripts/export_hf.py` on what a user may hand it: a mistyped checkpoint name (said as
missing, the real names listed), a damaged checkpoint or one with NaN weights (refused, exit 1,
no output left), and a sound one (every file written with the same mode)."""

import importlib.util
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch

from models.glm import GLMForCausalLM
from recipes import checkpoint
from tests.models import tiny_glm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")


def _script():
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("export_hf", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Checkpoints of a tiny GLM at steps 1 (sound) and 2 (a NaN in one weight)."""
    root = tmp_path_factory.mktemp("export") / "checkpoints"
    config = tiny_glm(num_hidden_layers=2)
    torch.manual_seed(0)
    model = GLMForCausalLM(config)
    model.init_weights(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"samples": 0, "model_config": config.to_dict()}
    checkpoint.save(root, 1, model, opt, state, keep=2)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    checkpoint.save(root, 2, model, opt, state, keep=2)
    return root


def test_a_mistyped_checkpoint_is_said_missing_with_the_real_names(run, tmp_path, capsys):
    export = _script()
    with pytest.raises(SystemExit) as err:
        export.main([str(run / "step_1"), str(tmp_path / "out")])
    said = capsys.readouterr().err
    assert err.value.code == 2
    assert f"{run / 'step_1'}: no such directory (committed checkpoints in {run}: " in said
    assert "step_00000001, step_00000002)" in said
    with pytest.raises(SystemExit):  # the run's checkpoints/ folder itself
        export.main([str(run), str(tmp_path / "out")])
    assert "not a checkpoint but holds the committed ones step_00000001" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_nan_weights_and_a_damaged_shard_are_refused_leaving_no_output(run, tmp_path, capsys):
    export = _script()
    assert export.main([str(run / "step_00000002"), str(tmp_path / "nan")]) == 1
    said = capsys.readouterr().err
    assert said.startswith(f"export_hf.py: checkpoint {run / 'step_00000002'}: ")
    assert "holds non-finite values (NaN or inf)" in said
    assert not (tmp_path / "nan").exists()
    damaged = tmp_path / "damaged"
    shutil.copytree(run / "step_00000001", damaged)
    shard = damaged / "model" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    assert export.main([str(damaged), str(tmp_path / "out")]) == 1
    said = capsys.readouterr().err
    assert f"checkpoint {damaged} refused: model/__0_0.distcp: " in said and "truncated" in said
    assert not (tmp_path / "out").exists()


def test_every_exported_file_gets_the_mode_of_the_json_files(run, tmp_path, capsys):
    export = _script()
    before = os.umask(0o022)
    try:
        assert export.main([str(run / "step_00000001"), str(tmp_path / "out")]) == 0
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert any(name.endswith(".safetensors") for name in modes), modes
    assert set(modes.values()) == {0o644}, modes
