"""Re-split staged device bundles so that each part fits one ``device`` call with this tree.

A call carries the working tree (tracked and untracked-not-ignored files) plus the carried
part, 64 MiB in all. ``../shared/device/stage.sh`` cuts parts of 60 MiB, which with this
repository's ~4.7 MB tree no longer fit (seen 2026-12-01). After ``stage.sh BUNDLE``, run

    python benchmarks/fit_stage_parts.py vllm fa4 [--margin-kib 4096]

to rewrite ``.stage/BUNDLE/partN`` from the stage cache (``$FLAMIA_STAGE_CACHE``, default
``~/.cache/flamia-stage``) with the largest part size that fits, using the shared
``split_parts.py`` and ``install.sh`` (so the parts install as before).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CALL_BYTES = 64 * 2**20
ROOT = Path(__file__).resolve().parents[1]
SHARED_DEVICE = ROOT.parent / "shared" / "device"


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files a device call sends: tracked plus untracked-not-ignored."""
    cmd = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    names = subprocess.run(cmd, cwd=root, check=True, capture_output=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names
               if n and (root / n.decode()).is_file())  # fmt: skip


def part_limit(tree: int, margin: int) -> int:
    """The largest part that fits one call beside a tree of ``tree`` bytes."""
    limit = CALL_BYTES - tree - margin
    if limit < 8 * 2**20:
        raise ValueError(f"the working tree ({tree / 2**20:.1f} MiB) leaves no room for a part")
    return limit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundles", nargs="+")
    p.add_argument("--margin-kib", type=int, default=4096,
                   help="room left in a call (2026-12-05: 0.5 MiB was refused as over 64 MiB)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(SHARED_DEVICE))
    import split_parts  # the shared splitter

    cache = Path(os.environ.get("FLAMIA_STAGE_CACHE", Path.home() / ".cache/flamia-stage"))
    tree = tree_bytes()
    split_parts.LIMIT = part_limit(tree, args.margin_kib * 1024)
    print(f"tree {tree / 2**20:.2f} MiB -> parts of at most {split_parts.LIMIT / 2**20:.2f} MiB")
    for bundle in args.bundles:
        split_parts.main(str(cache / bundle), str(ROOT / ".stage" / bundle),
                         str(SHARED_DEVICE / "install.sh"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
