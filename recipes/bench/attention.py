"""One MLA + DSA attention layer, forward + backward: seconds and peak memory per
(T, dsa_impl, mode).

The layer (GLM-5's proportions at a small width): hidden 512, 16 heads, q/kv ranks 128,
nope/rope/v 32/16/32, indexer 4 heads x 32, index_topk 256. The implementations are
`GLMConfig.dsa_impl` (masked: dense SDPA under the kept-key mask, the reference; latent and
per_head: the sparse attention over gathered keys), modes `indexer_training` (frozen, kl).

Each (T, dsa_impl, mode) runs in a fresh process
(`python -m recipes.bench.attention T DSA_IMPL MODE REPEATS`)
with one intra-op thread, so that one measurement's allocator cache and heap never shape the
next: one warm-up step, `repeats` timed steps (median of process CPU time: other load on the
machine does not enter), then one step inside `recipes.memory.MemoryMeter`, whose CPU figures
are the profiler's [memory] events with c10's cross-thread counter on; the peak is the step's
`peak_delta_bytes` over the live bytes before it (the layer's parameters and its input are
allocated before). The step: forward on a fixed random input, a fixed random projection of
the output as the loss (plus the indexer KL in kl mode), backward into the parameters and the
input.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from recipes.units import MiB

#: the dsa_impl values (recipes.config.choices.DSA_IMPLS), in the tables' order
DSA_IMPLS = ("masked", "latent", "per_head")
MODES = ("frozen", "kl")
LAYER = dict(
    hidden_size=512,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=256,
)


def layer_config(seq_len: int, dsa_impl: str, mode: str):
    """The benchmarked layer's GLMConfig (mla_tiny's other fields, one decoder layer)."""
    from models.glm import get_preset

    return get_preset(
        "mla_tiny",
        **LAYER,
        num_hidden_layers=1,
        indexer_types=None,
        num_mtp_layers=0,
        max_position_embeddings=max(seq_len, 4096),
        dsa_impl=dsa_impl,
        indexer_training=mode,
    )


def measure(seq_len: int, dsa_impl: str, mode: str, repeats: int) -> dict:
    """Seconds (median of `repeats`) and peak MiB of one forward + backward, in this process."""
    from models.glm.model.layers import rope_cos_sin
    from models.glm.model.mla import MLAttention
    from recipes.memory import MemoryMeter

    torch.set_num_threads(1)
    meter = MemoryMeter("cpu")  # before anything is allocated: the absolute figures count all
    config = layer_config(seq_len, dsa_impl, mode)
    torch.manual_seed(0)
    layer = MLAttention(config, 0)
    for p in layer.parameters():  # std 1/sqrt(fan_in): activations and logits of order one
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5) if p.ndim > 1 else None
    cos, sin = rope_cos_sin(seq_len, config.rotary_dim, config.rope_theta, torch.device("cpu"))
    x = torch.randn(1, seq_len, config.hidden_size, requires_grad=True)
    probe = torch.randn(1, seq_len, config.hidden_size)

    def step() -> None:
        out, _, kl = layer(x, cos, sin, with_kl=(mode == "kl"))
        loss = (out * probe).sum() / seq_len
        (loss if kl is None else loss + kl).backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    step()  # warm-up
    seconds = []
    for _ in range(repeats):
        t0 = time.process_time()
        step()
        seconds.append(time.process_time() - t0)
    with meter.measure() as m, m.region("step"):
        step()
    return {
        "T": seq_len,
        "dsa_impl": dsa_impl,
        "mode": mode,
        "seconds": statistics.median(seconds),
        "peak_mib": m.peak_delta_bytes("step") / MiB,
        "repeats": repeats,
    }


def _not_run(seq_len: int, dsa_impl: str, mode: str, why: str) -> dict:
    """The row of a (T, dsa_impl, mode) that did not run, saying why."""
    return {"T": seq_len, "dsa_impl": dsa_impl, "mode": mode, "skipped": why}


def run_fresh(seq_len: int, dsa_impl: str, mode: str, repeats: int, timeout: float) -> dict:
    """`measure` in a fresh Python process (one thread); its row, or a row saying why not."""
    module = "recipes.bench.attention"
    cmd = [sys.executable, "-m", module, str(seq_len), dsa_impl, mode, str(repeats)]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}
        )
    except subprocess.TimeoutExpired:
        return _not_run(seq_len, dsa_impl, mode, f"over {timeout:.0f} s")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        return _not_run(seq_len, dsa_impl, mode, f"failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def sweep(
    lengths, dsa_impls, modes, *, repeats: int, max_t: dict[str, int], timeout: float, log=print
) -> list[dict]:
    """Every (T, dsa_impl, mode), each in a fresh process; T ascending, at each T the
    dsa_impls side by side. A dsa_impl is not run past its `max_t` (masked's time and memory
    are quadratic in T; per_head only needs the sizes that decide against it)."""
    rows = []
    for T in lengths:
        for mode in modes:
            for dsa_impl in dsa_impls:
                if max_t.get(dsa_impl, T) < T:
                    rows.append(_not_run(T, dsa_impl, mode, f"T > {max_t[dsa_impl]}"))
                    continue
                row = run_fresh(T, dsa_impl, mode, repeats, timeout)
                log(json.dumps(row))
                rows.append(row)
    return rows


if __name__ == "__main__":  # one measurement: T DSA_IMPL MODE REPEATS; prints its row as JSON
    T_, dsa_impl_, mode_, repeats_ = sys.argv[1:5]
    print(json.dumps(measure(int(T_), dsa_impl_, mode_, int(repeats_))))
