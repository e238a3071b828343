"""The import contracts hold, can fail, and are what docs/architecture.md says; every package
installs, and none of them as a top-level `server`."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.contracts import ROOT, assemble, layer_table, lint_imports


def test_the_import_contracts_hold(tmp_path):
    result = lint_imports(assemble(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        ("jserve/core/plan.py", "import jserve.engine.llm_engine", "Layers"),  # up a layer
        ("jserve/core/buckets.py", "import jax", "Policy is pure Python"),
        ("jserve/pallas/kv_cache.py", "import jserve.core.plan", "Layers"),  # kernels: no policy
        ("jserve/loaders/tokenizer.py", "import jserve.core.request", "Layers"),  # a sibling
        ("jserve/server/app.py", "import jax.numpy", "The server imports no JAX"),
        ("jserve/server/app.py", "from jserve.runtime import sampler", "The server imports no"),
        ("jserve/core/request.py", "from jserve.core import scheduler", "No import cycle"),
        ("jserve/core/scheduler.py", "import jserve.simulate.simulator", "Layers"),  # upward
        ("jserve/simulate/costs.py", "import jserve.engine.llm_engine", "Layers"),  # a sibling
        ("jserve/simulate/costs.py", "import jserve.runtime.sampler", "The simulator is pure"),
    ],
)
def test_a_planted_wrong_way_import_breaks_its_contract(tmp_path, module, line, broken):
    tree = assemble(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    report = result.stdout.replace("\n", " ")
    assert f"{broken}" in report and "BROKEN" in report, result.stdout


def test_the_architecture_doc_shows_the_contracts_layer_table():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert layer_table() in doc, "paste tests.contracts.layer_table() into the doc:\n" + (
        layer_table()
    )


def test_every_package_folder_is_installed_and_server_only_as_jserve_server():
    with open(ROOT / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in ROOT.glob("jserve/**/*.py")}
    assert set(setuptools["packages"]) == folders | {"jserve.server"}
    assert setuptools["package-dir"] == {"jserve.server": "server"}
    assert not list(Path(ROOT / "server").glob("*/__init__.py"))  # no subpackage left out
