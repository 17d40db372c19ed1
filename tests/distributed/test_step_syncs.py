"""Host syncs of train.py's step as a GPU would see them, counted on CPU (recipes.bench.probe):
what the optimizer, the MoE dispatch and the trainer read from the device per step.

One 2-rank world (mesh.ep=2) counts rank 0's step of every case; the counts are deterministic
(they depend on the model, the mesh and the code, not on the machine or the data's values), so
the thresholds are exact. Small batches: the counts do not depend on the number of tokens.
"""

import pytest

from recipes.bench.probe_step import REGIONS, layer_counts
from tests.harness import run_world

OPT, PART, STEP = REGIONS
_SHARED = ["mesh.ep=2", "data.seq_len=32", "data.batch_size=2"]
CASES = {
    "small": ["model=small"],
    "small_normuon": ["model=small", "optim.normuon=true"],
    "mla_tiny": ["model=mla_tiny"],
    "small_3_layers": ["model=small", "++model.overrides.num_hidden_layers=3"],
    "small_standard": ["model=small", "optim.ns_algorithm=standard"],
}
#: `Muon.step`'s dispatched ops on rank 0 at commit 0290dae (the per-parameter update code),
#: from `python scripts/probe_step.py mesh.ep=2 data.seq_len=32 data.batch_size=2
#: --case model=small --case model=mla_tiny --no-double --baseline-tree <0290dae checkout>`
#: ("before" rows; the same without the data overrides: the step's ops do not depend on tokens)
OPS_AT_0290DAE = {"small": 2884, "mla_tiny": 3033}


def _count_cases(cases: dict[str, list[str]]) -> dict[str, dict]:
    from recipes.bench.probe_step import count_rank

    return {name: count_rank(case, profile=False) for name, case in cases.items()}


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict[str, dict]:
    cache = tmp_path_factory.mktemp("cache")
    extra = [*_SHARED, f"data.cache_dir={cache}", "mesh.world_size=2"]
    cases = {name: [*case, *extra] for name, case in CASES.items()}
    out = run_world(_count_cases, 2, cases, timeout_s=1200)[0]
    for name, case in cases.items():
        out[name]["layers"] = layer_counts(case)
    return out


def _sites(region: dict, under: str) -> int:
    return sum(s["count"] for s in region["syncs_by_site"] if s["site"].startswith(under))


def test_the_trainer_reads_the_device_once_per_logged_step(counts):
    """The trainer's own syncs: one stacked read of the step's figures and one copy of the
    batch per micro-step; none in its optimizer part besides the optimizer's own."""
    for name, c in counts.items():
        assert _sites(c[STEP], "recipes/") == 2, (name, c[STEP]["syncs_by_site"])
        assert _sites(c[PART], "recipes/") == 0, (name, c[PART]["syncs_by_site"])
        assert c[PART]["syncs"] == c[OPT]["syncs"], name


def test_muon_step_syncs_at_most_once(counts):
    """The gradient census is Muon.step's one device-to-host read, with the default
    `ns_algorithm="auto"` (Gram Newton-Schulz on the dense MLP's 256 x 768 blocks, whose
    blow-up counts ride in the census, `muon.blowups`) as with the standard iteration."""
    for name in ("small", "small_normuon", "mla_tiny", "small_standard"):
        opt = counts[name][OPT]
        assert counts[name]["optimizer"] == "Muon.step"
        assert opt["syncs"] <= 1, (name, opt["syncs_by_site"])
        assert _sites(opt, "muon/newton_schulz.py") == 0, (name, opt["syncs_by_site"])


def test_muon_step_syncs_do_not_grow_with_layers(counts):
    three, six = counts["small_3_layers"], counts["small"]
    assert (three["layers"]["layers"], six["layers"]["layers"]) == (3, 6)
    assert three[OPT]["syncs"] == six[OPT]["syncs"]


def test_train_step_syncs_at_most_one_per_moe_layer_and_two(counts):
    """At most one read per MoE layer (the all-to-all split sizes), the census, the logged
    figures, and the batch's copy."""
    for name, c in counts.items():
        bound = c["layers"]["moe_layers"] + 2 + 1
        assert c[STEP]["syncs"] <= bound, (name, c[STEP]["syncs_by_site"])


def test_muon_step_ops_at_most_035x_of_the_per_parameter_code(counts):
    """Momentum, the update guard and the apply dispatch a fixed number of ops per batch."""
    for name, before in OPS_AT_0290DAE.items():
        ops = counts[name][OPT]["ops"]
        assert ops <= 0.35 * before, (name, ops, counts[name][OPT]["ops_by_site"])


def test_muon_step_ops_grow_with_batches_not_parameters(counts):
    """Twice the layers put most of their parameters into the batches that were there (same
    shapes stack): the step's ops grow by at most what the added batches cost, each counted at
    the 3-layer step's ops per batch (its census and AdamW groups included), whatever the
    parameters they added to the others."""
    three, six = counts["small_3_layers"], counts["small"]
    (p3, b3), (p6, b6) = ((c["batches"]["params"], c["batches"]["batches"]) for c in (three, six))
    assert p6 >= 2 * p3 and 4 * (b6 - b3) < p6 - p3, (three["batches"], six["batches"])
    grown = six[OPT]["ops"] - three[OPT]["ops"]
    assert grown <= (b6 - b3) * three[OPT]["ops"] / b3, (grown, three["batches"], six["batches"])
