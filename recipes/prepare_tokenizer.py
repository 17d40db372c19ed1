"""The tokenizers `scripts/prepare_data.py` uses: a local transformers directory (refused when
it names code of its own, unless trusted), a `tokenizers` JSON file, or a byte-level BPE trained
on the training documents; and the smallest token dtype that holds a vocabulary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from recipes.data import TOKEN_DTYPES
from recipes.prepare_docs import PrepareError

#: end-of-sequence token of a trained tokenizer (and the names searched in a tokenizers file)
EOS_TOKEN = "<|endoftext|>"
_EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|eos|>", "[SEP]")


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


def from_tokenizers(tok, kind: str, source: str, eos_token: str | None) -> Tok:
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
    return from_tokenizers(tok, "tokenizers-json", str(path), eos_token)


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
