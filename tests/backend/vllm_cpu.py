"""vLLM 0.26 on a CPU machine for backend tests (``notes/vllm.md``): stub the CUDA
extension modules, install a CUDA platform reporting a chosen compute capability, and
register a tiny stand-in model architecture so engine configs build without importing
vLLM's CUDA model code. Kernels run under Triton's interpreter; the engine never starts."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch

STUB_MODULES = ("vllm._C_stable_libtorch", "vllm._C", "vllm.vllm_flash_attn")
ARCH = "FlamiaCpuTestLlama"


class _Stub(types.ModuleType):
    """A module whose every attribute is a function that refuses to run."""

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"{self.__name__}.{attr} is a CPU test stub")

        return unavailable


def install(capability: tuple[int, int] = (9, 0)) -> None:
    """Stub vLLM's CUDA modules and make the current platform a CUDA GPU of
    ``capability`` (idempotent; call before importing vLLM's config modules)."""
    for name in STUB_MODULES:
        sys.modules.setdefault(name, _Stub(name))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class CpuTestCuda(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "CPU test stand-in for a CUDA GPU"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def log_warnings(cls) -> None:
            pass

    platforms._current_platform = CpuTestCuda()
    _register_model()


def set_capability(capability: tuple[int, int]) -> None:
    """Change the stand-in platform's compute capability."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    type(current_platform).get_device_capability = classmethod(  # type: ignore[method-assign]
        lambda cls, device_id=0: DeviceCapability(*capability)
    )


def _register_model() -> None:
    from vllm import ModelRegistry

    if ARCH in ModelRegistry.get_supported_archs():
        return

    class FlamiaCpuTestLlama(torch.nn.Module):
        """Architecture stand-in: inspected by vLLM's config code, never run."""

        def __init__(self, *, vllm_config: object = None, prefix: str = "") -> None:
            super().__init__()

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    intermediate_tensors: object = None,
                    inputs_embeds: object = None) -> torch.Tensor:  # fmt: skip
            raise NotImplementedError

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            raise NotImplementedError

    ModelRegistry.register_model(ARCH, FlamiaCpuTestLlama)


def write_model_dir(path: Path, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                    dtype: str = "bfloat16",
                    sliding_window: int | None = None) -> Path:  # fmt: skip
    """A model directory holding only a Llama-shaped ``config.json``."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": [ARCH], "model_type": "llama", "hidden_size": heads * head_dim,
        "intermediate_size": 4 * heads * head_dim, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 2,
        "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "torch_dtype": dtype, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    if sliding_window is not None:
        cfg["sliding_window"] = sliding_window
    (path / "config.json").write_text(json.dumps(cfg))
    return path
