"""KAME engine: the four-stream Moshi front-end, batched over call slots, plus its STT + LLM back-end."""
