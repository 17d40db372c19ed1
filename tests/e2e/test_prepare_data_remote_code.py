"""scripts/prepare_data.py runs no code of a tokenizer directory: an `auto_map` naming the
directory's own Python module (which here writes a marker file when imported) is refused before
any input is read, unless `--trust-remote-code`."""

import json
import os
import subprocess
import sys
from pathlib import Path

from recipes.prepare_tokenizer import remote_code

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"
EOS = "<|endoftext|>"
MODULE = """
from pathlib import Path
from transformers import PreTrainedTokenizerFast

Path({marker!r}).write_text("imported")


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


def _tokenizer_dir(root: Path, marker: Path, where: str) -> Path:
    """A transformers tokenizer directory whose `where` (tokenizer_config.json or config.json)
    maps AutoTokenizer to its own module custom_tok.py."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS])
    tok.train_from_iterator(["the router sends tokens to experts"] * 4, trainer)
    root.mkdir()
    tok.save(str(root / "tokenizer.json"))
    auto_map = {"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]}
    config = {"tokenizer_class": "CustomTokenizer", "eos_token": EOS}
    if where == "tokenizer_config.json":
        config["auto_map"] = auto_map
    else:
        (root / where).write_text(json.dumps({"auto_map": auto_map}))
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "custom_tok.py").write_text(MODULE.format(marker=str(marker)))
    return root


def _prepare(tmp_path: Path, tok_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """The script as a user runs it, answering "y" should anything ask on stdin (transformers
    asks "Do you wish to run the custom code? [y/N]" and imports the module on a "y")."""
    (tmp_path / "doc.txt").write_text("the router sends tokens to experts")
    cmd = [sys.executable, str(SCRIPT), "--input", str(tmp_path / "doc.txt")]
    cmd += ["--out", str(tmp_path / "out"), "--tokenizer", str(tok_dir), "--val-fraction", "0"]
    # transformers copies a module it imports into its modules cache: one under tmp_path
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_MODULES_CACHE=str(tmp_path / "mod"))
    return subprocess.run(
        [*cmd, *extra], input="y\n", capture_output=True, text=True, env=env, timeout=300
    )


def test_a_tokenizer_with_its_own_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "marker"
    tok_dir = _tokenizer_dir(tmp_path / "tok", marker, "tokenizer_config.json")
    proc = _prepare(tmp_path, tok_dir)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"--tokenizer {tok_dir}: tokenizer_config.json has an auto_map" in proc.stderr
    assert "custom_tok.CustomTokenizer" in proc.stderr and "--trust-remote-code" in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
    # an auto_map in config.json is code too (transformers reads AutoTokenizer's entry there)
    other = _tokenizer_dir(tmp_path / "tok2", marker, "config.json")
    assert remote_code(other).startswith("config.json has an auto_map")
    assert remote_code(tmp_path) is None


def test_trust_remote_code_runs_it(tmp_path):
    """With the flag the directory's module is imported and its tokenizer prepares the data."""
    marker = tmp_path / "marker"
    tok_dir = _tokenizer_dir(tmp_path / "tok", marker, "tokenizer_config.json")
    proc = _prepare(tmp_path, tok_dir, "--trust-remote-code")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.read_text() == "imported"
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "transformers"
