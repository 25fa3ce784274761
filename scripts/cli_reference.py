"""Write docs/cli.md, the command-line reference, from the commands' own parsers.

Run it after changing a command's options, help or description;
``tests/unit/test_cli_reference.py`` fails while the page and the parsers differ.
"""

from __future__ import annotations

from pathlib import Path

from celery_fair.cli import reference_page

PAGE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

if __name__ == "__main__":
    text = PAGE.read_text() if PAGE.exists() else ""
    made = reference_page(prog="celery fair")
    PAGE.write_text(made)
    print("docs/cli.md:", "unchanged" if made == text else "written")
