"""Batched quintic Newton-Schulz orthogonalization: a pure function, no state.

Shapes: G_BRC is a batch of B blocks of R rows and C columns (any leading dims are the batch).
Each block is normalized by its own Frobenius norm, so fused expert weights viewed as
`[E, out, in]` are orthogonalized as E independent matrices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Coefficients = Sequence[tuple[float, float, float]]

#: Named coefficient sets. "fixed" repeats one triple (torch.optim.Muon's default); "tuned" is a
#: per-iteration schedule whose later steps pull singular values closer to 1. Steps beyond a
#: schedule's length reuse its last triple.
NS_COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "fixed": ((3.4445, -4.7750, 2.0315),),
    "tuned": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
}


def resolve_coefficients(
    coefficients: str | Coefficients,
) -> tuple[tuple[float, float, float], ...]:
    """Turn a coefficient-set name or an explicit list of (a, b, c) triples into a tuple."""
    if isinstance(coefficients, str):
        if coefficients not in NS_COEFFICIENTS:
            raise ValueError(
                f"ns_coefficients: unknown set {coefficients!r}; allowed: "
                f"{sorted(NS_COEFFICIENTS)} or a list of (a, b, c) triples"
            )
        return NS_COEFFICIENTS[coefficients]
    triples = tuple(tuple(float(x) for x in t) for t in coefficients)
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(
            f"ns_coefficients: expected a non-empty list of (a, b, c) triples, got {coefficients!r}"
        )
    return triples  # type: ignore[return-value]


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: str | Coefficients = "fixed",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximately orthogonalize each `[rows, cols]` block of `G` (shape `[..., rows, cols]`).

    Works on the wide orientation (tall blocks are transposed and transposed back), computes in
    `dtype`, and returns a tensor of `G`'s dtype. With the "fixed" set the singular values land
    in roughly [0.7, 1.1] rather than exactly 1, which is what Muon wants: speed over precision.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: expected [..., rows, cols], got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz: steps must be >= 1, got {steps}")
    schedule = resolve_coefficients(coefficients)
    lead = G.shape[:-2]
    X = G.to(dtype)
    # Blocks go through addmm (2-D) or baddbmm (3-D), the same fused kernels torch.optim.Muon
    # uses, so bf16 rounding matches it.
    X = X.reshape(-1, *G.shape[-2:]) if G.ndim > 3 else X
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for i in range(steps):
        a, b, c = schedule[min(i, len(schedule) - 1)]
        A = X @ X.mT
        B = mm(A, A, A, beta=b, alpha=c)
        X = mm(X, B, X, beta=a)
    if tall:
        X = X.mT
    X = X.reshape(*lead, *X.shape[-2:]) if G.ndim > 3 else X
    return X.to(G.dtype)


def orthogonalize_blocks(
    G: torch.Tensor,
    num_blocks: int,
    steps: int = 5,
    coefficients: str | Coefficients = "fixed",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Orthogonalize a fused `[num_blocks * out, in]` matrix as `num_blocks` separate blocks."""
    rows, cols = G.shape
    if num_blocks < 1 or rows % num_blocks:
        raise ValueError(f"num_blocks={num_blocks} must divide the {rows} rows of {tuple(G.shape)}")
    if num_blocks == 1:
        return newton_schulz(G, steps, coefficients, dtype, eps)
    out = newton_schulz(
        G.reshape(num_blocks, rows // num_blocks, cols), steps, coefficients, dtype, eps
    )
    return out.reshape(rows, cols)
