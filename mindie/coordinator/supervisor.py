"""`mindie cluster`'s watch over its processes once the cluster is up: a process that exits is
started again while the others keep serving, and both the cluster's output and the process's own log
say why it stopped (its exit code, or the signal that killed it).

Restarts back off: the first comes `first_delay_s` after the exit, and each further exit in a row
of a process that had not stayed up `stable_after_s` doubles the wait, up to `max_delay_s`, so that
one failing at start (its port taken, its model file gone) is retried without spinning. A process
that stayed up that long starts the count again.

The coordinator is restarted like an instance: the instances keep running and keep their roles
(a new coordinator offers each one its role again, which changes nothing, and opens its `/dresult`
streams anew); only the requests the old one was relaying are lost, their clients' connections with
it. A restarted instance comes back roleless: the coordinator sees that in its `/v1/status` and
gives it its role again (instances.Registry.poll).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


class Process(Protocol):
    pid: int

    def poll(self) -> int | None: ...


class Supervised(Protocol):
    """What a Supervisor needs of a cluster (cluster.LocalCluster)."""

    @property
    def processes(self) -> Mapping[str, Process]: ...

    @property
    def started_at(self) -> Mapping[str, float]: ...  # each process's last start, on the supervisor's clock

    def restart(self, name: str) -> None: ...

    def note(self, name: str, message: str) -> None: ...


def describe_exit(returncode: int) -> str:
    """Popen's returncode in words: a negative one is the signal that ended the process."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0  # up this long, a process is healthy: its next exit waits first_delay_s again

    def delay(self, quick_exits: int) -> float:
        return min(self.first_delay_s * 2 ** max(quick_exits - 1, 0), self.max_delay_s)


@dataclass
class _Watch:
    quick_exits: int = 0  # exits in a row, each before the process had stayed up stable_after_s
    restart_at: float | None = None  # it has exited: when it starts again
    restarts: int = 0


def _to_stderr(message: str) -> None:
    print(f"mindie cluster: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, cluster: Supervised, policy: RestartPolicy = RestartPolicy(),
                 report: Callable[[str], None] = _to_stderr, clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster = cluster
        self.policy = policy
        self.report = report
        self.clock = clock
        self._watches: dict[str, _Watch] = {}

    def restarts(self, name: str) -> int:
        watch = self._watches.get(name)
        return watch.restarts if watch else 0

    def check(self) -> None:
        """One look at every process: one that has exited gets its restart planned, and one whose
        time has come is started."""
        now = self.clock()
        for name, proc in list(self.cluster.processes.items()):
            watch = self._watches.setdefault(name, _Watch())
            if watch.restart_at is None:
                if (returncode := proc.poll()) is not None:
                    self._exited(name, watch, returncode, now)
            elif now >= watch.restart_at:
                self._restart(name, watch, now)

    def run(self, should_stop: Callable[[], bool], interval_s: float = 0.2) -> None:
        while not should_stop():
            self.check()
            time.sleep(interval_s)

    def _exited(self, name: str, watch: _Watch, returncode: int, now: float) -> None:
        up = now - self.cluster.started_at.get(name, now)
        delay = self._plan(watch, now, quick=up < self.policy.stable_after_s)
        self._say(name, f"{name} {describe_exit(returncode)} after {up:.1f} s up; restarting it in {delay:g} s")

    def _plan(self, watch: _Watch, now: float, quick: bool) -> float:
        watch.quick_exits = watch.quick_exits + 1 if quick else 1
        delay = self.policy.delay(watch.quick_exits)
        watch.restart_at = now + delay
        return delay

    def _restart(self, name: str, watch: _Watch, now: float) -> None:
        watch.restart_at = None
        try:
            self.cluster.restart(name)
        except OSError as exc:  # could not even spawn it: tried again later, as after a quick exit
            delay = self._plan(watch, now, quick=True)
            self._say(name, f"could not restart {name} ({exc}); trying again in {delay:g} s")
            return
        watch.restarts += 1
        self._say(name, f"{name} restarted (pid {self.cluster.processes[name].pid}, restart {watch.restarts})")

    def _say(self, name: str, message: str) -> None:
        self.report(message)
        self.cluster.note(name, message)
