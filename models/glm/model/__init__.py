"""The model on one device: its config, layers, attention, MoE, loss head, init and presets.

Expert parallelism, FSDP2, activation checkpointing and compile are installed from outside by
`models.glm.infra`; the transformers map is `models.glm.hf`. Still here and to move out: the
statistics all-reduces in `model`, the EP DTensors' local views in `moe` and `init`, and
QK-clip's redistribution of sharded weights in `qk_clip`.
"""
