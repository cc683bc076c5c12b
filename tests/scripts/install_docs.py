"""Runs the install recipes of docs/install.md as written (``nox -s install_docs``).

    python tests/scripts/install_docs.py [RECIPE ...]    # clone, wheel; default both

Each recipe is the page's bash blocks marked ``<!-- install-test: NAME ... -->``, in the
page's order, run as one ``bash`` script (``set -euo pipefail``) in a fresh copy of the clone
(the files git tracks or would track, uncommitted edits included) with the machine's own
environment, less anything of a venv or of jaxddp's test settings. ``wheel`` runs with every
``nvcc`` taken off ``PATH``, ``clone`` with the ``PATH`` as it is: a recipe must hold on a
machine with an ``nvcc`` (this project's CI machine has a wrapper script by that name) and on
one without. After the page's blocks (whose last runs the digits example on 2 ranks from
another folder), the script checks that the Python the recipe left active is the copy's new
venv and that ``jaxddp`` was imported from that venv, at pyproject.toml's version. Exit 1 if
any recipe fails; each recipe's seconds are printed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "install.md"
RECIPES = ("clone", "wheel")
TIMEOUT = 1200  # seconds per recipe: two mpi4jax-sized builds would fit, a hang would not
BLOCK = re.compile(r"<!-- install-test: ([\w ]+) -->\n```bash\n(.*?)```", re.DOTALL)
# What the recipe's last Python must show: that it is the venv the recipe made in the copy,
# and that jaxddp comes from that venv, not from the clone's sources.
VERIFY = """
python - "$COPY" "$VERSION" <<'EOF'
import sys
from pathlib import Path

import jaxddp

copy, version = Path(sys.argv[1]).resolve(), sys.argv[2]
venv = Path(sys.prefix).resolve()
assert venv.is_relative_to(copy) and venv != Path(sys.base_prefix).resolve(), (venv, copy)
module = Path(jaxddp.__file__).resolve()
assert module.is_relative_to(venv / "lib"), f"jaxddp imported from {module}, not {venv}"
assert jaxddp.__version__ == version, (jaxddp.__version__, version)
print(f"install-test: jaxddp {version} from {module}")
EOF
"""


def recipes(text: str) -> dict[str, str]:
    """Each recipe's blocks, joined in the page's order."""
    found: dict[str, list[str]] = {}
    for names, block in BLOCK.findall(text):
        for name in names.split():
            found.setdefault(name, []).append(block)
    return {name: "".join(blocks) for name, blocks in found.items()}


def copy_clone(dest: Path) -> None:
    """The clone's files as a fresh clone of its working tree would hold them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


def path_without_nvcc(path: str, scratch: Path) -> str:
    """``path`` with every folder that holds an ``nvcc`` replaced by a folder of links to
    everything else in it."""
    folders = []
    for i, folder in enumerate(path.split(os.pathsep)):
        if not (folder and (Path(folder) / "nvcc").exists()):
            folders.append(folder)
            continue
        shadow = scratch / f"path-{i}"
        shadow.mkdir(parents=True)
        for entry in Path(folder).iterdir():
            if entry.name != "nvcc":
                (shadow / entry.name).symlink_to(entry)
        folders.append(str(shadow))
    return os.pathsep.join(folders)


def environment(scratch: Path, *, hide_nvcc: bool) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAXDDP_", "NOX_", "PIP_REQUIRE_VIRTUALENV"))
        and k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME", "CUDA_ROOT")
    }
    venv = os.environ.get("VIRTUAL_ENV")
    path = env.get("PATH", "")
    if venv:  # a caller's active venv is not the machine's
        path = os.pathsep.join(p for p in path.split(os.pathsep) if not p.startswith(venv))
    if hide_nvcc:
        path = path_without_nvcc(path, scratch / "bin")
    env["PATH"] = path
    env["TMPDIR"] = str(scratch / "tmp")
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def run(name: str, body: str, version: str) -> tuple[bool, float]:
    scratch = Path(tempfile.mkdtemp(prefix=f"install-{name}-"))
    copy = scratch / "jaxddp"
    copy_clone(copy)
    hide = name == "wheel"
    env = {**environment(scratch, hide_nvcc=hide), "COPY": str(copy), "VERSION": version}
    script = scratch / "recipe.sh"
    script.write_text("set -euo pipefail\nset -x\n" + body + VERIFY)
    print(
        f"== {name}: docs/install.md's blocks in {copy} (nvcc {'hidden' if hide else 'as on PATH'})"
    )
    print(body, flush=True)
    start = time.monotonic()
    process = subprocess.Popen(["bash", str(script)], cwd=copy, env=env, start_new_session=True)
    try:
        code = process.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        print(f"== {name}: timed out after {TIMEOUT} s")
        code = -1
    seconds = time.monotonic() - start
    if code == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"== {name}: kept {scratch} for a look")
    return code == 0, seconds


def main() -> int:
    text = PAGE.read_text(encoding="utf-8")
    found = recipes(text)
    names = sys.argv[1:] or list(RECIPES)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    results = {}
    for name in names:
        if name not in found:
            print(f"docs/install.md marks no block for {name!r} (it marks {sorted(found)})")
            return 1
        results[name] = run(name, found[name], version)
    for name, (ok, seconds) in results.items():
        print(f"== {name}: {'passed' if ok else 'FAILED'} in {seconds:.0f} s")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
