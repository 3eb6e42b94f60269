"""The U-Net training loss: Dice + cross-entropy over background / interior / boundary,
with contact boundaries weighted and unannotated pixels left out."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .train_data import CONTACT, IGNORE

def dice_ce_loss(logits: torch.Tensor, target: torch.Tensor, contact_weight: float = 1.0,
                 eps: float = 1.0, ignore: bool | None = None) -> torch.Tensor:
    """Cross-entropy + (1 - soft Dice averaged over classes), computed in fp32.

    Target pixels equal to ``CONTACT`` count as boundary, with cross-entropy weight
    ``contact_weight`` (the U-Net paper's idea of weighting the gaps between touching cells).
    Pixels equal to ``IGNORE`` (outside an annotated region) add nothing to either term;
    ``ignore``: whether any may be present (None = look, one device sync).
    """
    logits = logits.float()
    contact = target == CONTACT
    target = torch.where(contact, torch.full_like(target, 2), target)
    ignored = target == IGNORE
    if bool(ignored.any()) if ignore is None else ignore:  # outside the annotated region: no loss
        valid = (~ignored).float()
        target = torch.where(ignored, torch.zeros_like(target), target)
        weight = valid * (1.0 + (contact_weight - 1.0) * contact.float())
        ce = (F.cross_entropy(logits, target, reduction="none") * weight).sum() / valid.sum().clamp_min(1.0)
        probs = logits.softmax(1) * valid.unsqueeze(1)
        onehot = F.one_hot(target, logits.shape[1]).movedim(-1, 1).float() * valid.unsqueeze(1)
        return ce + (1 - _soft_dice(probs, onehot, eps))
    if contact_weight != 1.0:
        weight = 1.0 + (contact_weight - 1.0) * contact.float()
        ce = (F.cross_entropy(logits, target, reduction="none") * weight).mean()
    else:
        ce = F.cross_entropy(logits, target)
    probs = logits.softmax(1)
    onehot = F.one_hot(target, logits.shape[1]).movedim(-1, 1).float()
    return ce + (1 - _soft_dice(probs, onehot, eps))


def _soft_dice(probs: torch.Tensor, onehot: torch.Tensor, eps: float) -> torch.Tensor:
    """Soft Dice averaged over classes (batch and spatial axes pooled)."""
    dims = (0,) + tuple(range(2, probs.ndim))
    inter = (probs * onehot).sum(dims)
    denom = probs.sum(dims) + onehot.sum(dims)
    return ((2 * inter + eps) / (denom + eps)).mean()
