"""Text for runtime.generate: the export's tokenizer, its chat template, and a streaming printer.

Text for runtime.generate: the export folder's tokenizer (transformers' AutoTokenizer over the files the export
copied from the Hugging Face folder), its chat template, and a stream that prints decoded text as tokens come."""
from __future__ import annotations

import sys
from pathlib import Path

# What a tokenizer (and its chat template) is made of in a Hugging Face folder, and the generation defaults:
# the export copies those the folder has beside the graphs (export/exporter.py, _lm_extras).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "generation_config.json")


class TextError(ValueError):
    """Text asked for where the export has no tokenizer or no chat template, or a tokenizer that cannot be read."""


def load_tokenizer(path: str | Path):
    """transformers' tokenizer from a folder holding tokenizer files (an export folder, a Hugging Face folder) or from
    one tokenizer.json file."""
    path = Path(path)
    if not path.exists():
        raise TextError(f"--tokenizer {path}: not found; expected a folder with tokenizer.json or a tokenizer.json file")
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        if path.is_file():
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        return transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise TextError(f"{path}: cannot be read as a Hugging Face tokenizer ({first})") from None


def has_tokenizer(folder: str | Path) -> bool:
    folder = Path(folder)
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def chat_ids(tokenizer, message: str, where: str) -> list[int]:
    """The token ids of one user message through the tokenizer's chat template, ending with the assistant's turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise TextError(f"--chat needs a chat template; the tokenizer of {where} has none (no chat_template.jinja, no "
                        "chat_template in tokenizer_config.json): use --prompt for plain text")
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own special tokens


def prompt_ids(tokenizer, text: str) -> list[int]:
    """Plain text as the tokenizer encodes it (with the special tokens it adds, a BOS for instance)."""
    return tokenizer(text)["input_ids"]


class TextStream:
    """`stream(token)` for each generated token: prints the text as it grows, the whole id list decoded each time
    (special tokens skipped) and only its new suffix printed, so word pieces get their spacing from their neighbours.
    A trailing incomplete UTF-8 sequence (U+FFFD) and trailing whitespace wait for the next token (a character split
    across tokens, a space a decoder may still fold); `end()` prints what is left. End-of-sequence tokens are not
    text: they end the stream, and are not printed."""

    def __init__(self, tokenizer, eos=(), write=None):
        self.tokenizer, self.eos = tokenizer, set(eos)
        self.write = write or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self.ids: list[int] = []
        self.shown = ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def __call__(self, token: int) -> None:
        if token in self.eos:
            return
        self.ids.append(token)
        self._show(self.text().rstrip("\ufffd").rstrip())

    def end(self) -> str:
        """Print the rest of the text and a newline; returns the whole text."""
        text = self.text()
        self._show(text)
        self.write("\n")
        return text

    def _show(self, text: str) -> None:
        if len(text) > len(self.shown) and text.startswith(self.shown):
            self.write(text[len(self.shown):])
            self.shown = text
