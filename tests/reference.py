"""Independent float64 references shared by the optimizer tests."""


def ref_ns(G, coefficients, steps=5, eps=1e-7):
    """float64 reference of the spec's Newton-Schulz on [..., rows, cols]."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for i in range(steps):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X


# Comparing one optimizer step taken on two layouts (or with two gradient summation orders),
# Newton-Schulz in float32. The gradients differ by a few float32 ulps (2^-24 ~ 6e-8 relative
# each; allow 16). Newton-Schulz amplifies a perturbation at most by the slope of its composed
# scalar map at small singular values, the product of the steps' linear coefficients a_i:
# 3.4445^5 ~ 485 for "fixed", ~ 976 for "polar_express" (the default; Gram Newton-Schulz computes
# the same polynomial). So the Muon update differs by at most 976 * 16 * 2^-24 ~ 9.3e-4 of its
# size; AdamW's elementwise update and the optimizer's float32 moments do not amplify. Hence
# 2e-3 of each tensor's own change in the step; the second term (4 float32 eps of the value)
# covers tensors that the step leaves unchanged. bf16 Newton-Schulz (2^-8 rounding, the same
# amplification) admits no bound below the update itself.
def ns_amplification(coefficients: str = "polar_express", steps: int = 5) -> float:
    """Product of the linear coefficients of a Newton-Schulz schedule's first `steps` steps."""
    import math

    from muon.coefficients import resolve_coefficients

    schedule = resolve_coefficients(coefficients)
    return math.prod(schedule[min(i, len(schedule) - 1)][0] for i in range(steps))


STEP_CHANGE_RTOL = 2 * ns_amplification() * 16 * 2.0**-24  # ~1.9e-3


def assert_same_step(before: dict, a: dict, b: dict) -> None:
    """`a` and `b` (name -> numpy array) are one step from `before` on two layouts: equal within
    STEP_CHANGE_RTOL of each tensor's change, plus float32 rounding of its value."""
    import numpy as np

    eps = float(np.finfo(np.float32).eps)
    for key, value in b.items():
        if value.dtype == bool:  # a flag (Muon's `gram_demoted`): the same on both layouts
            assert np.array_equal(a[key], value), key
            continue
        change = float(np.abs(value - before[key]).max())
        bound = STEP_CHANGE_RTOL * change + 4 * eps * float(np.abs(value).max())
        diff = float(np.abs(a[key] - value).max())
        assert diff <= bound, f"{key}: |a - b| = {diff:.3g} > {bound:.3g} (change {change:.3g})"
