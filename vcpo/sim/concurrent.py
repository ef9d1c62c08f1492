"""Generation and learning at once (``execution=concurrent``): the simulated rollout server in a process of its own.

PipelineRL's layout on two cores. A generator process produces the batches of steps start .. steps-1
(generation, then rewards) while the learner trains on them; after every optimizer step the learner
publishes the new policy version into shared memory, and the generator waits until the version a
batch needs is there. Under a lag model that overlaps (``Rollouts.overlaps``: no batch n >= 1 needs
θ_n), batch n is generated while the learner computes θ_n, so the two sides run at once. Each side
computes exactly what the serial loop computes, in the same order and from the same seeds, so a
concurrent run logs the serial run's metrics (timings aside); the tests hold that.

Weights travel through a ring of lag + 1 slots of shared tensors, version v in slot v mod (lag + 1).
The learner writes θ_{s+1} after training on batch s, when the generator has produced batch s and
needs only versions >= s + 1 - lag (``fixed``; >= s for ``pipeline_overlap``), so the slot written
(that of θ_{s-lag}) is never read again. A lock guards the ring; the generator polls the version it needs
rather than sleeping on a condition, because a process killed inside a multiprocessing ``Condition.wait``
never gives its wake back, and the next ``notify_all`` would block the learner forever. Every wait of the
learner's (the lock, the next batch) has a timeout and checks that the generator lives; and since between its
waits the learner may train, evaluate or checkpoint for minutes on a loaded machine (or wait for the rest of a
batch its generator died sending), a thread watching the generator's pidfd interrupts the learner's main thread
the moment the generator dies (``GeneratorInterrupt``, turned into `GeneratorDied`). Batches travel back pickled
at once, in a queue: the server's state keeps changing after a batch is sent. The generator dies with the
learner (PR_SET_PDEATHSIG), ignores Ctrl-C (the learner stops it), and reports its own failure as a traceback
the learner raises.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vcpo.lifetimes import die_with_parent

# The generator side's share of a step, measured in the process that did the work.
GENERATOR_TIMINGS = ("timing_s/gen", "timing_s/reward", "timing_s/gen_wait_weights")
POLL_S = 1.0  # how often the learner, waiting, checks that the generator is still alive
VERSION_POLL_S = 0.001  # how often the generator looks for the version it waits for
# What the watching thread sends the learner's main thread when the generator dies (no other part of a run uses it).
DEATH_SIGNAL = signal.SIGUSR2


class GeneratorDied(RuntimeError):
    """The generator process ended while the learner needed it (killed, out of memory, ...)."""


class GeneratorInterrupt(BaseException):
    """The generator died while the learner worked: raised wherever the learner's main thread was, and, as with
    KeyboardInterrupt, no ``except Exception`` on the way (a checkpoint's write error, say) takes it for its own.
    The run turns it into GeneratorDied with its message."""


@dataclass
class Produced:
    """One step's batch as the generator side hands it over."""

    step: int
    trajectories: list
    results: list[dict]  # the reward function's result per trajectory
    tool_log: object | None  # vcpo.sim.rollout.ToolLog of the batch's generation (multi-turn), else None
    timings: dict[str, float] = field(default_factory=dict)
    rollout_state: dict | None = None  # the server's state after this batch, where the learner checkpoints next


@dataclass
class GeneratorFailed:
    traceback: str


class SharedWeights:
    """Policy versions in shared memory, a ring of ``slots`` state dicts shaped like ``template``."""

    def __init__(self, template: dict[str, torch.Tensor], slots: int, context):
        self.slots = [{name: value.detach().clone().share_memory_() for name, value in template.items()} for _ in range(slots)]
        self.versions = torch.full((slots,), -1, dtype=torch.long).share_memory_()
        self.lock = context.Lock()
        self.waited_s = 0.0  # the generator's time waiting for versions, since the last take_waited()

    def publish(self, version: int, state: dict[str, torch.Tensor], reader_alive: Callable[[], bool] = lambda: True) -> None:
        """Write ``version`` into its slot; GeneratorDied when the lock stays taken by a reader that has died."""
        slot = version % len(self.slots)
        while not self.lock.acquire(timeout=POLL_S):
            if not reader_alive():
                raise GeneratorDied(f"the generator process died holding the weights' lock (publishing version {version})")
        try:
            for name, value in state.items():
                self.slots[slot][name].copy_(value)
            self.versions[slot] = version
        finally:
            self.lock.release()

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """Version ``version``'s weights, once the learner has published them."""
        slot = version % len(self.slots)
        started = time.perf_counter()
        while True:
            with self.lock:
                current = int(self.versions[slot])
            if current == version:
                break
            if current > version:
                raise RuntimeError(f"policy version {version} was overwritten by {current}: the ring is too small")
            time.sleep(VERSION_POLL_S)
        self.waited_s += time.perf_counter() - started
        return self.slots[slot]

    def take_waited(self) -> float:
        waited, self.waited_s = self.waited_s, 0.0
        return waited


def _generate(produce: Callable[[int], Produced], bind: Callable, first: int, steps: int, weights: SharedWeights,
              channel, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the learner ended before the line above took effect
        os._exit(1)
    try:
        bind(weights.get)
        for step in range(first, steps):
            produced = produce(step)
            produced.timings["timing_s/gen_wait_weights"] = waited = weights.take_waited()
            produced.timings["timing_s/gen"] -= waited
            channel.put(pickle.dumps(produced, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException:
        channel.put(pickle.dumps(GeneratorFailed(traceback.format_exc())))
    channel.close()
    channel.join_thread()


class GeneratorProcess:
    """The learner's end of a generator process: ``next_batch(step)`` and ``publish(version, weights)``.

    ``produce(step)`` must compute a step's batch exactly as the serial loop does; in the generator process
    (forked: it starts from the learner's state as it is, resumed or new) ``bind(get)`` first makes it read
    policy versions through ``get(version)``. ``published``: the versions the first batches may need."""

    def __init__(self, produce: Callable[[int], Produced], bind: Callable[[Callable[[int], dict]], None],
                 template: dict[str, torch.Tensor], slots: int, published: dict[int, dict[str, torch.Tensor]],
                 first: int, steps: int):
        context = multiprocessing.get_context("fork")  # the server's state as it is, without pickling a model
        self.weights = SharedWeights(template, slots, context)
        for version, state in sorted(published.items()):
            self.weights.publish(version, state)
        self.channel = context.Queue()
        self.process = context.Process(target=_generate, args=(produce, bind, first, steps, self.weights, self.channel, os.getpid()),
                                       name="vcpo-sim-generator", daemon=True)
        self.process.start()
        self.due = first  # the step whose batch the learner takes next
        self._closing = False
        self._watcher = self._interrupt_when_the_generator_dies()

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.weights.publish(version, state, self.process.is_alive)

    def next_batch(self, step: int) -> Produced:
        while True:
            try:
                item = pickle.loads(self.channel.get(timeout=POLL_S))
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise GeneratorDied(self.death_message(self.process.exitcode)) from None
        if isinstance(item, GeneratorFailed):
            raise RuntimeError(f"the generator process failed at step {step}:\n{item.traceback}")
        if item.step != step:
            raise RuntimeError(f"the generator sent step {item.step}'s batch where step {step}'s was due")
        self.due = step + 1
        return item

    def death_message(self, exitcode: int | None) -> str:
        return f"the generator process ended (exit code {exitcode}) before step {self.due}'s batch"

    def _interrupt_when_the_generator_dies(self) -> threading.Thread | None:
        """A thread that raises GeneratorInterrupt in the main thread when the generator ends other than by finishing
        its steps (None where that cannot be: a learner off the main thread, no pidfd; the waits' checks remain)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        try:
            handle = os.pidfd_open(self.process.pid)
        except OSError:
            return None
        died: list[int] = []

        def interrupt(signum, frame) -> None:  # in the main thread, between two of its bytecodes
            if died and not self._closing:
                raise GeneratorInterrupt(self.death_message(died[0]))

        def watch() -> None:
            select.select([handle], [], [])
            try:  # WNOWAIT: the zombie stays for multiprocessing to reap
                ended = os.waitid(os.P_PIDFD, handle, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # reaped already: the learner saw the end itself
                return
            finally:
                os.close(handle)
            if (ended.si_code == os.CLD_EXITED and ended.si_status == 0) or self._closing:
                return  # it produced every batch (or reported its failure in the queue), or the learner stopped it
            died.append(ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status)
            signal.pthread_kill(threading.main_thread().ident, DEATH_SIGNAL)

        self._previous_handler = signal.signal(DEATH_SIGNAL, interrupt)
        watcher = threading.Thread(target=watch, name="vcpo-sim-generator-watch", daemon=True)
        watcher.start()
        return watcher

    def close(self) -> None:
        self._closing = True
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()
        if self._watcher is not None:
            self._watcher.join()  # its signal, if it sent one, has reached the main thread: now the handler can go
            signal.signal(DEATH_SIGNAL, self._previous_handler)
        self.channel.close()
        self.channel.cancel_join_thread()
