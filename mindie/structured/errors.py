"""The error a grammar compile reports, apart from the compiler (which needs torch for its token
masks), so that request parsing can name it without loading the engine's dependencies."""


class GrammarError(ValueError):
    """A schema (or tool list) that cannot be compiled; the message names the problem."""
