# Quick start: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU build these machines serve from a local wheel; it is installed
# first so that resolving tba's own dependencies never pulls a CUDA build, and named again with
# the extras so that none of them can replace it. megatron-core (the `megatron` extra) needs only
# torch, numpy and packaging. DS_BUILD_OPS=0: DeepSpeed builds no C++ ops at install; the tests
# use torch's optimizers and none of its JIT-built ops. transformers and accelerate (the `hf`
# extra) need only torch among the heavy packages, so the pinned torch stays.
# A caching malloc (docs/cpu-memory.md): the `cpu` extra's cmeel-mimalloc needs no root; where root
# and apt exist, Debian's libtcmalloc-minimal4 (what `python -m tba run` prefers) and libjemalloc2 are installed too. Neither
# may fail the set-up: without them everything runs under glibc's malloc.
TORCH_SPEC ?= torch==2.13.0
# torch builds JIT extensions (DeepSpeed's async_io) under a lock file that a killed build leaves
# behind, and a later build waits on it for ever; each checkout keeps its own build directory in its
# venv, so no other checkout's build can leave it waiting, and the target below clears its own.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
DEEPSPEED_AIO_TIMEOUT_S ?= 900
# The suite runs in two worker processes (pytest-xdist): most tests wait on subprocesses, threads and
# files, so on CI's two cores it took about half the time of one process when last measured
# (333 s against 649 s, 2026-11-27; the suite has grown since).
# PYTEST_WORKERS=0 runs it in this process. The fifteen slowest tests are listed at the end, to keep CI
# within its 12 minutes.
PYTEST_WORKERS ?= 2
# More pytest arguments, and what to run (.ci/run leaves out the NVMe test, which it runs once DeepSpeed's op
# is built).
PYTEST_ARGS ?=
PYTEST_PATHS ?= tests

.PHONY: demo test deepspeed-aio clean

$(VENV)/.installed: pyproject.toml $(wildcard setup.py native/*.c native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[test,cpu,megatron,deepspeed,hf]" "$(TORCH_SPEC)" || \
	    DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[test,megatron,deepspeed,hf]" "$(TORCH_SPEC)"
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    ! (dpkg -s libtcmalloc-minimal4 && dpkg -s libjemalloc2) >/dev/null 2>&1; then \
	    (apt-get install -y -qq libtcmalloc-minimal4 libjemalloc2 >/dev/null 2>&1 || \
	     (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 libjemalloc2) >/dev/null 2>&1) || \
	    echo "make: libtcmalloc-minimal4/libjemalloc2 not installed (apt failed); tba uses mimalloc from the cpu extra, or glibc"; fi
	touch $@

demo: $(VENV)/.installed
	$(PY) -m tba demo

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15 $(PYTEST_ARGS) $(PYTEST_PATHS)

# DeepSpeed's async_io op (its NVMe swap) JIT-builds against libaio (Debian: libaio-dev) in about
# 2 minutes of one core, cached under .venv/torch_extensions, without debug info and with torch's header
# precompiled once for the files that include it (tools/deepspeed_aio.py);
# tests/integrations/test_deepspeed_nvme.py is skipped until it is built. CI runs this target (.ci/run), on one
# core (MAX_JOBS=1) beside the suite.
deepspeed-aio: $(VENV)/.installed
	rm -f $(TORCH_EXTENSIONS_DIR)/async_io/lock $(TORCH_EXTENSIONS_DIR)/pin_memory/lock
	timeout $(DEEPSPEED_AIO_TIMEOUT_S) $(PY) tools/deepspeed_aio.py

clean:
	rm -rf $(VENV) build *.egg-info tba/*.so
