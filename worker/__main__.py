"""`python -m worker` is `cy-llm`."""

import sys

from worker.cli import main

sys.exit(main())
