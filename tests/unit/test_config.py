"""The Hydra config tree composes and validates; bad input fails early, naming the key."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from recipes import config as schema

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = ("model", "mesh", "optim", "data", "logger", "checkpoint", "experiment")


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _all_choices() -> list[list[str]]:
    cases = [[]]
    for group in GROUPS:
        cases += [[f"{group}={name}"] for name in _options(group)]
    return cases


@pytest.mark.parametrize("overrides", _all_choices(), ids=lambda o: ",".join(o) or "default")
def test_every_config_composes_and_validates(overrides, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if overrides == ["data=tokens"]:
        token_file = tmp_path / "tokens.bin"
        token_file.write_bytes(bytes(64))
        overrides = [*overrides, f"data.path={token_file}"]
    cfg = _compose(overrides)
    schema.validate(cfg)
    plain = schema.to_plain(cfg)
    if plain["optim"]["name"] == "muon":
        assert plain["optim"]["remainder_strategy"] in ("agrs", "pad_all2all", "ragged_all_to_all")
    else:  # one schema per optimizer: an AdamW run carries no Muon key (QK-clip is shared)
        assert plain["optim"].keys() == {
            *("name", "lr", "weight_decay", "betas", "eps"),
            *("qk_clip_tau", "qk_clip_alpha"),
        }
    # What the workers receive round-trips into the typed schema.
    again = schema.from_yaml(OmegaConf.to_yaml(cfg, resolve=True))
    assert schema.to_plain(again) == plain


def test_model_group_matches_presets():
    from models.glm.config import PRESET_NAMES

    assert _options("model") == sorted(PRESET_NAMES)
    assert sorted(p.value for p in schema.ModelPreset) == sorted(PRESET_NAMES)


def test_embedded_default():
    cfg = schema.to_plain(_compose([]))
    assert cfg["model"]["preset"] == "tiny"
    assert (cfg["mesh"]["world_size"], cfg["mesh"]["ep"]) == (4, 2)
    assert (cfg["optim"]["name"], cfg["optim"]["remainder_strategy"]) == ("muon", "pad_all2all")
    assert (cfg["data"]["source"], cfg["data"]["vocab_size"]) == ("stdlib", 256)
    assert (cfg["logger"]["backend"], cfg["logger"]["mode"]) == ("wandb", "offline")


def test_user_keys_override():
    keys = [
        "optim.remainder_strategy=ragged_all_to_all",
        "optim.enable_all2all=false",
        "optim.lr=0.01",
        "mesh.world_size=8",
        "mesh.ep=4",
        "model=small",
        "train.steps=7",
        "train.seed=3",
        "logger=none",
        "checkpoint.every=5",
        "metrics.memory_every=2",
        "+model.overrides.num_hidden_layers=2",
    ]
    cfg = _compose(keys)
    schema.validate(cfg)
    plain = schema.to_plain(cfg)
    assert plain["optim"]["remainder_strategy"] == "ragged_all_to_all"
    assert plain["optim"]["enable_all2all"] is False
    assert (plain["mesh"]["world_size"], plain["mesh"]["ep"]) == (8, 4)
    assert (plain["model"]["preset"], plain["logger"]["backend"]) == ("small", "none")
    assert plain["model"]["overrides"] == {"num_hidden_layers": 2}
    assert (plain["train"]["steps"], plain["checkpoint"]["every"]) == (7, 5)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.remainder_strategy=agsr", ["optim.remainder_strategy", "agrs, pad_all2all"]),
        ("optim.lr=oops", ["optim.lr", "oops"]),
        ("optim.ns_dtype=float64", ["optim.ns_dtype", "bfloat16, float32, float16"]),
        ("optim.ns_algorithm=fast", ["optim.ns_algorithm", "standard, gram, auto"]),
        ("optim.ns_coefficients=cubic", ["optim.ns_coefficients", "fixed, tuned, polar_express"]),
        ("optim.nonexistent=1", ["nonexistent"]),
        ("model=huge", ["model", "tiny"]),
        ("logger=neptune", ["logger", "wandb"]),
        # one schema per optimizer: Muon keys do not exist under optim=adamw
        ("optim=adamw optim.remainder_strategy=agrs", ["remainder_strategy", "AdamWOptimConfig"]),
    ],
)
def test_compose_rejects(override, expected):
    with pytest.raises(ConfigCompositionException) as err:
        _compose(override.split())
    text = f"{err.value} {err.value.__cause__}"
    for fragment in expected:
        assert fragment in text


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optim.lr=-0.1"], "optim.lr=-0.1: must be > 0"),
        (["mesh.ep=3"], "mesh.ep=3: must divide mesh.world_size=4; allowed: 1, 2, 4"),
        (["mesh.world_size=0"], "mesh.world_size=0: must be > 0"),
        (["data=tokens"], "data.path=None: data.source=tokens needs a token file"),
        (["data=tokens", "data.path=/nonexistent/tok.bin"], "data.path=/nonexistent/tok.bin"),
        (["data.path=/nonexistent/src"], "no such source directory"),
        (["train.inject_nan_at_step=99", "train.steps=5"], "must be in [1, 5]"),
        (["+model.overrides.hidden=3"], "model.overrides.hidden=3: not a GLMConfig field"),
        (["optim.momentum=1.0"], "optim.momentum=1.0: must be in [0, 1)"),
        (["optim.normuon_beta2=1.0"], "optim.normuon_beta2=1.0: must be in [0, 1)"),
        (["optim.qk_clip_tau=0.0"], "optim.qk_clip_tau=0.0: must be > 0"),
        (["optim=adamw", "optim.qk_clip_alpha=1.5"], "optim.qk_clip_alpha=1.5: must be in [0, 1]"),
        (["data.vocab_size=300"], "does not fit data.dtype=uint8"),
        (["optim.name=adamw"], "optim.name=adamw: the optimizer is chosen with the config group"),
        (["data.vocab_size=100"], "data.vocab_size=100: data.source=stdlib has byte tokens"),
        (["optim.betas=[0.9,inf]"], "optim.betas[1]=inf: must be a finite number"),
        (["train.min_lr_ratio=nan"], "train.min_lr_ratio=nan: must be a finite number"),
        (["+model.overrides.n_group=3"], "model.overrides.n_group=3: GLMConfig.n_group (3) must"),
        (["+model.overrides.rope_theta=-1.0"], "model.overrides.rope_theta=-1.0: GLMConfig"),
        (["+model.overrides.num_experts_per_tok=9"], "model.overrides.num_experts_per_tok=9: "),
        (["mesh.world_size=6", "mesh.ep=3"], "mesh.ep=3: n_routed_experts (8) must be"),
    ],
)
def test_validate_rejects(overrides, expected):
    with pytest.raises(schema.ConfigError) as err:
        schema.validate(_compose(overrides))
    assert expected in str(err.value)


def test_validate_checks_the_launcher_world():
    with pytest.raises(schema.ConfigError, match="WORLD_SIZE=8"):
        schema.validate(_compose([]), env_world_size=8)


def test_every_field_has_help():
    lines = schema.describe()
    assert any(line.startswith("optim.remainder_strategy = 'pad_all2all'  # ") for line in lines)
    leaves = [line.split(" = ")[0] for line in lines]
    assert len(leaves) == len(set(leaves)) > 40
    for line in lines:
        assert line.split("  # ", 1)[1].strip(), line

    def walk(node):
        for f in dataclasses.fields(node):
            assert f.metadata.get("help"), f"{node.__name__}.{f.name} has no help"
            if dataclasses.is_dataclass(f.default_factory):
                walk(f.default_factory)

    walk(schema.Config)


def test_help_lists_every_key_with_allowed_values_and_help(tmp_path):
    """`--help` renders the schema for the composed config: Muon's keys by default, AdamW's
    (and no Muon key) with optim=adamw."""
    proc = _train_py("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    strategy = next(line for line in lines if line.startswith("optim.remainder_strategy = "))
    assert "[agrs, pad_all2all, ragged_all_to_all, auto]" in strategy
    assert "# Muon exchange for batches smaller than the FSDP group" in strategy
    assert any(line.startswith("optim.nesterov = true  [true, false]  # ") for line in lines)
    keys = {line.split(" = ")[0] for line in lines if line[:1].islower() and "  # " in line}
    assert keys == {line.split(" = ")[0] for line in schema.describe()}
    assert "optim: adamw, muon" in lines and "Powered by Hydra" not in proc.stdout
    assert not any(line.startswith("schema") for line in lines)
    adamw = _train_py("--help", "optim=adamw", cwd=tmp_path)
    assert adamw.returncode == 0, adamw.stderr
    optim = {
        line.split(" = ")[0] for line in adamw.stdout.splitlines() if line.startswith("optim.")
    }
    shared = ("name", "lr", "weight_decay", "betas", "eps", "qk_clip_tau", "qk_clip_alpha")
    assert optim == {f"optim.{k}" for k in shared}
    assert "optim.lr = 0.003  # " in adamw.stdout
    assert not list(tmp_path.iterdir())  # nothing written


def test_sweep_jobs_that_would_share_a_directory_fail_before_any_starts(tmp_path):
    """`a/b` and `a_b` give one directory name: the sweep fails before its first job; so does
    a sweep with one invalid job."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a_b").mkdir()
    proc = _train_py("-m", "data.path=a/b,a_b", cwd=tmp_path)
    assert proc.returncode != 0
    assert (
        "sweep jobs [data.path=a/b" in proc.stderr
        and "would share the run directory" in proc.stderr
    )
    proc = _train_py("-m", "optim.lr=0.1,nan", cwd=tmp_path)
    assert (
        "sweep job [optim.lr=nan" in proc.stderr and "optim.lr=nan: must be a finite" in proc.stderr
    )
    assert "[rank" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a_b"]  # nothing written


def test_run_dir_is_stable_per_command():
    assert schema.run_id("") == "base"
    assert schema.run_id("data.path=/a/b,optim.lr=0.1") == "data.path=_a_b,optim.lr=0.1"


def _train_py(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"run.root={cwd}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "optim.remainder_strategy=agsr",
            "expected one of [agrs, pad_all2all, ragged_all_to_all, auto]",
        ),
        ("mesh.ep=3", "mesh.ep=3: must divide mesh.world_size=4; allowed: 1, 2, 4"),
        ("optim.lr=nan", "optim.lr=nan: must be a finite number"),
        ("+model.overrides.hidden_size=-64", "model.overrides.hidden_size=-64: GLMConfig.hidden"),
        (
            "+model.overrides.n_routed_experts=6 mesh.ep=4",
            "mesh.ep=4: n_routed_experts (6) must be divisible by ep (4); allowed ep: [1, 2]",
        ),
    ],
)
def test_train_py_fails_fast_before_any_rank(override, expected, tmp_path):
    proc = _train_py(*override.split(), cwd=tmp_path)
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert proc.stderr.count(expected) == 1 and "Traceback" not in proc.stderr  # one message
    assert "[rank" not in proc.stdout + proc.stderr  # no rank ever started
    assert not list(tmp_path.iterdir())  # not even the empty run dir Hydra made


def test_newton_schulz_knobs_reach_the_optimizer():
    """optim.ns_coefficients / optim.ns_algorithm land in every Muon group (single process)."""
    from models.glm import GLMForCausalLM, get_preset
    from recipes.parallel import build_optimizer

    cfg = _compose(["optim.ns_coefficients=fixed", "optim.ns_algorithm=standard"])
    cfg.optim.normuon, cfg.optim.normuon_beta2 = True, 0.9
    opt = build_optimizer(cfg, GLMForCausalLM(get_preset("tiny")))
    muon = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    assert muon and all(
        (g["ns_coefficients"], g["ns_algorithm"], g["normuon"], g["normuon_beta2"])
        == ("fixed", "standard", True, 0.9)
        for g in muon
    )
    assert all("normuon_v" in opt.state[p] for g in muon for p in g["params"])
    default = build_optimizer(_compose([]), GLMForCausalLM(get_preset("tiny")))
    assert {
        (g["ns_coefficients"], g["ns_algorithm"])
        for g in default.param_groups
        if g["algorithm"] == "muon"
    } == {("polar_express", "auto")}


def test_attention_knobs_reach_the_model_and_optimizer():
    """metrics.attn_max_logit / optim.qk_clip_tau decide the recording; optim.muon_split which
    projections are split (auto: MLA only)."""
    from models.glm import GLMForCausalLM, get_preset
    from recipes.parallel import build_optimizer, muon_split_on, records_max_logits

    assert records_max_logits(_compose([]))
    assert not records_max_logits(_compose(["metrics.attn_max_logit=false"]))
    assert records_max_logits(_compose(["metrics.attn_max_logit=false", "optim.qk_clip_tau=50"]))
    gqa, mla = GLMForCausalLM(get_preset("tiny")), GLMForCausalLM(get_preset("mla_tiny"))
    assert not muon_split_on("auto", gqa) and muon_split_on("auto", mla)
    assert muon_split_on("on", gqa) and not muon_split_on("off", mla)
    opt = build_optimizer(_compose(["optim.muon_split=on"]), gqa)
    split = {n for g in opt.param_groups if g.get("num_blocks", 1) > 1 for n in g["param_names"]}
    assert "model.layers.0.self_attn.q_proj.weight" in split
    unsplit = build_optimizer(_compose([]), gqa)
    assert not any(
        "self_attn" in n
        for g in unsplit.param_groups
        if g.get("num_blocks", 1) > 1
        for n in g["param_names"]
    )
