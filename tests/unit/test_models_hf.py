"""Hugging Face adapter: exact round trip, the transformers Glm4Moe key layout and config fields,
multi-file export split by size, fused 3-D import, and the checks before a run starts. Parity
with transformers itself on a 4-rank mesh: test_models_hf_transformers.py."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.glm import GLMConfig, GLMForCausalLM
from models.glm.hf.adapter import INDEX, export_hf
from models.glm.hf.load import import_hf

ROOT = Path(__file__).resolve().parents[2]

CFG = GLMConfig(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_hidden_layers=3,
    n_dense_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=6,
    partial_rotary_factor=2 / 3,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=2.5,
    rope_theta=5000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.03,
    max_position_embeddings=512,
    num_mtp_layers=1,
)


def _model(cfg: GLMConfig) -> GLMForCausalLM:
    model = GLMForCausalLM(cfg)
    model.init_weights(0)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for r in model.routers():
            r.e_score_correction_bias.normal_()
    return model


def _expected_hf_shapes(c: GLMConfig) -> dict[str, tuple]:
    """transformers' Glm4Moe state-dict shapes (fused 3-D experts in memory, per-expert 2-D
    keys on disk), written out for config c (MTP layer as layer N)."""
    V, H, nh, nkv, hd = (
        c.vocab_size,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim_resolved,
    )
    F, I, E, S = c.intermediate_size, c.moe_intermediate_size, c.n_routed_experts, 0
    S = I * c.n_shared_experts
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for L in range(c.num_hidden_layers + c.num_mtp_layers):
        p = f"model.layers.{L}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (nh * hd, H),
                p + "self_attn.k_proj.weight": (nkv * hd, H),
                p + "self_attn.v_proj.weight": (nkv * hd, H),
                p + "self_attn.o_proj.weight": (H, nh * hd),
            }
        )
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (nh * hd,)
            shapes[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            shapes[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        if c.use_qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        if c.n_dense_layers > L:
            shapes[p + "mlp.gate_proj.weight"] = (F, H)
            shapes[p + "mlp.up_proj.weight"] = (F, H)
            shapes[p + "mlp.down_proj.weight"] = (H, F)
            continue
        shapes[p + "mlp.gate.weight"] = (E, H)
        shapes[p + "mlp.gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (I, H)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (H, I)
        shapes[p + "mlp.shared_experts.gate_proj.weight"] = (S, H)
        shapes[p + "mlp.shared_experts.up_proj.weight"] = (S, H)
        shapes[p + "mlp.shared_experts.down_proj.weight"] = (H, S)
        if c.num_hidden_layers <= L:  # the MTP layer's extra weights (public GLM checkpoints)
            shapes[p + "enorm.weight"] = (H,)
            shapes[p + "hnorm.weight"] = (H,)
            shapes[p + "eh_proj.weight"] = (H, 2 * H)
            shapes[p + "shared_head.norm.weight"] = (H,)
    return shapes


def _read_dir(path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported directory, through its index (the safetensors library)."""
    index = json.loads((path / INDEX).read_text())
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(path / name)))
    assert set(out) == set(index["weight_map"])
    return out


def _write_single(path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace a directory's weights by one `model.safetensors` (transformers' small layout)."""
    for old in [*path.glob("*.safetensors"), path / INDEX]:
        old.unlink(missing_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("tied", [False, True])
def test_export_layout_and_exact_round_trip(tmp_path, tied):
    head_dim = None if tied else CFG.head_dim  # None: derived from hidden / heads (4)
    cfg = GLMConfig(**{**CFG.to_dict(), "tie_word_embeddings": tied, "head_dim": head_dim})
    model = _model(cfg)
    # Files of at most 4 KiB: several files, each tensor whole in one of them.
    written = export_hf(model, cfg, str(tmp_path), max_shard_bytes=4096)
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(files) > 3 and sorted(written) == sorted(
        [f.name for f in files] + [INDEX, "config.json"]
    )
    n = len(files)
    assert [f.name for f in files] == [
        f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)
    ]
    assert not list(tmp_path.glob(".*"))  # no staging or temporary files left

    # Key names and shapes as transformers writes them; read with the real safetensors library.
    shapes, sizes = {}, {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():  # noqa: SIM118
                shapes[k] = tuple(f.get_slice(k).get_shape())
                sizes[path.name] = sizes.get(path.name, 0) + f.get_tensor(k).nbytes
    assert shapes == _expected_hf_shapes(cfg)
    assert all(v <= 4096 for v in sizes.values())  # no tensor here is larger than 4 KiB
    assert json.loads((tmp_path / INDEX).read_text())["metadata"]["total_size"] == sum(
        sizes.values()
    )
    assert ("lm_head.weight" in shapes) is not tied
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert ("head_dim" in hf_cfg) is not tied

    # Fused weights split as documented: gate rows then up rows per expert.
    on_disk = _read_dir(tmp_path)
    gu = model.model.layers[1].mlp.experts.gate_up_proj.detach().view(4, 16, 16)
    assert torch.equal(on_disk["model.layers.1.mlp.experts.2.gate_proj.weight"], gu[2, :8])
    assert torch.equal(on_disk["model.layers.1.mlp.experts.2.up_proj.weight"], gu[2, 8:])
    dn = model.model.layers[2].mlp.experts.down_proj.detach().view(4, 16, 8)
    assert torch.equal(on_disk["model.layers.2.mlp.experts.3.down_proj.weight"], dn[3])
    mtp_bias = model.model.mtp_layers[0].mlp.gate.e_score_correction_bias
    assert torch.equal(on_disk["model.layers.3.mlp.gate.e_score_correction_bias"], mtp_bias)

    cfg2, sd = import_hf(str(tmp_path))
    assert cfg2 == cfg
    ref = model.state_dict()
    assert sd.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(sd[k], v) and sd[k].dtype == v.dtype, k
    other = GLMForCausalLM(cfg2)
    other.load_state_dict(sd, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    assert torch.equal(other(ids), model(ids))


def test_bf16_export_keeps_router_fp32(tmp_path):
    """bf16 export: matrices rounded to bf16, the router weight and bias kept in float32."""
    model = _model(CFG)
    export_hf(model, CFG, str(tmp_path), dtype=torch.bfloat16)
    on_disk = _read_dir(tmp_path)
    assert on_disk["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert on_disk["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    q = on_disk["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, model.model.layers[0].self_attn.q_proj.weight.detach().bfloat16())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    _, sd = import_hf(str(tmp_path))  # bf16 files load into float32 weights
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], q.float())


def test_config_json_fields(tmp_path):
    export_hf(_model(CFG), CFG, str(tmp_path))
    hf = json.loads((tmp_path / "config.json").read_text())
    expected = dict(
        model_type="glm4_moe",
        architectures=["Glm4MoeForCausalLM"],
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=4,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        hidden_act="silu",
        initializer_range=0.03,
        max_position_embeddings=512,
        num_nextn_predict_layers=1,
        attention_dropout=0.0,
        dtype="float32",
    )
    for k, v in expected.items():
        assert hf[k] == v, k
    assert hf["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 5000.0,
        "partial_rotary_factor": 2 / 3,
    }


def test_import_fused_3d_layout_and_sharded_index(tmp_path):
    model = _model(CFG)
    export_hf(model, CFG, str(tmp_path / "a"))
    hf = _read_dir(tmp_path / "a")
    E, I, H = 4, 8, 16
    fused = {}
    for k, v in hf.items():
        if ".experts." not in k:
            fused[k] = v
    for L in (1, 2, 3):
        p = f"model.layers.{L}.mlp.experts."
        fused[p + "gate_up_proj"] = torch.stack(
            [
                torch.cat([hf[f"{p}{e}.gate_proj.weight"], hf[f"{p}{e}.up_proj.weight"]])
                for e in range(E)
            ]
        )
        fused[p + "down_proj"] = torch.stack([hf[f"{p}{e}.down_proj.weight"] for e in range(E)])
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    # Written by the real safetensors library, split over two files with an index.
    out = tmp_path / "b"
    out.mkdir()
    keys = sorted(fused)
    weight_map = {}
    for i, part in enumerate((keys[::2], keys[1::2])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(
            {k: fused[k].contiguous() for k in part}, str(out / name), metadata={"format": "pt"}
        )
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    cfg, sd = import_hf(str(out))
    assert cfg == CFG
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k


def test_import_errors_and_hf_defaults(tmp_path):
    model = _model(CFG)
    export_hf(model, CFG, str(tmp_path))
    hf = _read_dir(tmp_path)
    # A missing correction bias loads as zeros (as transformers does).
    del hf["model.layers.2.mlp.gate.e_score_correction_bias"]
    _write_single(tmp_path, hf)
    _, sd = import_hf(str(tmp_path))
    assert torch.equal(sd["model.layers.2.mlp.gate.e_score_correction_bias"], torch.zeros(4))
    # A missing piece of one expert is an error naming it.
    del hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    _write_single(tmp_path, hf)
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight"):
        import_hf(str(tmp_path))
    # A config.json key left out means transformers' default, not ours.
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    del hf_cfg["rope_parameters"], hf_cfg["rope_theta"], hf_cfg["routed_scaling_factor"]
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    hf["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(8, 16)
    _write_single(tmp_path, hf)
    cfg, _ = import_hf(str(tmp_path))
    assert cfg.routed_scaling_factor == 1.0 and cfg.rope_theta == 10000.0
    # A shape that does not fit the config is an error naming the key and both shapes.
    hf["model.norm.weight"] = torch.ones(17)
    _write_single(tmp_path, hf)
    with pytest.raises(
        ValueError, match=r"model\.norm\.weight: \(17,\) in the files, the model needs \(16,\)"
    ):
        import_hf(str(tmp_path))
    assert os.path.exists(tmp_path / "config.json")


def test_init_from_is_checked_before_launch(tmp_path):
    """`checkpoint.init_from` is validated with the config, before any rank starts: a missing
    tensor, a wrong shape and a config field that differs are errors naming them."""
    from omegaconf import OmegaConf

    from recipes.build import model_config
    from recipes.config import Config, ConfigError, validate

    def cfg(*extra):
        dotlist = [f"checkpoint.init_from={tmp_path}", *extra]
        return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))

    with pytest.raises(ConfigError, match="checkpoint.init_from=.*no config.json"):
        validate(cfg())
    config = model_config(cfg())
    export_hf(_model(config), config, str(tmp_path))
    validate(cfg())  # fits
    with pytest.raises(ConfigError, match=r"routed_scaling_factor: run 1\.5, files"):
        validate(cfg("model.overrides.routed_scaling_factor=1.5"))
    hf = _read_dir(tmp_path)
    del hf["model.layers.1.mlp.experts.0.down_proj.weight"]
    hf["model.norm.weight"] = torch.ones(3)
    _write_single(tmp_path, hf)
    with pytest.raises(ConfigError, match=r"experts\.0\.down_proj\.weight.*model\.norm\.weight"):
        validate(cfg())
