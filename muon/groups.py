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
    muon, adamw = _place(model, router=router, muon_split=muon_split)
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


def _place(
    model: nn.Module, *, router: str, muon_split: bool
) -> tuple[dict[tuple, tuple[list, list]], tuple[list, list]]:
    """(Muon's (names, params) by group key (num_blocks, split_sizes), AdamW's (names,
    params)): every trainable parameter once, a tied one under its first owner, a frozen one
    nowhere; raises naming the parameters no module of `model` owns."""
    placed: dict[int, str] = {}
    muon: dict[tuple, tuple[list, list]] = {}
    adamw: tuple[list, list] = ([], [])
    for mod_name, module in model.named_modules():
        blocks, splits, roles = _declarations(mod_name, module)
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            if id(p) in placed:  # tied weights: first owner wins, the tie is one parameter
                continue
            placed[id(p)] = name
            if not p.requires_grad:
                continue
            role = _role(module, roles, pname, name)
            if _to_muon(p, role, router):
                key = _muon_key(pname, blocks, splits, muon_split)
                names, params = muon.setdefault(key, ([], []))
            else:
                names, params = adamw
            names.append(name)
            params.append(p)
    missing = [n for n, p in model.named_parameters() if id(p) not in placed]
    if missing:
        raise ValueError(f"parameters in no group: {missing}")
    return muon, adamw


def _declarations(mod_name: str, module: nn.Module) -> tuple[dict, dict, dict]:
    """`module`'s orthogonal_blocks, orthogonal_splits and param_roles, each naming only
    tensors of its own."""
    blocks = getattr(module, "orthogonal_blocks", {}) or {}
    splits = getattr(module, "orthogonal_splits", {}) or {}
    roles = getattr(module, "param_roles", {}) or {}
    for key in list(blocks) + list(splits) + list(roles):
        if not hasattr(module, key) or not isinstance(getattr(module, key), torch.Tensor):
            raise ValueError(
                f"{type(module).__name__} at {mod_name or '<root>'} declares metadata for "
                f"{key!r}, which is not one of its parameters"
            )
    return blocks, splits, roles


def _role(module: nn.Module, roles: dict, pname: str, name: str) -> str | None:
    """The declared role of `module`'s parameter `pname` ("embedding" for an nn.Embedding's
    by default), or None."""
    role = roles.get(pname, "embedding" if isinstance(module, nn.Embedding) else None)
    if role is not None and role not in ROLES:
        raise ValueError(f"param_roles[{pname!r}] of {name}: {role!r} not in {ROLES}")
    return role


def _to_muon(p: torch.Tensor, role: str | None, router: str) -> bool:
    """Matrices go to Muon, but embeddings and the head; the router where `router` says."""
    if role == "router":
        return router == "muon" and p.ndim >= 2
    return p.ndim >= 2 and role not in ("embedding", "head")


def _muon_key(pname: str, blocks: dict, splits: dict, muon_split: bool) -> tuple:
    """The Muon group of parameter `pname`: (num_blocks, split_sizes), split_sizes only for
    unequal Muon Split blocks (else None)."""
    sizes = tuple(splits[pname]) if muon_split and pname in splits else None
    if sizes is not None and len(set(sizes)) == 1:  # equal: the num_blocks case
        return (len(sizes), None)
    if sizes is not None:
        return (len(sizes), sizes)
    return (int(blocks.get(pname, 1)), None)
