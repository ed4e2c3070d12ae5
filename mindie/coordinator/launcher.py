"""Runs the coordinator: its four listeners on one uvloop event loop, the instances brought into
service in the background, and a clean stop on SIGINT / SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading

from mindie.coordinator.app import build_apps
from mindie.coordinator.config import CoordinatorConfig
from mindie.coordinator.service import Coordinator
from mindie.server.http import listener, start

DRAIN_S = 30  # on a stop, requests in flight get this long to finish


async def serve(coord: Coordinator, stop: asyncio.Event | None = None, announce: bool = True) -> None:
    """Serves until SIGINT / SIGTERM (in the main thread) or until `stop` is set."""
    cfg = coord.config
    apps = build_apps(coord)
    listeners = [
        listener(app, host, port, timeout_keep_alive=max(1, int(cfg.keep_alive_s)), server_header=False,
                 headers=[("server", cfg.server_name)], timeout_graceful_shutdown=DRAIN_S)
        for (host, port), app in apps.items()
    ]
    stopping = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping.set)
    tasks, started = await start(listeners)
    if not started:  # a port in use: stop everything
        stopping.set()
    else:
        coord.start()
        if announce:
            print(f"coordinator: predict on http://{cfg.predict_ip}:{cfg.predict_port}, manage on "
                  f"http://{cfg.manage_ip}:{cfg.manage_port}, status on :{cfg.status_port}, metrics on "
                  f":{cfg.external_port}; {len(cfg.instances)} instance(s)", file=sys.stderr, flush=True)
    await stopping.wait()
    for one in listeners:
        one.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    await coord.close()
    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if not started:
        raise SystemExit("coordinator: could not start every listener (address in use?)")


def run(config: CoordinatorConfig) -> None:
    import uvloop

    logging.basicConfig(level={"WARN": "WARNING"}.get(config.log_level, config.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(Coordinator(config)))
