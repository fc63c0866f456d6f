"""Print the role × route table of the API (Markdown), generated from the app's routes by
``imgret.service.access``: what ``docs/api.md`` shows between its ``roles`` markers.

    python tools/role_table.py
"""

from __future__ import annotations

from imgret.service.access import markdown_table
from imgret.service.app import create_app

if __name__ == "__main__":
    print(markdown_table(create_app().openapi()), end="")
