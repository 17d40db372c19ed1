"""Token streams: flat numpy memmaps of token ids, and a resumable, world-size-free sampler.

Two sources, each with a training and a disjoint validation split:
- `stdlib` (the default): this Python's standard library (.py files, as bytes: vocab 256),
  present on every machine. The files are split deterministically (by a hash of each relative
  path, `data.val_fraction` of them held out), and each split is built once into
  `data.cache_dir` as a uint8 memmap (written to a temporary name and renamed, so concurrent
  builders are safe) and reused.
- `tokens`: a directory written by `scripts/prepare_data.py` (`train.bin`, `val.bin`,
  `meta.json`: tokenizer, vocab size, dtype, counts, bytes per token), or a single token file
  (training only: no held-out split, so no evaluation).

Sampling: the token file is cut into `seq_len + 1`-token chunks; epoch e visits them in the
order of a permutation seeded by (seed, e). Sample i of the global stream is chunk
perm_{i // n}[i % n]. A step consumes `world_size * grad_accum * batch_size` samples; the
only data state is the number of samples consumed, so a resume on another world size
continues the same stream.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recipes.data_files import (  # noqa: F401 - re-exported: the file layout lives there
    META_FILE,
    PREPARED_FILES,
    TOKEN_DTYPES,
    is_prepared,
    read_meta,
    stdlib_dir,
    stdlib_files,
)

_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class TokenFiles:
    """The token files of a data config: training, validation (None: no held-out split) and
    the UTF-8 bytes per token of the validation text (None: unknown), for bits per byte."""

    train: Path
    val: Path | None
    bytes_per_token: float | None


def split_files(files: list[Path], root: Path, val_fraction: float) -> dict[str, list[Path]]:
    """Files into {"train", "val"}: the `val_fraction` of them (at least one when the fraction
    is positive and there are two files or more) with the smallest hash of their relative path.
    A file's side depends only on its path and the others', not on its content or the machine;
    both lists keep the order of `files`."""
    n_val = 0
    if val_fraction > 0 and len(files) > 1:
        n_val = min(len(files) - 1, max(1, round(val_fraction * len(files))))

    def digest(p: Path) -> str:
        return hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest()

    held_out = set(sorted(files, key=digest)[:n_val])
    return {
        "train": [p for p in files if p not in held_out],
        "val": [p for p in files if p in held_out],
    }


def write_tokens(path: Path, tokens: np.ndarray) -> Path:
    """Write a flat token array as a raw memmap, atomically, with a JSON sidecar."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tokens.tofile(tmp)
    meta = {"dtype": tokens.dtype.name, "n_tokens": int(tokens.size)}
    path.with_suffix(".json").write_text(json.dumps(meta))
    os.replace(tmp, path)
    return path


def build_stdlib_tokens(
    cache_dir: str, source_dir: str | None = None, val_fraction: float = 0.05
) -> dict[str, Path | None]:
    """Build (once) the byte-level token files of a .py tree's training and validation files;
    returns {"train": path, "val": path or None (fewer than two files)}."""
    root = Path(source_dir).expanduser() if source_dir else stdlib_dir()
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    key = hashlib.sha256(f"{root}:{val_fraction!r}".encode())
    for p in files:
        st = p.stat()
        key.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    out: dict[str, Path | None] = {}
    for split, members in split_files(files, root, val_fraction).items():
        if not members:
            out[split] = None
            continue
        path = Path(cache_dir).expanduser() / f"stdlib-{key.hexdigest()[:16]}.{split}.u8.bin"
        if not path.is_file():
            corpus = _SEPARATOR.join(p.read_bytes() for p in members)
            write_tokens(path, np.frombuffer(corpus, dtype=np.uint8))
        out[split] = path
    return out


def token_files(data_cfg) -> TokenFiles:
    """The token files a data config names, building the stdlib corpus when needed."""
    if data_cfg.source == "stdlib":
        built = build_stdlib_tokens(data_cfg.cache_dir, data_cfg.path, data_cfg.val_fraction)
        return TokenFiles(built["train"], built["val"], 1.0)  # byte tokens
    path = Path(data_cfg.path).expanduser()
    if not is_prepared(path):
        return TokenFiles(path, None, None)
    meta = read_meta(path)
    val = meta["splits"].get("val", {})
    has_val = val.get("tokens", 0) > 0
    return TokenFiles(
        path / PREPARED_FILES["train"],
        path / PREPARED_FILES["val"] if has_val else None,
        val.get("bytes", 0) / val["tokens"] if has_val and val.get("bytes") else None,
    )


class TokenStream:
    """Samples of `seq_len + 1` tokens from a memmap, in a seeded per-epoch order."""

    def __init__(self, path: Path, dtype: str, seq_len: int, seed: int, vocab_size: int):
        self.path = path
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.seed = seed
        self.n_chunks = (self.tokens.size - 1) // seq_len
        if self.n_chunks < 1:
            raise ValueError(f"{path}: {self.tokens.size} tokens, fewer than seq_len + 1")
        self.vocab_size = vocab_size
        self._epoch, self._perm = -1, None

    def _chunk(self, sample: int) -> int:
        epoch, index = divmod(sample, self.n_chunks)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._perm = epoch, rng.permutation(self.n_chunks)
        return int(self._perm[index])

    def batch(self, first_sample: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples first_sample .. first_sample + batch_size - 1 as (input_ids, labels)."""
        T = self.seq_len
        rows = [self._chunk(first_sample + b) * T for b in range(batch_size)]
        x = np.stack([np.asarray(self.tokens[r : r + T + 1], dtype=np.int64) for r in rows])
        if x.max() >= self.vocab_size:
            raise ValueError(
                f"{self.path}: token id {x.max()} >= data.vocab_size={self.vocab_size}"
            )
        x = torch.from_numpy(x)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def micro_batch(
        self, consumed: int, micro: int, rank: int, world_size: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of `rank` for micro-step `micro` of the step starting at `consumed`."""
        return self.batch(consumed + (micro * world_size + rank) * batch_size, batch_size)
