from cliargs.parser import ArgParser, Parsed, UsageError

__all__ = ["ArgParser", "Parsed", "UsageError"]
