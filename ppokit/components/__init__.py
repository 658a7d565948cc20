"""The built-in components, one package per kind: ppokit's default plugin.

Each ``ppokit.components.<kind>`` package holds, side by side, the torch-free catalogue of
its kind (the call convention as a ``typing.Protocol``, the params models and one
:class:`~ppokit.catalogue.Component` entry per component, in ``__init__.py``) and the tensor
code (``impl.py``, imported only when a component is created). This module registers every
entry through the same ``ppokit_register`` hook as an installed plugin, and with them the
built-in variants (:mod:`ppokit.variants`) and tasks (:mod:`ppokit.tasks`).

Nothing here imports torch.
"""

from __future__ import annotations

import importlib

from ppokit.components.advantage import Advantage
from ppokit.components.aggregation import Aggregation
from ppokit.components.critic_target import CriticTarget
from ppokit.components.environment import Environment
from ppokit.components.group_filter import GroupFilter
from ppokit.components.kl_estimator import KLEstimator
from ppokit.components.policy_loss import PolicyLoss
from ppokit.components.position_mask import PositionMask
from ppokit.components.prompt_source import PromptSourceFactory
from ppokit.components.prompt_weight import PromptWeight
from ppokit.components.regression_loss import RegressionLoss
from ppokit.components.reward import Reward
from ppokit.components.rollout_correction import RolloutCorrection
from ppokit.components.rollout_engine import RolloutEngine
from ppokit.components.truncation import Truncation
from ppokit.hookspecs import Register, hookimpl
from ppokit.slots import KINDS

__all__ = [
    "KIND_PACKAGES",
    "Advantage",
    "Aggregation",
    "CriticTarget",
    "Environment",
    "GroupFilter",
    "KLEstimator",
    "PolicyLoss",
    "PositionMask",
    "PromptSourceFactory",
    "PromptWeight",
    "RegressionLoss",
    "Reward",
    "RolloutCorrection",
    "RolloutEngine",
    "Truncation",
    "ppokit_register",
]

#: The kind packages, one per kind, in the order a PPO round uses them.
KIND_PACKAGES = tuple(importlib.import_module(f"ppokit.components.{kind}") for kind in KINDS)


@hookimpl
def ppokit_register(register: Register) -> None:
    from ppokit import tasks, variants

    for package in KIND_PACKAGES:
        for entry in package.ENTRIES:
            register(entry)
    for entry in tasks.COMPONENTS:
        register(entry)
    for variant in variants.ENTRIES:
        register(variant)
    for task in tasks.ENTRIES:
        register(task)
