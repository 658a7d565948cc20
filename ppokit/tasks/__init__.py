"""Built-in tasks: the prompt generators, their rewards, and the task entries a spec names.

A task is a :class:`~ppokit.catalogue.Task` entry, registered by the default plugin through
``register(entry)`` as a plugin's task is: where its prompts come from, how an answer is
scored, and the generation length it needs, as a spec fragment (``task: arithmetic``).
Nothing here imports torch.
"""

from __future__ import annotations

from ppokit import papers
from ppokit.catalogue import Task
from ppokit.papers import cite
from ppokit.tasks import humaneval, reasoning_gym_entries
from ppokit.tasks.reasoning_gym_entries import ReasoningGymParams

__all__ = ["COMPONENTS", "ENTRIES"]

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
        # a number, not the problem's expression restated (math-verify would evaluate it)
        "reward": {"name": "math_verify", "final": "number"},
        "rollout": {"max_new_tokens": 256},
    },
    about="'What is 3 + (-4) * 7? Put the final answer in \\boxed{}.': two operands in "
    "[0, 99] and the operators +, -, * by default (data.options); the answer is exact; "
    "math_verify compares the boxed answer with it, which must be a number (final: number), "
    "not the expression restated. Prompts in the model's chat template.",
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
        # a number, not the problem's expression restated (math-verify would evaluate it)
        "reward": {"name": "math_verify", "final": "number"},
        "rollout": {
            "max_new_tokens": 48,
            "environment": {"name": "calculator", "open_first": True},
            "max_turns": 3,
            "max_observation_tokens": 16,
        },
    },
    about="Three two-digit operands; the episode has up to 3 model turns, each answered by the "
    "calculator environment; math_verify scores the final boxed answer, a number.",
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

#: The reasoning-gym generators with a task of their own (``rg_<generator>``), and the
#: generation length each needs.
REASONING_GYM_TASKS: dict[str, int] = {
    "basic_arithmetic": 256,
    "chain_sum": 256,
    "countdown": 512,
    "gsm_symbolic": 512,
    "puzzle24": 512,
}
#: The generator of the generic ``reasoning_gym`` task (data.source.dataset names another).
REASONING_GYM_DEFAULT = "basic_arithmetic"


def reasoning_gym_task(name: str, dataset: str, max_new_tokens: int) -> Task:
    """A task over one reasoning-gym generator: the train split, the held-out test split as
    its evaluation (the same generator, configuration and size: ``${data.source...}``)."""
    source = {"name": "reasoning_gym", **ReasoningGymParams(dataset=dataset).model_dump()}
    # the name form: the evaluation reads its rows with shuffle off, which a mapping refuses
    params = ("dataset", "config", "size", "instruction")
    held_out = {
        "source": "reasoning_gym",
        "options": {**{p: f"${{data.source.{p}}}" for p in params}, "split": "test"},
    }
    chat = {"chat_template": "${data.chat_template}", "system_prompt": "${data.system_prompt}"}
    return Task(
        name,
        f"reasoning-gym's {dataset} generator, scored by its own checker"
        if name != "reasoning_gym"
        else "Any reasoning-gym generator (data.source.dataset), scored by its own checker",
        {
            "data": {"source": source, "chat_template": True},
            "reward": "reasoning_gym",
            "eval": {"data": {**held_out, **chat}, "prompts": 200},
            "rollout": {"max_new_tokens": max_new_tokens},
        },
        about="Questions of reasoning-gym's generator (data.source.dataset; its configuration "
        "in data.source.config), the answer between <answer> tags; reasoning-gym's "
        "score_answer scores it (partial credit where it gives one). The evaluation reads "
        "the held-out split: questions whose hash puts them outside the training split. "
        "Needs pip install 'ppokit[tasks]'.",
        source=cite(("reasoning-gym", papers.REASONING_GYM)),
    )


REASONING_GYM = reasoning_gym_task("reasoning_gym", REASONING_GYM_DEFAULT, 512)

HUMANEVAL = Task(
    "humaneval",
    "HumanEval's 164 Python problems, each response run against the problem's tests",
    {
        "data": {"source": "humaneval", "chat_template": True},
        "reward": {"name": "code_tests", "field": "tests", "timeout": 10, "cpu_seconds": 5},
        "eval": {"prompts": 164, "k": [1, 10], "n": 10},
        "rollout": {"max_new_tokens": 512},
    },
    about="The problem's signature and docstring; the response's last ```python block, its "
    "imports included, runs against HumanEval's check(candidate) in the code_tests sandbox "
    "(bubblewrap). HumanEval has no training split: the evaluation reads the same 164 "
    "problems (use it to evaluate, ppokit eval). Needs pip install 'ppokit[tasks]'.",
    source=str(papers.HUMANEVAL),
)

#: The components the tasks bring beside the kind packages' (their prompt sources and reward).
COMPONENTS = (reasoning_gym_entries.SOURCE, humaneval.SOURCE, reasoning_gym_entries.REWARD)

#: Every built-in task.
ENTRIES: tuple[Task, ...] = (
    DEMO,
    ARITHMETIC,
    CALCULATOR,
    ECHO_GAME,
    REASONING_GYM,
    *(reasoning_gym_task(f"rg_{d}", d, t) for d, t in REASONING_GYM_TASKS.items()),
    HUMANEVAL,
)
