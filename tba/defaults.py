"""Every default of tba in one place, with its unit in its name.

The runtime, the engines, the command-line tools and the integrations read their defaults from
here, so that one number never disagrees with its twin in another module. Sizes are bytes, times
seconds, counts plain integers.
"""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

ALIGN_BYTES = 4096
"""Alignment of addresses, lengths and file offsets for O_DIRECT I/O."""

HUGE_PAGE_BYTES = 2 * MIB
"""A transparent huge page on x86-64 and most arm64 kernels: read buffers at least this large are
mapped asking for huge pages (``tba/io/_read_pool.py``, Note [Read buffers on huge pages])."""

MIN_OFFLOAD_BYTES = 64 * KIB
"""Storages smaller than this stay in memory: their I/O would cost more than it saves."""

BLOCK_SIZE_BYTES = 4 * MIB
"""Largest piece of one storage in one I/O request (and the size of one staging block)."""

QUEUE_DEPTH = 8
"""Requests in flight. Eight 4 MiB blocks keep an NVMe drive busy; on a small machine a deeper
queue only adds kernel work beside compute (measured: 3.5% longer steps at 32 than at 8)."""

HOST_WRITE_AHEAD_BYTES = 64 * MIB
"""Most bytes of host storages' writes handed to the engine at once (twice what eight 4 MiB
requests keep in flight); the rest wait in tba's own queue, where reads go ahead of them and a
write that backward no longer needs is dropped (``tba/runtime/_host_io.py``, Note [Writes wait in
tba's queue, not the engine's])."""

MAX_QUEUE_DEPTH = 4096
"""Largest queue depth accepted (the io_uring ring size limit)."""

MAX_ENGINE_THREADS = 8
"""The thread engine never runs more threads than this: each one waits in the kernel for its
request, and more only add context switches."""

PREFETCH_BUDGET_BYTES = None
"""Bound on bytes read ahead or held in memory for backward, and on idle read buffers kept. None
(default): the window sizes itself (``tba/runtime/_window.py``) within the bounds below."""

POLICY_MAX_WINDOW_BYTES = 512 * MIB
"""Largest prefetch window a placement policy's plan may set when no ``prefetch_budget_bytes`` was given."""

PREFETCH_WINDOW_INITIAL_BYTES = 8 * MIB
"""Self-sizing window: read-ahead budget before anything was measured: the smallest, so that the first
step never holds more than later ones (waits grow it within that step)."""

PREFETCH_WINDOW_MIN_BYTES = 8 * MIB
"""Self-sizing window: smallest read-ahead budget (the storage below the cursor is always allowed)."""

PREFETCH_WINDOW_MAX_FRACTION = 0.25
"""Self-sizing window: largest read-ahead budget as a fraction of the bytes the forward wrote."""

PREFETCH_WINDOW_GROW_FACTOR = 1.5
"""Self-sizing window: budget multiplier when an unpack waited for its read."""

PREFETCH_WINDOW_SHRINK_FACTOR = 0.95
"""Self-sizing window: budget multiplier after a backward pass in which nothing waited."""

PREFETCH_WINDOW_TOLERATED_WAITS = 1
"""Self-sizing window: waits per backward pass that neither grow the window nor stop it shrinking
(the first read of a backward may find nothing prefetched whatever the window)."""

DISCOVERY_MIN_BYTES_SHARE = 0.05
"""Layer discovery: a second kind of repeated block (beside the one holding the most saved bytes)
joins the layers when its blocks hold at least this share of that kind's bytes; smaller repeated
groups (two dropouts at the top level, say) stay out."""

DISCOVERY_REFINE_SHARE = 0.75
"""Layer discovery: repeated blocks inside the instances of a repeated group (an encoder's and a
decoder's blocks inside two stacks of one class) replace that group as the layers when they hold at
least this share of its saved bytes."""

HEAP_TRIM_EVERY_BYTES = 0
"""After this many bytes of offloaded storages are released, glibc's free heap pages are handed
back to the kernel with ``malloc_trim`` (``tba/runtime/_trim.py``; ``$TBA_HEAP_TRIM_EVERY_BYTES`` overrides it,
read at each release). 0, the default, never trims:
the pages of each written storage are handed back on their own, and the trim only made the next
allocations fault (Note [The heap trim is off] in ``tba/runtime/_trim.py``)."""

DISCARD_MIN_BYTES = 256 * KIB
"""Under glibc, only written storages of at least this many bytes have their pages handed back to the
kernel at once (Note [Small storages keep their pages] in ``tba/runtime/_trim.py``); smaller ones are only
freed, for glibc to reuse (the heap trim, which would return what it does not, is off by default)."""

RECOMPUTE_STATE_ALWAYS_COPIED_BYTES = 64 * KIB
"""A recomputed layer's state tensors (buffers, tensor attributes) of at most this many bytes are copied
before each of its forwards and put back for the recomputation, whatever earlier forwards did to them;
larger ones are copied only once a forward was seen to change them (Note [Side effects of a recomputed
forward] in ``tba/runtime/_layer_state.py``)."""

RECOMPUTE_NESTED_STATE_DEPTH = 6
"""Objects nested at most this many levels below a recomputed layer's module (``self.config.history`` is 2) are walked
and put back for the recomputation; deeper ones are held shallow: put back, not walked into (Note [The walk of nested
state] in ``tba/runtime/_nested_state.py``)."""

RECOMPUTE_NESTED_STATE_ITEMS = 1024
"""The items the walk of a recomputed layer's nested state takes per call, at most: an object reached past them is held
shallow (Note [The walk of nested state] in ``tba/runtime/_nested_state.py``)."""

LINGER_SWEEP_PER_CALL = 2
"""Written storages still used by the program that each save, unpack and freed view re-checks
(``tba/runtime/_release.py``, Note [A bounded sweep per tensor]): at most one storage starts lingering
per saved tensor, and each tensor makes three such calls, so the sweep keeps up at O(1) per tensor."""

DEFER_WAKE_JOBS = 16
"""Saves deferred before the training thread wakes the control thread to run them (``tba/_control.py``,
Note [Deferred jobs]): fewer wake-ups, fewer GIL hand-overs."""

DEFER_WAKE_BYTES = 1 * MIB
"""Bytes of storages whose deferred save wakes the control thread at once, whatever the count: a large
storage's write starts without waiting for others."""

DEFER_WAKE_UNPACK_JOBS = 64
"""Backward's deferred jobs (the bookkeeping of unpacks served from memory or read, a kept layer reached)
before the training thread wakes the control thread.

Note: [Backward wakes the control thread less often]
Each wake-up of the control thread in backward is a GIL hand-over the unpacking training thread waits
through. Waking it after 64 deferred jobs or 4 MiB instead of forward's 16 or 1 MiB lowered backward's
median in 9 of 10 rows of two alternating A/B runs of ``bench-hooks`` (by 5-44 µs per storage;
``docs/host-cost.md``, eighteenth pass). Forward's saves keep the lower thresholds: their writes start
early and free memory. The bytes are at most a quarter of the prefetch window (set at each entry, never
below forward's 1 MiB): the deferred jobs move the window, and a small one must not lag by most of itself.
"""

DEFER_WAKE_UNPACK_BYTES = 4 * MIB
"""Bytes of unpacked storages whose deferred bookkeeping wakes the control thread at once, at most: it moves
the prefetch window, so the reads ahead start at least every this many bytes of backward (less for a window
under 16 MiB: Note [Backward wakes the control thread less often])."""

EXIT_IO_WAIT_S = 10.0
"""At interpreter exit, the longest tba waits for transfers still in flight before it lets the
process end anyway (Note [No transfer ends during finalization] in ``tba/io/_io_uring.py``): a disk
that never answers must not hang the exit."""

RUNTIME_IDLE_CLOSE_S = 30.0
"""A spill file, engine and read pool shared by one-shot contexts (``tba/runtime/_shared.py``) is
closed after this many seconds unused."""

RUNTIME_IDLE_RELEASE_S = 1.0
"""An idle shared runtime's spill file keeps its disk blocks (or tmpfs pages) for this many seconds, so
that a training loop's next step overwrites them instead of reserving and allocating them again; then
it gives them back (at once where the file system is nearly full: :data:`IDLE_SPACE_MIN_FREE_FRACTION`)."""

IDLE_SPACE_MIN_FREE_FRACTION = 0.10
"""A file system with less free space than this fraction of its size (or than twice what an idle
spill file holds) counts as nearly full: idle spill files there give their space back at once."""

RUNTIME_IDLE_MAX = 4
"""Idle shared runtimes kept in the whole process (each holds a descriptor or two and engine threads): a
fresh directory per step must not pile up one per directory until the idle time runs out."""

RUNTIME_IDLE_PER_KEY = 2
"""Idle shared runtimes kept per directory and option set (more appear only with concurrent contexts)."""

LEFTOVER_COLLECT_MAX_GAP = 64
"""A reusable offloader entered while earlier graphs are alive runs a full ``gc.collect()`` for dropped
ones; after collections that found none, it waits twice as many such entries before the next one, at
most this many (Note [Collecting dropped graphs costs a full collection] in ``tba/runtime/_store_owner.py``)."""

SPILL_RESERVE_MIN_BYTES = 256 * MIB
"""The spill file grows by ``fallocate`` in steps of at least this (and at least its size so far),
so writes land in allocated space instead of extending the file."""

PREFETCH_DEPTH_LAYERS = 1
"""During backward through layer i, layers i-1 .. i-depth are read ahead."""

STAGING_BYTES = 256 * MIB
"""Pinned host staging pool of the CUDA staged route."""

INPUT_SHAPES_KEPT = 256
"""Input shapes whose profiled samples, plan and successor a placement runner keeps (the least recently seen
goes first; seen again, it is profiled again): Note [What is kept per input shape is bounded] in
``tba/runtime/_input_shapes.py``."""

PROFILE_STEPS = 2
"""Steps the adaptive policy profiles before it plans."""

ADAPTIVE_OVERHEAD_BOUND = 0.05
"""The adaptive policy's goal when none is given: the least activation memory whose predicted step
time is within ``1 + this`` of the fastest placement's (keep-all's)."""

PEAK_HEADROOM = 0.25
"""The adaptive planner takes a profiled step's measured activation peak this much higher when it
calibrates its memory model. On the 2-core VM, later steps of offload-heavy plans on small models
peaked up to 1.26x the profiled peak (the write backlog, and so the peak, varies with the disk's
speed from step to step); at 0.10 ``python -m tba rok``'s budget contract failed about one run in
four. Only the part of a plan's peak that moves with the disk (write backlog, read buffers) is
charged it, in proportion (Note [Headroom scales with a plan's I/O] in
``tba/runtime/_profiling.py``): keep-all none."""

BUDGET_MET_FACTOR = 1.05
"""A memory budget counts as met when the measured activation peak is at most this times the budget."""

POLICIES = ("adaptive", "offload", "keep")
"""Names accepted by ``policy=``; a :class:`tba.Plan` or :class:`tba.Policy` is accepted too."""
