"""``python -m relprop.cli`` (as ``torchrun -m relprop.cli`` runs it): the ``relprop`` command."""
import sys

from relprop.cli import main

sys.exit(main())
