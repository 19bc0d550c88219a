from paginate.pager import Page, PageNotFound, Paginator

__all__ = ["Page", "PageNotFound", "Paginator"]
