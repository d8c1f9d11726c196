"""An OpenAI-compatible HTTP server in front of a Triton `llm` model (the vLLM backend's tensors).

A Triton client like any other: it renders chat templates, maps OpenAI requests to `llm`'s
tensors (sent to Triton's HTTP `generate_stream`), streams server-sent events back and cancels
the Triton request when its client goes away.
It holds no engine state, so it runs next to tritonserver (`make serve`) or anywhere else:

    inflight-openai --triton-url host:8000 --model-dir /checkpoints/Llama-3-8B-Instruct --port 9000
"""
