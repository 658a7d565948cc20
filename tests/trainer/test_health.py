"""The signs of an unhealthy run (docs/health.md): each sign fires beyond its threshold and
not at it, after ``health.rounds`` rounds in a row, warns once when it starts; a constant
reward and a collapsed entropy fire theirs on the tiny model, and the demo fires none (a
skipped weight push fires the mismatch sign in test_vllm.py, with the other runs that start
vLLM in the test process)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ppokit.metrics_table import metric
from ppokit.spec import HealthSpec, Spec, SpecError, load_spec
from ppokit.trainer import train
from ppokit.trainer.display import health_line
from ppokit.trainer.health import SIGNS, check, fired_signs, warning
from ppokit.trainer.metrics import read_metrics
from tests.helpers.trainer import DEMO, small_spec

ROOT = Path(__file__).resolve().parents[2]
LEVEL = [s for s in SIGNS if s.name not in ("grad_spike", "stale_push", "flat_reward")]


def _health(**settings: Any) -> HealthSpec:
    return HealthSpec(**{"rounds": 1, **settings})


def _names(record: dict[str, Any], history: list[dict[str, Any]], health: HealthSpec) -> set:
    return {f.sign.name for f in check(record, history, health)}


# ---------------------------------------------------------------------- the pure module
@pytest.mark.parametrize("sign", LEVEL, ids=lambda s: s.name)
def test_a_sign_fires_beyond_its_threshold_and_not_at_it(sign) -> None:
    health = _health()  # the defaults, each sign on its own round
    threshold = getattr(health, sign.name)
    beyond = threshold + 0.05 if sign.above else threshold / 2
    assert _names({"round": 1, sign.metric: threshold}, [], health) == set()
    assert _names({"round": 1, sign.metric: beyond}, [], health) == {sign.name}
    assert _names({"round": 1, sign.metric: None}, [], health) == set()  # no value
    assert _names({"round": 1, sign.metric: beyond}, [], _health(**{sign.name: None})) == set()
    assert _names({"round": 1, sign.metric: beyond}, [], _health(enabled=False)) == set()


def test_the_gradient_spike_is_relative_to_the_recent_median() -> None:
    health = _health(grad_window=3)  # grad_spike 10: above 10 times the median
    history = [{"round": r, "grad_norm_actor": v} for r, v in enumerate([5.0, 1.0, 1.0, 2.0])]
    assert _names({"round": 5, "grad_norm_actor": 10.0}, history, health) == set()  # median 1
    assert _names({"round": 5, "grad_norm_actor": 10.5}, history, health) == {"grad_spike"}
    # fewer rounds than the window, or a median of 0: not evaluated
    assert _names({"round": 3, "grad_norm_actor": 99.0}, history[:2], health) == set()
    zeros = [{"round": r, "grad_norm_actor": 0.0} for r in range(1, 4)]
    assert _names({"round": 4, "grad_norm_actor": 99.0}, zeros, health) == set()


def test_stale_rows_leave_the_mismatch_sign_out() -> None:
    """Asynchronous rollouts: μ is the weights of earlier updates by design, so a round whose
    rows are stale does not fire the mismatch sign; one whose rows are fresh does."""
    health = _health()
    gap = {"round": 2, "rollout/mismatch_k3": 0.5}
    assert _names({**gap, "rollout/staleness_max": 1.0}, [], health) == set()
    assert _names({**gap, "rollout/staleness_max": 0.0}, [], health) == {"mismatch"}


def test_a_sign_fires_after_its_rounds_in_a_row_and_starts_once() -> None:
    health = _health(rounds=3)
    bad, good = {"entropy": 0.0001}, {"entropy": 1.0}
    rounds = [bad, bad, good, bad, bad, bad, bad, good, bad]
    history: list[dict[str, Any]] = [{"round": 0, "eval/accuracy": 0.5}]  # round 0: skipped
    seen = []
    for r, values in enumerate(rounds, start=1):
        record = {"round": r, **values}
        fired = check(record, history, health)
        seen.append("".join("S" if f.started else "F" for f in fired) or ".")
        history.append({**record, **{f.sign.key: 1.0 for f in fired}})
    assert "".join(seen) == ".....SF.."  # rounds 6 (the third bad in a row) and 7
    assert fired_signs(history) == {"entropy": (6, 2)}
    assert health_line(history) == "health: entropy from round 6 (2 rounds): see docs/health.md"
    assert health_line(history[:5]) == ""


def _rewards(means: list[float], std_from: int) -> list[dict[str, Any]]:
    """Training records with these reward means; every response alike from ``std_from``
    (1-based) on, as when each group's responses all score the same."""
    return [
        {
            "round": i,
            "reward_mean": m,
            "reward_std": 0.0 if i >= std_from else 0.3,
            "rollout/zero_variance_groups": 1.0 if i >= std_from else 0.2,
        }
        for i, m in enumerate(means, start=1)
    ]


@pytest.mark.parametrize(
    ("means", "std_from", "quiet"),
    [
        ([0.2, 0.5, 0.9, 1.0, 1.0, 1.0], 4, True),  # rose to its best and stays: solved
        ([1.0, 1.0, 1.0, 1.0], 1, False),  # never moved: no signal
        ([0.0, 0.0, 0.0, 0.0], 1, False),  # never moved, at 0
        ([0.3, 0.6, 0.0, 0.0, 0.0], 3, False),  # fell to a constant: broken, not solved
        ([0.2, 0.9, 0.7, 0.7, 0.7], 3, False),  # constant below its best round
    ],
)
def test_a_solved_task_is_told_apart_from_no_signal(
    means: list[float], std_from: int, quiet: bool
) -> None:
    records = _rewards(means, std_from)
    health = _health(rounds=2)
    fired = {f.sign.name for f in check(records[-1], records[:-1], health)}
    no_signal = {"constant_reward", "zero_variance"}
    assert (not (fired & no_signal)) if quiet else no_signal <= fired


def _flat(means: list[float], **more: float) -> list[dict[str, Any]]:
    return [{"round": r, "reward_mean": m, **more} for r, m in enumerate(means, start=1)]


def _fired_flat(records: list[dict[str, Any]], total: int, rounds: int = 5) -> list[int]:
    """The rounds on which flat_reward fires over ``records``, a run of ``total`` rounds."""
    health = _health(rounds=rounds)
    return [
        r["round"]
        for i, r in enumerate(records)
        if any(f.sign.name == "flat_reward" for f in check(r, records[:i], health, total))
    ]


NOISE = [0.31, 0.27, 0.33, 0.29, 0.30, 0.28, 0.32, 0.30, 0.27, 0.31, 0.29, 0.33, 0.30, 0.28]


def test_a_flat_reward_fires_from_a_quarter_of_the_run_and_names_its_causes() -> None:
    still = _flat(
        NOISE,
        **{"rollout/zero_variance_groups": 0.8, "approx_kl": 1e-8, "grad_norm_actor": 0.5},
        truncated_frac=1.0,
    )
    # from round 6 (a quarter of 24 rounds), held for 5 rounds: fires from round 10
    assert _fired_flat(still, total=24) == [10, 11, 12, 13, 14]
    assert _fired_flat(still, total=32) == [12, 13, 14]  # a quarter of 32: round 8 on
    assert _fired_flat(still, total=400) == []  # a quarter: not yet
    health = _health(rounds=5)
    (fired,) = [f for f in check(still[9], still[:9], health, 24) if f.sign.name == "flat_reward"]
    line = warning(fired, health)
    assert line.startswith("health: the slope of reward_mean over the rounds so far, ")
    assert "below health.flat_reward (2) for 5 rounds; likely: no variance in groups: 80%" in line
    assert "approx_kl 1e-08 per token with grad_norm_actor 0.5" in line
    assert "100% of responses cut" in line and line.endswith("see docs/health.md#flat_reward")
    off = _health(rounds=5, truncated=None)
    (quiet,) = [f for f in check(still[9], still[:9], off, 24) if f.sign.name == "flat_reward"]
    assert "truncated" not in warning(quiet, off)  # the truncated sign is off: not a cause
    plain = _flat(NOISE, approx_kl=1e-3, grad_norm_actor=0.5)
    (unknown,) = [f for f in check(plain[9], plain[:9], health, 24) if f.sign.name == "flat_reward"]
    assert "none of those it measures" in warning(unknown, health)
    assert _fired_flat(_flat([0.0] * 14), total=24)[0] == 10  # never moved at all


@pytest.mark.parametrize(
    "means",
    [
        [0.006, 0.012, 0.016, 0.016, 0.022, 0.020, 0.023, 0.029, 0.059, 0.035, 0.051, 0.078],
        [0.2, 0.5, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # solved
        [0.9, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.05, 0.0, 0.0],  # falls: not flat
    ],
)
def test_a_reward_that_moves_fires_no_flat_reward(means: list[float]) -> None:
    """The demo's first 12 rounds (a slow start), a task solved on the way, a collapse."""
    stds = [0.0 if m == 1.0 else 0.1 for m in means]
    records = [{**r, "reward_std": s} for r, s in zip(_flat(means), stds, strict=True)]
    assert _fired_flat(records, total=len(means), rounds=2) == []


def test_the_warning_names_the_metric_the_setting_and_the_page() -> None:
    health = _health(rounds=5)
    entropy = next(s for s in SIGNS if s.name == "entropy")
    history = [{"round": r, "entropy": 0.0004} for r in range(1, 5)]
    (fired,) = check({"round": 5, "entropy": 0.00042}, history, health)
    assert fired.started and fired.sign == entropy
    assert warning(fired, health) == (
        "health: entropy 0.00042 below health.entropy (0.001) for 5 rounds: "
        "see docs/health.md#entropy"
    )


def test_every_sign_has_a_setting_a_metric_row_and_a_section_of_the_page() -> None:
    page = (ROOT / "docs" / "health.md").read_text(encoding="utf-8")
    settings = set(HealthSpec.model_fields) - {"enabled", "rounds", "grad_window"}
    assert {s.name for s in SIGNS} == settings
    for sign in SIGNS:
        assert metric(sign.metric).label != sign.metric, sign.metric  # a row of the table
        assert f"### `{sign.name}`" in page and f"`{sign.metric}`" in page
        assert re.search(
            rf"\| \[`{sign.name}`\]\(#{sign.name}\) \| `{re.escape(sign.metric)}`", page
        )
    assert metric("health/entropy").name == "health/"  # the family of the fired signs
    assert "health" in Spec.model_json_schema()["properties"]


def test_the_settings_are_in_the_printed_spec() -> None:
    from typer.testing import CliRunner

    from ppokit.cli import app

    result = CliRunner().invoke(app, ["train", "--print-spec", "--set", "health.entropy=0.05"])
    assert result.exit_code == 0, result.output
    text = "\n".join(line.split("#")[0].rstrip() for line in result.output.splitlines()) + "\n"
    assert "\nhealth:\n  enabled: true\n  rounds: 5\n" in text
    assert "  entropy: 0.05\n" in text and "  truncated: null\n" in text


def test_the_settings_are_bounded() -> None:
    for bad in ("health.grad_spike=1", "health.zero_variance=1.5", "health.rounds=0"):
        with pytest.raises(SpecError, match=bad.split("=")[0].replace(".", r"\.")):
            small_spec(None, bad)


# ---------------------------------------------------------------------- runs
def _run(tmp_path: Path, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    result = train(small_spec(tmp_path / "run", *overrides))
    return result, read_metrics(tmp_path / "run")


def test_a_constant_reward_fires_its_signs_and_warns_once(tmp_path: Path, capsys) -> None:
    code = tmp_path / "one.py"
    code.write_text("def reward(prompts, responses):\n    return [1.0] * len(responses)\n")
    result, records = _run(
        tmp_path,
        f"reward={{name: python, function: '{code}:reward'}}",
        "advantage=grpo",  # a group baseline: the zero-variance groups are reported
        "critic=null",
        "train.rounds=3",
        "health.rounds=2",
    )
    assert [r["rollout/zero_variance_groups"] for r in records] == [1.0, 1.0, 1.0]
    for name in ("constant_reward", "zero_variance"):
        assert [r.get(f"health/{name}") for r in records] == [None, 1.0, 1.0]
        assert result["health"][name] == {"first_round": 2, "rounds": 2}
    err = capsys.readouterr().err
    assert err.count("warning: health: reward_std 0 below health.constant_reward") == 1
    assert "health: zero_variance from round 2 (2 rounds), constant_reward from round 2" in err


def test_a_collapsed_entropy_fires_its_sign(tmp_path: Path) -> None:
    """The sign fires on exactly the rounds whose entropy and the round's before it are
    below health.entropy (a collapsed policy's entropy may flicker above it and back)."""
    result, records = _run(
        tmp_path, "train.actor_lr=1.0", "policy.entropy_coef=0", "train.rounds=8", "health.rounds=2"
    )
    below = [r["entropy"] < 0.001 for r in records]
    fires = [1.0 if i >= 1 and below[i - 1] and below[i] else None for i in range(len(below))]
    assert [r.get("health/entropy") for r in records] == fires
    first = fires.index(1.0) + 1  # 1-based; the collapse happens within the 8 rounds
    assert result["health"]["entropy"]["first_round"] == first


def test_the_demo_fires_none(tmp_path: Path) -> None:
    """The packaged demo at its own size and settings, its first 12 rounds (the gradient
    norm's window full from round 11); ``ppokit train`` runs all 120 without a sign too."""
    spec = load_spec(DEMO, [f"output.dir={tmp_path}", "output.progress=false", "train.rounds=12"])
    result = train(spec)
    assert result["health"] == {}
    assert not any(k.startswith("health/") for r in read_metrics(tmp_path) for k in r)


#: The README's overrides that run a variant at the demo's round size and learning rates.
README_DEMO = [
    "rollout.prompts_per_round=16",
    "rollout.n=8",
    "train.ppo_epochs=2",
    "train.minibatch_size=64",
    "train.actor_lr=5e-4",
    "train.critic_lr=3e-3",
]


@pytest.mark.parametrize("variant", ["grpo", "rloo", "dapo"])
def test_the_readmes_variants_on_the_demo_task_fire_none(variant: str, tmp_path: Path) -> None:
    """The README's comparison (its variants with its demo overrides on the demo task) fires
    no sign in its first rounds: the demo's answers are exactly max_new_tokens long, and the
    task says so, so the truncated-responses sign does not cry wolf."""
    overrides = [*README_DEMO, "train.rounds=7", f"output.dir={tmp_path}", "output.progress=false"]
    spec = load_spec(variant, overrides)
    assert spec.task == "demo" and spec.health.truncated is None
    result = train(spec)
    assert result["health"] == {}
