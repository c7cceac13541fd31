"""`python -m hybrid.cli`: the `hybrid` command."""
import sys

from .main import main

sys.exit(main())
