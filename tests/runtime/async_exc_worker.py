"""Training under asynchronous exceptions, run by ``test_async_exceptions.py`` in a fresh process.

Usage: ``python async_exc_worker.py BACKEND DIRECTORY STEPS SIGNAL``. Each step arms a one-shot
timer (``setitimer``) at a random point of a tiny GPT's step (up to 1.5 step times, so about a
third of the steps complete). With ``SIGNAL`` =
``alarm`` the handler raises a user exception; with ``int`` the timer sends a real SIGINT and
Python's default handler raises ``KeyboardInterrupt``. The loop catches it and goes on. Prints one
JSON line: steps completed exactly, steps interrupted, signals sent, wrong steps, and what tba left
behind (spill files, descriptors opened since before the first step).
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import sys
import time

import torch

import tba
from tba._control import settle
from tba.bench.models import PRESETS, make_batch, make_gpt


class Interrupted(Exception):
    pass


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
        step(tba.offload_activations(directory, backend=backend, min_offload_bytes=0))
    step_s = (time.perf_counter() - start) / 3
    settle()
    tba.shutdown()
    fds_before = set(os.listdir("/proc/self/fd"))
    sent = []

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
                grads = step(tba.offload_activations(directory, backend=backend, min_offload_bytes=0))
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
                      "files": os.listdir(directory),
                      "fds": [os.readlink(f"/proc/self/fd/{fd}") for fd in left if os.path.exists(f"/proc/self/fd/{fd}")]}))


if __name__ == "__main__":
    main()
