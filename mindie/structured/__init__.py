"""Tool calling and structured output: grammar-constrained decoding (grammar.py) and the parser
that finds tool calls in model text (tool_parser.py)."""
