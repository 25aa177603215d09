"""`python -m moedesk`: the same as the `moedesk` command."""
import sys

from moedesk.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
