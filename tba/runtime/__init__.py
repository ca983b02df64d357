"""The saved-tensor path: what happens to each tensor autograd saves inside an offload context.

``_offloader.py`` holds the hooks (:class:`~tba.Offloader`: pack decides keep or offload, unpack
rebuilds the tensor); ``_views.py`` the saved views and the per-storage entry; ``_store.py`` the
entries' I/O and lifetime (dedup by storage, writes, reads, release); ``_prefetch.py`` the window
of storages read ahead during backward; ``_layers.py`` which layer is running; ``_recompute.py``
the checkpoint wrapper of recomputed layers; ``_stats.py`` the counters. Bytes reach the file
through a device route (:mod:`tba.device`) and an engine (:mod:`tba.io`).
"""
