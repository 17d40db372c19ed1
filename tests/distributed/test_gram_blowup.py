"""A Gram Newton-Schulz blow-up on one rank of a 2-rank FSDP world (muon.blowups): the matrices
that rank orthogonalized keep their values on both ranks, which hold a shard of each, the other
matrices step as they would without the blow-up, both ranks mark the step skipped, and the next
step's census demotes the batches that blew up to the standard iteration on both ranks, with
one warning each; on the full all-to-all path and on every remainder strategy.

The blow-up is forced on rank 0 only: `gram_iteration` is wrapped to multiply its output by 100
there (far outside the band). float32 Newton-Schulz; the unaffected matrices are compared
exactly with the same world's run without the blow-up (the same ops in the same order).
"""

from __future__ import annotations

import importlib
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from muon import Muon
from tests.harness import init_mesh, run_world

SHAPE = (256, 768)  # Gram under the default ns_algorithm="auto"


def _run(blow_up: bool, strategy: str) -> dict:
    ns_module = importlib.import_module("muon.newton_schulz")
    real, calls = ns_module.gram_iteration, []

    def gram(X, *args):
        calls.append(1)
        out = real(X, *args)
        return out.mul_(100.0) if armed and dist.get_rank() == 0 else out

    ns_module.gram_iteration = gram
    try:
        gen = torch.Generator().manual_seed(0)
        holder = nn.Module()
        holder.ps = nn.ParameterList(
            [nn.Parameter(torch.randn(*SHAPE, generator=gen)) for _ in range(3)]
        )
        fully_shard(holder, mesh=init_mesh((2,), ("fsdp",)))
        params = list(holder.ps)
        opt = Muon(
            [{"params": params}],
            lr=0.02,
            weight_decay=0.1,
            ns_dtype=torch.float32,
            remainder_strategy=strategy,
        )
        batches = [b for _, bs in opt.plans for b in bs]
        out: dict = {
            "paths": sorted(b.path for b in batches),
            # (matrices, their owners) per batch: rank 0's matrices are those that blow up
            "batches": [(b.param_indices, b.owners) for b in batches],
        }
        before = [p.to_local().clone() for p in params]
        for step in range(2):
            armed = blow_up and step == 0
            gen_step = torch.Generator().manual_seed(10 + step)
            for p in params:
                full = torch.randn(p.shape, generator=gen_step)
                p.grad = distribute_tensor(full, p.device_mesh, p.placements)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                n = len(calls)
                opt.step()
            out[f"gram_calls_{step}"] = len(calls) - n
            out[f"warned_{step}"] = sum("standard iteration" in str(w.message) for w in caught)
            out[f"skipped_{step}"] = opt.last_step_skipped
            kept = zip(params, before, strict=True)
            out[f"kept_{step}"] = [torch.equal(p.to_local(), b) for p, b in kept]
            out[f"params_{step}"] = [p.to_local().clone() for p in params]
        return out
    finally:
        ns_module.gram_iteration = real


def _all(strategies: list[str]) -> dict:
    """Both runs' figures per remainder strategy (plain data: a rank's tensors do not outlive
    it), their parameters compared here."""
    out = {}
    for strategy in strategies:
        blown, clean = _run(True, strategy), _run(False, strategy)
        pairs = zip(blown["params_0"], clean["params_0"], strict=True)
        same = [torch.equal(a, b) for a, b in pairs]
        for res in (blown, clean):
            for step in range(2):
                del res[f"params_{step}"]
        out[strategy] = {"blown": blown, "clean": clean, "same_0": same}
    return out


STRATEGIES = ["agrs", "pad_all2all", "ragged_all_to_all"]


def test_a_blow_up_on_one_rank_refuses_its_matrices_on_both_and_demotes_the_batch():
    """Three matrices on two ranks: a full batch (one matrix owned by each rank) and a
    remainder batch of one, exchanged by each remainder strategy."""
    results = run_world(_all, 2, STRATEGIES, timeout_s=900)
    for rank, by_strategy in enumerate(results):
        for strategy, res in by_strategy.items():
            blown, clean = res["blown"], res["clean"]
            where = (rank, strategy, blown["paths"])
            assert blown["paths"] == sorted(["full", strategy]), where
            batches = blown["batches"]
            mine = {i for b, owners in batches for i, o in zip(b, owners, strict=True) if o == 0}
            assert 1 <= len(mine) <= 2, where
            for i in range(3):  # rank 0's matrices kept on both ranks; the others stepped
                assert blown["kept_0"][i] == (i in mine), (where, blown["kept_0"])
                assert res["same_0"][i] == (i not in mine), (where, res["same_0"])
            assert blown["skipped_0"] and not clean["skipped_0"], where
            # the next step: both ranks learn it from the census, warn once per batch that
            # blew up and run the standard iteration on it (Gram only on the others)
            demoted = [set(b) & mine != set() for b, _ in batches]
            gram_here = [rank in owners for _, owners in batches]
            assert blown["warned_1"] == sum(demoted) and clean["warned_1"] == 0, where
            assert clean["gram_calls_1"] == sum(gram_here), where
            kept_gram = sum(g and not d for g, d in zip(gram_here, demoted, strict=True))
            assert blown["gram_calls_1"] == kept_gram, where
            assert not blown["skipped_1"], where
