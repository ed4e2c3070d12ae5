"""Starts the server: loads the model and the engine, then runs one uvicorn listener per plane
address on a uvloop event loop, and stops cleanly on SIGINT / SIGTERM (refuse new requests with
503, finish those in flight, then exit)."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import sys
import threading
from dataclasses import replace
from typing import Any

import uvicorn

from mindie.config_keys import ConfigError
from mindie.engine.async_engine import AsyncEngine
from mindie.engine.engine import LLMEngine
from mindie.server.app import build_apps
from mindie.server.config import ServerSettings
from mindie.server.dmi import PDNode
from mindie.server.http import listener, start
from mindie.server.metrics import ServerMetrics
from mindie.server.serving import Serving

DRAIN_LIMIT_S = 600  # longest a shutdown waits for requests in flight


def load(settings: ServerSettings, progress: bool = True) -> Serving:
    from tqdm import tqdm

    from mindie.model.loader import describe, load_model
    from mindie.ops.memory import return_free_heap

    steps = tqdm(total=2, desc="Loading model", unit="step", disable=not progress, dynamic_ncols=True)
    loaded = load_model(settings.model_path, settings.dtype, settings.quantization, settings.activation_bits)
    print(f"model {loaded.source}: {describe(loaded)}", file=sys.stderr)
    steps.update(1)
    try:
        engine = LLMEngine(loaded, settings.engine)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    steps.update(1)
    steps.close()
    print(f"context: {engine.limits.describe()}", file=sys.stderr)
    print(f"steps: {engine.config.describe_steps()}", file=sys.stderr)
    name = settings.model_name or loaded.name
    # From here on the settings say what runs: the served name, and every token limit set.
    settings = replace(settings, model_name=name, engine=engine.config)
    serving = Serving(settings, AsyncEngine(engine, settings.queue_delay_s), ServerMetrics(name))
    if settings.dmi:
        serving.pd = PDNode(settings, serving.engine)
    return_free_heap()
    print(f"memory: {memory_line(loaded.source, engine.kv_cache_bytes)}", file=sys.stderr)
    return serving


def _resident_bytes() -> int | None:
    """The process's resident set (Linux), None where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def _model_file_bytes(source: str) -> int:
    """The bytes of the model as stored: a GGUF file, or a directory's weight files."""
    if os.path.isfile(source):
        return os.path.getsize(source)
    return sum(os.path.getsize(os.path.join(source, f)) for f in os.listdir(source)
               if f.endswith((".safetensors", ".bin", ".gguf")))


def memory_line(source: str, kv_cache_bytes: int) -> str:
    """Resident memory at start-up against what it is made of: the model file, the KV cache (all
    of it allocated now), and the rest (Python, torch, tokenizers, working buffers)."""
    mib = 2**20
    model, resident = _model_file_bytes(source), _resident_bytes()
    parts = f"model file {model / mib:.0f} MiB + KV cache {kv_cache_bytes / mib:.0f} MiB"
    if resident is None:
        return parts
    return f"resident {resident / mib:.0f} MiB = {parts} + {(resident - model - kv_cache_bytes) / mib:.0f} MiB other"


def _ssl_options(settings: ServerSettings) -> dict[str, object]:
    """uvicorn's TLS options: our own context, for CA bundles of several files and revocation lists."""
    tls = settings.tls
    if tls is None:
        return {}
    password = None
    if tls.key_password_file:
        with open(tls.key_password_file, encoding="utf-8") as f:
            password = f.read().strip()

    def context(config: uvicorn.Config, default: Any) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(tls.cert, tls.key, password=password)
        if tls.ca_files:  # mutual TLS: clients must present a certificate signed by one of these
            for ca in tls.ca_files:
                ctx.load_verify_locations(cafile=ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
            for crl in tls.crl_files:
                ctx.load_verify_locations(cafile=crl)
            if tls.crl_files:
                ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        return ctx

    return {"ssl_context_factory": context}


async def serve(ctx: Serving, announce: bool = True, stop: asyncio.Event | None = None) -> None:
    """Serves until SIGINT / SIGTERM (when run in the main thread) or until `stop` is set."""
    apps = build_apps(ctx)
    scheme = "https" if ctx.settings.tls else "http"
    listeners = [
        listener(app, host, port, timeout_keep_alive=60, **_ssl_options(ctx.settings))
        for (host, port), app in apps.items()
    ]
    loop = asyncio.get_running_loop()
    stopping = stop or asyncio.Event()
    in_main_thread = threading.current_thread() is threading.main_thread()

    def on_signal() -> None:
        if stopping.is_set():  # a second Ctrl-C: stop now
            for one in listeners:
                one.force_exit = True
        stopping.set()
        ctx.draining = True

    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)

    async def drain() -> None:
        await stopping.wait()
        ctx.draining = True
        if announce:
            print(f"stopping: finishing {len(ctx.in_flight)} request(s) in flight", file=sys.stderr)
        for _ in range(DRAIN_LIMIT_S * 10):
            if not ctx.in_flight:
                break
            await asyncio.sleep(0.1)
        for one in listeners:
            one.should_exit = True

    drainer = asyncio.ensure_future(drain())
    tasks, started = await start(listeners)
    if started and announce:
        for (host, port), _ in apps.items():
            planes = [name for name, addr in (("business", (ctx.settings.host, ctx.settings.port)), (
                "management", (ctx.settings.management_host, ctx.settings.management_port)), (
                "metrics", (ctx.settings.management_host, ctx.settings.metrics_port)), (
                "intercomm", (ctx.settings.host, ctx.settings.inter_comm_port))) if addr == (host, port)]
            print(f"{'+'.join(planes)} plane listening on {scheme}://{host}:{port}", file=sys.stderr)
        print(f"serving {ctx.settings.model_name}; Ctrl-C to stop", file=sys.stderr)
    await asyncio.gather(*tasks, return_exceptions=True)
    drainer.cancel()
    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    ctx.engine.shutdown()
    if ctx.pd is not None:
        ctx.pd.close()
    failed = [t.exception() for t in tasks if t.exception() is not None] or [
        None for one in listeners if not one.started]
    if failed:
        raise SystemExit(f"could not start every listener: {failed[0] or 'address in use?'}")


SWITCH_INTERVAL_S = float(os.environ.get("MINDIE_SWITCH_INTERVAL_S", "0.0005"))


def run(settings: ServerSettings) -> None:
    ctx = load(settings)
    import uvloop

    # The engine thread takes the GIL back after every torch / kernel call (hundreds per step);
    # while the event loop runs Python, each of those waits up to the switch interval (5 ms by
    # default). A short interval keeps the HTTP work from stretching the model step.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvloop.run(serve(ctx))
