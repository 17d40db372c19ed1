"""Byte units, written once for recipes/ and scripts/ (standard library only: the torch-free
config reads them too). muon/ and models/ keep their own one-line constants: they cannot import
recipes/."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def mib(n_bytes: float) -> float:
    """`n_bytes` in MiB."""
    return n_bytes / MiB


def gib(n_bytes: float) -> float:
    """`n_bytes` in GiB."""
    return n_bytes / GiB
