"""The plugin's catalogue: the ``hlgauss`` regression loss's params and entry, and the
``ppo_hlgauss`` variant that uses it. Torch-free: the math (``ppokit_hlgauss.loss``) is
imported only when a run creates the component."""

from __future__ import annotations

from pydantic import Field, model_validator

import ppokit
from ppokit.hookspecs import Register


class HLGaussParams(ppokit.Params):
    """Parameters of the HL-Gauss critic loss."""

    bins: int = Field(51, ge=2, le=4096, description="number of value bins K")
    vmin: float = Field(-1.0, description="lower edge of the value support")
    vmax: float = Field(1.0, description="upper edge of the value support")
    sigma_ratio: float = Field(
        0.75, gt=0, description="Gaussian width in bin widths (sigma = ratio * (vmax - vmin) / K)"
    )

    @model_validator(mode="after")
    def _support(self) -> HLGaussParams:
        if not self.vmax > self.vmin:
            raise ValueError(f"vmax must be greater than vmin, got [{self.vmin}, {self.vmax}]")
        return self


PAPER = (
    "Stop Regressing: Training Value Functions via Classification for Scalable Deep RL "
    "(Farebrother et al., 2024), arXiv:2403.03950"
)

HLGAUSS = ppokit.Component(
    "regression_loss",
    "hlgauss",
    "ppokit_hlgauss.loss",
    params=HLGaussParams,
    summary="Distributional critic: cross-entropy to a Gaussian-smoothed histogram target",
    formula=(
        "p_k(Y) = [Phi((z_{k+1} - Y)/sigma) - Phi((z_k - Y)/sigma)] / "
        "[Phi((z_K - Y)/sigma) - Phi((z_0 - Y)/sigma)];  "
        "l = -sum_k p_k(Y) log softmax(h)_k;  V = sum_k softmax(h)_k c_k"
    ),
    source=PAPER,
)

PPO_HLGAUSS = ppokit.Variant(
    "ppo_hlgauss",
    "GAE-PPO with a distributional (HL-Gauss) critic",
    {
        "critic": {
            "loss": {"name": "hlgauss", "bins": 51, "vmin": -0.5, "vmax": 1.5, "sigma_ratio": 0.75}
        },
        "train": {"rounds": 80, "lr_schedule": "constant", "min_lr_ratio": 0.0},
    },
    papers=(PAPER,),
    choices="the value head has 51 outputs, logits over 51 bins covering [-0.5, 1.5] (the "
    "demo's returns lie in [0, 1] with gamma 1, plus a margin of half the range on each side); "
    "each target Y is spread over the bins by a Gaussian of sigma = 0.75 bin widths; the critic "
    "is trained with the cross-entropy to that histogram; the value is read as the expectation "
    "over bin centres. Everything else is the demo's PPO (the ppo_demo variant it extends).",
    scaled="80 rounds of the demo's PPO at a constant learning rate: the support [-0.5, 1.5] "
    "fits the demo's returns in [0, 1].",
    base="ppo_demo",
)


@ppokit.hookimpl
def ppokit_register(register: Register) -> None:
    register(HLGAUSS)
    register(PPO_HLGAUSS)
