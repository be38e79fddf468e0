"""A page's keyed table rows read with the standard library's HTML parser (no browser)."""

from __future__ import annotations

from html.parser import HTMLParser


class _KeyedCells(HTMLParser):
    def __init__(self, table_id: str):
        super().__init__()
        self.table_id, self.in_table, self.key, self.rows = table_id, False, None, {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id") == self.table_id:
            self.in_table = True
        elif tag == "tr" and self.in_table and "data-key" in attrs:
            self.key = attrs["data-key"]
            self.rows[self.key] = []

    def handle_endtag(self, tag):
        if tag == "table":
            self.in_table = False
        elif tag == "tr":
            self.key = None

    def handle_data(self, data):
        if self.key is not None and data.strip():
            self.rows[self.key].append(data.strip())


def keyed_cells(html: str, table_id: str) -> dict[str, list[str]]:
    """{data-key: the texts of that row's cells} for the table with id `table_id`."""
    parser = _KeyedCells(table_id)
    parser.feed(html)
    return parser.rows
