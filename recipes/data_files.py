"""The files a data config names, read with the standard library only: a prepared token
directory's layout and meta.json, this Python's standard-library sources, and what a token
file must not be. recipes/config/checks.py reads them before numpy and torch are imported;
recipes/data.py, which builds and streams the tokens, re-exports them.
"""

import json
import os
import sysconfig
from pathlib import Path

#: the files of a prepared token directory (`scripts/prepare_data.py`); meta.json is written
#: last, so a directory without it is not a finished one
PREPARED_FILES = {"train": "train.bin", "val": "val.bin"}
META_FILE = "meta.json"
#: the document boundaries beside a token file (`doc_offsets_file`): int64 offsets of each
#: document's first token and, last, the token count (n_documents + 1 values, cu_seqlens-style)
DOC_OFFSETS_DTYPE = "int64"
#: the token dtypes a file may use, smallest first, with the number of ids each holds
TOKEN_DTYPES = {"uint8": 2**8, "uint16": 2**16, "uint32": 2**32}
#: the leading bytes of files that hold something other than raw token ids: a container or a
#: compressed file read as tokens would train on its bytes without a word. Three bytes or
#: more each, so a real token file rarely starts with one (and a file written by
#: recipes.data.write_tokens, whose .json sidecar names its dtype, is never asked).
_NOT_TOKENS = (
    (b"\x93NUMPY", "a NumPy .npy file (its header would be read as tokens)"),
    (b"PK\x03\x04", "a zip archive (.npz, torch.save, ...)"),
    (b"\x1f\x8b\x08", "a gzip file"),
    (b"\xfd7zXZ\x00", "an xz file"),
    (b"\x28\xb5\x2f\xfd", "a zstd file"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"PAR1", "a Parquet file"),
    (b"\x7fELF", "an executable"),
    (b"%PDF-", "a PDF"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\x80\x04\x95", "a Python pickle"),
    (b"\x80\x05\x95", "a Python pickle"),
)


def stdlib_dir() -> Path:
    """The running Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[Path]:
    """The .py files under `root` in a fixed order, installed packages left out."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    # a walk that never enters the skipped directories (installed packages hold far more
    # files than the library itself); like Path.rglob, it does not follow directory symlinks
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files += [Path(parent, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_meta(directory: Path) -> dict:
    """The meta.json of a prepared token directory, checked for the keys training reads."""
    path = Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable meta.json ({err})") from None
    missing = {"vocab_size", "dtype", "splits"} - meta.keys()
    if missing or meta["dtype"] not in TOKEN_DTYPES:
        raise ValueError(
            f"{path}: needs vocab_size, dtype (one of {', '.join(TOKEN_DTYPES)}) and splits; "
            f"missing {sorted(missing)}, dtype {meta.get('dtype')!r}"
        )
    return meta


def doc_offsets_file(token_file: Path) -> Path:
    """Where the document boundaries of a token file lie: X.bin -> X.docs.bin."""
    return Path(token_file).with_suffix(".docs.bin")


def missing_doc_offsets(token_file: Path) -> str | None:
    """Why `data.pack=true` cannot read the document boundaries of `token_file`, or None."""
    docs = doc_offsets_file(token_file)
    if docs.is_file():
        return None
    return (
        f"needs the document boundaries of {token_file} ({docs.name} beside it), which it "
        "lacks (a directory prepared before scripts/prepare_data.py wrote them: prepare it "
        "again); data.pack=false reads it as one stream"
    )


def is_prepared(path: str | Path) -> bool:
    """A directory holding a finished `scripts/prepare_data.py` output (its meta.json)."""
    return (Path(path).expanduser() / META_FILE).is_file()


def not_tokens(path: Path) -> str | None:
    """What the file at `path` is when its first bytes say it is not raw token ids (a known
    container, compressed or executable format), else None. Any other file of whole tokens
    reads as token ids: raw ids carry no header that could tell them from other bytes."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((what for magic, what in _NOT_TOKENS if head.startswith(magic)), None)
