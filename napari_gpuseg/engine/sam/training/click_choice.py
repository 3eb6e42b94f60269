"""Which candidate mask an object's first click keeps, chosen by measuring it.

A first click asks the decoder for all its candidates (a tuned decoder's single-mask output
and SAM's three) and, by SAM's rule, keeps the one its IoU head rates highest. The head can
rate the wrong one highest on a kind of object: on whole cells in transmitted light the
shipped decoder's head always chose its single-mask output, which covered the nucleus or
half the cell, while its first multimask output covered the cell (one click on the training
cells 0.51 with the head's choice, 0.59 with that output). :func:`choose_click_output`
clicks every labelled object once (its most interior pixel, through
:func:`~.click_eval.click_ious`, as the annotator clicks) with each rule -- the head's
choice, then each candidate in turn -- and returns the rule with the highest mean IoU. The
decoder file stores it (``click_output``: ``scripts/calibrate_iou_head.py --choose-output``
for a shipped decoder, :func:`~.adapt.adapt_to_objects` on the user's annotated objects),
and :attr:`SamEngine.click_output` applies it. The masks do not change; which one a first
click keeps does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from ....models.sam.decoder_checkpoint import set_decoder_fields
from ...runtime.cancel import Cancelled
from .click_eval import click_ious
from .tune_config import first_outputs


@dataclass
class ClickChoice:
    """``output``: the rule chosen (None: the IoU head's choice; k: candidate k). ``ious``:
    mean one-click IoU per rule (key ``"head"`` or the candidate index as a string), over
    ``objects`` objects. ``per_field``: each field's one-click IoUs per rule (same keys;
    arrays, one value per object)."""

    output: int | None
    ious: dict = field(default_factory=dict)
    objects: int = 0
    per_field: list = field(default_factory=list)

    def record(self) -> dict:
        """What a decoder file keeps of it (plain types)."""
        return {"output": self.output, "objects": self.objects,
                "one_click_iou": {k: round(float(v), 4) for k, v in self.ious.items()}}


def candidate_count(engine) -> int:
    """How many candidates a first click decodes (4 for a decoder tuned here, else SAM's 3)."""
    return 4 if engine.candidates == "all" else 3


def choose_click_output(engine, fields: Iterable[tuple], margin: float = 0.01, cancel=None) -> ClickChoice:
    """Measure one click per object of each ``(image, labels, max_objects)`` in ``fields``
    (``max_objects`` None: every object; else that many drawn with seed 0) with the IoU head's
    choice and with each candidate kept instead; the candidate whose mean IoU beats the
    head's by more than ``margin`` (the best of those), else None. ``engine.click_output`` is
    left as it was."""
    fields = list(fields)
    rules: list[int | None] = [None, *range(candidate_count(engine))]
    per_field: list[dict] = []
    before = engine.click_output
    try:
        # the rules differ in which candidate is kept, not in what the decoder computes: each
        # object's clicks are decoded once, for the first rule, and kept for the others
        with engine.reuse_decodes():
            for image, labels, cap in fields:
                row = {}
                for rule in rules:
                    engine.click_output = rule
                    # a cap: only the views the clicks use are embedded (lazily), not the whole image
                    res = click_ious(engine, image, labels, clicks=1, max_objects=cap, box=False, cancel=cancel)
                    row[_key(rule)] = res["clicks"][:, 0]
                per_field.append(row)
    finally:
        engine.click_output = before
    n = int(sum(len(row["head"]) for row in per_field))
    means = {_key(r): float(np.concatenate([row[_key(r)] for row in per_field]).mean()) if n else float("nan")
             for r in rules}
    best = max(rules[1:], key=lambda r: means[_key(r)])
    chosen = best if n and means[_key(best)] > means["head"] + margin else None
    return ClickChoice(chosen, means, n, per_field)


BLENDS = (5.0, 10.0, 20.0)
"""The temperatures :func:`choose_click_blend` measures (softmax(t x predicted IoU) weights)."""


def choose_click_blend(engine, fields: Iterable[tuple], blends=BLENDS, margin: float = 0.01,
                       cancel=None) -> tuple[float | None, dict, dict]:
    """Measure one click per object of each ``(image, labels, max_objects)`` in ``fields``
    with one candidate kept (the IoU head's choice) and with the candidates of both views
    blended at each temperature of ``blends`` (:attr:`SamEngine.click_blend`). Returns (the
    temperature whose mean IoU beats keeping one by more than ``margin``, the best of those,
    else None; mean IoU per rule, None for one kept; per rule, each field's IoUs). The
    engine must keep the head's choice (``click_output`` None); its ``click_blend`` is left
    as it was."""
    if engine.click_output is not None:
        raise ValueError("a blend applies to the IoU head's choice only (click_output is set)")
    means, per_rule = _first_clicks_by_setting(engine, fields, "click_blend", (None, *blends), cancel)
    best = max(blends, key=lambda b: means[b])
    return (best if means[best] > means[None] + margin else None), means, per_rule


def _first_clicks_by_setting(engine, fields: Iterable[tuple], name: str, values, cancel=None) -> tuple[dict, dict]:
    """One click per object of each ``(image, labels, max_objects)`` in ``fields`` with the
    engine's attribute ``name`` set to each of ``values`` in turn (a setting that changes what
    is made of the decoder's outputs, not the outputs: each click is decoded once). Returns
    (mean IoU per value; per value, each field's IoUs); the attribute is left as it was."""
    fields = list(fields)
    per_rule: dict = {}
    before = getattr(engine, name)
    try:
        with engine.reuse_decodes():
            for value in values:
                setattr(engine, name, value)
                per_rule[value] = [click_ious(engine, im, lab, clicks=1, max_objects=cap, box=False,
                                              cancel=cancel)["clicks"][:, 0] for im, lab, cap in fields]
    finally:
        setattr(engine, name, before)
    means = {r: float(np.concatenate(v).mean()) if any(len(x) for x in v) else float("nan")
             for r, v in per_rule.items()}
    return means, per_rule


THRESHOLDS = (-3.0, -2.0, -1.0, 1.0)
"""The logits besides 0 :func:`choose_click_threshold` cuts a first click's mask at."""


def choose_click_threshold(engine, fields: Iterable[tuple], thresholds=THRESHOLDS, margin: float = 0.005,
                           cancel=None) -> tuple[float | None, dict, dict]:
    """Measure one click per object of each ``(image, labels, max_objects)`` in ``fields``
    with the first click's mask cut at logit 0 (SAM's rule) and at each of ``thresholds``
    (:attr:`SamEngine.click_threshold`), with the engine's first-click rule as it is
    (``click_output`` / ``click_blend``). Returns (the threshold whose mean IoU beats 0 by
    more than ``margin``, the best of those, else None; mean IoU per threshold; per
    threshold, each field's IoUs). The engine's ``click_threshold`` is left as it was."""
    means, per_rule = _first_clicks_by_setting(engine, fields, "click_threshold", (0.0, *thresholds), cancel)
    best = max(thresholds, key=lambda t: means[t])
    return (best if means[best] > means[0.0] + margin else None), means, per_rule


def store_click_choice(engine, path, images, labels, cancel=None, per_image: int | None = None) -> ClickChoice | None:
    """After training on ``labels`` (one label image per image, 0 = not annotated): measure
    the choice on every annotated object, or on ``per_image`` objects of each image drawn with
    seed 0 (:func:`choose_click_output`; only the views their clicks need are embedded) and
    store it in the decoder file at ``path`` (``click_output`` and the ``click_choice``
    record), and whether the candidates are better blended (:func:`choose_click_blend`, on the
    same objects): a blend that beats keeping one by more than 0.01, and beats the candidate
    chosen above by as much, is stored instead (``click_blend``, ``click_output`` None; the
    ``click_blend_choice`` record either way). Cancelled by ``cancel`` meanwhile: the file is
    removed (nothing is kept, as when training is cancelled) and None returned."""
    fields = []
    for im, lab in zip(images, labels):
        n = len(np.unique(lab[lab > 0]))
        if n:
            fields.append((im, lab, n if per_image is None else min(n, int(per_image))))
    blend, means = None, None
    before = engine.click_output
    try:
        with engine.reuse_decodes():  # both measurements decode each click once
            choice = choose_click_output(engine, fields, cancel=cancel)
            if fields:
                engine.click_output = None
                best, means, _per = choose_click_blend(engine, fields, cancel=cancel)
                kept = choice.ious["head" if choice.output is None else str(choice.output)]
                if best is not None and means[best] > kept + 0.01:  # beats the rule chosen above too
                    blend, choice.output = best, None
    except Cancelled:
        Path(path).unlink(missing_ok=True)
        return None
    finally:
        engine.click_output = before
    extra = {}
    if means is not None:
        extra["click_blend_choice"] = {"blend": blend, "objects": choice.objects,
                                       "one_click_iou": {_blend_key(r): round(v, 4) for r, v in means.items()}}
    set_decoder_fields(path, click_output=choice.output, click_choice=choice.record(), click_blend=blend, **extra)
    return choice


def _blend_key(blend: float | None) -> str:
    return "one kept" if blend is None else f"blend {blend:g}"


def output_to_train(engine, images, labels, first_candidates: str, cancel=None) -> int | None:
    """The candidate a training first click is aimed at (``SamTuneConfig.first_output``
    "measured"), numbered as a tuned decoder numbers them (0 the single-mask output, 1-3
    SAM's three; the trained decoder is one): the one ``engine`` keeps (its
    ``click_output``), else the one :func:`choose_click_output` measures on every object of
    ``labels``; None where that is the IoU head's choice or a candidate the schedule's first
    clicks do not decode (``first_candidates``). Training that candidate, rather than
    whichever fits best, teaches the mask the annotator will show: Adapt SAM on 15 cells, 1
    click on the cells of the validation frames 0.429 -> 0.453 (``docs/benchmarks.md``)."""
    out = engine.click_output
    if out is None:
        fields = [(im, lab, len(np.unique(lab[lab > 0]))) for im, lab in zip(images, labels)]
        out = choose_click_output(engine, fields, cancel=cancel).output
    if out is not None and engine.candidates != "all":
        out += 1  # a stock decoder offers SAM's three alone: its candidate k is output k + 1
    return out if out in first_outputs(first_candidates) else None


def _key(rule: int | None) -> str:
    return "head" if rule is None else str(rule)
