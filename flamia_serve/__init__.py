"""flamia_serve: low-precision, causally safe attention for training and serving."""

from flamia_serve.attention import flamia_attn, flamia_attn_varlen
from flamia_serve.numerics import RECIPES, Recipe
from flamia_serve.plan import VarlenPlan, plan_varlen

__all__ = ["RECIPES", "Recipe", "VarlenPlan", "flamia_attn", "flamia_attn_varlen", "plan_varlen"]
__version__ = "0.1.0"
