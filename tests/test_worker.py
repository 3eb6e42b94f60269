import threading
import time

import pytest
import torch

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.cancel import Cancelled
from napari_gpuseg.engine.runtime.worker import CANCELLED, DONE, FAILED, InferenceWorker


@pytest.fixture
def worker():
    w = InferenceWorker(Policy(torch.device("cpu"), "bf16"))
    yield w
    w.shutdown()


def slow_steps(n, progress=None, cancel=None):
    for i in range(n):
        time.sleep(0.02)
        if progress:
            progress(i + 1, n)
    return n


def test_runs_off_the_calling_thread_with_autocast_inside(worker):
    def probe():
        a = torch.randn(8, 8)
        return threading.current_thread().name, (a @ a).dtype, torch.is_inference_mode_enabled()

    name, dtype, inference = worker.submit(probe).result(10)
    assert name == "napari-gpuseg-worker" != threading.current_thread().name
    assert dtype == torch.bfloat16  # autocast was entered in the worker thread
    assert inference


def test_models_are_loaded_once(worker):
    loads = []

    def use():
        return worker.model("net", lambda: loads.append(1) or torch.nn.Linear(2, 2))

    a = worker.submit(use).result(10)
    b = worker.submit(use).result(10)
    assert a is b and len(loads) == 1


def test_cancel_running_job_stops_it_and_calls_back(worker):
    events = []
    job = worker.submit(slow_steps, 500, on_cancelled=lambda: events.append("cancelled"),
                        on_progress=lambda d, t: events.append(d))
    while not any(isinstance(e, int) for e in events):
        time.sleep(0.01)
    at_cancel = max(e for e in events if isinstance(e, int))
    job.cancel()
    assert job.wait(30)
    steps = [e for e in events if isinstance(e, int)]
    assert max(steps) <= at_cancel + 2 < 500  # stopped at its next step, far from its end
    assert job.status == CANCELLED and "cancelled" in events
    with pytest.raises(Cancelled):
        job.result()


def test_replace_cancels_stale_jobs_with_same_tag(worker):
    first = worker.submit(slow_steps, 200, tag="embed")
    second = worker.submit(slow_steps, 200, tag="embed")
    third = worker.submit(slow_steps, 3, tag="embed", replace=True)
    assert third.result(10) == 3
    assert first.status == CANCELLED and second.status == CANCELLED


def test_errors_are_delivered_not_raised_in_the_thread(worker):
    errors = []

    def boom():
        raise RuntimeError("CUDA out of memory")

    job = worker.submit(boom, on_error=errors.append)
    job.wait(5)
    assert job.status == FAILED and isinstance(errors[0], RuntimeError)
    # the worker keeps serving after an error
    assert worker.submit(lambda: 41 + 1).result(5) == 42
    assert worker.submit(lambda: 1).status in ("pending", "running", DONE)


def test_training_jobs_get_gradients(worker):
    def train_step():
        w = torch.ones(2, requires_grad=True)
        (w * 3).sum().backward()
        return w.grad

    assert torch.equal(worker.submit(train_step, inference=False).result(5), torch.full((2,), 3.0))
