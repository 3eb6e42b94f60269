"""Where the test suite's time goes in SAM's image encoder: a pytest plugin and its summary.

    OUT=/tmp/suite_enc PYTHONPATH=benchmarks OMP_NUM_THREADS=2 python -m pytest -q -n 2 -p suite_encoder
    python benchmarks/suite_encoder.py /tmp/suite_enc

As a plugin (``-p suite_encoder``, loaded in every xdist worker), it wraps ``TinyViT.forward``
(LiteMedSAM's encoder, the one the tests use) and records per call: a hash of the input
(values, shape, dtype, autocast) and of the weights, the seconds, and the running test. Each
process writes ``$OUT/calls_<pid>.json`` at exit. As a script, it sums them: the encoder's
total time, and how much of it re-encodes an input an earlier call already encoded (what
sharing engines and their embedding caches between test modules could save). The time of a
call includes any wait at the encoder's pause points. The plugin changes nothing else.
"""
from __future__ import annotations

import atexit
import collections
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

_CALLS: list = []
_LOCK = threading.Lock()


def _weights_id(module) -> str:
    key = getattr(module, "_suite_encoder_id", None)
    if key is None:
        h = hashlib.blake2b(digest_size=8)
        for p in module.parameters():
            h.update(p.detach().float().flatten()[:64].cpu().numpy().tobytes())
        key = module._suite_encoder_id = h.hexdigest()
    return key


def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    import torch

    from napari_gpuseg.models.sam import tiny_vit

    forward = tiny_vit.TinyViT.forward

    def timed(self, x, *args, **kwargs):
        h = hashlib.blake2b(digest_size=8)
        h.update(x.detach().float().contiguous().cpu().numpy().tobytes())
        try:
            autocast = torch.is_autocast_enabled(x.device.type)
        except TypeError:  # torch < 2.4
            autocast = torch.is_autocast_enabled()
        key = "|".join((h.hexdigest(), _weights_id(self), str(x.dtype), str(tuple(x.shape)), str(autocast)))
        t0 = time.perf_counter()
        try:
            return forward(self, x, *args, **kwargs)
        finally:
            with _LOCK:
                _CALLS.append([key, time.perf_counter() - t0, os.environ.get("PYTEST_CURRENT_TEST", "")])

    timed.__doc__ = forward.__doc__
    tiny_vit.TinyViT.forward = timed
    out = Path(os.environ.get("OUT", "suite_encoder_out"))
    out.mkdir(parents=True, exist_ok=True)
    atexit.register(lambda: (out / f"calls_{os.getpid()}.json").write_text(json.dumps(_CALLS)))


def summary(folder: Path) -> str:
    calls = [c for f in sorted(folder.glob("calls_*.json")) for c in json.loads(f.read_text())]
    if not calls:
        return f"no calls recorded in {folder}"
    seen: set = set()
    repeat_s, by_file = 0.0, collections.Counter()
    for key, seconds, test in calls:
        if key in seen:
            repeat_s += seconds
            by_file[test.split("::")[0]] += seconds
        seen.add(key)
    total = sum(c[1] for c in calls)
    lines = [f"encoder: {len(calls)} calls, {len(seen)} distinct inputs, {total:.0f} s",
             f"re-encoding an input already encoded: {repeat_s:.0f} s ({100 * repeat_s / total:.0f} %)"]
    lines += [f"  {s:6.0f} s  {name}" for name, s in by_file.most_common(12)]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(summary(Path(sys.argv[1])))
