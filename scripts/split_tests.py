"""Deal test files to N parallel streams by size (largest first, to the least-loaded stream).

    python scripts/split_tests.py N PATH...    -> N lines, each the files of one stream
"""

import pathlib
import sys

n = int(sys.argv[1])
files: list[pathlib.Path] = []
for a in sys.argv[2:]:
    p = pathlib.Path(a)
    files += sorted(p.glob("test_*.py")) if p.is_dir() else [p]
load = [0] * n
out: list[list[str]] = [[] for _ in range(n)]
for f in sorted(files, key=lambda f: -f.stat().st_size):
    k = load.index(min(load))
    load[k] += f.stat().st_size
    out[k].append(str(f))
print("\n".join(" ".join(o) for o in out))
