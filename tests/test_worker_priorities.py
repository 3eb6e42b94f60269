"""Priorities in the inference worker: order observed through the worker's log, not timing."""
import threading

import pytest
import torch

from napari_gpuseg.engine.runtime.device import Policy
from napari_gpuseg.engine.runtime.worker import BACKGROUND, CANCELLED, DONE, IDLE, INTERACTIVE, InferenceWorker, pause_point


@pytest.fixture
def worker():
    w = InferenceWorker(Policy(torch.device("cpu"), "fp32"))
    yield w
    w.shutdown()


def gate(worker):
    """Occupy the worker until the returned event is set, so jobs queue up behind it."""
    release, started = threading.Event(), threading.Event()
    job = worker.submit(lambda: (started.set(), release.wait(10)), tag="gate")
    assert started.wait(10)
    return release, job


def starts(worker, *tags):
    return [t for ev, _id, t in worker.log if ev == "start" and t in tags]


def test_higher_priority_runs_first_and_fifo_within_one(worker):
    release, _ = gate(worker)
    jobs = [worker.submit(lambda: None, tag="bg1", priority=BACKGROUND),
            worker.submit(lambda: None, tag="idle", priority=IDLE),
            worker.submit(lambda: None, tag="normal"),
            worker.submit(lambda: None, tag="bg2", priority=BACKGROUND),
            worker.submit(lambda: None, tag="prompt", priority=INTERACTIVE)]
    assert [j.tag for j in worker.pending()] == ["prompt", "normal", "bg1", "bg2", "idle"]
    release.set()
    for j in jobs:
        j.result(10)
    assert starts(worker, "bg1", "idle", "normal", "bg2", "prompt") == \
        ["prompt", "normal", "bg1", "bg2", "idle"]


def test_a_prompt_during_a_stepped_background_job_is_answered_between_steps(worker):
    step_started, go_on = threading.Event(), threading.Event()
    steps = []

    def background(n):
        for i in range(n):
            steps.append(i)
            if i == 1:
                step_started.set()
                go_on.wait(10)  # the prompt arrives while step 1 runs
            yield i
        return "all"

    bg = worker.submit(background, 5, tag="tiles", priority=BACKGROUND)
    assert step_started.wait(10)
    prompt = worker.submit(lambda: len(steps), tag="prompt", priority=INTERACTIVE)
    go_on.set()
    assert prompt.result(10) == 2  # answered after step 1, before step 2
    assert bg.result(10) == "all" and bg.status == DONE
    events = [(ev, t) for ev, _i, t in worker.log if t in ("tiles", "prompt")]
    assert events == [("start", "tiles"), ("pause", "tiles"), ("start", "prompt"),
                      ("end", "prompt"), ("resume", "tiles"), ("end", "tiles")]


def test_pause_point_serves_higher_priority_jobs_inside_a_running_job(worker):
    inside, go_on = threading.Event(), threading.Event()
    seen = []

    def long_job():
        inside.set()
        go_on.wait(10)
        pause_point()  # e.g. between two encoder blocks
        seen.append("after pause")
        return list(seen)

    bg = worker.submit(long_job, tag="encoder", priority=BACKGROUND)
    assert inside.wait(10)
    worker.submit(lambda: seen.append("prompt"), tag="prompt", priority=INTERACTIVE)
    later = worker.submit(lambda: seen.append("idle"), tag="idle", priority=IDLE)
    go_on.set()
    assert bg.result(10) == ["prompt", "after pause"]  # the idle job did not jump ahead
    later.result(10)
    assert seen == ["prompt", "after pause", "idle"]
    pause_point()  # outside a worker thread: nothing happens


def test_cancel_takes_effect_at_a_pause_point_and_closes_stepped_jobs(worker):
    inside, go_on, closed = threading.Event(), threading.Event(), []

    def long_job():
        inside.set()
        go_on.wait(10)
        pause_point()
        return "finished"

    job = worker.submit(long_job, tag="a", priority=BACKGROUND)
    assert inside.wait(10)
    job.cancel()
    go_on.set()
    assert job.wait(10) and job.status == CANCELLED

    def stepped():
        try:
            while True:
                yield
        finally:
            closed.append(True)

    release, _ = gate(worker)
    gen_job = worker.submit(stepped, tag="gen", priority=BACKGROUND)
    worker.submit(lambda: None, tag="x", priority=INTERACTIVE)
    release.set()
    # the stepped job gives way at every step while the worker has other work
    for _ in range(3):
        worker.submit(lambda: None, tag="x", priority=INTERACTIVE).result(10)
    assert worker.cancel("gen") == 1
    assert gen_job.wait(10) and gen_job.status == CANCELLED and closed == [True]


def test_image_switch_reorders_the_queue(worker):
    """A new image: the old image's queued background work is cancelled (or demoted) and
    the new image's work runs first."""
    release, _ = gate(worker)
    old_tiles = worker.submit(lambda: "old", tag=("tiles", "old"), priority=BACKGROUND)
    old_stack = worker.submit(lambda: "old stack", tag=("stack", "old"), priority=BACKGROUND)
    assert worker.reprioritize(("stack", "old"), IDLE) == 1
    worker.cancel(("tiles", "old"))
    new_tiles = worker.submit(lambda: "new", tag=("tiles", "new"), priority=BACKGROUND)
    prompt = worker.submit(lambda: "mask", tag="prompt", priority=INTERACTIVE)
    assert [j.tag for j in worker.pending()] == \
        [("tiles", "old"), "prompt", ("tiles", "new"), ("stack", "old")]
    release.set()
    assert prompt.result(10) == "mask" and new_tiles.result(10) == "new"
    assert old_stack.result(10) == "old stack"
    assert old_tiles.wait(10) and old_tiles.status == CANCELLED
    order = [t for ev, _i, t in worker.log if ev == "start" and t != "gate"]
    # the cancelled job is only dropped (it never runs its function)
    assert order[1:] == ["prompt", ("tiles", "new"), ("stack", "old")]


def wait_log(worker, event, job, timeout=10.0):
    """Block until ``(event, job)`` is in the worker's log (a test helper, not a timing)."""
    done = threading.Event()
    for _ in range(int(timeout * 100)):
        if any(ev == event and i == job.id for ev, i, _t in list(worker.log)):
            return
        done.wait(0.01)
    raise AssertionError(f"{event!r} of job {job.id} ({job.tag!r}) not in the worker log")


def test_background_hold_parks_background_work_at_its_pause_point_until_released(worker):
    """While the GUI shows a result, background work sleeps at its next pause point;
    prompts queued meanwhile are still served at once, and a release lets it go on."""
    inside, go_on = threading.Event(), threading.Event()
    progress = []

    def encoder():
        inside.set()
        go_on.wait(10)
        for i in range(3):
            pause_point()  # e.g. between two encoder blocks
            progress.append(i)
        return len(progress)

    bg = worker.submit(encoder, tag="tiles", priority=BACKGROUND)
    assert inside.wait(10)
    worker.hold_background(600)
    assert worker.holding
    go_on.set()
    wait_log(worker, "held", bg)
    assert progress == [] and not bg.wait(0)
    prompt = worker.submit(lambda: list(progress), tag="prompt", priority=INTERACTIVE)
    normal = worker.submit(lambda: "user work", tag="normal")  # not background: not held
    assert prompt.result(10) == [] and normal.result(10) == "user work"
    assert progress == [] and not bg.wait(0)  # still parked after serving them
    worker.release_background()
    assert not worker.holding
    assert bg.result(10) == 3
    events = [(ev, t) for ev, _i, t in worker.log if t in ("tiles", "prompt", "normal")]
    assert events == [("start", "tiles"), ("held", "tiles"), ("start", "prompt"), ("end", "prompt"),
                      ("start", "normal"), ("end", "normal"), ("unheld", "tiles"), ("end", "tiles")]


def test_hold_after_an_interactive_job_parks_background_steps_and_starts(worker):
    """``hold_after``: once the prompt ends, neither the next step of a stepped background
    job nor a new background job runs until the hold is released (or its deadline)."""
    release, _ = gate(worker)
    steps = []

    def tiles():
        for i in range(3):
            steps.append(i)
            yield i
        return "tiles"

    prompt = worker.submit(lambda: list(steps), tag="prompt", priority=INTERACTIVE, hold_after=600)
    bg = worker.submit(tiles, tag="tiles", priority=BACKGROUND)
    idle = worker.submit(lambda: "idle", tag="idle", priority=IDLE)
    release.set()
    assert prompt.result(10) == []
    wait_log(worker, "held", bg)
    assert worker.holding and steps == [] and not idle.wait(0)
    worker.release_background()
    assert bg.result(10) == "tiles" and idle.result(10) == "idle" and steps == [0, 1, 2]
    # a short hold nobody releases ends by itself
    worker.submit(lambda: None, tag="prompt", priority=INTERACTIVE, hold_after=0.05).result(10)
    assert worker.submit(lambda: "later", tag="bg", priority=BACKGROUND).result(10) == "later"


def test_a_held_background_job_can_be_cancelled(worker):
    inside = threading.Event()

    def encoder():
        inside.set()
        pause_point()
        return "finished"

    worker.hold_background(600)
    job = worker.submit(encoder, tag="tiles", priority=BACKGROUND)
    wait_log(worker, "held", job)  # held before it started: encoder() did not run
    assert not inside.is_set()
    job.cancel()
    assert job.wait(10) and job.status == CANCELLED and not inside.is_set()
    worker.release_background()


def test_a_job_deferred_at_pause_points_runs_after_the_step_it_waits_for(worker):
    """A prompt whose view the background encoder is computing (``defer`` True while that
    step runs) is not served at the step's pause points but right after the step; a prompt
    without ``defer`` is served at the first pause point, as before."""
    inside, go_on = threading.Event(), threading.Event()
    encoding = {"view": None}
    seen = []

    def tiles():
        for view in ("a", "b"):
            encoding["view"] = view
            if view == "a":
                inside.set()
                go_on.wait(10)
            for i in range(3):
                pause_point()  # e.g. between two encoder blocks
                seen.append(f"{view}{i}")
            encoding["view"] = None
            yield view

    bg = worker.submit(tiles, tag="tiles", priority=BACKGROUND)
    assert inside.wait(10)
    waits = worker.submit(lambda: seen.append("prompt on a"), tag="prompt-a", priority=INTERACTIVE,
                          defer=lambda: encoding["view"] == "a")
    go_on.set()
    waits.result(10)
    bg.result(10)
    assert seen == ["a0", "a1", "a2", "prompt on a", "b0", "b1", "b2"]
    # the same, needing a view not in progress: served at the first pause point
    seen.clear()
    inside.clear()
    go_on.clear()
    bg = worker.submit(tiles, tag="tiles", priority=BACKGROUND)
    assert inside.wait(10)
    other = worker.submit(lambda: seen.append("prompt on c"), tag="prompt-c", priority=INTERACTIVE,
                          defer=lambda: encoding["view"] == "c")
    go_on.set()
    other.result(10)
    bg.result(10)
    assert seen == ["prompt on c", "a0", "a1", "a2", "b0", "b1", "b2"]


def test_a_hold_stops_parking_work_that_a_waiting_prompt_needs(worker):
    """The dock holds background work while napari applies a prompt's edit; once the
    prompt is queued and waits for the step in progress, that step goes on at once."""
    inside, go_on = threading.Event(), threading.Event()
    progress = []

    def tiles():
        inside.set()
        go_on.wait(10)
        for i in range(3):
            pause_point()
            progress.append(i)
        yield "a"

    bg = worker.submit(tiles, tag="tiles", priority=BACKGROUND)
    assert inside.wait(10)
    worker.hold_background(600)
    go_on.set()
    wait_log(worker, "held", bg)
    assert progress == []
    prompt = worker.submit(lambda: list(progress), tag="prompt", priority=INTERACTIVE,
                           defer=lambda: len(progress) < 3 and not bg.wait(0))
    assert prompt.result(10) == [0, 1, 2]  # served after the step, not inside it
    worker.release_background()
    bg.result(10)


def test_a_failing_defer_check_serves_the_job(worker):
    inside, go_on = threading.Event(), threading.Event()
    seen = []

    def encoder():
        inside.set()
        go_on.wait(10)
        pause_point()
        seen.append("after pause")

    def broken():
        raise RuntimeError("no engine")

    bg = worker.submit(encoder, tag="encoder", priority=BACKGROUND)
    assert inside.wait(10)
    worker.submit(lambda: seen.append("prompt"), tag="prompt", priority=INTERACTIVE, defer=broken)
    go_on.set()
    bg.result(10)
    assert seen == ["prompt", "after pause"]
