"""The layers stay apart: app/ never imports ray, and the serving path (ingress, replica shell, async front,
API) loads without torch or transformers, which only the process that runs a model needs: a replica that
routes, or serves from an engine process, starts seconds sooner and smaller."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _loaded_after(module: str, heavy: tuple[str, ...]) -> list[str]:
    code = f"import sys, {module}; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_the_serving_path_imports_neither_torch_nor_transformers():
    for module in ("deployments.ingress", "deployments.replica", "app.server", "app.api.serving", "app.spec.remote"):
        assert _loaded_after(module, ("torch", "transformers")) == [], module


def test_app_never_imports_ray():
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "app").rglob("*.py")
                 if any(line.lstrip().startswith(("import ray", "from ray")) for line in path.read_text().splitlines())]
    assert offenders == []
