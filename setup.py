"""Build hook for the optional native extensions ``tba._uring`` (io_uring), ``tba._shield``, ``tba._gc``, ``tba._record``,
``tba._requests`` and ``tba._save``.

All package metadata lives in ``pyproject.toml``; this file only declares the C extension. The
extension is optional: when it cannot be compiled (no C compiler, no Python or kernel headers),
the build prints a warning and installation carries on without it: ``backend="auto"`` then
uses the portable thread engine, logging why, and without ``tba._shield`` an offloader's exit is
plain Python (``tba/_whole_exit.py`` says what that leaves open); without ``tba._gc`` the cycle collector
sees every object tba keeps per saved tensor (``tba/_untrack.py``); without ``tba._record`` the store's
per-storage record is the Python dataclass (``tba/runtime/_entry.py``), without ``tba._requests`` host
writes become engine requests in Python (``tba/runtime/_host_requests.py``), and without ``tba._save`` a host
storage's fresh save runs in Python (``tba/runtime/_writes.py``).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

URING_EXTENSION = Extension(
    "tba._uring",
    sources=["native/tba_uring.c", "native/uring_ring.c", "native/uring_io.c"],
    depends=["native/uring_ring.h"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    optional=True,
)

SHIELD_EXTENSION = Extension(
    "tba._shield",
    sources=["native/tba_shield.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    optional=True,
)

GC_EXTENSION = Extension(
    "tba._gc",
    sources=["native/tba_gc.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    optional=True,
)

RECORD_EXTENSION = Extension(
    "tba._record",
    sources=["native/tba_record.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    optional=True,
)

REQUESTS_EXTENSION = Extension(
    "tba._requests",
    sources=["native/tba_requests.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    optional=True,
)

SAVE_EXTENSION = Extension(
    "tba._save",
    sources=["native/tba_save.c"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    optional=True,
)


class OptionalBuildExt(build_ext):
    """``build_ext`` that turns any failure to compile the extension into a warning."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as err:  # noqa: BLE001 - any build failure must not stop installation
            self._warn(err)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as err:  # noqa: BLE001
            self._warn(err)

    @staticmethod
    def _warn(err: Exception) -> None:
        print(
            f"WARNING: a native extension of tba was not built ({err}); tba runs without it "
            "(see setup.py)."
        )


setup(ext_modules=[URING_EXTENSION, SHIELD_EXTENSION, GC_EXTENSION, RECORD_EXTENSION, REQUESTS_EXTENSION,
                         SAVE_EXTENSION],
      cmdclass={"build_ext": OptionalBuildExt})
