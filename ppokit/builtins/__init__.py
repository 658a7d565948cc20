"""The built-in components: ppokit's default plugin.

It is registered through the same ``ppokit_register`` hook as any installed plugin. Each
module here is the torch-free catalogue of one kind (params models, summaries, formulas,
requirements); the math lives in ``ppokit.components.<kind>`` (``ppokit.rewards`` for
rewards) and is imported only when a component is created.
"""

from __future__ import annotations

from ppokit.builtins import (
    advantage,
    aggregation,
    critic_target,
    kl_estimator,
    policy_loss,
    position_mask,
    prompt_weight,
    regression_loss,
    reward,
    truncation,
)
from ppokit.hookspecs import Register, hookimpl

CATALOGUES = (
    reward,
    truncation,
    kl_estimator,
    advantage,
    critic_target,
    position_mask,
    prompt_weight,
    regression_loss,
    policy_loss,
    aggregation,
)


@hookimpl
def ppokit_register(register: Register) -> None:
    for catalogue in CATALOGUES:
        catalogue.register_components(register)
