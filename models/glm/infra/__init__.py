"""The installer: what makes the single-device model (`models.glm.model`) run over many ranks.

`parallelize` (expert parallelism, activation checkpointing, compile, FSDP2), the expert-
parallel token exchange it swaps into the routed experts, each rank's rows of a sharded
parameter (`local`). A new parallel dimension goes here.
"""
