"""Text in, text out (issue 21, part 2): `python -m runtime.generate DIR --chat MESSAGE` (or `--prompt TEXT`) through
the tokenizer and chat template that the export copied from the Hugging Face folder.

A tiny random llama saved by transformers (weights spread wide: greedy tokens are not near ties) with a byte-level BPE
tokenizer trained here on a few sentences (multi-byte characters among them: a random model writes broken UTF-8
too), exported to raw and ort: the streamed text is the tokenizer's decode of transformers' own greedy `generate` on
the same chat-templated prompt, it stops at the model's eos, and bad input is one line. Each check is also shown
refusing a planted fault."""
import json
import shutil

import pytest
import torch

from corpus.text import save_tokenizer
from export import export_model
from models import preset
from runtime import open_generator
from runtime.generate import generate, main
from runtime.text import ExportTokenizer, TextStream, chat_ids, load_tokenizer, save_text

from chat_model import EOS, MESSAGE, save_chat_model

TARGETS = ("raw", "ort")
NEW = 24  # greedy tokens compared
class Tiny:
    """The Hugging Face folder, its export, the tokenizer and transformers' own greedy tokens."""

    def __init__(self, root):
        self.hf, self.out = root / "hf", root / "out"
        self.tokenizer, self.model = save_chat_model(self.hf)
        self.manifest = export_model(preset("tiny", capacity=64, chunk=8, source="transformers"), self.out, kind="lm",
                                     weights=str(self.hf), targets=TARGETS, log=lambda *_: None)
        self.chat = chat_ids(self.tokenizer, MESSAGE, "hf")
        self.want = self.greedy(self.chat)

    def greedy(self, prompt, **kwargs):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                      **kwargs)
        return out[0, len(prompt):].tolist()

    def text(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def copy(self, tmp_path, name, drop=()):
        """The export folder copied, without the files in `drop`."""
        folder = tmp_path / name
        shutil.copytree(self.out, folder, ignore=lambda _, names: [n for n in names if n in drop])
        return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Tiny(tmp_path_factory.mktemp("text"))


def cli(capsys, *args):
    """runtime.generate in this process -> (exit status, the streamed text, the --json result, stderr)."""
    try:
        rc = main([str(a) for a in args] + ["--json"])
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    if rc != 0:
        return rc, None, None, err
    text, stats, result, _ = out.rsplit("\n", 3)  # the text, its stats line, the JSON line
    assert "tokens/s" in stats, out
    return rc, text, json.loads(result), err


def test_the_export_carries_the_tokenizer_chat_template_and_eos(tiny):
    lm = tiny.manifest["lm"]
    assert lm["eos_token_ids"] == sorted(EOS)
    assert lm["tokenizer_files"] == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                     "generation_config.json"]
    for name in lm["tokenizer_files"]:
        assert (tiny.out / name).read_bytes() == (tiny.hf / name).read_bytes(), name
    assert chat_ids(load_tokenizer(tiny.out), MESSAGE, "out") == tiny.chat  # the export folder alone makes the prompt
    # ... read without transformers: the CLI tests below compare its text with transformers'
    assert isinstance(load_tokenizer(tiny.out), ExportTokenizer) and lm["text"]["tokenizer"] == "tokenizer.json"


def _wordpiece(folder, clean_up):
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    vocab = {t: i for i, t in enumerate(["[UNK]", "[CLS]", "[SEP]", "paris", "is", "n", "'", "t", ".", "?", ",", "it"])}
    wp = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wp.normalizer, wp.pre_tokenizer, wp.decoder = normalizers.Lowercase(), pre_tokenizers.BertPreTokenizer(), \
        decoders.WordPiece(cleanup=False)  # the clean-up, if any, is transformers'
    transformers.PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]", bos_token="[CLS]",
                                         clean_up_tokenization_spaces=clean_up).save_pretrained(folder)


@pytest.mark.parametrize("clean_up", (True, False))
def test_the_exported_tokenizer_decodes_as_transformers_does(tmp_path, clean_up):
    """transformers cleans up spaces before punctuation where the config says so, on a WordPiece model; on a BPE
    model it does not (the chat model's tokenizer with clean_up_tokenization_spaces set). Planted: an ExportTokenizer
    told the opposite of what save_text found decodes otherwise."""
    import transformers
    for name, make in (("wordpiece", lambda f: _wordpiece(f, clean_up)), ("bpe", lambda f: _bpe(f, clean_up))):
        hf, out = tmp_path / name / "hf", tmp_path / name / "out"
        make(hf)
        shutil.copytree(hf, out)
        text, want = save_text(hf, out), transformers.AutoTokenizer.from_pretrained(str(hf))
        ours = ExportTokenizer(out, text)
        for s in ("Paris is . It isn't ?", "paris , it is"):
            ids = want(s)["input_ids"]
            assert ours(s)["input_ids"] == ids and ours.decode(ids) == want.decode(ids), (name, s)
        flipped = ExportTokenizer(out, {**text, "clean_up_tokenization_spaces": not text["clean_up_tokenization_spaces"]})
        if name == "wordpiece" and clean_up:
            assert flipped.decode(want("Paris is .")["input_ids"]) != want.decode(want("Paris is .")["input_ids"])


def _bpe(folder, clean_up):
    tokenizer, _ = save_chat_model(folder / "model")
    tokenizer.clean_up_tokenization_spaces = clean_up
    tokenizer.save_pretrained(folder)


def test_text_generation_runs_without_torch(tiny):
    """runtime.generate's process reads the export's tokenizer with the tokenizers library (and a chat template with
    transformers' jinja renderer alone): transformers' AutoTokenizer would import torch, 280 MB more than the model
    it runs."""
    import subprocess
    import sys
    for text in ("--chat", "--prompt"):
        probe = (f"import sys, runtime.generate as g; g.main([{str(tiny.out)!r}, {text!r}, {MESSAGE!r}, "
                 "'--max-new-tokens', '2']); print('torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        assert out.strip().endswith("False"), (text, out)


@pytest.mark.parametrize("target", TARGETS)
def test_chat_streams_the_text_transformers_generates(tiny, target, capsys):
    rc, text, result, err = cli(capsys, tiny.out, "--target", target, "--chat", MESSAGE, "--max-new-tokens", NEW)
    assert rc == 0, err
    assert result["prompt_ids"] == tiny.chat and result["generated_ids"] == tiny.want
    assert result["stop"] == "max_new_tokens"  # no eos among them: the whole text is compared
    assert text == tiny.text(tiny.want), (text, tiny.text(tiny.want))
    print(target, repr(text))


def test_prompt_is_plain_text_and_differs_from_chat(tiny, capsys):
    """--prompt encodes the text as the tokenizer does; and the planted fault, a CLI reading --chat as plain text
    (no template), would not give the chat's text: the comparison above can tell them apart."""
    plain = tiny.tokenizer(MESSAGE)["input_ids"]
    want = tiny.greedy(plain)
    rc, text, result, err = cli(capsys, tiny.out, "--target", "ort", "--prompt", MESSAGE, "--max-new-tokens", NEW)
    assert rc == 0, err
    assert result["prompt_ids"] == plain and result["generated_ids"] == want and text == tiny.text(want)
    assert text != tiny.text(tiny.want)


def check_streamed(writes, final):
    """`writes`: (tokens generated so far, text written) for each write of a generation's stream. The text is `final`
    and came out while the tokens were coming, not all at the end."""
    assert "".join(w for _, w in writes) == final + "\n"
    tokens = max(n for n, _ in writes)
    early = sorted({n for n, w in writes if w and n < tokens})
    assert early and early[0] <= tokens // 4 and len(early) >= tokens // 4, writes


def test_text_comes_out_as_the_tokens_come(tiny):
    driver, writes, count = open_generator(tiny.out, "ort", provider="cpu"), [], [0]
    stream = TextStream(load_tokenizer(tiny.out), EOS, write=lambda s: writes.append((count[0], s)))

    def on_token(token):
        count[0] += 1
        stream(token)
    generate(driver, tiny.chat, NEW, on_token=on_token)
    stream.end()
    check_streamed(writes, tiny.text(tiny.want))
    with pytest.raises(AssertionError):  # planted fault: the same text, printed once at the end
        check_streamed([(NEW, tiny.text(tiny.want) + "\n")], tiny.text(tiny.want))


def streamed(tokenizer, ids, stream):
    """What `stream` writes for `ids`, checked: the decode of them all, no write holding a broken character."""
    writes = []
    s = stream(tokenizer, write=writes.append)
    for token in ids:
        s(token)
    s.end()
    assert "".join(writes) == tokenizer.decode(ids) + "\n", writes
    assert not any("\ufffd" in w for w in writes), writes
    return writes


class TokenByToken(TextStream):
    """A planted fault: each token decoded alone."""

    def __call__(self, token):
        self.write(self.tokenizer.decode([token]))

    def end(self):
        self.write("\n")


def test_incremental_decoding_keeps_characters_and_spacing(tiny, tmp_path):
    # byte-level BPE, one byte per token: 東 and é are split across tokens
    tokenizer = load_tokenizer(tiny.out)
    (pieces, _), = tiny.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("東京")
    ids = tiny.tokenizer.convert_tokens_to_ids(list(pieces)) + tokenizer(" café!")["input_ids"]
    assert len(ids) > 6 and tokenizer.decode(ids) == "東京 café!"
    assert streamed(tokenizer, ids, TextStream)[0] == "東"
    with pytest.raises(AssertionError):
        streamed(tokenizer, ids, TokenByToken)
    # word pieces (Metaspace BPE): a word's space is in its token, dropped when a token is decoded alone
    save_tokenizer(tmp_path, 200)
    pieces = load_tokenizer(tmp_path)
    ids = pieces("the attention block projects queries, keys and values")["input_ids"]
    assert "".join(streamed(pieces, ids, TextStream)) == "the attention block projects queries, keys and values\n"
    with pytest.raises(AssertionError):
        streamed(pieces, ids, TokenByToken)


def check_stopped_at(rc, text, result, tiny, eos_at):
    """The run stopped at the eos transformers' generate stops at: its tokens up to the eos, its text before it."""
    assert rc == 0 and result["stop"] == "eos"
    assert result["generated_ids"] == tiny.want[:eos_at + 1] and text == tiny.text(tiny.want[:eos_at])


def test_stops_at_the_models_eos(tiny, tmp_path, capsys):
    """A planted eos: the third token transformers generates (an ordinary token, so not skipped as special text),
    listed with one the model never writes; the run stops there, as transformers' generate does with that eos."""
    eos_at, unused = 2, 1
    planted = tiny.want[eos_at]
    assert planted not in tiny.want[:eos_at] and unused not in tiny.want
    assert tiny.greedy(tiny.chat, eos_token_id=[unused, planted]) == tiny.want[:eos_at + 1]
    folder = tiny.copy(tmp_path, "eos")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["lm"]["eos_token_ids"] = [unused, planted]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for target in TARGETS:
        check_stopped_at(*cli(capsys, folder, "--target", target, "--chat", MESSAGE, "--max-new-tokens", NEW)[:3],
                         tiny, eos_at)
    # planted fault: a run that ignores the eos (here: an eos the model never writes) is refused by the check
    rc, text, result, _ = cli(capsys, folder, "--chat", MESSAGE, "--max-new-tokens", NEW, "--eos", unused)
    assert result["generated_ids"] == tiny.want
    with pytest.raises(AssertionError):
        check_stopped_at(rc, text, result, tiny, eos_at)


def test_bad_input_is_one_line(tiny, tmp_path, capsys):
    bare = tiny.copy(tmp_path, "bare", drop=tiny.manifest["lm"]["tokenizer_files"])
    plain = tiny.copy(tmp_path, "plain", drop=("chat_template.jinja",))
    for args, status, message in (
            ([bare, "--chat", MESSAGE], 1, f"--chat needs a tokenizer; {bare} has none"),
            ([bare, "--prompt", MESSAGE], 1, f"--prompt needs a tokenizer; {bare} has none"),
            ([plain, "--chat", MESSAGE], 1, "--chat needs a chat template; the tokenizer of"),
            ([tiny.out, "--chat", MESSAGE, "--prompt", MESSAGE], 2, "argument --prompt: not allowed with argument --chat"),
            ([tiny.out, "--chat", MESSAGE, "--prompt-ids", "1"], 2, "not allowed with argument --chat"),
            ([tiny.out, "--chat", MESSAGE, "--tokenizer", tiny.out / "manifest.json"], 1,
             "cannot be read as a Hugging Face tokenizer"),
            ([tiny.out, "--chat", MESSAGE, "--tokenizer", tmp_path / "nothing"], 1, "not found; expected a folder"),
            ([tiny.out, "--prompt", ""], 1, "empty prompt"),
            ([tiny.out, "--chat", MESSAGE * 10], 1, "the cache holds 64, expected a shorter prompt")):
        rc, _, _, err = cli(capsys, *args)
        assert rc == status and err.startswith("error: ") and message in err and err.count("\n") == 1, (args, err)
    # each refused folder still runs what it can: ids without a tokenizer, plain text without a chat template
    rc, text, result, err = cli(capsys, bare, "--prompt-ids", ",".join(map(str, tiny.chat)), "--max-new-tokens", 4)
    assert rc == 0 and text == " ".join(map(str, tiny.want[:4])) + " ", err
    rc, text, result, err = cli(capsys, plain, "--prompt", MESSAGE, "--max-new-tokens", 4)
    assert rc == 0 and len(result["generated_ids"]) == 4, err


def test_the_chat_template_is_found_where_transformers_finds_it(tmp_path):
    """chat_template.jinja first, then chat_template.json's, then tokenizer_config.json's (named: "default"), each
    equal to what transformers' tokenizer reads from the same folder."""
    import transformers
    from runtime.text import chat_template
    save_chat_model(tmp_path / "hf")
    hf = tmp_path / "hf"
    config = json.loads((hf / "tokenizer_config.json").read_text())
    jinja = (hf / "chat_template.jinja").read_text()
    (hf / "chat_template.jinja").unlink()
    for where in ("config-string", "config-named", "none"):
        value = {"config-string": jinja, "config-named": [{"name": "tool_use", "template": "x"},
                                                           {"name": "default", "template": jinja}], "none": None}[where]
        (hf / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": value}))
        want = transformers.AutoTokenizer.from_pretrained(str(hf)).chat_template
        want = want.get("default") if isinstance(want, dict) else want
        assert chat_template(hf) == want == (jinja if value else None), where
