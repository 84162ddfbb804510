import sys

from kvjax.cli.main import main

sys.exit(main())
