"""Print the README's two commands (install, then test), as written, one per line: .ci/run runs them.

The install line ends by opening the chat app (`&& moedesk`), which needs a person at a terminal: that last step
is left off here and .ci/run checks the installed command answers instead.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

APP = " && moedesk"


def readme_commands(readme: str) -> tuple[str, str]:
    """(install line without its `&& moedesk`, test line) from the first bash block that holds both."""
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        lines = [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        install = [line for line in lines if "pip install -e ." in line and line.endswith(APP)]
        test = [line for line in lines if "pip install -e '.[test]'" in line and "pytest" in line]
        if install and test:
            return install[0][: -len(APP)], test[0]
    raise ValueError("README.md has no bash block with the install line (ending in `&& moedesk`) and the test line")


if __name__ == "__main__":
    try:
        print("\n".join(readme_commands(Path(sys.argv[1]).read_text())))
    except (OSError, ValueError) as e:
        sys.exit(f"readme_commands: {e}")
