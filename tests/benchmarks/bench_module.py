"""Load a script of ``benchmarks/`` as a module, as the tests of those scripts do."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(stem: str):
    """``benchmarks/<stem>.py`` as module ``bench_<stem>`` (registered: its dataclasses look it up)."""
    import search  # noqa: F401  (the packages first: benchmarks/ holds a search.py of its own)
    import tactics  # noqa: F401

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # for its `import _isolate`, which takes it off again
    spec = importlib.util.spec_from_file_location(f"bench_{stem}", os.path.join(ROOT, "benchmarks", f"{stem}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
