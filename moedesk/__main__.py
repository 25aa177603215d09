"""`python -m moedesk`: the same as the `moedesk` command."""
from moedesk.app.cli import main

if __name__ == "__main__":
    main()
