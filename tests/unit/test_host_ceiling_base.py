"""host-ceiling --base: the folder that imports another checkout's code as `lmserve` (server/bench/host_ceiling.py)."""

from __future__ import annotations

import subprocess
import sys

from lmserve.client.bench.harness import ROOT
from lmserve.server.bench.host_ceiling import PACKAGE_DIRS, _import_root


def test_the_import_root_maps_every_package_onto_the_checkout(tmp_path):
    root = _import_root(ROOT, tmp_path / "root")
    for name, folder in PACKAGE_DIRS.items():
        assert (root / "lmserve" / name).resolve() == (ROOT / folder).resolve()
    code = ("import lmserve.server.engine.sampler as s, lmserve.v1.lmserve_pb2 as p, lmserve.client as c; "
            "print(s.__file__); print(p.__file__); print(c.__file__)")
    done = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(root)}, capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(line.startswith(str(root / "lmserve")) for line in done.stdout.split())  # not the installed package
