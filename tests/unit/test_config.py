"""The Hydra config tree composes and validates; bad input fails early, naming the key."""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from muon.plan import REMAINDER_STRATEGIES
from recipes import config as schema
from recipes.config import run_dir

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
GROUPS = ("model", "mesh", "optim", "data", "logger", "checkpoint", "experiment")


def compose_config(overrides: list[str]):
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
        overrides = [*overrides, f"data.path={prepared_dir(tmp_path / 'prepared')}"]
    if overrides == ["model=hf"]:  # the model of a transformers directory: the tiny preset's
        from models.glm import GLMForCausalLM, get_preset
        from models.glm.hf.adapter import export_hf

        tiny = GLMForCausalLM(get_preset("tiny"))
        export_hf(tiny, tiny.config, tmp_path / "hf")
        overrides = [*overrides, f"model.path={tmp_path / 'hf'}"]
    cfg = compose_config(overrides)
    schema.validate(cfg)
    plain = schema.to_plain(cfg)
    if plain["optim"]["name"] == "muon":
        assert plain["optim"]["remainder_strategy"] in REMAINDER_STRATEGIES
    else:  # one schema per optimizer: an AdamW run carries no Muon key (QK-clip is shared)
        assert plain["optim"].keys() == {
            *("name", "lr", "weight_decay", "betas", "eps"),
            *("qk_clip_tau", "qk_clip_alpha"),
        }
    # What the workers receive round-trips into the typed schema.
    again = schema.from_yaml(OmegaConf.to_yaml(cfg, resolve=True))
    assert schema.to_plain(again) == plain


def test_model_group_matches_presets():
    from models.glm.model.presets import PRESET_NAMES

    # `model=hf` builds the model of a transformers directory (model.path) instead of a preset.
    assert _options("model") == sorted([*PRESET_NAMES, "hf"])
    assert sorted(p.value for p in schema.ModelPreset) == sorted([*PRESET_NAMES, "hf"])


def test_embedded_default():
    cfg = schema.to_plain(compose_config([]))
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
    cfg = compose_config(keys)
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
        ("train.indexer_training=train", ["train.indexer_training", "kl, frozen"]),
        # one schema per optimizer: Muon keys do not exist under optim=adamw
        ("optim=adamw optim.remainder_strategy=agrs", ["remainder_strategy", "AdamWOptimConfig"]),
    ],
)
def test_compose_rejects(override, expected):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(override.split())
    text = f"{err.value} {err.value.__cause__}"
    for fragment in expected:
        assert fragment in text


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optim.lr=-0.1"], "optim.lr=-0.1: must be > 0"),
        (["mesh.ep=3"], "mesh.ep=3: must divide mesh.world_size=4; allowed: 1, 2, 4"),
        (["mesh.cp=3"], "mesh.cp=3: must divide mesh.world_size=4; allowed: 1, 2, 4"),
        (["mesh.cp=0"], "mesh.cp=0: must be > 0"),
        (
            ["mesh.cp=2", "data.seq_len=126"],
            "data.seq_len=126: must be a multiple of 2 x mesh.cp = 4",
        ),
        (["mesh.world_size=0"], "mesh.world_size=0: must be > 0"),
        (["data=tokens"], "data.path=None: data.source=tokens needs a prepare_data.py"),
        (["data=tokens", "data.path=/nonexistent/tok.bin"], "data.path=/nonexistent/tok.bin"),
        (["data.val_fraction=1.0"], "data.val_fraction=1.0: must be in [0, 1)"),
        (["data.val_fraction=0"], "data.val_fraction=0.0: eval.every > 0 needs held-out"),
        (["eval.batches=0"], "eval.batches=0: must be > 0"),
        (["eval.every=-1"], "eval.every=-1: must be >= 0"),
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
        (["data.seq_len=131073"], "data.seq_len=131073: exceeds the model's max_position_emb"),
        (["train.mtp_loss_weight=-0.1"], "train.mtp_loss_weight=-0.1: must be >= 0"),
        (
            [
                "model=mla_tiny",
                "+model.overrides.index_topk=null",
                "+model.overrides.index_n_heads=null",
                "+model.overrides.index_head_dim=null",
                "+model.overrides.indexer_types=null",
            ],
            "checkpoint.export_hf=True: GLMConfig.index_topk is None",
        ),
        (
            ["+model.overrides.indexer_training=frozen"],
            "model.overrides.indexer_training=frozen: train.indexer_training=kl picks it",
        ),
        (
            ["model=mla_tiny", "+model.overrides.indexer_types=[full,full]"],
            "model.overrides.indexer_types=['full', 'full']: GLMConfig.indexer_types has 2",
        ),
        (
            ["model=mla_tiny", "+model.overrides.dsa_impl=dense"],
            "model.overrides.dsa_impl=dense: GLMConfig.dsa_impl must be one of ('latent', "
            "'per_head', 'masked')",
        ),
        (
            ["model=mla_tiny", "+model.overrides.dsa_chunk_mib=0"],
            "model.overrides.dsa_chunk_mib=0: GLMConfig.dsa_chunk_mib must be a positive int",
        ),
        (
            ["+model.overrides.kv_lora_rank=8"],
            "model.overrides.kv_lora_rank=8: GLMConfig.kv_lora_rank is a multi-head latent",
        ),
    ],
)
def test_validate_rejects(overrides, expected):
    with pytest.raises(schema.ConfigError) as err:
        schema.validate(compose_config(overrides))
    assert expected in str(err.value)


def prepared_dir(directory, vocab_size=300, val_tokens=600):
    """A minimal prepared token directory (what scripts/prepare_data.py writes)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.bin").write_bytes(bytes(2 * 600))  # 600 uint16 tokens
    (directory / "val.bin").write_bytes(bytes(2 * val_tokens))
    splits = {"train": {"tokens": 600, "bytes": 2000}, "val": {"tokens": val_tokens, "bytes": 50}}
    meta = {"vocab_size": vocab_size, "dtype": "uint16", "splits": splits}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def test_prepared_directory_gives_vocab_and_dtype(tmp_path):
    prepared = prepared_dir(tmp_path / "p")
    cfg = compose_config(["data=tokens", f"data.path={prepared}"])
    schema.validate(cfg)
    assert (cfg.data.vocab_size, cfg.data.dtype.value) == (300, "uint16")
    same = compose_config(["data=tokens", f"data.path={prepared}", "data.vocab_size=300"])
    schema.validate(same)  # a value that agrees is fine
    cases = [
        (["data.vocab_size=512"], "data.vocab_size=512: contradicts"),
        (["data.dtype=uint32"], "data.dtype=uint32: contradicts"),
    ]
    token_file = tmp_path / "flat.bin"
    token_file.write_bytes(bytes(1024))  # as uint8: 1024 tokens, a sample of 512 + 1
    cases += [
        ([f"data.path={token_file}"], "eval.every=50: data.path="),
        ([f"data.path={token_file}", "eval.every=0"], "data.vocab_size=None: needed"),
        ([f"data.path={tmp_path}"], "a directory without meta.json"),
        ([f"data.path={prepared_dir(tmp_path / 'noval', val_tokens=0)}"], "no validation tokens"),
    ]
    for extra, expected in cases:
        with pytest.raises(schema.ConfigError, match=re.escape(expected)):
            schema.validate(compose_config(["data=tokens", f"data.path={prepared}", *extra]))
    flat = ["data=tokens", f"data.path={token_file}", "eval.every=0", "data.dtype=uint8"]
    schema.validate(compose_config([*flat, "data.vocab_size=256"]))  # one file: the keys say it all


def test_validate_checks_the_token_file_sizes(tmp_path):
    """The token stream's length and element size, from file sizes, before any rank starts."""
    from recipes.data import write_tokens

    path = write_tokens(tmp_path / "tok.bin", np.arange(100, dtype=np.uint16))
    args = ["data=tokens", f"data.path={path}", "data.vocab_size=256", "eval.every=0"]
    args += ["data.dtype=uint16"]  # one token file: its keys are given, not read from meta.json
    schema.validate(compose_config([*args, "data.seq_len=99"]))  # 99 + 1 tokens: one sample
    with pytest.raises(schema.ConfigError, match=r"data.seq_len=100: .* holds 100"):
        schema.validate(compose_config([*args, "data.seq_len=100"]))
    with pytest.raises(schema.ConfigError, match=r"data.dtype=uint8: .*written as uint16"):
        schema.validate(compose_config([*args, "data.dtype=uint8", "data.seq_len=8"]))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 9)
    with pytest.raises(schema.ConfigError, match=r"data.dtype=uint16: .*9 bytes, not whole 2-byte"):
        schema.validate(compose_config([*args, f"data.path={odd}", "data.seq_len=2"]))
    (tmp_path / "src").mkdir()
    with pytest.raises(schema.ConfigError, match=r"data.path=.*src: no .py files"):
        schema.validate(compose_config([f"data.path={tmp_path / 'src'}"]))
    (tmp_path / "src" / "a.py").write_bytes(b"x" * 10)
    with pytest.raises(schema.ConfigError, match=r"data.seq_len=10: .* holds 10"):
        schema.validate(compose_config([f"data.path={tmp_path / 'src'}", "data.seq_len=10"]))


def test_training_objective_knobs_reach_the_model():
    """train.indexer_training picks the model's indexer mode; train.mtp_loss_weight defaults
    to DeepSeek-V3's 0.3; MLA fields and lists pass through model.overrides."""
    from recipes.build import model_config

    cfg = compose_config(
        ["model=mla_tiny", "train.indexer_training=frozen", "checkpoint.export_hf=0"]
    )
    schema.validate(cfg)
    assert model_config(cfg).indexer_training == "frozen"
    assert cfg.train.mtp_loss_weight == 0.3
    cfg = compose_config(
        [
            "model=mla_tiny",
            "+model.overrides.indexer_types=[full,full,shared]",
            "checkpoint.export_hf=false",
        ]
    )
    schema.validate(cfg)
    config = model_config(cfg)
    assert config.indexer_training == "kl" and config.indexer_types == ["full", "full", "shared"]
    assert type(config.indexer_types) is list


def test_validate_checks_the_launcher_world():
    with pytest.raises(schema.ConfigError, match="WORLD_SIZE=8"):
        schema.validate(compose_config([]), env_world_size=8)


def test_every_field_has_help():
    lines = schema.describe()
    strategy = (
        "optim.remainder_strategy = pad_all2all  [agrs, pad_all2all, ragged_all_to_all, auto]"
    )
    assert any(line.startswith(strategy + "  # ") for line in lines)
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


def _override(key: str, value) -> str:
    """`key=value` in Hydra's override grammar (strings quoted, lists bracketed)."""

    def text(v):
        if isinstance(v, list):
            return "[" + ",".join(text(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{text(x)}" for k, x in v.items()) + "}"
        if isinstance(v, bool) or v is None:
            return {True: "true", False: "false", None: "null"}[v]
        return f"'{v}'" if isinstance(v, str) else str(v)

    return f"{key}={text(value)}"


def _leaves(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("optim", schema.OPTIM_SCHEMAS)
def test_every_key_is_in_the_run_dir_name_or_declared_same_run(optim):
    """Every key of the composed config given on the command line: it shows in the run
    directory's name (Hydra's override_dirname) unless the schema declares it `same_run`, and the
    run directory's exclusions are exactly the schema's declarations (no hand list)."""
    base = compose_config([f"optim={optim}"])
    leaves = _leaves(OmegaConf.to_container(base, resolve=True, enum_to_str=True))
    overrides = [f"optim={optim}", *(_override(k, v) for k, v in leaves.items())]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    items = cfg.hydra.job.override_dirname.split(run_dir.ITEM_SEP)  # keys hold no `+` or `-`
    named = {item.split(run_dir.KV_SEP)[0] for item in items}
    declared = set(schema.same_run_keys())
    assert list(cfg.hydra.job.config.override_dirname.exclude_keys) == schema.same_run_keys()
    for key in leaves:
        assert (key in named) != (key in declared), key
    assert "optim" in named  # the optimizer choice changes what is trained
    # Logging and checkpointing never change the weights; the keys that once were missing:
    assert {k for k in leaves if k.split(".")[0] in ("logger", "metrics")} <= declared
    assert {k for k in leaves if k.startswith("checkpoint.")} - declared == {
        "checkpoint.init_from",
        "checkpoint.init_missing_mtp",
    }
    assert {"checkpoint.async_mode", "checkpoint.hf_dtype", "logger.project"} <= declared


def test_run_dir_is_stable_per_command():
    assert schema.run_id("") == "base"
    # Paths in the overrides can pass the file system's 255-byte name limit: a long leaf keeps
    # its start and a hash of the whole (stable, distinct per command).
    long = "+".join(f"model.path-/{'d' * 150}/{k}" for k in "ab")
    leaf = schema.run_id(long)
    assert len(leaf.encode()) <= schema.RUN_ID_MAX and leaf.startswith("model.path-_ddd")
    assert leaf == schema.run_id(long) != schema.run_id(long.replace("/b", "/c"))
    assert schema.run_id("data.path-/a/b+optim.lr-0.1") == "data.path-_a_b+optim.lr-0.1"


def test_run_dir_passes_back_as_an_override_value():
    """Names hold no `=` or `,` (Hydra's separators, conf/train.yaml sets `-` and `+`): a run's
    directory is a valid unquoted override value; quoted values, lists and paths that hold
    the old separators map to `_`. The summary's reuse command reads back as the same path."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from recipes.config import reuse_export_command

    dirname = OmegaConf.load(ROOT / "conf" / "train.yaml").hydra.job.config.override_dirname
    assert (dirname.kv_sep, dirname.item_sep) == (run_dir.KV_SEP, run_dir.ITEM_SEP) == ("-", "+")
    quoted = "checkpoint.init_from-'out/model=mla_tiny,x'+optim.betas-[0.9,0.95]+train.steps-20"
    leaf = schema.run_id(quoted)
    assert leaf == "checkpoint.init_from-out_model_mla_tiny_x+optim.betas-_0.9_0.95_+train.steps-20"
    parser = OverridesParser.create()
    path = f"outputs/default/{leaf}/hf"
    assert parser.parse_override(f"model.path={path}").value() == path
    for hf in (Path(path), Path("/tmp/a b/x=1,2/it's/hf")):
        words = shlex.split(reuse_export_command(hf))
        assert words[0] == "model=hf" and len(words) == 3
        for word, key in zip(words[1:], ("model.path", "checkpoint.init_from"), strict=True):
            override = parser.parse_override(word)
            assert override.key_or_group == key
            assert Path(override.value()).resolve() == hf.resolve()


def test_choice_lists_are_the_libraries_own():
    """The config enums list muon's and models' own constants, in their order (the schema
    spells them out: importing those packages imports torch, which the config must not)."""
    from models.glm.model.config import DSA_IMPLS
    from models.glm.model.presets import PRESET_NAMES
    from muon.coefficients import NS_COEFFICIENTS
    from muon.cost import NS_ALGORITHMS
    from muon.groups import ROUTER_CHOICES
    from muon.optimizer import ADJUST_LR, NS_DTYPES
    from muon.plan import REMAINDER_CHOICES

    pairs = [
        (schema.RemainderStrategy, REMAINDER_CHOICES),
        (schema.NsDtype, NS_DTYPES),
        (schema.NsCoefficients, tuple(NS_COEFFICIENTS)),
        (schema.NsAlgorithm, NS_ALGORITHMS),
        (schema.RouterOptim, ROUTER_CHOICES),
        (schema.AdjustLr, ADJUST_LR),
        (schema.ModelPreset, (*PRESET_NAMES, "hf")),  # hf: a transformers directory
        (schema.DsaImpl, DSA_IMPLS),
    ]
    for enum, values in pairs:
        assert tuple(e.value for e in enum) == tuple(values), enum.__name__


def test_muon_defaults_are_written_once_in_muon_options():
    """muon.options.MuonOptions is the one place of Muon's defaults: Muon.__init__'s keywords
    are its fields with its values, the composed `optim=muon` node (schema + conf/optim/muon.yaml)
    holds the same values under their config names, and build_optimizer hands every configured
    field to Muon from the key of its name (a field added to MuonOptions without a key, or a key
    whose default drifts, fails here)."""
    import inspect

    from muon import Muon
    from muon.options import DEFAULTS, OPTION_NAMES
    from recipes.build import MUON_RENAMED, MUON_UNCONFIGURED, muon_options

    signature = inspect.signature(Muon.__init__).parameters
    keywords = [k for k in signature if k not in ("self", "params", "link")]
    assert sorted(keywords) == sorted(OPTION_NAMES)
    assert {k: signature[k].default for k in keywords} == dataclasses.asdict(DEFAULTS)
    expected = {k: v for k, v in dataclasses.asdict(DEFAULTS).items() if k not in MUON_UNCONFIGURED}
    assert muon_options(compose_config([]).optim) == expected
    node = compose_config([]).optim
    for name in expected:
        key = MUON_RENAMED.get(name, name)
        assert key in node, f"MuonOptions.{name} has no optim.{key}"
    assert node.memory_budget_gib is None and DEFAULTS.memory_budget is None
    adamw = compose_config(["optim=adamw"]).optim  # the baseline: the AdamW groups' defaults
    assert (adamw.lr, list(adamw.betas), adamw.eps) == (
        DEFAULTS.adamw_lr,
        list(DEFAULTS.betas),
        DEFAULTS.adamw_eps,
    )
    # a changed key reaches Muon under Muon's name, converted
    changed = compose_config(
        ["optim.memory_budget_gib=0.5", "optim.eps=1e-6", "optim.momentum=0.9"]
    )
    kwargs = muon_options(changed.optim)
    assert (kwargs["memory_budget"], kwargs["adamw_eps"], kwargs["momentum"]) == (
        1 << 29,
        1e-6,
        0.9,
    )


def test_adjust_lr_none_reaches_the_optimizer():
    """`optim.adjust_lr=none` (muon.Muon's unscaled update) composes and lands in every group."""
    from models.glm import GLMForCausalLM, get_preset
    from recipes.build import build_optimizer

    opt = build_optimizer(
        compose_config(["optim.adjust_lr=none"]).optim, GLMForCausalLM(get_preset("tiny"))
    )
    muon_groups = [g for g in opt.param_groups if g.get("algorithm") == "muon"]
    assert muon_groups and all(g["adjust_lr"] == "none" for g in muon_groups)


def test_newton_schulz_knobs_reach_the_optimizer():
    """optim.ns_coefficients / optim.ns_algorithm land in every Muon group (single process)."""
    from models.glm import GLMForCausalLM, get_preset
    from recipes.build import build_optimizer

    cfg = compose_config(["optim.ns_coefficients=fixed", "optim.ns_algorithm=standard"])
    cfg.optim.normuon, cfg.optim.normuon_beta2 = True, 0.9
    opt = build_optimizer(cfg.optim, GLMForCausalLM(get_preset("tiny")))
    muon = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    assert muon and all(
        (g["ns_coefficients"], g["ns_algorithm"], g["normuon"], g["normuon_beta2"])
        == ("fixed", "standard", True, 0.9)
        for g in muon
    )
    assert all("normuon_v" in opt.state[p] for g in muon for p in g["params"])
    default = build_optimizer(compose_config([]).optim, GLMForCausalLM(get_preset("tiny")))
    assert {
        (g["ns_coefficients"], g["ns_algorithm"])
        for g in default.param_groups
        if g["algorithm"] == "muon"
    } == {("polar_express", "auto")}


def test_attention_knobs_reach_the_model_and_optimizer():
    """metrics.attn_max_logit / optim.qk_clip_tau decide the recording; optim.muon_split which
    projections are split (auto: MLA only)."""
    from models.glm import GLMForCausalLM, get_preset
    from recipes.build import build_optimizer, muon_split_on, records_max_logits

    assert records_max_logits(compose_config([]))
    assert not records_max_logits(compose_config(["metrics.attn_max_logit=false"]))
    assert records_max_logits(
        compose_config(["metrics.attn_max_logit=false", "optim.qk_clip_tau=50"])
    )
    gqa, mla = GLMForCausalLM(get_preset("tiny")), GLMForCausalLM(get_preset("mla_tiny"))
    assert not muon_split_on("auto", gqa) and muon_split_on("auto", mla)
    assert muon_split_on("on", gqa) and not muon_split_on("off", mla)
    opt = build_optimizer(compose_config(["optim.muon_split=on"]).optim, gqa)
    split = {n for g in opt.param_groups if g.get("num_blocks", 1) > 1 for n in g["param_names"]}
    assert "model.layers.0.self_attn.q_proj.weight" in split
    unsplit = build_optimizer(compose_config([]).optim, gqa)
    assert not any(
        "self_attn" in n
        for g in unsplit.param_groups
        if g.get("num_blocks", 1) > 1
        for n in g["param_names"]
    )


def test_dsa_impl_defaults_to_the_sparse_path_and_overrides_to_masked():
    """`python train.py model=mla_tiny` builds the sparse (latent) DSA path; the masked
    reference is `model.dsa_impl=masked` (a typed key; the GLMConfig field through
    `+model.overrides.dsa_impl` too); a path other than latent on a model without DSA is
    refused, naming the field."""
    from recipes.build import model_config

    assert model_config(compose_config(["model=mla_tiny"])).dsa_impl == "latent"
    for key in ("model.dsa_impl", "+model.overrides.dsa_impl"):
        masked = compose_config(["model=mla_tiny", f"{key}=per_head"])
        assert model_config(masked).dsa_impl == "per_head"
    with pytest.raises(ValueError, match="a path other than the default 'latent' needs DSA"):
        model_config(compose_config(["model=tiny", "model.dsa_impl=masked"]))


@pytest.mark.parametrize("key", ["+train.no_such_key", "+optim.no_such_key", "+no_such_key"])
def test_an_appended_unknown_key_is_refused_before_the_ranks(key):
    """Hydra's `+` appends to any node: the config composed, and every rank's `from_yaml`
    then failed on the unknown key."""
    cfg = compose_config([f"{key}=1"])
    with pytest.raises(schema.ConfigError, match=re.escape(f"{key[1:]}=1: not in the schema")):
        schema.validate(cfg)


@pytest.mark.parametrize("value", ["2", "yes", "1"])
def test_a_bool_key_takes_true_or_false_only(value):
    """OmegaConf turns `checkpoint.async_mode=2` (or `yes`) into True without a word."""
    overrides = [f"checkpoint.async_mode={value}"]
    cfg = compose_config(overrides)
    with pytest.raises(schema.ConfigError, match="checkpoint.async_mode=.*must be true or false"):
        schema.validate(cfg, overrides=overrides)
    schema.validate(
        compose_config(["checkpoint.async_mode=true"]), overrides=["checkpoint.async_mode=true"]
    )


def test_unknown_keys_fail_naming_the_nearest_real_one():
    """With or without `+`, on the command line (before Hydra composes) and in a composed
    config (what `+key=` added): one ConfigError naming the key and the closest real key."""
    for args, message in [
        (
            ["train.step=5"],
            "train.step: unknown key, with or without '+'; did you mean train.steps?",
        ),
        (["+train.step=5"], "did you mean train.steps?"),
        (["-m", "optim.remainder_stratgy=agrs,auto"], "did you mean optim.remainder_strategy?"),
        (["modle=tiny"], "did you mean model?"),
    ]:
        with pytest.raises(schema.ConfigError, match=re.escape(message)):
            schema.check_command_line(args)
    fine = ["-m", "model=mla_tiny", "hydra/launcher=slurm", "hydra.launcher.nodes=2", "--cfg"]
    schema.check_command_line([*fine, "job", "optim.lr=1,2", "+model.overrides.num_mtp_layers=0"])
    with pytest.raises(schema.ConfigError, match=re.escape("did you mean train.steps?")):
        schema.validate(compose_config(["+train.step=5"]))
    with pytest.raises(schema.ConfigError, match="optim.ns_steps=3: a key of optim=muon; "):
        schema.validate(compose_config(["optim=adamw", "+optim.ns_steps=3"]))
    with pytest.raises(schema.ConfigError, match="optim.ns_stpes=3: not in the schema"):
        schema.validate(compose_config(["optim=adamw", "+optim.ns_stpes=3"]))
