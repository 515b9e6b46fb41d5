"""Llama-style megatron-core GPTModel: the actor (LM head) and the critic (scalar value head).

Architecture, for every checkpoint this project loads: pre-norm decoder, RMSNorm, SwiGLU MLP
(linear_fc1 = [gate; up], silu(gate) * up, linear_fc2), RoPE (rotate-half, base = rope_theta),
grouped-query attention (num_query_groups key/value heads), LM head tied or untied, no biases.
The decoder is a ``pfppo_mega.families.DecoderShape``: the config's dimensions and what differs
by family, an ``Architecture`` (read from config.json with ``hf_io.architecture_from_hf``): q/k/v
biases (Qwen2; megatron's ``add_qkv_bias``), per-head q/k RMSNorm before RoPE (Qwen3; megatron's
``qk_layernorm``), head_dim (megatron's ``kv_channels``) and RoPE scaling (linear / llama3:
megatron's rotary embedding gets the scaled inverse frequencies of ``families.rope_inv_freq``;
its own ``rope_scaling`` flag fixes low / high_freq_factor and original_max_position_embeddings
at Llama-3.1's 1 / 4 / 8192).
The model records it as ``model.architecture``; the loader refuses a checkpoint of another.

Tensor / pipeline parallelism: the models are built for the layout of megatron's initialised
parallel state (``pfppo_mega.parallel.init_parallel``); ``check_layout`` refuses shapes the layout
cannot split. The vocabulary is padded to a multiple of tp (``reshard.padded_vocab_size``); the
padded logits are masked by the consumers (``pfppo_mega.models.passes``).

Layer spec: megatron's local (pure torch) spec, ``get_gpt_layer_local_spec``, on every machine.
The transformer-engine spec is faster on GPUs but fuses the norms into the linear layers
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), which changes the
parameter names ``pfppo_mega.models.hf_io`` converts; transformer-engine is never imported.

Prerequisite: ``pfppo_mega.parallel.init_parallel`` (megatron layers read its process groups and
RNG tracker, and it enables the CPU compatibility layer).

Training sequence with megatron DDP and optimizer (``wrap_ddp`` and ``build_optimizer`` set it up):

    zero_grads(ddp_model, optimizer)
    loss = loss_fn(actor_logits(ddp_model, input_ids, mask)); loss.backward()   # per micro-batch
    stats = optimizer_step(ddp_model, optimizer)   # finalize_model_grads, clip, AdamW step
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    """Hide megatron's expected notices: "Apex / Transformer Engine not installed, falling back
    to torch" at import, and its DeprecationWarnings about arguments we cannot pass (tp_group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")
        yield


with _quiet_megatron():
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.families import (
    Architecture, DecoderShape, indivisible_dimensions, legacy_architecture, require_dimensions, rope_inv_freq,
)
from pfppo_mega.models import fused_layers, vocab_grads
from pfppo_mega.models.reshard import padded_vocab_size

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- config


def check_layout(model: ModelConfig, *, tp: int, pp: int) -> None:
    """Raise ValueError listing every shape that tensor parallelism tp or pipeline parallelism
    pp cannot split (the vocabulary is padded instead, see reshard.padded_vocab_size)."""
    require_dimensions(model)
    problems = [f"  - {name}({value}) is not divisible by {factor}({size})"
                for name, value, factor, size in indivisible_dimensions(model, tp=tp, pp=pp)]
    if problems:
        raise ValueError(f"the model cannot be split over tp({tp}) x pp({pp}):\n" + "\n".join(problems))


def _layout(tp: Optional[int], pp: Optional[int]) -> tuple[int, int]:
    initialised = parallel_state.model_parallel_is_initialized()
    if tp is None:
        tp = parallel_state.get_tensor_model_parallel_world_size() if initialised else 1
    if pp is None:
        pp = parallel_state.get_pipeline_model_parallel_world_size() if initialised else 1
    return tp, pp


def _architecture(arch: Optional[Architecture], qkv_bias: bool) -> Architecture:
    if not isinstance(qkv_bias, bool) or not isinstance(arch, (Architecture, type(None))):
        raise TypeError(f"qkv_bias must be a bool and arch a families.Architecture or None, got "
                        f"qkv_bias={qkv_bias!r}, arch={arch!r}")
    if arch is None:
        return legacy_architecture(qkv_bias)
    if qkv_bias and not arch.qkv_bias:
        raise ValueError(f"qkv_bias=True contradicts arch={arch}; pass the Architecture alone")
    return arch


@dataclass(frozen=True)
class Features:
    """The training features of the config that change how megatron builds and trains the models
    (besides ``model.params_dtype`` and ``model.layer_spec``, which travel in ModelConfig):
    ``parallel.sequence_parallel``, ``parallel.use_distributed_optimizer``,
    ``parallel.virtual_pipeline_size``, ``training.recompute``, ``training.sparse_vocab_grads`` and
    ``training.fused_layers``. Defaults: everything off but sparse_vocab_grads and fused_layers
    (implementations of the same math; fused_layers takes effect on GPUs and on CPU fp32 models,
    see layer_path)."""

    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute: str = "none"
    virtual_pipeline_size: Optional[int] = None
    sparse_vocab_grads: bool = True
    fused_layers: bool = True


def layer_path(model: ModelConfig, features: Features, device_type: str,
               te_available: Optional[bool] = None) -> str:
    """The decoder layers the models get: "transformer_engine", "fused" (pfppo_mega.models.fused_layers)
    or "local" (megatron's own), from model.layer_spec, training.fused_layers, the device and whether
    TE is installed (default: looked up without importing it); see fused_layers.choose_layer_path."""
    te = fused_layers.te_importable() if te_available is None else te_available
    return fused_layers.choose_layer_path(model.layer_spec, fused_layers=features.fused_layers,
                                          device_type=device_type, params_dtype=model.params_dtype,
                                          te_available=te)


def fused_layers_active(model: ModelConfig, features: Features, device_type: str) -> bool:
    """Whether the models get pfppo_mega.models.fused_layers' spec (layer_path "fused")."""
    return layer_path(model, features, device_type) == "fused"


def features_from_config(cfg) -> Features:
    """Features of a loaded ``pfppo_mega.config.Config`` (the keys above)."""
    p = cfg.parallel
    return Features(sequence_parallel=p.sequence_parallel, use_distributed_optimizer=p.use_distributed_optimizer,
                    recompute=cfg.training.recompute, virtual_pipeline_size=p.virtual_pipeline_size,
                    sparse_vocab_grads=cfg.training.sparse_vocab_grads, fused_layers=cfg.training.fused_layers)


class FeatureError(ValueError):
    """A training feature the machine or this build cannot provide; names the config key."""


def check_features(model: ModelConfig, features: Features, *, device_type: Optional[str] = None,
                   tp: Optional[int] = None) -> None:
    """Refuse at start, by config key, what megatron or the machine cannot run (FeatureError lists
    every such key). ``device_type``: where the models will live ("cpu" / "cuda"; default: cuda
    when visible). Runs on CPU: the distributed optimizer, bf16 parameters with fp32 main weights.
    Refused on every device: sequence parallelism with the local layer spec (its WrappedTorchNorm
    asserts it off), and without TP. GPU only: selective / full recompute (megatron's recompute
    makes CUDA tensors inside the backward pass), the transformer_engine layer spec (and so
    sequence parallelism: layer_spec auto resolves to it where TE is installed); bf16 parameters
    need a GPU with bf16. Not wired into the trainer: the interleaved pipeline. TE is looked up,
    never imported, here."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    tp = _layout(tp, None)[0]
    problems = []
    path = layer_path(model, features, device_type)
    if features.sequence_parallel and tp == 1:
        problems.append("parallel.sequence_parallel = true needs parallel.tensor_model_parallel_size > 1 (TP is 1)")
    elif features.sequence_parallel and path != "transformer_engine":
        # On every device: the local spec's norm is megatron's WrappedTorchNorm, whose constructor
        # asserts `not config.sequence_parallel` (GPU or CPU alike).
        problems.append(f"parallel.sequence_parallel = true with model.layer_spec = {model.layer_spec!r} resolved to "
                        f"the {path!r} layers (any device): megatron's local spec norms (WrappedTorchNorm) and "
                        f"the fused layers' refuse sequence parallelism; set parallel.sequence_parallel false, or "
                        f"use model.layer_spec transformer_engine where transformer-engine is installed")
    elif features.sequence_parallel and device_type != "cuda":
        problems.append(f"parallel.sequence_parallel = true needs CUDA devices (device {device_type!r}); set it "
                        f"false on CPU")
    if model.layer_spec == "transformer_engine":
        te = None
        if not fused_layers.te_importable():
            te = "transformer_engine is not installed"
        elif device_type != "cuda":
            te = f"transformer_engine runs on CUDA devices only (device {device_type!r})"
        if te is not None:
            problems.append(f"model.layer_spec = 'transformer_engine': {te}; use 'auto' or 'local'")
    if model.params_dtype == "bfloat16" and device_type == "cuda" and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        problems.append(f"model.params_dtype = 'bfloat16': this GPU ({torch.cuda.get_device_name()}) has no bf16 "
                        f"support; use float32")
    if features.virtual_pipeline_size is not None:
        problems.append(f"parallel.virtual_pipeline_size = {features.virtual_pipeline_size}: the trainer builds one "
                        f"model chunk per pipeline stage (megatron's interleaved schedule is not wired in); set it null")
    if features.recompute not in ("none", "selective", "full"):
        problems.append(f"training.recompute = {features.recompute!r}: must be one of 'none', 'selective', 'full'")
    elif features.recompute != "none" and device_type != "cuda":
        problems.append(f"training.recompute = {features.recompute!r} needs CUDA devices (device {device_type!r}): "
                        f"megatron re-runs the forward inside autograd's backward, where it creates CUDA "
                        f"tensors that the CPU compatibility layer cannot map; set it 'none' on CPU")
    if problems:
        raise FeatureError("training features this run cannot provide:\n" + "\n".join(f"  - {q}" for q in problems))


def _recompute_kwargs(recompute: str) -> dict:
    """megatron's recompute settings for training.recompute."""
    if recompute == "selective":  # core attention only (megatron's default recompute_modules)
        return {"recompute_granularity": "selective"}
    if recompute == "full":  # every layer keeps its input only
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def transformer_config(
    model: ModelConfig, *, tp: Optional[int] = None, pp: Optional[int] = None, qkv_bias: bool = False,
    arch: Optional[Architecture] = None, features: Optional[Features] = None, device_type: Optional[str] = None,
) -> TransformerConfig:
    """megatron TransformerConfig of the decoder described by ``model`` and ``arch`` (None: Llama,
    or Qwen2 when the older flag ``qkv_bias`` is set).

    tp / pp default to the sizes of megatron's initialised parallel state (1 when none is);
    check_layout runs first. Dropout is 0 (RL fine-tuning; also makes the actor deterministic
    for log-prob ratios). ``features`` (default: all off) sets sequence parallelism and
    recomputation; check_features refuses what this machine cannot run (``device_type``: where the
    models will live, default cuda when visible; the dry run builds for "cuda" on the meta device).
    """
    shape = DecoderShape.from_model_config(model, _architecture(arch, qkv_bias))
    tp, pp = _layout(tp, pp)
    check_layout(model, tp=tp, pp=pp)
    features = features or Features()
    check_features(model, features, device_type=device_type, tp=tp)
    dtype = _DTYPES[model.params_dtype]
    path = layer_path(model, features, device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    fused = path == "fused"
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.arch.qkv_bias,
        qk_layernorm=shape.arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_backend=AttnBackend.auto if path == "transformer_engine" else AttnBackend.local,
        attention_softmax_in_fp32=True,
        # Fusions need apex / TE / CUDA kernels; off everywhere for identical numerics.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=path == "transformer_engine",  # TE's fused RoPE; the fused path hooks its own
        gradient_accumulation_fusion=False,
        use_te_activation_func=path != "local",  # the MLP hands fc1's output to the spec's FusedSwiGLU
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,  # megatron's fp16: Float16Module, and a loss scaler in the optimizer
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=features.sequence_parallel,  # GPUs only (check_features)
        **_recompute_kwargs(features.recompute),
        cuda_graph_scope=[],
    )
    config.pfppo_fused_layers = fused  # read by fused_layers' RoPE hook
    config.pfppo_layer_path = path     # read by _gpt (the spec)
    return config


# ----------------------------------------------------------------------------- placement


def model_device() -> torch.device:
    """Where this process's models live: the current CUDA device when one is visible (megatron's
    ``torch.cuda.current_device()``, set by ``parallel.init_parallel``), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def resolved(device: torch.device) -> torch.device:
    """The device a tensor made for ``device`` really lands on. Equal to ``device`` on a GPU; a torch
    function mode may map it (the CPU compatibility layer maps cuda to cpu, the placement test to meta)."""
    return torch.empty(0, device=device).device


class PlacementError(RuntimeError):
    """A model tensor is not on the device (or in the dtype) the builder put the model on."""


def check_placement(module: torch.nn.Module, device: torch.device, *, what: str,
                    dtype: Optional[torch.dtype] = None) -> None:
    """Raise PlacementError naming every parameter and buffer of ``module`` that is not on
    ``device`` (as resolved) or, when ``dtype`` is given, whose floating dtype differs. On a GPU a
    parameter left on the host dies in megatron's optimizer ("Wrapped parameters must be ...
    torch.cuda.*"), a buffer on the host at the first forward."""
    want = resolved(device)
    wrong = []
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in named:
            if t.device.type != want.type or (want.index is not None and t.device.index not in (None, want.index)):
                wrong.append(f"{kind} {name} {tuple(t.shape)} on {t.device}")
            elif dtype is not None and kind == "parameter" and t.is_floating_point() and t.dtype != dtype:
                wrong.append(f"{kind} {name} {tuple(t.shape)} in {t.dtype}")
    if wrong:
        shown = "\n".join(f"  - {w}" for w in wrong[:12]) + (f"\n  ... {len(wrong) - 12} more" if len(wrong) > 12 else "")
        raise PlacementError(f"{what}: {len(wrong)} tensor(s) not on {want}"
                             f"{f' in {dtype}' if dtype is not None else ''}:\n{shown}")


def _place(module: torch.nn.Module, device: Optional[torch.device], what: str) -> torch.nn.Module:
    """``module`` as built, checked to be wholly on ``device`` (default model_device()). Nothing is
    moved: every piece is made on the device (megatron's linears on ``current_device()``, our norms
    and heads likewise), so a piece that is not fails here, by name, on any machine."""
    check_placement(module, device if device is not None else model_device(), what=what)
    return module


# ----------------------------------------------------------------------------- models


def _gpt(cls: type, shape: DecoderShape, config: TransformerConfig, *, tie: bool) -> GPTModel:
    """The GPTModel of this rank's pipeline stage (where megatron put it: see ``_place``).
    ``unpadded_vocab_size`` records the true V (the model's own vocab_size is padded to a multiple
    of tp), ``architecture`` the family."""
    arch = shape.arch
    if config.qk_layernorm != arch.qk_norm or config.add_qkv_bias != arch.qkv_bias:
        raise ValueError(f"transformer config (qk_layernorm={config.qk_layernorm}, add_qkv_bias="
                         f"{config.add_qkv_bias}) was not made for {arch}")
    spec = _layer_spec(config, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm))
    with _quiet_megatron():
        module = cls(
            config=config,
            transformer_layer_spec=_block(spec, config),
            vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            parallel_output=True,
            share_embeddings_and_output_weights=tie,
            position_embedding_type="rope",
            rotary_base=shape.rope_theta,
        )
    if arch.rope.rope_type != "default":
        rotary = module.rotary_pos_emb  # every stage has one; inv_freq is a plain attribute, not state
        rotary.inv_freq = rope_inv_freq(config.kv_channels, shape.rope_theta, arch.rope, device=rotary.inv_freq.device)
    module.unpadded_vocab_size = shape.vocab_size
    module.architecture = arch
    if module.post_process:
        _selectable(module.output_layer)
    return module


def _layer_spec(config: TransformerConfig, local):
    """The layer spec of config.pfppo_layer_path (transformer_config) from megatron's local one."""
    path = getattr(config, "pfppo_layer_path", "local")
    if path != "local" and not config.use_te_activation_func:  # the MLP would apply silu to [gate | up] whole
        raise ValueError(f"a config with layer path {path!r} must set use_te_activation_func")
    if path == "fused":
        fused_layers.install_rope()
        return fused_layers.layer_spec(local)
    if path == "transformer_engine":
        return fused_layers.te_layer_spec(local)
    return fused_layers.placed_norms(local)


def _block(layer_spec, config: TransformerConfig) -> TransformerBlockSubmodules:
    """The decoder block of this pipeline stage: ``layer_spec`` per layer and a placed final norm
    (megatron's default for a layer spec is WrappedTorchNorm, made on the host in fp32)."""
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=fused_layers.PlacedRMSNorm)


def build_actor(model: ModelConfig, *, arch: Optional[Architecture] = None, qkv_bias: bool = False,
                features: Optional[Features] = None, device: Optional[torch.device] = None) -> GPTModel:
    """The policy: GPTModel with the LM head (tied to the embedding if tie_word_embeddings).
    ``arch``: the family (hf_io.architecture_from_hf); None = Llama (Qwen2 with ``qkv_bias``).
    Every parameter and buffer on ``device`` (default model_device(); checked, PlacementError).

    forward(input_ids [B, S], position_ids [B, S], attention_mask None) -> logits [B, S, Vp/tp]
    on the last pipeline stage (Vp = vocab padded to a multiple of tp), hidden states elsewhere.
    """
    shape = DecoderShape.from_model_config(model, _architecture(arch, qkv_bias))
    config = transformer_config(model, arch=shape.arch, features=features)
    return _place(_gpt(GPTModel, shape, config, tie=shape.tie_word_embeddings), device, "build_actor")


class ValueHead(torch.nn.Module):
    """values = hidden @ w, w: [H] -> [S, B, 1]. Replaces GPTModel.output_layer in the critic.

    Zero-initialised, so a fresh critic predicts 0 everywhere. Replicated (not split) across
    tensor-parallel ranks: its input hidden states are identical on all of them.
    Accepts and ignores output_layer's keyword arguments (weight, runtime_gather_output).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))

    def forward(self, hidden_states: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[Tensor, None]:
        return F.linear(hidden_states, self.weight), None  # [S, B, H] -> [S, B, 1]


class CriticModel(GPTModel):
    """The value model: the actor's trunk (same names, loadable from the same checkpoint) with
    ``output_layer`` replaced by a ValueHead. Never tied to the embedding.

    forward(input_ids [B, S], position_ids [B, S], attention_mask None) -> values [B, S] (fp32
    compute dtype of the model); on a non-last pipeline stage it returns hidden states.
    """

    def forward(self, input_ids: Tensor, position_ids: Tensor,
                attention_mask: Optional[Tensor] = None, **kwargs) -> Tensor:
        out = super().forward(input_ids, position_ids, attention_mask, **kwargs)
        if not self.post_process:
            return out
        return out.squeeze(-1)  # [B, S, 1] -> [B, S]


def build_critic(model: ModelConfig, *, arch: Optional[Architecture] = None, qkv_bias: bool = False,
                 features: Optional[Features] = None, device: Optional[torch.device] = None) -> CriticModel:
    """The value model: build_actor's trunk with a zero-initialised ValueHead, never tied; placed
    like build_actor."""
    shape = DecoderShape.from_model_config(model, _architecture(arch, qkv_bias))
    config = transformer_config(model, arch=shape.arch, features=features)
    device = device if device is not None else model_device()
    critic = _gpt(CriticModel, shape, config, tie=False)
    if critic.post_process:
        critic.output_layer = _selectable(ValueHead(shape.hidden_size, config.params_dtype, device))
    return _place(critic, device, "build_critic")


def wrap_frozen(model: GPTModel) -> torch.nn.Module:
    """A model that never trains (the reference policy, a reward model) wrapped as the trained
    ones are, minus DDP: megatron's Float16Module when bf16, which casts every parameter (the
    local-spec norms are built fp32) and the inputs to bf16 and the last stage's output to fp32,
    so a reference equal to the actor computes the actor's logits bit for bit (KL = 0 at step 0).
    Eval mode, no gradients; checked to be on the model's device in the config's dtype."""
    module: torch.nn.Module = Float16Module(model.config, model) if _half(model.config) else model
    module.eval().requires_grad_(False)
    check_placement(module, model_device(), what="frozen model", dtype=model.config.params_dtype)
    return module


# ----------------------------------------------------------------------------- the head at chosen positions


def _select_positions(layer: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of the output layer: hidden states [S, b, H] -> [N, 1, H] at
    ``layer.head_index`` (flat positions s * b + row), when one is set (see ``head_at``)."""
    index = getattr(layer, "head_index", None)
    if index is None:
        return None
    hidden = args[0]                                                   # [S, b, H]
    s, b, h = hidden.shape
    return (hidden.reshape(s * b, h).index_select(0, index).unsqueeze(1), *args[1:]), kwargs  # [N, 1, H]


def _selectable(layer: torch.nn.Module) -> torch.nn.Module:
    layer.head_index = None
    layer.register_forward_pre_hook(_select_positions, with_kwargs=True)
    return layer


@contextlib.contextmanager
def head_at(model: torch.nn.Module, index: Optional[Tensor]) -> Iterator[None]:
    """Within it, the output layer (LM head or ValueHead) of ``model``'s last pipeline stage runs
    only at ``index`` [N] (flat positions s * b + row of the decoder's [S, b] output; None: every
    position), so the model returns [1, N, Vp/tp] logits (actor) or [1, N] values (critic) instead
    of [b, S, ...]. No effect on the other stages (they have no output layer). The decoder still
    runs every position; only the head's work (the [.., V] matmul and whatever reads it) shrinks."""
    inner = unwrap(model)
    layer = getattr(inner, "output_layer", None) if getattr(inner, "post_process", False) else None
    if layer is None or index is None:
        yield
        return
    if inner.config.sequence_parallel:  # the head's input would be the S/tp shard of this rank
        raise ValueError("training.response_only_head = true with parallel.sequence_parallel = true: the output "
                         "layer's input is split over the sequence; set one of them false")
    layer.head_index = index
    try:
        yield
    finally:
        layer.head_index = None


@contextlib.contextmanager
def hidden_at_head(model: torch.nn.Module, on: bool = True) -> Iterator[Optional[torch.nn.Module]]:
    """Within it (``on``), the LM head of ``model``'s last pipeline stage multiplies nothing: it returns
    its input, so the model returns the final hidden states [b, S, H] ([1, N, H] under head_at) where
    it returned logits, for a fused head (pfppo_mega.kernels.fused_head) to take with the weight the
    layer would have used, ``layer.head_weight`` (the tied embedding's, or its own; this rank's
    vocabulary shard [Vp/tp, H]). Yields the layer, or None where there is no LM head here (another
    stage, the critic's ValueHead) or ``on`` is false. Under sequence parallelism the head's input is
    this rank's S/tp shard: refused."""
    inner = unwrap(model)
    layer = getattr(inner, "output_layer", None) if getattr(inner, "post_process", False) else None
    if not on or layer is None or isinstance(layer, ValueHead):
        yield None
        return
    if inner.config.sequence_parallel:
        raise ValueError("training.fused_head = true with parallel.sequence_parallel = true: the output layer's "
                         "input is split over the sequence; set one of them false")

    def forward(hidden_states: Tensor, weight: Optional[Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[Tensor, None]:
        # a plain reference, not a registered parameter (nn.Module.__setattr__ would add it to the
        # model's parameters and state dict under a new name)
        layer.__dict__["head_weight"] = weight if weight is not None else layer.weight  # [Vp/tp, H]
        return hidden_states, None

    layer.forward = forward  # an instance attribute: nn.Module.__call__ (and its pre-hooks) call it
    try:
        yield layer
    finally:
        del layer.forward


# ----------------------------------------------------------------------------- forward helpers


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel / CriticModel inside megatron DDP and Float16Module wrappers."""
    while isinstance(module, (DistributedDataParallel, Float16Module)):
        module = module.module
    return module


def _check_right_padded(attention_mask: Tensor, input_ids: Tensor) -> None:
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
            f"{tuple(input_ids.shape)} [B, S]"
        )
    mask = attention_mask.to(torch.bool)
    # Right padding: once a row has a 0 it stays 0, i.e. the mask never increases along S.
    rises = (mask[:, 1:] & ~mask[:, :-1]).any(dim=1)  # [B]; a host sync follows
    if bool(rises.any()):
        rows = rises.nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask rows {rows[:8]} are not right-padded (a 1 follows a 0); "
            f"these models take right-padded batches only (positions 0..S-1, causal attention)"
        )


def _positions(input_ids: Tensor) -> Tensor:
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)  # [B, S]


def actor_logits(model: torch.nn.Module, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                 *, gather_vocab: bool = False) -> Tensor:
    """Logits [B, S, Vp/tp] (Vp when gather_vocab) of a right-padded batch, one forward pass
    without the pipeline schedule (pp = 1 only; pfppo_mega.models.passes works at any layout).
    Vp = vocab padded to a multiple of tp (= V at tp = 1); padded columns are not masked here.

    input_ids: [B, S] int64; attention_mask: [B, S] (1 = token, 0 = right padding) or None.
    Attention is causal and positions are 0..S-1, so a right-padded row's real tokens never
    see its padding and their logits equal those of the unpadded row; logits at padded
    positions are meaningless. The mask is only checked, never applied.
    """
    if attention_mask is not None:
        _check_right_padded(attention_mask, input_ids)
    return model(input_ids, _positions(input_ids), None, runtime_gather_output=gather_vocab or None)


def critic_values(model: torch.nn.Module, input_ids: Tensor,
                  attention_mask: Optional[Tensor] = None) -> Tensor:
    """Values [B, S] of a right-padded batch (same conventions as actor_logits)."""
    if attention_mask is not None:
        _check_right_padded(attention_mask, input_ids)
    return model(input_ids, _positions(input_ids), None)


# ----------------------------------------------------------------------------- training


def _half(config: TransformerConfig) -> bool:
    """bf16 or fp16 parameters: megatron's Float16Module casts the norms, the inputs and the last
    stage's output (to fp32)."""
    return bool(config.bf16 or config.fp16)


def wrap_ddp(model: GPTModel, *, use_distributed_optimizer: bool = False,
             features: Optional[Features] = None) -> DistributedDataParallel:
    """Wrap in megatron DDP (and Float16Module first when bf16 or fp16); set finalize_model_grads_func.
    ``features.use_distributed_optimizer`` (or the flag) shards the optimizer over DP, which
    build_optimizer then follows. ``features.sparse_vocab_grads`` (default on): the LM head's and
    the word embedding's weight gradients go straight into DDP's buffer, the head's over many
    micro-batches at once (pfppo_mega.models.vocab_grads).

    ``config.finalize_model_grads_func`` (megatron's finalize_model_grads, after the held head
    gradients are added) makes megatron's schedules all-reduce gradients across data-parallel
    ranks (without it DP replicas silently drift). Gradients are reduced in fp32. Use the
    returned module for forward and backward.
    """
    features = features or Features()
    config = model.config
    module: torch.nn.Module = Float16Module(config, model) if _half(config) else model
    config.finalize_model_grads_func = _finalize
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer or features.use_distributed_optimizer,
    )
    check_placement(module, model_device(), what="the trained model", dtype=config.params_dtype)
    ddp = DistributedDataParallel(config, ddp_config, module)
    if features.sparse_vocab_grads:
        vocab_grads.install(model)
    return ddp


def _finalize(model_chunks, *args, **kwargs) -> None:
    """megatron's finalize_model_grads, once the held LM-head gradients are in the buffers."""
    vocab_grads.flush(model_chunks)
    finalize_model_grads(model_chunks, *args, **kwargs)


@dataclass(frozen=True)
class LossScaling:
    """fp16's loss scaler (model.params_dtype float16; megatron-core's OptimizerConfig fields and
    defaults). static None: dynamic (megatron's DynamicGradScaler: start at initial, halve on an
    inf/nan gradient once `hysteresis` of them were seen, double after `window` clean steps, never
    below min); a number: that constant scale."""

    static: Optional[float] = None
    initial: float = 2.0 ** 32
    min: float = 1.0
    window: int = 1000
    hysteresis: int = 2


def build_optimizer(model: DistributedDataParallel, *, lr: float, weight_decay: float, grad_clip: float,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    loss_scaling: Optional[LossScaling] = None) -> MegatronOptimizer:
    """AdamW through megatron's get_megatron_optimizer. ``model`` comes from wrap_ddp (megatron's
    optimizer reads gradients from DDP's buffers). grad_clip = 0 disables clipping (else the
    global grad norm, over all ranks, is clipped to grad_clip). 1-D parameters (norms) get no
    weight decay (megatron's default grouping). A learning-rate schedule may rewrite
    ``group["lr"]`` of ``optimizer.param_groups`` (each group carries ``lr_mult``).

    fp16 models (config.fp16) get megatron's mixed-precision optimizer with a loss scaler
    (``loss_scaling``, default LossScaling()): fp32 main weights, the loss multiplied by the scale
    before the backward (``config.grad_scale_func``, read by megatron's schedules), the gradients
    unscaled and checked for inf/nan before every step (optimizer_step skips a step that has one)."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"build_optimizer needs the megatron DDP module returned by wrap_ddp(model), got "
            f"{type(model).__name__}: megatron's optimizer reads gradients from DDP's buffers"
        )
    for name, value, ok in (("lr", lr, lr > 0), ("weight_decay", weight_decay, weight_decay >= 0),
                            ("grad_clip", grad_clip, grad_clip >= 0)):
        if not ok:
            raise ValueError(f"{name}({value}) must be {'> 0' if name == 'lr' else '>= 0'}")
    config = model.config
    opt_config = OptimizerConfig(
        optimizer="adam",  # megatron's "adam" is AdamW (decoupled weight decay)
        lr=lr,
        min_lr=lr,
        weight_decay=weight_decay,
        adam_beta1=betas[0],
        adam_beta2=betas[1],
        adam_eps=eps,
        clip_grad=grad_clip,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=model.ddp_config.use_distributed_optimizer,
        **_scaler_fields(loss_scaling or LossScaling()),
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    if config.fp16:  # megatron's schedules multiply the last stage's loss by the scale before backward
        config.grad_scale_func = optimizer.scale_loss
    # megatron groups 1-D params (norms) and biases with wd_mult = 0, but only its
    # OptimizerParamScheduler applies the multipliers; without one, apply them here.
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
    _fuse_adamw(optimizer)
    return optimizer


def _scaler_fields(ls: LossScaling) -> dict:
    for name, ok in (("static", ls.static is None or (math.isfinite(ls.static) and ls.static > 0)),
                     ("initial", math.isfinite(ls.initial) and ls.initial > 0),
                     ("min", math.isfinite(ls.min) and 0 < ls.min <= ls.initial),
                     ("window", ls.window >= 1), ("hysteresis", ls.hysteresis >= 1)):
        if not ok:
            raise ValueError(f"LossScaling.{name} = {getattr(ls, name)!r}: scales must be finite and > 0 with "
                             f"min <= initial; window and hysteresis >= 1")
    return dict(loss_scale=ls.static, initial_loss_scale=ls.initial, min_loss_scale=ls.min,
                loss_scale_window=ls.window, hysteresis=ls.hysteresis)


def loss_scale(optimizer: MegatronOptimizer) -> Optional[float]:
    """The fp16 loss scale now (None without a scaler: bf16, fp32)."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    scaler = next((o.grad_scaler for o in subs if getattr(o, "grad_scaler", None) is not None), None)
    return None if scaler is None else float(scaler.scale)


def _fuse_adamw(optimizer: MegatronOptimizer) -> None:
    """torch's fused AdamW kernel where megatron fell back to torch.optim.AdamW (no apex or
    transformer-engine FusedAdam): one pass over parameter, gradient and both moments instead of the
    for-loop default's six or so (135M parameters on 2 CPU threads: 0.08 s per step instead of 0.49
    s). Same update up to floating-point rounding; CPU and CUDA both have the kernel."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    for inner in [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]:
        if type(inner) is not torch.optim.AdamW or inner.state:  # set before the first step creates state
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if all(p.device.type in devices and p.is_floating_point() for p in params):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
            inner.defaults["fused"], inner.defaults["foreach"] = True, False


@dataclass(frozen=True)
class StepStats:
    """Outcome of one optimizer step. grad_norm is the global norm before clipping; update_successful
    is False when no step was taken (a non-finite grad norm, or a grad scaler's inf/nan check)."""

    update_successful: bool
    grad_norm: float
    overflow: bool = False  # fp16: the grad scaler found an inf/nan gradient (and lowered its scale)


def zero_grads(model: DistributedDataParallel, optimizer: MegatronOptimizer) -> None:
    """Clear DDP's gradient buffers and the optimizer's grads before a new accumulation."""
    vocab_grads.discard([model])
    model.zero_grad_buffer()
    optimizer.zero_grad()


def optimizer_step(model: DistributedDataParallel, optimizer: MegatronOptimizer, *,
                   finalize: bool = True) -> StepStats:
    """Reduce gradients across data-parallel ranks (finalize_model_grads), take the global grad norm,
    clip, and step -- or skip the step when the norm is not finite.

    Call after the backward passes of all micro-batches; finalize=False when a megatron schedule
    already ran config.finalize_model_grads_func. Without a grad scaler (bf16, fp32) megatron's own
    step() would apply a NaN/inf gradient: its clip test ``clip_coeff < 1.0`` is False for NaN, and
    AdamW then writes NaN into every weight and moment. Here a non-finite norm zeroes the grads and
    returns update_successful=False with the norm (the trainer counts it as a skipped update). The
    norm is all-reduced over the model-parallel ranks (and a distributed optimizer's DP ranks; DP
    gradients are already reduced), so every rank skips together. The sequence is megatron-core
    0.16's ChainedOptimizer.step (prepare, norm, clip, step) with the check between norm and clip.
    """
    if finalize:
        model.config.finalize_model_grads_func([model])
    if optimizer.prepare_grads():  # a grad scaler's inf/nan check (fp16 only); it updated its scale
        zero_grads(model, optimizer)
        return StepStats(update_successful=False, grad_norm=float("nan"), overflow=True)
    norm = float(optimizer.get_grad_norm())  # global, before clipping; a host sync
    if not math.isfinite(norm):
        zero_grads(model, optimizer)
        return StepStats(update_successful=False, grad_norm=norm)
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        params = [] if getattr(sub, "is_stub_optimizer", False) else sub.get_parameters()
        if params and sub.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=norm,
                                         use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return StepStats(update_successful=bool(optimizer.step_with_ready_grads()), grad_norm=norm)
