"""What both daemon processes (node and router) share: typed configuration loading."""
