"""The one exception type that means "the user asked for something we cannot do".

Everything raised as :class:`LonggenError` reaches the user as a single line on stderr and exit
code 2 (the argparse convention for bad usage); any other exception is a bug and keeps its
traceback.
"""


class LonggenError(Exception):
    """Bad input: a config, a model directory, a prompt or a checkpoint we cannot use."""
