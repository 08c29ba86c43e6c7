"""`python -m service.cli`: the `stepserve` command."""

import sys

from service.cli.main import main

sys.exit(main())
