"""For ``pytest --doctest-modules jaxddp``: the modules of an optional loader import its
library, so they are collected only where that library is installed (``jaxddp[grain]``,
``jaxddp[torch]``; the test sessions install torch only where its CPU build is served)."""

import importlib.util

collect_ignore = [
    path
    for name in ("grain", "torch")
    if importlib.util.find_spec(name) is None
    for path in (f"jaxddp/{name}.py", f"jaxddp/_data/loaders/{name}.py")
]
