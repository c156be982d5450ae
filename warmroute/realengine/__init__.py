"""A real inference engine on CPUs: llama.cpp (llama-cpp-python) serving a tiny random-weight model.

Needs the optional extra: pip install 'warmroute[llama]'.
"""

from warmroute.realengine.tiny_model import TinyModelSpec, write_tiny_model

__all__ = ["TinyModelSpec", "write_tiny_model"]
