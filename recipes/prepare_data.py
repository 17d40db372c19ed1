"""What `scripts/prepare_data.py` does: every input checked, the documents tokenized into
`train.bin` / `val.bin` (each document followed by EOS), their boundaries and `meta.json`
written into a temporary directory renamed to DIR once complete (its doc: the whole contract)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from recipes.data import (
    DOC_OFFSETS_DTYPE,
    META_FILE,
    PREPARED_FILES,
    doc_offsets_file,
    write_doc_offsets,
)
from recipes.outputs import OutputExists, check_output, clear_output
from recipes.prepare_docs import (
    PrepareError,
    distinct_documents,
    documents,
    input_files,
    val_documents,
)
from recipes.prepare_tokenizer import (
    EOS_TOKEN,
    Tok,
    check_dtype,
    check_remote_code,
    from_tokenizers,
    load_tokenizer,
    train_tokenizer,
)


def _check_out(out: Path, force: bool, inputs: list[Path]) -> None:
    try:
        check_output(out, force, "--out", inputs)
    except OutputExists as err:
        raise PrepareError(str(err)) from None


def _check_args(args: argparse.Namespace) -> None:
    """The arguments that fail before any input is read."""
    if args.tokenizer is not None:
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


def _tokenizer(args, files: list[Path], held_out: set[int], n_docs: int, tmp: Path) -> Tok:
    """--tokenizer's, or a BPE trained on the training documents (saved into `tmp`)."""
    if args.train_tokenizer is None:
        return load_tokenizer(args.tokenizer, args.eos_token, args.trust_remote_code)
    train_docs = (
        d for i, d in enumerate(distinct_documents(files, args.text_key)) if i not in held_out
    )
    trained = train_tokenizer(train_docs, args.train_tokenizer, n_docs - len(held_out))
    trained.save(str(tmp / "tokenizer.json"))
    return from_tokenizers(trained, "trained-bpe", "tokenizer.json", EOS_TOKEN)


def _write_tokens(args, files, held_out, n_docs, tok: Tok, dtype: str, tmp: Path) -> dict:
    """Every document's tokens and EOS into its split's file and its boundaries; the counts."""
    from tqdm import tqdm

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
    return counts


def _meta(args, tok: Tok, dtype: str, counts: dict, duplicates: int) -> dict:
    ref = counts["val"] if counts["val"]["tokens"] else counts["train"]
    return {
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
        "duplicates_left_out": duplicates,
        "bytes_per_token": ref["bytes"] / ref["tokens"],
        "val_fraction": args.val_fraction,
        "inputs": [str(p) for p in args.input],
    }


def prepare(args: argparse.Namespace) -> dict:
    """Check every input, tokenize, and write DIR atomically; returns meta.json's content."""
    out, force = args.out, getattr(args, "force", False)
    sources = [*args.input, *([args.tokenizer] if args.tokenizer else [])]
    _check_out(out, force, sources)
    _check_args(args)  # before any input is read
    files = input_files(args.input)
    # every input checked first; exact copies counted (and left out below)
    digests = [hashlib.sha256(d.encode("utf-8")).digest() for d in documents(files, args.text_key)]
    n_docs = len(set(digests))
    held_out = val_documents(n_docs, args.val_fraction)

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok = _tokenizer(args, files, held_out, n_docs, tmp)
        dtype = check_dtype(args.dtype, tok.vocab_size, f"tokenizer {tok.source}")
        counts = _write_tokens(args, files, held_out, n_docs, tok, dtype, tmp)
        meta = _meta(args, tok, dtype, counts, len(digests) - n_docs)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")  # last: complete
        _check_out(out, force, sources)  # nobody wrote it meanwhile (or --force)
        if out.exists() or out.is_symlink():
            clear_output(out)  # an empty directory, or what --force replaces
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta
