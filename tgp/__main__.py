import sys

from tgp.cli import main

sys.exit(main())
