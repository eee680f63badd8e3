"""Train a byte-level BPE tokenizer (GPT-2 style) with the ``tokenizers`` library.

Byte-level means every string round-trips and no text is ever unknown. The special tokens are the
embedded models' ``<|begin_of_text|>`` (id 0) and ``<|end_of_text|>`` (id 1). The tokenizer adds
BOS itself (a template post-processor), so HF transformers and SGLang see the same ids as the
reference runtime, which also reads ``add_bos_token`` from ``tokenizer_config.json``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import LonggenError
from ..runtime.embedded import BOS, EOS, write_tokenizer_config
from .config import TokenizerConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer(
    texts: Iterable[str],
    cfg: TokenizerConfig,
    out_dir: Path,
    model_max_length: int,
    num_texts: int | None = None,
    show_progress: bool = True,
) -> Path:
    """Learn merges from ``texts`` and write ``tokenizer.json`` + ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=num_texts)
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if (bos_id, eos_id) != (0, 1):
        raise LonggenError(f"tokenizer training gave BOS/EOS ids {bos_id}/{eos_id}, expected 0/1")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    write_tokenizer_config(out_dir, model_max_length)
    return out_dir


def check_tokenizer_dir(directory: Path) -> None:
    for name in TOKENIZER_FILES:
        if not (Path(directory) / name).is_file():
            raise LonggenError(f"tokenizer directory {directory} has no {name}")
