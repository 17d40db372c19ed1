"""metrics.jsonl read back (recipes.metrics_file): a cut last line is set apart and dropped on
resume with a warning; any other bad line is an error naming its line number."""

import json
import logging

import pytest

from recipes.metrics import truncate_after
from recipes.metrics_file import MetricsFileError, read_metrics


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_a_cut_last_line_is_dropped_on_resume_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)]
    _write(path, rows, tail='{"step": 4, "loss": 4.1870074272')  # the disk filled mid-line
    found = read_metrics(path)
    assert (found.rows, found.cut, found.cut_line) == (rows, '{"step": 4, "loss": 4.1870074272', 4)
    with caplog.at_level(logging.WARNING, logger="recipes"):
        truncate_after(path, 2)
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:2])
    (record,) = caplog.records
    assert f"{path}:4: the last line is cut" in record.getMessage()
    assert read_metrics(path).cut is None  # whole again


@pytest.mark.parametrize("bad", ['{"step": 2, "loss"', "[1, 2]", '{"loss": 1.0}', '{"step": "2"}'])
def test_any_other_bad_line_is_an_error_naming_its_line(tmp_path, bad):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 1}}\n\n{bad}\n{{"step": 3}}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:3: not a metrics row"):
        read_metrics(path)
    with pytest.raises(MetricsFileError, match=r"fix or remove line 3"):
        truncate_after(path, 3)
    assert path.read_text().startswith('{"step": 1}\n\n')  # left as it was


def test_no_file_and_a_whole_file(tmp_path):
    assert read_metrics(tmp_path / "none.jsonl").rows == []
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 1}, {"step": 2}])
    assert read_metrics(path).rows == [{"step": 1}, {"step": 2}] and read_metrics(path).cut is None
