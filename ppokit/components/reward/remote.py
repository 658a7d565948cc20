"""Rewards scored by servers (catalogue: :mod:`ppokit.components.reward`): ``http`` (a ppokit
reward server, or any that speaks its JSON) and ``judge`` (an LLM behind an
OpenAI-compatible chat-completions endpoint), over one :class:`~ppokit.components.reward.client.Client`
(its whole-exchange deadline, retries and one-line failures are that module's).

Every way a request can fail, the answer's checks included (a redirect, no HTTP, no JSON,
JSON nested too deep, a score that is no finite number, the wrong count), is one line
naming the URL and what happened (:class:`RemoteError`): it stops the run, or, with
``on_error: zero``, scores its responses 0 and flags them ``failed``. Results are in the
order of the responses whatever order the answers come in.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from ppokit.components.reward import (
    HTTP,
    JUDGE,
    JUDGE_GROUP_TEMPLATE,
    JUDGE_TEMPLATE,
    JUDGE_VERDICT_TEMPLATE,
    Scored,
)
from ppokit.components.reward.client import BadAnswer, Client, RemoteError, shown
from ppokit.errors import said

__all__ = ["HttpReward", "JudgeReward", "RemoteError", "parse_group", "parse_score"]


def _kind(value: Any) -> str:
    """A JSON value in words (``true``, ``the text '1'``, ``a list``), for a line."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return f"the text {said(repr(value), 40)}"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "an object"
    if isinstance(value, int):
        digits = len(str(abs(value))) if value.bit_length() < 10_000 else None
        return f"an integer of {digits} digits" if digits else "a very large integer"
    return repr(value)


def _numbers(value: Any, n: int, what: str) -> list[float]:
    """``value`` as ``n`` finite floats, or BadAnswer naming the first that is not one."""
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, list) else _kind(value)
        raise BadAnswer(f"{what}: expected {n} numbers, got {got}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadAnswer(f"{what}: item {i} is {_kind(v)}, not a number")
        try:
            x = float(v)
        except OverflowError:  # an integer beyond a float's range
            x = math.inf
        if not math.isfinite(x):
            raise BadAnswer(f"{what}: item {i} is {_kind(v)}, not a finite number")
        out.append(x)
    return out


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


@HTTP.implementation
class HttpReward:
    """Each request is ``{"prompts": [...], "responses": [...], "fields": {name: [...]}}``
    for a chunk of responses (the data's columns, ``lengths``, ``truncated``), and its
    answer ``{"scores": [...]}`` (one number per response; ``parts: {name: [...]}`` and
    ``flags`` when the server serves several rewards), checked: a wrong count, or a score
    that is no finite number (a text, a bool, NaN, an integer beyond a float's range), is a
    failure like a refused connection (not retried)."""

    blocking = True  # its calls wait on a server or a sandbox

    def __init__(
        self,
        *,
        url: str,
        chunk_size: int,
        part: str | None,
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        concurrency: int,
        on_error: str,
        api_key_env: str | None,
        max_response_mb: float,
    ) -> None:
        self.url, self.chunk_size, self.part, self.on_error = url, chunk_size, part, on_error
        self.client = Client(
            url, what="the http reward", timeout=timeout, retries=retries, backoff=backoff,
            max_backoff=max_backoff, concurrency=concurrency, api_key_env=api_key_env,
            max_response_mb=max_response_mb,
        )  # fmt: skip

    def _scores(self, answer: Any, n: int) -> list[float]:
        if not isinstance(answer, dict):
            raise BadAnswer("answered JSON that is no object")
        if self.part is None:
            return _numbers(answer.get("scores"), n, "its 'scores'")
        parts = answer.get("parts")
        if not isinstance(parts, dict) or self.part not in parts:
            names = sorted(parts) if isinstance(parts, dict) else []
            raise BadAnswer(f"its answer has no part {self.part!r} (parts: {names})")
        return _numbers(parts[self.part], n, f"its part {self.part!r}")

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Any:
        cuts = _chunks(len(responses), self.chunk_size)
        payloads = [
            {
                "prompts": prompts[c],
                "responses": responses[c],
                "fields": {k: list(v)[c] for k, v in fields.items()},
            }
            for c in cuts
        ]
        answers = self.client.post_all(payloads, stop=self.on_error == "stop")
        scores: list[float] = []
        failed: list[bool] = []
        for c, answer in zip(cuts, answers, strict=True):
            n = c.stop - c.start
            try:
                if isinstance(answer, RemoteError):
                    raise answer
                got = self._scores(answer, n)
            except BadAnswer as exc:
                if self.on_error == "stop":
                    raise RemoteError(f"the http reward: {shown(self.url)}: {exc}") from None
                got = None
            except RemoteError:
                got = None
            scores += got if got is not None else [0.0] * n
            failed += [got is None] * n
        if self.on_error == "zero":
            return Scored(scores, {"failed": failed})
        return scores

    def __repr__(self) -> str:
        return f"HttpReward({shown(self.url)!r})"


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
#: " / H" after a score: the top of the scale, which must be ``high``.
_OUT_OF = rf"(?:\s*/\s*({_NUMBER}))?"
# Each pattern is matched whole against one line (fullmatch: one start), and no two
# quantified neighbours can take the same character, so a failed match gives each character
# back at most once: linear in the line's length.
_SCORE = re.compile(rf"(?:final\s+)?score\s*(?:[:=]\s*)?({_NUMBER}){_OUT_OF}", re.IGNORECASE)
_BARE = re.compile(rf"({_NUMBER}){_OUT_OF}")
_REPLY = re.compile(rf"reply\s*(?:#\s*)?(\d+)\s*[:=\-]\s*({_NUMBER}){_OUT_OF}", re.IGNORECASE)
_LABEL = re.compile(r"(?:verdict|answer)\s*:\s*", re.IGNORECASE)
#: Markdown's bold, italic and code marks, dropped from a line before it is read.
_MARKS = str.maketrans("", "", "*`")


def _plain(line: str) -> str:
    """``line`` as read: without ``*`` and backquotes, leading ``#``, surrounding
    blanks and trailing ``.`` or ``!``."""
    return line.translate(_MARKS).strip().lstrip("#").strip().rstrip(".!").rstrip()


def _lines(text: str) -> list[str]:
    """The non-empty lines of ``text`` as read (:func:`_plain`), in order."""
    return [line for line in map(_plain, text.splitlines()) if line]


def _scaled(number: str, out_of: str | None, low: float, high: float) -> float | None:
    value = float(number)
    if out_of is not None and float(out_of) != high:
        return None
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return (value - low) / (high - low)


def parse_score(
    text: str, mode: str, low: float, high: float, positive: Sequence[str], negative: Sequence[str]
) -> float | None:
    """The judge's score in [0, 1] read from its answer, or None when there is none.

    Only the answer's last non-empty line is read, where the rubric asks for the verdict,
    and it must be the verdict whole: a score or word anywhere earlier (a judge quoting the
    reply, say) never counts. A line is read without markdown marks (``*``, backquotes),
    leading ``#``, surrounding blanks and a trailing ``.`` or ``!``.

    Mode ``number``: that line is ``Score: N`` (``Score N``, ``Score = N``, ``Final score:
    N``, any case; ``N / high`` allowed), or the whole answer is the number alone; N in
    [low, high] is scaled to (N − low) / (high − low). Mode ``verdict``: that line is one of
    the verdict words (any case, optionally after ``Verdict:`` or ``Answer:``), 1 for a
    positive one and 0 for a negative. Linear in the answer's length."""
    lines = _lines(text)
    if not lines:
        return None
    last = lines[-1]
    if mode == "verdict":
        label = _LABEL.match(last)
        word = last[label.end() :] if label else last
        words = {_plain(w).casefold(): 1.0 for w in positive}
        words |= {_plain(w).casefold(): 0.0 for w in negative}
        return words.get(word.casefold()) if word else None
    found = _SCORE.fullmatch(last) or (_BARE.fullmatch(last) if len(lines) == 1 else None)
    return _scaled(found.group(1), found.group(2), low, high) if found else None


def parse_group(text: str, count: int, low: float, high: float) -> list[float | None]:
    """Each reply's score in [0, 1] from a group answer, None where it has none.

    Only the answer's final block of ``Reply K: N`` lines is read (``Reply #K - N``,
    ``Reply K = N`` too; blank lines may part them): the lines from the end up to the
    first non-empty line of another shape, each read as :func:`parse_score` reads a line.
    A K given twice in that block, out of 1..count, or an N out of [low, high] scores
    none. Linear in the answer's length."""
    scores: dict[int, float | None] = {}
    twice: set[int] = set()
    for line in reversed(_lines(text)):
        found = _REPLY.fullmatch(line)
        if found is None:
            break
        digits = found.group(1).lstrip("0")
        k = int(digits) if 0 < len(digits) <= len(str(count)) else 0
        if k in scores:
            twice.add(k)
        scores[k] = _scaled(found.group(2), found.group(3), low, high)
    return [None if k in twice else scores.get(k) for k in range(1, count + 1)]


def _code(seed: bytes, n: int) -> str:
    """The ``n``-th code a fence may take in a request whose texts hash to ``seed``."""
    import hashlib

    return hashlib.sha256(seed + n.to_bytes(8, "big")).hexdigest()[:8]


def _fence(texts: Sequence[str]) -> str:
    """The fence's tag for a request of ``texts``: ``reply-`` and 8 hex digits, the first of
    :func:`_code`'s that occurs in none of them (in any case), so a reply pasted between
    ``<tag>`` and ``</tag>`` cannot close its fence or open another. The digits come from
    SHA-256 over the texts: the same request is sent the same rubric (a judge at
    temperature 0 answers it alike)."""
    import hashlib

    whole = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        whole.update(len(data).to_bytes(8, "big") + data)
    seed, seen, n = whole.digest(), [t.casefold() for t in texts], 0
    while any((code := _code(seed, n)) in t for t in seen):
        n += 1
    return f"reply-{code}"


@JUDGE.implementation
class JudgeReward:
    """One chat-completions request per response (``group``: per run of consecutive
    responses to the same prompt, its replies numbered from 1), asked for
    ``max_tokens`` tokens at ``temperature``, each response pasted in the rubric inside its
    fence (:func:`_fence`); the answer's ``choices[0].message.content`` is parsed
    (:func:`parse_score`, :func:`parse_group`). An answer without that field is a
    failure of the server (``on_error``); an answer without a score is ``unparsed``."""

    blocking = True  # its calls wait on a server or a sandbox

    def __init__(
        self,
        *,
        url: str,
        model: str,
        template: str | None,
        system: str | None,
        field: str | None,
        mode: str,
        low: float,
        high: float,
        positive: list[str],
        negative: list[str],
        unparsed: float,
        group: bool,
        temperature: float,
        max_tokens: int,
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        concurrency: int,
        on_error: str,
        api_key_env: str | None,
        max_response_mb: float,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model, self.system, self.field = model, system, field
        default = JUDGE_VERDICT_TEMPLATE if mode == "verdict" else JUDGE_TEMPLATE
        self.template = template or (JUDGE_GROUP_TEMPLATE if group else default)
        self.mode, self.low, self.high = mode, low, high
        self.positive, self.negative, self.unparsed = positive, negative, unparsed
        self.group, self.temperature, self.max_tokens = group, temperature, max_tokens
        self.on_error = on_error
        self.client = Client(
            self.endpoint, what="the judge reward", timeout=timeout, retries=retries,
            backoff=backoff, max_backoff=max_backoff, concurrency=concurrency,
            api_key_env=api_key_env, max_response_mb=max_response_mb,
        )  # fmt: skip

    def _request(self, text: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": text}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        return {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def _groups(self, prompts: list[str]) -> list[slice]:
        """Runs of consecutive responses to the same prompt (one run each without group)."""
        if not self.group:
            return [slice(i, i + 1) for i in range(len(prompts))]
        cuts, start = [], 0
        for i in range(1, len(prompts) + 1):
            if i == len(prompts) or prompts[i] != prompts[start]:
                cuts.append(slice(start, i))
                start = i
        return cuts

    def _text(self, prompts: list[str], responses: list[str], answers: list[Any], c: slice) -> str:
        """The rubric of the responses ``c``, each pasted inside its fence (``{tag}``,
        :func:`_fence`), whatever the template."""
        answer = answers[c.start]
        gold = "(none given)" if answer is None else str(answer)
        mine = responses[c]
        texts = [prompts[c.start], gold, self.template, self.system or "", *mine]
        tag = _fence([str(t) for t in texts])
        values = {"prompt": prompts[c.start], "answer": gold, "low": self.low, "high": self.high}
        fenced = [f"<{tag}>\n{r}\n</{tag}>" for r in mine]
        if self.group:
            listed = "\n\n".join(f"Reply {k + 1}:\n{r}" for k, r in enumerate(fenced))
            return self.template.format(**values, tag=tag, responses=listed, count=len(mine))
        words = {"positive": self.positive[0], "negative": self.negative[0]}
        return self.template.format(**values, **words, tag=tag, response=fenced[0])

    @staticmethod
    def _content(answer: Any) -> str:
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise BadAnswer("answered no choices[0].message.content") from None
        if not isinstance(content, str):
            raise BadAnswer("answered a message whose content is no text")
        return content

    def _parse(self, content: str, n: int) -> list[float | None]:
        if self.group:
            return parse_group(content, n, self.low, self.high)
        args = (self.mode, self.low, self.high, self.positive, self.negative)
        return [parse_score(content, *args)]

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Scored:
        answers: list[Any] = [None] * len(responses)
        if self.field is not None and self.field in fields:
            answers = list(fields[self.field])
        cuts = self._groups(prompts)
        requests = [self._request(self._text(prompts, responses, answers, c)) for c in cuts]
        replies = self.client.post_all(requests, stop=self.on_error == "stop")
        scores: list[float] = []
        unparsed: list[bool] = []
        failed: list[bool] = []
        for c, reply in zip(cuts, replies, strict=True):
            n = c.stop - c.start
            try:
                if isinstance(reply, RemoteError):
                    raise reply
                parsed = self._parse(self._content(reply), n)
            except (BadAnswer, RemoteError) as exc:
                if self.on_error == "stop":
                    if isinstance(exc, RemoteError):
                        raise
                    raise RemoteError(f"the judge reward: {shown(self.endpoint)}: {exc}") from None
                scores += [0.0] * n
                unparsed += [False] * n
                failed += [True] * n
                continue
            scores += [self.unparsed if p is None else p for p in parsed]
            unparsed += [p is None for p in parsed]
            failed += [False] * n
        flags: dict[str, list[bool]] = {"unparsed": unparsed}
        if self.on_error == "zero":
            flags["failed"] = failed
        return Scored(scores, flags)

    def __repr__(self) -> str:
        return f"JudgeReward({shown(self.endpoint)!r}, model={self.model!r})"
