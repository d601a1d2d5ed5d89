"""``PagedKVCache``: one layer's paged K/V cache in a FLAMIA format, written and read by the
serving kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flamia_serve.kernels.paged import paged_attention, write_kv_cache
from flamia_serve.kernels.paged.ops import _static_inverses, check_kernel_format
from flamia_serve.numerics.checks import check_int
from flamia_serve.numerics.exp2 import ExpMode
from flamia_serve.numerics.kv_pages import KVCacheDtype, KVPageFormat


@dataclass
class PagedKVCache:
    """A uint8 cache ``[num_blocks, 2, Hkv, page_size * slot_bytes]`` (``numerics.kv_pages``)
    plus its format. ``hadamard`` rotates K at write time and Q at attention time;
    ``k_scale``/``v_scale`` are the static scales of the ``fp8_static`` format."""

    data: torch.Tensor
    fmt: KVPageFormat
    hadamard: bool = False
    k_scale: float = 1.0
    v_scale: float = 1.0

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        page_size: int,
        heads_kv: int,
        head_dim: int,
        dtype: KVCacheDtype = "fp8",
        *,
        device: torch.device | str = "cuda",
        hadamard: bool = False,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> PagedKVCache:
        """A zeroed cache (page sizes 16, 32 and 64 are the tested ones; head dims 64, 128,
        256: the kernels' ``SUPPORTED_HEAD_DIMS``)."""
        for name, value in (("num_blocks", num_blocks), ("page_size", page_size),
                            ("heads_kv", heads_kv), ("head_dim", head_dim)):  # fmt: skip
            check_int(value, name, low=1)
        fmt = check_kernel_format(KVPageFormat(dtype, head_dim))  # type: ignore[arg-type]
        _static_inverses(fmt, k_scale, v_scale)  # refused here, not at the first write
        data = torch.zeros(fmt.cache_shape(num_blocks, page_size, heads_kv), dtype=torch.uint8,
                           device=device)  # fmt: skip
        return cls(data, fmt, hadamard, k_scale, v_scale)

    @property
    def page_size(self) -> int:
        return self.fmt.page_size_of(self.data)

    @property
    def heads_kv(self) -> int:
        return self.data.shape[2]

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantize new ``key``/``value`` ``[N, Hkv, d]`` into their slots (−1 = skip)."""
        write_kv_cache(self.data, key, value, slot_mapping, self.fmt, hadamard=self.hadamard,
                       k_scale=self.k_scale, v_scale=self.v_scale)  # fmt: skip

    def attention(
        self,
        q: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        *,
        softmax_scale: float | None = None,
        window: int | None = None,
        exp_mode: ExpMode = "exact",
        **launch: object,
    ) -> torch.Tensor:
        """Paged attention of ``q`` ``[T, Hq, d]`` (``kernels.paged.paged_attention``)."""
        return paged_attention(
            q, self.data, self.fmt, block_table, seq_lens, query_start_loc,
            softmax_scale=softmax_scale, window=window, exp_mode=exp_mode,
            hadamard=self.hadamard, k_scale=self.k_scale, v_scale=self.v_scale,
            **launch,  # type: ignore[arg-type]
        )  # fmt: skip
