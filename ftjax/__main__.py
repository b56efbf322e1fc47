"""``python -m ftjax`` runs the command line (see ``ftjax.cli``)."""
import sys

from ftjax.cli import main

sys.exit(main())
