"""One interface, two implementations of the PPO hot spots: pure torch and the fused kernels.

The trainer's `kernels: auto | torch | fused` switch is get_backend(mode). Both backends take
the same arguments as the pure-torch references in pfppo_mega.ppo and return the same types,
so they are interchangeable; tests/test_kernels_backends.py runs one conformance test over
every available backend.
"""

from typing import Protocol

import torch

from pfppo_mega import ppo
from pfppo_mega.kernels import ops
from pfppo_mega.ppo.losses import PolicyLossOutput

from pfppo_mega.constants import KERNEL_MODES
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16)


class KernelBackend(Protocol):
    """What the trainer calls for log-probs, the policy loss and advantages."""

    name: str

    def logprob_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V], labels [...] -> (log p(label) [...], entropy [...]), fp32 for bf16."""
        ...

    def policy_loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        clip_ratio_low: float,
        clip_ratio_high: float,
        dual_clip_c: float | None = None,
        loss_agg_mode: str = "token-mean",
        is_weights: torch.Tensor | None = None,
    ) -> PolicyLossOutput:
        """PPO clipped loss over [B, T] (formulas: pfppo_mega.ppo.policy_loss)."""
        ...

    def gae(
        self,
        rewards: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        *,
        gamma: float,
        lam: float,
        whiten: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) [B, T]; whiten: advantages -> masked_whiten(advantages, mask)."""
        ...


class TorchBackend:
    """The pure-torch references (pfppo_mega.ppo)."""

    name = "torch"

    def logprob_entropy(self, logits, labels):
        return ppo.logprobs_from_logits(logits, labels), ppo.entropy_from_logits(logits)

    def policy_loss(self, logp, old_logp, advantages, mask, **options):
        return ppo.policy_loss(logp, old_logp, advantages, mask, **options)

    def gae(self, rewards, values, mask, *, gamma, lam, whiten=False):
        with torch.no_grad():
            advantages, returns = ppo.compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
            if whiten:
                advantages = ppo.masked_whiten(advantages, mask)
        return advantages, returns


def _kernel_dtype(fn: str, *tensors: tuple[str, torch.Tensor]) -> torch.dtype:
    """The dtype torch's type promotion gives these tensors; it must be float32 or bfloat16."""
    dtype = tensors[0][1].dtype
    for _, t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if dtype not in _KERNEL_DTYPES:
        names = ", ".join(f"{name}: {t.dtype}" for name, t in tensors)
        raise TypeError(
            f"FusedBackend.{fn}: the kernels compute float32 or bfloat16 inputs; got {names} "
            f"(promoted: {dtype}). Use `kernels: torch` for other dtypes."
        )
    return dtype


def _as_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool/float32/bfloat16 (other dtypes become mask != 0), contiguous."""
    if mask.dtype not in _MASK_DTYPES:
        mask = mask != 0
    return mask.contiguous()


class FusedBackend:
    """The pfppo:: ops (pfppo_mega._C). Inputs are promoted and made contiguous as the torch
    reference would see them; unsupported dtypes raise a TypeError that names them."""

    name = "fused"

    def __init__(self) -> None:
        ops.require_built()

    def logprob_entropy(self, logits, labels):
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"FusedBackend.logprob_entropy: labels.shape={tuple(labels.shape)} must equal "
                f"logits.shape[:-1]={tuple(logits.shape[:-1])}"
            )
        _kernel_dtype("logprob_entropy", ("logits", logits))
        lead = labels.shape
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V]; a view unless rows are strided
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        logp, entropy = ops.logprob_entropy(flat, labels.reshape(-1).long().contiguous())
        return logp.view(lead), entropy.view(lead)

    def policy_loss(
        self, logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high,
        dual_clip_c=None, loss_agg_mode="token-mean", is_weights=None,
    ):
        named = [("logp", logp), ("old_logp", old_logp), ("advantages", advantages)]
        if is_weights is not None:
            named.append(("is_weights", is_weights))
        dtype = _kernel_dtype("policy_loss", *named)
        cast = [t.to(dtype).contiguous() for _, t in named]
        out = ops.policy_loss(
            cast[0], cast[1].detach(), cast[2].detach(), _as_mask(mask),
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
            dual_clip_c=dual_clip_c, loss_agg_mode=loss_agg_mode,
            is_weights=cast[3].detach() if is_weights is not None else None,
        )
        return PolicyLossOutput(
            loss=out.loss,
            pg_clipfrac=out.pg_clipfrac,
            pg_clipfrac_lower=out.pg_clipfrac_lower,
            approx_kl=out.approx_kl,
            is_weight_mean=out.is_weight_mean,
        )

    def gae(self, rewards, values, mask, *, gamma, lam, whiten=False):
        _kernel_dtype("gae", ("values", values))
        rewards = rewards.to(values.dtype).contiguous()  # the reference computes in values.dtype
        return ops.gae(
            rewards.detach(), values.detach().contiguous(), _as_mask(mask),
            gamma=gamma, lam=lam, whiten=whiten,
        )


def fused_available(device: torch.device | str = "cpu") -> bool:
    """True when the fused kernels are built for this device type."""
    device = torch.device(device)
    return ops.is_built() and (device.type == "cpu" or (device.type == "cuda" and ops.has_cuda()))


def get_backend(mode: str, device: torch.device | str = "cpu") -> KernelBackend:
    """The backend for `kernels: mode`. auto: fused when built for `device`, else torch;
    fused when not built: RuntimeError saying how to build it."""
    if mode == "torch":
        return TorchBackend()
    if mode == "fused":
        return FusedBackend()
    if mode == "auto":
        return FusedBackend() if fused_available(device) else TorchBackend()
    raise ValueError(f"kernels={mode!r} is not one of {KERNEL_MODES}")


def available_backends(device: torch.device | str = "cpu") -> list[KernelBackend]:
    """Every backend that runs on `device` (torch always; fused when built for it)."""
    backends: list[KernelBackend] = [TorchBackend()]
    if fused_available(device):
        backends.append(FusedBackend())
    return backends
