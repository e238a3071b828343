"""The policy half must import without jax (the import rule in docs/architecture.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import importlib, importlib.abc, pkgutil, sys

    class NoJax(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax", "jaxlib", "flax"):
                raise ImportError(f"{name} must not be imported by the scheduling core")
            return None

    sys.meta_path.insert(0, NoJax())
    try:
        import jax  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the jax blocker does not work")

    import jserve.core
    names = ["jserve.config", "jserve.sampling_params", "jserve.settings", "jserve.stopping"] + [
        m.name for m in pkgutil.walk_packages(jserve.core.__path__, "jserve.core.")
    ]
    for name in names:
        importlib.import_module(name)
    print(" ".join(sorted(names)))
    """
)


def test_core_modules_import_without_jax():
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    imported = set(result.stdout.split())
    expected = {
        "jserve.config",
        "jserve.sampling_params",
        "jserve.settings",
        "jserve.stopping",
        "jserve.core.admission",
        "jserve.core.deadlines",
        "jserve.core.block_manager",
        "jserve.core.buckets",
        "jserve.core.plan",
        "jserve.core.planner",
        "jserve.core.prefix_cache",
        "jserve.core.queues",
        "jserve.core.request",
        "jserve.core.scheduler",
    }
    assert expected <= imported
