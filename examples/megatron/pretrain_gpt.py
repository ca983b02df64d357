"""Train a megatron-core GPTModel on synthetic tokens, with or without tba.

Builds a GPTModel (local layer spec, fp32) from the flags, trains ``--steps`` steps of plain SGD
on random tokens drawn from a fixed seed, and prints one line per step::

    step N loss X time T mem M

``X`` is the exact loss (Python's shortest round-trip form of the float32 value), ``T`` the step
time in seconds (forward, backward, optimizer step), and ``M`` the activation memory of the step
in MiB: on CPU the peak resident set size during the step minus the resident set size before it
(:class:`tba.bench.meters.PeakRSS`), on CUDA the peak allocated bytes minus those allocated before.
Weight gradients stay allocated across steps, so ``M`` is activations and their transient
gradients. With ``--tba-offload-activations`` each forward runs inside a
:class:`tba.integrations.megatron.MegatronOffloader`; losses are identical with and without it.

``--cpu`` runs on the CPU with the stand-ins of ``cpu_shims.py`` for Megatron's CUDA-only calls,
under the malloc ``--allocator`` picks (below; ``--allocator system`` runs glibc's, with its adaptive
mmap threshold, as a user's plain process does); the last line gives the largest ``M`` over all
steps, the first included. ``--malloc-env`` re-executes the script once with glibc's mmap threshold
fixed (``tba.bench.meters.MALLOC_ENV``), the controlled mode in which freed tensors always leave the
resident set. Without ``--cpu`` the script needs one
CUDA device (single process, NCCL).
``--allocator`` (default ``auto``, the best caching malloc found; ``system`` for the C library's)
re-executes the script once with that malloc preloaded (:func:`tba.allocator.run_script_under`), the
same with and without tba; the header names it (docs/cpu-memory.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import detect, run_script_under
from tba.bench.meters import MALLOC_ENV, CudaPeak, PeakRSS
from tba.defaults import MIB
from tba.integrations.megatron import add_tba_arguments, offloader_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Memory is measured as described in this file's docstring.")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gloo, CUDA stand-ins)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    parser.add_argument("--malloc-env", action="store_true",
                        help="controlled measurement: re-run with glibc's mmap threshold fixed (default: plain process)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc to run under (re-executes the script once): auto = best caching one found "
                             "(default), system = the C library's")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers (default: 8)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default: 8)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length in tokens (default: 512)")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size in sequences (default: 2)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default: 1024)")
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout (default: 0.1)")
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default: 1e-3)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of weights, tokens and dropout (default: 1234)")
    parser.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                        help="Megatron activation recompute (default: none)")
    parser.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                        help="with --recompute-granularity full (default: uniform)")
    parser.add_argument("--recompute-num-layers", type=int, default=None,
                        help="with --recompute-granularity full (default: 1)")
    add_tba_arguments(parser)
    return parser


def build_gpt(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """A megatron-core GPTModel with the local layer spec, seeded by ``args.seed``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute: dict[str, Any] = {}
    if args.recompute_granularity is not None:
        recompute["recompute_granularity"] = args.recompute_granularity
    if args.recompute_granularity == "full":
        recompute["recompute_method"] = args.recompute_method or "uniform"
        recompute["recompute_num_layers"] = args.recompute_num_layers or 1
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        hidden_dropout=args.dropout, attention_dropout=args.dropout,
        use_cpu_initialization=device.type == "cpu", **recompute)
    torch.manual_seed(args.seed)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq)
    return model.to(device)


def synthetic_batches(args: argparse.Namespace, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of random tokens from a generator seeded by ``args.seed``; labels are the next token."""
    from cpu_shims import causal_mask

    generator = torch.Generator().manual_seed(args.seed)
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, -1)
    mask = causal_mask(args.seq, device)
    while True:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
        yield {"input_ids": tokens[:, :-1].contiguous(), "position_ids": positions, "attention_mask": mask,
               "labels": tokens[:, 1:].contiguous()}


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss; GPTModel returns per-token losses when given labels."""
    return model(**batch).mean()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
               offloader: Any = None) -> torch.Tensor:
    """Forward (inside ``offloader`` when given), backward, optimizer step; returns the detached loss."""
    optimizer.zero_grad(set_to_none=False)
    with offloader if offloader is not None else contextlib.nullcontext():
        loss = forward_loss(model, batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


@contextlib.contextmanager
def megatron_world(cpu: bool, seed: int) -> Iterator[torch.device]:
    """Megatron's process group and model-parallel state for one process; yields the device."""
    if cpu:
        from cpu_shims import cpu_megatron

        with cpu_megatron():
            yield torch.device("cpu")
        return
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; pass --cpu to run on the CPU")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(seed)
        yield torch.device("cuda", 0)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def train(args: argparse.Namespace) -> list[float]:
    """Run the whole training as the flags say, printing one line per step; returns the losses."""
    losses = []
    with megatron_world(args.cpu, args.seed) as device:
        model = build_gpt(args, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        offloader = offloader_from_args(args, model)
        mode = "tba" if offloader is not None else "keep"
        params = sum(p.numel() for p in model.parameters())
        print(f"# {mode}: GPTModel {args.layers} layers, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, "
              f"batch {args.batch}, vocab {args.vocab}, {params / 1e6:.1f}M params on {device.type}; "
              f"malloc {detect()}; time in s, mem = activation memory in MiB", flush=True)
        batches = synthetic_batches(args, device)
        peaks = []
        try:
            for step in range(1, args.steps + 1):
                batch = next(batches)
                torch.manual_seed(args.seed + step)
                with (PeakRSS() if device.type == "cpu" else CudaPeak()) as peak:
                    start = time.perf_counter()
                    loss = train_step(model, optimizer, batch, offloader)
                    elapsed = time.perf_counter() - start
                losses.append(loss.item())
                mem_mib = peak.delta_bytes / MIB
                peaks.append(mem_mib)
                print(f"step {step} loss {losses[-1]!r} time {elapsed:.3f} mem {mem_mib:.1f}", flush=True)
        finally:
            if offloader is not None:
                offloader.close()
        print(f"# {mode}: largest mem over steps 1..{len(peaks)}: {max(peaks):.1f} MiB", flush=True)
        if offloader is not None:
            stats = offloader.stats
            print(f"# tba: {stats.bytes_written / MIB:.1f} MiB written, {stats.bytes_read / MIB:.1f} MiB read, "
                  f"{stats.bytes_kept / MIB:.1f} MiB kept in memory, {offloader.bytes_kept_in_recompute / MIB:.1f} "
                  f"MiB kept inside Megatron recompute, write {stats.write_gbps:.2f} GB/s, "
                  f"read {stats.read_gbps:.2f} GB/s, backward waited {stats.unpack_wait_s:.3f} s", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if argv is None:
        run_script_under(args.allocator)
    if args.cpu and args.malloc_env and argv is None and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    warnings.filterwarnings("ignore", module=r"megatron\.")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
