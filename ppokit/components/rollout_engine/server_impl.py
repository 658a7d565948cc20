"""The ``vllm_server`` rollout engine: vLLM's OpenAI-compatible servers, in processes of their
own (``ppokit serve-rollouts SPEC`` starts one), token ids in and out over HTTP.

``start`` checks every server (``GET /v1/models``: it serves ``served_model_name``;
``GET /server_info``, which vLLM's server has with ``VLLM_SERVER_DEV_MODE=1``: it computes
log-probs after temperature and takes no sampling defaults from the model's folder), then
pushes the actor's current weights, so a server may start from any weights of the actor's
architecture. ``generate`` sends one ``POST /v1/completions`` a prompt: its token ids as the
prompt, ``n`` samples, the seed, the run's sampling settings and the EOS ids as stop
tokens, ``logprobs: 0`` with ``return_token_ids`` and ``return_tokens_as_token_ids``, so
the sampled tokens and their log μ come back as ids (never re-tokenized text). The requests
spread over the servers, at most ``max_in_flight`` on each at once (asyncio and httpx;
whichever server is free takes the next prompt). ``sync`` writes the actor's full weights
as safetensors to a new folder the servers can read and has each reload them
(``POST /collective_rpc`` with ``reload_weights(weights_path=...)``), then reset its
prefix cache; it returns once every server holds the new weights, so every response is of
the weights of the version the trainer records for it.

On several processes (``share``): either every process sends its prompts to all the servers
and process 0 pushes into them, or each process takes servers of its own
(``urls[process::processes]``, :func:`server_urls`) and pushes into those. Either way every
process takes part in the gathers of a push, which starts once every process has stopped
generating (a barrier), and then waits for the push's outcome, process 0's count of pushes
and the first failure (one gather): no process generates before its servers hold the new
weights, every process counts the same pushes, and a failed push stops every process with
its line.

With LoRA (``model.lora``) the start pushes the base weights as above, once, and every push
(the start's included) writes the adapters as peft saves them (``adapter_config.json``,
``adapter_model.safetensors``) to a new folder and has each server load them under a new
name, ``<served_model_name>-<this run's token>-v<k>`` for the k-th push
(``POST /v1/load_lora_adapter``), then unload the previous name
(``POST /v1/unload_lora_adapter``: no generation runs during a push, so none uses it);
``generate`` asks for the current name. The servers must run with ``--enable-lora``, a
``--max-lora-rank`` of at least ``model.lora.r`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
on; ``start`` names what is missing. ``close`` unloads the last name (where a server
still answers).

Every failure (a server unreachable, one that answers an HTTP error or a malformed answer,
one that dies mid-run, no complete answer within ``timeout``) is one line naming the
server's URL (:class:`ServerError`). Answers are JSON (the adapter endpoints' text is not
read); nothing read is unpickled.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
from torch import Tensor

from ppokit import distributed
from ppokit.components.rollout_engine import (
    VLLM_LORA_ENV,
    VLLM_SERVER,
    EngineContext,
    Generation,
    Sampling,
    lora_rank,
)
from ppokit.components.rollout_engine.vllm_impl import (
    FOLDER_PREFIX,
    adapter_weights,
    base_weights,
    new_folder,
    write_adapter,
)
from ppokit.errors import UserError, one_line, said

__all__ = [
    "ServerError",
    "VLLMServerEngine",
    "lora_missing",
    "parse_choices",
    "request_body",
    "server_urls",
]

T = TypeVar("T")

#: What the engine needs of a server's configuration: (key of its model_config, the value,
#: the flag that sets it).
NEEDED = (
    ("logprobs_mode", "processed_logprobs", "--logprobs-mode processed_logprobs"),
    ("generation_config", "vllm", "--generation-config vllm"),
)
#: How to start a server the engine can use, for the lines that name a missing setting.
HOW = "ppokit serve-rollouts SPEC starts one"
#: Seconds ``close`` waits for a server to unload the last adapters (best effort).
UNLOAD_TIMEOUT = 10.0


class ServerError(UserError):
    """A rollout server that failed the engine: one line naming its URL and the cause."""


class BadAnswer(Exception):
    """An answer that is not what the engine asked for (its message says how)."""


def root(url: str) -> str:
    """A server's root URL (``/v1`` and trailing slashes dropped)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def server_urls(urls: Sequence[str], share: bool, process: int, processes: int) -> list[str]:
    """The servers process ``process`` of ``processes`` generates with: all of ``urls`` when
    they are shared, else its own, ``urls[process::processes]`` (a :class:`UserError` when
    the processes cannot have as many each)."""
    if share:
        return list(urls)
    if len(urls) % processes:
        raise UserError(
            f"rollout.engine.urls: {len(urls)} server(s) cannot be split evenly over "
            f"{processes} processes (share: false gives each process urls[process::"
            f"{processes}]): give a multiple of {processes}, or share: true"
        )
    return list(urls[process::processes])


def request_body(
    model: str, prompt: list[int], sampling: Sampling, eos_ids: Sequence[int], seed: int | None
) -> dict[str, Any]:
    """The ``/v1/completions`` request for one prompt's responses: ``n`` samples (one when
    greedy: vLLM draws one greedy response a request), their ids and log μ back as ids."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(eos_ids),
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    if sampling.greedy:
        return {**body, "n": 1, "temperature": 0.0}
    return {
        **body,
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,  # 0: off, as in vLLM
        "top_p": sampling.top_p,
        "seed": seed,
        "logprobs": 0,  # the sampled token's own log-prob
        "return_tokens_as_token_ids": True,
    }


def lora_missing(config: Any, info: Any, r: int) -> str | None:
    """What a server lacks to load adapters of rank ``r`` at run time (the flag or the
    environment variable to start it with), from its ``/server_info`` (``info``, its
    ``vllm_config`` ``config``); None: nothing."""
    lora = config.get("lora_config") if isinstance(config, dict) else None
    rank = lora.get("max_lora_rank") if isinstance(lora, dict) else None
    env = info.get("vllm_env") if isinstance(info, dict) else None
    if not isinstance(rank, int):
        return f"--enable-lora --max-lora-rank {lora_rank(r)}"
    if rank < r:
        return f"--max-lora-rank {lora_rank(r)} (it has {rank})"
    if not isinstance(env, dict) or env.get(VLLM_LORA_ENV) is not True:
        return f"{VLLM_LORA_ENV}=True in its environment"
    return None


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise BadAnswer(f"{what} is not a list of token ids")
    return value


def parse_choices(
    answer: Any, n: int, max_tokens: int, greedy: bool
) -> tuple[list[list[int]], list[list[float]]]:
    """(token ids, log μ) of each of the ``n`` choices of a ``/v1/completions`` answer, in
    their ``index`` order; :class:`BadAnswer` for anything else."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        got = f"{len(choices)} choices" if isinstance(choices, list) else "no choices"
        raise BadAnswer(f"expected {n} choices, got {got}")
    ids: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    seen = set()
    for choice in choices:
        index = choice.get("index") if isinstance(choice, dict) else None
        if not isinstance(index, int) or not 0 <= index < n or index in seen:
            raise BadAnswer("a choice's index is missing, repeated or out of range")
        seen.add(index)
        tokens = _ints(choice.get("token_ids"), f"choice {index}'s token_ids")
        if not 0 < len(tokens) <= max_tokens:
            raise BadAnswer(f"choice {index} has {len(tokens)} tokens (1 to {max_tokens} asked)")
        ids[index] = tokens
        if greedy:
            continue
        logprobs = choice.get("logprobs")
        values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(values, list) or len(values) != len(tokens):
            raise BadAnswer(f"choice {index}'s logprobs.token_logprobs do not match its tokens")
        named = logprobs.get("tokens")
        if isinstance(named, list) and named != [f"token_id:{t}" for t in tokens]:
            raise BadAnswer(f"choice {index}'s logprobs.tokens are not its token_ids")
        out = []
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise BadAnswer(f"choice {index} has a log-prob that is no finite number")
            out.append(float(v))
        logps[index] = out
    return ids, logps


def _detail(response: httpx.Response) -> str:
    """An error answer's message (vLLM's ``{"error": {"message": ...}}`` or ``detail``)."""
    try:
        body = response.json()
    except ValueError:
        return said(response.text, 200)
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body))
        if isinstance(error, dict):
            error = error.get("message", error)
        return said(str(error), 200)
    return said(str(body), 200)


def _failure(exc: BaseException) -> str:
    """What a request's httpx failure means, in words."""
    if isinstance(exc, httpx.ConnectError):
        return f"is unreachable ({one_line(exc)})"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return f"dropped the connection without an answer (did it stop?): {one_line(exc)}"
    if isinstance(exc, httpx.TimeoutException):
        return "did not answer in time"
    return f"failed: {one_line(exc)}"


class ServerCalls:
    """HTTP calls to the servers on an event loop of their own, bounded by ``timeout``: each
    failure is one line naming the server's URL (:class:`ServerError`)."""

    urls: list[str]
    max_in_flight: int
    timeout: float
    busy: list[str]  # the servers with requests in flight (the timeout's line)

    def _run(
        self,
        work: Callable[[httpx.AsyncClient], Awaitable[T]],
        what: str,
        timeout: float | None = None,
    ) -> T:
        """``work(client)`` on an event loop of its own (this thread's: ``generate`` may run
        in the trainer's generation thread), stopped after ``timeout`` seconds (default:
        the engine's)."""
        limits = httpx.Limits(max_connections=len(self.urls) * self.max_in_flight + 8)
        timeout = self.timeout if timeout is None else timeout

        async def bounded() -> T:
            async with httpx.AsyncClient(
                timeout=httpx.Timeout(timeout), limits=limits, follow_redirects=False
            ) as client:
                return await asyncio.wait_for(work(client), timeout)

        try:
            return asyncio.run(bounded())
        except TimeoutError:
            raise ServerError(
                f"rollout.engine: {what} had no complete answer from "
                f"{', '.join(self.busy) or 'the servers'} within rollout.engine.timeout "
                f"({self.timeout:g} s)"
            ) from None

    async def _call(
        self,
        client: httpx.AsyncClient,
        method: str,
        url: str,
        what: str,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        text: bool = False,
    ) -> Any:
        """The JSON answer of one request (None for an empty one; ``text``: the answer is
        text, not read); a :class:`ServerError` naming ``url`` for every way it fails."""
        self.busy.append(url)
        try:
            response = await client.request(method, url, json=body, params=params)
        except httpx.HTTPError as exc:
            raise ServerError(f"rollout.engine: {url} {_failure(exc)} ({what})") from None
        finally:
            self.busy.remove(url)
        if response.status_code != 200:
            raise ServerError(
                f"rollout.engine: {url} answered HTTP {response.status_code} to {what}: "
                f"{_detail(response)}"
            )
        if not response.content or text:
            return None
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"rollout.engine: {url} answered {what} with no JSON") from None


@VLLM_SERVER.implementation
class VLLMServerEngine(ServerCalls):
    """Generates through vLLM's servers; see the module docstring."""

    samples_from_policy = False

    def __init__(
        self,
        *,
        urls: list[str],
        share: bool,
        served_model_name: str,
        max_in_flight: int,
        timeout: float,
        weights_dir: str | None,
    ) -> None:
        self.all_urls = [root(u) for u in urls]
        self.share = share
        world = distributed.world()  # the split checked before the models are built
        self.urls = server_urls(self.all_urls, share, world.rank, world.size)
        self.model = served_model_name
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.weights_dir = weights_dir
        self.context: EngineContext | None = None
        self.folder: Path | None = None  # this run's folder of pushed weights
        self.current: Path | None = None  # the weights the servers hold now
        self.max_len: int | None = None  # the smallest max_model_len of the servers
        self.pushes = 0  # weight pushes made (the first at the start)
        self.generated: list[int] = []  # the pushes each generation came after
        self.busy: list[str] = []  # the servers with requests in flight (the timeout's line)
        self.lora_rank: int | None = None  # the actor's LoRA rank (None: full weights)
        self.lora_prefix = ""  # this run's adapter names, before -v<k>
        self.adapter: str | None = None  # the name the servers hold the current adapters under
        self.adapters = 0  # adapter pushes made

    @property
    def _started(self) -> EngineContext:
        if self.context is None:
            raise RuntimeError("the vllm_server engine was not started")
        return self.context

    # ------------------------------------------------------------------ start
    def _check_answers(self, url: str, models: Any, info: Any) -> None:
        """The server at ``url`` serves the actor under the engine's name, as the engine
        needs (vLLM's configuration from ``/server_info``)."""
        served = [m.get("id") for m in (models or {}).get("data", []) if isinstance(m, dict)]
        if self.model not in served:
            raise ServerError(
                f"rollout.engine: {url} serves {', '.join(map(str, served)) or 'no model'}, "
                f"not {self.model!r}: set rollout.engine.served_model_name to its name (vLLM's "
                f"--served-model-name), or start it for this spec ({HOW})"
            )
        config = info.get("vllm_config") if isinstance(info, dict) else None
        model_config = config.get("model_config") if isinstance(config, dict) else None
        if not isinstance(model_config, dict):
            raise ServerError(f"rollout.engine: {url}/server_info has no vllm_config")
        for key, value, flag in NEEDED:
            if model_config.get(key) != value:
                raise ServerError(
                    f"rollout.engine: {url} runs with {key} {model_config.get(key)!r}: start "
                    f"it with {flag} ({HOW})"
                )
        length = model_config.get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool):
            self.max_len = length if self.max_len is None else min(self.max_len, length)
        missing = None if self.lora_rank is None else lora_missing(config, info, self.lora_rank)
        if missing is not None:
            raise ServerError(
                f"rollout.engine: {url} cannot load the actor's LoRA adapters (model.lora): "
                f"start it with {missing} ({HOW})"
            )

    def start(self, context: EngineContext) -> None:
        self.lora_rank = _lora_rank(context.model)
        self.context = context
        self.urls = server_urls(self.all_urls, self.share, context.process, context.processes)

        async def check(client: httpx.AsyncClient) -> None:
            for url in self.urls:
                models = await self._call(client, "GET", f"{url}/v1/models", "GET /v1/models")
                try:
                    info = await self._call(
                        client,
                        "GET",
                        f"{url}/server_info",
                        "GET /server_info",
                        params={"config_format": "json"},
                    )
                except ServerError as exc:
                    if "HTTP 404" not in str(exc):
                        raise
                    raise ServerError(
                        f"rollout.engine: {url} has no /server_info or /collective_rpc (the "
                        f"weight push): start it with VLLM_SERVER_DEV_MODE=1 in its "
                        f"environment ({HOW})"
                    ) from None
                self._check_answers(url, models, info)

        self._run(check, "the start's checks")
        if not self.share or context.process == 0:  # it pushes into its servers
            self.folder = self._new_folder()
            os.chmod(self.folder, 0o755)  # a server run by another user reads it
        self._push()  # the base weights under LoRA
        if self.lora_rank is not None:
            # a name of this run's own: several runs may share a server
            token = f"{os.getpid()}-{secrets.token_hex(4)}" if context.process == 0 else ""
            if context.processes > 1:
                token = distributed.each(token)[0]
            self.lora_prefix = f"{self.model}-{token}"
            self._push_adapters()

    def _new_folder(self) -> Path:
        """This run's folder of pushed weights: in ``weights_dir``, else in the temporary
        directory, where the folders a killed run left are removed first (``new_folder``;
        not in ``weights_dir``, which processes of other machines may share)."""
        if self.weights_dir is None:
            return new_folder("server-")
        Path(self.weights_dir).mkdir(parents=True, exist_ok=True)
        prefix = f"{FOLDER_PREFIX}{os.getpid()}-server-"
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.weights_dir))

    # ------------------------------------------------------------------ generate
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling) -> Generation:
        context = self._started
        ids, mask = prompt_ids.cpu(), prompt_mask.cpu().bool()  # one copy each
        prompts = [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]
        longest = max((len(p) for p in prompts), default=0)
        if self.max_len is not None and longest + sampling.max_new_tokens > self.max_len:
            raise UserError(
                f"rollout.engine: a prompt of {longest} tokens and {sampling.max_new_tokens} "
                f"new tokens pass the servers' max_model_len of {self.max_len}: start them "
                "with a larger --max-model-len or lower rollout.max_new_tokens"
            )
        per = 1 if sampling.greedy else sampling.n
        if sampling.greedy and sampling.n > 1:  # one greedy response a request
            prompts = [p for p in prompts for _ in range(sampling.n)]
        bodies = [
            request_body(
                self.adapter or self.model,
                p,
                sampling,
                context.eos_ids,
                None if sampling.seed is None else (sampling.seed + i * per) % (1 << 63),
            )
            for i, p in enumerate(prompts)
        ]
        if context.progress is not None:
            context.progress(0, sampling.max_new_tokens, len(prompts) * per)
        answers = self._run(lambda client: self._complete(client, bodies, sampling), "a generation")
        if context.progress is not None:
            context.progress(sampling.max_new_tokens, sampling.max_new_tokens, len(prompts) * per)
        self.generated.append(self.pushes)
        responses = [tokens for ids_, _ in answers for tokens in ids_]
        logps = [values for _, lps in answers for values in lps]
        return Generation.from_token_lists(
            responses,
            None if sampling.greedy else logps,
            context.eos_ids,
            context.pad_id,
            prompt_ids.device,
        )

    async def _complete(
        self, client: httpx.AsyncClient, bodies: list[dict[str, Any]], sampling: Sampling
    ) -> list[tuple[list[list[int]], list[list[float]]]]:
        """Every request's (ids, log μ), in order: ``max_in_flight`` workers a server, each
        taking the next request when its last is answered."""
        results: list[Any] = [None] * len(bodies)
        queue = iter(range(len(bodies)))  # shared: the event loop runs one worker at a time

        async def worker(url: str) -> None:
            for i in queue:
                answer = await self._call(
                    client, "POST", f"{url}/v1/completions", "a completion", bodies[i]
                )
                try:
                    results[i] = parse_choices(
                        answer, bodies[i]["n"], sampling.max_new_tokens, sampling.greedy
                    )
                except BadAnswer as exc:
                    raise ServerError(
                        f"rollout.engine: {url}/v1/completions answered wrong: {exc}"
                    ) from None

        await _all(
            [worker(url) for url in self.urls for _ in range(min(self.max_in_flight, len(bodies)))]
        )
        return results

    # ------------------------------------------------------------------ sync
    def sync(self) -> None:
        """Push the updated policy into every server: its full weights, or its LoRA
        adapters."""
        if self.lora_rank is not None:
            self._push_adapters()
        else:
            self._push()

    def _push(self) -> None:
        """The actor's weights written to a new folder and reloaded by this process's
        servers when it pushes (process 0 for shared servers, every process for servers of
        its own), the folder of the previous push removed. On several processes every
        process takes part in the gathers, then all learn the outcome (module docstring)."""
        context = self._started
        several = context.processes > 1
        if several:
            distributed.barrier()  # no process generates from here to the push's end
        weights = base_weights(context.model)  # gathered whole, one at a time (collectives)
        failed: ServerError | None = None
        if self.folder is None:  # it pushes into no server: it joins the gathers
            for _ in weights:
                pass
        else:
            try:
                self._write_and_reload(self.folder / f"v{self.pushes}", weights)
            except ServerError as exc:
                failed = exc
        self._settle(failed)

    def _settle(self, failed: ServerError | None) -> None:
        """A push's outcome: counted, or its failure raised; on several processes every
        process learns process 0's count and the first failure (one gather)."""
        if self._started.processes == 1:
            if failed is not None:
                raise failed
            self.pushes += 1
            return
        outcomes = distributed.each((self.pushes + 1, None if failed is None else str(failed)))
        self.pushes = outcomes[0][0]  # process 0's count: every process records the same
        first = next((error for _, error in outcomes if error is not None), None)
        if first is not None:
            raise ServerError(first)

    def _write_and_reload(self, folder: Path, weights: Iterable[tuple[str, Tensor]]) -> None:
        """``weights`` as safetensors in ``folder``, reloaded by every server of this
        process, then their prefix caches reset; the previous push's folder removed."""
        from safetensors.torch import save_file

        folder.mkdir()
        tensors = {name: t.contiguous().cpu() for name, t in weights}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(folder, 0o755)
        os.chmod(folder / "model.safetensors", 0o644)

        async def push(client: httpx.AsyncClient) -> None:
            async def one(url: str) -> None:
                body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
                await self._call(client, "POST", f"{url}/collective_rpc", "the weight push", body)
                await self._call(
                    client, "POST", f"{url}/reset_prefix_cache", "the prefix cache's reset"
                )

            await _all([one(url) for url in self.urls])

        self._run(push, "the weight push")
        previous, self.current = self.current, folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)

    def _push_adapters(self) -> None:
        """The actor's adapters written to a new folder and loaded under a new name by the
        servers of a process that pushes (as for :meth:`_push`), the previous name unloaded
        and its folder removed; every process takes part in the gathers and learns the
        outcome."""
        context = self._started
        if context.processes > 1:
            distributed.barrier()  # no process generates from here to the push's end
        name = f"{self.lora_prefix}-v{self.adapters}"
        failed: ServerError | None = None
        if self.folder is None:  # it pushes into no server: it joins the gathers
            adapter_weights(context.model)
        else:
            try:
                folder = _written_adapters(context.model, self.folder / f"lora-v{self.adapters}")
                self._swap({"lora_name": name, "lora_path": str(folder)}, self.adapter)
                if self.current is not None:  # the previous adapters, or the base weights
                    shutil.rmtree(self.current, ignore_errors=True)
                self.current = folder
            except ServerError as exc:
                failed = exc
        self.adapter = name
        self.adapters += 1
        self._settle(failed)

    def _swap(
        self, load: dict[str, str] | None, unload: str | None, timeout: float | None = None
    ) -> None:
        """On every server, the adapters ``load`` names loaded, then the name ``unload``
        unloaded."""

        async def one(client: httpx.AsyncClient, url: str) -> None:
            if load is not None:
                await self._call(
                    client, "POST", f"{url}/v1/load_lora_adapter", "the adapters' load", load,
                    text=True,
                )  # fmt: skip
            if unload is not None:
                await self._call(
                    client, "POST", f"{url}/v1/unload_lora_adapter", "an adapters' unload",
                    {"lora_name": unload}, text=True,
                )  # fmt: skip

        self._run(
            lambda client: _all([one(client, url) for url in self.urls]),
            "the adapters' push",
            timeout,
        )

    def close(self) -> None:
        if self.adapter is not None and self.folder is not None:
            with contextlib.suppress(ServerError):  # best effort: the run is over
                self._swap(None, self.adapter, UNLOAD_TIMEOUT)
        self.adapter = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        self.current = None
        self.context = None


def _written_adapters(model: Any, folder: Path) -> Path:
    """``folder``, holding the actor's adapters as peft saves them, readable by all."""
    write_adapter(model, folder)
    os.chmod(folder, 0o755)  # a server run by another user reads it
    for file in folder.iterdir():
        os.chmod(file, 0o644)
    return folder


def _lora_rank(model: Any) -> int | None:
    """The rank of the actor's LoRA adapters (None: no adapters)."""
    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict) or not config:
        return None
    return int(getattr(next(iter(config.values())), "r", 0)) or None


async def _all(jobs: list[Awaitable[None]]) -> None:
    """Run ``jobs`` together; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
