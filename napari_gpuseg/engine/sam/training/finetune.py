"""Fine-tune a SAM decoder to your images: frozen image encoder, simulated interaction.

    result = finetune_sam(images, labels, model="nuclei_sam", out_path="my_decoder.pt")
    engine = load_engine(result.path)          # the tuned decoder on the same encoder

Every training view is embedded once (:mod:`train_views`; with ``cache_dir`` the
embeddings persist on disk and a rerun skips the encoder). The prompt encoder and mask
decoder then learn from simulated users (:mod:`simulated_prompts`): each object starts with one
positive click (multimask output, the best of the three candidates counts, as SAM trains;
``first_candidates="all"`` adds the single-mask output, so the IoU head learns to rank all
four as the engine picks a tuned decoder's first click) or a jittered box, then one or more
corrective clicks with the previous low-res logits as mask input. Loss: BCE + Dice on the
masks, MSE of the IoU head against the true IoU. AdamW with warm-up and cosine decay over
steps or the time budget, a validation split of whole images with early stopping, a loss
callback, Cancel. The training steps run in fp32 on a CPU, also where the device policy
picks bf16 for inference (a CPU with AVX512-BF16 or AMX: bf16 steps were only 1.05-1.12x
faster there, and a short high-lr run that learned in fp32 diverged in bf16); on CUDA the
policy's autocast (a GradScaler for fp16) and a halved batch on out-of-memory. The views are
embedded, and validation decodes, in the policy's precision, as the annotator will.
The checkpoint holds only the decoder (:mod:`napari_gpuseg.models.sam.decoder_checkpoint`).

Only models whose masks come at their input size train (LiteMedSAM and decoders tuned on it,
256 px); others (SAM ViT-B/L/H, MobileSAM: 256 px masks for a 1024 px input) are refused in
one line. ``encoder_lr > 0`` (their TinyViT encoder) also trains the image
encoder's last ``encoder_stages`` stages (1: the last) and neck, at that learning rate: the
views keep the encoder trunk's output (every stage before those, computed once), each step
runs the trained stages on its views with gradients, and the checkpoint then carries those
encoder tensors too (for LiteMedSAM about 3 M parameters, 6 MB in fp16, for the last stage;
5 M, 10 MB, for the last two), so that the tuned file gives other embeddings than its base.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ...runtime.batching import is_oom
from ...runtime.cancel import CancelToken, Cancelled, ProgressFn, check
from ...runtime.memory import empty_cache
from .click_choice import output_to_train
from .episode_loss import episode, evaluate, first_prompts, sample_objects  # noqa: F401 - evaluate re-exported
from .train_views import TrainView, collect_views
from .tune_config import SamTuneConfig


CPU_OBJECTS_PER_PASS = 2  # a training step's objects per decoder pass on a CPU (benchmarks/train_memory.py)


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during training: the best decoder so far was saved first. ``result`` is the
    :class:`SamTuneResult` (``stopped == "interrupted"``, ``path`` where it was saved)."""

    def __init__(self, result: "SamTuneResult") -> None:
        super().__init__(f"interrupted at step {result.best_step}")
        self.result = result


@dataclass
class SamTuneEvent:
    """Sent to ``on_event`` after every step (``val`` set after an evaluation)."""

    step: int
    total: int
    loss: float
    seconds: float
    val: dict | None = None


@dataclass
class SamTuneResult:
    engine: object  # the SamEngine with the best decoder loaded
    path: str | None
    best_score: float | None
    best_step: int
    history: list = field(default_factory=list)
    stopped: str = "done"  # "done" | "early" | "time" | "cancelled" | "interrupted"
    seconds: float = 0.0
    n_train_views: int = 0
    n_val_views: int = 0


# -- the loop ------------------------------------------------------------------------------

def _split(n_images: int, cfg: SamTuneConfig) -> tuple[set, set]:
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(n_images)
    n_val = int(round(n_images * cfg.val_fraction)) if n_images > 1 else 0
    if cfg.val_fraction > 0 and n_images > 1:
        n_val = max(1, n_val)
    return set(order[n_val:].tolist()), set(order[:n_val].tolist())


def _lr_factor(step: int, total: int, warmup: int, time_frac: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    frac = max((step - warmup) / max(1, total - warmup), time_frac)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))


def finetune_sam(images: Sequence[np.ndarray], labels: Sequence[np.ndarray], model="nuclei_sam",
                 config: SamTuneConfig | None = None, out_path: str | os.PathLike | None = None,
                 on_event: Callable[[SamTuneEvent], None] | None = None, progress: ProgressFn = None,
                 cancel: CancelToken | None = None, policy=None, cache_dir: str | os.PathLike | None = None,
                 meta: dict | None = None) -> SamTuneResult:
    """Fine-tune the decoder of ``model`` (a registry name, a checkpoint or decoder file, or
    a loaded :class:`SamEngine`) on 2D ``images`` with instance ``labels``; save the best
    decoder (by validation score) to ``out_path``. ``progress(done, total)`` reports the
    embedding of the training views; ``on_event`` every training step.

    ``out_path`` is checked before anything is embedded (``OSError``, one line: a folder, a
    folder that cannot be written). Ctrl-C during the training steps saves the best decoder
    so far to ``out_path`` and raises :class:`TuneInterrupted` (a ``KeyboardInterrupt``)
    holding the result."""
    cfg = config or SamTuneConfig()
    cfg.check()
    if len(images) == 0:
        raise ValueError("no training images")
    if out_path is not None:
        from ...unet.train_output import check_output_path

        check_output_path(out_path)
    engine = _engine(model, policy, cache_dir)
    sam, device = engine.sam, engine.policy.device
    _check_geometry(engine)
    rng = np.random.default_rng(cfg.seed)
    tail = _encoder_tail(sam, cfg)
    zooms = cfg.view_zooms or (1.0, cfg.click_zoom or engine.click_zoom)
    views = collect_views(engine, images, labels, cfg.views_per_image, rng, progress, cancel,
                          zooms=tuple(dict.fromkeys(float(z) for z in zooms)), polarity=cfg.polarity,
                          contrast_jitter=cfg.contrast_jitter, trunk=cfg.encoder_stages if tail else 0,
                          orientations=cfg.orientations)
    if cfg.first_output == "measured":  # before training: the base decoder's candidate
        cfg = dataclasses.replace(cfg, first_output=output_to_train(engine, images, labels, cfg.first_candidates, cancel))
    train_imgs, val_imgs = _split(len(images), cfg)
    train = [i for i, v in enumerate(views) if v.source in train_imgs]
    val = [i for i, v in enumerate(views) if v.source in val_imgs]
    if not train:
        raise ValueError("no training view holds a whole object: check the labels")
    best = _Best(engine, views, _val_pairs(views, val, cfg), cfg, tail)

    opt, scaler = _optimizer(engine, cfg, tail)
    history: list[dict] = []
    stopped, k = "done", cfg.objects_per_view
    t0 = time.perf_counter()

    initial = best.evaluate(0)
    if initial is not None:
        history.append({"step": 0, "loss": None, **{f"val_{k2}": v for k2, v in initial.items()}})
    sam.train()
    step = 0
    try:
        while step < cfg.max_steps:
            check(cancel)
            elapsed = time.perf_counter() - t0
            if cfg.max_time and elapsed >= cfg.max_time:
                stopped = "time"
                break
            tfrac = elapsed / cfg.max_time if cfg.max_time else 0.0
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * _lr_factor(step, cfg.max_steps, cfg.warmup, tfrac)
            try:
                loss_val = _step(engine, views, train, k, rng, cfg, opt, scaler, tail)
            except Exception as exc:  # out of memory on a GPU: fewer objects per step
                if not is_oom(exc) or k == 1:
                    raise
                opt.zero_grad(set_to_none=True)
                k = max(1, k // 2)
                empty_cache(device)
                continue
            step += 1
            scores = best.evaluate(step) if step % cfg.eval_every == 0 or step == cfg.max_steps else None
            rec = {"step": step, "loss": loss_val}
            if scores is not None:
                rec.update({f"val_{k2}": v for k2, v in scores.items()})
            history.append(rec)
            if on_event is not None:
                on_event(SamTuneEvent(step, cfg.max_steps, loss_val, time.perf_counter() - t0, scores))
            if scores is not None and best.stale >= cfg.patience:
                stopped = "early"
                break
    except Cancelled:
        stopped = "cancelled"
    except KeyboardInterrupt:
        stopped = "interrupted"  # no evaluation now: save the best so far at once
    if stopped == "time" and step % cfg.eval_every != 0:
        best.evaluate(step)
    best.restore()
    sam.decoder_tuned = True
    if tail:  # its embeddings are no longer the base's: a name of its own for the cache keys
        from ....models.sam.decoder_checkpoint import encoder_digest
        from ..loader import base_identity

        tuned = {k: v for k, v in sam.image_encoder.state_dict().items() if k.startswith(tail)}
        sam.encoder_source = None  # until it is saved (the file then carries the whole tail)
        sam.encoder_id = f"{base_identity(engine)[0]}+{encoder_digest(tuned)}"
        engine.info = dataclasses.replace(engine.info, encoder=sam.encoder_id)
    # a base decoder's measured first-click candidate (click_choice) says nothing about the
    # retrained one: the IoU head's choice (and logit 0) until it is measured again
    sam.click_output = engine.click_output = None
    sam.click_threshold, engine.click_threshold = None, 0.0
    seconds = time.perf_counter() - t0
    path = None
    if out_path is not None and stopped != "cancelled":
        path = str(_save(out_path, engine, cfg, history, best.step, best.score, seconds, stopped,
                         len(train), len(val), meta or {}, tail))
        if tail:
            sam.encoder_source = path
    engine.forget_decoder_work()
    result = SamTuneResult(engine, path, best.score, best.step, history, stopped, seconds, len(train), len(val))
    if stopped == "interrupted":
        raise TuneInterrupted(result)
    return result


def _check_geometry(engine) -> None:
    """Training compares the decoder's masks with the objects at the model's input size: a
    model whose masks come smaller (SAM ViT-B/L/H and MobileSAM: 1024 px in, 256 px masks) is
    refused with one line before anything is embedded."""
    pe = engine.sam.prompt_encoder
    masks = pe.mask_input_size
    if tuple(masks) != tuple(pe.input_image_size):
        raise ValueError(f"fine-tuning needs a model whose masks come at its input size (LiteMedSAM and the "
                         f"decoders tuned on it, 256 px); {engine.info.name} takes {pe.input_image_size[0]} px "
                         f"and gives {masks[0]} px masks")


def _encoder_tail(sam, cfg: SamTuneConfig) -> tuple[str, ...]:
    """The image encoder's state-dict prefixes that train (``cfg.encoder_lr > 0``: its last
    ``cfg.encoder_stages`` stages and neck), else ``()``; ``ValueError`` for an encoder that
    cannot be split there."""
    if not cfg.encoder_lr:
        return ()
    enc = sam.image_encoder
    if not (hasattr(enc, "trunk") and hasattr(enc, "last_stages")):
        raise ValueError(f"encoder_lr: only a TinyViT image encoder (LiteMedSAM, MobileSAM) can train its "
                         f"last stages, this model has {type(enc).__name__}")
    return tuple(enc.last_stages_parts(cfg.encoder_stages))


def trained_stages(sam, tokens: torch.Tensor, stages: int) -> torch.Tensor:
    """The embeddings of trunk ``tokens`` (``B x L x C``, :func:`.train_views.trunk_features`)
    through the encoder's last ``stages`` stages and neck. The tokens' grid has the
    embedding's aspect, at the same or a finer resolution (an earlier stage's output)."""
    h, w = sam.embedding_size
    scale = max(1, round(math.sqrt(tokens.shape[1] / (h * w))))
    return sam.image_encoder.last_stages(tokens, (h * scale, w * scale), stages)


def _tail_params(sam, tail: tuple[str, ...]) -> list:
    return [p for k, p in sam.image_encoder.named_parameters() if k.startswith(tail)] if tail else []


def _optimizer(engine, cfg: SamTuneConfig, tail: tuple[str, ...] = ()):
    """AdamW over the prompt encoder and mask decoder (and the encoder's ``tail`` at
    ``cfg.encoder_lr``; everything else frozen), and a gradient scaler that is active for
    fp16 on CUDA only. Each group's ``base_lr`` is what the schedule scales."""
    sam = engine.sam
    params = list(sam.prompt_encoder.parameters()) + list(sam.mask_decoder.parameters())
    enc = _tail_params(sam, tail)
    for p in sam.parameters():
        p.requires_grad_(False)
    for p in params + enc:
        p.requires_grad_(True)
    groups = [{"params": params, "lr": cfg.lr, "base_lr": cfg.lr}]
    if enc:
        groups.append({"params": enc, "lr": cfg.encoder_lr, "base_lr": cfg.encoder_lr})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    use_scaler = engine.policy.device.type == "cuda" and engine.policy.precision == "fp16"
    return opt, torch.amp.GradScaler("cuda", enabled=use_scaler)


def train_autocast(policy):
    """The precision of a training step: fp32 on a CPU, the policy's elsewhere."""
    if policy.device.type == "cpu" and policy.precision != "fp32":
        policy = dataclasses.replace(policy, precision="fp32")
    return policy.autocast()


def _engine(model, policy, cache_dir):
    """The engine whose decoder is tuned: ``model`` itself when it is a loaded engine."""
    from ..interactive.cache import EmbeddingCache
    from ..loader import load_engine

    if hasattr(model, "sam") and hasattr(model, "embed"):
        return model
    cache = EmbeddingCache(max_bytes=8 << 30, disk_dir=cache_dir) if cache_dir else EmbeddingCache(8 << 30)
    return load_engine(model, policy=policy, cache=cache)


def _val_pairs(views: Sequence[TrainView], val: list[int], cfg: SamTuneConfig) -> list[tuple[int, int]]:
    """Fixed (view, object) pairs of the held-back views, at most ``cfg.val_objects``."""
    pairs = [(vi, int(o)) for vi in val for o in views[vi].ids]
    if len(pairs) > cfg.val_objects:
        pick = np.random.default_rng(cfg.seed + 1).choice(len(pairs), cfg.val_objects, replace=False)
        pairs = [pairs[k] for k in sorted(pick)]
    return pairs


def objects_per_pass(cfg: SamTuneConfig, device) -> int | None:
    """How many objects go through the decoder together in a training step: the config's
    ``objects_per_pass``, else :data:`CPU_OBJECTS_PER_PASS` on a CPU and all of them on
    other devices (where an out-of-memory halves the objects per step instead)."""
    if cfg.objects_per_pass is not None:
        return int(cfg.objects_per_pass)
    return CPU_OBJECTS_PER_PASS if torch.device(device).type == "cpu" else None


def _step(engine, views, train, k, rng, cfg: SamTuneConfig, opt, scaler, tail: tuple[str, ...] = ()) -> float:
    """One optimiser step on ``cfg.views_per_step`` random views x ``k`` objects; clicks and
    boxes in two episodes, their losses weighted by their share. Returns the loss.

    Each episode's prompts are drawn for all its objects first (:func:`first_prompts`),
    then its objects go through the decoder :func:`objects_per_pass` at a time, each group's
    loss (weighted by its share) back-propagated before the next: the gradients add up to
    those of one pass over all objects, while only one group's activations (about 90 MiB
    per object and decode for SAM's decoder at 256 px, two decodes kept per episode) are
    held at once.

    With an encoder ``tail`` the views hold trunk outputs: the trained stages turn them into
    embeddings with gradients once per step, the decoder's passes back-propagate into a
    detached copy, and its gradient then goes through those stages in one backward pass."""
    sam, device = engine.sam, engine.policy.device
    idx = rng.choice(train, size=min(cfg.views_per_step, len(train)), replace=False)
    emb, owner, gt = sample_objects(views, idx, k, rng, device)
    full = None
    if tail:
        with train_autocast(engine.policy):
            full = trained_stages(sam, emb, cfg.encoder_stages).float()
        emb = full.detach().requires_grad_(True)
    is_box = rng.random(len(gt)) < cfg.box_fraction
    opt.zero_grad(set_to_none=True)
    loss_val = 0.0
    per_pass = objects_per_pass(cfg, device) or len(gt)
    for use_box in (False, True):
        sel = np.nonzero(is_box == use_box)[0]
        if len(sel) == 0:
            continue
        prompts = first_prompts(gt[sel], use_box, rng, cfg)
        for start in range(0, len(sel), per_pass):
            part = sel[start:start + per_pass]
            with train_autocast(engine.policy):
                loss = episode(sam, emb[owner[torch.as_tensor(part, device=device)]], gt[part], use_box, rng,
                               cfg, device, prompts=prompts.take(slice(start, start + per_pass))) * (len(part) / len(gt))
            scaler.scale(loss).backward()
            loss_val += float(loss.detach())
            del loss
    if full is not None:
        full.backward(emb.grad)
    scaler.step(opt)
    scaler.update()
    return loss_val


class _Best:
    """Validation on fixed pairs; keeps the decoder of the best score and counts
    evaluations without improvement (``stale``) for early stopping."""

    def __init__(self, engine, views, pairs, cfg: SamTuneConfig, tail: tuple[str, ...] = ()):
        self.engine, self.views, self.pairs, self.cfg, self.tail = engine, views, pairs, cfg, tail
        self.score, self.step, self.state, self.stale = None, 0, None, 0

    def _embedded(self) -> list:
        """The views as the decoder sees them: with an encoder tail, the held-back views'
        trunk outputs through the current trained stages (the others as they are)."""
        if not self.tail:
            return self.views
        sam, policy = self.engine.sam, self.engine.policy
        out = list(self.views)
        for vi in sorted({vi for vi, _ in self.pairs}):
            tokens = self.views[vi].embedding[None].to(policy.device, torch.float32)
            with policy.autocast():
                emb = trained_stages(sam, tokens, self.cfg.encoder_stages)[0]
            out[vi] = dataclasses.replace(self.views[vi], embedding=emb.to("cpu", torch.float16))
        return out

    def evaluate(self, step: int) -> dict | None:
        if not self.pairs:
            return None
        sam = self.engine.sam
        sam.eval()
        with torch.no_grad():
            views = self._embedded()
            with self.engine.policy.autocast():
                val = evaluate(sam, views, self.pairs, self.cfg, self.engine.policy.device)
        sam.train()
        if self.score is None or val["score"] > self.score:
            self.score, self.step, self.stale = val["score"], step, 0
            keep = ("prompt_encoder.", "mask_decoder.") + tuple(f"image_encoder.{t}" for t in self.tail)
            self.state = copy.deepcopy({n: p.detach().clone() for n, p in sam.state_dict().items()
                                        if n.startswith(keep)})
        else:
            self.stale += 1
        return val

    def restore(self) -> None:
        """Load the best decoder (if any evaluation ran) and freeze the model for inference."""
        sam = self.engine.sam
        if self.state is not None:
            sam.load_state_dict(self.state, strict=False)
        sam.eval()
        for p in sam.parameters():
            p.requires_grad_(False)


def _save(out_path, engine, cfg, history, best_step, best_score, seconds, stopped, n_train, n_val, meta,
          tail: tuple[str, ...] = ()):
    from ....models.sam.decoder_checkpoint import save_decoder
    from ..loader import base_identity

    base, sha = base_identity(engine)
    training = {"config": dataclasses.asdict(cfg), "best_step": best_step, "stopped": stopped,
                "seconds": round(seconds, 1), "train_views": n_train, "val_views": n_val,
                "history": history, **meta}
    metrics = {k: v for k, v in (history[0] if history else {}).items() if k.startswith("val_")}
    best = next((h for h in history if h.get("step") == best_step and "val_score" in h), None)
    click_zoom = float(cfg.click_zoom if cfg.click_zoom is not None else engine.click_zoom)
    return save_decoder(Path(out_path), engine.sam, base, sha, encoder_parts=tail, training=training,
                        click_zoom=click_zoom,
                        metrics={"before": metrics, "best": best or {}, "best_score": best_score})
