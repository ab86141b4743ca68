import sys

from flashoverlap.cli import main

sys.exit(main())
