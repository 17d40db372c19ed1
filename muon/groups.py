"""Build Muon and AdamW parameter groups from a model's own metadata (never from names).

A module declares, as plain data:
  `orthogonal_blocks = {"gate_up_proj": 2 * E}`  independent matrices stacked along dim 0
  `orthogonal_splits = {"weight": (P, R) * N}`   rows of its blocks along dim 0 (Muon Split:
                                                 per-head blocks, used with `muon_split=True`)
  `param_roles = {"weight": "head"}`             "embedding" | "head" | "router"
`nn.Embedding` weights count as "embedding" without a declaration. A frozen parameter
(`requires_grad` False, e.g. a DSA indexer that is not trained) joins no group: it gets no
update and no optimizer state.
"""

from __future__ import annotations

import torch
from torch import nn

ROUTER_CHOICES = ("adamw", "muon")
ROLES = ("embedding", "head", "router")


def param_groups(
    model: nn.Module,
    *,
    router: str = "adamw",
    lr: float = 0.02,
    weight_decay: float = 0.0,
    adamw_lr: float = 3e-3,
    adamw_weight_decay: float = 0.0,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    muon_split: bool = False,
) -> list[dict]:
    """Muon groups (one per block count) for hidden matrices; one AdamW group for the rest.

    Matrices go to Muon; embeddings, the output head, norms, biases and other vectors go to AdamW;
    the router weight goes where `router` says. With `muon_split`, matrices whose module
    declares `orthogonal_splits` are orthogonalized block by block (equal blocks as `num_blocks`,
    unequal ones as `split_sizes`). Every trainable parameter lands in exactly one
    group (frozen ones in none), and
    each group carries `param_names` for error messages and the cross-rank plan check.
    """
    if router not in ROUTER_CHOICES:
        raise ValueError(f"router: {router!r} is not one of {ROUTER_CHOICES}")
    placed: dict[int, str] = {}
    muon: dict[tuple, tuple[list, list]] = {}
    adamw: tuple[list, list] = ([], [])
    for mod_name, module in model.named_modules():
        blocks = getattr(module, "orthogonal_blocks", {}) or {}
        splits = getattr(module, "orthogonal_splits", {}) or {}
        roles = getattr(module, "param_roles", {}) or {}
        for key in list(blocks) + list(splits) + list(roles):
            if not hasattr(module, key) or not isinstance(getattr(module, key), torch.Tensor):
                raise ValueError(
                    f"{type(module).__name__} at {mod_name or '<root>'} declares metadata for "
                    f"{key!r}, which is not one of its parameters"
                )
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in placed:  # tied weights: first owner wins, the tie is one parameter
                continue
            if not p.requires_grad:
                placed[id(p)] = name
                continue
            role = roles.get(pname, "embedding" if isinstance(module, nn.Embedding) else None)
            if role is not None and role not in ROLES:
                raise ValueError(f"param_roles[{pname!r}] of {name}: {role!r} not in {ROLES}")
            to_muon = p.ndim >= 2 and role not in ("embedding", "head")
            if role == "router":
                to_muon = router == "muon" and p.ndim >= 2
            placed[id(p)] = name
            if to_muon:
                sizes = tuple(splits[pname]) if muon_split and pname in splits else None
                if sizes is not None and len(set(sizes)) == 1:  # equal: the num_blocks case
                    key = (len(sizes), None)
                elif sizes is not None:
                    key = (len(sizes), sizes)
                else:
                    key = (int(blocks.get(pname, 1)), None)
                names, params = muon.setdefault(key, ([], []))
            else:
                names, params = adamw
            names.append(name)
            params.append(p)
    missing = [n for n, p in model.named_parameters() if id(p) not in placed]
    if missing:
        raise ValueError(f"parameters in no group: {missing}")
    groups = [
        dict(
            params=params,
            param_names=names,
            algorithm="muon",
            lr=lr,
            weight_decay=weight_decay,
            num_blocks=blocks,
            **({"split_sizes": sizes} if sizes else {}),
        )
        for (blocks, sizes), (names, params) in sorted(
            muon.items(), key=lambda kv: (kv[0][0], kv[0][1] or ())
        )
    ]
    if adamw[1]:
        groups.append(
            dict(
                params=adamw[1],
                param_names=adamw[0],
                algorithm="adamw",
                lr=adamw_lr,
                weight_decay=adamw_weight_decay,
                betas=tuple(adamw_betas),
                eps=adamw_eps,
            )
        )
    return groups
