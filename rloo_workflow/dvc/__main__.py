import sys

from rloo_workflow.dvc.cli import main

sys.exit(main())
