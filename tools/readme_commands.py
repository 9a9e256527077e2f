"""The README's two commands, read from the README itself, so CI cannot drift from it.

    python3 tools/readme_commands.py test    # prints the test command
    python3 tools/readme_commands.py setup   # prints the set-up command

The set-up command is the first ```bash block of the README, the test command
the ```bash block that follows the line "Tests:".
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"```bash\n(.*?)\n```", re.S)


def commands(text: str) -> dict:
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        raise ValueError("README.md has no ```bash block")
    tests = text.find("\nTests:")
    after = [b for b in blocks if tests >= 0 and b.start() > tests]
    if not after:
        raise ValueError("README.md has no ```bash block after a line 'Tests:'")
    return {"setup": blocks[0].group(1).strip(), "test": after[0].group(1).strip()}


def main(argv: list) -> int:
    if len(argv) != 1 or argv[0] not in ("setup", "test"):
        print("usage: readme_commands.py setup|test", file=sys.stderr)
        return 2
    print(commands(README.read_text())[argv[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
