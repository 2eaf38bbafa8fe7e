import sys

from rloo.dvc.cli import main

sys.exit(main())
