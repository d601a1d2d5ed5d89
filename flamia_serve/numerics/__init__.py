"""Numerics core: codecs, scale rules, quantizers, recipes and argument checks.

Everything that decides a bit lives here; kernels and the reference twin import it.
"""

from flamia_serve.numerics.formats import (
    E2M1_MAX,
    E4M3_MAX,
    EXP_MAX,
    EXP_MIN,
    NVFP4_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_ceil,
    e4m3_encode,
    exp2i,
    hadamard,
    nvfp4_block_scale,
    pack_e2m1,
    pow2_exponent_ceil,
    unpack_e2m1,
)
from flamia_serve.numerics.recipe import RECIPES, Recipe, resolve_recipe
from flamia_serve.numerics.scales import (
    TOKEN_BLOCK,
    Block2DTensor,
    FP8Tensor,
    Granularity,
    NVFP4Tensor,
    fp8_exponents,
    quantize_blocks_2d,
    quantize_fp8,
    quantize_nvfp4,
    token_block_ids,
    token_documents,
)

__all__ = [
    "E2M1_MAX",
    "E4M3_MAX",
    "EXP_MAX",
    "EXP_MIN",
    "NVFP4_MAX",
    "RECIPES",
    "TOKEN_BLOCK",
    "Block2DTensor",
    "FP8Tensor",
    "Granularity",
    "NVFP4Tensor",
    "Recipe",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_ceil",
    "e4m3_encode",
    "exp2i",
    "fp8_exponents",
    "hadamard",
    "nvfp4_block_scale",
    "pack_e2m1",
    "pow2_exponent_ceil",
    "quantize_blocks_2d",
    "quantize_fp8",
    "quantize_nvfp4",
    "resolve_recipe",
    "token_block_ids",
    "token_documents",
    "unpack_e2m1",
]
