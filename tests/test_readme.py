"""The README's first snippet runs verbatim in a fresh interpreter, and its claims about the
Python version hold."""
import configparser
import os
import pathlib
import re
import subprocess
import sys
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_the_first_snippet_runs_verbatim(tmp_path):
    snippet = python_blocks()[0]
    assert "xla_force_host_platform_device_count=8" in snippet.splitlines()[1]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    # the snippet's own flags (it sets them with setdefault), plus the suite's codegen flag (conftest.py)
    (flags,) = re.findall(r'os\.environ\.setdefault\("XLA_FLAGS", "([^"]*)"\)', snippet.splitlines()[1])
    env = dict(os.environ, XLA_FLAGS=flags + " --xla_backend_optimization_level=0")
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"step \d: loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert "automap plan on mesh data=2 x model=4 (8 devices)" in out.stdout


def test_declared_python_version_is_what_jax_needs():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    ours = cfg["options"]["python_requires"]
    jax_needs = metadata.metadata("jax")["Requires-Python"]
    assert ours == jax_needs, f"setup.cfg says python_requires {ours}, jax needs {jax_needs}"
    minimum = re.search(r">=\s*(\d+\.\d+)", ours).group(1)
    assert f"Python {minimum} or newer" in (ROOT / "README.md").read_text()
    assert sys.version_info >= tuple(map(int, minimum.split(".")))
