"""recipes/outputs.py: a taken output is refused unless `--force`, which never removes an input;
scripts/export_hf.py checks its `out` before reading the checkpoint."""

import importlib.util
from pathlib import Path

import pytest

from recipes.checkpoint import COMMITTED
from recipes.outputs import OutputExists, check_output, replace_output

ROOT = Path(__file__).resolve().parents[2]


def test_taken_outputs_are_refused_and_force_replaces_them(tmp_path):
    empty, full, file = tmp_path / "empty", tmp_path / "full", tmp_path / "file"
    empty.mkdir()
    full.mkdir()
    (full / "a").write_text("")
    file.write_text("")
    for free in (empty, tmp_path / "missing"):
        check_output(free, force=False)
    with pytest.raises(OutputExists, match=r"--out .*full: exists and is a non-empty directory"):
        check_output(full, force=False)
    with pytest.raises(OutputExists, match=r"--out .*file: exists and is a file; pass --force"):
        replace_output(file, force=False)
    with pytest.raises(OutputExists, match=r"holds the input .*full/a; --force would delete it"):
        replace_output(full, force=True, inputs=[full / "a"])
    assert (full / "a").exists()
    replace_output(full, force=True, inputs=[file])
    replace_output(file, force=True)
    assert not full.exists() and not file.exists()


def test_export_hf_refuses_a_taken_out_before_reading_the_checkpoint(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (ckpt / COMMITTED).write_text("")  # committed, but empty: reading it would fail otherwise
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    for argv, message in (
        ([str(ckpt), str(out)], f"out {out}: exists and is a non-empty directory; pass --force"),
        ([str(ckpt), str(tmp_path / "run"), "--force"], f"holds the input {ckpt}"),
    ):
        with pytest.raises(SystemExit) as err:
            mod.main(argv)
        assert err.value.code == 2 and message in capsys.readouterr().err
    assert (out / "config.json").read_text() == "{}" and (ckpt / COMMITTED).exists()
