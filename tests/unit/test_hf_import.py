"""Import of transformers directories beyond the plain layout: block-wise fp8 checkpoints
(dequantized, each read cut at any row), other quantizations refused, MTP layers absent from the
files (an error unless initialized on request, then reported), tensors the model has no place
for, and `model=hf model.path`."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.glm import GLMConfig, GLMForCausalLM
from models.glm.hf.adapter import INDEX, export_hf
from models.glm.hf.load import import_hf, load_hf

CFG = GLMConfig(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_hidden_layers=2,
    n_dense_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    num_mtp_layers=1,
)
BLOCK = (3, 5)  # blocks that tile neither the rows nor the columns of any matrix here


def _model(cfg: GLMConfig = CFG) -> GLMForCausalLM:
    model = GLMForCausalLM(cfg)
    model.init_weights(0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rewrite(path, tensors: dict[str, torch.Tensor], **config_changes) -> None:
    for old in [*path.glob("*.safetensors"), path / INDEX]:
        old.unlink(missing_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    hf.update(config_changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))


def _quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style block quantization: scale_inv = amax / 448 per block (e4m3's max)."""
    bn, bk = block
    rows, cols = w.shape
    scale = torch.empty(-(-rows // bn), -(-cols // bk))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / scale[i, j]).to(q.dtype)
    return q, scale


def _dequantized(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """The reference: every element times the scale of its block, one block at a time."""
    bn, bk = block
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale[i, j]
    return out


def _fp8_dir(tmp_path):
    """Our export rewritten as a GLM-5-FP8-style release: every 2-D matrix except the
    embedding, the head and the router is fp8 with its block scale."""
    model = _model()
    export_hf(model, CFG, str(tmp_path))
    plain = _tensors(tmp_path)
    files, want = {}, {}
    for name, w in plain.items():
        skip = ("embed_tokens", "lm_head", "mlp.gate.")
        if w.ndim == 2 and not any(s in name for s in skip):
            q, s = _quantize(w)
            files[name], files[name + "_scale_inv"] = q, s
            want[name] = _dequantized(q, s)
        else:
            files[name] = want[name] = w
    qc = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
    _rewrite(tmp_path, files, quantization_config=qc)
    return plain, want, files


@pytest.mark.parametrize("chunk_elems", [None, 7])  # 7: reads of one row, mid-block
def test_fp8_block_checkpoint_loads_dequantized(tmp_path, chunk_elems):
    plain, want, _ = _fp8_dir(tmp_path)
    model = GLMForCausalLM(CFG)
    assert load_hf(model, tmp_path, chunk_elems=chunk_elems) == []
    export_hf(model, CFG, str(tmp_path / "back"))  # our weights in the checkpoint's names
    got = _tensors(tmp_path / "back")
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name
        # Near the original: e4m3 keeps 3 mantissa bits (rounding error <= 2^-4 relative) and
        # its subnormals (below 2^-6 x scale) are spaced 2^-9 x scale, scale = amax / 448; so
        # every element is within 2^-4 x its block's amax, hence of the tensor's.
        amax = plain[name].abs().max()
        assert (got[name] - plain[name]).abs().max() <= amax * 2**-4, name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], plain[q])  # the fp8 values were really dequantized


def test_fp8_refusals_name_the_format(tmp_path):
    _, _, files = _fp8_dir(tmp_path)
    qc = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        (dict(quantization_config={"quant_method": "compressed-tensors"}), files),
        (dict(quantization_config={**qc, "activation_scheme": "static"}), files),
        (dict(quantization_config=None), files),  # raw fp8: the silent 448-for-0.07 case
        ({}, {k: v for k, v in files.items() if k != q + "_scale_inv"}),
        ({}, {**files, q + "_scale_inv": torch.ones(1, 1)}),
    ]
    messages = [
        "quant_method='compressed-tensors'.*only block-wise fp8",
        "activation_scheme 'static'",
        "stored as fp8.*no quantization_config",
        rf"missing tensors: \['{q}_scale_inv'\]",
        rf"{q}_scale_inv: \(1, 1\) in the files",
    ]
    for (changes, tensors), message in zip(cases, messages, strict=True):
        _rewrite(tmp_path, tensors, **{"quantization_config": qc, **changes})
        with pytest.raises(ValueError, match=message):
            import_hf(tmp_path)


def test_missing_mtp_layer_is_an_error_unless_initialized(tmp_path):
    model = _model()
    export_hf(model, CFG, str(tmp_path))
    tensors = _tensors(tmp_path)
    mtp = sorted(k for k in tensors if k.startswith("model.layers.2."))
    main = {k: v for k, v in tensors.items() if k not in mtp}
    _rewrite(tmp_path, main)
    fresh = GLMForCausalLM(CFG)
    fresh.init_weights(5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"model.layers.2'\].*set init_missing_mtp=True"):
        load_hf(fresh, tmp_path)
    reported = load_hf(fresh, tmp_path, init_missing_mtp=True)
    assert sorted(reported) == mtp
    for key, value in fresh.state_dict().items():
        if key.startswith("model.mtp_layers."):
            assert torch.equal(value, before[key]), key  # kept its seeded init
        else:
            assert torch.equal(value, model.state_dict()[key]), key
    # Half an MTP layer is a broken file, not an absent layer.
    _rewrite(tmp_path, {**main, mtp[0]: tensors[mtp[0]]})
    with pytest.raises(ValueError, match="missing tensors"):
        load_hf(GLMForCausalLM(CFG), tmp_path, init_missing_mtp=True)
    # The public checkpoints' MTP copies of the embedding and head are accepted (ours shares
    # the model's); any other tensor the model has no place for is an error naming it.
    copies = {
        "model.layers.2.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        "model.layers.2.shared_head.head.weight": tensors["lm_head.weight"].clone(),
    }
    _rewrite(tmp_path, {**tensors, **copies})
    assert load_hf(GLMForCausalLM(CFG), tmp_path) == []
    _rewrite(tmp_path, {**tensors, "model.layers.0.self_attn.extra.weight": torch.ones(2)})
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.0.self_attn.extra"):
        load_hf(GLMForCausalLM(CFG), tmp_path)


def test_model_hf_builds_the_directory_config(tmp_path):
    """`model=hf model.path=DIR`: the model of DIR's config.json (with overrides), its
    vocabulary kept; a missing or stray path and a data vocabulary that does not fit are
    errors naming the key."""
    from omegaconf import OmegaConf

    from recipes.build import model_config
    from recipes.config import Config, ConfigError, validate

    cfg_hf = GLMConfig(**{**CFG.to_dict(), "vocab_size": 300})
    export_hf(_model(cfg_hf), cfg_hf, str(tmp_path))

    def cfg(*dotlist):
        base = OmegaConf.structured(Config)
        return OmegaConf.merge(
            base, OmegaConf.from_dotlist(["checkpoint.export_hf=false", *dotlist])
        )

    run = cfg("model.preset=hf", f"model.path={tmp_path}")
    validate(run)
    assert model_config(run) == cfg_hf  # vocab 300 from the files, data.vocab_size 256 fits
    more = cfg("model.preset=hf", f"model.path={tmp_path}", "model.overrides.num_mtp_layers=0")
    assert model_config(more).num_mtp_layers == 0
    validate(cfg("model.preset=hf", f"model.path={tmp_path}", f"checkpoint.init_from={tmp_path}"))
    with pytest.raises(ConfigError, match="model.path=None: model=hf needs"):
        validate(cfg("model.preset=hf"))
    with pytest.raises(ConfigError, match="model.path=.*no config.json"):
        validate(cfg("model.preset=hf", f"model.path={tmp_path / 'nope'}"))
    with pytest.raises(ConfigError, match="model.path=.*read by model=hf only"):
        validate(cfg(f"model.path={tmp_path}"))
    with pytest.raises(ConfigError, match=r"data.vocab_size=512: .*<= 300"):
        validate(
            cfg(
                "model.preset=hf",
                f"model.path={tmp_path}",
                "data.vocab_size=512",
                "data.dtype=uint16",
            )
        )
    # A preset that disagrees with the files fails naming every differing field.
    with pytest.raises(ConfigError, match=r"hidden_size: run 64, files 16.*model=hf model.path"):
        validate(
            cfg(f"checkpoint.init_from={tmp_path}", "data.vocab_size=300", "data.dtype=uint16")
        )


def test_glm_moe_dsa_config_mapping():
    """glm_moe_dsa config.json <-> attention='mla': exact round trips of the MLA presets, the
    indexer pattern derived as transformers derives it, yarn scaling, and refusals naming the
    key for what our model cannot compute."""
    from models.glm import get_preset
    from models.glm.hf.config import config_from_hf, config_to_hf

    for name in ("mla_tiny", "glm5", "glm52"):
        config = get_preset(name)
        hf = config_to_hf(config)
        assert hf["model_type"] == "glm_moe_dsa" and hf["head_dim"] == config.qk_rope_head_dim
        assert config_from_hf(json.loads(json.dumps(hf))) == config
    hf = config_to_hf(get_preset("mla_tiny", indexer_types=["full", "shared", "shared"]))
    del hf["indexer_types"], hf["layer_types"]  # per layer: 3 entries
    hf.update(index_topk_freq=2, index_skip_topk_offset=1, num_hidden_layers=5)
    hf["mlp_layer_types"] = ["dense"] + ["sparse"] * 4
    transformers = pytest.importorskip("transformers")
    theirs = transformers.GlmMoeDsaConfig(**hf).indexer_types
    assert config_from_hf(hf).indexer_types == theirs and "shared" in theirs
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    hf["rope_parameters"] = {**yarn, "rope_theta": 5e4}
    ours = config_from_hf(hf)
    assert ours.rope_scaling == yarn and ours.rope_theta == 5e4
    assert config_to_hf(ours)["rope_parameters"] == {**yarn, "rope_theta": 5e4}
    for key, value, message in (
        ("hidden_act", "gelu", "hidden_act must be 'silu'"),
        ("mlp_bias", True, "mlp_bias must be false"),
        ("mlp_layer_types", ["sparse", "dense"] + ["sparse"] * 3, "only the first layers"),
        ("model_type", "deepseek_v3", "model_type must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            config_from_hf({**hf, key: value})
    dense = dict(index_topk=None, index_n_heads=None, index_head_dim=None, indexer_types=None)
    with pytest.raises(ValueError, match="index_topk is None"):
        config_to_hf(get_preset("mla_tiny", **dense))


def test_bf16_glm_moe_dsa_export_keeps_fp32_modules(tmp_path):
    """A bf16 export keeps what transformers keeps in float32 (the router, the indexer's head
    weights) and rounds the rest; shared DSA layers have no indexer tensors, as in GLM-5."""
    from models.glm import get_preset

    config = get_preset("mla_tiny")
    export_hf(_model(config), config, str(tmp_path), dtype=torch.bfloat16)
    files = _tensors(tmp_path)
    assert files["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert files["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert files["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("model.layers.1.self_attn.indexer.") for k in files)
    assert any(k.startswith("model.layers.3.self_attn.indexer.") for k in files)  # MTP: own
