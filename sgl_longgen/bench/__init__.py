"""Measurement tools for a GPU host; the product never imports them.

====================  ===========================================================================
``gpu_check``         our algorithms inside ``sglang.Engine``: greedy equality, per-step timing
``kernels``           hybrid tree attention vs SGLang's FlashInfer verify vs an AR decode step
``engine_check``      the ``longgen`` attention backend inside ``sglang.Engine`` (NGRAM)
``compile_report``    the Triton kernels compiled for sm_90 without a GPU: registers, spills
``engine_bench``      ``sgl-longgen bench --engine sglang``: every method in ``sglang.Engine``
====================  ===========================================================================

Each but ``engine_bench`` (run through ``sgl-longgen bench``) is run as
``python -m sgl_longgen.bench.<name> --help``. They reach SGLang only through
:mod:`sgl_longgen.sglang` (engines from :func:`sgl_longgen.sglang.engine.open_engine`).
"""
