"""The prepared CuTe launches' plumbing, checked on a CPU (no GPU, no kernel runs).

Eager forward+backward steps on one plan go through the CuTe forward and backward paths
with ``cute.compile`` replaced by a recorder and every Triton launch stubbed (the Triton
launchers' halves are the ones CI runs under the interpreter). Per configuration (recipes
x head dims) it checks what a GPU run could only show as wrong numbers: each launch is
prepared once and kept (``AttnCall.prepared``), and every recorded kernel call of every
step received that step's tensors in its slots (the forward's O/M/lse, Q where the kernel
quantizes it, a fresh ticket; the backward's M/lse in each pass), not the first step's, and
the backward's Triton launches ran in every step in order (the V gather before the
kernels, one dQ read-back after them).

Run in the CuTe venv (``benchmarks/cute_venv.sh``; its Triton may differ from 3.6, whose
interpreter our kernels need, hence the stubs)::

    PYTHONPATH=$PWD /tmp/cute312/bin/python benchmarks/check_cute_plumbing.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors pass the entry point's checks
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from flamia_serve import custom_ops, flamia_attn_varlen, plan_varlen
from flamia_serve.kernels import _common
from flamia_serve.probes import make_pack

LENS = (300, 1, 200)
CONFIGS = [("mxfp8", 128), ("mixed_nvfp4", 128), ("mxfp8_grad_input", 128), ("mxfp8", 64),
           ("mxfp8", 256), ("mxfp8_grad_input", 256), ("mixed_nvfp4", 256)]  # fmt: skip
# positions in the CuTe kernels' argument lists (attn_fwd_sm90_call's / attn_bwd_sm90_launch's
# ``aligned`` order)
FWD_Q, FWD_TICKET, FWD_OUT, FWD_M, FWD_LSE = 0, 11, 12, 13, 14
BWD_M, BWD_LSE, BWD_DK, BWD_DV = 14, 15, 22, 23
COPY_TO_COLUMNS, DQ_READ_BACK = 7, "_dq_from_fragments_kernel"  # columns.py's copies


def stub_triton_launches(calls: list | None = None) -> None:
    """Every ``TritonLaunch``: a no-op returning a no-op runner (so ``BoundLaunch`` takes
    its kept path as after a compiled launch); with ``calls``, each launch and runner call
    appends ``(kernel name, every parameter's value)``."""

    def runner_of(name: str):
        def runner(*values: object) -> None:
            if calls is not None:
                calls.append((name, values))

        return runner

    def launch(self, grid, *args, **kwargs):  # TritonLaunch.__call__
        name = self.kernel.fn.__name__
        runner = runner_of(name)
        runner(*(_common.launch_values(self.kernel, args, kwargs) or args))
        return runner

    _common.TritonLaunch.__call__ = launch


def stub_cute(calls: list | None = None) -> None:
    """The CuTe kernels as if on an sm_90 GPU with 132 SMs, ``cute.compile`` replaced by a
    recorder of each kernel call's ``(kernel class name, args)`` into ``calls`` (None:
    nothing recorded). Needs the CuTe DSL installed (imports the CuTe modules)."""
    from flamia_serve.kernels.attn_bwd import cute_sm90 as bwd_cute
    from flamia_serve.kernels.attn_bwd import ops as bwd_ops
    from flamia_serve.kernels.attn_fwd import cute_sm90 as fwd_cute
    from flamia_serve.kernels.attn_fwd import ops as fwd_ops

    def compile_kernel(kernel, aligned, *scalars, **options):
        name = type(kernel).__name__
        if calls is None:
            return lambda *args: None
        return lambda *args: calls.append((name, args))

    for module in (fwd_cute, bwd_cute):
        module.compile_kernel = compile_kernel
        module.sm_count = lambda device: 132
    for module in (fwd_ops, bwd_ops):
        module.cute_available = lambda device: True


def cute_configs(recipe: str, d: int) -> dict:
    """``flamia_attn_varlen``'s ``config``/``bwd_config`` for the CuTe kernels."""
    from flamia_serve.kernels.attn_bwd.ops import CUTE_BWD_CONFIG
    from flamia_serve.kernels.attn_fwd.ops import default_config

    nvfp4 = recipe.startswith("mixed")
    cfg = default_config(d, torch.device("cpu"), kernel="cute", qk_nvfp4=nvfp4)
    return {"config": cfg, "bwd_config": CUTE_BWD_CONFIG}


def _count_preparations() -> dict:
    counts = {"forward": 0, "backward": 0, "backward kernels": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    custom_ops.prepare_forward = counted("forward", custom_ops.prepare_forward)
    custom_ops.prepare_backward = counted("backward", custom_ops.prepare_backward)
    custom_ops.attn_bwd_launch = counted("backward kernels", custom_ops.attn_bwd_launch)
    return counts


def check(recipe: str, d: int, calls: list, counts: dict, steps: int = 3) -> str:
    configs = cute_configs(recipe, d)
    q_slot = configs["config"].quantize_q and not recipe.startswith("mixed") and d <= 128
    cu, ms = make_pack(LENS, 4, 2, d, seed=1)[3:]
    plan = plan_varlen(cu, sum(LENS), ms)
    counts.update(dict.fromkeys(counts, 0))
    tickets, modes = set(), []
    for step in range(steps):
        q, k, v = (x.requires_grad_() for x in make_pack(LENS, 4, 2, d, seed=2 + step)[:3])
        calls.clear()
        out, m, lse = flamia_attn_varlen(
            q, k, v, cu, ms, plan=plan, recipe=recipe, return_stats=True, **configs
        )
        ((name, args),) = [call for call in calls if call[0].startswith("Flamia")]
        assert name == "FlamiaFwdSm90", name
        assert args[FWD_OUT] is out and args[FWD_M] is m and args[FWD_LSE] is lse, "fwd outputs"
        assert (args[FWD_Q] is q) == q_slot, "fwd Q slot"
        tickets.add(args[FWD_TICKET].data_ptr())
        calls.clear()
        out.float().sum().backward()
        names = [name for name, _ in calls]
        modes = [name for name in names if name.startswith("Flamia")]
        assert modes and set(modes) == {"FlamiaBwdSm90"}, modes
        first, last = names.index("FlamiaBwdSm90"), len(names) - 1 - names[::-1].index(
            "FlamiaBwdSm90")  # fmt: skip
        gathers = [i for i, (name, args) in enumerate(calls)
                   if name == "_copy_kernel" and not args[COPY_TO_COLUMNS]]  # fmt: skip
        assert gathers and max(gathers) < first, f"the V gather before the kernels: {names}"
        assert names.count(DQ_READ_BACK) == 1 and names.index(DQ_READ_BACK) > last, names
        for _, args in (call for call in calls if call[0] == "FlamiaBwdSm90"):
            assert args[BWD_M] is m and args[BWD_LSE] is lse, "bwd M/lse slots"
            assert args[BWD_DK] is not args[BWD_DV]
        assert len({id(args[BWD_DK]) for name, args in calls if name == "FlamiaBwdSm90"}) == 1, (
            "one dK per step"
        )
    assert len(tickets) == steps, "a fresh ticket per forward"
    assert counts == {"forward": 1, "backward": 1, "backward kernels": 1}, counts
    return f"{recipe} d={d}: {len(modes)} backward pass(es), prepared once over {steps} steps"


def main() -> int:
    calls: list[tuple[str, tuple]] = []
    stub_triton_launches(calls)
    stub_cute(calls)
    counts = _count_preparations()
    for recipe, d in CONFIGS:
        print(check(recipe, d, calls, counts))
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
