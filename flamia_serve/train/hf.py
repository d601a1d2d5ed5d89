"""transformers 5.x integration: ``attn_implementation="flamia"``.

``register()`` adds ``"flamia"`` to transformers' ``AttentionInterface`` (and its mask
interface, with the flash-attention rule: no dense mask, a 2-D padding mask only when
there is padding). Model configs choose the numerics with three optional fields:

* ``flamia_recipe`` — ``"mxfp8"`` (default), ``"mxfp8_grad_input"``, ``"mixed_nvfp4"``,
  ``"mixed_nvfp4_hadamard"`` (``numerics.RECIPES``);
* ``flamia_exact_causal`` — per-token Q/K exponents (default ``False``);
* ``flamia_path`` — ``"auto"`` (kernels on CUDA, the reference twin elsewhere),
  ``"kernel"`` or ``"reference"``.

Documents: packed inputs are read as transformers reads them: ``cu_seq_lens_q`` /
``max_length_q`` keyword arguments of a batch-size-1 call when the caller passes them (no
host synchronisation), else document starts from ``position_ids`` (every row start, and a
position that does not follow its predecessor, starts a document, in every row as the
SDPA/eager masks read them; one host read per microbatch, cached across layers; under
``torch.compile`` only for batch size 1: a compiled batch of several rows is one document
per row). Without either, each batch row is one document; a 2-D padding mask is honoured
by packing the unpadded tokens; any other mask (a custom 4-D one, which transformers passes
through as given) raises. Generation with a KV cache (query
shorter than the keys) is not a training call: it raises (serve with the vLLM backend).
"""

from __future__ import annotations

import weakref

import torch

from flamia_serve.plan import VarlenPlan, plan_varlen
from flamia_serve.train.module import flamia_attention, use_kernels

NAME = "flamia"


def register() -> None:
    """Register ``attn_implementation="flamia"`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, flamia_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)


class _LastBySource:
    """What was derived from the last tensor seen (a pack's documents and plan), keyed by
    that tensor's identity and version: every layer of one forward passes the same
    ``cu_seq_lens_q`` / ``position_ids`` / attention mask object."""

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._version = -1
        self._value: object = None

    def get(self, source: torch.Tensor) -> object:
        """The value put for ``source`` (unchanged since), else None."""
        if self._ref is not None and self._ref() is source and source._version == self._version:
            return self._value
        return None

    def put(self, source: torch.Tensor, value: object) -> None:
        self._ref, self._version, self._value = weakref.ref(source), source._version, value


#: (cu_seqlens, plan) of the last packed microbatch ((None, None): a document per row)
_CACHE = _LastBySource()
#: (packing,) of the last attention mask (``_mask_packing``; packing None: no padding)
_UNPADDED = _LastBySource()


def _documents_from_positions(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """``cu_seqlens`` int32 of the flattened ``[batch, S]`` rows: a document starts at every
    row start and where a position does not follow its predecessor, as transformers'
    ``find_packed_sequence_indices`` reads them (reads the device once)."""
    pos = position_ids.expand(batch, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = starts.flatten().nonzero().flatten().to(torch.int32)
    end = torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)
    return torch.cat([idx, end])


def _packed_plan(kwargs: dict, batch: int, seq: int
                 ) -> tuple[torch.Tensor, int, VarlenPlan | None] | None:  # fmt: skip
    """(cu_seqlens, max_seqlen, plan) of a packed call over the flattened ``[batch, seq]``
    tokens, or None when it is not packed (``cu_seq_lens_q`` describes batch size 1)."""
    total = batch * seq
    cu = kwargs.get("cu_seq_lens_q") if batch == 1 else None
    position_ids = kwargs.get("position_ids")
    source = cu if cu is not None else position_ids
    if source is None:
        return None
    if not torch.compiler.is_compiling():
        hit = _CACHE.get(source)
        if hit is not None:  # plan None: a document per row
            return None if hit[1] is None else (hit[0], hit[1].max_seqlen, hit[1])
    if cu is not None:
        cu = cu.to(torch.int32)
        max_len = kwargs.get("max_length_q")
        max_len = int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
    else:
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) \
                or position_ids.shape[1] != seq:  # fmt: skip
            return None
        cu = _documents_from_positions(position_ids, batch)
        if cu.numel() == batch + 1:  # a document per row: the batched path is the same call
            if not torch.compiler.is_compiling():
                _CACHE.put(source, (None, None))  # read once per microbatch, not per layer
            return None
        max_len = int((cu[1:] - cu[:-1]).max())
    if torch.compiler.is_compiling():
        return cu, max_len, None
    plan = plan_varlen(cu, total, max_len)
    _CACHE.put(source, (cu, plan))
    return cu, max_len, plan


def _compute_dtype(query: torch.Tensor, value: torch.Tensor) -> torch.dtype:
    """BF16/FP16 operands: the value's dtype when it is one, else autocast's, else BF16 (under
    autocast Llama hands over FP32 Q/K after RoPE)."""
    if value.dtype in (torch.bfloat16, torch.float16):
        return value.dtype
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
    return torch.bfloat16


#: keyword arguments of transformers' attention interface that change the result and that
#: flamia does not implement (Gemma 2 logit softcapping, GPT-OSS sinks); a sliding window
#: (Mistral, Qwen, Gemma) is refused only where a document is longer than it
UNSUPPORTED_KWARGS = ("softcap", "s_aux")


def _unsupported(name: str, value: object) -> None:
    raise NotImplementedError(
        f"flamia attention does not implement {name} (got {value!r}): use another "
        "attn_implementation for this model (the result would silently differ)"
    )


def flamia_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query ``[B, Hq, S, d]``, key/value ``[B, Hkv, S, d]``
    -> ``([B, S, Hq, d]`` in query's dtype, ``None)``."""
    if dropout:
        raise ValueError(
            f"flamia attention has no dropout; set attention_dropout=0 (got {dropout})"
        )
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            _unsupported(name, kwargs[name])
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            "flamia attention takes attention_mask as a 2-D padding mask [B, S] or None, got "
            f"shape {tuple(attention_mask.shape)}: a custom (e.g. 4-D block-diagonal) mask "
            "would be ignored; pass packed documents as position_ids or cu_seq_lens_q, or use "
            "another attn_implementation"
        )
    if query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            "flamia attention is a training attention (query and key lengths equal); for "
            "generation with a KV cache serve with vLLM (--attention-backend flamia) or use "
            'attn_implementation="sdpa"'
        )
    config = module.config
    opts = dict(
        causal=bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
        recipe=getattr(config, "flamia_recipe", "mxfp8"),
        exact_causal=bool(getattr(config, "flamia_exact_causal", False)),
        softmax_scale=scaling,
        path=getattr(config, "flamia_path", "auto"),
    )
    dtype = _compute_dtype(query, value)
    batch, _, seq, _ = query.shape
    q, k, v = (x.transpose(1, 2).to(dtype) for x in (query, key, value))  # [B, S, H, d]
    # rows with padding are unpadded below; packed rows only without a padding mask (as
    # transformers' masks read position_ids), a single row as before. Under torch.compile
    # a batch of several rows stays one document per row: finding documents inside rows
    # reads the device (data-dependent), which a fullgraph trace of the batched call avoids
    several = batch > 1 and (attention_mask is not None or torch.compiler.is_compiling())
    packed = None if several else _packed_plan(kwargs, batch, seq)
    window = kwargs.get("sliding_window")
    if window is not None and window < (packed[1] if packed is not None else seq):
        _unsupported("sliding_window", window)  # a window no document exceeds changes nothing
    if packed is not None:
        cu, max_len, plan = packed
        if not use_kernels(q.device, opts["path"]):
            plan = None
        flat = (x.flatten(0, 1) for x in (q, k, v))
        out = flamia_attention(*flat, cu, max_len, plan=plan, **opts).view(q.shape)
    elif attention_mask is not None and (packing := _mask_packing(attention_mask, q, opts)):
        out = _unpadded(q, k, v, packing, opts)
    else:
        out = flamia_attention(q, k, v, **opts)
    return out.to(query.dtype), None


def _mask_packing(mask: torch.Tensor, q: torch.Tensor, opts: dict) -> tuple | None:
    """``(token index, cu_seqlens, max_seqlen, plan)`` of the unpadded tokens of the 2-D
    padding ``mask`` ``[B, S]`` (nonzero: a token), each row one document; None when
    nothing is padded. Made once per mask (host reads), not per layer."""
    compiling = torch.compiler.is_compiling()
    hit = None if compiling else _UNPADDED.get(mask)
    if hit is not None:
        return hit[0]
    packing = None
    valid = mask.bool()
    if not valid.all():
        idx = valid.flatten().nonzero().flatten()
        lengths = valid.sum(1)
        cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=q.device)
        cu[1:] = lengths.cumsum(0)
        max_len = max(int(lengths.max()), 1)
        kernels = use_kernels(q.device, opts["path"]) and not compiling
        # valid by construction: no host read to check it
        plan = plan_varlen(cu, int(idx.numel()), max_len, validate=False) if kernels else None
        packing = (idx, cu, max_len, plan)
    if not compiling:
        _UNPADDED.put(mask, (packing,))
    return packing


def _unpadded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: tuple,
              opts: dict) -> torch.Tensor:  # fmt: skip
    """Padded batch ``[B, S, ...]``: its unpadded tokens (``packing``: :func:`_mask_packing`)
    attended as one document per row, scattered back (padded positions get zeros)."""
    idx, cu, max_len, plan = packing
    batch, seq = q.shape[:2]
    packed = flamia_attention(
        q.flatten(0, 1)[idx], k.flatten(0, 1)[idx], v.flatten(0, 1)[idx], cu, max_len,
        plan=plan, **opts,
    )  # fmt: skip
    out = q.new_zeros(batch * seq, *q.shape[2:])
    out = out.index_copy(0, idx, packed)
    return out.view(q.shape)
