"""Training under asynchronous exceptions, run by ``test_async_exceptions.py`` in a fresh process.

Usage: ``python async_exc_worker.py BACKEND DIRECTORY STEPS SIGNAL``. Each step arms a one-shot
timer (``setitimer``) at a random point of a tiny GPT's step, up to 1.5 step times, so about a
third of the steps complete. Every layer is offloaded (``policy="offload"``): the adaptive default
would keep a model this small in memory, and its steps would finish before most timers. With ``SIGNAL`` =
``alarm`` the handler raises a user exception; with ``int`` the timer sends a real SIGINT and
Python's default handler raises ``KeyboardInterrupt``. The loop catches it and goes on. Prints one
JSON line: steps completed exactly, steps interrupted, signals sent, wrong steps, and what tba left
behind (spill files, descriptors opened since before the first step).

Note: [Signals that land in a weakref callback]
CPython runs a signal handler at the next bytecode boundary, which can be inside a weak-reference
callback written in Python (``WeakKeyDictionary``'s ``remove``); an exception raised there is
"ignored" (handed to ``sys.unraisablehook``) and never reaches the loop. tba's own weak references
have no callbacks for this reason, but torch's and the standard library's do. The worker's
unraisable hook therefore records each swallowed interrupt with the module that owns the callback,
and reports them as ``swallowed``: the test accepts those from outside tba and fails on any from tba.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import sys
import time
import weakref

import torch

import tba
from tba._control import settle
from tba.bench.models import PRESETS, make_batch, make_gpt


class Interrupted(Exception):
    pass


def _owner(callback: object) -> str:
    """The module that owns ``callback``: for a container's ``remove`` closure (``WeakKeyDictionary``,
    ``WeakSet``) the module whose globals, or whose class's instance, hold that container."""
    captured = [cell.cell_contents for cell in getattr(callback, "__closure__", None) or ()]
    for target in captured + list(getattr(callback, "__defaults__", None) or ()):
        target = target() if isinstance(target, weakref.ref) else target
        if target is None or callable(target):
            continue
        for holder in gc.get_referrers(target):
            if not isinstance(holder, dict):
                continue
            if holder.get("__name__") in sys.modules and sys.modules[holder["__name__"]].__dict__ is holder:
                return holder["__name__"]
            for outer in gc.get_referrers(holder):
                if getattr(outer, "__dict__", None) is holder:
                    return type(outer).__module__
                if isinstance(outer, dict) and outer.get("__name__") in sys.modules:
                    return outer["__name__"]
    return getattr(callback, "__module__", None) or "?"


def record_swallowed(swallowed: list[str]) -> None:
    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if unraisable.exc_type in (Interrupted, KeyboardInterrupt):
            swallowed.append(_owner(unraisable.object))
        else:
            sys.__unraisablehook__(unraisable)

    sys.unraisablehook = hook


def main() -> None:
    backend, directory, steps, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    config = PRESETS["tiny"]
    model = make_gpt(config)
    tokens, targets = make_batch(config)

    def step(ctx: object) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with ctx:
            loss = model(tokens, targets)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    want = step(tba.offload_activations(directory, backend="threads", min_offload_bytes=1 << 40))
    start = time.perf_counter()
    for _ in range(3):
        step(tba.offload_activations(directory, backend=backend, min_offload_bytes=0, policy="offload"))
    step_s = (time.perf_counter() - start) / 3
    settle()
    tba.shutdown()
    fds_before = set(os.listdir("/proc/self/fd"))
    sent = []
    swallowed: list[str] = []
    record_swallowed(swallowed)

    def on_alarm(signum: int, frame: object) -> None:
        sent.append(signum)
        raise Interrupted

    if kind == "alarm":
        signal.signal(signal.SIGALRM, on_alarm)
    else:
        signal.signal(signal.SIGALRM, lambda signum, frame: (sent.append(signum), os.kill(os.getpid(), signal.SIGINT)))
    rng = random.Random(0)
    done = interrupted = wrong = 0
    for _ in range(steps):
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0001, 1.5 * step_s))
                grads = step(tba.offload_activations(directory, backend=backend, min_offload_bytes=0, policy="offload"))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            done += 1
            wrong += not all(torch.equal(g, w) for g, w in zip(grads, want))
        except (Interrupted, KeyboardInterrupt):
            interrupted += 1
        grads = None
    gc.collect()
    settle()
    # Successive contexts share idle runtimes (file, engine) per directory until shutdown: what is
    # still open after it was leaked.
    tba.shutdown()
    left = sorted(set(os.listdir("/proc/self/fd")) - fds_before)
    print(json.dumps({"done": done, "interrupted": interrupted, "sent": len(sent), "wrong": wrong,
                      "swallowed": swallowed,
                      "files": os.listdir(directory),
                      "fds": [os.readlink(f"/proc/self/fd/{fd}") for fd in left if os.path.exists(f"/proc/self/fd/{fd}")]}))


if __name__ == "__main__":
    main()
