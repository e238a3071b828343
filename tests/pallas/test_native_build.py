"""The native kernels' build: ISA levels, the cache a fleet can share, the lock, --cache-dir.

The cache cases run a stand-in compiler: it logs each command line and "builds" a copy of a
real library of the portable level (which every x86-64 CPU runs), so they cost no compile and
can count the compiles exactly; for two processes racing it takes a second, so they overlap.
A CPU is simulated by replacing `native_isa.cpu_features`; MATRIX is the cache matrix: what a
shared cache holds, the CPU that loads from it, and what it loads and builds.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jserve.config.cache_dir import default_cache_dir
from jserve.pallas import native_build, native_isa
from jserve.pallas.native_build import Build, NativeKernelsUnavailable
from jserve.pallas.native_isa import ISA_ENV, Isa, levels

ROOT = Path(__file__).resolve().parents[2]
BASE = {"fpu", "sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "popcnt"}
NO_AVX = frozenset(BASE)
ZEN1 = NO_AVX | {"xsave", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2"}  # AVX2, no AVX-512
ZEN4 = ZEN1 | {"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512cd"}
KNL = ZEN1 | {"avx512f"}  # Knights Landing: AVX-512 F without VL
X86_ONLY = pytest.mark.skipif(
    platform.machine() not in native_isa.X86_64_MACHINES, reason="x86-64's levels"
)
FAKE_CXX = """#!{python}
import shutil, sys, time
if sys.argv[1:] == ["--version"]:
    print("fake-c++ 1.0")
    sys.exit(0)
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
time.sleep({delay})
shutil.copy({library!r}, sys.argv[sys.argv.index("-o") + 1])
"""


# the macros the sources choose their code paths by, and those each level's build defines
PATH_MACROS = {"AVX2", "FMA", "AVX512F", "AVX512VL"}
PATHS = {"portable": set(), "avx2": {"AVX2", "FMA"}, "avx512": PATH_MACROS}
CPUINFO_NAME = {"SSE3": "pni", "CRC32": "sse4_2"}  # where /proc/cpuinfo names it otherwise


def level(isa: str) -> native_isa.IsaLevel:
    return next(level for level in levels(platform.machine()) if level.isa == isa)


@pytest.fixture(scope="session")
def portable_library() -> Path:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(ISA_ENV, "portable")
        try:
            return native_build.load_or_raise().path
        except NativeKernelsUnavailable as e:
            pytest.skip(f"native CPU kernels unavailable: {e}")


class FakeCompiler:
    def __init__(self, directory: Path, library: Path, delay: float):
        self.path, self.log = directory / "fake-c++", directory / "compiles.log"
        source = FAKE_CXX.format(
            python=sys.executable, log=str(self.log), library=str(library), delay=delay
        )
        self.path.write_text(source)
        self.path.chmod(0o755)

    def compiled(self) -> list[str]:
        """The level of each compile so far, in order (read from its flags)."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [_level_of(line.split()) for line in lines]


def _level_of(flags: list[str]) -> str:
    return "avx512" if "-mavx512f" in flags else "avx2" if "-mavx2" in flags else "portable"


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch, portable_library) -> FakeCompiler:
    """$CXX is the stand-in (its path, in the build key, makes every test's builds its own)."""
    fake = FakeCompiler(tmp_path, portable_library, delay=0)
    monkeypatch.setenv("CXX", str(fake.path))
    monkeypatch.delenv(ISA_ENV, raising=False)
    return fake


def simulate_cpu(monkeypatch, features: frozenset[str]) -> None:
    monkeypatch.setattr(native_isa, "cpu_features", lambda: features)


def test_levels_are_fixed_targets_never_this_machine():
    for lv in (*levels("x86_64"), *levels("aarch64")):
        native = [f for f in lv.flags if f.endswith("=native") or f.startswith("-mtune=")]
        assert native in ([], ["-mtune=generic"]), lv
    x86 = levels("x86_64")
    assert [lv.isa for lv in x86] == [Isa.PORTABLE, Isa.AVX2, Isa.AVX512]
    assert all(a.features < b.features for a, b in itertools.pairwise(x86))  # each needs more
    assert levels("aarch64") == (native_isa.IsaLevel(Isa.PORTABLE, (), frozenset()),)


@X86_ONLY
@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512"])
def test_flags_enable_exactly_the_features_the_level_needs(isa):
    """The ISA macros a level's flags define beyond the x86-64 baseline choose the sources'
    code paths as -march=native does on a CPU of that level, and the CPU check covers every
    instruction set they enable (a macro's /proc/cpuinfo name is among the level's features)."""
    try:
        compiler = native_build.find_compiler()
    except NativeKernelsUnavailable as e:
        pytest.skip(f"native CPU kernels unavailable: {e}")

    def macros(flags):
        cmd = [compiler, *flags, "-dM", "-E", "-x", "c++", os.devnull]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return set(re.findall(r"^#define __([A-Z0-9_]+)__ 1$", out, re.MULTILINE))

    extra = macros(level(isa).flags) - macros(level("portable").flags)
    assert extra & PATH_MACROS == PATHS[isa]
    assert {CPUINFO_NAME.get(m, m.lower()) for m in extra} <= level(isa).features


@X86_ONLY
@pytest.mark.parametrize(
    ("features", "override", "chosen"),
    [
        (ZEN4, None, "avx512"),
        (ZEN1, None, "avx2"),  # an AMD Zen 1: AVX2, no AVX-512
        (KNL, None, "avx2"),  # the AVX-512 block needs VL too
        (NO_AVX, None, "portable"),
        (frozenset(), None, "portable"),  # no /proc/cpuinfo
        (ZEN4, "avx2", "avx2"),
        (ZEN4, "portable", "portable"),
    ],
)
def test_the_widest_level_the_cpu_runs_or_the_override(monkeypatch, features, override, chosen):
    simulate_cpu(monkeypatch, features)
    if override:
        monkeypatch.setenv(ISA_ENV, override)
    else:
        monkeypatch.delenv(ISA_ENV, raising=False)
    assert native_isa.choose_level().isa == chosen


def test_an_override_the_cpu_cannot_run_is_an_error(monkeypatch):
    simulate_cpu(monkeypatch, ZEN1)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=r"lacks \(avx512f, avx512vl\).*portable, avx2"):
        native_isa.choose_level()
    monkeypatch.setenv(ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="levels on x86_64 are portable, avx2, avx512"):
        native_isa.choose_level()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setenv(ISA_ENV, "avx2")
    with pytest.raises(ValueError, match=r"levels on aarch64 are portable$"):
        native_isa.choose_level()


# shared cache holds (built on other machines) -> this CPU -> level loaded, levels compiled here
MATRIX = {
    "avx512_cache_avx512_cpu": (["avx512"], ZEN4, "avx512", []),
    "avx512_cache_avx2_cpu": (["avx512"], ZEN1, "avx2", ["avx2"]),
    "avx512_cache_avx512f_only_cpu": (["avx512"], KNL, "avx2", ["avx2"]),
    "avx512_cache_no_avx_cpu": (["avx512"], NO_AVX, "portable", ["portable"]),
    "avx2_cache_avx512_cpu": (["avx2"], ZEN4, "avx512", ["avx512"]),
    "every_level_cached_avx2_cpu": (["portable", "avx2", "avx512"], ZEN1, "avx2", []),
}


@X86_ONLY
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_cache_matrix(monkeypatch, tmp_path, fake_cxx, name):
    """A cache shared between machines: each loads the widest level it runs, built there or
    by another machine, and never touches another level's library."""
    cached, features, loaded, compiled_here = MATRIX[name]
    directory = tmp_path / "cache" / "native"
    for isa in cached:  # built by other machines
        native_build.built_library(Build.plan(str(fake_cxx.path), level(isa)), directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    simulate_cpu(monkeypatch, features)
    kernels = native_build.load_or_raise(tmp_path / "cache")
    assert kernels.level.isa == loaded
    assert kernels.path.parent == directory and kernels.path.name.startswith(
        f"jserve_cpu_kernels-{loaded}-"
    )
    assert fake_cxx.compiled() == [*cached, *compiled_here]
    assert {name: (directory / name).read_bytes() for name in before} == before


@X86_ONLY
@pytest.mark.parametrize("plant", ["features_this_cpu_lacks", "no_sidecar", "another_build"])
def test_a_library_this_cpu_cannot_run_is_rebuilt_not_loaded(
    monkeypatch, tmp_path, fake_cxx, portable_library, plant
):
    """Where this CPU's build belongs lies a library that is not it (here not even a library:
    loading it would fail): its sidecar claims AVX-512 on an AVX2 CPU, is missing (an
    interrupted build) or names another build. It is rebuilt for this CPU and that is loaded."""
    simulate_cpu(monkeypatch, ZEN1)
    build = Build.plan(str(fake_cxx.path), level("avx2"))
    library = build.library(tmp_path / "native")
    library.parent.mkdir()
    library.write_bytes(b"not a library")
    record = build.record()
    if plant == "features_this_cpu_lacks":
        record["features"] += ["avx512f", "avx512vl"]
    elif plant == "another_build":
        record["key"] = "0" * 16
    if plant != "no_sidecar":
        native_build.sidecar(library).write_text(json.dumps(record))
    kernels = native_build.load_or_raise(tmp_path)
    assert kernels.path == library and fake_cxx.compiled() == ["avx2"]
    assert library.read_bytes() == portable_library.read_bytes()
    assert json.loads(native_build.sidecar(library).read_text()) == build.record()


CHILD = """
import os, sys, time
from pathlib import Path
from jserve.pallas import native_build
cache, ready = Path(sys.argv[1]), Path(sys.argv[2])
(ready / str(os.getpid())).touch()
while len(list(ready.iterdir())) < 2:  # both processes ask for the build at once
    time.sleep(0.01)
print(native_build.load_or_raise(cache).path)
"""


def test_two_processes_starting_at_once_build_once(tmp_path, portable_library):
    fake_cxx = FakeCompiler(tmp_path, portable_library, delay=1)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = {k: v for k, v in os.environ.items() if k != ISA_ENV} | {"CXX": str(fake_cxx.path)}
    cmd = [sys.executable, "-c", CHILD, str(tmp_path / "cache"), str(ready)]
    children = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    outs = [child.communicate(timeout=300) for child in children]
    assert [child.returncode for child in children] == [0, 0], [err[-2000:] for _, err in outs]
    [path] = {out.decode().strip() for out, _ in outs}  # both loaded the same library
    assert Path(path).parent == tmp_path / "cache" / "native"
    assert len(fake_cxx.compiled()) == 1


def test_the_engine_builds_its_kernels_under_its_cache_dir(
    monkeypatch, tmp_path, fake_cxx, default_model
):
    """EngineArgs.cache_dir (--cache-dir) is where the native build lands, and the model's
    kernels are that build; nothing is built in the default cache directory."""
    from jserve.config.engine_args import EngineArgs
    from jserve.engine.setup import build_engine_parts

    args = EngineArgs(
        cache_dir=str(tmp_path / "cache"), compilation_cache_dir=str(default_cache_dir() / "xla"),
        max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=8, max_model_len=64,
    )  # fmt: skip
    parts = build_engine_parts(args, default_model)
    [library] = (tmp_path / "cache" / "native").glob("*.so")
    assert parts.runner.matmul_impl == "native" and native_build.load().path == library
    assert len(fake_cxx.compiled()) == 1
    key = native_build.load().key
    assert not list((default_cache_dir() / "native").glob(f"*{key}*"))


def test_a_long_build_says_it_is_still_going(tmp_path, portable_library, monkeypatch, caplog):
    """A start-up is never silent for long: a line when the build starts, one every
    HEARTBEAT_S while the compiler runs, and one when it is done."""
    fake_cxx = FakeCompiler(tmp_path, portable_library, delay=0.35)
    monkeypatch.setenv("CXX", str(fake_cxx.path))
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.setattr(native_build, "HEARTBEAT_S", 0.1)
    build = Build.plan(str(fake_cxx.path), native_isa.choose_level())
    with caplog.at_level("INFO", logger=native_build.__name__):
        native_build.built_library(build, tmp_path / "cache")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("building native CPU kernels")
    assert sum("so far" in line for line in lines) >= 2, lines
    assert lines[-1].startswith("built native CPU kernels") and len(fake_cxx.compiled()) == 1
