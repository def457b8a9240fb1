"""`python -m controller.cli ...` is `specroute ...`."""

import sys

from controller.cli import main

sys.exit(main())
