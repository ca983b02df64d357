"""tba.bench.isolated: the environment of a measured process."""

from tba.bench.isolated import process_environment
from tba.bench.meters import MALLOC_ENV


def test_a_plain_process_drops_glibc_tuning_but_keeps_jemalloc_settings(monkeypatch):
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:-1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    env = process_environment("system", malloc_env=False)
    assert env["MALLOC_CONF"] == "dirty_decay_ms:-1"
    assert "MALLOC_MMAP_THRESHOLD_" not in env and "MALLOC_ARENA_MAX" not in env


def test_a_controlled_process_fixes_glibc_thresholds(monkeypatch):
    monkeypatch.setenv("MALLOC_CONF", "dirty_decay_ms:-1")
    env = process_environment("system", malloc_env=True)
    assert env["MALLOC_CONF"] == "dirty_decay_ms:-1"
    assert all(env[key] == value for key, value in MALLOC_ENV.items())
