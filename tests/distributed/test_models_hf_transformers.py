"""Parity with transformers itself, in both directions, on 4 ranks with ep 2: directories that
transformers wrote (Glm4Moe with an MTP layer added as the public checkpoints store it, a
block-fp8 copy of it, GlmMoeDsa) start a run through `model=hf model.path=DIR
checkpoint.init_from=DIR`, and what the run exports loads back in transformers.

One world serves every directory (`_hf_world` runs them in turn) and one train.py run checks
the logged step-1 loss of a GlmMoeDsa fine-tune against transformers' loss on the same tokens.
"""

import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.harness import run_world

ROOT = Path(__file__).resolve().parents[2]
INDEX = "model.safetensors.index.json"

GLM4_MOE_KW = dict(
    vocab_size=256,  # the stdlib byte tokens of a run need >= 256
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_theta=5000.0,
    num_nextn_predict_layers=1,
)
# index_topk 8 < the 12- and 16-token sequences below, so the sparse mask is real; layer 1
# is "shared" (it reuses layer 0's top-k and has no indexer weights).
GLM_MOE_DSA_KW = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    index_topk=8,
    index_head_dim=16,
    index_n_heads=8,
    indexer_types=["full", "shared", "full"],
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)
FP8_BLOCK = (3, 5)  # tiles neither rows nor columns, nor the ranks' row shards


def _randomize(model) -> None:
    """Norms away from 1, non-zero biases and router correction bias, matrices scaled so the
    logits are O(1): a swapped or dropped tensor shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))


def _files(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _add_file(path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """One more safetensors file in a directory, listed in its index."""
    save_file(tensors, str(path / name), metadata={"format": "pt"})
    index = json.loads((path / INDEX).read_text())
    index["weight_map"].update({k: name for k in tensors})
    (path / INDEX).write_text(json.dumps(index))


def _glm4_moe_dir(path) -> None:
    """A random Glm4Moe saved by transformers in bf16 over several files, plus its MTP layer
    (transformers builds none, so save_pretrained writes none): `model.layers.3.*` written
    here as GLM-4.5's files store it, a MoE decoder layer with enorm, hnorm, eh_proj,
    shared_head.norm and copies of the embedding and head."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    model = Glm4MoeForCausalLM(Glm4MoeConfig(**GLM4_MOE_KW))
    _randomize(model)
    model.to(torch.bfloat16).save_pretrained(str(path), max_shard_size="40KB")
    saved = _files(path)
    assert not any(k.startswith("model.layers.3.") for k in saved)  # dropped, as expected
    g = torch.Generator().manual_seed(7)
    mtp = {}
    for key, value in saved.items():  # layer 2 is a MoE layer: the MTP layer has its shapes
        if key.startswith("model.layers.2."):
            noise = 0.1 * torch.randn(value.shape, generator=g)
            mtp[key.replace("layers.2.", "layers.3.")] = (value.float() + noise).bfloat16()
    H = GLM4_MOE_KW["hidden_size"]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{name}.weight"] = (1 + 0.2 * torch.randn(H, generator=g)).bfloat16()
    mtp["model.layers.3.eh_proj.weight"] = (torch.randn(H, 2 * H, generator=g) / H).bfloat16()
    mtp["model.layers.3.embed_tokens.weight"] = saved["model.embed_tokens.weight"].clone()
    mtp["model.layers.3.shared_head.head.weight"] = saved["lm_head.weight"].clone()
    _add_file(path, "model-mtp.safetensors", mtp)


def _fp8_copy(src, dst) -> dict[str, torch.Tensor]:
    """`src` as a block-fp8 release (every 2-D matrix but the embedding, head and router
    quantized to e4m3 with amax / 448 block scales); returns the dequantized tensors."""
    dst.mkdir()
    files, want = {}, {}
    bn, bk = FP8_BLOCK
    for name, w in _files(src).items():
        w = w.float()
        if w.ndim != 2 or any(s in name for s in ("embed_tokens", "lm_head", "mlp.gate.", "head.")):
            files[name] = want[name] = w
            continue
        rows, cols = w.shape
        scale = torch.empty(-(-rows // bn), -(-cols // bk))
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        deq = torch.empty(rows, cols)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                r, c = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
                scale[i, j] = w[r, c].abs().max().clamp(min=1e-12) / 448.0
                q[r, c] = (w[r, c] / scale[i, j]).to(q.dtype)
                deq[r, c] = q[r, c].float() * scale[i, j]
        files[name], files[name + "_scale_inv"], want[name] = q, scale, deq
    save_file(files, str(dst / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK),
        "activation_scheme": "dynamic",
    }
    (dst / "config.json").write_text(json.dumps(hf))
    return want


def _glm_moe_dsa_dir(path) -> None:
    """A random GlmMoeDsa saved by transformers in float32; its config.json then declares one
    MTP layer, as GLM-5's does, whose weights the files do not hold."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**GLM_MOE_DSA_KW))
    _randomize(model)
    model.save_pretrained(str(path), max_shard_size="60KB")
    hf = json.loads((path / "config.json").read_text())
    hf["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(hf))


def _transformers(path, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """transformers' own float32 logits of a directory (eager attention and experts)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    with torch.no_grad():
        return model(ids).logits, info


def _run_config(src, *extra: str) -> str:
    from omegaconf import OmegaConf

    from recipes.config import Config

    dotlist = ["model.preset=hf", f"model.path={src}", f"checkpoint.init_from={src}"]
    dotlist += ["checkpoint.init_missing_mtp=true"]  # the glm_moe_dsa files lack their MTP layer
    dotlist += ["mesh.world_size=4", "mesh.ep=2", *extra]
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    return OmegaConf.to_yaml(cfg)


def _hf_world(jobs: list[dict], ids):
    """Per job, as a run starts from a transformers directory (checks, build, init_from):
    the import's memory peak, the logits, then a checkpoint and its export on every rank."""
    from models.glm.hf.adapter import hf_tensors
    from recipes import checkpoint
    from recipes.build import build_model, model_config
    from recipes.config import from_yaml, validate
    from recipes.hf import DCPRegions, export_checkpoint, init_from
    from recipes.memory import MemoryMeter

    out = []
    for job in jobs:
        cfg = from_yaml(job["config"])
        validate(cfg)  # includes the header check of the directory
        meter = MemoryMeter("cpu")
        model = build_model(cfg, model_config(cfg), torch.device("cpu"))
        # A checkpoint holds optimizer state too: one AdamW step at lr 0 (below) creates it and
        # leaves the weights those of the files.
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=False)
        with meter.measure("import") as m:
            initialized = init_from(model, job["src"], init_missing_mtp=True)
        ids_t = torch.tensor(ids)
        with torch.no_grad():
            logits = model(ids_t).numpy()
        model.loss(ids_t[:, :-1], ids_t[:, 1:]).backward()
        opt.step()
        state = {"model_config": model_config(cfg).to_dict()}
        ckpt = checkpoint.save(job["ckpt"], 1, model, opt, state, keep=1)
        # Collect garbage of the steps above first: a cycle freed inside the export would
        # count as negative bytes and hide the export's own peak.
        gc.collect()
        with meter.measure("export") as e:
            written = export_checkpoint(ckpt, job["out"], max_shard_gib=50 / 2**20)  # 50 KiB
        # What one export read may hold: the tensor and the saved piece it is cut from.
        largest_hf = max(math.prod(t.shape) * 4 for t in hf_tensors(model_config(cfg)))
        md = DCPRegions(Path(ckpt) / "model").metadata.state_dict_metadata.values()
        largest_piece = max(math.prod(c.sizes) * 4 for entry in md for c in entry.chunks)
        out.append(
            dict(
                logits=logits,
                initialized=initialized,
                import_peak=m.peak_delta_bytes(),
                written=written,
                export_peak=e.peak_delta_bytes(),
                export_bound=largest_hf + largest_piece,
            )
        )
    return out


def _close(ours, theirs) -> None:
    # Both are float32 forwards of the same weights and differ only in summation order: a
    # dot product of K <= 128 terms is off by <= K x 2^-24 relative to the sum of its
    # |terms| (~1e-5 over the few dozen matmuls of 3-4 layers, typically ~1e-6). That is
    # far below a swapped or missing tensor (O(1) logits change). A router or indexer
    # top-k near tie could flip under that noise; these seeds have none.
    torch.testing.assert_close(torch.as_tensor(ours), theirs, rtol=1e-4, atol=1e-5)


def test_transformers_dirs_init_from_on_4_ranks_ep2_and_export_round_trip(tmp_path):
    """Glm4Moe with an MTP layer (bf16, several files), its block-fp8 copy and a GlmMoeDsa
    whose config declares an MTP layer its files lack start 4-rank ep=2 runs: logits equal to
    transformers' float32 forward (the fp8 copy: to our single-process import of it), the
    MTP layer loaded or reported as initialized; our export of each (written by all 4
    ranks) loads back in transformers with every tensor, only the MTP layer unexpected, and
    the same logits. Each rank's import peak above its shards stays within one expert's
    weights (bf16 files), its export peak within the tensor it reads plus the saved piece."""
    pytest.importorskip("transformers")
    from models.glm.hf.load import import_hf

    glm4, fp8, dsa = tmp_path / "glm4", tmp_path / "fp8", tmp_path / "dsa"
    _glm4_moe_dir(glm4)
    assert len(list(glm4.glob("model-*.safetensors"))) > 3
    fp8_want = _fp8_copy(glm4, fp8)
    _glm_moe_dsa_dir(dsa)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    want4, _ = _transformers(glm4, ids)
    want_dsa, _ = _transformers(dsa, ids)
    _, fp8_sd = import_hf(fp8)
    from models.glm import GLMForCausalLM
    from models.glm.hf.load import HFDir

    single = GLMForCausalLM(HFDir(fp8).config)
    single.load_state_dict(fp8_sd)
    with torch.no_grad():
        want_fp8 = single(ids)

    names = ("glm4", "fp8", "dsa")
    jobs = [
        dict(
            config=_run_config(src),
            src=str(src),
            ckpt=str(tmp_path / f"ckpt-{n}"),
            out=str(tmp_path / f"export-{n}"),
        )
        for n, src in zip(names, (glm4, fp8, dsa), strict=True)
    ]
    results = run_world(_hf_world, 4, jobs, ids.tolist())
    by_job = [[r[j] for r in results] for j in range(len(jobs))]
    for (name, want), runs in zip(
        [("glm4", want4), ("fp8", want_fp8), ("dsa", want_dsa)], by_job, strict=True
    ):
        for r in runs:
            _close(r["logits"], want)
        written = [set(r["written"]) for r in runs]
        assert all(written) and not set.intersection(*written), name  # each rank: own files
        assert all(0 < r["export_peak"] <= r["export_bound"] for r in runs), name
    glm4_runs, fp8_runs, dsa_runs = by_job
    assert all(r["initialized"] == [] for r in glm4_runs + fp8_runs)  # the MTP layer loaded
    mtp_dsa = sorted(dsa_runs[0]["initialized"])
    assert mtp_dsa and all(n.startswith("model.layers.3.") for n in mtp_dsa)
    I, D = GLM4_MOE_KW["moe_intermediate_size"], GLM4_MOE_KW["hidden_size"]
    one_expert = 3 * I * D * 4  # gate, up and down of one expert, float32
    assert all(0 < r["import_peak"] <= one_expert for r in glm4_runs), glm4_runs

    # Back into transformers: every tensor, the MTP layer its only unexpected keys.
    theirs4 = _files(glm4)
    for name, want in (("glm4", want4), ("dsa", want_dsa)):
        out = tmp_path / f"export-{name}"
        back, info = _transformers(out, ids)
        assert not info["missing_keys"] and not info["mismatched_keys"], name
        assert info["unexpected_keys"] and all(
            k.startswith("model.layers.3.") for k in info["unexpected_keys"]
        ), name
        _close(back, want)
    exported4 = _files(tmp_path / "export-glm4")
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert exported4.keys() == theirs4.keys() - copies
    for k, v in exported4.items():
        assert torch.equal(v, theirs4[k].float()), k
    exported_fp8 = _files(tmp_path / "export-fp8")
    for k, v in fp8_want.items():
        if k not in copies:
            assert torch.equal(exported_fp8[k], v), k  # each rank dequantized its rows exactly
    exported_dsa, theirs_dsa = _files(tmp_path / "export-dsa"), _files(dsa)
    assert exported_dsa.keys() - theirs_dsa.keys() == set(mtp_dsa)
    for k, v in theirs_dsa.items():
        assert torch.equal(exported_dsa[k], v), k


def _run(cmd: list[str], cwd) -> str:
    env = dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def test_train_py_fine_tunes_a_transformers_glm_moe_dsa_and_export_script(tmp_path):
    """`python train.py model=hf model.path=DIR checkpoint.init_from=DIR` on 4 ranks (ep 2)
    with a directory transformers wrote: the logged step-1 loss is transformers' loss on the
    same tokens, the missing MTP layer is named in one warning; the run's own export and
    scripts/export_hf.py, in one process and on 2 torchrun ranks (`--force` over an older
    export), write the same tensors, byte-identical between the two script runs."""
    pytest.importorskip("transformers")
    from omegaconf import OmegaConf

    from recipes.config import Config
    from recipes.data import TokenStream, token_files

    src = tmp_path / "src"
    _glm_moe_dsa_dir(src)
    # Absolute paths, twice in the run directory's name: recipes.config.run_id shortens it.
    args = ["model=hf", f"model.path={src}", f"checkpoint.init_from={src}"]
    args += ["checkpoint.init_missing_mtp=true"]
    args += ["mesh.world_size=4", "mesh.ep=2", "train.steps=1", "logger=none"]
    args += ["optim.lr=1e-9", "optim.adamw_lr=1e-9", "train.router_bias_rate=0"]
    args += ["data.seq_len=16", "data.batch_size=1", f"data.cache_dir={tmp_path / 'cache'}"]
    args += [f"run.root={tmp_path / 'runs'}"]
    out = _run([sys.executable, str(ROOT / "train.py"), *args], tmp_path)
    assert "initialized from the transformers directory" in out
    assert out.count("holds no MTP layer weights") == 1
    (run_dir,) = (tmp_path / "runs" / "default").iterdir()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first["step"] == 1

    # The same tokens: each rank's micro-batch of step 1, the loss averaged over ranks.
    data = OmegaConf.structured(Config).data
    data.cache_dir = str(tmp_path / "cache")
    stream = TokenStream(token_files(data).train, "uint8", 16, 0, 256)  # seq_len 16, seed 0
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(src), dtype=torch.float32, attn_implementation="eager"
    )
    losses = []
    with torch.no_grad():
        for rank in range(4):
            x, y = stream.micro_batch(0, 0, rank, 4, 1)
            losses.append(F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()))
    # fp32 on both sides (see _close): the mean loss agrees to ~1e-6 relative.
    assert first["loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)

    run_export = _files(run_dir / "hf")
    for name, want in _files(src).items():  # lr 1e-9: one step moves nothing visibly
        torch.testing.assert_close(run_export[name], want, rtol=0, atol=1e-6, msg=name)
    ckpt = str(run_dir / "checkpoints" / "step_00000001")
    script = str(ROOT / "scripts" / "export_hf.py")
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, script, ckpt, str(one), "--max-shard-gib", "1e-4"], tmp_path)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    two.mkdir()  # a previous export's stale shard: --force replaces the directory whole
    (two / "model-00009-of-00009.safetensors").write_text("stale")
    forced = [script, ckpt, str(two), "--max-shard-gib", "1e-4", "--force"]
    printed = _run([*launch, *forced], tmp_path)
    assert "[rank 0] wrote" in printed and "[rank 1] wrote" in printed
    files = sorted(p.name for p in one.iterdir())
    assert len(files) > 4 and files == sorted(p.name for p in two.iterdir())
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    exported = _files(one)
    assert exported.keys() == run_export.keys()
    for name, tensor in run_export.items():
        assert torch.equal(exported[name], tensor), name
