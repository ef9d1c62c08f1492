"""Walk a simulator run's config through the calls that pass it on; count the walk's stays, rooms and returns.

Runs a tiny simulator training (a random one-layer model, 2 steps, threads=1) as ``Trainer(config).run()`` under
``sys.setprofile`` and keeps the calls of vcpo's functions that receive the run's config: one of the arguments,
other than a method's ``self``, is a ``SimConfig`` or an object holding one as an attribute (``ResolvedRun``, the
``Trainer``, ``RunFolder``). ``--derived`` also follows what is derived from it: the config's field values
(an int, bool or None excepted: those cannot be told apart by identity), what its properties return, and what a
call on the walk returns (other than an int, bool or None). ``--once``: each function's first call only, so that the
loop's steps count once. A room is vcpo's first-level module or package (``vcpo.sim``); ``--rooms module``: each
module (``vcpo.sim.train``); ``--rooms sim``: each module of ``vcpo.sim``, else the first-level one. A stay is a
maximal run of consecutive walk calls in one room; a return, a stay in a room the walk had left before
(returns = stays - rooms).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import tempfile
from pathlib import Path

import vcpo
from vcpo.local_models import save_random_model
from vcpo.sim.config import SimConfig, apply_overrides
from vcpo.sim.train import Trainer

TINY = {"steps": 2, "prompts_per_step": 2, "responses_per_prompt": 2, "micro_batch_size": 4, "max_response_tokens": 8,
        "update_tokens": 4, "eval_every": 0, "eval_problems": 4, "warmup_steps": 0, "checkpoint_every": 1,
        "progress": False, "lag": 2, "threads": 1}
PACKAGE = str(Path(vcpo.__file__).resolve().parent)


def holds_config(value) -> bool:
    if isinstance(value, SimConfig):
        return True
    attributes = getattr(value, "__dict__", None)
    if attributes is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        attributes = {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    return isinstance(attributes, dict) and any(isinstance(v, SimConfig) for v in attributes.values())


def room(module: str, rooms: str) -> str:
    parts = module.split(".")
    if rooms == "module" or (rooms == "sim" and parts[:2] == ["vcpo", "sim"]):
        return module
    return ".".join(parts[:2])


class Walk:
    """The calls on the walk, as (module, qualified name), in the order they start."""

    def __init__(self):
        self.calls: list[tuple[str, str, bool]] = []  # (module, function, whether it receives the config itself)
        self.tracked: dict[int, object] = {}  # id -> the derived value (kept alive, so that its id is not reused)
        self.returning: set[int] = set()  # frames on the walk (or a SimConfig's own), whose return is derived

    def track(self, value) -> None:
        if isinstance(value, (str, float, tuple, Path)) or type(value).__module__.startswith("vcpo."):
            self.tracked[id(value)] = value

    def profile(self, frame, event, arg):
        if event == "return" and id(frame) in self.returning:
            self.returning.discard(id(frame))
            self.track(arg)
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        code, local = frame.f_code, frame.f_locals
        count = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[:count])
        values = [local.get(name) for name in names]
        if code.co_flags & inspect.CO_VARARGS:
            values += list(local.get(code.co_varnames[count], ()))
            count += 1
        if code.co_flags & inspect.CO_VARKEYWORDS:
            values += list(local.get(code.co_varnames[count], {}).values())
        if names and names[0] in ("self", "cls"):
            owner, values = values[0], values[1:]
            if isinstance(owner, SimConfig):  # a property or method of the config: what it returns is derived
                self.returning.add(id(frame))
        holds = any(holds_config(v) for v in values)
        if holds or any(id(v) in self.tracked for v in values):
            self.calls.append((frame.f_globals.get("__name__", "?"), code.co_qualname, holds))
            self.returning.add(id(frame))

    def follow(self, config: SimConfig) -> None:
        for field in dataclasses.fields(config):
            self.track(getattr(config, field.name))
        sys.setprofile(self.profile)
        try:
            Trainer(config).run()
        finally:
            sys.setprofile(None)


def stays(calls: list[tuple[str, str, bool]], rooms: str, derived: bool = False, once: bool = False) -> list[str]:
    seen, sequence = set(), []
    for module, function, holds in calls:
        if (once and (module, function) in seen) or not (holds or derived):
            continue
        seen.add((module, function))
        name = room(module, rooms)
        if not sequence or sequence[-1] != name:
            sequence.append(name)
    return sequence


def summary(sequence: list[str]) -> dict:
    returns = sum(1 for i, name in enumerate(sequence) if name in sequence[:i])
    return {"stays": len(sequence), "rooms": len(set(sequence)), "returns": returns, "sequence": sequence}


VARIANTS = [(derived, once, rooms) for derived in (False, True) for once in (False, True)
            for rooms in ("package", "sim", "module")]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", action="store_true", help="print every call on the walk")
    parser.add_argument("--sequence", action="store_true", help="print each variant's rooms in order")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = save_random_model(Path(tmp) / "base", hidden_size=32, num_layers=1)
        config = apply_overrides(SimConfig(), {**TINY, "base": str(base), "out": str(Path(tmp) / "run")})
        walk = Walk()
        walk.follow(config)
    if args.calls:
        for module, function, holds in walk.calls:
            print(f"  {'config ' if holds else 'derived'} {module}.{function}")
    results = []
    print(f"{'follows':8} {'calls':6} {'rooms':8} {'stays':>5} {'rooms':>5} {'returns':>7}")
    for derived, once, rooms in VARIANTS:
        result = summary(stays(walk.calls, rooms, derived, once))
        result.update(derived=derived, once=once, room=rooms)
        results.append(result)
        print(f"{'derived' if derived else 'config':8} {'first' if once else 'all':6} {rooms:8} "
              f"{result['stays']:5} {result['rooms']:5} {result['returns']:7}")
        if args.sequence:
            print("    " + " -> ".join(result["sequence"]))
    return results


if __name__ == "__main__":
    main()
