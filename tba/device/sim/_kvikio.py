"""A fake ``kvikio`` package for the simulated device: ``CuFile`` futures with delays and no stream order.

Like the real one, a ``pread``/``pwrite`` returns at once with a future; the transfer is cut into
``task_size`` pieces (the call's, else the setting's; one piece when it is at least the size) run by
``num_threads`` threads (defaults 1 thread and 4 MiB, as kvikio's), touches device memory by address
whenever its thread gets to it, and knows nothing of streams: ordering against device work is the
caller's job. Each transfer is its own participant of the race checker, starting where the host is
when it is submitted; ``get()`` merges it back into the host.
A transfer whose buffer died before it ran is reported as a use after free.

Only the attributes tba calls exist (:data:`tba.device.KVIKIO_API`); the contract test checks the
installed kvikio package has the same ones.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tba.io import memory_view


class FakeIOFuture:
    """``kvikio.cufile.IOFuture``: ``get()`` waits and returns the bytes moved (raises the transfer's error)."""

    def __init__(self, futures: list[Future], nbytes: int, sim: Any, who: str) -> None:
        self._futures = futures
        self._nbytes = nbytes
        self._sim = sim
        self._who = who

    def get(self) -> int:
        """As kvikio's: the first failed piece's error, raised without waiting for the other pieces. A transfer of one
        piece has then ended, and the host is ordered after it; one of several may still be moving bytes, and is not."""
        try:
            for future in self._futures:
                future.result()
        except BaseException:
            if len(self._futures) == 1:
                self._sim.checker.merge("host", self._sim.checker.retire(self._who))
            raise
        self._sim.checker.merge("host", self._sim.checker.retire(self._who))
        return self._nbytes

    def done(self) -> bool:
        return all(future.done() for future in self._futures)


class FakeKvikio:
    """State of one fake kvikio package: settings, GDS status, injected failures, open files."""

    def __init__(self, sim: Any, *, gds: bool = True, seed: int = 0, max_delay_s: float = 0.002) -> None:
        self.sim = sim
        self.gds = gds
        self.settings: dict[str, Any] = {"num_threads": 1, "task_size": 4 << 20, "compat_mode": not gds}
        self.fail_reads: BaseException | None = None
        self.write_gate: threading.Event | None = None
        self._rng = random.Random(seed)
        self._max_delay_s = max_delay_s
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 0
        self._lock = threading.Lock()
        self.module = self._module()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            threads = int(self.settings["num_threads"])
            if self._pool is None or self._pool_threads != threads:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fake-kvikio")
                self._pool_threads = threads
            return self._pool

    def _module(self) -> types.ModuleType:
        fake = self
        module = types.ModuleType("kvikio")
        defaults = types.ModuleType("kvikio.defaults")
        driver = types.ModuleType("kvikio.cufile_driver")

        def set_(config: Any, value: Any = None) -> None:
            fake.settings.update(config if isinstance(config, dict) else {config: value})

        defaults.set = set_
        defaults.get = lambda key: fake.settings[key]
        defaults.is_compat_mode_preferred = lambda: bool(fake.settings["compat_mode"])
        driver.get = lambda key: {"is_gds_available": fake.gds}[key]

        class CuFile:
            def __init__(self, path: str, flags: str = "r") -> None:
                self._fd = os.open(path, os.O_RDWR if "+" in flags else os.O_RDONLY)

            def close(self) -> None:
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1

            def pwrite(self, buf: torch.Tensor, size: int, file_offset: int = 0,
                       task_size: int | None = None) -> FakeIOFuture:
                return fake._submit(self._fd, buf, size, file_offset, task_size, write=True)

            def pread(self, buf: torch.Tensor, size: int, file_offset: int = 0,
                      task_size: int | None = None) -> FakeIOFuture:
                return fake._submit(self._fd, buf, size, file_offset, task_size, write=False)

        module.CuFile = CuFile
        module.defaults = defaults
        module.cufile_driver = driver
        return module

    def _submit(self, fd: int, buf: torch.Tensor, size: int, offset: int, task_size: int | None,
                write: bool) -> FakeIOFuture:
        self.sim.check_alive()  # Note [A broken context] in tba/device/sim/_faults.py
        who = self.sim.checker.spawn("kvikio")
        address = buf.data_ptr()
        self.sim.checker.access(who, address, size, not write, f"kvikio {'pwrite' if write else 'pread'}")
        storage = buf.untyped_storage()
        ref = StorageWeakRef(storage)
        if self.sim.allocator.block_at(storage.data_ptr()) is None:  # Note [A freed model tensor is the next kernel's]
            self.sim.allocator.watch(ref, storage.data_ptr(), storage.nbytes())
        del storage
        task = int(task_size or self.settings["task_size"])  # task_size >= size: one task, as kvikio's single-task guard
        if task <= 0:
            raise ValueError("`task_size` must be positive")
        pool = self._executor()
        futures = [pool.submit(self._task, fd, ref, address + start, min(task, size - start), offset + start, write)
                   for start in range(0, size, task)] or [pool.submit(lambda: None)]
        return FakeIOFuture(futures, size, self.sim, who)

    def _task(self, fd: int, ref: StorageWeakRef, address: int, nbytes: int, offset: int, write: bool) -> None:
        time.sleep(self._rng.random() * self._max_delay_s)
        if write and self.write_gate is not None:
            self.write_gate.wait()
        self.sim.check_alive()  # Note [A broken context] in tba/device/sim/_faults.py: a transfer under way fails too
        if not write and self.fail_reads is not None:
            raise self.fail_reads
        alive = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        if alive is None:
            self.sim.fail(f"use after free: a kvikio {'pwrite' if write else 'pread'} ran after its buffer was freed")
            return
        view = memory_view(address, nbytes)
        name = "pwrite" if write else "pread"
        done = 0
        while done < nbytes:  # as kvikio's POSIX path: a short transfer goes on; an error is a RuntimeError
            try:
                moved = os.pwrite(fd, view[done:], offset + done) if write else os.preadv(fd, [view[done:]], offset + done)
            except OSError as error:
                raise RuntimeError(f"POSIX error on {name}: {os.strerror(error.errno)}") from None
            if moved == 0:
                raise RuntimeError(f"POSIX error on {name}: EOF")
            done += moved
        del alive

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@contextlib.contextmanager
def fake_kvikio(sim: Any, **options: Any) -> Iterator[FakeKvikio]:
    """``import kvikio`` gives the fake inside the block; tba's cached kvikio checks are reset around it."""
    from tba.device._kvikio import gds_unavailable_reason, kvikio_unavailable_reason

    fake = FakeKvikio(sim, **options)
    saved = {name: sys.modules.get(name) for name in ("kvikio", "kvikio.defaults", "kvikio.cufile_driver")}
    sys.modules.update({"kvikio": fake.module, "kvikio.defaults": fake.module.defaults,
                        "kvikio.cufile_driver": fake.module.cufile_driver})
    kvikio_unavailable_reason.cache_clear()
    gds_unavailable_reason.cache_clear()
    try:
        yield fake
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        kvikio_unavailable_reason.cache_clear()
        gds_unavailable_reason.cache_clear()
        fake.close()
