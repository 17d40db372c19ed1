"""The installer: what makes the single-device model (`models.glm.model`) run over many ranks.

`parallelize` (expert parallelism, activation checkpointing, compile, FSDP2); `expert_parallel`,
the routed experts' subclass with the expert-parallel token exchange that it swaps in;
`statistics`, the expert loads and max attention logits summed over the ranks; `qk_clip`,
QK-clip's rescaling of (sharded) W_q / W_k rows; `init`, each rank's deterministic init of its
own shard; `local`, a sharded parameter's rows on this rank. A new parallel dimension goes here.
"""
