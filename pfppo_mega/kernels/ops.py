"""The pfppo:: torch ops (pfppo_mega._C): fake shapes, autograd, and typed Python wrappers.

Each op is one header (csrc/<op>.h: its table of modes, arguments, device-neutral math and, for
the host, its schema, input checks and one wrapper for both devices), one kernel per device
(csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu), the registrations below (fake implementation for
meta/FakeTensor tracing, autograd), and the pure-torch reference that the tests compare against.
The tables of modes come from the extension (pfppo_mega._C.*_modes), never written here again.

The ops are strict (2-D, contiguous, float32/bfloat16, int64 labels) and name the argument and
its expected shape when given anything else; pfppo_mega.kernels.FusedBackend adapts general
inputs ([..., V] logits, mixed dtypes) before calling them.
"""

from dataclasses import dataclass

import torch

from pfppo_mega.kernels.shard_math import (  # noqa: F401  (re-exported: the combine math)
    LogProbCombined,
    LogProbPartials,
    combine_partials,
    finish_partials,
    rescale_partials,
)
from pfppo_mega.ppo.advantages import has_gaps

try:
    from pfppo_mega import _C
except ImportError as err:  # not built: the torch backend still works
    _C = None
    _IMPORT_ERROR: ImportError | None = err
else:
    _IMPORT_ERROR = None

BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` (or `python build_ext.py` for an "
    "in-place build) in the repository root, or select `kernels: torch`"
)


def is_built() -> bool:
    """True when pfppo_mega._C imports (the pfppo:: ops exist)."""
    return _C is not None


def has_cuda() -> bool:
    """True when pfppo_mega._C was built with its CUDA kernels."""
    return _C is not None and bool(_C.has_cuda)


def require_built() -> None:
    """Raise a RuntimeError that says how to build the extension when it is missing."""
    if _C is None:
        raise RuntimeError(f"pfppo_mega._C is not importable ({_IMPORT_ERROR}); {BUILD_HINT}")


def require_device(t: torch.Tensor, name: str) -> None:
    """Raise when the extension has no kernels for the device of t."""
    require_built()
    if t.device.type == "cuda" and not has_cuda():
        raise RuntimeError(
            f"pfppo_mega._C was built without CUDA kernels but {name} is on {t.device}; "
            "rebuild on a machine with a CUDA build of torch and nvcc (PFPPO_BUILD_CUDA=1)"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"pfppo:: ops run on cpu or cuda; {name} is on {t.device}")


# ---------------------------------------------------------------------------------------------
# Fake implementations (shapes only) and autograd.


def _check(cond: bool, msg: str) -> None:
    torch._check(cond, lambda: msg)


def _fake_logprob_rows(op: str):
    """The fake of a forward of the log-prob table (every mode: four [N] float32 outputs)."""

    def fake(logits, labels, *_options):
        _check(logits.dim() == 2, f"pfppo::{op}: logits must be [N, V]")
        _check(labels.shape == logits.shape[:1], f"pfppo::{op}: labels must be [N]")
        n = logits.shape[0]
        return tuple(logits.new_empty(n, dtype=torch.float32) for _ in range(4))

    return fake


def _fake_logprob_entropy_backward(
    grad_logp, grad_entropy, logits, labels, row_max, log_sumexp, entropy, vocab_start,
    temperature=1.0, vocab_size=-1,
):
    _check(logits.dim() == 2, "pfppo::logprob_entropy_backward: logits must be [N, V]")
    return logits.new_empty(logits.shape)


def _fake_policy_loss(logp, old_logp, advantages, mask, *_options):
    _check(logp.dim() == 2, "pfppo::policy_loss: logp must be [B, T]")
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        _check(t.shape == logp.shape, f"pfppo::policy_loss: {name} must be shaped like logp [B, T]")
    scalars = tuple(logp.new_empty(()) for _ in range(5))
    return scalars + (torch.empty_like(logp, memory_format=torch.contiguous_format),)


def _fake_gae(rewards, values, mask, gamma, lam, whiten=False, shift_mean=True, row_chunks=0):
    _check(values.dim() == 2, "pfppo::gae: values must be [B, T]")
    for name, t in (("rewards", rewards), ("mask", mask)):
        _check(t.shape == values.shape, f"pfppo::gae: {name} must have the shape of values [B, T]")
    out = torch.empty_like(values, memory_format=torch.contiguous_format)
    return out, torch.empty_like(out)


def _logprob_entropy_setup(ctx, inputs, output):
    logits, labels, *options = inputs  # options: temperature, vocab_size (schema defaults)
    _logp, entropy, row_max, log_sumexp = output
    ctx.mark_non_differentiable(row_max, log_sumexp)  # auxiliary outputs, saved for backward
    ctx.save_for_backward(logits, labels, row_max, log_sumexp, entropy)
    ctx.temperature = options[0] if len(options) > 0 else 1.0
    ctx.vocab_size = options[1] if len(options) > 1 else -1


def _logprob_entropy_backward(ctx, grad_logp, grad_entropy, _grad_max, _grad_log_sumexp):
    logits, labels, row_max, log_sumexp, entropy = ctx.saved_tensors
    grad = torch.ops.pfppo.logprob_entropy_backward(
        grad_logp.float().contiguous(), grad_entropy.float().contiguous(), logits, labels,
        row_max, log_sumexp, entropy, 0, ctx.temperature, ctx.vocab_size,
    )
    return grad, None, None, None


def _not_differentiable(op: str, hint: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"pfppo::{op} is not differentiable; {hint}")

    return backward


def _policy_loss_setup(ctx, inputs, output):
    *_stats, grad_logp = output
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(grad_logp)


def _policy_loss_backward(ctx, grad_loss, *_unused):
    # The forward pass already wrote d loss / d logp; backward scales it by the incoming
    # gradient, skipping the pass when that is exactly 1 (loss.backward()). The check reads
    # one scalar (a device sync on CUDA); traced graphs always multiply.
    (grad_logp,) = ctx.saved_tensors
    if not torch.compiler.is_compiling() and bool(grad_loss == 1):
        grad = grad_logp
    else:
        grad = grad_logp * grad_loss.to(grad_logp.dtype)
    return (grad,) + (None,) * (3 + len(POLICY_LOSS_OPTIONS))


# The autograd of each forward of the log-prob table (csrc/logprob_entropy.h): the full
# vocabulary's backward, or none for a shard's partials (vocab_parallel has its own Function).
# tests/test_kernels.py checks that these keys are exactly the extension's LOGPROB_MODES.
_LOGPROB_AUTOGRAD = {  # op: (backward, setup_context)
    "logprob_entropy": (_logprob_entropy_backward, _logprob_entropy_setup),
    "logprob_entropy_partials": (
        _not_differentiable(
            "logprob_entropy_partials",
            "use vocab_parallel_logprob_entropy or logprob_entropy_shard_backward",
        ),
        None,
    ),
}


def _register() -> None:
    for op in LOGPROB_MODES:  # a row Python does not know has no fake and fails the table test
        if op in _LOGPROB_AUTOGRAD:
            torch.library.register_fake(f"pfppo::{op}", _fake_logprob_rows(op))
            backward, setup = _LOGPROB_AUTOGRAD[op]
            torch.library.register_autograd(f"pfppo::{op}", backward, setup_context=setup)
    torch.library.register_fake("pfppo::logprob_entropy_backward", _fake_logprob_entropy_backward)
    torch.library.register_fake("pfppo::policy_loss", _fake_policy_loss)
    torch.library.register_fake("pfppo::gae", _fake_gae)
    torch.library.register_autograd(
        "pfppo::policy_loss", _policy_loss_backward, setup_context=_policy_loss_setup
    )
    # Without these, backprop through the ops would silently give no gradient.
    torch.library.register_autograd(
        "pfppo::gae",
        _not_differentiable("gae", "GAE targets are constants: pass detached rewards and values"),
    )
    torch.library.register_autograd(
        "pfppo::logprob_entropy_backward",
        _not_differentiable("logprob_entropy_backward", "double backward is not implemented"),
    )


def _schema_options(op: str, tensors: int) -> tuple[str, ...]:
    """The keyword arguments of pfppo::op after its first `tensors` inputs, read from the C++
    schema (the one place they are written)."""
    if _C is None:
        return ()
    return tuple(a.name for a in getattr(torch.ops.pfppo, op).default._schema.arguments[tensors:])


# Each fused op's table of modes as the extension declares it (csrc/<op>.h, exported by
# csrc/module.cpp), and the policy loss's keywords as its schema declares them.
# pfppo_mega.constants.KERNEL_LOSS_AGG_MODES mirrors the loss modes for the config layer;
# tests/test_kernels.py checks every table against Python, the CPU and the CUDA sources.
POLICY_LOSS_AGG_MODES: tuple[str, ...] = tuple(getattr(_C, "policy_loss_agg_modes", ()))
POLICY_LOSS_OPTIONS: tuple[str, ...] = _schema_options("policy_loss", 4)
GAE_WHITEN_MODES: tuple[str, ...] = tuple(getattr(_C, "gae_whiten_modes", ()))
LOGPROB_MODES: tuple[str, ...] = tuple(getattr(_C, "logprob_modes", ()))

# The reference's (whiten, shift_mean) of each row of the GAE table (pfppo_mega.ppo.masked_whiten);
# tests/test_kernels.py runs every row of the extension's table through it against the kernel.
GAE_WHITEN_FLAGS: dict[str, tuple[bool, bool]] = {
    "none": (False, True),
    "whiten": (True, True),
    "whiten-keep-mean": (True, False),
}

if _C is not None:
    _register()


# ---------------------------------------------------------------------------------------------
# Wrappers.


def _vocab_size_arg(vocab_size: int | None) -> int:
    return -1 if vocab_size is None else vocab_size


def logprob_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / T)[label] and the softmax entropy per row, in one pass over logits.

        y = x / T,  lse = logsumexp_v y_v,  logp = y_label - lse,  H = -sum_v p_v log p_v

    logits [N, V] float32/bfloat16 (unit stride along V), labels [N] int64 in [0, vocab_size);
    columns >= vocab_size (None: V) are padding and count as -inf (gradient 0).
    -> logp [N], entropy [N], both float32. Differentiable w.r.t. logits (grad in logits.dtype).
    """
    require_device(logits, "logits")
    logp, entropy, _max, _log_sumexp = torch.ops.pfppo.logprob_entropy(
        logits, labels, temperature, _vocab_size_arg(vocab_size)
    )
    return logp, entropy


def logprob_entropy_partials(
    logits_shard: torch.Tensor, labels: torch.Tensor, vocab_start: int, *,
    temperature: float = 1.0, vocab_size: int | None = None,
) -> LogProbPartials:
    """Partials (pfppo_mega.kernels.shard_math) of logits_shard [N, V_shard] / T whose column 0
    is vocab entry vocab_start; global columns >= vocab_size are padding.

    labels [N] int64 are global vocab indices. Not differentiable: the vocab-parallel backward
    is logprob_entropy_shard_backward, given the combined lse and entropy.
    """
    require_device(logits_shard, "logits_shard")
    out = torch.ops.pfppo.logprob_entropy_partials(
        logits_shard, labels, vocab_start, temperature, _vocab_size_arg(vocab_size)
    )
    return LogProbPartials(*out)


def logprob_entropy_shard_backward(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    combined: LogProbCombined,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """d(loss)/d logits_shard [N, V_shard] from the combined statistics and the output grads
    (all [N] float32):  (g [v == label] - p_v (g + h (log p_v + H))) / T,
    log p_v = (y_v - max) - log_sumexp; 0 on padding columns."""
    require_device(logits_shard, "logits_shard")
    return torch.ops.pfppo.logprob_entropy_backward(
        grad_logp, grad_entropy, logits_shard, labels, combined.max, combined.log_sumexp,
        combined.entropy, vocab_start, temperature, _vocab_size_arg(vocab_size),
    )


@dataclass
class FusedPolicyLoss:
    """The op's outputs: the five PolicyLossOutput scalars plus d loss / d logp [B, T]."""

    loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    pg_clipfrac_lower: torch.Tensor
    approx_kl: torch.Tensor
    is_weight_mean: torch.Tensor
    grad_logp: torch.Tensor


def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    **options,
) -> FusedPolicyLoss:
    """PPO clipped loss (formulas: pfppo_mega.ppo.policy_loss), forward and d loss / d logp in
    one pass. logp, old_logp, advantages, is_weights: [B, T], one dtype (float32/bfloat16);
    mask [B, T] bool/float32/bfloat16. options: the schema's keywords (POLICY_LOSS_OPTIONS:
    is_weights=None, clip_ratio_low, clip_ratio_high, dual_clip_c=None,
    loss_agg_mode="token-mean", one of POLICY_LOSS_AGG_MODES). loss is differentiable w.r.t.
    logp only (like the reference, which detaches the rest); the other scalars are metrics."""
    require_device(logp, "logp")
    unknown = sorted(set(options) - set(POLICY_LOSS_OPTIONS))
    if unknown:
        raise TypeError(f"policy_loss: unknown keyword(s) {unknown}; the op takes {POLICY_LOSS_OPTIONS}")
    options = {"is_weights": None, "dual_clip_c": None, "loss_agg_mode": "token-mean", **options}
    missing = [k for k in POLICY_LOSS_OPTIONS if k not in options]
    if missing:
        raise TypeError(f"policy_loss: missing keyword(s) {missing}")
    return FusedPolicyLoss(*torch.ops.pfppo.policy_loss(logp, old_logp, advantages, mask, **options))


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = False,
    shift_mean: bool = True,
    row_chunks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns (formulas: pfppo_mega.ppo.compute_gae) of [B, T] inputs.

    whiten: advantages -> masked_whiten(advantages, mask, shift_mean) (returns unchanged).
    row_chunks: pieces per row of the chunked scan (0 = automatic; > 1 forces it, for tests).
    Not differentiable (backward raises).

    The kernels scan right-padded (prefix) masks. A mask with gaps (a multi-turn response: tool and
    user tokens, mask 0, between the policy's turns) means GAE over the real tokens alone, the gaps
    skipped (compute_gae): that is GAE over each row's real tokens moved to its front, so such a
    mask is compacted (a stable sort per row), scanned, and the outputs put back (0 in the gaps).
    Checking for gaps is one host sync.
    """
    require_device(values, "values")
    if mask.device.type != "meta" and mask.dim() == 2 and bool(has_gaps(mask)):
        order = torch.sort((~mask.bool()).to(torch.uint8), dim=1, stable=True).indices     # [B, T] real first
        adv, ret = torch.ops.pfppo.gae(rewards.gather(1, order).contiguous(), values.gather(1, order).contiguous(),
                                       mask.gather(1, order).contiguous(), gamma, lam, whiten, shift_mean, row_chunks)
        return torch.empty_like(adv).scatter_(1, order, adv), torch.empty_like(ret).scatter_(1, order, ret)
    return torch.ops.pfppo.gae(rewards, values, mask, gamma, lam, whiten, shift_mean, row_chunks)

