"""GLM-MoE decoder-only causal language model (single-device code; see parallelize.py).

Attention is grouped-query (GLM-4.5) or multi-head latent with optional DeepSeek Sparse Attention
(GLM-5), per `GLMConfig.attention`. Multi-token prediction (depth k = 1..D), chained as InternLM
xtuner's GLM-5.2 `MTPBlock` chains its depths (`xtuner/v1/module/mtp/mtp_block.py`,
`mtp_layer.py`): depth 1 reads the main stack's last hidden state before the final norm, h^0;
depth k reads the embedding of the token k positions ahead and h^{k-1},
    h^k = shared_head.norm(Layer_k(eh_proj(cat(enorm(embed(t_{i+k})), hnorm(h^{k-1})))))
(the embedding first, as vLLM's and SGLang's GLM / DeepSeek MTP modules and Megatron-LM read
`eh_proj`); the normed h^k feeds both the shared lm_head, which predicts t_{i+k+1}, and the
next depth. Layer_k is MTP layer k - 1, or, with one MTP layer and `mtp_depths` D > 1, that one
layer at every depth (GLM-5 trains three depths on one layer); there, under DSA with
`index_share_for_mtp_iteration` (xtuner's `Glm52MoEConfig` default), depths >= 2 attend the keys
depth 1's indexer kept, as xtuner's `dsa_topk_sharing.py` reuses them. The MTP loss is the mean
over depths of their cross-entropies; `losses` returns it next to the next-token loss, with
D > 1 also each depth's own (`mtp_loss/depth_k`, detached: for the logs).
Every cross-entropy runs over `loss_chunk_tokens` tokens at a time
(`models.glm.model.loss_head`), so a long sequence never holds its [T, V] float32 logits at
once; labels outside [0, V) other than -100 are refused before any layer runs.

Shape legend: B batch, T sequence, D hidden, V vocab, E experts, K kept keys (DSA).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.glm.model import execution, init
from models.glm.model.config import GLMConfig
from models.glm.model.execution import recomputing
from models.glm.model.layers import MLP, Attention, RMSNorm, rope_cos_sin
from models.glm.model.loss_head import IGNORE_INDEX, check_labels, chunked_cross_entropy
from models.glm.model.mla import MLAttention
from models.glm.model.moe import MoE, Router
from models.glm.model.packing import ahead_in_document, document_bounds
from models.glm.model.sequence import LocalTokens


class DecoderLayer(nn.Module):
    """Pre-norm block: h + Attn(norm(h)), then h + MLP(norm(h)) with a dense MLP or an MoE.

    With `checkpoint_activations` (set by `parallelize`) the block keeps only its input for
    backward and runs its forward again there (non-reentrant activation checkpointing); the
    recomputation does not count expert loads a second time."""

    checkpoint_activations = False
    _compiled_block = None

    def __init__(self, config: GLMConfig, is_moe: bool, layer: int) -> None:
        super().__init__()
        self.is_moe = is_moe
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mla = config.attention == "mla"
        self.self_attn = MLAttention(config, layer) if self.mla else Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if is_moe else MLP(config.hidden_size, config.intermediate_size)

    def compile_block(self) -> None:
        """Run the block's computation through torch.compile from now on. Parameter names do
        not change, and hooks on the layer (FSDP2's) and the checkpoint around the block stay
        eager: a checkpoint with a recomputation context cannot be traced by dynamo. The
        functions `models.glm.model.execution.eager` marks (data-dependent dispatch, counters
        read under recomputation) run eagerly inside it."""
        execution.mark()
        self._compiled_block = torch.compile(self._block)

    @property
    def compiled(self) -> bool:
        """Whether the block runs through torch.compile (`compile_block` has run)."""
        return self._compiled_block is not None

    @property
    def reads_topk(self) -> bool:
        """Whether the layer attends keys an earlier layer's indexer kept (a "shared" DSA layer)
        rather than running its own indexer."""
        return self.mla and self.self_attn.sparse and self.self_attn.indexer is None

    def forward(
        self,
        h_BTD,
        cos_TR,
        sin_TR,
        topk_BTK=None,
        with_kl: bool = False,
        doc_start_BT=None,
        tokens: LocalTokens | None = None,
    ):
        """(h [B, T, D], the kept keys [B, T, K] under DSA else None, the indexer KL or None).
        `topk_BTK`: kept keys to attend instead of running the layer's own indexer (a "shared"
        layer's: the previous layer's), or None. `doc_start_BT`: packed documents (each
        token's document's first position): attention stays inside each document. `tokens`:
        the T tokens are these of a longer sequence (`models.glm.model.sequence`); a
        checkpointed layer gathers the other tokens' keys again when it recomputes."""
        block = self._compiled_block or self._block
        args = (h_BTD, cos_TR, sin_TR, topk_BTK, with_kl, doc_start_BT, tokens)
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(
                block,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), recomputing()),
            )
        return block(*args)

    def _block(self, h_BTD, cos_TR, sin_TR, topk_BTK, with_kl, doc_start_BT=None, tokens=None):
        x_BTD = self.input_layernorm(h_BTD)
        if self.mla:
            a_BTD, topk_BTK, kl = self.self_attn(
                x_BTD, cos_TR, sin_TR, topk_BTK, with_kl, doc_start_BT, tokens
            )
        else:
            a_BTD, kl = self.self_attn(x_BTD, cos_TR, sin_TR, doc_start_BT, tokens), None
        h_BTD = h_BTD + a_BTD
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD)), topk_BTK, kl


class SharedHead(nn.Module):
    """The MTP layer's own final norm (the output projection is the model's lm_head)."""

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """A multi-token-prediction MoE layer with the parameters of the public GLM checkpoints
    (enorm, hnorm, eh_proj [D, 2D], shared_head.norm; xtuner's `final_layernorm`); its
    attention runs its own indexer unless handed the kept keys of an earlier depth."""

    def __init__(self, config: GLMConfig, layer: int) -> None:
        super().__init__(config, is_moe=True, layer=layer)
        D = config.hidden_size
        self.enorm = RMSNorm(D, config.rms_norm_eps)
        self.hnorm = RMSNorm(D, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.shared_head = SharedHead(config)

    def forward(
        self,
        h_BTD,
        emb_BTD,
        cos_TR,
        sin_TR,
        topk_BTK=None,
        with_kl: bool = False,
        doc_start_BT=None,
        tokens: LocalTokens | None = None,
    ):
        """(this depth's shared_head-normed output, for lm_head and the next depth; the kept
        keys [B, T, K] under DSA else None; the indexer KL or None) from the previous depth's
        h and the shifted tokens' embeddings; `topk_BTK`: an earlier depth's kept keys to
        attend instead of running the indexer, or None; `doc_start_BT`, `tokens` as
        DecoderLayer's."""
        x_BTD = self.eh_proj(torch.cat([self.enorm(emb_BTD), self.hnorm(h_BTD)], dim=-1))
        h_BTD, topk_BTK, kl = super().forward(
            x_BTD, cos_TR, sin_TR, topk_BTK, with_kl, doc_start_BT, tokens
        )
        return self.shared_head.norm(h_BTD), topk_BTK, kl


class GLMModel(nn.Module):
    """Embedding, decoder layers (dense first, then MoE), final norm; MTP layers on the side."""

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        # The pad row takes no gradient (and starts at zero, `init_weights`), as transformers'
        # and xtuner's GLM embeddings build it (`padding_idx=pad_token_id`).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, is_moe=i >= config.n_dense_layers, layer=i)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        L = config.num_hidden_layers
        self.mtp_layers = nn.ModuleList(
            MTPLayer(config, layer=L + i) for i in range(config.num_mtp_layers)
        )


class GLMForCausalLM(nn.Module):
    """GLM-4.5 / GLM-5 style MoE causal LM.

    forward(input_ids [B, T]) -> logits [B, T, V]; forward(input_ids, labels) -> the dict of
    `losses`; loss(input_ids, labels) -> the next-token loss alone. Parameter metadata for Muon:
    the router weight carries param_roles "router", the lm_head weight "head", fused experts
    `orthogonal_blocks`; a frozen DSA indexer has requires_grad False.
    """

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.param_roles = {"weight": "head"}
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        with_mtp: bool = True,
        labels_checked: bool = False,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        tokens: LocalTokens | None = None,
    ):
        """Logits [B, T, V] for input_ids [B, T] (causal attention, positions 0..T-1); with
        `labels` [B, T] (next tokens, -100 ignored) the dict of float32 scalars `loss` (the
        next-token cross-entropy), `mtp_loss` (when MTP layers exist and `with_mtp`) and
        `indexer_kl` (under DSA with indexer_training "kl"). Labels outside [0, V) other than
        -100 are refused before any layer runs (one host read; `labels_checked`: the caller
        has run `models.glm.model.loss_head.check_labels` on them, on the host). Everything runs
        inside forward so that FSDP2's hooks on the root module cover the shared embedding
        and lm_head. Packed documents: `position_ids` [B, T] (RoPE's positions) with
        `doc_ids` [B, T] (non-decreasing along each row; equal ids: one document) make
        attention, the indexer's top-k and the MTP depths stay inside each document, so
        every document computes what it would alone (`models.glm.model.packing`).
        `tokens` (`models.glm.model.sequence.LocalTokens`): the arguments are the full
        sequence's, and only these of its tokens are computed (their logits, or their share of
        each loss: the sum over them divided by the full sequence's count)."""
        c = self.config
        seq_len = input_ids.shape[1]
        doc_start_BS, doc_end_BS = document_bounds(input_ids, position_ids, doc_ids)
        if seq_len > c.max_position_embeddings:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_position_embeddings "
                f"({c.max_position_embeddings})"
            )
        if labels is not None and not labels_checked:
            check_labels(labels, c.vocab_size)
        positions = position_ids
        if tokens is not None:
            tokens = tokens.on(input_ids.device)
            positions = tokens.positions_T if positions is None else tokens.take(positions)
        local = tokens.take if tokens is not None else (lambda x: x)
        doc_start_BT = local(doc_start_BS)
        with_kl = labels is not None and c.uses_dsa and c.indexer_training == "kl"
        h_BTD = self.model.embed_tokens(local(input_ids))
        cos_TR, sin_TR = rope_cos_sin(
            h_BTD.shape[1], c.rotary_dim, c.rope_theta, input_ids.device, c.rope_scaling, positions
        )
        topk_BTK, kls = None, []
        for layer in self.model.layers:
            reused = topk_BTK if layer.reads_topk else None
            h_BTD, topk_BTK, kl = layer(
                h_BTD, cos_TR, sin_TR, reused, with_kl, doc_start_BT, tokens
            )
            kls += [kl] if kl is not None else []
        normed_BTD = self.model.norm(h_BTD)
        if labels is None:
            return self.lm_head(normed_BTD)
        out = {"loss": self.head_loss(normed_BTD, labels, tokens)}
        depths = c.mtp_depths_resolved if with_mtp else 0
        if depths:
            docs = None if doc_start_BS is None else (doc_start_BS, doc_end_BS)
            rope = (cos_TR, sin_TR)
            mtp = self._mtp_losses(h_BTD, input_ids, labels, rope, with_kl, kls, docs, tokens)
            out["mtp_loss"] = torch.stack(mtp).mean()
            if depths > 1:  # each depth's own, for the logs (the objective uses the mean)
                out.update({f"mtp_loss/depth_{k}": v.detach() for k, v in enumerate(mtp, 1)})
        if kls:
            out["indexer_kl"] = torch.stack(kls).mean()
        return out

    def _mtp_losses(self, h_BTD, input_ids, labels, rope, with_kl, kls, docs, tokens):
        """Each depth's cross-entropy (module doc: xtuner's chaining) from the main stack's
        hidden state before the final norm; appends the depths' indexer KLs to `kls`. `docs`:
        packed documents' (first, last) positions per token, [B, S] each: depth k reads and
        predicts the token k ahead in the same document, wrapping around inside it where a
        document alone wraps around the sequence (those positions have no target). The ahead
        tokens are found in the full sequence, then cut to `tokens` (a context-parallel
        layout's chunk boundaries are crossed as on one rank)."""
        c, seq_len = self.config, input_ids.shape[1]
        one_layer = len(self.model.mtp_layers) == 1
        share_topk = one_layer and c.uses_dsa and c.index_share_for_mtp_iteration
        local = tokens.take if tokens is not None else (lambda x: x)
        doc_start_BT = None if docs is None else local(docs[0])
        losses, first_topk_BTK = [], None
        for k in range(1, c.mtp_depths_resolved + 1):
            # GLM-5's depths share one layer (num_mtp_layers 1), else layer k - 1.
            layer = self.model.mtp_layers[0 if one_layer else k - 1]
            # Position i reads token t_{i+k} = input_ids[i + k] and predicts labels[i + k];
            # the last k positions have no target (the wrapped ids there are never seen by
            # an earlier position: attention is causal).
            if docs is None:
                ahead_BS, target_BS = input_ids.roll(-k, dims=1), labels.roll(-k, dims=1)
                target_BS[:, seq_len - k :] = IGNORE_INDEX
            else:
                ahead_BS, target_BS = ahead_in_document(input_ids, labels, k, *docs)
            emb_BTD = self.model.embed_tokens(local(ahead_BS))
            reused = first_topk_BTK if share_topk else None
            h_BTD, topk_BTK, kl = layer(
                h_BTD, emb_BTD, *rope, reused, with_kl, doc_start_BT, tokens
            )
            first_topk_BTK = topk_BTK if k == 1 else first_topk_BTK
            kls += [kl] if kl is not None else []
            losses.append(self.head_loss(h_BTD, target_BS, tokens))
        return losses

    def head_loss(
        self, h_BTD: torch.Tensor, labels_BS: torch.Tensor, tokens: LocalTokens | None = None
    ) -> torch.Tensor:
        """The mean cross-entropy of the hidden states' logits against `labels_BS`; under
        `tokens` the labels are the full sequence's and the result is these tokens' share of
        its mean (their sum over the full count)."""
        count = None
        if tokens is not None:
            count = (labels_BS != IGNORE_INDEX).sum().clamp(min=1)
            labels_BS = tokens.take(labels_BS)
        return chunked_cross_entropy(
            self.lm_head,
            h_BTD,
            labels_BS,
            self.config.loss_chunk_tokens,
            check=False,
            count=count,
        )

    def loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, **packing: torch.Tensor
    ) -> torch.Tensor:
        """Mean cross-entropy (float32) of next-token labels [B, T] over the non -100 tokens;
        `packing`: forward's position_ids and doc_ids, if any."""
        return self(input_ids, labels, with_mtp=False, **packing)["loss"]  # FSDP2 hooks run

    def losses(
        self, input_ids: torch.Tensor, labels: torch.Tensor, with_mtp: bool = True
    ) -> dict[str, torch.Tensor]:
        """The training terms (see forward): `loss`, and `mtp_loss` / `indexer_kl` if any."""
        return self(input_ids, labels, with_mtp=with_mtp)

    def routers(self) -> list[Router]:
        """The routers of the MoE layers, the MTP layers' last."""
        layers = [*self.model.layers, *self.model.mtp_layers]
        return [layer.mlp.gate for layer in layers if layer.is_moe]

    def expert_loads(self) -> torch.Tensor:
        """The expert loads each MoE layer's router counted since the last bias update, on
        this process's tokens: int64 [n_moe_layers, E] (empty without MoE layers)."""
        routers = self.routers()
        if not routers:
            return torch.zeros(0, dtype=torch.long)
        return torch.stack([r.expert_load for r in routers])

    @torch.no_grad()
    def apply_router_bias_update(self, loads_LE: torch.Tensor, rate) -> torch.Tensor:
        """Aux-loss-free balancing from the loads `loads_LE` [n_moe_layers, E] (`expert_loads`,
        or their sum over the ranks that share the model): bias += rate * sign(mean_load -
        load) per MoE layer; then reset the counts. `rate`: a float or a 0-dim tensor. Returns
        the loads used, float32."""
        routers = self.routers()
        loads_LE = loads_LE.float()
        if not routers:
            return loads_LE
        delta_LE = rate * torch.sign(loads_LE.mean(-1, keepdim=True) - loads_LE)
        for r, delta_E in zip(routers, delta_LE, strict=True):
            r.e_score_correction_bias += delta_E.to(r.e_score_correction_bias.dtype)
            r.expert_load.zero_()
        return loads_LE

    def attentions(self) -> list[nn.Module]:
        """The attention of every layer, the MTP layers' last: all of them train (MTP in the
        training forward), so QK-clip watches and clips them all (an MTP layer's row stays
        -inf, never clipped, for forwards without MTP)."""
        return [layer.self_attn for layer in (*self.model.layers, *self.model.mtp_layers)]

    def record_max_logits(self, on: bool) -> None:
        """Make training forwards record each head's largest attention logit (or stop)."""
        for attn in self.attentions():
            attn.record_max_logits = on
            attn.max_logits_N = None

    def take_max_logits(self):
        raise AttributeError(
            "GLMForCausalLM.take_max_logits is gone: models.glm.infra.statistics."
            "take_max_logits(model) takes the maximum over the ranks; this process's own "
            "maxima are GLMForCausalLM.take_local_max_logits()"
        )

    def update_router_bias(self, rate):
        raise AttributeError(
            "GLMForCausalLM.update_router_bias is gone: use "
            "models.glm.infra.statistics.update_router_bias(model, rate)"
        )

    def qk_clip_(self, *args, **kwargs):
        raise AttributeError(
            "GLMForCausalLM.qk_clip_ is gone: use models.glm.infra.qk_clip.qk_clip_(model, ...)"
        )

    @torch.no_grad()
    def take_local_max_logits(self) -> torch.Tensor:
        """Each layer's per-head largest pre-softmax logit that this process's forwards
        recorded since the last call, float32 [L, N] (-inf for a layer that recorded nothing);
        then reset."""
        attns = self.attentions()
        device = next(self.parameters()).device
        rows = [
            a.max_logits_N
            if a.max_logits_N is not None
            else torch.full((a.n_heads,), -torch.inf, device=device)
            for a in attns
        ]
        logits_LN = torch.stack(rows)
        for a in attns:
            a.max_logits_N = None
        return logits_LN

    def num_parameters(self) -> int:
        """Number of distinct parameters (global sizes; works on meta and on sharded parameters)."""
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_weights(self, seed: int, rows: init.Rows = init.whole_rows) -> int:
        """Deterministic init from `seed`: matrices ~ N(0, initializer_range), norms 1, biases and
        the router correction bias 0, expert loads 0. Each parameter is filled only in the rows
        this process holds, `rows(p)` (`models.glm.model.init`: by default all of them; a
        sharded model's rows are `models.glm.infra.init`'s), drawing the fixed global row chunks
        they overlap, so the values do not depend on who holds which rows and the cost is
        proportional to the rows held; on CUDA the values are drawn on the device. A no-op on
        meta tensors. Returns the number of random values drawn."""
        return init.init_model(self, seed, rows)
