import sys

from hostagent.cli import main

sys.exit(main())
