"""``python -m jaxddp doctor``: the same as the ``jaxddp`` console script."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
