"""Token files and the resumable sample stream."""

import numpy as np
import pytest
import torch

from recipes import data


@pytest.fixture
def source(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "a.py").write_text("print('a')\n" * 50)
    (root / "pkg" / "b.py").write_text("x = 1\n" * 80)
    (root / "site-packages" / "skip.py").write_text("installed = True\n")
    (root / "notes.txt").write_text("not python")
    return root


def test_stdlib_corpus_built_once_and_reused(source, tmp_path):
    cache = tmp_path / "cache"
    built = data.build_stdlib_tokens(str(cache), str(source), val_fraction=0.0)
    assert built["val"] is None  # nothing held out
    tokens = np.memmap(built["train"], dtype=np.uint8, mode="r")
    expected = (source / "a.py").read_bytes() + b"\n\n" + (source / "pkg" / "b.py").read_bytes()
    assert tokens.tobytes() == expected  # sorted files, installed packages left out
    mtime = built["train"].stat().st_mtime_ns
    assert data.build_stdlib_tokens(str(cache), str(source), val_fraction=0.0) == built
    assert built["train"].stat().st_mtime_ns == mtime  # reused, not rebuilt
    (source / "a.py").write_text("changed\n" * 50)
    assert data.build_stdlib_tokens(str(cache), str(source), 0.0)["train"] != built["train"]
    assert not list(cache.glob(".*.tmp"))


def test_stdlib_split_holds_out_whole_files_by_path(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(40):
        (root / f"m{i:02d}.py").write_text(f"# module {i}\n" * (i + 1))
    files = data.stdlib_files(root)
    split = data.split_files(files, root, 0.1)
    assert len(split["val"]) == 4 and len(split["train"]) == 36
    assert set(split["val"]).isdisjoint(split["train"])
    (root / "m00.py").write_text("other content, same path\n")  # a side follows the path only
    assert data.split_files(data.stdlib_files(root), root, 0.1) == split
    built = data.build_stdlib_tokens(str(tmp_path / "cache"), str(root), val_fraction=0.1)
    val = np.fromfile(built["val"], dtype=np.uint8).tobytes()
    assert val == b"\n\n".join(p.read_bytes() for p in split["val"])
    assert data.split_files(files[:1], root, 0.5) == {"train": files[:1], "val": []}
    assert len(data.split_files(files, root, 0.001)["val"]) == 1  # at least one file


def test_running_pythons_stdlib_is_found():
    files = data.stdlib_files(data.stdlib_dir())
    assert len(files) > 500
    assert not any("site-packages" in p.parts for p in files)


def test_stream_is_deterministic_and_covers_each_epoch(tmp_path):
    path = data.write_tokens(tmp_path / "t.bin", np.arange(1001, dtype=np.uint16) % 97)
    stream = data.TokenStream(path, "uint16", seq_len=10, seed=3, vocab_size=97)
    assert stream.n_chunks == 100
    x, y = stream.batch(0, 100)
    assert x.shape == (100, 10) and bool((x[:, 1:] == y[:, :-1]).all())
    starts = sorted(int(v) for v in x[:, 0])
    assert starts == sorted((np.arange(100) * 10) % 97)  # every chunk once per epoch
    again = data.TokenStream(path, "uint16", seq_len=10, seed=3, vocab_size=97)
    assert bool((again.batch(0, 100)[0] == x).all())
    other_seed = data.TokenStream(path, "uint16", seq_len=10, seed=4, vocab_size=97)
    assert not bool((other_seed.batch(0, 100)[0] == x).all())


def test_step_layout_consumes_the_same_stream_on_any_world(tmp_path):
    path = data.write_tokens(tmp_path / "t.bin", np.arange(5001, dtype=np.uint16))
    stream = data.TokenStream(path, "uint16", seq_len=8, seed=0, vocab_size=2**16)
    four = [stream.micro_batch(16, m, r, 4, 2)[0] for m in range(2) for r in range(4)]
    two = [stream.micro_batch(16, m, r, 2, 4)[0] for m in range(2) for r in range(2)]
    rows = lambda batches: sorted(tuple(row.tolist()) for b in batches for row in b)  # noqa: E731
    assert rows(four) == rows(two) == rows([stream.batch(16, 16)[0]])


def test_token_ids_beyond_vocab_are_rejected(tmp_path):
    path = data.write_tokens(tmp_path / "t.bin", np.full(100, 300, dtype=np.uint16))
    stream = data.TokenStream(path, "uint16", seq_len=8, seed=0, vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size=256"):
        stream.batch(0, 1)


def test_an_evaluation_set_larger_than_the_split_is_reported_once(tmp_path, caplog):
    """70 held-out sequences, 128 asked for (4 batches x 4 ranks x 8): rank 0 says so once, with
    the figures; a set that fits says nothing."""
    from recipes.evaluate import Evaluator

    path = data.write_tokens(tmp_path / "val.bin", np.zeros(70 * 8 + 1, dtype=np.uint16))
    stream = data.TokenStream(path, "uint16", seq_len=8, seed=0, vocab_size=256)
    big = Evaluator(stream, batches=4, batch_size=8, bytes_per_token=None)
    with caplog.at_level("WARNING", logger="recipes"):
        big.samples(1, 4)  # other ranks stay quiet
        big.samples(0, 4)
        big.samples(0, 4)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "= 128 sequences" in warned[0]
    assert "the validation split holds 70: 58 of them repeat" in warned[0]
    assert Evaluator(stream, batches=2, batch_size=8, bytes_per_token=None).repeated(4) is None


def _documents_file(tmp_path, lengths):
    """A token file of documents of `lengths` (document i: ids 100 i + 1, 100 i + 2, ...),
    with its boundaries."""
    docs = [100 * i + 1 + np.arange(n) for i, n in enumerate(lengths)]
    offsets = np.cumsum([0, *lengths])
    return data.write_tokens(tmp_path / "d.bin", np.concatenate(docs).astype(np.uint16), offsets)


def test_packed_samples_restart_positions_and_stop_labels_at_each_document(tmp_path):
    lengths = [5, 3, 9, 2, 12, 6]
    path = _documents_file(tmp_path, lengths)
    dense = data.TokenStream(path, "uint16", seq_len=8, seed=1, vocab_size=2**16)
    packed = data.TokenStream(path, "uint16", seq_len=8, seed=1, vocab_size=2**16, pack=True)
    x, y = dense.batch(0, dense.n_chunks)
    px, py, pos, doc = packed.batch(0, packed.n_chunks)
    assert torch.equal(px, x)  # the same samples, with their documents
    starts = np.cumsum([0, *lengths])
    for b in range(x.shape[0]):
        first = dense.chunk(b) * 8  # the sample's first token in the stream
        for t in range(8):
            at = first + t
            d = np.searchsorted(starts, at, side="right") - 1
            # from 0 at each document's first token, and at the sample's first
            assert int(pos[b, t]) == at - max(starts[d], first), (b, t)
            assert int(doc[b, t]) == d - (np.searchsorted(starts, first, side="right") - 1)
            last = at + 1 == starts[d + 1]  # no label across the boundary
            assert int(py[b, t]) == (-100 if last else int(y[b, t])), (b, t)
    assert int((py == -100).sum()) > 0 and int((pos == 0).sum()) > x.shape[0]


def test_packing_needs_the_document_boundaries(tmp_path, source):
    path = data.write_tokens(tmp_path / "t.bin", np.arange(100, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"data.pack=true needs the document boundaries"):
        data.TokenStream(path, "uint16", seq_len=8, seed=0, vocab_size=2**16, pack=True)
    data.write_doc_offsets(path, np.array([0, 40, 90]))  # not ending at the token count
    with pytest.raises(ValueError, match=r"data.pack=true: .* then 100"):
        data.TokenStream(path, "uint16", seq_len=8, seed=0, vocab_size=2**16, pack=True)
    # the stdlib build keeps them: each file with the separator after it
    built = data.build_stdlib_tokens(str(tmp_path / "cache"), str(source), val_fraction=0.0)
    offsets = np.fromfile(data.doc_offsets_file(built["train"]), dtype=np.int64)
    a, b = (len((source / f).read_bytes()) for f in ("a.py", "pkg/b.py"))
    assert offsets.tolist() == [0, a + 2, a + 2 + b]
    data.doc_offsets_file(built["train"]).unlink()  # a cache built before: written on use
    data.build_stdlib_tokens(str(tmp_path / "cache"), str(source), val_fraction=0.0)
    again = np.fromfile(data.doc_offsets_file(built["train"]), dtype=np.int64)
    assert again.tolist() == offsets.tolist()


def test_a_directory_without_boundaries_is_refused_naming_data_pack(tmp_path):
    from recipes import config as schema
    from tests.unit.test_config import compose_config, prepared_dir

    prepared = prepared_dir(tmp_path / "p")  # as prepared before the boundaries were written
    args = ["data=tokens", f"data.path={prepared}"]
    schema.validate(compose_config(args))  # data.pack=false reads it as one stream
    with pytest.raises(schema.ConfigError, match=r"data.pack=True: needs the document"):
        schema.validate(compose_config([*args, "data.pack=true"]))
    for split in ("train", "val"):
        n = (prepared / f"{split}.bin").stat().st_size // 2
        data.write_doc_offsets(prepared / f"{split}.bin", np.array([0, n // 2, n]))
    schema.validate(compose_config([*args, "data.pack=true"]))
