"""The layers stay apart: app/ never imports ray, and the serving path (ingress, replica shell, async front,
API) loads without torch or transformers, which only the process that runs a model needs: a replica that
routes, or serves from an engine process, starts seconds sooner and smaller."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _first_to_load(modules: tuple[str, ...], heavy: tuple[str, ...]) -> dict[str, list[str]]:
    """Import ``modules`` in order in one fresh interpreter; for each, which of ``heavy`` were loaded once it was
    (the first module that loads one names the culprit)."""
    code = ("import importlib, json, sys; loaded = {}\n"
            f"for module in {modules!r}:\n"
            "    importlib.import_module(module)\n"
            f"    loaded[module] = [m for m in {heavy!r} if m in sys.modules]\n"
            "print(json.dumps(loaded))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_serving_path_imports_neither_torch_nor_transformers():
    modules = ("deployments.ingress", "deployments.replica", "app.server", "app.api.serving", "app.spec.remote")
    loaded = _first_to_load(modules, ("torch", "transformers"))
    assert loaded == {module: [] for module in modules}, loaded


def test_app_never_imports_ray():
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "app").rglob("*.py")
                 if any(line.lstrip().startswith(("import ray", "from ray")) for line in path.read_text().splitlines())]
    assert offenders == []
