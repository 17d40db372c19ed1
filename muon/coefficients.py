"""The coefficients of Newton-Schulz's odd quintics: the named sets, the Polar Express schedule
derived from its paper's rule, the check of a user's set, and the band its composed map keeps
singular values in (`band_top`). Pure functions of numbers: no tensor of a model passes here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

import torch

from muon.cost import NS_ALGORITHMS, check_algorithm

Coefficients = Sequence[tuple[float, float, float]]
Triple = tuple[float, float, float]

# Polar Express (Amsel, Persson, Musco, Gower, 2025: "The Polar Express: Optimal Matrix Sign
# Methods and Their Application to the Muon Algorithm"). Each step is the odd quintic that best
# approximates 1, in the max norm, on the interval [l, u] the singular values are known to lie in
# after the previous steps. The paper's choices for bf16 Muon:
PE_LOWER = 1e-3  # smallest normalized singular value the schedule is built for
PE_CUSHION = 0.02407327424182761  # fit intervals below this fraction of u are fitted on [cu, u]
PE_SAFETY = 1.01  # each step is applied as p(x / 1.01): rounding may push x slightly above u
PE_STEPS = 8  # schedule length; steps beyond it repeat the last (converged) quintic


def _minimax_quintic(lo: float, hi: float) -> Triple:
    """The odd quintic a x + b x^3 + c x^5 minimizing max |1 - p(x)| over [lo, hi].

    Remez exchange: the optimum equioscillates at lo, two interior extrema q < r, and hi
    (p = 1 - E, 1 + E, 1 - E, 1 + E); solve the 4x4 system for (a, b, c, E), move q and r to the
    roots of p'(x) = a + 3 b x^2 + 5 c x^4, repeat until E settles.
    """
    if hi - lo <= 1e-6 * hi:
        # The interval has collapsed onto hi: the limit of the optimum is the quintic with
        # p(hi) = 1 and p'(hi) = p''(hi) = 0, i.e. (15 t - 10 t^3 + 3 t^5) / 8 with t = x / hi.
        return (15 / 8 / hi, -10 / 8 / hi**3, 3 / 8 / hi**5)
    q, r = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    err = math.inf
    for _ in range(100):
        x = torch.tensor([lo, q, r, hi], dtype=torch.float64)
        system = torch.stack([x, x**3, x**5, signs], dim=1)
        a, b, c, new_err = torch.linalg.solve(system, torch.ones(4, dtype=torch.float64)).tolist()
        root = math.sqrt(b * b * 9 - 20 * a * c)
        q, r = sorted(math.sqrt((-3 * b + s * root) / (10 * c)) for s in (-1.0, 1.0))
        if abs(new_err - err) < 1e-15:
            break
        err = new_err
    return (a, b, c)


@cache
def polar_express_coefficients(
    steps: int = PE_STEPS,
    lower: float = PE_LOWER,
    cushion: float = PE_CUSHION,
    safety: float = PE_SAFETY,
) -> tuple[Triple, ...]:
    """Derive the Polar Express schedule: `steps` minimax-optimal quintics, greedily composed.

    Start from singular values in [lower, 1] (Frobenius normalization guarantees <= 1). Step i
    fits the best quintic on [max(l, cushion u), u], rescales it so that p(l) and p(u) sit
    symmetrically around 1, and the next interval is [p(l), 2 - p(l)]. The cushion stops the
    first steps from chasing tiny singular values with huge coefficients. Every step is then
    applied as p(x / safety), so a singular value that bf16 rounding left slightly above the
    interval is still mapped inside it.
    """
    lo, hi = lower, 1.0
    out = []
    for _ in range(steps):
        a, b, c = _minimax_quintic(max(lo, cushion * hi), hi)
        scale = 2 / (a * (lo + hi) + b * (lo**3 + hi**3) + c * (lo**5 + hi**5))
        a, b, c = a * scale, b * scale, c * scale
        lo = a * lo + b * lo**3 + c * lo**5
        hi = 2 - lo
        out.append((a / safety, b / safety**3, c / safety**5))
    return tuple(out)


#: Named coefficient sets. "fixed" repeats one triple (torch.optim.Muon's default); "tuned" is a
#: per-iteration schedule whose later steps pull singular values closer to 1; "polar_express" is
#: derived by `polar_express_coefficients`. Steps beyond a schedule's length reuse its last triple.
NS_COEFFICIENTS: dict[str, tuple[Triple, ...]] = {
    "fixed": ((3.4445, -4.7750, 2.0315),),
    "tuned": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": polar_express_coefficients(),
}


def resolve_coefficients(
    coefficients: str | Coefficients,
) -> tuple[Triple, ...]:
    """Turn a coefficient-set name or an explicit list of (a, b, c) triples into a tuple."""
    if isinstance(coefficients, str):
        if coefficients not in NS_COEFFICIENTS:
            raise ValueError(
                f"ns_coefficients: unknown set {coefficients!r}; allowed: "
                f"{sorted(NS_COEFFICIENTS)} or a list of (a, b, c) triples"
            )
        return NS_COEFFICIENTS[coefficients]

    def real(x) -> bool:  # a bool or a string is a typo; NaN or an infinity poisons every update
        return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)

    if not isinstance(coefficients, (list, tuple)) or not all(
        isinstance(t, (list, tuple)) and len(t) == 3 and all(map(real, t)) for t in coefficients
    ):
        raise ValueError(
            "ns_coefficients: expected a name or a non-empty list of (a, b, c) triples of finite "
            f"numbers, got {coefficients!r}"
        )
    triples = tuple(tuple(float(x) for x in t) for t in coefficients)
    if not triples:
        raise ValueError(
            f"ns_coefficients: expected a non-empty list of (a, b, c) triples, got {coefficients!r}"
        )
    return triples  # type: ignore[return-value]


def parse_variant(text: str) -> dict[str, str]:
    """ "COEFFICIENTS,ALGORITHM" (e.g. "fixed,standard", a command-line spelling) as the
    `muon.Muon` keywords `ns_coefficients` and `ns_algorithm`, each validated."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(
            f"ns variant {text!r}: expected COEFFICIENTS,ALGORITHM with COEFFICIENTS one of "
            f"{sorted(NS_COEFFICIENTS)} and ALGORITHM one of {', '.join(NS_ALGORITHMS)}"
        )
    resolve_coefficients(parts[0])
    return {"ns_coefficients": parts[0], "ns_algorithm": check_algorithm(parts[1])}


@cache
def band_top(schedule: tuple[Triple, ...], steps: int) -> float:
    """The largest value the composed scalar map reaches on [0, 1]: in exact arithmetic no
    output singular value of `steps` steps exceeds it. A 1025-point grid, refined three times
    around its best point, in Python floats: it first runs inside a step, where a tensor's
    read would be a host read."""

    def composed(x: float) -> float:
        for i in range(steps):
            a, b, c = schedule[min(i, len(schedule) - 1)]
            x = a * x + b * x**3 + c * x**5
        return x

    lo, hi, best, n = 0.0, 1.0, -math.inf, 1024
    for _ in range(4):
        x = [lo + (hi - lo) * i / n for i in range(n + 1)]
        y = [composed(v) for v in x]
        k = max(range(n + 1), key=y.__getitem__)
        best = max(best, y[k])
        lo, hi = x[max(k - 1, 0)], x[min(k + 1, n)]
    return best
