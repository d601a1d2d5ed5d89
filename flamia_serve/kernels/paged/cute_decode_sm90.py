"""NVFP4-cache decode for Hopper (sm_90) in CuTe DSL: the fast path of the paged decode.

Same numerics as the Triton kernel beside it (``paged/triton.py``; twin
``reference.paged.paged_attention``) for one new token per sequence with ``exact``
exponentials: Q in FP16 scaled by a power of two per head (``|q| ≤ 2^15``), the cache's
E2M1 codes times their E4M3 block scale widened exactly to FP16, ``S = Q16·K16`` and
``O += P̂16·V16`` with FP32 accumulation, ``P̂ = E4M3(2^(x − M + 8))`` for an integer
running maximum ``M``, the normaliser summing P̂ itself.

Design (``mma.sync m16n8k16``, no shared memory in the key loop): one CTA per (sequence,
KV head, key split); each of its ``WARPS`` warps takes every ``WARPS``-th 16-key tile of
the split (a tile lies inside one page) with its own online softmax, and the warps merge
through shared memory at the end, as split-K partials do. The GQA group (at most 16 heads)
fills the MMA's 16 rows. Each thread loads its own bytes of K and V straight into
registers and widens them into MMA fragments (thread ``(g, t)`` = lane ``(4g + t)``):

* K is the B operand of ``S = Q·Kᵀ`` (n = key): thread ``(g, t)`` holds key ``g``'s
  elements ``[t·d/4, (t+1)·d/4)`` (one 16-byte load at d = 128); Q's A fragments take the
  head dimension in the same permuted order (a dot product does not care about it);
* V is the B operand of ``O = P̂·V`` (k = key, n = head column): thread ``(g, t)`` holds
  keys ``2t, 2t+1, 2t+8, 2t+9``, elements ``[g·d/8, (g+1)·d/8)`` (8-byte loads at d = 128);
  n-tile ``j`` column ``n`` is head column ``n·d/8 + j``, put back in order when O is stored;
* an E2M1 nibble ``s e1 e0 m`` becomes the E4M3 byte ``s 0 0 e1 e0 m 0 0`` (its value
  times 2^-6), two of which ``cvt.rn.f16x2.e4m3x2`` widens at once; times the block scale
  ·2^6 in FP16 (exact: at most 7 significant bits within [2^-10, 2688]).

Loads run one tile ahead and block-table entries two tiles ahead. Requires
``nvidia-cutlass-dsl`` and ``flash-attn-4``; imported lazily by ``ops`` on sm_90 only.
"""

from __future__ import annotations

import functools

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from flash_attn.cute import utils as fa_utils

from flamia_serve.kernels.cute_sm90_common import compile_kernel, kernel_tensors, pow2
from flamia_serve.numerics.formats import P_HAT_EXP

#: warps per CTA, keys per warp step (one k-block of P̂·V), MMA rows (the GQA group)
WARPS = 4
TILE = 16
ROWS = 16
NO_MAX = -1073741824.0  # running-maximum sentinel (-2^30), as the Triton kernel's
#: 2^15: the FP16 row maximum of Q (reference.Q_FP16_MAX)
Q16_EXP = 15
P_SCALE = float(2**P_HAT_EXP)


# ---------------------------------------------------------------- PTX helpers
def _asm(result, args, text: str, constraints: str):
    return llvm.inline_asm(
        result, args, text, constraints, has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


def _fields(res, ty, n: int, loc, ip) -> list:
    mlir = T.i32() if ty is Int32 else T.f32()
    return [ty(llvm.extractvalue(mlir, res, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def load_words(addr: Int64, n: int, *, loc=None, ip=None) -> list[Int32]:
    """``n`` (1, 2 or 4) 32-bit words at global byte address ``addr`` (aligned to ``4n``),
    through the read-only path."""
    a = Int64(addr).ir_value(loc=loc, ip=ip)
    if n == 1:
        return [Int32(_asm(T.i32(), [a], "ld.global.nc.u32 $0, [$1];", "=r,l"))]
    regs = ", ".join(f"${i}" for i in range(n))
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * n), [a],
        f"ld.global.nc.v{n}.u32 {{{regs}}}, [${n}];", ",".join(["=r"] * n) + ",l",
    )  # fmt: skip
    return _fields(res, Int32, n, loc, ip)


@dsl_user_op
def load_bytes(addr: Int64, n: int, *, loc=None, ip=None) -> Int32:
    """``n`` (1, 2 or 4) bytes at global address ``addr`` (aligned to ``n``), zero-extended."""
    if n == 4:
        return load_words(addr, 1, loc=loc, ip=ip)[0]
    ty = "u8" if n == 1 else "u16"
    return Int32(_asm(
        T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)],
        f"{{ .reg .b16 t; ld.global.nc.{ty} t, [$1]; cvt.u32.u16 $0, t; }}", "=r,l",
    ))  # fmt: skip


@dsl_user_op
def mma_f16(a: list, b: list, c: list, *, loc=None, ip=None) -> list[Float32]:
    """``D = A·B + C`` of ``mma.sync m16n8k16`` (A: four f16x2, B: two f16x2, C/D: four f32)."""
    args = [Int32(x).ir_value(loc=loc, ip=ip) for x in (*a, *b)]
    args += [Float32(x).ir_value(loc=loc, ip=ip) for x in c]
    res = _asm(
        llvm.StructType.get_literal([T.f32()] * 4), args,
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
        "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
    )  # fmt: skip
    return _fields(res, Float32, 4, loc, ip)


# an E2M1 nibble s e1 e0 m -> the E4M3 byte s 0 0 e1 e0 m 0 0 (value · 2^-6), four bytes at
# once: "lo" from the low (even-element) nibbles, "hi" from the high ones
_REENCODE = (
    "shl.b32 t0, {w}, 2; and.b32 t0, t0, 0x1C1C1C1C; shl.b32 t1, {w}, 4; "
    "and.b32 t1, t1, 0x80808080; or.b32 {lo}, t0, t1; "
    "shr.b32 t0, {w}, 2; and.b32 t0, t0, 0x1C1C1C1C; and.b32 t1, {w}, 0x80808080; "
    "or.b32 {hi}, t0, t1; "
)


@dsl_user_op
def e2m1_word(w: Int32, *, loc=None, ip=None) -> list[Int32]:
    """Eight E2M1 codes (one word, element ``e`` in nibble ``e``) as four f16x2 of their
    values · 2^-6: elements (0, 2), (4, 6), (1, 3), (5, 7)."""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(w).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 t0, t1, lo, hi; .reg .b16 a, b, c, d; "
        + _REENCODE.format(w="$4", lo="lo", hi="hi")
        + "mov.b32 {a, b}, lo; cvt.rn.f16x2.e4m3x2 $0, a; cvt.rn.f16x2.e4m3x2 $1, b; "
        "mov.b32 {c, d}, hi; cvt.rn.f16x2.e4m3x2 $2, c; cvt.rn.f16x2.e4m3x2 $3, d; }",
        "=r,=r,=r,=r,r",
    )  # fmt: skip
    return _fields(res, Int32, 4, loc, ip)


@dsl_user_op
def e2m1_word_pair(wa: Int32, wb: Int32, *, loc=None, ip=None) -> list[Int32]:
    """The same element of two keys' words as one f16x2 (key ``a`` low): eight registers,
    element 0..7 in order, values · 2^-6."""
    res = _asm(
        llvm.StructType.get_literal([T.i32()] * 8),
        [Int32(w).ir_value(loc=loc, ip=ip) for w in (wa, wb)],
        "{ .reg .b32 t0, t1, la, ha, lb, hb, x; .reg .b16 p, q; "
        + _REENCODE.format(w="$8", lo="la", hi="ha")
        + _REENCODE.format(w="$9", lo="lb", hi="hb")
        + "prmt.b32 x, la, lb, 0x5140; mov.b32 {p, q}, x; "
        "cvt.rn.f16x2.e4m3x2 $0, p; cvt.rn.f16x2.e4m3x2 $2, q; "
        "prmt.b32 x, la, lb, 0x7362; mov.b32 {p, q}, x; "
        "cvt.rn.f16x2.e4m3x2 $4, p; cvt.rn.f16x2.e4m3x2 $6, q; "
        "prmt.b32 x, ha, hb, 0x5140; mov.b32 {p, q}, x; "
        "cvt.rn.f16x2.e4m3x2 $1, p; cvt.rn.f16x2.e4m3x2 $3, q; "
        "prmt.b32 x, ha, hb, 0x7362; mov.b32 {p, q}, x; "
        "cvt.rn.f16x2.e4m3x2 $5, p; cvt.rn.f16x2.e4m3x2 $7, q; }",
        ",".join(["=r"] * 8) + ",r,r",
    )  # fmt: skip
    return _fields(res, Int32, 8, loc, ip)


@dsl_user_op
def scale_pair(sa: Int32, sb: Int32, byte: int, *, loc=None, ip=None) -> Int32:
    """f16x2 of E4M3 byte ``byte`` of ``sa`` (low) and of ``sb`` (high), each · 2^6."""
    sel = byte | ((4 + byte) << 4)
    return Int32(_asm(
        T.i32(), [Int32(s).ir_value(loc=loc, ip=ip) for s in (sa, sb)],
        f"{{ .reg .b32 x, y, k; .reg .b16 p, q; prmt.b32 x, $1, $2, {sel}; mov.b32 {{p, q}}, x; "
        "cvt.rn.f16x2.e4m3x2 y, p; mov.b32 k, 0x54005400; mul.rn.f16x2 $0, y, k; }",
        "=r,r,r",
    ))  # fmt: skip


@dsl_user_op
def hmul2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """f16x2 product (exact here: the operands' significands fit FP16's together)."""
    return Int32(_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b)],
        "mul.rn.f16x2 $0, $1, $2;", "=r,r,r",
    ))  # fmt: skip


@dsl_user_op
def p_hat_pair(p0: Float32, p1: Float32, *, loc=None, ip=None) -> Int32:
    """f16x2 of ``E4M3(p0)``, ``E4M3(p1)`` (RNE, saturating), ``p0`` low."""
    return Int32(_asm(
        T.i32(), [Float32(p).ir_value(loc=loc, ip=ip) for p in (p0, p1)],
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.rn.f16x2.e4m3x2 $0, t; }",
        "=r,f,f",
    ))  # fmt: skip


@dsl_user_op
def f16_pair_sum(x: Int32, *, loc=None, ip=None) -> Float32:
    """float32 sum of an f16x2's two values."""
    return Float32(_asm(
        T.f32(), [Int32(x).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 a, b; .reg .f32 u, v; mov.b32 {a, b}, $1; cvt.f32.f16 u, a; "
        "cvt.f32.f16 v, b; add.f32 $0, u, v; }", "=f,r",
    ))  # fmt: skip


@dsl_user_op
def ceil_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
                        "cvt.rpi.f32.f32 $0, $1;", "=f,f"))  # fmt: skip


@cute.jit
def q16_exponent(amax: Float32) -> Int32:
    """int32 ``ceil(log2(amax / 2^15))`` clamped to [-127, 127], -127 for zero (the Triton
    kernel's ``pow2_exponent_ceil(amax, 15, 0)``)."""
    bits = amax.bitcast(Int32)
    ea = ((bits >> 23) & 0xFF) - 127
    e = ea - Q16_EXP
    e = e + 1 if (bits & 0x7FFFFF) > 0 else e
    e = Int32(-127) if ea == -127 else e
    e = Int32(-127) if e < -127 else e
    return Int32(127) if e > 127 else e


# ---------------------------------------------------------------- kernel
class NvFP4DecodeSm90:
    """Compiled once per (head dim, KV heads, GQA group, page size, partial output, output
    dtype)."""

    def __init__(self, head_dim: int, heads_kv: int, group: int, page_size: int,
                 partial: bool) -> None:  # fmt: skip
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {head_dim}: the CuTe decode supports 64, 128 and 256")
        if not 1 <= group <= ROWS:
            raise ValueError(f"GQA group {group}: the CuTe decode supports 1 to {ROWS}")
        if page_size % TILE:
            raise ValueError(f"page_size {page_size}: the CuTe decode needs a multiple of {TILE}")
        self.d = head_dim
        self.heads_kv = heads_kv
        self.group = group
        self.page = page_size
        self.partial = partial
        self.k_words = head_dim // 32  # K words per thread and key
        self.v_words = max(1, head_dim // 64)  # V words per thread and key
        self.k_scale_bytes = head_dim // 64
        self.v_scale_bytes = max(1, head_dim // 128)
        self.code_bytes = head_dim // 2
        self.scale_bytes = head_dim // 16
        self.region = page_size * (self.code_bytes + self.scale_bytes)
        self.scale_base = page_size * self.code_bytes

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, Hq, d) bf16/fp16
        mCache: cute.Tensor,  # (blocks, 2, Hkv, region) uint8
        mBT: cute.Tensor,  # (B, pages) int32
        mSeqLens: cute.Tensor,  # (B,) int32
        mQsl: cute.Tensor,  # (B+1,) int32
        mOut: cute.Tensor,  # (T, Hq, d) bf16/fp16
        mPartO: cute.Tensor,  # (rows·Hq·d,) f32
        mPartML: cute.Tensor,  # (rows·Hq·2,) f32
        qk_scale: Float32,
        num_splits: Int32,
        part_tokens: Int32,
        num_decodes: Int32,
        stream: cuda.CUstream,
    ):
        @cute.struct
        class Storage:
            sO: cute.struct.MemRange[Float32, WARPS * self.group * self.d]
            sM: cute.struct.MemRange[Float32, WARPS * self.group]
            sL: cute.struct.MemRange[Float32, WARPS * self.group]

        self.kernel(
            mQ, mCache, mBT, mSeqLens, mQsl, mOut, mPartO, mPartML, qk_scale, num_splits,
            part_tokens, Storage,
        ).launch(
            grid=[num_decodes, self.heads_kv, num_splits], block=[32 * WARPS, 1, 1],
            stream=stream,
        )  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mCache: cute.Tensor,
        mBT: cute.Tensor,
        mSeqLens: cute.Tensor,
        mQsl: cute.Tensor,
        mOut: cute.Tensor,
        mPartO: cute.Tensor,
        mPartML: cute.Tensor,
        qk_scale: Float32,
        num_splits: Int32,
        part_tokens: Int32,
        Storage: cutlass.Constexpr,
    ):
        d, group = self.d, self.group
        seq, kvh, split = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4
        t = lane % 4
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        sO = storage.sO.get_tensor(cute.make_layout((WARPS, group, d), stride=(group * d, d, 1)))
        sM = storage.sM.get_tensor(cute.make_layout((WARPS, group), stride=(group, 1)))
        sL = storage.sL.get_tensor(cute.make_layout((WARPS, group), stride=(group, 1)))

        q_start = mQsl[seq]
        q_len = mQsl[seq + 1] - q_start
        if q_len > 0:
            kv_hi = mSeqLens[seq] - q_len + 1
            n_tiles = (kv_hi + TILE - 1) // TILE
            per_split = (n_tiles + num_splits - 1) // num_splits
            t_begin = split * per_split
            t_end = cutlass.min(t_begin + per_split, n_tiles)
            first = t_begin + warp
            n_it = Int32(0)
            if first < t_end:
                n_it = (t_end - first + WARPS - 1) // WARPS
            # Q: rows g and g + 8 (heads of the group), this thread's head columns, FP16
            # scaled by 2^-eq per row; A fragments in the K fragments' column order
            two_halves = const_expr(group > 8)
            row_scale = cute.make_rmem_tensor(2, Float32)
            qa = []  # per 16-column chunk: (a0, a1, a2, a3)
            q_rows = []
            for rh in cutlass.range_constexpr(2 if two_halves else 1):
                row = g + 8 * rh
                vals = cute.make_rmem_tensor(d // 4, Float32)
                amax = Float32(0.0)
                for e in cutlass.range_constexpr(d // 4):
                    vals[e] = Float32(0.0)
                    if row < group:
                        vals[e] = mQ[q_start, kvh * group + row, t * (d // 4) + e].to(Float32)
                    amax = fa_utils.fmax(amax, abs(vals[e]))
                for k in cutlass.range_constexpr(2):
                    amax = fa_utils.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << k))
                eq = q16_exponent(amax)
                inv = pow2(0 - eq)
                row_scale[rh] = qk_scale * pow2(eq)
                pairs = []
                for c in cutlass.range_constexpr(d // 16):
                    e0 = 8 * (c // 2) + 4 * (c % 2)
                    pairs.append((
                        fa_utils.cvt_f16x2_f32(vals[e0] * inv, vals[e0 + 2] * inv, cutlass.Float16),
                        fa_utils.cvt_f16x2_f32(vals[e0 + 1] * inv, vals[e0 + 3] * inv,
                                               cutlass.Float16),
                    ))  # fmt: skip
                q_rows.append(pairs)
            zero = Int32(0)
            for c in cutlass.range_constexpr(d // 16):
                hi = q_rows[1][c] if const_expr(two_halves) else (zero, zero)
                qa.append((q_rows[0][c][0], hi[0], q_rows[0][c][1], hi[1]))

            acc = cute.make_rmem_tensor((d // 8, 4), Float32)
            acc.fill(0.0)
            m_run = cute.make_rmem_tensor(2, Float32)
            m_run.fill(NO_MAX)
            l_run = cute.make_rmem_tensor(2, Float32)
            l_run.fill(0.0)
            n_raw = 2 * self.k_words + 2 + 4 * self.v_words + 4
            raw = cute.make_rmem_tensor(n_raw, Int32)
            blk_ahead = cute.make_rmem_tensor(1, Int32)
            base = mCache.iterator.toint()
            if n_it > 0:
                self.load_tile(raw, base, first, mBT[seq, first * TILE // self.page], kvh, g, t)
            if n_it > 1:
                blk_ahead[0] = mBT[seq, (first + WARPS) * TILE // self.page]
            for it in cutlass.range(n_it, unroll=1):
                tile = first + it * WARPS
                cur = []
                for i in cutlass.range_constexpr(n_raw):
                    cur.append(raw[i])
                if it + 1 < n_it:
                    self.load_tile(raw, base, tile + WARPS, blk_ahead[0], kvh, g, t)
                if it + 2 < n_it:
                    blk_ahead[0] = mBT[seq, (tile + 2 * WARPS) * TILE // self.page]
                self.attend(cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t,
                            two_halves)  # fmt: skip

            # merge the warps' partials through shared memory
            for rh in cutlass.range_constexpr(2 if two_halves else 1):
                for k in cutlass.range_constexpr(2):
                    l_run[rh] = l_run[rh] + cute.arch.shuffle_sync_bfly(l_run[rh], offset=1 << k)
                row = g + 8 * rh
                if row < group:
                    if t == 0:
                        sM[warp, row] = m_run[rh]
                        sL[warp, row] = l_run[rh]
                    for j in cutlass.range_constexpr(d // 8):
                        sO[warp, row, 2 * t * (d // 8) + j] = acc[j, 2 * rh]
                        sO[warp, row, (2 * t + 1) * (d // 8) + j] = acc[j, 2 * rh + 1]
            cute.arch.barrier()
            tid = warp * 32 + lane
            for k in cutlass.range_constexpr((group * d + 32 * WARPS - 1) // (32 * WARPS)):
                idx = tid + k * 32 * WARPS
                if idx < group * d:
                    self.store_row_value(sO, sM, sL, idx, q_start, kvh, split, part_tokens,
                                         mOut, mPartO, mPartML)  # fmt: skip

    @cute.jit
    def load_tile(self, raw, base: Int64, tile: Int32, blk: Int32, kvh: Int32, g, t):
        """This thread's code words and scale bytes of ``tile`` (in page ``blk``) into
        ``raw``: K (keys g, g + 8), K scales, V (keys 2t, 2t+1, 2t+8, 2t+9), V scales."""
        d = self.d
        off0 = tile * TILE % self.page
        k_region = base + ((Int64(blk) * 2) * self.heads_kv + kvh) * self.region
        v_region = base + ((Int64(blk) * 2 + 1) * self.heads_kv + kvh) * self.region
        kw, vw = self.k_words, self.v_words
        for j in cutlass.range_constexpr(2):
            off = off0 + 8 * j + g
            at = k_region + off * self.code_bytes + t * (d // 8)
            for p in cutlass.range_constexpr((kw + 3) // 4):
                words = load_words(at + 16 * p, min(4, kw))
                for i in cutlass.range_constexpr(min(4, kw)):
                    raw[j * kw + 4 * p + i] = words[i]
            raw[2 * kw + j] = load_bytes(
                k_region + self.scale_base + off * self.scale_bytes + t * self.k_scale_bytes,
                self.k_scale_bytes,
            )
        for k in cutlass.range_constexpr(4):
            off = off0 + 2 * t + k % 2 + 8 * (k // 2)
            words = load_words(v_region + off * self.code_bytes + g * (d // 16), vw)
            for i in cutlass.range_constexpr(vw):
                raw[2 * kw + 2 + k * vw + i] = words[i]
            raw[2 * kw + 2 + 4 * vw + k] = load_bytes(
                v_region + self.scale_base + off * self.scale_bytes + g * d // 128,
                self.v_scale_bytes,
            )

    @cute.jit
    def attend(self, cur, tile, kv_hi, qa, row_scale, acc, m_run, l_run, t, two_halves):
        """One 16-key tile of the warp's online softmax from its loaded ``cur`` words."""
        d = self.d
        kw, vw = self.k_words, self.v_words
        key0 = tile * TILE
        # S = Q·Kᵀ: n-tile j holds keys 8j .. 8j+7 of the tile
        s = []
        for j in cutlass.range_constexpr(2):
            c_frag = [Float32(0.0)] * 4
            k_scales = cur[2 * kw + j]
            for i in cutlass.range_constexpr(kw):
                sc = scale_pair(k_scales, k_scales, i // 2)
                r = e2m1_word(cur[j * kw + i])
                for h in cutlass.range_constexpr(2):
                    b = (hmul2(r[h], sc), hmul2(r[2 + h], sc))
                    c_frag = mma_f16(qa[2 * i + h], b, c_frag)
            s.append(c_frag)
        # keys of this thread's scores: (n-tile j, column 2t + u) = key 8j + 2t + u
        a_frag = [Int32(0)] * 4
        rows = 2 if const_expr(two_halves) else 1
        m_new = cute.make_rmem_tensor(2, Float32)
        x = cute.make_rmem_tensor((2, 4), Float32)
        grow = Float32(0.0)  # the largest rise of a running maximum
        for rh in cutlass.range_constexpr(rows):
            tmax = Float32(-Float32.inf)
            for j in cutlass.range_constexpr(2):
                for u in cutlass.range_constexpr(2):
                    v = s[j][2 * rh + u] * row_scale[rh]
                    v = v if key0 + 8 * j + 2 * t + u < kv_hi else -Float32.inf
                    x[rh, 2 * j + u] = v
                    tmax = fa_utils.fmax(tmax, v)
            for k in cutlass.range_constexpr(2):
                tmax = fa_utils.fmax(tmax, cute.arch.shuffle_sync_bfly(tmax, offset=1 << k))
            m_new[rh] = fa_utils.fmax(m_run[rh], ceil_f32(tmax))
            grow = fa_utils.fmax(grow, m_new[rh] - m_run[rh])
        if cute.arch.vote_any_sync(grow > Float32(0.0)):
            for rh in cutlass.range_constexpr(rows):
                alpha = pow2(Int32(fa_utils.fmax(m_run[rh] - m_new[rh], Float32(-127.0))))
                l_run[rh] = l_run[rh] * alpha
                for j in cutlass.range_constexpr(d // 8):
                    acc[j, 2 * rh] = acc[j, 2 * rh] * alpha
                    acc[j, 2 * rh + 1] = acc[j, 2 * rh + 1] * alpha
                m_run[rh] = m_new[rh]
        for rh in cutlass.range_constexpr(rows):
            for j in cutlass.range_constexpr(2):
                p0 = cute.math.exp2(x[rh, 2 * j] - m_run[rh], fastmath=True) * P_SCALE
                p1 = cute.math.exp2(x[rh, 2 * j + 1] - m_run[rh], fastmath=True) * P_SCALE
                pair = p_hat_pair(p0, p1)
                l_run[rh] = l_run[rh] + f16_pair_sum(pair)
                a_frag[2 * j + rh] = pair
        # O += P̂·V: B registers pair keys (2t, 2t+1) and (2t+8, 2t+9); keys past the
        # sequence read zero codes and scales (their slots may hold anything)
        v0 = 2 * kw + 2
        vs0 = v0 + 4 * vw
        w = cute.make_rmem_tensor((4, vw), Int32)
        sv = cute.make_rmem_tensor(4, Int32)
        for k in cutlass.range_constexpr(4):
            ok = key0 + 2 * t + k % 2 + 8 * (k // 2) < kv_hi
            sv[k] = cur[vs0 + k] if ok else Int32(0)
            for i in cutlass.range_constexpr(vw):
                w[k, i] = cur[v0 + k * vw + i] if ok else Int32(0)
        for i in cutlass.range_constexpr(vw):
            sc01 = scale_pair(sv[0], sv[1], i // 2)
            sc23 = scale_pair(sv[2], sv[3], i // 2)
            r01 = e2m1_word_pair(w[0, i], w[1, i])
            r23 = e2m1_word_pair(w[2, i], w[3, i])
            for e in cutlass.range_constexpr(8):
                j = 8 * i + e
                b = (hmul2(r01[e], sc01), hmul2(r23[e], sc23))
                out = mma_f16(a_frag, b, [acc[j, 0], acc[j, 1], acc[j, 2], acc[j, 3]])
                for u in cutlass.range_constexpr(4):
                    acc[j, u] = out[u]

    @cute.jit
    def store_row_value(self, sO, sM, sL, idx, q_start, kvh, split, part_tokens, mOut, mPartO,
                        mPartML):  # fmt: skip
        """Merge the warps' (M, l, O) of element ``idx`` (row-major over group rows x head
        columns) and store it: the output, or the split's partial (O/l, M, l) rows."""
        d = self.d
        row = idx // d
        col = idx - row * d
        m_max = sM[0, row]
        for w in cutlass.range_constexpr(1, WARPS):
            m_max = fa_utils.fmax(m_max, sM[w, row])
        l_sum = Float32(0.0)
        o_sum = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            wt = pow2(Int32(fa_utils.fmax(sM[w, row] - m_max, Float32(-127.0))))
            l_sum = l_sum + sL[w, row] * wt
            o_sum = o_sum + sO[w, row, col] * wt
        o = o_sum / (l_sum if l_sum > Float32(0.0) else Float32(1.0))
        head = kvh * self.group + row
        if const_expr(self.partial):
            at = (split * part_tokens + q_start) * (self.heads_kv * self.group) + head
            mPartO[at * d + col] = o
            if col == 0:
                mPartML[at * 2] = m_max
                mPartML[at * 2 + 1] = l_sum * (1.0 / P_SCALE)
        else:
            mOut[q_start, head, col] = o.to(mOut.element_type)


_COMPILED: dict[tuple, object] = {}


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)


def paged_decode_nvfp4_sm90(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    part_o: torch.Tensor,
    part_ml: torch.Tensor,
    *,
    num_decodes: int,
    num_splits: int,
    part_tokens: int,
    page_size: int,
    qk_scale: float,
) -> None:
    """Decode the first ``num_decodes`` sequences (one new token each) over an NVFP4 cache
    (``ops.run_paged_attention``'s contract): into ``out`` when ``num_splits`` is 1, else
    into the split-K partials ``part_o`` / ``part_ml`` (``part_tokens`` rows per split) for
    ``combine_splits_kernel``."""
    heads_q, d = q.shape[1], q.shape[2]
    heads_kv = cache.shape[2]
    partial = num_splits > 1
    if not partial:  # the partials are not written: any float32 tensors do
        part_o = part_ml = _placeholder(q.device)
    aligned = (
        (q, 2), (cache, 16), (block_table, 4), (seq_lens, 4), (query_start_loc, 4), (out, 2),
        (part_o, 4), (part_ml, 4),
    )  # fmt: skip
    key = (d, heads_kv, heads_q // heads_kv, page_size, partial, q.dtype, out.dtype)
    if key not in _COMPILED:
        kernel = NvFP4DecodeSm90(d, heads_kv, heads_q // heads_kv, page_size, partial)
        _COMPILED[key] = compile_kernel(kernel, aligned, Float32(qk_scale), Int32(1), Int32(1),
                                        Int32(1))  # fmt: skip
    _COMPILED[key](*kernel_tensors(aligned), qk_scale, num_splits, part_tokens, num_decodes)
