"""What every prompt source promises, checked the same way for each."""

from __future__ import annotations

import json
from typing import Any

from ppokit.data import make_prompt_source


def assert_resumes(spec: Any, seed: int, chunks: list[int], split: int) -> None:
    """Drawing ``chunks`` rows with a stop after the first ``split`` of them (the state
    through JSON, restored into a source made with another seed: the state carries the
    seed) gives the rows and the final state of drawing them without stopping."""
    uninterrupted = make_prompt_source(spec, seed)
    expected = [uninterrupted.next_rows(n) for n in chunks]
    first = make_prompt_source(spec, seed)
    got = [first.next_rows(n) for n in chunks[:split]]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make_prompt_source(spec, seed + 1)
    resumed.load_state_dict(state)
    got += [resumed.next_rows(n) for n in chunks[split:]]
    assert got == expected
    assert resumed.state_dict() == uninterrupted.state_dict()
