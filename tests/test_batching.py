import pytest
import torch

from napari_gpuseg.engine.runtime import batching
from napari_gpuseg.engine.runtime.cancel import Cancelled, CancelToken


class FlakyNet:
    """Squares its input; raises a CUDA-style OOM whenever a batch exceeds ``limit``."""

    def __init__(self, limit):
        self.limit = limit
        self.sizes = []

    def __call__(self, batch):
        self.sizes.append(len(batch))
        if len(batch) > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch * batch + 1


def test_oom_backoff_identical_to_small_fixed_batch():
    batching.forget_batch_sizes()
    x = torch.randn(37, 3, 5)
    net = FlakyNet(limit=5)
    runner = batching.BatchRunner(batch_size=32, key=("net", (3, 5)))
    got = torch.stack(runner.run(net, x))
    ref = torch.stack(batching.run_batched(lambda b: b * b + 1, x, batch_size=2))
    assert torch.equal(got, ref)
    assert runner.oom_events == 3  # 32 -> 16 -> 8 -> 4
    assert runner.batch_size == 4
    assert sum(s for s in net.sizes if s <= 5) == 37  # every item processed exactly once
    # the size that worked is remembered for the same key
    assert batching.remembered_batch_size(("net", (3, 5))) == 4
    runner2 = batching.BatchRunner(key=("net", (3, 5)))
    net2 = FlakyNet(limit=5)
    runner2.run(net2, x)
    assert max(net2.sizes) == 4 and runner2.oom_events == 0


def test_order_preserved_with_lists_and_tuples():
    items = list(range(23))
    out = batching.run_batched(lambda b: [v * 10 for v in b], items, batch_size=4)
    assert out == [v * 10 for v in items]
    x = torch.arange(10.0)
    pairs = batching.run_batched(lambda b: (b, -b), x, batch_size=3)
    assert [float(p[0]) for p in pairs] == list(range(10))
    assert [float(p[1]) for p in pairs] == [-v for v in range(10)]


def test_non_oom_errors_propagate_and_oom_at_size_one_raises():
    with pytest.raises(ValueError):
        batching.run_batched(lambda b: (_ for _ in ()).throw(ValueError("bad")), [1, 2], batch_size=2)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        batching.run_batched(FlakyNet(limit=0), torch.ones(3), batch_size=4)


def test_wrong_result_count_is_an_error():
    with pytest.raises(ValueError, match="returned 1 results for 2 items"):
        batching.run_batched(lambda b: [0], [1, 2], batch_size=2)


def test_progress_and_cancel():
    seen = []
    token = CancelToken()

    def fn(b):
        if len(seen) >= 2:
            token.cancel()
        return b

    def progress(done, total):
        seen.append((done, total))

    with pytest.raises(Cancelled):
        batching.run_batched(fn, list(range(20)), batch_size=3, progress=progress, cancel=token)
    assert seen[0] == (0, 20) and seen[1] == (3, 20)


def test_initial_batch_size_from_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    size = batching.initial_batch_size(1000, "cuda", item_bytes=2**30, headroom=0.7)
    assert size == 7
    assert batching.initial_batch_size(3, "cpu") == 3


class TimedNet:
    """Doubles its input; each call advances a fake clock by ``overhead + per_item(size) * size``."""

    def __init__(self, overhead, per_item):
        self.now, self.overhead, self.per_item, self.sizes = 0.0, overhead, per_item, []

    def clock(self):
        return self.now

    def __call__(self, batch):
        n = len(batch)
        self.sizes.append(n)
        self.now += self.overhead + self.per_item(n) * n
        return [2 * v for v in batch]


def test_cpu_batch_is_measured_and_stays_at_one_where_bigger_batches_cost_more_per_item():
    # activations that leave the caches: each item costs more in a bigger batch
    batching.forget_batch_sizes()
    net = TimedNet(0.0, lambda n: 1.0 + 0.2 * (n - 1))
    runner = batching.BatchRunner(key=("probe-slow",), clock=net.clock)
    assert runner.run(net, list(range(12))) == [2 * v for v in range(12)]
    assert net.sizes[:4] == [1, 1, 2, 1] and set(net.sizes[3:]) == {1}
    assert batching.remembered_batch_size(("probe-slow",)) == 1


def test_cpu_batch_grows_while_it_pays_and_is_remembered():
    # a fixed cost per call (a small decoder): doubling pays until it reaches 8
    batching.forget_batch_sizes()
    net = TimedNet(1.0, lambda n: 0.1 if n <= 8 else 0.5)
    runner = batching.BatchRunner(key=("probe-fast",), clock=net.clock)
    assert runner.run(net, list(range(60))) == [2 * v for v in range(60)]
    assert net.sizes[:6] == [1, 1, 2, 4, 8, 16] and set(net.sizes[6:-1]) == {8}
    assert batching.remembered_batch_size(("probe-fast",)) == 8
    again = TimedNet(1.0, lambda n: 0.1)
    batching.BatchRunner(key=("probe-fast",), clock=again.clock).run(again, list(range(20)))
    assert again.sizes == [8, 8, 4]  # no second probe


def test_a_given_size_a_gpu_an_unkeyed_run_or_a_few_items_are_not_probed():
    batching.forget_batch_sizes()
    net = TimedNet(0.0, lambda n: 1.0)
    batching.BatchRunner(batch_size=3, key=("given",), clock=net.clock).run(net, list(range(7)))
    assert net.sizes == [3, 3, 1]
    gpu = TimedNet(0.0, lambda n: 1.0)
    batching.BatchRunner(key=("on-gpu",), device="cuda", clock=gpu.clock).run(gpu, list(range(20)))
    assert gpu.sizes == [16, 4]  # sized from the card (here: no memory figure), not timed
    unkeyed = TimedNet(0.0, lambda n: 1.0)
    batching.BatchRunner(clock=unkeyed.clock).run(unkeyed, list(range(7)))
    assert unkeyed.sizes == [4, 3]  # nothing to remember it under: the CPU default
    small = TimedNet(0.0, lambda n: 1.0)
    batching.BatchRunner(key=("small",), clock=small.clock).run(small, [1, 2])
    assert small.sizes == [2]  # too few items to measure


def test_oom_during_the_probe_backs_off_and_keeps_every_item():
    import itertools

    batching.forget_batch_sizes()
    net = FlakyNet(limit=1)
    # every call seems to take one tick whatever its size, so the probe doubles into the OOM
    runner = batching.BatchRunner(key=("probe-oom",), clock=itertools.count().__next__)
    x = torch.arange(9.0)
    assert torch.equal(torch.stack(runner.run(net, x)), x * x + 1)
    assert net.sizes[:3] == [1, 1, 2] and runner.oom_events == 1
    assert batching.remembered_batch_size(("probe-oom",)) == 1
