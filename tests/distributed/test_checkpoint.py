"""Checkpoint commit protocol and resharding, on a small FSDP2 stand-in model (gloo, CPU)."""

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from models.glm.infra.local import local_tensor
from recipes import checkpoint
from recipes.checkpoint import COMMITTED
from tests.harness import WorldError, run_world
from tests.reference import assert_same_step


class StandIn(nn.Module):
    """Embedding, a hidden matrix and a head: enough to exercise sharded state dicts."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 12)
        self.hidden = nn.Linear(12, 10, bias=False)
        self.head = nn.Linear(10, 16)

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.embed(x))))


def _build(seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = StandIn()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.hidden, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, steps: int, start: int = 0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * s + dist.get_rank())
        x = torch.randint(0, 16, (4, 5), generator=g)
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _full(model, opt):
    """Full parameters and first moments as numpy (tensors do not cross the result queue)."""
    params = {n: p.detach().full_tensor().numpy() for n, p in model.named_parameters()}
    sd = opt.state_dict()["state"]
    moments = [sd[i]["exp_avg"].full_tensor().numpy() for i in sorted(sd)]
    return params, moments


def _save_then_die_mid_save(root: str):
    """Save at 2 (and keep what it holds in a file); at 3 every rank writes its model shards,
    then kills itself with SIGKILL before the optimizer state and the commit."""
    root = Path(root)
    model, opt = _build()
    _train(model, opt, 2)
    checkpoint.save(root, 2, model, opt, {"samples": 8}, keep=2)
    params, moments = _full(model, opt)
    if dist.get_rank() == 0:
        np.savez(root / "expected.npz", *moments, **params)
    dist.barrier()
    _train(model, opt, 1, start=2)
    real_save = checkpoint.dcp.save

    def save_then_die(state_dict, *, storage_writer):
        real_save(state_dict, storage_writer=storage_writer)
        if Path(storage_writer.path).name == "model":
            os.kill(os.getpid(), signal.SIGKILL)  # model written; optimizer and commit not

    checkpoint.dcp.save = save_then_die
    checkpoint.save(root, 3, model, opt, {"samples": 12}, keep=2)


def _load_then_prune(root: str):
    """Load (into a fresh model) the newest checkpoint; then saves at 3, 4, 5 and a rerun of 5
    with keep=2."""
    root = Path(root)
    fresh, fresh_opt = _build(seed=1)  # different init: everything must come from the file
    state = checkpoint.load(checkpoint.latest(root), fresh, fresh_opt)
    state["rng"] = state["rng"] is not None  # tensors do not cross the result queue
    loaded = _full(fresh, fresh_opt)
    for step in (3, 4, 5):
        _train(fresh, fresh_opt, 1, start=step)
        checkpoint.save(root, step, fresh, fresh_opt, {"samples": step}, keep=2)
    checkpoint.save(root, 5, fresh, fresh_opt, {"samples": 55}, keep=2)  # a rerun of a step
    return state, loaded


def test_killed_mid_save_keeps_previous_then_keep_prunes(tmp_path):
    with pytest.raises(WorldError, match="died"):
        run_world(_save_then_die_mid_save, 4, str(tmp_path))
    partial = tmp_path / ".tmp-step_00000003"
    assert (partial / "model" / ".metadata").is_file() and not (partial / COMMITTED).exists()
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step_00000002"]
    state, loaded = run_world(_load_then_prune, 4, str(tmp_path))[0]
    assert state["step"] == 2 and state["samples"] == 8 and state["world_size"] == 4
    assert state["rng"]  # same world size: this rank's RNG comes back
    expected = np.load(tmp_path / "expected.npz")
    for key, value in loaded[0].items():
        np.testing.assert_array_equal(value, expected[key])
    for i, got in enumerate(loaded[1]):
        np.testing.assert_array_equal(got, expected[f"arr_{i}"])
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step_00000004", "step_00000005"]
    assert json.loads((tmp_path / "step_00000005" / "trainer.json").read_text())["samples"] == 55
    assert not list(tmp_path.glob(".tmp-*"))
    for part in ("model", "optim"):  # DCP's sharded format: every rank wrote its own file
        files = sorted(p.name for p in (tmp_path / "step_00000005" / part).iterdir())
        assert files == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]


def _verified_resume(root: str):
    """Save at 1 and 2 on every rank; rank 0 cuts rank 1's optimizer shard of step 2; then
    load_newest without and with fallback, into a fresh model: what each rank sees."""
    from recipes.checkpoint_resume import CheckpointRefused, load_newest

    root = Path(root)
    model, opt = _build()
    _train(model, opt, 1)
    checkpoint.save(root, 1, model, opt, {"samples": 4}, keep=3)
    first = _full(model, opt)
    _train(model, opt, 1, start=1)
    checkpoint.save(root, 2, model, opt, {"samples": 8}, keep=3)
    shard = root / "step_00000002" / "optim" / "__1_0.distcp"
    if dist.get_rank() == 0:
        shard.write_bytes(shard.read_bytes()[:-8])
    dist.barrier()
    fresh, fresh_opt = _build(seed=1)
    try:
        load_newest(root, fresh, fresh_opt, fallback=False)
        refused = None
    except CheckpointRefused as err:
        refused = str(err)
    found, state = load_newest(root, fresh, fresh_opt, fallback=True)
    return refused, found.name, state["step"], _full(fresh, fresh_opt), first


def test_every_rank_refuses_a_cut_shard_alike_and_falls_back_together(tmp_path):
    """2 ranks: the manifest holds every rank's files (each rank hashed its own), a shard of
    rank 1 cut by 8 bytes is refused on every rank with the same message naming it, and with
    fallback every rank loads step 1 (the same weights and moments it saved)."""
    out = run_world(_verified_resume, 2, str(tmp_path))
    manifest = json.loads((tmp_path / "step_00000001" / "MANIFEST.json").read_text())["files"]
    for part in ("model", "optim"):
        assert {f"{part}/__0_0.distcp", f"{part}/__1_0.distcp", f"{part}/.metadata"} <= {*manifest}
    assert {"rng/rank_0.safetensors", "rng/rank_1.safetensors", "trainer.json"} <= {*manifest}
    refused = {rank[0] for rank in out}
    assert len(refused) == 1, refused  # one message, every rank
    (message,) = refused
    assert "step_00000002 refused: optim/__1_0.distcp: " in message and "(truncated)" in message
    for _, name, step, loaded, first in out:
        assert name == "step_00000001" and step == 1
        for key, value in first[0].items():
            np.testing.assert_array_equal(loaded[0][key], value)
        for got, want in zip(loaded[1], first[1], strict=True):
            np.testing.assert_array_equal(got, want)
    assert (tmp_path / "refused-step_00000002" / COMMITTED).is_file()


def _glm_config(world: int, ep: int, *extra: str, ns_dtype: str = "float32") -> str:
    """8 sequences per step on any world, so both layouts see the same global batch. Newton-
    Schulz in float32: bf16 would amplify the layouts' other gradient summation orders by an
    amount that depends on the CPU (see assert_same_step)."""
    from omegaconf import OmegaConf

    from recipes.config import Config

    overrides = [f"mesh.world_size={world}", f"mesh.ep={ep}", "train.steps=4"]
    overrides += [f"optim.ns_dtype={ns_dtype}"]
    overrides += ["data.seq_len=32", f"data.batch_size={8 // world}", "train.warmup_steps=1"]
    overrides += list(extra)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(overrides))
    return OmegaConf.to_yaml(cfg)


def _glm_snapshot(trainer) -> dict[str, np.ndarray]:
    out = {n: p.detach().full_tensor().numpy() for n, p in trainer.model.named_parameters()}
    for n, b in trainer.model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            out[n] = b.numpy().copy()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    trainer.opt.state_dict()  # collective: NorMuon's moments current on every rank
    for p, st in trainer.opt.state.items():
        for k, v in st.items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[f"{names[id(p)]}:{k}"] = v.numpy().copy()
    return out


def _glm_train_save(configs: list[str], run_dirs: list[str], cache: str):
    from recipes.config import from_yaml
    from recipes.trainer import Trainer

    out = []
    for config_yaml, run_dir in zip(configs, run_dirs, strict=True):
        cfg = from_yaml(config_yaml)
        cfg.data.cache_dir = cache
        trainer = Trainer(cfg, Path(run_dir), torch.device("cpu"))
        for _ in range(2):
            metrics = trainer.train_step(measure=False)
        trainer.save()
        saved = _glm_snapshot(trainer)
        trainer.train_step(measure=False)
        out.append((saved, _glm_snapshot(trainer), sorted(metrics)))
    return out


def _glm_resume_step(configs: list[str], run_dirs: list[str], cache: str):
    from recipes.config import from_yaml
    from recipes.trainer import Trainer

    out = []
    for config_yaml, run_dir in zip(configs, run_dirs, strict=True):
        cfg = from_yaml(config_yaml)
        cfg.data.cache_dir = cache
        trainer = Trainer(cfg, Path(run_dir), torch.device("cpu"))
        trainer.resume()
        loaded = _glm_snapshot(trainer)
        trainer.train_step(measure=False)
        out.append((trainer.step, loaded, _glm_snapshot(trainer)))
    return out


#: the GQA tiny model with NorMuon (Muon momentum and NorMuon's moments; a GQA run without
#: NorMuon reshards nothing this one does not); MLA + DSA (seq_len 32 > index_topk 16, a shared
#: layer) with a trained MTP layer and the KL-trained indexer; the same with the indexer frozen
#: (no optimizer state). The MLA runs are without NorMuon: no `normuon_v` state there.
_RESHARD_RUNS = {
    "tiny_normuon": ["optim.normuon=true"],
    "mla_kl": ["model.preset=mla_tiny"],
    "mla_frozen": ["model.preset=mla_tiny", "train.indexer_training=frozen"],
}


def test_glm_muon_checkpoint_reshards_4x_ep2_to_2x_ep1(tmp_path):
    """The real model and Muon: what 4 ranks at ep=2 saved loads exactly on 2 ranks at ep=1
    (parameters, router bias, Muon momentum, AdamW moments, NorMuon's moments), and the next
    step matches; for the GQA model with NorMuon and the MLA + DSA + MTP model, with a
    trained and a frozen indexer."""
    cache = str(tmp_path / "cache")
    dirs = [str(tmp_path / name) for name in _RESHARD_RUNS]
    four = [_glm_config(4, 2, *extra) for extra in _RESHARD_RUNS.values()]
    two = [_glm_config(2, 1, *extra) for extra in _RESHARD_RUNS.values()]
    first = run_world(_glm_train_save, 4, four, dirs, cache, timeout_s=300)[0]
    second = run_world(_glm_resume_step, 2, two, dirs, cache, timeout_s=300)[0]
    for name, (saved, after, keys), (step, loaded, resumed) in zip(
        _RESHARD_RUNS, first, second, strict=True
    ):
        assert step == 3 and loaded.keys() == saved.keys(), name
        assert any(k.endswith(":momentum_buffer") for k in saved)
        biases = [v for k, v in saved.items() if k.endswith("e_score_correction_bias")]
        assert biases and all(np.abs(b).max() > 0 for b in biases)  # router bias updates ran
        for key, value in saved.items():
            np.testing.assert_array_equal(loaded[key], value, err_msg=f"{name}: {key}")
        # One more step on the other layout: the same update up to the gradient summation
        # order, bounded in tests/reference.py (float32 Newton-Schulz; measured: 2.3e-5 of the
        # change, the bound 1e-3; bf16 measured 3.8e-2). A stale learning rate after the load
        # (schedule factor 1.0 one step earlier, 0.775 now) would be over 20% of the change off.
        assert_same_step(saved, resumed, after)
        moments = [v for k, v in saved.items() if k.endswith(":normuon_v")]
        if name == "tiny_normuon":  # every Muon matrix has moments, and they moved
            assert len(moments) == sum(k.endswith(":momentum_buffer") for k in saved)
            assert all(np.abs(v).max() > 0 for v in moments)
        else:
            assert not moments, name
        if name.startswith("mla"):
            assert "mtp_loss" in keys and ("indexer_kl" in keys) == (name == "mla_kl"), keys
            indexer = [k for k in saved if ".indexer." in k]
            states = [k for k in indexer if ":" in k]  # optimizer state of the indexer
            assert indexer and (bool(states) == (name == "mla_kl")), (name, states)
            if name == "mla_frozen":  # never updated: still the initial values after 3 steps
                for k in indexer:
                    np.testing.assert_array_equal(resumed[k], saved[k], err_msg=k)


def _local_tensors(trainer) -> list[torch.Tensor]:
    """This rank's own state: local shards of parameters and optimizer state, buffers."""
    out = [local_tensor(t) for t in trainer.model.state_dict().values()]
    for st in trainer.opt.state.values():
        out += [local_tensor(v) for v in st.values()]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _glm_save_memory_and_async(config_yaml: str, run_dir: str, cache: str):
    """Peak of a synchronous save over this rank's state; then an asynchronous save that
    training runs past, committed by `wait`, loads back exactly."""
    from recipes.config import from_yaml
    from recipes.trainer import Trainer

    cfg = from_yaml(config_yaml)
    cfg.data.cache_dir = cache
    trainer = Trainer(cfg, Path(run_dir), torch.device("cpu"))
    trainer.train_step(measure=False)
    local = _local_tensors(trainer)
    largest, own = max(t.nbytes for t in local), sum(t.nbytes for t in local)
    with trainer.meter.measure("save") as m:
        trainer.save()
    sync_delta = m.peak_delta_bytes()
    trainer.checkpointer = checkpoint.Checkpointer(trainer.ckpt_root, keep=5, async_mode=True)
    trainer.train_step(measure=False)
    saved = _glm_snapshot(trainer)
    with trainer.meter.measure("async") as m:
        trainer.save()
    async_delta = m.peak_delta_bytes()
    trainer.train_step(measure=False)  # runs while the background write may still go on
    trainer.checkpointer.wait()
    fresh = Trainer(cfg, Path(run_dir), torch.device("cpu"))
    fresh.resume()
    return sync_delta, largest, own, async_delta, fresh.step, saved, _glm_snapshot(fresh)


def test_glm_save_peak_per_rank_and_async_save(tmp_path):
    """`small` preset, 4 ranks, ep=2. A synchronous save: each rank's peak above its own state
    (parameter shards, optimizer state, buffers) stays within its largest single local tensor
    (what a clone of one non-contiguous shard costs; DCP's pickled plans, ~0.1-0.4 MB here,
    fit inside it). An asynchronous save stages one CPU copy of the rank's state, is committed
    only by `wait`, and loads back exactly although training went on meanwhile."""
    cache = str(tmp_path / "cache")
    config = _glm_config(4, 2, "model.preset=small")
    results = run_world(_glm_save_memory_and_async, 4, config, str(tmp_path), cache)
    for sync_delta, largest, own, async_delta, step, saved, loaded in results:
        assert 0 < sync_delta <= largest < own
        assert own <= async_delta <= own + largest
        assert step == 2 and loaded.keys() == saved.keys()
        for key, value in saved.items():
            np.testing.assert_array_equal(loaded[key], value, err_msg=key)


def test_bench_checkpoint_script_table(tmp_path):
    """scripts/bench_checkpoint.py on a 2-rank world: table and results written, every rank
    wrote its checkpoint files, the import within one expert per rank."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_checkpoint.py"
    args = ["--preset", "tiny", "--layouts", "2x2", "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 2 | 2 |" in proc.stdout
    (row,) = json.loads((tmp_path / "results.json").read_text())
    assert row["files"] == 2 and len(row["ranks"]) == 2
    assert 0 < row["import"] <= row["expert"] and row["save"] > 0 and row["own"] > row["largest"]
    assert row["world"] == 2
    assert "| 2 | 2 |" in (tmp_path / "table.md").read_text()
