"""Write the settings tables of docs/configuration.md from celery-fair's table of settings.

Run it after changing a row of ``celery_fair/worker/options.py``;
``tests/unit/test_options.py`` fails while the page and the table differ.
"""

from __future__ import annotations

from pathlib import Path

from celery_fair.worker.options import reference_page

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

if __name__ == "__main__":
    text = PAGE.read_text()
    made = reference_page(text)
    PAGE.write_text(made)
    print("docs/configuration.md:", "unchanged" if made == text else "tables written")
