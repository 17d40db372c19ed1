"""The model on one device: its config, layers, attention, MoE, loss head, init and presets.

Nothing here communicates: the model counts expert loads and records attention maxima on its
own tokens, and its init fills the rows it is told it holds. Expert parallelism, FSDP2,
activation checkpointing, compile, the statistics summed over ranks, QK-clip's weight surgery
and the per-shard init are installed from outside by `models.glm.infra`, which imports this
package (never the reverse); the transformers map is `models.glm.hf`.
"""
