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
import sys
from pathlib import Path

from recipes.data import TOKEN_DTYPES
from recipes.outputs import add_force_argument
from recipes.prepare_data import prepare
from recipes.prepare_docs import PrepareError


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
