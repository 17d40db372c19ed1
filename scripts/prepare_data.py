"""Tokenize text into the token directory `python train.py data=tokens data.path=DIR` reads.

    python scripts/prepare_data.py --input corpus/ --out data/corpus --train-tokenizer 8192
    python scripts/prepare_data.py --input a.jsonl b.jsonl --text-key text --out DIR \\
        --tokenizer path/to/transformers-tokenizer-dir   (or a tokenizers .json file)

Inputs: text files (one document each), directories of them (searched recursively, hidden
files left out, in path order) and JSONL files (`.jsonl`: one document per line, its text under
`--text-key`). Every input is read and checked before anything is written: an unreadable or
non-UTF-8 file, a JSONL line without the key, an empty document, no input at all each fail with
a message naming the file (and line). A file reachable under several names (symbolic or hard
links, a file named and inside a named directory) is read once, and a document whose exact text
came before (another file, another JSONL line) is left out (`meta.json`'s
`duplicates_left_out`): no text is both in `train.bin` and in `val.bin`.

The documents are split by document: `--val-fraction` of them (at least one when positive),
chosen by a hash of their position, go to `val.bin`, the rest to `train.bin`, each document
followed by the tokenizer's end-of-sequence token. Token ids are stored in the smallest of
uint8 / uint16 / uint32 that holds the vocabulary (or `--dtype`). `meta.json` records the
tokenizer, vocab size, dtype, token / document / byte counts per split and the bytes per token
of the validation text (train.py's `val/bpb`); `train.docs.bin` / `val.docs.bin` hold each
split's document boundaries (int64 offsets of every document's first token, then the token
count; meta.json's `doc_offsets`), which `data.pack=true` reads.

`--train-tokenizer VOCAB` trains a byte-level BPE (the `tokenizers` library) on the training
documents and saves it as DIR/tokenizer.json; `--tokenizer` loads a local transformers
tokenizer directory (AutoTokenizer) or a `tokenizers` JSON file. Nothing is downloaded, and
nothing of the directory runs: one whose tokenizer_config.json or config.json has an `auto_map`
(transformers would import the Python module it names) is refused unless `--trust-remote-code`.
DIR is built under a temporary name next to it and renamed when complete, so a failed or
interrupted run never leaves a DIR that looks finished; an existing non-empty DIR is an error
unless `--force` is given (the old DIR is then replaced once the new one is complete).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.data import (  # noqa: E402
    DOC_OFFSETS_DTYPE,
    META_FILE,
    PREPARED_FILES,
    TOKEN_DTYPES,
    doc_offsets_file,
    write_doc_offsets,
)
from recipes.outputs import (  # noqa: E402
    OutputExists,
    add_force_argument,
    check_output,
    clear_output,
)

#: end-of-sequence token of a trained tokenizer (and the names searched in a tokenizers file)
EOS_TOKEN = "<|endoftext|>"
_EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|eos|>", "[SEP]")


class PrepareError(ValueError):
    """Bad input; the message names the file, line or argument."""


# -------------------------------------------------------------------------------- documents
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


# ------------------------------------------------------------------------------ tokenizers
@dataclass
class Tok:
    """A tokenizer as this script uses it: batched encoding without special tokens, and EOS."""

    kind: str  # "trained-bpe", "tokenizers-json" or "transformers"
    source: str
    vocab_size: int
    eos_id: int
    eos_token: str
    _encode: object
    _decode: object

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)


def _from_tokenizers(tok, kind: str, source: str, eos_token: str | None) -> Tok:
    names = [eos_token] if eos_token else list(_EOS_NAMES)
    found = [(n, tok.token_to_id(n)) for n in names if tok.token_to_id(n) is not None]
    if not found:
        raise PrepareError(
            f"--tokenizer {source}: no end-of-sequence token among {names} (pass --eos-token)"
        )
    name, eos_id = found[0]
    return Tok(
        kind,
        source,
        tok.get_vocab_size(with_added_tokens=True),
        eos_id,
        name,
        lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)],
        lambda ids: tok.decode(ids, skip_special_tokens=False),
    )


def remote_code(path: Path) -> str | None:
    """What in a tokenizer directory names Python code of its own that transformers would
    import on loading it (an `auto_map` of tokenizer_config.json or config.json), or None."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            config = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # absent or not JSON: transformers reports it if it needs the file
        if isinstance(config, dict) and config.get("auto_map"):
            return f"{name} has an auto_map ({json.dumps(config['auto_map'])})"
    return None


def check_remote_code(path: Path, trusted: bool) -> None:
    """Refuse a tokenizer directory with code of its own unless `--trust-remote-code`."""
    found = remote_code(path) if path.is_dir() else None
    if found and not trusted:
        raise PrepareError(
            f"--tokenizer {path}: {found}: loading it would run the directory's Python code; "
            "refused (pass --trust-remote-code if you trust that code)"
        )


def load_tokenizer(path: Path, eos_token: str | None, trust_remote_code: bool = False) -> Tok:
    """A local transformers tokenizer directory or a `tokenizers` JSON file (a directory's own
    code runs only with `trust_remote_code`: check_remote_code)."""
    check_remote_code(path, trust_remote_code)
    if path.is_dir():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise PrepareError(
                f"--tokenizer {path}: a directory needs transformers (or pass its tokenizer.json)"
            ) from None
        try:
            tok = AutoTokenizer.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise PrepareError(f"--tokenizer {path}: not a tokenizer directory ({err})") from None
        eos_id = tok.convert_tokens_to_ids(eos_token) if eos_token else tok.eos_token_id
        if eos_id is None or (eos_token and eos_id == tok.unk_token_id):
            raise PrepareError(f"--tokenizer {path}: no end-of-sequence token (pass --eos-token)")
        return Tok(
            "transformers",
            str(path),
            len(tok),
            int(eos_id),
            tok.convert_ids_to_tokens(int(eos_id)),
            lambda texts: tok(texts, add_special_tokens=False)["input_ids"],
            lambda ids: tok.decode(ids, skip_special_tokens=False),
        )
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust library raises its own exception types
        raise PrepareError(f"--tokenizer {path}: not a tokenizers JSON file ({err})") from None
    return _from_tokenizers(tok, "tokenizers-json", str(path), eos_token)


def train_tokenizer(texts: Iterator[str], vocab_size: int, length: int):
    """A byte-level BPE trained on `texts` (no normalization: decoding gives the text back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def smallest_dtype(vocab_size: int) -> str:
    """The smallest token dtype that holds ids 0 .. vocab_size - 1."""
    for name, capacity in TOKEN_DTYPES.items():
        if vocab_size <= capacity:
            return name
    raise PrepareError(f"vocab size {vocab_size} does not fit uint32")


def check_dtype(dtype: str, vocab_size: int, what: str) -> str:
    """`dtype` ("auto": the smallest that fits), checked against the vocab size."""
    if dtype == "auto":
        return smallest_dtype(vocab_size)
    if vocab_size > TOKEN_DTYPES[dtype]:
        raise PrepareError(
            f"--dtype {dtype}: holds {TOKEN_DTYPES[dtype]} ids, {what} has {vocab_size}; "
            f"use --dtype {smallest_dtype(vocab_size)} or auto"
        )
    return dtype


# ---------------------------------------------------------------------------------- prepare
def _check_out(out: Path, force: bool, inputs: list[Path]) -> None:
    try:
        check_output(out, force, "--out", inputs)
    except OutputExists as err:
        raise PrepareError(str(err)) from None


def prepare(args: argparse.Namespace) -> dict:
    """Check every input, tokenize, and write DIR atomically; returns meta.json's content."""
    from tqdm import tqdm

    out, force = args.out, getattr(args, "force", False)
    sources = [*args.input, *([args.tokenizer] if args.tokenizer else [])]
    _check_out(out, force, sources)
    if args.tokenizer is not None:  # before any input is read
        check_remote_code(args.tokenizer, args.trust_remote_code)
    if not 0.0 <= args.val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    if args.train_tokenizer is not None:
        if args.train_tokenizer < 257:
            raise PrepareError(
                f"--train-tokenizer {args.train_tokenizer}: a byte-level BPE needs a vocab of "
                "at least 257 (256 bytes + the end-of-sequence token)"
            )
        check_dtype(args.dtype, args.train_tokenizer, "--train-tokenizer")
    files = input_files(args.input)
    # every input checked first; exact copies counted (and left out below)
    digests = [hashlib.sha256(d.encode("utf-8")).digest() for d in documents(files, args.text_key)]
    n_docs = len(set(digests))
    held_out = val_documents(n_docs, args.val_fraction)

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if args.train_tokenizer is not None:
            train_docs = (
                d
                for i, d in enumerate(distinct_documents(files, args.text_key))
                if i not in held_out
            )
            trained = train_tokenizer(train_docs, args.train_tokenizer, n_docs - len(held_out))
            trained.save(str(tmp / "tokenizer.json"))
            tok = _from_tokenizers(trained, "trained-bpe", "tokenizer.json", EOS_TOKEN)
        else:
            tok = load_tokenizer(args.tokenizer, args.eos_token, args.trust_remote_code)
        dtype = check_dtype(args.dtype, tok.vocab_size, f"tokenizer {tok.source}")
        counts = {s: {"documents": 0, "tokens": 0, "bytes": 0} for s in PREPARED_FILES}
        lengths: dict[str, list[int]] = {s: [] for s in PREPARED_FILES}  # tokens per document
        sinks = {s: open(tmp / name, "wb") for s, name in PREPARED_FILES.items()}  # noqa: SIM115
        try:
            batch: list[tuple[int, str]] = []
            bar = tqdm(total=n_docs, desc="tokenize", unit="doc", disable=None)
            for i, doc in enumerate(distinct_documents(files, args.text_key)):
                batch.append((i, doc))
                if len(batch) == args.batch_size or i == n_docs - 1:
                    ids = tok.encode_batch([d for _, d in batch])
                    for (j, d), doc_ids in zip(batch, ids, strict=True):
                        split = "val" if j in held_out else "train"
                        arr = np.asarray([*doc_ids, tok.eos_id], dtype=dtype)
                        arr.tofile(sinks[split])
                        c = counts[split]
                        c["documents"] += 1
                        c["tokens"] += arr.size
                        c["bytes"] += len(d.encode("utf-8"))
                        lengths[split].append(arr.size)
                    bar.update(len(batch))
                    batch = []
            bar.close()
        finally:
            for f in sinks.values():
                f.close()
        for split, name in PREPARED_FILES.items():  # the boundaries data.pack reads
            write_doc_offsets(tmp / name, np.cumsum([0, *lengths[split]]))
        ref = counts["val"] if counts["val"]["tokens"] else counts["train"]
        meta = {
            "format": 1,
            "tokenizer": {
                "kind": tok.kind,
                "source": tok.source,
                "eos_id": tok.eos_id,
                "eos_token": tok.eos_token,
            },
            "vocab_size": tok.vocab_size,
            "dtype": dtype,
            "splits": counts,
            "doc_offsets": {
                "dtype": DOC_OFFSETS_DTYPE,
                **{s: doc_offsets_file(Path(n)).name for s, n in PREPARED_FILES.items()},
            },
            "duplicates_left_out": len(digests) - n_docs,
            "bytes_per_token": ref["bytes"] / ref["tokens"],
            "val_fraction": args.val_fraction,
            "inputs": [str(p) for p in args.input],
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # last: complete
        _check_out(out, force, sources)  # nobody wrote it meanwhile (or --force)
        if out.exists() or out.is_symlink():
            clear_output(out)  # an empty directory, or what --force replaces
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", type=Path, required=True, help="files or directories")
    ap.add_argument("--out", type=Path, required=True, help="output directory (new or empty)")
    add_force_argument(ap)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", type=Path, help="transformers dir or tokenizers .json")
    which.add_argument(
        "--train-tokenizer", type=int, metavar="VOCAB", help="train a byte-level BPE of VOCAB"
    )
    ap.add_argument("--val-fraction", type=float, default=0.05, help="documents held out")
    ap.add_argument("--text-key", default="text", help="JSONL field holding the text")
    ap.add_argument("--eos-token", help="end-of-sequence token of --tokenizer (default: its own)")
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let --tokenizer's directory run its own Python code (an auto_map)",
    )
    ap.add_argument(
        "--dtype", choices=["auto", *TOKEN_DTYPES], default="auto", help="token id type"
    )
    ap.add_argument("--batch-size", type=int, default=1000, help="documents per encode call")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error(f"--batch-size {args.batch_size}: must be >= 1")
    try:
        meta = prepare(args)
    except PrepareError as err:
        sys.exit(f"prepare_data.py: {err}")
    s = meta["splits"]
    if args.train_tokenizer is not None and meta["vocab_size"] < args.train_tokenizer:
        print(
            f"prepare_data.py: warning: --train-tokenizer {args.train_tokenizer}: this corpus "
            f"gives a vocabulary of {meta['vocab_size']} (BPE stops merging when no pair of "
            "tokens repeats); meta.json and the model take that size",
            file=sys.stderr,
        )
    print(
        f"{args.out}: vocab {meta['vocab_size']} ({meta['dtype']}); train {s['train']['tokens']} "
        f"tokens / {s['train']['documents']} documents, val {s['val']['tokens']} tokens / "
        f"{s['val']['documents']} documents; {meta['bytes_per_token']:.3f} bytes per token"
    )
    print(f"train with: python train.py data=tokens data.path={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
