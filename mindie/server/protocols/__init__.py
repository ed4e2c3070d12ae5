"""The API families, each split into parse (body -> engine requests) and render (results -> the
family's bytes) around the seam in base.py: native.py, tgi.py, vllm.py, openai_chat.py and
openai_completions.py (with openai.py, what those two share), triton.py. params.py holds the
request vocabulary several families share, messages.py chat messages and their prompt, tools.py
tool calling and structured output. None of them imports torch or the engine."""
