"""torch alone: does non-reentrant checkpoint's early stop survive CUDA memory history or the sanitizer?

    python tools/checkpoint_early_stop.py none|history|sanitizer [--steps 200]

A checkpointed ``Linear-GELU-Linear-Dropout`` block on CUDA, forward and backward ``--steps`` times, no
tba. ``history`` records ``torch.cuda.memory._record_memory_history()`` first; ``sanitizer`` needs
``TORCH_CUDA_SANITIZER=1`` in the environment (torch enables it at import). Prints the errors backward
raised, the first one, and the checkpoint frames still alive. On an H200 with torch 2.11 (docs/gpu.md,
the third run): none 0 of 200, history 200 of 200 (``SystemError``), sanitizer 200 of 200 and one frame
alive: why tba runs recomputations to the end under those tools (Note [Recomputation runs to the end] in
``tba/runtime/_early_stop.py``). ``--early-stop-off`` passes ``early_stop=False``, tba's workaround.
It also prints the device bytes allocated after the first and the last step (``--block gpt``: the tiny
GPT's block, whose attention saves views): the fourth run saw a tba step with a recomputed layer under
both tools end holding 1 MiB its first call allocated, and whether torch alone does is the next question.
Exits 2 without CUDA, 1 when any step failed.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import sys

import torch
from torch.utils.checkpoint import checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("none", "history", "sanitizer"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--early-stop-off", action="store_true", help="pass early_stop=False, as tba does")
    parser.add_argument("--block", choices=("mlp", "gpt"), default="mlp",
                        help="the checkpointed layer: Linear-GELU-Linear-Dropout, or the tiny GPT's block (attention)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("checkpoint_early_stop: needs a CUDA GPU")
        return 2
    if args.mode == "sanitizer" and "TORCH_CUDA_SANITIZER" not in os.environ:
        print("checkpoint_early_stop: run with TORCH_CUDA_SANITIZER=1 in the environment")
        return 2
    if args.mode == "history":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    extra = {"early_stop": False} if args.early_stop_off else {}
    if extra and "early_stop" not in inspect.signature(checkpoint).parameters:
        print("checkpoint_early_stop: this torch's checkpoint takes no early_stop= (tba keeps early stop there)")
        return 2
    if args.block == "gpt":
        from tba.bench.models import PRESETS, Block

        layer = Block(PRESETS["tiny"]).cuda()
    else:
        layer = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                    torch.nn.Dropout(0.1)).cuda()
    failures, first, allocated = 0, None, []
    for _ in range(args.steps):
        x = torch.randn(2, 32, 64, device="cuda", requires_grad=True)
        try:
            checkpoint(lambda t: t + layer(t), x, use_reentrant=False, **extra).sum().backward()
        except Exception as err:  # noqa: BLE001 - counting whatever torch raises is the point
            failures += 1
            first = first or f"{type(err).__name__}: {err}"
        del x
        gc.collect()
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    frames = sum(1 for o in gc.get_objects() if type(o).__name__ == "_CheckpointFrame")
    print(f"{args.mode}{' early_stop=False' if extra else ''} ({args.block}): {failures} of {args.steps} steps failed"
          f"{'; first: ' + first if first else ''}; checkpoint frames alive: {frames}; bytes allocated after "
          f"the first step {allocated[0]}, after the last {allocated[-1]}, most {max(allocated)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
