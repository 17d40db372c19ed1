"""The model on one device: its config, layers, attention, MoE, loss head, init and presets.

Nothing here communicates or asks whether a tensor is sharded (no torch.distributed, no
DTensor): expert parallelism, FSDP2, activation checkpointing and compile are installed from
outside by `models.glm.infra`, the transformers map is `models.glm.hf`.
"""
