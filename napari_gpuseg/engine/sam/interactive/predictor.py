"""SAM predictor engine: batched, cached embeddings and batched prompt decoding.

    engine = SamEngine(sam_model, SamModelInfo("lite_medsam", image_size=256, normalization="minmax"))
    img = engine.prepare(numpy_image)             # contrast + channels, once per image
    engine.embed([img])                           # all tiles of all images, batched, cached
    masks = engine.predict(img, [Prompt(box=[x0, y0, x1, y1])])

Coordinates follow SAM: (x, y) in image pixels. Nothing here imports Qt or napari.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from .decode_call import blend_views, keep_best, module_outputs, prompt_tensors, render_masks
from .fast_decoder import decode_sparse, supports_factored
from ...runtime.batching import run_batched, to_device
from ...runtime.device import Policy, all_finite, resolve_policy, guard_finite
from .cache import EmbeddingCache
from ...runtime.cancel import CancelToken, ProgressFn, check
from .mask_input_carry import into_click_view
from .inputs import PreparedImage, prepare_image, view_input
from .view_selection import ViewSets
from .views import View, prompt_box, route_click, route_native, touches_cut
from .prompt_types import MaskResult, Prompt, paste_labels, prompt_coords  # noqa: F401 - paste_labels re-exported
from .encoder_pauses import add_pause_points


GPU_EMBED_STEP = 2  # views per background encoder step on a GPU (embed_steps)


@dataclass(frozen=True)
class SamModelInfo:
    name: str
    image_size: int = 1024
    normalization: str = "sam"  # "sam" (mean/std on 0..255) or "minmax" (LiteMedSAM)
    box_trained: bool = False  # True for models that respond to boxes, not single points
    decoder_tuned: bool = False  # a decoder tuned to clicks on microscopy (nuclei_sam, Adapt SAM's files)
    encoder: str = ""  # the image encoder's identity (embedding cache keys); default: name


class SamEngine(ViewSets):
    """Owns one SAM model on one device; embeds images in batches and decodes prompts."""

    def __init__(self, sam: torch.nn.Module, info: SamModelInfo, policy: Policy | None = None,
                 cache: EmbeddingCache | None = None, tile_overlap: int | None = None,
                 contrast: tuple[float, float] = (0.0, 100.0)):
        self.policy = resolve_policy(policy)
        self.sam = sam.to(self.policy.device).eval()
        self.info = info
        self.cache = cache if cache is not None else EmbeddingCache()
        self.tile_overlap = tile_overlap
        self.contrast = contrast
        # clicks are decoded in views this much finer than native (1 = the grid tiles), the
        # scale the model's decoder was trained at (decoder_checkpoint.apply_decoder)
        self.click_zoom = float(getattr(sam, "click_zoom", 1.0))
        # the candidates of a multimask prompt: a decoder tuned here trains its single-mask
        # output on every corrective click and box, so that output competes as a fourth
        # candidate (measured: docs/benchmarks.md); a stock SAM decoder offers its three
        self.candidates = "all" if getattr(sam, "decoder_tuned", False) else "multi"
        # the candidate a first click keeps: None, the highest predicted IoU (SAM's rule); k,
        # candidate k of :attr:`candidates` in every view, chosen by measuring first clicks on
        # labelled objects (scripts/calibrate_iou_head.py --choose-output, Adapt SAM) and
        # stored with the decoder (decoder_checkpoint.apply_decoder)
        self.click_output: int | None = getattr(sam, "click_output", None)
        # with no click_output: a first click's mask blends all candidates of both its views,
        # weighted by softmax(click_blend x predicted IoU) (keep_best, blend_views), where the
        # decoder file names the temperature, measured on training objects (None: the best one)
        self.click_blend: float | None = getattr(sam, "click_blend", None)
        # the logit a first click's mask is cut at (SAM's 0 unless the decoder names one,
        # measured on training objects: a decoder whose first masks come out smaller than the
        # objects it learned draws them at a lower level, see click_choice.choose_click_threshold)
        self.click_threshold: float = float(getattr(sam, "click_threshold", None) or 0.0)
        self.last_batch_size: int | None = None
        self._extra_views: dict[str, list[View]] = {}  # ad-hoc views made per image digest
        # per embedding: the decoder's work that depends on the image alone (see fast_decoder)
        self._memos: OrderedDict[tuple, dict] = OrderedDict()
        self._nonfinite: set = set()  # keys of views whose embedding was not finite (never cached)
        self._encoding: frozenset = frozenset()  # keys of the views the encoder is computing
        self._factored = supports_factored(self.sam)
        # the decoder's outputs per (image, view, prompts), kept inside reuse_decodes() only
        self._reused: dict | None = None
        encoder = getattr(self.sam, "image_encoder", None)
        if isinstance(encoder, torch.nn.Module):  # stand-in models in tests may have none
            add_pause_points(encoder)

    MEMOS = 4  # embeddings whose decoder products are kept (~35 MB each at 64 x 64)
    MASK_RENDER_BYTES = 64 * 2**20  # full-size mask logits of one decoder call rendered at once

    def decoder_memo(self, image: PreparedImage, view: View, source: str = "view") -> dict:
        """The dict :func:`fast_decoder.decode_sparse` keeps for the embedding of ``view``:
        the decoder's image-only products, reused by every later prompt on it. ``source``
        tells embeddings of one view apart (``"field"``: cut from :mod:`field_map`'s map)."""
        key = self._key(image, view) + (source,)
        memo = self._memos.pop(key, None)
        if memo is None:
            memo = {}
            while len(self._memos) >= self.MEMOS:
                self._memos.popitem(last=False)
        self._memos[key] = memo
        return memo

    def warm_decoder(self, image: PreparedImage, views: Sequence[View] | None = None,
                     cancel: CancelToken | None = None) -> int:
        """Fill the decoder memo of ``views`` (default: the image's first :attr:`MEMOS`
        grid views) with one throwaway box decode each, so the user's first prompt on an
        embedding costs what later ones do instead of about three times as much. Call it
        after :meth:`embed`, in the background. Returns how many views were warmed."""
        if not self._factored:
            return 0
        image = self.prepare(image)
        views = list(views) if views is not None else self.views(image)[: self.MEMOS]
        for view in views:
            check(cancel)
            memo = self.decoder_memo(image, view)
            if memo:
                continue
            box = np.array([view.x0, view.y0, view.x0 + view.w, view.y0 + view.h], float)
            self._decode(self.embedding(image, view), view, [Prompt(box=box)], False, memo)
        return len(views)

    def forget_decoder_work(self) -> None:
        """Drop what the decoder computed per embedding (call after its weights change);
        the embeddings themselves stay valid."""
        self._memos.clear()

    @contextmanager
    def reuse_decodes(self):
        """Inside it, a decoder call repeated for the same prompts on the same view (no mask
        input) reuses the decoder's outputs: the candidates and their predicted IoUs do not
        depend on :attr:`click_output`, only which one is kept does. Measuring first clicks
        under every rule (``click_choice``) decodes once instead of once per rule. The
        decoder's weights must not change inside it."""
        outer = self._reused
        self._reused = {} if outer is None else outer
        try:
            yield self
        finally:
            self._reused = outer

    # -- images and views ----------------------------------------------------
    @property
    def input_size(self) -> int:
        return self.info.image_size

    def prepare(self, image: np.ndarray | PreparedImage) -> PreparedImage:
        if isinstance(image, PreparedImage):
            return image
        return prepare_image(image, self.contrast)

    def _key(self, image: PreparedImage, view: View) -> tuple:
        return (image.digest, self.info.encoder or self.info.name, self.policy.precision, str(self.policy.device),
                view.y0, view.x0, view.h, view.w, view.input_size) + ((view.zoom,) if view.zoom else ())

    def is_embedded(self, image: PreparedImage, views: Sequence[View] | None = None) -> bool:
        return all(self._key(image, v) in self.cache for v in (views or self.views(image)))

    def is_encoding(self, image: PreparedImage, views: Sequence[View]) -> bool:
        """True while the encoder computes one of ``views`` (in a call a pause point interrupted)."""
        return any(self._key(image, v) in self._encoding for v in views)

    def views_ready(self, image: PreparedImage, views: Sequence[View] | None = None) -> int:
        """How many of ``views`` (default: the image's grid views) are embedded."""
        return sum(self._key(image, v) in self.cache for v in (views or self.views(image)))

    def embed_steps(self, image: np.ndarray | PreparedImage, views: Sequence[View] | None = None,
                    step: int | None = None, focus: Callable[[], tuple[float, float] | None] | None = None,
                    progress: ProgressFn = None, cancel: CancelToken | None = None) -> Iterator[int]:
        """Embed the missing ``views`` of one image (default: its grid) one encoder batch at
        a time, yielding the number of views ready after each batch; returns the prepared
        image. Run it as a worker job and queued prompts are served between batches.

        Views already embedded (by a prompt that needed one, say) are skipped when their
        turn comes. ``focus()`` (x, y), asked before each batch, puts the views nearest it
        first. ``step`` is the views per batch (default: one on CPU, where a batch is no
        faster per view and a shorter step answers a prompt sooner; :data:`GPU_EMBED_STEP` on
        a GPU, where a prompt's decode queues behind the step's kernels on the same stream
        and pause points cannot cut that wait short)."""
        image = self.prepare(image)
        views = list(views) if views is not None else self.views(image)
        total = len(views)
        if step is None:
            step = 1 if self.policy.device.type == "cpu" else GPU_EMBED_STEP
        while True:
            check(cancel)
            todo = [v for v in views if self._key(image, v) not in self.cache]
            if progress:
                progress(total - len(todo), total)
            if not todo:
                return image
            where = focus() if focus is not None else None
            if where is not None:
                x, y = where
                todo.sort(key=lambda v: (v.x0 + v.w / 2 - x) ** 2 + (v.y0 + v.h / 2 - y) ** 2)
            self.embed([image], [todo[:max(1, step)]], batch_size=max(1, step), cancel=cancel)
            yield total - len(todo) + min(len(todo), max(1, step))

    # -- encoder --------------------------------------------------------------
    def encode(self, batch: torch.Tensor) -> torch.Tensor:
        """The image encoder on a (B, 3, H, W) input batch, under the device policy (a
        non-finite result under autocast re-runs in fp32). cuDNN autotunes only inputs of the
        model's own size (views), never the field map's blocks, whose shapes change with
        every image size (each new shape would be tuned again)."""
        x = to_device(batch, self.policy.device)
        benchmark = tuple(x.shape[-2:]) == (self.input_size, self.input_size)

        def run():
            with torch.inference_mode(), self.policy.autocast(benchmark=benchmark):
                return self.sam.image_encoder(x)

        # a non-finite embedding under autocast re-runs in fp32 (and pins fp32 for the device)
        return guard_finite(self.policy, run, "image embedding")

    def embed(self, images: Sequence[np.ndarray | PreparedImage],
              views: Sequence[Sequence[View]] | None = None, batch_size: int | None = None,
              progress: ProgressFn = None, cancel: CancelToken | None = None) -> list[PreparedImage]:
        """Embed every (missing) view of every image; several views per encoder call."""
        prepared = [self.prepare(im) for im in images]
        todo: list[tuple[PreparedImage, View]] = []
        seen = set()
        for i, img in enumerate(prepared):
            for v in (views[i] if views is not None else self.views(img)):
                key = self._key(img, v)
                if key not in seen and self.cache.get(key) is None:
                    seen.add(key)
                    todo.append((img, v))
        if not todo:
            if progress:
                progress(1, 1)
            return prepared
        s = self.input_size

        def encode(pairs):
            check(cancel)
            x = torch.stack([view_input(img, v, self.info.normalization) for img, v in pairs])
            outer = self._encoding  # a prompt served at a pause point may embed its own views
            self._encoding = outer | frozenset(self._key(img, v) for img, v in pairs)
            try:
                out = self.encode(x)
            finally:
                self._encoding = outer
            # each embedding to its own host copy, inside the OOM back-off; the batch output
            # is dropped here, so the peak is the embeddings plus one batch, not twice them.
            # A non-finite one (even after the fp32 re-run) is never cached: the next call
            # embeds the view again instead of serving empty masks from it for good
            for (img, v), emb in zip(pairs, out):
                if all_finite(emb):
                    self.cache.put(self._key(img, v), emb.to("cpu", copy=True))
                else:
                    self._nonfinite.add(self._key(img, v))
            return [None] * len(pairs)

        key = ("sam-encoder", self.info.name, s, self.policy.precision, str(self.policy.device))
        item_bytes = 40 * 3 * s * s * 4  # activations of one image, a loose upper bound
        run_batched(encode, todo, batch_size=batch_size, key=key, device=self.policy.device,
                    item_bytes=item_bytes, progress=progress, cancel=cancel)
        return prepared

    def embedding(self, image: PreparedImage, view: View) -> torch.Tensor:
        emb = self.cache.get(self._key(image, view))
        if emb is None:
            self.embed([image], [[view]])
            emb = self.cache.get(self._key(image, view))
            if emb is None and self._key(image, view) in self._nonfinite:
                self._nonfinite.discard(self._key(image, view))
                raise FloatingPointError(f"the image embedding of view {view} is not finite (NaN or "
                                         "inf) even in fp32: check the image values")
            if emb is None:  # cache too small to hold even one entry
                raise MemoryError("embedding cache is too small for one embedding")
        return emb

    # -- decoder --------------------------------------------------------------
    def route(self, image: PreparedImage, prompt: Prompt, zoom: bool = True) -> View:
        """The view a prompt is decoded in: its mask input's; for a first click (points, no
        box) the most central click view (:meth:`click_views`; :meth:`predict` tries the
        grid too); else a native view (:func:`views.route_native`: a grid tile, or a view
        made and reused). ``zoom=False`` skips the click views."""
        if prompt.mask_input is not None:
            return prompt.mask_input.view
        if zoom and prompt.box is None and prompt.points is not None:
            view = route_click(prompt.points, self.click_views(image))
            if view is not None:
                return view
        click = prompt.box is None
        return route_native(prompt_box(prompt.points, prompt.box),
                            self.native_click_views(image) if click else self.views(image),
                            self._extra_views.setdefault(image.digest, []), image.shape,
                            self.input_size, click=click)

    def predict(self, image: np.ndarray | PreparedImage, prompts: Sequence[Prompt],
                multimask: bool = False, cancel: CancelToken | None = None,
                near_box: bool = False, zoom: bool = True) -> list[MaskResult]:
        """Masks for ``prompts``; prompts sharing a view and a shape go in one decoder call.

        ``multimask=True`` asks for the candidates (:attr:`candidates`: SAM's three, and
        for a decoder tuned here its single-mask output too) and keeps the one with the
        highest predicted IoU, or candidate :attr:`click_output` when the decoder names one,
        or, when it names :attr:`click_blend`, blends them by predicted IoU, a first click's
        two views joined (``decode_call.blend_views``; ``all_scores`` keeps every candidate's
        score); that first mask is cut at :attr:`click_threshold` (:meth:`first_click_logits`).
        ``near_box=True``: the mask
        of a prompt with a box (and no mask input) is computed near its box only, the box
        grown by half its size per side (``fast_decoder.mask_region``, as box mode does);
        a mask reaching further is cut there. The same numbers inside; the decoder's mask
        upscaling, its largest per-pixel part, runs on that region alone. The result's
        low-res logits then hold ``fast_decoder.ROI_FILL`` outside the region, so do not
        feed them back as a mask input. ``zoom=False`` decodes every prompt in a native view
        only (no click views: a first look at a first click before its click view is embedded).
        """
        image = self.prepare(image)
        for p in prompts:
            p.check_inside(image.shape)
        given = list(prompts)
        prompts = [self._into_click_view(image, p) if zoom else p for p in given]
        routed = [self.route(image, p, zoom=zoom) for p in prompts]
        results = self._decode_routed(image, prompts, routed, multimask, cancel, near_box)
        # a corrective click carried into a click view whose mask reaches a cut edge of it
        # (the object may go on outside) is decoded again in its mask input's own view
        back = [i for i, (p, q) in enumerate(zip(given, prompts))
                if q is not p and touches_cut(results[i].mask, routed[i], image.shape)]
        if back:
            redo = [given[i] for i in back]
            own = [self.route(image, p) for p in redo]
            for i, res in zip(back, self._decode_routed(image, redo, own, multimask, cancel, near_box)):
                results[i] = res
        # a first click in a zoomed view is also decoded at native scale; the candidate with
        # the higher predicted IoU wins, and the native one always when the zoomed mask
        # reaches a cut edge of its view (the object may go on outside it); with click_blend,
        # both views' blends are joined instead (blend_views)
        zoomed = set(self.click_views(image)) - set(self.native_click_views(image))
        again = [i for i, (p, v) in enumerate(zip(prompts, routed)) if p.mask_input is None and v in zoomed]
        if again:
            redo = [prompts[i] for i in again]
            native = [self.route(image, p, zoom=False) for p in redo]
            blend = self.blend_for(multimask)
            for i, res in zip(again, self._decode_routed(image, redo, native, multimask, cancel, near_box)):
                if blend is not None:
                    results[i] = blend_views(results[i], res, blend)
                elif res.score > results[i].score or touches_cut(results[i].mask, routed[i], image.shape):
                    results[i] = res
        return results

    def _into_click_view(self, image: PreparedImage, prompt: Prompt) -> Prompt:
        """``prompt`` as :meth:`predict` decodes it: a corrective click after a native-scale
        mask carried into a click view (:func:`mask_input_carry.into_click_view`)."""
        if self.click_zoom <= 1:
            return prompt
        return into_click_view(prompt, self.click_views(image))

    def _decode_routed(self, image: PreparedImage, prompts: Sequence[Prompt], routed: list[View],
                       multimask: bool, cancel, near_box: bool) -> list[MaskResult]:
        """Decode each prompt in its view; prompts sharing a view and a shape in one call."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (p, v) in enumerate(zip(prompts, routed)):
            k = (v, 0 if p.points is None else len(p.points), p.box is not None,
                 p.mask_input is not None)
            groups[k].append(i)
        results: list[MaskResult | None] = [None] * len(prompts)
        for (view, _npts, _hasbox, _hasmask), idx in groups.items():
            check(cancel)
            emb = self.embedding(image, view)
            memo = self.decoder_memo(image, view)
            group = [prompts[i] for i in idx]
            reuse = None
            if self._reused is not None and not _hasmask:
                reuse = (image.digest, view, multimask, near_box, tuple(_prompt_key(p) for p in group))
            for i, res in zip(idx, self._decode(emb, view, group, multimask, memo, near_box, reuse)):
                results[i] = res
        return results  # type: ignore[return-value]

    def _decode(self, emb: torch.Tensor, view: View, prompts: list[Prompt],
                multimask: bool, memo: dict | None = None, near_box: bool = False,
                reuse: tuple | None = None) -> list[MaskResult]:
        """One decoder call (:mod:`decode_call`). Without a mask input, the factored decoder
        (fp32; the same numbers as the module up to rounding) reuses ``memo`` from earlier
        prompts on this embedding, which makes interactive prompts several times cheaper.
        ``reuse``: the key under which :meth:`reuse_decodes` keeps the decoder's outputs."""
        kept = self._reused.get(reuse) if reuse is not None and self._reused is not None else None
        if kept is not None:
            low_res, iou = kept
        else:
            low_res, iou = self._decoder_outputs(emb, view, prompts, multimask, memo, near_box)
            if reuse is not None and self._reused is not None:
                self._reused[reuse] = (low_res, iou)
        chosen, scores = keep_best(low_res, iou, multimask, self.click_output, self.blend_for(multimask))
        # one call's prompts all have a mask input or none (_decode_routed groups them so)
        chosen = self.first_click_logits(chosen, multimask and prompts[0].mask_input is None)
        full_np = render_masks(chosen, view, self.MASK_RENDER_BYTES)
        scores_np = scores.cpu().numpy()
        all_scores = iou.cpu().numpy()
        return [MaskResult(full_np[i], view.y0, view.x0, float(scores_np[i]), chosen[i].detach(),
                           view, all_scores[i]) for i in range(len(prompts))]

    def first_click_logits(self, logits: torch.Tensor, first_click: bool) -> torch.Tensor:
        """A first click's kept logits (a multimask prompt without a mask input) shifted so
        that its mask, cut at 0, is the logits above :attr:`click_threshold`; the shifted
        logits are also what a corrective click refines (the mask shown is its mask input)."""
        return logits - self.click_threshold if first_click and self.click_threshold else logits

    def blend_for(self, multimask: bool) -> float | None:
        """The temperature a multimask prompt's candidates are blended with (None: keep one)."""
        return self.click_blend if multimask and self.click_output is None else None

    def _decoder_outputs(self, emb: torch.Tensor, view: View, prompts: list[Prompt], multimask: bool,
                         memo: dict | None, near_box: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(low-res logits (N, M, L, L), predicted IoUs (N, M)) in fp32 of the candidates
        ``multimask`` asks for (:attr:`candidates`, else the single-mask output)."""
        dev = self.policy.device
        points, boxes, masks, roi = prompt_tensors(view, prompts, dev, self.input_size, emb.shape[-1], near_box)
        with torch.inference_mode(), self.policy.autocast():
            sparse, dense = self.sam.prompt_encoder(points=points, boxes=boxes, masks=masks)
            outputs = self.candidates if multimask else "single"
            if masks is None and self._factored:
                iou, _sel, low_res = decode_sparse(self.sam, emb, sparse, outputs,
                                                   memo=memo, roi=roi, device=dev)  # emb copied once per memo
            else:
                low_res, iou = self._decode_module(emb, sparse, dense, outputs)
        return low_res.float(), iou.float()

    def _decode_module(self, emb, sparse, dense, outputs: str):
        """The mask decoder module's (low-res logits, IoU) for ``outputs`` (see decode_sparse)."""
        return module_outputs(self.sam, self.policy.device, emb, sparse, dense, outputs)

    # -- conveniences -----------------------------------------------------------
    def predict_boxes(self, image, boxes: np.ndarray, cancel: CancelToken | None = None,
                      embed_batch_size: int | None = None) -> list[MaskResult]:
        """One mask per (x0, y0, x1, y1) box; all boxes routed, embedded and decoded in batches."""
        image = self.prepare(image)
        prompts = [Prompt(box=b) for b in prompt_coords(boxes, "boxes", (-1, 4))]
        for p in prompts:
            p.check_inside(image.shape)
        needed = sorted({self.route(image, p) for p in prompts})
        self.embed([image], [needed], batch_size=embed_batch_size, cancel=cancel)
        return self.predict(image, prompts, cancel=cancel)


def _prompt_key(prompt: Prompt) -> tuple:
    """A prompt without a mask input as a hashable value (its points, labels and box)."""
    def raw(a):
        return None if a is None else (a.shape, np.ascontiguousarray(a).tobytes())
    return raw(prompt.points), raw(prompt.labels), raw(prompt.box)
