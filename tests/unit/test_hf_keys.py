"""Import and export that never drop a key: token ids round-trip, every config.json key is
mapped or harmless (transformers' own configs import), a key that changes the math is an
error naming it, as are a missing model_type and non-float weight tensors; a model with
several MTP depths on one layer exports that one layer."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.glm import get_preset
from models.glm.hf_adapter import INDEX, export_hf
from models.glm.hf_config import config_from_hf, config_to_hf
from models.glm.hf_import import HFDir, import_hf


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

    from recipes.config import Config, ConfigError, validate
    from recipes.parallel import model_config

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
