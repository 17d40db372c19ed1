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

Packed documents (`data.pack`): the same samples, each also carrying its documents. Token
files keep their document boundaries beside them (`doc_offsets_file`: prepare_data.py writes
them, the stdlib build too); a sample's positions restart at 0 at each document's first token
(and at the sample's first), its doc_ids number its documents, and the label of a document's
last token is -100 (`packed_fields`), so no loss term predicts across a document boundary.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.glm.model.loss_head import IGNORE_INDEX
from recipes.data_files import (  # noqa: F401 - re-exported: the file layout lives there
    DOC_OFFSETS_DTYPE,
    META_FILE,
    PREPARED_FILES,
    TOKEN_DTYPES,
    doc_offsets_file,
    is_prepared,
    missing_doc_offsets,
    read_meta,
    stdlib_dir,
    stdlib_files,
)

_SEPARATOR = b"\n\n"
#: the model keywords of a packed batch's fields after (input_ids, labels)
PACKED = ("position_ids", "doc_ids")


def packing_kwargs(fields) -> dict:
    """The model's keyword arguments for a batch's fields after (input_ids, labels): none
    unpacked, else position_ids and doc_ids."""
    return dict(zip(PACKED, fields, strict=True)) if fields else {}


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


def write_doc_offsets(token_file: Path, offsets: np.ndarray) -> Path:
    """Write the document boundaries of `token_file` (`doc_offsets_file`) atomically."""
    path = doc_offsets_file(token_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    np.asarray(offsets, dtype=DOC_OFFSETS_DTYPE).tofile(tmp)
    os.replace(tmp, path)
    return path


def _joined_offsets(lengths: list[int], separator: int) -> np.ndarray:
    """The document offsets of texts joined by a separator (each document keeps the
    separator after it)."""
    sizes = [n + separator for n in lengths[:-1]] + lengths[-1:]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(DOC_OFFSETS_DTYPE)


def write_tokens(path: Path, tokens: np.ndarray, doc_offsets: np.ndarray | None = None) -> Path:
    """Write a flat token array as a raw memmap, atomically, with a JSON sidecar (and the
    document boundaries first, when given: the token file's name marks a finished write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if doc_offsets is not None:
        write_doc_offsets(path, doc_offsets)
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
            texts = [p.read_bytes() for p in members]
            offsets = _joined_offsets([len(t) for t in texts], len(_SEPARATOR))
            write_tokens(path, np.frombuffer(_SEPARATOR.join(texts), dtype=np.uint8), offsets)
        elif not doc_offsets_file(path).is_file():  # built before the boundaries were kept
            sizes = [p.stat().st_size for p in members]  # in the cache key: the same files
            write_doc_offsets(path, _joined_offsets(sizes, len(_SEPARATOR)))
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
    """Samples of `seq_len + 1` tokens from a memmap, in a seeded per-epoch order. With
    `pack` (data.pack) the samples carry their documents (`batch`)."""

    def __init__(
        self, path: Path, dtype: str, seq_len: int, seed: int, vocab_size: int, pack: bool = False
    ):
        self.path = path
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.doc_starts = _doc_starts(path, self.tokens.size) if pack else None
        self.seq_len = seq_len
        self.seed = seed
        self.n_chunks = (self.tokens.size - 1) // seq_len
        if self.n_chunks < 1:
            raise ValueError(f"{path}: {self.tokens.size} tokens, fewer than seq_len + 1")
        self.vocab_size = vocab_size
        self._epoch, self._perm = -1, None

    def chunk(self, sample: int) -> int:
        epoch, index = divmod(sample, self.n_chunks)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._perm = epoch, rng.permutation(self.n_chunks)
        return int(self._perm[index])

    def batch(self, first_sample: int, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Samples first_sample .. first_sample + batch_size - 1 as (input_ids, labels), and,
        packed, (input_ids, labels, position_ids, doc_ids) (`packed_fields`)."""
        T = self.seq_len
        rows = [self.chunk(first_sample + b) * T for b in range(batch_size)]
        x = np.stack([np.asarray(self.tokens[r : r + T + 1], dtype=np.int64) for r in rows])
        if x.max() >= self.vocab_size:
            raise ValueError(
                f"{self.path}: token id {x.max()} >= data.vocab_size={self.vocab_size}"
            )
        if self.doc_starts is not None:
            return packed_fields(x, np.asarray(rows), self.doc_starts)
        x = torch.from_numpy(x)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def micro_batch(
        self, consumed: int, micro: int, rank: int, world_size: int, batch_size: int
    ) -> tuple[torch.Tensor, ...]:
        """The batch of `rank` for micro-step `micro` of the step starting at `consumed`."""
        return self.batch(consumed + (micro * world_size + rank) * batch_size, batch_size)


def _doc_starts(path: Path, n_tokens: int) -> np.ndarray:
    """The first token of each document of a token file (its `doc_offsets_file`, checked)."""
    if (why := missing_doc_offsets(path)) is not None:
        raise ValueError(f"data.pack=true {why}")
    offsets = np.fromfile(doc_offsets_file(path), dtype=DOC_OFFSETS_DTYPE)
    if (
        offsets.size < 2
        or offsets[0] != 0
        or offsets[-1] != n_tokens
        or (np.diff(offsets) <= 0).any()
    ):
        raise ValueError(
            f"data.pack=true: {doc_offsets_file(path)} is not the document boundaries of "
            f"{path} ({n_tokens} tokens): needs 0, increasing offsets, then {n_tokens}"
        )
    return offsets[:-1]


def packed_fields(x_BS: np.ndarray, rows_B: np.ndarray, doc_starts: np.ndarray):
    """(input_ids, labels, position_ids, doc_ids) [B, T] of samples x [B, T + 1] that start at
    token `rows` of a stream whose documents start at `doc_starts`: positions count from 0 at
    each document's first token (and at the sample's first: a document cut by the sample's
    start is a document of its own), doc_ids count the documents of a row from 0, and a
    document's last token has no label (-100), as when each document runs alone."""
    T = x_BS.shape[1] - 1
    at_BS = rows_B[:, None] + np.arange(T + 1)
    doc_BS = np.searchsorted(doc_starts, at_BS, side="right") - 1
    first_BS = np.maximum(doc_starts[doc_BS], rows_B[:, None])
    x, doc = torch.from_numpy(x_BS), torch.from_numpy(doc_BS - doc_BS[:, :1])
    labels = x[:, 1:].masked_fill(doc[:, 1:] != doc[:, :-1], IGNORE_INDEX)
    positions = torch.from_numpy(at_BS - first_BS)[:, :-1]
    return x[:, :-1].contiguous(), labels, positions.contiguous(), doc[:, :-1].contiguous()
