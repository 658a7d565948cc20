"""Built-in tasks: the prompt generators, their rewards, and the task entries a spec names.

A task is a :class:`~ppokit.catalogue.Task` entry, registered by the default plugin through
``register(entry)`` as a plugin's task is: where its prompts come from, how an answer is
scored, and the generation length it needs, as a spec fragment (``task: arithmetic``).
Nothing here imports torch.
"""

from __future__ import annotations

from ppokit import papers
from ppokit.catalogue import Task

__all__ = ["ENTRIES"]

#: The calculator environment's instruction: the tool's tags, and the answer's form.
CALCULATOR_PROMPT = (
    "You have a calculator: write the problem's expression between <calc> and </calc>, and "
    "its result comes back. Give the final answer as \\boxed{N}."
)

DEMO = Task(
    "demo",
    "Echo the symbol the prompt shows ('echo b' -> 'bbbb')",
    {
        "data": {"source": "demo"},
        "reward": "demo",
        "rollout": {"max_new_tokens": 4},
        # every answer is max_new_tokens long: each response ends at the limit, by design
        "health": {"truncated": None},
    },
    about="Prompts 'echo <s>' for a symbol drawn from 'abcd'; the reward is the fraction of the "
    "response's first 4 characters equal to s. A prompt-blind policy scores at most 0.25. "
    "Every answer is exactly 4 tokens long, so the truncated-responses sign is off.",
)

ARITHMETIC = Task(
    "arithmetic",
    "Generated arithmetic problems, the answer in \\boxed{}, checked by math-verify",
    {
        "data": {"source": "arithmetic", "chat_template": True},
        "reward": "math_verify",
        "rollout": {"max_new_tokens": 256},
    },
    about="'What is 3 + (-4) * 7? Put the final answer in \\boxed{}.': two operands in "
    "[0, 99] and the operators +, -, * by default (data.options); the answer is exact; "
    "math_verify compares the boxed answer with it. Prompts in the model's chat template.",
)

CALCULATOR = Task(
    "calculator",
    "Arithmetic with a calculator tool: the model writes <calc>expression</calc>, the result "
    "comes back",
    {
        "data": {
            "source": "arithmetic",
            "chat_template": True,
            "system_prompt": CALCULATOR_PROMPT,
            "options": {"ops": "+-*", "min_value": 10, "max_value": 99, "terms": 3},
        },
        "reward": "math_verify",
        "rollout": {
            "max_new_tokens": 48,
            "environment": {"name": "calculator", "open_first": True},
            "max_turns": 3,
            "max_observation_tokens": 16,
        },
    },
    about="Three two-digit operands; the episode has up to 3 model turns, each answered by the "
    "calculator environment; math_verify scores the final boxed answer.",
    source=str(papers.TOOLFORMER),
)

ECHO_GAME = Task(
    "echo_game",
    "A three-turn echo game: echo the symbol each turn's observation shows",
    {
        "data": {"source": "demo", "options": {"turns": 3}},
        "reward": [],
        "rollout": {"max_new_tokens": 4, "environment": "echo", "max_turns": 3},
        # every turn is max_new_tokens long: each episode ends at the limit, by design
        "health": {"truncated": None},
    },
    about="The demo's prompts over 3 turns: the echo environment shows the next symbol after "
    "each answer and scores each turn; no outcome reward. Every turn is 4 tokens long.",
)

#: Every built-in task.
ENTRIES: tuple[Task, ...] = (DEMO, ARITHMETIC, CALCULATOR, ECHO_GAME)
