from tablefmt.render import render_table

__all__ = ["render_table"]
