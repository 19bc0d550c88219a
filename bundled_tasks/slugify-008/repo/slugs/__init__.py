from slugs.slugify import slugify, unique_slug

__all__ = ["slugify", "unique_slug"]
