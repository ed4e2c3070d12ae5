"""A real server (uvicorn on uvloop, the real engine) on free local ports, in a background thread."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import replace

import httpx
import uvloop

from mindie.config import EngineConfig
from mindie.server.config import ServerSettings
from mindie.server.launcher import load, serve
from mindie.server.serving import Serving

_handed_out: set[int] = set()


def free_block(hosts: list[str], offsets: Iterable[int]) -> int:
    """A base port whose base + offset, for each offset, is free now on every host and was not handed
    out before by this process, taken below the kernel's ephemeral range (32768 up): a port handed out
    by bind(0) can be taken by an outgoing connection or another bind(0) before the process binds it
    (a coordinator once died on 'address already in use' for its manage port, predict + 1; two PD
    audio tests for a server's port)."""
    offsets = list(offsets)
    for _ in range(1000):
        base = random.randrange(10000, 32768 - max(offsets))
        ports = {base + offset for offset in offsets}
        if ports & _handed_out:
            continue
        try:
            with ExitStack() as stack:
                for host in hosts:
                    for port in ports:
                        stack.enter_context(socket.socket()).bind((host, port))
        except OSError:
            continue
        _handed_out.update(ports)
        return base
    raise RuntimeError(f"no free block of ports {offsets} on {hosts} below 32768")


def free_port(host: str = "127.0.0.1") -> int:
    return free_block([host], [0])


def local_settings(model_path: str | None, **changes: object) -> ServerSettings:
    """Settings for a test server: every plane on 127.0.0.1, on its own free port."""
    base = ServerSettings(host="127.0.0.1", port=free_port(), management_host="127.0.0.1",
                          management_port=free_port(), metrics_port=free_port(), model_path=model_path,
                          engine=EngineConfig(num_kv_blocks=64, block_size=16, max_seq_len=512, max_input_token_len=400,
                                              max_iter_times=256))
    return replace(base, **changes)  # type: ignore[arg-type]


class RunningServer:
    def __init__(self, settings: ServerSettings, ctx: Serving | None = None) -> None:
        self.settings = settings
        self.ctx = ctx or load(settings, progress=False)
        self._loop = uvloop.new_event_loop()
        self._stop = asyncio.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._wait_ready()
        scheme = "https" if settings.tls else "http"
        self.url = f"{scheme}://127.0.0.1:{settings.port}"
        self.management_url = f"{scheme}://127.0.0.1:{settings.management_port}"
        self.metrics_url = f"{scheme}://127.0.0.1:{settings.metrics_port}"

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(serve(self.ctx, announce=False, stop=self._stop))
        except BaseException as exc:  # surfaced by _wait_ready / close
            self._error = exc

    def _wait_ready(self) -> None:
        import time

        for _ in range(400):
            if self._error is not None:
                raise self._error
            try:
                with socket.create_connection(("127.0.0.1", self.settings.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.025)
        raise TimeoutError("the test server did not start")

    def call_soon(self, fn, *args) -> None:
        """Runs fn(*args) on the server's event loop, as its own tasks would."""
        self._loop.call_soon_threadsafe(fn, *args)

    def run(self, coro, timeout: float = 10):
        """Runs a coroutine on the server's event loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


def chat_with_parts(server: RunningServer, content: list[dict] | str, **extra: object) -> httpx.Response:
    """One user turn of `content` (a string or parts) to the chat route: greedy, 6 tokens, the
    prompt's and the answer's token ids returned."""
    body = {"model": server.settings.model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, "return_token_ids": True, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def respond_with_parts(server: RunningServer, content: list[dict], **extra: object) -> httpx.Response:
    """One user turn of Responses parts to /v1/responses: greedy, 6 tokens."""
    body = {"model": server.settings.model_name, "input": [{"role": "user", "content": content}],
            "max_output_tokens": 6, "temperature": 0, **extra}
    return httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)


def assert_responds_as_chat(server: RunningServer, content: list[dict], chat_content: list[dict]) -> dict:
    """The Responses route answers `content` as the chat route answers `chat_content` (the same
    media as chat parts): the same text from the same number of prompt and output tokens. The
    response's body."""
    said = chat_with_parts(server, chat_content)
    assert said.status_code == 200, said.text
    r = respond_with_parts(server, content)
    assert r.status_code == 200, r.text
    body, said = r.json(), said.json()
    assert body["output"][0]["content"][0]["text"] == said["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == said["usage"]["prompt_tokens"]  # the media tokens included
    assert body["usage"]["output_tokens"] == said["usage"]["completion_tokens"]
    return body
