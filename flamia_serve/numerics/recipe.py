"""Attention recipes: which format each product uses (DESIGN.md N2–N7)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QKFormat = Literal["e4m3", "nvfp4"]
GradQK = Literal["codes", "input"]
MAX_NVFP4_SCALE_CANDIDATES = 8


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
    * ``grad_qk`` — the Q and K that dK = dŜᵀ·Q and dQ = dŜ·K multiply (N6): ``"codes"``,
      Q̂/K̂ (E4M3); ``"input"``, the unquantized inputs as ``Q·2^-eQ`` / ``K·2^-eK`` rounded to
      BF16 (exact for BF16 inputs; ``numerics.grad_operand``) with Q̂/K̂'s E4M3 exponents,
      so dŜ's codes and scales are those of ``"codes"``. The scores keep Q̂/K̂ either way:
      the forward and P̂ do not change.
    * ``nvfp4_scale_candidates`` — NVFP4 Q/K only (N7): E4M3 block scales tried per group of
      16, from the round-up scale downwards one E4M3 step at a time; each group keeps the
      one of least squared error (``numerics.nvfp4_group_scale``). 1 is the round-up scale
      alone (no code clamps); the presets use 3 (relative error of normal data 0.100 →
      0.087).

    V is always E4M3 per key (N3); P and dS are E4M3; dO is E4M3 with token-block scales.
    """

    name: str
    qk_format: QKFormat = "e4m3"
    hadamard: bool = False
    token_block: int = 32
    ds_block: tuple[int, int] = (32, 32)
    dq_ds_block: tuple[int, int] = (32, 64)
    grad_qk: GradQK = "codes"
    nvfp4_scale_candidates: int = 3

    def __post_init__(self) -> None:
        if not 1 <= self.nvfp4_scale_candidates <= MAX_NVFP4_SCALE_CANDIDATES:
            raise ValueError(
                f"Recipe.nvfp4_scale_candidates must be in [1, {MAX_NVFP4_SCALE_CANDIDATES}], "
                f"got {self.nvfp4_scale_candidates!r}"
            )
        if self.grad_qk not in ("codes", "input"):
            raise ValueError(f"Recipe.grad_qk must be 'codes' or 'input', got {self.grad_qk!r}")

    @property
    def grad_input(self) -> bool:
        """dK/dQ multiply the unquantized Q/K (``grad_qk == "input"``)."""
        return self.grad_qk == "input"


RECIPES: dict[str, Recipe] = {
    "mxfp8": Recipe("mxfp8"),
    "mixed_nvfp4": Recipe("mixed_nvfp4", qk_format="nvfp4"),
    "mixed_nvfp4_hadamard": Recipe("mixed_nvfp4_hadamard", qk_format="nvfp4", hadamard=True),
    # mxfp8 whose gradient products multiply dŜ by the unquantized Q and K (N6)
    "mxfp8_grad_input": Recipe("mxfp8_grad_input", grad_qk="input"),
}


def resolve_recipe(recipe: str | Recipe) -> Recipe:
    """A :class:`Recipe` from a preset name or an instance; ``ValueError`` names the choices."""
    if isinstance(recipe, Recipe):
        return recipe
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)} or a Recipe, got {recipe!r}")
    return RECIPES[recipe]
