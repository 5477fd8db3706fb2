"""Performance ratios of the cache and replay engine, measured in one run.

    python -m bench.ratios [--model DIR] [--corpus PATH] [--json PATH]

The same as `python -m fca bench`; see fca/jobs/bench.py for what each ratio times.
"""

import sys

from fca.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
