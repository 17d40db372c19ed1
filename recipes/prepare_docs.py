"""The documents `scripts/prepare_data.py` tokenizes: the input files (directories searched,
links resolved), their texts (text files and JSONL lines) checked and named when bad, each
distinct text once, and the held-out ones chosen by a hash of their position."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path


class PrepareError(ValueError):
    """Bad input; the message names the file, line or argument."""


def input_files(paths: list[Path]) -> list[Path]:
    """The distinct files named by `paths` (files, or directories searched recursively), in
    order. A file reachable under several names (a symbolic or hard link, a file also inside a
    named directory) is listed once, under its first name: it is one file, read once, so its
    text cannot land in both splits."""
    files: list[Path] = []
    seen: set[tuple[int, int]] = set()  # (device, inode) of the files listed: links resolved
    for p in paths:
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise PrepareError(f"--input {p}: a directory with no files")
        elif p.is_file():
            found = [p]
        else:
            raise PrepareError(f"--input {p}: no such file or directory")
        for f in found:
            st = f.stat()  # follows symbolic links
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                files.append(f)
    if not files:
        raise PrepareError("--input: no files given")
    return files


def documents(files: list[Path], text_key: str) -> Iterator[str]:
    """Every document of `files`, in order; bad input raises PrepareError naming it."""
    for f in files:
        try:
            text = f.read_bytes().decode("utf-8")
        except OSError as err:
            raise PrepareError(f"{f}: cannot be read ({err.strerror or err})") from None
        except UnicodeDecodeError as err:
            raise PrepareError(f"{f}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        if f.suffix != ".jsonl":
            if not text.strip():
                raise PrepareError(f"{f}: empty text")
            yield text
            continue
        lines = 0
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)[text_key]
            except (ValueError, KeyError, TypeError):
                raise PrepareError(
                    f"{f}:{number}: not a JSON object with a string under --text-key {text_key!r}"
                ) from None
            if not isinstance(doc, str) or not doc.strip():
                raise PrepareError(f"{f}:{number}: empty text under --text-key {text_key!r}")
            lines += 1
            yield doc
        if not lines:
            raise PrepareError(f"{f}: empty text (no JSONL lines)")


def distinct_documents(files: list[Path], text_key: str) -> Iterator[str]:
    """`documents`, each text once: a later exact copy (another file, another JSONL line) is
    left out, so that no text is both trained on and held out."""
    seen: set[bytes] = set()
    for doc in documents(files, text_key):
        digest = hashlib.sha256(doc.encode("utf-8")).digest()
        if digest not in seen:
            seen.add(digest)
            yield doc


def val_documents(n_docs: int, val_fraction: float) -> set[int]:
    """Indices of the held-out documents: `val_fraction` of them (at least one when positive
    and there are two or more), those with the smallest hash of their index."""
    if val_fraction <= 0 or n_docs < 2:
        return set()
    n_val = min(n_docs - 1, max(1, round(val_fraction * n_docs)))
    digest = lambda i: hashlib.sha256(str(i).encode()).digest()  # noqa: E731
    return set(sorted(range(n_docs), key=digest)[:n_val])
