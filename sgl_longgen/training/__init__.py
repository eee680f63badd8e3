"""Training: the byte-level BPE tokenizer, a small Llama-architecture LM from scratch, and
TokenSwift's draft heads on a frozen base model.

Each trainer is a typed config (``config.py``), a loss (``lm.py``, ``heads.py``) and the shared
loop (``loop.py``: optimizer, schedule, progress bar, periodic checkpoints, time budget). The
batched causal forward used for training lives in ``forward.py`` and reuses the runtime model's
modules, so a trained checkpoint is exactly what ``load_model`` and SGLang load. ``proxy.py``
chains everything into the embedded proxy model. ``command.py`` writes the command line each run
records, for the ``sgl-longgen train`` commands and for ``proxy.py`` run as a script alike.
"""
