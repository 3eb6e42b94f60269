"""What the docks hold after a job: no low-res logits of a whole stack, no failed job."""
from __future__ import annotations

import types

import torch

from napari_gpuseg.widgets import sam_automatic, unet_adapt


def test_automatic_dock_keeps_no_low_res_logits(monkeypatch):
    asked = {}

    def segment_everything_batch(engine, planes, params, **kwargs):
        asked.update(kwargs)
        return []

    monkeypatch.setattr(sam_automatic, "segment_everything_batch", segment_everything_batch)
    worker = types.SimpleNamespace(policy=None, model=lambda key, loader, replace=False: object())
    dock = types.SimpleNamespace(worker=worker)
    sam_automatic.SamAutomaticWidget._job_run(dock, "lite_medsam", "everything", [], None, None, 2.0, 15,
                                              None, None)
    assert asked.get("keep_logits") is False  # every plane's masks are kept by the dock


def test_adapt_dock_drops_a_failed_job():
    class Status:
        def setText(self, text):
            self.text = text

    status = Status()
    dock = types.SimpleNamespace(job=object(), _busy=lambda busy: None, status=status,
                                 _report_error=lambda exc: status.setText(f"Adapt U-Net: {exc}"))
    unet_adapt.UNetAdaptWidget._failed(dock, torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert dock.job is None  # its error and inputs are not held until the next start
    assert "out of memory" in dock.status.text
