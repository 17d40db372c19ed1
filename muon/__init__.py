"""Distributed Muon: Newton-Schulz orthogonalization of sharded matrices, plus AdamW groups."""

from muon.coefficients import NS_COEFFICIENTS
from muon.groups import param_groups
from muon.newton_schulz import newton_schulz, orthogonalize_blocks
from muon.optimizer import Muon

__all__ = ["Muon", "param_groups", "newton_schulz", "orthogonalize_blocks", "NS_COEFFICIENTS"]
