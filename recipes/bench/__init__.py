"""The measuring toolkit the scripts and tests share (their local worlds start with
`recipes.world.run_world`, as training's do): sharded matrices with gradients (`fixtures`),
timers that interleave variants (`timing`), one table / CSV writer (`report`) and the command
lines' argument types (`cli`); per benchmark a measuring module and its report (`remainder`,
`remainder_report`; `newton_schulz`, `newton_schulz_optim`, `newton_schulz_report`). Scripts
under `scripts/` are thin command lines over it; `world` re-exports `recipes.world` for code
written against it."""
