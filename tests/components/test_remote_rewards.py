"""The rewards that call servers, against servers on loopback in this process: ``http``
against ppokit's own reward server (the same scores as the reward run here, in chunks, at
most ``concurrency`` requests at once, a part of several rewards), ``judge`` against a stub
of an OpenAI-compatible endpoint (the rubric it is sent, scores and verdicts parsed,
unparsed answers counted, a group in one request), and the failures of both: no server, a
busy one (retried with backoff), one that never answers, a wrong answer, a too large one;
each is one line naming the URL and the cause, or with ``on_error: zero`` scores 0 and
flags. Also the reward server's own answers to bad requests, and the consent a run
folder's URL needs."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from ppokit.components.reward.remote import RemoteError, parse_group, parse_score
from ppokit.errors import MissingDependency, UserError
from ppokit.runfolder import read_run_spec
from ppokit.serve import ScoreService, build_app, load_rewards
from ppokit.spec import SpecError, validate_spec
from ppokit.trainer.assembly import Checked, Where, rewards_of, scored
from tests.helpers import free_port
from tests.helpers.components import make
from tests.helpers.servers import ChatStub, run_app, silent_socket

FAST = dict(retries=0, backoff=0.0, timeout=5.0)


def _service(spec_data: dict[str, Any]) -> ScoreService:
    return ScoreService(rewards_of(validate_spec(spec_data)))


class Counting:
    """A score service that counts its requests and the most in flight at once, each
    request held ``delay`` seconds."""

    def __init__(self, service: ScoreService, delay: float = 0.0) -> None:
        self.service, self.delay = service, delay
        self.requests: list[int] = []
        self.in_flight = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, data: Any) -> dict[str, Any]:
        with self.lock:
            self.requests.append(len(data["responses"]))
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(self.delay)
            return self.service(data)
        finally:
            with self.lock:
                self.in_flight -= 1


TWO = {
    "reward": [
        {"name": "exact_match", "weight": 1.0},
        {"name": "length_penalty", "target": 2, "scale": 0.5, "weight": 2.0},
    ]
}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Counting]]:
    counting = Counting(_service(TWO))
    app = build_app(counting, counting.service.health, max_request_mb=1.0, concurrency=8)
    with run_app(app) as running:
        yield running.url, counting


def _fields(answers: list[str], lengths: list[int]) -> dict[str, Any]:
    return {"answer": answers, "lengths": lengths, "truncated": [False] * len(answers)}


# ---------------------------------------------------------------------- http
@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", " A "]), st.integers(0, 6)), max_size=23),
    st.integers(1, 8),
)
def test_http_scores_what_the_rewards_score_here(server, rows, chunk) -> None:
    """Over the server, in chunks of ``chunk_size``, in order: R and each part equal the
    rewards run in this process, and the requests are the chunks."""
    url, counting = server
    responses = [r for r, _ in rows]
    fields = _fields(["a"] * len(rows), [n for _, n in rows])
    prompts = ["p"] * len(rows)
    local = counting.service({"prompts": prompts, "responses": responses, "fields": fields})
    counting.requests.clear()
    reward = make("reward", "http", url=f"{url}/score", chunk_size=chunk, **FAST)
    assert reward(prompts, responses, **fields) == local["scores"]
    assert counting.requests == [min(chunk, len(rows) - a) for a in range(0, len(rows), chunk)]
    part = make("reward", "http", url=f"{url}/score", chunk_size=chunk, part="exact_match")
    assert part(prompts, responses, **fields) == local["parts"]["exact_match"]


def test_http_keeps_at_most_concurrency_requests_in_flight() -> None:
    counting = Counting(_service({"reward": "exact_match"}), delay=0.2)
    app = build_app(counting, counting.service.health, max_request_mb=1.0, concurrency=16)
    with run_app(app) as running:
        reward = make(
            "reward", "http", url=f"{running.url}/score", chunk_size=1, concurrency=3, **FAST
        )
        out = reward(["p"] * 8, ["a", "b"] * 4, **_fields(["a"] * 8, [1] * 8))
    assert out == [1.0, 0.0] * 4
    assert len(counting.requests) == 8 and counting.most == 3


def test_http_part_that_the_server_does_not_serve(server) -> None:
    url, _ = server
    reward = make("reward", "http", url=f"{url}/score", part="nope", **FAST)
    with pytest.raises(RemoteError, match=r"/score: its answer has no part 'nope' \(parts: "):
        reward(["p"], ["a"], **_fields(["a"], [1]))


def _one_line(exc: BaseException, *parts: str) -> None:
    text = str(exc)
    assert "\n" not in text
    for part in parts:
        assert part in text, text


def test_no_server_is_one_line_naming_the_url_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}/score"
    reward = make("reward", "http", url=url, retries=2, backoff=0.01, timeout=2.0)
    with pytest.raises(RemoteError) as info:
        reward(["p"], ["a"])
    _one_line(info.value, "the http reward", url, "cannot connect", "(after 3 tries)")


def test_a_server_that_never_answers_times_out() -> None:
    with silent_socket() as url:
        reward = make("reward", "http", url=url, retries=0, timeout=0.3)
        with pytest.raises(RemoteError) as info:
            reward(["p"], ["a"])
    _one_line(info.value, url, "no complete answer within 0.3 s")


@pytest.fixture
def chat() -> Iterator[tuple[str, ChatStub]]:
    stub = ChatStub()
    with run_app(stub.app()) as running:
        yield f"{running.url}/v1", stub


def test_a_busy_server_is_retried_with_backoff(chat) -> None:
    url, stub = chat
    stub.status, stub.fail = 503, 2
    judge = make("reward", "judge", url=url, model="m", retries=2, backoff=0.01, timeout=5.0)
    assert judge(["p"], ["r"]).scores == [0.7]
    assert len(stub.requests) == 3
    stub.fail = 2
    judge = make("reward", "judge", url=url, model="m", retries=1, backoff=0.01, timeout=5.0)
    with pytest.raises(RemoteError) as info:
        judge(["p"], ["r"])
    _one_line(info.value, f"{url}/chat/completions", "answered HTTP 503", "(after 2 tries)")


def test_a_client_error_is_not_retried(chat) -> None:
    url, stub = chat
    stub.status, stub.fail = 400, 5
    judge = make("reward", "judge", url=url, model="m", retries=3, backoff=0.01)
    with pytest.raises(RemoteError, match="answered HTTP 400"):
        judge(["p"], ["r"])
    assert len(stub.requests) == 1


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (b'{"choices": []}', "answered no choices[0].message.content"),
        (b"not json", "answered no JSON"),
        (b'{"pad": "' + b"x" * 4096 + b'"}', "answered more than"),
    ],
)
def test_a_wrong_answer_stops_the_run_or_scores_zero(chat, raw: bytes, cause: str) -> None:
    url, stub = chat
    stub.raw = raw
    judge = make("reward", "judge", url=url, model="m", max_response_mb=0.001, **FAST)
    with pytest.raises(RemoteError) as info:
        judge(["p", "p"], ["a", "b"])
    _one_line(info.value, "the judge reward", url, cause)
    zero = make(
        "reward", "judge", url=url, model="m", max_response_mb=0.001, on_error="zero", **FAST
    )
    out = zero(["p", "p"], ["a", "b"])
    assert out.scores == [0.0, 0.0] and out.flags["failed"] == [True, True]


def test_on_error_zero_flags_the_failed_chunks_through_the_boundary() -> None:
    """Through the trainer's boundary the flags are float [B] tensors (the round's
    reward/http/failed_frac)."""
    url = f"http://127.0.0.1:{free_port()}/score"
    reward = make("reward", "http", url=url, on_error="zero", chunk_size=2, **FAST)
    wrapped = Checked("reward", Where("reward", "http", "ppokit"), reward, timeout=30)
    got, flags = scored(wrapped, "reward", ["p"] * 3, ["a"] * 3, {})
    assert torch.equal(got, torch.zeros(3)) and torch.equal(flags["failed"], torch.ones(3))


# ---------------------------------------------------------------------- judge
def test_the_judge_is_sent_the_rubric_and_its_scores_are_parsed(chat) -> None:
    url, stub = chat
    replies = iter(["Thinking...\nScore: 3", "score = 10", "I cannot tell", "8.5"])
    stub.reply = lambda messages: next(replies)
    judge = make("reward", "judge", url=url, model="judge-m", system="Be strict.", **FAST)
    judge.client.concurrency = 1  # the replies in the order of the responses
    out = judge(["2+2?"] * 4, ["4", "5", "x", "4"], answer=["4", "4", None, "4"])
    assert out.scores == [0.3, 1.0, 0.0, 0.85]
    assert out.flags["unparsed"] == [False, False, True, False]
    first = stub.requests[0]
    assert first["model"] == "judge-m" and first["temperature"] == 0.0
    assert first["messages"][0] == {"role": "system", "content": "Be strict."}
    text = first["messages"][1]["content"]
    tag = re.search(r"<(reply-[0-9a-f]{8})>", text).group(1)
    assert "2+2?" in text and f"\n<{tag}>\n4\n</{tag}>\n" in text
    assert "Reference answer: 4" in text
    assert "Reference answer: (none given)" in stub.requests[2]["messages"][1]["content"]


def test_the_verdict_rubric_names_its_words(chat) -> None:
    url, stub = chat
    stub.reply = lambda messages: "Right."
    judge = make(
        "reward", "judge", url=url, model="m", mode="verdict", positive=["right", "yes"],
        negative=["wrong"], **FAST,
    )  # fmt: skip
    assert judge(["p"], ["r"]).scores == [1.0]
    assert "Answer with one word: right or wrong." in stub.requests[0]["messages"][0]["content"]


def test_the_unparsed_fraction_reaches_the_rounds_metrics(chat) -> None:
    url, stub = chat
    stub.reply = lambda messages: "no score here"
    judge = make("reward", "judge", url=url, model="m", unparsed=-1.0, **FAST)
    wrapped = Checked("reward", Where("reward", "judge", "ppokit"), judge, timeout=30)
    got, flags = scored(wrapped, "reward", ["p"] * 2, ["a", "b"], {})
    assert torch.equal(got, torch.full((2,), -1.0))
    assert torch.equal(flags["unparsed"], torch.ones(2))


def test_group_mode_asks_once_per_group(chat) -> None:
    url, stub = chat

    def rank(messages: list[dict[str, str]]) -> str:
        text = messages[-1]["content"]
        return "Reply 1: 2\nReply 2: 9" if "task A" in text else "Reply 2: 4\nReply 1: 11"

    stub.reply = rank
    judge = make("reward", "judge", url=url, model="m", group=True, unparsed=0.5, **FAST)
    out = judge(["task A", "task A", "task B", "task B"], ["a1", "a2", "b1", "b2"])
    assert len(stub.requests) == 2
    texts = sorted(r["messages"][0]["content"] for r in stub.requests)
    tag = re.search(r"<(reply-[0-9a-f]{8})>", texts[0]).group(1)
    assert "Task:\ntask A" in texts[0]
    assert f"Reply 1:\n<{tag}>\na1\n</{tag}>\n\nReply 2:\n<{tag}>\na2\n</{tag}>" in texts[0]
    assert out.scores == [0.2, 0.9, 0.5, 0.4]  # 11 is out of [0, 10]: unparsed
    assert out.flags["unparsed"] == [False, False, True, False]


@settings(max_examples=50, deadline=None)
@given(
    st.floats(-100, 100, allow_nan=False),
    st.floats(0.5, 50, allow_nan=False),
    st.floats(0, 1),
    st.sampled_from(["Score: {}", "some reasoning\nSCORE = **{}**", "{}", "Score:{} "]),
)
def test_parse_score_reads_a_number_in_range(low: float, width: float, at: float, form: str):
    high = low + width
    value = round(low + at * width, 3)
    if not low <= value <= high:
        return
    got = parse_score(form.format(value), "number", low, high, ["yes"], ["no"])
    assert got is not None and math.isclose(got, (value - low) / width, abs_tol=1e-9)
    assert parse_score(f"Score: {high + 1}", "number", low, high, ["yes"], ["no"]) is None


def test_parse_verdicts_and_groups() -> None:
    """The verdict is the answer's last line, whole (tests/components/test_judge_parse.py)."""
    args = (0.0, 1.0, ["correct", "yes"], ["incorrect", "no"])
    assert parse_score("It is:\nCorrect.", "verdict", *args) == 1.0
    assert parse_score("correct? no,\nINCORRECT", "verdict", *args) == 0.0
    assert parse_score("It is Correct.", "verdict", *args) is None  # not the whole line
    assert parse_score("incorrectly phrased", "verdict", *args) is None  # whole words
    assert parse_score("nothing", "verdict", *args) is None
    assert parse_group("Reply 2: 5\nreply #1 - 10\nReply 3: 99", 3, 0, 10) == [1.0, 0.5, None]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"url": "ftp://x", "model": "m"}, "no http:// or https:// URL"),
        ({"url": "http://x", "model": "m", "template": "{prompt} {oops}"}, "unknown {oops}"),
        ({"url": "http://x", "model": "m", "group": True, "template": "{response}"}, "unknown"),
        ({"url": "http://x", "model": "m", "low": 5, "high": 5}, "must exceed low"),
        ({"url": "http://x", "model": "m", "group": True, "mode": "verdict"}, "must be 'number'"),
        ({"url": "http://x", "model": "m", "positive": ["ok"], "negative": ["OK"]}, "both"),
    ],
)
def test_judge_params_are_checked_at_validation(params: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("{", r"\{").replace("(", r"\(")):
        validate_spec({"reward": {"name": "judge", **params}})


def test_an_api_key_comes_from_the_environment(chat, monkeypatch) -> None:
    url, stub = chat
    monkeypatch.delenv("PPOKIT_TEST_KEY", raising=False)
    with pytest.raises(UserError, match="PPOKIT_TEST_KEY is not set"):
        make("reward", "judge", url=url, model="m", api_key_env="PPOKIT_TEST_KEY", **FAST)
    monkeypatch.setenv("PPOKIT_TEST_KEY", "sk-te\nst")
    with pytest.raises(UserError, match=r"PPOKIT_TEST_KEY holds a control character$"):
        make("reward", "judge", url=url, model="m", api_key_env="PPOKIT_TEST_KEY", **FAST)
    monkeypatch.setenv("PPOKIT_TEST_KEY", "sk-test")
    judge = make("reward", "judge", url=url, model="m", api_key_env="PPOKIT_TEST_KEY", **FAST)
    assert judge(["p"], ["r"]).scores == [0.7]
    assert stub.headers[-1]["authorization"] == "Bearer sk-test"


# ---------------------------------------------------------------------- the server
def test_the_server_refuses_bad_requests_in_one_line() -> None:
    service = _service({"reward": "exact_match"})
    app = build_app(service, service.health, max_request_mb=0.001, concurrency=1)
    client = TestClient(app)
    health = client.get("/health").json()
    assert health == {"status": "ok", "rewards": ["exact_match"], "weights": {"exact_match": 1.0}}
    big = client.post("/score", content=b"x" * 2000)
    assert big.status_code == 413 and "larger than 0.001 MiB" in big.json()["error"]
    assert client.post("/score", content=b"{").status_code == 400
    bad = client.post("/score", json={"prompts": ["p"], "responses": ["a", "b"]})
    assert bad.status_code == 400 and bad.json()["error"] == "1 prompts for 2 responses"
    missing = client.post("/score", json={"prompts": ["p"], "responses": ["a"]})
    assert missing.status_code == 422 and "needs the field 'answer'" in missing.json()["error"]
    ok = client.post(
        "/score", json={"prompts": ["p"], "responses": ["A "], "fields": {"answer": ["a"]}}
    )
    assert ok.json() == {"scores": [1.0], "parts": {"exact_match": [1.0]}, "flags": {}}


def test_a_reward_named_with_its_params_or_a_spec_file(tmp_path: Path) -> None:
    spec = load_rewards("regex", ["pattern=(\\d+)", "field=answer"], [])
    assert spec.reward[0].params == {"pattern": "(\\d+)", "field": "answer"}
    file = tmp_path / "spec.yaml"
    file.write_text(yaml.safe_dump(TWO))
    assert [r.name for r in load_rewards(str(file), [], []).reward] == [
        "exact_match",
        "length_penalty",
    ]
    with pytest.raises(SpecError, match="unknown reward 'nope'"):
        load_rewards("nope", [], [])
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_rewards("regex", ["pattern"], [])


def test_a_missing_extra_is_one_line_naming_the_install(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "starlette.applications", None)
    with pytest.raises(MissingDependency, match=r"pip install 'ppokit\[serve\]'"):
        build_app(lambda d: d, dict, max_request_mb=1, concurrency=1)
    monkeypatch.setitem(sys.modules, "tenacity", None)
    with pytest.raises(MissingDependency, match=r"the http reward needs the 'tenacity'"):
        make("reward", "http", url="http://127.0.0.1:1/score")


# ---------------------------------------------------------------------- consent
@pytest.mark.parametrize(
    "reward",
    [
        {"name": "http", "url": "http://10.0.0.1:8000/score"},
        {"name": "judge", "url": "http://10.0.0.1:8000/v1", "model": "m"},
    ],
)
def test_a_run_folders_server_is_contacted_only_with_consent(tmp_path: Path, reward) -> None:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({"reward": [reward]}))
    with pytest.raises(UserError) as info:
        read_run_spec(tmp_path)
    _one_line(
        info.value, f"names a {reward['name']} reward url", reward["url"], "--trust-remote-code"
    )
    assert read_run_spec(tmp_path, trust_remote_code=True)["reward"] == [reward]


def test_flags_are_reported_as_fractions_of_the_rounds_responses() -> None:
    """A reward's flags become reward/<name>/<flag>_frac over every generated response."""
    from ppokit.trainer.groups import Filled, Generated
    from ppokit.trainer.round import generated_metrics
    from ppokit.trainer.scoring import Scores

    flags = {"judge/unparsed": torch.tensor([1.0, 0.0])}
    generated = Generated(2, ["judge"], list(flags), torch.device("cpu"))
    for flagged in ([1.0, 0.0], [1.0, 1.0]):  # two generation batches
        flags = {"judge/unparsed": torch.tensor(flagged)}
        scores = Scores(torch.zeros(2), {"judge": torch.zeros(2)}, {"judge": 1.0}, flags)
        ones = torch.ones(2, dtype=torch.long)
        generated.add(scores, ones, torch.zeros(2, dtype=torch.bool), ones)
    got = Filled(kept=None, generated=generated, filtered=False)
    metrics = generated_metrics(got, None, torch.device("cpu"))
    assert float(metrics["reward/judge/unparsed_frac"]) == 0.75


def test_the_judge_example_spec_validates_with_a_loopback_judge() -> None:
    from ppokit.spec import load_spec

    root = Path(__file__).resolve().parents[2]
    spec = load_spec(root / "examples" / "specs" / "smollm2_judge_cpu.yaml")
    judge = spec.reward[1]
    assert judge.name == "judge" and judge.params["url"].startswith("http://127.0.0.1:")
    assert spec.advantage.name == "gdpo"
