"""CUDA's memory-relevant choices, emulated on fake cpu tensors (for a CPU-only build of torch).

A CPU-only build cannot run backward on fake `cuda` tensors, so the predictor traces on fake
`cpu` and makes the choices CUDA would make where they change memory (DESIGN.md section 3):

- scaled_dot_product_attention takes the CUDA fused kernels (flash for 16-bit inputs without a
  mask, memory-efficient otherwise), whose meta kernels run on fake cpu tensors;
- dropout uses `native_dropout` with a bool mask, not a float noise tensor;
- optimizers that support it run `foreach=True`, CUDA's default for plain tensors;
- bf16 autocast follows the CUDA cast policy (torch 2.13's AutocastCUDA op lists), e.g.
  layer_norm and softmax in fp32, instead of the CPU one.

The dispatcher overrides are registered for the duration of `cuda_emulation()` only, so a real
CPU run outside it keeps CPU behaviour.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import Library, fallthrough_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

# torch 2.13's AutocastCUDA registrations (aten/src/ATen/autocast_mode.{h,cpp}), by policy.
_CUDA_LOWER_PRECISION = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)  # fmt: skip
_CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)  # fmt: skip
_CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)  # fmt: skip
_CUDA_FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
_CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)  # fmt: skip
_CUDA_BANNED = ("binary_cross_entropy",)

CUDA_AUTOCAST_POLICY: dict[str, str] = {
    **dict.fromkeys(_CUDA_LOWER_PRECISION, "lower_precision_fp"),
    **dict.fromkeys(_CUDA_FP32, "fp32"),
    **dict.fromkeys(_CUDA_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
    **dict.fromkeys(_CUDA_FP32_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(_CUDA_PROMOTE, "promote"),
    **dict.fromkeys(_CUDA_BANNED, "banned"),
}
"""aten op (with overload) -> CUDA autocast cast policy, as registered in torch 2.13."""

# Lower-precision on both CPU and CUDA: the C++ CPU kernel is already right (and keeps its
# cache of weight casts), so it is not overridden.
_CPU_LOWER_PRECISION = frozenset(
    {
        "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm",
        "addbmm", "linear", "_convolution.deprecated", "matmul", "conv_tbc",
        "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
        "scaled_dot_product_attention",
    }
)  # fmt: skip
# CPU-only machinery that has no CUDA counterpart worth emulating (CPU LSTM kernels).
_KEEP_CPU = frozenset({"mkldnn_rnn_layer"})

_BCE_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
    "on CUDA; use binary_cross_entropy_with_logits or BCEWithLogitsLoss."
)


def _op(name: str) -> torch._ops.OpOverload:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")  # type: ignore[no-any-return]


def _registered(key: str) -> set[str]:
    return {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(key)
        if name.startswith("aten::")
    }


def _eligible(value: object) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == "cpu"
    )


class _WeightCastCache:
    """Autocast's cache of lower-precision casts of fp32 leaf weights, cleared on autocast exit."""

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`tensor` in `dtype`, reusing an earlier cast of the same weight."""
        cacheable = (
            tensor.dtype == torch.float32
            and tensor.requires_grad
            and tensor.is_leaf
            and not tensor._is_view()
        )
        if not cacheable:
            return tensor.to(dtype)
        hit = self._casts.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        casted = tensor.to(dtype)
        self._casts[id(tensor)] = (weakref.ref(tensor), casted)
        return casted

    def clear(self) -> None:
        """Forget every cast (autocast was left)."""
        self._casts.clear()

    def __bool__(self) -> bool:
        return bool(self._casts)


class _ClearCastsOnAutocastExit(TorchFunctionMode):
    """Clears the emulated weight-cast cache at the first torch call after autocast ends."""

    def __init__(self, cache: _WeightCastCache) -> None:
        super().__init__()
        self.cache = cache

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.cache and not torch.is_autocast_enabled("cpu"):
            self.cache.clear()
        return func(*args, **(kwargs or {}))


def _no_autocast() -> Any:
    return torch._C._ExcludeDispatchKeyGuard(
        torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    )


def _cast_all(args: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return tree_map_only(torch.Tensor, lambda t: cast(t) if _eligible(t) else t, args)


def _promote_type(args: Any, lower: torch.dtype) -> torch.dtype:
    widest = lower
    for leaf in tree_leaves(args):
        if _eligible(leaf) and leaf.dtype == torch.float32:
            widest = torch.float32
    return widest


def _autocast_kernel(name: str, policy: str, cache: _WeightCastCache) -> Callable[..., Any]:
    """A Python AutocastCPU kernel for `name` that applies CUDA's `policy`."""
    op = _op(name)

    def lower_precision_fp(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype("cpu")
        with _no_autocast():
            cast = _cached_cast_to(cache, dtype)
            return op(*_cast_all(args, cast), **_cast_all(kwargs, cast))

    def fp32(*args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            cast = lambda t: t.to(torch.float32)  # noqa: E731
            return op(*_cast_all(args, cast), **_cast_all(kwargs, cast))

    def fp32_set_opt_dtype(*args: Any, **kwargs: Any) -> Any:
        with _no_autocast():
            if not _eligible(args[0]):
                return op(*args, **kwargs)
            return op(*_with_dtype(op, args, kwargs, torch.float32), **kwargs)

    def fp32_append_dtype(*args: Any, **kwargs: Any) -> Any:
        out = torch.float32 if _eligible(args[0]) else args[0].dtype
        with _no_autocast():
            return _op(_CUDA_FP32_APPEND_DTYPE[name])(*args, **kwargs, dtype=out)

    def promote(*args: Any, **kwargs: Any) -> Any:
        dtype = _promote_type((args, kwargs), torch.get_autocast_dtype("cpu"))
        with _no_autocast():
            cast = lambda t: t.to(dtype)  # noqa: E731
            return op(*_cast_all(args, cast), **_cast_all(kwargs, cast))

    def banned(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(_BCE_BANNED)

    kernels: dict[str, Callable[..., Any]] = {
        "lower_precision_fp": lower_precision_fp,
        "fp32": fp32,
        "fp32_set_opt_dtype": fp32_set_opt_dtype,
        "fp32_append_dtype": fp32_append_dtype,
        "promote": promote,
        "banned": banned,
    }
    return kernels[policy]


def _cached_cast_to(
    cache: _WeightCastCache, dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A cast to `dtype` through the weight-cast cache."""
    return lambda t: t if t.dtype == dtype else cache.cast(t, dtype)


def _with_dtype(
    op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[Any, ...]:
    """`args` with the op's optional `dtype` argument set when the caller left it unset."""
    names = [a.name for a in op._schema.arguments]
    index = names.index("dtype")
    if index < len(args):
        if args[index] is None:
            return (*args[:index], dtype, *args[index + 1 :])
        return args
    if kwargs.get("dtype") is None:
        kwargs["dtype"] = dtype
    return args


# ---------------------------------------------------------------- kernel choices


def _pad_last_dim(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    rest = tensor.shape[-1] % multiple
    return tensor if rest == 0 else torch.nn.functional.pad(tensor, (0, multiple - rest))


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """CUDA's convert_boolean_attn_mask: a bool mask becomes -inf/0 in the query dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), -math.inf, torch.zeros((), dtype=dtype))


def _flash_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: object) -> bool:
    same_heads = query.shape[-1] == key.shape[-1] == value.shape[-1]
    return (
        mask is None
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.dim() == 4
        and same_heads
        and query.shape[-1] <= 256
    )


def _efficient_ok(query: torch.Tensor, value: torch.Tensor) -> bool:
    alignment = 8 if query.dtype in (torch.float16, torch.bfloat16) else 4
    return (
        query.dim() == 4
        and query.shape[-1] % alignment == 0
        and value.shape[-1] % alignment == 0
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )


def _sdpa_as_on_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """scaled_dot_product_attention routed as on an sm80+ card: flash, efficient, else math."""
    if not enable_gqa and _flash_ok(query, key, value, attn_mask):
        head_dim = query.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
            _pad_last_dim(query, 8), _pad_last_dim(key, 8), _pad_last_dim(value, 8),
            dropout_p, is_causal, False, scale=og_scale,
        )[0]  # fmt: skip
        return out[..., :head_dim]
    mask = _float_mask(attn_mask, query.dtype)
    if not enable_gqa and _efficient_ok(query, value):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        if mask is not None:
            mask = _pad_last_dim(mask, 16)[..., : key.shape[-2]].expand(
                query.shape[0], query.shape[1], query.shape[-2], key.shape[-2]
            )
        efficient: torch.Tensor = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, grad, dropout_p, is_causal, scale=scale
        )[0]
        return efficient
    math_path: torch.Tensor = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )[0]
    return math_path


def _dropout_as_on_cuda(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """at::dropout on CUDA: the fused native_dropout (bool mask) whenever it applies."""
    if not train or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype)
    return torch.native_dropout(input, p, train)[0]


def prefer_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Run `optimizer` with foreach kernels where it left the choice to torch, as CUDA would.

    Fake parameters are not plain tensors, so torch's default would pick the for-loop.
    """
    for group in optimizer.param_groups:
        undecided = "foreach" in group and group["foreach"] is None and not group.get("fused")
        if undecided and not group.get("differentiable", False):
            group["foreach"] = True


class _ScalarReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A fake tensor's value read in Python (`.item()`) answers 1: Adafactor reads its step
    count and each parameter's and update's norm into Python floats that scale its updates in
    place, never a tensor's size, so any value allocates what the real step does (1, not 0:
    it divides by the step's square root)."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return False if args[0].dtype is torch.bool else 1
        return func(*args, **(kwargs or {}))


def answer_scalar_reads(optimizer: torch.optim.Optimizer) -> None:
    """Let `optimizer.step()` read fake scalars (see `_ScalarReads`) in a trace."""
    step = optimizer.step

    def step_reading_scalars(*args: Any, **kwargs: Any) -> Any:
        with _ScalarReads():  # type: ignore[no-untyped-call]
            return step(*args, **kwargs)

    setattr(optimizer, "step", step_reading_scalars)  # noqa: B010 (mypy forbids assigning a method)


# ---------------------------------------------------------------- the context

_COMPOSITE = "CompositeImplicitAutograd"


def _impl(lib: Library, name: str, kernel: Callable[..., Any], key: str) -> None:
    lib.impl(name, kernel, key)  # type: ignore[no-untyped-call]


def _register_autocast_policy(lib: Library, cache: _WeightCastCache) -> None:
    for name, policy in CUDA_AUTOCAST_POLICY.items():
        if name in _CPU_LOWER_PRECISION:
            continue
        _impl(lib, name, _autocast_kernel(name, policy, cache), "AutocastCPU")
    # CPU-only entries (e.g. cross_entropy_loss in fp32, cat promotion) do nothing on CUDA.
    for name in sorted(_registered("AutocastCPU") - set(CUDA_AUTOCAST_POLICY) - _KEEP_CPU):
        _impl(lib, name, fallthrough_kernel, "AutocastCPU")


@contextmanager
def cuda_emulation() -> Iterator[None]:
    """Make fake cpu tensors allocate as CUDA would (kernel choices and autocast policy)."""
    lib = Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    cache = _WeightCastCache()
    try:
        with warnings.catch_warnings():
            # Overriding aten kernels is the point; torch warns about it once per process.
            warnings.filterwarnings("ignore", "Warning only once", UserWarning)
            _impl(lib, "scaled_dot_product_attention", _sdpa_as_on_cuda, _COMPOSITE)
            _impl(lib, "dropout", _dropout_as_on_cuda, _COMPOSITE)
            _register_autocast_policy(lib, cache)
        with _ClearCastsOnAutocastExit(cache):
            yield
    finally:
        cache.clear()
        lib._destroy()  # type: ignore[no-untyped-call]
