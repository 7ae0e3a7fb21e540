"""Where the pieces of the embedded ``tritonserver`` live, and the backend directory we assemble from them.

The ``nvidia-pytriton`` wheel (0.7.0) carries tritonserver 2.51.0, the Python backend, its stubs for several
Python versions and the local response cache; our Python-based backends live in ``python_backends/``. Triton
wants them all under one ``--backend-directory``:

    <build>/backends/python/       libtriton_python.so, triton_python_backend_utils.py, the stub for this Python
    <build>/backends/tokenizer/    -> python_backends/tokenizer (symlink)
    <build>/backends/torchscript/  -> python_backends/torchscript (symlink)
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_BACKENDS = REPO_ROOT / "python_backends"
DEFAULT_BUILD_DIR = REPO_ROOT / ".build"
TEMPLATES = REPO_ROOT / "model_repository"
"""The tracked configs of one model (``embed``: the ensemble, ``tokenizer``, ``encoder``) that ``make model`` fills in
for each model it exports."""
MODEL_REPOSITORY_ENV = "TRITON_EMBED_MODEL_REPOSITORY"
"""The environment variable that names another repository for :data:`DEFAULT_MODEL_REPOSITORY`."""
REFERENCE_REPOSITORY = DEFAULT_BUILD_DIR / "reference_repository"
"""The packaged all-MiniLM-L6-v2 at fp32, which ``make reference-model`` writes for the tests and ``make bench``: a
repository of its own, so that they never replace the model a user exported for ``make serve``."""
DEFAULT_MODEL_REPOSITORY = Path(os.environ.get(MODEL_REPOSITORY_ENV) or DEFAULT_BUILD_DIR / "model_repository")
"""The repository ``make model`` writes and ``make serve`` serves (git-ignored, under the build folder);
``$TRITON_EMBED_MODEL_REPOSITORY`` where set (the tests and ``make bench`` set it to :data:`REFERENCE_REPOSITORY`)."""


class LayoutError(RuntimeError):
    """A file the embedded server needs is missing (nvidia-pytriton not installed, or a Python it has no stub for)."""


@dataclass(frozen=True)
class TritonLayout:
    """Paths inside the installed ``pytriton`` package.

    Attributes:
        root: ``site-packages/pytriton/tritonserver``.
        libs: ``site-packages/nvidia_pytriton.libs`` (shared libraries the binary links against).
    """

    root: Path
    libs: Path

    @property
    def binary(self) -> Path:
        """The ``tritonserver`` executable."""
        return self.root / "bin" / "tritonserver"

    @property
    def cache_dir(self) -> Path:
        """Folder for ``--cache-directory`` (holds ``local/libtritoncache_local.so``)."""
        return self.root / "caches"

    def stub(self) -> Path:
        """The ``triton_python_backend_stub`` built for the running interpreter's major.minor."""
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        path = self.root / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not path.is_file():
            raise LayoutError(f"nvidia-pytriton has no Python backend stub for Python {version} ({path})")
        return path


def find_layout() -> TritonLayout:
    """Locate the tritonserver files of the installed ``nvidia-pytriton``.

    Raises:
        LayoutError: pytriton is not installed or lacks the binary.
    """
    spec = importlib.util.find_spec("pytriton")  # its files only: importing it would load its client
    if spec is None or not spec.submodule_search_locations:
        raise LayoutError("nvidia-pytriton is not installed; run `make serve` or `make install`")
    package = Path(next(iter(spec.submodule_search_locations))).resolve()
    layout = TritonLayout(root=package / "tritonserver", libs=package.parent / "nvidia_pytriton.libs")
    if not layout.binary.is_file():
        raise LayoutError(f"tritonserver binary not found at {layout.binary}")
    return layout


def assemble_backends(layout: TritonLayout, build_dir: Path = DEFAULT_BUILD_DIR) -> Path:
    """Build the ``--backend-directory`` (see the module docstring) and return its path.

    Idempotent: files are refreshed, symlinks re-pointed. Our backend code is linked, not copied, so edits to
    ``python_backends/`` take effect on the next model load.
    """
    backends = build_dir / "backends"
    python_dir = backends / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (
        layout.root / "backends" / "python" / "libtriton_python.so",
        layout.root / "backends" / "python" / "triton_python_backend_utils.py",
        layout.stub(),
    ):
        _install_file(src, python_dir / src.name)
    for backend in sorted(p for p in PYTHON_BACKENDS.iterdir() if (p / "model.py").is_file()):
        link = backends / backend.name
        if link.is_symlink() and link.resolve() == backend.resolve():
            continue
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        tmp = backends / f".{backend.name}.{os.getpid()}"
        tmp.symlink_to(backend, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a server starting at the same time sees the old or the new link
    return backends


def _install_file(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` unless identical; via rename, so a stub another server is running stays intact."""
    if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def server_environment(layout: TritonLayout) -> dict[str, str]:
    """Environment for the ``tritonserver`` process.

    ``LD_LIBRARY_PATH`` gets the wheel's libraries and libpython's folder (the stub embeds this interpreter);
    ``PYTHONPATH`` gets this interpreter's site-packages so the stub imports torch, tokenizers and numpy from the
    same environment we run in.
    """
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(layout.libs), libdir, env.get("LD_LIBRARY_PATH")) if p)
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*site, *filter(None, [env.get("PYTHONPATH")])]))
    return env
