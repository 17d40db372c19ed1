"""Activation bytes of a training step, per token, counted op by op from the model code.

What autograd saves for backward (`tests/unit/test_step_memory.py` checks these against
`saved_tensors_hooks` on real layers: GQA and MLA + DSA under every `dsa_impl`, frozen and
KL-trained indexer, MTP): per decoder layer (`layer_activation_bytes`), per loss head
(`head_bytes_per_token`) and the transients the estimate adds (one layer's MLP backward,
`backward_bytes_per_token`; one cross-entropy chunk, `loss_head_chunk_bytes`). DSA's sparse
paths keep O(index_topk) bytes per token (the kept keys' positions, the KL's kept-key terms);
only the masked reference grows with the sequence (SDPA keeps the [T, S] mask). Tokens are
assumed evenly routed (each rank's experts receive N*K rows on average). `recipes.step_memory`
adds these up for a step; `recipes.context_memory` splits them by query and key side under
context parallelism.
"""

from __future__ import annotations

from models.glm import GLMConfig


def attention_bytes_per_token(config: GLMConfig, a: int, seq_len: int) -> int:
    """Saved by input norm + attention of one layer, per token; `a` = compute itemsize."""
    if config.attention == "mla":
        return mla_bytes_per_token(config, a, seq_len)
    D, hd = config.hidden_size, config.head_dim_resolved
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    total = norm_bytes_per_token(D, a) + D * a  # norm; its output, saved by q/k/v
    if config.use_qk_norm:
        total += (nh + nkv) * (hd * (4 + a) + 4)  # per-head norms of q and k
    # SDPA (flash kernels) saves q, the head-repeated k and v, its output and the
    # log-sum-exp; the output's transpose-reshape for o_proj is a view of it.
    total += 4 * nh * hd * a + nh * 4
    return total


def mla_bytes_per_token(config: GLMConfig, a: int, seq_len: int) -> int:
    """Multi-head latent attention (models/glm/model/mla.py), per token: the input norm and its
    output, the query and key/value latents with their norms, then by `dsa_impl`:
    - dense MLA and "masked": kv_b_proj's input, SDPA's q, k (the concatenated nope + rope
      heads), the kv_b output v is a view of, its output and log-sum-exp, and under DSA with
      seq_len > index_topk the sparse mask SDPA keeps in the compute dtype ([T, S]: S per
      token). Counts the fused kernels (the GLM-5 shapes have equal q/k and v widths; CPU
      runs with unequal widths fall back to the math kernel, which keeps [T, S] scores);
    - "per_head": the same without the mask, plus the kept keys' int64 positions (K);
    - "latent": the q_b output q_nope is a view of (read by kv_b_proj's key rows), the latent
      query [N, L + R] and key [L + R], the kept keys' positions, the latent output [N, L]
      and log-sum-exp, and o_proj's input (nothing of size S: the gathered keys are
      recomputed in backward). A "shared" layer counts its kept keys too (a per-layer view
      of one [B, T, K] tensor: an overestimate of K * 8 bytes per token and shared layer)."""
    D, N = config.hidden_size, config.num_attention_heads
    P, R, V, L = (
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
        config.kv_lora_rank,
    )
    total = norm_bytes_per_token(D, a) + D * a
    if config.q_lora_rank is not None:
        total += norm_bytes_per_token(config.q_lora_rank, a) + config.q_lora_rank * a
    total += norm_bytes_per_token(L, a)
    if a == 4:  # the latent norm's float32 input is then a view of the whole kv_a output
        total += R * 4
    impl = config.dsa_impl if config.uses_dsa else "masked"
    if impl == "latent":
        kept = min(config.index_topk, seq_len) * 8
        return (
            total + N * (P + R) * a + (N + 1) * (L + R) * a + kept + N * L * a + N * 4 + N * V * a
        )
    total += L * a + 2 * N * (P + R) * a + N * (P + V) * a + N * V * a + N * 4
    if impl == "per_head":
        return total + min(config.index_topk, seq_len) * 8
    if config.uses_dsa and seq_len > config.index_topk:
        total += seq_len * a
    return total


def indexer_kl_bytes_per_token(config: GLMConfig, a: int, seq_len: int) -> int:
    """What a trained ("kl") indexer of a "full" layer adds, per token: its key norm (input,
    mean, rstd), the float32 scaled query, key and head weights the kept keys' scores are
    recomputed from, and the KL's log-softmax, target and two masks over the K kept keys
    (plus their int64 positions under "masked", whose attention keeps a mask instead). A
    frozen indexer runs under no_grad and saves nothing. Nothing of size S: the all-pairs
    scores are reduced to the top-k chunk by chunk under no_grad."""
    C, M, K = config.index_head_dim, config.index_n_heads, min(config.index_topk, seq_len)
    total = C * a + 2 * a + C * 4 + M * C * 4 + M * 4 + 2 * K + 2 * K * 4
    return total + (K * 8 if config.dsa_impl == "masked" else 0)


def indexer_layer(config: GLMConfig, layer: int) -> bool:
    """Whether decoder layer `layer` (an MTP layer when >= num_hidden_layers) runs an indexer
    of its own (a "full" DSA layer)."""
    return config.uses_dsa and config.layer_indexer_type(layer) == "full"


def kl_layer(config: GLMConfig, layer: int) -> bool:
    """Whether decoder layer `layer` runs a KL-trained indexer."""
    return indexer_layer(config, layer) and config.indexer_training == "kl"


def norm_bytes_per_token(dim: int, a: int) -> int:
    """RMSNorm: the float32 input, the normalized value in the compute dtype, the rsqrt."""
    return dim * 4 + dim * a + 4


def mlp_bytes_per_token(inner: int, a: int) -> int:
    """SwiGLU: gate and up outputs, silu(gate), their product (the input is counted by the
    norm that produced it)."""
    return 4 * inner * a


def moe_bytes_per_token(config: GLMConfig, a: int, ep: int) -> int:
    """Router, routed experts (K rows per token, evenly routed) and shared expert."""
    D, E, K = config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    I = config.moe_intermediate_size
    router = E * 4 + K * 8 + K * 4 + 4  # sigmoid scores, chosen ids, weights and their sum
    if a != 4:
        router += D * 4  # the float32 copy of the input the router's linear saves
    # Dispatch indices (token of each assignment, sort order), the routing weights; with EP the
    # permutation into local-expert order and back.
    routed = K * (8 + 8 + 4) + (K * 16 if ep > 1 else 0)
    # Per row: the gathered input, gate+up output, silu, product; then the expert output the
    # weighted sum saves (its weighted rows are not kept: `_Combine` of models/glm/model/moe.py).
    routed += K * (2 * D + 4 * I) * a
    shared = mlp_bytes_per_token(I * config.n_shared_experts, a)
    return router + routed + shared


def layer_bytes_per_token(
    config: GLMConfig, is_moe: bool, a: int, ep: int, *, seq_len: int = 1, layer: int = 0
) -> int:
    """Activation bytes decoder layer `layer` keeps for backward, per token (`seq_len` matters
    to DSA's masks and a trained indexer only)."""
    D = config.hidden_size
    total = attention_bytes_per_token(config, a, seq_len) + norm_bytes_per_token(D, a) + D * a
    if kl_layer(config, layer):
        total += indexer_kl_bytes_per_token(config, a, seq_len)
    if is_moe:
        return total + moe_bytes_per_token(config, a, ep)
    return total + mlp_bytes_per_token(config.intermediate_size, a)


def layer_activation_bytes(
    config: GLMConfig,
    layer: int,
    is_moe: bool,
    a: int,
    ep: int,
    batch: int,
    seq_len: int,
    *,
    keys: int | None = None,
) -> int:
    """Activation bytes of decoder layer `layer` (an MTP layer when >= num_hidden_layers) for
    a micro-batch of `batch` sequences of `seq_len` tokens, each token attending `keys`
    positions (default `seq_len`; a context-parallel rank's tokens attend the whole
    sequence's: `recipes.context_memory`)."""
    tokens, keys = batch * seq_len, keys or seq_len
    total = tokens * layer_bytes_per_token(config, is_moe, a, ep, seq_len=keys, layer=layer)
    if layer >= config.num_hidden_layers:
        total += tokens * mtp_input_bytes_per_token(config, a)
    if is_moe:  # the grouped expert GEMM's int32 offsets, one per local expert
        total += 4 * (config.n_routed_experts // ep)
    return total


def backward_bytes_per_token(config: GLMConfig, is_moe: bool, a: int) -> int:
    """Activation gradients a layer's MLP backward holds at once, per token: of its output and
    input ([rows, D] each), of gate+up and of their product ([rows, 2I], [rows, I]); K rows a
    token through routed experts (measured: small and mla_tiny steps within 2%)."""
    D = config.hidden_size
    if is_moe:
        return config.num_experts_per_tok * (2 * D + 3 * config.moe_intermediate_size) * a
    return (2 * D + 3 * config.intermediate_size) * a


def mtp_input_bytes_per_token(config: GLMConfig, a: int) -> int:
    """An MTP layer before its decoder block: enorm and hnorm and their concatenation (saved
    by eh_proj); its loss head is counted as the model's (`head_bytes_per_token`)."""
    D = config.hidden_size
    return 2 * norm_bytes_per_token(D, a) + 2 * D * a


def head_bytes_per_token(config: GLMConfig, a: int) -> int:
    """A loss head, per token, kept for backward: the final norm, its output (the checkpointed
    input of the cross-entropy chunks), the target and the token ids. The [T, V] logits are
    never kept: `loss_head_chunk_bytes`."""
    D = config.hidden_size
    return norm_bytes_per_token(D, a) + D * a + 8 + 8


def loss_head_chunk_bytes(config: GLMConfig, a: int, tokens: int) -> int:
    """The loss head's transient: one chunk of `loss_chunk_tokens` tokens (at most `tokens`;
    models/glm/model/model.py `chunked_cross_entropy`), at its peak the chunk's [chunk, V] logits in
    the compute dtype and in float32 (forward, and again in backward, where the float32 copy
    becomes the gradient in place and is cast back to the compute dtype): (a + 4) bytes per
    logit, 4 in float32 compute (no copy); below float32 also the backward's float32 sum of
    the weight's gradient over the chunks ([V, D], cast to the compute dtype once at the
    end, when the chunk is gone)."""
    c = min(config.loss_chunk_tokens, tokens)
    chunk = c * config.vocab_size * (4 + (a if a < 4 else 0))
    return chunk + (4 * config.vocab_size * config.hidden_size if a < 4 else 0)
