"""Train a small Hugging Face model with ``transformers.Trainer``, with or without tba.

It uses :class:`tba.integrations.hf.TbaTrainer`: a ``Trainer`` whose training forwards run inside
one reusable :class:`tba.Offloader` (backward, gradient accumulation, the optimizer and the
scheduler stay the Trainer's), closed when ``train()`` returns.

The model is built from a config (GPT-2 or Llama, no download) and the data are random tokens from
a fixed seed, so runs with and without ``--tba`` see the same batches and dropout masks and print
the same losses. CPU only; one line per optimizer step::

    step N loss X

Example::

    python examples/hf/train.py --model llama --steps 5 --tba --tba-dir /nvme/tba

``--allocator`` (default ``auto``, the best caching malloc found; ``system`` for the C library's)
re-executes the script once with that malloc preloaded (:func:`tba.allocator.run_script_under`), the
same with and without tba; the header names it (docs/cpu-memory.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch
import transformers

from tba.allocator import CHOICES as ALLOCATORS
from tba.allocator import detect, run_script_under
from tba.integrations.hf import TbaTrainer


class RandomTokens(torch.utils.data.Dataset):
    """``size`` sequences of random tokens drawn from ``seed``; labels are the inputs (causal LM)."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(vocab_size, (size, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class PrintLoss(transformers.TrainerCallback):
    """Prints ``step N loss X`` for every logged training loss."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']}", flush=True)


def build_model(name: str, width: int, layers: int, vocab_size: int, seq_len: int) -> torch.nn.Module:
    """A small GPT-2 or Llama model with random weights from a config."""
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=width, n_layer=layers,
                                         n_head=max(1, width // 64))
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
                                      num_hidden_layers=layers, num_attention_heads=max(1, width // 64),
                                      max_position_embeddings=seq_len)
    return transformers.LlamaForCausalLM(config)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Example: python examples/hf/train.py --model llama --steps 5 --tba")
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2", help="architecture (default: %(default)s)")
    parser.add_argument("--width", type=int, default=128, help="hidden size (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="decoder blocks (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch size (default: %(default)s)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights, data and dropout (default: %(default)s)")
    parser.add_argument("--tba", action="store_true", help="offload activations with tba")
    parser.add_argument("--tba-dir", default=None, help="tba's directory (default: $TBA_DIR or the temp dir)")
    parser.add_argument("--tba-backend", default="auto", help="tba I/O backend (default: %(default)s)")
    parser.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                        help="malloc to run under (re-executes the script once): auto = best caching one found "
                             "(default), system = the C library's")
    parser.add_argument("--output-dir", default=None, help="Trainer output directory (default: a temporary one)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> TbaTrainer:
    """Train as the command line says; returns the trainer (its ``model`` and ``tba_stats``)."""
    args = parse_args(argv)
    if argv is None:
        run_script_under(args.allocator)
    print(f"malloc {detect()}", flush=True)
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.width, args.layers, args.vocab, args.seq)
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="tba-hf-")
    training_args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
    )
    dataset = RandomTokens(args.steps * args.batch * args.grad_accum, args.seq, args.vocab, args.seed)
    tba_options = {"directory": args.tba_dir, "backend": args.tba_backend} if args.tba else None
    trainer = TbaTrainer(model=model, args=training_args, train_dataset=dataset, tba_options=tba_options,
                         callbacks=[PrintLoss()])
    trainer.train()
    if trainer.tba_stats is not None:
        stats = trainer.tba_stats
        print(f"tba wrote {stats.bytes_written / 2**20:.1f} MiB and read {stats.bytes_read / 2**20:.1f} MiB", flush=True)
    return trainer


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
