"""The algorithm core: drafters, trees, verification, sampling and the partial-KV policy.

Engine-agnostic: plain torch and Python. The reference runtime, the SGLang worker and the Ray
cluster code are adapters around these pieces.
"""
