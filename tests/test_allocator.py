"""The glibc allocator set-up: applied once, skipped off glibc/Linux and when the user chose."""
from __future__ import annotations

import pytest

from napari_gpuseg.engine.runtime import allocator


class FakeLibc:
    def __init__(self, refuse=()):
        self.calls = []
        self.refuse = set(refuse)

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 0 if param in self.refuse else 1


@pytest.fixture
def fresh(monkeypatch):
    """A module state as at start-up, with a fake glibc recording the mallopt calls."""
    monkeypatch.setattr(allocator, "_state", {})
    libc = FakeLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    return libc


def test_configures_once_and_is_idempotent(fresh):
    assert allocator.configure_allocator({}) == "configured"
    assert fresh.calls == list(allocator.SETTINGS)
    assert (allocator.M_MMAP_MAX, 0) in fresh.calls and (allocator.M_TOP_PAD, 2**30) in fresh.calls
    n = len(fresh.calls)
    assert allocator.configure_allocator({}) == "configured"
    assert allocator.configure_allocator({}) == "configured"
    assert len(fresh.calls) == n  # no second round of mallopt


def test_user_settings_win(fresh):
    assert allocator.configure_allocator({"MALLOC_ARENA_MAX": "2"}).startswith("skipped: MALLOC_ARENA_MAX")
    assert fresh.calls == []
    allocator._state.clear()
    assert "GLIBC_TUNABLES" in allocator.configure_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    allocator._state.clear()
    assert "NAPARI_GPUSEG_MALLOC" in allocator.configure_allocator({"NAPARI_GPUSEG_MALLOC": "0"})
    assert fresh.calls == []


def test_a_refused_setting_is_reported(fresh):
    fresh.refuse = {allocator.M_MMAP_MAX}
    assert allocator.configure_allocator({}) == f"configured (mallopt refused [{allocator.M_MMAP_MAX}])"


@pytest.mark.parametrize("system, libc", [("Darwin", ("", "")), ("Windows", ("", "")),
                                          ("Linux", ("musl", "1.2"))])
def test_skipped_off_glibc(monkeypatch, system, libc):
    monkeypatch.setattr(allocator, "_state", {})
    monkeypatch.setattr(allocator.platform, "system", lambda: system)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: libc)

    def no_cdll(*_a, **_k):
        raise AssertionError("the C library must not be touched off glibc")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_cdll)
    assert allocator.configure_allocator({}).startswith("skipped: not glibc")


def test_real_glibc_accepts_the_settings(monkeypatch):
    """On this Linux/glibc machine the real mallopt takes every setting."""
    if allocator._glibc() is None:
        pytest.skip("not glibc")
    monkeypatch.setattr(allocator, "_state", {})
    assert allocator.configure_allocator({}) == "configured"
