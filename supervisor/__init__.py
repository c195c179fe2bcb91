"""kimi-serve: keeps an SGLang server actually serving."""

__version__ = "0.1.0"
