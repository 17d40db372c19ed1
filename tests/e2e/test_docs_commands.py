"""Every fenced shell command of README.md and docs/*.md runs as documented.

A command is a line (continuations joined, a trailing `# comment` dropped, `a && b` as two) of
a ```bash / sh / shell / console block, or a line starting with `python ` in a block without a
language (output shown under its command). Each matches exactly one entry of `COMMANDS`:

- `Run(pattern, shrink, writes, needs="", rc=0, drop="")`: run from the repository root (a copy
  of it made of links: outputs stay out of the checkout) at its smallest size, `shrink` applied
  (a `key=value` replaces the command's own value of that key or is added; `--flag [values]`
  replaces every occurrence of the flag, with its values, by one, or is added; each flag of
  `drop` is removed with its values); it must exit `rc` and write every glob of `writes`;
  `needs` names paths other entries write (it runs after them).
- `NotRun(pattern, why)`: GPU-only, Slurm-only, W&B-only (an account and the network) or the
  test suite itself, with the reason.

A new command in the docs without an entry fails `test_every_documented_command_has_one_entry`;
an entry no command matches fails it too. To add a command: one line in `COMMANDS`, e.g.
    Run(r"^python scripts/probe_step\\.py", "--steps 1", "probe_out/results.json"),
Placeholders the docs write (`/tmp/...`, `path/to/tokenizer-dir`) map to paths in the copy
(`PLACEHOLDERS`); inputs a user brings (a corpus) are made by `_inputs`.

Afterwards, every path the commands left in the copy must be git-ignored (`git status` stays
clean after running them from a checkout) and the checkout itself must be unchanged. Commands
run in parallel (`WORKERS`); every `python scripts/plan_memory.py` runs in one process, which
imports torch and the model code once. `DOCS_COMMANDS=<regex>` runs only the commands it
matches (e.g. while adding one).
"""

# ruff: noqa: E501 - COMMANDS is a table: one line per command
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.interpreter import with_interpreter, write_shims

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = ("bash", "sh", "shell", "console")
WORKERS = 3  # subprocesses at once: ranks of one world often wait on each other


@dataclasses.dataclass(frozen=True)
class Run:
    """A command the test runs: its pattern, the arguments that shrink it, what it writes."""

    pattern: str
    shrink: str
    writes: str
    needs: str = ""
    rc: int = 0
    drop: str = ""


@dataclasses.dataclass(frozen=True)
class NotRun:
    """A command the test does not run, and why."""

    pattern: str
    why: str


GPU = "GPU-only: needs a CUDA device"
SLURM = "Slurm-only: needs a Slurm cluster (tests/slurm runs these where Slurm is installed)"
WANDB = "W&B-only: needs a W&B account and the network"
SUITE = "the test suite itself (this test is part of it)"
SETUP = "installs this checkout into the Python environment the tests already run in"

# every train.py run: 2 steps of 32-token sequences, one held-out batch, no progress bar
TRAIN = "train.steps=2 train.warmup_steps=1 data.seq_len=32 data.batch_size=2 eval.batches=1"
TRAIN += " metrics.progress=false"
ONE = "mesh.world_size=1 mesh.ep=1"  # one rank (the world size is never part of a run's name)
PLAN = "--world-size 16"  # the planner's fake world: 16 ranks instead of 512 (ep 8 still fits)
STUDY = f"{TRAIN} {ONE} train.warmup_steps=1 eval.every=1"
NS = "--scale 64 --repeats 1 --train-steps 2 --train-seeds 1 --train-lrs 0.02 --step-world 2"
NS += " --step-count 2 --step-repeats 1 --cond-scale 16"
REMAINDER = "--world-size 2 --shape 64x48 --remainders 1 --steps 1 --warmup 1"

# pattern (re.search on the command as the docs write it) -> shrink -> writes [-> needs]
COMMANDS: list[Run | NotRun] = [
    NotRun(r"^pip install", SETUP),
    NotRun(r"^python -m pytest", SUITE),
    Run(r"^python train\.py$", f"{TRAIN} {ONE}", "outputs/default/*/hf/config.json outputs/default/*/wandb/offline-run-*"),
    Run(r"^python train\.py optim\.remainder_strategy=ragged_all_to_all mesh\.ep=4", f"{TRAIN} logger=none", "outputs/default/*ragged_all_to_all*/checkpoints"),
    Run(r"^python train\.py optim=adamw logger=none$", f"{TRAIN} {ONE}", "outputs/default/*optim-adamw*/metrics.jsonl"),
    Run(r"^python train\.py model=mla_tiny mesh\.world_size=4 mesh\.cp=2$", f"{TRAIN} mesh.world_size=2 mesh.ep=1 logger=none", "outputs/default/*mla_tiny*/metrics.jsonl"),
    Run(r"^/usr/bin/time -f %e python train\.py train\.steps=0$", "", "", rc=1),  # a config error: nothing written
    Run(r"^python train\.py experiment=smoke$", f"{TRAIN} {ONE} logger=none", "outputs/smoke/*/checkpoints/step_*/COMMITTED outputs/smoke/*/hf"),
    Run(r"^python train\.py -m experiment=strategies optim\.remainder_strategy=agrs,pad_all2all,ragged_all_to_all$", f"{TRAIN} mesh.world_size=2 mesh.ep=1 logger=none checkpoint.export_hf=false", "outputs/strategies/*agrs*/metrics.jsonl outputs/strategies/*pad_all2all*/metrics.jsonl outputs/strategies/*ragged*/metrics.jsonl"),
    Run(r"^python train\.py -m experiment=strategies .* optim\.ns_coefficients=fixed", f"{TRAIN} {ONE} optim.remainder_strategy=agrs logger=none checkpoint.export_hf=false", "outputs/strategies/*fixed*/metrics.jsonl"),
    Run(r"^python scripts/compare_strategies\.py outputs/strategies --out compare/$", "", "compare/comparison.md compare/comparison.csv compare/runs.csv compare/step_time.png", needs="outputs/strategies"),
    NotRun(r"^python scripts/compare_strategies\.py --wandb", WANDB),
    NotRun(r"^wandb sync", WANDB),
    NotRun(r"^python scripts/wandb_dashboard\.py --entity", WANDB),
    NotRun(r"^sbatch ", SLURM),
    NotRun(r"^scripts/slurm/sweep_strategies\.sh -N", SLURM),
    NotRun(r"^python train\.py -m hydra/launcher=slurm", SLURM),
    NotRun(r"^eval \"\$\(scripts/slurm/local_cluster\.sh start|^srun |^scripts/slurm/local_cluster\.sh (status|stop)", SLURM + "; local_cluster.sh also needs root"),
    Run(r"^DRY_RUN=1 NPROC_PER_NODE=4 bash scripts/slurm/train\.sbatch mesh\.ep=2$", "", ""),
    NotRun(r"^scripts/gpu_check\.sh gpu_check_out( +--only bench)?$", GPU),
    Run(r"^scripts/gpu_check\.sh gpu_check_out --dry-run$", "", "gpu_check_out"),
    Run(r"^python scripts/plan_memory\.py --model glm5 --world-size 512 --ep 8$", PLAN, ""),
    Run(r"^python scripts/plan_memory\.py --model glm52 --world-size 512 --ep 8$", PLAN, ""),
    Run(r"^python scripts/plan_memory\.py --model glm52 --world-size 512 --ep 8 --no-expert-aware --budget-gib 16 --json plan\.json$", PLAN, "plan.json", rc=1),
    Run(r"^python scripts/plan_memory\.py --model glm5 --world-size 512 --ep 8 --muon-split$", PLAN, ""),
    Run(r"^python scripts/plan_memory\.py --model glm5 --world-size 1024 --ep 8$", "--world-size 32", ""),
    Run(r"^python scripts/plan_memory\.py --model glm52 --world-size 1024 --ep 8$", "--world-size 32", ""),
    Run(r"^python scripts/plan_memory\.py --model glm45_air --world-size 64 --ep 8$", PLAN, ""),
    Run(r"^python scripts/plan_memory\.py --model glm5 --world-size 512 --ep 8 --strategy pad_all2all$", PLAN, ""),
    Run(r"^python scripts/plan_memory\.py --model glm5 --world-size 512 --ep 8 --strategy pad_all2all --muon-split --normuon$", PLAN, ""),
    # --step: 128 ranks keep the documented verdicts (checkpointed: fits at 4096 and 32768 tokens,
    # not at 131072; not checkpointed: never, so every one exits 1)
    Run(r"^python scripts/plan_memory\.py --model glm52? --world-size 512 --ep 8 --muon-split --strategy auto --step --seq-len 4096 --budget-gib 141$", "--world-size 128", "", rc=1),
    Run(r"^python scripts/plan_memory\.py --model glm52? --world-size 512 --ep 8 --muon-split --strategy auto --step --seq-len 32768 --budget-gib 141$", "--world-size 128", "", rc=1),
    Run(r"^python scripts/plan_memory\.py --model glm52? --world-size 512 --ep 8 --muon-split --strategy auto --step --seq-len 131072 --budget-gib 141$", "--world-size 128", "", rc=1),
    Run(r"^python scripts/plan_memory\.py --model glm52 --world-size 512 --ep 8 --muon-split --strategy auto --step --seq-len 1048576 --budget-gib 141$", "--world-size 128", "", rc=1),
    # cp 4 / 32 fit with full checkpointing only (the other mode does not: exit 1); cp 128 fits both
    Run(r"^python scripts/plan_memory\.py --model glm52 --world-size 512 --ep 8 --muon-split --strategy auto --step --seq-len \d+ --budget-gib 141 --cp (4|32)$", "--world-size 128", "", rc=1),
    Run(r"^python scripts/plan_memory\.py --model glm52 --world-size 512 --ep 8 --muon-split --strategy auto --step --seq-len 131072 --budget-gib 141 --cp 128( --cp-keep-gathered)?$", "--world-size 128", ""),
    Run(r"^python scripts/plan_memory\.py --model glm45_air --world-size 8 --ep 8 --step --budget-gib 141$", "", "", rc=1),
    Run(r"^python scripts/plan_memory\.py --model glm45_air --world-size 64 --ep 8 --step --budget-gib 141$", PLAN, ""),
    Run(r"^python train\.py -m run\.root=runs/split optim\.muon_split=on,off", f"{TRAIN} {ONE}", "runs/split/*/*/metrics.jsonl"),
    Run(r"^python scripts/attention_runs\.py runs/split --key optim\.muon_split", "--every 1", "", needs="runs/split"),
    Run(r"^python train\.py -m run\.root=runs/qkclip optim\.qk_clip_tau=null,1\.0", f"{TRAIN} {ONE}", "runs/qkclip/*/*/metrics.jsonl"),
    Run(r"^python scripts/attention_runs\.py runs/qkclip --key optim\.qk_clip_tau$", "--every 1", "", needs="runs/qkclip"),
    Run(r"^python scripts/bench_remainder\.py --ns-variant fixed,standard$", REMAINDER, "bench_out/results.json bench_out/tables.md bench_out/remainder.png"),
    Run(r"^python scripts/bench_remainder\.py --world-size 4 .* --out /tmp/b$", REMAINDER, "tmp/b/results.csv"),
    Run(r"^python scripts/bench_step\.py --baseline /tmp/before --steps [58] --out bench_step_out --ns-variant fixed,standard$", "--steps 1 --warmup 0 --strategies pad_all2all", "bench_step_out/results.json bench_step_out/tables.md", needs="tmp/before"),
    NotRun(r"^git clone https://github\.com/microsoft/dion /tmp/dion$", "needs the network: the microsoft/dion checkout bench_dion.py compares against"),
    Run(r"^python scripts/bench_dion\.py --dion /tmp/dion --steps 6 --out bench_dion_out$", "--steps 1 --warmup 0 --repeats 1", "bench_dion_out/results.json bench_dion_out/tables.md", drop="--dion"),
    Run(r"^python scripts/measure_transient\.py --baseline /tmp/before --out /tmp/transient$", "--variants pad_all2all --repeats 1", "tmp/transient/results.json tmp/transient/tables.md", drop="--baseline"),
    # one small case, no baseline: the time-only entries below run a baseline tree
    Run(r"^python scripts/probe_step\.py mesh\.ep=2 --case model=small --case .* --baseline-tree /tmp/probe-before --out /tmp/probe_final$", "--case model=tiny --no-double", "tmp/probe_final/results.json tmp/probe_final/tables.md", drop="--baseline-tree"),
    Run(r"^python scripts/probe_step\.py --case model=small --baseline-tree /tmp/probe-before --time-only .* --out /tmp/ptime3 mesh\.ep=2$", "model=tiny --baseline-tree . --time-steps 1 --time-rounds 1", "tmp/ptime3/results.json"),
    Run(r"^python scripts/bench_context\.py$", "--cp 2 --seq-len 512 --topk 32 --repeats 1", "bench_out/context/tables.md bench_out/context/context.png"),
    Run(r"^python scripts/bench_attention\.py --per-head-max-t 2048$", "--lengths 256 --dsa-impls masked,latent --modes frozen --repeats 1", "bench_out/attention/tables.md bench_out/attention/attention.png"),
    # its training and Muon-step parts run whole in tests/e2e/test_bench_newton_schulz.py
    Run(r"^python scripts/bench_newton_schulz\.py --scale 8 --out bench_ns$", f"{NS} --skip train,step", "bench_ns/results.json"),
    Run(r"^python scripts/bench_newton_schulz\.py --scale 8 --repeats 5 --variants .* --skip train,step --out bench_ns_after$", NS, "bench_ns_after/results.json"),
    Run(r"^python train\.py -m experiment=optimizers optim=muon optim\.lr=0\.0025.* run\.root=study_small$", f"{STUDY} optim.lr=0.02", "study_small/optimizers/*/metrics.jsonl"),
    Run(r"^python train\.py -m experiment=optimizers optim=adamw optim\.lr=5e-4.* run\.root=study_small$", f"{STUDY} optim.lr=3e-3", "study_small/optimizers/*/metrics.jsonl"),
    Run(r"^python scripts/compare_optimizers\.py study_small/optimizers .* --out compare_small$", "", "compare_small", needs="study_small"),
    Run(r"^python train\.py -m experiment=optimizers optim=muon optim\.lr=0\.005 .*run\.root=study_after$", f"{STUDY}", "study_after/optimizers/*/metrics.jsonl"),
    Run(r"^python train\.py -m experiment=optimizers optim=adamw optim\.lr=1e-3 .*run\.root=study_after$", f"{STUDY}", "study_after/optimizers/*/metrics.jsonl"),
    Run(r"^python scripts/compare_optimizers\.py study_after/optimizers .* --out compare_after$", "", "compare_after", needs="study_after"),
    Run(r"^python train\.py -m experiment=optimizers model=tiny .*optim=muon .* run\.root=study_tiny$", f"{STUDY} optim.lr=0.02", "study_tiny/optimizers/*/metrics.jsonl"),
    Run(r"^python train\.py -m experiment=optimizers model=tiny .*optim=adamw .* run\.root=study_tiny$", f"{STUDY} optim.lr=3e-3", "study_tiny/optimizers/*/metrics.jsonl"),
    Run(r"^python scripts/compare_optimizers\.py study_tiny/optimizers .* --out compare_tiny$", "", "compare_tiny", needs="study_tiny"),
    Run(r"^python train\.py -m experiment=optimizers model=mla_tiny .*optim=muon .* run\.root=study_mla$", f"{STUDY} optim.lr=0.02", "study_mla/optimizers/*/metrics.jsonl"),
    Run(r"^python train\.py -m experiment=optimizers model=mla_tiny .*optim=adamw .* run\.root=study_mla$", f"{STUDY} optim.lr=3e-3", "study_mla/optimizers/*/metrics.jsonl"),
    Run(r"^python scripts/compare_optimizers\.py study_mla/optimizers .* --out compare_mla$", "", "compare_mla", needs="study_mla"),
    Run(r"^python scripts/measure_init\.py --preset small --meshes 1:1 4:2 8:4 --rounds 3 --out init\.json$", "--preset tiny --meshes 1:1 2:2 --rounds 1 --repeats 1", "init.json"),
    Run(r"^python scripts/measure_step_memory\.py --preset small --world-size 4 --ep 2 --modes full none --out step\.json$", "--preset tiny --world-size 2 --modes none", "step.json"),
    Run(r"^python scripts/measure_step_memory\.py --preset mla_tiny --world-size 4 --ep 2 --modes full none$", "--world-size 2 --modes none", ""),
    Run(r"^python scripts/prepare_data\.py --input corpus/ more\.jsonl --out data/corpus --train-tokenizer 8192$", "", "data/corpus/meta.json data/corpus/tokenizer.json"),
    Run(r"^python scripts/prepare_data\.py --input corpus/ --out data/corpus-tok --tokenizer path/to/tokenizer-dir$", "", "data/corpus-tok/meta.json", needs="data/corpus"),
    Run(r"^python train\.py data=tokens data\.path=data/corpus$", f"{TRAIN} {ONE} logger=none", "outputs/default/*data.path-data_corpus*/metrics.jsonl", needs="data/corpus"),
]  # fmt: skip

#: what the docs write for a path the user picks -> the path in the copy
PLACEHOLDERS = {"/tmp/": "tmp/", "path/to/tokenizer-dir": "data/corpus/tokenizer.json"}
#: in the copy, made by the test (a user's inputs, stand-ins for /tmp): not checked as outputs
INPUTS = ("corpus", "more.jsonl", "tmp", ".bin", ".logs")
#: the checkout the bench_step baseline is built from (docs/benchmarks.md names it)
BASELINE_COMMIT = "e380687"


# ---------------------------------------------------------------------------------- reading
def documented_commands() -> list[tuple[str, str]]:
    """(doc, command) for every shell command of a fenced block, in the docs' order."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
            lang, body = m.group(1), m.group(2)
            if lang and lang not in SHELL_LANGS:
                continue
            lines = body.replace("\\\n", " ").splitlines()
            if not lang:  # output blocks: only the lines that are commands
                lines = [line for line in lines if line.startswith("python ")]
            for line in lines:
                command = _strip_comment(line).strip()
                if command and not command.startswith("#"):
                    out += [(doc.name, " ".join(p.split())) for p in command.split(" && ")]
    return out


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a `#` outside quotes after a blank)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def entry_for(command: str) -> list[Run | NotRun]:
    """The entries whose pattern matches `command` (exactly one, or the table is wrong)."""
    return [e for e in COMMANDS if re.search(e.pattern, command)]


def shrunk(command: str, shrink: str, drop: str = "") -> str:
    """`command` with placeholders mapped and `shrink` applied (see the module docstring)."""
    for placeholder, path in PLACEHOLDERS.items():
        command = command.replace(placeholder, path)
    words = shlex.split(command)
    start = next(i for i, w in enumerate(words) if not re.match(r"^[A-Z_]+=", w))
    head, args = words[: start + 1], words[start + 1 :]
    for flag in drop.split():
        args = _replace_flag(args, flag, [])
    extra = shlex.split(shrink)
    i = 0
    while i < len(extra):
        word = extra[i]
        if word.startswith("--"):
            j = i + 1
            while j < len(extra) and not extra[j].startswith("--"):
                j += 1
            args = _replace_flag(args, word, extra[i:j])
            i = j
            continue
        key = word.split("=", 1)[0]
        same = [k for k, a in enumerate(args) if a.split("=", 1)[0] == key and "=" in a]
        if same:
            args[same[0]] = word
        else:
            args.append(word)
        i += 1
    return shlex.join(head + args)


def _replace_flag(args: list[str], flag: str, new: list[str]) -> list[str]:
    """`args` with every occurrence of `flag` and its values replaced by `new`, once (at the
    first occurrence), or `new` appended when `flag` is absent."""
    if flag not in args:
        return args + new
    out, placed, k = [], False, 0
    while k < len(args):
        if args[k] != flag:
            out.append(args[k])
            k += 1
            continue
        k += 1  # its values: up to the next flag, or the next key=value unless they are
        overrides = k < len(args) and "=" in args[k]  # key=value overrides (`--case`)
        while k < len(args) and not args[k].startswith("-") and (overrides or "=" not in args[k]):
            k += 1
        if not placed:
            out += new
            placed = True
    return out


# ------------------------------------------------------------------------------------ tests
def test_every_documented_command_has_one_entry():
    """Each documented command matches exactly one entry, and each entry some command."""
    commands = documented_commands()
    assert len(commands) > 40
    problems = []
    for doc, command in commands:
        matches = entry_for(command)
        if len(matches) != 1:
            problems.append(f"{doc}: `{command}` matches {len(matches)} entries of COMMANDS")
    used = {id(e) for _, c in commands for e in entry_for(c)}
    problems += [
        f"no documented command matches {e.pattern!r}" for e in COMMANDS if id(e) not in used
    ]
    assert not problems, "\n".join(problems)


def test_shrinking_replaces_values_and_flags():
    cmd = "python train.py -m optim.lr=0.01,0.02 run.root=study mesh.ep=2"
    assert shrunk(cmd, "optim.lr=0.02 train.steps=2") == (
        "python train.py -m optim.lr=0.02 run.root=study mesh.ep=2 train.steps=2"
    )
    cmd = "python scripts/m.py --meshes 1:1 4:2 --out /tmp/x --variants 'a b,c'"
    assert shrunk(cmd, "--meshes 1:1 --rounds 1") == (
        "python scripts/m.py --meshes 1:1 --out tmp/x --variants 'a b,c' --rounds 1"
    )
    assert shrunk("DRY_RUN=1 bash s.sh mesh.ep=2", "mesh.ep=1") == "DRY_RUN=1 bash s.sh mesh.ep=1"
    # every occurrence of a flag becomes one; a flag of overrides takes them all; drop removes
    cmd = (
        "python p.py mesh.ep=2 --case model=small --case model=small a=1 --base /tmp/b --out o x=1"
    )
    assert shrunk(cmd, "--case model=tiny", drop="--base") == (
        "python p.py mesh.ep=2 --case model=tiny --out o x=1"
    )


@dataclasses.dataclass
class _Job:
    command: str  # as the docs write it
    run: str  # shrunk
    entry: Run
    log: Path
    rc: int | None = None
    seconds: float = 0.0


def _copy_of_checkout(root: Path) -> None:
    """`root` as the repository root: a link to every tracked top-level entry."""
    names = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in sorted({n.split("/")[0] for n in names}):
        (root / name).symlink_to(ROOT / name)
    write_shims(root / ".bin")
    (root / ".logs").mkdir()


def _inputs(root: Path) -> None:
    """What a user brings: a corpus (text files and a JSONL file) and, for bench_step's
    `--baseline /tmp/before`, the checkout docs/benchmarks.md names (`git worktree add`)."""
    import json

    stdlib = Path(os.__file__).parent
    (root / "corpus").mkdir()
    for i, src in enumerate(sorted(stdlib.glob("[a-c]*.py"))[:24]):
        (root / "corpus" / f"doc{i:02d}.txt").write_text(src.read_text(errors="ignore")[:4000])
    lines = [
        json.dumps({"text": p.read_text(errors="ignore")[:2000]})
        for p in sorted(stdlib.glob("d*.py"))[:8]
    ]
    (root / "more.jsonl").write_text("\n".join(lines) + "\n")
    before = root / "tmp" / "before"
    before.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", BASELINE_COMMIT, "muon", "recipes", "models"],
        cwd=ROOT,
        capture_output=True,
    )
    if archive.returncode:  # a shallow clone: this checkout stands in for the baseline
        for name in ("muon", "recipes", "models"):
            (before / name).symlink_to(ROOT / name)
        return
    import io

    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(before, filter="data")


def _env(root: Path) -> dict[str, str]:
    env = with_interpreter(dict(os.environ), root / ".bin")
    return dict(
        env,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        MPLBACKEND="Agg",
    )


_PLANNER = re.compile(r"^python scripts/plan_memory\.py ")
_PLANNER_PROGRAM = """\
import contextlib, runpy, sys
for line in sys.stdin.read().splitlines():
    log, *argv = line.split("\\0")
    with open(log, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        sys.argv = ["scripts/plan_memory.py", *argv]
        try:
            runpy.run_path("scripts/plan_memory.py", run_name="__main__")
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc(); rc = 1
    print(log, rc, flush=True)
"""


def _run_planner(jobs: list[_Job], root: Path) -> None:
    """Every planner command in one process (torch and the model code imported once)."""
    lines = "\n".join("\0".join([str(j.log), *shlex.split(j.run)[2:]]) for j in jobs)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _PLANNER_PROGRAM],
        cwd=root,
        env=_env(root),
        input=lines,
        capture_output=True,
        text=True,
        timeout=900,
    )
    codes = dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines())
    for j in jobs:
        j.rc = int(codes.get(str(j.log), -1))
        j.seconds = (time.monotonic() - t0) / len(jobs)
        if j.rc == -1:
            j.log.write_text(proc.stderr[-4000:])


def _run_one(job: _Job, root: Path) -> None:
    t0 = time.monotonic()
    with open(job.log, "w") as log:
        proc = subprocess.run(
            ["bash", "-c", job.run],
            cwd=root,
            env=_env(root),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    job.rc, job.seconds = proc.returncode, time.monotonic() - t0


def _git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _left_behind(root: Path) -> list[str]:
    """Paths the commands created in the copy (directories with a trailing /)."""
    out = []
    for p in sorted(root.iterdir()):
        if p.is_symlink() or p.name in INPUTS:
            continue
        out.append(p.name + ("/" if p.is_dir() else ""))
        if p.is_dir():
            out += [f"{p.name}/{q.relative_to(p).as_posix()}" for q in p.rglob("*") if q.is_file()][
                :200
            ]
    return out


@pytest.mark.slow
def test_documented_commands_run_and_leave_only_ignored_files(tmp_path_factory):
    """Every `Run` entry's commands, shrunk, exit as documented and write what the docs say;
    what they leave is git-ignored and the checkout is unchanged."""
    from recipes.data import build_stdlib_tokens

    root = tmp_path_factory.mktemp("docs-commands")
    status_before = _git_status()
    _copy_of_checkout(root)
    _inputs(root)
    build_stdlib_tokens(os.path.expanduser("~/.cache/moe_muon_recipes"))  # once, not per run
    only = re.compile(os.environ.get("DOCS_COMMANDS", ""))  # e.g. DOCS_COMMANDS=bench_step
    jobs: dict[str, _Job] = {}
    for _, command in documented_commands():
        (entry,) = entry_for(command)
        if isinstance(entry, Run) and only.search(command):
            run = shrunk(command, entry.shrink, entry.drop)
            if run not in jobs:  # the same command in two docs, or two that shrink alike
                jobs[run] = _Job(command, run, entry, root / ".logs" / f"{len(jobs):02d}.log")
    planner = [j for j in jobs.values() if _PLANNER.match(j.run)]
    others = [j for j in jobs.values() if not _PLANNER.match(j.run)]
    t0 = time.monotonic()
    done: dict[int, Future] = {}
    lock = threading.Lock()

    def producers(job: _Job) -> list[Future]:
        needs = job.entry.needs.split()
        with lock:
            return [
                done[id(other)]
                for other in others
                if other is not job
                and id(other) in done
                and any(w.startswith(n) for w in other.entry.writes.split() for n in needs)
            ]

    def start(job: _Job) -> None:
        for future in producers(job):
            future.result()
        _run_one(job, root)

    by_world: dict[str, list[_Job]] = {}
    for job in planner:  # one fake process group per process: one process per world size
        words = shlex.split(job.run)
        by_world.setdefault(words[words.index("--world-size") + 1], []).append(job)
    with ThreadPoolExecutor(WORKERS) as pool:
        plan_futures = [pool.submit(_run_planner, group, root) for group in by_world.values()]
        # producers first: a job waits only on jobs submitted (so started) before it
        for job in sorted(others, key=lambda j: bool(j.entry.needs)):
            with lock:
                done[id(job)] = pool.submit(start, job)
        for future in plan_futures:
            future.result()
        for future in done.values():
            future.result()
    wall = time.monotonic() - t0

    failures = []
    for job in jobs.values():
        missing = [w for w in job.entry.writes.split() if not list(root.glob(w))]
        if job.rc != job.entry.rc or missing:
            tail = job.log.read_text()[-3000:] if job.log.exists() else ""
            failures.append(
                f"`{job.command}`\n  ran as `{job.run}`: exit {job.rc} (documented: "
                f"{job.entry.rc}); missing {missing}\n{tail}"
            )
    timing = ", ".join(
        f"{j.seconds:.0f}s {j.run[:50]}"
        for j in sorted(jobs.values(), key=lambda j: -j.seconds)[:8]
    )
    print(f"docs commands: {len(jobs)} in {wall:.0f} s; slowest: {timing}")
    (root / ".logs" / "failures.txt").write_text("\n\n".join(failures))
    assert not failures, f"{len(failures)} documented commands failed:\n\n" + "\n\n".join(failures)

    quickstart = [j for j in jobs.values() if j.command == "python train.py"]
    for job in quickstart:  # its export passes back as the summary line says (no quoting)
        (line,) = [x for x in job.log.read_text().splitlines() if "from this export:" in x]
        reuse = shlex.split(line.split("from this export: ", 1)[1])
        assert reuse[0] == "model=hf" and "'" not in line, line
        proc = subprocess.run(
            [sys.executable, "train.py", *reuse, *shlex.split(f"{TRAIN} {ONE}"), "run.name=reused"],
            cwd=root,
            env=_env(root),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        (reused,) = (root / "outputs" / "reused").iterdir()
        assert "=" not in reused.name and "," not in reused.name, reused.name

    left = _left_behind(root)
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=ROOT,
        input="\n".join(left),
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    tracked_clean = [
        p
        for p in left
        if p not in ignored and not any(p.startswith(i) for i in ignored if i.endswith("/"))
    ]
    assert not tracked_clean, f"not git-ignored (add to .gitignore): {tracked_clean}"
    assert _git_status() == status_before, "the commands changed the checkout"
