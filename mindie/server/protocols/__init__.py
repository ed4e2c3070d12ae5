"""The API families, each split into parse (body -> engine requests) and render (results -> the
family's bytes) around the seam in base.py: native.py, tgi.py, vllm.py, openai_chat.py,
openai_completions.py (with openai.py, what those two share), openai_responses.py (with
responses_request.py, its request body and input items in chat terms, and responses_store.py,
the responses kept for previous_response_id), triton.py. params.py holds the
request vocabulary several families share, messages.py chat messages and their prompt, tools.py
tool calling and OpenAI's structured output, guided.py the structured-output fields of vLLM,
llama.cpp and TGI. None of them imports torch or the engine."""
