"""A tiny BPE tokenizer trained on a fixed text: tests and the benchmark's peers need tokenizer files, and none
can be downloaded here. Written as Hugging Face writes them (tokenizer.json, tokenizer_config.json)."""
from __future__ import annotations

import json
from pathlib import Path

TEXT = ("the attention block projects queries keys and values, rotates queries and keys, writes the cache, "
        "scores each query against every key it may see, masks the future, takes the softmax and mixes the "
        "values; grouped query attention shares each key and value head among several query heads. ") * 8


def save_tokenizer(folder: str | Path, vocab_size: int) -> Path:
    """tokenizer.json with at most `vocab_size` tokens (ids below the model's vocabulary), and its config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([TEXT], trainer)
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 32768}, indent=2) + "\n")
    return folder / "tokenizer.json"
