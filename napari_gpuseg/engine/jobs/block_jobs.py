"""The front door of block jobs: a big image in blocks, here or on a Dask cluster, with the
same ``cluster`` argument as :func:`~napari_gpuseg.engine.jobs.pipeline.run_folder`.

The blocks themselves are :func:`napari_gpuseg.engine.blocks.run.run_blocks`; this opens the
image (a zarr store's path, with the ``channel`` option) and the cluster, and maps the
options of folder jobs onto what blocks take. GUI-free and print-free.
"""
from __future__ import annotations

import os
from typing import Callable

from ..runtime.cancel import CancelToken
from .method_registry import DEFAULT_FOLDER_METHOD


def run_blocks(image, out_dir, method: str = DEFAULT_FOLDER_METHOD, method_options: dict | None = None, *,
               cluster=None, devices=None, cancel: CancelToken | None = None,
               on_dashboard: Callable[[str], None] | None = None,
               notify: Callable[[str], None] | None = None, **kwargs):
    """Segment ``image`` in blocks; returns the block run's report.

    ``image``: the path of a zarr / OME-Zarr store (``method_options["channel"]`` picks the
    channel of a multichannel one), a ``ZarrImage`` or an ``engine.blocks.ArraySource``.
    ``cluster``: as for ``run_folder`` (None: here). ``devices``: one device (every worker's
    on a cluster). Other keywords go to the block runner (``block``, ``halo``, ``name``,
    ``into_input``, ``precision``, ``progress``, ``overwrite``, ``methods``)."""
    from ..blocks.run import run_blocks as run_in_blocks
    from .dask_runner import cluster_options
    from .folder_plan import parse_devices

    options = dict(method_options or {})
    channel = options.pop("channel", None)
    if isinstance(image, (str, os.PathLike)):
        from ...io.zarr_images import open_zarr

        image = open_zarr(image, channel=channel)
    elif channel is not None:
        raise ValueError("option channel: give the store's path (the channel is chosen when it is opened)")
    options = {k: v for k, v in options.items() if v is not None}
    if cluster is None and devices is not None and len(parse_devices(devices)) > 1:
        raise ValueError(f"devices {devices}: blocks in this process run on one device; name one, or run "
                         "them on a cluster (--cluster local starts one worker per GPU)")
    device = cluster_options(method, devices, None, None)
    cancel = cancel or CancelToken()
    if cluster is None:
        return run_in_blocks(image, out_dir, method, options, device=device, cancel=cancel, **kwargs)
    from .clusters import open_cluster

    with open_cluster(cluster, cancel=cancel, notify=notify) as handle:
        if on_dashboard is not None:
            on_dashboard(handle.dashboard)
        return run_in_blocks(image, out_dir, method, options, client=handle.client, device=device,
                             cancel=cancel, **kwargs)


def stores_in(in_dir, out_dir, pattern: str, recursive: bool = False) -> tuple[list, bool]:
    """(the zarr stores inside the folder ``in_dir``, whether it also holds image files to
    segment): a folder job runs its files, then each store in blocks (:func:`run_stores`)."""
    from ...io.zarr_images import find_stores
    from .outputs import list_inputs

    stores = find_stores(in_dir, recursive, exclude=[out_dir])
    if not stores:
        return [], True
    return stores, bool(list_inputs(in_dir, out_dir, pattern, recursive))


def run_stores(stores, in_dir, out_dir, method: str = DEFAULT_FOLDER_METHOD, method_options: dict | None = None,
               *, cluster=None, cancel: CancelToken | None = None,
               on_store: Callable[[int, int, str, object], None] | None = None,
               on_dashboard: Callable[[str], None] | None = None,
               notify: Callable[[str], None] | None = None, **kwargs) -> tuple[int, bool]:
    """Each zarr store of the folder ``in_dir`` in blocks, one after another, on one cluster
    (or here), its outputs under the same relative folder of ``out_dir``.
    ``on_store(k, n, rel, result)`` hears each store's :class:`BlockReport`, or the
    exception that stopped that store (the next one runs). Returns (stores that failed,
    cancelled)."""
    from pathlib import Path

    from .clusters import open_cluster

    cancel = cancel or CancelToken()
    handle = None if cluster is None else open_cluster(cluster, cancel=cancel, notify=notify)
    failed = 0
    try:
        if handle is not None and on_dashboard is not None:
            on_dashboard(handle.dashboard)
        for k, store in enumerate(stores, 1):
            rel = Path(store).relative_to(in_dir)
            try:
                rep = run_blocks(store, Path(out_dir) / rel.parent, method, method_options, cluster=handle,
                                 cancel=cancel, **kwargs)
            except (ValueError, RuntimeError, OSError) as exc:  # this store only; the next one runs
                failed += 1
                if on_store is not None:
                    on_store(k, len(stores), rel.as_posix(), exc)
                continue
            if on_store is not None:
                on_store(k, len(stores), rel.as_posix(), rep)
            if rep.cancelled:
                return failed, True
    finally:
        if handle is not None:
            handle.close()
    return failed, False
