"""warmroute: a prefix-aware router for fleets of self-hosted LLM inference servers."""

__version__ = "0.1.0"
