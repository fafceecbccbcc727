"""How far a path's logits are from the float32 reference: the numbers the bench's gate compares
(shared by the bench and its worker processes)."""

from __future__ import annotations

import torch


def logit_metrics(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """Distance of ``logits`` (B, S, V) to the float32 reference ``ref``.

    ``kl``: mean over positions of KL(softmax(ref) || softmax(logits)) in nats;
    ``top5_agreement``: mean over positions of |top5(logits) ∩ top5(ref)| / 5.
    """
    a, r = logits.float(), ref.float()
    diff = a - r
    logp_ref = torch.log_softmax(r, dim=-1)
    kl = (logp_ref.exp() * (logp_ref - torch.log_softmax(a, dim=-1))).sum(-1).mean()
    return {
        "max_abs_err": diff.abs().max().item(),
        "rel_l2_err": (diff.norm() / r.norm()).item(),
        "kl": max(kl.item(), 0.0),
        "top5_agreement": top5_hits(a.topk(5, dim=-1).indices, r).float().mean().item(),
    }


def top5_hits(top5: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """(B, S, 5) bool: is the reference's k-th most likely token among the path's top 5 (``top5``:
    the path's top-5 token indices, (B, S, 5))."""
    top_r = ref.topk(5, dim=-1).indices
    return (top_r.unsqueeze(-1) == top5.unsqueeze(-2)).any(-1)
