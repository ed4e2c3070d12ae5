"""Tool calling and structured output: grammar-constrained decoding (grammar.py compiles,
matcher.py follows one request, schemas.py rewrites schemas before compiling; the error in
errors.py, which loads without torch) and the parser that finds tool calls in model text
(tool_parser.py)."""
