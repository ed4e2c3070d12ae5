"""Tool calling and structured output: grammar-constrained decoding (grammar.py; its error in
errors.py, which loads without torch) and the parser that finds tool calls in model text
(tool_parser.py)."""
