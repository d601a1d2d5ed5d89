"""Argument checks shared by every public entry point: clear errors naming the argument."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (64, 128, 256)
INPUT_DTYPES = (torch.bfloat16, torch.float16)
#: what the numerics' quantizers take: the kernels' inputs, and float32 (the twin also
#: quantizes float32 intermediates: G = f ∘ dO, Hadamard-rotated Q/K, dS)
FLOAT_DTYPES = (*INPUT_DTYPES, torch.float32)


@dataclass(frozen=True)
class VarlenShape:
    """Sizes of a packed varlen attention call."""

    total_tokens: int
    num_docs: int
    heads_q: int
    heads_kv: int
    head_dim: int


def check_tensor(
    x: object,
    name: str,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    layout: str = "",
    at_least: bool = False,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``x`` fits: a tensor of one
    of ``dtypes`` with ``ndim`` dims (``at_least``: ``ndim`` or more). ``layout`` (such as
    ``"[T, H, d]"``) is named in the message about dims."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")
    if (x.dim() < ndim) if at_least else (x.dim() != ndim):
        dims = f"at least {ndim}" if at_least else str(ndim)
        where = f" {layout}" if layout else ""
        raise ValueError(f"{name} must have {dims} dims{where}, got shape {tuple(x.shape)}")
    return x


def check_tokens(x: object, name: str = "x") -> torch.Tensor:
    """``x`` if it is a packed ``[T, H, d]`` tensor of ``FLOAT_DTYPES`` with ``d >= 1`` (what
    the numerics' quantizers take); else ``TypeError``/``ValueError`` naming ``name``."""
    x = check_tensor(x, name, ndim=3, dtypes=FLOAT_DTYPES, layout="[T, H, d]")
    if x.shape[-1] < 1:
        raise ValueError(f"{name}: head dim must be at least 1, got shape {tuple(x.shape)}")
    return x


def check_int(value: object, name: str, *, low: int, high: int | None = None) -> int:
    """``value`` if it is an int (not a bool) in ``[low, high]``; else ``TypeError`` /
    ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def check_batched_inputs(q: object, k: object, v: object) -> tuple[int, int]:
    """Check a batched call, q ``[B, S, Hq, d]``, k/v ``[B, S, Hkv, d]`` BF16/FP16, and return
    ``(B, S)``. ``ValueError`` names what differs."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(x, name, ndim=4, dtypes=INPUT_DTYPES)
    batch, seq = q.shape[:2]
    if k.shape[:2] != (batch, seq) or v.shape[:2] != (batch, seq):
        raise ValueError(
            f"q, k, v must share [B, S], got {tuple(q.shape[:2])}, {tuple(k.shape[:2])}, "
            f"{tuple(v.shape[:2])}"
        )
    return batch, seq


def batched_cu_seqlens(q: object, k: object, v: object) -> torch.Tensor | None:
    """:func:`check_batched_inputs`, then the call's ``cu_seqlens`` (int32 ``[B+1]`` on q's
    device, one document per batch row), or ``None`` when ``B·S == 0`` (nothing to
    attend)."""
    batch, seq = check_batched_inputs(q, k, v)
    if batch * seq == 0:
        return None
    return torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=q.device)


def check_cu_seqlens_layout(cu_seqlens: object, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` is a contiguous 1-D int32 tensor on ``device`` (no host read: the
    kernels index it as a plain array, so a strided view would be read wrongly)."""
    cu = check_tensor(cu_seqlens, "cu_seqlens", ndim=1, dtypes=(torch.int32,))
    if cu.device != device:
        raise ValueError(f"cu_seqlens must be on {device}, got {cu.device}")
    if not cu.is_contiguous():
        raise ValueError(
            f"cu_seqlens must be contiguous (got stride {cu.stride(0)}); pass "
            "cu_seqlens.contiguous()"
        )
    return cu


def check_cu_seqlens(cu_seqlens: object, total_tokens: int, device: torch.device) -> int:
    """Validate ``cu_seqlens`` (int32, 1-D, starts at 0, non-decreasing, ends at T).

    Returns the largest document length. Reads the values on the host (one sync).
    """
    cu = check_cu_seqlens_layout(cu_seqlens, device)
    if cu.numel() < 2:
        raise ValueError(f"cu_seqlens needs at least 2 entries (B+1), got {cu.numel()}")
    host = cu.cpu()
    if int(host[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(host[0])}")
    lengths = host[1:] - host[:-1]
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    if int(host[-1]) != total_tokens:
        raise ValueError(
            f"cu_seqlens must end at the number of tokens {total_tokens}, got {int(host[-1])}"
        )
    return int(lengths.max())


def check_max_seqlen(max_seqlen: object, longest: int) -> int:
    """``max_seqlen`` must be an int >= the longest document."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}")
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen ({max_seqlen}) is below the longest document ({longest})")
    return max_seqlen


def check_varlen_inputs(
    q: object,
    k: object,
    v: object,
    cu_seqlens: object,
    max_seqlen: object,
    *,
    head_dims: tuple[int, ...] = SUPPORTED_HEAD_DIMS,
    check_values: bool = True,
) -> VarlenShape:
    """Check a packed varlen call: q ``[T, Hq, d]``, k/v ``[T, Hkv, d]``, BF16/FP16.

    ``check_values=False`` skips reading ``cu_seqlens`` on the host (a plan validated it).
    """
    q = check_tensor(q, "q", ndim=3, dtypes=INPUT_DTYPES)
    k = check_tensor(k, "k", ndim=3, dtypes=INPUT_DTYPES)
    v = check_tensor(v, "v", ndim=3, dtypes=INPUT_DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q, got {t.device}")
    total, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] != total:
        raise ValueError(f"k must have {total} tokens like q, got {k.shape[0]}")
    if k.shape[2] != d:
        raise ValueError(f"k head dim {k.shape[2]} differs from q head dim {d}")
    if d not in head_dims:
        raise ValueError(f"head dim must be one of {head_dims}, got {d}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    if not check_values:
        check_cu_seqlens_layout(cu_seqlens, q.device)
        return VarlenShape(total, cu_seqlens.numel() - 1, hq, k.shape[1], d)
    check_max_seqlen(max_seqlen, check_cu_seqlens(cu_seqlens, total, q.device))
    return VarlenShape(total, cu_seqlens.numel() - 1, hq, hkv, d)


def check_flag(value: object, name: str) -> bool:
    """A boolean option (``causal``, ``exact_causal``): a bool, NumPy's bool or an integer 0
    or 1; anything else (a string such as ``"false"`` is truthy) is a ``TypeError``."""
    kind = type(value)
    numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
    if numpy_bool or (isinstance(value, numbers.Integral) and value in (0, 1)):  # bool too
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def check_softmax_scale(softmax_scale: float | None, head_dim: int) -> float:
    """Default ``1/sqrt(d)``; a given scale must be a positive finite real number (a Python
    or NumPy number, or a one-element tensor; not a bool or a string)."""
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool | str | bytes):
        raise TypeError(f"softmax_scale must be a number, got {softmax_scale!r}")
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"softmax_scale must be a number, got {softmax_scale!r}") from exc
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    return scale


def check_device(device: object, name: str = "device") -> torch.device:
    """A ``torch.device`` that exists here, from a ``torch.device`` or a string such as
    ``"cpu"``, ``"cuda"``, ``"cuda:1"``.

    Raises ``TypeError``/``ValueError`` naming ``name`` for another type, an unknown
    spelling, a device type other than cpu/cuda, CUDA on a torch that sees no CUDA GPU, or a
    CUDA index past the last device.
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} {device!r}: unknown device (use cpu or cuda)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"{name} {str(dev)!r}: not supported (use cpu or cuda)")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{name} {str(dev)!r}: this torch ({torch.__version__}) sees no CUDA GPU; use cpu"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{name} {str(dev)!r}: only {count} CUDA device(s), cuda:0..{count - 1}")
    return dev
