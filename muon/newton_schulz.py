"""Batched quintic Newton-Schulz orthogonalization: a pure function, no state.

Shapes: G_BRC is a batch of B blocks of R rows and C columns (any leading dims are the batch).
Each block is normalized by its own Frobenius norm, so fused expert weights viewed as
`[E, out, in]` are orthogonalized as E independent matrices.

Every variant applies, to each normalized singular value x, the composition of odd quintics
p_i(x) = a_i x + b_i x^3 + c_i x^5; they differ in the coefficients and in how the matrix
products are arranged:

- coefficients "fixed", "tuned" (named sets) or "polar_express" (derived in
  `muon.coefficients`);
- algorithm "standard": X <- a X + (b A + c A^2) X with A = X X^T, on the wide orientation;
- algorithm "gram": the same polynomial carried on the small m x m Gram matrix R = X X^T (for an
  m x n block, m < n): each step forms H = a I + b R + c R^2, accumulates Q <- H Q and updates
  R <- H R H, and X is multiplied once, at the end, by Q. A restart (X <- Q X, R <- X X^T, Q <- I)
  before the steps listed in `restarts` (default `GRAM_RESTARTS`) keeps the rounding errors of
  R from compounding. When the FLOP count (`muon.cost.ns_flops`) says Gram is not cheaper for
  a shape, the standard iteration runs instead, so "gram" is safe to ask for everywhere. In
  bf16 the updates of R can still lose the result when singular values span a wide range: a
  block whose output's largest singular value (a Krylov estimate on the output, from below)
  leaves the method's band by more than `GRAM_SLACK` is recomputed with the standard iteration
  (one host read per call, to learn which blocks), or, with `blowups=` (the optimizer's form),
  returned as zeros with its flag left on the device.
- algorithm "auto": "gram" on blocks of at least `GRAM_MIN_ROWS` x `GRAM_MIN_ROWS` where it needs
  fewer FLOPs, "standard" elsewhere (the optimizer's default).
- symmetric products: X X^T, R^2, H Q and H R H are symmetric; `symmetric=True` computes the
  upper block row and the lower-right block only and mirrors the rest (3/4 of the work).

Which iteration runs on a shape (`effective_algorithm`) and what it costs live in `muon.cost`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from muon.coefficients import Coefficients, band_top, resolve_coefficients
from muon.cost import (  # the algorithms and what they cost (`muon.cost`)
    GRAM_MIN_ROWS,  # noqa: F401 - `ns_algorithm="auto"`'s threshold, importable from here too
    GRAM_RESTARTS,
    check_algorithm,
    effective_algorithm,
    restart_segments,
)

# ----------------------------------------------------------------------------- kernels


def _mul(A, B, symmetric: bool, C=None, *, beta: float = 1.0, alpha: float = 1.0):
    """beta * C + alpha * A @ B (C optional), through the fused addmm/baddbmm kernels.

    With `symmetric` the product is known to be symmetric ([..., m, k] @ [..., k, m]): only the
    top h = m // 2 rows and the lower-right block are computed, the lower-left block is the
    mirror of the upper-right one."""
    if not symmetric:
        if C is None:
            return torch.matmul(A, B) if alpha == 1.0 else torch.matmul(A, B).mul_(alpha)
        return (torch.addmm if A.ndim == 2 else torch.baddbmm)(C, A, B, beta=beta, alpha=alpha)
    m = A.size(-2)
    h = m // 2
    out = torch.empty(*A.shape[:-1], B.size(-1), dtype=A.dtype, device=A.device)
    top, low = out[..., :h, :], out[..., h:, h:]
    if C is None:
        torch.matmul(A[..., :h, :], B, out=top)
        torch.matmul(A[..., h:, :], B[..., :, h:], out=low)
        if alpha != 1.0:
            top.mul_(alpha), low.mul_(alpha)
    else:
        mm = torch.addmm if A.ndim == 2 else torch.baddbmm
        mm(C[..., :h, :], A[..., :h, :], B, beta=beta, alpha=alpha, out=top)
        mm(C[..., h:, h:], A[..., h:, :], B[..., :, h:], beta=beta, alpha=alpha, out=low)
    out[..., h:, :h] = top[..., h:].mT
    return out


def _standard(X: torch.Tensor, schedule, steps: int, symmetric: bool) -> torch.Tensor:
    # Blocks go through addmm (2-D) or baddbmm (3-D), the same fused kernels torch.optim.Muon
    # uses, so bf16 rounding matches it.
    mm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for i in range(steps):
        a, b, c = schedule[min(i, len(schedule) - 1)]
        A = _mul(X, X.mT, symmetric)
        B = _mul(A, A, symmetric, A, beta=b, alpha=c)
        X = mm(X, B, X, beta=a)
    return X


def gram_iteration(
    X: torch.Tensor, schedule, steps: int, symmetric: bool, restarts
) -> torch.Tensor:
    """Gram Newton-Schulz of the normalized wide blocks `X`."""
    # H = a I + K with K = b R + c R^2 keeps a out of the low-precision matrix K (a ~ 3 next to
    # diagonal entries ~ 1/m would lose their digits); the fused "beta * C + A @ B" kernels
    # (H Q = a Q + K Q, H R = a R + K R) add the identity part in their accumulator.
    for first, last in restart_segments(steps, restarts):
        R = _mul(X, X.mT, symmetric)
        Q = None
        for i in range(first, last):
            a, b, c = schedule[min(i, len(schedule) - 1)]
            K = _mul(R, R, symmetric, R, beta=b, alpha=c)
            if Q is None:
                Q = K.clone()
                Q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                Q = _mul(K, Q, symmetric, Q, beta=a)
            if i + 1 < last:  # R <- H (H R); the segment's last R is never read
                R = _mul(K, R, symmetric, R, beta=a)
                R = _mul(K, R, symmetric, R, beta=a)
        X = Q @ X
    return X


#: Gram outputs whose largest singular value exceeds the method's band by more than this are
#: recomputed with the standard iteration: the slack bf16 standard Newton-Schulz stays within
#: (tests/unit/test_newton_schulz.py), so a Gram block is kept only where it keeps that promise.
GRAM_SLACK = 0.04
#: Krylov (Lanczos) steps of the output check (`top_singular_value`)
CHECK_STEPS = 6


def top_singular_value(O: torch.Tensor) -> torch.Tensor:
    """Each block's largest singular value, estimated from below on the output itself.

    Rayleigh-Ritz on a `CHECK_STEPS`-dimensional Krylov space of O O^T (O is m x n, m <= n) from
    one seeded Gaussian vector: the basis V is orthonormalized in float32 (twice, so the
    projection T = V^T O O^T V is exact up to the matrix-vector products' rounding), and the
    largest eigenvalue of T never exceeds sigma_max^2, so a flagged block is truly out of band.
    No host sync: `_checked_gram` decides what to do with the flags.
    Krylov spaces find an isolated top eigenvalue far faster than power iteration: a direction
    at 1.25 among 256 at <= 1.13 is found to 1e-3 within 6 steps (the Chebyshev bound: its
    angle shrinks by T_5(1 + 2 gap)^2 ~ 1e5), where 8 power iterations read 1.14. Cost:
    2 * CHECK_STEPS matrix-vector products with O in O's dtype (a float32 copy of a bf16 O
    would double the bytes each product reads, and on a CPU batched float32 products with one
    vector were measured slower than bf16 ones), a shrinking share of the iteration for larger
    blocks (O(mn) against O(m^2 n)); every product one bmm or baddbmm call on 3-D views, so
    that a call dispatches few ops (matmul's broadcasting would add views around each). The
    output is checked, not the Gram-side factors: in bf16 the products Q R Q^T and Q X round
    differently, and a Gram-side estimate read 1.08 where the output's largest singular value
    was 1.47."""
    O_BRC = O.reshape(-1, *O.shape[-2:])  # a view: the products below are plain bmm calls
    Ot_BCR, m = O_BRC.mT, O.size(-2)
    v = _start_vector(m, O.device).expand(O_BRC.size(0), m, 1)
    basis, images = [v], []
    for i in range(min(CHECK_STEPS, m)):
        w = torch.bmm(O_BRC, torch.bmm(Ot_BCR, v.to(O.dtype))).float()  # O O^T v
        images.append(w)
        if i + 1 == min(CHECK_STEPS, m):  # the space is complete: no next basis vector
            break
        V = torch.cat(basis, dim=-1) if len(basis) > 1 else v
        Vt = V.mT
        for _ in range(2):  # classical Gram-Schmidt, twice ("twice is enough")
            w = torch.baddbmm(w, V, torch.bmm(Vt, w), alpha=-1)
        v = w / torch.linalg.vector_norm(w, dim=-2, keepdim=True).clamp(min=1e-30)
        basis.append(v)
    V, W = torch.cat(basis, dim=-1), torch.cat(images, dim=-1)
    T = torch.bmm(V.mT, W)
    T = ((T + T.mT) / 2).double().nan_to_num(nan=1e30, posinf=1e30, neginf=-1e30)
    top = _top_eigenvalue(T).clamp(min=0).sqrt().to(torch.float32)
    return top.reshape(O.shape[:-2])


#: (rows, device) -> the check's unit start vector `[rows, 1]`, float32
_START_VECTORS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _start_vector(m: int, device: torch.device) -> torch.Tensor:
    """The Krylov check's start vector: a seeded Gaussian direction, drawn on `device` once per
    row count and reused, so that a step neither draws it again nor needs a generator (which a
    CUDA graph would have to register) nor copies it from the host."""
    key = (m, torch.device(device))
    v = _START_VECTORS.get(key)
    if v is None:
        gen = torch.Generator(device=device).manual_seed(0)
        v = torch.randn(m, 1, generator=gen, device=device, dtype=torch.float32)
        v = _START_VECTORS.setdefault(key, v / v.norm())
    return v


def _top_eigenvalue(T: torch.Tensor, squarings: int = 10) -> torch.Tensor:
    """The largest eigenvalue of each small symmetric positive semi-definite T (float64), from
    below, without a host sync (torch.linalg.eigvalsh checks its result on the host): T^1024
    by repeated squaring, whose columns lie along the top eigenvector unless the top two
    eigenvalues are within ~1e-3 relative of each other (then either is the answer), and the
    largest Rayleigh quotient of those columns."""
    P = T
    for i in range(squarings):
        # scaled to Frobenius norm 1 before every other squaring: the largest eigenvalue of
        # the scaled P is at least 1/sqrt(k) of it (k <= CHECK_STEPS), so two squarings keep
        # it above 1/k^2 and below 1 (no overflow, no underflow of the direction sought)
        if i % 2 == 0:
            P = P / torch.linalg.matrix_norm(P, keepdim=True).clamp(min=1e-300)
        P = torch.bmm(P, P)
    quotients = (P * torch.bmm(T, P)).sum(-2) / (P * P).sum(-2).clamp(min=1e-300)
    return quotients.amax(-1)


def _checked_gram(X, schedule, steps, symmetric, restarts, blowups=None) -> torch.Tensor:
    """Gram Newton-Schulz with the output check: a block whose output leaves the band is
    recomputed by the standard iteration (one host read, to learn whether any did), or, when a
    `blowups` list is given, set to zeros with its flag appended to the list (no read)."""
    out = gram_iteration(X, schedule, steps, symmetric, restarts)
    bad = top_singular_value(out) > band_top(tuple(schedule), steps) + GRAM_SLACK
    if blowups is not None:
        blowups.append(bad.reshape(-1))
        return out.masked_fill_(bad[..., None, None], 0)
    if bad.any():
        if out.ndim == 2:
            return _standard(X, schedule, steps, symmetric)
        out[bad] = _standard(X[bad], schedule, steps, symmetric)
    return out


def _normalized(G: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    """Each block divided by its Frobenius norm (at least `eps`), in `dtype`.

    float16 flushes magnitudes below ~6e-8 to zero and overflows above 65504, so a float16
    iteration takes the norm and divides in float32 and casts the normalized block (entries
    <= 1): a float16 input's own norm passes 65504 at an RMS of 64 on a 1024 x 1024 block.
    Other dtypes cast first, as torch.optim.Muon does (bf16 has float32's range), so their
    rounding matches it."""
    norm_dims = dict(dim=(-2, -1), keepdim=True)
    if dtype == torch.float16:
        X = G.to(torch.promote_types(G.dtype, torch.float32))
        return (X / torch.linalg.vector_norm(X, **norm_dims).clamp(min=eps)).to(dtype)
    X = G.to(dtype)
    return X / torch.linalg.vector_norm(X, **norm_dims).clamp(min=eps)


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: str | Coefficients = "fixed",
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
    *,
    algorithm: str = "standard",
    symmetric: bool = False,
    restarts: Sequence[int] = GRAM_RESTARTS,
    blowups: list | None = None,
) -> torch.Tensor:
    """Approximately orthogonalize each `[rows, cols]` block of `G` (shape `[..., rows, cols]`).

    Works on the wide orientation (tall blocks are transposed and transposed back), computes in
    `dtype`, and returns a tensor of `G`'s dtype. With the "fixed" set the singular values land
    in roughly [0.7, 1.1] rather than exactly 1, which is what Muon wants: speed over precision.
    `algorithm="gram"` iterates on the Gram matrix where that needs fewer FLOPs (restarting
    before each step in `restarts`) and runs the standard iteration elsewhere; "auto" does so
    only on blocks of at least `GRAM_MIN_ROWS` rows and columns; `symmetric`
    computes symmetric products by halves (see the module docstring).

    A Gram block whose output leaves the band (`GRAM_SLACK`) is recomputed with the standard
    iteration, which needs one host read per call. `blowups`, a list, asks for the form without
    it: such a block is returned as zeros and one bool device tensor of the call's blocks
    (`[B]`, B the product of `G`'s leading dims, 1 for a matrix; True where a block blew up) is
    appended to the list when the Gram iteration ran (nothing when the standard one did). The
    caller must then act on the flags; `muon.Muon` refuses that step's update of the parameter
    and runs the standard iteration on the batch from the next step on.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: expected [..., rows, cols], got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz: steps must be >= 1, got {steps}")
    schedule = resolve_coefficients(coefficients)
    check_algorithm(algorithm)
    lead = G.shape[:-2]
    X = _normalized(G, dtype, eps)
    X = X.reshape(-1, *G.shape[-2:]) if G.ndim > 3 else X
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    rows, cols = G.shape[-2:]
    if (
        effective_algorithm(rows, cols, steps, algorithm, symmetric=symmetric, restarts=restarts)
        == "gram"
    ):
        X = _checked_gram(X, schedule, steps, symmetric, restarts, blowups)
    else:
        X = _standard(X, schedule, steps, symmetric)
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
    **variant,
) -> torch.Tensor:
    """Orthogonalize a fused `[num_blocks * out, in]` matrix as `num_blocks` separate blocks.

    `variant` holds `newton_schulz`'s keyword-only options (algorithm, symmetric, restarts,
    blowups: its flags are then `[num_blocks]`)."""
    rows, cols = G.shape
    if num_blocks < 1 or rows % num_blocks:
        raise ValueError(f"num_blocks={num_blocks} must divide the {rows} rows of {tuple(G.shape)}")
    if num_blocks == 1:
        return newton_schulz(G, steps, coefficients, dtype, eps, **variant)
    out = newton_schulz(
        G.reshape(num_blocks, rows // num_blocks, cols), steps, coefficients, dtype, eps, **variant
    )
    return out.reshape(rows, cols)
