"""Import and export that never drop a key: token ids round-trip, every config.json key is
mapped or harmless (transformers' own configs import), a key that changes the math is an
error naming it, as are a missing model_type and non-float weight tensors; a model with
several MTP depths on one layer exports that one layer."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.glm import get_preset
from models.glm.hf.adapter import INDEX, export_hf
from models.glm.hf.config import config_from_hf, config_to_hf
from models.glm.hf.load import HFDir, import_hf


def _export(tmp_path, config):
    from models.glm import GLMForCausalLM

    model = GLMForCausalLM(config)
    model.init_weights(0)
    export_hf(model, config, str(tmp_path))
    return model


def test_token_ids_round_trip(tmp_path):
    config = get_preset("mla_tiny", bos_token_id=3, eos_token_id=[5, 7], pad_token_id=9)
    _export(tmp_path, config)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (3, [5, 7], 9)
    assert HFDir(tmp_path).config == config
    glm52 = config_to_hf(get_preset("glm52"))
    assert (glm52["eos_token_id"], glm52["pad_token_id"]) == ([154820, 154827, 154829], 154820)
    # Absent ids mean transformers' defaults of the model type (GlmMoeDsaConfig: 0, 1, None).
    hf = config_to_hf(get_preset("glm5"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        del hf[key]
    assert (config_from_hf(hf).bos_token_id, config_from_hf(hf).eos_token_id) == (0, 1)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        get_preset("tiny", eos_token_id=[1, -2])


def test_transformers_configs_import_with_every_key_known():
    """transformers' own config.json of both model types (every key it writes) imports."""
    transformers = pytest.importorskip("transformers")
    for cls, kw in (
        (transformers.GlmMoeDsaConfig, dict(index_topk_freq=4, index_skip_topk_offset=3)),
        (transformers.Glm4MoeConfig, dict(head_dim=128)),  # GLM-4.5-Air sets it
    ):
        hf = json.loads(cls(**kw).to_json_string(use_diff=False))
        config = config_from_hf(hf)
        assert config.num_hidden_layers == hf["num_hidden_layers"]
    dsa = json.loads(
        transformers.GlmMoeDsaConfig(index_topk_freq=4, index_skip_topk_offset=3).to_json_string(
            use_diff=False
        )
    )
    assert config_from_hf(dsa).indexer_types == get_preset("glm52").indexer_types
    # GLM-5.2's IndexShare keys without indexer_types map to the same schedule.
    ours = config_to_hf(get_preset("glm52"))
    del ours["indexer_types"]
    ours.update(index_topk_freq=4, index_skip_topk_offset=3, index_share_for_mtp_iteration=True)
    assert config_from_hf(ours) == get_preset("glm52")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("some_new_switch", 1, r"keys this importer does not know: \['some_new_switch'\]"),
        ("scoring_func", "softmax", "scoring_func must be 'sigmoid'"),
        ("indexer_rope_interleave", False, "indexer_rope_interleave must be true"),
        ("rope_interleave", False, "rope_interleave must be true"),
        ("auto_map", {"AutoModel": "modeling_x.X"}, "auto_map .* remote modeling code"),
        ("topk_method", "greedy", "topk_method must be 'noaux_tc'"),
        ("attention_dropout", 0.1, "attention_dropout must be 0"),
        ("moe_layer_freq", 2, "moe_layer_freq must be 1"),
        ("quantization_config", {"quant_method": "awq"}, "quant_method='awq'"),
    ],
)
def test_keys_that_change_the_math_are_errors_naming_them(key, value, message):
    hf = config_to_hf(get_preset("mla_tiny"))
    config_from_hf(hf)  # the export itself imports
    with pytest.raises(ValueError, match=message):
        config_from_hf({**hf, key: value})


def test_missing_model_type_is_an_error():
    hf = config_to_hf(get_preset("tiny"))
    del hf["model_type"]
    with pytest.raises(ValueError, match="config.json has no model_type"):
        config_from_hf(hf)


def test_integer_weight_tensors_are_refused_by_name(tmp_path):
    _export(tmp_path, get_preset("tiny", num_mtp_layers=0))
    tensors = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (tmp_path / INDEX).unlink()
    name = "model.layers.0.mlp.gate_proj.weight"
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"not floating point \(\['I32'\].*{name}"):
        import_hf(tmp_path)


def test_mtp_depths_on_one_layer_export_that_layer(tmp_path):
    config = get_preset("mla_tiny", mtp_depths=3)
    model = _export(tmp_path, config)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 1
    names = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    layers = {int(k.split(".")[2]) for k in names if k.startswith("model.layers.")}
    assert layers == {0, 1, 2, 3}  # 3 layers + the one MTP layer
    back, state = import_hf(tmp_path)
    assert back.num_mtp_layers == 1 and back.mtp_depths is None  # a training choice
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k


def test_run_from_files_without_mtp_weights_needs_the_config_key(tmp_path):
    """`checkpoint.init_from` of a directory whose config.json declares an MTP layer it holds
    no weights of: refused before launch, naming checkpoint.init_missing_mtp; allowed with it."""
    from omegaconf import OmegaConf

    from recipes.build import model_config
    from recipes.config import Config, ConfigError, validate

    def cfg(*extra):
        dotlist = [f"checkpoint.init_from={tmp_path}", "model.overrides.num_mtp_layers=1"]
        return OmegaConf.merge(
            OmegaConf.structured(Config), OmegaConf.from_dotlist([*dotlist, *extra])
        )

    config = model_config(cfg())
    _export(tmp_path, config)
    tensors = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    (tmp_path / INDEX).unlink()
    mtp = f"model.layers.{config.num_hidden_layers}."
    kept = {k: v for k, v in tensors.items() if not k.startswith(mtp)}
    assert len(kept) < len(tensors)
    save_file(kept, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="set checkpoint.init_missing_mtp=true"):
        validate(cfg())
    validate(cfg("checkpoint.init_missing_mtp=true"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
        ("attention_bias", "false", "attention_bias must be true or false"),
        ("norm_topk_prob", "false", "norm_topk_prob must be true or false"),
        ("norm_topk_prob", 0, "norm_topk_prob must be true or false"),
        ("index_share_for_mtp_iteration", "true", "index_share_for_mtp_iteration must be true"),
        ("rope_interleave", 1, "rope_interleave must be true or false"),
        ("routed_scaling_factor", True, "routed_scaling_factor must be a number"),
        ("num_nextn_predict_layers", True, "num_nextn_predict_layers must be an integer"),
        ("first_k_dense_replace", 1.0, "first_k_dense_replace must be an integer"),
        ("eos_token_id", "154820", "eos_token_id must be an integer or a list of ints or null"),
        ("indexer_types", "full", "indexer_types must be a list of strings or null"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor must be 1.0 for glm_moe_dsa"),
        ("use_qk_norm", True, "use_qk_norm must be false for glm_moe_dsa"),
    ],
)
def test_config_json_values_of_the_wrong_type_are_refused_by_name(key, value, message):
    """A string where a bool belongs (Python reads "false" as true: the head would be tied to
    the embedding and the file's lm_head dropped), a bool or a float where an int belongs, a
    string where a list belongs (an eos id read digit by digit), a rotary factor the MLA
    attention ignores: each refused, naming the key."""
    hf = json.loads(json.dumps(config_to_hf(get_preset("mla_tiny"))))
    config_from_hf(hf)
    with pytest.raises(ValueError, match=rf"config\.json {message}"):
        config_from_hf({**hf, key: value})
    if key == "partial_rotary_factor":  # transformers 5 keeps it in rope_parameters
        rope = {**hf["rope_parameters"], key: value}
        with pytest.raises(ValueError, match=rf"config\.json {message}"):
            config_from_hf({**hf, "rope_parameters": rope})


def _xtuner_reads(hf_config) -> dict:
    """The attributes InternLM xtuner's `Glm52MoEConfig.from_hf` (xtuner/v1/model/moe/glm52.py
    at b934f4620) reads from transformers' GlmMoeDsaConfig, as it reads them: a plain
    attribute access raises AttributeError when config.json lacks the key; `getattr(..., d)`
    ones have a default there. `index_share_for_mtp_iteration` is read whenever
    `num_nextn_predict_layers` is set (GLM-5.2 MTP requires it true)."""
    plain = [
        "vocab_size",
        "max_position_embeddings",
        "eos_token_id",
        "num_hidden_layers",
        "first_k_dense_replace",
        "hidden_size",
        "intermediate_size",
        "rms_norm_eps",
        "model_type",
        "hidden_act",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "num_attention_heads",
        "attention_bias",
        "attention_dropout",
        "index_topk",
        "index_head_dim",
        "index_n_heads",
        "index_topk_freq",
        "index_skip_topk_offset",
        "indexer_rope_interleave",
        "indexer_types",
        "head_dim",
        "qk_head_dim",
        "tie_word_embeddings",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_group",
        "topk_group",
        "scoring_func",
        "norm_topk_prob",
        "routed_scaling_factor",
        "mlp_layer_types",
        "rope_parameters",
    ]
    out = {name: getattr(hf_config, name) for name in plain}
    out["pad_token_id"] = getattr(hf_config, "pad_token_id", None)
    out["num_nextn_predict_layers"] = getattr(hf_config, "num_nextn_predict_layers", 0)
    if out["num_nextn_predict_layers"]:
        out["index_share_for_mtp_iteration"] = hf_config.index_share_for_mtp_iteration
    return out


def test_xtuner_reads_the_glm_moe_dsa_export(tmp_path):
    """An export read back the way xtuner's GLM-5.2 loader reads it (transformers'
    from_pretrained, then its attribute reads): every attribute exists and says what our
    model computes, the IndexShare schedule and the MTP top-k reuse included."""
    transformers = pytest.importorskip("transformers")
    config = get_preset("mla_tiny", index_share_for_mtp_iteration=True, pad_token_id=7)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(config)))
    reads = _xtuner_reads(transformers.GlmMoeDsaConfig.from_pretrained(tmp_path))
    assert reads["index_share_for_mtp_iteration"] is True
    assert reads["num_nextn_predict_layers"] == config.num_mtp_layers == 1
    assert reads["indexer_types"] == config.indexer_types == ["full", "shared", "full"]
    assert (reads["index_topk_freq"], reads["index_skip_topk_offset"]) == (2, 1)
    assert reads["qk_head_dim"] == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert reads["pad_token_id"] == 7 and reads["scoring_func"] == "sigmoid"


def test_an_xtuner_config_json_round_trips_every_key(tmp_path):
    """The config.json xtuner's `Glm52MoEConfig.hf_config` writes (its keyword arguments, at
    GLM-5.2's settings on a 5-layer model, saved by transformers) -> our GLMConfig -> our
    export: every key comes back with its value, but `transformers_version` (the writer's)."""
    transformers = pytest.importorskip("transformers")
    xtuner_kwargs = dict(
        architectures=["GlmMoeDsaForCausalLM"],
        vocab_size=256,
        max_position_embeddings=1024,
        pad_token_id=200,
        eos_token_id=[200, 201, 202],
        num_hidden_layers=5,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        mlp_layer_types=None,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"},
        rope_interleave=True,
        hidden_act="silu",
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        qk_head_dim=24,
        v_head_dim=16,
        attention_bias=False,
        attention_dropout=0.0,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",
        tie_word_embeddings=False,
        ep_size=1,
        pretraining_tp=1,
        index_topk=16,
        index_head_dim=16,
        index_n_heads=4,
        index_topk_freq=4,
        index_topk_pattern=None,
        index_skip_topk_offset=3,
        index_share_for_mtp_iteration=True,
        indexer_rope_interleave=True,
        indexer_types=None,
        num_nextn_predict_layers=1,
        dtype=torch.bfloat16,
    )
    transformers.GlmMoeDsaConfig(**xtuner_kwargs).save_pretrained(tmp_path)
    given = json.loads((tmp_path / "config.json").read_text())
    assert {"index_share_for_mtp_iteration", "index_topk_freq", "layer_types"} <= set(given)
    config = config_from_hf(given)
    assert config.indexer_types == ["full", "full", "full", "shared", "shared"]
    written = config_to_hf(config, dtype=torch.bfloat16)
    assert set(given) - set(written) == {"transformers_version"}
    differ = {k: (v, written[k]) for k, v in given.items() if k in written and written[k] != v}
    assert not differ, differ
