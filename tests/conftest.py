import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# the annotator's second encoder process (a CPU's first tile after a drop) is started by the
# tests of it (test_encoder_process.py), not by every dock a test opens
os.environ.setdefault("NAPARI_GPUSEG_ENCODER_PROCESS", "0")

import pytest  # noqa: E402

from napari_gpuseg.engine.runtime.allocator import configure_allocator  # noqa: E402

# The tests run the engine in this process, as a script does. Give it the allocator set-up
# the CLI and the plugin's workers use on a CPU (README, *Use from Python*); otherwise a test's
# speed depends on whether a worker ran earlier in the session. The allocator tests keep
# their own state. The encoder-heavy files ran 13 % faster (114 -> 99 s, 2-core AVX2 EPYC).
configure_allocator()

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if not SHARED_DATA.exists():  # CI clones next to ../shared as well; allow an override
    SHARED_DATA = Path(os.environ.get("NAPARI_GPUSEG_SHARED_DATA", SHARED_DATA))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.fail(f"real test data not found at {SHARED_DATA} (set NAPARI_GPUSEG_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def cpu_policy():
    from napari_gpuseg.engine.runtime.device import Policy
    import torch

    return Policy(torch.device("cpu"), "fp32")
