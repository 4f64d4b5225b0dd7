"""Imported first by every benchmark script: ``benchmarks/search.py`` is named like the ``search``
package, and Python puts a script's folder first on ``sys.path``, where that file would shadow
the package for everything imported after (``automap.automap``'s default search included). This
takes the folder off the path again.
"""
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
