"""FP8 attention backward for Hopper (sm_90a) in CuTe DSL: the fast path of ``attn_bwd``.

Same numerics as the Triton kernel beside it (its module docstring defines every product;
twin: ``flamia_serve.reference.attention_backward``), with the same scale blocks: one dÔ /
Ĝ / Q exponent per 32 queries (a "half"), dK's dS exponent per 32 keys x half, dQ's per 64
keys x half.

Design: one CTA per (128-key tile, K/V head) of the longest-first key work list. A producer
warp TMA-loads the tile's K̂ and V̂ (token-major) and K̂ᵀ (column layout) once, then for every
query head of the GQA group and every query step Q̂ and dÔ (E4M3, token-major) and dK's / dV's
B operands (the Q codes and Ĝ, below) into a ring of shared-memory stages. A step is two
32-query halves (``STEP_FOR_D``; one with the mixed recipes' BF16 Q/K at d = 128, for
shared memory); each half is a token block with its own Q / dÔ / Ĝ exponents and dS block
exponents, so the numerics do not depend on the step. Two consumer warpgroups each own 64
keys (keys on the MMAs' M) and take every step:

* ``Sᵀ = K̂·Q̂ᵀ`` and ``dPᵀ = V̂·dÔᵀ`` (FP8 ``wgmma`` from shared memory, N = the step), P̂
  rebuilt as the forward built it, ``dSᵀ = P ∘ (dP − D)``;
* dV and dK in pieces of 64 head-dimension columns, A from registers, two forms
  (``ops.CUTE_BF16_KV_HEAD_DIMS``, the kernel's ``bf16_kv``). At d = 128, ``dV += P̂ᵀ·(Ĝ·2^eG)`` and
  ``dK += (dŜ·2^ek)ᵀ·Q̂`` by BF16 ``wgmma`` (A in the accumulator's own layout; B tiles of
  BF16 rows by column, ``q_rows`` / ``g_rows``, read MN-major) into the FP32 dK/dV
  accumulators, which hold the sums of every step: E4M3 values times powers of two are
  exact in BF16 and the BF16 ``wgmma`` adds in FP32, so there is no per-step promotion.
  At d = 64, ``dV += (P̂ᵀ·Ĝ)·2^eG`` and ``dK += (dŜᵀ·Q̂)·2^ek`` per half by FP8 ``wgmma`` of
  the codes (B in the column layout, ``q_t`` / ``g_t``, whose permutation makes the
  accumulator fragment the A fragment as it is), promoted to FP32 per half (an FP8
  ``wgmma`` adds with fewer bits). The BF16 form is faster at d = 128 (no promotion FFMAs,
  waits or spills), the FP8 one at d = 64 (half the tensor time of the BF16 products);
* ``dQᵀ = K̂ᵀ·dŜᵀ`` (N = the step; each half's dŜ carries its own exponent, undone per query
  column when staged): dŜ goes to shared memory transposed. At d = 128 dQ is added once per
  CTA step, as FA3/FA4 do: after a barrier over both warpgroups (dŜ tiles double-buffered by
  step parity), warpgroup w computes head-dim piece w over both warpgroups' keys,
  ``2^eb0·K̂ᵀ₀·dŜᵀ₀ + 2^eb1·K̂ᵀ₁·dŜᵀ₁`` (each 64-key block keeps its exponent; the other
  warpgroup's factor comes through ``sDqFac``), after dK's products are done (two dQ
  products beside them make ptxas serialize every ``wgmma`` of the kernel, C7512). At d = 64
  each warpgroup adds its own keys' dQ. The FP32 result is staged as it lies in the
  accumulator registers (16-byte stores) and one bulk reduce-add adds it to the step's block
  of ``dq_acc [Hq, t_pad / step, step·d]`` (blocks by column-layout position;
  ``dq_layout.dq_fragment_index`` reads dQ back); dQ is summed in no fixed order: not
  bitwise repeatable.

d = 256 (one CTA's dK and dV accumulators would need 256 registers per thread) runs in one
of two forms (``PASS_HEAD_DIMS``, ``bwd_modes``). With E4M3 Q/K, two passes per key tile, one
CTA each (the default): the dK/dQ pass (``mode="dkdq"``: Sᵀ, dPᵀ, dS, dK and dQ over all
256 columns) and then the dV pass (``mode="dv"``: Sᵀ, P̂, dV); both rebuild P̂ by the same
code (``rebuild_p``), so they see the same bits. The mixed recipes' BF16 Q/K tiles do not
fit the dK/dQ pass's shared memory: they run two CTAs per key tile (``PARTS_FOR_D``), each
rebuilding Sᵀ and dPᵀ over all 256 columns and accumulating 128 columns of dK/dV/dQ.
H200, P2's shape (``results/bwd_variants_pass_split_2026-12-04.json``): 6.8 ms in passes
against 8.9 in parts (T = 8192), 25.4 against 33.9 (T = 16384).

Per-query statistics (Q/dÔ/Ĝ exponents, M, lse, D) are staged in shared memory per step by
the producer warp's lanes and read by the consumers column by column, two columns' per
16-byte load (``stats_pair``). With block exponents (one 2^eQ per half, one 2^eK per warp's
keys) the scores' factor is one product per half and dS's two block maxima come from one
warp reduction per half; dŜ's stores to shared memory apply the swizzle once per thread
(``ds_word0``). sm_90a SASS of the unmasked d = 128 step: 1019 instructions per consumer
thread, 1134 before these (``benchmarks/sass_loops.py``); H100, both kernels in one process
(``results/bwd_step_ab_w_s28_2026-12-06.json``): the backward 0-3% faster on W1-W9 and P3
(median 1%), dK and dV the same bits. Tried and dropped: keeping dS
times 2^eV in registers and folding 2^-eV into dŜ's factors (32 multiplies fewer) — the
factors overflow where a block's dS is tiny and V's exponent negative. Interior steps (all
keys and queries inside the document; causal: every query at or after every key) run a
copy of the step without the per-element masks.

Mixed recipes (NVFP4 Q/K): Sᵀ is rebuilt as the CuTe forward builds S, by a BF16 ``wgmma``
of the NVFP4 values widened exactly (``KernelQKV.q_wide``/``k_wide``) with the second-level
exponents as factors; dK and dQ contract the E4M3 codes as in ``mxfp8`` (their K exponent
``kdq`` then comes from ``k_exp``).

``grad_qk="input"`` (``mxfp8_grad_input``; the kernel's ``bf16_dq``): dK's B rows
(``q_rows``) hold Q's input over its exponents (BF16 dK at every head dim then), and dQᵀ =
Kᵀ·dŜᵀ is a BF16 ``wgmma`` of K·2^-eK's rows (``KernelQKV.k_rows``, keys in order, read
MN-major) and dŜ's E4M3 values staged as BF16 (keys x queries, two queries a word, read
MN-major), with the same dŜ codes and factors. Its tiles take 32 KB more shared memory than
the E4M3 ones at d = 128: its 64-query steps fit (``STEP_BF16_DQ_D128``), and the
one-kernel "parts" form at d = 256. The recipe's default backward on sm_90 (H200,
2026-12-05: GPU tests passed; W3 backward 65.1 ms against the Triton kernel's 310 and
``mxfp8``'s 59.2, single samples of ``--quick``: rerun with ``time_ms``'s five calls before
relying on the 10%).

Validity: rows past the document are masked by selects (the token-major tiles may hold the
next document's codes, which a select, unlike a zero weight, keeps out even when they are
NaN); the column-layout tiles and the BF16 rows by column hold zeros there (the layout's
column alignment is a multiple of 128, checked by the launcher).

Requires ``nvidia-cutlass-dsl`` and ``flash-attn-4`` (``quack``); imported lazily by
``ops.attn_bwd`` only on sm_90 when they are installed.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
import torch
from cutlass import BFloat16 as BF16
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import LayoutEnum
from flash_attn.cute import pipeline as fa_pipeline
from flash_attn.cute import utils as fa_utils
from quack import copy_utils, layout_utils, sm90_utils

from flamia_serve.kernels._common import BoundCall
from flamia_serve.kernels.attn_bwd.dq_layout import dq_fragment_index
from flamia_serve.kernels.columns import (
    DQReadBack,
    pack_column_tokens,
    rows_from_columns,
    rows_from_columns_launch,
)
from flamia_serve.kernels.cute_sm90_common import (
    FP8,
    accumulator_to_a,
    column_offset,
    compile_kernel,
    e4m3_exponent,
    ffi_tensor,
    kernel_tensors,
    pow2,
    v_t_position,
)
from flamia_serve.kernels.schedule import WorkList
from flamia_serve.kernels.workspace import PackWorkspace, pack_constant, zeroed_accumulator
from flamia_serve.numerics import P_HAT_EXP, operands
from flamia_serve.numerics.formats import exp2i
from flamia_serve.numerics.operands import KernelDO, KernelQKV

#: queries of one token block (a "half" of a 64-query step)
HALF = 32
#: queries per step by head dim: two halves (H200, causal; d = 64:
#: ``results/bwd_variants_steps_2026-12-01.json``, 218 vs 182 TFLOP/s for one half at T = 8192;
#: d = 128 with BF16 dK/dV, ``results/bwd_variants_bf16_kv_2026-12-03.json``: 277 / 312 vs
#: 275 / 302 TFLOP/s for one half at T = 8192 / 16384)
STEP_FOR_D = {64: 64, 128: 64, 256: HALF}
#: CTAs per 128-key tile by head dim in the "parts" form (d = 256: the mixed recipes, or
#: 256 left out of ``PASS_HEAD_DIMS``), each with ``d / parts`` columns of dK/dV/dQ and the
#: whole head dim for Sᵀ and dPᵀ (so every dS code is the same in every part): at d = 256 one
#: CTA's dK/dV accumulators would need 256 registers per thread; two parts keep d = 128's
#: register shape (sm_90a compile: 8 B stack, 12 B spill stores at one-half steps and two
#: stages, 174 KB of shared memory; 223 KB with the mixed recipes' BF16 Q/K)
PARTS_FOR_D = {64: 1, 128: 1, 256: 2}
#: queries per step of the d = 256 dV pass (``mode="dv"``; it stages no dÔ, dŜ or dQ, so
#: two halves fit): H200, ``results/bwd_variants_dv_step_2026-12-04.json``, the whole
#: backward 6.80 → 6.55 ms at T = 8192, 25.05 → 24.86 at 16384 against one half
STEP_DV_PASS = 64
#: the mixed recipes' BF16 Q/K tiles at d = 128 take one half per step: two would need 250 KB
#: of shared memory (a CTA can have 227 KB)
STEP_WIDE_D128 = HALF
#: queries per step of the BF16 dQ product (``bf16_dq``, grad_qk="input") at d = 128: two
#: halves, which fit 227 KB exactly (232,448 B; sm_90a compile: 168 registers, 112 B
#: stack; 120 B with the statistics in column pairs). H100, 2026-12-06, same call against one half
#: (``results/train_attention_grad_input{32,64}_s26_2026-12-06.json``): backward W3 64.6 →
#: 55.8 ms, W7 1.596 → 1.575; GPU tests passed, accuracy unchanged (dQ/dK cos 0.99809)
STEP_BF16_DQ_D128 = 2 * HALF


def step_queries(head_dim: int, qk_wide: bool, bf16_dq: bool = False) -> int:
    """Queries per step: ``STEP_WIDE_D128`` for BF16 Q/K tiles and ``STEP_BF16_DQ_D128`` for
    the BF16 dQ product at d = 128, else ``STEP_FOR_D`` (one half at d = 256: two would not
    fit shared memory with two stages)."""
    if qk_wide and head_dim == 128:
        return STEP_WIDE_D128
    if bf16_dq and head_dim == 128:
        return STEP_BF16_DQ_D128
    return STEP_FOR_D[head_dim]


#: keys per consumer warpgroup, warpgroups per CTA
WG_KEYS = 64
NUM_WG = 2
TILE_N = WG_KEYS * NUM_WG
#: FP32 values per dQ staging store (16 bytes)
DQ_VEC = 4
#: per-half exponent factors of a step (``sHalfFac``: dÔ's at 0..1, Ĝ's at 2..3)
HALF_FACTORS = 4
#: the per-query statistics in column pairs (``sStats[0]``; ``stats_pair`` reads a group):
#: group 0 P̂'s (qk_scale·2^eQ, M − 8), group 1 dS's (f = 2^(M − 8 − lse), D)
STAT_QK, STAT_REF, STAT_F, STAT_D = 0, 1, 2, 3
# named barriers (0 is __syncthreads), one of each per consumer warpgroup
_BAR_AMAX = 1
_BAR_DS = 3
_BAR_DQ = 5
_BAR_DS_CTA = 7  # both consumer warpgroups (joint dQ)


class FlamiaBwdSm90:
    """Compiled once per (head dim, heads, causal, dK key block, stages, debug)."""

    def __init__(
        self,
        head_dim: int,
        heads_q: int,
        heads_kv: int,
        causal: bool,
        dk_keys: int,
        num_stages: int,
        debug_p: bool,
        qk_wide: bool = False,
        bf16_kv: bool = False,
        block_exponents: bool = False,
        mode: str = "parts",
        bf16_dq: bool = False,
    ) -> None:
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {head_dim}: the CuTe backward supports 64, 128 and 256")
        if mode not in ("parts", "dv", "dkdq"):
            raise ValueError(f"mode {mode!r}: 'parts', 'dv' or 'dkdq'")
        # mode: "parts" (dK, dV, dQ in one kernel, ``parts`` CTAs per key tile); "dv" (pass A:
        # Sᵀ -> P̂ -> dV over all of d) or "dkdq" (pass B: Sᵀ, dPᵀ -> dS -> dK and dQ over all
        # of d), one CTA per key tile each, launched one after the other
        self.mode = mode
        self.do_dv = mode != "dkdq"
        self.do_ds = mode != "dv"
        if mode != "parts":
            if qk_wide or not bf16_kv:
                raise ValueError(f"mode {mode!r} needs E4M3 Q/K and BF16 dK/dV (bf16_kv)")
            if head_dim // 64 < NUM_WG:
                raise ValueError(f"mode {mode!r}: head_dim {head_dim} has too few pieces")
        if bf16_dq and (not bf16_kv or mode != "parts"):
            raise ValueError("bf16_dq (grad_qk='input') needs bf16_kv and mode 'parts'")
        parts = PARTS_FOR_D[head_dim] if mode == "parts" else 1
        if dk_keys not in (16, 32, 64):
            raise ValueError(f"dk_keys {dk_keys}: the CuTe backward supports 16, 32 and 64")
        self.d = head_dim
        self.parts = parts  # head-dim parts over CTAs (each rebuilds S, dP over all of d)
        # this CTA's dK/dV/dQ 64-column pieces (pass modes: all of d, 4 at d = 256)
        self.halves = head_dim // 64 // parts
        self.heads_q = heads_q
        self.heads_kv = heads_kv
        self.group = heads_q // heads_kv
        self.causal = causal
        self.dk_keys = dk_keys
        self.num_stages = num_stages
        self.debug_p = debug_p
        # Sᵀ's operands: E4M3 codes, or NVFP4 values widened to BF16 (mixed recipes)
        self.qk_wide = qk_wide
        self.qk_dtype = cutlass.BFloat16 if qk_wide else FP8
        self.num_threads = 128 * (NUM_WG + 1)
        self.step_q = STEP_DV_PASS if mode == "dv" else step_queries(head_dim, qk_wide, bf16_dq)
        # dK/dV's B operands (Q̂ and Ĝ): BF16 rows by column read MN-major (products in BF16,
        # accumulated in FP32 across steps), or E4M3 column-layout tiles (FP8 products per
        # half, promoted); box = one 64-column piece of a step
        self.bf16_kv = bf16_kv
        # dQ per CTA step: warpgroup w adds head-dim piece w over both warpgroups' keys
        self.joint_dq = self.halves >= NUM_WG
        # joint dQ: pieces per warpgroup (parts 1, dkdq at d = 256 2)
        self.dq_pieces = self.halves // NUM_WG if self.joint_dq else self.halves
        self.ds_bufs = 2 if self.joint_dq else 1  # dŜ tiles double-buffered by step parity
        self.kv_b_dtype = BF16 if self.bf16_kv else FP8
        # dQᵀ = Kᵀ·dŜᵀ: FP8 of K̂ᵀ's column-layout tiles and dŜ's codes (keys in the column
        # layout's order), or (``bf16_dq``, recipes with grad_qk="input") BF16 of the rows of
        # K·2^-eK (``KernelQKV.k_rows``, keys in order) and dŜ's values, both read MN-major
        self.bf16_dq = bf16_dq
        self.dq_dtype = BF16 if bf16_dq else FP8
        # dŜ's tile in 32-bit words: (queries, keys / 4) of codes or (keys, queries / 2) of
        # BF16 values
        self.ds_words_shape = (
            (WG_KEYS, self.step_q // 2) if bf16_dq else (self.step_q, WG_KEYS // 4)
        )
        self.kv_b_box = (self.step_q, 64) if self.bf16_kv else (64, self.step_q)
        # lanes staging the halves' exponent factors: dÔ's, and (E4M3 B operands) Ĝ's
        self.exp_lanes = 2 if self.bf16_kv else 4
        # the E4M3 Q/K exponents are per 32-token block (not per token, ``exact_causal``): one
        # 2^eQ per half and one 2^eK per thread's keys (a warp's 16 keys lie in one block),
        # so dS's two block maxima come from one running maximum, and (E4M3 scores) a
        # column's score factor is one product
        self.block_exponents = block_exponents
        self.uniform_kfac = block_exponents and not qk_wide

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, Hq, d) e4m3 (bf16: qk_wide)
        mK: cute.Tensor,  # (T, Hkv, d) e4m3 (bf16: qk_wide)
        mV: cute.Tensor,  # (T, Hkv, d) e4m3
        mDO: cute.Tensor,  # (T, Hq, d) e4m3
        mQt: cute.Tensor,  # dK's B: (t_pad, Hq, d) bf16 Q codes by column (bf16_kv), else
        #                    (d, t_pad, Hq) e4m3 in the column layout
        mKt: cute.Tensor,  # dQ's A: (d, t_pad, Hkv) e4m3, column layout, or (bf16_dq) (t_pad,
        #                    Hkv, d) bf16 K·2^-eK by column
        mGt: cute.Tensor,  # dV's B: (t_pad, Hq, d) bf16 Ĝ·2^eG by column (bf16_kv), else
        #                    (d, t_pad, Hq) e4m3 Ĝ codes in the column layout
        mQexp: cute.Tensor,  # (Hq, T) int16
        mQsexp: cute.Tensor,  # (Hq, T) int8, NVFP4 second level (qk_wide; else mQexp)
        mKexp: cute.Tensor,  # (Hkv, t_pad) int16, column layout (read with qk_wide)
        mFactors: cute.Tensor,  # (Hkv, 3, t_pad) f32: 2^eK (scores), eV, 2^-eV
        mDOexp: cute.Tensor,  # (Hq, T) int16
        mGexp: cute.Tensor,  # (Hq, t_pad) int16
        mDelta: cute.Tensor,  # (Hq, T) f32
        mM: cute.Tensor,  # (T, Hq) f32
        mLSE: cute.Tensor,  # (T, Hq) f32
        mCu: cute.Tensor,  # (B+1,) int32
        mVtStart: cute.Tensor,  # (B,) int32
        mItemDoc: cute.Tensor,  # (N,) int32
        mItemTile: cute.Tensor,  # (N,) int32
        mCount: cute.Tensor,  # (1,) int32
        mDQ: cute.Tensor,  # (Hq, t_pad // step, step·d) f32, zeroed: fragment order per step
        mDK: cute.Tensor,  # (T, Hkv, d) bf16/fp16
        mDV: cute.Tensor,  # (T, Hkv, d) bf16/fp16
        mDbg: cute.Tensor,  # (Hq, T, T) f32 (debug_p only)
        qk_scale: Float32,
        softmax_scale: Float32,
        n_ctas: Int32,
        stream: cuda.CUstream,
    ):
        d = self.d
        mQ, mDO = (layout_utils.select(t, [0, 2, 1]) for t in (mQ, mDO))  # (T, d, H)
        mK, mV = (layout_utils.select(t, [0, 2, 1]) for t in (mK, mV))
        if const_expr(self.bf16_kv):
            mQt, mGt = (layout_utils.select(t, [0, 2, 1]) for t in (mQt, mGt))  # (t_pad, d, H)
        if const_expr(self.bf16_dq):
            mKt = layout_utils.select(mKt, [0, 2, 1])  # (t_pad, d, Hkv)
        halves = self.halves
        qk = self.qk_dtype
        rows_layout = sm90_utils.make_smem_layout(FP8, LayoutEnum.ROW_MAJOR, (WG_KEYS, d), NUM_WG)
        k_rows_layout = sm90_utils.make_smem_layout(qk, LayoutEnum.ROW_MAJOR, (WG_KEYS, d), NUM_WG)
        # dQ's A in 64-column pieces of the head dimension: (warpgroup, piece) -> index
        # wg·halves + piece; column-layout tiles (64 head-dim rows x keys) or BF16 rows (keys
        # x 64 head-dim columns, read MN-major through transposed views)
        kt_box = (WG_KEYS, 64) if self.bf16_dq else (64, WG_KEYS)
        kt_layout = sm90_utils.make_smem_layout(
            self.dq_dtype, LayoutEnum.ROW_MAJOR, kt_box, NUM_WG * halves
        )
        step_layout = sm90_utils.make_smem_layout(
            FP8, LayoutEnum.ROW_MAJOR, (self.step_q, d), self.num_stages
        )
        q_step_layout = sm90_utils.make_smem_layout(
            qk, LayoutEnum.ROW_MAJOR, (self.step_q, d), self.num_stages
        )
        # dK's / dV's B in 64-column pieces (stage · halves + piece): BF16 token-major tiles
        # (read MN-major, through transposed views) or E4M3 column-layout tiles
        step_t_layout = sm90_utils.make_smem_layout(
            self.kv_b_dtype, LayoutEnum.ROW_MAJOR, self.kv_b_box, self.num_stages * halves
        )
        # dŜ per warpgroup (and step parity): queries x keys (E4M3 codes) or, bf16_dq, keys x
        # queries (BF16 values, read MN-major)
        ds_box = (WG_KEYS, self.step_q) if self.bf16_dq else (self.step_q, WG_KEYS)
        ds_layout = sm90_utils.make_smem_layout(
            self.dq_dtype, LayoutEnum.ROW_MAJOR, ds_box, NUM_WG * self.ds_bufs
        )
        # dQᵀ pieces in the accumulators' fragment order (``dq_fragment_index``): per warpgroup,
        # (64·step values of a piece, piece)
        dq_layout = cute.make_layout((64 * self.step_q, self.dq_pieces, NUM_WG))
        # (dK block | dQ block, half, warp, warpgroup)
        amax_layout = cute.make_layout((2, 2, 4, NUM_WG))
        # per step and query, in column pairs so that one 16-byte load gives a thread two
        # adjacent columns' pair of statistics (``stats_pair``): group 0 qk_scale·2^eQ and
        # M − 8 (P̂), group 1 f and D (dS); index (stat, column, stage) with stat = STAT_*.
        # Apart: 2^eQ per query (``sQfac``) and the halves' 2^e_dÔ at h, 2^e_Ĝ at 2 + h
        # (``sHalfFac``)
        step_q, stages = self.step_q, self.num_stages
        stats_layout = cute.make_layout(
            ((2, 2), (2, step_q // 2), stages),
            stride=((2, 2 * step_q), (1, 4), 4 * step_q),
        )
        qfac_layout = cute.make_layout((step_q, stages))
        half_layout = cute.make_layout((HALF_FACTORS, stages))
        mma_kw = dict(atom_layout_mnk=(1, 1, 1))
        # Sᵀ (in the score operands' type) and dPᵀ: keys x queries, contraction over d (A
        # and B from shared memory; the two accumulators share one layout)
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            qk, qk, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            tiler_mn=(WG_KEYS, self.step_q), **mma_kw,
        )  # fmt: skip
        tiled_mma_s = sm90_helpers.make_trivial_tiled_mma(
            FP8, FP8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            tiler_mn=(WG_KEYS, self.step_q), **mma_kw,
        )  # fmt: skip
        # dV / dK pieces: keys x 64 head columns, contraction over a half (one k-block of the
        # step's fragments; A in registers)
        b_major = warpgroup.OperandMajorMode.MN if self.bf16_kv else warpgroup.OperandMajorMode.K
        tiled_mma_kv = sm90_helpers.make_trivial_tiled_mma(
            self.kv_b_dtype, self.kv_b_dtype, warpgroup.OperandMajorMode.K, b_major, Float32,
            tiler_mn=(WG_KEYS, 64), a_source=warpgroup.OperandSource.RMEM, **mma_kw,
        )  # fmt: skip
        # dQᵀ pieces: 64 head columns x queries, contraction over the warpgroup's keys
        dq_major = warpgroup.OperandMajorMode.MN if self.bf16_dq else warpgroup.OperandMajorMode.K
        tiled_mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dq_dtype, self.dq_dtype, dq_major, dq_major, Float32,
            tiler_mn=(64, self.step_q), **mma_kw,
        )  # fmt: skip
        tma_load = cpasync.CopyBulkTensorTileG2SOp()

        def atom(tensor, layout, box):
            return cpasync.make_tiled_tma_atom(
                tma_load, tensor, cute.select(layout, mode=[0, 1]), box, 1
            )

        atom_k, tma_k = atom(mK, k_rows_layout, (WG_KEYS, d))
        atom_v, tma_v = atom(mV, rows_layout, (WG_KEYS, d))
        atom_kt, tma_kt = atom(mKt, kt_layout, kt_box)
        atom_q, tma_q = atom(mQ, q_step_layout, (self.step_q, d))
        atom_do, tma_do = atom(mDO, step_layout, (self.step_q, d))
        atom_qt, tma_qt = atom(mQt, step_t_layout, self.kv_b_box)
        atom_gt, tma_gt = atom(mGt, step_t_layout, self.kv_b_box)
        qk_bytes = qk.width // 8
        do_dv, do_ds = int(self.do_dv), int(self.do_ds)
        # K̂ (and with dS: V̂, dQ's K pieces)
        self.kv_bytes = (do_ds + qk_bytes) * NUM_WG * WG_KEYS * d + (
            do_ds * (self.dq_dtype.width // 8) * NUM_WG * WG_KEYS * 64 * halves)
        # per query: Q̂ (scores), dÔ (dS), and dK's / dV's B operands
        self.step_bytes = (do_ds + qk_bytes) * self.step_q * d + (
            (do_dv + do_ds) * self.kv_b_dtype.width // 8) * self.step_q * 64 * halves
        stages = self.num_stages

        def tile(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]

        # shared memory, in this order; a pass mode leaves out the buffers it does not touch
        # (dV pass: V̂, K̂ᵀ, dÔ, the Q̂ B operand, dŜ, dQ, the amax exchange; dK/dQ pass: Ĝ)
        fields = {
            "mbar_kv": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_step": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "mbar_stats": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "sStats": cute.struct.Align[
                cute.struct.MemRange[Float32, cute.cosize(stats_layout)], 16
            ],
            "sQfac": cute.struct.MemRange[Float32, cute.cosize(qfac_layout)],
            "sHalfFac": cute.struct.MemRange[Float32, cute.cosize(half_layout)],
            "sAmax": cute.struct.MemRange[Float32, cute.cosize(amax_layout)],
            "sDqFac": cute.struct.MemRange[Float32, 2 * NUM_WG * 2],
            "sK": tile(qk, k_rows_layout),
            "sV": tile(FP8, rows_layout),
            "sKt": tile(self.dq_dtype, kt_layout),
            "sQ": tile(qk, q_step_layout),
            "sDO": tile(FP8, step_layout),
            "sQt": tile(self.kv_b_dtype, step_t_layout),
            "sGt": tile(self.kv_b_dtype, step_t_layout),
            "sDS": tile(self.dq_dtype, ds_layout),
            "sDQ": cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(dq_layout)], 128],
        }
        ds_only = ("sAmax", "sDqFac", "sV", "sKt", "sDO", "sQt", "sDS", "sDQ")
        left_out = (ds_only if not self.do_ds else ()) + (("sGt",) if not self.do_dv else ())
        for name in left_out:
            del fields[name]
        self.smem_fields = frozenset(fields)
        Storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        self.smem_bytes = Storage.size_in_bytes()

        self.kernel(
            (tma_k, tma_v, tma_kt, tma_q, tma_do, tma_qt, tma_gt),
            (atom_k, atom_v, atom_kt, atom_q, atom_do, atom_qt, atom_gt),
            (mQexp, mQsexp, mKexp), mFactors, mDOexp, mGexp, mDelta, mM, mLSE, mCu, mVtStart,
            mItemDoc, mItemTile, mCount, mDQ, mDK, mDV, mDbg, qk_scale, softmax_scale,
            (rows_layout, kt_layout, step_layout, step_t_layout, ds_layout, dq_layout,
             amax_layout, (stats_layout, qfac_layout, half_layout), k_rows_layout,
             q_step_layout),
            (tiled_mma_s, tiled_mma_kv, tiled_mma_dq, tiled_mma_qk), Storage,
        ).launch(
            grid=[n_ctas * self.parts, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    # ---------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(
        self,
        tmas: tuple,
        atoms: tuple,
        exps: tuple,
        mFactors: cute.Tensor,
        mDOexp: cute.Tensor,
        mGexp: cute.Tensor,
        mDelta: cute.Tensor,
        mM: cute.Tensor,
        mLSE: cute.Tensor,
        mCu: cute.Tensor,
        mVtStart: cute.Tensor,
        mItemDoc: cute.Tensor,
        mItemTile: cute.Tensor,
        mCount: cute.Tensor,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDV: cute.Tensor,
        mDbg: cute.Tensor,
        qk_scale: Float32,
        softmax_scale: Float32,
        layouts: tuple,
        mmas: tuple,
        Storage: cutlass.Constexpr,
    ):
        (rows_layout, kt_layout, step_layout, step_t_layout, ds_layout, dq_layout, amax_layout,
         stats_layouts, k_rows_layout, q_step_layout) = layouts  # fmt: skip
        mQexp, mQsexp, mKexp = exps
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            # (the atoms fill sK, sV, sKt, sQ, sDO, sQt, sGt: a pass mode loads only its own)
            for a, buf in zip(atoms, ("sK", "sV", "sKt", "sQ", "sDO", "sQt", "sGt"), strict=True):
                if const_expr(buf in self.smem_fields):
                    cpasync.prefetch_descriptor(a)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_WG * 4)
        pipe_kv = fa_pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=mma_warps, tx_count=self.kv_bytes, defer_sync=True,
        )  # fmt: skip
        pipe_step = fa_pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_step.data_ptr(), num_stages=self.num_stages,
            producer_group=tma_warp, consumer_group=mma_warps, tx_count=self.step_bytes,
            defer_sync=True,
        )  # fmt: skip
        # per-query statistics: the producer warp's 32 lanes (one query each) -> consumers
        pipe_stats = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_stats.data_ptr(), num_stages=self.num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_WG * 128),
            defer_sync=True,
        )  # fmt: skip
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        # (a pass mode's Storage lacks the other pass's buffers: None in their place)
        smem_tensors = [
            getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
            if name in self.smem_fields else None
            for name, layout in (
                ("sK", k_rows_layout), ("sV", rows_layout), ("sKt", kt_layout),
                ("sQ", q_step_layout), ("sDO", step_layout), ("sQt", step_t_layout),
                ("sGt", step_t_layout), ("sDS", ds_layout),
            )
        ]  # fmt: skip
        sDQ = None
        sAmax = None
        sDqFac = None
        if const_expr(self.do_ds):
            # dŜ's tile as 32-bit words: the same swizzle (by row bytes) in 4-byte units
            ds_words_layout = sm90_utils.make_smem_layout(
                Int32, LayoutEnum.ROW_MAJOR, self.ds_words_shape, NUM_WG * self.ds_bufs
            )
            smem_tensors.append(
                storage.sDS.get_tensor(
                    ds_words_layout.outer, swizzle=ds_words_layout.inner, dtype=Int32
                )
            )
            # the same words unswizzled: the E4M3 codes' stores apply the 64-byte swizzle once
            # per thread (``ds_word0``), not once per store
            if const_expr(not self.bf16_dq and (
                ds_words_layout.inner != cute.make_swizzle(2, 4, 3) or self.step_q * 64 % 1024
            )):  # fmt: skip
                raise ValueError(f"dŜ's tile: {ds_words_layout.inner}, expected S<2,4,3> and "
                                 "whole KB buffers")  # fmt: skip
            ds_flat = cute.make_tensor(
                cute.recast_ptr(storage.sDS.data_ptr(), dtype=Int32),
                cute.make_layout(cute.size(ds_words_layout)),
            )
            sDQ = storage.sDQ.get_tensor(dq_layout)
            sAmax = storage.sAmax.get_tensor(amax_layout)
            # joint dQ: each warpgroup's dQ factors 2^eb·softmax_scale per (half, warpgroup,
            # parity)
            sDqFac = storage.sDqFac.get_tensor(cute.make_layout((2, NUM_WG, 2)))
        else:
            smem_tensors.append(None)
            ds_flat = None
        # (column pairs of statistics, 2^eQ per query, the halves' factors)
        sStats = tuple(
            getattr(storage, name).get_tensor(layout)
            for name, layout in zip(("sStats", "sQfac", "sHalfFac"), stats_layouts, strict=True)
        )
        smem_tensors += [sDqFac, ds_flat]
        pipes = (pipe_kv, pipe_step, pipe_stats)
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        cta_p = cute.arch.block_idx()[0]
        cta = cta_p // self.parts
        part = cta_p - cta * self.parts
        item = cta // self.heads_kv
        hk = cta - item * self.heads_kv
        if item < mCount[0]:
            doc = mItemDoc[item]
            doc_start = mCu[doc]
            item_ctx = dict(
                doc_start=doc_start, seqlen=mCu[doc + 1] - doc_start, vt_start=mVtStart[doc],
                key0=mItemTile[item] * TILE_N, hk=hk, part=part,
            )  # fmt: skip
            if warp_idx < 4:
                # the launch allocates 168 registers x 384 threads; 128·24 + 256·240 fits it
                # exactly (more for either side and setmaxnreg.inc waits forever)
                cute.arch.setmaxregister_decrease(24)
                if warp_idx == 0:
                    self.produce(
                        item_ctx, tmas, atoms, smem_tensors, pipes, sStats, (mQexp, mQsexp),
                        mDOexp, mGexp, mDelta, mM, mLSE, qk_scale,
                    )  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(240)
                self.consume(
                    item_ctx, mmas, smem_tensors, sDQ, sAmax, sStats, pipes, mFactors, mKexp,
                    mDQ, mDK, mDV, mDbg, softmax_scale,
                )  # fmt: skip

    @cute.jit
    def first_step(self, key0: Int32) -> Int32:
        """First query of the item's steps: the tile's first key (causal) or 0."""
        lo = Int32(0)
        if const_expr(self.causal):
            lo = key0
        return lo

    @cute.jit
    def produce(
        self, w, tmas, atoms, smem, pipes, sStats, q_exps, mDOexp, mGexp, mDelta, mM, mLSE,
        qk_scale,
    ):  # fmt: skip
        """TMA loads: the key tile once, then Q̂, dÔ, Q̂ᵀ, Ĝᵀ per head and step; and each
        step's per-query statistics, one query per lane, into shared memory (their global
        loads run ahead of the consumers with the stages)."""
        pipe_kv, pipe_step, pipe_stats = pipes
        tma_k, tma_v, tma_kt, tma_q, tma_do, tma_qt, tma_gt = tmas
        atom_k, atom_v, atom_kt, atom_q, atom_do, atom_qt, atom_gt = atoms
        sK, sV, sKt, sQ, sDO, sQt, sGt, _, _, _, _ = smem
        doc_start, vt_start, hk, key0 = w["doc_start"], w["vt_start"], w["hk"], w["key0"]
        halves = self.halves

        kv_bar = pipe_kv.sync_object_full.get_barrier(0)
        pipe_kv.producer_acquire_w_index_phase(0, Int32(1))
        load_k = _rows_copy(atom_k, tma_k, hk, (WG_KEYS, self.d), sK, doc_start)
        load_v = None
        if const_expr(self.do_ds):
            load_v = _rows_copy(atom_v, tma_v, hk, (WG_KEYS, self.d), sV, doc_start)
        for wg in cutlass.range_constexpr(NUM_WG):
            load_k(src_idx=key0 // WG_KEYS + wg, dst_idx=wg, tma_bar_ptr=kv_bar)
            if const_expr(self.do_ds):
                load_v(src_idx=key0 // WG_KEYS + wg, dst_idx=wg, tma_bar_ptr=kv_bar)
                for hf in cutlass.range_constexpr(halves):
                    kt_piece = w["part"] * halves + hf
                    if const_expr(self.bf16_dq):  # K·2^-eK rows, keys in order
                        load_kt = _rows_piece_copy(
                            atom_kt, tma_kt, hk, (WG_KEYS, 64), sKt, kt_piece, vt_start
                        )
                    else:
                        load_kt = _cols_copy(
                            atom_kt, tma_kt, hk, (64, WG_KEYS), sKt, kt_piece, vt_start
                        )
                    load_kt(
                        src_idx=key0 // WG_KEYS + wg, dst_idx=wg * halves + hf, tma_bar_ptr=kv_bar
                    )
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        lo = self.first_step(key0)
        n_steps = cute.ceil_div(w["seqlen"] - lo, self.step_q)
        for g in cutlass.range(self.group, unroll=1):
            h = hk * self.group + g
            load_q = _rows_copy(atom_q, tma_q, h, (self.step_q, self.d), sQ, doc_start)
            load_do = None
            if const_expr(self.do_ds):
                load_do = _rows_copy(atom_do, tma_do, h, (self.step_q, self.d), sDO, doc_start)
            copy_t = _rows_piece_copy if const_expr(self.bf16_kv) else _cols_copy
            # dK's B (Q rows: dS) and dV's B (Ĝ rows: dV) per piece
            loads_t = [
                (copy_t(atom_qt, tma_qt, h, self.kv_b_box, sQt, w["part"] * halves + hf, vt_start)
                 if self.do_ds else None,
                 copy_t(atom_gt, tma_gt, h, self.kv_b_box, sGt, w["part"] * halves + hf, vt_start)
                 if self.do_dv else None)
                for hf in range(halves)
            ]  # fmt: skip
            for i in cutlass.range(n_steps, unroll=1):
                pipe_step.producer_acquire(state)
                bar = pipe_step.producer_get_barrier(state)
                at = lo // self.step_q + i
                load_q(src_idx=at, dst_idx=state.index, tma_bar_ptr=bar)
                if const_expr(self.do_ds):
                    load_do(src_idx=at, dst_idx=state.index, tma_bar_ptr=bar)
                for hf in cutlass.range_constexpr(halves):
                    piece = state.index * halves + hf
                    if const_expr(self.do_ds):
                        loads_t[hf][0](src_idx=at, dst_idx=piece, tma_bar_ptr=bar)
                    if const_expr(self.do_dv):
                        loads_t[hf][1](src_idx=at, dst_idx=piece, tma_bar_ptr=bar)
                pipe_stats.producer_acquire(state)
                self.stage_stats(
                    w, h, lo + i * self.step_q, state.index, sStats, q_exps, mDOexp, mGexp, mDelta,
                    mM, mLSE, qk_scale,
                )  # fmt: skip
                pipe_stats.producer_commit(state)
                state.advance()

    @cute.jit
    def stage_stats(
        self, w, h, i0, idx, sStats, q_exps, mDOexp, mGexp, mDelta, mM, mLSE, qk_scale
    ):  # fmt: skip
        """This lane's query of each half of step ``i0`` (head ``h``): its factors into
        stage ``idx`` (the scores' ``qk_scale·2^eQ`` from ``q_exps[1]``, NVFP4's second level
        with ``qk_wide``; the products' ``2^eQ`` from ``q_exps[0]``); lanes 0..1 the halves'
        dÔ exponents (row 5 at ``hb``) and, with E4M3 dK/dV operands, lanes 2..3 Ĝ's (at
        ``2 + hb``) as factors (1 past the document)."""
        lane = cute.arch.lane_idx()
        doc_start = w["doc_start"]
        seqlen = w["seqlen"]
        n_halves = self.step_q // HALF
        mQexp, mQsexp = q_exps
        s_pairs, s_qfac, s_half = sStats
        for hb in cutlass.range_constexpr(n_halves):
            c = hb * HALF + lane
            q = i0 + c
            eq = Int32(0)
            eqs = Int32(0)
            m = Float32(0.0)
            lse = Float32(0.0)
            dl = Float32(0.0)
            if q < seqlen:
                tok = doc_start + q
                eq = Int32(mQexp[h, tok])
                eqs = Int32(mQsexp[h, tok]) if const_expr(self.qk_wide) else eq
                m = mM[tok, h]
                if const_expr(self.do_ds):
                    lse = mLSE[tok, h]
                    dl = mDelta[h, tok]
            # P̂'s statistics the same in every mode
            s_pairs[STAT_QK, c, idx] = pow2(eqs) * qk_scale
            s_pairs[STAT_REF, c, idx] = m - P_HAT_EXP
            if const_expr(self.do_ds):
                s_qfac[c, idx] = pow2(eq)
                s_pairs[STAT_F, c, idx] = cute.math.exp2(m - P_HAT_EXP - lse, fastmath=True)
                s_pairs[STAT_D, c, idx] = dl
        if const_expr(self.do_ds):  # (pass A reads no row 5)
            if lane < self.exp_lanes and lane % 2 < n_halves:  # (one half: lanes 0, 2)
                hb = lane % 2
                q = i0 + hb * HALF
                e = Int32(0)
                if q < seqlen:
                    if lane < 2:
                        e = Int32(mDOexp[h, doc_start + q])
                    else:
                        e = Int32(mGexp[h, w["vt_start"] + q])
                s_half[lane, idx] = pow2(e)

    @cute.jit
    def consume(
        self, w, mmas, smem, sDQ, sAmax, sStats, pipes, mFactors, mKexp, mDQ, mDK, mDV, mDbg,
        softmax_scale,
    ):  # fmt: skip
        """The two key warpgroups: every step of every head of the group, then dK/dV."""
        tiled_mma_s, tiled_mma_kv, tiled_mma_dq, tiled_mma_qk = mmas
        sK, sV, sKt, sQ, sDO, sQt, sGt, sDS, sDSw, sDqFac, sDSflat = smem
        pipe_kv, pipe_step, pipe_stats = pipes
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        t = tidx - wg * 128  # thread in its warpgroup
        thr_s = tiled_mma_s.get_slice(t)
        thr_kv = tiled_mma_kv.get_slice(t)
        wg_s = tiled_mma_s.get_slice(0)
        wg_kv = tiled_mma_kv.get_slice(0)
        wg_dq = tiled_mma_dq.get_slice(0)
        d = self.d
        wg_qk = tiled_mma_qk.get_slice(0)
        _, tSrK, tSrQ = sm90_utils.partition_fragment_ABC(wg_qk, (WG_KEYS, self.step_q, d), sK, sQ)
        # (pass modes: the other pass's operands are None)
        tPrV = tPrDO = frag_p = tVrG = frag_ds = tKrQ = tQrK = tQrS = None
        if const_expr(self.do_ds):
            _, tPrV, tPrDO = sm90_utils.partition_fragment_ABC(
                wg_s, (WG_KEYS, self.step_q, d), sV, sDO
            )
        # dV / dK / dQᵀ in 64-column pieces of the head dimension (B / A index: stage or
        # warpgroup · halves + piece)
        kv_shape = (WG_KEYS, 64, self.step_q)
        if const_expr(self.do_dv):
            if const_expr(self.bf16_kv):  # token-major tiles, read MN-major
                sGt = layout_utils.transpose_view(sGt)
            _, frag_p, tVrG = sm90_utils.partition_fragment_ABC(wg_kv, kv_shape, None, sGt)
        if const_expr(self.do_ds):
            if const_expr(self.bf16_kv):
                sQt = layout_utils.transpose_view(sQt)
            _, frag_ds, tKrQ = sm90_utils.partition_fragment_ABC(wg_kv, kv_shape, None, sQt)
            dq_shape = (64, self.step_q, WG_KEYS)
            if const_expr(self.bf16_dq):  # keys x head dim / keys x queries, read MN-major
                sKt, sDS = layout_utils.transpose_view(sKt), layout_utils.transpose_view(sDS)
            _, tQrK, tQrS = sm90_utils.partition_fragment_ABC(wg_dq, dq_shape, sKt, sDS)
        # a dQᵀ piece's accumulator to shared memory as it lies in registers: 16-byte stores,
        # thread t's n-th four values at 512·n + 4·t (consecutive threads, consecutive banks)
        dq_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout(128), cute.make_layout(DQ_VEC),
        )  # fmt: skip
        tDQs = []
        if const_expr(self.do_ds):
            tDQs = [
                dq_copy.get_slice(t).partition_D(sDQ[None, hf, wg])
                for hf in range(self.dq_pieces)
            ]
        # dK and dV pieces (parts), dV (dv) or dK (dkdq): 64x64 FP32 each
        acc_dk = []
        acc_dv = []
        for _hf in cutlass.range_constexpr(self.halves):
            if const_expr(self.do_ds):
                acc_dk.append(
                    cute.make_rmem_tensor(thr_kv.partition_shape_C((WG_KEYS, 64)), Float32)
                )
            if const_expr(self.do_dv):
                acc_dv.append(
                    cute.make_rmem_tensor(thr_kv.partition_shape_C((WG_KEYS, 64)), Float32)
                )
        # this thread's rows (keys) and columns (queries) of a step's score tile, in register
        # order (tCcS) and as (rows, columns) (tScS)
        tCcS = thr_s.partition_C(cute.make_identity_tensor((WG_KEYS, self.step_q)))
        tScS = layout_utils.reshape_acc_to_mn(tCcS)
        n_rows = cute.size(tScS, mode=[0])
        n_cols = cute.size(tScS, mode=[1])
        col0 = tScS[0, 0][1]
        warp = t // 32
        seqlen = w["seqlen"]
        key0 = w["key0"] + wg * WG_KEYS  # this warpgroup's first key
        hk = w["hk"]
        # per key row: 2^eK (scores), eV, 2^-eV, 2^eV; kdq: 2^eK of dQ's E4M3 K̂ (the scores'
        # with E4M3 Q/K)
        kfac = cute.make_rmem_tensor(n_rows, Float32)
        kdq = kfac
        if const_expr(self.qk_wide):
            kdq = cute.make_rmem_tensor(n_rows, Float32)
        ev = cute.make_rmem_tensor(n_rows, Float32)
        vinv = cute.make_rmem_tensor(n_rows, Float32)
        vfac = cute.make_rmem_tensor(n_rows, Float32)
        key = cute.make_rmem_tensor(n_rows, Int32)
        for r in cutlass.range_constexpr(n_rows):
            key[r] = key0 + tScS[r, 0][0]
            kfac[r] = Float32(0.0)
            ev[r] = Float32(0.0)
            vinv[r] = Float32(0.0)
            vfac[r] = Float32(0.0)
            if const_expr(self.qk_wide):
                kdq[r] = Float32(0.0)
            if key[r] < seqlen:
                col = w["vt_start"] + v_t_position(key[r])
                kfac[r] = mFactors[hk, 0, col]
                if const_expr(self.qk_wide):
                    kdq[r] = pow2(Int32(mKexp[hk, col]))
                ev[r] = mFactors[hk, 1, col]
                vinv[r] = mFactors[hk, 2, col]
                vfac[r] = pow2(Int32(ev[r]))
        for hf in cutlass.range_constexpr(len(acc_dk)):
            acc_dk[hf].fill(0.0)
        for hf in cutlass.range_constexpr(len(acc_dv)):
            acc_dv[hf].fill(0.0)
        pipe_kv.consumer_wait_w_index_phase(0, Int32(0))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        lo = self.first_step(w["key0"])
        n_steps = cute.ceil_div(seqlen - lo, self.step_q)
        # a warpgroup whose keys all lie past the document, or (causal) whose first key
        # follows every query of a step, only keeps the stages in step
        wg_live = key0 < seqlen
        # E4M3 dŜ: this thread's first word in buffer 0 (``step``: its word n holds the codes
        # of query col0 + odd + 8·n at keys k0 - odd, + 1, + 8, + 9 in the column layout's
        # order) and the byte permutation that builds its words. The words of a buffer are
        # 64-byte rows (swizzle S<2,4,3>: byte bits 4-5 XOR bits 7-8, the row's low three
        # bits); 8 rows further and other buffers (whole KBs) leave those bits alone, so the
        # swizzle is applied here once.
        ds_word0 = Int32(0)
        ds_sel = Int32(0)
        if const_expr(self.do_ds and not self.bf16_dq):
            odd = Int32(tScS[0, 0][0]) & 1
            ds_sel = Int32(0x6240) if odd == 0 else Int32(0x3715)
            ds_byte = (col0 + odd) * 64 + v_t_position(tScS[0, 0][0] - odd) // 4 * 4
            ds_word0 = (ds_byte ^ ((ds_byte >> 3) & 0x30)) >> 2
        ctx = dict(
            w=w, wg=wg, t=t, warp=warp, col0=col0, key=key, kfac=kfac, kdq=kdq, ev=ev, vinv=vinv,
            vfac=vfac, tScS=tScS, tCcS=tCcS, n_rows=n_rows, n_cols=n_cols, tSrK=tSrK, tSrQ=tSrQ,
            tPrV=tPrV, tPrDO=tPrDO, frag_p=frag_p, frag_ds=frag_ds, tVrG=tVrG, tKrQ=tKrQ,
            tQrK=tQrK, tQrS=tQrS, acc_dk=acc_dk, acc_dv=acc_dv, sDS=sDS, sDSw=sDSw,
            sDQ=sDQ, tDQs=tDQs, sAmax=sAmax, mmas=mmas, seqlen=seqlen, key0=key0,
            sDqFac=sDqFac, sDSflat=sDSflat, ds_word0=ds_word0, ds_sel=ds_sel,
        )  # fmt: skip
        other_key0 = w["key0"] + (1 - wg) * WG_KEYS  # the other warpgroup's first key
        for g in cutlass.range(self.group, unroll=1):
            h = hk * self.group + g
            for i in cutlass.range(n_steps, unroll=1):
                i0 = lo + i * self.step_q
                pipe_step.consumer_wait(state, pipe_step.consumer_try_wait(state))
                pipe_stats.consumer_wait(state, pipe_stats.consumer_try_wait(state))
                live = wg_live
                if const_expr(self.causal):
                    live = wg_live and i0 + self.step_q > key0
                # interior steps (every key and query inside the document; causal: every
                # query at or after every key) skip the per-element masks
                inside = i0 + self.step_q <= seqlen and key0 + WG_KEYS <= seqlen
                if const_expr(self.causal):
                    inside = inside and i0 >= key0 + WG_KEYS - 1
                parity = (g * n_steps + i) & 1
                other_live = other_key0 < seqlen
                if const_expr(self.causal):
                    other_live = other_live and i0 + self.step_q > other_key0
                if const_expr(not self.do_ds):  # pass A: no barrier, no dQ
                    if live and inside:
                        self.step_dv(ctx, state.index, h, i0, sStats, mDbg, False)
                    elif live:
                        self.step_dv(ctx, state.index, h, i0, sStats, mDbg, True)
                else:
                    if live and inside:
                        self.step(
                            ctx, state.index, h, i0, sStats, mDQ, mDbg, softmax_scale, False,
                            parity,
                        )  # fmt: skip
                    elif live:
                        self.step(
                            ctx, state.index, h, i0, sStats, mDQ, mDbg, softmax_scale, True,
                            parity,
                        )  # fmt: skip
                    elif other_live:  # only the other warpgroup's keys: its dŜ, my dQ piece
                        if const_expr(self.joint_dq):
                            self.dq_only(ctx, h, i0, mDQ, parity)
                pipe_stats.consumer_release(state)
                pipe_step.consumer_release(state)
                state.advance()
        if const_expr(self.do_ds):
            if t == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.store_dkv(ctx, thr_kv, mDK, mDV, softmax_scale)

    @cute.jit
    def rebuild_p(self, ctx, stage, h, i0, sStats, mDbg, masked: cutlass.Constexpr):
        """Sᵀ = K̂·Q̂ᵀ and P̂ rebuilt from it in place (E4M3 values in FP32), as the forward built
        it: the one code path of every mode, so both passes' P̂ are the same bits. With dS
        (parts, dkdq) dPᵀ = V̂·dÔᵀ is issued right after Sᵀ and left running; returns
        ``(acc_s, acc_dp)`` (``acc_dp`` None in pass A)."""
        tiled_mma_s, _, _, tiled_mma_qk = ctx["mmas"]
        w = ctx["w"]
        wg = ctx["wg"]
        doc_start = w["doc_start"]
        seqlen = ctx["seqlen"]
        n_rows, n_cols = ctx["n_rows"], ctx["n_cols"]
        acc_s = sm90_utils.gemm_zero_init(
            tiled_mma_qk, (WG_KEYS, self.step_q), ctx["tSrK"], ctx["tSrQ"], A_idx=wg, B_idx=stage,
            wg_wait=-1,
        )  # fmt: skip
        acc_dp = None
        if const_expr(self.do_ds):
            acc_dp = sm90_utils.gemm_zero_init(
                tiled_mma_s, (WG_KEYS, self.step_q), ctx["tPrV"], ctx["tPrDO"], A_idx=wg,
                B_idx=stage, wg_wait=-1,
            )  # fmt: skip
            warpgroup.wait_group(1)  # Sᵀ done; dPᵀ runs on while P̂ is rebuilt
        else:
            warpgroup.wait_group(0)
        s_mn = layout_utils.reshape_acc_to_mn(acc_s)
        # column by column: the query's statistics (staged in shared memory by the producer
        # warp) are read where they are used, so only two columns' stay in registers
        cols_per_half = n_cols // (self.step_q // HALF)
        for j in cutlass.range_constexpr(n_cols):
            c = ctx["col0"] + column_offset(j)
            q = i0 + c
            if const_expr(j % 2 == 0):
                pair = stats_pair(sStats[0], ctx["col0"], j, 0, stage)
            qfac = pair[j % 2]  # qk_scale · 2^eQ
            ref = pair[2 + j % 2]  # M − 8
            if const_expr(self.uniform_kfac and j % cols_per_half == 0):
                # one 2^eQ per half and 2^eK per warp: one product for the half (a query
                # past the document, whose factor differs, is masked)
                qk = sStats[0][STAT_QK, j // cols_per_half * HALF, stage] * ctx["kfac"][0]
            for r in cutlass.range_constexpr(n_rows):
                key = ctx["key"][r]
                if const_expr(not self.uniform_kfac):
                    qk = qfac * ctx["kfac"][r]
                y = s_mn[r, j] * qk + ctx["ev"][r]
                if const_expr(masked):
                    ok = key < seqlen and q < seqlen
                    if const_expr(self.causal):
                        ok = ok and q >= key
                    y = y if ok else -Float32.inf
                p = cute.math.exp2(y - ref, fastmath=True)
                if const_expr(self.debug_p):
                    if key < seqlen and q < seqlen:
                        mDbg[h, doc_start + q, doc_start + key] = p
                s_mn[r, j] = p
        # P̂'s values in place (E4M3 round trips by the hardware conversions, two values
        # each), then the A fragment of dV's products (k-block hb: half hb's queries)
        p8 = cute.make_rmem_tensor(cute.size(acc_s), FP8)
        p8.store(acc_s.load().to(FP8))
        acc_s.store(p8.load().to(Float32))
        return acc_s, acc_dp

    @cute.jit
    def step_dv(self, ctx, stage, h, i0, sStats, mDbg, masked: cutlass.Constexpr):
        """Pass A's step: P̂ (``rebuild_p``), then dV += P̂ᵀ·(Ĝ·2^eG) over every 64-column piece
        (BF16 ``wgmma``, A from registers), waited before the stage is released."""
        acc_s, _ = self.rebuild_p(ctx, stage, h, i0, sStats, mDbg, masked)
        frag_p = fa_utils.cvt_f16(layout_utils.reshape_acc_to_frgA(acc_s), BF16)
        self.accumulate_kv(ctx, ctx["acc_dv"], frag_p, ctx["tVrG"], stage)
        warpgroup.wait_group(0)

    @cute.jit
    def step(
        self, ctx, stage, h, i0, sStats, mDQ, mDbg, softmax_scale, masked: cutlass.Constexpr,
        parity,
    ):  # fmt: skip
        """One step (one or two 32-query halves) of one head for this warpgroup's 64 keys
        (``masked``: some keys or queries lie outside the document or, causal, a key
        follows a query)."""
        wg = ctx["wg"]
        n_rows, n_cols = ctx["n_rows"], ctx["n_cols"]
        n_halves = self.step_q // HALF
        cols_per_half = n_cols // n_halves  # a thread's columns of one half, in order
        halves = self.halves
        acc_s, acc_dp = self.rebuild_p(ctx, stage, h, i0, sStats, mDbg, masked)
        s_mn = layout_utils.reshape_acc_to_mn(acc_s)
        dp_mn = layout_utils.reshape_acc_to_mn(acc_dp)
        dv_order = []  # E4M3 dV products still to promote: (half, piece)
        if const_expr(self.bf16_kv):
            # dV += P̂ᵀ·(Ĝ·2^eG): BF16 A from the accumulator (P̂ exact), B the dequantized Ĝ
            # (exact in BF16), accumulated in the wgmma's FP32 accumulator across steps
            # (pass B: no dV)
            if const_expr(self.do_dv):
                frag_p = fa_utils.cvt_f16(layout_utils.reshape_acc_to_frgA(acc_s), BF16)
                self.accumulate_kv(ctx, ctx["acc_dv"], frag_p, ctx["tVrG"], stage)
        else:
            # dV += (P̂ᵀ·Ĝ)·2^eG per half and 64-column piece (E4M3: the column layout's
            # permutation makes the accumulator the A fragment), one product in flight while
            # the previous one is promoted
            accumulator_to_a(acc_s, ctx["frag_p"])
            dv_order = [(hb, hf) for hb in range(n_halves) for hf in range(halves)]
        acc_v = [None] * len(dv_order)

        def issue_dv(n):
            hb, hf = dv_order[n]
            acc_v[n] = self.issue_kv_piece(ctx, ctx["frag_p"], ctx["tVrG"], stage, hb, hf)

        def promote_dv(n):
            hb, hf = dv_order[n]
            warpgroup.wait_group(0)
            self.promote(ctx["acc_dv"][hf], acc_v[n], sStats[2][2 + hb, stage])
            if const_expr(n + 1 < len(dv_order)):
                issue_dv(n + 1)

        # dPᵀ done (BF16 dK/dV: the dV products just issued may still run)
        if const_expr(self.bf16_kv):
            warpgroup.wait_group(halves if self.do_dv else 0)
        else:
            warpgroup.wait_group(0)
        # dS in place of dP; amax of dS·2^eQ (dK's blocks) and dS·2^eK (dQ's) per half: the
        # power-of-two factors are applied to the column / row maxima of |dS| (with block
        # exponents both to one maximum). Where P̂ is 0, dS is 0: a select, so that a masked
        # key's or query's non-finite dP stays out; interior steps (one document, nothing
        # masked) leave that to the product, as the contract allows inside a document.
        s_pairs, s_qfac, s_half = sStats
        amax = [Float32(0.0)] * n_halves  # block exponents: max |dS| of the half (this thread)
        amax_k = [Float32(0.0)] * n_halves
        amax_q = [Float32(0.0)] * n_halves
        q_exp_fac = [Float32(1.0)] * n_halves  # block exponents: the half's 2^eQ
        for hb in cutlass.range_constexpr(n_halves):
            dp_fac = cute.make_rmem_tensor(n_rows, Float32)  # 2^eV · 2^e_dÔ per key row
            row_amax = cute.make_rmem_tensor(n_rows, Float32)
            do_fac = s_half[hb, stage]
            for r in cutlass.range_constexpr(n_rows):
                dp_fac[r] = ctx["vfac"][r] * do_fac
                row_amax[r] = Float32(0.0)
            for jj in cutlass.range_constexpr(cols_per_half):
                j = hb * cols_per_half + jj
                c = ctx["col0"] + column_offset(j)
                if const_expr(j % 2 == 0):
                    pair = stats_pair(s_pairs, ctx["col0"], j, 1, stage)
                f = pair[j % 2]  # 2^(M − 8 − lse)
                delta = pair[2 + j % 2]
                col_amax = Float32(0.0)
                for r in cutlass.range_constexpr(n_rows):
                    pv = s_mn[r, j]
                    ds = pv * ctx["vinv"][r] * f * (dp_mn[r, j] * dp_fac[r] - delta)
                    if const_expr(masked):
                        ds = Float32(0.0) if pv == Float32(0.0) else ds
                    dp_mn[r, j] = ds
                    if const_expr(self.block_exponents):
                        amax[hb] = fa_utils.fmax(amax[hb], abs(ds))
                    else:
                        col_amax = fa_utils.fmax(col_amax, abs(ds))
                        row_amax[r] = fa_utils.fmax(row_amax[r], abs(ds))
                if const_expr(not self.block_exponents):
                    amax_k[hb] = fa_utils.fmax(amax_k[hb], col_amax * s_qfac[c, stage])
            if const_expr(self.block_exponents):
                # a query past the document stages 2^0, its dS is 0: the half's first
                # query is inside the document whenever any of its dS is not 0
                q_exp_fac[hb] = s_qfac[hb * HALF, stage]
            else:
                for r in cutlass.range_constexpr(n_rows):
                    amax_q[hb] = fa_utils.fmax(amax_q[hb], row_amax[r] * ctx["kdq"][r])
        # (the first E4M3 dV product runs during the exponent exchange; issued earlier, it
        # would hold its accumulator beside P̂ and dS and spill)
        if const_expr(len(dv_order) > 0):
            issue_dv(0)
        # block exponents: dK per (dk_keys keys x half), dQ per (64 keys x half); with block
        # exponents one maximum per half is reduced and both factors applied after (exact)
        sAmax = ctx["sAmax"]
        warp = ctx["warp"]
        for hb in cutlass.range_constexpr(n_halves):
            if const_expr(self.block_exponents):
                amax[hb] = cute.arch.warp_reduction_max(amax[hb], threads_in_group=32)
                amax_k[hb] = amax[hb] * q_exp_fac[hb]
                amax_q[hb] = amax[hb] * ctx["kdq"][0]  # (row 0 is inside if any row is)
            else:
                amax_k[hb] = cute.arch.warp_reduction_max(amax_k[hb], threads_in_group=32)
                amax_q[hb] = cute.arch.warp_reduction_max(amax_q[hb], threads_in_group=32)
        if ctx["t"] % 32 == 0:
            for hb in cutlass.range_constexpr(n_halves):
                sAmax[0, hb, warp, wg] = amax_k[hb]
                sAmax[1, hb, warp, wg] = amax_q[hb]
        if const_expr(len(dv_order) > 0):
            promote_dv(0)
        cute.arch.barrier(barrier_id=_BAR_AMAX + wg, number_of_threads=128)
        # rows of a warp are 16 keys: a dK block of dk_keys keys spans dk_keys // 16 warps
        per_block = self.dk_keys // 16
        first = warp // per_block * per_block if const_expr(per_block > 1) else warp
        ek = [None] * n_halves
        eb = [None] * n_halves
        k_inv = [None] * n_halves
        b_inv = [None] * n_halves
        for hb in cutlass.range_constexpr(n_halves):
            block_amax = sAmax[0, hb, first, wg]
            for k in cutlass.range_constexpr(1, max(per_block, 1)):
                block_amax = fa_utils.fmax(block_amax, sAmax[0, hb, first + k, wg])
            tile_amax = fa_utils.fmax(
                fa_utils.fmax(sAmax[1, hb, 0, wg], sAmax[1, hb, 1, wg]),
                fa_utils.fmax(sAmax[1, hb, 2, wg], sAmax[1, hb, 3, wg]),
            )
            ek[hb] = e4m3_exponent(block_amax)
            eb[hb] = e4m3_exponent(tile_amax)
            # dŜ's scalings 2^-ek and 2^-eb, 0 for a block whose dS is all 0: its exponent is
            # -127, and 2^127 times the other factors can overflow (0 · inf is NaN)
            k_inv[hb] = Float32(0.0) if block_amax == Float32(0.0) else pow2(-ek[hb])
            b_inv[hb] = Float32(0.0) if tile_amax == Float32(0.0) else pow2(-eb[hb])
        # the rest of dV before dŜ is built (a product in flight beside P̂, dS and dŜ spills)
        for n in cutlass.range_constexpr(1, len(dv_order)):
            promote_dv(n)
        # dŜ for dK (registers, A fragment, in place of P̂) and dŜ for dQ (in place of dS,
        # then shared memory, transposed); products of powers of two: one multiply each
        for hb in cutlass.range_constexpr(n_halves):
            row_fac = cute.make_rmem_tensor(n_rows, Float32)  # 2^eK · 2^-eb
            for r in cutlass.range_constexpr(n_rows):
                row_fac[r] = ctx["kdq"][r] * b_inv[hb]
            half_fac = q_exp_fac[hb] * k_inv[hb]  # block exponents: 2^eQ · 2^-ek
            for jj in cutlass.range_constexpr(cols_per_half):
                j = hb * cols_per_half + jj
                col_fac = half_fac
                if const_expr(not self.block_exponents):
                    col_fac = s_qfac[ctx["col0"] + column_offset(j), stage] * k_inv[hb]
                for r in cutlass.range_constexpr(n_rows):
                    ds = dp_mn[r, j]
                    s_mn[r, j] = ds * col_fac
                    dp_mn[r, j] = ds * row_fac[r]
        frag_ds = ctx["frag_ds"]
        if const_expr(self.bf16_kv):
            # dK's A: dŜ (E4M3 round trip, hardware conversions) times its block's 2^ek, BF16
            ds_k8 = cute.make_rmem_tensor(cute.size(acc_s), FP8)
            ds_k8.store(acc_s.load().to(FP8))
            acc_s.store(ds_k8.load().to(Float32))
            for hb in cutlass.range_constexpr(n_halves):
                ek_f = pow2(ek[hb])
                for jj in cutlass.range_constexpr(cols_per_half):
                    j = hb * cols_per_half + jj
                    for r in cutlass.range_constexpr(n_rows):
                        s_mn[r, j] = s_mn[r, j] * ek_f
            frag_ds = fa_utils.cvt_f16(layout_utils.reshape_acc_to_frgA(acc_s), BF16)
            # dK's products run while dŜ goes to shared memory
            self.accumulate_kv(ctx, ctx["acc_dk"], frag_ds, ctx["tKrQ"], stage)
        else:
            accumulator_to_a(acc_s, frag_ds)  # dŜ's E4M3 codes (the 2^ek after the product)
        ds8 = cute.make_rmem_tensor(cute.size(acc_dp), FP8)
        ds8.store(acc_dp.load().to(FP8))
        # dŜ to shared memory as 32-bit words (at d = 128 byte stores were used while the FP8
        # dK/dV's promotion made the words spill; with BF16 dK/dV the words cut its stack from
        # 104 to 24 B and run ~10% faster, H200 2026-12-03): K̂ᵀ holds the keys in the column
        # layout order, where keys k, k+1, k+8, k+9 (k even) are four consecutive bytes of a
        # query's row. Word n of this thread's codes holds keys k0, k0+8 x queries 2n, 2n+1 of
        # its accumulator (k0 = its first key); the lane 4 apart holds k0 ± 1. The thread with
        # the even key writes the pair's word of the first query, the other the second's.
        sDS_w = ctx["sDSw"]
        ds_buf = wg
        if const_expr(self.joint_dq):
            ds_buf = parity * NUM_WG + wg
        if const_expr(self.bf16_dq):
            # BF16 dŜ (the E4M3 values just rounded, widened exactly), keys x queries, keys in
            # order as in K's rows: register values 2n, 2n + 1 are one key's queries 2m, 2m + 1,
            # one word
            acc_dp.store(ds8.load().to(Float32))
            tCcS = ctx["tCcS"]
            for n in cutlass.range_constexpr(cute.size(acc_dp) // 2):
                at = tCcS[2 * n]
                word = fa_utils.cvt_f16x2_f32(acc_dp[2 * n], acc_dp[2 * n + 1], BF16)
                sDS_w[at[0], at[1] // 2, ds_buf] = word
        else:
            ds_words = cute.recast_tensor(ds8, Int32)
            rows, per_row = self.ds_words_shape
            at = ctx["ds_word0"] + ds_buf * (rows * per_row)
            for n in cutlass.range_constexpr(n_cols // 2):
                mine = ds_words[n]
                other = cute.arch.shuffle_sync_bfly(mine, offset=4)
                word = Int32(cute.arch.prmt(mine, other, ctx["ds_sel"]))
                # (query col0 + odd + 8·n: register column 2·n is col0 + 8·n)
                ctx["sDSflat"][at + n * 8 * per_row] = word
        if ctx["t"] == 0:  # the previous dQ tile has left shared memory
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(self.joint_dq):
            sDqFac = ctx["sDqFac"]  # (written through a local: not through ctx in a branch)
            if ctx["t"] == 0:
                for hb in cutlass.range_constexpr(n_halves):
                    sDqFac[hb, wg, parity] = pow2(eb[hb]) * softmax_scale
            warpgroup.wait_group(0)  # dK's products done (their registers, see below)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=_BAR_DS_CTA, number_of_threads=256)
            self.dq_joint(ctx, h, i0, mDQ, parity)
        else:
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=_BAR_DS + wg, number_of_threads=128)
            self.dq_per_warpgroup(ctx, stage, h, i0, mDQ, eb, ek, frag_ds, softmax_scale)

    @cute.jit
    def dq_per_warpgroup(self, ctx, stage, h, i0, mDQ, eb, ek, frag_ds, softmax_scale) -> None:
        """dQ of this warpgroup's keys, all head-dim pieces (d = 64), and with E4M3 dK/dV the
        dK products: ``(dŜᵀ·Q̂)·2^ek`` per half, promoted, interleaved with the dQᵀ pieces."""
        wg = ctx["wg"]
        tiled_mma_dq = ctx["mmas"][2]
        halves = self.halves
        n_halves = self.step_q // HALF
        # (E4M3 dK/dV: dK += (dŜᵀ·Q̂)·2^ek per half) and dQᵀ = K̂ᵀ·dŜᵀ (both halves, each column
        # already scaled by its half's 2^-eb), in pieces of 64 head-dimension columns, two
        # products in flight
        dq_fac = [pow2(eb[hb]) * softmax_scale for hb in range(n_halves)]
        if const_expr(self.bf16_kv):
            # dK's products done before the dQᵀ pieces (see the joint form above)
            warpgroup.wait_group(0)
            order = [("q", 0, hf) for hf in range(halves)]
        else:
            # E4M3 dK products per half (promoted with its 2^ek) interleaved with dQᵀ's
            order = [
                item
                for hf in range(halves)
                for item in [("k", 0, hf), ("q", 0, hf)]
                + [("k", hb, hf) for hb in range(1, n_halves)]
            ]
        ek_fac = [pow2(ek[hb]) for hb in range(n_halves)]
        accs = [None] * len(order)

        def issue(n):
            kind, hb, hf = order[n]
            if const_expr(kind == "k"):
                accs[n] = self.issue_kv_piece(ctx, frag_ds, ctx["tKrQ"], stage, hb, hf)
            else:
                accs[n] = sm90_utils.gemm_zero_init(
                    tiled_mma_dq, (64, self.step_q), ctx["tQrK"], ctx["tQrS"],
                    A_idx=wg * halves + hf, B_idx=wg, wg_wait=-1,
                )  # fmt: skip

        def finish(n):
            kind, hb, hf = order[n]
            if const_expr(kind == "k"):
                self.promote(ctx["acc_dk"][hf], accs[n], ek_fac[hb])
            else:
                # value e of the fragment is query column 8·(e // 4) + …: its half's factor,
                # then the values in register order (``dq_fragment_index`` reads them back)
                acc = accs[n]
                per_half = cute.size(acc) // n_halves
                for e in cutlass.range_constexpr(cute.size(acc)):
                    acc[e] = acc[e] * dq_fac[e // per_half]
                _stage(acc, ctx["tDQs"][hf])

        depth = 2  # products in flight
        for n in cutlass.range_constexpr(depth):
            if const_expr(n < len(order)):
                issue(n)
        for n in cutlass.range_constexpr(len(order)):
            warpgroup.wait_group(depth - 1 if const_expr(n + depth - 1 < len(order)) else 0)
            finish(n)
            if const_expr(n + depth < len(order)):
                issue(n + depth)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_DQ + wg, number_of_threads=128)
        self.add_dq(
            ctx, ctx["sDQ"][None, None, wg], mDQ, h, i0,
            ctx["w"]["part"] * self.step_q * 64 * self.halves, self.step_q * 64 * self.halves,
        )

    @cute.jit
    def dq_only(self, ctx, h, i0, mDQ, parity) -> None:
        """Joint dQ in a step where only the other warpgroup's keys are live: this warpgroup's
        dŜ tile zero (factor 0), then its dQ piece from the other's."""
        wg = ctx["wg"]
        t = ctx["t"]
        sDS_w = ctx["sDSw"]
        rows, per_row = self.ds_words_shape
        for n in cutlass.range_constexpr(rows * per_row // 128):
            at = n * 128 + t
            sDS_w[at // per_row, at % per_row, parity * NUM_WG + wg] = Int32(0)
        sDqFac = ctx["sDqFac"]
        if t == 0:
            for hb in cutlass.range_constexpr(self.step_q // HALF):
                sDqFac[hb, wg, parity] = Float32(0.0)
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_DS_CTA, number_of_threads=256)
        self.dq_joint(ctx, h, i0, mDQ, parity)

    @cute.jit
    def dq_joint(self, ctx, h, i0, mDQ, parity) -> None:
        """dQ piece ``wg`` (64 head-dim columns) over both warpgroups' keys: 2^eb0·K̂ᵀ₀·dŜᵀ₀ +
        2^eb1·K̂ᵀ₁·dŜᵀ₁ (each 64-key block keeps its own exponents, as in the per-warpgroup
        form), staged and bulk-added once per CTA step (64·step FP32 values per warpgroup:
        16 KB at 64-query steps)."""
        wg = ctx["wg"]
        tiled_mma_dq = ctx["mmas"][2]
        n_halves = self.step_q // HALF
        dqp = self.dq_pieces  # this warpgroup's pieces: wg·dqp + p (parts: 1, dkdq: 2)
        # issued piece-major, one commit group per product
        accs = [
            [
                sm90_utils.gemm_zero_init(
                    tiled_mma_dq, (64, self.step_q), ctx["tQrK"], ctx["tQrS"],
                    A_idx=kb * self.halves + wg * dqp + p, B_idx=parity * NUM_WG + kb,
                    wg_wait=-1,
                )
                for kb in range(NUM_WG)
            ]
            for p in range(dqp)
        ]  # fmt: skip
        fac = [[ctx["sDqFac"][hb, kb, parity] for hb in range(n_halves)] for kb in range(NUM_WG)]
        for p in cutlass.range_constexpr(dqp):
            warpgroup.wait_group((dqp - 1 - p) * NUM_WG)  # piece p's products done
            acc = accs[p][0]
            per_half = cute.size(acc) // n_halves
            for e in cutlass.range_constexpr(cute.size(acc)):
                hb = e // per_half
                acc[e] = acc[e] * fac[0][hb] + accs[p][1][e] * fac[1][hb]
            _stage(acc, ctx["tDQs"][p])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=_BAR_DQ + wg, number_of_threads=128)
        piece = 64 * self.step_q
        # the pieces lie side by side in sDQ and in the step's block of dq_acc: one bulk add
        self.add_dq(
            ctx, ctx["sDQ"][None, None, wg], mDQ, h, i0,
            (ctx["w"]["part"] * self.halves + wg * dqp) * piece, dqp * piece,
        )  # fmt: skip

    @cute.jit
    def add_dq(self, ctx, src, mDQ, h, i0, offset, count) -> None:
        """``count`` staged FP32 values to the step's block of ``dq_acc`` from ``offset`` on, by
        one bulk reduce-add (queries past the document land in its own padding columns'
        block, never read back)."""
        if ctx["t"] == 0:
            copy_utils.cpasync_reduce_bulk_add_f32(
                src.iterator,
                mDQ[h, (ctx["w"]["vt_start"] + i0) // self.step_q, None].iterator + offset,
                count * 4,
            )  # fmt: skip
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def accumulate_kv(self, ctx, acc, frag_a, t_b, stage) -> None:
        """``acc[piece] += A·B[piece]`` for every 64-column piece of the head dimension: BF16
        ``wgmma`` (A in registers, B = the Ĝ or Q rows of ``stage``) into the FP32 dV or dK
        accumulators; issued, not waited."""
        for hf in cutlass.range_constexpr(self.halves):
            sm90_utils.gemm(
                ctx["mmas"][1], acc[hf], frag_a, t_b[None, None, None, stage * self.halves + hf],
                zero_init=False, wg_wait=-1,
            )  # fmt: skip

    @cute.jit
    def issue_kv_piece(self, ctx, frag_a, t_b, stage, hb, hf) -> cute.Tensor:
        """A half's dV or dK product for head-dimension columns ``64·hf ..``: keys x 64,
        contraction over half ``hb``'s queries (k-block ``hb`` of A = P̂ or dŜ in registers
        and of B = the Ĝᵀ or Q̂ᵀ piece of ``stage``); issued, not waited."""
        tiled_mma = ctx["mmas"][1]
        acc = cute.make_rmem_tensor(tiled_mma.partition_shape_C((WG_KEYS, 64)), Float32)
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, False)
        b = t_b[None, None, None, stage * self.halves + hf]
        cute.gemm(atom, acc, frag_a[None, None, hb], b[None, None, hb], acc)
        warpgroup.commit_group()
        return acc

    @cute.jit
    def promote(self, acc: cute.Tensor, part: cute.Tensor, scale: Float32) -> None:
        """``acc += part · scale`` (FP32: the per-step promotion of an FP8 product)."""
        for e in cutlass.range_constexpr(cute.size(acc)):
            acc[e] = acc[e] + part[e] * scale

    @cute.jit
    def store_dkv(self, ctx, thr_kv, mDK, mDV, softmax_scale):
        """dK·softmax_scale and dV·2^-eV in the output dtype, rows inside the document."""
        w = ctx["w"]
        tKcK = layout_utils.reshape_acc_to_mn(
            thr_kv.partition_C(cute.make_identity_tensor((WG_KEYS, 64)))
        )
        dk_pairs = cute.recast_tensor(mDK, Int32)
        dv_pairs = cute.recast_tensor(mDV, Int32)
        n_rows = cute.size(tKcK, mode=[0])
        n_cols = cute.size(tKcK, mode=[1])
        for hf in cutlass.range_constexpr(self.halves):
            dk_mn = None
            dv_mn = None
            if const_expr(self.do_ds):
                dk_mn = layout_utils.reshape_acc_to_mn(ctx["acc_dk"][hf])
            if const_expr(self.do_dv):
                dv_mn = layout_utils.reshape_acc_to_mn(ctx["acc_dv"][hf])
            for r in cutlass.range_constexpr(n_rows):
                key = ctx["key"][r]
                if key < ctx["seqlen"]:
                    tok = w["doc_start"] + key
                    vinv = ctx["vinv"][r]
                    for c in cutlass.range_constexpr(0, n_cols, 2):
                        at = ((w["part"] * self.halves + hf) * 64 + tKcK[0, c][1]) // 2
                        if const_expr(self.do_ds):
                            dk_pairs[tok, w["hk"], at] = fa_utils.cvt_f16x2_f32(
                                dk_mn[r, c] * softmax_scale, dk_mn[r, c + 1] * softmax_scale,
                                mDK.element_type,
                            )  # fmt: skip
                        if const_expr(self.do_dv):
                            dv_pairs[tok, w["hk"], at] = fa_utils.cvt_f16x2_f32(
                                dv_mn[r, c] * vinv, dv_mn[r, c + 1] * vinv, mDV.element_type
                            )


@cute.jit
def stats_pair(
    s_pairs: cute.Tensor, col0: Int32, j: cutlass.Constexpr, group: cutlass.Constexpr, stage
) -> cute.Tensor:
    """Statistics ``a = 2·group`` and ``b = 2·group + 1`` of a thread's columns ``c`` and
    ``c + 1`` (``c = col0 + column_offset(j)``, ``j`` and ``col0`` even) from one 16-byte
    load: ``(a_c, a_c+1, b_c, b_c+1)`` in registers."""
    step_q = cute.size(s_pairs, mode=[1])
    stages = cute.size(s_pairs, mode=[2])
    quads = cute.make_tensor(
        s_pairs.iterator,
        cute.make_layout((4, step_q // 2, 2, stages), stride=(1, 4, 2 * step_q, 4 * step_q)),
    )
    return copy_utils.load_s2r(quads[None, col0 // 2 + 4 * (j // 2), group, stage])


@cute.jit
def _stage(acc: cute.Tensor, dst: cute.Tensor) -> None:
    """A dQᵀ accumulator to its staging tile as it lies in registers (16-byte stores)."""
    cute.autovec_copy(cute.make_tensor(acc.iterator, cute.make_layout(dst.shape)), dst)


def _rows_copy(atom, tma, head, box, smem, doc_start):
    """TMA copy of token-major tiles of a document (source index: tile of the document)."""
    g = cute.local_tile(cute.domain_offset((doc_start, 0), tma[None, None, head]), box, (None, 0))
    return copy_utils.tma_get_copy_fn(atom, 0, cute.make_layout(1), g, smem)[0]


def _rows_piece_copy(atom, tma, head, box, smem, piece, first_row):
    """TMA copy of row tiles of a document from ``first_row`` on, head-dimension columns
    ``64·piece ..`` (source index: tile of the document)."""
    g = cute.local_tile(
        cute.domain_offset((first_row, 64 * piece), tma[None, None, head]), box, (None, 0)
    )
    return copy_utils.tma_get_copy_fn(atom, 0, cute.make_layout(1), g, smem)[0]


def _cols_copy(atom, tma, head, box, smem, piece, vt_start):
    """TMA copy of column-layout tiles, head-dimension rows ``64·piece ..`` (source index:
    column tile of the document)."""
    g = cute.local_tile(
        cute.domain_offset((64 * piece, vt_start), tma[None, None, head]), box, (0, None)
    )
    return copy_utils.tma_get_copy_fn(atom, 0, cute.make_layout(1), g, smem)[0]


_COMPILED: dict[tuple, object] = {}
#: head dims whose E4M3-Q/K backward (BF16 dK/dV) runs as two kernels, ``mode="dkdq"`` then
#: ``mode="dv"`` (one CTA per key tile each); the others run one kernel (``mode="parts"``;
#: at d = 256 two CTAs per key tile, each with half of dK/dV/dQ's columns)
PASS_HEAD_DIMS = frozenset({256})


def bwd_modes(d: int, wide: bool, bf16_kv: bool, bf16_dq: bool = False) -> tuple[str, ...]:
    """The kernels ``attn_bwd_sm90`` launches, in order: ``("dkdq", "dv")`` for E4M3 Q/K and
    BF16 dK/dV at a head dim in ``PASS_HEAD_DIMS``, else ``("parts",)`` (also with a BF16 dQ
    product, ``bf16_dq``: its BF16 K and dŜ tiles do not fit the dK/dQ pass's shared memory)."""
    if d in PASS_HEAD_DIMS and not wide and bf16_kv and not bf16_dq:
        return ("dkdq", "dv")
    return ("parts",)


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    """The debug pointer when no P̂ is asked for (never written)."""
    return torch.empty(1, 1, 1, dtype=torch.float32, device=device)


def _rows_by_column(values: torch.Tensor, qkv: KernelQKV) -> torch.Tensor:
    """BF16 ``[t_pad, H, d]``: token ``t``'s ``values`` ``[T, H, d]`` at row ``v_t_key`` of
    its column (each document's tokens in order), zeros elsewhere: what ``quantize_qkv`` /
    ``quantize_do`` write as ``q_rows`` / ``g_rows``, rebuilt by torch for operands quantized
    without them (slower: a fresh buffer and a scatter per call)."""
    rows = values.new_zeros((qkv.v_t.shape[2], *values.shape[1:]), dtype=torch.bfloat16)
    return rows.index_copy_(0, operands.v_t_key(qkv.key_columns()), values.to(torch.bfloat16))


def _kv_b_operands(
    qkv: KernelQKV, qdo: KernelDO, bf16_kv: bool
) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
    """dK's and dV's B operands as the kernel reads them: BF16 rows by column ``[t_pad, H,
    d]`` (``bf16_kv``; the quantizers' ``q_rows`` / ``g_rows``, else rebuilt from the codes)
    or the E4M3 column layout ``[d, t_pad, H]`` (``q_t`` / ``g_t``)."""
    if bf16_kv:
        q_rows = qkv.q_rows if qkv.q_rows is not None else _rows_by_column(qkv.q_codes, qkv)
        g_rows = qdo.g_rows
        if g_rows is None:
            if qdo.g_t is None:
                raise ValueError("qdo has neither g_rows nor g_t: quantize_do wrote no Ĝ")
            cols = qkv.key_columns()
            codes = rows_from_columns(qdo.g_t, cols)
            factor = exp2i(torch.index_select(qdo.g_exp.t(), 0, cols))
            g_values = codes.view(torch.float8_e4m3fn).float() * factor[..., None]
            g_rows = _rows_by_column(g_values, qkv)
        return (q_rows, 16), (g_rows, 16)
    if qkv.q_t is None or qdo.g_t is None:
        raise ValueError(
            f"the CuTe backward at head_dim {qkv.q_codes.shape[2]} reads qkv.q_t and qdo.g_t: "
            "quantize with q_transposed=True and quantize_do(..., g_columns=True)"
        )
    return (qkv.q_t.permute(1, 2, 0), 16), (qdo.g_t.permute(1, 2, 0), 16)


def attn_bwd_sm90_launch(
    qkv: KernelQKV,
    qdo: KernelDO,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    cu_seqlens: torch.Tensor,
    work: WorkList,
    *,
    heads_q: int,
    causal: bool,
    softmax_scale: float,
    qk_scale: float,
    dk_keys: int,
    out_dtype: torch.dtype,
    bf16_kv: bool,
    debug_p: torch.Tensor | None = None,
    num_stages: int = 2,
    workspace: PackWorkspace | None = None,
) -> tuple:
    """The CuTe backward prepared for ``ops.BwdLaunch`` (``ops.attn_bwd``'s contract: ``(dQ
    [T, Hq, d], dK, dV [T, Hkv, d])`` in ``out_dtype`` from quantized operands; ``work`` is a
    key-tile list with ``block_n = TILE_N``; the column layout's alignment must be a multiple
    of ``TILE_N``): ``(dq_acc, gather, kernels, finish, dk, dv, keepable)`` — the zeroed
    FP32 dQ accumulator, the token-major V gather (already run for this call: V codes from
    the column layout, into the workspace's buffer), the compiled kernels bound to their
    tensors (slots ``m``, ``lse``, ``dk``, ``dv``; one per pass), the dQ read-back, this
    call's dK/dV, and whether the prepared launch may run again (not when dK/dV's B operands
    were rebuilt here from this call's codes). ``bf16_kv``: dK/dV as BF16 products of
    ``q_rows``/``g_rows`` (else FP8 ones of ``q_t``/``g_t``, promoted). ``workspace``: the
    pack's, for the dQ accumulator and the token-major V codes. Operands quantized for
    ``grad_qk="input"`` (``qkv.grad_input``) run the BF16 dQ product of ``qkv.k_rows``
    (``bf16_dq``; ``bf16_kv`` then required: ``q_rows`` holds Q's input)."""
    total, heads_kv, d = qkv.k_codes.shape
    dev = qkv.k_codes.device
    q_in, k_in, q_score_exp = qkv.score_operands("CuTe backward")  # Sᵀ's
    wide = qkv.q4 is not None
    bf16_dq = qkv.grad_input
    if bf16_dq and (not bf16_kv or qkv.q_rows is None or qkv.k_rows is None):
        raise ValueError("grad_qk='input' on the CuTe backward needs bf16_kv, q_rows and k_rows")
    t_pad = qkv.v_t.shape[2]
    step = step_queries(d, wide, bf16_dq)
    dq_acc = zeroed_accumulator(workspace, (heads_q, t_pad // step, step * d), dev)
    dk = torch.empty(total, heads_kv, d, dtype=out_dtype, device=dev)
    dv = torch.empty_like(dk)
    v_shape = (total, heads_kv, d)  # token-major V codes, gathered from the column layout
    v_bytes = (
        workspace.empty("v_codes", v_shape, torch.uint8) if workspace is not None
        else torch.empty(v_shape, dtype=torch.uint8, device=dev)
    )  # fmt: skip
    cols = qkv.key_columns()
    tokens = pack_column_tokens(workspace, cols, qkv.column_align, t_pad)
    gather = rows_from_columns_launch(qkv.v_t, cols, v_bytes, tokens)
    gather()
    v_codes = v_bytes.view(torch.float8_e4m3fn)
    keepable = not bf16_kv or (qkv.q_rows is not None and qdo.g_rows is not None)
    q_b, g_b = _kv_b_operands(qkv, qdo, bf16_kv)
    dbg = debug_p if debug_p is not None else _placeholder(dev)
    m, lse = m_rows.contiguous(), lse_rows.contiguous()
    aligned = (
        (q_in, 16), (k_in, 16), (v_codes, 16), (qdo.do_codes, 16),
        q_b, (qkv.k_rows, 16) if bf16_dq else (qkv.k_t.permute(1, 2, 0), 16), g_b,
        (qkv.q_exp.t(), 4),
        (q_score_exp, 4), (qkv.k_exp, 4), (qkv.kv_factors, 16),
        (qdo.do_exp.t(), 4), (qdo.g_exp, 4), (qdo.delta.t(), 4), (m, 4),
        (lse, 4), (cu_seqlens, 4), (qkv.doc_v_t_start, 4), (work.doc, 4),
        (work.tile, 4), (work.count, 4), (dq_acc, 16), (dk, 16), (dv, 16), (dbg, 4),
    )  # fmt: skip
    block_exponents = qkv.k_exp_block % HALF == 0  # Q/K share the block (1: per token)
    tensors = kernel_tensors(aligned) if total else []
    slots = {"m": m, "lse": lse, "dk": dk, "dv": dv}
    kernels = []
    # P̂ for debug_p: every kernel writes it (both passes rebuild the same bits; a GPU test
    # runs each pass alone and compares)
    debug = debug_p is not None
    for mode in bwd_modes(d, wide, bf16_kv, bf16_dq):
        key = (d, heads_q, heads_kv, causal, dk_keys, num_stages, debug, out_dtype, wide,
               bf16_kv, block_exponents, mode, bf16_dq)  # fmt: skip
        if key not in _COMPILED:
            kernel = FlamiaBwdSm90(
                d, heads_q, heads_kv, causal, dk_keys, num_stages, debug, wide, bf16_kv,
                block_exponents, mode=mode, bf16_dq=bf16_dq,
            )
            _COMPILED[key] = compile_kernel(
                kernel, aligned, Float32(qk_scale), Float32(softmax_scale), Int32(1)
            )
        if total:
            args = [*tensors, qk_scale, softmax_scale, work.num_slots * heads_kv]
            kernels.append(BoundCall(_COMPILED[key], args, slots, fixed=ffi_tensor))
    at = pack_constant(  # where dq_acc holds each token's dQ (the pack fixes it)
        workspace, ("dq_index", step, d),
        lambda: dq_fragment_index(operands.v_t_key(cols), step, d),
    )  # fmt: skip
    finish = DQReadBack(dq_acc, at, d, out_dtype)
    return dq_acc, gather, kernels, finish, dk, dv, keepable
