"""The attention benchmark's pieces: one in-process measurement of the layer, the targets'
verdicts from rows, the skipped-runs line, and its command line refusing bad values."""

import importlib.util
from pathlib import Path

import pytest

from recipes.bench.attention import layer_config, measure
from recipes.bench.attention_report import skipped_note, targets

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_attention", ROOT / "scripts/bench_attention.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_is_the_benchmarked_shape():
    c = layer_config(1024, "latent", "kl")
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (
        512,
        16,
        128,
        128,
    )
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (32, 16, 32)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (4, 32, 256)
    assert (c.dsa_impl, c.indexer_training, c.num_hidden_layers) == ("latent", "kl", 1)


@pytest.mark.parametrize("dsa_impl", ["latent", "masked"])
def test_measure_runs_one_step_and_reports_a_peak(dsa_impl):
    import torch

    threads = torch.get_num_threads()  # measure() sets one thread, for its own process
    try:
        row = measure(300, dsa_impl, "kl", repeats=1)  # T > index_topk: sparse
    finally:
        torch.set_num_threads(threads)
    assert row["T"] == 300 and row["dsa_impl"] == dsa_impl and row["seconds"] > 0
    assert row["peak_mib"] > 0


def _row(T, dsa_impl, mode, s, mib):
    return {"T": T, "dsa_impl": dsa_impl, "mode": mode, "seconds": s, "peak_mib": mib}


def test_targets_pass_miss_and_not_run():
    rows = []
    for mode in ("frozen", "kl"):
        rows += [_row(4096, "masked", mode, 10.0, 1000.0), _row(2048, "latent", mode, 1.0, 100.0)]
        rows += [_row(4096, "latent", mode, 3.0, 200.0)]
    rows.append(_row(8192, "latent", "frozen", 12.0, 500.0))  # time 12x (MISS), peak 2.5x (MISS)
    got = {t["target"]: t["ok"] for t in targets(rows)}
    assert got["T=4096 frozen: sparse / masked time"] is True  # 0.3 <= 0.35
    assert got["T=4096 kl: sparse / masked peak"] is True  # 0.2 <= 0.25
    assert got["frozen: sparse peak 8192 / 4096"] is False
    assert got["frozen: sparse time 8192 / 2048"] is False
    assert got["kl: sparse peak 8192 / 4096"] is None  # kl at 8192 was not run


def test_skipped_note_names_dsa_impl_lengths_and_reason():
    rows = [
        {"T": T, "dsa_impl": "masked", "mode": m, "skipped": "T > 4096"}
        for T in (8192, 16384)
        for m in ("frozen", "kl")
    ]
    assert skipped_note(rows) == "Not run: masked at T = 8192, 16384 (T > 4096)."
    assert skipped_note([_row(1024, "latent", "kl", 1.0, 1.0)]) == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dsa-impls", "latent,sparse"], "--dsa-impls: ['sparse']"),
        (["--modes", "train"], "--modes: ['train']"),
        (["--lengths", "1024,x"], "--lengths: positive ints"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--paths", "latent"], "--paths is now --dsa-impls (of masked, latent, per_head)"),
    ],
)
def test_command_line_refuses_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        _script().parse_args(argv)
    assert message in capsys.readouterr().err
