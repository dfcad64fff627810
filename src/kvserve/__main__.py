"""`python -m kvserve ...` is `kvserve ...`."""
import sys

from kvserve.cli import main

sys.exit(main())
