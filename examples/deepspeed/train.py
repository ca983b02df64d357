"""Train tba's built-in GPT with DeepSpeed, with or without tba offloading its activations.

The DeepSpeed config comes from ``--config`` (default: ``ds_config.json`` beside this script:
ZeRO-2, optimizer states offloaded to CPU, torch's Adam). ``--tba`` adds a ``"tba"`` block to it
(``{}`` unless the file has one, plus ``--tba-dir``), which turns tba on through
:class:`tba.integrations.deepspeed.TbaDeepSpeed`. Data is synthetic and seeded, so runs with and
without ``--tba`` see the same batches and dropout masks and print the same losses.

One line per optimizer step::

    step N loss X time T mem M

``loss`` is the mean over the step's micro-batches (full precision), ``time`` the step's wall time
in seconds (forward, backward and ``engine.step()`` of every micro-batch), ``mem`` its activation
peak in MiB, measured as ``tba/bench/harness.py`` does: the peak resident set size during the step
minus the size just before it, plus the idle read buffers tba held before the step. It runs under
the malloc ``--allocator`` picks (below; ``--allocator system`` runs glibc's, with its adaptive mmap
threshold, as a user's plain process does), and the summary gives the largest ``mem`` over all
steps, the first included, besides the median of the later steps. ``--malloc-env`` re-executes the
script once with glibc's mmap threshold fixed (``tba.bench.meters.MALLOC_ENV``), the controlled mode
in which freed tensors always leave the process. The first step also allocates the optimizer states.

Runs as one process without a launcher (it sets ``RANK=0``, ``WORLD_SIZE=1`` and a free
``MASTER_PORT`` when they are unset), or under ``deepspeed`` / ``torchrun``.

``--allocator`` (default ``auto``, the best caching malloc found; ``system`` for the C library's)
re-executes the script once with that malloc preloaded (:func:`tba.allocator.run_script_under`), the
same with and without tba; the header names it (docs/cpu-memory.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import time

from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import detect, run_script_under
from tba.defaults import MIB

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Example: python examples/deepspeed/train.py --steps 3 --tba")
    parser.add_argument("--config", default=os.path.join(HERE, "ds_config.json"),
                        help="DeepSpeed config JSON (default: %(default)s)")
    parser.add_argument("--tba", action="store_true", help="add a \"tba\" block to the config: offload activations")
    parser.add_argument("--tba-dir", default=None, help="tba's directory (default: the block's, else $TBA_DIR or /tmp)")
    parser.add_argument("--preset", default="bench", help="model preset from tba/bench/models.py (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--grad-accum", type=int, default=None, help="override gradient_accumulation_steps")
    parser.add_argument("--checkpoint", action="store_true",
                        help="run every block under deepspeed.checkpointing.checkpoint (reentrant recompute)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and dropout (default: %(default)s)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc to run under (re-executes the script once): auto = best caching one found "
                             "(default), system = the C library's")
    parser.add_argument("--malloc-env", action="store_true",
                        help="controlled measurement: re-run with glibc's mmap threshold fixed (default: plain process)")
    return parser.parse_args(argv)


def reexec_with_malloc_env() -> None:
    """Restart this script with the fixed mmap threshold unless it already runs with it."""
    from tba.bench.meters import MALLOC_ENV

    if any(os.environ.get(key) != value for key, value in MALLOC_ENV.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **MALLOC_ENV))


def single_process_env() -> None:
    """torch.distributed settings for one process, unless a launcher set them."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)


def skip_shared_memory_allreduce(deepspeed) -> None:
    """With one rank there is nothing to reduce between processes; DeepSpeed's CPU backend would
    still JIT-compile its shared-memory allreduce op (about a minute, and a C++ compiler) on first
    use. Marking the op unavailable makes DeepSpeed use torch.distributed's gloo directly."""
    builder = deepspeed.accelerator.get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and int(os.environ["WORLD_SIZE"]) == 1:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def build_config(args: argparse.Namespace) -> dict:
    with open(args.config) as file:
        config = json.load(file)
    if args.grad_accum is not None:
        config["gradient_accumulation_steps"] = args.grad_accum
        config.pop("train_batch_size", None)
    if args.tba:
        block = config.setdefault("tba", {})
        if args.tba_dir is not None:
            block["directory"] = args.tba_dir
    return config


def checkpoint_blocks(blocks, checkpoint) -> None:
    """Route each block's forward through DeepSpeed's reentrant activation checkpointing."""
    for block in blocks:
        block.forward = lambda *inputs, _forward=block.forward: checkpoint(_forward, *inputs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if argv is None:
        run_script_under(args.allocator)
    if args.malloc_env:
        reexec_with_malloc_env()
    single_process_env()
    import deepspeed
    import torch

    from tba.bench.meters import PeakRSS
    from tba.bench.models import PRESETS, make_batch, make_gpt
    from tba.integrations.deepspeed import TbaDeepSpeed

    skip_shared_memory_allreduce(deepspeed)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    config = build_config(args)
    model_config = PRESETS[args.preset]
    micro_batch = config.get("train_micro_batch_size_per_gpu", model_config.batch_size)
    model_config = type(model_config)(**{**vars(model_config), "batch_size": micro_batch})
    model = make_gpt(model_config, seed=args.seed)
    if args.checkpoint:
        checkpoint_blocks(model.blocks, deepspeed.checkpointing.checkpoint)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    offload = TbaDeepSpeed(engine, config)
    accumulation = engine.gradient_accumulation_steps()
    print(f"malloc {detect()}", flush=True)
    print(f"preset {args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"micro-batch {micro_batch}, gradient accumulation {accumulation}, ZeRO stage "
          f"{engine.zero_optimization_stage()}, tba {'on' if offload.offloader else 'off'}", flush=True)
    peaks = []
    for step in range(1, args.steps + 1):
        losses = []
        held_before = offload.offloader.pool_idle_bytes if offload.offloader is not None else 0
        with PeakRSS() as peak:
            began = time.perf_counter()
            for micro in range(accumulation):
                index = (step - 1) * accumulation + micro
                tokens, targets = make_batch(model_config, seed=args.seed + index)
                torch.manual_seed(args.seed + index)
                with offload:
                    loss = engine(tokens, targets)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                del loss
            elapsed = time.perf_counter() - began
        peaks.append(peak.delta_bytes + held_before)
        print(f"step {step} loss {sum(losses) / len(losses)!r} time {elapsed:.3f} mem {peaks[-1] / MIB:.1f}",
              flush=True)
    offload.close()
    later = peaks[1:] or peaks
    print(f"activation peak, median of steps {args.steps - len(later) + 1}..{args.steps}: "
          f"{statistics.median(later) / MIB:.1f} MiB; largest over steps 1..{args.steps}: {max(peaks) / MIB:.1f} MiB")
    if offload.stats is not None:
        stats = offload.stats
        print(f"tba wrote {stats.bytes_written / MIB:.1f} MiB, read {stats.bytes_read / MIB:.1f} MiB, "
              f"kept {stats.bytes_kept / MIB:.1f} MiB in memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
