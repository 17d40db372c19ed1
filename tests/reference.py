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
