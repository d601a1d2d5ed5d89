"""Launcher of the fused quantization kernel (``quantize_qkv_kernel``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_serve.kernels._common import interpreted
from flamia_serve.kernels.quant.triton import quantize_qkv_kernel
from flamia_serve.kernels.schedule import (
    V_T_ALIGN,
    TokenBlocks,
    token_block_table,
    v_t_length,
    v_t_position,
)
from flamia_serve.numerics import (
    FP8Tensor,
    NVFP4Tensor,
    Recipe,
    resolve_recipe,
    token_documents,
)
from flamia_serve.reference import QuantizedQKV

EXPONENT_DTYPE = torch.int16  # kernel-side storage of the E4M3 tensors' exponents


@dataclass(frozen=True)
class KernelQKV:
    """What the quantization kernel writes (the attention kernels' operands).

    ``q_codes`` ``[T, Hq, d]`` / ``k_codes`` ``[T, Hkv, d]`` E4M3; ``v_t`` ``[Hkv, d, t_pad]``
    E4M3 V codes with keys contiguous, document ``b`` starting at column
    ``doc_v_t_start[b]`` (16-aligned), its key ``j`` at ``doc_v_t_start[b] + v_t_position(j)``
    (permuted inside 16-key groups, see ``schedule.v_t_position``; ``key_columns``); codes
    outside documents are zero, so a key tile may run past a document's end (the CuTe
    kernel's TMA loads whole tiles). Exponents are int16:
    ``q_exp``
    ``[T, Hq]`` (a view of a head-major ``[Hq, T]`` buffer); ``k_exp`` / ``v_exp``
    ``[Hkv, t_pad]`` in ``v_t``'s column layout, so a key tile's exponents are one aligned
    >= 4-byte vector per thread, which Triton's pipeliner stages through shared memory like
    the code tiles. ``kv_factors`` ``[Hkv, 3, t_pad]`` float32, same columns: ``2^eK``, ``eV``
    and ``2^-eV`` exactly (the CuTe kernel reads floats instead of converting the exponents
    in every thread). q4/k4 NVFP4 (mixed recipe only);
    ``qk_rescale`` = 1/d after the Hadamard option; ``k_exp_block``: keys sharing one K
    exponent (document-local blocks; 1 = per token).
    """

    q_codes: torch.Tensor
    q_exp: torch.Tensor
    k_codes: torch.Tensor
    k_exp: torch.Tensor
    v_t: torch.Tensor
    doc_v_t_start: torch.Tensor
    cu_seqlens: torch.Tensor
    v_exp: torch.Tensor
    kv_factors: torch.Tensor
    q4: NVFP4Tensor | None
    k4: NVFP4Tensor | None
    qk_rescale: float
    k_exp_block: int = 1

    def key_columns(self) -> torch.Tensor:
        """int64 ``[T]``: the column of each token (as a key) in ``v_t``'s layout."""
        doc, pos = token_documents(self.cu_seqlens, self.k_codes.shape[0])
        return self.doc_v_t_start.long()[doc] + v_t_position(pos)

    def to_reference(self) -> QuantizedQKV:
        """The same operands in the reference twin's layout (V token-major, int8 exponents)."""
        column = self.key_columns()
        v_codes = self.v_t[:, :, column].permute(2, 0, 1).contiguous()

        def fp8(codes: torch.Tensor, exp: torch.Tensor) -> FP8Tensor:
            return FP8Tensor(codes, exp.to(torch.int8).contiguous())

        return QuantizedQKV(
            fp8(self.q_codes, self.q_exp),
            fp8(self.k_codes, self.k_exp[:, column].t()),
            fp8(v_codes, self.v_exp[:, column].t()),
            self.q4, self.k4, self.qk_rescale,
        )  # fmt: skip


def _head_major_exponents(
    total: int, heads: int, device: torch.device, dtype: torch.dtype = EXPONENT_DTYPE
) -> torch.Tensor:
    """``[T, H]`` view of a ``[H, T]`` buffer."""
    return torch.empty(heads, total, dtype=dtype, device=device).t()


def _nvfp4_empty(total: int, heads: int, d: int, device: torch.device) -> NVFP4Tensor:
    return NVFP4Tensor(
        torch.empty(total, heads, d // 2, dtype=torch.uint8, device=device),
        torch.empty(total, heads, d // 16, dtype=torch.float8_e4m3fn, device=device),
        _head_major_exponents(total, heads, device, torch.int8),
    )


def _num_programs(device: torch.device, items: int, programs_per_sm: int) -> int:
    """Persistent grid: ``programs_per_sm`` per SM (2 under the CPU interpreter)."""
    if device.type != "cuda":
        return min(items, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(items, sms * programs_per_sm))


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    recipe: str | Recipe = "mxfp8",
    exact_causal: bool = False,
    blocks: TokenBlocks | None = None,
    num_warps: int = 4,
    programs_per_sm: int = 32,
) -> KernelQKV:
    """Quantize packed Q ``[T, Hq, d]``, K/V ``[T, Hkv, d]`` (BF16/FP16) in one launch.

    Same codes as ``flamia_serve.reference.quantize_qkv``, bit for bit. Inputs are assumed
    checked (public entry points do that); ``blocks`` may be passed to reuse a plan.
    ``num_warps`` / ``programs_per_sm`` (persistent grid) default to the H200's best
    (``benchmarks/tune_quant.py``).
    """
    rec = resolve_recipe(recipe)
    if rec.token_block % V_T_ALIGN:
        raise ValueError(
            f"recipe token_block {rec.token_block}: must be a multiple of {V_T_ALIGN} (the "
            "K-major V layout permutes keys inside 16-key groups)"
        )
    total, heads_q, d = q.shape
    heads_kv = k.shape[1]
    dev = q.device
    if blocks is None:
        blocks = token_block_table(cu_seqlens, total, rec.token_block)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1)")
    t_pad = v_t_length(total, cu_seqlens.numel() - 1)
    q_codes = torch.empty(total, heads_q, d, dtype=torch.float8_e4m3fn, device=dev)
    k_codes = torch.empty(total, heads_kv, d, dtype=torch.float8_e4m3fn, device=dev)
    q_exp = _head_major_exponents(total, heads_q, dev)
    k_exp = torch.empty(heads_kv, t_pad, dtype=EXPONENT_DTYPE, device=dev)
    v_t = torch.empty(heads_kv, d, t_pad, dtype=torch.float8_e4m3fn, device=dev)
    # columns past every document's padded end are zero (the kernel zeroes the padding
    # inside documents): key tiles that run past the last document read finite codes
    v_t[:, :, total:].zero_()
    v_exp = torch.empty(heads_kv, t_pad, dtype=EXPONENT_DTYPE, device=dev)
    kv_factors = torch.empty(heads_kv, 3, t_pad, dtype=torch.float32, device=dev)
    nvfp4 = rec.qk_format == "nvfp4"
    q4 = _nvfp4_empty(total if nvfp4 else 0, heads_q, d, dev)
    k4 = _nvfp4_empty(total if nvfp4 else 0, heads_kv, d, dev)
    if total > 0:
        grid = (_num_programs(dev, blocks.num_slots * (heads_q + 2 * heads_kv), programs_per_sm),)
        quantize_qkv_kernel[grid](
            q, k, v, blocks.start, blocks.length, blocks.v_t_start,
            q_codes, q_exp, k_codes, k_exp, v_t, v_exp, kv_factors,
            q4.codes, q4.block_scales, q4.exponents, k4.codes, k4.block_scales, k4.exponents,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            t_pad, total, blocks.num_slots,
            HQ=heads_q, HKV=heads_kv, D=d, BLOCK=rec.token_block,
            PER_TOKEN_QK=bool(exact_causal), QK_NVFP4=nvfp4, HADAMARD=rec.hadamard,
            LOG2_D=d.bit_length() - 1, INTERPRET=interpreted(),
            num_warps=num_warps,
        )  # fmt: skip
    rescale = 1.0 / d if nvfp4 and rec.hadamard else 1.0
    return KernelQKV(
        q_codes, q_exp, k_codes, k_exp, v_t, blocks.doc_v_t_start, cu_seqlens, v_exp, kv_factors,
        q4 if nvfp4 else None, k4 if nvfp4 else None, rescale,
        1 if exact_causal else rec.token_block,
    )  # fmt: skip
