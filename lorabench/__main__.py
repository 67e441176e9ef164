import sys

from lorabench.cli import main

sys.exit(main())
