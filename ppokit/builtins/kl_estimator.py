"""Catalogue of the built-in kl_estimator components (torch-free)."""

from __future__ import annotations

from pydantic import Field

from ppokit.builtins._base import Params
from ppokit.hookspecs import Register

MODULE = "ppokit.components.kl_estimator"
SOURCE = "Approximating KL Divergence (J. Schulman, 2020), http://joschu.net/blog/kl-approx.html"


class KLParams(Params):
    straight_through: bool = Field(
        False, description="keep the value, take the gradient of k2 (logp - logp_ref)"
    )


ESTIMATORS = (
    ("k1", "K1", "Log-ratio: unbiased, high variance", "k1 = logp - logp_ref"),
    ("k2", "K2", "Half squared log-ratio: biased, low variance", "k2 = 0.5 (logp - logp_ref)^2"),
    (
        "k3",
        "K3",
        "exp(d) - d - 1: unbiased and non-negative",
        "k3 = clamp(exp(d) - d - 1, 0, 10), d = clamp(logp_ref - logp, -20, 20)",
    ),
    ("abs", "AbsKL", "Absolute log-ratio", "|logp - logp_ref|"),
)


def register_components(register: Register) -> None:
    for name, cls, summary, formula in ESTIMATORS:
        register(
            "kl_estimator",
            name,
            f"{MODULE}:{cls}",
            params=KLParams,
            summary=summary,
            formula=formula + "; straight_through: value + k2 - sg(k2) with sg(value)",
            requires=("logp_ref",),
            source=SOURCE,
        )
