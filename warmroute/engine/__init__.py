"""The emulated inference engine: a pure scheduler/cache model (`model`) and its HTTP shell (`server`).

It is an emulation, not an inference engine: it generates filler words, but its prefix cache, admission,
chunked prefill and step timing follow vLLM's so that routing decisions have the same consequences.
"""
