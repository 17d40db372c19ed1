"""Properties of scripts/prepare_data.py on generated document directories: texts in nested
folders with exact duplicates, symbolic links (same folder, another folder, relative, absolute),
hard links, JSONL files and empty files. Either the run fails naming an empty file, or every
distinct file is read once, every distinct text lands in exactly one split once, and no text is
in both `train.bin` and `val.bin`."""

from __future__ import annotations

import json
import os
import tempfile
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from recipes.prepare_data import prepare
from recipes.prepare_docs import PrepareError, input_files

#: a few words, so that generated texts collide (exact duplicates across files) and the BPE
#: learns something; " " alone is an empty document (the run must refuse it by name)
WORDS = ["loss", "expert", "über", "日本", "a", " ", "\n"]
TEXT = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map("".join)
#: (kind, target file index, folder of the link): kinds of second names a file can have
LINK = st.tuples(
    st.sampled_from(["symlink", "relative", "hardlink"]),
    st.integers(0, 20),
    st.sampled_from([".", "sub", "sub/deep"]),
)
LAYOUT = st.fixed_dictionaries(
    {
        "files": st.lists(
            st.tuples(TEXT, st.sampled_from([".", "sub", "sub/deep"])), min_size=1, max_size=8
        ),
        "jsonl": st.lists(TEXT, max_size=4),  # one more file: one document per line
        "links": st.lists(LINK, max_size=5),
    }
)


def _build(root: Path, layout: dict) -> list[Path]:
    """Writes the layout under root; returns its distinct files (the links' targets)."""
    files = []
    for i, (text, folder) in enumerate(layout["files"]):
        (root / folder).mkdir(parents=True, exist_ok=True)
        f = root / folder / f"doc{i:02d}.txt"
        f.write_text(text)
        files.append(f)
    if layout["jsonl"]:
        f = root / "lines.jsonl"
        f.write_text("".join(json.dumps({"text": t}) + "\n" for t in layout["jsonl"]))
        files.append(f)
    for j, (kind, target, folder) in enumerate(layout["links"]):
        src = files[target % len(files)]
        (root / folder).mkdir(parents=True, exist_ok=True)
        link = root / folder / f"link{j}{src.suffix}"
        if kind == "hardlink":
            os.link(src, link)
        elif kind == "relative":
            link.symlink_to(os.path.relpath(src, link.parent))
        else:
            link.symlink_to(src)
    return files


def _inodes(paths) -> list[tuple[int, int]]:
    return [(s.st_dev, s.st_ino) for s in map(os.stat, paths)]


def _texts(files: list[Path]) -> list[str]:
    """Each distinct file's documents, in the order `input_files` lists them."""
    out = []
    for f in files:
        raw = f.read_text()
        if f.suffix == ".jsonl":
            out += [json.loads(line)["text"] for line in raw.splitlines() if line.strip()]
        else:
            out.append(raw)
    return out


def _decode(out: Path) -> dict[str, list[str]]:
    from tokenizers import Tokenizer

    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = meta["tokenizer"]["eos_id"]
    docs = {}
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"]).tolist()
        docs[split], start = [], 0
        for k, t in enumerate(ids):
            if t == eos:
                docs[split].append(tok.decode(ids[start:k], skip_special_tokens=False))
                start = k + 1
    return docs


# 14 documents, 3 of them also under a second name in the same folder (the report: 17 read)
LICENSES = {
    "files": [(f"license {i} " + "a" * i, ".") for i in range(14)],
    "jsonl": [],
    "links": [("symlink", 2, "."), ("relative", 5, "."), ("hardlink", 9, ".")],
}


@given(LAYOUT)
@example(LICENSES)
@example({"files": [("a", "."), ("a", "sub")], "jsonl": ["a"], "links": []})  # one text 3x
def test_every_distinct_file_is_listed_once(layout):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        made = _build(root, layout)
        listed = input_files([root, root / made[0].relative_to(root)])  # the file twice
        assert len(set(_inodes(listed))) == len(listed)  # no file under two names
        assert set(_inodes(listed)) == set(_inodes(made))  # and none left out


@settings(max_examples=max(2, settings.default.max_examples // 2))  # a BPE trained per example
@given(LAYOUT, st.sampled_from([0.2, 0.5]))
@example(LICENSES, 0.5)
@example({"files": [("a", "."), ("a", "sub"), ("b", ".")], "jsonl": ["a"], "links": []}, 0.5)
@example({"files": [("a", "."), (" ", "sub")], "jsonl": [], "links": []}, 0.2)  # empty file
def test_each_text_lands_in_one_split_once(layout, val_fraction):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "in"
        made = _build(root, layout)
        texts = _texts(made)
        args = Namespace(
            input=[root],
            out=Path(tmp) / "out",
            train_tokenizer=300,
            tokenizer=None,
            eos_token=None,
            val_fraction=val_fraction,
            text_key="text",
            dtype="auto",
            batch_size=3,
        )
        empty = [f for f in made if f.suffix == ".txt" and not f.read_text().strip()]
        if empty or any(not t.strip() for t in texts):
            with pytest.raises(PrepareError, match="empty text"):
                prepare(args)
            assert not args.out.exists()
            return
        event("prepared")
        meta = prepare(args)
        docs = _decode(args.out)
        assert not set(docs["train"]) & set(docs["val"])
        assert sorted(docs["train"] + docs["val"]) == sorted(set(texts))  # each text once
        assert meta["duplicates_left_out"] == len(texts) - len(set(texts))
        if len(set(texts)) >= 2:
            assert docs["val"]  # a positive fraction holds at least one document out
