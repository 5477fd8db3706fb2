import sys

from fca.cli import main

sys.exit(main())
