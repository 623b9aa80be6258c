"""The engine in its own process: the same outputs as the engine in a thread (greedy, seeded
sampling with n > 1, stop strings, aborts, refusals), each delivered once and in order; aborts
reach the child; a paused reader's outputs merge; a dead child fails the open streams and the
health check; stopping (and the command's SIGINT, and a killed server) leaves no process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from paged_attention.cli.serve import ServeSpec
from paged_attention.engine import Engine, SamplingParams
from paged_attention.engine.request import RequestError
from paged_attention.modeling.models import load_model
from paged_attention.server.engine_owner import (
    EngineClosedError,
    EngineOwner,
    EngineStepError,
    ThreadEngineOwner,
)
from paged_attention.server.engine_process import EngineProcess, EngineSpec, ProcessEngineOwner

OPTIONS = dict(num_blocks=128, block_size=16, max_num_seqs=16)
SPEC = EngineSpec("tiny", OPTIONS)
ROOT = Path(__file__).resolve().parents[1]


class Finals:
    """on_step: keeps the finished outputs the owner reports (aborted ones included)."""

    def __init__(self) -> None:
        self.outputs = []

    def __call__(self, engine, outputs) -> None:
        self.outputs += [o for o in outputs if o.finished]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def process_owner():
    finals = Finals()
    owner = EngineOwner(EngineProcess(SPEC), on_step=finals)
    owner.finals = finals
    owner.start()
    yield owner
    owner.stop()


async def collect(owner, prompt, params, abort_after: int | None = None):
    """The request's items after its admission (or the refusal alone)."""
    stream = owner.submit(prompt, params)
    first = await stream.outputs.get()
    if first is not None:
        return first
    items = []
    while True:
        item = await stream.outputs.get()
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items
        if len(items) == abort_after:
            owner.abort(stream)
            await asyncio.sleep(0.2)
            while not stream.outputs.empty():  # outputs already on their way when it aborted
                items.append(stream.outputs.get_nowait())
            assert not any(item.finished for item in items)  # the abort's output is not its
            return items


REQUESTS = [
    ("Hello there", SamplingParams(max_new_tokens=30), None),
    ("Three samples", SamplingParams(max_new_tokens=20, n=3, temperature=1.0, seed=5), None),
    ("Stop me", SamplingParams(max_new_tokens=40, temperature=1.0, seed=3), None),  # see below
    ("Aborted", SamplingParams(max_new_tokens=300), 3),
    ("Too long", SamplingParams(max_new_tokens=5000), None),  # beyond the model's context
    ("Scored", SamplingParams(max_new_tokens=12, logprobs=3, prompt_logprobs=2), None),
]


def same_logprobs(ours, theirs) -> bool:
    """Entries (dicts of token id -> Logprob, or None) with the same tokens and ranks, and
    values equal to float32 rounding (the two processes run the same model)."""
    if ours is None or theirs is None:
        return ours is theirs
    return len(ours) == len(theirs) and all(
        (a is None and b is None)
        or (
            a is not None
            and b is not None
            and list(a) == list(b)
            and all(a[t].rank == b[t].rank and abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        )
        for a, b in zip(ours, theirs)
    )


def serve_one_by_one(owner, tokenizer, requests):
    async def scenario():
        results = []
        for text, params, abort_after in requests:
            prompt = tokenizer(text)["input_ids"]
            results.append(await collect(owner, prompt, params, abort_after))
        return results

    return asyncio.run(scenario())


def test_the_process_owner_gives_the_thread_owners_outputs_once_each_in_order(tiny, process_owner):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer=tokenizer, **OPTIONS)
    # a stop string met in the middle of that sampled answer (the tiny model's text is random)
    text, params, _ = REQUESTS[2]
    (answer,) = engine.generate([text], params)
    stop = answer.texts[0][12:14]
    assert len(stop) == 2 and stop in answer.texts[0]
    requests = list(REQUESTS)
    requests[2] = (text, SamplingParams(**{**vars(params), "stop": (stop,)}), None)
    thread_owner = ThreadEngineOwner(engine)
    thread_owner.start()
    try:
        expected = serve_one_by_one(thread_owner, tokenizer, requests)
    finally:
        thread_owner.stop()
    got = serve_one_by_one(process_owner, tokenizer, requests)
    for (_, _, abort_after), ours, theirs in zip(requests, got, expected):
        if isinstance(theirs, Exception):
            assert type(ours) is type(theirs) is RequestError
            assert (ours.argument, ours.limit, str(ours)) == (
                theirs.argument,
                theirs.limit,
                str(theirs),
            )
            continue
        # A reader slower than the engine gets merged items (OutputQueue), so the number of
        # items depends on timing; the outputs do not.
        last, reference = ours[-1], theirs[-1]
        if abort_after is not None:  # two prefixes of the same greedy answer
            shorter = min(len(last.outputs[0]), len(reference.outputs[0]))
            assert last.outputs[0][:shorter] == reference.outputs[0][:shorter]
        else:
            assert (last.outputs, last.texts, last.finish_reasons, last.prompt) == (
                reference.outputs,
                reference.texts,
                reference.finish_reasons,
                reference.prompt,
            )
        entries = range(len(last.outputs))
        # every token and character delivered exactly once, in order
        assert [sum((o.new_tokens[i] for o in ours), []) for i in entries] == last.outputs
        assert ["".join(o.new_texts[i] for o in ours) for i in entries] == last.texts
        if last.logprobs is not None or reference.logprobs is not None:
            assert all(map(same_logprobs, last.logprobs, reference.logprobs))
            assert same_logprobs(last.prompt_logprobs, reference.prompt_logprobs)
            # each token's logprobs delivered once, in order
            assert [sum((o.new_logprobs[i] for o in ours), []) for i in entries] == last.logprobs
        if abort_after is None:
            assert last.finished and last.metrics.finished_time is not None
            assert len(last.metrics.token_times) == len(reference.metrics.token_times)
    assert len(got[1][-1].outputs) == 3
    assert got[2][-1].finish_reasons == ["stop"]
    assert got[2][-1].texts[0] == answer.texts[0][: answer.texts[0].index(stop)]
    scored = got[5][-1]
    assert len(scored.logprobs[0]) == 12 and len(scored.prompt_logprobs) == len(scored.prompt)


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_an_abort_reaches_the_engine_and_frees_its_blocks(tiny, process_owner):
    engine = process_owner.engine
    tokenizer, finals = tiny[1], process_owner.finals.outputs
    seen = len(finals)
    got = serve_one_by_one(
        process_owner, tokenizer, [("Abort me", SamplingParams(max_new_tokens=500), 2)]
    )
    assert not got[0][-1].finished
    wait_for(lambda: len(finals) > seen)
    assert finals[-1].finish_reasons == ["abort"] and len(finals[-1].outputs[0]) < 500
    assert len(engine.scheduler.running) == 0
    assert engine.block_manager.num_free_device_blocks() == engine.block_manager.num_device_blocks
    assert engine.stats.steps > 0


def test_a_paused_reader_gets_one_merged_output(tiny, process_owner):
    tokenizer = tiny[1]
    params = SamplingParams(max_new_tokens=150)
    prompt = tokenizer("pause")["input_ids"]
    finals = process_owner.finals.outputs

    async def scenario():
        seen = len(finals)
        stream = process_owner.submit(prompt, params)
        assert await stream.outputs.get() is None
        while len(finals) == seen:  # the reader pauses until the whole answer is there
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert stream.outputs.qsize() == 1
        return stream.outputs.get_nowait(), finals[-1]

    merged, final = asyncio.run(scenario())
    assert merged.finished and len(merged.outputs[0]) == 150
    assert merged.new_tokens == merged.outputs == final.outputs
    assert merged.new_texts == merged.texts == final.texts


def child_pids() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dead_engine_process_fails_its_streams_and_the_health_check(tiny):
    owner = EngineOwner(EngineProcess(SPEC))
    assert isinstance(owner, ProcessEngineOwner)
    owner.start()
    assert owner.alive
    prompt = tiny[1]("die")["input_ids"]

    async def scenario():
        stream = owner.submit(prompt, SamplingParams(max_new_tokens=1000))
        assert await stream.outputs.get() is None
        await stream.outputs.get()  # running
        os.kill(owner.engine.process.pid, signal.SIGKILL)
        while True:
            item = await stream.outputs.get()
            if isinstance(item, BaseException):
                return item

    error = asyncio.run(scenario())
    assert isinstance(error, EngineStepError)
    assert f"exit status {-signal.SIGKILL}" in str(error) and "died" in str(error)
    assert not owner.alive

    async def late():
        with pytest.raises(EngineClosedError, match="not running"):
            owner.submit(prompt, SamplingParams())

    asyncio.run(late())
    owner.stop(timeout=10)
    assert gone(owner.engine.process.pid)


def test_stop_ends_the_running_requests_and_the_engine_process(tiny):
    before = child_pids()
    owner = EngineOwner(EngineProcess(SPEC))
    pid = owner.engine.process.pid
    assert pid in child_pids() - before
    owner.start()
    prompt = tiny[1]("stop")["input_ids"]

    async def scenario():
        stream = owner.submit(prompt, SamplingParams(max_new_tokens=1000))
        assert await stream.outputs.get() is None
        await stream.outputs.get()
        await asyncio.to_thread(owner.stop, 30)
        outputs = []
        while not stream.outputs.empty():
            outputs.append(stream.outputs.get_nowait())
        return outputs

    outputs = asyncio.run(scenario())
    assert outputs[-1].finished and outputs[-1].finish_reasons == ["abort"]
    assert not owner.alive
    assert gone(pid) and pid not in child_pids()


def test_a_bad_serve_argument_is_a_usage_error_and_leaves_no_process():
    import argparse

    from paged_attention.cli import serve
    from paged_attention.errors import UsageError

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    before = child_pids()
    args = parser.parse_args(["--model", "tiny", "--kv-memory", "0.000001"])
    with pytest.raises(UsageError, match="--kv-memory"):
        EngineProcess(ServeSpec(args))
    wait_for(lambda: not (child_pids() - before), timeout=10)


def test_a_serve_spec_that_sends_no_tokenizer():
    """serve's own process reads the tokenizer while the engine's loads the model: the engine
    is built with its tokenizer all the same, and only the sizes come back."""
    import argparse

    from paged_attention.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny", "--num-blocks", "16", "--no-compile"])
    engine = EngineProcess(ServeSpec(args, send_tokenizer=False))
    try:
        assert engine.tokenizer is None and engine.block_manager.num_device_blocks == 16
    finally:
        engine.close()


def start_serve(port: int, stderr=None, extra: list[str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "paged_attention", "serve", "--model", "tiny"]
    command += ["--port", str(port), "--num-blocks", "64", "--log-level", "warning"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        command + (extra or []), env=environment, start_new_session=True, stderr=stderr
    )


def wait_healthy(port: int, server: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 180
    while True:
        assert server.poll() is None, "the server exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.1)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_serve_leaves_no_engine_process(sig):
    """Ctrl-C reaches the whole process group (the engine's process ignores it; the server
    shuts down and stops it, exit status 0); a killed server's engine process exits by itself
    (its command pipe closes). No process of the server's is left either way."""
    port = free_port()
    server = start_serve(port)
    try:
        wait_healthy(port, server)
        # the engine's process, forked from the command line's own process (its command line
        # is the server's), and possibly multiprocessing's resource tracker
        children = psutil.Process(server.pid).children()
        command = " ".join(psutil.Process(server.pid).cmdline())
        assert any(" ".join(c.cmdline()) == command for c in children)
        assert not any("spawn_main" in " ".join(c.cmdline()) for c in children)
        if sig == signal.SIGINT:
            os.killpg(server.pid, sig)  # as a terminal's Ctrl-C does
            assert server.wait(60) == 0
        else:
            server.kill()
            server.wait(60)
        wait_for(lambda: all(gone(child.pid) for child in children), timeout=30)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def test_a_second_ctrl_c_quits_at_once_without_a_traceback():
    """Ctrl-C twice while a request is open (its body half sent, so the graceful shutdown
    waits for it, with --shutdown-timeout an hour): the server quits at the second, with exit
    status 0, no traceback (uvicorn cancels the lifespan then) and no process of its own left."""
    import socket

    port = free_port()
    server = start_serve(port, stderr=subprocess.PIPE, extra=["--shutdown-timeout", "3600"])
    try:
        wait_healthy(port, server)
        children = psutil.Process(server.pid).children()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b'\r\nContent-Length: 100\r\n\r\n{"model": '
            )
            time.sleep(0.5)
            os.killpg(server.pid, signal.SIGINT)
            time.sleep(2)  # the first one began the graceful shutdown: it waits for the request
            assert server.poll() is None
            os.killpg(server.pid, signal.SIGINT)
            assert server.wait(30) == 0
        errors = server.stderr.read().decode()
        assert "Traceback" not in errors and "CancelledError" not in errors, errors
        wait_for(lambda: all(gone(child.pid) for child in children), timeout=30)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


FORKED = """
from paged_attention.engine import SamplingParams
from paged_attention.server.engine_process import EngineProcess, EngineSpec
import asyncio
from paged_attention.server.engine_owner import EngineOwner

async def main():
    owner = EngineOwner(EngineProcess(EngineSpec("tiny", {"num_blocks": 32}), start_method="fork"))
    owner.start()
    stream = owner.submit([3, 4, 5], SamplingParams(max_new_tokens=5))
    items = [await stream.outputs.get()]
    while items[-1] is None or not items[-1].finished:
        items.append(await stream.outputs.get())
    await asyncio.to_thread(owner.stop)
    print(items[-1].outputs)

asyncio.run(main())
"""


def test_fork_start_in_a_fresh_process_serves_the_same_tokens(tiny):
    """``start_method="fork"`` from a process that has run no torch operation yet (what it is
    for: a start without importing torch again) gives the same tokens."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer=tokenizer, num_blocks=32, block_size=16)
    (expected,) = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=5))
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", FORKED], env=environment, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(expected.outputs)
