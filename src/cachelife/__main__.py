"""`python -m cachelife`: the command line (`cachelife.tools.cli`)."""

from cachelife.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
