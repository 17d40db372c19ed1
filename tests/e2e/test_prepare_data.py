"""scripts/prepare_data.py: text files and JSONL to train.bin / val.bin / meta.json, decoded back
exactly, then trained on with `data=tokens data.path=DIR` alone; bad inputs fail by name."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recipes import prepare_data

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"


def prepare_data_script():
    spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("prepare_data", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _corpus(root: Path) -> list[str]:
    """Text files in nested directories and a JSONL file; returns every document."""
    rng = np.random.default_rng(1)
    words = ["loss", "expert", "router", "Muon", "über", "naïve", "日本語", "tab\there", "x = 1\n"]
    docs = []
    (root / "sub").mkdir(parents=True)
    for i in range(12):
        text = " ".join(rng.choice(words, 40 + 5 * i)) + ("\n" if i % 2 else "  ")
        (root / ("sub" if i % 3 else ".") / f"doc{i:02d}.txt").write_text(text)
        docs.append(text)
    lines = [" ".join(rng.choice(words, 30)) for _ in range(6)]
    (root / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    (root / ".hidden").write_text("left out")
    return docs + lines


def _decode(out: Path) -> list[str]:
    from tokenizers import Tokenizer

    meta = json.loads((out / "meta.json").read_text())
    tok = Tokenizer.from_file(str(out / meta["tokenizer"]["source"]))
    eos = meta["tokenizer"]["eos_id"]
    docs = []
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
        assert ids.size == meta["splits"][split]["tokens"] and ids[-1] == eos
        cuts = np.flatnonzero(ids == eos)
        assert cuts.size == meta["splits"][split]["documents"]
        starts = np.concatenate([[0], cuts[:-1] + 1])
        docs += [tok.decode(ids[a:b].tolist()) for a, b in zip(starts, cuts, strict=True)]
    return docs


def test_prepare_decodes_back_and_trains_with_only_the_path(tmp_path):
    docs = _corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    cmd = [sys.executable, str(SCRIPT), "--input", str(tmp_path / "corpus"), "--out", str(out)]
    cmd += ["--train-tokenizer", "300", "--val-fraction", "0.2", "--batch-size", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and 257 <= meta["vocab_size"] <= 300
    assert meta["splits"]["val"]["documents"] == 4  # 0.2 of 18 documents
    assert sorted(_decode(out)) == sorted(docs)  # exactly the input documents, each once
    bytes_ = sum(len(d.encode()) for d in docs)
    assert sum(s["bytes"] for s in meta["splits"].values()) == bytes_
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "prepared"]  # no leftovers
    # The saved tokenizer, loaded as a tokenizers JSON file, gives the same token files.
    again = tmp_path / "again"
    argv = ["--input", str(tmp_path / "corpus"), "--out", str(again), "--val-fraction", "0.2"]
    assert prepare_data_script().main([*argv, "--tokenizer", str(out / "tokenizer.json")]) == 0
    for name in ("train.bin", "val.bin"):
        assert (again / name).read_bytes() == (out / name).read_bytes()
    # So does a transformers tokenizer directory holding it (AutoTokenizer, local files only).
    from transformers import PreTrainedTokenizerFast

    hf_dir = tmp_path / "hf-tokenizer"
    eos = meta["tokenizer"]["eos_token"]
    PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"), eos_token=eos
    ).save_pretrained(hf_dir)
    hf_out = tmp_path / "from-hf"
    assert (
        prepare_data_script().main([*argv[:3], str(hf_out), *argv[4:], "--tokenizer", str(hf_dir)])
        == 0
    )
    assert json.loads((hf_out / "meta.json").read_text())["tokenizer"]["kind"] == "transformers"
    for name in ("train.bin", "val.bin"):
        assert (hf_out / name).read_bytes() == (out / name).read_bytes()

    args = [f"data.path={out}", "data=tokens", "train.steps=2", "mesh.world_size=1", "mesh.ep=1"]
    args += ["data.seq_len=16", "data.batch_size=2", "eval.batches=1", "logger=none"]
    args += ["checkpoint.export_hf=false", f"run.root={tmp_path / 'runs'}"]
    env = dict(os.environ, WANDB_MODE="offline")
    train = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "default").iterdir()
    config = (run_dir / "config.yaml").read_text()
    assert f"vocab_size: {meta['vocab_size']}" in config and "dtype: uint16" in config
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    bpb = last["val/loss"] / np.log(2) / meta["bytes_per_token"]
    assert last["val/bpb"] == pytest.approx(bpb)


def test_bad_inputs_fail_by_name_and_leave_no_directory(tmp_path, monkeypatch):
    mod = prepare_data_script()
    good = tmp_path / "good.txt"
    good.write_text("some text\n")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    out = tmp_path / "out"
    cases = [
        (["--input", str(tmp_path / "empty_dir")], "empty_dir: a directory with no files"),
        (["--input", str(tmp_path / "missing")], "missing: no such file or directory"),
        (["--input", str(good), str(tmp_path / "empty.txt")], "empty.txt: empty text"),
        (["--input", str(tmp_path / "latin1.txt")], "latin1.txt: not UTF-8 text"),
        (["--input", str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not a JSON object"),
        (["--input", str(good), "--dtype", "uint8"], "--dtype uint8: holds 256 ids"),
        (["--input", str(good), "--train-tokenizer", "100"], "--train-tokenizer 100"),
        (["--input", str(good), "--val-fraction", "1"], "--val-fraction 1.0: must be in"),
        (["--input", str(good), "--out", str(tmp_path)], "exists and is a non-empty directory"),
        (["--input", str(good), "--out", str(tmp_path), "--force"], "holds the input"),
    ]
    for extra, expected in cases:
        argv = ["--out", str(out), "--train-tokenizer", "300", *extra]
        with pytest.raises(SystemExit) as err:
            mod.main(argv)
        assert expected in str(err.value), (extra, str(err.value))
        assert not out.exists()
    bad_tok = tmp_path / "tok.json"
    bad_tok.write_text("{}")
    with pytest.raises(SystemExit, match="tok.json: not a tokenizers JSON file"):
        mod.main(["--input", str(good), "--out", str(out), "--tokenizer", str(bad_tok)])

    def interrupted(*args, **kwargs):  # the run dies half-way, after some files exist
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_data, "train_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mod.main(["--input", str(good), "--out", str(out), "--train-tokenizer", "300"])
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_force_replaces_an_existing_directory_once_the_new_one_is_complete(tmp_path, monkeypatch):
    """Without `--force` a taken `--out` is refused (its files kept); with it, a run that dies
    half-way keeps the old directory whole and a complete one replaces it."""
    mod = prepare_data_script()
    (tmp_path / "good.txt").write_text("some text\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.bin").write_text("the previous corpus")
    argv = ["--input", str(tmp_path / "good.txt"), "--out", str(out), "--train-tokenizer", "300"]
    with pytest.raises(SystemExit, match="pass --force to replace it"):
        mod.main(argv)
    train_tokenizer = prepare_data.train_tokenizer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_data, "train_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mod.main([*argv, "--force"])
    assert sorted(p.name for p in out.iterdir()) == ["old.bin"]
    monkeypatch.setattr(prepare_data, "train_tokenizer", train_tokenizer)
    assert mod.main([*argv, "--force"]) == 0
    assert not (out / "old.bin").exists() and (out / "meta.json").is_file()


def test_a_vocabulary_smaller_than_asked_is_reported(tmp_path, capsys):
    """A small corpus cannot fill `--train-tokenizer 8192`: the script says which size it got
    (meta.json's, which the model takes) instead of passing over it silently."""
    mod = prepare_data_script()
    _corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    assert (
        mod.main(
            ["--input", str(tmp_path / "corpus"), "--out", str(out), "--train-tokenizer", "8192"]
        )
        == 0
    )
    vocab = json.loads((out / "meta.json").read_text())["vocab_size"]
    assert vocab < 8192
    err = capsys.readouterr().err
    assert f"--train-tokenizer 8192: this corpus gives a vocabulary of {vocab}" in err


def test_packed_documents_train_mla_tiny_on_the_prepared_boundaries(tmp_path):
    """The boundaries prepare_data.py writes are its documents (each ending in EOS), and
    `data.pack=true` trains and evaluates mla_tiny (DSA, IndexShare, MTP) on them."""
    _corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    argv = ["--input", str(tmp_path / "corpus"), "--out", str(out), "--val-fraction", "0.2"]
    assert prepare_data_script().main([*argv, "--train-tokenizer", "300"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    eos = meta["tokenizer"]["eos_id"]
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
        offsets = np.fromfile(out / meta["doc_offsets"][split], dtype=np.int64)
        assert offsets.tolist() == [0, *(np.flatnonzero(ids == eos) + 1).tolist()]
        assert offsets.size == meta["splits"][split]["documents"] + 1
    args = [f"data.path={out}", "data=tokens", "data.pack=true", "model=mla_tiny"]
    args += ["train.steps=2", "mesh.world_size=1", "mesh.ep=1", "data.seq_len=64"]
    args += ["data.batch_size=2", "eval.batches=1", "eval.every=2", "logger=none"]
    args += ["checkpoint.export_hf=false", f"run.root={tmp_path / 'runs'}"]
    train = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=dict(os.environ, WANDB_MODE="offline"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "default").iterdir()
    assert "pack: true" in (run_dir / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    for key in ("loss", "mtp_loss", "indexer_kl", "val/loss"):
        assert np.isfinite(last[key]), key
