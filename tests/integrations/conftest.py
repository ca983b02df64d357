"""Fixtures shared by the integration tests."""

from __future__ import annotations

import os
import socket

import pytest
import torch


@pytest.fixture(scope="module")
def single_process_group():
    """One gloo process group for a DeepSpeed test module; DeepSpeed's shared-memory allreduce op is not built.

    That op only speeds up allreduce between ranks on one node and JIT-compiles for about a
    minute on first use, which a one-rank test does not need.
    """
    deepspeed = pytest.importorskip("deepspeed")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    compatible = deepspeed.ops.__compatible_ops__
    name = deepspeed.accelerator.get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
    was_compatible = compatible.get(name)
    compatible[name] = False
    yield
    compatible[name] = was_compatible
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
