"""Generated parameter sets and split layouts on two gloo ranks against the single-process
optimizer (`run_case` of test_muon_distributed.py: parameters, momentum and NorMuon moments
after three float32 steps).

The cases are drawn in the parent with a fixed seed, so every run checks the same ones, and
all run inside one spawned world: on a flat FSDP mesh of 2, matrices of 1-24 rows with one
block, `num_blocks` dividing the rows, or `split_sizes` of unequal heights whose count need
not divide the rows ((5, 3, 2) on 10 rows: MLA's nope + rope when odd), shards cutting blocks
or not; on an expert mesh (ep=2, efsdp=1), fused experts of 2 or 4 blocks; each under a drawn
remainder strategy (in turn), all-to-all on or off, NorMuon on or off (in turn).
"""

from __future__ import annotations

import random

from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from tests.distributed.test_muon_distributed import NORMUON, ep_shard, flat_shard, run_case
from tests.harness import init_mesh, run_world

SEED, CASES = 28, 8


def _blocks(rng: random.Random, rows: int):
    kind = rng.choice(["one", "divisor", "split"])
    if kind == "one" or rows == 1:
        return 1
    if kind == "divisor":
        return rng.choice([d for d in range(1, rows + 1) if rows % d == 0])
    while True:  # unequal heights (equal ones are the num_blocks case)
        cuts = sorted(rng.sample(range(1, rows), rng.randint(1, min(3, rows - 1))))
        sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True))
        if len(set(sizes)) > 1:
            return sizes


def generated_cases(seed: int = SEED, count: int = CASES) -> list[dict]:
    """`count` cases: (label, mesh, specs [((rows, cols), blocks)], strategy, a2a, normuon)."""
    rng = random.Random(seed)
    cases = [  # the layouts an audit found refused or wrong, then drawn ones
        dict(mesh="flat", specs=[((10, 6), (5, 3, 2))] * 3, strategy="pad_all2all", a2a=True),
    ]
    while len(cases) < count:
        mesh = rng.choice(["flat", "flat", "ep"])
        if mesh == "flat":
            specs = []
            for _ in range(rng.randint(1, 4)):
                rows, cols = rng.randint(1, 24), rng.randint(1, 12)
                specs += [((rows, cols), _blocks(rng, rows))] * rng.randint(1, 3)
        else:
            experts = rng.choice([2, 4])
            specs = [((experts * rng.randint(1, 6), rng.randint(2, 8)), experts)] * rng.randint(
                1, 3
            )
        cases.append(dict(mesh=mesh, specs=specs, a2a=rng.random() < 0.8))
    for i, case in enumerate(cases):  # every strategy, NorMuon on and off
        case["strategy"] = case.get("strategy") or STRATEGIES[i % len(STRATEGIES)]
        case["normuon"] = i % 2 == 1
        case["label"] = f"{case['mesh']} {case['strategy']} a2a={case['a2a']} {case['specs']}"
    return cases


def _generated_world(cases: list[dict]) -> list[tuple[str, float]]:
    flat, ep = init_mesh((2,), ("fsdp",)), init_mesh((1, 2), ("efsdp", "ep"))
    results = []
    for case in cases:
        shard = flat_shard(flat) if case["mesh"] == "flat" else ep_shard(ep)
        ns = NORMUON if case["normuon"] else None
        err, _ = run_case(case["specs"], shard, case["strategy"], case["a2a"], ns=ns)
        results.append((case["label"], err))
    return results


def test_generated_layouts_equal_the_single_process_result():
    results = run_world(_generated_world, 2, generated_cases(), timeout_s=600)
    assert results[0] == results[1]  # every rank saw the same max error (one all-reduce)
    for label, err in results[0]:
        # float32 Newton-Schulz on identical inputs: the bound of test_muon_distributed.py
        assert err < 2e-5, f"{label}: max |distributed - reference| = {err:.3g}"
