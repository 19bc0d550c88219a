from inifile.reader import IniError, get_int, parse_ini

__all__ = ["IniError", "get_int", "parse_ini"]
