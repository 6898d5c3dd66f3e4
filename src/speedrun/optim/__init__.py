"""Optimizers: Muon for weight matrices (see ``speedrun.optim.muon``) and its orthogonalization backends."""

from speedrun.optim.muon import SHAPE_SCALES, Muon, muon_split, set_muon_split
from speedrun.optim.orthogonalize import (
    BACKENDS,
    NS_COEFFICIENTS,
    NS_FORMS,
    POLAR_EXPRESS_COEFFICIENTS,
    newton_schulz,
    orthogonalize,
    polar_express,
    svd_orthogonalize,
)

__all__ = [
    "BACKENDS",
    "NS_COEFFICIENTS",
    "NS_FORMS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "SHAPE_SCALES",
    "Muon",
    "muon_split",
    "newton_schulz",
    "orthogonalize",
    "polar_express",
    "set_muon_split",
    "svd_orthogonalize",
]
