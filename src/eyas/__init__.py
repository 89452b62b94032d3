"""eyas: train EAGLE-3 speculative-decoding draft heads with vLLM in the loop."""

__version__ = "0.1.0"
