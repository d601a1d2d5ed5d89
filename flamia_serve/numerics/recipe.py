"""Attention recipes: which format each product uses (DESIGN.md N2–N7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QKFormat = Literal["e4m3", "nvfp4"]


@dataclass(frozen=True)
class Recipe:
    """A training/serving attention recipe.

    * ``qk_format`` — ``"e4m3"``: Q/K E4M3 with token-block exponents (MXFP8);
      ``"nvfp4"``: QKᵀ from NVFP4 Q/K (per-16 E4M3 scales + per-token power of two).
    * ``hadamard`` — rotate Q and K by the same orthonormal Hadamard matrix before NVFP4.
    * ``token_block`` — tokens sharing a Q/K/dO exponent (N2).
    * ``ds_block`` — (query, key) block of one dS exponent in dK = dSᵀ·Q̂ (N6, the paper's
      32×32); ``dq_ds_block`` — the same for dQ = dS·K̂, whose contraction runs over keys:
      on Hopper one exponent must span the backward kernel's whole key tile (64 keys).

    V is always E4M3 per key (N3); P and dS are E4M3; dO is E4M3 with token-block scales.
    """

    name: str
    qk_format: QKFormat = "e4m3"
    hadamard: bool = False
    token_block: int = 32
    ds_block: tuple[int, int] = (32, 32)
    dq_ds_block: tuple[int, int] = (32, 64)


RECIPES: dict[str, Recipe] = {
    "mxfp8": Recipe("mxfp8"),
    "mixed_nvfp4": Recipe("mixed_nvfp4", qk_format="nvfp4"),
    "mixed_nvfp4_hadamard": Recipe("mixed_nvfp4_hadamard", qk_format="nvfp4", hadamard=True),
}


def resolve_recipe(recipe: str | Recipe) -> Recipe:
    """A :class:`Recipe` from a preset name or an instance; ``ValueError`` names the choices."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)} or a Recipe, got {recipe!r}")
    return RECIPES[recipe]
