"""The declarative spec: which component fills each slot, plus model, data, rollout,
training and output settings.

A component slot takes a name (``advantage: gae``) or a mapping with the name and its
parameters (``advantage: {name: gae, lam: 0.95}``). Validation runs in two passes and
reports every error at once, each with its path in the spec (after a named variant and task
are merged under the file: :mod:`ppokit.spec.compose`):

1. structure (pydantic, ``extra="forbid"`` everywhere);
2. components: each name against the registry (with close-name suggestions), its parameters
   against the component's params model, and cross-slot requirements (an estimator that
   needs values needs a critic, a group estimator needs ``rollout.n >= 2``, ...).

Nothing here imports torch or transformers.
"""

from ppokit.spec.checks import MAX_ROUND_POSITIONS, spec_warnings, validate_spec
from ppokit.spec.compose import (
    DEFAULT_TASK,
    Composed,
    annotated_yaml,
    compose,
    leaf_values,
    leaves,
    load_spec,
    named_spec,
    spec_mapping,
)
from ppokit.spec.files import (
    DEMO_SOURCE,
    DEMO_SPEC,
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    MAX_SPEC_NODES,
    parse_spec_text,
    read_demo_spec,
    read_spec_file,
)
from ppokit.spec.models import (
    CPU_BF16_MIN_PARAMETERS,
    MAX_REWARD_WEIGHT,
    ArithmeticOptions,
    ComponentSpec,
    CriticSpec,
    DataSpec,
    DemoOptions,
    EvalSpec,
    HealthSpec,
    KLSpec,
    LoraSpec,
    ModelSpec,
    OutputSpec,
    ParallelSpec,
    PolicySpec,
    RewardSpec,
    RolloutSpec,
    Spec,
    SpecError,
    TinySpec,
    TrainSpec,
)
from ppokit.spec.overrides import apply_overrides

__all__ = [
    "CPU_BF16_MIN_PARAMETERS",
    "DEFAULT_TASK",
    "DEMO_SOURCE",
    "DEMO_SPEC",
    "MAX_REWARD_WEIGHT",
    "MAX_ROUND_POSITIONS",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_DEPTH",
    "MAX_SPEC_NODES",
    "ArithmeticOptions",
    "ComponentSpec",
    "Composed",
    "CriticSpec",
    "DataSpec",
    "DemoOptions",
    "EvalSpec",
    "HealthSpec",
    "KLSpec",
    "LoraSpec",
    "ModelSpec",
    "OutputSpec",
    "ParallelSpec",
    "PolicySpec",
    "RewardSpec",
    "RolloutSpec",
    "Spec",
    "SpecError",
    "TinySpec",
    "TrainSpec",
    "annotated_yaml",
    "apply_overrides",
    "compose",
    "leaf_values",
    "leaves",
    "load_spec",
    "named_spec",
    "parse_spec_text",
    "read_demo_spec",
    "read_spec_file",
    "spec_mapping",
    "spec_warnings",
    "validate_spec",
]
