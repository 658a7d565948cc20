"""A smoke run (``ppokit train --smoke``): two small rounds of the spec's own components on
the tiny model, in a folder of its own (a temporary one, removed when the run ends, unless
given)."""

from __future__ import annotations

import tempfile

from ppokit import distributed
from ppokit.spec import Spec, validate_spec

__all__ = ["SMOKE_NOTE", "SMOKE_PREFIX", "SMOKE_TINY", "TEMPORARY", "smoke_folder", "smoke_spec"]

#: The tiny model of a smoke run, unless the spec configures its own: the demo's heads of 32
#: dimensions (vLLM's CPU attention has no head size of 16).
SMOKE_TINY = {"num_attention_heads": 2, "num_key_value_heads": 2}
#: The prefix of a smoke run's temporary folder (removed when the run ends).
SMOKE_PREFIX = "ppokit-smoke-"
#: Where a smoke run without an output folder writes, as its lines say it.
TEMPORARY = "a temporary folder, removed at the end"
#: What a smoke run says first: its numbers check the plumbing, not the method.
SMOKE_NOTE = (
    "ppokit: smoke run: 2 rounds of the spec's components on the tiny random model, a check "
    "that the spec runs end to end, not of learning"
)
#: What a smoke run says at its end when no reward was above 0.
ZERO_REWARDS = (
    "ppokit: every reward of the smoke run was 0, as expected of the tiny random model on "
    "this task, so its advantages, losses and gradients are 0 too"
)


def smoke_spec(spec: Spec, out: str | None = None) -> Spec:
    """Two rounds of the spec's own components on the tiny model with small batches.

    The tiny model is SMOKE_TINY under what the spec's ``model.tiny`` sets. They
    write to ``out`` when given, else to a new temporary directory (which
    :func:`~ppokit.trainer.loop.train` removes at the end of the run), never to the spec's
    own output directory.
    """
    data = spec.model_dump()
    n = max(2, min(spec.rollout.n, 4))
    own = spec.model.tiny.model_dump(include=spec.model.tiny.model_fields_set)
    tiny = {**data["model"]["tiny"], **SMOKE_TINY, **own}
    data["model"].update(
        actor="tiny",
        tiny=tiny,
        critic_init=None,
        device="auto",
        dtype="auto",
        gradient_checkpointing=False,
    )
    data["rollout"].update(prompts_per_round=4, n=n, max_new_tokens=8)
    t = data["train"]
    batch = 4 * n
    minibatch = None if t["minibatch_size"] is None else batch // 2
    micro = None if t["micro_batch_size"] is None else max(1, (minibatch or batch) // 2)
    t.update(
        rounds=2,
        critic_warmup_rounds=min(t["critic_warmup_rounds"], 1),
        warmup_steps=min(t["warmup_steps"], 1),
        minibatch_size=minibatch,
        micro_batch_size=micro,
    )
    if out is None:
        data["output"].update(dir=tempfile.mkdtemp(prefix=SMOKE_PREFIX), overwrite=True)
    else:
        data["output"].update(dir=out)
    data["output"].update(save_every=1, sample_every=1, report_to=[])
    if data.get("eval") is not None:  # a small evaluation, at the start and at the end
        e = data["eval"]
        ks = e["k"] if isinstance(e["k"], list) else [e["k"]]
        e.update(prompts=min(e["prompts"], 8), k=sorted({min(k, 2) for k in ks}), n=None)
        e.update(max_new_tokens=None)
        e.update(batch_size=min(e["batch_size"], 8))
    return validate_spec(data)


def smoke_folder(main: bool) -> str:
    """A new temporary folder for a smoke run, made by the first process and named to all."""
    folder = distributed.first_text(tempfile.mkdtemp(prefix=SMOKE_PREFIX) if main else None)
    assert folder is not None  # the first process always names one
    return folder
