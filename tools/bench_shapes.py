#!/usr/bin/env python3
"""Inputs whose shape changes every step: how many steps of the bare adaptive context follow a plan.

A collator that pads each batch to its longest sequence gives a new input shape at most steps. This
trains a built-in GPT under ``with tba.offload_activations(directory=d):`` (nothing else passed,
a new context per step), each step on a batch of a sequence length drawn at random between half
the preset's length and the whole of it, and reports per step what the step did: ``P`` profiled
(offload-all, measured), ``-`` offloaded everything without a plan, or the code of the plan it
followed (its own shape's or that of a larger shape covering it: Note [A new input shape follows a
larger one's plan] in ``tba/runtime/_input_shapes.py``). Losses are compared with the same steps
without tba.

Example:
    python tools/bench_shapes.py --preset demo --steps 60
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tba  # noqa: E402
from tba.bench.models import PRESETS, make_batch, make_gpt  # noqa: E402


def _steps(preset: str, steps: int, seed: int) -> list[int]:
    config, rng = PRESETS[preset], random.Random(seed)
    return [rng.randint(config.seq_len // 2, config.seq_len) for _ in range(steps)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="built-in GPT (default demo)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths (default 0)")
    parser.add_argument("--directory", default=None, help="spill directory (default: a new one under /var/tmp)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    config = PRESETS[args.preset]
    lengths = _steps(args.preset, args.steps, args.seed)
    model = make_gpt(config)
    reference = copy.deepcopy(model)
    directory = args.directory or tempfile.mkdtemp(prefix="tba-shapes-", dir="/var/tmp")
    print(f"model: GPT preset {args.preset!r}; {args.steps} steps, sequence length {config.seq_len // 2}-"
          f"{config.seq_len} at random (seed {args.seed}); spill directory {directory}", flush=True)
    did, same = [], True
    for step, length in enumerate(lengths):
        batch = make_batch(dataclasses.replace(config, seq_len=length), seed=step)
        torch.manual_seed(step)
        with tba.offload_activations(directory) as offloader:
            loss = model(*batch)
            profiled = offloader.policy_runner._step.pending is not None
            plan = offloader.plan
        loss.backward()
        torch.manual_seed(step)
        expected = reference(*batch)
        expected.backward()
        same = same and torch.equal(loss.detach(), expected.detach())
        did.append("P" if profiled else plan.code if plan is not None else "-")
        print(f"step {step:3d}  length {length:4d}  {did[-1]}", flush=True)
    same = same and all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    first = next((i for i, code in enumerate(did) if code not in ("P", "-")), len(did))
    after = did[first:]
    planned = sum(code not in ("P", "-") for code in after)
    print(f"first plan at step {first}; after it, {planned} of {len(after)} steps followed a plan, "
          f"{after.count('P')} were profiled, {after.count('-')} offloaded everything unplanned")
    print(f"losses and gradients identical to training without tba: {'yes' if same else 'NO'}")
    if args.directory is None:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
