"""recipes.checkpoint.latest: only committed checkpoints count."""

from recipes import checkpoint


def test_latest_ignores_uncommitted(tmp_path):
    (tmp_path / "step_00000004").mkdir()  # killed before the marker
    (tmp_path / ".tmp-step_00000006").mkdir()
    assert checkpoint.latest(tmp_path) is None
    (tmp_path / "step_00000002").mkdir()
    (tmp_path / "step_00000002" / checkpoint.COMMITTED).write_text("2\n")
    assert checkpoint.latest(tmp_path) == tmp_path / "step_00000002"
    assert checkpoint.latest(tmp_path / "missing") is None
