"""Token streams: flat numpy memmaps of token ids, and a resumable, world-size-free sampler.

The default corpus is this Python's standard library (.py files, as bytes: vocab 256), present
on every machine. It is built once into `data.cache_dir` as a uint8 memmap (written to a
temporary name and renamed, so concurrent builders are safe) and reused.

Sampling: the token file is cut into `seq_len + 1`-token chunks; epoch e visits them in the
order of a permutation seeded by (seed, e). Sample i of the global stream is chunk
perm_{i // n}[i % n]. A step consumes `world_size * grad_accum * batch_size` samples; the
only data state is the number of samples consumed, so a resume on another world size
continues the same stream.
"""

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

_SEPARATOR = b"\n\n"


def stdlib_dir() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """The .py files under `root` in a fixed order, installed packages left out."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def write_tokens(path: Path, tokens: np.ndarray) -> Path:
    """Write a flat token array as a raw memmap, atomically, with a JSON sidecar."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tokens.tofile(tmp)
    meta = {"dtype": tokens.dtype.name, "n_tokens": int(tokens.size)}
    path.with_suffix(".json").write_text(json.dumps(meta))
    os.replace(tmp, path)
    return path


def build_stdlib_tokens(cache_dir: str, source_dir: str | None = None) -> Path:
    """Build (once) the byte-level token file of a .py tree; returns its path."""
    root = Path(source_dir).expanduser() if source_dir else stdlib_dir()
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files under {root}")
    key = hashlib.sha256(str(root).encode())
    for p in files:
        st = p.stat()
        key.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
    path = Path(cache_dir).expanduser() / f"stdlib-{key.hexdigest()[:16]}.u8.bin"
    if path.is_file():
        return path
    corpus = _SEPARATOR.join(p.read_bytes() for p in files)
    return write_tokens(path, np.frombuffer(corpus, dtype=np.uint8))


def token_file(data_cfg) -> Path:
    """The token file a data config names, building the stdlib corpus when needed."""
    if data_cfg.source == "stdlib":
        return build_stdlib_tokens(data_cfg.cache_dir, data_cfg.path)
    return Path(data_cfg.path).expanduser()


class TokenStream:
    """Samples of `seq_len + 1` tokens from a memmap, in a seeded per-epoch order."""

    def __init__(self, path: Path, dtype: str, seq_len: int, seed: int, vocab_size: int):
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
            raise ValueError(f"token id {x.max()} >= data.vocab_size={self.vocab_size}")
        x = torch.from_numpy(x)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def micro_batch(
        self, consumed: int, micro: int, rank: int, world_size: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of `rank` for micro-step `micro` of the step starting at `consumed`."""
        return self.batch(consumed + (micro * world_size + rank) * batch_size, batch_size)
