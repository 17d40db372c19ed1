"""Parts of the training loop on one process: the learning-rate schedule, the ranks' log files."""

import math

import pytest
from omegaconf import OmegaConf

from recipes.build import lr_lambda
from recipes.config import Config


def train_cfg(*overrides: str):
    base = ["mesh.world_size=2", "mesh.ep=1", "data.seq_len=32", "logger.backend=none"]
    return OmegaConf.merge(
        OmegaConf.structured(Config), OmegaConf.from_dotlist([*base, *overrides])
    )


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule(schedule):
    f = lr_lambda(
        train_cfg("train.steps=100", "train.warmup_steps=10", f"train.schedule={schedule}")
    )
    assert f(0) == pytest.approx(1 / 11) and f(9) == pytest.approx(10 / 11)
    assert f(10) == pytest.approx(1.0)
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[schedule]
    assert f(100) == pytest.approx(end)
    if schedule == "cosine":
        assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    values = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_rank_logging_files(tmp_path):
    """A rank's warnings (Python's and libraries') and its failure land in logs/rank_<k>.log;
    rank 0's lines also in train.log. In-process: the handlers are removed afterwards."""
    import logging
    import warnings

    from recipes import launch

    names = ("", "recipes", "recipes.failure", "torch", "torch.distributed")
    saved = {n: (logging.getLogger(n).propagate, logging.getLogger(n).level) for n in names}
    try:
        failure = launch.setup_logging(2, tmp_path)
        logging.getLogger("recipes").info("rank 2 info stays on the console")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a warning raised on rank 2", UserWarning, stacklevel=1)
        logging.getLogger("torch.distributed").warning("a library's warning")
        try:
            raise RuntimeError("boom")
        except RuntimeError as err:
            failure.error("rank %d failed: %r", 2, err, exc_info=True)
        launch.setup_logging(0, tmp_path)  # set up again in one process: replaced, not stacked
        logging.getLogger("recipes").info("a rank-0 line")
    finally:  # the loggers as they were, for the tests after this one in this process
        for name in names:
            logger = logging.getLogger(name)
            launch._replace(logger, [])
            logger.propagate = saved[name][0]
            logger.setLevel(saved[name][1])
        logging.captureWarnings(False)
    text = (tmp_path / "logs" / "rank_2.log").read_text()
    assert "UserWarning: a warning raised on rank 2" in text
    assert "[torch.distributed][WARNING] - a library's warning" in text
    assert "rank 2 failed: RuntimeError('boom')" in text and "Traceback" in text
    assert "info stays" not in text and "rank-0 line" not in text
    assert "[recipes][INFO] - a rank-0 line" in (tmp_path / "train.log").read_text()
    assert (tmp_path / "logs" / "rank_0.log").read_text() == ""
