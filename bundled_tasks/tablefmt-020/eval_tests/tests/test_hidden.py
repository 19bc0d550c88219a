from tablefmt import render_table


def test_header_wider_than_values():
    table = render_table(["item", "quantity", "price"], [["apple", 3, 1.5], ["kiwi", 12, 0.25]])
    assert table.splitlines() == [
        "item   quantity  price",
        "-----  --------  -----",
        "apple         3   1.50",
        "kiwi         12   0.25",
    ]


def test_header_only_table():
    assert render_table(["name", "qty"], []) == "name  qty\n----  ---"


def test_all_lines_same_width_when_last_column_numeric():
    table = render_table(["description", "count"], [["x", 1], ["y", 100]])
    assert len({len(line) for line in table.splitlines()}) == 1
