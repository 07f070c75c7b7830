"""Text for runtime.generate: the export's tokenizer, its chat template, and a streaming printer.

Text for runtime.generate: the export folder's tokenizer, its chat template, and a stream that prints decoded text as
tokens come. The export resolves the tokenizer with transformers once (save_text) and writes what it resolved: its
backend as a tokenizers file, its special tokens and clean-up rule (the chat template is read from the folder).
runtime.generate then reads it with the tokenizers library alone (ExportTokenizer): transformers' AutoTokenizer
imports torch, 280 MB of a process that otherwise holds only the model. A folder the export did not write (`--tokenizer PATH`, an older export) is read with
transformers."""
from __future__ import annotations

import json
import sys
from pathlib import Path

# What a tokenizer (and its chat template) is made of in a Hugging Face folder, and the generation defaults:
# the export copies those the folder has beside the graphs (export/exporter.py, _lm_extras).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "generation_config.json")


class TextError(ValueError):
    """Text asked for where the export has no tokenizer or no chat template, or a tokenizer that cannot be read."""


RESOLVED = "tokenizer.resolved.json"  # the backend, where transformers' differs from the folder's tokenizer.json


def load_tokenizer(path: str | Path):
    """The tokenizer of an export folder (as its export resolved it), or transformers' from a folder holding tokenizer
    files (a Hugging Face folder, an export that recorded none) or from one tokenizer.json file."""
    path = Path(path)
    if not path.exists():
        raise TextError(f"--tokenizer {path}: not found; expected a folder with tokenizer.json or a tokenizer.json file")
    if text := _exported_text(path):
        return ExportTokenizer(path, text)
    return _transformers_tokenizer(path)


def _exported_text(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "manifest.json").read_text()).get("lm", {}).get("text")
    except (OSError, ValueError, AttributeError):
        return None


def _transformers_tokenizer(path: Path):
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        if path.is_file():
            return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        return transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise TextError(f"{path}: cannot be read as a Hugging Face tokenizer ({first})") from None


def save_text(hf_folder: str | Path, out: Path) -> dict | None:
    """At export: the tokenizer transformers reads from `hf_folder`, as ExportTokenizer will read it from `out` (which
    already holds the folder's tokenizer files): the manifest's `lm.text`. Its backend goes to RESOLVED where it
    differs from the tokenizer.json copied (a post-processor transformers rebuilt from its config, a converted
    sentencepiece model). None where transformers gives no tokenizers backend: runtime.generate then loads
    transformers."""
    try:
        tokenizer = _transformers_tokenizer(Path(hf_folder))
    except TextError:  # runtime.generate says so when text is asked for; the graphs do not need it
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    copied = out / "tokenizer.json"
    same = copied.is_file() and _backend(copied).to_str() == backend.to_str()
    if not same:
        backend.save(str(out / RESOLVED))
    return {"tokenizer": copied.name if same else RESOLVED,
            "special_tokens": {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)},
            "clean_up_tokenization_spaces": _cleans_up(tokenizer, backend)}


def _cleans_up(tokenizer, backend) -> bool:
    """Whether transformers' decode cleans up spaces: as configured, except on a BPE model (unless forced)."""
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and \
        (type(backend.model).__name__ != "BPE" or bool(forced))


def _backend(path: Path):
    import tokenizers
    return tokenizers.Tokenizer.from_file(str(path))


class ExportTokenizer:
    """What runtime.generate asks of transformers' tokenizer (encode, decode, the chat template), from what the export
    resolved (save_text): the tokenizers library and, for a chat template, transformers' jinja renderer, which
    imports neither torch nor the rest of transformers."""

    def __init__(self, folder: Path, text: dict):
        try:
            self.backend = _backend(folder / text["tokenizer"])
        except Exception as e:
            raise TextError(f"{folder / text['tokenizer']}: cannot be read as a tokenizers file ({e})") from None
        self.chat_template = chat_template(folder)  # read where it is, as transformers does: an edit to it holds
        self.special_tokens = text.get("special_tokens", {})
        self.clean_up = text.get("clean_up_tokenization_spaces", False)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up else text

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        from transformers.utils.chat_template_utils import render_jinja_template
        rendered, _ = render_jinja_template([messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return self(rendered[0], add_special_tokens=False)["input_ids"] if tokenize else rendered[0]


def chat_template(folder: Path) -> str | None:
    """The chat template where transformers finds it in a folder: chat_template.jinja, else the "chat_template" of
    chat_template.json or tokenizer_config.json (of a list of named templates, the one named "default")."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            template = json.loads((folder / name).read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
        if isinstance(template, str) and template:
            return template
    return None


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization: spaces a word-piece decoder leaves before punctuation and contractions."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                     (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


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
