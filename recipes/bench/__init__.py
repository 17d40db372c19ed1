"""The measuring toolkit the scripts and tests share: one way to start a local world
(`world.run_world`), sharded matrices with gradients (`fixtures`), timers that interleave
variants (`timing`), one table / CSV writer (`report`) and the command lines' argument types
(`cli`); per benchmark a measuring module and its report (`remainder`, `remainder_report`;
`newton_schulz`, `newton_schulz_optim`, `newton_schulz_report`). Scripts under `scripts/` are
thin command lines over it; `tests/harness.py` starts its worlds with the same runner."""
