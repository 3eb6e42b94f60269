"""The flag that makes the second encoder process wait while a prompt is served here: up and
down across a memory map, nested raises, a bounded wait, and its file removed at the end."""
import os
import threading
import time

from napari_gpuseg.engine.sam import encoder_gate as eg


def test_a_reader_waits_while_the_flag_is_up_and_no_longer():
    gate = eg.Gate()
    try:
        reader = eg.GateReader(gate.path)
        t0 = time.monotonic()
        reader.wait()  # down: at once
        assert reader.waited == 0.0
        done = threading.Event()
        with gate.raised():
            with gate.raised():  # nested (a served job's own pause point): still one raise
                pass
            waiter = threading.Thread(target=lambda: (reader.wait(), done.set()))
            waiter.start()
            assert not done.wait(0.3)  # held while the flag is up
        assert done.wait(5)  # and goes on once it is down
        waiter.join(5)
        assert gate.raises == 1
        assert 0.25 < reader.waited < time.monotonic() - t0
    finally:
        gate.close()
    assert not os.path.exists(gate.path)


def test_one_raise_is_waited_for_at_most_the_bound(monkeypatch):
    monkeypatch.setattr(eg, "MAX_WAIT_S", 0.2)
    gate = eg.Gate()
    try:
        reader = eg.GateReader(gate.path)
        with gate.raised():  # a process that never lowers it (it hung, or ended)
            t0 = time.monotonic()
            reader.wait()
            assert 0.15 < time.monotonic() - t0 < 2.0
            t1 = time.monotonic()
            for _ in range(50):  # the encoder's later pause points: no wait for the same raise
                reader.wait()
            assert time.monotonic() - t1 < 0.1
        with gate.raised():  # a new raise is waited for again
            t2 = time.monotonic()
            reader.wait()
            assert time.monotonic() - t2 > 0.15
    finally:
        gate.close()


def test_no_flag_to_be_had_leaves_no_file_and_a_process_that_never_waits(monkeypatch, tmp_path):
    from napari_gpuseg.engine.sam import encoder_process as ep

    monkeypatch.setattr(eg.tempfile, "tempdir", str(tmp_path))

    def no_map(*_a, **_k):
        raise OSError("no shared memory here")

    monkeypatch.setattr(eg.mmap, "mmap", no_map)
    proc = ep.EncoderProcess("nuclei_sam", "fp32", command=["/no/such/python"])
    assert proc._gate is None and list(tmp_path.iterdir()) == []  # its file went at once
    with proc.held():  # holding is a no-op
        pass
    assert proc.state == "failed"


def test_a_gate_whose_process_ends_before_the_reader_mapped_it_leaves_no_file():
    """napari closed while the second process was still starting: nobody unlinked the file."""
    import subprocess
    import sys

    code = ("from napari_gpuseg.engine.sam.encoder_gate import Gate\n"
            "g = Gate()\nprint(g.path, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    path = out.stdout.strip()
    assert path and not os.path.exists(path)
