"""The planner under context parallelism: GLM-5.2's long sequences on an H200 (141 GiB), the
cp = 1 figures of docs/planner.md, QK-clip's recording cost, and `--cp` refused up front."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from models.glm import get_preset
from models.glm.infra.context_parallel import local_tokens
from models.glm.model.qk_clip import recording_flops
from recipes.context_memory import cp_choices
from recipes.planning import attention_figures
from recipes.planning_step import planning_config
from recipes.step_memory import estimate_inputs, estimate_step_memory, smallest_fitting_cp
from recipes.units import GiB

ROOT = Path(__file__).resolve().parents[2]
CP_PARTS = {
    "gathered key side (all layers)",
    "gathered key side (one layer)",
    "gathered key side (recomputed)",
    "key-side gradients (one layer)",
}


@pytest.fixture(scope="module")
def glm52_full():
    """GLM-5.2 on 512 ranks, ep 8, full checkpointing, as `plan_memory.py --step` builds it."""
    cfg = planning_config("glm52", 512, 8, 131072, 1, "full", 1, ("optim.max_inflight=3",))
    yield estimate_inputs(cfg, world_size=512)
    dist.destroy_process_group()  # the fake world estimate_inputs joined


def _at(glm52_full, seq_len: int, cp: int = 1):
    model, opt, kw = glm52_full
    at = {"tokens": seq_len, "seq_len": seq_len, "cp": cp}
    return estimate_step_memory(model, opt, **{**kw, **at})


def test_cp_one_figures_are_docs_planner_md(glm52_full):
    """The checkpointed step at cp = 1, as docs/planner.md prints it (4096 and 131072 tokens)."""
    for seq_len, inputs, peak in ((4096, 4.078, 37.372), (131072, 130.501, 292.323)):
        est = _at(glm52_full, seq_len)
        assert round(est.parts["activations (layer inputs)"] / GiB, 3) == inputs
        assert round(est.total / GiB, 3) == peak
        assert not CP_PARTS & set(est.parts)


@pytest.mark.parametrize("seq_len,most", [(131072, 512), (1 << 20, 64)])
def test_glm52_long_sequences_fit_an_h200_at_the_smallest_cp_named(glm52_full, seq_len, most):
    model, opt, kw = glm52_full
    kw = {**kw, "tokens": seq_len, "seq_len": seq_len}
    found = smallest_fitting_cp(model, opt, kw, 512, 141)
    assert found is not None
    cp, est = found
    assert cp <= most and est.fits(141) and _at(glm52_full, seq_len, cp).total == est.total
    smaller = [c for c in cp_choices(512, seq_len) if c < cp]
    assert smaller and not any(_at(glm52_full, seq_len, c).fits(141) for c in smaller)
    assert {"gathered key side (recomputed)", "key-side gradients (one layer)"} <= set(est.parts)


def test_qk_clip_recording_costs_nothing_extra_on_the_sparse_path():
    opt = SimpleNamespace(state={})
    latent = attention_figures(opt, get_preset("glm52"), 8192, 4096, 1e15)
    assert latent["qk_clip_record_flops"] == 0 and latent["qk_clip_record_path"] == "sparse"
    masked = attention_figures(opt, get_preset("glm52", dsa_impl="masked"), 8192, 4096, 1e15)
    assert masked["qk_clip_record_flops"] > 0 and masked["qk_clip_record_path"] == "dense"


def test_qk_clip_recording_under_cp_is_the_ranks_share():
    """Head-tail chunks of whole query chunks: the cp ranks' recordings add up to one rank's
    of the whole sequence; the planner charges the view rank's share of its sequences."""
    S, cp, heads, qk = 4096, 4, 64, 128
    whole = recording_flops(S, heads, qk)
    parts = [recording_flops(S, heads, qk, local_tokens("head_tail", cp, r, S)) for r in range(cp)]
    assert sum(parts) == whole and max(parts) <= 1.1 * whole / cp
    opt, config = SimpleNamespace(state={}), get_preset("glm45_air")
    one = attention_figures(opt, config, 8192, S, 1e15)
    ranks = [attention_figures(opt, config, 8192, S, 1e15, cp=cp, rank=r) for r in range(cp)]
    assert sum(f["qk_clip_record_flops"] for f in ranks) == pytest.approx(
        cp * one["qk_clip_record_flops"], rel=1e-12
    )


def _plan_memory():
    path = ROOT / "scripts" / "plan_memory.py"
    spec = importlib.util.spec_from_file_location("plan_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--cp", "3"], "--cp 3 must be a positive divisor of the world of 512 ranks"),
        (["--cp", "0"], "--cp 0 must be a positive divisor"),
        (["--cp", "8", "--seq-len", "4104"], "--cp 8: 2 x cp = 16 must divide the sequence"),
    ],
)
def test_a_bad_cp_is_refused_before_any_work(flags, says, monkeypatch, capsys):
    script = _plan_memory()
    monkeypatch.setattr(script, "plan_from_args", lambda *a, **k: pytest.fail("planned"))
    with pytest.raises(SystemExit) as exit_:
        script.main(["--model", "glm52", "--world-size", "512", *flags])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
