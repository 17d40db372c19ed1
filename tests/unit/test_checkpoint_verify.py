"""Checkpoint integrity in one process: the manifest written at commit, each kind of damage
refused naming the file, `checkpoint.fallback`, non-finite weights, and DCP's pickles read
without running code (a crafted `.metadata` or optimizer entry writes no marker)."""

import io
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from recipes import checkpoint, checkpoint_verify, dcp_safe
from recipes.checkpoint_resume import CheckpointRefused, load_newest
from tests.faults import Payload, flip

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")


def _model_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def _save(root: Path, step: int, model, opt) -> Path:
    return checkpoint.save(root, step, model, opt, {"samples": step}, keep=3)


def _rewrite_manifest(ckpt: Path) -> None:
    """What a checkpoint made elsewhere carries: a manifest that matches its files."""
    step = int((ckpt / checkpoint.COMMITTED).read_text().split()[0])
    sha = checkpoint_verify.write_manifest(ckpt, [])
    (ckpt / checkpoint.COMMITTED).write_text(checkpoint_verify.commit_text(step, sha))


@pytest.fixture
def two(tmp_path):
    """Checkpoints of steps 1 and 2 (other weights) and the model of step 1."""
    model, opt = _model_opt()
    _save(tmp_path, 1, model, opt)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return tmp_path, _save(tmp_path, 2, model, opt), first


def test_the_manifest_lists_every_file_and_a_sound_checkpoint_verifies(two):
    root, ckpt, _ = two
    manifest = json.loads((ckpt / checkpoint_verify.MANIFEST).read_text())
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == files - {"COMMITTED", "MANIFEST.json"}
    assert {"model/__0_0.distcp", "optim/.metadata", "trainer.json"} <= set(manifest["files"])
    for name, want in manifest["files"].items():
        assert want == checkpoint_verify.digest(ckpt / name), name
    assert (
        checkpoint_verify.manifest_sha(ckpt)
        == checkpoint_verify.digest(ckpt / checkpoint_verify.MANIFEST)["sha256"]
    )
    assert checkpoint_verify.verify(ckpt) == []


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {  # name: (file, what is done to it, what the refusal says about it)
    "flipped": ("model/__0_0.distcp", flip, "contents differ from MANIFEST.json (SHA-256"),
    "truncated": ("model/__0_0.distcp", _truncate, "(truncated)"),
    "zeroed": (
        "optim/__0_0.distcp",
        lambda p: p.write_bytes(bytes(p.stat().st_size)),
        "SHA-256 mismatch, every byte zero",
    ),
    "no-metadata": ("model/.metadata", Path.unlink, "missing"),
    "garbage-trainer-json": ("trainer.json", lambda p: p.write_text("{step: 2,"), "not JSON"),
    "no-rng": ("rng/rank_0.safetensors", Path.unlink, "missing"),
    "no-manifest": ("MANIFEST.json", Path.unlink, "missing (COMMITTED names it)"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_is_refused_naming_the_file_and_fallback_takes_the_previous(two, damage):
    root, ckpt, first = two
    name, spoil, said = DAMAGE[damage]
    spoil(ckpt / name)
    problems = checkpoint_verify.verify(ckpt)
    assert any(p.startswith(f"{name}: ") and said in p for p in problems), problems
    model, opt = _model_opt(seed=5)
    with pytest.raises(CheckpointRefused, match=f"checkpoint {ckpt} refused: .*{name}: ") as err:
        load_newest(root, model, opt, fallback=False)
    assert "checkpoint.fallback=true" in str(err.value)
    assert checkpoint.latest(root) == ckpt  # stopped: nothing moved
    found, state = load_newest(root, model, opt, fallback=True)
    assert found.name == "step_00000001" and state["step"] == 1 and state["samples"] == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, first[key]), key
    assert (root / "refused-step_00000002" / "COMMITTED").is_file()
    assert [c.name for c in checkpoint.committed(root)] == ["step_00000001"]


def test_fallback_with_every_checkpoint_damaged_stops_naming_them(two):
    root, ckpt, _ = two
    (ckpt / "trainer.json").write_text("")
    (root / "step_00000001" / "model" / ".metadata").unlink()
    model, opt = _model_opt()
    with pytest.raises(CheckpointRefused, match="every committed checkpoint was refused") as e:
        load_newest(root, model, opt, fallback=True)
    assert "(step_00000002, step_00000001, now refused-*" in str(e.value)
    assert checkpoint.committed(root) == []


def test_a_checkpoint_before_manifests_gets_the_structural_checks(two):
    """COMMITTED holding the step only (written before manifests): no manifest needed, but a
    shard shorter than its `.metadata` says is still refused."""
    _, ckpt, _ = two
    (ckpt / checkpoint_verify.MANIFEST).unlink()
    (ckpt / checkpoint.COMMITTED).write_text("2\n")
    assert checkpoint_verify.verify(ckpt) == []
    _truncate(ckpt / "optim" / "__0_0.distcp")
    (problem,) = checkpoint_verify.verify(ckpt)
    assert problem.startswith("optim/__0_0.distcp: ") and ".metadata needs" in problem


def test_non_finite_weights_are_refused_naming_the_checkpoint(two):
    root, _, first = two
    model, opt = _model_opt()
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
        model[0].bias[1] = float("inf")
    ckpt = _save(root, 3, model, opt)
    assert checkpoint_verify.verify(ckpt) == []  # the files are as written: the weights are not
    with pytest.raises(CheckpointRefused, match=r"step_00000003 refused: non-finite weights") as e:
        load_newest(root, model, opt, fallback=False)
    assert "in 2 parameters: 0.bias, 1.weight" in str(e.value)
    found, _ = load_newest(root, model, opt, fallback=True)
    assert found.name == "step_00000002"


def test_a_crafted_metadata_is_refused_by_name_and_runs_nothing(two):
    root, ckpt, _ = two
    ran = root / "code-ran"
    metadata = dcp_safe.read_metadata(ckpt / "model" / ".metadata")
    metadata.storage_meta.modules = [Payload(str(ran))]  # rides along a real metadata
    (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(metadata))
    _rewrite_manifest(ckpt)  # consistent, as a checkpoint from elsewhere would be
    (problem,) = checkpoint_verify.verify(ckpt)
    assert problem.startswith("model/.metadata: refers to io.open, which is not one of DCP's")
    model, opt = _model_opt()
    with pytest.raises(dcp_safe.UnsafeCheckpointError, match=r"\.metadata: refers to io\.open"):
        checkpoint.load(ckpt, model, opt)
    with pytest.raises(dcp_safe.UnsafeCheckpointError):
        checkpoint.read_model_state(ckpt)
    assert not ran.exists()
    FileSystemReader(ckpt / "model").read_metadata()  # torch's own reader runs it: it is real
    assert ran.exists()


def test_a_crafted_optimizer_entry_is_refused_by_name_and_runs_nothing(two):
    """The non-tensor values in the .distcp files (param_groups) are torch.save records that
    DCP reads with weights_only=False."""
    root, ckpt, _ = two
    ran = root / "code-ran"
    state = checkpoint.read_optimizer_state(ckpt)
    state["param_groups"][0]["lr"] = Payload(str(ran))
    for old in (ckpt / "optim").iterdir():
        old.unlink()
    torch.distributed.checkpoint.save(state, storage_writer=FileSystemWriter(ckpt / "optim"))
    _rewrite_manifest(ckpt)
    model, opt = _model_opt()
    refused = r"entry 'param_groups\.0\.lr': refers to io\.open"
    with pytest.raises(dcp_safe.UnsafeCheckpointError, match=refused):
        checkpoint.load(ckpt, model, opt)
    assert not ran.exists()
    _load_state_dict_from_keys(storage_reader=FileSystemReader(ckpt / "optim"))  # torch's: runs
    assert ran.exists()


def test_the_metadata_allow_list_admits_what_dcp_writes(two):
    """Every global a real `.metadata` names is admitted (dtypes of every kind included)."""
    _, ckpt, _ = two
    seen = set()

    class Recording(dcp_safe.MetadataUnpickler):
        def find_class(self, module, name):
            seen.add(f"{module}.{name}")
            return super().find_class(module, name)

    for part in ("model", "optim"):
        with open(ckpt / part / ".metadata", "rb") as f:
            Recording(f, part).load()
    assert {"torch.Size", "torch.float32", "pathlib.PosixPath"} <= seen
    for dtype in (torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        assert dcp_safe.MetadataUnpickler(io.BytesIO(pickle.dumps(dtype)), "x").load() is dtype
