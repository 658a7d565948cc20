"""Dynamic sampling (rollout.filter): the stopping rule as a property over which groups pass
in which batch (a stand-in learner, no model), Rollout.cat, and rounds on the tiny model
where half the prompts can never be informative."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.catalogue import NoParams
from ppokit.data import make_prompt_source
from ppokit.errors import UserError
from ppokit.trainer import train
from ppokit.trainer.assembly import Checked, Where
from ppokit.trainer.metrics import read_metrics
from ppokit.trainer.producers.filling import Batch, fill
from ppokit.trainer.prompts import format_prompts
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Scores
from tests.helpers import Plugin
from tests.helpers.components import make
from tests.helpers.trainer import GROUP_FILTERED, learner, small_spec


# ------------------------------------------------------------- the stopping rule
class _Scorer:
    """Rewards 0, 1, 0, 1, ... for an informative row's responses, 0.5 for the others."""

    device = torch.device("cpu")
    tokenizer = SimpleNamespace(pad_token_id=0)
    assembly = SimpleNamespace(requires=frozenset())

    def rollout(self, rows: list[dict[str, Any]], ro: Rollout) -> Any:
        n = ro.response_ids.shape[0] // len(rows)
        scores = [(i % 2 if row["informative"] else 0.5) for row in rows for i in range(n)]
        texts = [f"{row['index']}:{i}" for row in rows for i in range(n)]
        return Scores(torch.tensor(scores, dtype=torch.float32)), texts


class _Parts:
    """What :func:`fill` is given, without a model: each batch's responses are as long as
    the batch's number (so batches pad differently) and start with the row's index."""

    def __init__(self, n: int, prompts: int, limit: int, exhausted: str = "train") -> None:
        self.settings = SimpleNamespace(
            n=n, prompts_per_round=prompts, max_generation_batches=limit, filter_exhausted=exhausted
        )
        self.scorer = _Scorer()
        where = Where("rollout.filter", "informative", "ppokit")
        self.filter = Checked("group_filter", where, make("group_filter", "informative"))

    def fill(
        self, rows: list[dict[str, Any]], formatted: list[str], draw: Any, phase: Any = None
    ) -> Any:
        return fill(
            _Source(rows, formatted, draw, self.sample, self.settings.n),
            scorer=self.scorer, group_filter=self.filter,  # type: ignore[arg-type]
            settings=self.settings, timings={},  # type: ignore[arg-type]
            phase=phase or (lambda phase: None),
        )  # fmt: skip

    def sample(self, formatted: list[str], n: int, batch: int = 0, rows: Any = None) -> Rollout:
        index = torch.tensor([int(p) for p in formatted]).repeat_interleave(n)
        prompt_len, length = 1 + batch % 3, 1 + batch
        b = index.shape[0]
        response = torch.full((b, length), 7)
        response[:, 0] = index
        return Rollout(
            prompt_ids=torch.full((b, prompt_len), 5),
            prompt_mask=torch.ones(b, prompt_len, dtype=torch.long),
            response_ids=response,
            response_mask=torch.ones(b, length, dtype=torch.bool),
            truncated=torch.zeros(b, dtype=torch.bool),
            logp_rollout=-torch.rand(b, length),
        )


class _Source:
    """:func:`fill`'s batches: ``rows`` first, then what ``draw`` gives, sampled by
    ``sample`` (nothing generated ahead)."""

    refills = True
    overlaps = False

    def __init__(self, rows: Any, formatted: Any, draw: Any, sample: Any, n: int) -> None:
        self.first, self.draw, self.sample, self.n = (rows, formatted), draw, sample, n

    def held(self) -> None:
        return None

    def generate(self, number: int) -> Batch:
        rows, formatted = self.first if number == 0 else self.draw()
        return Batch(rows, formatted, self.sample(formatted, self.n, batch=number, rows=rows))

    def worth(self, passed: int, share: int) -> bool:
        return False

    def counted(self, passed: int, drawn: int) -> None:
        pass

    def give_back(self) -> None:
        return None


class _Stream:
    """A data stream of rows with an ``informative`` flag; ``drawn`` counts the rows read."""

    def __init__(self, flags: list[bool], prompts: int) -> None:
        self.rows = [{"prompt": str(i), "index": i, "informative": f} for i, f in enumerate(flags)]
        self.prompts = prompts
        self.drawn = 0

    def __call__(self) -> tuple[list[dict[str, Any]], list[str]]:
        rows = self.rows[self.drawn : self.drawn + self.prompts]
        self.drawn += self.prompts
        return rows, [row["prompt"] for row in rows]


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(2, 4), st.data())
def test_the_stopping_rule(prompts: int, limit: int, n: int, data: st.DataObject) -> None:
    """The round stops at the first batch that brings the passed groups to prompts_per_round
    or at max_generation_batches; it keeps the first prompts_per_round passed groups, in
    order, with their own responses; rejected groups never enter it; the data position is
    the prompts drawn."""
    flags = data.draw(st.lists(st.booleans(), min_size=prompts * limit, max_size=prompts * limit))
    parts = _Parts(n, prompts, limit)
    stream = _Stream(flags, prompts)
    rows, formatted = stream()
    got = parts.fill(rows, formatted, draw=stream)

    passed_by_batch = [sum(flags[b * prompts : (b + 1) * prompts]) for b in range(limit)]
    cumulative = [sum(passed_by_batch[: b + 1]) for b in range(limit)]
    batches = next((b + 1 for b, c in enumerate(cumulative) if c >= prompts), limit)
    assert got.batches == batches <= limit
    assert stream.drawn == batches * prompts  # every drawn prompt is consumed
    passed = cumulative[batches - 1]
    assert got.passed_groups == passed
    assert got.generated_groups == batches * prompts
    assert got.kept_groups == min(prompts, passed) <= prompts
    assert got.exhausted == (passed < prompts)
    expected = [i for i, f in enumerate(flags[: batches * prompts]) if f][:prompts]
    if not expected:
        assert got.kept is None
        return
    kept = got.kept
    assert [row["index"] for row in kept.rows] == expected
    assert all(row["informative"] for row in kept.rows)  # no rejected group
    ro = kept.rollout
    assert ro.response_ids.shape[0] == len(expected) * n
    assert torch.equal(ro.response_ids[:, 0], torch.tensor(expected).repeat_interleave(n))
    assert kept.texts == [f"{i}:{k}" for i in expected for k in range(n)]
    assert torch.equal(
        kept.scores.total, torch.tensor([k % 2 for _ in expected for k in range(n)]).float()
    )
    assert got.generated.sums[0].item() == batches * prompts * n  # every response counted


def test_an_exhausted_round_is_an_error_when_asked() -> None:
    parts = _Parts(2, 4, 3, exhausted="error")
    stream = _Stream([False] * 12, 4)
    rows, formatted = stream()
    with pytest.raises(UserError, match=r"rollout.filter: .*passed 0 of the round's 4 groups in 3"):
        parts.fill(rows, formatted, draw=stream)
    assert stream.drawn == 12


# ------------------------------------------------------------- Rollout.cat
@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 6)), min_size=1, max_size=4
    )
)
def test_cat_repads_prompts_left_and_responses_right(shapes: list[tuple[int, int, int]]) -> None:
    parts = []
    g = torch.Generator().manual_seed(len(shapes))
    for rows, p, t in shapes:
        plen = torch.randint(1, p + 1, (rows,), generator=g)
        rlen = torch.randint(0, t + 1, (rows,), generator=g)
        pmask = (torch.arange(p)[None, :] >= (p - plen)[:, None]).long()
        rmask = torch.arange(t)[None, :] < rlen[:, None]
        parts.append(
            Rollout(
                torch.randint(3, 50, (rows, p), generator=g) * pmask,
                pmask,
                torch.randint(3, 50, (rows, t), generator=g) * rmask,
                rmask,
                rlen == t,
                torch.where(rmask, -torch.rand(rows, t, generator=g), 0.0),
            )
        )
    whole = Rollout.cat(parts, pad_id=0)
    p, t = max(s[1] for s in shapes), max(s[2] for s in shapes)
    assert whole.prompt_ids.shape == (sum(s[0] for s in shapes), p)
    assert whole.response_ids.shape[1] == t
    at = 0
    for part in parts:
        rows = part.prompt_ids.shape[0]
        for i in range(rows):
            # the real tokens of every row, in order, with the padding on the same side
            got_p = whole.prompt_ids[at + i][whole.prompt_mask[at + i].bool()]
            assert torch.equal(got_p, part.prompt_ids[i][part.prompt_mask[i].bool()])
            assert whole.prompt_mask[at + i, -1] == 1 or part.prompt_mask[i].sum() == 0
            m = whole.response_mask[at + i]
            assert torch.equal(
                whole.response_ids[at + i][m], part.response_ids[i][part.response_mask[i]]
            )
            assert torch.equal(
                whole.logp_rollout[at + i][m], part.logp_rollout[i][part.response_mask[i]]
            )
            assert (whole.logp_rollout[at + i][~m] == 0).all()
            assert not m[part.response_mask.shape[1] :].any()  # responses start at 0
        at += rows
    assert torch.equal(whole.truncated, torch.cat([x.truncated for x in parts]))


def test_cat_changes_no_log_prob(tmp_path) -> None:
    """Prompts padded further on the left and responses on the right: the actor's log-probs
    of every response token are those of the rollout alone (positions count real tokens)."""
    lrn = learner(small_spec(tmp_path))
    short = lrn.sample(["echo a"], 2)
    long = lrn.sample(["echo a b c d e", "echo b"], 2)
    both = Rollout.cat([short, long], pad_id=lrn.setup.models.tokenizer.pad_token_id)
    with torch.no_grad():
        alone = lrn.setup.forwards.policy_logprobs(short)
        joined = lrn.setup.forwards.policy_logprobs(both)[: short.response_ids.shape[0]]
    t = short.response_ids.shape[1]
    m = short.response_mask
    torch.testing.assert_close(joined[:, :t][m], alone[m], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------- rounds on the tiny model
def half_constant() -> Any:
    """The demo's prompts echo one of a, b, c, d: prompts of a and b score 0.5 whatever the
    response (never informative); those of c and d score the fraction of the response's
    characters in a-m (which differs between the tiny model's samples)."""

    def reward(
        prompts: list[str], responses: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        out = []
        for response, symbol in zip(responses, answer, strict=True):
            if symbol in "ab":
                out.append(0.5)
            else:
                out.append(sum("a" <= ch <= "m" for ch in response) / max(1, len(response)))
        return out

    return reward


def _plugin() -> Plugin:
    return Plugin().add(
        "reward",
        "half_constant",
        half_constant,
        params=NoParams,
        summary="half the prompts constant",
    )


FILTERED = ["reward=half_constant", *GROUP_FILTERED]


def test_rounds_update_on_informative_groups_only(use_registry, tmp_path) -> None:
    """Every round holds prompts_per_round informative groups, none of them of a constant
    prompt; the data position is the prompts drawn."""
    use_registry(_plugin())
    spec = small_spec(tmp_path, *FILTERED)
    lrn = learner(spec)
    source = make_prompt_source(spec.data, spec.seed)
    prompts = spec.rollout.prompts_per_round

    def draw() -> tuple[list[dict[str, Any]], list[str]]:
        rows = source.next_rows(prompts)
        return rows, format_prompts(rows, lrn.setup.models.tokenizer, spec.data)

    batches = 0
    for r in range(1, 4):
        rows, formatted = draw()
        result = lrn.round(rows, formatted, r, draw=draw)
        batches += int(result.metrics["rollout/generation_batches"])
        assert source.drawn == batches * prompts
        assert float(result.metrics["rollout/kept_groups"]) == prompts
        assert not float(result.metrics["rollout/exhausted"])
        data = result.data
        n = spec.rollout.n
        assert data.batch.batch_size == prompts * n
        scores = result.scores.view(prompts, n)
        assert (scores.max(1).values > scores.min(1).values).all()  # every group informative
        assert all(not p.endswith(("a", "b")) for p in result.prompts)
    assert batches > 3  # the constant half made the rounds draw more


def test_short_and_empty_rounds(use_registry, tmp_path) -> None:
    """One batch a round: a round short of groups updates on what passed (the minibatches of
    train.minibatch_size, the last smaller); a round where nothing passes has no update,
    says so and leaves the parameters as they were."""
    use_registry(_plugin())
    spec = small_spec(
        tmp_path, *FILTERED, "rollout.max_generation_batches=1", "rollout.prompts_per_round=6"
    )
    lrn = learner(spec)
    symbols = ["c", "a", "d", "b", "a", "b"]  # 2 of 6 can pass
    rows = [{"prompt": f"echo {s}", "answer": s} for s in symbols]
    before = [p.detach().clone() for p in lrn.setup.models.actor.parameters()]
    result = lrn.round(rows, [r["prompt"] for r in rows], 1)
    kept = float(result.metrics["rollout/kept_groups"])
    assert 1 <= kept <= 2 and float(result.metrics["rollout/exhausted"]) == 1.0
    assert float(result.metrics["rollout/generated_groups"]) == 6
    assert result.metrics["grad_norm_actor"] is not None
    assert any(
        not torch.equal(a, b)
        for a, b in zip(before, lrn.setup.models.actor.parameters(), strict=True)
    )
    constant = [{"prompt": "echo a", "answer": "a"}, {"prompt": "echo b", "answer": "b"}] * 3
    before = [p.detach().clone() for p in lrn.setup.models.actor.parameters()]
    empty = lrn.round(constant, [r["prompt"] for r in constant], 2)
    assert float(empty.metrics["rollout/kept_groups"]) == 0
    assert "policy_loss" not in empty.metrics and empty.scores is None
    assert any("no generated group passed rollout.filter" in m for m in empty.skipped)
    assert all(
        torch.equal(a, b) for a, b in zip(before, lrn.setup.models.actor.parameters(), strict=True)
    )


def test_a_run_where_half_the_prompts_are_constant(use_registry, tmp_path) -> None:
    """`ppokit train`: every round updates on prompts_per_round informative groups; the
    reward of every generated response is logged, the kept ones' apart."""
    use_registry(_plugin())
    spec = small_spec(tmp_path, *FILTERED, "train.rounds=3", "output.save_every=3")
    random.seed(0)
    train(spec)
    records = read_metrics(tmp_path)
    assert [r["round"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["rollout/kept_groups"] == spec.rollout.prompts_per_round
        assert r["rollout/generated_groups"] == r["rollout/generation_batches"] * 4
        assert r["rollout/generation_batches"] >= 1 and r["policy_loss"] is not None
        assert r["rollout/passed_groups"] >= r["rollout/kept_groups"]


def test_a_filtered_run_resumes_exactly(use_registry, tmp_path) -> None:
    """The data position is checkpointed by the source: 2 rounds, resumed for a third, log
    what 3 rounds without stopping log (counts of batches included)."""
    from ppokit.trainer.metrics import TIMING

    use_registry(_plugin())
    whole, split = tmp_path / "whole", tmp_path / "split"
    train(small_spec(whole, *FILTERED, "train.rounds=3"))
    train(small_spec(split, *FILTERED, "train.rounds=2", "output.save_every=1"))
    train(small_spec(split, *FILTERED, "train.rounds=3", "output.save_every=1"), resume=True)

    def untimed(run: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run)]

    assert untimed(split) == untimed(whole)
    assert sum(r["rollout/generation_batches"] for r in untimed(whole)) > 3


def test_a_filter_reads_the_host_once_per_batch(use_registry, tmp_path, monkeypatch) -> None:
    """Beyond a round's reads without a filter (tests/trainer/test_hygiene.py), a filter's
    flags are read once per generation batch; the none filter (keeps_all) is not called."""
    from collections import Counter

    from ppokit.trainer.metrics import read_once

    from .test_hygiene import allowed, host_reads

    use_registry(_plugin())
    spec = small_spec(
        tmp_path, *FILTERED, "rollout.max_generation_batches=1", "train.minibatch_size=null"
    )
    lrn = learner(spec)
    rows = [{"prompt": f"echo {s}", "answer": s} for s in "cdcd"]  # every prompt can pass
    formatted = [r["prompt"] for r in rows]
    lrn.round(rows, formatted, 1)  # warm-up
    with host_reads(monkeypatch) as calls:
        result = lrn.round(rows, formatted, 2)
        values = read_once(result.metrics)
    assert values["rollout/kept_groups"] > 0 and values["rollout/generation_batches"] == 1
    expected = allowed(optimizer_steps=spec.train.ppo_epochs) + Counter({("tolist", "fill"): 1})
    assert calls == expected
    called = []
    none = small_spec(tmp_path, *FILTERED, "rollout.filter=none")
    lrn = learner(none)
    monkeypatch.setattr(
        type(lrn.setup.assembly.filter.component), "__call__", lambda self, g: called.append(g)
    )
    result = lrn.round(rows, formatted, 1)
    assert not called and "rollout/kept_groups" not in result.metrics  # nothing filtered


class _TradeOff(_Scorer):
    """R = 1 on every response, its two parts trading off (1, 0) against (0, 1) inside an
    informative row's group, and a component that reads the parts."""

    assembly = SimpleNamespace(requires=frozenset({"reward_parts"}))

    def rollout(self, rows: list[dict[str, Any]], ro: Rollout) -> Any:
        n = ro.response_ids.shape[0] // len(rows)
        a = [float(row["informative"] and i % 2 == 0) for row in rows for i in range(n)]
        b = [float(not row["informative"] or i % 2 == 1) for row in rows for i in range(n)]
        parts = {"a": torch.tensor(a), "b": torch.tensor(b)}
        total = parts["a"] + parts["b"]
        texts = [f"{row['index']}:{i}" for row in rows for i in range(n)]
        return Scores(total, parts, {"a": 1.0, "b": 1.0}), texts


def test_the_filter_sees_the_reward_parts_when_a_component_reads_them() -> None:
    """Every group's R is flat; only the groups whose parts vary pass informative, and the
    kept groups carry their parts into the round's batch."""
    parts = _Parts(2, 2, 3)
    parts.scorer = _TradeOff()
    stream = _Stream([False, True, False, True, True, False], 2)
    rows, formatted = stream()
    got = parts.fill(rows, formatted, draw=stream)
    assert [row["index"] for row in got.kept.rows] == [1, 3]
    columns, weights = got.kept.scores.columns()
    assert columns.tolist() == [[1.0, 0.0], [0.0, 1.0]] * 2 and weights.tolist() == [[1, 1]] * 4


def test_a_filter_that_rejects_every_group_keeps_no_batch() -> None:
    """Memory stays flat over any number of generation batches: a rejected batch's
    responses are gone before the next one is generated, and the live line says which batch
    it is and that nothing passed yet."""
    import gc
    import weakref

    limit = 6
    parts = _Parts(2, 4, limit)
    made: list[weakref.ref[Rollout]] = []
    alive: list[int] = []
    sample = parts.sample

    def tracked(formatted: list[str], n: int, batch: int = 0, rows: Any = None) -> Rollout:
        gc.collect()
        alive.append(sum(ref() is not None for ref in made))
        out = sample(formatted, n, batch, rows)
        made.append(weakref.ref(out))
        return out

    parts.sample = tracked  # type: ignore[method-assign]
    phases: list[str] = []
    stream = _Stream([False] * (4 * limit), 4)
    rows, formatted = stream()
    got = parts.fill(rows, formatted, draw=stream, phase=phases.append)
    assert got.kept is None and got.batches == limit
    assert alive == [0] * limit  # no earlier batch's responses live on
    assert f"generating batch {limit} of at most {limit} (0 of 4 groups passed so far)" in phases
