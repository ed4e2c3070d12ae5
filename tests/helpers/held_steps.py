"""Control over an engine's steps from a test: a step can be held until released (a long prefill
in progress), every step can cost a time per computed token (a model on a busy CPU, where a
tiny random model would compute in microseconds), and each step records the requests it ran."""

from __future__ import annotations

import threading
import time

import torch

from mindie.engine.engine import LLMEngine
from mindie.engine.runner import PromptLogits
from mindie.engine.scheduler import SchedulerOutput
from mindie.engine.sequence import Sequence


class HeldSteps:
    def __init__(self, engine: LLMEngine, cost_s_per_token: float = 0.0) -> None:
        self.cost_s_per_token = cost_s_per_token
        self.steps: list[set[str]] = []  # per step run, the ids of the requests it computed
        self._open = threading.Event()
        self._open.set()
        self._entered = threading.Event()
        self._execute = engine.runner.execute
        engine.runner.execute = self._run  # type: ignore[method-assign]

    def _run(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence], list[PromptLogits]]:
        self.steps.append({s.seq.request.request_id for s in out.scheduled})
        self._entered.set()
        self._open.wait()
        time.sleep(self.cost_s_per_token * out.num_tokens)
        return self._execute(out)

    def hold(self) -> None:
        """The next step waits, once it has started, until release()."""
        self._entered.clear()
        self._open.clear()

    def wait_held(self, timeout: float = 10.0) -> None:
        if not self._entered.wait(timeout):
            raise TimeoutError("no step started")

    def release(self) -> None:
        self._open.set()

    def ran_since(self, first_step: int) -> set[str]:
        """Every request computed by the steps from `first_step` (an index into `steps`) on."""
        return set().union(*self.steps[first_step:])
