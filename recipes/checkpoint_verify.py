"""Checkpoint integrity: a manifest of every file, written at commit and verified at load.

At commit every rank hashes the files it wrote (its `__<rank>_*.distcp` shards and its RNG
file) and rank 0 the rest (`.metadata`, `trainer.json`), so the hashing is shared like the
writing. Rank 0 writes `MANIFEST.json` (each file's size and SHA-256) and then `COMMITTED`,
whose second line is the manifest's own SHA-256, so a changed or deleted manifest is caught
too. SHA-256, not a cheaper checksum: hashlib's runs at memory speed next to the disk writes
(docs/training.md measures it), and a cryptographic hash also makes a changed file
indistinguishable from a tampered one, so there is one answer to both.

`problems(ckpt, share, shares)` checks one share of the files (the files split by size over
`shares`, the same split on every rank); share 0 also reads what the other checks rest on:
COMMITTED, the manifest, `trainer.json` (JSON, its step) and both `.metadata` files (through
the restricted unpickler, every shard they point into present and long enough).
`verify(ckpt)` is the collective version: every rank its share, the problems gathered. A
checkpoint committed before manifests (COMMITTED holds the step only) gets the structural
checks alone. `nonfinite_parameters(model)` names the parameters holding NaN or inf.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from recipes import dcp_safe
from recipes.ranks import local_tensor

MANIFEST = "MANIFEST.json"
_COMMITTED = "COMMITTED"  # recipes.checkpoint.COMMITTED (that module imports this one)
_PARTS = ("model", "optim")


def digest(path: Path) -> dict[str, int | str]:
    """A file's size and SHA-256 (read in hashlib's buffer, never whole)."""
    with open(path, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": Path(path).stat().st_size, "sha256": sha}


def _files(ckpt: Path) -> list[str]:
    """Every file of a checkpoint directory but COMMITTED and the manifest, relative, sorted."""
    found = (p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    return sorted(f for f in found if f not in (_COMMITTED, MANIFEST))


def own_digests(tmp: Path, rank: int) -> dict[str, dict]:
    """The digests of the files rank `rank` wrote into the checkpoint being committed."""
    tmp = Path(tmp)
    mine = [p for part in _PARTS for p in (tmp / part).glob(f"__{rank}_*.distcp")]
    mine += list((tmp / "rng").glob(f"rank_{rank}.*"))
    return {p.relative_to(tmp).as_posix(): digest(p) for p in mine}


def gather_digests(tmp: Path, rank: int) -> list[dict[str, dict]] | None:
    """Collective: this rank's digests, gathered on rank 0 (None elsewhere). It is also the
    commit's barrier: rank 0 has them only once every rank's files are in place."""
    mine = own_digests(tmp, rank)
    if not dist.is_initialized():
        return [mine]
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def write_manifest(tmp: Path, parts: list[dict[str, dict]]) -> str:
    """Rank 0: MANIFEST.json from the ranks' digests plus every file none of them hashed;
    returns the manifest's SHA-256 (for COMMITTED)."""
    tmp = Path(tmp)
    files = {name: d for part in parts for name, d in part.items()}
    for name in _files(tmp):
        if name not in files:
            files[name] = digest(tmp / name)
    text = json.dumps({"algorithm": "sha256", "files": dict(sorted(files.items()))}, indent=1)
    (tmp / MANIFEST).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def commit_text(step: int, manifest_sha: str) -> str:
    """What COMMITTED holds: the step, then the manifest's SHA-256."""
    return f"{step}\n{MANIFEST} sha256 {manifest_sha}\n"


def manifest_sha(ckpt: Path) -> str | None:
    """The manifest SHA-256 COMMITTED records (None: committed before manifests)."""
    lines = (Path(ckpt) / _COMMITTED).read_text(errors="replace").splitlines()
    fields = lines[1].split() if len(lines) > 1 else []
    return fields[2] if len(fields) == 3 and fields[:2] == [MANIFEST, "sha256"] else None


def _manifest(ckpt: Path) -> tuple[dict[str, dict], list[str]]:
    """The manifest's files and what is wrong with the manifest itself."""
    expected = manifest_sha(ckpt)
    if expected is None:
        return {}, []
    path = ckpt / MANIFEST
    if not path.is_file():
        return {}, [f"{MANIFEST}: missing (COMMITTED names it)"]
    if digest(path)["sha256"] != expected:
        return {}, [f"{MANIFEST}: its SHA-256 differs from the one COMMITTED records"]
    return json.loads(path.read_text())["files"], []


def _share(files: dict[str, dict], share: int, shares: int) -> list[str]:
    """The files of `share`: largest first to the least-loaded share (same on every rank)."""
    load = [0] * shares
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        k = min(range(shares), key=lambda i: (load[i], i))
        load[k] += files[name]["size"]
        if k == share:
            mine.append(name)
    return mine


def _file_problem(ckpt: Path, name: str, want: dict) -> str | None:
    path = ckpt / name
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size != want["size"]:
        cut = " (truncated)" if size < want["size"] else ""
        return f"{name}: {size} bytes, {MANIFEST} says {want['size']}{cut}"
    if digest(path)["sha256"] != want["sha256"]:
        zero = ", every byte zero" if _all_zero(path) else ""
        return f"{name}: contents differ from {MANIFEST} (SHA-256 mismatch{zero})"
    return None


def _all_zero(path: Path, chunk: int = 1 << 24) -> bool:
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip(b"\0"):
                return False
    return True


def _trainer_problem(ckpt: Path) -> str | None:
    path = ckpt / "trainer.json"
    if not path.is_file():
        return "trainer.json: missing"
    try:
        state = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"trainer.json: not JSON ({err})"
    step = (ckpt / _COMMITTED).read_text(errors="replace").split("\n")[0]
    if not isinstance(state, dict) or not step.isdigit() or state.get("step") != int(step):
        return f"trainer.json: not the trainer state of step {step} (COMMITTED's)"
    return None


def _metadata_problems(ckpt: Path, part: str) -> list[str]:
    """`.metadata` read safely; every shard it points into present and long enough."""
    try:
        metadata = dcp_safe.read_metadata(ckpt / part / ".metadata")
    except FileNotFoundError:
        return [f"{part}/.metadata: missing"]
    except dcp_safe.UnsafeCheckpointError as err:
        return [f"{part}/.metadata: {err.reason}"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    out = []
    for name, end in sorted(needed.items()):
        path = ckpt / part / name
        if not path.is_file():
            out.append(f"{part}/{name}: missing (.metadata points into it)")
        elif path.stat().st_size < end:
            size = path.stat().st_size
            out.append(f"{part}/{name}: {size} bytes, .metadata needs {end} (truncated)")
    return out


def problems(
    ckpt: Path, share: int = 0, shares: int = 1, parts: tuple[str, ...] = (*_PARTS, "rng")
) -> list[str]:
    """What is wrong with share `share` of `shares` of a checkpoint's files ([] when sound);
    `parts=("model",)`: the model, trainer.json and COMMITTED only (what an export reads)."""
    ckpt = Path(ckpt)
    files, found = _manifest(ckpt)
    files = {n: d for n, d in files.items() if n.split("/")[0] in (*parts, "trainer.json")}
    if share == 0:
        found += [p for p in [_trainer_problem(ckpt)] if p]
        for part in set(parts) & set(_PARTS):
            found += _metadata_problems(ckpt, part)
    for name in _share(files, share, shares):
        problem = _file_problem(ckpt, name, files[name])
        if problem and not any(f.startswith(f"{name}: ") for f in found):
            found.append(problem)
    return found


def verify(ckpt: Path) -> list[str]:
    """Collective (or one process): every rank checks its share; all get every problem,
    sorted by file."""
    if not dist.is_initialized():
        return sorted(problems(ckpt))
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, problems(ckpt, dist.get_rank(), dist.get_world_size()))
    return sorted({p for rank in found for p in rank})


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """Collective (or one process): the names of the parameters with a NaN or inf anywhere
    (each rank checks its own shards, one host read), in the model's order."""
    named = list(model.named_parameters())
    flags = [torch.isfinite(local_tensor(p)).all() for _, p in named]
    finite = torch.stack(flags).tolist() if flags else []
    mine = [n for (n, _), ok in zip(named, finite, strict=True) if not ok]
    if dist.is_initialized():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
        bad = {n for rank in found for n in rank}
        return [n for n, _ in named if n in bad]
    return mine
