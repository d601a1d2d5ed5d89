"""The operand contract: what quantization writes and the attention kernels (forward and
backward) and the reference twin read. One home for the layouts, so ``kernels/`` and
``reference/`` both import it and neither imports the other.

Two layouts of the same codes and exponents:

* reference layout (``QuantizedQKV``, ``QuantizedDO``): token-major ``[T, H, d]`` codes and
  int8 exponents ``[T, H]``, the executable spec's view;
* kernel layout (``KernelQKV``, ``KernelDO``): token-major codes for the operands that an
  MMA contracts over the head dimension, plus *column-layout* copies ``[H, d, t_pad]`` for
  the ones contracted over tokens (FP8 ``wgmma`` wants both operands K-major, and one
  token-block quantization serves both orientations: DESIGN N2), with their exponents in
  the same columns.

Column layout: document ``b`` starts at column ``doc_v_t_start[b]`` (a multiple of the
layout's *column alignment*: ``V_T_ALIGN`` = 16 at least, so tiles load as 16-byte vectors;
the CuTe forward's key tile, 128, for the layout it reads, so that no whole-tile TMA load
holds two documents); its token ``j`` sits at ``doc_v_t_start[b] + v_t_position(j)``
(permuted inside 16-token groups, see ``v_t_position``); columns outside documents hold zero
codes, ``COLUMN_SLACK`` of them after the last one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_serve.numerics.scales import FP8Tensor, NVFP4Tensor, token_documents

#: each document starts at a multiple of this in the column layout (16-byte loads)
V_T_ALIGN = 16
#: kernel-side storage of the E4M3 operands' exponents
EXPONENT_DTYPE = torch.int16


def v_t_position(key):
    """Column, inside its document's span of the column layout, of document-local token
    ``key`` (int tensor, torch or Triton). Tokens are permuted inside each 16-token group
    (token ``8a + 2b + c`` at ``4b + 2a + c``: order 0,1,8,9,2,3,10,11,4,5,12,13,6,7,14,15)
    so that a Hopper FP8 ``wgmma`` accumulator fragment of ``Q̂·K̂ᵀ`` (columns ``2b + c`` and
    ``8 + 2b + c`` per thread) is, byte for byte, the A fragment of ``P̂·V̂`` (4 consecutive
    keys per register): P̂ stays in registers. 16-token groups, 32-token exponent blocks and
    tiles keep their sets of tokens."""
    k = key & 15
    return (key - k) + (((k >> 1) & 3) << 2) + ((k >> 3) << 1) + (k & 1)


def v_t_key(position):
    """Inverse of ``v_t_position``: the document-local token stored at column ``position``."""
    i = position & 15
    return (position - i) + ((i >> 2) << 1) + (((i >> 1) & 1) << 3) + (i & 1)


#: zero columns after the last document: a whole key tile loaded at a document's start
#: stays inside the array
COLUMN_SLACK = 64


def check_column_align(align: int) -> int:
    """``align`` if it is a positive multiple of ``V_T_ALIGN``, else ``ValueError``."""
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align % V_T_ALIGN:
        raise ValueError(
            f"column_align must be a positive multiple of {V_T_ALIGN}, got {align!r}"
        )
    return align


def v_t_length(total_tokens: int, num_docs: int, align: int = V_T_ALIGN) -> int:
    """Columns of the column layout (an upper bound from the host-side sizes): every document
    padded to ``align``, then ``COLUMN_SLACK`` zero columns."""
    docs = -(-(total_tokens + (align - 1) * num_docs) // align) * align
    return docs + COLUMN_SLACK


def token_columns(
    cu_seqlens: torch.Tensor, doc_v_t_start: torch.Tensor, total: int
) -> torch.Tensor:
    """int64 ``[T]``: the column of every packed token in the column layout."""
    doc, pos = token_documents(cu_seqlens, total)
    return doc_v_t_start.long()[doc] + v_t_position(pos)


@dataclass(frozen=True)
class QuantizedQKV:
    """All quantized operands of one call, reference layout.

    ``q8``/``k8``: E4M3 Q/K (token-block, or per-token with ``exact_causal``) — QKᵀ in the
    MXFP8 recipe and dQ/dK products in both; ``q4``/``k4``: NVFP4 Q/K (mixed recipe, after
    the optional Hadamard rotation); ``v8``: E4M3 V per key. ``q_grad``/``k_grad``
    (``Recipe(grad_qk="input")`` only): BF16 ``[T, H, d]``, the unquantized Q/K over their
    E4M3 scales (``grad_operand``), which dK/dQ multiply instead of the codes.
    """

    q8: FP8Tensor
    k8: FP8Tensor
    v8: FP8Tensor
    q4: NVFP4Tensor | None = None
    k4: NVFP4Tensor | None = None
    #: exact factor restoring the scores after an unnormalized Hadamard rotation (1/d)
    qk_rescale: float = 1.0
    q_grad: torch.Tensor | None = None
    k_grad: torch.Tensor | None = None


@dataclass(frozen=True)
class QuantizedDO:
    """The backward's dO operands, reference layout (DESIGN N5, N6).

    ``do8``: E4M3 dO with token-block exponents (dÔ: dP = dÔ·Vᵀ and ``delta``);
    ``g8``: E4M3 of ``G = f ∘ dO`` with token-block exponents, ``f_i = 2^(M_i − 8 − lse_i)``
    the forward's normaliser of row ``i`` (dV = P̂ᵀ·Ĝ with P̂ as the forward stored it);
    ``delta``: ``rowsum(dÔ ∘ O)`` float32 ``[T, Hq]``.
    """

    do8: FP8Tensor
    g8: FP8Tensor
    delta: torch.Tensor


@dataclass(frozen=True)
class KernelQKV:
    """What the quantization kernel writes (the attention kernels' operands), kernel layout.

    ``q_codes`` ``[T, Hq, d]`` / ``k_codes`` ``[T, Hkv, d]`` E4M3, token-major; ``v_t``
    ``[Hkv, d, t_pad]`` E4M3 V codes in the column layout (module docstring). Exponents are
    int16: ``q_exp`` ``[T, Hq]`` (a view of a head-major ``[Hq, T]`` buffer); ``k_exp`` /
    ``v_exp`` ``[Hkv, t_pad]`` in the column layout. ``kv_factors`` ``[Hkv, 3, t_pad]``
    float32, same columns: ``2^eK``, ``eV`` and ``2^-eV`` exactly (the CuTe kernels read
    floats instead of converting exponents in every thread; with NVFP4 Q/K, ``2^eK`` is of
    K's NVFP4 second level, per token: the scores' factor). ``q4``/``k4``: NVFP4 (mixed
    recipe only); ``qk_rescale`` = 1/d after the Hadamard option; ``k_exp_block``: keys
    sharing one K exponent (document-local blocks; 1 = per token).

    Written only when gradients are needed (``with_transposed``): ``q_t`` ``[Hq, d, t_pad]``
    and ``k_t`` ``[Hkv, d, t_pad]``, the same E4M3 codes as ``q_codes``/``k_codes`` in the
    column layout (the backward contracts dK = dSᵀ·Q̂ over queries and dQ = dS·K̂ over keys);
    ``q_rows`` ``[t_pad, Hq, d]`` BF16 (``quantize_qkv(q_rows=True)``): dK's Q operand, a row
    per column with each document's tokens in order (``v_t_key`` of the column) and zeros in
    the padding: the Q codes' values (the CuTe backward's dK operand at the head dims where it
    multiplies in BF16), or with ``grad_input`` Q's ``grad_operand``. ``k_rows`` ``[t_pad,
    Hkv, d]`` (``quantize_qkv(k_rows=True)``): the same for K, dQ's operand. ``grad_input``:
    the recipe's ``grad_qk`` is ``"input"`` (the rows hold the inputs' values).

    Written only when asked (``quantize_qkv(widen=True)``, NVFP4 Q/K): ``q_wide`` ``[T, Hq,
    d]`` / ``k_wide`` ``[T, Hkv, d]`` BF16, the NVFP4 values without their per-token power of
    two (exact): the score operands of the CuTe kernels, which multiply them in BF16 (Hopper
    has no FP4 MMA). ``scores_only`` (``quantize_qkv(scores_only=True)``): only what the
    CuTe forward reads was written (``q_wide``/``k_wide``, the NVFP4 second levels,
    ``kv_factors``, ``v_t``, ``v_exp``); the E4M3 Q/K codes and exponents and the packed
    NVFP4 codes and block scales hold no values, and every other reader refuses it.

    ``q_input`` (``quantize_qkv(defer_q=True)``, E4M3 Q/K): the BF16/FP16 Q ``[T, Hq, d]`` as
    given, which the CuTe forward quantizes as it loads it (same rule, same codes); ``q_codes``
    and ``q_exp`` then hold no values, and every other reader refuses it, except that
    ``q_short`` > 0 (``quantize_qkv(q_short=...)``): the rows of documents of at most that
    many tokens hold their codes and exponents (the forward's window kernel reads them).
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
    q_t: torch.Tensor | None = None
    k_t: torch.Tensor | None = None
    #: documents start at multiples of this in the column layout (``check_column_align``)
    column_align: int = V_T_ALIGN
    #: int64 ``[T]``, each token's column (``key_columns``), when the quantizer had them
    columns: torch.Tensor | None = None
    q_wide: torch.Tensor | None = None
    k_wide: torch.Tensor | None = None
    scores_only: bool = False
    q_input: torch.Tensor | None = None
    q_rows: torch.Tensor | None = None
    k_rows: torch.Tensor | None = None
    grad_input: bool = False
    q_short: int = 0

    @property
    def unwidened(self) -> bool:
        """NVFP4 Q/K quantized without the widened copy the CuTe kernels read."""
        return self.q4 is not None and (self.q_wide is None or self.k_wide is None)

    def score_operands(
        self, kernel: str, *, quantizes_q: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The score product's operands as the CuTe kernels read them: ``(Q, K, Q exponents
        [Hq, T])``: E4M3 codes and their exponents, or with NVFP4 Q/K the widened values
        and the second level (``kv_factors`` row 0 then holds K's); with ``q_input``, Q is
        that input (for a kernel that ``quantizes_q``; its exponents then hold no values).
        ``ValueError`` naming ``kernel`` without the widened copy, or with ``q_input`` for a
        kernel that does not quantize Q."""
        if self.q_input is not None:
            if not quantizes_q:
                self.check_full(f"the {kernel}")
            return self.q_input, self.k_codes, self.q_exp.t()
        if self.unwidened:
            raise ValueError(f"NVFP4 Q/K on the {kernel}: quantize with widen=True")
        if self.q4 is not None:
            return self.q_wide, self.k_wide, self.q4.exponents.t()
        return self.q_codes, self.k_codes, self.q_exp.t()

    def check_full(self, reader: str) -> None:
        """``ValueError`` naming ``reader`` when only the score operands were written, or Q
        was left to the CuTe forward (``q_input``)."""
        if self.q_input is not None:
            raise ValueError(
                f"{reader} reads the E4M3 Q codes, which a defer_q quantization leaves "
                "unwritten (only the CuTe forward quantizes Q itself)"
            )
        if self.scores_only:
            raise ValueError(
                f"{reader} reads the E4M3 Q/K codes or the packed NVFP4 codes, which a "
                "scores_only quantization leaves unwritten (only the CuTe forward reads it)"
            )

    def key_columns(self) -> torch.Tensor:
        """int64 ``[T]``: the column of each token in the column layout."""
        if self.columns is not None:
            return self.columns
        return token_columns(self.cu_seqlens, self.doc_v_t_start, self.k_codes.shape[0])

    def nvfp4_kernel_args(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(codes, block scales, exponents) of Q and of K for a kernel's NVFP4 pointers:
        the NVFP4 operands, or placeholders of the right dtypes (never read) without them."""
        self.check_full("a Triton attention kernel")
        if self.q4 is not None and self.k4 is not None:
            return (
                (self.q4.codes, self.q4.block_scales, self.q4.exponents),
                (self.k4.codes, self.k4.block_scales, self.k4.exponents),
            )
        placeholder = (self.q_codes.view(torch.uint8), self.q_codes, self.q_exp)
        return placeholder, placeholder

    def to_reference(self) -> QuantizedQKV:
        """The same operands in the reference layout (V token-major, int8 exponents)."""
        self.check_full("to_reference")
        column = self.key_columns()
        v_codes = self.v_t[:, :, column].permute(2, 0, 1).contiguous()

        def fp8(codes: torch.Tensor, exp: torch.Tensor) -> FP8Tensor:
            return FP8Tensor(codes, exp.to(torch.int8).contiguous())

        q_grad = k_grad = None
        if self.grad_input:
            if self.q_rows is None or self.k_rows is None:
                raise ValueError(
                    "to_reference of a grad_qk='input' quantization reads q_rows and k_rows: "
                    "quantize with q_rows=True and k_rows=True"
                )
            in_order = v_t_key(column)  # each token's row (rows keep the tokens in order)
            q_grad, k_grad = self.q_rows[in_order], self.k_rows[in_order]
        return QuantizedQKV(
            fp8(self.q_codes, self.q_exp),
            fp8(self.k_codes, self.k_exp[:, column].t()),
            fp8(v_codes, self.v_exp[:, column].t()),
            self.q4, self.k4, self.qk_rescale, q_grad, k_grad,
        )  # fmt: skip


@dataclass(frozen=True)
class KernelDO:
    """What the dO quantization kernel writes, kernel layout (twin: ``QuantizedDO``).

    ``do_codes`` ``[T, Hq, d]`` E4M3 token-major, ``do_exp`` ``[T, Hq]`` int16 (view of a
    head-major buffer); ``g_t`` ``[Hq, d, t_pad]`` E4M3 codes of ``G`` in the column layout
    (None when not asked for), ``g_exp`` ``[Hq, t_pad]`` int16 in the same columns; ``g_rows``
    ``[t_pad, Hq, d]`` BF16 ``code·2^eG``, a row per column with each document's tokens in
    order (``v_t_key`` of the column) and zeros in the padding (the CuTe backward's dV
    operand; None when not asked for); ``delta`` and ``row_factor`` (the
    ``f`` that G was built with) ``[T, Hq]`` float32 (views of head-major buffers).
    """

    do_codes: torch.Tensor
    do_exp: torch.Tensor
    g_t: torch.Tensor | None
    g_exp: torch.Tensor
    delta: torch.Tensor
    row_factor: torch.Tensor
    doc_v_t_start: torch.Tensor
    cu_seqlens: torch.Tensor
    #: documents start at multiples of this in the column layout (``check_column_align``)
    column_align: int = V_T_ALIGN
    g_rows: torch.Tensor | None = None

    def to_reference(self) -> QuantizedDO:
        if self.g_t is None:
            raise ValueError("to_reference reads Ĝ's codes from g_t: quantize with g_columns=True")
        column = token_columns(self.cu_seqlens, self.doc_v_t_start, self.do_codes.shape[0])
        g_codes = self.g_t[:, :, column].permute(2, 0, 1).contiguous()
        return QuantizedDO(
            FP8Tensor(self.do_codes, self.do_exp.to(torch.int8).contiguous()),
            FP8Tensor(g_codes, self.g_exp[:, column].t().to(torch.int8).contiguous()),
            self.delta.contiguous(),
        )
