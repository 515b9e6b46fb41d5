"""One interface, two implementations of the PPO hot spots: pure torch and the fused kernels.

The trainer's `kernels: auto | torch | fused` switch is get_backend(mode). Both backends take
the same arguments as the pure-torch references in pfppo_mega.ppo and return the same types,
so they are interchangeable; tests/test_kernels_backends.py runs one conformance test over
every available backend.
"""

import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Protocol

import torch

from pfppo_mega import ppo
from pfppo_mega.constants import KERNEL_MODES
from pfppo_mega.kernels import ops, shard_math
from pfppo_mega.kernels.shard_math import LogProbCombined, LogProbPartials
from pfppo_mega.ppo.losses import PolicyLossOutput

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_MASK_DTYPES = (torch.bool, torch.float32, torch.bfloat16)


class KernelBackend(Protocol):
    """What the trainer calls for log-probs, the policy loss and advantages."""

    name: str

    def logprob_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
        vocab_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V], labels [...] -> (log p(label) [...], entropy [...]) of
        softmax(logits[..., :vocab_size] / temperature), fp32 for bf16. Columns >= vocab_size
        (None: V) are vocabulary padding: they get no probability and a zero gradient."""
        ...

    def logprob_entropy_partials(
        self, logits_shard: torch.Tensor, labels: torch.Tensor, *, vocab_start: int,
        vocab_size: int | None, temperature: float,
    ) -> LogProbPartials:
        """The four [N] partials of one vocab shard [N, Vs] (pfppo_mega.kernels.shard_math)."""
        ...

    def logprob_entropy_shard_backward(
        self, logits_shard: torch.Tensor, labels: torch.Tensor, *, vocab_start: int,
        vocab_size: int | None, temperature: float, combined: LogProbCombined,
        grad_logp: torch.Tensor, grad_entropy: torch.Tensor,
    ) -> torch.Tensor:
        """d loss / d logits_shard [N, Vs] (logits_shard.dtype, 0 on padding columns)."""
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
        loss_scale_factor: float | None = None,
    ) -> PolicyLossOutput:
        """PPO clipped loss over [B, T] (formulas: pfppo_mega.ppo.policy_loss); loss_scale_factor:
        the constant of seq-mean-token-sum-norm (None = T, as ppo.agg_loss)."""
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


def _check_logprob_args(fn: str, logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                        vocab_size: int | None) -> None:
    """The contract both backends enforce, with the expected shape spelled out."""
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{fn}: logits must have shape [..., V] with V >= 1 (a vocabulary); "
                         f"got {tuple(logits.shape)}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"{fn}: labels.shape={tuple(labels.shape)} must equal "
                         f"logits.shape[:-1]={tuple(logits.shape[:-1])}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"{fn}: labels must be an integer tensor; got {labels.dtype}")
    if not 0.0 < temperature < float("inf"):
        raise ValueError(f"{fn}: temperature={temperature} must be a finite number > 0")
    if vocab_size is not None and not 1 <= vocab_size <= logits.shape[-1]:
        raise ValueError(f"{fn}: vocab_size={vocab_size} must be in [1, V] = [1, {logits.shape[-1]}] "
                         f"(columns >= vocab_size are padding)")


def _check_bt(fn: str, **tensors: torch.Tensor) -> None:
    """Every tensor [B, T] like the first."""
    (first, ref), *rest = tensors.items()
    if ref.dim() != 2:
        raise ValueError(f"{fn}: {first} must have shape [B, T] (2-D); got {tuple(ref.shape)}")
    for name, t in rest:
        if t is not None and t.shape != ref.shape:
            raise ValueError(f"{fn}: {name} must have shape [B, T] = {list(ref.shape)} like {first}; "
                             f"got {list(t.shape)}")


class TorchBackend:
    """The pure-torch references (pfppo_mega.ppo, pfppo_mega.kernels.shard_math)."""

    name = "torch"

    def logprob_entropy(self, logits, labels, *, temperature=1.0, vocab_size=None):
        _check_logprob_args("TorchBackend.logprob_entropy", logits, labels, temperature, vocab_size)
        shard_math.check_labels("TorchBackend.logprob_entropy", labels,
                                vocab_size if vocab_size is not None else logits.shape[-1],
                                "vocab_size" if vocab_size is not None else "V")
        if vocab_size is not None and vocab_size < logits.shape[-1]:
            logits = logits[..., :vocab_size]  # padding dropped: no probability, zero gradient
        if temperature != 1.0:
            # In fp32 at least, like the kernels and the vocab-parallel path: a bf16 logits / T
            # would round the tempered logits to bf16 (up to 0.06 in log p at V = 76k).
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        return ppo.logprobs_from_logits(logits, labels), ppo.entropy_from_logits(logits)

    def logprob_entropy_partials(self, logits_shard, labels, *, vocab_start, vocab_size, temperature):
        if vocab_size is not None:
            shard_math.check_labels("TorchBackend.logprob_entropy_partials", labels, vocab_size,
                                    "vocab_size")
        return shard_math.partials(logits_shard, labels, vocab_start=vocab_start,
                                   vocab_size=vocab_size, temperature=temperature)

    def logprob_entropy_shard_backward(self, logits_shard, labels, *, vocab_start, vocab_size,
                                       temperature, combined, grad_logp, grad_entropy):
        return shard_math.shard_grad(logits_shard, labels, vocab_start=vocab_start,
                                     vocab_size=vocab_size, temperature=temperature,
                                     combined=combined, grad_logp=grad_logp,
                                     grad_entropy=grad_entropy)

    def policy_loss(self, logp, old_logp, advantages, mask, **options):
        _check_bt("TorchBackend.policy_loss", logp=logp, old_logp=old_logp, advantages=advantages,
                  mask=mask, is_weights=options.get("is_weights"))
        return ppo.policy_loss(logp, old_logp, advantages, mask, **options)

    def gae(self, rewards, values, mask, *, gamma, lam, whiten=False):
        _check_bt("TorchBackend.gae", values=values, rewards=rewards, mask=mask)
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


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] as the kernels read it: unit stride along V, rows that do not overlap (a
    stride-0 expanded tensor is copied); a view when it already is."""
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[-1]):
        return x.contiguous()
    return x


def _labels(labels: torch.Tensor) -> torch.Tensor:
    return labels.long().contiguous()


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

    def logprob_entropy(self, logits, labels, *, temperature=1.0, vocab_size=None):
        _check_logprob_args("FusedBackend.logprob_entropy", logits, labels, temperature, vocab_size)
        _kernel_dtype("logprob_entropy", ("logits", logits))
        lead = labels.shape
        flat = _rows(logits.reshape(-1, logits.shape[-1]))  # [N, V]; a view unless rows are strided
        logp, entropy = ops.logprob_entropy(flat, _labels(labels.reshape(-1)),
                                            temperature=temperature, vocab_size=vocab_size)
        return logp.view(lead), entropy.view(lead)

    def logprob_entropy_partials(self, logits_shard, labels, *, vocab_start, vocab_size, temperature):
        _kernel_dtype("logprob_entropy_partials", ("logits_shard", logits_shard))
        return ops.logprob_entropy_partials(_rows(logits_shard), _labels(labels), vocab_start,
                                            temperature=temperature, vocab_size=vocab_size)

    def logprob_entropy_shard_backward(self, logits_shard, labels, *, vocab_start, vocab_size,
                                       temperature, combined, grad_logp, grad_entropy):
        return ops.logprob_entropy_shard_backward(
            _rows(logits_shard), _labels(labels), vocab_start, combined,
            grad_logp.float().contiguous(), grad_entropy.float().contiguous(),
            temperature=temperature, vocab_size=vocab_size,
        )

    def policy_loss(
        self, logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high,
        dual_clip_c=None, loss_agg_mode="token-mean", is_weights=None, loss_scale_factor=None,
    ):
        _check_bt("FusedBackend.policy_loss", logp=logp, old_logp=old_logp, advantages=advantages,
                  mask=mask, is_weights=is_weights)
        named = [("logp", logp), ("old_logp", old_logp), ("advantages", advantages)]
        if is_weights is not None:
            named.append(("is_weights", is_weights))
        dtype = _kernel_dtype("policy_loss", *named)
        cast = [t.to(dtype).contiguous() for _, t in named]
        kernel_mode, norm_scale = loss_agg_mode, 1.0
        if loss_agg_mode == "seq-mean-token-sum-norm":
            # verl 0.9.1's Dr.GRPO: sum / (rows with >= 1 token) / C = the kernel's seq-mean-token-sum
            # over the constant C (no host sync)
            c = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
            if not c > 0:
                raise ValueError(f"FusedBackend.policy_loss: loss_scale_factor={loss_scale_factor} must be > 0")
            kernel_mode = "seq-mean-token-sum"
            norm_scale = 1.0 / c
        out = ops.policy_loss(
            cast[0], cast[1].detach(), cast[2].detach(), _as_mask(mask),
            clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
            dual_clip_c=dual_clip_c, loss_agg_mode=kernel_mode,
            is_weights=cast[3].detach() if is_weights is not None else None,
        )
        return PolicyLossOutput(
            loss=out.loss * norm_scale,
            pg_clipfrac=out.pg_clipfrac,
            pg_clipfrac_lower=out.pg_clipfrac_lower,
            approx_kl=out.approx_kl,
            is_weight_mean=out.is_weight_mean,
        )

    def gae(self, rewards, values, mask, *, gamma, lam, whiten=False):
        _check_bt("FusedBackend.gae", values=values, rewards=rewards, mask=mask)
        _kernel_dtype("gae", ("values", values))
        # a multi-turn mask with gaps is compacted inside ops.gae (the kernels scan prefix masks)
        rewards = rewards.to(values.dtype).contiguous()  # the reference computes in values.dtype
        return ops.gae(
            rewards.detach(), values.detach().contiguous(), _as_mask(mask),
            gamma=gamma, lam=lam, whiten=whiten,
        )


def fused_available(device: torch.device | str = "cpu") -> bool:
    """True when the fused kernels are built for this device type."""
    device = torch.device(device)
    return ops.is_built() and (device.type == "cpu" or (device.type == "cuda" and ops.has_cuda()))


# ----------------------------------------------------------------------------- GPU verification
# `kernels: auto` on a GPU uses the fused CUDA kernels only on a machine kind where the GPU check
# (scripts/gpu_kernels_check.sh: build, kernel tests vs torch and fp64) has passed and written a
# marker for the device name; without one, auto means torch there (said once). `fused` by name is
# always honoured.

MARKER_DIR_ENV = "PFPPO_KERNELS_VERIFIED_DIR"
_REPO = Path(__file__).resolve().parents[2]
_SAID: set[str] = set()


def device_kind(device: torch.device) -> str:
    """The machine kind a marker is for: the GPU's name (e.g. "NVIDIA H200")."""
    return torch.cuda.get_device_name(device)


def marker_dir() -> Path:
    """Where markers live: $PFPPO_KERNELS_VERIFIED_DIR, else build/kernels_verified of the checkout."""
    return Path(os.environ.get(MARKER_DIR_ENV) or _REPO / "build" / "kernels_verified")


def marker_path(kind: str) -> Path:
    return marker_dir() / (re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") + ".json")


def write_marker(device: torch.device | str = "cuda") -> Path:
    """Record that the fused kernels passed the GPU check on this device kind (the check calls it)."""
    device = torch.device(device)
    kind = device_kind(device)
    path = marker_path(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": kind, "torch": torch.__version__, "cuda": torch.version.cuda}) + "\n")
    return path


def fused_verified(device: torch.device | str) -> bool:
    """True when the GPU check has verified the fused kernels on this device's kind (CPU: always,
    the CPU kernels are tested by the test suite on every machine)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type == "cpu"
    return marker_path(device_kind(device)).is_file()


def _say_once(key: str, msg: str, log: Callable[[str], None] | None) -> None:
    if key not in _SAID:
        _SAID.add(key)
        (log or (lambda m: print(m, file=sys.stderr)))(msg)


def get_backend(mode: str, device: torch.device | str | None = None, *,
                log: Callable[[str], None] | None = None) -> KernelBackend:
    """The backend for `kernels: mode` on ``device`` (None: cuda when visible, else cpu).
    auto: fused when built for the device and, on a GPU, verified there by the GPU check (a
    marker for the device kind, ``marker_path``); else torch, said once through ``log``.
    fused: always (RuntimeError saying how to build it when not built)."""
    if mode == "torch":
        return TorchBackend()
    if mode == "fused":
        return FusedBackend()
    if mode != "auto":
        raise ValueError(f"kernels={mode!r} is not one of {KERNEL_MODES}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if not fused_available(device):
        return TorchBackend()
    if fused_verified(device):
        return FusedBackend()
    kind = device_kind(device)
    _say_once(kind, f"kernels: auto -> torch on {kind}: the fused CUDA kernels are not verified on this machine "
                    f"kind (no {marker_path(kind)}; scripts/gpu_kernels_check.sh writes it when the kernel tests "
                    f"pass). `kernels: fused` uses them anyway.", log)
    return TorchBackend()


def available_backends(device: torch.device | str = "cpu") -> list[KernelBackend]:
    """Every backend that runs on `device` (torch always; fused when built for it)."""
    backends: list[KernelBackend] = [TorchBackend()]
    if fused_available(device):
        backends.append(FusedBackend())
    return backends
