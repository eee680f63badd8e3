"""sgl-longgen: lossless speculative decoding for ultra-long generation, inside SGLang."""

__version__ = "0.1.0"
