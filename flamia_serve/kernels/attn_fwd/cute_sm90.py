"""FP8 attention forward for Hopper (sm_90a) in CuTe DSL: the fast path of ``attn_fwd``.

Same numerics as the Triton kernel beside it (twin: ``flamia_serve.reference``): per score
``y = (Q̂·K̂ᵀ)·qk_scale·2^(eQ_i + eK_j) + eV_j``, an integer running row reference ``m``,
``P̂ = E4M3(2^(y − m + 8))`` into ``P̂·V̂`` (each key tile's product starts from zero and is
added to the FP32 output: promotion per tile), normaliser ``l = Σ 2^(y − m + 8 − eV_j)``.

Design (the structure of FlashAttention-3/4's sm90 forward, written for our numerics; its
public helper modules are used as a dependency): persistent CTAs, one per SM, take the
longest-first work list of (document, query tile, head) items through an atomic ticket (or a
static stride; the producer warp hands each item to the consumers through shared memory).
Per CTA a producer warp TMA-loads Q, then per key tile K with its exponent factors
(``kv_factors``, one barrier) and V^T (``v_t``, keys contiguous: FP8 ``wgmma`` wants both
operands K-major) into a ring of shared-memory stages; consumer warpgroups (64 query rows
each) take turns on the tensor cores (named-barrier ping-pong), so one's softmax step runs
under another's MMAs; ``overlap=True`` also issues the next tile's ``Q̂·K̂ᵀ`` before the
current ``P̂·V̂`` (more registers: measured slower, see ``benchmarks/NOTES.md``). P̂ stays
in registers (RS ``wgmma``): ``v_t`` stores keys permuted inside 16-key groups
(``operands.v_t_position``), which makes the E4M3 accumulator fragment of ``Q̂·K̂ᵀ`` the A
fragment of ``P̂·V̂`` as it is; the exponent factors use the same columns, so a thread's
four factors of a 16-key group are adjacent in shared memory.

Mixed recipes (NVFP4 Q/K): Hopper has no FP4 MMA, so the scores come from the NVFP4 values
widened exactly to BF16 (``KernelQKV.q_wide``/``k_wide``) by a BF16 ``wgmma``, with the
per-token second-level exponents as the row/column factors (``kv_factors`` row 0 then holds
K's); P̂·V̂ stays FP8 (at d = 256 with 64-key tiles: the BF16 tiles double Q/K's shared
memory).

Requires ``nvidia-cutlass-dsl`` and ``flash-attn-4`` (``quack``); imported lazily by
``ops.attn_fwd`` only on sm_90 when they are installed.
"""

from __future__ import annotations

from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
import torch
from cutlass import Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.utils import LayoutEnum
from flash_attn.cute import pipeline as fa_pipeline
from flash_attn.cute import utils as fa_utils
from quack import copy_utils, layout_utils, sm90_utils

from flamia_serve.kernels._common import BoundCall, sm_count
from flamia_serve.kernels.cute_sm90_common import (
    FP8,
    accumulator_to_a,
    column_offset,
    compile_kernel,
    e4m3_exponent,
    ffi_tensor,
    kernel_tensors,
    load_shared_words,
    pow2,
    store_global_words,
)
from flamia_serve.kernels.schedule import WorkList
from flamia_serve.kernels.workspace import PackWorkspace, zero_counter
from flamia_serve.numerics import P_HAT_EXP
from flamia_serve.numerics.exp2 import P_E4M3, RNE_MAGIC, RNE_MAGIC_BITS
from flamia_serve.numerics.operands import KernelQKV

# named barriers (0 is __syncthreads): the tensor-core turns of consumer warpgroups 0..2,
# then each warpgroup's own (its quantization of Q)
_BAR_TURN = 1
_BAR_WG = 4
#: (with ``q_block``) the consumers' last Q̂·K̂ᵀ of an item -> the producer's first K/V load
#: of the next item
_BAR_KV_GATE = 8
# Mitchell-P's E4M3 codes: code = RNE(8·t') + bias·8 for t' = t + P_HAT_EXP; adding
# (127 − bias)·8 and shifting by 20 makes a code the top bits of its float32
_MITCHELL_BIAS = float(P_E4M3.bias << P_E4M3.mant_bits)
_E4M3_TO_F32 = (127 - P_E4M3.bias) << P_E4M3.mant_bits
_WORK_STAGES = 2  # work items the producer warp may publish ahead of the consumers
#: 32-bit words per row of the epilogue's staging tile: 64 pairs of output values (128
#: columns, one d_chunk) and 4 words of padding, so that the eight rows a warp's pair
#: stores reach fall on distinct banks
_O_ROW = 64 + 4


class FlamiaFwdSm90:
    """Compiled once per (head dim, heads, causal, K-exponent block, config)."""

    def __init__(
        self,
        head_dim: int,
        heads_q: int,
        heads_kv: int,
        causal: bool,
        k_exp_block: int,
        tile_m: int,
        tile_n: int,
        num_stages: int,
        overlap: bool,
        ticket: bool,
        extend: bool = False,
        exp_mode: str = "exact",
        qk_wide: bool = False,
        promote_pv: bool = True,
        q_block: int = 0,
        stage_o: bool = True,
    ) -> None:
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {head_dim}: the CuTe forward supports 64, 128 and 256")
        if qk_wide and head_dim > 128 and tile_n > 64:
            raise ValueError(
                "BF16 score operands (NVFP4 Q/K) at head_dim 256 take 64-key tiles (shared memory)"
            )
        self.d = head_dim
        # the score operands: E4M3 codes, or NVFP4 values widened to BF16 (mixed recipes)
        self.qk_dtype = cutlass.BFloat16 if qk_wide else FP8
        # P̂·V̂ runs in chunks of at most 128 output columns, each promoted into its part of O
        # before the next is issued: O plus one chunk's product stay in registers (d = 256)
        self.d_chunk = min(head_dim, 128)
        self.n_chunks = head_dim // self.d_chunk
        if self.n_chunks > 1 and overlap and promote_pv:
            raise ValueError(
                "overlap=True with promote_pv=True needs head_dim <= 128 (both P̂·V̂ chunks' "
                "products in flight)"
            )
        # True: each key tile's P̂·V̂ starts from zero and is added to O in FP32 (promotion
        # per tile); False: it accumulates into O inside the ``wgmma`` (no product
        # accumulator, and a warpgroup's tensor-core turn is only its MMA issues)
        self.promote_pv = promote_pv
        self.heads_q = heads_q
        self.group = heads_q // heads_kv
        self.causal = causal
        self.k_exp_block = k_exp_block if tile_n % k_exp_block == 0 else 1
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.overlap = overlap
        self.ticket = ticket
        self.extend = extend
        if exp_mode not in ("exact", "mitchell"):
            raise ValueError(f"exp_mode must be 'exact' or 'mitchell' (serving), got {exp_mode!r}")
        self.exp_mode = exp_mode
        # q_block > 0: Q arrives in BF16/FP16 and each consumer warpgroup quantizes its 64 rows
        # as the quantizer would (E4M3, one exponent per q_block query rows of the document:
        # 32, or 1 for per-token exponents, the serving rule of the extend path), so Q needs
        # no quantization launch
        if q_block not in (0, 1, 32):
            raise ValueError(f"q_block must be 0 (Q quantized beforehand), 1 or 32, got {q_block}")
        if q_block and (qk_wide or head_dim > 128):
            raise ValueError(
                "q_block (Q quantized in the kernel) needs E4M3 Q/K and head_dim <= 128 (shared "
                "memory)"
            )
        self.q_block = q_block
        self.num_wg = self.tile_m // 64
        assert self.num_wg in (1, 2, 3)
        # O leaves through shared memory in 16-byte row pieces (``epilogue``; needs O's token
        # and head strides in multiples of 8 elements) up to d = 128; at d = 256 the staging
        # tile would cost the main loop registers (local sm_90a build: +56 B of stack)
        self.stage_o = stage_o and head_dim <= 128
        self.num_threads = 128 * (self.num_wg + 1)
        self.gate_threads = 32 + 128 * self.num_wg  # _BAR_KV_GATE: producer warp, consumers
        self.mma_regs, self.producer_regs = {1: (256, 56), 2: (240, 24), 3: (160, 32)}[self.num_wg]

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, Hq, d) e4m3 (or bf16: qk_wide; bf16/fp16: q_block)
        mK: cute.Tensor,  # (T, Hkv, d) e4m3 (or bf16)
        mVt: cute.Tensor,  # (d, t_pad, Hkv) e4m3, keys contiguous
        mQexp: cute.Tensor,  # (Hq, T) int16 (int8: NVFP4's second level)
        mFactors: cute.Tensor,  # (Hkv, 3, t_pad) f32: 2^eK, eV, 2^-eV in v_t's columns
        mCu: cute.Tensor,  # (B+1,) int32: queries (and keys unless ``extend``)
        mCuK: cute.Tensor,  # (B+1,) int32: keys with ``extend`` (else not read)
        mVtStart: cute.Tensor,  # (B,) int32
        mItemDoc: cute.Tensor,  # (N,) int32
        mItemTile: cute.Tensor,  # (N,) int32
        mCount: cute.Tensor,  # (1,) int32
        mTicket: cute.Tensor,  # (1,) int32, zero at launch: items taken after the first
        mO: cute.Tensor,  # (T, Hq, d) bf16 or fp16
        mM: cute.Tensor,  # (T, Hq) f32
        mLSE: cute.Tensor,  # (T, Hq) f32
        qk_scale: Float32,
        n_programs: Int32,
        stream: cuda.CUstream,
    ):
        mQ = layout_utils.select(mQ, [0, 2, 1])  # (T, d, Hq)
        mK = layout_utils.select(mK, [0, 2, 1])  # (T, d, Hkv)
        qk = self.qk_dtype
        sQ_layout = sm90_utils.make_smem_layout(qk, LayoutEnum.ROW_MAJOR, (self.tile_m, self.d))
        sK_layout = sm90_utils.make_smem_layout(
            qk, LayoutEnum.ROW_MAJOR, (self.tile_n, self.d), self.num_stages
        )
        sV_layout = sm90_utils.make_smem_layout(
            FP8, LayoutEnum.ROW_MAJOR, (self.d, self.tile_n), self.num_stages
        )
        # what Q's TMA fills: the E4M3 tile itself, or (q_block) its BF16/FP16 input
        q_in = mQ.element_type
        sQin_layout = sm90_utils.make_smem_layout(q_in, LayoutEnum.ROW_MAJOR, (self.tile_m, self.d))
        q_in_elems = 8
        if const_expr(self.q_block > 0):
            q_in_elems = cute.cosize(sQin_layout)
        else:
            sQin_layout = sQ_layout
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            qk, qk, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.tile_n),
        )  # fmt: skip
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            FP8, FP8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_wg, 1, 1), tiler_mn=(64, self.d_chunk),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(
            tma_load, mQ, sQin_layout, (self.tile_m, self.d)
        )
        atom_k, tma_k = cpasync.make_tiled_tma_atom(
            tma_load, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.d), 1
        )
        atom_v, tma_v = cpasync.make_tiled_tma_atom(
            tma_load, mVt, cute.select(sV_layout, mode=[0, 1]), (self.d, self.tile_n), 1
        )
        # a key tile's exponent factors ride with its K tile (one barrier, one stage)
        sF_layout = cute.make_layout((self.tile_n, 3, self.num_stages))
        atom_f, tma_f = cpasync.make_tiled_tma_atom(
            tma_load, layout_utils.select(mFactors, [2, 1, 0]), cute.make_layout((self.tile_n, 3)),
            (self.tile_n, 3),
        )  # fmt: skip
        self.tma_bytes = {
            name: cute.size_in_bytes(dtype, cute.select(layout, mode=[0, 1]))
            for name, dtype, layout in (
                ("q", q_in, sQin_layout), ("k", qk, sK_layout), ("v", FP8, sV_layout)
            )
        }  # fmt: skip
        self.tma_bytes["k"] += cute.size_in_bytes(Float32, cute.make_layout((self.tile_n, 3)))
        stages = self.num_stages

        @cute.struct
        class Storage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_work: cute.struct.MemRange[cutlass.Int64, 2 * _WORK_STAGES]
            sWork: cute.struct.MemRange[Int32, _WORK_STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[qk, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[qk, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[FP8, cute.cosize(sV_layout)], 1024]
            sF: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sF_layout)], 128]
            # q_block: the BF16/FP16 Q tile, each row's exponent, each warp's amax
            sQin: cute.struct.Align[cute.struct.MemRange[q_in, q_in_elems], 1024]
            sQe: cute.struct.MemRange[Int32, self.tile_m]
            sAmax: cute.struct.MemRange[Float32, 4 * self.num_wg]
            # each warpgroup's 64 output rows of one d_chunk, as pairs of output values
            sO: cute.struct.Align[
                cute.struct.MemRange[Int32, self.num_wg * 64 * _O_ROW if self.stage_o else 4], 128
            ]

        self.kernel(
            tma_q, tma_k, tma_v, tma_f, atom_q, atom_k, atom_v, atom_f, mQexp, mCu, mCuK,
            mVtStart,
            mItemDoc, mItemTile, mCount, mTicket, mO, mM, mLSE, qk_scale, sQ_layout, sQin_layout,
            sK_layout, sV_layout, sF_layout, tiled_mma_qk, tiled_mma_pv, Storage,
        ).launch(
            grid=[n_programs, 1, 1], block=[self.num_threads, 1, 1], stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    # ---------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(
        self,
        tma_q: cute.Tensor,
        tma_k: cute.Tensor,
        tma_v: cute.Tensor,
        tma_f: cute.Tensor,
        atom_q: cute.CopyAtom,
        atom_k: cute.CopyAtom,
        atom_v: cute.CopyAtom,
        atom_f: cute.CopyAtom,
        mQexp: cute.Tensor,
        mCu: cute.Tensor,
        mCuK: cute.Tensor,
        mVtStart: cute.Tensor,
        mItemDoc: cute.Tensor,
        mItemTile: cute.Tensor,
        mCount: cute.Tensor,
        mTicket: cute.Tensor,
        mO: cute.Tensor,
        mM: cute.Tensor,
        mLSE: cute.Tensor,
        qk_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sQin_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sF_layout: cute.Layout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        Storage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (atom_q, atom_k, atom_v, atom_f):
                cpasync.prefetch_descriptor(atom)
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(Storage)
        tma_warp = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_wg * 4)
        pipe_q = fa_pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=1, producer_group=tma_warp,
            consumer_group=mma_warps, tx_count=self.tma_bytes["q"], defer_sync=True,
        )  # fmt: skip
        pipe_k = fa_pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages,
            producer_group=tma_warp, consumer_group=mma_warps, tx_count=self.tma_bytes["k"],
            defer_sync=True,
        )  # fmt: skip
        pipe_v = fa_pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages,
            producer_group=tma_warp, consumer_group=mma_warps, tx_count=self.tma_bytes["v"],
            defer_sync=True,
        )  # fmt: skip
        # work items, producer warp -> consumers (one shared-memory slot per stage)
        pipe_work = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_work.data_ptr(), num_stages=_WORK_STAGES,
            producer_group=tma_warp,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_wg * 128),
            defer_sync=True,
        )  # fmt: skip
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sF = storage.sF.get_tensor(sF_layout)
        sQin = sQ
        if const_expr(self.q_block > 0):
            sQin = storage.sQin.get_tensor(sQin_layout.outer, swizzle=sQin_layout.inner)
        q_scratch = SimpleNamespace(
            sQin=sQin, sQe=storage.sQe.get_tensor(cute.make_layout(self.tile_m)),
            sAmax=storage.sAmax.get_tensor(cute.make_layout(4 * self.num_wg)),
            sO=storage.sO.get_tensor(
                cute.make_layout((self.num_wg, 64, _O_ROW), stride=(64 * _O_ROW, _O_ROW, 1))
            ),
        )  # fmt: skip

        # work items w = item * Hq + head (items longest first): CTA b takes item b first,
        # then grid + (ticket drawn); sWork carries them from the producer warp
        sched = SimpleNamespace(
            doc=mItemDoc, tile=mItemTile, cu=mCu, cu_k=mCuK, vt_start=mVtStart, ticket=mTicket,
            n_work=mCount[0] * self.heads_q, n_ctas=cute.arch.grid_dim()[0], pipe=pipe_work,
            slots=storage.sWork.get_tensor(cute.make_layout(_WORK_STAGES)),
        )  # fmt: skip
        pipeline_init_wait(cluster_shape_mn=(1, 1))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(
                    sched, (tma_q, tma_k, tma_v, tma_f), (atom_q, atom_k, atom_v, atom_f),
                    (sQin, sK, sV, sF), pipe_q, pipe_k, pipe_v,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consume(
                sched, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sF, pipe_q, pipe_k, pipe_v, mQexp,
                mO, mM, mLSE, qk_scale, q_scratch,
            )  # fmt: skip

    @cute.jit
    def work_item(self, sched, work):
        """Work item ``work``: its document's first query row (``q_start``) and key
        (``k_start``), key count (``seqlen``), first v_t column, query tile, head, K/V head
        and key tiles. Query ``i`` of a document sits at key position ``q_offset + i``:
        ``q_offset`` = keys − queries with ``extend`` (new tokens after cached ones), else 0;
        ``q_base`` = ``q_start − q_offset`` is the row of position 0."""
        item = work // self.heads_q
        head = work - item * self.heads_q
        doc = sched.doc[item]
        tile = sched.tile[item]
        q_start = sched.cu[doc]
        seqlen = sched.cu[doc + 1] - q_start
        k_start, q_offset = q_start, Int32(0)
        if const_expr(self.extend):
            k_start = sched.cu_k[doc]
            q_offset = sched.cu_k[doc + 1] - k_start - seqlen
            seqlen = seqlen + q_offset
        n_blocks = cute.ceil_div(seqlen, self.tile_n)
        if const_expr(self.causal):
            last = q_offset + (tile + 1) * self.tile_m
            n_blocks = cutlass.min(n_blocks, cute.ceil_div(last, self.tile_n))
        return SimpleNamespace(
            q_start=q_start, k_start=k_start, q_offset=q_offset, q_base=q_start - q_offset,
            seqlen=seqlen, vt_start=sched.vt_start[doc], tile=tile, head=head,
            head_kv=head // self.group, n_blocks=n_blocks,
        )  # fmt: skip

    @cute.jit
    def produce(self, sched, tma, atoms, smem, pipe_q, pipe_k, pipe_v):
        """TMA loads per work item: Q (once its buffer is free; with ``q_block`` its
        BF16/FP16 input), then per key tile (from the last down) K with its exponent factors
        on one barrier, and V^T."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        work_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, _WORK_STAGES)
        q_phase = Int32(1)
        after_first = Int32(0)  # the first item's K/V wait for no earlier item
        work = cute.arch.block_idx()[0]
        while work < sched.n_work:
            work_state = self.publish_work(sched, work_state, work)
            w = self.work_item(sched, work)
            state = self.produce_item(w, tma, atoms, smem, pipe_q, pipe_k, pipe_v, state, q_phase,
                                      after_first)  # fmt: skip
            after_first = Int32(1)
            q_phase ^= 1
            if const_expr(self.ticket):
                ticket = Int32(0)
                if cute.arch.lane_idx() == 0:
                    ticket = fa_utils.atomic_add_i32(1, sched.ticket.iterator)
                work = sched.n_ctas + cute.arch.shuffle_sync(ticket, 0)
            else:
                work += sched.n_ctas
        self.publish_work(sched, work_state, work)  # past the end: the consumers stop

    @cute.jit
    def publish_work(self, sched, work_state, work):
        """Hand work item ``work`` to the consumer warpgroups (one lane writes the slot and
        arrives; the arrive orders the write before the consumers' wait)."""
        sched.pipe.producer_acquire(work_state)
        with cute.arch.elect_one():
            sched.slots[work_state.index] = work
            sched.pipe.producer_commit(work_state)
        work_state.advance()
        return work_state

    @cute.jit
    def receive_work(self, sched, work_state):
        """The next work item of this CTA (consumer threads)."""
        sched.pipe.consumer_wait(work_state)
        work = sched.slots[work_state.index]
        sched.pipe.consumer_release(work_state)
        work_state.advance()
        return work, work_state

    @cute.jit
    def produce_item(self, w, tma, atoms, smem, pipe_q, pipe_k, pipe_v, state, q_phase,
                     after_first):  # fmt: skip
        """One item's loads: the last key tile's K first, then Q, then the rest in order.
        With ``q_block``, Q first (its input buffer is free once the warpgroups quantized the
        item before), then the K/V tiles once every consumer warpgroup has passed that item's
        last Q̂·K̂ᵀ (``_BAR_KV_GATE``; ``after_first``: there was an item before), as they did
        while Q's release came after that Q̂·K̂ᵀ (see ``release_k``)."""
        tma_q, tma_k, tma_v, tma_f = tma
        atom_q, atom_k, atom_v, atom_f = atoms
        sQ, sK, sV, sF = smem
        vt_start, head_kv, n_blocks = w.vt_start, w.head_kv, w.n_blocks
        gQ = cute.local_tile(
            cute.domain_offset((w.q_start, 0), tma_q[None, None, w.head]),
            (self.tile_m, self.d), (w.tile, 0),
        )  # fmt: skip
        gK = cute.local_tile(
            cute.domain_offset((w.k_start, 0), tma_k[None, None, head_kv]),
            (self.tile_n, self.d), (None, 0),
        )  # fmt: skip
        gV = cute.local_tile(
            cute.domain_offset((0, vt_start), tma_v[None, None, head_kv]),
            (self.d, self.tile_n), (0, None),
        )  # fmt: skip
        load_q, _, _ = copy_utils.tma_get_copy_fn(
            atom_q, 0, cute.make_layout(1), gQ, sQ, single_stage=True
        )
        gF = cute.local_tile(
            cute.domain_offset((vt_start, 0), tma_f[None, None, head_kv]), (self.tile_n, 3),
            (None, 0),
        )  # fmt: skip
        loads_k = []
        for atom, g, s in ((atom_k, gK, sK), (atom_f, gF, sF)):
            fn, _, _ = copy_utils.tma_get_copy_fn(atom, 0, cute.make_layout(1), g, s)
            loads_k.append(copy_utils.tma_producer_copy_fn(fn, pipe_k))
        load_k = copy_utils.chain_tma_producer_copy_fns(loads_k)
        load_v, _, _ = copy_utils.tma_get_copy_fn(atom_v, 0, cute.make_layout(1), gV, sV)
        load_v = copy_utils.tma_producer_copy_fn(load_v, pipe_v)
        n = n_blocks - 1
        if const_expr(self.q_block > 0):
            pipe_q.producer_acquire_w_index_phase(0, q_phase)
            load_q(tma_bar_ptr=pipe_q.sync_object_full.get_barrier(0))
            if after_first > 0:
                cute.arch.barrier(barrier_id=_BAR_KV_GATE, number_of_threads=self.gate_threads)
            pipe_k.producer_acquire(state)
            load_k(src_idx=n, producer_state=state)
        else:
            pipe_k.producer_acquire(state)
            load_k(src_idx=n, producer_state=state)
            pipe_q.producer_acquire_w_index_phase(0, q_phase)
            load_q(tma_bar_ptr=pipe_q.sync_object_full.get_barrier(0))
        pipe_v.producer_acquire(state)
        load_v(src_idx=n, producer_state=state)
        state.advance()
        for i in cutlass.range(n_blocks - 1, unroll=1):
            n = n_blocks - 2 - i
            pipe_k.producer_acquire(state)
            load_k(src_idx=n, producer_state=state)
            pipe_v.producer_acquire(state)
            load_v(src_idx=n, producer_state=state)
            state.advance()
        return state

    @cute.jit
    def consume(
        self, sched, tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sF, pipe_q, pipe_k, pipe_v, mQexp,
        mO, mM, mLSE, qk_scale, q_scratch,
    ):  # fmt: skip
        """Consumer warpgroups: every work item of this CTA (with ``q_block``, first its Q
        rows quantized), key tiles from the last (masked: document end, causal diagonal) down
        to the first, then the epilogue."""
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        wg_mma_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * 128)
        _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(
            wg_mma_qk, (self.tile_m, self.tile_n, self.d), sQ, sK
        )
        # one (O chunk, V̂ᵀ rows) pair per chunk of d_chunk output columns
        sV_chunks = cute.flat_divide(sV, (self.d_chunk, self.tile_n))
        acc_O, tOrV = [], []
        for h in cutlass.range_constexpr(self.n_chunks):
            acc_h, tOrP, tOrV_h = sm90_utils.partition_fragment_ABC(
                wg_mma_pv, (self.tile_m, self.d_chunk, self.tile_n), None,
                sV_chunks[None, None, h, 0, None],
            )  # fmt: skip
            acc_O.append(acc_h)
            tOrV.append(tOrV_h)
        # this thread's rows and key columns of a score tile
        tScS = layout_utils.reshape_acc_to_mn(
            thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        )
        n_rows = cute.size(tScS, mode=[0])
        # this thread's key columns are col0 + column_offset(j), col0 = 2·(lane % 4); their
        # exponent factors sit at 2·col0 + _factor_offset(j) (v_t's permuted columns)
        col0 = tScS[0, 0][1]
        ctx = SimpleNamespace(
            mma_qk=lambda k_idx, wait: sm90_utils.gemm_zero_init(
                tiled_mma_qk, (self.tile_m, self.tile_n), tSrQ, tSrK, B_idx=k_idx, wg_wait=wait
            ),
            mma_pv=lambda v_idx, wait, h=0: sm90_utils.gemm_zero_init(
                tiled_mma_pv, (self.tile_m, self.d_chunk), tOrP, tOrV[h], B_idx=v_idx,
                wg_wait=wait,
            ),
            # O += P̂·V̂ inside the wgmma (``promote_pv=False``)
            mma_pv_into_o=lambda v_idx, wait, h=0: sm90_utils.gemm_w_idx(
                tiled_mma_pv, acc_O[h], tOrP, tOrV[h], zero_init=False, B_idx=v_idx,
                wg_wait=wait,
            ),
            pipe_k=pipe_k, pipe_v=pipe_v, acc_O=acc_O, tOrP=tOrP, wg=wg, tScS=tScS, sF=sF,
            col0=col0,
            row=cute.make_rmem_tensor(n_rows, Int32),  # query position among the keys
            qfac=cute.make_rmem_tensor(n_rows, Float32),  # qk_scale · 2^eQ
            m_run=cute.make_rmem_tensor(n_rows, Float32),
            l_run=cute.make_rmem_tensor(n_rows, Float32),
            alpha=cute.make_rmem_tensor(n_rows, Float32),
            sQ=sQ, sQe=q_scratch.sQe, sAmax=q_scratch.sAmax, sQin=q_scratch.sQin, sO=q_scratch.sO,
            tid_wg=tidx - wg * 128,
        )  # fmt: skip
        if const_expr(self.num_wg > 1):
            if wg == 0:  # the first warpgroup takes the first turn
                cute.arch.barrier_arrive(barrier_id=_BAR_TURN, number_of_threads=256)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        work_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, _WORK_STAGES)
        q_phase = Int32(0)
        work, work_state = self.receive_work(sched, work_state)
        while work < sched.n_work:
            w = self.work_item(sched, work)
            if const_expr(self.q_block > 0):
                pipe_q.consumer_wait_w_index_phase(0, q_phase)
                self.quantize_q_rows(ctx, w)
                pipe_q.consumer_release_w_index(0)  # the next item's Q may load now
            item_ctx = self.start_item(ctx, w, mQexp, qk_scale)
            state = self.key_tiles(item_ctx, state, pipe_q, q_phase, w)
            q_phase ^= 1
            self.epilogue(acc_O, thr_mma_pv, item_ctx, mO, mM, mLSE, w)
            work, work_state = self.receive_work(sched, work_state)

    @cute.jit
    def start_item(self, ctx, w, mQexp, qk_scale):
        """Per-item state: query rows, ``qk_scale·2^eQ``, reset statistics and accumulator
        (a helper, so the item loop itself assigns only runtime values)."""
        for r in cutlass.range_constexpr(cute.size(ctx.row)):
            ctx.row[r] = w.q_offset + w.tile * self.tile_m + ctx.tScS[r, 0][0]
            qe = Int32(0)
            if ctx.row[r] < w.seqlen:
                if const_expr(self.q_block > 0):
                    qe = ctx.sQe[ctx.tScS[r, 0][0]]
                else:
                    qe = Int32(mQexp[w.head, w.q_base + ctx.row[r]])
            ctx.qfac[r] = pow2(qe) * qk_scale
        ctx.m_run.fill(-Float32.inf)
        ctx.l_run.fill(0.0)
        for h in cutlass.range_constexpr(self.n_chunks):
            ctx.acc_O[h].fill(0.0)
        return SimpleNamespace(**vars(ctx), seqlen=w.seqlen)

    @cute.jit
    def key_tiles(self, ctx, state, pipe_q, q_phase, w):
        """The key tiles of one item (Q released after its last Q̂·K̂ᵀ)."""
        n_blocks = w.n_blocks
        n_masked_end = n_blocks - 1
        if const_expr(self.causal):
            first_row = w.q_offset + w.tile * self.tile_m
            n_masked_end = cutlass.min(first_row // self.tile_n, n_blocks - 1)
        if const_expr(self.q_block == 0):  # (else waited for before quantize_q_rows)
            pipe_q.consumer_wait_w_index_phase(0, q_phase)
        if const_expr(not self.promote_pv):
            state = self.key_tiles_into_o(ctx, state, pipe_q, n_blocks, n_masked_end)
        elif const_expr(self.overlap):
            # first tile alone (nothing to add to O yet), then each Q̂·K̂ᵀ overlaps the
            # previous tile's P̂·V̂, then the last P̂·V̂
            n = n_blocks - 1
            ctx.pipe_k.consumer_wait(state, ctx.pipe_k.consumer_try_wait(state))
            acc_S = ctx.mma_qk(state.index, 0)
            self.softmax_step(ctx, acc_S, state, n, True)
            self.release_k(ctx, state)
            self.stage_p(ctx, acc_S)
            for i in cutlass.range(n_blocks - 1 - n_masked_end, unroll=1):
                state = self.key_tile_overlapped(ctx, state, n_blocks - 2 - i, True)
            for i in cutlass.range(n_masked_end, unroll=1):
                state = self.key_tile_overlapped(ctx, state, n_masked_end - 1 - i, False)
            self.release_q(pipe_q)
            ctx.pipe_v.consumer_wait(state, ctx.pipe_v.consumer_try_wait(state))
            acc_T = ctx.mma_pv(state.index, 0)
            ctx.pipe_v.consumer_release(state)
            state.advance()
            ctx.acc_O[0].store(ctx.acc_O[0].load() + acc_T.load())
        else:
            # a warpgroup's turn on the tensor cores: P̂·V̂ of one tile and Q̂·K̂ᵀ of the next
            self.turn_wait(ctx.wg)
            for i in cutlass.range(n_blocks - n_masked_end, unroll=1):
                state = self.key_tile_serial(ctx, state, n_blocks - 1 - i, True)
            for i in cutlass.range(n_masked_end, unroll=1):
                state = self.key_tile_serial(ctx, state, n_masked_end - 1 - i, False)
            self.release_q(pipe_q)
            self.turn_pass(ctx.wg)
        return state

    @cute.jit
    def key_tiles_into_o(self, ctx, state, pipe_q, n_blocks, n_masked_end):
        """``promote_pv=False``: each key tile's P̂·V̂ accumulates into O inside the
        ``wgmma``. A warpgroup's turn on the tensor cores is only MMA issues: P̂·V̂ of one
        tile and Q̂·K̂ᵀ of the next (serial: P̂·V̂ is waited for with the next Q̂·K̂ᵀ), or
        Q̂·K̂ᵀ of the next and P̂·V̂ of this one (``overlap``: P̂·V̂ runs during the next
        tile's softmax step). O holds its rows against the reference of the last softmax
        step: it is rescaled by that step's ``alpha`` before the next P̂·V̂ adds to it. The
        first tile (the last key tile, always masked) runs alone; O starts at zero."""
        self.turn_wait(ctx.wg)
        ctx.pipe_k.consumer_wait(state, ctx.pipe_k.consumer_try_wait(state))
        acc_S = ctx.mma_qk(state.index, -1)
        self.turn_pass(ctx.wg)
        warpgroup.wait_group(0)
        self.softmax_step(ctx, acc_S, state, n_blocks - 1, True)
        self.release_k(ctx, state)
        self.stage_p(ctx, acc_S)
        if const_expr(not self.overlap):
            self.turn_wait(ctx.wg)
            self.issue_pv_into_o(ctx, state)
        for i in cutlass.range(n_blocks - 1 - n_masked_end, unroll=1):
            state = self.key_tile_into_o(ctx, state, n_blocks - 2 - i, True)
        for i in cutlass.range(n_masked_end, unroll=1):
            state = self.key_tile_into_o(ctx, state, n_masked_end - 1 - i, False)
        if const_expr(self.overlap):
            self.turn_wait(ctx.wg)
            self.issue_pv_into_o(ctx, state)
        self.turn_pass(ctx.wg)
        self.release_q(pipe_q)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def release_k(self, ctx, state):
        """Free a K stage (with its exponent factors). With ``q_block``, after a shared-memory
        fence: the SASS issues the factors' last ``LDS`` right before the release and uses it
        after. With Q released early and neither this fence nor the K/V gate
        (``produce_item``), the later warpgroups' outputs varied from run to run; either one
        alone made them repeatable (H200, ``benchmarks/NOTES.md``): both are kept."""
        if const_expr(self.q_block > 0):
            cute.arch.fence_view_async_shared()
        ctx.pipe_k.consumer_release(state)

    @cute.jit
    def release_q(self, pipe_q):
        """After the item's last Q̂·K̂ᵀ: Q's buffer is free (without ``q_block``; with it, the
        BF16/FP16 input was released once quantized), and the producer may start the next
        item's K/V loads (``_BAR_KV_GATE``)."""
        if const_expr(self.q_block > 0):
            cute.arch.barrier_arrive(barrier_id=_BAR_KV_GATE, number_of_threads=self.gate_threads)
        else:
            pipe_q.consumer_release_w_index(0)

    @cute.jit
    def quantize_q_rows(self, ctx, w):
        """This warpgroup's 64 rows of the Q tile, BF16/FP16 in ``sQin``, as E4M3 codes into
        ``sQ`` and their exponents into ``sQe`` (twin: ``numerics.scales.quantize_fp8``, as
        the quantization kernel computes it): ``e = ceil(log2(amax / 448))`` over ``q_block``
        rows of the document (NaN-ignoring max, as the quantizer's), codes ``RNE(x·2^−e)``.
        Thread ``t`` takes half of row ``t // 2``: a 32-row block is two warps (their maxima
        meet in ``sAmax``). Rows past the document's queries quantize as zeros (they are
        masked)."""
        half_d = self.d // 2
        s_amax, s_qe = ctx.sAmax, ctx.sQe  # (stores inside a dynamic if: not through ctx)
        row = ctx.tid_wg // 2
        tile_row = ctx.wg * 64 + row
        src = cute.local_tile(ctx.sQin, (1, half_d), (tile_row, ctx.tid_wg % 2))
        x_in = cute.make_rmem_tensor((1, half_d), ctx.sQin.element_type)
        cute.autovec_copy(src, x_in)
        x = cute.make_rmem_tensor((1, half_d), Float32)
        x.store(x_in.load().to(Float32))
        # (w.seqlen counts keys: with extend, q_offset of them are cached ones)
        if w.tile * self.tile_m + tile_row >= w.seqlen - w.q_offset:
            x.fill(0.0)
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(half_d):
            amax = fa_utils.fmax(amax, cute.math.absf(x[i]))
        if const_expr(self.q_block == 1):
            amax = fa_utils.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1))
        else:
            amax = fa_utils.warp_reduce(amax, fa_utils.fmax)
            warp = ctx.tid_wg // 32
            if cute.arch.lane_idx() == 0:
                s_amax[ctx.wg * 4 + warp] = amax
            self.wg_sync(ctx.wg)
            amax = fa_utils.fmax(amax, s_amax[ctx.wg * 4 + (warp ^ 1)])
        e = e4m3_exponent(amax)
        scale = pow2(-e)
        codes = cute.make_rmem_tensor((1, half_d), FP8)
        codes.store((x.load() * scale).to(FP8))
        dst = cute.local_tile(ctx.sQ, (1, half_d), (tile_row, ctx.tid_wg % 2))
        cute.autovec_copy(codes, dst)
        if ctx.tid_wg % 2 == 0:
            s_qe[tile_row] = e
        cute.arch.fence_view_async_shared()  # the codes, for this warpgroup's wgmma
        self.wg_sync(ctx.wg)

    @cute.jit
    def wg_sync(self, wg):
        """Barrier of one consumer warpgroup's 128 threads."""
        cute.arch.barrier(barrier_id=_BAR_WG + wg, number_of_threads=128)

    @cute.jit
    def issue_pv_into_o(self, ctx, state):
        """Wait for tile ``state``'s V̂ᵀ, then issue ``O += P̂·V̂`` (not waited for)."""
        ctx.pipe_v.consumer_wait(state, ctx.pipe_v.consumer_try_wait(state))
        for h in cutlass.range_constexpr(self.n_chunks):
            ctx.mma_pv_into_o(state.index, -1, h)

    @cute.jit
    def key_tile_into_o(self, ctx, state, n, mask: cutlass.Constexpr):
        """Key tile ``n`` after the first; ``state`` is the previous tile's (its P̂·V̂ in
        flight, serial, or not yet issued, ``overlap``). Returns this tile's state."""
        state_v = state.clone()
        state.advance()
        ctx.pipe_k.consumer_wait(state, ctx.pipe_k.consumer_try_wait(state))
        if const_expr(self.overlap):
            self.turn_wait(ctx.wg)
            acc_S = ctx.mma_qk(state.index, -1)
            self.issue_pv_into_o(ctx, state_v)
            self.turn_pass(ctx.wg)
            warpgroup.wait_group(1)
        else:
            acc_S = ctx.mma_qk(state.index, -1)
            self.turn_pass(ctx.wg)
            warpgroup.wait_group(0)
            ctx.pipe_v.consumer_release(state_v)
        self.softmax_step(ctx, acc_S, state, n, mask)
        self.release_k(ctx, state)
        if const_expr(self.overlap):
            warpgroup.wait_group(0)
            ctx.pipe_v.consumer_release(state_v)
        self.rescale_o(ctx)
        self.stage_p(ctx, acc_S)
        if const_expr(not self.overlap):
            self.turn_wait(ctx.wg)
            self.issue_pv_into_o(ctx, state)
        return state

    @cute.jit
    def rescale_o(self, ctx):
        """O ·= ``alpha`` (2^(m_old − m_new) per row) before the next P̂·V̂ adds to it. A warp
        whose rows all kept their reference (every ``alpha`` exactly 1; the integer reference
        moves on a few tiles of a row only) skips it: O·1 is O, the same bits."""
        moved = ctx.alpha[0] != Float32(1.0)
        for r in cutlass.range_constexpr(1, cute.size(ctx.alpha)):
            moved = moved or ctx.alpha[r] != Float32(1.0)
        if cute.arch.vote_any_sync(moved):
            for h in cutlass.range_constexpr(self.n_chunks):
                acc_O_mn = layout_utils.reshape_acc_to_mn(ctx.acc_O[h])
                for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                        acc_O_mn[r, c] = acc_O_mn[r, c] * ctx.alpha[r]

    @cute.jit
    def key_tile_overlapped(self, ctx, state, n, mask: cutlass.Constexpr):
        """Key tile ``n`` after the first: its Q̂·K̂ᵀ runs while the previous tile's P̂·V̂ is
        issued; softmax step; ``O = (O + P̂·V̂_prev) · 2^(m_old − m_new)``."""
        state_v = state.clone()
        state.advance()
        ctx.pipe_k.consumer_wait(state, ctx.pipe_k.consumer_try_wait(state))
        self.turn_wait(ctx.wg)
        acc_S = ctx.mma_qk(state.index, -1)
        ctx.pipe_v.consumer_wait(state_v, ctx.pipe_v.consumer_try_wait(state_v))
        acc_T = ctx.mma_pv(state_v.index, -1)
        self.turn_pass(ctx.wg)
        warpgroup.wait_group(1)
        self.softmax_step(ctx, acc_S, state, n, mask)
        self.release_k(ctx, state)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(state_v)
        self.update_o(ctx, acc_T, add_first=True)
        self.stage_p(ctx, acc_S)
        return state

    @cute.jit
    def key_tile_serial(self, ctx, state, n, mask: cutlass.Constexpr):
        """Key tile ``n``: Q̂·K̂ᵀ, softmax step, ``O = O · 2^(m_old − m_new) + P̂·V̂``; the
        other warpgroup's softmax runs while this one's MMAs do."""
        ctx.pipe_k.consumer_wait(state, ctx.pipe_k.consumer_try_wait(state))
        acc_S = ctx.mma_qk(state.index, -1)
        self.turn_pass(ctx.wg)
        warpgroup.wait_group(0)
        self.softmax_step(ctx, acc_S, state, n, mask)
        self.release_k(ctx, state)
        self.stage_p(ctx, acc_S)
        ctx.pipe_v.consumer_wait(state, ctx.pipe_v.consumer_try_wait(state))
        self.turn_wait(ctx.wg)
        for h in cutlass.range_constexpr(self.n_chunks):
            acc_T = ctx.mma_pv(state.index, 0, h)
            self.update_o(ctx, acc_T, add_first=False, h=h)
        ctx.pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def update_o(self, ctx, acc_T, add_first: cutlass.Constexpr, h: cutlass.Constexpr = 0):
        """O += P̂·V̂ of a tile in FP32 (the per-tile promotion), with O's rescale by ``alpha``
        = 2^(m_old − m_new): ``(O + T)·alpha`` (``add_first``: overlap mode, T belongs to the
        previous row reference) or ``O·alpha + T`` (one FFMA per element); ``h``: the chunk
        of output columns ``acc_T`` holds."""
        acc_O_mn = layout_utils.reshape_acc_to_mn(ctx.acc_O[h])
        acc_T_mn = layout_utils.reshape_acc_to_mn(acc_T)
        for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                if const_expr(add_first):
                    acc_O_mn[r, c] = (acc_O_mn[r, c] + acc_T_mn[r, c]) * ctx.alpha[r]
                else:
                    acc_O_mn[r, c] = acc_O_mn[r, c] * ctx.alpha[r] + acc_T_mn[r, c]

    @cute.jit
    def softmax_step(self, ctx, acc_S, state, n, mask: cutlass.Constexpr):
        """Folded logits ``y = s·qfac·2^eK + eV``, integer running reference, ``P = 2^(y − m +
        8)`` (in ``acc_S``), normaliser ``l += P·2^−eV``; ``ctx.alpha`` = 2^(m_old − m_new)
        rescales O. The exponent factors come from the stage the K tile arrived in; past the
        document (``mask``) logits are −inf and ``2^−eV`` is 0, whatever the buffer holds."""
        s_mn = layout_utils.reshape_acc_to_mn(acc_S)
        n_rows = cute.size(ctx.m_run)
        factors = ctx.sF[None, None, state.index]
        # this thread's factors: 4 adjacent floats per 16-key group, from column 2·col0
        thr_factors = cute.domain_offset((2 * ctx.col0, 0), factors)
        for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            key = n * self.tile_n + ctx.col0 + column_offset(j)
            if const_expr(self.k_exp_block > 1):  # one K exponent per aligned key block
                k_scale = factors[column_offset(j) // self.k_exp_block * self.k_exp_block, 0]
            else:
                k_scale = thr_factors[_factor_offset(j), 0]
            v_exp = thr_factors[_factor_offset(j), 1]
            for r in cutlass.range_constexpr(n_rows):
                y = s_mn[r, j] * (ctx.qfac[r] * k_scale) + v_exp
                if const_expr(mask):
                    ok = key < ctx.seqlen
                    if const_expr(self.causal):
                        ok = ok and key <= ctx.row[r]
                    y = y if ok else -Float32.inf
                s_mn[r, j] = y
        ref = cute.make_rmem_tensor(n_rows, Float32)
        l_tile = cute.make_rmem_tensor((n_rows, 2), Float32)  # two partial sums per row
        for r in cutlass.range_constexpr(n_rows):
            row_max = fa_utils.fmax_reduce(s_mn[r, None].load(), init_val=None, arch=90)
            row_max = cute.arch.warp_reduction_max(row_max, threads_in_group=4)
            m_old = ctx.m_run[r]
            m_new = cute.math.ceil(row_max)
            m_new = m_new if m_new > m_old else m_old
            m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
            ctx.alpha[r] = cute.math.exp2(m_old - m_safe, fastmath=True)
            ctx.m_run[r] = m_new
            ref[r] = m_safe - P_HAT_EXP
            l_tile[r, 0] = Float32(0.0)
            l_tile[r, 1] = Float32(0.0)
        if const_expr(self.exp_mode == "mitchell"):
            self.mitchell_p(s_mn, ref)
            p_hat_mn = s_mn  # E4M3 values already: the normaliser sums them as they are
        else:
            for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                for r in cutlass.range_constexpr(n_rows):
                    s_mn[r, j] = cute.math.exp2(s_mn[r, j] - ref[r], fastmath=True)
            # l sums P̂ itself (N3): E4M3 round trips by the hardware conversions, two each
            p8 = cute.make_rmem_tensor(cute.size(acc_S), FP8)
            p8.store(acc_S.load().to(FP8))
            p_hat = cute.make_rmem_tensor(cute.size(acc_S), Float32)
            p_hat.store(p8.load().to(Float32))
            p_hat_mn = layout_utils.reshape_acc_to_mn(
                cute.make_tensor(p_hat.iterator, acc_S.layout)
            )
        for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            v_inv = thr_factors[_factor_offset(j), 2]
            if const_expr(mask):
                key = n * self.tile_n + ctx.col0 + column_offset(j)
                v_inv = v_inv if key < ctx.seqlen else Float32(0.0)
            for r in cutlass.range_constexpr(n_rows):
                l_tile[r, j % 2] += p_hat_mn[r, j] * v_inv
        for r in cutlass.range_constexpr(n_rows):
            ctx.l_run[r] = ctx.l_run[r] * ctx.alpha[r] + (l_tile[r, 0] + l_tile[r, 1])

    @cute.jit
    def mitchell_p(self, s_mn, ref):
        """Mitchell-P (serving only, DESIGN N9, twin ``numerics.exp2.mitchell_codes``): the
        E4M3 code of ``2^(y − ref)`` is ``RNE(8·(y − ref)) + 56`` (integer part → exponent,
        fraction → mantissa), codes under the smallest normal (8) flushed to 0. One FMA
        rounds ``8y + 56 − 8·ref`` through the magic number 1.5·2^23 (its low bits are then
        the code), integer operations make the code's float32 value ``(code + 960) << 20``:
        no exponential, no float→int conversion. ``s_mn`` takes the values."""
        n_rows = cute.size(ref)
        offset = cute.make_rmem_tensor(n_rows, Float32)
        for r in cutlass.range_constexpr(n_rows):
            offset[r] = RNE_MAGIC + (_MITCHELL_BIAS - 8.0 * ref[r])  # exact: ref is integral
        for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
            for r in cutlass.range_constexpr(n_rows):
                code = (s_mn[r, j] * 8.0 + offset[r]).bitcast(Int32) - RNE_MAGIC_BITS
                value = ((code + _E4M3_TO_F32) << 20).bitcast(Float32)
                s_mn[r, j] = value if code >= 8 else Float32(0.0)

    @cute.jit
    def stage_p(self, ctx, acc_S):
        """P̂ = E4M3(P) into the A fragment of the next ``P̂·V̂`` (registers; ``v_t``'s column
        order makes this a register view: ``accumulator_to_a``)."""
        accumulator_to_a(acc_S, ctx.tOrP)

    @cute.jit
    def turn_wait(self, wg):
        if const_expr(self.num_wg > 1):
            cute.arch.barrier(barrier_id=_BAR_TURN + wg, number_of_threads=256)

    @cute.jit
    def turn_pass(self, wg):
        if const_expr(self.num_wg > 1):
            next_wg = wg + 1 if wg + 1 < self.num_wg else 0
            cute.arch.barrier_arrive(barrier_id=_BAR_TURN + next_wg, number_of_threads=256)

    @cute.jit
    def epilogue(self, acc_O, thr_mma_pv, ctx, mO, mM, mLSE, w):
        """O = acc / l in the output dtype, the row reference M and base-2 lse, for the rows
        inside the document. Up to d = 128 (``stage_o``) O goes through shared memory
        (``sO``: the warpgroup's 64 rows, as the accumulator holds them), then out in 16-byte
        row pieces, each row written whole: the accumulator's own pair stores reach 16 bytes
        in each of eight rows per warp store (partial sectors), which took up to a third of a
        short-document pack's forward on the H200 (``fwd_items.py --ablate noepi``)."""
        ctx.l_run.store(fa_utils.warp_reduce(ctx.l_run.load(), lambda a, b: a + b, width=4))
        tOcO = layout_utils.reshape_acc_to_mn(
            thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.d_chunk)))
        )
        out_pairs = cute.recast_tensor(mO, Int32)  # two adjacent output columns per store
        sO = ctx.sO[ctx.wg, None, None]  # (64 rows, _O_ROW words)
        if const_expr(self.stage_o):
            self.wg_sync(ctx.wg)  # the previous item's reads of sO are done
        for r in cutlass.range_constexpr(cute.size(ctx.m_run)):
            inv = cute.arch.rcp_approx(ctx.l_run[r])
            acc_mn = layout_utils.reshape_acc_to_mn(acc_O[0])
            if const_expr(self.stage_o):  # rows past the document are written, not stored
                row = tOcO[r, 0][0] - ctx.wg * 64
                for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 2):
                    sO[row, tOcO[0, c][1] // 2] = fa_utils.cvt_f16x2_f32(
                        acc_mn[r, c] * inv, acc_mn[r, c + 1] * inv, mO.element_type
                    )
            if ctx.row[r] < w.seqlen:
                tok = w.q_base + ctx.row[r]
                if const_expr(not self.stage_o):
                    for h in cutlass.range_constexpr(self.n_chunks):
                        acc_mn = layout_utils.reshape_acc_to_mn(acc_O[h])
                        for c in cutlass.range_constexpr(0, cute.size(acc_mn, mode=[1]), 2):
                            col = h * self.d_chunk + tOcO[0, c][1]
                            out_pairs[tok, w.head, col // 2] = fa_utils.cvt_f16x2_f32(
                                acc_mn[r, c] * inv, acc_mn[r, c + 1] * inv, mO.element_type
                            )
                if tOcO[0, 0][1] == 0:
                    m = ctx.m_run[r]
                    mM[tok, w.head] = m
                    mLSE[tok, w.head] = m - P_HAT_EXP + cute.math.log2(ctx.l_run[r], fastmath=True)
        if const_expr(self.stage_o):
            self.wg_sync(ctx.wg)
            pieces = self.d // 8  # 16-byte pieces of a row
            first_row = w.q_offset + w.tile * self.tile_m + ctx.wg * 64  # among the keys
            s_base = sO.iterator.toint()
            o_at = mO.iterator.toint() + Int64(w.head) * (mO.layout.stride[1] * 2)
            for k in cutlass.range_constexpr(64 * pieces // 128):
                idx = ctx.tid_wg + 128 * k
                row = idx // pieces
                piece = idx - row * pieces
                if first_row + row < w.seqlen:
                    words = load_shared_words(s_base + (row * _O_ROW + piece * 4) * 4, 4)
                    tok = Int64(w.q_base + first_row + row)
                    store_global_words(o_at + tok * (mO.layout.stride[0] * 2) + piece * 16, words)


def _factor_offset(j: int) -> int:
    """Column, relative to ``2·col0``, of the factors of that key in ``v_t``'s permuted
    order (``v_t_position(col0 + column_offset(j)) - 2·col0``; col0 = 2q < 8)."""
    n8 = j // 2
    return 16 * (n8 // 2) + 2 * (n8 % 2) + j % 2


_COMPILED: dict[tuple, object] = {}


def attn_fwd_sm90(
    qkv: KernelQKV,
    cu_seqlens: torch.Tensor,
    work: WorkList,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    *,
    heads_q: int,
    causal: bool,
    qk_scale: float,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    overlap: bool,
    ticket: bool = True,
    cu_seqlens_k: torch.Tensor | None = None,
    exp_mode: str = "exact",
    workspace: PackWorkspace | None = None,
    promote_pv: bool = True,
) -> None:
    """Fill ``out [T, Hq, d]`` (BF16/FP16), ``m_rows``/``lse_rows [T, Hq]`` (float32) from
    quantized operands; ``work`` was built with ``block_m = tile_m`` (one persistent CTA per SM
    takes (item, head) pairs after its first by atomic ticket, or with ``ticket=False`` by a
    static stride). ``qk_scale = softmax_scale·log2(e)``.

    ``cu_seqlens_k`` (extend, as a prefill on top of cached keys): the documents' keys in
    ``qkv.k_codes`` and the column layout, with ``cu_seqlens`` then counting only the query
    rows; each document's queries are its last keys (query ``i`` of ``n`` sees keys ``j <=
    L − n + i`` with ``causal``), and ``work`` was built with the same ``cu_seqlens_k``.
    ``exp_mode="mitchell"`` (serving only; training is always exact): Mitchell-P instead of
    ``exp2`` (``numerics.exp2``). ``workspace``: the pack's, for the ticket counter.
    ``promote_pv=False``: P̂·V̂ accumulates into O inside the ``wgmma`` (``FwdConfig``)."""
    counter = zero_counter(workspace, out.device)
    call = attn_fwd_sm90_call(
        qkv, cu_seqlens, work, out, m_rows, lse_rows, counter, heads_q=heads_q, causal=causal,
        qk_scale=qk_scale, tile_m=tile_m, tile_n=tile_n, num_stages=num_stages,
        overlap=overlap, persistent=ticket, cu_seqlens_k=cu_seqlens_k, exp_mode=exp_mode,
        promote_pv=promote_pv,
    )  # fmt: skip
    call(q=qkv.q_input, out=out, m=m_rows, lse=lse_rows, ticket=counter)


def attn_fwd_sm90_call(
    qkv: KernelQKV,
    cu_seqlens: torch.Tensor,
    work: WorkList,
    out: torch.Tensor,
    m_rows: torch.Tensor,
    lse_rows: torch.Tensor,
    ticket: torch.Tensor,
    *,
    heads_q: int,
    causal: bool,
    qk_scale: float,
    tile_m: int,
    tile_n: int,
    num_stages: int,
    overlap: bool,
    persistent: bool = True,
    cu_seqlens_k: torch.Tensor | None = None,
    exp_mode: str = "exact",
    promote_pv: bool = True,
) -> BoundCall:
    """:func:`attn_fwd_sm90` compiled and bound: ``call(q=qkv.q_input, out=, m=, lse=,
    ticket=)`` launches it, ``ticket`` an int32 zero (``zero_counter``; persistent grid
    only, ``persistent`` = the old ``ticket``); later calls may pass other tensors of the
    same dtypes and layouts (``BoundCall``)."""
    d = qkv.k_codes.shape[2]
    v_t = qkv.v_t.permute(1, 2, 0)  # (d, t_pad, Hkv), keys contiguous
    # NVFP4 Q/K: widened values, one K exponent per key (their second level)
    q_in, k_in, q_exp = qkv.score_operands("CuTe forward", quantizes_q=True)
    wide = qkv.q4 is not None
    # Q as given (defer_q): quantized by the consumers, per token or per 32-token block
    q_block = qkv.k_exp_block if qkv.q_input is not None else 0
    k_exp_block = 1 if wide else qkv.k_exp_block
    # (tensor, byte alignment the kernel may assume): TMA-loaded and paired-store tensors 16
    extend = cu_seqlens_k is not None
    aligned = (
        (q_in, 16), (k_in, 16), (v_t, 16), (q_exp, 4), (qkv.kv_factors, 16),
        (cu_seqlens, 4), (cu_seqlens_k if extend else cu_seqlens, 4), (qkv.doc_v_t_start, 4),
        (work.doc, 4), (work.tile, 4),
        (work.count, 4), (ticket, 4),
        (out, 16),
        (m_rows, 4), (lse_rows, 4),
    )  # fmt: skip
    heads_kv = qkv.k_codes.shape[1]
    stage_o = out.stride(0) % 8 == 0 and out.stride(1) % 8 == 0
    key = (d, heads_q, heads_kv, causal, k_exp_block, tile_m, tile_n, num_stages, overlap,
           persistent, out.dtype, extend, exp_mode, wide, promote_pv, q_block, q_in.dtype,
           stage_o)  # fmt: skip
    if key not in _COMPILED:
        kernel = FlamiaFwdSm90(
            d, heads_q, heads_kv, causal, k_exp_block, tile_m, tile_n, num_stages, overlap,
            persistent, extend, exp_mode, wide, promote_pv, q_block, stage_o,
        )  # fmt: skip
        _COMPILED[key] = compile_kernel(kernel, aligned, Float32(qk_scale), Int32(1))
    ctas = max(1, min(work.num_slots * heads_q, sm_count(out.device)))
    slots = {"q": qkv.q_input, "out": out, "m": m_rows, "lse": lse_rows, "ticket": ticket}
    args = [*kernel_tensors(aligned), qk_scale, ctas]
    return BoundCall(_COMPILED[key], args, slots, fixed=ffi_tensor)
