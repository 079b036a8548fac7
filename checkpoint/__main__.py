"""`python -m checkpoint inspect|convert|diff ...` (also installed as `varstate-ckpt`)."""

import sys

from checkpoint._cli._main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
